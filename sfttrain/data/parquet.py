"""Streaming Parquet reader, a row group at a time, and the epoch's order: a function of the seed,
the epoch and the row groups alone, so a data position saved by N ranks is valid for M ranks."""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import PurePath
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sfttrain.config import as_list
from sfttrain.errors import DataError
from sfttrain.hub import is_repo_id

# rows shuffled together (groups shuffled, then rows within windows): a reader holds one window's
# text and decodes each group once an epoch
SHUFFLE_WINDOW_ROWS = 200_000
# a conversion from JSON (sfttrain.data.files) holds JSON text cells and each row's source line
JSON_CELLS = "sfttrain.json_cells"
LINE_COLUMN = "__sfttrain_line__"


@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int
    first_row: int  # global row id of its first row
    num_rows: int
    source: str  # the user's file it comes from (`file`, unless converted from JSON)


class PromptResponse:
    """Prompt and response strings by verl's (nested) key paths (no prompt path: the response alone).
    joined_keys: further prompt columns (Alpaca's input) joined a line apart, as LLaMA-Factory does."""

    def __init__(self, prompt_path: Optional[list[str]], response_path: list[str], joined_keys: list[str] = ()):
        self.prompt_path, self.response_path, self.joined_keys = prompt_path, response_path, list(joined_keys)
        self.paths = [path for path in (prompt_path, response_path) if path] + [[key] for key in self.joined_keys]

    def columns(self, file: str, names: list[str]) -> list[str]:
        for key_path in self.paths:
            if key_path[0] not in names:
                raise DataError(f"{file}: no column {key_path[0]!r} (columns: {names}); set data.prompt_key / "
                                f"data.response_key to the right columns{_form_hint(names)}")
        return list(dict.fromkeys(path[0] for path in self.paths))

    def decode(self, cells: dict) -> tuple[str, str]:
        prompt, response = (_text(cells[p[0]], p) if p else "" for p in (self.prompt_path, self.response_path))
        for key in self.joined_keys:
            text = None if cells[key] in (None, "") else _text(cells[key], [key])
            prompt = f"{prompt}\n{text}" if prompt and text else prompt or text or ""
        return prompt, response


class DataFileChanged(DataError):
    """A data file rewritten, replaced or deleted after the start-up scan counted its rows."""

    def __init__(self, source: str, change: str, next_step: str = ""):
        self.source, self.change, self.next_step = source, change, next_step
        super().__init__(f"data file {source} changed while the run trained: {change} since the start-up scan (a "
                         "data_prep script or rsync writing into its folder, say); the rows it holds now are not those "
                         "the run scanned, counted and fingerprinted, so training stopped before reading "
                         f"them{next_step}")

    def __reduce__(self):  # raised in a DataLoader worker, it reaches the rank pickled
        return DataFileChanged, (self.source, self.change, self.next_step)

    def then_resume(self, next_step: str) -> "DataFileChanged":
        return DataFileChanged(self.source, self.change, f". Put the file back as it was while a run reads it: "
                               f"{next_step}. To train on the new data, start in a new run folder "
                               "(trainer.default_local_dir), whose start-up scans it")


def file_stamp(path: str) -> Optional[tuple[int, ...]]:
    """Changes when a file is rewritten (size, mtime) or replaced (device, inode); None once gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def no_rows(source: str) -> DataError:
    return DataError(f"{source}: the file has no rows; point data.train_files / data.val_files at a file with rows")


def hub_id_hint(path: str) -> str:
    """How to write a hub dataset (TRL takes its id) to a file, for a path shaped like its id."""
    if not is_repo_id(path) or os.path.splitext(path)[1]:  # a missing "data/train.parquet" is a local path
        return ""
    return (f". {path!r} looks like a Hugging Face hub dataset id: sfttrain reads local files, so write the split "
            f"to one first, e.g. python -c \"import datasets; datasets.load_dataset('{path}', split='train')"
            ".to_parquet('train.parquet')\" (a dataset with several configs names one after the id; python "
            "data_prep/gsm8k.py writes GSM8K's splits)")


def _form_hint(names: list[str]) -> str:
    """The keys for the form of data a file's columns suggest (README: Your own data)."""
    if chat := next((name for name in ("messages", "conversations") if name in names), None):  # OpenAI's, ShareGPT's
        return (f"; the file has a {chat!r} column: for conversations set data.multiturn.enable=true "
                f"data.multiturn.messages_key={chat}")
    if {"prompt", "completion"} <= set(names):
        return ("; TRL's prompt-completion columns: data.prompt_key=prompt data.response_key=completion (where they "
                "hold message lists: data.multiturn.enable=true data.multiturn.messages_key=[prompt,completion])")
    if "text" in names and len(names) == 1:
        return ("; a 'text' column of whole texts trains every token with data.prompt_key=null "
                "data.response_key=text data.apply_chat_template=false")
    return ""


