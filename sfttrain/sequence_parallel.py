"""Ulysses sequence parallelism over packed rows: each sp rank keeps a slice of every row, and an
all-to-all around attention turns [T/sp, H, D] into [T, H/sp, D] and back. Each rank's loss is its
slice's sum, scaled like every rank's (`sfttrain.loss.normalised`); FSDP shards over dp_shard x sp,
so no loss is divided by sp anywhere."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from sfttrain import attention
from sfttrain.config import ConfigError


class SequenceParallel:
    """One rank's place in its sequence-parallel group: runs attention over whole rows."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group, self.size = group, size

    def attention_forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, **kwargs):
        """transformers' attention contract on the slice: query [1, H, T/sp, D], key/value
        [1, Hkv, T/sp, D] -> ([1, T/sp, H, D], None)."""
        # KV heads fewer than sp repeated, so that query head group j meets KV head j
        key, value = (t if t.shape[1] % self.size == 0 else t.repeat_interleave(self.size // t.shape[1], dim=1)
                      for t in (key, value))
        # [1, H, T/sp, D] -> [1, H/sp, T, D]: head group j to rank j, whose tokens arrive i-th from rank i
        query, key, value = (self._exchange(t[0].reshape(self.size, t.shape[1] // self.size, *t.shape[2:]))
                             .transpose(0, 1).reshape(1, t.shape[1] // self.size, -1, t.shape[3])
                             for t in (query, key, value))
        out, _ = attention.varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
        # [1, T, H/sp, D] -> [1, T/sp, H, D]: token slice j to rank j, head group i from rank i
        recv = self._exchange(out[0].reshape(self.size, -1, *out.shape[2:]))
        return recv.permute(1, 0, 2, 3).reshape(1, recv.shape[1], -1, out.shape[3]), None

    # eager under model.compile: a graph break around the collective, not a trace of it
    @torch.compiler.disable
    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Chunk j of dim 0 to rank j; chunk i of the result from rank i (autograd: back in backward)."""
        return all_to_all_single(torch.empty_like(send, memory_format=torch.contiguous_format), send.contiguous(),
                                 group=self.group)


def check_model(model_config, sp: int) -> None:
    """What Ulysses over sp ranks needs of the model's config: heads that split, and no router loss
    (its per-sample statistics would need each sample's tokens from all sp ranks)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % sp:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {heads} attention heads do not "
                          f"split over {sp} ranks; use a size that divides {heads}")
    if kv_heads % sp and sp % kv_heads:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {kv_heads} key/value heads neither "
                          f"split over {sp} ranks nor repeat evenly to {sp}; use a divisor or a multiple of "
                          f"{kv_heads} that divides {heads}")
    if getattr(model_config, "output_router_logits", False):
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the router's load-balancing loss "
                          "(output_router_logits=true) is computed per sample and does not run under sequence "
                          "parallelism yet; set ulysses_sequence_parallel_size=1 or output_router_logits=false")


def apply(lm: nn.Module, group: dist.ProcessGroup, size: int) -> SequenceParallel:
    """Installs Ulysses' attention on the model of `lm` (a CausalLMLoss)."""
    check_model(lm.model.config, size)
    sp = SequenceParallel(group, size)
    attention.register(sp.attention_forward)
    return sp
