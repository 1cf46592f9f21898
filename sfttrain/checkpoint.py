"""Sharded (DCP) checkpoints: atomic commit, retention by what is on disk, exact and elastic resume.

Layout of `<run>/global_step_N/`:
  .metadata, __*.distcp   model + optimizer, sharded (torch.distributed.checkpoint), reshardable
  trainer_state.json      step, data position, data fingerprint, optimizer/LR settings, wandb id, world size
  rng/rank_R.pt           each rank's RNG states
  config.yaml             the resolved run config
  hf/                     the model's config, generation config and tokenizer (for export)
  huggingface/            with trainer.save_hf, on the final checkpoint: the exported HF model
  COMPLETE                written last; only folders with it are ever resumed from

Commit protocol: every rank writes into `.global_step_N.tmp`; once every rank's write has finished
(all ranks agree on it: at once, or with trainer.async_save at a later step boundary, the write
having run in a background thread while training went on) rank 0 writes COMPLETE, fsyncs, and
renames the folder to `global_step_N` in one `os.replace`. A `global_step_N` therefore either does not exist or is
complete: a crash at any moment leaves only a `.tmp` folder, which the next start deletes.
Deletion (retention, replacing an older save of the same step) is the reverse: one rename to
`.global_step_N.trash`, then the slow `rmtree`, so a half-deleted folder is never visible either.

The data position is (epoch, samples of that epoch consumed): with the seed it names exactly
which global samples were used, whatever the world size, so a checkpoint written by N ranks
resumes on M (the model and optimizer are resharded by DCP). RNG states are per rank and only
restored when the world size is unchanged (training itself draws no random numbers: the data
order is a function of the seed and the epoch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import socket
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sfttrain.config import Config, ConfigError, TrainerConfig, to_yaml
from sfttrain.data.fingerprint import differences
from sfttrain.distributed import World, barrier
from sfttrain.optim import set_step

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
DEBRIS = re.compile(r"^\.global_step_\d+\.(tmp|trash)$")
METRICS = "metrics.jsonl"
REWOUND = "metrics_rewound.jsonl"
# frozen weights (LoRA's base) are model.partial_pretrain's, unchanged: a checkpoint holds what
# training changes, the trainable weights and their optimizer state (full fine-tuning: everything).
# Not strict: loading sets the trainable weights only; _check_same_model has matched their names.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


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

    def advance(self, batch) -> None:
        self.step += 1
        self.epoch, self.consumed_in_epoch = batch.epoch, batch.consumed_in_epoch


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint in the run folder, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        m = STEP_DIR.match(name)
        path = os.path.join(run_dir, name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve(path: str) -> str:
    """A checkpoint folder, or a run folder (its latest complete checkpoint). Raises ConfigError
    for anything that is not a complete sfttrain checkpoint."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_complete(path):
        return path
    found = complete_checkpoints(path)
    if found:
        return found[-1][1]
    raise ConfigError(f"{path!r} is neither a complete sfttrain checkpoint (a global_step_N folder with a "
                      f"{COMPLETE} marker) nor a run folder that holds one")


def find_resume(t: TrainerConfig, run_dir: str) -> Optional[str]:
    """The checkpoint to resume from, or None for a fresh start. Rank 0 decides and tells the
    others (every rank must load the same step). On a fresh start, metrics.jsonl records left by
    an earlier attempt in this run folder are moved aside (see `rewind_metrics`)."""
    result: tuple[Optional[str], Optional[str]] = (None, None)
    if _rank() == 0:
        try:
            result = (_find_resume(t, run_dir), None)
            if result[0] is None:
                rewind_metrics(run_dir, 0)
        except ConfigError as e:
            result = (None, str(e))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if result[1] is not None:
        raise ConfigError(result[1])
    return result[0]


