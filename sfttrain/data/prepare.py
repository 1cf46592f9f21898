"""The start-up pass over the data before the model loads, shared by the run and the preflight
(sfttrain.plan): row counts, batch plan, and the data report, said before any compute is spent and
written to <run folder>/data_report.json (rows left with nothing to train on, what truncation cut,
duplicates).

The data fingerprint is everything that decides which rows a run reads next and what they train on.
Checkpoints record it and a resume refuses a difference (it would silently change the rows or their
tokens) unless overridden. Keyed by the config key the user would change, so a difference names its
fix; its part that is not the order also names the per-row length cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch.distributed as dist

from sfttrain.checkpoint_folder import write_atomically
from sfttrain.config import Config, DataConfig
from sfttrain.data.batching import BatchPlan, make_plan
from sfttrain.data.render import resolve_chat_template
from sfttrain.data.loader import RowStats, digest, row_stats
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.render import RENDERING_VERSION, RenderedSample, Renderer
from sfttrain.distributed import from_every_rank
from sfttrain.errors import ConfigError

LENGTHS_DIR = "row_stats"  # in the run folder, unless data.length_cache_dir names another
REPORT_FILE = "data_report.json"
SHOWN_ROWS = 8  # row ids named in messages
SHOWN_FILES = 3  # files named in the report's line (data_report.json lists them all)
ORDER_KEYS = ("trainer.seed", "data.shuffle", "data.train_batch_size")
ROWS_KEY = "the rows' tokens (sha256; data files rewritten with other rows)"
RENDERING_KEY = "sfttrain's rendering of rows (version)"


@dataclass
class Rows:
    tokenizer: object
    renderer: Renderer
    source: ParquetSource
    stats: RowStats  # its keep set: the rows trained
    fingerprint: dict  # what the run's checkpoints record of the data
    val_source: Optional[ParquetSource] = None
    val_samples: Optional[list[RenderedSample]] = None  # this rank's share; None: no data.val_files


def scan_rows(cfg: Config, source: ParquetSource, renderer: Renderer, tokenizer, share: tuple[int, int],
              run_dir: str, fill_cache: bool = True) -> tuple[RowStats, dict]:
    """(row counts, data fingerprint); share = (rank, ranks). fill_cache=False (the preflight) reads
    the length cache but never makes one. Rows without a supervised token (a prompt filling
    max_length) stop the run or are dropped."""
    d = cfg.data
    fingerprint = data_fingerprint(cfg, source, tokenizer)
    cache = length_cache_file(d, fingerprint, run_dir)
    if not (fill_cache or d.length_cache_dir or os.path.isfile(cache)):
        cache = None
    stats = row_stats(source, renderer, *share, cache)
    empty = np.flatnonzero(stats.loss_tokens == 0)
    if len(empty) and d.no_loss_rows == "error":
        raise ConfigError(
            f"{len(empty)} training rows have no supervised token left after data.truncation={d.truncation} "
            f"to data.max_length={d.max_length} (their prompt fills it), e.g. rows {_rows(empty)['rows']}. Set "
            "data.no_loss_rows=drop to train without them, or raise data.max_length (or data.truncation=left, "
            "which keeps the response's end)")
    stats = dataclasses.replace(stats, keep=stats.loss_tokens > 0)
    # a hash of every row's tokens: a file rewritten with other rows of the same size keeps its path, size and rows
    return stats, {**fingerprint, "rows dropped (data.no_loss_rows=drop)": int((~stats.keep).sum()),
                   ROWS_KEY: hashlib.sha256(stats.digests.tobytes()).hexdigest()}


def plan_and_report(cfg: Config, rows: Rows, dp_size: int, run_dir: Optional[str]) -> tuple[BatchPlan, dict]:
    plan = make_plan(cfg, dp_size, int(rows.stats.keep.sum()))
    report = first_epoch_report(cfg, rows.source, rows.stats, plan)
    if rows.val_samples is not None:
        report["validation"] = validation_report(rows.val_samples, rows.stats, rows.val_source.num_rows)
    if run_dir is not None and dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        write_atomically(os.path.join(run_dir, REPORT_FILE), json.dumps(report, indent=1))
    return plan, report


def first_epoch_report(cfg: Config, source: ParquetSource, stats: RowStats, plan: BatchPlan) -> dict:
    """The first epoch's rows; others differ only in the rows a global batch leaves over."""
    epoch = stats.kept(source.epoch_order(cfg.trainer.seed, 0, cfg.data.shuffle))
    epoch = epoch[:plan.steps_per_epoch * plan.global_batch]
    cut = np.flatnonzero(stats.full_lengths > stats.lengths)
    trained = stats.kept(np.arange(len(stats.digests)))
    _, first = np.unique(stats.digests[trained], return_index=True)  # each digest's first row
    # an empty response leaves the end token its one supervised token: it teaches the model to stop at once
    empty = np.flatnonzero((stats.loss_tokens == 1) & (stats.full_lengths == stats.lengths))
    report = {
        "files": [{"path": f, "rows": n} for f, n in source.file_rows],
        "columns_not_read": sorted(source.unread),
        "unread_text": source.unread_text(),
        "rows": len(stats.lengths),
        "rows_trained": int(stats.keep.sum()),
        "rows_dropped_no_loss": _rows(np.flatnonzero(~stats.keep)),
        "tokens_before_truncation": _summary(stats.full_lengths),
        "tokens": _summary(stats.lengths),
        "truncated": {**_rows(cut), "share": len(cut) / max(1, len(stats.lengths)),
                      "effect": {"right": "eos_cut", "left": "start_cut"}.get(cfg.data.truncation)},
        "supervised_tokens_per_epoch": int(stats.loss_tokens[epoch].sum()),
        "rows_per_epoch": len(epoch),
        "duplicate_rows": _rows(np.delete(trained, first)),
        "empty_responses": None if cfg.data.multiturn.enable else _rows(empty),
        "rows_rendered_at_startup": stats.rendered,
        "length_cache": stats.cache_file,
    }
    # a row id counts through all the files: with several, each listed row also by its file's row
    for key in ("truncated", "duplicate_rows", "empty_responses") if len(report["files"]) > 1 else ():
        if report[key]:
            report[key]["at"] = [source.where(row) for row in report[key]["rows"]]
    return report


