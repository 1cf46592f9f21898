"""Sharded (DCP) checkpoints: the checkpointer (atomic commit, retention of this run's
checkpoints), loading for exact and elastic resume, and each rank's RNG state.

Layout of `<run>/global_step_N/`:
  .metadata, __*.distcp   model + optimizer, sharded (torch.distributed.checkpoint), reshardable
  trainer_state.json      step, data position, data fingerprint, optimizer/LR settings, wandb id, world size,
                          run id (sfttrain.resume), LoRA base identity (sfttrain.lora.base_identity)
  rng/rank_R.pt           each rank's RNG states
  config.yaml             the resolved run config
  hf/                     the model's config, generation config and tokenizer (for export)
  huggingface/            with trainer.save_hf, on the final checkpoint: the exported HF model (written after
                          the commit, sfttrain.export.into_checkpoint)
  COMPLETE                written last; only folders with it are ever resumed from

Commit protocol: every rank writes into `.global_step_N.tmp`; once every rank's write has finished
(all ranks agree on it: at once, or with trainer.async_save at a later step boundary, the write
having run in a background thread while training went on) rank 0 writes COMPLETE, fsyncs, and
renames the folder to `global_step_N` (sfttrain.checkpoint_folder.publish, which also replaces an
older save of the same step without a moment where neither is committed). A crash at any moment
leaves a `.tmp` folder at worst, which the next start deletes. A save that fails on any rank (a
full disk) ends every rank with one CheckpointError: the partial folder removed, the last good
checkpoint and the free space named.

The data position is (epoch, samples of that epoch consumed): with the seed it names exactly
which global samples were used, whatever the world size, so a checkpoint written by N ranks
resumes on M (the model and optimizer are resharded by DCP). RNG states are per rank and only
restored when the world size is unchanged (training itself draws no random numbers: the data
order is a function of the seed and the epoch).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sfttrain.checkpoint_folder import COMPLETE, STATE_FILE, complete_checkpoints, enforce_retention, fsync_dir, \
    fsync_tree, hide, publish, read_state, remove, tree_bytes, write_synced
from sfttrain.config import Config, ConfigError, to_yaml
from sfttrain.distributed import World
from sfttrain.errors import CheckpointError
from sfttrain.metrics import rewind_metrics
from sfttrain.optim import set_step

# frozen weights (LoRA's base) are model.partial_pretrain's, unchanged: a checkpoint holds what
# training changes, the trainable weights and their optimizer state (full fine-tuning: everything).
# Not strict: loading sets the trainable weights only; _check_same_model has matched their names.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
# what a failed write raises: DCP's CheckpointException (every rank's error) is a BaseException
WRITE_ERRORS = (Exception, CheckpointException)


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
    base: Optional[dict] = None  # LoRA: the base model the adapters are trained on (sfttrain.lora.base_identity)

    def advance(self, batch) -> None:
        self.step += 1
        self.epoch, self.consumed_in_epoch = batch.epoch, batch.consumed_in_epoch


class Checkpointer:
    """Writes `global_step_N` checkpoints of one run (`run_id`). With trainer.async_save, a periodic
    save returns once this rank's shard is copied to host memory (with trainer.async_save_pinned on
    CUDA: into pinned host buffers allocated at the first saves and reused by the later ones); one
    writer thread per rank then writes the saves in order (DCP, trainer.save_thread_count threads
    per file set) while training goes on, and each is committed at the first step boundary where
    every rank's write has finished (`poll`). Up to trainer.async_save_in_flight saves are staged or
    being written at once, each holding a host copy of this rank's shard: saves that come faster
    than the disk writes them queue there, and a save finding the queue full waits for the oldest.
    The final save waits for every write (nothing is left in flight when training ends). Retention
    keeps this run's newest trainer.max_ckpt_to_keep; the deletions run on a thread of their own.

    Per committed checkpoint, `report(record, line)` gets its size on disk and, counted from the
    save's start, the seconds the training loop was stalled (of them, the seconds waiting for an
    older save's write to free a place), the seconds until every rank's write had finished (DCP's
    last step on rank 0 waits for all ranks), the write's own seconds and GB/s (from when the writer
    thread took it up), and the seconds until the commit (at a step boundary)."""

    def __init__(self, run_dir: str, world: World, cfg: Config, run_id: str, report: Callable[[dict, str], None]):
        self.run_dir, self.world, self.cfg, self.run_id, self.report = run_dir, world, cfg, run_id, report
        self.pending: collections.deque[PendingSave] = collections.deque()  # oldest first
        own = complete_checkpoints(run_dir, run_id)
        self.last_bytes = tree_bytes(own[-1][1]) if own and world.is_main else None  # rank 0's space check
        # DCP's writes run collectives of their own (on the writer thread); the main thread's agreement
        # on "every rank has written" must not interleave with them, so each gets its own gloo group
        # (async_save needs a CPU backend also when training runs on nccl; gloo calls on host
        # tensors never wait for the GPU)
        timeout = datetime.timedelta(seconds=cfg.trainer.nccl_timeout)
        self.write_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agree_group = dist.new_group(backend="gloo", timeout=timeout)
        self.staging = Staging(cfg, world) if cfg.trainer.async_save else None
        # saves that may be in flight at once: trainer.async_save_in_flight, or fewer where host memory
        # holds fewer copies of the shards (agreed by all ranks at the first background save)
        self.slots, self.slots_agreed = cfg.trainer.async_save_in_flight, False
        self.thread_errors = WriterThreadErrors()
        # one writer: every rank writes its saves in the same order, so DCP's collectives pair up
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self.cleaner = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")  # retention's deletions

    def save(self, state: TrainState, model, optimizer, tokenizer, wandb_id: Optional[str] = None,
             final: bool = False) -> None:
        """Collective: every rank calls it. Raises CheckpointError on every rank if any rank could
        not write its part (nothing is committed then)."""
        started = time.perf_counter()
        background = self.cfg.trainer.async_save and not final
        room = self.slots - 1 if background else 0
        while len(self.pending) > room:  # a full queue (or a final save) waits for the oldest write
            self._wait_oldest()
        waited = time.perf_counter() - started
        tmp = os.path.join(self.run_dir, f".global_step_{state.step}.tmp")
        self._agree(state.step, tmp, _attempt(lambda: self._prepare(tmp)))
        (future, slot), error = (None, None), None
        try:
            future, slot = self._start_write(tmp, state, model, optimizer, tokenizer, wandb_id, background)
        except WRITE_ERRORS as e:  # noqa: BLE001 - any failure of any rank is agreed on below
            error = e
        self._agree(state.step, tmp, error, future)
        self.pending.append(PendingSave(state.step, tmp, os.path.join(self.run_dir, f"global_step_{state.step}"),
                                        future, slot, started, time.perf_counter() - started, waited, background))
        future.add_done_callback(self.pending[-1].mark_written)
        if background and not self.slots_agreed:
            self._agree_slots()
        if not background:
            self.wait()

    def poll(self) -> None:
        """Commits, oldest first, the saves in flight that every rank has finished writing.
        Collective; one tiny gloo all-reduce per call while a save is in flight, nothing otherwise."""
        while self.pending and self._all_written(self.pending[0].future.done()):
            self._commit()

    def wait(self) -> None:
        """Collective: waits for every save in flight and commits them."""
        while self.pending:
            self._wait_oldest()

    def close(self) -> None:
        """Waits for retention's deletions (the next start would delete what is left of them)."""
        self.cleaner.shutdown(wait=True)
        self.writer.shutdown(wait=True)

    def _agree_slots(self) -> None:
        """Collective, after the first background save has staged: as many saves in flight as every
        node's available memory holds host copies of its ranks' shards beside the first (at most
        trainer.async_save_in_flight); then the pinned slots' buffers are allocated in the background."""
        copy = self.staging.copy_bytes
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        available = host_memory_available()
        # one copy's worth kept free: allocating a pinned slot briefly needs two (DCP copies, then pins)
        fit = available // max(copy * local_ranks, 1) - 1
        more = torch.tensor([max(0, min(self.slots - 1, fit))])
        dist.all_reduce(more, op=dist.ReduceOp.MIN, group=self.agree_group)
        wanted, self.slots, self.slots_agreed = self.slots, 1 + int(more.item()), True
        if self.slots < wanted and self.world.is_main:
            logging.getLogger("sfttrain").warning(
                f"trainer.async_save_in_flight={wanted}, but host memory holds {self.slots}: a host copy of a rank's "
                f"shard takes {_gb(copy)} ({local_ranks} ranks per node) and {_gb(available)} are "
                f"available. At most {self.slots} saves will be in flight; a save finding them all in flight "
                "waits for the oldest write")
        self.staging.allocate(self.slots)

    def _wait_oldest(self) -> None:
        with contextlib.suppress(*WRITE_ERRORS):  # _all_written reports it on every rank
            self.pending[0].future.result()
        self._all_written(True)
        self._commit()

    def _prepare(self, tmp: str) -> None:
        """Rank 0: a fresh `tmp` folder, once the free space can take a checkpoint of the last one's size."""
        if not self.world.is_main:
            return
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
        free = shutil.disk_usage(self.run_dir).free
        if self.last_bytes and free < self.last_bytes:
            raise NotEnoughSpace(f"it needs about {_gb(self.last_bytes)} (the size of the last checkpoint) and "
                          f"{self.run_dir} has {_gb(free)} free, so it was not started")
        os.makedirs(os.path.join(tmp, "rng"))

    def _start_write(self, tmp: str, state: TrainState, model, optimizer, tokenizer,
                     wandb_id: Optional[str], background: bool) -> tuple[Future, int]:
        """Every rank writes into `tmp`: the small files here, the model and optimizer shard on the
        writer thread (from a host copy if background). Returns the write's future and its staging slot."""
        world, cfg = self.world, self.cfg
        model_sd, optim_sd = _state_dicts(model, optimizer)
        state_dict, slot = {"model": model_sd, "optim": optim_sd}, None
        if background:
            # a host copy the next optimizer steps cannot change, taken before save() returns
            state_dict, slot = self.staging.stage(state_dict, busy={p.slot for p in self.pending})
        written = self.writer.submit(self._write, state_dict, tmp)
        del model_sd, optim_sd, state_dict
        _torch_save_synced(_rng_state(), os.path.join(tmp, "rng", f"rank_{world.rank}.pt"))
        if world.is_main:
            extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size}
            write_synced(os.path.join(tmp, STATE_FILE), json.dumps(extra, indent=1))
            write_synced(os.path.join(tmp, "config.yaml"), to_yaml(cfg))
            hf = os.path.join(tmp, "hf")
            model.config.save_pretrained(hf)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(hf)
            tokenizer.save_pretrained(hf)
        return written, slot

    def _write(self, state_dict: dict, tmp: str) -> tuple[Optional[int], float]:
        """The writer thread: this rank's DCP write into `tmp`; rank 0 then fsyncs what DCP does not,
        so COMPLETE never reaches the disk before what it vouches for. Returns the checkpoint's size
        (rank 0; None elsewhere) and the write's seconds."""
        started = time.perf_counter()
        self.thread_errors.clear()
        writer = dcp.FileSystemWriter(tmp, thread_count=self.cfg.trainer.save_thread_count)
        dcp.save(state_dict, storage_writer=writer, process_group=self.write_group)
        self.thread_errors.raise_first()
        if not self.world.is_main:
            return None, time.perf_counter() - started
        fsync_tree(tmp)
        return tree_bytes(tmp), time.perf_counter() - started

    def _all_written(self, done: bool) -> bool:
        """True when every rank's write of the oldest save in flight has finished (each rank's
        shard, RNG file and, on rank 0, DCP's metadata are then on disk); a write that failed on any
        rank fails every rank."""
        future = self.pending[0].future
        error = future.exception() if done else None
        status = torch.tensor([-1 if error is not None else int(done)])
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.agree_group)
        if status.item() < 0:
            with contextlib.suppress(*WRITE_ERRORS):  # every rank's writer has stopped before the clean-up
                future.result()
            failed = self.pending.popleft()
            self._fail(failed.step, failed.tmp, error)
        return status.item() == 1

    def _agree(self, step: int, tmp: str, error: Optional[BaseException], writing: Optional[Future] = None) -> None:
        """Collective: raises CheckpointError on every rank if `error` is set on any (once this
        rank's write in flight, if any, has stopped)."""
        status = torch.tensor([int(error is not None)])
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.agree_group)
        if status.item():
            if writing is not None:
                with contextlib.suppress(*WRITE_ERRORS):
                    writing.result()
            self._fail(step, tmp, error)

    def _fail(self, step: int, tmp: str, error: Optional[BaseException]) -> None:
        """Collective, once every rank has stopped writing: rank 0 removes the partial folder and
        words the one message every rank raises. Later saves still queued are not started (their
        `.tmp` folders are deleted at the next start)."""
        for later in self.pending:
            later.future.cancel()
        errors = [None] * self.world.world_size
        dist.all_gather_object(errors, _one_line(error) if error is not None else None, group=self.agree_group)
        box = [None]
        if self.world.is_main:
            with contextlib.suppress(OSError):
                if os.path.lexists(tmp):
                    remove(tmp)
            box[0] = self._not_saved(step, errors)
        dist.broadcast_object_list(box, src=0, group=self.agree_group)
        raise CheckpointError(box[0])

    def _not_saved(self, step: int, errors: list[Optional[str]]) -> str:
        """What failed, what is left, how much space there is, and what to do."""
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        full = any(_disk_full(text) for _, text in failed)
        rank, text = failed[0]
        why = (f"the disk is full ({text}, on rank {rank})" if full
               else f"{text} (rank {rank}{f' and {len(failed) - 1} other ranks' if len(failed) > 1 else ''})")
        own = complete_checkpoints(self.run_dir, self.run_id)
        last = own[-1][1] if own else None
        size = self.last_bytes or (tree_bytes(last) if last else None)
        free = shutil.disk_usage(self.run_dir).free
        keep = self.cfg.trainer.max_ckpt_to_keep
        space = f"{self.run_dir} has {_gb(free)} free" + (f"; a checkpoint takes {_gb(size)}" if size else "") + \
            (f" (max_ckpt_to_keep={keep} needs room for {keep + 1}: the oldest is deleted after the next commit)"
             if keep and size else "")
        then = f"it resumes from {last}" if last else "no checkpoint of this run was committed yet, so it starts afresh"
        return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed (its partial "
                f"folder was removed); the last good checkpoint is {last or 'none'}. {space}. Free space (or set "
                "trainer.default_local_dir on a larger disk, or lower trainer.max_ckpt_to_keep), then run the same "
                f"command: with trainer.resume_mode=auto {then}")

    def _commit(self) -> None:
        """After every rank's write: rank 0 writes COMPLETE and renames the folder (the commit),
        then applies retention to this run's checkpoints."""
        p, world = self.pending.popleft(), self.world
        error = None
        if world.is_main:
            try:
                write_synced(os.path.join(p.tmp, COMPLETE), "")
                fsync_dir(p.tmp)
                publish(p.tmp, p.final)  # the commit
                self.last_bytes = p.future.result()[0]
            except OSError as e:
                error = e
        self._agree(p.step, p.tmp, error)
        if world.is_main:
            enforce_retention(self.run_dir, self.cfg.trainer.max_ckpt_to_keep, self.run_id,
                              delete=lambda path: self.cleaner.submit(shutil.rmtree, hide(path), True))
            self._report(p, self.last_bytes, p.future.result()[1], time.perf_counter() - p.started)
            self._warn_if_next_will_not_fit()

    def _warn_if_next_will_not_fit(self) -> None:
        free = shutil.disk_usage(self.run_dir).free
        if free < self.last_bytes:
            logging.getLogger("sfttrain").warning(
                f"{self.run_dir} has {_gb(free)} free and a checkpoint takes {_gb(self.last_bytes)}: the next save "
                "will not fit (retention deletes the oldest only after the next commit). Free space now, or the "
                "next save stops the run (it then resumes from the last checkpoint)")

    def _report(self, p: PendingSave, size: int, write_s: float, seconds: float) -> None:
        stall = p.stall_s if p.background else seconds
        written = p.written_s or seconds  # None only if its callback has not run yet: it ended just now
        record = {"step": p.step, "event": "checkpoint", "path": p.final, "async": p.background, "bytes": size,
                  "stall_s": stall, "waited_previous_s": p.waited_s, "written_s": written, "write_s": write_s,
                  "commit_s": seconds, "gb_per_s": size / 1e9 / write_s}
        waited = f" ({p.waited_s:.2f} s of it for older saves' writes)" if p.waited_s >= 0.01 else ""
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
    future: Future  # the write and its fsyncs: (the checkpoint's size in bytes on rank 0, the write's seconds)
    slot: Optional[int]  # the staging slot holding its host copy (Staging; None: not staged)
    started: float  # perf_counter when save() began
    stall_s: float  # seconds the training loop waited for it (a background write: until it was staged)
    waited_s: float  # of stall_s, the seconds spent waiting for older saves' writes to free a place
    background: bool  # written by DCP's thread while training went on
    written_s: Optional[float] = None  # seconds from started until this rank's write finished

    def mark_written(self, _future: Future) -> None:
        self.written_s = time.perf_counter() - self.started


