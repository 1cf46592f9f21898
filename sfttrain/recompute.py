"""Activation checkpointing: which decoder layers recompute their activations in backward, and what
a recomputed layer keeps (model.enable_gradient_checkpointing, gradient_checkpointing_ratio,
recompute_attention).

A checkpointed layer keeps its input and, for long samples, its attention kernel's output (the
output and its softmax statistics: about one hidden state per token, the size of the input
again). Backward then recomputes the projections, norms and MLP, but not attention, which
dominates a long sample's step (at 128k tokens, 85% of the FLOPs of W1's model) and whose forward
a full recomputation runs a second time. model.recompute_attention: false keeps the output, true
keeps the input alone (the least memory), auto keeps the output from data.max_length >= 8192
(LONG_SAMPLE) on: for shorter samples recomputing attention costs little (W2b's 4096-token samples:
under a tenth of a layer's forward), and the memory serves the batch.

The checkpoint is torch's, around the layer's `forward` (for the attention output, with a
selective policy over the ops a layer runs): under torch.compile that is inside the compiled layer,
where the partitioner recomputes only what backward reads. A layer's last projection (the MLP's
down) feeds nothing but the residual sum that leaves the layer, so its GEMM is not rerun: about a
quarter of a Llama layer's forward GEMMs. FSDP2's hooks, around `forward`, stay outside and are not
run again by the recomputation. A layer with code that must run outside the compiled graph
(torch.compiler.disable: LoRA on a MoE's experts, sfttrain.lora) cannot hold a checkpoint inside
its graph, so it recomputes everything through transformers' own switch, which in transformers
5.17 places the checkpoint outside the compiled layer. Layers that rerun attention under
compilation, either way, run on inductor's Python wrapper (`reruns_attention_compiled` says why).

model.recompute_qkv: false also keeps the output of the layer's fused q/k/v GEMM
(sfttrain.fuse_projections): one GEMM fewer rerun in backward, a ninth of an 8B Llama layer's forward
GEMMs, for the q, k and v widths a token (Llama-3-8B: 6144 values, 1.5 hidden states). The policy
finds that GEMM by its weight's shape, which only the fused projection has (`qkv_weight_shape`).
"""

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


def apply(model: nn.Module, layers: list[nn.Module], cfg: ModelConfig, max_length: int) -> None:
    """Activation checkpointing on model.gradient_checkpointing_ratio of `layers`, spread evenly (a
    model whose weights and optimizer state leave room for some activations recomputes only the
    layers that do not fit), keeping what `keeps_attention` and model.recompute_qkv say."""
    chosen = chosen_layers(layers, cfg)
    if has_eager_parts_compiled(cfg, chosen):
        transformers_checkpointing(model, layers, chosen)
        return
    keep_attention = wants_attention_kept(cfg, max_length)
    qkv = None if cfg.recompute_qkv else qkv_weight_shape(model.config)
    # no context_fn unless there is a policy: dynamo refuses the default one (noop_context_fn)
    policy = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, keeping(keep_attention, qkv))}
              if keep_attention or qkv else {})
    for layer in chosen:
        layer.forward = functools.partial(checkpointed_forward, layer.forward, **policy)


def chosen_layers(layers: list[nn.Module], cfg: ModelConfig) -> list[nn.Module]:
    """The layers model.gradient_checkpointing_ratio checkpoints, refusing model.recompute_qkv=false where
    they run parts outside their compiled graph (the preflight checks it on the model built on meta)."""
    chosen = checkpointed(layers, cfg.gradient_checkpointing_ratio)
    if has_eager_parts_compiled(cfg, chosen) and not cfg.recompute_qkv:
        raise ConfigError("model.recompute_qkv=false: this model's layers run parts outside their compiled "
                          "graph (LoRA on a MoE's experts), whose checkpoint recomputes everything; remove it")
    return chosen


def checkpointed(layers: list[nn.Module], ratio: float) -> list[nn.Module]:
    """Layer i is checkpointed when floor((i + 1) * ratio) steps up: `ratio` of them, spread evenly."""
    return [layer for i, layer in enumerate(layers) if int((i + 1) * ratio) > int(i * ratio)]


def wants_attention_kept(cfg: ModelConfig, max_length: int) -> bool:
    """model.recompute_attention read: false, or auto with samples of LONG_SAMPLE tokens or more."""
    return cfg.recompute_attention is False or (cfg.recompute_attention == "auto" and max_length >= LONG_SAMPLE)


