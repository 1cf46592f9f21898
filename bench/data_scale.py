"""Data at scale on one CPU core: rows/s of the start-up scan and of reads in training order.

Builds a 1M-row Parquet file (row groups of 10k rows, ~0.5 KB of text per row), then measures:
  scan_read      rank 0's share read (decode only), for 1 of 1 and 1 of 8 ranks: rows/s and row
                 groups decoded (a contiguous share of 8 decodes ~1/8 of the groups; the strided
                 share the scan used before touches all of them)
  scan_render    rendering the first --render_rows rows as the scan does, each row's tokens digested
                 too (in a checkout that has loader.digest): stories260K's tokenizer on plain text, and
                 Qwen2.5's with its chat template (W1's)
  length_cache   loading every row's counts from the length cache (what a resume does instead)
  train_order    a shuffled epoch read step by step (--batch rows a step) for --train_rows rows
                 (more than a shuffle window): rows/s and row groups decoded

Run: PYTHONPATH=. taskset -c 0 python bench/data_scale.py [--rows 1000000] [--out results.json]
(without taskset, a fast tokenizer's batch path takes every core for the rendering)
With PYTHONPATH=/another/checkout it measures that checkout's reader (before/after).
rows_per_cpu_s is the figure to compare on a shared machine; rows_per_s is wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sfttrain.data import parquet

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a farmer sells eggs apples each day at market for dollars how many does she have left".split()


def build(path: Path, rows: int, group_rows: int) -> None:
    rng = np.random.default_rng(0)
    writer = None
    for start in range(0, rows, group_rows):
        n = min(group_rows, rows - start)
        words = np.array(WORDS)[rng.integers(0, len(WORDS), size=(n, 90))]
        text = [" ".join(w) for w in words]
        table = pa.table({"question": [f"Q{start + i}: {t[:200]}?" for i, t in enumerate(text)],
                          "answer": [t[100:] + f" #### {start + i}" for i, t in enumerate(text)]})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=group_rows)
    writer.close()


def source(path: Path) -> parquet.ParquetSource:
    """The reader of GSM8K-like question/answer columns (also with a checkout from before row fields)."""
    if hasattr(parquet, "PromptResponse"):
        return parquet.ParquetSource([str(path)], parquet.PromptResponse(["question"], ["answer"]))
    return parquet.ParquetSource([str(path)], ["question"], ["answer"])


def timed(fn) -> tuple[dict, object]:
    """Wall and CPU seconds: on a shared machine the CPU time is the figure that holds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}, out


def rates(n: int, seconds: dict) -> dict:
    return {"rows": n, **seconds, "rows_per_s": n / seconds["seconds"], "rows_per_cpu_s": n / seconds["cpu_seconds"]}


def read_all(src: parquet.ParquetSource, rows: np.ndarray, block: int = 4096) -> int:
    n = 0
    for start in range(0, len(rows), block):
        n += len(src.read(rows[start:start + block]))
    return n


def scan_read(path: Path, world: int, strided: bool = False) -> dict:
    """Rank 0's share: contiguous (this scan), or every world-th row (the scan before it)."""
    src = source(path)
    share = np.arange(0, src.num_rows, world) if strided else np.arange(0, src.num_rows // world)
    seconds, n = timed(lambda: read_all(src, share))
    return {"world": world, "strided": strided, **rates(n, seconds),
            "groups_decoded": getattr(src, "groups_decoded", None), "groups_total": len(src.row_groups)}


def scan_render(path: Path, rows: int, tokenizer: str, chat: bool) -> dict:
    """The scan's rendering of the first `rows` rows, a block of 4096 at a time as the scan renders
    them (one call per row in a checkout from before Renderer.render_many)."""
    from transformers import AutoTokenizer

    from sfttrain.data import loader
    from sfttrain.data.render import Renderer

    renderer = Renderer(AutoTokenizer.from_pretrained(REPO / tokenizer), max_length=4096, truncation="right",
                        apply_chat_template=chat)
    texts = source(path).read(np.arange(rows))
    blocks = [texts[start:start + 4096] for start in range(0, rows, 4096)]
    digest = getattr(loader, "digest", lambda sample: None)  # the scan's per-row digest, where it has one
    if hasattr(renderer, "render_many"):
        seconds, _ = timed(lambda: [digest(s) for block in blocks for s in renderer.render_many(block)])
    else:
        seconds, _ = timed(lambda: [renderer.render(*row) for row in texts])
    return {"tokenizer": tokenizer, "chat_template": chat, **rates(rows, seconds)}


def length_cache(rows: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stats.npz")
        np.savez(path, **{k: np.ones(rows, np.int64) for k in ("lengths", "loss_tokens", "full_lengths")})
        seconds, _ = timed(lambda: [np.load(path)[k] for k in ("lengths", "loss_tokens", "full_lengths")])
    return rates(rows, seconds)


def train_order(path: Path, rows: int, batch: int, budget_s: float) -> dict:
    src = source(path)
    order = src.epoch_order(seed=1, epoch=0, shuffle=True)[:rows]
    def read_steps() -> int:
        start, n = time.perf_counter(), 0
        while n < len(order) and time.perf_counter() - start < budget_s:
            n += len(src.read(order[n:n + batch]))
        return n

    seconds, n = timed(read_steps)
    return {**rates(n, seconds), "batch": batch, "groups_decoded": getattr(src, "groups_decoded", None),
            "stopped_by_time_budget": n < len(order)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--group_rows", type=int, default=10_000)
    ap.add_argument("--render_rows", type=int, default=20_000)
    ap.add_argument("--train_rows", type=int, default=300_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--budget_s", type=float, default=120.0, help="time limit of the train-order read")
    ap.add_argument("--data", default=None, help="reuse this Parquet file (built there if missing)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.data or os.path.join(tempfile.gettempdir(), f"data_scale_{args.rows}.parquet"))
    if not path.exists():
        build(path, args.rows, args.group_rows)
    results = {"file": str(path), "bytes": path.stat().st_size, "cpus": sorted(os.sched_getaffinity(0)),
               "scan_read": [scan_read(path, 1), scan_read(path, 8), scan_read(path, 8, strided=True)],
               "scan_render": [scan_render(path, args.render_rows, "assets/models/stories260K", False),
                               scan_render(path, args.render_rows, "assets/tokenizers/qwen2.5-instruct", True)],
               "length_cache": length_cache(args.rows),
               "train_order": train_order(path, args.train_rows, args.batch, args.budget_s)}
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