class Staging:
    """The host copies of async saves: one slot per save that may be in flight. With
    trainer.async_save_pinned on CUDA each slot keeps pinned buffers, reused by every later save in
    it (the device-to-host copy at full PCIe speed, no allocation per save). Allocating them is
    slow (seconds per GB on an H200 host, page locking), so the first save's slot is allocated when
    it stages and the other slots (as many as host memory holds: Checkpointer._agree_slots) right
    after, on a thread of their own, while training goes on.
    Otherwise (pinned memory needs an accelerator) each save gets a fresh host copy, freed once written."""

    def __init__(self, cfg: Config, world: World):
        self.pinned = cfg.trainer.async_save_pinned and world.device.type == "cuda"
        self.stagers: dict[int, BlockingAsyncStager] = {}  # slot -> its stager, made at its first use
        self.allocating: dict[int, Future] = {}  # slot -> its buffers' allocation, until it is first used
        self.allocator = ThreadPoolExecutor(1, thread_name_prefix="ckpt-pin")
        self.first: Optional[dict] = None  # pinned: the first host copy (slot 0), the shape of the others
        self.copy_bytes = 0  # the bytes of one host copy

    def stage(self, state_dict: dict, busy: set) -> tuple[dict, int]:
        """A host copy of `state_dict` in a slot not in `busy` (the slots of saves in flight)."""
        slot = min(set(range(len(busy) + 1)) - busy)
        if slot in self.allocating:
            self.allocating.pop(slot).result()  # its buffers are still being allocated
        staged = self.stager(slot).stage(state_dict)
        if not self.copy_bytes:  # the first copy
            self.copy_bytes = _tensor_bytes(staged)
            self.first = staged if self.pinned else None  # pinned: slot 0's buffers, kept anyway
        return staged, slot

    def allocate(self, slots: int) -> None:
        """Pinned: the buffers of slots 1..slots-1, on a thread of their own (each shaped like the
        first copy, its contents overwritten when the slot is used)."""
        if self.pinned:
            for slot in range(1, slots):
                self.allocating[slot] = self.allocator.submit(self.stager(slot).stage, self.first)
        self.first = None

    def stager(self, slot: int) -> BlockingAsyncStager:
        return self.stagers.setdefault(slot, BlockingAsyncStager(cache_staged_state_dict=self.pinned))


