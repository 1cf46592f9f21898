"""Start-up notes for keys set away from their default that this configuration never reads: accepted
(verl's command lines carry them), but said, with what would make them count."""

from __future__ import annotations

import os
from typing import Callable

from sfttrain.config.schema import Config, TrainerConfig, default_of, logger_names, short, value_of

# (the mode that leaves them unread, its section, the keys, why and what would read them)
_UNREAD: list[tuple[Callable[[Config], bool], str, tuple[str, ...], Callable[[Config], str]]] = [
    (lambda c: c.model.lora_rank <= 0, "model", ("lora_alpha", "target_modules", "lora_dropout"),
     lambda c: "model.lora_rank=0 trains every weight, no LoRA adapter; set model.lora_rank > 0 (e.g. 32) for LoRA"),
    (lambda c: c.data.multiturn.enable, "data",
     ("prompt_key", "response_key", "prompt_dict_keys", "response_dict_keys"),
     lambda c: "data.multiturn.enable=true reads conversations from data.multiturn.messages_key="
               f"{short(c.data.multiturn.messages_key)}"),
    (lambda c: not c.data.multiturn.enable, "data.multiturn",
     ("messages_key", "tools_key", "enable_thinking_key", "system_key"),
     lambda c: "rows are prompt/response pairs (data.prompt_key, data.response_key); set data.multiturn.enable=true "
               "for conversations"),
    (lambda c: c.optim.lr_scheduler == "constant", "optim", ("min_lr_ratio",),
     lambda c: "optim.lr_scheduler=constant never decays the LR; set optim.lr_scheduler=cosine to decay to lr * "
               "min_lr_ratio"),
    (lambda c: c.optim.lr_warmup_steps > 0 and c.optim.lr_warmup_steps_ratio != 0, "optim", ("lr_warmup_steps_ratio",),
     lambda c: f"optim.lr_warmup_steps={c.optim.lr_warmup_steps} sets the warmup; set optim.lr_warmup_steps=-1 to "
               "warm up over the ratio"),
    (lambda c: c.trainer.test_freq > 0 and c.data.val_files in (None, "", []), "trainer", ("test_freq",),
     lambda c: "no data.val_files to validate on; set data.val_files"),
    (lambda c: not c.trainer.async_save, "trainer",
     ("async_save_pinned", "async_save_in_flight", "async_save_writer", "async_save_staging"),
     lambda c: "trainer.async_save=false writes every checkpoint in the training loop; set trainer.async_save=true "
               "for background saves"),
]


def moot_settings(cfg: Config) -> list[str]:
    notes = []
    for unread, prefix, keys, why in _UNREAD:
        set_keys = [f"{key}={short(value_of(cfg, key))}" for key in (f"{prefix}.{k}" for k in keys)
                    if value_of(cfg, key) != default_of(key)]
        if set_keys and unread(cfg):
            notes.append(f"{', '.join(set_keys)} ignored: {why(cfg)}")
    return [f"  NOTE: {note}" for note in [*notes, *_moot_run_names(cfg.trainer)]]


def _moot_run_names(t: TrainerConfig) -> list[str]:
    # the names are wandb's run and project, and name the default run folder: with neither they label nothing
    if "wandb" in logger_names(t):
        return []
    folders = os.path.normpath(t.default_local_dir).split(os.sep)
    keys = [f"trainer.{key}={short(value)}" for key, value in (("project_name", t.project_name),
                                                               ("experiment_name", t.experiment_name))
            if value != default_of(f"trainer.{key}") and value not in folders]
    return [f"{', '.join(keys)} ignored: they name the wandb run and the default run folder, but trainer.logger="
            f"{short(t.logger)} has no wandb and trainer.default_local_dir={t.default_local_dir} is set; add wandb "
            "to trainer.logger to use them"] if keys else []
