"""Entry point: torchrun --nproc_per_node=N -m sfttrain.run [recipe.yaml] key=value ...

Parse the config, start the ranks, build the trainer, train, shut down cleanly.
`python -m sfttrain.run --help [section]` lists every key (sfttrain/help.py).

A mistake the user must fix (sfttrain/errors.py, which lists the exit codes: 2 config, 3 data,
4 non-finite loss, 5 missing dependency, 6 checkpoint not saved, 7 export failed, 9 out of memory;
and 8, stopped by SIGTERM after a save), what a filesystem refuses (a full disk, a read-only one, a
permission: sfttrain.fs_faults) and running out of memory end the run with one message, printed once
by rank 0, and its exit code; under torchrun the same message is rank 0's elastic error file, so
torchrun's "Root Cause" shows it (once) instead of `error_file: <N/A>`. A rank whose collective fails
because another rank ended first leaves the word to that one. Ctrl-C ends every rank with one line
and exit code 130.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import sys
import time

from sfttrain import phase, stop_signal
from sfttrain.config import Config, ConfigError, load_config
from sfttrain.errors import OutOfMemory, UserError
from sfttrain.help import print_help

# a rank other than 0 waits this long for rank 0 to report the same error and end the job
# (torchrun then stops it); past that, it is the one rank that knows, and reports it itself
WAIT_FOR_RANK0_S = 60
HYDRA_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the YAML file, the key=value overrides): the file is the first argument, or Hydra's
    --config-path DIR --config-name NAME (verl's way: DIR/NAME.yaml)."""
    hydra, rest = hydra_flags(argv)
    yaml_path = rest[0] if rest and "=" not in rest[0] else None
    overrides = rest[1:] if yaml_path else rest
    if not hydra:
        return yaml_path, overrides
    if yaml_path or "name" not in hydra:
        raise ConfigError("name the YAML file once: as the first argument (python -m sfttrain.run my_sft.yaml ...), "
                          "or as Hydra's --config-path DIR --config-name NAME (DIR/NAME.yaml)")
    name = hydra["name"] if hydra["name"].endswith((".yaml", ".yml")) else hydra["name"] + ".yaml"
    return os.path.join(hydra.get("path", "."), name), overrides


def hydra_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Hydra's --config-path / --config-name (also -cp / -cn; DIR or =DIR) taken out of argv."""
    flags, rest, args = {}, [], iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in HYDRA_FLAGS:
            flags[HYDRA_FLAGS[flag]] = value if eq else next(args, "")
        else:
            rest.append(arg)
    return flags, rest


def stop(error: UserError) -> None:
    """Ends this rank on a user mistake: the message goes to the elastic error file (torchrun's
    summary shows it) and to stderr; the process exits with the code of its kind. Every rank
    usually raises the same error (same config; data checks gather their verdicts): rank 0 reports
    it, and torchrun stops the others when rank 0 exits, before they have written or printed
    anything, so the summary holds the message once. A rank that outlives the wait is the one
    that knows (an error of its own), and reports it itself. An error every rank raises at the same
    point (StoppedBySignal) needs no wait: each rank writes it to its error file, rank 0 prints it."""
    message = f"sfttrain: {error.kind}: {error}"
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if not (rank0 or error.every_rank):
        time.sleep(WAIT_FOR_RANK0_S)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            # torch's own layout (elastic/multiprocessing/errors), the traceback replaced by the message
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    if rank0 or not error.every_rank:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # at once, without the interpreter's teardown of torch (seconds): a rank still tearing
    # down when torchrun stops the job would be reported as killed
    os._exit(error.exit_code)


def main(argv: list[str] | None = None) -> None:
    phase.dump_stacks_on_sigusr1()  # before any thread starts: each inherits the signal mask (see there)
    stop_signal.follow_the_launcher()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in ("-h", "--help"):
            print_help(argv[1] if len(argv) > 1 else None)
            return
        cfg = load_config(*parse_args(argv))
    except UserError as e:
        stop(e)
    # torch and transformers load only now: a config mistake is reported within a second. A
    # bug (any other exception) still reaches torchrun's summary with its traceback (`record`).
    from torch.distributed.elastic.multiprocessing.errors import record

    record(train)(cfg)


