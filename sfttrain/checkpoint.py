"""Sharded (DCP) checkpoints: the checkpointer (atomic commit, retention of this run's
checkpoints), loading for exact and elastic resume, and each rank's RNG state.

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

The data position is (epoch, samples of that epoch consumed): with the seed it names exactly
which global samples were used, whatever the world size, so a checkpoint written by N ranks
resumes on M (the model and optimizer are resharded by DCP). RNG states are per rank and only
restored when the world size is unchanged (training itself draws no random numbers: the data
order is a function of the seed and the epoch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import STATE_FILE, complete_checkpoints, damaged_error, enforce_retention, fsync_path, \
    fsync_tree, hide, publish, read_state, remove, room_problem, size_text, tree_bytes, what_auto_does, \
    write_complete, write_synced
from sfttrain.config import Config, ConfigError, to_yaml
from sfttrain.distributed import World, peer_lost
from sfttrain.errors import CheckpointError, data_worker_died
from sfttrain.fs_faults import SIZE_LIMIT_FIX, disk_full_text, fault, file_at_size_limit, folder_gone, over_size_limit
from sfttrain.metrics import rewind_metrics
from sfttrain.optim import set_step

# frozen weights (LoRA's base) are model.partial_pretrain's, unchanged: a checkpoint holds what
# training changes, the trainable weights and their optimizer state (full fine-tuning: everything).
# Not strict: loading sets the trainable weights only; check_same_model has matched their names.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
# what a failed write raises: DCP's CheckpointException (every rank's error) is a BaseException
WRITE_ERRORS = (Exception, CheckpointException)
# a rank's state of the save in flight, as the ranks agree on it (the minimum wins): failed, stuck
# (unfinished past `Checkpointer.stuck_after_s`), still writing, written
FAILED, STUCK = -2, -1
# a write is taken for stuck only past trainer.nccl_timeout and past its rank's share of the checkpoint
# at this rate: a large checkpoint on slow storage (one GPU's 8B model and AdamW state, 96 GB, on a
# 50 MB/s NFS: 32 minutes) is slow, not stuck
SLOWEST_WRITE_BYTES_PER_S = 20e6


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position: the epoch being read ...
    consumed_in_epoch: int = 0  # ... and how many of its samples (in the seeded order) were used
    global_batch: int = 0
    seed: int = 0
    wandb_id: Optional[str] = None
    data: Optional[dict] = None  # the data fingerprint (sfttrain.data.fingerprint)
    schedule: Optional[dict] = None  # the optimizer and LR schedule settings (sfttrain.optim.schedule_settings)
    run_id: Optional[str] = None  # the run these checkpoints belong to (sfttrain.resume)
    base: Optional[dict] = None  # LoRA: the base and the adapter settings they are trained with (lora.trained_identity)

    def advance(self, batch) -> None:
        self.step += 1
        self.epoch, self.consumed_in_epoch = batch.epoch, batch.consumed_in_epoch


class Checkpointer:
    """Writes `global_step_N` checkpoints of one run (`run_id`). With trainer.async_save a periodic
    save is DCP's async_save: it returns once DCP's stager has copied this rank's shard to host
    memory (on CUDA page-locked with trainer.async_save_pinned, allocated at the first save and
    reused), and DCP writes it while training goes on, in a writer process of the rank's own
    (trainer.async_save_writer; a thread of the rank shares the GIL that kernel launches need). It
    commits at the first step boundary where every rank's write has finished (`poll`). One save is in
    flight at a time (DCP's stager keeps one host copy of each tensor): a save due before the last
    one is written waits for it. The final save is written in the training process and waited for.
    Retention keeps this run's newest trainer.max_ckpt_to_keep; the deletions run on a thread of their own.

    Per committed checkpoint, `report(record, line)` gets its size on disk and, counted from the
    save's start, the seconds the training loop was stalled (of them, the seconds waiting for the
    previous save's write), the seconds until this rank's write had finished, the write's own seconds
    and GB/s, the seconds until the commit, and whether the loop had to wait for it (`awaited`: a
    final save, the next save, a stop or a non-finite step found it still in flight)."""

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
        problem = None
        if self.world.is_main:
            need = self.last_bytes or estimated_bytes(self.model)
            problem = room_problem(self.run_dir, shutil.disk_usage(self.run_dir).free, need, not self.last_bytes)
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise ConfigError(box[0])

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
            model_sd, optim_sd = _state_dicts(self.model, self.optimizer)
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
        writer = dcp.FileSystemWriter(tmp, thread_count=self.cfg.trainer.save_thread_count)
        starts = self.kind == AsyncCheckpointerType.PROCESS and self._writer() is None
        with _ignored_by_the_writer() if starts else contextlib.nullcontext():
            future = dcp.async_save(shards, storage_writer=writer, process_group=self.write_group,
                                    async_checkpointer_type=self.kind, async_stager=self.stager)
            while starts and not _spawned() and not future.done():  # DCP's thread spawns it: at once
                time.sleep(0.001)
        return future

    def poll(self) -> None:
        """Commits the save in flight once every rank has finished writing it. Collective, after every
        step; one tiny gloo all-reduce per call while a save is in flight, nothing otherwise."""
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
        """Waits for retention's deletions (the next start would delete what is left of them) and ends
        DCP's writer process (it ignores SIGTERM: `_ignored_by_the_writer`)."""
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
        """The save's small files, taken now (the RNG state and the step's position change with the
        next step) and written by the writer thread: their fsyncs would stall training behind the
        disk's queue of earlier writes."""
        world = self.world
        files: dict[str, Any] = {os.path.join("rng", f"rank_{world.rank}.pt"): _rng_state()}
        if world.is_main:
            extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size}
            files[STATE_FILE] = json.dumps(extra, indent=1)
            files["config.yaml"] = self.config_yaml
        return files

    def _write(self, shards: dict | Future, tmp: str, small_files: dict[str, Any], began: float) -> float:
        """The writer thread: the small files (each fsynced), rank 0's model config and tokenizer (hf/),
        then the shards: DCP's write here (a final or synchronous save), or the wait for DCP's background
        write. Rank 0 checks that DCP wrote every item it planned. Returns the write's seconds."""
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
            metadata = shards.result()
        else:
            writer = dcp.FileSystemWriter(tmp, thread_count=self.cfg.trainer.save_thread_count)
            metadata = dcp.save(shards, storage_writer=writer, process_group=self.write_group)
        if self.world.is_main:
            check_every_item_written(metadata)
        return time.perf_counter() - began

    def _fall_back_if_writer_lost(self) -> None:
        """Collective, before a background save: a writer process that ended since the last save (the host's
        out-of-memory killer, a stray kill) would fail this save and lose every step since the last one. DCP
        starts its writer once per process, so every rank's background saves go to a thread from now on (the
        writers of all ranks form one group: a live one would wait for the lost one)."""
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
        """Ends DCP's writer process at once (a save failed somewhere, or is stuck: a rank's write cannot
        finish without every rank's); the write it was running fails."""
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
        """A write that every rank has not finished within stuck_after_s of its start is stuck (a network
        filesystem that stopped answering, a writer process stopped): waiting on would hang the run for good,
        each rank's agreement above answering every second, so no collective times out. Raised on every rank
        without touching the run folder, whose disk may be what hangs (a listing or a removal would hang
        too): the next start removes the partial folder."""
        self._stop_writer()  # not joined: a process in a stuck write ends only once the write returns
        then = what_auto_does(self.committed, " of this run")
        raise CheckpointError(
            f"the checkpoint of step {p.step} was not saved: its write has not finished "
            f"{time.perf_counter() - p.write_began:.0f} s after it began (the longest a write may take here: "
            f"{self.stuck_after_s:.0f} s, the larger of trainer.nccl_timeout={self.cfg.trainer.nccl_timeout} and a "
            f"rank's share of the checkpoint at {SLOWEST_WRITE_BYTES_PER_S / 1e6:.0f} MB/s): it is stuck, e.g. on a network filesystem that stopped "
            f"answering or in a checkpoint writer process that was stopped. Nothing of it was committed; the last "
            f"good checkpoint is {self.committed or 'none'}. Check that {self.run_dir} answers (ls, df), then run the same command: with "
            f"trainer.resume_mode=auto {then}. A write that is only slow needs a larger trainer.nccl_timeout")

    def _agree(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective: raises CheckpointError on every rank if `error` is set on any."""
        status = torch.tensor([int(error is not None)])
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.agree_group)
        if status.item():
            self._fail(step, tmp, error, renamed)

    def _fail(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective, once every rank has stopped writing: rank 0 removes the partial folder and words the
        one message every rank raises."""
        errors = [None] * self.world.world_size
        dist.all_gather_object(errors, one_line(error) if error is not None else None, group=self.agree_group)
        box = [None]
        if self.world.is_main:
            limited = file_at_size_limit(tmp) if os.path.isdir(tmp) else None  # named before the folder goes
            with contextlib.suppress(OSError):
                if os.path.lexists(tmp):
                    remove(tmp)
            box[0] = self._not_saved(step, errors, limited, os.path.lexists(tmp), renamed)
        dist.broadcast_object_list(box, src=0, group=self.agree_group)
        raise CheckpointError(box[0])

    def _not_saved(self, step: int, errors: list[Optional[str]], limited: Optional[str], left: bool,
                   renamed: bool) -> str:
        """What failed, what is left, and what to do (`limited`: a file of the save at the file size limit;
        `left`: its partial folder could not be removed, on a disk turned read-only, say; `renamed`: the commit
        failed after its rename, whose fsync a failing disk refused: the folder is whole, its name may not last)."""
        if gone := folder_gone(self.run_dir):  # and its checkpoints and free space with it
            return f"the checkpoint of step {step} was not saved: {gone}"
        own = [(s, path) for s, path in complete_checkpoints(self.run_dir, self.run_id) if not (renamed and s == step)]
        last = own[-1][1] if own else None
        why, fix = self._why_not_saved(errors, limited, last)
        then = what_auto_does(last, " of this run")
        if renamed:
            final = os.path.join(self.run_dir, f"global_step_{step}")
            return (f"the checkpoint of step {step} may not be saved: {why}, in its commit, once its files were on the "
                    f"disk and its folder renamed to {final}: whether the rename reached the disk is not known. The last "
                    f"good checkpoint before it is {last or 'none'}. {fix}, then run the same command: with "
                    f"trainer.resume_mode=auto it resumes from {final} where it is there (whole), else {then}")
        partial = (f"its partial folder .global_step_{step}.tmp is left, and the next start deletes it" if left
                   else "its partial folder was removed")
        return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed ({partial}); "
                f"the last good checkpoint is {last or 'none'}. {fix}, then run the same command: with "
                f"trainer.resume_mode=auto {then}")

    def _why_not_saved(self, errors: list[Optional[str]], limited: Optional[str],
                       last: Optional[str]) -> tuple[str, str]:
        """(the failure in words, what to do): the file size limit, a full disk and how much space there
        is, another fault of a filesystem (sfttrain.fs_faults), or any other error."""
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        # a rank that lost a peer inside a collective reports only that: the cause is the peer's error
        causes = [(rank, text) for rank, text in failed if not peer_lost(text)] or failed
        full = [(rank, text) for rank, text in causes if _disk_full(text)]
        rank, text = (full or causes)[0]
        if limited or over_size_limit(text):  # the disk may have room: a file met the limit (EFBIG)
            return (f"the file size limit (ulimit -f) was reached ({f'{limited}: ' if limited else ''}{text}, on rank "
                    f"{rank})"), SIZE_LIMIT_FIX
        found = fault(text, self.run_dir)
        if found is not None and not (full and found.in_run_folder):  # not the run folder's disk filling
            return f"{found.cause}, on rank {rank}", found.fix  # read-only, denied, open files, another disk full
        why = (f"the disk is full ({text}, on rank {rank})" if full
               else f"{text} (rank {rank}{f' and {len(failed) - 1} other ranks' if len(failed) > 1 else ''})")
        if not (full or NOT_STARTED in text):
            return why, "Fix what the error names"
        size = self.last_bytes or (tree_bytes(last) if last else None)
        keep = self.cfg.trainer.max_ckpt_to_keep
        space = f"{self.run_dir} has {size_text(shutil.disk_usage(self.run_dir).free)} free" + \
            (f"; a checkpoint takes {size_text(size)}" if size else "") + \
            (f" (max_ckpt_to_keep={keep} needs room for {keep + 1}: the oldest is deleted after the next commit)"
             if keep and size else "")
        return why, (f"{space}. Free space (or set trainer.default_local_dir on a larger disk, or lower "
                     "trainer.max_ckpt_to_keep)")

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