def _find_resume(t: TrainerConfig, run_dir: str) -> Optional[str]:
    """disable: None. resume_path: trainer.resume_from_path. auto: the run folder's latest complete
    checkpoint; if it has none, resume_from_path when given (a run seeded from another run's
    checkpoint still resumes its own progress after a crash), else None."""
    found = complete_checkpoints(run_dir)
    if t.resume_mode == "auto" and found:
        return found[-1][1]
    if t.resume_mode == "disable" or not t.resume_from_path:
        path = None
    else:
        try:
            path = resolve(t.resume_from_path)
        except ConfigError as e:
            raise ConfigError(f"trainer.resume_from_path: {e}") from None
    start = _step_of(path) if path else 0
    newer = [p for step, p in found if step > start and os.path.abspath(p) != path]
    if newer:
        logging.getLogger("sfttrain").warning(
            f"{run_dir} holds checkpoints from further than this run starts (step {start}): "
            f"{[os.path.basename(p) for p in newer]}. They are replaced as this run reaches their steps; until "
            "then, resume_mode=auto (and max_ckpt_to_keep) would take them for this run's latest. Use a new "
            "trainer.default_local_dir to keep the runs apart.")
    return path


def check_shared_run_dir(run_dir: str, world: World, patience_s: float = 10.0) -> None:
    """Collective, at start-up: every rank must see the run folder rank 0 writes to (checkpoints are
    written by all ranks into one folder and committed by rank 0). Rank 0 writes a file with a
    fresh token; a rank that cannot read that token there (a node-local disk, or a path that
    resolves differently on its node) makes every rank stop with a ConfigError naming it. A
    rank waits up to patience_s for the file, for network filesystems' attribute caches."""
    box = [_write_probe(run_dir) if world.is_main else None]
    dist.broadcast_object_list(box, src=0)  # after rank 0's write: the others look for it now
    token, error = box[0]
    if error is not None:
        raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {error}")
    probe = os.path.join(run_dir, f".shared-check-{token}")
    deadline = time.monotonic() + patience_s
    while not _reads(probe, token) and time.monotonic() < deadline:
        time.sleep(0.5)
    seen = [None] * world.world_size
    dist.all_gather_object(seen, (_reads(probe, token), socket.gethostname(), os.path.abspath(run_dir)))
    if world.is_main:
        os.remove(probe)
    blind = [f"rank {r} on {host} ({path})" for r, (ok, host, path) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"trainer.default_local_dir={run_dir!r} is not one folder shared by every node: "
                          f"rank 0 on {seen[0][1]} wrote a file into {seen[0][2]} that {', '.join(blind[:4])} "
                          "cannot see. Put the run folder on storage every node mounts (not a node-local "
                          "disk such as /tmp or $TMPDIR), with a path that names it on every node")


def _write_probe(run_dir: str) -> tuple[Optional[str], Optional[str]]:
    """(token, None) once the probe file holds it, or (None, why it could not be written)."""
    token = uuid.uuid4().hex
    try:
        os.makedirs(run_dir, exist_ok=True)
        _write(os.path.join(run_dir, f".shared-check-{token}"), token)
    except OSError as e:
        return None, str(e)
    return token, None


def _reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def _step_of(path: str) -> int:
    m = STEP_DIR.match(os.path.basename(path))
    if m:
        return int(m.group(1))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return int(json.load(f)["step"])


