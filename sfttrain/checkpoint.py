"""Sharded (DCP) checkpoints: atomic commit, retention by what is on disk, exact and elastic resume.

Layout of `<run>/global_step_N/`:
  .metadata, __*.distcp   model + optimizer, sharded (torch.distributed.checkpoint), reshardable
  trainer_state.json      step, data position, data fingerprint, optimizer/LR settings, wandb id, world size
  rng/rank_R.pt           each rank's RNG states
  config.yaml             the resolved run config
  hf/                     the model's config, generation config and tokenizer (for export)
  huggingface/            with trainer.save_hf, on the final checkpoint: the exported HF model
  COMPLETE                written last; only folders with it are ever resumed from

Commit protocol: every rank writes into `.global_step_N.tmp`; after a barrier (so every rank's
shard is on disk) rank 0 writes the small files and COMPLETE, fsyncs, and renames the folder to
`global_step_N` in one `os.replace`. A `global_step_N` therefore either does not exist or is
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

import dataclasses
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sfttrain.config import Config, ConfigError, TrainerConfig, to_yaml
from sfttrain.data.fingerprint import differences
from sfttrain.distributed import World, barrier
from sfttrain.optim import set_step

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
DEBRIS = re.compile(r"^\.global_step_\d+\.(tmp|trash)$")
METRICS = "metrics.jsonl"
REWOUND = "metrics_rewound.jsonl"


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


def _step_of(path: str) -> int:
    m = STEP_DIR.match(os.path.basename(path))
    if m:
        return int(m.group(1))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return int(json.load(f)["step"])


def save(run_dir: str, state: TrainState, model, optimizer, scheduler, world: World, cfg: Config, tokenizer,
         wandb_id: Optional[str] = None, export_hf: bool = False) -> str:
    """Collective: every rank calls it. Returns the committed `global_step_N` path. With
    export_hf, the checkpoint also holds `huggingface/` (written by all ranks, shard by shard)."""
    final = os.path.join(run_dir, f"global_step_{state.step}")
    tmp = os.path.join(run_dir, f".global_step_{state.step}.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
        os.makedirs(os.path.join(tmp, "rng"))
    barrier(world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    del model_sd, optim_sd
    _torch_save_synced(_rng_state(), os.path.join(tmp, "rng", f"rank_{world.rank}.pt"))
    if world.is_main:
        extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size,
                 "scheduler": scheduler.state_dict()}
        _write(os.path.join(tmp, "trainer_state.json"), json.dumps(extra, indent=1))
        _write(os.path.join(tmp, "config.yaml"), to_yaml(cfg))
        hf = os.path.join(tmp, "hf")
        model.config.save_pretrained(hf)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    barrier(world)  # every rank's shard and RNG file is written (and DCP has fsynced them)
    if export_hf:
        from sfttrain.export import export

        export(tmp, os.path.join(tmp, "huggingface"), rank=world.rank, world_size=world.world_size,
               trust_remote_code=cfg.model.trust_remote_code)
        barrier(world)
    if world.is_main:
        _fsync_tree(tmp)
        _write(os.path.join(tmp, COMPLETE), "")
        _fsync_dir(tmp)
        if os.path.lexists(final):  # an older save of this step (a fresh start or a resume from an earlier one)
            _remove(final)
        os.replace(tmp, final)  # the commit
        _fsync_dir(run_dir)
        enforce_retention(run_dir, cfg.trainer.max_ckpt_to_keep)
    barrier(world)
    return final


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
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _check_same_model(path, model_sd)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
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
    shapes = [f"{k}: checkpoint {tuple(stored[k].size)} vs model {tuple(v.shape)}" for k, v in model_sd.items()
              if k in stored and hasattr(stored[k], "size") and tuple(stored[k].size) != tuple(v.shape)]
    if missing or shapes:
        raise ConfigError(f"{path} was written for another model than model.partial_pretrain: "
                          f"{len(missing)} weights missing {missing[:5]}, {len(shapes)} of other shapes {shapes[:3]}. "
                          "Resume with the same model, or use trainer.resume_mode=disable (or a new "
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
