"""The start-up pass over the data, before the model is loaded: the data fingerprint, every
training row's token counts (rendered once, or read from the length cache of an earlier start), the
rows trained, the batch plan from them, this rank's validation rows rendered, and the data report
(written to the run folder)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from sfttrain.config import Config, DataConfig, as_list
from sfttrain.data.files import unread_subfolders
from sfttrain.data.fingerprint import data_fingerprint, rendering_key, with_rows
from sfttrain.data.loader import RowStats, epoch_rows, render_share, row_stats
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.batching import BatchPlan, make_plan
from sfttrain.data.render import RenderedSample, Renderer
from sfttrain.data.report import (data_report, locate_rows, select_rows, training_twins, validation_section,
                                  write_report)
from sfttrain.distributed import World
from sfttrain.errors import ConfigError

LENGTHS_DIR = "row_stats"  # in the run folder (unless data.length_cache_dir names another): <rendering key>.npz


@dataclass(frozen=True)
class PreparedData:
    stats: RowStats
    plan: BatchPlan
    fingerprint: dict
    report: dict
    val_samples: Optional[list[RenderedSample]]  # this rank's share of the validation rows; None: no data.val_files


def prepare_data(cfg: Config, source: ParquetSource, val_source: Optional[ParquetSource], renderer: Renderer,
                 tokenizer, world: World, run_dir: str) -> PreparedData:
    d = cfg.data
    fingerprint = data_fingerprint(cfg, source, tokenizer)
    cache = length_cache_file(d, fingerprint, run_dir)
    stats = select_rows(row_stats(source, renderer, world.rank, world.world_size, cache), d)
    fingerprint = with_rows(fingerprint, stats.keep, stats.digests)
    plan = make_plan(cfg, world.dp_size, int(stats.keep.sum()))
    report = first_epoch_report(cfg, source, stats, plan)
    val_samples = None
    if val_source is not None:
        val_samples = render_share(val_source, renderer, world.dp_rank, world.dp_size)
        report["validation"] = validation_report(val_samples, stats, val_source.num_rows)
    if world.is_main:
        write_report(report, run_dir)
    return PreparedData(stats, plan, fingerprint, report, val_samples)


def first_epoch_report(cfg: Config, source: ParquetSource, stats: RowStats, plan: BatchPlan) -> dict:
    """The data report (sfttrain.data.report) of the rows the first epoch trains."""
    first_epoch = epoch_rows(source, stats, cfg.trainer.seed, 0, cfg.data.shuffle)
    report = data_report(stats, first_epoch[:plan.steps_per_epoch * plan.global_batch], cfg.data)
    report = {"files": [{"path": f, "rows": n} for f, n in source.file_rows()],
              "subfolders_not_read": unread_subfolders(as_list(cfg.data.train_files)),
              "columns_not_read": sorted(source.unread), **report}
    if len(report["files"]) > 1:
        locate_rows(report, source.where)
    return report


def validation_report(samples: list[RenderedSample], stats: RowStats, rows: int) -> dict:
    """The validation rows' part of the report, from every rank's share (ranks of one data-parallel
    rank render the same share: the pairs are counted once)."""
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, list(zip(*(a.tolist() for a in training_twins(samples, stats)))))
    return validation_section(rows, list({pair for share in shares for pair in share}))


def length_cache_file(d: DataConfig, fingerprint: dict, run_dir: str) -> str:
    """The file holding every row's token counts for this fingerprint, in data.length_cache_dir (made
    here, and refused at once if it cannot be written: the scan's work would be lost at its end) or
    the run folder's row_stats/."""
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
