"""Model FLOPs utilisation (MFU), as the benchmark workloads define it (docs/workloads.md):

    flops per token = 6 T + 4 (N - T) + 6 L H Dh (sum_i s_i^2) / (sum_i s_i),  MFU = that x tokens/s / peak

N: the parameters that run for a token (a MoE's routed ones x top_k / E), T those of them trained
(frozen ones get no weight gradient). Recomputation is not counted; the head is, for every token."""

from dataclasses import dataclass

import torch

from sfttrain import moe

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16 peak of one H100/H200 SXM, the workloads' reference

# dense bf16 peaks from the data sheets, by substring of the device name: the first match wins
GPU_BF16_PEAK_FLOPS = (
    ("GB200", 2500e12), ("B200", 2250e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
    ("H200", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12), ("RTX 6000 Ada", 365e12),
    ("RTX A6000", 155e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device``'s GPU; None where unknown (CPU too): no MFU then."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_BF16_PEAK_FLOPS if key in name), None)


def count_params(model: torch.nn.Module, trainable_only: bool = False, routed_only: bool = False) -> int:
    """Parameters of ``model`` (only those trained, only the routed experts'), a tied embedding once;
    global sizes under FSDP2."""
    return sum(p.numel() for name, p in model.named_parameters()
               if (p.requires_grad or not trainable_only) and (moe.is_routed_expert(name) or not routed_only))


def mfu(flops_per_token: float, tokens_per_s: float, num_gpus: int, peak_flops: float = H200_BF16_PEAK_FLOPS) -> float:
    """A fraction, not percent; ``tokens_per_s``: real input tokens over all GPUs."""
    return flops_per_token * tokens_per_s / (peak_flops * num_gpus)


def head_dim_of(config) -> int:
    """The attention head width: config.head_dim where set (Qwen3's differs), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that the FLOP count needs."""
    num_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    trainable_params: int  # all of num_params in full fine-tuning; LoRA: the adapters
    # what runs per token: top_k of a MoE's num_experts routed experts
    active_params: int
    active_trainable: int
    routing: moe.Routing | None  # None: a dense model

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        c = model.config
        num_params, trainable = count_params(model), count_params(model, trainable_only=True)
        routing = moe.routing(c)
        idle = 1 - routing.top_k / routing.num_experts if routing else 0.0  # the share of routed experts a token skips
        routed = count_params(model, routed_only=True)
        routed_trainable = count_params(model, trainable_only=True, routed_only=True)
        active = num_params - round(routed * idle)
        # trained experts (LoRA on them too: W + BA gets a weight gradient) cost 6 per active parameter
        active_trainable = trainable - routed_trainable + (round(routed * (1 - idle)) if routed_trainable else 0)
        return cls(num_params, c.num_hidden_layers, c.num_attention_heads, head_dim_of(c), trainable, active,
                   active_trainable, routing)

    def describe_active(self) -> str:
        """What MFU counts for a mixture of experts, for the start-up line ("" for a dense model)."""
        if self.routing is None:
            return ""
        return (f", {self.active_params / 1e6:.2f}M active per token ({self.routing.top_k} of "
                f"{self.routing.num_experts} experts; MFU counts these)")

    def flops_per_token(self, sample_lengths: list[int]) -> float:
        dense = 6 * self.active_trainable + 4 * (self.active_params - self.active_trainable)
        squares = sum(s * s for s in sample_lengths)
        return dense + 6 * self.num_layers * self.num_heads * self.head_dim * squares / sum(sample_lengths)

    @property
    def attention_coefficient(self) -> float:
        """A sample of s tokens costs about s + coefficient * s^2 linear-layer tokens (rank balancing)."""
        return self.num_layers * self.num_heads * self.head_dim / self.active_params
