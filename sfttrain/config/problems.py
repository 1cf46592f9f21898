"""Checks of the configuration that need no world size and no data, per section, each problem naming
the key to change (batch arithmetic that needs the world size is in `sfttrain.data.batching`); and the
notes for keys set away from their default that this configuration never reads: accepted (verl's command
lines carry them), but said, with what would make them count."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Optional

from omegaconf import ListConfig

from sfttrain.config.compat import verl_switch_problems
from sfttrain.config.schema import (DTYPES, LOGGERS, Config, DataConfig, FSDPConfig, ModelConfig, OptimConfig,
                                    TrainerConfig, as_list, default_of, logger_names, schema_fields, short, value_of)
from sfttrain.errors import ConfigError


def _choice(key: str, value: Any, choices: tuple) -> Iterator[str]:
    if value not in choices:
        yield f"{key}={value!r} is not one of {list(choices)}"


def config_problems(cfg: Config) -> list[str]:
    """Every problem, each once, so that a config is fixed in one go."""
    problems = list(cfg.load_problems)
    for key, f in schema_fields():  # every key outside the values, or below the least, its schema field names
        value, least, default = value_of(cfg, key), f.metadata["minimum"], default_of(key)
        problems += _choice(key, value, f.metadata["choices"]) if f.metadata["choices"] else ()
        if least is not None and value is not None and value < least:
            instead = f"{key}={default}" if default is not None else f"{key}={least}, or null (the default)"
            problems.append(f"{key}={value} is {'negative' if least == 0 else f'below {least}'}; "
                            f"{f.metadata['help']}: e.g. {instead}")
    problems += [*_validate_data(cfg.data), *_validate_model(cfg.model), *verl_switch_problems(cfg),
                 *_validate_fsdp(cfg), *_validate_optim(cfg.optim), *_validate_trainer(cfg.trainer),
                 *_validate_fp8(cfg)]
    return list(dict.fromkeys(problems))


def check_sequence_parallel_size(sp: int) -> None:
    """The world check's (sfttrain.distributed), which both the run and the preflight run."""
    if sp < 1:
        raise ConfigError(f"ulysses_sequence_parallel_size must be >= 1 (1: off), got {sp}")


def rendering_problems(max_length: int, truncation: str) -> Iterator[str]:
    """The config's; the start-up's data scan is not run past them (a renderer cannot take them)."""
    if max_length <= 0:
        yield f"data.max_length must be positive, got {max_length}"
    if max_length == 1:
        yield "data.max_length=1 leaves no token to train on (a prompt token, then its next); use at least 2"
    yield from _choice("data.truncation", truncation, ("error", "left", "right"))


def _validate_data(d: DataConfig) -> Iterator[str]:
    if d.train_files in (None, "", []):
        yield ("data.train_files is required: a Parquet, JSON Lines, JSON or CSV file, a directory or a "
               "pattern of them, or a list of these")
    yield from rendering_problems(d.max_length, d.truncation)
    if d.max_token_len_per_gpu is not None and d.max_token_len_per_gpu < d.max_length:
        yield (f"data.max_token_len_per_gpu={d.max_token_len_per_gpu} is below data.max_length="
               f"{d.max_length}: a longest sample would not fit; raise it or lower data.max_length")
    if d.prompt_key is None and not d.multiturn.enable and d.apply_chat_template:
        yield ("data.prompt_key=null trains whole texts without a prompt, which a chat template would "
               "render as an empty user turn: set data.apply_chat_template=false")
    if d.prompt_key is not None and not _columns(d.prompt_key):
        yield (f"data.prompt_key={d.prompt_key!r}: give a column name, null, or a list of columns whose texts are "
               "joined into the prompt, e.g. [instruction,input]")
    elif len(as_list(d.prompt_key)) > 1 and d.prompt_dict_keys:
        yield (f"data.prompt_dict_keys with data.prompt_key={as_list(d.prompt_key)}: nested keys follow one column; "
               "give data.prompt_key one column, or remove data.prompt_dict_keys")
    if not _columns(d.multiturn.messages_key):
        yield (f"data.multiturn.messages_key={d.multiturn.messages_key!r}: give a column name, or a list of columns "
               "whose message lists make one conversation, e.g. [prompt,completion]")
    if d.multiturn.enable and not d.apply_chat_template:
        yield ("data.multiturn.enable=true renders conversations with a chat template: remove "
               "data.apply_chat_template=false (data.chat_template=... sets a template of your own)")
    if d.chat_template is not None and not d.apply_chat_template and not d.multiturn.enable:
        yield (f"data.chat_template={short(d.chat_template)} with data.apply_chat_template=false: the raw "
               "prompt text is tokenized, so the template would render nothing; remove data.chat_template "
               "for raw text, or remove data.apply_chat_template=false to render prompts with it")
    if d.prompt_key is None and d.prompt_dict_keys:
        yield (f"data.prompt_dict_keys={list(d.prompt_dict_keys)} with data.prompt_key=null: there is no "
               "prompt column to follow them into; set data.prompt_key to the column that holds them, or "
               "remove data.prompt_dict_keys")
    keys = as_list(d.prompt_key)  # one column read at two nested keys (verl's extra_info: question, answer): two cells
    prompts = [[*keys[:1], *(d.prompt_dict_keys or [])], *([key] for key in keys[1:])]
    if keys and not d.multiturn.enable and [d.response_key, *(d.response_dict_keys or [])] in prompts:
        yield (f"data.prompt_key={d.prompt_key!r} and data.response_key={d.response_key!r} read the same cell: each "
               "sample would be its answer after itself as the prompt; set data.response_key to the answers' column "
               "(or data.prompt_dict_keys / data.response_dict_keys to a nested column's two fields)")


