"""The start-up pass over the training data, before the model is loaded: the data fingerprint,
every row's token counts (rendered once, or read from the length cache of an earlier start), the
rows trained, the batch plan from them, and the data report (written to the run folder)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sfttrain.config import Config, DataConfig
from sfttrain.data.fingerprint import data_fingerprint, rendering_key, with_rows_dropped
from sfttrain.data.loader import RowStats, epoch_rows, row_stats
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.batching import BatchPlan, make_plan
from sfttrain.data.render import Renderer
from sfttrain.data.report import data_report, select_rows, write_report
from sfttrain.distributed import World
from sfttrain.errors import ConfigError

CACHE_DIR = "row_stats"  # in the run folder (unless data.length_cache_dir names another): <rendering key>.npz


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
    cache = length_cache_file(d, fingerprint, run_dir)
    stats = select_rows(row_stats(source, renderer, world.rank, world.world_size, cache), d)
    fingerprint = with_rows_dropped(fingerprint, stats.keep)
    plan = make_plan(cfg, world.dp_size, int(stats.keep.sum()))
    first_epoch = epoch_rows(source, stats, cfg.trainer.seed, 0, d.shuffle)[:plan.steps_per_epoch * plan.global_batch]
    report = data_report(stats, first_epoch, d)
    if world.is_main:
        write_report(report, run_dir)
    return PreparedData(stats, plan, fingerprint, report)


def length_cache_file(d: DataConfig, fingerprint: dict, run_dir: str) -> str:
    """The file holding every row's token counts for this fingerprint, in data.length_cache_dir (made
    here, and refused at once if it cannot be written: the scan's work would be lost at its end) or
    the run folder's row_stats/."""
    if d.length_cache_dir is None:
        folder = os.path.join(run_dir, CACHE_DIR)
    else:
        folder = os.path.abspath(os.path.expanduser(d.length_cache_dir))
        try:
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError("not writable by this user")
        except OSError as e:
            raise ConfigError(f"data.length_cache_dir={d.length_cache_dir!r}: cannot keep the row lengths there "
                              f"({e}); name a folder this user can write, or null for the run folder's "
                              f"{CACHE_DIR}/") from None
    return os.path.join(folder, rendering_key(fingerprint) + ".npz")
