"""model.fuse_projections and model.fold_lora: an inductor pre-grad pass over the compiled layers' graphs.
Fusing: `linear(x, w_i, b_i)` of projections that read the same x (q/k/v; gate/up; LoRA's A) and agree
in whether they are trained becomes `linear(x, cat(w), cat(b))` split back; the concatenation is a copy,
so frozen groups over FROZEN_GROUP_MAX_BYTES stay apart (auto), but the q/k/v group recompute_qkv=false keeps.
Folding: adapted projections of one x (peft: linear(x, W) + linear(linear(x, A), B) s) become
U = x @ [A_1; ...; A_n]^T and [y_1 | ... | y_n] = [x | U] @ [[W_1, s B_1, 0], ...]^T, one GEMM whose
backward (`lora_linear`) never computes the frozen W's gradient."""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import register_decomposition
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import CheckpointPolicy

from sfttrain.config import ModelConfig
from sfttrain.recompute import qkv_weight_shape

FROZEN_GROUP_MAX_BYTES = 32 * 2**20  # where copying the weights costs what the saved launches save
LINEAR = (torch._C._nn.linear, F.linear)  # a linear layer in dynamo's graph


def graph_pass(cfg: ModelConfig, model_config, fuse: bool, fold_lora: bool) -> FuseSharedInputProjections | None:
    if not fuse:
        return None
    hidden, qkv = qkv_weight_shape(model_config)
    bound = math.inf if cfg.fuse_projections is True else FROZEN_GROUP_MAX_BYTES
    return FuseSharedInputProjections(bound, None if cfg.recompute_qkv else (qkv, hidden), fold_lora)


class FuseSharedInputProjections(CustomGraphPass):
    """inductor's `pre_grad_custom_pass`, counting in counters["inductor"]["fused_projections"] and
    ["folded_lora"]. Frozen groups over frozen_max_bytes stay unfused unless their fused weight has
    the shape `always_fused` ([out, in]), which is never folded: recompute finds its GEMM by it."""

    def __init__(self, frozen_max_bytes: float = math.inf, always_fused: tuple[int, int] | None = None,
                 fold_lora: bool = False):
        self.frozen_max_bytes, self.always_fused, self.fold_lora = frozen_max_bytes, always_fused, fold_lora

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.fold_lora:
            adapted = defaultdict(list)
            for node in graph.nodes:
                if (a := Adapted.match(node)) is not None:
                    adapted[a.x, a.bias is not None].append(a)
            for group in adapted.values():
                if self.bounds([a.weight for a in group]) == (True, False):
                    fold_group(graph, group)
                    counters["inductor"]["folded_lora"] += 1
        groups = defaultdict(list)
        for node in graph.nodes:
            if (key := group_key(node)) is not None:
                groups[key].append(node)
        for (_, trained, *_), nodes in groups.items():
            if len(nodes) > 1 and (trained or any(self.bounds([n.args[1] for n in nodes]))):
                fuse(graph, nodes)
                counters["inductor"]["fused_projections"] += 1

    def describe(self) -> str:
        but_qkv = " but q/k/v's" if self.always_fused else ""
        folded = f", LoRA's B inside the frozen GEMMs{but_qkv} (model.fold_lora)" if self.fold_lora else ""
        if self.frozen_max_bytes == math.inf:
            return folded
        kept = "" if self.always_fused is None else " other than q/k/v, whose output model.recompute_qkv=false keeps"
        return f", but not groups of frozen weights over {int(self.frozen_max_bytes) >> 20} MiB a layer{kept}{folded}"

    def bounds(self, weights: list[torch.fx.Node]) -> tuple[bool, bool]:
        """Whether a group's frozen weights fit frozen_max_bytes, and whether their fused shape is always_fused."""
        values = [w.meta["example_value"] for w in weights]
        fits = sum(w.numel() * w.element_size() for w in values) <= self.frozen_max_bytes
        return fits, (sum(w.shape[0] for w in values), values[0].shape[1]) == self.always_fused

    def uuid(self) -> str:
        """inductor's cache key: the code of this pass and its settings."""
        with open(__file__, "rb") as f:
            code = f.read() + repr((self.frozen_max_bytes, self.always_fused, self.fold_lora)).encode()
        return hashlib.sha256(code).hexdigest()


