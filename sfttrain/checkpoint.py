"""Sharded (DCP) checkpoints: the checkpointer, its atomic commit and the retention of this run's
checkpoints (loading: sfttrain.checkpoint_load).

`<run>/global_step_N/` holds the model and optimizer shards (DCP's .metadata and __*.distcp, reshardable),
trainer_state.json (TrainState, run id, world size), rng/rank_R.pt, config.yaml, hf/ (config and tokenizer,
for export), with trainer.save_hf huggingface/ (the export, after the commit), and COMPLETE, written last:
its files and their sizes. Only folders with COMPLETE, whose files are those it lists, are resumed from.

Commit: every rank writes into `.global_step_N.tmp`; once every rank's write has finished (at once, or with
trainer.async_save at a later step boundary) rank 0 writes COMPLETE, fsyncs and renames the folder. A crash
leaves a `.tmp` folder at worst, which the next start deletes; a save that fails on any rank ends every
rank with one CheckpointError. The data position and the seed name the samples used whatever the world
size, so N ranks' checkpoint resumes on M.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import io
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Callable, Optional, TypeVar

import psutil  # type: ignore[import-untyped]  # (peft and wandb require it)
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import STATE_FILE, complete_checkpoints, fsync_path, hide, \
    publish, remove, room_problem, size_text, tree_bytes, write_complete, write_synced
# re-exported (noqa): the trainer, the preflight and the exporter know them as sfttrain.checkpoint's
from sfttrain.checkpoint_load import (TrainState, check_same_model, estimated_bytes, load,  # noqa: F401
                                      read_back, rng_state, state_dicts, trained_state_dict)  # noqa: F401
from sfttrain.checkpoint_writer import DeviceCopy, OneLineError, Staging, WriterProcess, one_line, tensor_bytes, \
    write_shards
from sfttrain.config import Config, ConfigError, to_yaml
from sfttrain.distributed import World, decided_by_rank0, from_every_rank, ranks_of_this_launcher
from sfttrain.errors import CheckpointError
from sfttrain.faults import (SIZE_LIMIT_FIX, data_worker_died, disk_full, fault, file_at_size_limit, folder_gone,
                             over_size_limit, peer_lost, resumes_from, what_next)

# DCP's CheckpointException (every rank's error) is a BaseException
WRITE_ERRORS = (Exception, CheckpointException)
# a rank's state of the oldest save's write, agreed by a MIN over ranks: failed, stuck, still writing, written
FAILED, STUCK = -2, -1
# a write is stuck past trainer.nccl_timeout and its rank's share at this rate: slow storage is slow, not stuck
SLOWEST_WRITE_BYTES_PER_S = 20e6
T = TypeVar("T")
NOT_STARTED = "so it was not started"  # how the message of a save refused for lack of space ends


class Checkpointer:
    """Writes `global_step_N` checkpoints of run `run_id`. With trainer.async_save a periodic save returns
    once this rank's shard is copied (Staging); one writer thread per rank writes the saves in order (on
    CUDA through a writer process: trainer.async_save_writer) while training goes on, and each commits at
    the first step boundary where every rank has written it (`poll`). A save finding
    trainer.async_save_in_flight saves in flight waits for the oldest; the final save waits for all.
    `report(record, line)` gets each commit's size and seconds (stall, write, until the commit)."""

    def __init__(self, run_dir: str, world: World, cfg: Config, run_id: str,
                 report: Callable[[Optional[dict], str], None], model, optimizer, tokenizer, writer: str):
        self.run_dir, self.world, self.cfg, self.run_id, self.report = run_dir, world, cfg, run_id, report
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer  # what each save holds
        self.config_yaml = to_yaml(cfg) if world.is_main else ""  # once: rendering it per save stalls
        self.pending: collections.deque[PendingSave] = collections.deque()  # oldest first
        own = complete_checkpoints(run_dir, run_id)
        self.last_bytes = tree_bytes(own[-1][1]) if own and world.is_main else None  # rank 0's space check
        # known without asking the run folder's disk, which a stuck write may leave stuck too (_stuck)
        self.committed: Optional[str] = own[-1][1] if own else None
        self.write_began: Optional[float] = None  # perf_counter when the writer thread's running write began
        self.stuck_after_s = max(cfg.trainer.nccl_timeout,
                                 estimated_bytes(model) / world.world_size / SLOWEST_WRITE_BYTES_PER_S)
        self.warned_grace = False
        # DCP's collectives (writer thread) and the agreement on the writes (main thread) must not
        # interleave: a gloo group each (host tensors: never waiting for the GPU)
        timeout = datetime.timedelta(seconds=cfg.trainer.nccl_timeout)
        self.write_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agree_group = dist.new_group(backend="gloo", timeout=timeout)
        self.in_process = writer == "process"  # trainer.async_save_writer as sfttrain.resolved chose it
        self.process: Optional[WriterProcess] = None
        pinned = cfg.trainer.async_save_pinned and world.device.type == "cuda"
        self.staging = Staging(world.device, pinned, shared=self.in_process)  # background saves' copies
        # fewer where the staging memory holds fewer copies (agreed after the first step: _reserve_slots)
        self.slots, self.slots_agreed = cfg.trainer.async_save_in_flight, False
        # one writer: every rank writes its saves in the same order, so DCP's collectives pair up
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self.cleaner = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")  # retention's deletions
        decided_by_rank0(self._check_room)  # a disk that cannot take the next save stops every rank now

    def _check_room(self) -> None:
        need = self.last_bytes or estimated_bytes(self.model)
        if problem := room_problem(self.run_dir, shutil.disk_usage(self.run_dir).free, need, not self.last_bytes):
            raise ConfigError(problem)

    def save(self, state: TrainState, wandb_id: Optional[str] = None, final: bool = False) -> None:
        """Collective. Raises CheckpointError on every rank if any rank could not write its part."""
        started = time.perf_counter()
        background = self.cfg.trainer.async_save and not final
        self.wait(self.slots - 1 if background else 0)  # a full queue waits for the oldest
        waited = time.perf_counter() - started
        if self.in_process and not self.pending:  # (with a save in flight, its write finds a lost writer)
            self._replace_lost_writer()
        tmp = os.path.join(self.run_dir, f".global_step_{state.step}.tmp")
        taken, error = _attempt(lambda: self._prepare(tmp, background))
        self._agree(state.step, tmp, error)  # before the write, whose collectives need every rank
        assert taken is not None  # or _agree has raised
        state_dict, slot = taken
        future = self.writer.submit(self._write, state_dict, tmp, slot, self._small_files(state, wandb_id), started)
        del state_dict, taken
        self.pending.append(PendingSave(state.step, tmp, os.path.join(self.run_dir, f"global_step_{state.step}"),
                                        future, slot, started, time.perf_counter() - started, waited, background))
        if not background:
            self.wait()

    def poll(self) -> None:
        """Collective, after every step: commits, oldest first, the saves every rank has written (one tiny
        all-reduce while a save is in flight). After the first step (the optimizer's state exists) it
        reserves the staging of the saves to come."""
        if self.cfg.trainer.async_save and not self.slots_agreed and self.cfg.trainer.save_freq > 0:
            self._reserve_slots()
        while self.pending and self._all_written(self.pending[0].future.done()):
            self._commit()

    def wait(self, keep: int = 0) -> None:
        """Collective: waits for the oldest saves' writes until `keep` are in flight, and commits them. The
        ranks ask each other every second, so a failed write on one stops the others waiting for it in DCP's
        collectives."""
        while len(self.pending) > keep:
            self.pending[0].awaited = True
            while not self._all_written(bool(wait([self.pending[0].future], timeout=1.0).done)):
                pass
            self._commit()

    def close(self) -> None:
        self.cleaner.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        if self.process is not None:
            self.process.close()

    def _reserve_slots(self) -> None:
        """Collective: where background saves are staged (trainer.async_save_staging) and how many may be in
        flight (as many copies as every node's memory holds, at least one). Pinned host copies are
        allocated now, before the second step: page locking beside the steps would slow them."""
        model_sd, optim_sd = state_dicts(self.model, self.optimizer)
        live = {"model": model_sd, "optim": optim_sd}
        copy, device, local_ranks = max(tensor_bytes(live), 1), self.world.device, ranks_of_this_launcher()
        available = psutil.virtual_memory().available  # Linux's MemAvailable: free and droppable cache
        # one copy's worth kept free for the rest of the node's work (data workers, the writes' page cache)
        host_fit = available // (copy * local_ranks) - 1
        if device.type != "cuda":  # the device's memory is the host's, where the host slot takes one copy
            device_fit = host_fit - 1
        elif copy - tensor_bytes(live, on="cuda") > copy // 100:  # offloaded (cpu_offload): a device copy is a host one
            device_fit = 0
        else:  # a tenth of the whole is left for later steps' higher peaks and fragmentation
            free, total = torch.cuda.mem_get_info(device)
            device_fit = max(0, free - total // 10) // copy
        fits = torch.tensor([host_fit, device_fit])
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.agree_group)
        host_fit, device_fit = fits.tolist()
        wanted, setting = self.slots, self.cfg.trainer.async_save_staging
        on_device = device_fit >= 1 and (setting == "device" or
                                         setting == "auto" and device.type == "cuda" and device_fit >= wanted)
        self.slots, self.slots_agreed = max(1, min(wanted, device_fit if on_device else host_fit)), True
        if self.in_process:  # the writer process first, on every rank (a collective of the writer threads)
            self.writer.submit(self._writer_process)
        started = time.perf_counter()
        pinned = self.staging.reserve(live, self.slots, on_device)
        for slot in pinned if self.in_process else []:  # sent to the writer process now, not with a save's write
            self.writer.submit(lambda kept: self._writer_process().write(self.staging.kept[kept], kept), slot)
        if not self.world.is_main:
            return
        where = (f"on {device} (its free memory holds {self.slots} beside the first step's peak), then copied to "
                 "host memory by the writer" if on_device else "in host memory")
        locked = (f"; {len(pinned)} x {size_text(copy)} of page-locked host memory allocated in "
                  f"{time.perf_counter() - started:.1f} s before step 2 (once: page locking beside the steps would "
                  "slow them)" if pinned else "")
        self.report(None, f"background saves: each takes a copy of a rank's model and optimizer shard "
                          f"({size_text(copy)}) {where} (trainer.async_save_staging={setting}); {self.slots} in flight "
                          f"at most{locked}")
        if self.slots < wanted:
            holds = (f"the free memory of {device} holds {self.slots}" if on_device else
                     f"host memory holds {self.slots}: a host copy of a rank's shard takes {size_text(copy)} "
                     f"({local_ranks} ranks per node) and {size_text(available)} are available")
            logging.getLogger("sfttrain").warning(
                f"trainer.async_save_in_flight={wanted}, but {holds}. At most {self.slots} saves will be in flight; "
                "a save finding them all in flight waits for the oldest write")

    def _prepare(self, tmp: str, background: bool) -> tuple[dict | DeviceCopy, Optional[int]]:
        """Rank 0 makes the save's folder where its disk has room; every rank takes its state dict and, for
        a background save, copies it before save() returns (the next steps change the weights)."""
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
            free = shutil.disk_usage(self.run_dir).free
            if self.last_bytes and free < self.last_bytes:
                raise OneLineError(f"it needs about {size_text(self.last_bytes)} (the size of the last checkpoint) "
                                   f"and {self.run_dir} has {size_text(free)} free, {NOT_STARTED}")
            os.makedirs(os.path.join(tmp, "rng"))
        model_sd, optim_sd = state_dicts(self.model, self.optimizer)
        if not background:
            return {"model": model_sd, "optim": optim_sd}, None
        return self.staging.stage({"model": model_sd, "optim": optim_sd}, busy={p.slot for p in self.pending})

    def _small_files(self, state: TrainState, wandb_id: Optional[str]) -> dict[str, str | bytes]:
        """Taken now, written by the writer thread: their fsyncs would stall training behind earlier writes."""
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        files: dict[str, str | bytes] = {os.path.join("rng", f"rank_{self.world.rank}.pt"): rng.getvalue()}
        if self.world.is_main:
            files[STATE_FILE] = json.dumps({**asdict(state), "wandb_id": wandb_id,
                                            "world_size": self.world.world_size}, indent=1)
            files["config.yaml"] = self.config_yaml
        return files

    def _write(self, state_dict: dict | DeviceCopy, tmp: str, slot: Optional[int], small_files: dict[str, str | bytes],
               started: float) -> tuple[float, float]:
        """The writer thread: the small files (first: DCP's write ends once every rank has begun it, so rank
        0's fsync of the folder after it covers them), then the shards, a background save's in the writer
        process. Returns the shards' write seconds and the seconds since `started`."""
        self.write_began = time.perf_counter()  # (_all_written: a write unfinished past stuck_after_s is stuck)
        try:
            for name, content in small_files.items():
                write_synced(os.path.join(tmp, name), content)
            if self.world.is_main:
                hf = os.path.join(tmp, "hf")
                self.model.config.save_pretrained(hf)
                if getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(hf)
                self.tokenizer.save_pretrained(hf)
            threads = self.cfg.trainer.save_thread_count
            if isinstance(state_dict, DeviceCopy):  # staged on the device: its host copy is made now
                assert slot is not None  # Staging.stage gives every copy a slot
                state_dict = self.staging.to_host(state_dict, slot)
            if slot is None or not self.in_process:
                write_s = write_shards(state_dict, tmp, threads, self.write_group, self.world.is_main)
            else:
                process = self._writer_process()
                self.write_began = time.perf_counter()  # a writer started anew (a lost one's replacement)
                write_s = process.write(state_dict, slot, tmp, threads)  # its slot's copy: kept there
            return write_s, time.perf_counter() - started
        finally:
            self.write_began = None

    def _writer_process(self) -> WriterProcess:
        """Made on the writer thread, by every rank at the same point of its tasks."""
        if self.process is None:
            self.process = WriterProcess(self.world.rank, self.world.world_size, self.write_group,
                                         self.cfg.trainer.nccl_timeout)
        return self.process

    def _replace_lost_writer(self) -> None:
        """Collective, before a save with none in flight: a writer process that ended (the OOM killer)
        would fail this save; the writers form one group, so every rank's is replaced."""
        codes = from_every_rank(self.process and self.process.exit_code(), self.agree_group)
        lost = {rank: code for rank, code in enumerate(codes) if code is not None}
        if not lost:
            return
        self.writer.submit(self._stop_writer).result()  # on the writer thread, which alone uses the process
        self.process = None
        if self.world.is_main:
            logging.getLogger("sfttrain").warning(
                f"the checkpoint writer process of rank(s) {sorted(lost)} had ended (exit code(s) "
                f"{sorted(lost.values())}; -9 is SIGKILL, most often the host's out-of-memory killer): every rank's "
                "writer is started anew for this save")

    def _all_written(self, done: bool) -> bool:
        """True when every rank has written the oldest save; a write that failed on any rank fails every rank."""
        future = self.pending[0].future
        error = future.exception() if done else None
        began = self.write_began  # (the oldest save's: the writer thread writes the saves in order)
        stuck = not done and began is not None and time.perf_counter() - began > self.stuck_after_s
        status = torch.tensor([FAILED if error is not None else STUCK if stuck else int(done)])
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.agree_group)
        if status.item() == STUCK:
            self._stuck(self.pending[0].step, time.perf_counter() - (began or self.pending[0].started))
        if status.item() == FAILED:
            self._stop_writer()
            with contextlib.suppress(*WRITE_ERRORS):  # every rank's writer has stopped before the clean-up
                future.result()
            failed = self.pending.popleft()
            self._agree(failed.step, failed.tmp, error)
        return status.item() == 1

    def _stuck(self, step: int, seconds: float) -> None:
        """A write unfinished past stuck_after_s would hang the run for good (the ranks' agreement answers
        every second, so no collective times out). Raised without touching the run folder, whose disk may
        be what hangs: the next start removes the partial folder."""
        self._stop_writer(timeout=10)
        raise CheckpointError(
            f"the checkpoint of step {step} was not saved: its write has not finished {seconds:.0f} s after it "
            f"began (the longest a write may take here: {self.stuck_after_s:.0f} s, the larger of "
            f"trainer.nccl_timeout={self.cfg.trainer.nccl_timeout} and a rank's share of the checkpoint at "
            f"{SLOWEST_WRITE_BYTES_PER_S / 1e6:.0f} MB/s): it is stuck, e.g. on a network filesystem that stopped "
            "answering or in a checkpoint writer process that was stopped. Nothing of it was committed; the last "
            f"good checkpoint is {self.committed or 'none'}. Check that {self.run_dir} answers (ls, df). "
            f"{resumes_from(self.committed)}. A write that is only slow needs a larger trainer.nccl_timeout")

    def _stop_writer(self, timeout: Optional[float] = None) -> None:
        """A save failed somewhere: a rank's write cannot finish without every rank's (a writer thread
        ends with DCP's own error)."""
        if self.process is not None:
            self.process.stop(timeout)

    def _agree(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective: raises CheckpointError on every rank if `error` is set on any, once every rank has
        stopped writing; rank 0 removes the partial folders (this save's and the later ones') and words
        the one message every rank raises."""
        every = from_every_rank(one_line(error) if error is not None else None, self.agree_group)
        errors = [(rank, text) for rank, text in enumerate(every) if text is not None]
        if not errors:
            return
        for later in self.pending:
            later.future.cancel()

        def clean_up() -> None:
            limited = file_at_size_limit(tmp) if os.path.isdir(tmp) else None  # named before the folder goes
            for partial in [tmp, *(later.tmp for later in self.pending)]:
                with contextlib.suppress(OSError):
                    if os.path.lexists(partial):
                        remove(partial)
            raise CheckpointError(self._not_saved(step, errors, limited, os.path.lexists(tmp), renamed))

        decided_by_rank0(clean_up, self.agree_group)

    def _not_saved(self, step: int, errors: list[tuple[int, str]], limited: Optional[str], left: bool,
                   renamed: bool) -> str:
        """What failed, what is left, and what to do (`limited`: a file at the file size limit; `left`: the
        partial folder could not be removed; `renamed`: the commit failed after its rename, whose fsync
        a failing disk refused)."""
        if gone := folder_gone(self.run_dir):  # and its checkpoints and free space with it
            return f"the checkpoint of step {step} was not saved: {gone}"
        own = [(s, path) for s, path in complete_checkpoints(self.run_dir, self.run_id) if not (renamed and s == step)]
        last = own[-1][1] if own else None
        # a rank that lost a peer inside a collective reports only that: the cause is the peer's error
        causes = [(rank, text) for rank, text in errors if not peer_lost(text)] or errors
        rank, text = ([(rank, text) for rank, text in causes if disk_full(text)] or causes)[0]
        found, full = fault(text, self.run_dir), disk_full(text)  # a full disk, read-only, denied, open files
        if limited or over_size_limit(text):  # the disk may have room: a file met the limit (EFBIG)
            why, fix = (f"the file size limit (ulimit -f) was reached ({f'{limited}: ' if limited else ''}{text}, on "
                        f"rank {rank})"), SIZE_LIMIT_FIX
        elif found is not None and not (full and found.in_run_folder):  # (the run folder's: this save's own)
            why, fix = f"{found.cause}, on rank {rank}", found.fix
        else:
            why = (f"the disk is full ({text}, on rank {rank})" if full else
                   f"{text} (rank {rank}{f' and {len(errors) - 1} other ranks' if len(errors) > 1 else ''})")
            fix = (f"{self.run_dir} has {size_text(shutil.disk_usage(self.run_dir).free)} free. Free space (or set "
                   "trainer.default_local_dir on a larger disk, or lower trainer.max_ckpt_to_keep: the oldest goes "
                   "after the next commit)" if full or NOT_STARTED in text else "Fix what the error names")
        if renamed:
            final = os.path.join(self.run_dir, f"global_step_{step}")
            return (f"the checkpoint of step {step} may not be saved: {why}, in its commit, once its files were on "
                    f"the disk and its folder renamed to {final}: whether the rename reached the disk is not known. "
                    f"The last good checkpoint before it is {last or 'none'}. {fix}. The same command then resumes "
                    f"from {final} where it is there (whole), else from {last or 'nothing: it starts afresh'}")
        partial = (f"its partial folder .global_step_{step}.tmp is left, and the next start deletes it" if left
                   else "its partial folder was removed")
        return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed ({partial}); "
                f"the last good checkpoint is {last or 'none'}. {fix}. {what_next(self.cfg.trainer)}")

    def _commit(self) -> None:
        p, world = self.pending.popleft(), self.world
        error, renamed, size = None, False, 0
        if world.is_main:
            try:
                size = write_complete(p.tmp)
                fsync_path(p.tmp)
                publish(p.tmp, p.final)  # the commit
                self.last_bytes = size
            except OSError as e:
                error = e
                renamed = os.path.isdir(p.final) and not os.path.lexists(p.tmp)  # publish's rename was done
        self._agree(p.step, p.tmp, error, renamed)
        self.committed = p.final
        if not world.is_main:
            return
        # retention: this run's newest max_ckpt_to_keep (all where null or 0), as on disk, so it holds across resumes
        keep = self.cfg.trainer.max_ckpt_to_keep
        for _, path in complete_checkpoints(self.run_dir, self.run_id)[:-keep] if keep else []:
            self.cleaner.submit(shutil.rmtree, hide(path), True)
        write_s, written_s = p.future.result()
        seconds = time.perf_counter() - p.started
        stall = p.stall_s if p.background else seconds
        record = {"step": p.step, "event": "checkpoint", "path": p.final, "async": p.background, "bytes": size,
                  "stall_s": stall, "waited_previous_s": p.waited_s, "written_s": written_s, "write_s": write_s,
                  "commit_s": seconds, "gb_per_s": size / 1e9 / write_s, "awaited": p.awaited,
                  "staging": ("device" if self.staging.on_device else "host") if p.background else None}
        waited = f" ({p.waited_s:.2f} s of it for older saves' writes)" if p.waited_s >= 0.01 else ""
        self.report(record, f"checkpoint {os.path.basename(p.final)} committed: {size / 1e9:.3g} GB, training "
                            f"stalled {stall:.2f} s{waited}, written in {write_s:.2f} s ({record['gb_per_s']:.3g} GB/s"
                            f"{', in the background' if p.background else ''}), committed {seconds:.2f} s after "
                            "the save began")
        log = logging.getLogger("sfttrain")
        if (free := shutil.disk_usage(self.run_dir).free) < size:
            log.warning(f"{self.run_dir} has {size_text(free)} free and a checkpoint takes "
                        f"{size_text(size)}: the next save will not fit (retention deletes the oldest only "
                        "after the next commit). Free space now, or the next save stops the run (it then resumes from "
                        "the last checkpoint)")
        # once, where a SIGTERM's save would outlast the default grace (sfttrain.stop_signal)
        warning = stop_signal.grace_warning(write_s) if self.cfg.trainer.save_on_sigterm else None
        if warning and not self.warned_grace:
            self.warned_grace = True
            log.warning(warning)


@dataclass
class PendingSave:
    step: int
    tmp: str
    final: str
    future: Future  # the write and its fsyncs; its result: (the write's seconds, seconds from started until written)
    slot: Optional[int]  # the staging slot holding its host copy (None: not staged)
    started: float  # perf_counter when save() began
    stall_s: float  # seconds the training loop waited for it (a background write: until it was staged)
    waited_s: float  # of stall_s, the seconds spent waiting for older saves' writes to free a place
    background: bool  # written while training went on
    awaited: bool = False  # committed by a wait of the loop for its write, not at a step boundary (poll)


def _attempt(work: Callable[[], T]) -> tuple[Optional[T], Optional[BaseException]]:
    """`work`'s value, or its error for every rank to agree on; a data worker's death that landed in the
    save is raised on: its exit code is the worker's, not the save's."""
    try:
        return work(), None
    except WRITE_ERRORS as e:  # noqa: BLE001 - reported to every rank by Checkpointer._agree
        if data_worker_died(e):
            raise
        return None, e
