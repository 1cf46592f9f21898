"""Reading a checkpoint back: the resume's load (exact or elastic), the model-match check, each
rank's RNG state, and the train state that a checkpoint records."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from sfttrain.checkpoint_folder import damaged_error, read_state
from sfttrain.checkpoint_writer import one_line
from sfttrain.config import Config, ConfigError
from sfttrain.distributed import World, agree_on_errors
from sfttrain.metrics import rewind_metrics
from sfttrain.optim import set_step

# a checkpoint holds what training changes: frozen weights (LoRA's base) come from model.partial_pretrain.
# Not strict: check_same_model has matched the trained weights' names.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
MODEL_PREFIX = "model."  # the DCP state dict is {"model": hf_state_dict, "optim": ...}
# what torch.load and DCP's metadata reader raise on a file that does not read back
UNREADABLE = (OSError, RuntimeError, EOFError, pickle.UnpicklingError)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position: the epoch being read ...
    consumed_in_epoch: int = 0  # ... and how many of its samples (in the seeded order) were used
    global_batch: int = 0
    seed: int = 0
    wandb_id: Optional[str] = None
    data: Optional[dict] = None  # the data fingerprint (sfttrain.data.prepare)
    schedule: Optional[dict] = None  # the optimizer and LR schedule settings (sfttrain.optim.schedule_settings)
    run_id: Optional[str] = None  # the run these checkpoints belong to (sfttrain.resume)
    base: Optional[dict] = None  # LoRA: the base and the adapter settings they are trained with (lora.trained_identity)

    def advance(self, batch) -> None:
        self.step += 1
        self.epoch, self.consumed_in_epoch = batch.epoch, batch.consumed_in_epoch


def load(path: str, model, optimizer, scheduler, world: World, cfg: Config, current: TrainState) -> TrainState:
    """Collective. Restores model, optimizer and (same world size only: they are per rank) RNG states,
    puts the optimizer and LR schedule at the checkpoint's step with the current config's settings,
    and returns `current` at the checkpoint's step and data position."""
    extra = read_state(path)
    model_sd, optim_sd = state_dicts(model, optimizer)
    check_same_model(path, model_sd)
    with read_back(path):
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=STATE_DICT_OPTIONS)
    del model_sd, optim_sd
    assert current.schedule is not None  # this run's own state, made with its schedule
    set_step(optimizer, scheduler, cfg.optim, current.schedule["total steps"], extra["step"])
    if extra["world_size"] == world.world_size and (rng := _read_rng_states(path, world)):
        set_rng_state(rng)
    state = dataclasses.replace(current, step=extra["step"], epoch=extra["epoch"],
                                consumed_in_epoch=extra["consumed_in_epoch"], wandb_id=extra["wandb_id"])
    if world.is_main:
        run_dir = cfg.trainer.default_local_dir
        rewind_metrics(run_dir, state.step,
                       {"step": state.step, "event": "resumed", "from": os.path.abspath(path),
                        "saved_world_size": extra["world_size"], "world_size": world.world_size},
                       own=os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(run_dir))
    return state


@contextlib.contextmanager
def read_back(path: str):
    """DCP's reads of shards that do not read back (changed, though of the sizes COMPLETE lists) end
    with the damaged-checkpoint error on every rank (DCP gathers every rank's failures)."""
    try:
        yield
    except CheckpointException as e:
        if e.args[0] != "read":  # a failure of DCP's planning, not of the files
            raise
        causes = sorted({_first_sentence(exc) for exc, _ in e.failures.values()})
        raise damaged_error(path, f"its shards do not read back ({'; '.join(causes)})") from None


def _read_rng_states(path: str, world: World) -> Optional[dict]:
    """Collective: this rank's RNG states (None without the file). A file that does not read back on
    any rank fails every rank at once: a rank failing alone would leave the others waiting."""
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


def state_dicts(model, optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts, frozen weights left out."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    return trained_state_dict(model, model_sd), optim_sd


def trained_state_dict(model, model_sd: Optional[dict] = None) -> dict:
    """The model's part of a checkpoint (the preflight's: of the model built on the meta device).
    ignore_frozen_params keeps a frozen weight tied to a trained one (LoRA's lm_head.weight)."""
    model_sd = get_model_state_dict(model, options=STATE_DICT_OPTIONS) if model_sd is None else model_sd
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def model_tensors(path: str) -> dict[str, TensorStorageMetadata]:
    """HF name -> DCP metadata of a checkpoint's model tensors, in the order they were saved."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except UNREADABLE as e:
        raise damaged_error(path, f"it does not read back ({_first_sentence(e)})") from None
    return {k[len(MODEL_PREFIX):]: md for k, md in metadata.state_dict_metadata.items()
            if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}


def check_same_model(path: str, model_sd: dict) -> None:
    """A checkpoint of another model fails here with names and shapes, not deep inside DCP."""
    stored = model_tensors(path)
    missing = sorted(set(model_sd) - set(stored))
    extra = sorted(set(stored) - set(model_sd))  # e.g. adapters on other layers (model.target_modules)
    shapes = [f"{k}: checkpoint {tuple(stored[k].size)} vs model {tuple(v.shape)}" for k, v in model_sd.items()
              if k in stored and tuple(stored[k].size) != tuple(v.shape)]
    if missing or extra or shapes:
        raise ConfigError(f"{path} was written for another model than model.partial_pretrain (or another "
                          f"LoRA setup: model.lora_rank, model.target_modules): {len(missing)} weights missing "
                          f"{missing[:5]}, "
                          f"{len(extra)} not in this model {extra[:5]}, {len(shapes)} of other shapes {shapes[:3]}. "
                          "Resume with the same model and LoRA keys, or use trainer.resume_mode=disable (or a new "
                          "trainer.default_local_dir) to start afresh")


def estimated_bytes(model) -> int:
    """A checkpoint's size before the first is written: each trained weight under each of its names
    and AdamW's two moments of each unique one; a DTensor whole (DCP writes each element once)."""
    named = model.state_dict(keep_vars=True)
    trained = [t for t in named.values() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    unique = {id(t): t for t in trained}.values()
    return sum(t.numel() * t.element_size() for t in trained) + 2 * sum(t.numel() * t.element_size() for t in unique)


def rng_state() -> dict:
    """Every RNG's state as tensors, ints and lists only: it loads with torch.load(weights_only=True),
    so a checkpoint file is never unpickled (a pickle can run code)."""
    version, mt_state, gauss = random.getstate()
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # numpy's global RandomState is an MT19937, whose legacy state is a tuple
    name, keys, pos, has_gauss, cached = legacy
    state = {"python": [version, list(mt_state), gauss], "numpy": [name, torch.from_numpy(keys.astype(np.int64)),
                                                                    pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
