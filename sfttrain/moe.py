"""Mixture-of-experts specifics: routing, a MoE decoder's shape from config.json, the router's
load-balancing loss, checkpoints with one weight per expert, LoRA on the experts, their grouped GEMMs. The
router loss (output_router_logits=true) is Hugging Face's aux = E sum_e f_e P_e per sample, token-weighted:

    step loss = sum_t CE_t / (loss tokens of the step) + coef x sum_s T_s aux_s / (real tokens of the step)

aux depends on the tokens it is taken over; a sample is the one group no split of the step cuts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sfttrain.config import ConfigError
from sfttrain.data.pack import MicroBatch

@dataclass(frozen=True)
class Routing:  # top_k of num_experts routed experts run per token
    top_k: int
    num_experts: int


def routing(config) -> Routing | None:
    """From a PretrainedConfig or a config.json dict; None for a dense model."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    experts = get("num_experts") or get("num_local_experts")  # Qwen-MoE / Mixtral spelling
    top_k = get("num_experts_per_tok")
    return Routing(int(top_k), int(experts)) if experts and top_k else None


def is_routed_expert(name: str) -> bool:  # ".experts." names every routed-expert parameter and peft's adapters on it
    return ".experts." in f".{name}."


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

    def mlp_activations_per_token(self) -> int:
        """Values one sparse MLP keeps for backward per token (gate, up, their product; router logits)."""
        return (3 * self.routing.top_k * self.expert_intermediate + 3 * self.shared_intermediate
                + self.routing.num_experts)


class RouterBalance:
    """The router's load-balancing loss and the experts' load: `record` each training forward's logits,
    `take` the micro-batch's sum_s T_s aux_s, `step_stats` for the step's all-reduce, `metrics` from its sums."""

    def __init__(self, config):
        self.routing = routing(config)
        self.coef = float(config.router_aux_loss_coef)
        self.pending: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | float = 0.0  # sum over the step's samples of T_s aux_s (this rank's)
        self.load: torch.Tensor | float = 0.0  # [sparse layers, experts] top-k picks of real tokens

    @classmethod
    def of(cls, config) -> RouterBalance | None:  # None without output_router_logits=true
        if not getattr(config, "output_router_logits", False):
            return None
        if routing(config) is None or getattr(config, "router_aux_loss_coef", None) is None:
            raise ConfigError(f"{config.model_type}: output_router_logits=true but the config names no experts "
                              "and router_aux_loss_coef; set output_router_logits=false in the model's config.json")
        return cls(config)

    def record(self, router_logits: tuple[torch.Tensor, ...], batch: MicroBatch) -> None:
        lengths = batch.cu_seqlens.diff().long()
        tokens = batch.input_ids.shape[1]
        samples = len(lengths) if batch.num_samples is None else batch.num_samples
        # each token's segment; output_size: no device-to-host sync for the result's length
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                          output_size=tokens)
        real = (segment < samples).float()
        experts = self.routing.num_experts
        picks = torch.zeros(len(lengths), experts, device=lengths.device)
        probs = torch.zeros(len(lengths), experts, device=lengths.device)
        load = []
        for logits in router_logits:
            p = torch.softmax(logits.float(), dim=-1)
            chosen = torch.zeros_like(p).scatter_(1, p.topk(self.routing.top_k, dim=-1).indices, 1.0)
            picks.index_add_(0, segment, chosen)
            probs = probs.index_add(0, segment, p)
            load.append(real @ chosen)
        # per sample: E sum_e (picks_e / (L T)) (probs_e / (L T)), weighted by T
        scale = len(router_logits) ** 2 * lengths.clamp(min=1).float()
        per_sample = experts * (picks * probs).sum(-1) / scale
        self.pending = per_sample[:samples].sum()
        self.aux_sum = self.aux_sum + self.pending.detach()
        self.load = self.load + torch.stack(load)

    def take(self) -> torch.Tensor:
        pending, self.pending = self.pending, None
        return pending

    def step_stats(self, device: torch.device) -> torch.Tensor:
        """This rank's [sum_s T_s aux_s, load...] of the step; reset for the next."""
        load = torch.as_tensor(self.load, dtype=torch.float32, device=device).flatten()
        stats = torch.cat([torch.as_tensor(self.aux_sum, dtype=torch.float32, device=device).reshape(1), load])
        self.aux_sum, self.load = 0.0, 0.0
        return stats

    def metrics(self, stats: list[float], real_tokens: int) -> dict:
        """router_aux: the step's token-weighted mean of aux; expert_load: the busiest expert's picks
        over the mean expert's in the most unbalanced layer (1: balanced)."""
        load = torch.tensor(stats[1:]).view(-1, self.routing.num_experts)
        balance = load.max(-1).values / load.mean(-1).clamp(min=1e-9)
        return {"router_aux": stats[0] / max(real_tokens, 1), "expert_load": balance.max().item()}


