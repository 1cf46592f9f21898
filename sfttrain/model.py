"""Load the Hugging Face model and tokenizer; choose the attention backend; apply Liger."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sfttrain import attention, lora, weights
from sfttrain.checkpoint_folder import not_a_model_folder, weight_files
from sfttrain.config import Config, ConfigError, ModelConfig
from sfttrain.dtypes import DTYPE
from sfttrain.errors import GPU_INSTALL, DependencyError
from sfttrain.faults import unreadable
from sfttrain.hub import local_model_path, model_config
from sfttrain.loss import CausalLM, output_head
from sfttrain.moe import RouterBalance, implementation_for


def load_tokenizer(cfg: ModelConfig, chat_template: str | None = None):
    path = local_model_folder(cfg)
    # samples longer than the tokenizer's model_max_length are handled by data.truncation
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # files to fix: JSON that does not parse, or what the tokenizers library cannot read
        raise ConfigError(f"model.partial_pretrain={cfg.partial_pretrain!r}: its tokenizer does not load from {path} "
                          f"({type(e).__name__}: {str(e).splitlines()[0]}); restore the model's own tokenizer files "
                          "(tokenizer.json, tokenizer_config.json)") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def check_max_length(cfg: Config, folder: str) -> None:
    """Refuses data.max_length above the model's positions (a packed row restarts them per sample)."""
    config = model_config(folder, cfg.model.trust_remote_code)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cfg.data.max_length > limit and not cfg.data.allow_beyond_max_position:
        raise ConfigError(f"data.max_length={cfg.data.max_length} is above the model's max_position_embeddings="
                          f"{limit} ({cfg.model.partial_pretrain}): samples would train positions it never saw. Lower "
                          f"data.max_length to {limit} (data.truncation cuts longer samples), or set "
                          "data.allow_beyond_max_position=true if the model is meant to extend its context")


def check_model_config(cfg: Config, folder: str) -> None:
    """What config.json alone decides: the loss's head, the router loss, Ulysses heads over the sp ranks."""
    config = model_config(folder, cfg.model.trust_remote_code)
    output_head(config)
    RouterBalance.of(config)
    if cfg.ulysses_sequence_parallel_size > 1:
        attention.check_ulysses(config, cfg.ulysses_sequence_parallel_size)


def embedding_rows(cfg: ModelConfig, folder: str) -> int | None:
    return getattr(model_config(folder, cfg.trust_remote_code).get_text_config(), "vocab_size", None)


@dataclass
class LoadedModel:
    model: CausalLM
    attn_backend: str
    liger: bool  # Liger's kernels patched in, and its fused loss to be used


def load_model(cfg: ModelConfig, device: torch.device) -> LoadedModel:
    """The model on the meta device in model_dtype, varlen attention installed; no rank builds it whole."""
    path = local_model_folder(cfg)
    check_weights(cfg, path)
    config = model_config(path, cfg.trust_remote_code)
    backend = attention_backend(cfg, config, device.type)
    model = build_on_meta(cfg, config)
    if os.path.isfile(os.path.join(path, "generation_config.json")):  # from_config does not read it
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.config.use_cache = False  # training never reuses a KV cache
    liger = cfg.use_liger and apply_liger(model, device, cfg.compile)
    if cfg.lora_rank > 0:
        model = lora.apply_lora(model, cfg)  # after Liger: its patched MLP still calls the wrapped linears
    return LoadedModel(model, backend, liger)


def attention_backend(cfg: ModelConfig, config, device_type: str) -> str:
    backend = attention.select_backend(cfg.attn_implementation, device_type)
    attention.check_model(config, backend, lora.base_dtype(cfg))
    return backend


def build_on_meta(cfg: ModelConfig, config) -> nn.Module:
    """The model of `config` on the meta device, in the dtype it trains in (LoRA's frozen base: the compute dtype)."""
    moe = {"experts_implementation": name} if (name := implementation_for(config)) else {}
    dtype = lora.base_dtype(cfg) if cfg.lora_rank > 0 else DTYPE[cfg.fsdp_config.model_dtype]
    with weights.parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                attn_implementation=attention.ATTN_IMPLEMENTATION,
                                                trust_remote_code=cfg.trust_remote_code, **moe)