def validation_report(samples: list[RenderedSample], stats: RowStats, rows: int) -> dict:
    """Validation rows with a training row's tokens measure what training saw. Ranks of one
    data-parallel rank render the same share: the pairs are counted once."""
    trained = stats.kept(np.arange(len(stats.digests)))
    order = np.argsort(stats.digests[trained], kind="stable")
    known = stats.digests[trained][order]
    digests = np.array([digest(s) for s in samples], dtype=np.int64)
    found = np.isin(digests, known)
    pairs = zip([s.row for s, f in zip(samples, found) if f], trained[order[np.searchsorted(known, digests[found])]])
    twins = sorted({pair for share in from_every_rank([(v, int(t)) for v, t in pairs]) for pair in share})
    return {"rows": rows, "in_training": {"count": len(twins), "rows": [v for v, _ in twins[:SHOWN_ROWS]],
                                          "training_rows": [t for _, t in twins[:SHOWN_ROWS]]}}


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


def data_fingerprint(cfg: Config, source: ParquetSource, tokenizer) -> dict:
    d = cfg.data
    template = ((resolve_chat_template(d) or getattr(tokenizer, "chat_template", None))
                if d.apply_chat_template else None)
    return {
        "data.train_files": _files(source),
        "trainer.seed": cfg.trainer.seed,
        "data.shuffle": d.shuffle,
        "data.train_batch_size": d.train_batch_size,
        "data.max_length": d.max_length,
        "data.truncation": d.truncation,
        "data.apply_chat_template": d.apply_chat_template,
        "chat template (sha256)": _sha256(template) if template else None,
        "data.prompt_key": [d.prompt_key, *(d.prompt_dict_keys or [])],
        "data.response_key": [d.response_key, *(d.response_dict_keys or [])],
        "data.multiturn": asdict(d.multiturn),
        "tokenizer (sha256)": tokenizer_sha256(tokenizer),
        RENDERING_KEY: RENDERING_VERSION,
    }


def rendering_key(fingerprint: dict) -> str:
    """Names what a row's token counts depend on: the files (with their modification times) and the rendering."""
    parts = {k: v for k, v in fingerprint.items() if k not in ORDER_KEYS}
    parts["mtimes"] = [os.stat(f["path"]).st_mtime_ns for f in fingerprint["data.train_files"]]
    return _sha256(json.dumps(parts, sort_keys=True))[:16]


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """'key: saved -> current' for each key both hold (another version may record others), sections key by key."""
    return [line for key in saved if key in current and saved[key] != current[key]
            for line in (differences(saved[key], current[key], f"{prefix}{key}.")
                         if isinstance(saved[key], dict) and isinstance(current[key], dict)
                         else [f"{prefix}{key}: {saved[key]} -> {current[key]}"])]