# checkpoints' one weight per expert (`experts.{e}.gate_proj.weight`; Mixtral's under
# `block_sparse_moe` as w1, w3, w2, its router too): (module rename, gate, up, down)
PER_EXPERT_LAYOUTS = ((".mlp.", "gate_proj", "up_proj", "down_proj"),
                      (".block_sparse_moe.", "w1", "w3", "w2"))


def read_per_expert(files: dict[str, str], name: str, index: tuple[slice, ...],
                    read: Callable[[str, str, tuple], torch.Tensor]) -> torch.Tensor | None:
    """The slice `index` of the parameter `name` from a checkpoint that stores its experts one by one
    (or Mixtral's router under its old name); None where it has neither. files: tensor name -> file;
    read(file, tensor name, index) reads a slice (() : all)."""
    for module, gate, up, down in PER_EXPERT_LAYOUTS:
        key = name.replace(".mlp.", module)
        if key in files:  # renamed only (Mixtral's router)
            return read(files[key], key, index)
        prefix, _, param = key.rpartition(".")
        parts = {"gate_up_proj": (gate, up), "down_proj": (down,)}.get(param)
        if parts is None or not prefix.endswith(".experts"):
            continue
        experts = range(index[0].start, index[0].stop)
        keys = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in experts]
        if not all(k in files for per_expert in keys for k in per_expert):
            continue
        if not keys:  # this rank holds no expert of this layer
            return torch.empty([s.stop - s.start for s in index])
        # gate_up_proj[e] is gate_proj's [F, D] above up_proj's; down_proj[e] is down_proj's [D, F]
        return torch.stack([torch.cat([read(files[k], k, ()) for k in per_expert])[index[1:]]
                            for per_expert in keys])
    return None


FUSED_EXPERTS = ("gate_up_proj", "down_proj")  # transformers 5's 3-D expert parameters


def expert_lora_targets(model: nn.Module, cfg) -> tuple[list[str], str | None]:
    """peft's target_parameters for LoRA on the fused experts (no nn.Linear, so all-linear misses
    them), and why a MoE model gets none (None: a dense model, or adapted)."""
    if routing(model.config) is None:
        return [], None
    # "model.layers.0.mlp.experts.gate_up_proj" -> "mlp.experts.gate_up_proj" (peft matches the end)
    targets = sorted({".".join(name.replace(".base_layer", "").split(".")[-3:])
                      for name, p in model.named_parameters()
                      if is_routed_expert(name) and name.endswith(FUSED_EXPERTS) and p.dim() == 3})
    if not targets:
        return [], "this transformers keeps no fused 3-D expert parameters"
    if cfg.target_modules != "all-linear":
        return [], f"model.target_modules={cfg.target_modules} names linear layers only; all-linear adds the experts"
    if cfg.lora_dropout:  # peft adapts the experts under all-linear itself: it would fail later
        raise ConfigError(f"model.lora_dropout={cfg.lora_dropout} with target_modules=all-linear on "
                          f"{model.config.model_type}: peft adapts the fused experts only without dropout; set "
                          "model.lora_dropout=0, or list model.target_modules (the experts then stay frozen)")
    return targets, None


def describe_lora(model: nn.Module, cfg) -> list[str]:
    """The start-up line on what LoRA adapts in a MoE (none for a dense model or without LoRA)."""
    if cfg.lora_rank <= 0 or routing(model.config) is None:
        return []
    experts, routers = {}, False
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if getattr(module, "parameter_name", None) in FUSED_EXPERTS:  # peft's ParamWrapper on a 3-D parameter
            experts[module.parameter_name] = module.r.get("default")
        routers |= name.endswith(".mlp.gate")
    router_words = "routers adapted too (peft's choice for this family)" if routers else "routers not adapted"
    if experts:
        ranks = ", ".join(f"{param} rank {r}" for param, r in sorted(experts.items()))
        # sfttrain.lora.run_parameter_adapters_eager says why
        eager = "; the adapted experts run eager, outside the compiled layers" if cfg.compile else ""
        return [f"  lora on experts     : routed experts adapted per expert ({ranks}; peft target_parameters); "
                f"{router_words}{eager}"]
    _, reason = expert_lora_targets(model, cfg)
    return [f"  lora on experts     : routed experts NOT adapted ({reason}); {router_words}"]


# A MoE layer's expert MLPs as two grouped GEMMs in the compute dtype: transformers' own function takes
# torch's grouped GEMM only on bf16 weights, and otherwise loops over the experts in fp32 with a host sync.
# Layouts this does not cover go to transformers' function.
GROUPED_MM = "sfttrain_grouped_mm"


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
    gate_up = F.grouped_mm(x, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offsets)
    y = F.grouped_mm(self._apply_gate(gate_up), self.down_proj.to(dtype).transpose(-2, -1), offs=offsets)
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
    """The grouped-GEMM experts implementation for a MoE model; None for a dense one."""
    if routing(config) is None:
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(GROUPED_MM, grouped_experts_forward)
    return GROUPED_MM