class Checkpointer:
    """Writes `global_step_N` checkpoints. With trainer.async_save, a periodic save returns once
    this rank's shard is copied to host memory; DCP writes it from a background thread while
    training goes on, and it is committed at the first step boundary where every rank's write
    has finished (`poll`), at the latest when the next save begins. One save is in flight at a
    time. The final save waits for its write (nothing is left in flight when training ends).

    Per committed checkpoint, `report(record, line)` gets its size on disk and, counted from the
    save's start, the seconds the training loop was stalled, the seconds until every rank's write
    had finished (DCP's last step on rank 0 waits for all ranks) with the GB/s over that span,
    and the seconds until the commit (at a step boundary)."""

    def __init__(self, run_dir: str, world: World, cfg: Config, report: Callable[[dict, str], None]):
        self.run_dir, self.world, self.cfg, self.report = run_dir, world, cfg, report
        self.pending: Optional[PendingSave] = None
        # DCP's background thread runs collectives of its own; the main thread's agreement on
        # "every rank has written" must not interleave with them, so each gets its own gloo group
        # (async_save needs a CPU backend also when training runs on nccl; gloo calls on host
        # tensors never wait for the GPU)
        self.write_group = dist.new_group(backend="gloo")
        self.agree_group = dist.new_group(backend="gloo")

    def save(self, state: TrainState, model, optimizer, tokenizer, wandb_id: Optional[str] = None,
             final: bool = False, export_hf: bool = False) -> None:
        """Collective: every rank calls it. With export_hf, the checkpoint also holds
        `huggingface/` (written by all ranks, shard by shard)."""
        started = time.perf_counter()
        self.wait()
        background = self.cfg.trainer.async_save and not final
        tmp = os.path.join(self.run_dir, f".global_step_{state.step}.tmp")
        future = self._start_write(tmp, state, model, optimizer, tokenizer, wandb_id, background)
        self.pending = PendingSave(state.step, tmp, os.path.join(self.run_dir, f"global_step_{state.step}"), future,
                                   started, time.perf_counter() - started, background, export_hf)
        future.add_done_callback(self.pending.mark_written)
        if not background:
            self.wait()

    def poll(self) -> None:
        """Commits the save in flight if every rank has finished writing it. Collective; one tiny
        gloo all-reduce per call while a save is in flight, nothing otherwise."""
        if self.pending is not None and self._all_written(self.pending.future.done()):
            self._commit()

    def wait(self) -> None:
        """Collective: waits for the save in flight, then commits it."""
        if self.pending is not None:
            with contextlib.suppress(Exception):  # _all_written re-raises it on this rank
                self.pending.future.result()
            self._all_written(True)
            self._commit()

    def _start_write(self, tmp: str, state: TrainState, model, optimizer, tokenizer,
                     wandb_id: Optional[str], background: bool) -> Future:
        """Every rank writes into `tmp`; returns the future of the DCP write (done unless background)."""
        world, cfg = self.world, self.cfg
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
            os.makedirs(os.path.join(tmp, "rng"))
        barrier(world)
        model_sd, optim_sd = _state_dicts(model, optimizer)
        # FileSystemWriter stages async saves itself (torch 2.11 and 2.13): new host tensors, a
        # copy the next optimizer step cannot change, taken before async_save returns
        writer = dcp.FileSystemWriter(tmp)
        if background:
            future = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                                    process_group=self.write_group)
        else:
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
            future = Future()
            future.set_result(None)
        del model_sd, optim_sd
        _torch_save_synced(_rng_state(), os.path.join(tmp, "rng", f"rank_{world.rank}.pt"))
        if world.is_main:
            extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size}
            _write(os.path.join(tmp, "trainer_state.json"), json.dumps(extra, indent=1))
            _write(os.path.join(tmp, "config.yaml"), to_yaml(cfg))
            hf = os.path.join(tmp, "hf")
            model.config.save_pretrained(hf)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(hf)
            tokenizer.save_pretrained(hf)
        return future

    def _all_written(self, done: bool) -> bool:
        """True when every rank's write has finished (each rank's shard, RNG file and, on rank 0,
        DCP's metadata are then on disk); a write that failed on any rank fails every rank."""
        future = self.pending.future
        failed = done and future.exception() is not None
        status = torch.tensor([-1 if failed else int(done)])
        dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.agree_group)
        if failed:
            raise future.exception()
        if status.item() < 0:
            raise RuntimeError(f"the checkpoint of step {self.pending.step} failed on another rank; its "
                               f"{self.pending.tmp} is left unfinished (deleted at the next start)")
        return status.item() == 1

    def _commit(self) -> None:
        """After every rank's write: rank 0 writes COMPLETE and renames the folder (the commit)."""
        p, world = self.pending, self.world
        self.pending = None
        if p.export_hf:
            from sfttrain.export import export

            export(p.tmp, os.path.join(p.tmp, "huggingface"), rank=world.rank, world_size=world.world_size,
                   trust_remote_code=self.cfg.model.trust_remote_code)
            barrier(world)
        if world.is_main:
            size = _tree_bytes(p.tmp)
            _fsync_tree(p.tmp)
            _write(os.path.join(p.tmp, COMPLETE), "")
            _fsync_dir(p.tmp)
            if os.path.lexists(p.final):  # an older save of this step (a fresh start or a resume from an earlier one)
                _remove(p.final)
            os.replace(p.tmp, p.final)  # the commit
            _fsync_dir(self.run_dir)
            enforce_retention(self.run_dir, self.cfg.trainer.max_ckpt_to_keep)
            self._report(p, size, time.perf_counter() - p.started)
        if p.export_hf:
            barrier(world)  # the exported model is complete for every rank once save returns

    def _report(self, p: PendingSave, size: int, seconds: float) -> None:
        stall = p.stall_s if p.background else seconds
        written = p.written_s or seconds  # None only if its callback has not run yet: it ended just now
        record = {"step": p.step, "event": "checkpoint", "path": p.final, "async": p.background, "bytes": size,
                  "stall_s": stall, "written_s": written, "commit_s": seconds, "gb_per_s": size / 1e9 / written}
        self.report(record, f"checkpoint {os.path.basename(p.final)} committed: {size / 1e9:.3g} GB, training "
                            f"stalled {stall:.2f} s, written in {written:.2f} s ({record['gb_per_s']:.3g} GB/s"
                            f"{', in the background' if p.background else ''}), committed {seconds:.2f} s after "
                            "the save began")


