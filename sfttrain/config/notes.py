"""Start-up lines (the run's and the preflight's) for keys set away from their default that this
configuration never reads: accepted, as verl's command lines carry them into modes where they mean
nothing, but said, with what would make them count. Contradictions are refused in `validate`."""

from __future__ import annotations

import os
from typing import Any

from sfttrain.config.schema import Config, DataConfig, ModelConfig, OptimConfig, TrainerConfig, default_of, logger_names, short


def moot_settings(cfg: Config) -> list[str]:
    notes = [*_moot_lora(cfg.model), *_moot_data_keys(cfg.data), *_moot_schedule(cfg.optim),
             *_moot_validation(cfg), *_moot_async_save(cfg.trainer), *_moot_run_names(cfg.trainer)]
    return [f"  NOTE: {note}" for note in notes]


def _set_keys(section: Any, prefix: str, keys: tuple[str, ...]) -> list[str]:
    """`prefix.key=value` of those keys whose value differs from the schema's default."""
    values = {key: getattr(section, key) for key in keys}
    return [f"{prefix}.{key}={short(value)}" for key, value in values.items()
            if value != default_of(f"{prefix}.{key}")]


def _moot_lora(m: ModelConfig) -> list[str]:
    # verl's LoRA keys sit in its model section beside lora_rank; 0 trains every weight, no adapter
    if m.lora_rank > 0 or not (keys := _set_keys(m, "model", ("lora_alpha", "target_modules", "lora_dropout"))):
        return []
    return [f"{', '.join(keys)} ignored: model.lora_rank=0 trains every weight, no LoRA adapter; set model.lora_rank "
            "> 0 (e.g. 32) for LoRA"]


def _moot_data_keys(d: DataConfig) -> list[str]:
    # conversations are read from the messages column(s), prompt/response rows from the prompt and
    # response columns: the other mode's keys are read by nothing
    if d.multiturn.enable:
        keys = _set_keys(d, "data", ("prompt_key", "response_key", "prompt_dict_keys", "response_dict_keys"))
        return [f"{', '.join(keys)} ignored: data.multiturn.enable=true reads conversations from "
                f"data.multiturn.messages_key={short(d.multiturn.messages_key)}"] if keys else []
    keys = _set_keys(d.multiturn, "data.multiturn", ("messages_key", "tools_key", "enable_thinking_key", "system_key"))
    return [f"{', '.join(keys)} ignored: rows are prompt/response pairs (data.prompt_key, data.response_key); set "
            "data.multiturn.enable=true for conversations"] if keys else []


def _moot_schedule(o: OptimConfig) -> list[str]:
    notes = []
    if o.lr_scheduler == "constant" and o.min_lr_ratio != default_of("optim.min_lr_ratio"):
        notes.append(f"optim.min_lr_ratio={o.min_lr_ratio} ignored: optim.lr_scheduler=constant never decays the LR; "
                     "set optim.lr_scheduler=cosine to decay to lr * min_lr_ratio")
    if o.lr_warmup_steps > 0 and o.lr_warmup_steps_ratio not in (0, default_of("optim.lr_warmup_steps_ratio")):
        notes.append(f"optim.lr_warmup_steps_ratio={o.lr_warmup_steps_ratio} ignored: optim.lr_warmup_steps="
                     f"{o.lr_warmup_steps} sets the warmup; set optim.lr_warmup_steps=-1 to warm up over the ratio")
    return notes


def _moot_validation(cfg: Config) -> list[str]:
    # verl's scripts pass test_freq with val_files; without them there is nothing to validate on
    t = cfg.trainer
    if t.test_freq > 0 and cfg.data.val_files in (None, "", []):
        return [f"trainer.test_freq={t.test_freq} ignored: no data.val_files to validate on; set data.val_files"]
    return []


def _moot_async_save(t: TrainerConfig) -> list[str]:
    keys = _set_keys(t, "trainer", ("async_save_pinned", "async_save_in_flight", "async_save_writer",
                                    "async_save_staging"))
    if t.async_save or not keys:
        return []
    return [f"{', '.join(keys)} ignored: trainer.async_save=false writes every checkpoint in the training loop; set "
            "trainer.async_save=true for background saves"]


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