def reruns_attention_compiled(cfg: ModelConfig, max_length: int, eager_parts: bool) -> bool:
    """Whether compiled layers rerun their attention kernel under compilation: checkpointed whole,
    inside their graph, or, with parts outside the graph (eager_parts: LoRA on a MoE's experts),
    through transformers' checkpoint around them, which recomputes everything whatever the setting.
    Inductor's partitioner then wraps the kernel (an op tagged as drawing random numbers, for
    dropout) in a call that replays the RNG state, which inductor's C++ wrapper cannot emit (torch
    2.11 to 2.13: an assertion in its codegen), so sfttrain.parallel.cpp_wrapper leaves such runs
    on the Python one."""
    kept = wants_attention_kept(cfg, max_length) and not eager_parts
    return cfg.compile and cfg.enable_gradient_checkpointing and not kept


def keeps_attention(cfg: ModelConfig, max_length: int, chosen: list[nn.Module]) -> bool:
    """A checkpointed layer keeps its attention output where the setting asks for it and it can:
    not when, compiled, it runs parts outside the graph (the module docstring says why)."""
    return wants_attention_kept(cfg, max_length) and not has_eager_parts_compiled(cfg, chosen)


def has_eager_parts_compiled(cfg: ModelConfig, chosen: list[nn.Module]) -> bool:
    return cfg.compile and any(has_eager_parts(layer) for layer in chosen)


def describe(layers: list[nn.Module], cfg: ModelConfig, max_length: int) -> str:
    """The start-up line: how many layers recompute in backward, and what each keeps."""
    if not cfg.enable_gradient_checkpointing:
        return "  recompute           : none (model.enable_gradient_checkpointing=false): every activation kept"
    chosen = checkpointed(layers, cfg.gradient_checkpointing_ratio)
    setting = f"model.recompute_attention={str(cfg.recompute_attention).lower()}"
    if cfg.recompute_attention == "auto":
        setting += f", data.max_length {'>=' if max_length >= LONG_SAMPLE else '<'} {LONG_SAMPLE}"
    if keeps_attention(cfg, max_length, chosen):
        kept = f"its input and its attention output ({setting})"
    elif not wants_attention_kept(cfg, max_length):
        kept = f"its input only ({setting})" if cfg.recompute_qkv else f"its input ({setting})"
    else:
        kept = "its input only: its compiled graph has parts outside it, which a selective checkpoint cannot hold"
    if not cfg.recompute_qkv:
        kept += ", and its fused q/k/v GEMM output (model.recompute_qkv=false)"
    return f"  recompute           : {len(chosen)} of {len(layers)} layers in backward, each keeping {kept}"


def checkpointed_forward(forward, *args, **kwargs):
    # non-reentrant: works with FSDP2's hooks and with inputs that need no grad
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def keeping(attention: bool, qkv: tuple[int, int] | None):
    """The selective checkpoint's policy: keep the attention kernel's outputs (`attention`) and the
    output of the GEMM whose weight operand has the shape `qkv` (the fused q/k/v projection's,
    transposed), recompute the rest. A closure: dynamo takes a function as a constant, where the
    values of a functools.partial would be traced (its ints as symbols) and break the graph. The shape
    is compared only where it is static, a weight's: a symbolic size compared with an int would add a
    guard and recompile the layer."""
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if attention and op in kernel_ops():
            return CheckpointPolicy.MUST_SAVE
        if qkv and op in GEMMS and all(isinstance(d, int) for d in args[-1].shape) and tuple(args[-1].shape) == qkv:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def qkv_weight_shape(config) -> tuple[int, int]:
    """(hidden, q + k + v widths): the GEMM operand of a layer's fused q/k/v projection
    (sfttrain.fuse_projections) as aten's mm and addmm see it, transposed. No other projection of a
    decoder layer has it: gate/up fused are two intermediate widths wide, the LoRA adapters' A rank-wide
    and their B read rank-wide inputs."""
    return config.hidden_size, (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim_of(config)


def has_eager_parts(layer: nn.Module) -> bool:
    """Whether a module of the layer runs outside torch.compile's graph (torch.compiler.disable)."""
    return any(getattr(module.forward, "_torchdynamo_disable", False) for module in layer.modules())


def transformers_checkpointing(model: nn.Module, layers: list[nn.Module], chosen: list[nn.Module]) -> None:
    # The name is the one transformers 5.17 has; later 5.x call it an alias of
    # activation_checkpointing_enable and warn on every run, which the user can do nothing about
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.* deprecated", category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.gradient_checkpointing = layer in chosen  # transformers' per-layer switch