@dataclass
class PendingSave:
    """A save whose write may still be running: committed by `Checkpointer.poll` or `.wait`."""
    step: int
    tmp: str
    final: str
    future: Future
    started: float  # perf_counter when save() began
    stall_s: float  # seconds the training loop waited for it (a background write: until it was staged)
    background: bool  # written by DCP's thread while training went on
    export_hf: bool
    written_s: Optional[float] = None  # seconds from started until this rank's write finished

    def mark_written(self, _future: Future) -> None:
        self.written_s = time.perf_counter() - self.started


def check_resume(path: str, cfg: Config, current: TrainState) -> list[str]:
    """What resuming from `path` would change, said before the model is loaded: the lines to
    print, or a ConfigError for what is refused. `current` holds this run's data fingerprint and
    optimizer/schedule settings.

    The rule: the data must be what the checkpoint read (its fingerprint; a difference is refused
    unless trainer.resume_allow_data_change=true); the optimizer and LR schedule follow the
    current config (the LR is a pure function of the step and the config), every difference from
    the checkpoint's is printed, and a schedule that ends before the checkpoint's step is refused."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    return (check_data(path, saved, current.data, cfg.trainer.resume_allow_data_change)
            + check_schedule(path, saved, current.schedule))


def load(path: str, model, optimizer, scheduler, world: World, cfg: Config, current: TrainState) -> TrainState:
    """Collective. Restores model, optimizer and (same world size only) RNG states, puts the
    optimizer and LR schedule at the checkpoint's step with the current config's settings
    (sfttrain.optim.set_step; see check_resume), and returns `current` at the checkpoint's step
    and data position. Rank 0 then rewinds the run folder's metrics.jsonl to the loaded step."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        extra = json.load(f)
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


