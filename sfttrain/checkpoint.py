"""Sharded (DCP) checkpoints: atomic commit, retention by what is on disk, exact resume.

Layout of `<run>/global_step_N/`:
  .metadata, __*.distcp   model + optimizer, sharded (torch.distributed.checkpoint), reshardable
  trainer_state.json      step, data position, LR scheduler, wandb id, world size
  rng/rank_R.pt           each rank's RNG states
  config.yaml             the resolved run config
  hf/                     the model's config, generation config and tokenizer (for export)
  COMPLETE                written last; only folders with it are ever resumed from

A checkpoint is written under `.global_step_N.tmp` and renamed once every rank is done, so a crash
mid-save never leaves a `global_step_N` that looks complete but isn't.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sfttrain.config import Config, ConfigError, TrainerConfig, to_yaml
from sfttrain.distributed import World, barrier

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position: the epoch being read ...
    consumed_in_epoch: int = 0  # ... and how many of its samples (in the seeded order) were used
    global_batch: int = 0
    seed: int = 0
    wandb_id: Optional[str] = None

    def advance(self, batch) -> None:
        self.step += 1
        self.epoch, self.consumed_in_epoch = batch.epoch, batch.consumed_in_epoch


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint in the run folder, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        m = STEP_DIR.match(name)
        path = os.path.join(run_dir, name)
        if m and os.path.isfile(os.path.join(path, COMPLETE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_resume(t: TrainerConfig, run_dir: str) -> Optional[str]:
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path" or t.resume_from_path:
        path = t.resume_from_path
        if not os.path.isfile(os.path.join(path, COMPLETE)):
            raise ConfigError(f"trainer.resume_from_path={path!r} is not a complete sfttrain checkpoint "
                              f"(no {COMPLETE} marker)")
        return path
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def save(run_dir: str, state: TrainState, model, optimizer, scheduler, world: World, cfg: Config, tokenizer,
         wandb_id: Optional[str] = None) -> str:
    final = os.path.join(run_dir, f"global_step_{state.step}")
    if os.path.isfile(os.path.join(final, COMPLETE)):
        return final  # this exact state is already committed
    tmp = os.path.join(run_dir, f".global_step_{state.step}.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
        os.makedirs(os.path.join(tmp, "rng"))
    barrier(world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{world.rank}.pt"))
    barrier(world)
    if world.is_main:
        extra = {**asdict(state), "wandb_id": wandb_id, "world_size": world.world_size,
                 "scheduler": scheduler.state_dict()}
        _write(os.path.join(tmp, "trainer_state.json"), json.dumps(extra, indent=1))
        _write(os.path.join(tmp, "config.yaml"), to_yaml(cfg))
        model.config.save_pretrained(os.path.join(tmp, "hf"))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(os.path.join(tmp, "hf"))
        tokenizer.save_pretrained(os.path.join(tmp, "hf"))
        _write(os.path.join(tmp, COMPLETE), "")
        os.replace(tmp, final)
        _fsync_dir(run_dir)
        enforce_retention(run_dir, cfg.trainer.max_ckpt_to_keep)
    barrier(world)
    return final


def load(path: str, model, optimizer, scheduler, world: World, cfg: Config) -> TrainState:
    with open(os.path.join(path, "trainer_state.json")) as f:
        extra = json.load(f)
    if extra["global_batch"] != cfg.data.train_batch_size or extra["seed"] != cfg.trainer.seed:
        raise ConfigError(f"{path} was written with data.train_batch_size={extra['global_batch']} and "
                          f"trainer.seed={extra['seed']}; resuming with other values would change which samples "
                          "come next. Use the same values, or trainer.resume_mode=disable to start afresh")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    scheduler.load_state_dict(extra["scheduler"])
    rng_file = os.path.join(path, "rng", f"rank_{world.rank}.pt")
    if extra["world_size"] == world.world_size:  # RNG streams are per rank: only restorable 1:1
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainState(extra["step"], extra["epoch"], extra["consumed_in_epoch"], extra["global_batch"],
                      extra["seed"], extra["wandb_id"])


def enforce_retention(run_dir: str, keep: Optional[int]) -> None:
    """Keeps the newest `keep` complete checkpoints, judged by what is on disk (so it holds
    across resumes). The marker goes first, so a half-deleted folder is never resumed from."""
    if not keep or keep <= 0:
        return
    for _, path in complete_checkpoints(run_dir)[:-keep]:
        os.remove(os.path.join(path, COMPLETE))
        shutil.rmtree(path)


def remove_stale_tmp(run_dir: str) -> None:
    if os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            if name.startswith(".global_step_") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
