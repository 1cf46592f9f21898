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


def is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def are_parameters(nodes) -> bool:
    """Whether each of `nodes` but None is a graph input (a parameter): it exists before any op."""
    return all(isinstance(n, torch.fx.Node) and n.op == "placeholder" for n in nodes if n is not None)


def concatenated(graph: torch.fx.Graph, params: list[torch.fx.Node]) -> torch.fx.Node:
    """The parameters concatenated along dim 0 at the insertion point, recomputed in backward."""
    return recomputed(with_value(graph.call_function(torch.cat, (params,), {"dim": 0})))


def split_back(graph: torch.fx.Graph, fused: torch.fx.Node, replaced: list[torch.fx.Node]) -> None:
    """Hands each of `replaced` its columns of `fused` (their outputs side by side, in order)."""
    sizes = [node.meta["example_value"].shape[-1] for node in replaced]
    with graph.inserting_after(fused):
        parts = with_value(graph.call_function(torch.split, (fused, sizes), {"dim": -1}))
    for i, node in enumerate(replaced):
        with graph.inserting_after(parts):
            part = graph.call_function(operator.getitem, (parts, i))
        part.meta.update(node.meta)
        node.replace_all_uses_with(part)


def recomputed(node: torch.fx.Node) -> torch.fx.Node:
    """Marks a concatenation of parameters for recomputation in backward: saved, it would hold a copy
    of the weights from forward to backward."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return node


def with_value(node: torch.fx.Node) -> torch.fx.Node:
    """Gives an inserted node the fake `example_value` later passes read, as dynamo computes it: under
    the inputs' fake mode and the Python dispatcher (which handles symbolic sizes)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    modes = {t.fake_mode for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)}
    with modes.pop() if modes else contextlib.nullcontext(), enable_python_dispatcher():
        node.meta["example_value"] = node.target(*args, **kwargs)
    return node
