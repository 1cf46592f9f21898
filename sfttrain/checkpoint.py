"""Sharded (DCP) checkpoints: the checkpointer (background saves, atomic commit, retention of this
run's checkpoints). What a checkpoint holds and its loading: sfttrain.checkpoint_state.

Layout of `<run>/global_step_N/`:
  .metadata, __*.distcp   model + optimizer, sharded (torch.distributed.checkpoint), reshardable
  trainer_state.json      step, data position, data fingerprint, optimizer/LR settings, wandb id, world size,
                          run id (sfttrain.resume), LoRA base and adapter settings (sfttrain.lora.trained_identity)
  rng/rank_R.pt           each rank's RNG states
  config.yaml             the resolved run config
  hf/                     the model's config, generation config and tokenizer (for export)
  huggingface/            with trainer.save_hf, on the final checkpoint: the exported HF model (written after
                          the commit, sfttrain.export.into_checkpoint)
  COMPLETE                written last, the list of the files above and their sizes; only folders with it are
                          ever resumed from, and only while their files are those it lists

Commit protocol: every rank writes into `.global_step_N.tmp`; once every rank's write has finished
(all ranks agree on it: at once, or with trainer.async_save at a later step boundary) rank 0 fsyncs
the folder, writes COMPLETE and renames the folder to `global_step_N` (sfttrain.checkpoint_folder.publish,
which also replaces an older save of the same step without a moment where neither is committed). A
crash at any moment leaves a `.tmp` folder at worst, which the next start deletes. A save that fails
on any rank (a full disk) ends every rank with one CheckpointError: the partial folder removed, the
last good checkpoint and the free space named.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from sfttrain import stop_signal
from sfttrain.checkpoint_faults import NOT_STARTED, SLOWEST_WRITE_BYTES_PER_S, not_saved, stuck_text
from sfttrain.checkpoint_folder import STATE_FILE, complete_checkpoints, enforce_retention, fsync_path, fsync_tree, \
    hide, publish, remove, room_problem, size_text, tree_bytes, write_complete, write_synced
# load, read_back, check_same_model and trained_state_dict: imported from here by the trainer, export and plan
from sfttrain.checkpoint_state import (OneLineError, TrainState, check_same_model, estimated_bytes,  # noqa: F401
                                       load, one_line, read_back, rng_state, state_dicts, trained_state_dict)
from sfttrain.config import Config, ConfigError, to_yaml
from sfttrain.distributed import World, decided_by_rank0, from_every_rank
from sfttrain.errors import CheckpointError, data_worker_died
from sfttrain.faults import file_at_size_limit

# what a failed write raises: DCP's CheckpointException (every rank's error) is a BaseException
WRITE_ERRORS = (Exception, CheckpointException)
# a rank's state of the save in flight, as the ranks agree on it (the minimum wins): failed, stuck
# (unfinished past `Checkpointer.stuck_after_s`), still writing, written
FAILED, STUCK = -2, -1


class Checkpointer:
    """Writes `global_step_N` checkpoints of one run (`run_id`). With trainer.async_save a periodic save is
    DCP's async_save: it returns once DCP's stager has copied this rank's shard to host memory (pinned on
    CUDA: trainer.async_save_pinned), and DCP writes it while training goes on (trainer.async_save_writer).
    It commits at the first step boundary where every rank's write has finished (`poll`). One save is in
    flight (DCP's stager keeps one host copy of each tensor): the next waits for it. The final save is
    written in the training process. Retention keeps this run's newest trainer.max_ckpt_to_keep.
    Each commit's `report(record, line)`: its size, the loop's stall (of it, the wait for the previous
    save), the write's seconds and GB/s, the seconds until the commit, and whether the loop waited for it."""

    def __init__(self, run_dir: str, world: World, cfg: Config, run_id: str, report: Callable[[dict, str], None],
                 model, optimizer, tokenizer):
        self.run_dir, self.world, self.cfg, self.run_id, self.report = run_dir, world, cfg, run_id, report
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer  # what each save holds
        # rank 0's config.yaml of every save, rendered once: a rendering (the whole schema through
        # OmegaConf) would stall the training thread at each save
        self.config_yaml = to_yaml(cfg) if world.is_main else None
        self.pending: Optional[PendingSave] = None
        own = complete_checkpoints(run_dir, run_id)
        self.last_bytes = tree_bytes(own[-1][1]) if own and world.is_main else None  # rank 0's space check
        # this run's newest committed checkpoint, known to every rank without asking the run folder's disk
        # (a write stuck on it would leave a listing stuck too: _stuck)
        self.committed: Optional[str] = own[-1][1] if own else None
        self.stuck_after_s = max(cfg.trainer.nccl_timeout,
                                 estimated_bytes(model) / world.world_size / SLOWEST_WRITE_BYTES_PER_S)
        self.warned_grace = False  # _warn_if_a_stop_would_not_save has said it
        # DCP's writes run collectives of their own; the agreement on "every rank has written" must not
        # interleave with them, so each gets its own gloo group (async_save needs a CPU backend also when
        # training runs on nccl; gloo calls on host tensors never wait for the GPU)
        timeout = datetime.timedelta(seconds=cfg.trainer.nccl_timeout)
        self.write_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agree_group = dist.new_group(backend="gloo", timeout=timeout)
        t, cuda = cfg.trainer, world.device.type == "cuda"
        # auto: a process on CUDA (kernel launches need the GIL); a thread on CPU, where a step's long ops
        # release the GIL and a process would only add its start-up to every rank
        self.kind = AsyncCheckpointerType.PROCESS if t.async_save_writer == "process" or \
            t.async_save_writer == "auto" and cuda else AsyncCheckpointerType.THREAD
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=t.async_save_pinned and cuda, use_shared_memory=self.kind == AsyncCheckpointerType.PROCESS,
            use_async_staging=False, use_non_blocking_copy=cuda)) if t.async_save else None
        self.writer_process: Optional[multiprocessing.Process] = None  # DCP's, once its first write is done
        # also at an uncaught error's exit: multiprocessing would end the writer with SIGTERM, which it ignores
        # (_ignored_by_the_writer), and wait for it forever
        weakref.finalize(self, _kill_spawned)
        # small files, then the wait for DCP's write: one thread, so the saves' collectives pair up in order
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self.cleaner = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")  # retention's deletions
        self._check_room()

    def _check_room(self) -> None:
        """Collective, at start-up: the run folder's disk takes the next save (the size of this run's
        last checkpoint, or before its first an estimate), else every rank stops now."""
        def check() -> None:
            need = self.last_bytes or estimated_bytes(self.model)
            if problem := room_problem(self.run_dir, shutil.disk_usage(self.run_dir).free, need, not self.last_bytes):
                raise ConfigError(problem)

        decided_by_rank0(check)

    def save(self, state: TrainState, wandb_id: Optional[str] = None, final: bool = False) -> None:
        """Collective: every rank calls it. Raises CheckpointError on every rank if any rank could
        not write its part (nothing is committed then)."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        background = self.stager is not None and not final
        if background:
            self._fall_back_if_writer_lost()
        first = background and self.kind == AsyncCheckpointerType.PROCESS and self._writer() is None
        tmp = os.path.join(self.run_dir, f".global_step_{state.step}.tmp")
        self._agree(state.step, tmp, _attempt(lambda: self._prepare(tmp)))
        shards, error = None, None
        try:
            model_sd, optim_sd = state_dicts(self.model, self.optimizer)
            shards = {"model": model_sd, "optim": optim_sd}
            if background:
                shards = self._async_save(shards, tmp)
        except WRITE_ERRORS as e:  # noqa: BLE001 - any failure of any rank is agreed on below
            error = _save_error(e)
        self._agree(state.step, tmp, error)
        staged = time.perf_counter()
        future = self.writer.submit(self._write, shards, tmp, self._small_files(state, wandb_id), staged)
        self.pending = PendingSave(state.step, tmp, os.path.join(self.run_dir, f"global_step_{state.step}"),
                                   future, started, staged - started, waited, background, first)
        future.add_done_callback(self.pending.mark_written)
        if not background:
            self.wait()

    def _async_save(self, shards: dict, tmp: str) -> Future:
        """DCP's background save; returns once the shards are staged."""
        writer = ShardWriter(tmp, thread_count=self.cfg.trainer.save_thread_count)
        starts = self.kind == AsyncCheckpointerType.PROCESS and self._writer() is None
        with _ignored_by_the_writer() if starts else contextlib.nullcontext():
            future = dcp.async_save(shards, storage_writer=writer, process_group=self.write_group,
                                    async_checkpointer_type=self.kind, async_stager=self.stager)
            while starts and not _spawned() and not future.done():  # DCP's thread spawns it: at once
                time.sleep(0.001)
        return future

    def poll(self) -> None:
        """Collective, after every step: commits the save in flight once every rank has written it (one tiny
        gloo all-reduce while a save is in flight)."""
        if self.pending and self._all_written(self.pending.future.done()):
            self._commit()

    def wait(self) -> None:
        """Collective: waits for the save in flight, if any, and commits it. The ranks ask each other every
        second: a rank whose write failed says so at once, and the others stop waiting for their own."""
        if self.pending:
            self.pending.awaited = True
            while self.pending and not self._all_written(_finished_within(self.pending.future, seconds=1.0)):
                pass
        if self.pending:
            self._commit()

    def close(self) -> None:
        """Waits for retention's deletions and ends DCP's writer process (it ignores SIGTERM)."""
        self.cleaner.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        if self.stager is not None:
            self.stager.close()
        self._stop_writer()

    def _prepare(self, tmp: str) -> None:
        """Rank 0: a fresh `tmp` folder, once the free space can take a checkpoint of the last one's size."""
        if not self.world.is_main:
            return
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
        free = shutil.disk_usage(self.run_dir).free
        if self.last_bytes and free < self.last_bytes:
            raise NotEnoughSpace(f"it needs about {size_text(self.last_bytes)} (the size of the last checkpoint) "
                                 f"and {self.run_dir} has {size_text(free)} free, {NOT_STARTED}")
        os.makedirs(os.path.join(tmp, "rng"))

    def _small_files(self, state: TrainState, wandb_id: Optional[str]) -> dict[str, Any]:
        """The save's small files, taken now (the next step changes them) and written by the writer thread:
        their fsyncs would stall training behind the disk's queue of earlier writes."""
        world = self.world
        files: dict[str, Any] = {os.path.join("rng", f"rank_{world.rank}.pt"): rng_state()}
        if world.is_main:
            extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size}
            files[STATE_FILE] = json.dumps(extra, indent=1)
            files["config.yaml"] = self.config_yaml
        return files

    def _write(self, shards: dict | Future, tmp: str, small_files: dict[str, Any], began: float) -> float:
        """The writer thread: the small files (each fsynced), rank 0's model config and tokenizer (hf/),
        then the shards: DCP's write here (a final or synchronous save), or the wait for DCP's background
        write. Returns the write's seconds."""
        for name, content in small_files.items():
            path = os.path.join(tmp, name)
            if isinstance(content, str):
                write_synced(path, content)
            else:
                _torch_save_synced(content, path)
        if self.world.is_main:
            hf = os.path.join(tmp, "hf")
            self.model.config.save_pretrained(hf)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(hf)
            self.tokenizer.save_pretrained(hf)
        if isinstance(shards, Future):
            shards.result()
        else:
            dcp.save(shards, storage_writer=ShardWriter(tmp, thread_count=self.cfg.trainer.save_thread_count),
                     process_group=self.write_group)
        return time.perf_counter() - began

    def _fall_back_if_writer_lost(self) -> None:
        """Collective, before a background save: a writer process lost since the last save (the out-of-memory
        killer) would fail this save. DCP starts its writer once, so every rank writes on a thread from now on."""
        if self.kind != AsyncCheckpointerType.PROCESS:
            return
        codes = [None] * self.world.world_size
        dist.all_gather_object(codes, self._writer() and self._writer().exitcode, group=self.agree_group)
        lost = {rank: code for rank, code in enumerate(codes) if code is not None}
        if not lost:
            return
        self._stop_writer()
        self.kind = AsyncCheckpointerType.THREAD
        if self.world.is_main:
            logging.getLogger("sfttrain").warning(
                f"the checkpoint writer process of rank(s) {sorted(lost)} had ended (exit code(s) {sorted(lost.values())}; "
                "-9 is SIGKILL, most often the host's out-of-memory killer): from now on each rank writes its "
                "background saves on a thread of its own")

    def _writer(self) -> Optional[multiprocessing.Process]:
        """DCP's writer process of this rank (the one process it spawns), found once it is started."""
        if self.writer_process is None and self.kind == AsyncCheckpointerType.PROCESS:
            self.writer_process = next(iter(_spawned()), None)
        return self.writer_process

    def _stop_writer(self) -> None:
        """Ends DCP's writer process at once (a write failed somewhere, or is stuck); its write fails."""
        process = self._writer()
        if process is not None and process.exitcode is None:
            process.kill()

    def _all_written(self, done: bool) -> bool:
        """True when every rank's write of the save in flight has finished (each rank's shard, RNG file and,
        on rank 0, DCP's metadata are then on disk); a write that failed on any rank fails every rank."""
        p = self.pending
        error = p.future.exception() if done else None
        if error is not None and (gone := self._writer()) is not None and gone.exitcode is not None:
            error = WriterProcessError(f"the checkpoint writer process of rank {self.world.rank} ended (exit code "
                                       f"{gone.exitcode}; a negative code is the signal that ended it, e.g. -9 for "
                                       "the kernel's out-of-memory killer)")
        stuck = not done and time.perf_counter() - p.write_began > self.stuck_after_s * (2 if p.first else 1)
        status = torch.tensor([FAILED if error is not None else STUCK if stuck else int(done)])
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.agree_group)
        if status.item() == STUCK:
            self._stuck(p)
        if status.item() == FAILED:
            self._stop_writer()
            with contextlib.suppress(*WRITE_ERRORS):  # every rank's writer has stopped before the clean-up
                p.future.result()
            self.pending = None
            self._fail(p.step, p.tmp, error)
        return status.item() == 1

    def _stuck(self, p: PendingSave) -> None:
        """A write unfinished past stuck_after_s (a network filesystem that stopped answering, a stopped writer)
        would hang the run for good: the agreement answers every second, so no collective times out. Raised
        without touching the run folder, whose disk may hang too: the next start removes the partial folder."""
        self._stop_writer()  # not joined: a process in a stuck write ends only once the write returns
        raise CheckpointError(stuck_text(p.step, time.perf_counter() - p.write_began, self.stuck_after_s,
                                         self.cfg.trainer.nccl_timeout, self.committed, self.run_dir))

    def _agree(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective: raises CheckpointError on every rank if `error` is set on any."""
        status = torch.tensor([int(error is not None)])
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.agree_group)
        if status.item():
            self._fail(step, tmp, error, renamed)

    def _fail(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective, once every rank has stopped writing: rank 0 removes the partial folder and words the
        one message every rank raises."""
        errors = from_every_rank(one_line(error) if error is not None else None, self.agree_group)

        def clean_up() -> None:
            limited = file_at_size_limit(tmp) if os.path.isdir(tmp) else None  # named before the folder goes
            with contextlib.suppress(OSError):
                if os.path.lexists(tmp):
                    remove(tmp)
            raise CheckpointError(not_saved(self.cfg.trainer, self.run_id, step, errors, limited, os.path.lexists(tmp),
                                            renamed, self.last_bytes))

        decided_by_rank0(clean_up, self.agree_group)

    def _commit(self) -> None:
        """After every rank's write: rank 0 writes COMPLETE and renames the folder (the commit),
        then applies retention to this run's checkpoints."""
        p, world = self.pending, self.world
        self.pending = None
        self._writer()  # DCP's writer process, known from its first write on (_stop_writer)
        error, renamed = None, False
        if world.is_main:
            try:
                fsync_tree(p.tmp)  # every rank's small files and DCP's folders, before COMPLETE vouches for them
                size = write_complete(p.tmp)
                fsync_path(p.tmp)
                publish(p.tmp, p.final)  # the commit
                self.last_bytes = size
            except OSError as e:
                error = e
                renamed = os.path.isdir(p.final) and not os.path.lexists(p.tmp)  # publish's rename was done
        self._agree(p.step, p.tmp, error, renamed)
        self.committed = p.final
        if world.is_main:
            enforce_retention(self.run_dir, self.cfg.trainer.max_ckpt_to_keep, self.run_id,
                              delete=lambda path: self.cleaner.submit(shutil.rmtree, hide(path), True))
            write_s = p.future.result()
            self._report(p, self.last_bytes, write_s, time.perf_counter() - p.started)
            self._warn_if_next_will_not_fit()
            self._warn_if_a_stop_would_not_save(write_s)

    def _warn_if_next_will_not_fit(self) -> None:
        free = shutil.disk_usage(self.run_dir).free
        if free < self.last_bytes:
            logging.getLogger("sfttrain").warning(
                f"{self.run_dir} has {size_text(free)} free and a checkpoint takes {size_text(self.last_bytes)}: the "
                "next save will not fit (retention deletes the oldest only after the next commit). Free space now, or "
                "the next save stops the run (it then resumes from the last checkpoint)")

    def _warn_if_a_stop_would_not_save(self, write_s: float) -> None:
        """Once, where a SIGTERM's save would outlast the default grace (sfttrain.stop_signal)."""
        warning = stop_signal.grace_warning(write_s) if self.cfg.trainer.save_on_sigterm else None
        if warning and not self.warned_grace:
            self.warned_grace = True
            logging.getLogger("sfttrain").warning(warning)

    def _report(self, p: PendingSave, size: int, write_s: float, seconds: float) -> None:
        stall = p.stall_s if p.background else seconds
        written = p.written_s or seconds  # None only if its callback has not run yet: it ended just now
        record = {"step": p.step, "event": "checkpoint", "path": p.final, "async": p.background, "bytes": size,
                  "stall_s": stall, "waited_previous_s": p.waited_s, "written_s": written, "write_s": write_s,
                  "commit_s": seconds, "gb_per_s": size / 1e9 / write_s, "awaited": p.awaited}
        waited = f" ({p.waited_s:.2f} s of it for the previous save's write)" if p.waited_s >= 0.01 else ""
        self.report(record, f"checkpoint {os.path.basename(p.final)} committed: {size / 1e9:.3g} GB, training "
                            f"stalled {stall:.2f} s{waited}, written in {write_s:.2f} s ({record['gb_per_s']:.3g} GB/s"
                            f"{', in the background' if p.background else ''}), committed {seconds:.2f} s after "
                            "the save began")


@dataclass
class PendingSave:
    """A save whose write may still be running: committed by `Checkpointer.poll` or `.wait`."""
    step: int
    tmp: str
    final: str
    future: Future  # Checkpointer._write: the write's seconds
    started: float  # perf_counter when save() began
    stall_s: float  # seconds the training loop waited for it (a background write: until it was staged)
    waited_s: float  # of stall_s, the seconds spent waiting for the previous save's write
    background: bool  # written by DCP in the background while training went on
    first: bool  # the first background save to a writer process, which DCP starts first (an interpreter importing torch)
    written_s: Optional[float] = None  # seconds from started until this rank's write finished
    awaited: bool = False  # the training loop waited for its write (Checkpointer.wait)

    @property
    def write_began(self) -> float:
        return self.started + self.stall_s

    def mark_written(self, _future: Future) -> None:
        self.written_s = time.perf_counter() - self.started


class ShardWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter whose file errors fail the rank's write: DCP joins its extra writer threads and
    keeps the results that arrived (torch 2.11-2.13), so a thread that died left its items out of a checkpoint
    that looked whole, and printed its traceback beside the run's message."""

    def write_data(self, plan, planner):
        errors, create = [], self.fs.create_stream

        @contextlib.contextmanager
        def kept(path, mode):
            try:
                with contextlib.ExitStack() as files:
                    try:
                        stream = files.enter_context(create(path, mode))
                    except Exception as e:  # noqa: BLE001 - raised below, in this rank's write
                        errors.append(e)
                        stream = io.BytesIO()  # the file's items written nowhere
                    yield stream
            except Exception as e:  # noqa: BLE001 - as above
                errors.append(e)

        self.fs.create_stream = kept
        try:
            results = super().write_data(plan, planner)
        finally:
            del self.fs.create_stream  # the class's own again
        if errors:
            raise errors[0]
        return results


@contextlib.contextmanager
def _ignored_by_the_writer():
    """What DCP's writer process is spawned with, and keeps: SIGTERM and SIGINT ignored (a SIGTERM to every
    process of the job, or Ctrl-C, leaves it the save in flight that the rank's stop waits for), stderr on
    /dev/null (its errors reach the rank through DCP; it would print DCP's INFO lines per save, and a traceback
    once its rank is gone). It ends with its rank (its pipe closes), at `Checkpointer.close` or at exit."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN), signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stderr.flush()
    stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def _spawned() -> list[multiprocessing.Process]:
    """The rank's spawned processes: DCP's writer is the one sfttrain starts (DataLoader workers fork)."""
    return [p for p in multiprocessing.active_children() if isinstance(p, multiprocessing.context.SpawnProcess)]


def _kill_spawned() -> None:
    for process in _spawned():
        process.kill()


def _finished_within(future: Future, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        future.exception(timeout=seconds)  # waits; the error itself is read by _all_written
    return future.done()


def _attempt(work: Callable[[], None]) -> Optional[BaseException]:
    try:
        work()
    except WRITE_ERRORS as e:  # noqa: BLE001 - reported to every rank by Checkpointer._agree
        return _save_error(e)
    return None


def _save_error(error: BaseException) -> BaseException:
    """A failure of the save, for `Checkpointer._agree` to word as one; a data worker's death that landed in the
    save is raised on (it was worded as the checkpoint not saved, exit code 6, not the worker's, exit code 9)."""
    if data_worker_died(error):
        raise error
    return error


class NotEnoughSpace(OneLineError):
    """A save not started: the free space is below the last checkpoint's size."""


class WriterProcessError(OneLineError):
    """DCP's writer process of a rank ended during a write."""


def _torch_save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
