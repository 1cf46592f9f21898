"""A mixture-of-experts layer's expert MLPs as two grouped GEMMs in the compute dtype: transformers'
own function takes torch's grouped GEMM only on bf16 weights, and otherwise loops over the experts
in fp32 with a host sync. Layouts this does not cover go to transformers' function."""

from __future__ import annotations

import torch

from sfttrain.moe import routing

IMPLEMENTATION = "sfttrain_grouped_mm"


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], top_k_index / top_k_weights [T, K] -> [T, H] (transformers' contract)."""
    if not _covers(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    device = hidden_states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.gate_up_proj.dtype
    num_tokens, top_k = top_k_index.shape
    expert_of_pair = top_k_index.reshape(-1)  # one (token, expert) pair per entry
    order = torch.argsort(expert_of_pair, stable=True)  # the pairs grouped by expert
    # histc, not bincount (data-dependent length: a graph break); floats on the CPU, ints on CUDA
    counted = expert_of_pair.int() if hidden_states.is_cuda else expert_of_pair.float()
    per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)

    x = hidden_states[order // top_k].to(dtype)
    gate_up = torch._grouped_mm(x, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(self._apply_gate(gate_up), self.down_proj.to(dtype).transpose(-2, -1), offs=offsets)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(dtype)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    # summed in fp32 without atomics, returned in the compute dtype as a dense MLP's is: the input's
    # (fp32) would turn the residual stream fp32 and recompile the compiled layers
    return y[back].view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(dtype)


def _covers(experts) -> bool:
    """Fused [gate; up] weights in transformers' default layout (absent flags mean it)."""
    flags = {"has_gate": True, "is_concatenated": True, "has_bias": False, "is_transposed": False,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    return (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")
            and all(getattr(experts, name, default) == default for name, default in flags.items()))


def implementation_for(config) -> str | None:
    """This module's experts implementation for a MoE model under a transformers that takes one; else None."""
    if routing(config) is None:
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, grouped_experts_forward)
    return IMPLEMENTATION
