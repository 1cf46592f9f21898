"""model.fuse_projections: projections that read the same input (q/k/v; gate/up; LoRA's A) run as one
GEMM in the compiled layers: an inductor pre-grad pass rewrites `linear(x, w_i, b_i)` of a group into
`linear(x, cat(w), cat(b))` split back. A group's weights agree in whether they are trained (else the
frozen one's gradient would be computed). The concatenation is a copy, so frozen groups over
FROZEN_GROUP_MAX_BYTES stay unfused (auto), but the q/k/v group recompute_qkv=false keeps."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from sfttrain import graph_rewrite, lora_fold
from sfttrain.config import ModelConfig
from sfttrain.graph_rewrite import LINEAR, are_parameters, concatenated, is_call, split_back, with_value
from sfttrain.recompute import qkv_weight_shape

FROZEN_GROUP_MAX_BYTES = 32 * 2**20  # where copying the weights costs what the saved launches save


def graph_pass(cfg: ModelConfig, model_config) -> FuseSharedInputProjections | None:
    """The pass model.fuse_projections asks for (None: off); with model.fold_lora it folds LoRA's
    groups first (sfttrain.lora_fold)."""
    if not cfg.fuses_projections():
        return None
    hidden, qkv = qkv_weight_shape(model_config)
    bound = math.inf if cfg.fuse_projections is True else FROZEN_GROUP_MAX_BYTES
    return FuseSharedInputProjections(bound, None if cfg.recompute_qkv else (qkv, hidden),
                                      cfg.folds_lora())


class FuseSharedInputProjections(CustomGraphPass):
    """inductor's `pre_grad_custom_pass`, counting in counters["inductor"]["fused_projections"] and
    ["folded_lora"]. Frozen groups over frozen_max_bytes stay unfused unless their fused weight has
    the shape `always_fused` ([out, in]), which is never folded: recompute finds its GEMM by it."""

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
        """inductor's cache key: the code of this pass and of the helpers it calls, and the settings."""
        code = b"".join(open(path, "rb").read() for path in (__file__, lora_fold.__file__, graph_rewrite.__file__))
        settings = repr((self.frozen_max_bytes, self.always_fused, self.fold_lora)).encode()
        return hashlib.sha256(code + settings).hexdigest()


def group_key(node: torch.fx.Node) -> tuple | None:
    """(input, weights trained, has bias, weights' dtype) of a linear that can join a group; else None.
    Only parameters (graph inputs) join: they exist before the group's first linear."""
    if not is_call(node, LINEAR) or node.kwargs:
        return None
    x, weight, bias = (*node.args, None)[:3]
    if not are_parameters([weight, bias]):
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