def stop_generation_at(model: nn.Module, token_id: int) -> list[int]:
    """Adds `token_id`, the token each trained answer ends with, to generate()'s stop ids; returns them."""
    config = model.generation_config
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if token_id not in ids:
        ids.append(token_id)
        config.eos_token_id = ids if len(ids) > 1 else ids[0]
    return ids


def materialise_model(model: nn.Module, cfg: ModelConfig, device: torch.device, buffer_device: torch.device,
                      seed: int) -> None:
    """The sharded meta model filled with the folder's weights, or a random init. Collective for a hub id."""
    weights.materialise(model, device, buffer_device, seed, None if cfg.random_init else local_model_folder(cfg))


def liger_patching():
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError:
        raise DependencyError(f"model.use_liger=true but liger-kernel is not installed: {GPU_INSTALL} in the "
                              "checkout, or set model.use_liger=false") from None
    return MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance


def apply_liger(model: nn.Module, device: torch.device, compile_layers: bool) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in this model (sfttrain.loss calls its cross-entropy);
    False on CPU."""
    if device.type != "cuda":
        logging.getLogger("sfttrain").warning("model.use_liger=true ignored: Liger's kernels need a CUDA device")
        return False
    MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance = liger_patching()
    if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"Liger has no kernels for model type {model.config.model_type!r}; set model.use_liger=false")
    # with model.compile, inductor fuses norm/SwiGLU/RoPE itself (and cannot trace Liger's autograd
    # functions): only Liger's fused loss is used then
    kernels = not compile_layers
    _apply_liger_kernel_to_instance(model=model, rope=kernels, rms_norm=kernels, swiglu=kernels,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, each an FSDP unit; found after fully_shard renames them too."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (_no_split_modules={names})")
    return layers


def local_model_folder(cfg: ModelConfig) -> str:
    """model.partial_pretrain as a local folder this user may read. Collective for a hub id."""
    path = local_model_path(cfg.partial_pretrain)
    check_model_folder(cfg, path)
    return path


def check_model_folder(cfg: ModelConfig, path: str) -> None:
    config = os.path.join(path, "config.json")
    check_readable(cfg, [path, config])
    if not os.path.isfile(config):
        instead = not_a_model_folder(path) or ("is not a local model folder with a config.json, nor a hub id "
                                               "(org/name, such as Qwen/Qwen2.5-0.5B-Instruct)")
        raise ConfigError(f"model.partial_pretrain={cfg.partial_pretrain!r} {instead}")
    try:
        model_config(path, cfg.trust_remote_code)
    # not JSON; no or an unknown model_type; code it would have to trust; sizes its family's validation
    # refuses (a hidden size that the heads do not divide), raised as huggingface_hub's own error type
    except (OSError, ValueError, StrictDataclassError) as e:
        reason = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
        raise ConfigError(f"model.partial_pretrain={cfg.partial_pretrain!r}: transformers cannot read {config}: "
                          f"{str(reason).splitlines()[0]} Restore the model's own config.json, or use a transformers "
                          "that knows its model type") from None


def check_readable(cfg: ModelConfig, paths: list[str]) -> None:
    if problem := unreadable(paths):
        raise ConfigError(f"model.partial_pretrain={cfg.partial_pretrain!r} cannot be read: {problem}")


def check_weights_readable(cfg: ModelConfig, folder: str) -> None:
    if not cfg.random_init:
        check_readable(cfg, weight_files(folder))


def check_weights(cfg: ModelConfig, path: str) -> None:
    if not cfg.random_init and not weight_files(path):
        raise ConfigError(f"model.partial_pretrain={path!r} has a config but no weights (*.safetensors / *.bin); "
                          "set model.random_init=true to train from a random initialisation")
