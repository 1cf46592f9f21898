"""Ulysses sequence parallelism (DeepSpeed-Ulysses) over sfttrain's packed rows.

With `ulysses_sequence_parallel_size` = sp > 1, the sp ranks of one group receive the same
micro-batches (the data is split by data-parallel rank) and each keeps one contiguous slice of
every packed row: T / sp tokens, with their true position ids and labels. Embeddings, MLPs, norms
and the loss run on the slice. Around attention one all-to-all turns the slice's [T/sp, H, D]
into [T, H/sp, D]: every rank then attends over the WHOLE row (all samples, the row's full
cu_seqlens) for its share of the heads, and a second all-to-all returns [T/sp, H, D]. The model
code is untouched: the hook wraps the attention function registered with transformers.

Gradients. Rank r's loss is the sum over its slice's tokens, scaled like every other rank's
(`sfttrain.loss.normalised`: x reduce ranks / the step's global loss-token count). The
all-to-all's backward is the reverse all-to-all, so the gradient that reaches each rank's
activations holds every rank's loss; each rank's parameter gradient is then its slice's share
of the total, and the total is their SUM over the sp group. FSDP shards over dp_shard x sp
flattened (as torchtitan's dp_shard_cp), so its reduce-scatter averages over all those ranks and
`normalised` multiplies by their number: no loss is divided by sp anywhere (verl scales the
loss by 1/sp on one of its paths, which makes the update depend on the layout).

Grouped-query attention: the query heads must divide by sp. Key/value heads that divide by sp
are split like the query heads; fewer KV heads than sp (sp a multiple of them) are repeated to
sp heads first, so each rank gets the one KV head its query heads use; other counts are refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sfttrain import attention
from sfttrain.config import ConfigError


class SequenceParallel:
    """One rank's place in its sequence-parallel group: runs attention over whole rows."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group, self.size = group, size

    def attention_forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, **kwargs):
        """transformers' attention contract on the slice: query [1, H, T/sp, D], key/value
        [1, Hkv, T/sp, D] -> ([1, T/sp, H, D], None), computed by the varlen attention over the
        whole row for H/sp heads."""
        key, value = (repeat_kv_heads(t, self.size) for t in (key, value))
        query, key, value = (self._gather_sequence(t) for t in (query, key, value))
        out, _ = attention.varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return self._scatter_sequence(out), None

    # the exchanges stay eager under model.compile: a graph break around a collective, not a trace of it
    @torch.compiler.disable
    def _gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, T/sp, D] -> [1, H/sp, T, D]: all tokens of the row, this rank's heads."""
        heads, local, dim = x.shape[1:]
        # send head group j to rank j; rank i's chunk arrives i-th, i.e. in token order
        send = x[0].reshape(self.size, heads // self.size, local, dim)
        recv = AllToAll.apply(send, self.group)  # [sp, H/sp, T/sp, D], first dim = source rank
        return recv.transpose(0, 1).reshape(1, heads // self.size, self.size * local, dim)

    @torch.compiler.disable
    def _scatter_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """[1, T, H/sp, D] -> [1, T/sp, H, D]: this rank's tokens, all heads."""
        tokens, heads, dim = out.shape[1:]
        send = out[0].reshape(self.size, tokens // self.size, heads, dim)  # token slice j to rank j
        recv = AllToAll.apply(send, self.group)  # [sp, T/sp, H/sp, D], first dim = head group
        return recv.permute(1, 0, 2, 3).reshape(1, tokens // self.size, self.size * heads, dim)


class AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; chunk i of the result came from rank i. Its gradient is
    the same exchange backwards."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def repeat_kv_heads(x: torch.Tensor, sp: int) -> torch.Tensor:
    """[1, Hkv, T, D] with Hkv < sp: each KV head repeated sp / Hkv times, in place of its
    query-head group, so that head group j of the queries meets KV head j."""
    heads = x.shape[1]
    return x if heads % sp == 0 else x.repeat_interleave(sp // heads, dim=1)


def check_heads(model_config, sp: int) -> None:
    """Refuses head counts Ulysses cannot split over sp ranks, before any compute."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % sp:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {heads} attention heads do not "
                          f"split over {sp} ranks; use a size that divides {heads}")
    if kv_heads % sp and sp % kv_heads:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {kv_heads} key/value heads neither "
                          f"split over {sp} ranks nor repeat evenly to {sp}; use a divisor or a multiple of "
                          f"{kv_heads} that divides {heads}")


def check_model(model_config, sp: int) -> None:
    """What Ulysses over sp ranks needs of the model, from its config alone (the run checks it on the
    loaded model, the preflight on config.json): heads that split, and no router loss."""
    check_heads(model_config, sp)
    if getattr(model_config, "output_router_logits", False):  # its per-sample statistics would need each
        # sample's tokens from all sp ranks
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the router's load-balancing loss "
                          "(output_router_logits=true) is computed per sample and does not run under sequence "
                          "parallelism yet; set ulysses_sequence_parallel_size=1 or output_router_logits=false")


def apply(lm: nn.Module, group: dist.ProcessGroup, size: int) -> SequenceParallel:
    """Installs Ulysses' attention on the model of `lm` (a CausalLMLoss); the data loader feeds
    it `sfttrain.data.pack.local_slice`s."""
    check_model(lm.model.config, size)  # lm.router is there exactly where the config asks for the router loss
    sp = SequenceParallel(group, size)
    attention.register(sp.attention_forward)
    return sp