def tokenizer_sha256(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha256(text + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def _files(source: ParquetSource) -> list[dict]:
    return [{"path": os.path.abspath(f), "bytes": os.path.getsize(f), "rows": n} for f, n in source.file_rows]


def _sha256(text: Optional[str]) -> str:
    return hashlib.sha256(str(text).encode()).hexdigest()


def describe(report: dict) -> str:
    full, trunc, repeated = report["tokens_before_truncation"], report["truncated"], report["duplicate_rows"]
    lines = [
        f"  files               : {_files_text(report['files'])}",
        *([f"  columns not read    : {', '.join(report['columns_not_read'])} (data.prompt_key, data.response_key "
           "or data.multiturn.* name the columns read)"] if report["columns_not_read"] else []),
        f"  data                : {report['rows']} rows, {report['rows_trained']} trained "
        f"({report['rows_dropped_no_loss']['count']} dropped: no supervised token), "
        f"{report['rows_per_epoch']} per epoch, {report['supervised_tokens_per_epoch']} supervised tokens per epoch",
        f"  tokens per row      : mean {full['mean']:.1f}, p50 {full['p50']:.0f}, p99 {full['p99']:.0f}, "
        f"max {full['max']} (before truncation)",
        f"  truncated           : {trunc['count']} rows ({100 * trunc['share']:.2f}%)",
        *([f"  duplicates          : rows {_row_list(repeated)} ({repeated['count']} in all) repeat an earlier row's "
           "tokens: that sample trains more than once an epoch"] if repeated["count"] else []),
        f"  row scan            : {_row_scan(report)}",
    ]
    if text := report.get("unread_text"):
        rows, joined = report["rows"], ",".join([*text["prompt_key"], next(iter(text["rows"]))])
        lines.append(f"  WARNING: text the run does not read, beside the prompt: "
                     f"{', '.join(f'column {c} in {n} of {rows} rows' for c, n in text['rows'].items())}. A column "
                     f"that belongs to the prompt (Alpaca's input after its instruction) is joined to it when listed "
                     f"in data.prompt_key: data.prompt_key=[{joined}]")
    if trunc["count"] and trunc["effect"] == "eos_cut":
        lines.append(f"  WARNING: data.truncation=right cut the end of {trunc['count']} responses, EOS "
                     f"included (those samples never learn to stop), e.g. rows {_row_list(trunc)}")
    if trunc["count"] and trunc["effect"] == "start_cut":
        lines.append(f"  WARNING: data.truncation=left cut the start of {trunc['count']} samples (BOS, system "
                     f"prompt and the prompt's beginning), e.g. rows {_row_list(trunc)}")
    if (empty := report["empty_responses"]) and empty["count"]:
        lines.append(f"  WARNING: rows {_row_list(empty)} ({empty['count']} in all) have an empty response: "
                     "the end token alone is trained on them (the model learns to answer nothing). Fill in their "
                     "responses or leave them out")
    if (val := report.get("validation")) and (twins := val["in_training"])["count"]:
        lines.append(f"  WARNING: validation rows {_listed(twins['rows'], twins['count'])} ({twins['count']} of "
                     f"{val['rows']}) are training rows {_listed(twins['training_rows'], twins['count'])} (the same "
                     "tokens): the validation loss on them measures what training saw. Give data.val_files rows kept "
                     "out of data.train_files")
    return "\n".join(lines)


def _files_text(files: list[dict]) -> str:
    shown = ", ".join(f"{f['path']} ({f['rows']} rows)" for f in files[:SHOWN_FILES])
    return f"{len(files)}: {shown}" + (f" and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else "")


def _row_scan(report: dict) -> str:
    rendered, cache = report["rows_rendered_at_startup"], report["length_cache"]
    if rendered == 0:
        return f"every row's length read from {cache} (an earlier start's or preflight's: the same data and rendering)"
    return f"{rendered} rows rendered" + (f", lengths cached in {cache} for the next start" if cache else "")


def _summary(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)), "max": int(values.max())}


def _rows(rows) -> dict:
    return {"count": len(rows), "rows": [int(r) for r in rows[:SHOWN_ROWS]]}


def _row_list(section: dict) -> str:
    return _listed(section.get("at") or section["rows"], section["count"])


def _listed(shown: list, count: int) -> str:
    return "[" + ", ".join(map(str, shown)) + (", ..." if count > len(shown) else "") + "]"
