"""Padding-free packing and the balanced split of a step's samples over ranks and micro-batches.

A micro-batch is ONE row: the samples concatenated, `position_ids` restarting at 0 for each and
`cu_seqlens` marking the boundaries, labels shifted inside each sample so no target crosses one.
The pad to a multiple of `pad_to` has no targets and joins the last sample's attention segment
(causal: it sees the sample, is never seen), so it changes no loss or gradient and a one-sample
row stays one segment, which cuDNN's attention runs. Every rank computes the same split from the
same lengths, with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfttrain.data.render import RenderedSample

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]: the next token where it is a target, else IGNORE_INDEX
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [n + 1] int32 sample boundaries (the pad segment's included)
    max_seqlen: int  # the longest attention segment (the last sample's includes the pad)
    num_loss_tokens: int
    num_samples: int | None = None  # the real samples' segments come first; None: every segment
    # [num_loss_tokens] the positions whose logits the loss needs, found on the host (on the device: a sync)
    loss_rows: torch.Tensor | None = None

    def __post_init__(self):
        if self.loss_rows is None:
            self.loss_rows = (self.labels.view(-1) != IGNORE_INDEX).nonzero().view(-1)

    def to(self, device: torch.device) -> "MicroBatch":
        return self.map_tensors(lambda t: t.to(device, non_blocking=True))

    TENSORS = 5  # the tensors map_tensors maps

    def map_tensors(self, fn) -> "MicroBatch":
        return MicroBatch(fn(self.input_ids), fn(self.labels), fn(self.position_ids), fn(self.cu_seqlens),
                          self.max_seqlen, self.num_loss_tokens, self.num_samples, fn(self.loss_rows))

    def model_inputs(self) -> dict:
        """The HF model call's keywords (transformers' FlashAttentionKwargs)."""
        bounds = self.attention_bounds()
        return dict(input_ids=self.input_ids, position_ids=self.position_ids,
                    cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                    max_length_q=self.max_seqlen, max_length_k=self.max_seqlen)

    def attention_bounds(self) -> torch.Tensor:
        """The samples' segments, the pad joining the last one."""
        n = self.num_samples
        if not n or n + 1 == len(self.cu_seqlens):  # no pad, or nothing but pad (an empty micro-batch)
            return self.cu_seqlens
        return torch.cat([self.cu_seqlens[:n], self.cu_seqlens[-1:]])


def shifted_labels(sample: RenderedSample) -> list[int]:
    """Position t's target is the same sample's token t+1, where that token is trained."""
    ids, mask = sample.input_ids, sample.loss_mask
    return [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def pack(samples: list[RenderedSample], pad_to: int = 1) -> MicroBatch:
    if not samples:
        return empty_micro_batch()
    input_ids, labels, bounds = [], [], [0]
    positions: list[int] = []
    for s in samples:
        input_ids += s.input_ids
        labels += shifted_labels(s)
        positions += range(len(s.input_ids))
        bounds.append(bounds[-1] + len(s.input_ids))
    num_loss = sum(label != IGNORE_INDEX for label in labels)
    max_seqlen = max(len(s.input_ids) for s in samples)
    return pad_row(MicroBatch(torch.tensor([input_ids]), torch.tensor([labels]), torch.tensor([positions]),
                              torch.tensor(bounds, dtype=torch.int32), max_seqlen, num_loss, len(samples)), pad_to)


def pad_row(batch: MicroBatch, pad_to: int) -> MicroBatch:
    pad = -batch.input_ids.shape[1] % pad_to
    if not pad:
        return batch
    samples = len(batch.cu_seqlens) - 1 if batch.num_samples is None else batch.num_samples
    length = batch.input_ids.shape[1] + pad
    # the pad ends the last sample's segment (with no sample, its own)
    last_segment = length - int(batch.cu_seqlens[samples - 1]) if samples else length
    return MicroBatch(torch.cat([batch.input_ids, batch.input_ids.new_zeros(1, pad)], 1),
                      torch.cat([batch.labels, batch.labels.new_full((1, pad), IGNORE_INDEX)], 1),
                      torch.cat([batch.position_ids, torch.arange(pad, dtype=batch.position_ids.dtype)[None]], 1),
                      torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad]),
                      max(batch.max_seqlen, last_segment), batch.num_loss_tokens, samples)


def local_slice(batch: MicroBatch, rank: int, size: int) -> MicroBatch:
    """Rank `rank`'s equal contiguous slice of the row (padded to split), cut on the host. The
    boundaries stay the whole row's (attention gathers it again); the loss-token count is the slice's."""
    if size == 1:
        return batch
    batch = pad_row(batch, size)
    length = batch.input_ids.shape[1] // size
    part = slice(rank * length, (rank + 1) * length)
    labels = batch.labels[:, part]
    return MicroBatch(batch.input_ids[:, part], labels, batch.position_ids[:, part], batch.cu_seqlens,
                      batch.max_seqlen, int((labels != IGNORE_INDEX).sum()), batch.num_samples)


def max_segment_length(max_length: int, pad_to: int, slices: int = 1) -> int:
    """The longest segment a row can hold: a sample and the pad after it (for pad_to, and to split into
    `slices`). A kernel told less leaves the excess outputs unwritten (NaN x 0 is NaN)."""
    return max_length + pad_to - 1 + slices - 1


def empty_micro_batch() -> MicroBatch:
    """One token with no target: a rank with fewer micro-batches than its peers joins FSDP's collectives."""
    return MicroBatch(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX),
                      torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32), 1, 0, 0)


def loss_tokens(sample: RenderedSample) -> int:
    return sum(sample.loss_mask[1:])  # the first token has no predecessor to predict it from


def balanced_bins(costs: list[float], n_bins: int, per_bin: int | None = None) -> list[list[int]]:
    """Longest-processing-time-first into n_bins of near-equal cost (exactly per_bin items each if set);
    ties go to the lower index, so every rank computes the same split."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0.0] * n_bins
    for i in order:
        open_bins = [b for b in range(n_bins) if per_bin is None or len(bins[b]) < per_bin]
        b = min(open_bins, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += costs[i]
    return [sorted(b) for b in bins]


def budget_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing: fewest bins whose token total stays within the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        b = next((b for b, load in enumerate(loads) if load + lengths[i] <= budget), len(bins))
        if b == len(bins):
            bins.append([])
            loads.append(0)
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]
