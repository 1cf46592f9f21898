"""The start-up pass over the training data, before the model is loaded: the data fingerprint,
every row's token counts (rendered once, or read from the length cache of an earlier start), the
rows trained, the batch plan from them, and the data report (written to the run folder)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sfttrain.config import Config
from sfttrain.data.fingerprint import data_fingerprint, rendering_key, with_rows_dropped
from sfttrain.data.loader import RowStats, epoch_rows, row_stats
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.batching import BatchPlan, make_plan
from sfttrain.data.render import Renderer
from sfttrain.data.report import data_report, select_rows, write_report
from sfttrain.distributed import World

CACHE_DIR = "row_stats"  # in the run folder: <fingerprint's rendering key>.npz


@dataclass(frozen=True)
class PreparedData:
    stats: RowStats
    plan: BatchPlan
    fingerprint: dict
    report: dict


def prepare_train_data(cfg: Config, source: ParquetSource, renderer: Renderer, tokenizer, world: World,
                       run_dir: str) -> PreparedData:
    d = cfg.data
    fingerprint = data_fingerprint(cfg, source, tokenizer)
    cache = os.path.join(run_dir, CACHE_DIR, rendering_key(fingerprint) + ".npz")
    stats = select_rows(row_stats(source, renderer, world.rank, world.world_size, cache), d)
    fingerprint = with_rows_dropped(fingerprint, stats.keep)
    plan = make_plan(cfg, world.dp_size, int(stats.keep.sum()))
    first_epoch = epoch_rows(source, stats, cfg.trainer.seed, 0, d.shuffle)[:plan.steps_per_epoch * plan.global_batch]
    report = data_report(stats, first_epoch, d, cache)
    if world.is_main:
        write_report(report, run_dir)
    return PreparedData(stats, plan, fingerprint, report)