def _columns(value: Any) -> bool:
    return (isinstance(value, str) and value != "" or isinstance(value, (list, tuple, ListConfig)) and len(value) > 0
            and all(isinstance(k, str) and k for k in value))


def _validate_model(m: ModelConfig) -> Iterator[str]:
    if m.partial_pretrain in (None, ""):
        yield "model.partial_pretrain is required: a local Hugging Face model folder or a hub id"
    if not 0.0 < m.gradient_checkpointing_ratio <= 1.0:
        yield (f"model.gradient_checkpointing_ratio must lie in (0, 1], got {m.gradient_checkpointing_ratio}; "
               "set model.enable_gradient_checkpointing=false to recompute no layer")
    for key, value in (("gradient_checkpointing_ratio", m.gradient_checkpointing_ratio),
                       ("recompute_attention", m.recompute_attention)):  # what shapes it, set with it off
        if not m.enable_gradient_checkpointing and value != default_of(f"model.{key}"):
            yield (f"model.{key}={str(value).lower()} shapes gradient checkpointing, which "
                   "model.enable_gradient_checkpointing=false turns off (every activation kept): set "
                   f"model.enable_gradient_checkpointing=true, or remove model.{key}")
    # the switches of the compiled layers, and what each needs
    if m.compile_cpp_wrapper in (True, False) and not m.compile:
        yield (f"model.compile_cpp_wrapper={str(m.compile_cpp_wrapper).lower()} chooses who launches the "
               "compiled layers' kernels, but model.compile=false runs them eagerly: set "
               "model.compile=true, or remove model.compile_cpp_wrapper")
    if m.fuse_projections is True and not m.compile:
        yield ("model.fuse_projections=true rewrites the compiled layers' graphs: set model.compile=true, "
               "or remove model.fuse_projections")
    if m.recompute_qkv is False and not (m.enable_gradient_checkpointing and m.fuses_projections()):
        yield ("model.recompute_qkv=false keeps the fused q/k/v GEMM's output of checkpointed, compiled "
               "layers: it needs model.enable_gradient_checkpointing=true, model.compile=true and fused "
               "projections (model.fuse_projections=true; auto fuses them with LoRA only); set those "
               "or remove model.recompute_qkv")
    if m.fold_lora is True and not (m.lora_rank > 0 and m.fuses_projections()):
        yield ("model.fold_lora=true folds LoRA adapters into the fused projections of compiled layers: "
               "it needs model.lora_rank > 0, model.compile=true and fused projections "
               "(model.fuse_projections auto or true); set those or remove model.fold_lora")
    if m.fold_lora is True and m.lora_dropout > 0:
        yield (f"model.fold_lora=true with model.lora_dropout={m.lora_dropout}: an adapter folded into its "
               "frozen projection's GEMM reads that projection's input, but with dropout its A reads a "
               "dropped-out copy, so nothing would fold; set model.lora_dropout=0 or remove model.fold_lora")
    if m.lora_rank > 0 and not 0.0 <= m.lora_dropout < 1.0:
        yield f"model.lora_dropout must lie in [0, 1), got {m.lora_dropout}"
    names = m.target_modules  # checked against the model's layers at load (sfttrain.lora)
    if m.lora_rank > 0 and not (isinstance(names, str) or
                                isinstance(names, list) and all(isinstance(n, str) for n in names)):
        yield f"model.target_modules must be all-linear or a list of linear layer names, got {names!r}"