class WriterThreadErrors:
    """The errors of DCP's extra writer threads (FileSystemWriter's thread_count > 1). DCP does not
    notice when one of them dies (torch 2.11-2.13 join them and keep the results that arrived, so a
    checkpoint could be committed without that thread's files, and the thread's traceback is printed
    beside the run's one message): they are kept here instead and fail the save."""

    THREAD = "_write_files_from_queue"  # the target DCP's writer threads run, part of their name

    def __init__(self):
        self.errors: list[BaseException] = []
        self.previous = threading.excepthook
        threading.excepthook = self.hook

    def hook(self, args) -> None:
        if args.thread is not None and self.THREAD in args.thread.name:
            self.errors.append(args.exc_value)
        else:
            self.previous(args)

    def clear(self) -> None:
        self.errors.clear()

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


def _tensor_bytes(state_dict: dict) -> int:
    """The bytes of the tensors in a (nested) state dict, a DTensor's local shard only."""
    total = 0
    for value in state_dict.values():
        if isinstance(value, dict):
            total += _tensor_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


def host_memory_available() -> int:
    """Bytes of host memory available to new allocations without swapping (Linux's MemAvailable:
    free memory plus the page cache that can be dropped); elsewhere, the free pages."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _attempt(work: Callable[[], None]) -> Optional[BaseException]:
    try:
        work()
    except WRITE_ERRORS as e:  # noqa: BLE001 - reported to every rank by Checkpointer._agree
        return e
    return None


class NotEnoughSpace(OSError):
    """A save not started: the free space is below the last checkpoint's size."""