class ChatMessages:
    """Conversations (data.multiturn), and the template's tools= / enable_thinking= of each row."""

    def __init__(self, messages_keys: list[str], tools_key: Optional[str], thinking_key: Optional[str],
                 system_key: Optional[str] = None):
        self.messages_keys, self.system_key = messages_keys, system_key  # several: their lists joined (TRL's)
        self.optional = [(key, kwarg) for key, kwarg in ((tools_key, "tools"), (thinking_key, "enable_thinking"))
                         if key]

    def columns(self, file: str, names: list[str]) -> list[str]:
        for key in self.messages_keys:
            if key not in names:
                raise DataError(f"{file}: no column {key!r} (columns: {names}); set data.multiturn.messages_key to the "
                                f"column of role/content lists{_form_hint(names)}")
        optional = [key for key, _ in self.optional] + [self.system_key]
        return [*self.messages_keys] + [key for key in optional if key in names]

    def decode(self, cells: dict) -> tuple[list[dict], dict]:
        parts = [_messages(cells[key], key) for key in self.messages_keys]
        if self.system_key in cells:
            parts.insert(0, _system(cells[self.system_key], self.system_key, parts[0]))
        # a null (or empty: ShareGPT's "no tools") cell: the template's default
        kwargs = {kwarg: _json(cells[key], key) if kwarg == "tools" else cells[key] for key, kwarg in self.optional
                  if key in cells and cells[key] is not None and cells[key] != ""}
        return sum(parts, []), kwargs


def row_fields(d) -> PromptResponse | ChatMessages:
    m = d.multiturn
    if m.enable:
        return ChatMessages(as_list(m.messages_key), m.tools_key, m.enable_thinking_key, m.system_key)
    prompt_keys = as_list(d.prompt_key)  # a column, or columns joined (Alpaca's [instruction,input])
    return PromptResponse(key_path(next(iter(prompt_keys), None), d.prompt_dict_keys),
                          key_path(d.response_key, d.response_dict_keys), prompt_keys[1:])


