"""LoRA adapters (peft) on the Hugging Face model: frozen base, trainable low-rank adapters.

With model.lora_rank > 0, `apply_lora` injects peft's LoRA layers into the loaded model in
place and returns the same Hugging Face model (peft's wrapper is dropped: `CausalLMLoss`, FSDP
and the checkpoints all work on the unmodified module tree, now with adapters inside it).

Precision: the frozen base is held in the compute dtype (`base_dtype`): its weights are never
updated, so an fp32 master copy would only cost memory (the bf16 forward casts them to bf16
anyway, so the arithmetic is the same). The adapters keep fp32 master weights and AdamW state
(peft's `autocast_adapter_dtype` lifts them from the base's bf16). Under FSDP2 one decoder layer
then holds bf16 frozen weights and fp32 adapters in one `fully_shard` group: the mixed-precision
policy casts both to bf16 for the all-gather, and only the adapters get gradients, all bf16,
reduced in fp32, so the group's all-gather and reduce-scatter each see one dtype.

Checkpoints hold the trainable weights only (`sfttrain.checkpoint`); the base is
model.partial_pretrain's, recorded by `base_identity` (name, hub revision, weight files' names and
sizes) with the adapters' rank, alpha and target modules (`trained_identity`): a resume or an export
onto another base, or a resume with other adapter settings, is refused (`check_base`). `sfttrain.export`
writes a peft adapter folder and a merged model.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import warnings

import torch
from torch import nn

from sfttrain import moe
from sfttrain.config import ConfigError, ModelConfig, mixed_precision_dtypes
from sfttrain.dtypes import CONFIG_NAMES, DTYPE
from sfttrain.errors import DependencyError

ALL_LINEAR = "all-linear"  # peft's spelling: every nn.Linear except the output layer


def base_dtype(cfg: ModelConfig) -> torch.dtype:
    """The frozen base's dtype: the compute dtype (mixed precision's param dtype, else model_dtype)."""
    dtypes = mixed_precision_dtypes(cfg.fsdp_config)
    return DTYPE[dtypes[0] if dtypes else cfg.fsdp_config.model_dtype]


def lora_config(cfg: ModelConfig, target_modules, target_parameters: list[str] | None = None):
    from peft import LoraConfig

    # target_parameters: a MoE's fused experts (sfttrain.moe.expert_lora_targets), only when there are some
    extra = {"target_parameters": target_parameters} if target_parameters else {}
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target_modules, bias="none", task_type="CAUSAL_LM", **extra)


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Injects the adapters into `model` (in place), everything else frozen; returns `model`.
    On a meta-device model the adapters are empty too: `sfttrain.weights` draws them
    (`init_adapter`) from the seed, so every rank and every rerun gets the same ones."""
    model = wrap(model, cfg).get_base_model()
    run_parameter_adapters_eager(model)
    if mixed_precision_dtypes(cfg.fsdp_config):
        # autocast (one device) or FSDP's param_dtype sets the GEMMs' dtype. peft would first cast
        # each adapter's bf16 input up to the fp32 adapter's dtype, which autocast casts straight
        # back down: two kernels per adapted layer, and a copy of the input saved for backward
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    return model


def wrap(model: nn.Module, cfg: ModelConfig):
    """peft's PeftModel around `model` (whose modules now hold the adapters); only the adapters
    require grad (peft freezes the rest)."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise DependencyError("model.lora_rank > 0 needs peft, one of sfttrain's own requirements: pip install "
                              "'peft>=0.21' (or pip install -e . in the checkout again)") from None
    target = check_target_modules(model, cfg.target_modules)
    experts, _ = moe.expert_lora_targets(model, cfg)
    with warnings.catch_warnings():
        # peft >= 0.21 converts transformers 4's expert names itself and checks the rank pattern it
        # adds for gate_up_proj against modules, not the parameters it applies to (it does apply)
        warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
        # PeftModel reads the model's is_gradient_checkpointing, which transformers 5 deprecates: a warning on
        # every LoRA run (and preflight) that the user can do nothing about
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, lora_config(cfg, target, experts), autocast_adapter_dtype=True)


def run_parameter_adapters_eager(model: nn.Module) -> None:
    """peft adapts a fused parameter (a MoE's experts) by registering a torch parametrization on the
    module at every forward and removing it after: module surgery that dynamo cannot trace (torch
    2.11 asserts in its guards on the parametrization's cache). The outermost such wrapper runs
    outside the compiled layer, a graph break on each side of the experts; the rest of the layer
    stays compiled. Eager runs are unchanged."""
    from peft.tuners.lora.layer import ParamWrapper

    nested = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for module in model.modules():
        if isinstance(module, ParamWrapper) and id(module) not in nested:
            module.forward = torch.compiler.disable(module.forward)


def describe(cfg: ModelConfig) -> list[str]:
    """The start-up line for LoRA (none without it)."""
    if cfg.lora_rank <= 0:
        return []
    base = CONFIG_NAMES[base_dtype(cfg)]
    return [f"  lora                : rank {cfg.lora_rank}, alpha {cfg.lora_alpha} (scale "
            f"{cfg.lora_alpha / cfg.lora_rank:g}), targets {cfg.target_modules}, dropout {cfg.lora_dropout}; "
            f"frozen base in {base}, adapters and AdamW state in fp32"]


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the model's nn.Linear modules, output layer excluded (the names
    peft's target_modules matches)."""
    output = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not output})