def train(cfg: Config) -> None:
    rank = int(os.environ.get("RANK", 0))
    stop_signal.note_interrupts()
    try:
        _train(cfg, rank)
    except KeyboardInterrupt:  # also raised while an error below was being handled
        interrupted(cfg, rank)
    # Python's final garbage collection of torch's and transformers' object graphs costs seconds
    # of CPU per rank at exit; everything is written and closed by now, so skip it.
    gc.freeze()


def _train(cfg: Config, rank: int) -> None:
    from sfttrain.distributed import init_world, shutdown
    from sfttrain.metrics import require_loggers
    from sfttrain.trainer import FSDPSFTTrainer

    timeout = cfg.trainer.nccl_timeout
    try:
        require_loggers(cfg)
        world = init_world(cfg)
        if world.device.type == "cuda":  # NCCL's own watchdog ends the process without a Python exception
            phase.start_watchdog(rank, timeout)
        trainer = FSDPSFTTrainer(cfg, world)
        try:
            trainer.train()
        finally:
            trainer.logger.close()  # the bar ends before any error is printed
        phase.enter("shutdown")
        shutdown(world)
    except UserError as e:
        stop(e)
    except Exception as e:  # a bug, or a collective's timeout: then where this rank was
        try:
            explain(e, cfg, rank)
        except Exception as later:  # torch's SIGCHLD handler raises wherever the rank is when its data
            explain(later, cfg, rank)  # worker dies, and the rank's read of that worker may fail first
            raise later
        phase.report_timeout(e, rank, timeout)
        raise


def explain(error: Exception, cfg: Config, rank: int) -> None:
    """Ends this rank with one message where the error has a cause the user can act on (or ends it
    quietly where another rank's message is the job's); returns for a bug."""
    from sfttrain.fs_faults import filesystem_error, folder_gone_error
    from sfttrain.distributed import peer_lost

    if stop_signal.interrupted():  # the collective of a rank that Ctrl-C stopped first
        interrupted(cfg, rank)
    if short := out_of_memory(error, cfg, rank, phase.current()) or killed_worker(error, cfg, rank, phase.current()):
        stop(short)  # (before the filesystems: a worker's full /dev/shm is memory run out, as its SIGBUS is)
    if refused := filesystem_error(error, cfg.trainer.default_local_dir, phase.current()):
        stop(refused)
    if gone := folder_gone_error(error, cfg.trainer.default_local_dir, phase.current()):
        stop(gone)
    if peer_lost(str(error)):  # another rank ended first, with the cause (its message, a traceback): torchrun
        stop_signal.end_if_told()  # ends this one (its SIGTERM, or one already noted), without a second
        time.sleep(WAIT_FOR_RANK0_S)  # traceback; past the wait, this rank says what it saw


def out_of_memory(error: BaseException, cfg: Config, rank: int, where: str) -> OutOfMemory | None:
    """A rank out of memory (CUDA's allocator, the host's, or Python's) as one message: where, what
    was asked for, and the keys that shrink what that phase holds. None for any other error."""
    import torch

    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        device, asked = "GPU", text.split(" If reserved")[0].split(" See documentation")[0]
    elif isinstance(error, MemoryError) or "DefaultCPUAllocator" in text:
        size = re.search(r"allocate (\d+) bytes", text)
        device, asked = "host", f"{int(size.group(1)) / 2**30:.2f} GiB asked for" if size else "MemoryError"
    else:
        return None
    m, d = cfg.model, cfg.data
    if where == "start-up":
        fix = ("the model's weights, gradients and AdamW state on each rank: shard them over more ranks, train LoRA "
               "adapters (model.lora_rank), or keep them in host memory (model.fsdp_config.offload_params=true)")
    elif where.startswith(("step", "validation")):
        budget = (f"data.max_token_len_per_gpu={d.max_token_len_per_gpu}" if d.max_token_len_per_gpu
                  else f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}")
        fix = (f"a micro-batch's activations and its loss's logits: lower {budget} or model.loss_chunk_tokens="
               f"{m.loss_chunk_tokens}" + ("" if m.enable_gradient_checkpointing else
                                          ", or recompute activations in backward (model.enable_gradient_checkpointing=true)"))
    elif where.startswith("the save"):
        fix = "a checkpoint's staged copy: trainer.async_save_staging=host, or a lower trainer.async_save_in_flight"
    else:
        fix = "what this phase holds"
    return OutOfMemory(f"rank {rank} ran out of {device} memory in {where} ({asked}). What fills it: {fix}. "
                       "`python -m sfttrain.plan` with the same arguments and --nproc estimates the memory per rank. "
                       f"The same command then resumes from the last checkpoint committed in {cfg.trainer.default_local_dir}")


