"""Parquet rows to this rank's packed micro-batches. The data position (epoch, samples consumed) and
the seed say which samples were used, whatever the world size."""

from __future__ import annotations

import array
import dataclasses
import hashlib
import io
import itertools
import logging
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import write_atomically
from sfttrain.config import DataConfig
from sfttrain.distributed import decided_by_rank0, from_every_rank
from sfttrain.errors import DataError, UserError
from sfttrain.data.pack import MicroBatch, budget_bins, empty_micro_batch, local_slice, loss_tokens, pack
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.batching import BatchPlan
from sfttrain.data.render import RenderedSample, Renderer, RowError

# torch warns per rank when one rank's workers outnumber the CPUs; `describe_workers` counts the node's ranks too
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes in total",
                        category=UserWarning)


@dataclass
class StepBatch:
    epoch: int
    consumed_in_epoch: int  # samples of `epoch` consumed once this step is done
    micro_batches: list[MicroBatch]  # this rank's share
    num_loss_tokens: int  # the whole step, all ranks: the loss normaliser
    sample_lengths: list[int]  # the whole step, all ranks (tokens/s and the MFU attention term)
    rows: list[int]  # global row ids of the step (for error messages)

    def map_tensors(self, fn) -> "StepBatch":
        return dataclasses.replace(self, micro_batches=[m.map_tensors(fn) for m in self.micro_batches])


