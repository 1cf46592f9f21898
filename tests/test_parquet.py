"""The streaming reader over several files and row groups, and the per-epoch order."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sfttrain.config import ConfigError
from sfttrain.data import parquet
from sfttrain.data.parquet import ChatMessages, ParquetSource, PromptResponse, key_path
from sfttrain.errors import DataError
from tests.conftest import BASE_OVERRIDES, run_sfttrain


@pytest.fixture()
def two_files(gsm8k_dir, tmp_path):
    """The GSM8K sample split into two files of 50-row row groups."""
    table = pq.read_table(gsm8k_dir / "train.parquet")
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    pq.write_table(table.slice(0, 700), paths[0], row_group_size=50)
    pq.write_table(table.slice(700), paths[1], row_group_size=50)
    return [str(p) for p in paths], table.to_pylist()


def test_rows_across_files_and_nested_keys(two_files):
    files, rows = two_files
    src = ParquetSource(files, PromptResponse(key_path("extra_info", ["question"]), key_path("answer", None)))
    assert src.num_rows == len(rows) and len(src.row_groups) == 14 + 26
    picks = np.array([1999, 0, 699, 700, 1234, 49, 50])
    for (prompt, response, row), want in zip(src.read(picks), picks):
        assert row == want
        assert prompt == rows[want]["question"] and response == rows[want]["answer"]


@pytest.mark.parametrize("window", [10**6, 120])
def test_epoch_order_is_a_seeded_permutation(two_files, monkeypatch, window):
    """Full shuffle (small data) and windowed shuffle over row groups (large data)."""
    monkeypatch.setattr(parquet, "SHUFFLE_WINDOW_ROWS", window)
    src = ParquetSource(two_files[0], PromptResponse(["question"], ["answer"]))
    order = src.epoch_order(seed=3, epoch=0, shuffle=True)
    assert sorted(order.tolist()) == list(range(src.num_rows))
    assert (order == src.epoch_order(seed=3, epoch=0, shuffle=True)).all()
    assert (order != src.epoch_order(seed=3, epoch=1, shuffle=True)).any()
    assert (order != src.epoch_order(seed=4, epoch=0, shuffle=True)).any()
    assert (src.epoch_order(seed=3, epoch=0, shuffle=False) == np.arange(src.num_rows)).all()


def test_missing_nested_key_names_file_and_row(two_files):
    src = ParquetSource(two_files[0], PromptResponse(key_path("extra_info", ["prompt"]), ["answer"]))
    with pytest.raises(ConfigError, match=r"a.parquet row 0: no key 'prompt' under 'extra_info'"):
        src.read(np.array([0]))


def test_shuffled_epoch_decodes_each_row_group_once(two_files, monkeypatch):
    """Reading a windowed-shuffle epoch step by step returns the right rows, and each row group
    is decoded from disk once (a window's groups stay cached until the window is consumed)."""
    monkeypatch.setattr(parquet, "SHUFFLE_WINDOW_ROWS", 120)  # windows of 3 groups of 50 rows
    files, rows = two_files
    src = ParquetSource(files, PromptResponse(["question"], ["answer"]))
    order = src.epoch_order(seed=3, epoch=0, shuffle=True)
    got = [item for start in range(0, len(order), 24) for item in src.read(order[start:start + 24])]
    assert [row for _, _, row in got] == order.tolist()
    assert all(prompt == rows[row]["question"] and response == rows[row]["answer"] for prompt, response, row in got)
    assert src.groups_decoded == len(src.row_groups)


def test_bad_cells_name_file_row_and_column(tmp_path):
    """A null, a non-string and a messages cell that is not JSON: each named with its file, its row
    in that file and its column."""
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"q": ["a", None, "c"], "r": ["x", "y", "z"], "n": [1, 2, 3],
                             "messages": ["[]", "[{", "[]"]}), path, row_group_size=2)
    with pytest.raises(DataError, match=r"bad.parquet row 1: q is null, expected a string"):
        ParquetSource([str(path)], PromptResponse(["q"], ["r"])).read(np.array([1]))
    with pytest.raises(DataError, match=r"bad.parquet row 2: n is int, expected a string"):
        ParquetSource([str(path)], PromptResponse(["q"], ["n"])).read(np.array([2]))
    with pytest.raises(DataError, match=r"bad.parquet row 1: messages is a string but not JSON"):
        ParquetSource([str(path)], ChatMessages(["messages"], None, None)).read(np.array([1]))


def test_a_bad_cell_in_rank_1s_share_stops_every_rank_at_once(gsm8k_dir, tmp_path):
    """2 real ranks, a null answer in rows only rank 1 scans: rank 0 learns it in the start-up
    gather and reports it (torchrun's root cause is rank 0, exit code 3). Before, rank 0 waited in
    the gather while rank 1 slept 60 s and then reported it alone. The file is JSON Lines (rank 0
    converts it while rank 1 waits, sfttrain/data/files.py), so the row is named by its line."""
    rows = pq.read_table(gsm8k_dir / "train.parquet").slice(0, 40).select(["question", "answer"]).to_pylist()
    rows[33]["answer"] = None
    data = tmp_path / "nulls.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = run_sfttrain(2, [*BASE_OVERRIDES, f"data.train_files={data}", f"trainer.default_local_dir={tmp_path / 'run'}",
                           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2"], check=False, timeout=240,
                       torchrun=True)  # its root cause
    message = (f"sfttrain: data error: {data} line 34: answer is null, expected a string; this row has no value for "
               "it (or no key 'answer' at all): fill it in, or remove the row")
    assert out.returncode != 0, out.stdout[-3000:]  # torchrun exits 1 when a rank failed
    assert [line for line in out.stdout.splitlines() if line.startswith("sfttrain: ")] == [message], out.stdout[-3000:]
    root_cause = out.stdout.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)", root_cause) and "exitcode  : 3" in root_cause, root_cause