def _validate_fsdp(cfg: Config) -> Iterator[str]:
    f, no_shard = cfg.model.fsdp_config, cfg.model.fsdp_config.sharding_strategy == "NO_SHARD"
    key = "model.fsdp_config.sharding_strategy=NO_SHARD (every rank holds the whole model)"  # DDP: no FSDP shards
    if no_shard and f.fsdp_size not in (-1, 0, 1):
        yield (f"{key} contradicts fsdp_size={f.fsdp_size}; remove fsdp_size, or use HYBRID_SHARD for "
               "shard groups of that size")
    if no_shard and f.offloaded():
        yield f"{key}: CPU offload moves FSDP's shards to the host; use FULL_SHARD with cpu_offload=true"
    if no_shard and cfg.ulysses_sequence_parallel_size > 1:
        yield (f"{key}: Ulysses ranks share one copy of the weights through FSDP; use FULL_SHARD with "
               "ulysses_sequence_parallel_size > 1")
    if f.backward_prefetch not in (None, "BACKWARD_PRE"):
        yield ("model.fsdp_config.backward_prefetch: FSDP2 always prefetches the next layer's "
               "all-gather in backward (BACKWARD_PRE); remove the key or set it to BACKWARD_PRE")
    if f.wrap_policy not in (None, {}, {"min_num_params": 0}):
        yield ("model.fsdp_config.wrap_policy: sfttrain shards every decoder layer and the root; "
               "a custom wrap policy is not supported, remove the key")
    try:
        dtypes = mixed_precision_dtypes(f) or ()
    except ConfigError as e:
        yield str(e)
        dtypes = ()
    if "fp16" in (f.model_dtype, *dtypes):
        yield ("fp16 (model.fsdp_config.model_dtype or mixed_precision) needs loss scaling, which sfttrain "
               "does not implement (small gradients would underflow to zero); use bf16")


def _validate_optim(o: OptimConfig) -> Iterator[str]:
    yield from _choice("optim.optimizer", o.optimizer.lower(), ("adamw",))
    for key, value in (("optim.lr", o.lr), ("optim.eps", o.eps), ("optim.weight_decay", o.weight_decay),
                       ("optim.clip_grad", o.clip_grad)):
        if not math.isfinite(value):
            yield (f"{key}={value} is not a finite number; set a number such as its default "
                   f"{default_of(key)}")
    # torch's AdamW checks betas, eps and weight decay in its defaults only, not in parameter groups
    if len(o.betas) != 2:
        yield f"optim.betas must have two values, got {o.betas}"
    elif not all(0.0 <= beta < 1.0 for beta in o.betas):
        yield (f"optim.betas={list(o.betas)}: each must lie in [0, 1), such as its default "
               f"{default_of('optim.betas')}")
    if not 0.0 <= o.lr_warmup_steps_ratio <= 1.0 or not 0.0 <= o.min_lr_ratio <= 1.0:
        yield "optim.lr_warmup_steps_ratio and optim.min_lr_ratio must lie in [0, 1]"


def _validate_trainer(t: TrainerConfig) -> Iterator[str]:
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 0:
        yield (f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep}: set N > 0 to keep this run's newest N "
               "checkpoints, or null (the default; 0 is the same, as in verl) to keep every one")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield "trainer.resume_mode=resume_path needs trainer.resume_from_path"
    if t.resume_mode == "disable" and t.resume_from_path:  # verl ignores the path: which was meant?
        yield (f"trainer.resume_mode=disable starts afresh, so trainer.resume_from_path="
               f"{t.resume_from_path} would be ignored: drop trainer.resume_from_path to start afresh, or "
               "drop trainer.resume_mode=disable (trainer.resume_mode=resume_path) to resume from it")
    if t.resume_mode == "disable" and t.resume_allow_data_change:
        yield ("trainer.resume_allow_data_change=true lets a resume go on with changed data, but "
               "trainer.resume_mode=disable never resumes: remove trainer.resume_allow_data_change to "
               "start afresh, or remove trainer.resume_mode=disable to resume")
    steps = t.profile_steps
    if steps and (min(steps) < 1 or sorted(steps) != list(range(min(steps), max(steps) + 1))):
        yield (f"trainer.profile_steps={list(steps)}: give consecutive step numbers from 1 on, once each, "
               "e.g. [11, 12, 13] (one window is profiled)")
    if t.profile_memory and not t.profile_steps:
        yield ("trainer.profile_memory=true records memory over trainer.profile_steps: name those steps "
               "too, e.g. trainer.profile_steps=[11]")
    for name in logger_names(t):
        if name not in LOGGERS:  # verl's list is longer: say what there is instead
            yield (f"trainer.logger={name!r} is not one of {list(LOGGERS)}. Every run writes its metrics "
                   "to <run folder>/metrics.jsonl (`python -m sfttrain.plot <run folder>` draws them); for "
                   "a dashboard use wandb (WANDB_MODE=offline keeps it on this machine)")


