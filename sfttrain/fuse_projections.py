"""model.fuse_projections: the projections that read the same input run as one GEMM in the compiled layers.

A decoder layer's q, k and v projections read the same normed hidden state, and so do the MLP's gate
and up projections (with LoRA, their adapters' A matrices too). Separately that is five GEMMs where
two would do: the input is read once instead of five times, the narrow k and v GEMMs (128 columns
on W1's model) ride in a wide one, and backward's input gradient is one GEMM per group instead of a
GEMM per projection and their sum. On a host-bound step (W1 with LoRA launches ~1,700 GEMMs a step)
fewer launches also mean less host time.

How: an inductor pre-grad pass (`FuseSharedInputProjections`) over each compiled layer's graph
rewrites `linear(x, w_i, b_i)` for i in a group into `linear(x, cat(w), cat(b))` split back into
the projections' outputs. Autograd then gives each weight its slice of one weight-gradient GEMM.
The model, its parameters and its checkpoints are unchanged: the concatenation is in the graph.

A group holds projections of one input whose weights agree in whether they are trained: a frozen
base weight fused with a LoRA adapter would have its gradient GEMM computed (the concatenation
requires grad), the very work LoRA skips. Biases: all or none of a group's projections have one.

What fusing costs: the concatenated weight is a copy, made in forward and again in backward (twice
4 bytes of traffic a bf16 weight). What it saves is launches and narrow GEMMs: two or three GEMMs
and a sum fewer a group, forward and backward, ~10 us of host time each where the step is the
host's (W1's). Both are fixed per micro-batch, so the break-even is a weight size: copying 32 MiB
twice takes ~30 us at ~4.5 TB/s, what the ~3 launches of a two-projection group take. Groups of
frozen weights over FROZEN_GROUP_MAX_BYTES are left unfused (`graph_pass`): on W2b's 8B Llama the
gate/up weights are 224 MiB a layer, whose copies cost memory at the peak and time each step
(docs/benchmarks.md); W1's largest group is 17 MiB. Trained groups, the adapters' A,
are small, and a fused full fine-tuning is what model.fuse_projections=true asks for. The q/k/v
group whose GEMM output model.recompute_qkv=false keeps stays fused whatever its size: that keeping
needs its one GEMM (sfttrain.recompute).
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from sfttrain import lora_fold
from sfttrain.config import ModelConfig
from sfttrain.graph_rewrite import LINEAR, concatenated, split_back, with_value
from sfttrain.recompute import qkv_weight_shape

FROZEN_GROUP_MAX_BYTES = 32 * 2**20  # the largest frozen group model.fuse_projections=auto fuses (above)


def graph_pass(cfg: ModelConfig, model_config) -> FuseSharedInputProjections | None:
    """The pass model.fuse_projections asks for: none; every group (true); or, auto, every group but
    frozen ones over FROZEN_GROUP_MAX_BYTES. The q/k/v group model.recompute_qkv=false keeps is fused
    either way. With LoRA and model.fold_lora (ModelConfig.folds_lora), the groups of adapted
    projections it would fuse are folded first (sfttrain.lora_fold), but that q/k/v group."""
    if not cfg.fuses_projections():
        return None
    hidden, qkv = qkv_weight_shape(model_config)
    bound = math.inf if cfg.fuse_projections is True else FROZEN_GROUP_MAX_BYTES
    return FuseSharedInputProjections(bound, None if cfg.recompute_qkv else (qkv, hidden),
                                      cfg.folds_lora())


class FuseSharedInputProjections(CustomGraphPass):
    """The pre-grad graph pass (inductor's `pre_grad_custom_pass`). Each group it fuses counts in
    torch._dynamo's counters["inductor"]["fused_projections"], each group of LoRA projections it folds
    in ["folded_lora"], beside inductor's own passes'.
    frozen_max_bytes: frozen groups whose weights take more are left unfused, unless their fused weight
    has the shape `always_fused` ([out, in]: the q/k/v group whose GEMM output recompute keeps).
    fold_lora: groups of adapted projections are folded (sfttrain.lora_fold) where their frozen weights
    would be fused, but for the `always_fused` group (recompute finds its GEMM by that weight's shape)."""

    def __init__(self, frozen_max_bytes: float = math.inf, always_fused: tuple[int, int] | None = None,
                 fold_lora: bool = False):
        self.frozen_max_bytes, self.always_fused, self.fold_lora = frozen_max_bytes, always_fused, fold_lora

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.fold_lora:
            counters["inductor"]["folded_lora"] += lora_fold.fold(graph, self.folds)
        groups = defaultdict(list)
        for node in graph.nodes:
            key = group_key(node)
            if key is not None:
                groups[key].append(node)
        for (_, trained, *_), nodes in groups.items():
            if len(nodes) > 1 and (trained or self.fuses_frozen([n.args[1] for n in nodes])):
                fuse(graph, nodes)
                counters["inductor"]["fused_projections"] += 1

    def describe(self) -> str:
        """What the start-up line says of the groups left apart and of LoRA's folding."""
        but_qkv = " but q/k/v's" if self.always_fused else ""
        folded = f", LoRA's B inside the frozen GEMMs{but_qkv} (model.fold_lora)" if self.fold_lora else ""
        if self.frozen_max_bytes == math.inf:
            return folded
        kept = "" if self.always_fused is None else " other than q/k/v, whose output model.recompute_qkv=false keeps"
        return f", but not groups of frozen weights over {int(self.frozen_max_bytes) >> 20} MiB a layer{kept}{folded}"

    def fuses_frozen(self, weights: list[torch.fx.Node]) -> bool:
        return self.within_bound(weights) or self.fused_shape(weights) == self.always_fused

    def folds(self, weights: list[torch.fx.Node]) -> bool:
        return self.within_bound(weights) and self.fused_shape(weights) != self.always_fused

    def within_bound(self, weights: list[torch.fx.Node]) -> bool:
        values = [w.meta["example_value"] for w in weights]
        return sum(w.numel() * w.element_size() for w in values) <= self.frozen_max_bytes

    @staticmethod
    def fused_shape(weights: list[torch.fx.Node]) -> tuple[int, int]:
        values = [w.meta["example_value"] for w in weights]
        return sum(w.shape[0] for w in values), values[0].shape[1]

    def uuid(self) -> str:
        """inductor's cache key for the pass: the graphs it makes depend on this file's and
        sfttrain.lora_fold's code and the pass's settings."""
        code = b"".join(open(path, "rb").read() for path in (__file__, lora_fold.__file__))
        settings = repr((self.frozen_max_bytes, self.always_fused, self.fold_lora)).encode()
        return hashlib.sha256(code + settings).hexdigest()


def group_key(node: torch.fx.Node) -> tuple | None:
    """(input, weights trained, has bias, weights' dtype) of a linear that can join a group; else None.
    Only a linear of graph inputs (parameters) joins: the concatenation goes before the group's first
    linear, where a weight computed inside the graph (a cast, say) may not exist yet."""
    if node.op != "call_function" or node.target not in LINEAR or node.kwargs:
        return None
    x, weight, bias = (*node.args, None)[:3]
    params = [weight] if bias is None else [weight, bias]
    if not all(isinstance(p, torch.fx.Node) and p.op == "placeholder" for p in params):
        return None
    w = weight.meta.get("example_value")
    if w is None or w.dim() != 2 or "example_value" not in node.meta:
        return None
    return x, w.requires_grad, bias is not None, w.dtype


def fuse(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Replaces the group's linears by one over the concatenated weights (and biases), split back."""
    x = nodes[0].args[0]
    weights = [n.args[1] for n in nodes]
    biases = [n.args[2] for n in nodes if len(n.args) > 2 and n.args[2] is not None]  # all or none (group_key)
    with graph.inserting_before(nodes[0]):
        weight = concatenated(graph, weights)
        bias = concatenated(graph, biases) if biases else None
        fused = with_value(graph.call_function(torch._C._nn.linear, (x, weight, bias)))
    split_back(graph, fused, nodes)
    for node in nodes:
        graph.erase_node(node)
