"""Model FLOPs utilisation (MFU), as the benchmark workloads define it (docs/workloads.md).

    flops per token = 6 N + 6 L H Dh (sum_i s_i^2) / (sum_i s_i)
    MFU             = flops per token x real tokens/s / (peak FLOP/s x GPUs)

N counts every parameter that runs for a token, once (a tied embedding once): in a mixture of
experts the non-expert parameters (shared experts included) plus the routed experts' parameters
x top_k / num_experts (sfttrain.moe). L is the number of layers, H the number of attention heads,
Dh the head size, and s_i the length of sample i. The dense term is 2 N for the
forward and 4 N for the backward. With LoRA the frozen weights need no weight gradient, only the
input gradient, so their backward is 2 N: the dense term is 4 N_frozen + 6 N_trainable (the
adapters, also counted in N, get the full 6).
Recomputation under activation checkpointing is not counted: MFU measures useful work.

The formula is the workloads' (docs/workloads.md), the same for every system compared: throughput
in units of the model's nominal FLOPs. It counts the output head for every token, while sfttrain's
loss runs the head only at the positions with a target (sfttrain.loss), as the objective needs: on
a prompt-heavy workload sfttrain runs fewer FLOPs than counted: (6 or, frozen, 4) x N_head per
token without a target (W1: 42% of its tokens, 0.34 of its 2.96 GFLOP a token; docs/benchmarks.md
gives both utilisations where it matters).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from sfttrain import moe

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16 peak of one H100/H200 SXM, the workloads' reference

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets, matched as
# substrings of torch.cuda.get_device_name(); the first match wins, so the more specific names
# come first ("H100 PCIe" before "H100", "L40S" before "L40" before "L4").
GPU_BF16_PEAK_FLOPS = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 6000 Ada", 365e12),
    ("RTX A6000", 155e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops(device: torch.device) -> Optional[float]:
    """The dense bf16 peak of ``device``'s GPU, or None where unknown (CPU included): MFU is then
    omitted rather than computed against another chip's peak."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_BF16_PEAK_FLOPS if key in name), None)


def flops_per_token(
    num_params: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    sample_lengths: Iterable[int],
    trainable_params: int | None = None,
) -> float:
    """``6 T + 4 (N - T) + 6 L H Dh sum(s_i^2) / sum(s_i)`` with T the trainable parameters
    (None: all N; frozen ones cost no weight gradient).

    The attention term is per token: each sample of length s costs ``6 L H Dh s^2`` in total
    (QK^T and PV, forward and backward), spread over its s tokens.
    """
    lengths = [int(s) for s in sample_lengths]
    total = sum(lengths)
    if total <= 0:
        raise ValueError("sample_lengths must hold at least one token")
    trainable = num_params if trainable_params is None else trainable_params
    dense = 6 * trainable + 4 * (num_params - trainable)
    attention = 6 * num_layers * num_heads * head_dim * sum(s * s for s in lengths) / total
    return dense + attention


def count_params(model: torch.nn.Module) -> int:
    """All parameters of ``model``, each counted once: a tied embedding / LM head is one tensor.

    Deduplicated by identity, so ties survive any wrapping. Under FSDP2 each parameter is a
    DTensor whose ``numel()`` is the global (unsharded) size, so every rank gets the full count.
    """
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values())


def count_trainable(model: torch.nn.Module) -> int:
    """The parameters that get gradients, each counted once (global sizes under FSDP2)."""
    unique = {id(p): p for p in model.parameters() if p.requires_grad}
    return sum(p.numel() for p in unique.values())


def mfu(flops_per_token: float, tokens_per_s: float, num_gpus: int, peak_flops: float = H200_BF16_PEAK_FLOPS) -> float:
    """``flops_per_token x tokens_per_s / (peak_flops x num_gpus)``, a fraction (not percent).

    ``tokens_per_s`` counts real (non-pad) input tokens over all GPUs.
    """
    return flops_per_token * tokens_per_s / (peak_flops * num_gpus)


def head_dim_of(config) -> int:
    """A transformers config's attention head width: its own head_dim where it sets one (Qwen3's
    differs from hidden_size / heads), else that quotient."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that the FLOP count needs, read once from the unsharded model."""

    num_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    trainable_params: int  # all of num_params in full fine-tuning; LoRA: the adapters
    # what runs per token: a mixture of experts runs top_k of its num_experts routed experts; a
    # dense model all of num_params / trainable_params
    active_params: int
    active_trainable: int
    routing: moe.Routing | None  # None: a dense model

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        c = model.config
        head_dim = head_dim_of(c)
        num_params, trainable = count_params(model), count_trainable(model)
        routing = moe.routing(c)
        idle = 1 - routing.active_fraction if routing else 0.0  # the share of routed experts a token skips
        routed, routed_trainable = moe.routed_expert_params(model), moe.routed_expert_params(model, trainable_only=True)
        active = num_params - round(routed * idle)
        # trained experts (full fine-tuning, or LoRA on them: the adapted weight W + BA gets a weight
        # gradient in each expert GEMM) cost 6 per active parameter; frozen ones 4
        active_trainable = trainable - routed_trainable + (round(routed * (1 - idle)) if routed_trainable else 0)
        return cls(num_params, c.num_hidden_layers, c.num_attention_heads, head_dim, trainable, active,
                   active_trainable, routing)

    def describe_active(self) -> str:
        """What MFU counts for a mixture of experts, for the start-up line ("" for a dense model)."""
        if self.routing is None:
            return ""
        return (f", {self.active_params / 1e6:.2f}M active per token ({self.routing.top_k} of "
                f"{self.routing.num_experts} experts; MFU counts these)")

    def flops_per_token(self, sample_lengths: Iterable[int]) -> float:
        return flops_per_token(self.active_params, self.num_layers, self.num_heads, self.head_dim, sample_lengths,
                               self.active_trainable)

    @property
    def attention_coefficient(self) -> float:
        """A sample of s tokens costs about s + coefficient * s^2 linear-layer-token equivalents
        (the two terms of flops_per_token): what balancing samples over ranks weighs."""
        return self.num_layers * self.num_heads * self.head_dim / self.active_params