def group_key(node: torch.fx.Node) -> tuple | None:
    """(input, weights trained, has bias, weights' dtype) of a linear of parameters (graph inputs: they
    exist before the group's first linear); else None."""
    if not is_call(node, LINEAR) or node.kwargs or "example_value" not in node.meta:
        return None
    x, weight, bias = (*node.args, None)[:3]
    w = weight.meta.get("example_value") if are_parameters([weight, bias]) else None
    if w is None or w.dim() != 2:
        return None
    return x, w.requires_grad, bias is not None, w.dtype


def fuse(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    biases = [_bias(n) for n in nodes if _bias(n) is not None]  # all or none (group_key)
    with graph.inserting_before(nodes[0]):
        weight = concatenated(graph, [n.args[1] for n in nodes])
        bias = concatenated(graph, biases) if biases else None
        fused = call(graph, torch._C._nn.linear, (nodes[0].args[0], weight, bias))
    split_back(graph, fused, nodes, nodes)


def folded_linear(x, u, frozen, trained, bias):
    """[x | u] @ [frozen, trained]^T + bias, the trained block cast to x's dtype (as autocast casts it)."""
    return F.linear(torch.cat([x, u], -1), torch.cat([frozen, trained.to(frozen.dtype)], 1), bias)


@torch.library.custom_op("sfttrain::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, u: torch.Tensor, frozen: torch.Tensor, trained: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`folded_linear`, with a backward that computes no gradient of the frozen block."""
    return folded_linear(x, u, frozen, trained, bias)


@lora_linear.register_fake
def _(x, u, frozen, trained, bias):
    return x.new_empty(*x.shape[:-1], frozen.shape[0])


def _setup(ctx, inputs, output):
    x, u, frozen, trained, _ = inputs
    ctx.save_for_backward(u, frozen, trained)
    ctx.width = x.shape[-1]


def _backward(ctx, grad):
    u, frozen, trained = ctx.saved_tensors
    # dim -1 where forward says 1: the same expression would be merged by CSE and forward's copy
    # of the weights saved for backward
    grad_input = grad @ torch.cat([frozen, trained.to(frozen.dtype)], -1)
    flat_grad, flat_u = grad.reshape(-1, grad.shape[-1]), u.reshape(-1, u.shape[-1])
    grad_trained = (flat_grad.t() @ flat_u).to(trained.dtype)  # the frozen block's gradient is never computed
    return grad_input[..., :ctx.width], grad_input[..., ctx.width:], None, grad_trained, None


lora_linear.register_autograd(_backward, setup_context=_setup)


@register_decomposition(torch.ops.sfttrain.lora_linear.default)
def _inline(x, u, frozen, trained, bias):
    """inductor generates the op into the compiled layer (no Python a call); below autograd: `_backward` stays."""
    return folded_linear(x, u, frozen, trained, bias)


class Adapted:
    """One adapted projection in the graph: out = add(base, mul(linear(linear(x, A), B), scale))."""

    def __init__(self, out: torch.fx.Node):
        self.out = out
        self.base, mul = out.args
        self.linear_b, self.scale = mul.args
        self.linear_a = self.linear_b.args[0]
        self.x, self.weight, self.bias = self.base.args[0], self.base.args[1], _bias(self.base)
        self.lora_a, self.lora_b = self.linear_a.args[1], self.linear_b.args[1]

    @classmethod
    def match(cls, node: torch.fx.Node) -> Adapted | None:
        args = node.args if is_call(node, (operator.add,)) else ()
        if not (len(args) == 2 and is_call(args[0], LINEAR) and is_call(args[1], (operator.mul,))
                and is_call(args[1].args[0], LINEAR) and is_call(args[1].args[0].args[0], LINEAR)):
            return None
        a = cls(node)
        if (a.linear_a.args[0] is not a.x or _bias(a.linear_a) is not None or _bias(a.linear_b) is not None
                or a.base.kwargs or not are_parameters([a.weight, a.lora_a, a.lora_b, a.bias])
                or any(len(n.users) != 1 for n in (a.base, args[1], a.linear_b, a.linear_a))):  # each feeds the next
            return None
        w, x, out, lora_a, lora_b = (n.meta["example_value"] for n in (a.weight, a.x, a.base, a.lora_a, a.lora_b))
        # frozen base, computed in its own dtype (no autocast cast between), trained adapters
        frozen = not w.requires_grad and out.dtype == x.dtype == w.dtype
        return a if frozen and lora_a.requires_grad and lora_b.requires_grad else None


def fold_group(graph: torch.fx.Graph, group: list[Adapted]) -> None:
    position = {node: i for i, node in enumerate(graph.nodes)}
    first = min((a.out for a in group), key=position.__getitem__)
    for a in group:  # a later projection's scale (a float peft reads) is needed at the first sum
        if isinstance(a.scale, torch.fx.Node) and position[a.scale] > position[first]:
            first.prepend(a.scale)
    x = group[0].x
    with graph.inserting_before(first):
        u = call(graph, torch._C._nn.linear, (x, concatenated(graph, [a.lora_a for a in group])))
        scaled = [call(graph, operator.mul, (a.lora_b, a.scale), recompute=True) for a in group]
        trained = scaled[0] if len(group) == 1 else call(graph, torch.block_diag, tuple(scaled), recompute=True)
        frozen = concatenated(graph, [a.weight for a in group])
        bias = concatenated(graph, [a.bias for a in group]) if group[0].bias is not None else None
        fused = call(graph, torch.ops.sfttrain.lora_linear.default, (x, u, frozen, trained, bias))
    split_back(graph, fused, [a.out for a in group],
               [node for a in group for node in (a.out, a.out.args[1], a.linear_b, a.linear_a, a.base)])


def _bias(linear: torch.fx.Node) -> torch.fx.Node | None:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def are_parameters(nodes) -> bool:
    """Whether each of `nodes` but None is a graph input (a parameter): it exists before any op."""
    return all(isinstance(n, torch.fx.Node) and n.op == "placeholder" for n in nodes if n is not None)


def concatenated(graph: torch.fx.Graph, params: list[torch.fx.Node]) -> torch.fx.Node:
    """One parameter as it is; several concatenated along dim 0 at the insertion point, recomputed in backward."""
    if len(params) == 1:
        return params[0]
    return call(graph, torch.cat, (params,), {"dim": 0}, recompute=True)


def split_back(graph: torch.fx.Graph, fused: torch.fx.Node, replaced: list[torch.fx.Node],
               erased: list[torch.fx.Node]) -> None:
    """Hands each of `replaced` its columns of `fused` (their outputs side by side), then erases `erased`."""
    sizes = [node.meta["example_value"].shape[-1] for node in replaced]
    with graph.inserting_after(fused):
        parts = call(graph, torch.split, (fused, sizes), {"dim": -1})
    for i, node in enumerate(replaced):
        with graph.inserting_after(parts):
            part = graph.call_function(operator.getitem, (parts, i))
        part.meta.update(node.meta)
        node.replace_all_uses_with(part)
    for node in erased:  # users first
        graph.erase_node(node)


def call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None, recompute: bool = False):
    """A node inserted with the fake `example_value` later passes read, computed as dynamo does (under the
    inputs' fake mode and the Python dispatcher, which handles symbolic sizes). `recompute`: a product of
    parameters, recomputed in backward (saved, it would hold a copy of the weights)."""
    node = graph.call_function(target, args, kwargs or {})
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    modes = {t.fake_mode for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)}
    with modes.pop() if modes else contextlib.nullcontext(), enable_python_dispatcher():
        node.meta["example_value"] = node.target(*args, **kwargs)
    if recompute:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return node
