"""Streaming Parquet reader and the per-epoch sample order.

Files are read one row group at a time (never loaded whole). The order of an epoch is a pure
function of (seed, epoch, the files' row groups): it does not depend on the world size, so a
data position saved by N ranks is valid for M ranks (elastic resume).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sfttrain.config import ConfigError
from sfttrain.errors import DataError

# Rows shuffled together. Small datasets (below this) get a full shuffle; larger ones a shuffle of
# row-group order plus a full shuffle inside windows of this many rows, so that reading stays
# sequential-ish and memory stays bounded.
SHUFFLE_WINDOW_ROWS = 200_000


@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int
    first_row: int  # global row id of its first row
    num_rows: int


class ParquetSource:
    """Rows of one or many Parquet files, addressed by a global row id."""

    def __init__(self, files: list[str], prompt_path: list[str], response_path: list[str], cache_groups: int = 8):
        if not files:
            raise ConfigError("no Parquet files given")
        self.prompt_path, self.response_path = prompt_path, response_path
        self.row_groups: list[RowGroup] = []
        for file in files:
            self._add_file(os.path.expanduser(file))
        self.num_rows = sum(g.num_rows for g in self.row_groups)
        self._starts = np.array([g.first_row for g in self.row_groups])
        self._cache: OrderedDict[int, tuple[list, list]] = OrderedDict()
        self._cache_groups = cache_groups

    def _add_file(self, file: str) -> None:
        if not os.path.isfile(file):
            raise DataError(f"data file {file!r} does not exist (check data.train_files / data.val_files)")
        try:
            meta = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable Parquet file ({os.path.getsize(file)} bytes; {e}); "
                            "rewrite it (e.g. python data_prep/gsm8k.py) or fix data.train_files / data.val_files")
        columns = meta.schema_arrow.names
        for key_path in (self.prompt_path, self.response_path):
            if key_path[0] not in columns:
                raise DataError(f"{file}: no column {key_path[0]!r} (columns: {columns}); set data.prompt_key / "
                                  "data.response_key to the right columns")
        if meta.metadata.num_rows == 0:
            raise DataError(f"{file}: the file has no rows; point data.train_files / data.val_files at a file with rows")
        first = sum(g.num_rows for g in self.row_groups)
        for i in range(meta.num_row_groups):
            n = meta.metadata.row_group(i).num_rows
            self.row_groups.append(RowGroup(file, i, first, n))
            first += n

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """Global row ids in the order the epoch consumes them."""
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

    def read(self, rows: np.ndarray) -> list[tuple[str, str, int]]:
        """(prompt, response, row id) for each global row id, in the given order."""
        out = []
        for row in rows.tolist():
            g = int(np.searchsorted(self._starts, row, side="right")) - 1
            prompts, responses = self._group(g)
            local = row - self.row_groups[g].first_row
            out.append((prompts[local], responses[local], row))
        return out

    def _group(self, g: int) -> tuple[list, list]:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        group = self.row_groups[g]
        table = pq.ParquetFile(group.file).read_row_group(
            group.index, columns=[self.prompt_path[0], self.response_path[0]])
        prompts = [self._text(v, self.prompt_path, group, i) for i, v in
                   enumerate(table.column(self.prompt_path[0]).to_pylist())]
        responses = [self._text(v, self.response_path, group, i) for i, v in
                     enumerate(table.column(self.response_path[0]).to_pylist())]
        self._cache[g] = (prompts, responses)
        if len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return prompts, responses

    @staticmethod
    def _text(value, key_path: list[str], group: RowGroup, local: int) -> str:
        """Follows verl's nested keys (data.prompt_dict_keys) down to a string."""
        for key in key_path[1:]:
            if not isinstance(value, dict) or key not in value:
                raise DataError(f"{group.file} row {local + _rows_before(group)}: no key {key!r} under "
                                  f"{key_path[0]!r}; check data.prompt_dict_keys / data.response_dict_keys")
            value = value[key]
        if not isinstance(value, str):
            raise DataError(f"{group.file} row {local + _rows_before(group)}: {'.'.join(key_path)} is "
                              f"{type(value).__name__}, expected a string")
        return value


def _rows_before(group: RowGroup) -> int:
    """Row number inside its own file of the row group's first row (for error messages)."""
    meta = pq.ParquetFile(group.file).metadata
    return sum(meta.row_group(i).num_rows for i in range(group.index))


def key_path(key: str, dict_keys: Optional[list[str]]) -> list[str]:
    return [key, *(dict_keys or [])]
