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
import pickle
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import STATE_FILE, complete_checkpoints, damaged_error, enforce_retention, fsync_path, \
    hide, publish, read_state, remove, room_problem, size_text, tree_bytes, write_complete, write_synced
from sfttrain.checkpoint_writer import OneLineError, Staging, WriterProcess, WriterThreadErrors, cuda_room, \
    one_line, tensor_bytes, write_shards, writer_kind
from sfttrain.config import Config, ConfigError, to_yaml
from sfttrain.distributed import World, agree_on_errors, decided_by_rank0, from_every_rank, ranks_of_this_launcher
from sfttrain.errors import CheckpointError, data_worker_died
from sfttrain.faults import (SIZE_LIMIT_FIX, disk_full, fault, file_at_size_limit, folder_gone, over_size_limit, peer_lost,
                             resumes_from, what_next)
from sfttrain.metrics import rewind_metrics
from sfttrain.optim import set_step

# frozen weights (LoRA's base) are model.partial_pretrain's, unchanged: a checkpoint holds what
# training changes, the trainable weights and their optimizer state (full fine-tuning: everything).
# Not strict: loading sets the trainable weights only; check_same_model has matched their names.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
# what a failed write raises: DCP's CheckpointException (every rank's error) is a BaseException
WRITE_ERRORS = (Exception, CheckpointException)
# a rank's state of the oldest save's write, as the ranks agree on it (the minimum wins): failed, stuck
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
    """Writes `global_step_N` checkpoints of one run (`run_id`). With trainer.async_save, a periodic
    save returns once this rank's shard is copied (sfttrain.checkpoint_writer's Staging: on the GPU
    where its memory allows, the writer thread then copying it to host memory; or straight to host
    memory, with trainer.async_save_pinned on CUDA into pinned copies allocated between the first and
    the second step and reused by the later saves); one writer thread per rank then writes the saves
    in order (DCP, trainer.save_thread_count threads per file set; by default on CUDA through a
    writer process of the rank's own, which holds no GIL that training needs:
    trainer.async_save_writer) while training goes on, and each is committed at the first step boundary where every rank's write has finished
    (`poll`). Up to trainer.async_save_in_flight saves are staged or
    being written at once, each holding a host copy of this rank's shard: saves that come faster
    than the disk writes them queue there, and a save finding the queue full waits for the oldest.
    The final save waits for every write (nothing is left in flight when training ends). Retention
    keeps this run's newest trainer.max_ckpt_to_keep; the deletions run on a thread of their own.

    Per committed checkpoint, `report(record, line)` gets its size on disk and, counted from the
    save's start, the seconds the training loop was stalled (of them, the seconds waiting for an
    older save's write to free a place), the seconds until every rank's write had finished (DCP's
    last step on rank 0 waits for all ranks), the write's own seconds and GB/s (from when the writer
    thread took it up), and the seconds until the commit (at a step boundary)."""

    def __init__(self, run_dir: str, world: World, cfg: Config, run_id: str, report: Callable[[dict, str], None],
                 model, optimizer, tokenizer):
        self.run_dir, self.world, self.cfg, self.run_id, self.report = run_dir, world, cfg, run_id, report
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer  # what each save holds
        # rank 0's config.yaml of every save, rendered once: the run's config does not change, and a rendering
        # (the whole schema through OmegaConf) would stall the training thread at each save
        self.config_yaml = to_yaml(cfg) if world.is_main else None
        self.pending: collections.deque[PendingSave] = collections.deque()  # oldest first
        own = complete_checkpoints(run_dir, run_id)
        self.last_bytes = tree_bytes(own[-1][1]) if own and world.is_main else None  # rank 0's space check
        # this run's newest committed checkpoint, known to every rank without asking the run folder's disk
        # (a write stuck on it would leave a listing stuck too: _stuck)
        self.committed: Optional[str] = own[-1][1] if own else None
        self.write_began: Optional[float] = None  # perf_counter when the running write began (the writer thread's)
        self.stuck_after_s = max(cfg.trainer.nccl_timeout,
                                 estimated_bytes(model) / world.world_size / SLOWEST_WRITE_BYTES_PER_S)
        self.warned_grace = False  # _warn_if_a_stop_would_not_save has said it
        # DCP's writes run collectives of their own (on the writer thread); the main thread's agreement
        # on "every rank has written" must not interleave with them, so each gets its own gloo group
        # (async_save needs a CPU backend also when training runs on nccl; gloo calls on host
        # tensors never wait for the GPU)
        timeout = datetime.timedelta(seconds=cfg.trainer.nccl_timeout)
        self.write_group = dist.new_group(backend="gloo", timeout=timeout)
        self.agree_group = dist.new_group(backend="gloo", timeout=timeout)
        # where background saves are written (sfttrain.checkpoint_writer): a writer process of this
        # rank's own (made after the first step: _reserve_slots), or the writer thread itself
        self.in_process = writer_kind(cfg.trainer.async_save_writer, world.device) == "process"
        self.process: Optional[WriterProcess] = None
        pinned = cfg.trainer.async_save_pinned and world.device.type == "cuda"
        self.staging = Staging(world.device, pinned, shared=self.in_process) if cfg.trainer.async_save else None
        # saves that may be in flight at once: trainer.async_save_in_flight, or fewer where the memory they are
        # staged in (the GPU's or the host's) holds fewer copies of the shards (agreed by all ranks after the
        # first step: _reserve_slots)
        self.slots, self.slots_agreed = cfg.trainer.async_save_in_flight, False
        self.thread_errors = WriterThreadErrors()
        # one writer: every rank writes its saves in the same order, so DCP's collectives pair up
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
        background = self.cfg.trainer.async_save and not final
        room = self.slots - 1 if background else 0
        while len(self.pending) > room:  # a full queue (or a final save) waits for the oldest write
            self._wait_oldest()
        waited = time.perf_counter() - started
        if self.in_process and not self.pending:  # (with a save in flight, its write finds a lost writer)
            self._replace_lost_writer()
        tmp = os.path.join(self.run_dir, f".global_step_{state.step}.tmp")
        self._agree(state.step, tmp, _attempt(lambda: self._prepare(tmp)))
        (state_dict, slot), error = (None, None), None
        try:
            model_sd, optim_sd = _state_dicts(self.model, self.optimizer)
            state_dict, slot = self._prepare_write({"model": model_sd, "optim": optim_sd}, background)
        except WRITE_ERRORS as e:  # noqa: BLE001 - any failure of any rank is agreed on below
            error = _save_error(e)
        self._agree(state.step, tmp, error)  # before the write, whose collectives need every rank
        future = self.writer.submit(self._write, state_dict, tmp, slot, self._small_files(state, wandb_id))
        del state_dict
        self.pending.append(PendingSave(state.step, tmp, os.path.join(self.run_dir, f"global_step_{state.step}"),
                                        future, slot, started, time.perf_counter() - started, waited, background))
        future.add_done_callback(self.pending[-1].mark_written)
        if not background:
            self.wait()

    def poll(self) -> None:
        """Commits, oldest first, the saves in flight that every rank has finished writing.
        Collective, after every step; one tiny gloo all-reduce per call while a save is in flight,
        nothing otherwise. After the first step (the optimizer's state exists from then on) it
        reserves the host copies of the background saves to come."""
        if self.staging is not None and not self.slots_agreed and self.cfg.trainer.save_freq > 0:
            self._reserve_slots()
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
        if self.process is not None:
            self.process.close()

    def _reserve_slots(self) -> None:
        """Collective: where background saves are staged and how many may be in flight, agreed by
        every rank. In host memory, as many as every node's available memory holds copies of its
        ranks' shards (at most trainer.async_save_in_flight, at least one); on the device
        (trainer.async_save_staging), as many as its free memory holds beside the first step's peak.
        Then the staging reserves its host copies (pinned: allocated now, before the second step)."""
        model_sd, optim_sd = _state_dicts(self.model, self.optimizer)
        live = {"model": model_sd, "optim": optim_sd}
        copy, device = max(tensor_bytes(live), 1), self.world.device
        local_ranks = ranks_of_this_launcher()
        available = host_memory_available()
        # one copy's worth kept free for the rest of the node's work (data workers, the writes' page cache)
        host_fit = available // (copy * local_ranks) - 1
        fits = torch.tensor([host_fit, self._device_fit(live, copy, host_fit)])
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.agree_group)
        host_fit, device_fit = fits.tolist()
        wanted, setting = self.slots, self.cfg.trainer.async_save_staging
        on_device = device_fit >= 1 and (setting == "device" or
                                         setting == "auto" and device.type == "cuda" and device_fit >= wanted)
        self.slots, self.slots_agreed = max(1, min(wanted, device_fit if on_device else host_fit)), True
        if self.in_process:
            # the writer process first, on every rank (making it is a collective of the writer threads)
            self.writer.submit(self._writer_process)
        started = time.perf_counter()
        pinned = self.staging.reserve(live, self.slots, on_device)
        if self.in_process:  # each pinned slot's copy is sent to the writer process now, not with a save's write
            for slot in pinned:
                self.writer.submit(lambda slot=slot: self._writer_process().keep(slot, self.staging.kept[slot]))
        if self.world.is_main:
            self._say_staging(wanted, copy, local_ranks, available, on_device, pinned, time.perf_counter() - started)

    def _device_fit(self, live: dict, copy: int, host_fit: int) -> int:
        """How many copies of the shard the training device holds beside the first step's peak."""
        device = self.world.device
        if device.type != "cuda":  # the device's memory is the host's, where the host slot takes one copy
            return host_fit - 1
        if copy - tensor_bytes(live, on="cuda") > copy // 100:
            return 0  # offloaded to host memory (model.fsdp_config.cpu_offload): a "device" copy would be a host one
        return cuda_room(device) // copy

    def _say_staging(self, wanted: int, copy: int, local_ranks: int, available: int, on_device: bool,
                     pinned: list[int], pinning_s: float) -> None:
        """A line: where the saves' copies are taken, how many may be in flight (the first is in
        each background save's metrics.jsonl record too: `staging`) and the page-locked host memory
        allocated for them (the pause before step 2)."""
        device, setting = self.world.device, self.cfg.trainer.async_save_staging
        where = (f"on {device} (its free memory holds {self.slots} beside the first step's peak), then copied to "
                 "host memory by the writer" if on_device else "in host memory")
        locked = (f"; {len(pinned)} x {size_text(copy)} of page-locked host memory allocated in {pinning_s:.1f} s "
                  "before step 2 (once: page locking beside the steps would slow them)" if pinned else "")
        self.report(None, f"background saves: each takes a copy of a rank's model and optimizer shard "
                          f"({size_text(copy)}) {where} (trainer.async_save_staging={setting}); {self.slots} in flight "
                          f"at most{locked}")
        if self.slots < wanted:
            log = logging.getLogger("sfttrain")
            holds = (f"the free memory of {device} holds {self.slots}" if on_device else
                     f"host memory holds {self.slots}: a host copy of a rank's shard takes {size_text(copy)} "
                     f"({local_ranks} ranks per node) and {size_text(available)} are available")
            log.warning(f"trainer.async_save_in_flight={wanted}, but {holds}. At most {self.slots} saves will be in "
                        "flight; a save finding them all in flight waits for the oldest write")

    def _wait_oldest(self) -> None:
        """Waits for the oldest save's write on every rank, then commits it. The ranks ask each other
        every second: a rank whose write failed says so at once, and the others stop waiting for
        their own writes (which may wait for that rank's in one of DCP's collectives)."""
        while not self._all_written(_finished_within(self.pending[0].future, seconds=1.0)):
            pass
        self._commit()

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

    def _prepare_write(self, state_dict: dict, background: bool) -> tuple[dict, Optional[int]]:
        """What the writer thread is to write: the model and optimizer state dict (a copy if
        background, taken before save() returns: the next optimizer steps cannot change it) and
        its staging slot."""
        if not background:
            return state_dict, None
        return self.staging.stage(state_dict, busy={p.slot for p in self.pending})

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

    def _write_small_files(self, tmp: str, files: dict[str, Any]) -> None:
        """On the writer thread, before the shards: DCP's write ends on every rank only once every
        rank has started it, so rank 0's size and fsync of the whole folder after its write
        (write_shards) cover every rank's small files. Rank 0 also writes the model's config and
        the tokenizer (hf/)."""
        for name, content in files.items():
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

    def _write(self, state_dict: dict, tmp: str, slot: Optional[int],
               small_files: dict[str, Any]) -> float:
        """The writer thread: the small files, then write_shards here (a final or synchronous save:
        training waits for it anyway), or a background save's in the writer process."""
        self.write_began = time.perf_counter()  # (_all_written: a write unfinished past stuck_after_s is stuck)
        try:
            self._write_small_files(tmp, small_files)
            threads = self.cfg.trainer.save_thread_count
            if slot is not None:  # a background save: its host copy (made now if it was staged on the device)
                state_dict = self.staging.to_host(state_dict, slot)
            if slot is None or not self.in_process:
                return write_shards(state_dict, tmp, threads, self.write_group, self.world.is_main, self.thread_errors)
            process = self._writer_process()
            self.write_began = time.perf_counter()  # a writer started anew (a lost one's replacement): not the write
            return process.write(state_dict, tmp, threads, slot)  # its slot's copy: kept there
        finally:
            self.write_began = None

    def _writer_process(self) -> WriterProcess:
        """Made on the writer thread, by every rank in the same order of its tasks."""
        if self.process is None:
            self.process = WriterProcess(self.world.rank, self.world.world_size, self.write_group,
                                         self.cfg.trainer.nccl_timeout)
        return self.process

    def _replace_lost_writer(self) -> None:
        """Collective, before a save with none in flight: a writer process that ended since the last
        save (the host's out-of-memory killer, a stray kill) would fail this save and lose every step
        since the last one. The writers of all ranks form one group, so every rank's is replaced: the
        save's write starts new ones (_writer_process), which are sent the kept host copies anew."""
        codes = [None] * self.world.world_size
        dist.all_gather_object(codes, self.process and self.process.exit_code(), group=self.agree_group)
        lost = {rank: code for rank, code in enumerate(codes) if code is not None}
        if not lost:
            return
        self.writer.submit(self._stop_writer).result()  # on the writer thread, which alone uses the process
        self.process = None
        if self.world.is_main:
            logging.getLogger("sfttrain").warning(
                f"the checkpoint writer process of rank(s) {sorted(lost)} had ended (exit code(s) {sorted(lost.values())}; "
                "-9 is SIGKILL, most often the host's out-of-memory killer): every rank's writer is started anew "
                "for this save")

    def _all_written(self, done: bool) -> bool:
        """True when every rank's write of the oldest save in flight has finished (each rank's
        shard, RNG file and, on rank 0, DCP's metadata are then on disk); a write that failed on any
        rank fails every rank."""
        future = self.pending[0].future
        error = future.exception() if done else None
        began = self.write_began  # (the oldest save's: the writer thread writes the saves in order)
        stuck = not done and began is not None and time.perf_counter() - began > self.stuck_after_s
        status = torch.tensor([FAILED if error is not None else STUCK if stuck else int(done)])
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.agree_group)
        if status.item() == STUCK:
            self._stuck(self.pending[0], began)
        if status.item() == FAILED:
            self._stop_writer()
            with contextlib.suppress(*WRITE_ERRORS):  # every rank's writer has stopped before the clean-up
                future.result()
            failed = self.pending.popleft()
            self._fail(failed.step, failed.tmp, error)
        return status.item() == 1

    def _stuck(self, p: PendingSave, began: Optional[float]) -> None:
        """A write that every rank has not finished within stuck_after_s of its start is stuck
        (a network filesystem that stopped answering, a writer process stopped): waiting on would hang the
        run for good, each rank's agreement above answering every second, so no collective times out. Raised
        on every rank without touching the run folder, whose disk may be what hangs (a listing or a removal
        would hang too): the next start removes the partial folder."""
        if self.process is not None:
            self.process.process.kill()  # not joined: a process in a stuck write ends only once the write returns
        last = self.committed
        raise CheckpointError(
            f"the checkpoint of step {p.step} was not saved: its write has not finished "
            f"{time.perf_counter() - (began or p.started):.0f} s after it began (the longest a write may take here: "
            f"{self.stuck_after_s:.0f} s, the larger of trainer.nccl_timeout={self.cfg.trainer.nccl_timeout} and a "
            f"rank's share of the checkpoint at {SLOWEST_WRITE_BYTES_PER_S / 1e6:.0f} MB/s): it is stuck, e.g. on a network filesystem that stopped "
            f"answering or in a checkpoint writer process that was stopped. Nothing of it was committed; the last "
            f"good checkpoint is {last or 'none'}. Check that {self.run_dir} answers (ls, df). {resumes_from(last)}. A write "
            "that is only slow needs a larger trainer.nccl_timeout")

    def _agree(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective: raises CheckpointError on every rank if `error` is set on any."""
        status = torch.tensor([int(error is not None)])
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.agree_group)
        if status.item():
            self._fail(step, tmp, error, renamed)

    def _stop_writer(self) -> None:
        """A writer process is stopped when a save failed somewhere: a rank's write cannot finish
        without every rank's. (A writer thread ends with DCP's own error, which DCP shares.)"""
        if self.process is not None:
            self.process.stop()

    def _fail(self, step: int, tmp: str, error: Optional[BaseException], renamed: bool = False) -> None:
        """Collective, once every rank has stopped writing: rank 0 removes the partial folder (and
        those of later saves in the queue, which are not started or end with this run) and words the
        one message every rank raises."""
        for later in self.pending:
            later.future.cancel()
        errors = from_every_rank(one_line(error) if error is not None else None, self.agree_group)

        def clean_up() -> None:
            limited = file_at_size_limit(tmp) if os.path.isdir(tmp) else None  # named before the folder goes
            for partial in [tmp, *(later.tmp for later in self.pending)]:
                with contextlib.suppress(OSError):
                    if os.path.lexists(partial):
                        remove(partial)
            raise CheckpointError(self._not_saved(step, errors, limited, os.path.lexists(tmp), renamed))

        decided_by_rank0(clean_up, self.agree_group)

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
        if renamed:
            final = os.path.join(self.run_dir, f"global_step_{step}")
            return (f"the checkpoint of step {step} may not be saved: {why}, in its commit, once its files were on the "
                    f"disk and its folder renamed to {final}: whether the rename reached the disk is not known. The last "
                    f"good checkpoint before it is {last or 'none'}. {fix}. The same command then resumes from {final} where "
                    f"it is there (whole), else from {last or 'nothing: it starts afresh'}")
        partial = (f"its partial folder .global_step_{step}.tmp is left, and the next start deletes it" if left
                   else "its partial folder was removed")
        return (f"the checkpoint of step {step} was not saved: {why}. Nothing of it was committed ({partial}); "
                f"the last good checkpoint is {last or 'none'}. {fix}. {what_next(self.cfg.trainer)}")

    def _why_not_saved(self, errors: list[Optional[str]], limited: Optional[str],
                       last: Optional[str]) -> tuple[str, str]:
        """(the failure in words, what to do): the file size limit, a full disk and how much space there
        is, another fault of a filesystem (sfttrain.faults), or any other error."""
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        # a rank that lost a peer inside a collective reports only that: the cause is the peer's error
        causes = [(rank, text) for rank, text in failed if not peer_lost(text)] or failed
        full = [(rank, text) for rank, text in causes if disk_full(text)]
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
        p, world = self.pending.popleft(), self.world
        error, renamed = None, False
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
                  "commit_s": seconds, "gb_per_s": size / 1e9 / write_s,
                  "staging": ("device" if self.staging.on_device else "host") if p.background else None}
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


def estimated_bytes(model) -> int:
    """A checkpoint's size before the first is written: each trained weight under each of its names
    (a tied weight is saved under both) and AdamW's two moments of each, in the weight's dtype; a
    DTensor whole (its shape is global: DCP writes each element once). DCP's own overhead (a few KB
    per tensor) and the small files are left out."""
    named = model.state_dict(keep_vars=True)
    trained = [t for t in named.values() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    unique = {id(t): t for t in trained}.values()
    return sum(t.numel() * t.element_size() for t in trained) + 2 * sum(t.numel() * t.element_size() for t in unique)


def host_memory_available() -> int:
    """Bytes of host memory available to new allocations without swapping (Linux's MemAvailable:
    free memory plus the page cache that can be dropped); elsewhere, the free pages."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


NOT_STARTED = "so it was not started"  # how NotEnoughSpace's message ends


class NotEnoughSpace(OneLineError):
    """A save not started: the free space is below the last checkpoint's size."""


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
    if errors := agree_on_errors(error):
        raise damaged_error(path, f"it does not read back ({'; '.join(errors)})")
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
