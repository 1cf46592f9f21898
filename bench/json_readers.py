"""What pyarrow's and datasets' JSON readers do with the files sfttrain converts (sfttrain.data.files).

  cases    small files of what users bring (a cell that changes type between rows, a null before
           the strings, nested shapes that differ, a malformed line after a blank one, a top-level
           list): each reader's table or error, beside sfttrain's conversion
  memory   a generated JSON list (--rows Alpaca-shaped rows, indented as json.dump(indent=1) writes
           it), read by datasets' load_dataset("json") and converted by sfttrain, each in a process
           of its own (both libraries imported in each): CPU seconds, RSS after the imports, peak RSS

Run: PYTHONPATH=. python bench/json_readers.py [--rows 200000] [--out results.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CASES = {
    "type_changes": ['{"question": "q", "answer": "a"}', '{"question": "q", "answer": 5}'],
    "null_then_text": ['{"question": "q", "answer": null}', '{"question": "q", "answer": "a"}'],
    "nested_shapes": ['{"q": "a", "extra_info": {"index": 1}}', '{"q": "b", "extra_info": {"index": "x", "n": [1]}}'],
    "bad_line_3": ['{"question": "q", "answer": "a"}', "", '{"question": "q", "answer": }'],
    "list": ['[{"question": "q", "answer": "a"},', '{"question": "q", "answer": "b"}]'],
}


def attempt(read) -> str:
    try:
        return f"ok: {read()}"
    except Exception as e:  # what the reader says is the result
        return f"{type(e).__name__}: {str(e.__cause__ or e)[:160]}"


def cases(folder: str) -> dict:
    import datasets
    import pyarrow.json as paj

    from sfttrain.data.files import convert, records

    datasets.disable_progress_bars()
    out = {}
    for name, lines in CASES.items():
        path = os.path.join(folder, f"{name}.json")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        data = open(path, "rb").read()
        out[name] = {
            "pyarrow read_json": attempt(lambda: paj.read_json(io.BytesIO(data)).to_pylist()),
            "pyarrow open_json (block of one row)": attempt(lambda: paj.open_json(
                io.BytesIO(data), read_options=paj.ReadOptions(block_size=40)).read_all().to_pylist()),
            "datasets": attempt(lambda: datasets.load_dataset("json", data_files=path, split="train",
                                                              cache_dir=os.path.join(folder, "hf")).to_list()),
            "sfttrain": attempt(lambda: convert(path, path + ".parquet") or [r for _, r in records(path)]),
        }
    return out


def measure(reader: str, path: str) -> None:
    """In a process of its own: one reader over the list file, its CPU time and peak RSS printed as JSON."""
    import datasets
    import pyarrow.parquet as pq

    from sfttrain.data.files import convert

    datasets.disable_progress_bars()
    imported, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, time.process_time()
    if reader == "datasets":
        rows = len(datasets.load_dataset("json", data_files=path, split="train", cache_dir=path + ".hf"))
    else:
        convert(path, path + ".parquet")
        rows = pq.ParquetFile(path + ".parquet").metadata.num_rows
    print(json.dumps({"rows": rows, "cpu_s": round(time.process_time() - start, 1), "rss_imports_mb": imported,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))


def memory(folder: str, rows: int) -> dict:
    path = os.path.join(folder, "list.json")
    with open(path, "w") as f:
        json.dump([{"instruction": f"Add {i} and {i + 1}.", "input": "x" * 200, "output": "y" * 300,
                    "extra_info": {"index": i}} for i in range(rows)], f, indent=1)
    out = {"file_mb": os.path.getsize(path) >> 20}
    for reader in ("datasets", "sfttrain"):
        done = subprocess.run([sys.executable, __file__, "--measure", reader, path], capture_output=True, text=True,
                              check=True)
        out[reader] = json.loads(done.stdout.splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--out", default=None)
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        return measure(*args.measure)
    with tempfile.TemporaryDirectory() as folder:
        results = {"cases": cases(folder), "memory": memory(folder, args.rows)}
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