def estimated_bytes(model) -> int:
    """A checkpoint's size before the first is written: each trained weight under each of its names
    (a tied weight is saved under both) and AdamW's two moments of each, in the weight's dtype; a
    DTensor whole (its shape is global: DCP writes each element once). DCP's own overhead (a few KB
    per tensor) and the small files are left out."""
    named = model.state_dict(keep_vars=True)
    trained = [t for t in named.values() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    unique = {id(t): t for t in trained}.values()
    return sum(t.numel() * t.element_size() for t in trained) + 2 * sum(t.numel() * t.element_size() for t in unique)


def check_every_item_written(metadata: Metadata) -> None:
    """DCP's FileSystemWriter does not notice when one of its extra writer threads dies (torch 2.11-2.13
    join them and keep the results that arrived): the checkpoint's metadata then lacks that thread's
    items. Such a save fails instead of being committed without them."""
    planned = sum(len(md.chunks) if hasattr(md, "chunks") else 1 for md in metadata.state_dict_metadata.values())
    if len(metadata.storage_data) < planned:
        raise OSError(f"DCP wrote {len(metadata.storage_data)} of the {planned} items of the checkpoint (a writer "
                      "thread of trainer.save_thread_count failed; its error is printed above)")


@contextlib.contextmanager
def _ignored_by_the_writer():
    """SIGTERM and SIGINT ignored while DCP spawns its writer process, which keeps what it is spawned
    with: a SIGTERM sent to every process of the job (Slurm at its time limit) or a terminal's Ctrl-C
    leaves it the save in flight that the rank's stop waits for. It ends with its rank (its pipe
    closes, or `end_helpers`), at `Checkpointer.close`, or at the interpreter's exit."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN), signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
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


def one_line(error: BaseException) -> str:
    """An exception as one line: DCP's CheckpointException holds every rank's traceback; its last
    line names the cause."""
    if isinstance(error, OneLineError):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    full = [line for line in lines if "No space left" in line]  # the cause, beside the zip writer's symptom
    if full:
        return full[-1][:300]
    text = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"
    return text[:300]


class OneLineError(OSError):
    """An error already worded as one line (`one_line` keeps it as it is)."""


class WriterProcessError(OneLineError):
    """DCP's writer process of a rank ended during a write."""


NOT_STARTED = "so it was not started"  # how NotEnoughSpace's message ends


class NotEnoughSpace(OneLineError):
    """A save not started: the free space is below the last checkpoint's size."""


def _disk_full(text: str) -> bool:
    # ENOSPC, or the torch.save writer's symptom of it ("unexpected pos" in inline_container.cc)
    return disk_full_text(text) or "unexpected pos" in text


def load(path: str, model, optimizer, scheduler, world: World, cfg: Config, current: TrainState) -> TrainState:
    """Collective. Restores model, optimizer and (same world size only) RNG states, puts the
    optimizer and LR schedule at the checkpoint's step with the current config's settings
    (sfttrain.optim.set_step; see check_resume), and returns `current` at the checkpoint's step
    and data position. Rank 0 then rewinds the run folder's metrics.jsonl to the loaded step."""
    extra = read_state(path)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    check_same_model(path, model_sd)
    with read_back(path):
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=STATE_DICT_OPTIONS)
    del model_sd, optim_sd
    set_step(optimizer, scheduler, cfg.optim, current.schedule["total steps"], extra["step"])
    if extra["world_size"] == world.world_size and (rng := _read_rng_states(path, world)):  # per-rank: only 1:1
        _set_rng_state(rng)
    state = dataclasses.replace(current, step=extra["step"], epoch=extra["epoch"],
                                consumed_in_epoch=extra["consumed_in_epoch"], wandb_id=extra["wandb_id"])
    if world.is_main:
        run_dir = cfg.trainer.default_local_dir
        rewind_metrics(run_dir, state.step,
                       {"step": state.step, "event": "resumed", "from": os.path.abspath(path),
                        "saved_world_size": extra["world_size"], "world_size": world.world_size},
                       own=os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(run_dir))
    return state


