"""From Parquet rows to this rank's packed micro-batches, step by step.

The data position is (epoch, samples of that epoch consumed): with the seed it says exactly
which global samples were used, whatever the world size.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from sfttrain.config import ConfigError
from sfttrain.data.pack import MicroBatch, budget_bins, empty_micro_batch, loss_tokens, pack
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.plan import BatchPlan
from sfttrain.data.render import RenderedSample, Renderer


@dataclass
class StepBatch:
    epoch: int
    consumed_in_epoch: int  # samples of `epoch` consumed once this step is done
    micro_batches: list[MicroBatch]  # this rank's share
    num_loss_tokens: int  # the whole step, all ranks: the loss normaliser
    sample_lengths: list[int]  # the whole step, all ranks (tokens/s and the MFU attention term)
    rows: list[int]  # global row ids of the step (for error messages)


class TrainData:
    def __init__(self, source: ParquetSource, renderer: Renderer, plan: BatchPlan, dp_rank: int,
                 seed: int, shuffle: bool, attn_coef: float):
        self.source, self.renderer, self.plan, self.dp_rank = source, renderer, plan, dp_rank
        self.seed, self.shuffle = seed, shuffle
        # balancing cost of a sample of s tokens: s + attn_coef * s^2 (linear layers + attention)
        self.attn_coef = attn_coef

    def batches(self, epoch: int, consumed: int) -> Iterator[StepBatch]:
        """Endless stream of steps from a data position; the trainer decides when to stop."""
        b = self.plan.global_batch
        while True:
            order = self.source.epoch_order(self.seed, epoch, self.shuffle)
            while consumed + b <= len(order):
                rows = order[consumed:consumed + b]
                consumed += b
                yield self._step(rows, epoch, consumed)
            epoch, consumed = epoch + 1, 0

    def _step(self, rows: np.ndarray, epoch: int, consumed: int) -> StepBatch:
        samples = [self.renderer.render(p, r, row) for p, r, row in self.source.read(rows)]
        lengths = [len(s.input_ids) for s in samples]
        costs = [n + self.attn_coef * n * n for n in lengths]
        mine = self.plan.split(lengths, costs)[self.dp_rank]
        micro = [pack([samples[i] for i in idx]) for idx in mine]
        return StepBatch(epoch, consumed, micro, sum(loss_tokens(s) for s in samples), lengths,
                         [s.row for s in samples])


def prefetched(it: Iterator[StepBatch], depth: int) -> Iterator[StepBatch]:
    """Runs `it` in a background thread `depth` steps ahead (tokenizers release the GIL).
    Exceptions reach the consumer at the step where they happened."""
    if depth <= 0:
        yield from it
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce():
        try:
            for item in it:
                q.put(item)
            q.put(done)
        except BaseException as e:  # handed over to the training thread
            q.put(e)

    threading.Thread(target=produce, daemon=True, name="sfttrain-data").start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def render_share(source: ParquetSource, renderer: Renderer, rank: int, world: int) -> list[RenderedSample]:
    """Renders rows rank, rank+world, ... ; a render error on any rank stops every rank with the
    same message (e.g. a sample over data.max_length with data.truncation=error)."""
    error, samples = None, []
    for p, r, row in source.read(np.arange(rank, source.num_rows, world)):
        try:
            samples.append(renderer.render(p, r, row))
        except ValueError as e:
            error = str(e)
            break
    errors = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise ConfigError(first)
    return samples


def validation_batches(samples: list[RenderedSample], micro_batch: int, token_budget: int | None,
                       device: torch.device) -> list[MicroBatch]:
    """This rank's validation micro-batches, padded with empty ones to the count of the busiest
    rank (every rank must run the same number of forwards)."""
    if token_budget:
        groups = budget_bins([len(s.input_ids) for s in samples], token_budget)
    else:
        groups = [list(range(i, min(i + micro_batch, len(samples)))) for i in range(0, len(samples), micro_batch)]
    batches = [pack([samples[i] for i in g]) for g in groups]
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [empty_micro_batch() for _ in range(int(count.item()) - len(batches))]
