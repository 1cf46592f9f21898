"""Activation checkpointing: which decoder layers recompute in backward and what they keep (their input;
for long samples their attention output, which a full recomputation would run twice; with
recompute_qkv=false the fused q/k/v GEMM's output). torch's checkpoint wraps the layer's `forward`, inside
its compiled graph and FSDP2's hooks; a layer with code outside the graph (LoRA on a MoE's experts)
recomputes everything through transformers' own switch."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from sfttrain.attention import kernel_ops
from sfttrain.config import ConfigError, ModelConfig
from sfttrain.flops import head_dim_of


LONG_SAMPLE = 8192  # data.max_length from which model.recompute_attention=auto keeps attention outputs
GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)  # what a linear runs as, without and with bias


def apply(model: nn.Module, layers: list[nn.Module], cfg: ModelConfig, keep_attention: bool) -> None:
    """Activation checkpointing on model.gradient_checkpointing_ratio of `layers`, spread evenly;
    keep_attention: model.recompute_attention as `attention_kept` resolved it."""
    chosen = chosen_layers(layers, cfg)
    if has_eager_parts_compiled(cfg, chosen):
        transformers_checkpointing(model, layers, chosen)
        return
    qkv = None if cfg.recompute_qkv else qkv_weight_shape(model.config)
    # no context_fn unless there is a policy: dynamo refuses the default one (noop_context_fn)
    policy = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, keeping(keep_attention, qkv))}
              if keep_attention or qkv else {})
    for layer in chosen:
        layer.forward = functools.partial(checkpointed_forward, layer.forward, **policy)


def chosen_layers(layers: list[nn.Module], cfg: ModelConfig) -> list[nn.Module]:
    """The layers model.gradient_checkpointing_ratio checkpoints (recompute_qkv=false checked against them)."""
    chosen = checkpointed(layers, cfg.gradient_checkpointing_ratio)
    if has_eager_parts_compiled(cfg, chosen) and not cfg.recompute_qkv:
        raise ConfigError("model.recompute_qkv=false: this model's layers run parts outside their compiled "
                          "graph (LoRA on a MoE's experts), whose checkpoint recomputes everything; remove it")
    return chosen


def checkpointed(layers: list[nn.Module], ratio: float) -> list[nn.Module]:
    """Layer i is checkpointed when floor((i + 1) * ratio) steps up: `ratio` of them, spread evenly."""
    return [layer for i, layer in enumerate(layers) if int((i + 1) * ratio) > int(i * ratio)]


def attention_kept(cfg: ModelConfig, layers: list[nn.Module], max_length: int) -> bool:
    """Whether the checkpointed `layers` keep their attention output: as `wants_attention_kept`, unless
    a part outside their compiled graph makes them recompute everything."""
    return wants_attention_kept(cfg, max_length) and not has_eager_parts_compiled(cfg, chosen_layers(layers, cfg))


def wants_attention_kept(cfg: ModelConfig, max_length: int) -> bool:
    """model.recompute_attention read: false, or auto with samples of LONG_SAMPLE tokens or more."""
    return cfg.recompute_attention is False or (cfg.recompute_attention == "auto" and max_length >= LONG_SAMPLE)


def has_eager_parts_compiled(cfg: ModelConfig, chosen: list[nn.Module]) -> bool:
    """Whether compiled layers run a module outside the graph (torch.compiler.disable)."""
    return cfg.compile and any(getattr(module.forward, "_torchdynamo_disable", False)
                               for layer in chosen for module in layer.modules())


def checkpointed_forward(forward, *args, **kwargs):
    # non-reentrant: works with FSDP2's hooks and with inputs that need no grad. A function of its own: with
    # partial(checkpoint, ...) as a layer's forward, dynamo leaves the checkpoint out of the compiled graph
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def describe(layers: list[nn.Module], cfg: ModelConfig, keep_attention: bool) -> str:
    """The start-up line: how many layers recompute in backward, and what each keeps (keep_attention:
    as `attention_kept` resolved it)."""
    if not cfg.enable_gradient_checkpointing:
        return "  recompute           : none (model.enable_gradient_checkpointing=false): every activation kept"
    chosen = checkpointed(layers, cfg.gradient_checkpointing_ratio)
    setting = f"model.recompute_attention={str(cfg.recompute_attention).lower()}"
    if cfg.recompute_attention == "auto":  # auto keeps it from LONG_SAMPLE tokens on
        setting += f", data.max_length {'>=' if keep_attention else '<'} {LONG_SAMPLE}"
    if has_eager_parts_compiled(cfg, chosen):
        kept = "its input only: its compiled graph has parts outside it, which a selective checkpoint cannot hold"
    elif keep_attention:
        kept = f"its input and its attention output ({setting})"
    else:
        kept = f"its input only ({setting})" if cfg.recompute_qkv else f"its input ({setting})"
    if not cfg.recompute_qkv:
        kept += ", and its fused q/k/v GEMM output (model.recompute_qkv=false)"
    return f"  recompute           : {len(chosen)} of {len(layers)} layers in backward, each keeping {kept}"


def keeping(attention: bool, qkv: tuple[int, int] | None):
    """The selective checkpoint's policy: keep the attention kernel's outputs and the GEMM output whose
    weight has the shape `qkv`. A closure (a partial dynamo would trace); static shapes only (else a guard)."""
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if attention and op in kernel_ops():
            return CheckpointPolicy.MUST_SAVE
        if qkv and op in GEMMS and all(isinstance(d, int) for d in args[-1].shape) and tuple(args[-1].shape) == qkv:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def qkv_weight_shape(config) -> tuple[int, int]:
    """The fused q/k/v weight as aten's mm sees it (hidden, q + k + v widths): no other projection's shape."""
    return config.hidden_size, (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim_of(config)


def transformers_checkpointing(model: nn.Module, layers: list[nn.Module], chosen: list[nn.Module]) -> None:
    # transformers 5.17's name; later 5.x deprecate it with a warning the user can do nothing about
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.* deprecated",
                                category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.gradient_checkpointing = layer in chosen  # transformers' per-layer switch
