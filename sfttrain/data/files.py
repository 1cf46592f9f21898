"""What data.train_files / data.val_files name, as Parquet files for the streaming reader.

An entry is a data file (Parquet, JSON Lines, JSON, CSV, TSV, Arrow; the text ones may be compressed
as .gz, .bz2, .zst), a directory of them, a glob pattern, or a folder `datasets`' save_to_disk wrote.
A directory holding several splits' files is refused: read whole, it would train on them all.
Files other than Parquet are converted once into the run folder's data_cache/, named by the source's
path, size and mtime, so an edited source converts anew. JSON cells are stored as JSON text, so rows
that differ in keys and types read back as written, and a bad cell is named with its line.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import io
import itertools
import json
import os
import re
from typing import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from sfttrain.checkpoint_folder import replace_synced
from sfttrain.data.parquet import JSON_CELLS, LINE_COLUMN, ChatMessages, ParquetSource, PromptResponse, no_rows
from sfttrain.distributed import decided_by_rank0
from sfttrain.errors import DataError
from sfttrain.faults import unreadable

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow", ".csv", ".tsv")
DATA_PATTERNS = ", ".join("*" + s for s in DATA_SUFFIXES)  # for messages
TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")  # formats that may come compressed
COMPRESSED = (".gz", ".bz2", ".zst")  # pyarrow detects the codec by the suffix
SAVED_DATASETS = ("state.json", "dataset_dict.json")  # in a folder datasets' save_to_disk wrote (Dataset, DatasetDict)
CONVERTED_DIR = "data_cache"  # in the run folder: the JSON, CSV and Arrow files converted to Parquet
ROW_GROUP_ROWS = 1000  # rows per row group of a conversion (as data_prep/gsm8k.py writes)
FORMAT_VERSION = 1  # part of a conversion's name: a change of format converts again
SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")  # a split named in a file name, as a word


def open_source(paths: list[str], fields: PromptResponse | ChatMessages, run_dir: str) -> ParquetSource:
    """Rank 0 converts (the run folder is shared): a malformed line stops every rank with one message."""
    files = data_files(paths)
    targets = {f: cached_parquet(f, run_dir) for f in files if data_format(f) != ".parquet"}

    def convert_missing() -> None:
        for source, target in targets.items():
            if not os.path.isfile(target):
                convert(source, target)

    decided_by_rank0(convert_missing)
    return ParquetSource([targets.get(f, f) for f in files], fields, origins={t: s for s, t in targets.items()})


def data_files(paths: list[str]) -> list[str]:
    files = []
    for path in map(os.path.expanduser, paths):
        if is_pattern(path):
            files += pattern_files(path)
        elif os.path.isdir(path):
            files += folder_files(readable(path))
        else:
            files.append(path)
    return [readable(file) for file in files]


def readable(path: str) -> str:
    """pyarrow would call an unreadable file no Parquet file, and rewriting it the fix."""
    if problem := unreadable([path]):
        raise DataError(f"data file {path!r} (data.train_files / data.val_files) cannot be read: {problem}")
    return path


def missing_entries(paths: list[str]) -> list[str]:
    return [p for p in paths if not (is_pattern(os.path.expanduser(p)) or os.path.exists(os.path.expanduser(p)))]


def nearest_name(path: str) -> str:
    """The existing name most like `path`'s first missing part, as "; did you mean X?"; else ""."""
    path = os.path.abspath(os.path.expanduser(path))
    parent, wanted = os.path.dirname(path), os.path.basename(path)
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        parent, wanted = os.path.dirname(parent), os.path.basename(parent)
    near = difflib.get_close_matches(wanted, os.listdir(parent) if os.access(parent, os.R_OK) else [], n=1)
    return f"; did you mean {os.path.join(parent, near[0])}?" if near else ""


def is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[") and not os.path.exists(path)


def pattern_files(pattern: str) -> list[str]:
    files = sorted(f for f in glob.glob(pattern, recursive=True)
                   if os.path.isfile(f) and data_format(f) in DATA_SUFFIXES)
    if not files:
        raise DataError(f"{pattern}: no data file ({DATA_PATTERNS}) matches this pattern; "
                        "check data.train_files / data.val_files")
    return files


def folder_files(path: str) -> list[str]:
    if any(os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASETS):
        import datasets  # a folder save_to_disk wrote: its Arrow files, in the order datasets reads them

        try:
            saved = datasets.load_from_disk(path)
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path}: datasets' load_from_disk cannot read it ({type(e).__name__}: {e}); save the "
                            "dataset again with save_to_disk, or to Parquet with to_parquet") from None
        if isinstance(saved, datasets.DatasetDict):
            splits = ", ".join(os.path.join(path, split) for split in sorted(saved))
            raise DataError(f"{path}: a DatasetDict that datasets' save_to_disk wrote; point data.train_files / "
                            f"data.val_files at one of its splits: {splits}")
        return [f["filename"] for f in saved.cache_files]
    found = sorted(name for name in os.listdir(path) if data_format(name) in DATA_SUFFIXES and not name.startswith("."))
    if not found:
        inside = subfolders_with_data(path)
        where = (f"; its subfolder{'s' * (len(inside) > 1)} {', '.join(inside[:3])} hold{'s' * (len(inside) == 1)} "
                 "some (a folder's files are read, not those of its subfolders)") if inside else ""
        raise DataError(f"{path}: a directory without data files ({DATA_PATTERNS}){where}; "
                        "point data.train_files / data.val_files at one that has them")
    by_split: dict[str, list[str]] = {}
    for name in found:  # a split named by a word of the name (test-00000-of-00001.parquet, gsm8k-test.arrow)
        by_split.setdefault(next((w for w in re.split(r"[-_.]", name.lower()) if w in SPLITS), None), []).append(name)
    splits = {split: os.path.join(path, names[0] if len(names) == 1 else os.path.commonprefix(names) + "*")
              for split, names in by_split.items() if split}
    if len(splits) > 1:
        raise DataError(f"{path}: its files are named for several splits, which read whole would all be trained on; "
                        "name one split's files (or list the files): " + "; ".join(map(": ".join, splits.items())))
    return [os.path.join(path, name) for name in found]