class ParquetSource:
    """Rows of Parquet files by global row id. origins: the user's file of each conversion."""

    def __init__(self, files: list[str], fields: PromptResponse | ChatMessages,
                 origins: Optional[dict[str, str]] = None):
        self.fields = fields
        self.origins = origins or {}
        self.row_groups: list[RowGroup] = []
        self._columns: dict[str, list[str]] = {}  # per file: the columns read
        self._stamps: dict[str, Optional[tuple[int, ...]]] = {}  # per file: its file_stamp when opened
        self.unread: set[str] = set()  # the other columns, for the data report
        self.file_rows: list[tuple[str, int]] = []  # (user's file, rows) per file as listed
        for file in files:
            self._add_file(os.path.expanduser(file))
        self.num_rows = sum(g.num_rows for g in self.row_groups)
        self._starts = np.array([g.first_row for g in self.row_groups])
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._cache_rows = SHUFFLE_WINDOW_ROWS + max(g.num_rows for g in self.row_groups)
        self.groups_decoded = 0  # for bench/data_scale.py and tests

    def _add_file(self, file: str) -> None:  # a missing file is the start-up checks' (sfttrain.checks)
        self._stamps[file] = file_stamp(file)  # before its metadata is read: a later change is seen
        try:
            meta = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable Parquet file ({os.path.getsize(file)} bytes; {e}); "
                            "rewrite it (e.g. python data_prep/gsm8k.py) or fix data.train_files / data.val_files "
                            "(JSON Lines, JSON, CSV, TSV and Arrow files are read when named *.jsonl / *.json / "
                            "*.csv / *.tsv / *.arrow, the text ones also compressed: *.jsonl.gz, .bz2, .zst)")
        source = self.origins.get(file, file)
        names = [n for n in meta.schema_arrow.names if n != LINE_COLUMN]
        self._columns[file] = self.fields.columns(source, names)
        self.unread.update(n for n in names if n not in self._columns[file])
        if meta.metadata.num_rows == 0:
            raise no_rows(source)
        self.file_rows.append((source, meta.metadata.num_rows))
        first = sum(g.num_rows for g in self.row_groups)
        for i in range(meta.num_row_groups):
            n = meta.metadata.row_group(i).num_rows
            self.row_groups.append(RowGroup(file, i, first, n, source))
            first += n

    def unread_text(self) -> dict:
        """Per text column not read, the rows holding text in it (Alpaca's input beside its instruction)."""
        if not isinstance(self.fields, PromptResponse) or not self.fields.prompt_path:
            return {}
        counts: Counter[str] = Counter()
        for file, read in self._columns.items():
            parquet = pq.ParquetFile(file)
            json_cells = JSON_CELLS.encode() in (parquet.schema_arrow.metadata or {})
            text = [f.name for f in parquet.schema_arrow if f.name not in read and f.name != LINE_COLUMN
                    and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))]
            for batch in parquet.iter_batches(columns=text) if text else ():
                for name, cells in zip(batch.schema.names, batch.columns):
                    length = pc.utf8_length(cells)  # a JSON cell's text is quoted: '""' holds none
                    filled = pc.and_(pc.starts_with(cells, '"'), pc.greater(length, 2)) if json_cells else \
                        pc.greater(length, 0)
                    counts[name] += pc.sum(filled).as_py() or 0
        rows = {name: n for name, n in sorted(counts.items()) if n}
        return {"prompt_key": [self.fields.prompt_path[0], *self.fields.joined_keys], "rows": rows} if rows else {}

    def where(self, row: int) -> str:
        group = self.row_groups[int(np.searchsorted(self._starts, row, side="right")) - 1]
        return _where(group, row - group.first_row)

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        if not shuffle:
            return np.arange(self.num_rows)
        rng = np.random.default_rng([seed, epoch])
        order, window = [], []
        for g in rng.permutation(len(self.row_groups)):
            group = self.row_groups[g]
            window.append(np.arange(group.first_row, group.first_row + group.num_rows))
            if sum(len(w) for w in window) >= SHUFFLE_WINDOW_ROWS:
                order.append(rng.permutation(np.concatenate(window)))
                window = []
        if window:
            order.append(rng.permutation(np.concatenate(window)))
        return np.concatenate(order)

    def read(self, rows: np.ndarray, bad: Optional[list[tuple[int, str]]] = None) -> list[tuple]:
        """(prompt, response, row) or (messages, template kwargs, row) per row id, one `take` per group.
        Groups go in the order rows first name them, so the cache trimmed after the read drops the
        window that ended, not the one that began. A bad cell raises, or with `bad` its row is left out
        and added to it as (row, message)."""
        rows = np.asarray(rows, dtype=np.int64)
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        out: list = [None] * len(rows)
        for g in dict.fromkeys(groups.tolist()):
            where = np.flatnonzero(groups == g)
            group = self.row_groups[g]
            locals_ = (rows[where] - group.first_row).tolist()
            table = self._group(g).take(locals_)
            columns = {name: _cells(table, name) for name in table.column_names}
            for i, local, cells in zip(where.tolist(), locals_, zip(*columns.values())):
                try:
                    out[i] = (*self.fields.decode(dict(zip(columns, cells))), group.first_row + local)
                except DataError as e:  # a cell's: named by its row (or line)
                    if bad is None:
                        raise DataError(f"{_where(group, local)}: {e}") from None
                    bad.append((group.first_row + local, f"{_where(group, local)}: {e}"))
        while sum(t.num_rows for t in self._cache.values()) > self._cache_rows and len(self._cache) > 1:
            self._cache.popitem(last=False)  # after the read: no group of this request is evicted during it
        return [row for row in out if row is not None]

    def _group(self, g: int) -> pa.Table:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        group = self.row_groups[g]
        try:
            table = pq.ParquetFile(group.file).read_row_group(group.index, columns=self._columns[group.file])
        finally:  # a file changed since start-up fails its read in many ways, or reads as other rows
            self._check_unchanged(group)
        self.groups_decoded += 1
        self._cache[g] = table.combine_chunks()
        return self._cache[g]

    def _check_unchanged(self, group: RowGroup) -> None:
        stamp = file_stamp(group.file)
        if stamp != self._stamps[group.file]:
            raise DataFileChanged(group.source if group.source == group.file else f"{group.source} (as {group.file})",
                                  "deleted" if stamp is None else "rewritten or replaced")


def _text(value, key_path: list[str]) -> str:
    for key in key_path[1:]:
        if not isinstance(value, dict) or key not in value:
            raise DataError(f"no key {key!r} under {key_path[0]!r}; check data.prompt_dict_keys / "
                            "data.response_dict_keys")
        value = value[key]
    if isinstance(value, list):
        raise DataError(f"{'.'.join(key_path)} is list, expected a string; for conversations set "
                        "data.multiturn.enable=true (a prompt and a completion that are lists of messages, TRL's "
                        "form: with data.multiturn.messages_key=[prompt,completion])")
    if not isinstance(value, str):  # a JSON file's row without the key reads as null too
        raise DataError(f"{'.'.join(key_path)} is {_kind(value)}, expected a string" + (
            f"; this row has no value for it (or no key {key_path[-1]!r} at all): fill it in, or remove the row"
            if value is None else ""))
    return value