# what torch.load and DCP's metadata reader raise on a file that does not read back
UNREADABLE = (OSError, RuntimeError, EOFError, pickle.UnpicklingError)


@contextlib.contextmanager
def read_back(path: str):
    """DCP's reads of a checkpoint whose files do not read back (of the sizes its COMPLETE lists, yet
    changed: check_intact passed) end with the damaged-checkpoint error, not a traceback (the resume,
    and sfttrain.export). DCP gathers every rank's read failures and raises them on all ranks at once."""
    try:
        yield
    except CheckpointException as e:
        if e.args[0] != "read":  # a failure of DCP's planning, not of the files
            raise
        causes = sorted({_first_sentence(exc) for exc, _ in e.failures.values()})
        raise damaged_error(path, f"its shards do not read back ({'; '.join(causes)})") from None


def _read_file(path: str, read: Callable[[], Any]) -> Any:
    """One file of the checkpoint at `path` that every rank reads alike (DCP's .metadata): a file that
    does not read back is the damaged-checkpoint error."""
    try:
        return read()
    except UNREADABLE as e:
        raise damaged_error(path, f"it does not read back ({_first_sentence(e)})") from None


def _read_rng_states(path: str, world: World) -> Optional[dict]:
    """Collective: this rank's RNG states from the checkpoint (None where it has no such file, as
    in a checkpoint of an older sfttrain). A file that does not read back on any rank is the
    damaged-checkpoint error on every rank at once (a rank that failed alone would leave the others
    waiting in the next collective)."""
    state, error = None, None
    file = os.path.join(path, "rng", f"rank_{world.rank}.pt")
    try:
        state = torch.load(file, weights_only=True) if os.path.isfile(file) else None
    except UNREADABLE as e:
        error = f"rank {world.rank}'s RNG file: {_first_sentence(e)}"
    errors = [None] * world.world_size
    dist.all_gather_object(errors, error)
    if any(errors):
        raise damaged_error(path, f"it does not read back ({'; '.join(e for e in errors if e)})")
    return state


