"""Token-sum cross-entropy, normalised by the step's global loss-token count.

`CausalLMLoss` wraps the unmodified Hugging Face model: it runs the decoder to hidden states and
computes the summed loss from them and the output embedding, so the [tokens, vocab] logits are
never held whole (Liger's fused linear cross-entropy, or chunks recomputed in backward). It is
the FSDP root module, so the embedding / lm_head all-gathers happen inside its forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sfttrain.data.pack import IGNORE_INDEX, MicroBatch

# Tokens per chunk of the unfused loss: bounds the logits held at once to CHUNK x vocab (fp32).
LOSS_CHUNK_TOKENS = 4096


class CausalLMLoss(nn.Module):
    def __init__(self, model: nn.Module, fused: bool, compiled_max_seqlen: int | None = None):
        """fused: Liger's fused linear cross-entropy. compiled_max_seqlen: the layers are compiled;
        pass this fixed upper bound as the attention's max sample length (the kernels only need a
        bound, and a compiled layer would specialise and recompile on every distinct value)."""
        super().__init__()
        self.model = model  # the Hugging Face causal LM, unmodified
        self.fused = fused
        self.compiled_max_seqlen = compiled_max_seqlen
        self.chunk_loss = torch.compile(_chunk_loss, dynamic=True) if compiled_max_seqlen else _chunk_loss
        cfg = model.config
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            raise ValueError(f"{cfg.model_type}: logit soft-capping / scaling is not supported by sfttrain's loss yet")

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        """Sum of the token losses of the micro-batch (fp32 scalar)."""
        inputs = batch.model_inputs()
        if self.compiled_max_seqlen:
            inputs.update(max_length_q=self.compiled_max_seqlen, max_length_k=self.compiled_max_seqlen)
        hidden = self.model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        hidden = hidden.view(-1, hidden.shape[-1])
        weight = self.model.get_output_embeddings().weight
        labels = batch.labels.view(-1)
        if self.fused:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            # accum_dtype fp32: the weight gradient sums over all chunks; bf16 would round it
            return liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX,
                                                    reduction="sum", accum_dtype=torch.float32)
        return chunked_cross_entropy_sum(hidden, weight, labels, self.chunk_loss)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk_loss=_chunk_loss) -> torch.Tensor:
    """Summed cross-entropy computed chunk by chunk; each chunk's logits are recomputed in
    backward instead of stored (one extra lm_head matmul, a fraction of the memory)."""
    if hidden.shape[0] <= LOSS_CHUNK_TOKENS:
        return chunk_loss(hidden, weight, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(LOSS_CHUNK_TOKENS), labels.split(LOSS_CHUNK_TOKENS)):
        total = total + checkpoint(chunk_loss, h, weight, y, use_reentrant=False)
    return total


def normalised(loss_sum: torch.Tensor, global_loss_tokens: int, dp_size: int) -> torch.Tensor:
    """The micro-batch's share of the step loss: sum / (loss tokens of the WHOLE step, all ranks).

    FSDP averages gradients over the dp_size ranks; multiplying by dp_size turns that average
    into the sum, so the update equals that of one rank running the whole step at once,
    however the step is split into ranks and micro-batches."""
    return loss_sum * (dp_size / max(global_loss_tokens, 1))
