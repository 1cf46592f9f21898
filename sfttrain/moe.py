"""Mixture-of-experts specifics: which parameters are routed experts, how many of them run per
token, and the shape of a MoE decoder as its config.json describes it.

Qwen2-MoE, Qwen3-MoE and Mixtral (transformers 5) hold each layer's routed experts as fused 3-D
parameters under `mlp.experts` (`gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]); a router
(`mlp.gate`) picks top_k of the E experts per token. Qwen2-MoE adds a shared expert
(`mlp.shared_expert`, with a sigmoid gate) that runs for every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

EXPERTS = ".experts."  # in the name of every routed-expert parameter (and of adapters peft puts on them)


@dataclass(frozen=True)
class Routing:
    """top_k of num_experts routed experts run per token."""
    top_k: int
    num_experts: int

    @property
    def active_fraction(self) -> float:
        return self.top_k / self.num_experts


def routing(config) -> Routing | None:
    """The model's routing from its config (a PretrainedConfig or a config.json dict); None for a
    dense model."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    experts = get("num_experts") or get("num_local_experts")  # Qwen-MoE / Mixtral spelling
    top_k = get("num_experts_per_tok")
    return Routing(int(top_k), int(experts)) if experts and top_k else None


def is_routed_expert(name: str) -> bool:
    return EXPERTS in f".{name}."


def routed_expert_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters of the routed experts, each counted once (global sizes under FSDP2)."""
    unique = {id(p): p for name, p in model.named_parameters()
              if is_routed_expert(name) and (p.requires_grad or not trainable_only)}
    return sum(p.numel() for p in unique.values())


@dataclass(frozen=True)
class MoeShape:
    """The MoE part of a decoder's config.json: which layers are sparse and how large their experts are."""
    routing: Routing
    expert_intermediate: int
    shared_intermediate: int  # Qwen2-MoE's shared expert; 0: none
    sparse_layers: int  # layers whose MLP is the experts; the others keep a dense MLP (Qwen's mlp_only_layers)

    @classmethod
    def from_config(cls, c: dict) -> MoeShape | None:
        r = routing(c)
        if r is None:
            return None
        layers = c["num_hidden_layers"]
        step = c.get("decoder_sparse_step") or 1
        dense = set(c.get("mlp_only_layers") or [])
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(r, c.get("moe_intermediate_size") or c["intermediate_size"],
                   c.get("shared_expert_intermediate_size") or 0, sparse)

    def mlp_params(self, hidden: int) -> int:
        """One sparse layer's MLP: router, experts (gate, up, down each), shared expert and its gate."""
        r = self.routing
        shared = 3 * hidden * self.shared_intermediate + hidden if self.shared_intermediate else 0
        return r.num_experts * hidden + r.num_experts * 3 * hidden * self.expert_intermediate + shared

    def mlp_activations_per_token(self) -> int:
        """bf16 values one sparse MLP keeps for backward per token: top_k copies of the token
        (gate, up and their product per routed expert), the shared expert's, the router's logits."""
        return (3 * self.routing.top_k * self.expert_intermediate + 3 * self.shared_intermediate
                + self.routing.num_experts)
