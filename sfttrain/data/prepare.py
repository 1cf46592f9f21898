"""The start-up pass over the data before the model loads (fingerprint, row counts, batch plan, data
report), shared by the run and the preflight (sfttrain.plan)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from sfttrain.config import Config, DataConfig, as_list
from sfttrain.data.batching import BatchPlan, make_plan
from sfttrain.data.files import unread_subfolders
from sfttrain.data.fingerprint import data_fingerprint, rendering_key, with_rows
from sfttrain.data.loader import RowStats, epoch_rows, row_stats
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.render import RenderedSample, Renderer
from sfttrain.data.report import (data_report, locate_rows, select_rows, training_twins, validation_section,
                                  write_report)
from sfttrain.distributed import from_every_rank
from sfttrain.errors import ConfigError

LENGTHS_DIR = "row_stats"  # in the run folder, unless data.length_cache_dir names another


@dataclass
class Rows:
    tokenizer: object
    renderer: Renderer
    source: ParquetSource
    stats: RowStats  # after select_rows
    fingerprint: dict  # what the run's checkpoints record of the data
    val_source: Optional[ParquetSource] = None
    val_samples: Optional[list[RenderedSample]] = None  # this rank's share; None: no data.val_files


def scan_rows(cfg: Config, source: ParquetSource, renderer: Renderer, tokenizer, share: tuple[int, int],
              run_dir: str, fill_cache: bool = True) -> tuple[RowStats, dict]:
    """(row counts, data fingerprint); share = (rank, ranks). fill_cache=False (the preflight) reads
    the length cache but never makes one."""
    fingerprint = data_fingerprint(cfg, source, tokenizer)
    cache = length_cache_file(cfg.data, fingerprint, run_dir)
    if not (fill_cache or cfg.data.length_cache_dir or os.path.isfile(cache)):
        cache = None
    stats = select_rows(row_stats(source, renderer, *share, cache), cfg.data)
    return stats, with_rows(fingerprint, stats.keep, stats.digests)


def plan_and_report(cfg: Config, rows: Rows, dp_size: int, run_dir: Optional[str]) -> tuple[BatchPlan, dict]:
    plan = make_plan(cfg, dp_size, int(rows.stats.keep.sum()))
    report = first_epoch_report(cfg, rows.source, rows.stats, plan)
    if rows.val_samples is not None:
        report["validation"] = validation_report(rows.val_samples, rows.stats, rows.val_source.num_rows)
    if run_dir is not None and dist.get_rank() == 0:
        write_report(report, run_dir)
    return plan, report


def first_epoch_report(cfg: Config, source: ParquetSource, stats: RowStats, plan: BatchPlan) -> dict:
    first_epoch = epoch_rows(source, stats, cfg.trainer.seed, 0, cfg.data.shuffle)
    report = data_report(stats, first_epoch[:plan.steps_per_epoch * plan.global_batch], cfg.data)
    report = {"files": [{"path": f, "rows": n} for f, n in source.file_rows()],
              "subfolders_not_read": unread_subfolders(as_list(cfg.data.train_files)),
              "columns_not_read": sorted(source.unread), "unread_text": source.unread_text(), **report}
    if len(report["files"]) > 1:
        locate_rows(report, source.where)
    return report


def validation_report(samples: list[RenderedSample], stats: RowStats, rows: int) -> dict:
    """Ranks of one data-parallel rank render the same share: the pairs are counted once."""
    shares = from_every_rank(list(zip(*(a.tolist() for a in training_twins(samples, stats)))))
    return validation_section(rows, list({pair for share in shares for pair in share}))


def length_cache_file(d: DataConfig, fingerprint: dict, run_dir: str) -> str:
    """A length_cache_dir that cannot be written is refused now, not after the scan's work."""
    if d.length_cache_dir is None:
        folder = os.path.join(run_dir, LENGTHS_DIR)
    else:
        folder = os.path.abspath(os.path.expanduser(d.length_cache_dir))
        try:
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError("not writable by this user")
        except OSError as e:
            raise ConfigError(f"data.length_cache_dir={d.length_cache_dir!r}: cannot keep the row lengths there "
                              f"({e}); name a folder this user can write, or null for the run folder's "
                              f"{LENGTHS_DIR}/") from None
    return os.path.join(folder, rendering_key(fingerprint) + ".npz")
