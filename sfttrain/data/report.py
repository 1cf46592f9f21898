"""What the rendered training data holds, said before any compute is spent (and written to
<run folder>/data_report.json): rows left with nothing to train on, what truncation cut, duplicates."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from typing import Callable

import numpy as np

from sfttrain.checkpoint_folder import write_atomically
from sfttrain.config import ConfigError, DataConfig
from sfttrain.data.loader import RowStats, digest
from sfttrain.data.render import RenderedSample

REPORT_FILE = "data_report.json"
SHOWN_ROWS = 8  # row ids named in messages
SHOWN_FILES = 3  # files named in the report's line (data_report.json lists them all)


def select_rows(stats: RowStats, d: DataConfig) -> RowStats:
    """Rows without a supervised token (a prompt filling max_length) stop the run or are dropped."""
    empty = np.flatnonzero(stats.loss_tokens == 0)
    if len(empty) and d.no_loss_rows == "error":
        raise ConfigError(
            f"{len(empty)} training rows have no supervised token left after data.truncation={d.truncation} "
            f"to data.max_length={d.max_length} (their prompt fills it), e.g. rows {_first(empty)}. Set "
            "data.no_loss_rows=drop to train without them, or raise data.max_length (or data.truncation=left, "
            "which keeps the response's end)")
    return dataclasses.replace(stats, keep=stats.loss_tokens > 0)


def data_report(stats: RowStats, epoch_rows: np.ndarray, d: DataConfig) -> dict:
    """epoch_rows: the first epoch's; others differ only in the rows a global batch leaves over."""
    cut = np.flatnonzero(stats.full_lengths > stats.lengths)
    effect = {"right": "eos_cut", "left": "start_cut"}.get(d.truncation)  # what the cut removes
    return {
        "rows": len(stats.lengths),
        "rows_trained": int(stats.keep.sum()),
        "rows_dropped_no_loss": _rows(np.flatnonzero(~stats.keep)),
        "tokens_before_truncation": _summary(stats.full_lengths),
        "tokens": _summary(stats.lengths),
        "truncated": {**_rows(cut), "share": len(cut) / max(1, len(stats.lengths)), "effect": effect},
        "supervised_tokens_per_epoch": int(stats.loss_tokens[epoch_rows].sum()),
        "rows_per_epoch": len(epoch_rows),
        "duplicate_rows": _rows(repeated_rows(stats)),
        "empty_responses": None if d.multiturn.enable else _rows(empty_responses(stats)),
        "rows_rendered_at_startup": stats.rendered,
        "length_cache": stats.cache_file,
    }


def empty_responses(stats: RowStats) -> np.ndarray:
    """An empty response leaves the end token its one supervised token: it teaches the model to stop at once."""
    return np.flatnonzero((stats.loss_tokens == 1) & (stats.full_lengths == stats.lengths))


def repeated_rows(stats: RowStats) -> np.ndarray:
    trained = stats.kept(np.arange(len(stats.digests)))
    _, first = np.unique(stats.digests[trained], return_index=True)
    repeated = np.ones(len(trained), bool)
    repeated[first] = False
    return trained[repeated]


def training_twins(samples: list[RenderedSample], stats: RowStats) -> tuple[np.ndarray, np.ndarray]:
    """(validation rows, training rows) with the same tokens: validation there measures what training saw."""
    trained = stats.kept(np.arange(len(stats.digests)))
    order = np.argsort(stats.digests[trained], kind="stable")
    known = stats.digests[trained][order]
    digests = np.array([digest(s) for s in samples], dtype=np.int64)
    found = np.isin(digests, known)
    twins = trained[order[np.searchsorted(known, digests[found])]]
    return np.array([s.row for s in samples], dtype=np.int64)[found], twins


def validation_section(rows: int, twins: list[tuple[int, int]]) -> dict:
    twins = sorted(twins)
    return {"rows": rows, "in_training": {"count": len(twins), "rows": [v for v, _ in twins[:SHOWN_ROWS]],
                                          "training_rows": [t for _, t in twins[:SHOWN_ROWS]]}}


def describe(report: dict) -> str:
    full, trunc, repeated = report["tokens_before_truncation"], report["truncated"], report["duplicate_rows"]
    lines = [
        f"  files               : {_files_text(report['files'])}",
        *(f"  NOTE: {folder}'s subfolder{'s' * (len(inside) > 1)} {', '.join(inside[:SHOWN_FILES])} "
          f"hold{'s' * (len(inside) == 1)} data files that are not read (a folder's own files are); list them in "
          f"data.train_files, or give the pattern {os.path.join(folder, '**', '*')} (every data file under it)"
          for folder, inside in report["subfolders_not_read"].items()),
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
    listed = Counter(f["path"] for f in files)
    again = ", ".join(f"{path} {n} times" for path, n in listed.items() if n > 1)
    return (f"{len(files)}: {shown}" + (f" and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else "")
            + (f"; listed more than once: {again}, so its rows train as many times an epoch" if again else ""))


def _row_scan(report: dict) -> str:
    rendered, cache = report["rows_rendered_at_startup"], report["length_cache"]
    if rendered == 0:
        return f"every row's length read from {cache} (an earlier start's or preflight's: the same data and rendering)"
    return f"{rendered} rows rendered" + (f", lengths cached in {cache} for the next start" if cache else "")


def write_report(report: dict, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    write_atomically(os.path.join(run_dir, REPORT_FILE), json.dumps(report, indent=1))


def _summary(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)), "max": int(values.max())}


def _rows(rows) -> dict:
    return {"count": len(rows), "rows": _first(rows)}


LISTED_SECTIONS = ("truncated", "duplicate_rows", "empty_responses")


def locate_rows(report: dict, where: Callable[[int], str]) -> None:
    """Each listed row also by its file and row, for several files: a row id counts through them all."""
    for key in LISTED_SECTIONS:
        if report.get(key):
            report[key]["at"] = [where(row) for row in report[key]["rows"]]


def _row_list(section: dict) -> str:
    return _listed(section.get("at") or section["rows"], section["count"])


def _listed(shown: list, count: int) -> str:
    return "[" + ", ".join(map(str, shown)) + (", ..." if count > len(shown) else "") + "]"


def _first(rows) -> list[int]:
    return [int(r) for r in rows[:SHOWN_ROWS]]