def _one_line(error: BaseException) -> str:
    """An exception as one line: DCP's CheckpointException holds every rank's traceback; its last
    line names the cause."""
    if isinstance(error, NotEnoughSpace):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    full = [line for line in lines if "No space left" in line]  # the cause, beside the zip writer's symptom
    if full:
        return full[-1][:300]
    text = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"
    return text[:300]


def _disk_full(text: str) -> bool:
    # ENOSPC, or the torch.save writer's symptom of it ("unexpected pos" in inline_container.cc)
    return "No space left" in text or "Errno 28" in text or "unexpected pos" in text


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def load(path: str, model, optimizer, scheduler, world: World, cfg: Config, current: TrainState) -> TrainState:
    """Collective. Restores model, optimizer and (same world size only) RNG states, puts the
    optimizer and LR schedule at the checkpoint's step with the current config's settings
    (sfttrain.optim.set_step; see check_resume), and returns `current` at the checkpoint's step
    and data position. Rank 0 then rewinds the run folder's metrics.jsonl to the loaded step."""
    extra = read_state(path)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    _check_same_model(path, model_sd)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=STATE_DICT_OPTIONS)
    del model_sd, optim_sd
    set_step(optimizer, scheduler, cfg.optim, current.schedule["total steps"], extra["step"])
    rng_file = os.path.join(path, "rng", f"rank_{world.rank}.pt")
    if extra["world_size"] == world.world_size and os.path.isfile(rng_file):  # per-rank streams: only 1:1
        _set_rng_state(torch.load(rng_file, weights_only=True))
    state = dataclasses.replace(current, step=extra["step"], epoch=extra["epoch"],
                                consumed_in_epoch=extra["consumed_in_epoch"], wandb_id=extra["wandb_id"])
    if world.is_main:
        rewind_metrics(cfg.trainer.default_local_dir, state.step,
                       {"step": state.step, "event": "resumed", "from": os.path.abspath(path),
                        "saved_world_size": extra["world_size"], "world_size": world.world_size})
    return state


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts, frozen weights left out. ignore_frozen_params alone
    keeps a frozen weight tied to another (LoRA's lm_head.weight, which named_parameters skips as
    a duplicate of the embedding): such names are dropped here."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def _check_same_model(path: str, model_sd: dict) -> None:
    """A checkpoint of another model fails here with names and shapes, not deep inside DCP."""
    stored = {k[len("model."):]: md for k, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
              if k.startswith("model.")}
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