def _validate_fp8(cfg: Config) -> Iterator[str]:
    """The device and torchao are checked at start-up (sfttrain.fp8)."""
    m, sp = cfg.model, cfg.ulysses_sequence_parallel_size
    if m.fp8 == "off" and not m.fp8_fast_accum_grads:
        yield ("model.fp8_fast_accum_grads=false sets how FP8 gradient GEMMs accumulate, but model.fp8=off "
               "runs none: set model.fp8 (tensorwise, rowwise or auto), or remove "
               "model.fp8_fast_accum_grads")
    # the weight gradient's GEMM runs over a rank's tokens, a dimension FP8 wants divisible by 16
    if m.fp8 != "off" and sp >= 1 and cfg.data.pad_to_multiple % (16 * sp) != 0:
        yield (f"model.fp8={m.fp8} needs data.pad_to_multiple={cfg.data.pad_to_multiple} to be a multiple "
               f"of {16 * sp} (16 tokens per rank{f' x {sp} Ulysses ranks' if sp > 1 else ''}: FP8 GEMMs "
               f"take dimensions that divide by 16); set data.pad_to_multiple={math.lcm(128, 16 * sp)}")
    if m.fp8 != "off" and m.lora_rank > 0:
        yield (f"model.fp8={m.fp8} with model.lora_rank={m.lora_rank}: FP8 linear layers compute the "
               "weight gradient of the frozen base too (work LoRA skips in bf16), so they would slow "
               "LoRA down; set model.fp8=off for LoRA")
    for key, value, moot in (("recompute_qkv", False, "there is no q/k/v GEMM output to keep"),
                             ("fuse_projections", True, "the setting would fuse nothing")):
        if m.fp8 != "off" and getattr(m, key) is value:
            yield (f"model.fp8={m.fp8} with model.{key}={str(value).lower()}: FP8 linear layers are not fused "
                   f"(sfttrain/fuse_projections.py), so {moot}; remove model.{key} or set model.fp8=off")


def mixed_precision_dtypes(f: FSDPConfig) -> Optional[tuple[str, str]]:
    """(param_dtype, reduce_dtype) for FSDP's MixedPrecisionPolicy, None for none; verl's bool or dict."""
    mp = f.mixed_precision
    if mp is False or mp is None:
        return None
    if mp is True:
        return ("bf16", "fp32")
    if isinstance(mp, dict):
        unknown = set(mp) - {"param_dtype", "reduce_dtype", "buffer_dtype"}
        if unknown:
            raise ConfigError(f"model.fsdp_config.mixed_precision: unknown keys {sorted(unknown)}")
        param, reduce = mp.get("param_dtype", "bf16"), mp.get("reduce_dtype", "fp32")
        for key, value in (("param_dtype", param), ("reduce_dtype", reduce)):
            for problem in _choice(f"model.fsdp_config.mixed_precision.{key}", value, DTYPES):
                raise ConfigError(problem)
        return (param, reduce)
    raise ConfigError(f"model.fsdp_config.mixed_precision must be true, false or a dict, got {mp!r}")


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
    # the run names are wandb's run and project, and name the default run folder: with neither they label nothing
    t, folders = cfg.trainer, os.path.normpath(cfg.trainer.default_local_dir).split(os.sep)
    keys = [f"trainer.{key}={short(value)}" for key, value in (("project_name", t.project_name),
                                                               ("experiment_name", t.experiment_name))
            if value != default_of(f"trainer.{key}") and value not in folders]
    if keys and "wandb" not in logger_names(t):
        notes.append(f"{', '.join(keys)} ignored: they name the wandb run and the default run folder, but "
                     f"trainer.logger={short(t.logger)} has no wandb and trainer.default_local_dir="
                     f"{t.default_local_dir} is set; add wandb to trainer.logger to use them")
    return [f"  NOTE: {note}" for note in notes]
