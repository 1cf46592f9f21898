"""LoRA adapters (peft) injected in place into the Hugging Face model: the loss, FSDP and checkpoints
see the unmodified module tree. The frozen base is held in the compute dtype, the adapters in fp32.
Checkpoints record the base and settings they were trained with (`trained_identity`, `check_base`)."""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import warnings

import torch
from torch import nn

from sfttrain import moe, quant
from sfttrain.config import ConfigError, ModelConfig, mixed_precision_dtypes
from sfttrain.dtypes import CONFIG_NAMES, DTYPE

ALL_LINEAR = "all-linear"  # peft's spelling: every nn.Linear except the output layer


def base_dtype(cfg: ModelConfig) -> torch.dtype:
    dtypes = mixed_precision_dtypes(cfg.fsdp_config)
    return DTYPE[dtypes[0] if dtypes else cfg.fsdp_config.model_dtype]


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Injects the adapters into `model` in place, everything else frozen (model.base_quant: in 4
    bits); returns `model`. On the meta device sfttrain.weights draws them from the seed (`init_adapter`)."""
    model = wrap(model, cfg).get_base_model()
    run_parameter_adapters_eager(model)
    if cfg.base_quant != "none":
        quant.quantize_on_meta(model, cfg.base_quant)
    if mixed_precision_dtypes(cfg.fsdp_config):
        # the GEMMs' dtype is set by autocast or FSDP: peft's cast of the input up to the fp32
        # adapter's dtype would only be cast back down (and a copy saved for backward)
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    return model


def wrap(model: nn.Module, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    target = check_target_modules(model, cfg.target_modules)
    experts, _ = moe.expert_lora_targets(model, cfg)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=target, bias="none", task_type="CAUSAL_LM",
                        **({"target_parameters": experts} if experts else {}))
    with warnings.catch_warnings():
        # warnings the user can do nothing about: peft checks the rank pattern it adds for
        # gate_up_proj against modules (it does apply), and reads a deprecated transformers property
        warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, config, autocast_adapter_dtype=True)


def run_parameter_adapters_eager(model: nn.Module) -> None:
    """peft adapts a fused parameter (a MoE's experts) by registering a parametrization at every
    forward, which dynamo cannot trace: the outermost such wrapper runs outside the compiled layer."""
    from peft.tuners.lora.layer import ParamWrapper

    nested = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for module in model.modules():
        if isinstance(module, ParamWrapper) and id(module) not in nested:
            module.forward = torch.compiler.disable(module.forward)


def describe(cfg: ModelConfig) -> list[str]:
    if cfg.lora_rank <= 0:
        return []
    base = CONFIG_NAMES[base_dtype(cfg)]
    if cfg.base_quant != "none":
        base = f"{quant.HELD[cfg.base_quant]}; embeddings, norms and head in {base})"
    return [f"  lora                : rank {cfg.lora_rank}, alpha {cfg.lora_alpha} (scale "
            f"{cfg.lora_alpha / cfg.lora_rank:g}), targets {cfg.target_modules}, dropout {cfg.lora_dropout}; "
            f"frozen base in {base}, adapters and AdamW state in fp32"]


def check_target_modules(model: nn.Module, target_modules):
    """model.target_modules as peft takes it ("all-linear", or a list of names), each name checked
    against the leaf names of the model's linear layers but the output layer."""
    if target_modules == ALL_LINEAR:
        return ALL_LINEAR
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    output = model.get_output_embeddings()
    available = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, nn.Linear) and m is not output})
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise ConfigError(f"model.target_modules={names}: {unknown or 'no name'} names no linear layer of "
                          f"{type(model).__name__}; its linear layers are {available} (or use {ALL_LINEAR})")
    return names


def is_adapter_weight(name: str) -> bool:
    """A parameter (or module) name inside an adapter: `...q_proj.lora_A.default.weight`."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base model's own name of a parameter peft wrapped: `q_proj.base_layer.weight` -> `q_proj.weight`."""
    # one wrapper per adapted parameter of a module (a MoE's experts)
    return re.sub(r"(\.base_layer)+\.", ".", name)


def init_adapter(name: str, module: nn.Module) -> None:
    """peft's default initialisation of one adapter matrix (init_lora_weights=True): A as nn.Linear's
    own (Kaiming-uniform), B zero, so the adapted model starts equal to the base."""
    if ".lora_B." in name + ".":
        nn.init.zeros_(module.weight)
    else:
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))


def base_identity(name: str, folder: str) -> dict:
    """Which base a LoRA checkpoint adapts: model.partial_pretrain, the hub revision (a hub-cache
    snapshot's commit), per weight file its size and a digest of three 64 KiB samples (another base
    of the same shapes differs too), and the absolute folder (for an export run elsewhere)."""
    folder = os.path.abspath(folder)
    in_hub_cache = os.path.basename(os.path.dirname(folder)) == "snapshots"
    files = {os.path.basename(f): _file_fingerprint(f) for pattern in ("*.safetensors", "*.bin", "*.index.json")
             for f in sorted(glob.glob(os.path.join(folder, pattern)))}
    return {"name": name, "revision": os.path.basename(folder) if in_hub_cache else None, "files": files,
            "folder": folder}


def trained_identity(m: ModelConfig, folder: str) -> dict:
    """The base's identity and the adapter settings that fix the function the adapters compute."""
    keys = ("lora_rank", "lora_alpha", "target_modules", "base_quant")
    return {**base_identity(m.partial_pretrain, folder), "adapters": {f"model.{key}": getattr(m, key) for key in keys}}


def _file_fingerprint(path: str, sample: int = 1 << 16) -> list:
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
            f.seek(offset)
            digest.update(f.read(sample))
    return [size, digest.hexdigest()[:16]]


def check_base(saved: dict | None, current: dict, what: str) -> None:
    """Refuses `what` (a resume, an export) of adapters trained on `saved` onto the base `current`."""
    if saved is None:  # written before checkpoints recorded their base
        return
    adapters, now = saved.get("adapters") or {}, current.get("adapters") or {}  # an export passes none
    changed = [f"{key}: {adapters[key]} -> {now[key]}" for key in adapters if key in now and adapters[key] != now[key]]
    if changed:
        raise ConfigError(f"{what}: the LoRA adapters were trained with other settings ({'; '.join(changed)}); "
                          "with these they would compute another function (alpha scales their output). Set them "
                          "back to resume, or start a new run (another trainer.default_local_dir, or "
                          "trainer.resume_mode=disable)")
    revisions = saved["revision"] and current["revision"] and saved["revision"] != current["revision"]
    if saved["files"] == current["files"] and not revisions:
        return
    changed = sorted(name for name in set(saved["files"]) | set(current["files"])
                     if saved["files"].get(name) != current["files"].get(name))
    raise ConfigError(f"{what}: the LoRA adapters were trained on {_named(saved)}, but the base here is "
                      f"{_named(current)}, another model (weight files that differ: {changed[:4]}). Adapters "
                      "on another base compute something else: use the base they were trained on")


def _named(identity: dict) -> str:
    return identity["name"] + (f" (revision {identity['revision']})" if identity["revision"] else "")
