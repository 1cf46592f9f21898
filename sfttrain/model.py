"""Load the Hugging Face model and tokenizer; choose the attention backend; apply Liger."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sfttrain import attention
from sfttrain.config import ConfigError, ModelConfig

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(cfg: ModelConfig):
    _check_folder(cfg.partial_pretrain)
    # samples longer than the tokenizer's model_max_length are handled by data.truncation
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(cfg.partial_pretrain, trust_remote_code=cfg.trust_remote_code)


@dataclass
class LoadedModel:
    model: nn.Module
    attn_backend: str
    liger: bool  # Liger's kernels patched in, and its fused loss to be used


def load_model(cfg: ModelConfig, device: torch.device, seed: int) -> LoadedModel:
    """The model on CPU in model_dtype (sharding moves it to the device), with the packed
    varlen attention installed."""
    path = cfg.partial_pretrain
    _check_folder(path)
    backend = attention.select_backend(cfg.attn_implementation, device.type)
    attention.configure(backend)
    kwargs = dict(dtype=DTYPE[cfg.fsdp_config.model_dtype], attn_implementation=attention.ATTN_IMPLEMENTATION,
                  trust_remote_code=cfg.trust_remote_code)
    if cfg.random_init:
        torch.manual_seed(seed)  # every rank builds the same weights
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        if not _has_weights(path):
            raise ConfigError(f"model.partial_pretrain={path!r} has a config but no weights (*.safetensors / *.bin); "
                              "set model.random_init=true to train from a random initialisation")
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    try:
        attention.check_model(model.config, backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model.config.use_cache = False  # training never reuses a KV cache
    return LoadedModel(model, backend, cfg.use_liger and apply_liger(model, device, cfg.compile))


def apply_liger(model: nn.Module, device: torch.device, compile_layers: bool) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE kernels, patched into this model instance. The fused
    linear cross-entropy is called by sfttrain.loss itself (with the labels, so it really runs).
    On CPU (Liger's kernels are Triton, GPU-only) it warns and returns False."""
    if device.type != "cuda":
        logging.getLogger("sfttrain").warning("model.use_liger=true ignored: Liger's kernels need a CUDA device")
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError:
        raise ConfigError("model.use_liger=true but liger-kernel is not installed: pip install 'sfttrain[gpu]' "
                          "or set model.use_liger=false") from None
    if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"Liger has no kernels for model type {model.config.model_type!r}; set model.use_liger=false")
    # with model.compile, inductor fuses norm/SwiGLU/RoPE itself (and cannot trace Liger's autograd
    # functions): only Liger's fused loss is used then
    kernels = not compile_layers
    _apply_liger_kernel_to_instance(model=model, rope=kernels, rms_norm=kernels, swiglu=kernels,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (each becomes one FSDP unit)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (_no_split_modules={names})")
    return layers


def _check_folder(path: str) -> None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.partial_pretrain={path!r} is not a local model folder with a config.json "
                          "(sfttrain does not download from a hub: download the model first)")


def _has_weights(path: str) -> bool:
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))