def subfolders_with_data(path: str) -> list[str]:
    """Subfolders one or two levels down (not **: it may be a large tree) holding data files, not read."""
    return sorted({os.path.dirname(f) for depth in (1, 2)
                   for f in glob.glob(os.path.join(glob.escape(path), *["*"] * depth, "*"))
                   if os.path.isfile(f) and data_format(f) in DATA_SUFFIXES})


def data_format(path: str) -> str:
    """.jsonl for train.jsonl and train.jsonl.gz."""
    root, suffix = os.path.splitext(path)
    inner = os.path.splitext(root)[1]
    return inner if suffix in COMPRESSED and inner in TEXT_SUFFIXES else suffix


def open_text(path: str):
    return io.TextIOWrapper(pa.input_stream(path, compression="detect"), encoding="utf-8-sig")


def cached_parquet(source: str, run_dir: str) -> str:
    stat = os.stat(source)
    key = json.dumps([os.path.abspath(source), stat.st_size, stat.st_mtime_ns, FORMAT_VERSION])
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(run_dir, CONVERTED_DIR, f"{stem}.{hashlib.sha256(key.encode()).hexdigest()[:16]}.parquet")


def convert(source: str, target: str) -> None:
    """Written whole or not at all: a lost conversion under its name would be every later start's data."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp, text = f"{target}.{os.getpid()}.tmp", data_format(source) in (".csv", ".tsv")
    try:
        schema, batches = {".arrow": arrow_batches, ".csv": csv_batches, ".tsv": csv_batches}.get(
            data_format(source), json_batches)(source)
        rows = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            for batch in batches:
                writer.write_batch(batch, row_group_size=ROW_GROUP_ROWS)
                rows += batch.num_rows
        if not rows:
            raise no_rows(source)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, UnicodeDecodeError) or text and isinstance(e, pa.ArrowInvalid):  # also CSV's "invalid UTF8"
            raise DataError(f"{source}: not a readable {data_format(source)[1:].upper()} file ({e}); text files are "
                            "read as UTF-8 (Excel: Save As 'CSV UTF-8'; PowerShell: Out-File -Encoding utf8; or "
                            "iconv -f GBK -t UTF-8 with the encoding it has)") from None
        if isinstance(e, OSError) and e.errno is None and source.endswith(COMPRESSED):  # the codec's, not the OS's
            raise DataError(f"{source}: cannot be decompressed ({e}); the file is cut short or not compressed as its "
                            f"name says: write it again, or name it for what it is") from None
        if isinstance(e, OSError) and e.errno is not None:  # pyarrow's error names no file: sfttrain.run names it
            e.filename = e.filename or tmp
        raise
    replace_synced(tmp, target)


def arrow_batches(source: str) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """An Arrow IPC file (datasets writes the stream format), memory-mapped: read whole without a copy."""
    try:
        table = pa.ipc.open_stream(pa.memory_map(source)).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(pa.memory_map(source)).read_all()
    return table.schema, table.to_batches()


def csv_batches(source: str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Every column read as text: an answer of digits stays the text it is."""
    parse = pacsv.ParseOptions(delimiter="\t" if data_format(source) == ".tsv" else ",", newlines_in_values=True)
    header = pacsv.open_csv(source, parse_options=parse).schema.names
    reader = pacsv.open_csv(source, parse_options=parse,
                            convert_options=pacsv.ConvertOptions(column_types={name: pa.string() for name in header}))
    return reader.schema, reader


def json_batches(source: str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Two passes, the keys then the rows. Cells are kept as JSON text: pyarrow's JSON reader refuses a
    column that changes type, and datasets' names no line (docs/benchmarks.md)."""
    keys = list(dict.fromkeys(key for _, row in records(source) for key in row))  # first-seen order
    if not keys:
        raise no_rows(source)
    schema = pa.schema([(key, pa.string()) for key in keys] + [(LINE_COLUMN, pa.int64())], metadata={JSON_CELLS: "1"})
    rows = records(source)
    batches = iter(lambda: list(itertools.islice(rows, ROW_GROUP_ROWS)), [])
    return schema, (pa.record_batch([[None if row.get(key) is None else json.dumps(row[key], ensure_ascii=False)
                                      for _, row in batch] for key in keys] + [[line for line, _ in batch]],
                                    schema=schema) for batch in batches)


def records(path: str) -> Iterator[tuple[int | None, dict]]:
    """(line, row) per row of JSON Lines; a JSON list is decoded whole, its rows without a line."""
    with open_text(path) as f:
        if data_format(path) == ".json" and (text := f.read()).lstrip().startswith("["):
            yield from ((None, _row(value, f"{path} row {i}")) for i, value in enumerate(_decoded(text, path, None)))
            return
    with open_text(path) as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                yield line, _row(_decoded(text, path, line), f"{path} line {line}")


def _decoded(text: str, path: str, line: int | None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = " (a .json file holds a list of objects, or one object per line)" * (data_format(path) == ".json"
                                                                                  and line is not None)
        raise DataError(f"{path} line {line or e.lineno}: not valid JSON ({e.msg}, column {e.colno}){hint}; fix "
                        "or remove the line") from None


def _row(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{where}: a row is a JSON object ({{\"prompt\": ..., \"response\": ...}}), "
                        f"not {type(value).__name__}")
    return value
