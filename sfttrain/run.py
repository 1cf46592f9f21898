"""Entry point: torchrun --nproc_per_node=N -m sfttrain.run [recipe.yaml] key=value ...

A user's mistake or an actionable fault ends the run with one message from rank 0 and its exit code.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from sfttrain.config import Config, ConfigError, load_config
from sfttrain.errors import UserError
from sfttrain.faults import classify, peer_lost, timed_out, what_next
from sfttrain.help import format_help
from sfttrain.runtime import Runtime

# a rank other than 0 waits this long for rank 0 to report the error; past it, it reports its own
WAIT_FOR_RANK0_S = 60


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the YAML file, the overrides): the first argument, or Hydra's --config-path DIR --config-name NAME
    (also -cp / -cn, DIR or =DIR)."""
    hydra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    hydra.add_argument("--config-path", "-cp")
    hydra.add_argument("--config-name", "-cn")
    flags, rest = hydra.parse_known_args(argv)
    yaml_path = rest[0] if rest and "=" not in rest[0] else None
    overrides = rest[1:] if yaml_path else rest
    name = flags.config_name
    if flags.config_path is None and name is None:
        return yaml_path, overrides
    if yaml_path or name is None:
        raise ConfigError("name the YAML file once: as the first argument (python -m sfttrain.run my_sft.yaml ...), "
                          "or as Hydra's --config-path DIR --config-name NAME (DIR/NAME.yaml)")
    name = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    return os.path.join(flags.config_path or ".", name), overrides


def stop(error: UserError) -> None:
    """Ends this rank on a user mistake with its exit code; rank 0 says it."""
    message = f"sfttrain: {error.kind}: {error}"
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if not (rank0 or error.every_rank):
        time.sleep(WAIT_FOR_RANK0_S)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            # torch's layout (elastic/multiprocessing/errors), the message for the traceback
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    if rank0 or not error.every_rank:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # without torch's teardown: a rank still tearing down when torchrun stops the job is reported as killed
    os._exit(error.exit_code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in ("-h", "--help"):
            print(format_help(argv[1] if len(argv) > 1 else None))
            return
        cfg = load_config(*parse_args(argv), check=False)  # its problems are listed with the start-up checks
    except UserError as e:
        stop(e)
    runtime = Runtime().start()  # before any thread starts
    one_thread_without_torchrun()
    # torch loads only now: a config mistake is said within a second; `record` gives torchrun a bug's traceback
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(train)(cfg, runtime)
    finally:
        runtime.close()


def one_thread_without_torchrun() -> None:
    """A rank started without torchrun and without OMP_NUM_THREADS gets one thread, as torchrun's ranks do:
    torch's default of every core is many times slower wherever other work shares the cores."""
    if "OMP_NUM_THREADS" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads; the DataLoader workers inherit it
    if int(os.environ.get("RANK", 0)) == 0:
        print("NOTE: OMP_NUM_THREADS is unset: one CPU thread per rank, as torchrun sets (OMP_NUM_THREADS=N for "
              "more)", flush=True)


def train(cfg: Config, runtime: Runtime) -> None:
    rank = int(os.environ.get("RANK", 0))
    try:
        _train(cfg, rank, runtime)
    except KeyboardInterrupt:  # also raised while an error below was being handled
        interrupted(cfg, rank, runtime)
    # skip the final collection of torch's object graphs: seconds per rank, and everything is closed
    gc.freeze()


def _train(cfg: Config, rank: int, runtime: Runtime) -> None:
    from sfttrain.distributed import init_world, shutdown
    from sfttrain.trainer import FSDPSFTTrainer

    timeout = cfg.trainer.nccl_timeout
    try:
        world = init_world(cfg)
        if world.device.type == "cuda":  # NCCL's own watchdog ends the process without a Python exception
            runtime.start_watchdog(rank, timeout)
        trainer = FSDPSFTTrainer(cfg, world, runtime)
        try:
            trainer.train()
        finally:
            trainer.logger.close()  # the bar ends before any error is printed
        runtime.enter("shutdown")
        shutdown(world)
    except UserError as e:
        stop(e)
    except Exception as e:  # a bug, or a collective's timeout: then where this rank was
        try:
            explain(e, cfg, rank, runtime)
        except Exception as later:  # torch's SIGCHLD handler raises wherever the rank is when its data
            explain(later, cfg, rank, runtime)  # worker dies, and the rank's read of that worker may fail first
            raise later
        if timed_out(e):
            runtime.report_phase(rank, timeout)
        raise


def explain(error: Exception, cfg: Config, rank: int, runtime: Runtime) -> None:
    """Ends this rank where the user can act on the error; returns for a bug."""
    if runtime.interrupted:  # the collective of a rank that Ctrl-C stopped first
        interrupted(cfg, rank, runtime)
    if known := classify(error, cfg, rank, runtime.phase):
        stop(known)
    if peer_lost(str(error)):  # another rank ended first with the cause: torchrun ends this one
        runtime.end_if_told()
        time.sleep(WAIT_FOR_RANK0_S)  # past the wait, this rank says what it saw


def interrupted(cfg: Config, rank: int, runtime: Runtime) -> None:
    """A Ctrl-C that stops at once (sfttrain.runtime): one line and exit code 130, no tracebacks."""
    if rank == 0:
        print(f"sfttrain: interrupted (Ctrl-C) in {runtime.phase}, without a save. "
              f"{what_next(cfg.trainer)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


if __name__ == "__main__":
    main()
