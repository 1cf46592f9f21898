"""model.fold_lora: each LoRA adapter's B runs inside its frozen projection's GEMM, in the compiled
layers. A group of adapted projections of one input x (peft: linear(x, W) + linear(linear(x, A), B) s)
becomes U = x @ [A_1; ...; A_n]^T and [y_1 | ... | y_n] = [x | U] @ [[W_1, s B_1, 0], ...]^T, one GEMM
whose backward (`lora_linear`) never computes the frozen W's gradient. An inductor pre-grad pass run
by sfttrain.fuse_projections."""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch._inductor.decomposition import register_decomposition

from sfttrain.graph_rewrite import (LINEAR, are_parameters, concatenated, is_call, recomputed, split_back,
                                    with_value)


def folded_linear(x, u, frozen, trained, bias):
    """[x | u] @ [frozen, trained]^T + bias, in x's dtype: the trained block cast to it (as autocast
    casts an fp32 adapter for its GEMM)."""
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
    """inductor generates the op into the compiled layer (no Python per call); applied below
    autograd, so the backward is still `_backward`."""
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
        """The adapted projection whose output (peft's sum) `node` is, or None."""
        if not is_call(node, (operator.add,)) or len(node.args) != 2:
            return None
        base, mul = node.args
        if not (is_call(base, LINEAR) and is_call(mul, (operator.mul,)) and is_call(mul.args[0], LINEAR)):
            return None
        linear_b = mul.args[0]
        linear_a = linear_b.args[0]
        if not (is_call(linear_a, LINEAR) and linear_a.args[0] is base.args[0] and _bias(linear_a) is None
                and _bias(linear_b) is None):
            return None
        if any(len(n.users) != 1 for n in (base, mul, linear_b, linear_a)):  # each feeds only the next
            return None
        if base.kwargs or not are_parameters([base.args[1], linear_a.args[1], linear_b.args[1], _bias(base)]):
            return None
        found = cls(node)
        w, out = found.weight.meta["example_value"], base.meta["example_value"]
        # frozen base, computed in its own dtype (no autocast cast between), trained adapters
        if w.requires_grad or out.dtype != w.dtype or found.x.meta["example_value"].dtype != w.dtype:
            return None
        return found if all(p.meta["example_value"].requires_grad for p in (found.lora_a, found.lora_b)) else None


def _bias(linear: torch.fx.Node) -> torch.fx.Node | None:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def fold(graph: torch.fx.Graph, folds_frozen) -> int:
    """Folds every group of adapted projections of one input whose frozen weights `folds_frozen`
    accepts (a list of weight nodes -> bool); returns the number of groups folded."""
    groups = defaultdict(list)
    for node in graph.nodes:
        adapted = Adapted.match(node)
        if adapted is not None:
            groups[adapted.x, adapted.bias is not None].append(adapted)
    folded = 0
    for group in groups.values():
        if folds_frozen([a.weight for a in group]):
            fold_group(graph, group)
            folded += 1
    return folded


def fold_group(graph: torch.fx.Graph, group: list[Adapted]) -> None:
    """Replaces the group's projections (base, A, B, scale, sum) by one lora_linear, split back."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    first = min((a.out for a in group), key=position.__getitem__)
    for a in group:  # a later projection's scale (a float peft reads) is needed at the first sum
        if isinstance(a.scale, torch.fx.Node) and position[a.scale] > position[first]:
            first.prepend(a.scale)
    x = group[0].x
    with graph.inserting_before(first):
        u = with_value(graph.call_function(torch._C._nn.linear, (x, _joined(graph, [a.lora_a for a in group]))))
        scaled = [recomputed(with_value(graph.call_function(operator.mul, (a.lora_b, a.scale)))) for a in group]
        trained = (scaled[0] if len(group) == 1 else
                   recomputed(with_value(graph.call_function(torch.block_diag, tuple(scaled)))))
        frozen = _joined(graph, [a.weight for a in group])
        bias = _joined(graph, [a.bias for a in group]) if group[0].bias is not None else None
        fused = with_value(graph.call_function(torch.ops.sfttrain.lora_linear.default, (x, u, frozen, trained, bias)))
    split_back(graph, fused, [a.out for a in group])
    for a in group:
        for node in (a.out, a.out.args[1], a.linear_b, a.linear_a, a.base):
            graph.erase_node(node)


def _joined(graph: torch.fx.Graph, params: list[torch.fx.Node]) -> torch.fx.Node:
    """One projection's parameter as it is, a group's concatenated."""
    return params[0] if len(params) == 1 else concatenated(graph, params)
