"""A mixture-of-experts layer's expert MLPs as two grouped GEMMs in the compute dtype.

transformers 5 stores a MoE layer's experts as fused 3-D parameters (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) and runs them through the function that `config._experts_implementation`
names. Its own `grouped_mm` function calls torch's grouped GEMM only when the weights are already
bf16 under torch.compile. sfttrain keeps fp32 master weights and computes under bf16 autocast,
which torch's grouped GEMM does not take part in (it is not autocast-enabled), so transformers
falls back to a Python loop over the experts in fp32 that reads the group offsets on the host: a
graph break in every MoE layer, and fp32 GEMMs where the rest of the model runs bf16.

`grouped_experts_forward` casts the experts' weights to the autocast dtype itself (a cast autograd
sees through: the gradients reach the fp32 weights as fp32) and runs each projection as one
grouped GEMM over the tokens sorted by expert, with no host sync. Outside autocast it computes in
the weights' own dtype. Layouts it does not cover (biased, transposed or interleaved experts, a
post-expert norm, expert parallelism) go to transformers' own function unchanged.
"""

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
    # tokens per expert without a host sync; histc rather than bincount, whose output length
    # depends on the data (torch.compile would break the graph there). histc counts float on the
    # CPU and ints on CUDA, as transformers does it.
    counted = expert_of_pair.int() if hidden_states.is_cuda else expert_of_pair.float()
    per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)

    x = hidden_states[order // top_k].to(dtype)
    gate_up = torch._grouped_mm(x, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(self._apply_gate(gate_up), self.down_proj.to(dtype).transpose(-2, -1), offs=offsets)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(dtype)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    # each token's K expert outputs summed in fp32 (a deterministic reduction, no atomics), returned in
    # the compute dtype as a dense MLP's down_proj returns it under autocast: in the input's (fp32, the
    # norm's output with fp32 weights) it would turn the residual stream fp32 after the first MoE layer,
    # and the compiled layers, whose first call got it in bf16, would recompile for fp32
    return y[back].view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(dtype)


def _covers(experts) -> bool:
    """Fused [gate; up] weights in transformers' default layout (flags absent in an older 5.x mean
    that layout)."""
    flags = {"has_gate": True, "is_concatenated": True, "has_bias": False, "is_transposed": False,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    return (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")
            and all(getattr(experts, name, default) == default for name, default in flags.items()))


def implementation_for(config) -> str | None:
    """The experts implementation to build a model of `config` with: this module's for a MoE
    model under a transformers whose experts take one (5.x); None otherwise (transformers 4 keeps
    each expert as plain linear layers, which autocast already runs in bf16)."""
    if routing(config) is None:
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, grouped_experts_forward)
    return IMPLEMENTATION
