"""Helpers of sfttrain's inductor pre-grad graph passes (sfttrain.fuse_projections, sfttrain.lora_fold):
what a linear layer is in dynamo's graph, and how an inserted node gets the fake value later passes read."""

from __future__ import annotations

import contextlib
import operator

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import CheckpointPolicy

LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def concatenated(graph: torch.fx.Graph, params: list[torch.fx.Node]) -> torch.fx.Node:
    """The parameters concatenated along dim 0, a node inserted at the graph's insertion point,
    recomputed in backward (`recomputed`)."""
    return recomputed(with_value(graph.call_function(torch.cat, (params,), {"dim": 0})))


def split_back(graph: torch.fx.Graph, fused: torch.fx.Node, replaced: list[torch.fx.Node]) -> None:
    """Hands each of `replaced` (the nodes one fused GEMM replaces, its output's columns side by side
    in their order) its columns of `fused`."""
    sizes = [node.meta["example_value"].shape[-1] for node in replaced]
    with graph.inserting_after(fused):
        parts = with_value(graph.call_function(torch.split, (fused, sizes), {"dim": -1}))
    for i, node in enumerate(replaced):
        with graph.inserting_after(parts):
            part = graph.call_function(operator.getitem, (parts, i))
        part.meta.update(node.meta)
        node.replace_all_uses_with(part)


def recomputed(node: torch.fx.Node) -> torch.fx.Node:
    """Marks a concatenation of parameters for recomputation in backward. Left to itself, inductor's
    partitioner saves the concatenated weight for the input gradient's GEMM: a copy of the group's
    weights per layer held from forward to backward, where the unfused layer saves the parameters
    themselves, at no cost. Recomputing costs one more copy of the weights."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return node


def with_value(node: torch.fx.Node) -> torch.fx.Node:
    """Gives an inserted node the `example_value` (a fake tensor) later passes read, from its inputs'.
    Computed as dynamo computes its own (get_fake_value): under the inputs' fake mode (a backend may
    run under another) and the Python dispatcher, whose decompositions handle symbolic sizes where
    the C++ ones do not (torch 2.11's linear of a 3-d input asks for its numel)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    modes = {t.fake_mode for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)}
    with modes.pop() if modes else contextlib.nullcontext(), enable_python_dispatcher():
        node.meta["example_value"] = node.target(*args, **kwargs)
    return node