def _first_sentence(error: BaseException) -> str:
    return one_line(error).split(". ")[0]  # torch's zip reader goes on for 200 characters of guesses


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts, frozen weights left out."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    return _trained(model, model_sd), optim_sd


def trained_state_dict(model) -> dict:
    """The model's part of a checkpoint (the preflight's, of the model built on the meta device)."""
    return _trained(model, get_model_state_dict(model, options=STATE_DICT_OPTIONS))


def _trained(model, model_sd: dict) -> dict:
    """ignore_frozen_params alone keeps a frozen weight tied to another (LoRA's lm_head.weight, which
    named_parameters skips as a duplicate of the embedding): such names are dropped here."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def check_same_model(path: str, model_sd: dict) -> None:
    """A checkpoint of another model fails here with names and shapes, not deep inside DCP (and in the
    preflight, against the model built on the meta device)."""
    metadata = _read_file(path, dcp.FileSystemReader(path).read_metadata)
    stored = {k[len("model."):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(stored))
    extra = sorted(set(stored) - set(model_sd))  # e.g. adapters on other layers (model.target_modules)
    shapes = [f"{k}: checkpoint {tuple(stored[k].size)} vs model {tuple(v.shape)}" for k, v in model_sd.items()
              if k in stored and hasattr(stored[k], "size") and tuple(stored[k].size) != tuple(v.shape)]
    if missing or extra or shapes:
        raise ConfigError(f"{path} was written for another model than model.partial_pretrain (or another "
                          f"LoRA setup: model.lora_rank, model.target_modules): {len(missing)} weights missing {missing[:5]}, "
                          f"{len(extra)} not in this model {extra[:5]}, {len(shapes)} of other shapes {shapes[:3]}. "
                          "Resume with the same model and LoRA keys, or use trainer.resume_mode=disable (or a new "
                          "trainer.default_local_dir) to start afresh")


def _rng_state() -> dict:
    """Every RNG's state as tensors, ints and lists only, so that it loads with
    torch.load(weights_only=True): a checkpoint file is never unpickled (a pickle can run code)."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt_state), gauss], "numpy": [name, torch.from_numpy(keys.astype(np.int64)),
                                                                    pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _torch_save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