# other formats' names of the chat templates' roles: ShareGPT's turns ({"from": "human", "value": ...}),
# Gemini's 'model', OpenAI's 'developer' (and its former 'function'), Llama 3's 'ipython'
ROLE_NAMES = {"human": "user", "gpt": "assistant", "observation": "tool", "function_response": "tool",
              "model": "assistant", "developer": "system", "function": "tool", "ipython": "tool"}


def _messages(value, key: str) -> list[dict]:
    """Message dicts without the null keys Parquet's struct union adds (templates test `is defined`)."""
    value = _json(value, key)
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DataError(f"{key} is {_kind(value)}, expected a list of {{role, content}} messages")
    return [_text_parts(_turn({k: v for k, v in m.items() if v is not None}, f"{key}[{i}]"), f"{key}[{i}]")
            for i, m in enumerate(value)]


def _turn(message: dict, where: str) -> dict:
    """The templates' {role, content}: of ShareGPT's turn, of a function_call turn (LLaMA-Factory's) as
    OpenAI's tool_calls, of a role by another name."""
    if "role" not in message and {"from", "value"} <= message.keys():
        turn = {k: v for k, v in message.items() if k not in ("from", "value")}
        if message["from"] == "function_call":
            return {"role": "assistant", "tool_calls": _tool_calls(message["value"], where), **turn}
        message = {"role": message["from"], "content": message["value"], **turn}
    role = message.get("role")
    return {**message, "role": ROLE_NAMES[role]} if isinstance(role, str) and role in ROLE_NAMES else message


def _tool_calls(value, where: str) -> list[dict]:
    calls = _json(value, where)
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and "name" in c for c in calls):
        raise DataError(f"{where}: a function_call turn's value is {str(value)[:80]!r}, not a call "
                        '{"name": ..., "arguments": {...}} (or a list of them)')
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _text_parts(message: dict, where: str) -> dict:
    """OpenAI's text parts joined by newlines, as vLLM joins them; other parts are refused."""
    parts = message.get("content")
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        return message
    kinds = [p.get("type") for p in parts]
    if any(k != "text" or not isinstance(p.get("text"), str) for k, p in zip(kinds, parts)):
        raise DataError(f"{where}: content parts of types {kinds}: sfttrain trains on text alone (parts of type "
                        "'text' with a 'text' string); drop the other parts, or the row")
    return {**message, "content": "\n".join(p["text"] for p in parts)}


def _system(value, key: str, conversation: list[dict]) -> list[dict]:
    if value is None or value == "":
        return []
    if not isinstance(value, str):
        raise DataError(f"{key} is {_kind(value)}, expected a string (a system prompt)")
    if conversation and conversation[0].get("role") == "system":
        raise DataError(f"a system prompt both in the {key} column and as the conversation's first message; keep one "
                        "(data.multiturn.system_key=null leaves the column unread)")
    return [{"role": "system", "content": value}]


def _json(value, key: str):
    """A cell that may hold its value as JSON text (tool schemas often do)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{key} is a string but not JSON ({e})")


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _cells(table: pa.Table, column: str) -> list:
    values = table.column(column).to_pylist()
    if JSON_CELLS.encode() not in (table.schema.metadata or {}):
        return values
    return [None if v is None else json.loads(v) for v in values]


def _where(group: RowGroup, local: int) -> str:
    """The line of a JSON file, else the row in the user's file."""
    parquet = pq.ParquetFile(group.file)
    line = (parquet.read_row_group(group.index, columns=[LINE_COLUMN]).column(0)[local].as_py()
            if LINE_COLUMN in parquet.schema_arrow.names else None)  # None: a JSON list's row
    if line is not None:
        return f"{group.source} line {line}"
    row = local + sum(parquet.metadata.row_group(i).num_rows for i in range(group.index))
    header = {".csv", ".tsv"} & set(PurePath(group.source).suffixes)  # also of train.csv.gz
    return f"{group.source} row {row}" + (" (from 0, the header row not counted)" if header else "")


def key_path(key: Optional[str], dict_keys: Optional[list[str]]) -> Optional[list[str]]:
    return [key, *(dict_keys or [])] if key is not None else None