def killed_worker(error: BaseException, cfg: Config, rank: int, where: str) -> OutOfMemory | None:
    """A DataLoader worker killed by SIGKILL or SIGBUS, or one that found the shared memory full, as one
    message. torch's error names the worker and the signal (raised where the rank was when the worker died,
    or as the cause of the next step's "exited unexpectedly"). SIGKILL is most often the host's out-of-memory
    killer, SIGBUS a full /dev/shm (the workers hand their batches over in shared memory), so both are said
    as memory run out (exit code 9), each with its fix. None for any other error (another signal is a
    crash: its traceback is the bug's)."""
    from sfttrain.checkpoint_folder import latest_of_newest_run
    from sfttrain.fs_faults import SHARED_MEMORY, fault

    last = latest_of_newest_run(cfg.trainer.default_local_dir)
    then = f"resumes from {last[1]}" if last else "starts afresh (no checkpoint was committed yet)"
    if re.search(r"in DataLoader worker process \d+", str(error)) and SHARED_MEMORY in str(error):
        full = fault(error, None)  # the worker's own error, which the DataLoader re-raised in the rank
        return OutOfMemory(f"rank {rank}'s DataLoader worker could not hand a step over in {where}: {full.cause}. "
                           f"{full.fix}. The same command then {then}")
    # the signal in strsignal's words, as torch's message has them (the C library's, in this process's locale)
    names = {signal.strsignal(s): s for s in (signal.SIGKILL, signal.SIGBUS)}
    sign = re.compile(rf"DataLoader worker \(pid (\d+)\) is killed by signal: ({'|'.join(map(re.escape, names))})")
    killed = None
    while error is not None and not killed:
        killed, error = sign.search(str(error)), error.__cause__ or error.__context__
    if not killed:
        return None
    sig = signal.Signals(names[killed.group(2)])
    if sig == signal.SIGKILL:
        cause = ("most often the host's out-of-memory killer (`dmesg` or `journalctl -k` names what it killed; a "
                 "cgroup's or Slurm job's memory limit kills the same way). Each of a rank's data.num_workers="
                 f"{cfg.data.num_workers} workers is a process holding the steps it builds ahead: lower "
                 "data.num_workers (0 builds them in the rank itself), or give the job more host memory")
    else:
        cause = ("most often a full shared memory: the workers hand their batches to the rank through /dev/shm, "
                 "which a container limits to 64 MiB unless told (`docker run --shm-size=8g`; on Kubernetes an emptyDir of "
                 f"medium Memory mounted at /dev/shm; `df -h /dev/shm` shows its size). Or set data.num_workers=0 "
                 f"(now {cfg.data.num_workers}): the rank then builds its batches itself, without shared memory")
    return OutOfMemory(f"rank {rank}'s DataLoader worker (pid {killed.group(1)}) was killed by {sig.name} in "
                       f"{where}: {cause}. The same command then {then}")


def interrupted(cfg: Config, rank: int) -> None:
    """Ctrl-C: one line (rank 0) and exit code 130, the shell's for SIGINT, without a traceback per rank.
    Nothing after the last committed checkpoint is kept (a save in flight is never committed)."""
    from sfttrain import phase

    if rank == 0:
        print(f"sfttrain: interrupted (Ctrl-C) in {phase.current()}; the same command resumes from the last checkpoint "
              f"committed in {cfg.trainer.default_local_dir}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


if __name__ == "__main__":
    main()
