"""Write GSM8K as train.parquet / test.parquet for sfttrain (and verl).

    python data_prep/gsm8k.py --local_dir ~/data/gsm8k                          # from the hub
    python data_prep/gsm8k.py --local_dir ~/data/gsm8k --input_dir assets/data/gsm8k  # offline

Columns: question (str), answer (str), and extra_info = {question, answer, split, index}, the
verl-style nested copy, so both `data.prompt_key=question` and
`data.prompt_key=extra_info data.prompt_dict_keys=['question']` work.

With --messages the files hold conversations instead, for `data.multiturn.enable=true`:
messages = [{role: user, content: question}, {role: assistant, content: answer}], and extra_info.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sfttrain.checkpoint_folder import replace_synced
from sfttrain.faults import fault

SPLITS = ("train", "test")
HUB_DATASET, HUB_CONFIG = "openai/gsm8k", "main"


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            rows.append(check_row(obj, f"{path}:{lineno}"))
    return rows


def check_row(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question", "answer"):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"{where}: row lacks a string {key!r}")
    return {"question": obj["question"], "answer": obj["answer"]}


def load_hub(split: str) -> list[dict]:
    try:
        import datasets  # lazy: the offline path needs no `datasets`

        ds = datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split=split)
    except Exception as e:
        raise RuntimeError(
            f"could not load {HUB_DATASET} ({HUB_CONFIG}, split {split}) from the Hugging Face hub: {e}\n"
            f"offline? pass --input_dir DIR with {', '.join(s + '.jsonl' for s in SPLITS)} "
            f"(e.g. assets/data/gsm8k, or the original openai/grade-school-math data)"
        ) from e
    return [check_row(obj, f"{HUB_DATASET}[{split}] row {i}") for i, obj in enumerate(ds)]


def to_table(rows: list[dict], split: str) -> pa.Table:
    extra = [{"question": r["question"], "answer": r["answer"], "split": split, "index": i} for i, r in enumerate(rows)]
    extra_type = pa.struct(
        [("question", pa.string()), ("answer", pa.string()), ("split", pa.string()), ("index", pa.int64())]
    )
    return pa.table(
        {
            "question": pa.array([r["question"] for r in rows], pa.string()),
            "answer": pa.array([r["answer"] for r in rows], pa.string()),
            "extra_info": pa.array(extra, extra_type),
        }
    )


def to_messages_table(rows: list[dict], split: str) -> pa.Table:
    """The same rows as one-question conversations (`data.multiturn.enable=true`)."""
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    conversations = [[{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
                     for r in rows]
    table = to_table(rows, split)
    return pa.table({"messages": pa.array(conversations, pa.list_(message)), "extra_info": table.column("extra_info")})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_dir", required=True, help="output directory for train.parquet and test.parquet")
    p.add_argument("--input_dir", default=None, help="read train.jsonl/test.jsonl from here instead of the hub")
    p.add_argument("--messages", action="store_true",
                   help="write a messages column (user question, assistant answer) for data.multiturn.enable=true")
    p.add_argument("--row_group_size", type=int, default=1000, help="rows per Parquet row group")
    args = p.parse_args(argv)
    if args.row_group_size < 1:
        p.error("--row_group_size must be >= 1")

    out_dir = Path(args.local_dir).expanduser()
    in_dir = Path(args.input_dir).expanduser() if args.input_dir else None
    if in_dir is not None and not in_dir.is_dir():
        sys.exit(f"error: --input_dir not found: {in_dir}")

    try:  # read both splits before writing anything
        convert = to_messages_table if args.messages else to_table
        tables = {s: convert(read_jsonl(in_dir / f"{s}.jsonl") if in_dir else load_hub(s), s) for s in SPLITS}
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")

    for split, table in tables.items():
        path = out_dir / f"{split}.parquet"
        try:
            write_whole(table, path, args.row_group_size)
        except OSError as e:  # a folder that cannot be made or written, a full disk: one line, no traceback
            found = fault(e, None)
            sys.exit(f"error: cannot write {path}: " + (f"{found.cause}. {found.fix}" if found else str(e)))
        print(f"wrote {path}: {table.num_rows} rows")


def write_whole(table: pa.Table, path: Path, row_group_size: int) -> None:
    """Writes `path` under a temporary name, renamed once whole: a write cut short (a full disk, Ctrl-C)
    leaves no file by the final name that a training run would read as the data and fail on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(table, tmp, row_group_size=row_group_size)
        replace_synced(str(tmp), str(path))  # sfttrain's own: fsynced before the rename, the folder after it
    finally:
        tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