@dataclass(frozen=True)
class RowStats:
    lengths: np.ndarray  # tokens trained on (after truncation)
    loss_tokens: np.ndarray  # supervised tokens
    full_lengths: np.ndarray  # tokens before truncation
    digests: np.ndarray  # 64 bits of each row's tokens (`digest`)
    rendered: int  # rows this start rendered (0: all read from the length cache)
    cache_file: str | None = None
    keep: np.ndarray | None = None  # bool per row: trained (prepare.scan_rows); None: all

    def kept(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.keep is None else rows[self.keep[rows]]


class TrainData(IterableDataset):
    """Steps from the data position `start` for torch's DataLoader, whose workers render outside the
    loop's GIL; worker w of W builds steps w, w + W, ..., which the DataLoader's round-robin returns in order."""

    def __init__(self, source: ParquetSource, renderer: Renderer, plan: BatchPlan, stats: RowStats, dp_rank: int,
                 seed: int, shuffle: bool, attn_coef: float, pad_to: int, row_slice: tuple[int, int] = (0, 1)):
        self.source, self.renderer, self.plan, self.stats, self.dp_rank = source, renderer, plan, stats, dp_rank
        self.seed, self.shuffle, self.pad_to = seed, shuffle, pad_to
        self.row_slice = row_slice  # (this rank's slice, slices per row): Ulysses sequence parallelism
        self.attn_coef = attn_coef  # a sample's balancing cost: s + attn_coef * s^2
        self.start = (0, 0)  # (epoch, samples of it consumed): step_batches sets it

    def positions(self, epoch: int, consumed: int) -> Iterator[tuple[np.ndarray, int, int]]:
        b = self.plan.global_batch
        while True:
            order = self.stats.kept(self.source.epoch_order(self.seed, epoch, self.shuffle))
            while consumed + b <= len(order):
                rows = order[consumed:consumed + b]
                consumed += b
                yield rows, epoch, consumed
            epoch, consumed = epoch + 1, 0

    def __iter__(self) -> Iterator[StepBatch | UserError]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for position in itertools.islice(self.positions(*self.start), worker, None, workers):
            try:
                step = self.step(*position)
            except UserError as e:  # passed on as an item: torch would re-raise it inside its traceback
                yield e
                return
            # into shared memory here, where a full /dev/shm raises in the rank; torch's feeder thread
            # would print the error and drop the step, the rank waiting for it forever
            yield step.map_tensors(torch.Tensor.share_memory_) if info else step

    def step(self, rows: np.ndarray, epoch: int, consumed: int) -> StepBatch:
        """Every rank splits the step alike from the known lengths, then renders its own share."""
        lengths = self.stats.lengths[rows].tolist()
        costs = [n + self.attn_coef * n * n for n in lengths]
        micro_idx = self.plan.split(lengths, costs)[self.dp_rank]
        mine = sorted(i for idx in micro_idx for i in idx)  # one read, in epoch order (see ParquetSource.read)
        rendered = dict(zip(mine, self.renderer.render_many(self.source.read(rows[mine]))))
        check_counts(rendered.values(), self.stats, self.source)
        micro = [local_slice(pack([rendered[i] for i in idx], self.pad_to), *self.row_slice) for idx in micro_idx]
        return StepBatch(epoch, consumed, micro, int(self.stats.loss_tokens[rows].sum()), lengths, rows.tolist())


def check_counts(samples, stats: RowStats, source: ParquetSource) -> None:
    """The scan's counts normalise the loss: a row that renders to others now stops the run."""
    for s in samples:
        now, then = (len(s.input_ids), loss_tokens(s)), (int(stats.lengths[s.row]), int(stats.loss_tokens[s.row]))
        if now != then:
            raise DataError(
                f"{source.where(s.row)} renders now to {now[0]} tokens, {now[1]} supervised, but the "
                f"start-up row scan counted {then[0]} and {then[1]}; the loss is normalised by those counts, so "
                "training on would rescale its gradients. Either the chat template does not render the same text "
                "twice (e.g. it calls strftime_now: write the date into the template or the data) or the length "
                f"cache is stale, e.g. the tokenizer files changed: delete {stats.cache_file} and start again")


PREFETCH = 2  # steps each data worker builds ahead (the DataLoader's prefetch_factor)
OPEN_FILES_BASE = 256  # beside the steps in flight: libraries, sockets, files


def open_files_needed(d: DataConfig, dp_size: int) -> int:
    """File descriptors a rank and each worker need (a worker that runs out hangs its handover): one per
    tensor in flight. Under a token budget first-fit fills each bin but the last over half."""
    if not d.num_workers:
        return 0
    samples = max(1, d.train_batch_size // dp_size)
    if d.max_token_len_per_gpu:
        tokens = (samples + 1) * d.max_length
        micro_batches = min(d.train_batch_size, 2 * math.ceil(tokens / d.max_token_len_per_gpu) + 1)
    else:
        micro_batches = max(1, samples // d.micro_batch_size_per_gpu)
    return OPEN_FILES_BASE + (PREFETCH + 1) * MicroBatch.TENSORS * micro_batches


def step_batches(data: TrainData, epoch: int, consumed: int, num_workers: int,
                 pin_memory: bool) -> Iterator[StepBatch]:
    """Pinned here, not by the DataLoader's pin thread: it sets torch's thread count to 1, which the
    autograd thread inherits, and torch.compile then recompiles the layers backward re-runs."""
    data.start = (epoch, consumed)
    steps = iter(DataLoader(data, batch_size=None, num_workers=num_workers,
                            prefetch_factor=PREFETCH if num_workers else None,
                            worker_init_fn=leave_signals_to_the_rank if num_workers else None))
    try:
        for item in steps:
            if isinstance(item, UserError):
                raise item
            yield item.map_tensors(torch.Tensor.pin_memory) if pin_memory else item
    except (EOFError, ConnectionError):  # a killed worker's handover: torch's SIGCHLD handler names it moments later
        time.sleep(1)
        raise


def describe_workers(num_workers: int, ranks_here: int, where: str = "this node") -> list[str]:
    if num_workers == 0:
        return []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = num_workers * ranks_here
    lines = [f"  data workers        : {num_workers} a rank, {processes} on {where} ({ranks_here} ranks, {cpus} CPUs)"]
    if processes + ranks_here > cpus:
        share = cpus // ranks_here
        fix = (f"data.num_workers={share - 1} gives each rank and its workers {share} CPUs" if share > 1 else
               "data.num_workers=0 builds the steps in the ranks themselves, with no processes of their own")
        lines.append(f"  WARNING: {processes} data workers and {ranks_here} ranks share {where}'s {cpus} CPUs: "
                     f"they take turns, and the ranks wait for the CPU as well as for their steps. {fix}")
    return lines


def leave_signals_to_the_rank(worker_id: int) -> None:
    """The rank saves before a SIGTERM's stop."""
    stop_signal.leave_to_the_rank()


STATS = ("lengths", "loss_tokens", "full_lengths", "digests")  # RowStats' per-row columns


def digest(sample: RenderedSample) -> int:
    """The same on every rank and start, as Python's hash() of bytes is not."""
    data = array.array("q", sample.input_ids).tobytes()  # faster than through numpy
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def render_share(source: ParquetSource, renderer: Renderer, rank: int, world: int) -> list[RenderedSample]:
    return _scan(source, renderer, rank, world, keep=True)[0]


def row_stats(source: ParquetSource, renderer: Renderer, rank: int, world: int,
              cache_file: str | None = None) -> RowStats:
    """Collective: every row's token counts, from cache_file or rendered a share a rank."""
    cached = decided_by_rank0(lambda: _load_stats(cache_file) if cache_file else None)
    if cached is not None:
        return RowStats(*cached, rendered=0, cache_file=cache_file)
    _, local = _scan(source, renderer, rank, world, keep=False)
    rows = np.concatenate(from_every_rank(local))
    columns = np.zeros((len(STATS), source.num_rows), np.int64)
    columns[:, rows[:, 0]] = rows[:, 1:].T
    if rank == 0 and cache_file:
        _save_stats(cache_file, columns)
    return RowStats(*columns, rendered=len(rows), cache_file=cache_file)


def _load_stats(path: str) -> list[np.ndarray] | None:
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as f:
            return [f[name] for name in STATS] if set(STATS) <= set(f.files) else None
    # a damaged file fails numpy's reader in many ways, each the same to a cache
    except Exception as e:  # noqa: BLE001
        logging.getLogger("sfttrain").warning(f"the length cache {path} does not read back ({type(e).__name__}: "
                                              f"{e}): ignored; every row is rendered again and the cache written anew")
        return None


def _save_stats(path: str, columns: list[np.ndarray]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    npz = io.BytesIO()
    np.savez(npz, **dict(zip(STATS, columns)))
    write_atomically(path, npz.getvalue())


SCAN_BLOCK_ROWS = 4096  # rows read and rendered at once by the start-up scan
NAMED_BAD_ROWS = 5  # said at once, not one bad row per start


def _scan(source: ParquetSource, renderer: Renderer, rank: int, world: int,
          keep: bool) -> tuple[list[RenderedSample], np.ndarray]:
    """Collective: (the samples if keep, [row, *STATS] per row) of this rank's share. A bad row on any
    rank stops every rank with one message."""
    error, bad, samples, stats, stopped = None, [], [], [], False
    first, end = rank * source.num_rows // world, (rank + 1) * source.num_rows // world  # this rank's share
    try:
        for start in range(first, end, SCAN_BLOCK_ROWS):  # a block at a time: never a share's text all in memory
            if stopped := len(bad) >= NAMED_BAD_ROWS:  # enough to name: the rest is not rendered
                break
            failed: list[RowError] = []
            block = renderer.render_many(source.read(np.arange(start, min(start + SCAN_BLOCK_ROWS, end)), bad), failed)
            for e in failed:  # a row that does not render: its file and row (or line) replace its `row N`
                text = re.sub(rf"^row {e.row}(: | )", lambda m: "the row " * (m[1] == " "), str(e))
                bad.append((e.row, f"{source.where(e.row)}: {text}"))
            for sample in block:
                stats.append((sample.row, len(sample.input_ids), loss_tokens(sample), sample.full_length,
                              digest(sample)))
                if keep:
                    samples.append(sample)
    except DataError as e:  # not a row's: the file's
        error = str(e)
    found = from_every_rank((error, len(bad), sorted(bad)[:NAMED_BAD_ROWS], stopped))
    if first := next((e for e, *_ in found if e), None):
        raise DataError(first)
    if total := sum(n for _, n, _, _ in found):
        rows = sorted(b for _, _, named, _ in found for b in named)
        file = source.where(rows[0][0]).rsplit(" ", 2)[0]  # the next rows in that file by their row or line alone
        more = ", ".join(source.where(row).removeprefix(file + " ") for row, _ in rows[1:NAMED_BAD_ROWS])
        count = f"{total} or more" if any(s for *_, s in found) else str(total)
        raise DataError(rows[0][1] + (f" ({count} bad rows; the next: {more})" if total > 1 else ""))
    return samples, np.array(stats, dtype=np.int64).reshape(-1, 1 + len(STATS))


def validation_batches(samples: list[RenderedSample], micro_batch: int, token_budget: int | None, pad_to: int,
                       device: torch.device, row_slice: tuple[int, int] = (0, 1)) -> list[MicroBatch]:
    """Padded with empty micro-batches to the busiest rank's count."""
    if token_budget:
        groups = budget_bins([len(s.input_ids) for s in samples], token_budget)
    else:
        groups = [list(range(i, min(i + micro_batch, len(samples)))) for i in range(0, len(samples), micro_batch)]
    batches = [pack([samples[i] for i in g], pad_to) for g in groups]
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    batches += [empty_micro_batch() for _ in range(int(count.item()) - len(batches))]
    return [local_slice(b, *row_slice) for b in batches]