def check_target_modules(model: nn.Module, target_modules):
    """model.target_modules as peft takes it ("all-linear", or a list of names), each name checked
    against the model's linear layers."""
    if target_modules == ALL_LINEAR:
        return ALL_LINEAR
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    available = linear_module_names(model)
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
    # peft nests one wrapper per adapted parameter of a module (a MoE's experts.gate_up_proj and down_proj)
    return re.sub(r"(\.base_layer)+\.", ".", name)


def init_adapter(name: str, module: nn.Module) -> None:
    """peft's default initialisation of one adapter matrix (init_lora_weights=True): A as nn.Linear's
    own (Kaiming-uniform), B zero, so the adapted model starts equal to the base."""
    if ".lora_B." in name + ".":
        nn.init.zeros_(module.weight)
    else:
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))


def base_identity(name: str, folder: str) -> dict:
    """Which base a LoRA checkpoint adapts: model.partial_pretrain as given, the hub revision (the
    snapshot's commit, for a folder in the hub cache) and a cheap fingerprint of the weights: per
    weight or index file its size and a digest of three small samples of its bytes (start,
    middle, end), so another base of the same shapes differs too, for a few hundred KB read; and the
    absolute folder it was read from (an export from another working directory finds a relative
    model.partial_pretrain there)."""
    folder = os.path.abspath(folder)
    in_hub_cache = os.path.basename(os.path.dirname(folder)) == "snapshots"
    files = {os.path.basename(f): _file_fingerprint(f) for pattern in ("*.safetensors", "*.bin", "*.index.json")
             for f in sorted(glob.glob(os.path.join(folder, pattern)))}
    return {"name": name, "revision": os.path.basename(folder) if in_hub_cache else None, "files": files,
            "folder": folder}


def trained_identity(m: ModelConfig, folder: str) -> dict:
    """What a LoRA checkpoint's adapters are: the base's identity and the settings that fix the function
    the adapters compute (their shapes, where they sit, alpha's scale of their output)."""
    return {**base_identity(m.partial_pretrain, folder), "adapters": {f"model.{key}": getattr(m, key) for key in
                                                                        ("lora_rank", "lora_alpha", "target_modules")}}


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
    check_adapters(saved.get("adapters"), current.get("adapters"), what)
    revisions = saved["revision"] and current["revision"] and saved["revision"] != current["revision"]
    if saved["files"] == current["files"] and not revisions:
        return
    changed = sorted(name for name in set(saved["files"]) | set(current["files"])
                     if saved["files"].get(name) != current["files"].get(name))
    raise ConfigError(f"{what}: the LoRA adapters were trained on {_named(saved)}, but the base here is "
                      f"{_named(current)}, another model (weight files that differ: {changed[:4]}). Adapters "
                      "on another base compute something else: use the base they were trained on")


def check_adapters(saved: dict | None, current: dict | None, what: str) -> None:
    """Refuses `what` with adapter settings other than those the adapters were trained with (an export
    reads them from the checkpoint: it passes none)."""
    changed = [f"{key}: {saved[key]} -> {current[key]}" for key in saved or {}
               if key in (current or {}) and saved[key] != current[key]]
    if changed:
        raise ConfigError(f"{what}: the LoRA adapters were trained with other settings ({'; '.join(changed)}); "
                          "with these they would compute another function (alpha scales their output). Set them "
                          "back to resume, or start a new run (another trainer.default_local_dir, or "
                          "trainer.resume_mode=disable)")


def _named(identity: dict) -> str:
    return identity["name"] + (f" (revision {identity['revision']})" if identity["revision"] else "")