def check_data(path: str, saved: dict, fingerprint: dict, allow_change: bool) -> list[str]:
    """A resume continues the checkpoint's data position: the same rows in the same order,
    rendered the same way, or (trainer.resume_allow_data_change=true) the user's explicit choice."""
    legacy = saved.get("data") is None  # written before checkpoints held the fingerprint
    recorded = {"data.train_batch_size": saved["global_batch"], "trainer.seed": saved["seed"]} if legacy \
        else saved["data"]
    changed = differences(recorded, fingerprint)
    notes = [f"data: {path} records no data fingerprint (an older sfttrain): only the batch size and seed "
             "were checked"] if legacy else []
    if changed and not allow_change:
        raise ConfigError(f"{path} was written with other data settings; resuming would silently change which "
                          "rows come next or how they are tokenized:\n    " + "\n    ".join(changed) +
                          "\nUse the checkpoint's values; or set trainer.resume_allow_data_change=true to continue "
                          "from its data position (epoch, samples consumed) on the new data; or "
                          "trainer.resume_mode=disable (or a new trainer.default_local_dir) to start afresh")
    return notes + [f"data (allowed by trainer.resume_allow_data_change) {c}" for c in changed]


def check_schedule(path: str, saved: dict, schedule: dict) -> list[str]:
    """The current optimizer and schedule settings apply; each difference is said. A schedule
    that ends at or before the checkpoint's step (other than the checkpoint's own end: a
    finished run started again) would train nothing."""
    step, total = saved["step"], schedule["total steps"]
    old = saved.get("schedule")
    if step >= total and (old is None or old["total steps"] != total):
        raise ConfigError(f"{path} is at step {step}, but this run's schedule ends at step {total} "
                          "(trainer.total_training_steps, or trainer.total_epochs x steps per epoch): nothing "
                          f"would be trained. Set trainer.total_training_steps above {step} to continue, or "
                          "trainer.resume_mode=disable (or a new trainer.default_local_dir) to start afresh")
    if old is None:
        return [f"optimizer: {path} records no optimizer settings (an older sfttrain): the config's apply"]
    notes = [f"optimizer (the config's apply) {c}" for c in differences(old, schedule)]
    if step >= total:
        notes.append(f"the checkpoint is this run's last step ({step}): nothing left to train")
    return notes


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


def rewind_metrics(run_dir: str, step: int, note: Optional[dict] = None) -> None:
    """Makes metrics.jsonl the history of the state being resumed: records of steps after `step`
    (logged by an attempt that crashed or was stopped after its last checkpoint; the resumed run
    logs those steps again) and a torn last line move to metrics_rewound.jsonl; `note` is appended."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        return
    keep, dropped = [], []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except json.JSONDecodeError:
                record = None
            ok = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step
            (keep if ok else dropped).append(line if line.endswith("\n") else line + "\n")
    if note is not None:
        keep.append(json.dumps(note) + "\n")
    if not dropped and note is None:
        return
    if dropped:
        with open(os.path.join(run_dir, REWOUND), "a") as f:
            f.writelines(dropped)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def enforce_retention(run_dir: str, keep: Optional[int]) -> None:
    """Keeps the newest `keep` complete checkpoints, judged by what is on disk (so it holds
    across resumes and counts checkpoints this process never wrote)."""
    if not keep or keep <= 0:
        return
    for _, path in complete_checkpoints(run_dir)[:-keep]:
        _remove(path)


def remove_stale_tmp(run_dir: str) -> None:
    """Deletes the debris of interrupted saves and deletions (never a committed checkpoint)."""
    if os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            if DEBRIS.match(name):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _remove(path: str) -> None:
    """Atomically makes `path` invisible (one rename), then deletes it."""
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name}.trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    _fsync_dir(parent)
    shutil.rmtree(trash, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, files in os.walk(root) for name in files)


def _fsync_tree(root: str) -> None:
    """fsyncs the small files written outside DCP (DCP fsyncs its own shards) and every folder,
    so COMPLETE never reaches the disk before what it vouches for."""
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".distcp"):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
