"""data_prep/gsm8k.py, run as users run it (a subprocess), on the in-repo GSM8K sample."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).parents[1]
SCRIPT = REPO / "data_prep/gsm8k.py"
SAMPLE = REPO / "assets/data/gsm8k"
EXTRA_INFO = pa.struct(
    [("question", pa.string()), ("answer", pa.string()), ("split", pa.string()), ("index", pa.int64())]
)


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True, text=True, env=env
    )


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k") / "nested/dir"  # created by the script
    p = run("--local_dir", out, "--input_dir", SAMPLE, "--row_group_size", 500)
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("split", ["train", "test"])
def test_parquet_matches_jsonl(out_dir, split):
    rows = [json.loads(line) for line in (SAMPLE / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    table = pq.read_table(out_dir / f"{split}.parquet")
    assert table.num_rows == len(rows) == {"train": 2000, "test": 200}[split]
    assert table.column_names == ["question", "answer", "extra_info"]
    assert table.schema.field("question").type == pa.string() == table.schema.field("answer").type
    assert table.schema.field("extra_info").type == EXTRA_INFO
    assert table.column("question").to_pylist() == [r["question"] for r in rows]
    assert table.column("answer").to_pylist() == [r["answer"] for r in rows]
    expected = [{"question": r["question"], "answer": r["answer"], "split": split, "index": i}
                for i, r in enumerate(rows)]
    assert table.column("extra_info").to_pylist() == expected


def test_row_group_size(out_dir):
    meta = pq.ParquetFile(out_dir / "train.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [500] * 4


def test_tilde_is_expanded(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    p = run("--local_dir", "~/data/gsm8k", "--input_dir", SAMPLE, env=env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "data/gsm8k/train.parquet").is_file() and (tmp_path / "data/gsm8k/test.parquet").is_file()


def test_missing_input_dir(tmp_path):
    missing = tmp_path / "no_such_dir"
    p = run("--local_dir", tmp_path / "out", "--input_dir", missing)
    assert p.returncode != 0
    assert str(missing) in p.stderr
    assert not (tmp_path / "out").exists()


def test_missing_split_file(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/train.jsonl").write_text((SAMPLE / "train.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    p = run("--local_dir", tmp_path / "out", "--input_dir", tmp_path / "in")
    assert p.returncode != 0
    assert str(tmp_path / "in/test.jsonl") in p.stderr


def test_row_without_answer_names_file_and_line(tmp_path):
    (tmp_path / "in").mkdir()
    good = json.dumps({"question": "1+1?", "answer": "2\n#### 2"})
    (tmp_path / "in/train.jsonl").write_text(f"{good}\n{good}\n" + json.dumps({"question": "no answer"}) + "\n")
    (tmp_path / "in/test.jsonl").write_text(f"{good}\n")
    p = run("--local_dir", tmp_path / "out", "--input_dir", tmp_path / "in")
    assert p.returncode != 0
    assert f"{tmp_path / 'in/train.jsonl'}:3" in p.stderr and "'answer'" in p.stderr


def test_a_write_that_fails_says_why_and_leaves_no_file(tmp_path):
    """An output folder that cannot be made (a file in its way), and a write cut short (the file size limit,
    `ulimit -f`, as a full disk would): one line naming the file and the fix, exit code 1, no traceback, and
    no train.parquet for a run to read as the data (written under a temporary name, renamed once whole)."""
    import resource

    (tmp_path / "afile").write_text("")
    p = run("--local_dir", tmp_path / "afile" / "out", "--input_dir", SAMPLE)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"error: cannot write {tmp_path}/afile/out/train.parquet: [Errno 20] Not a directory" in p.stderr, p.stderr

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(SCRIPT), "--local_dir", str(out), "--input_dir", str(SAMPLE)], cwd=REPO,
                       capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert (f"error: cannot write {out}/train.parquet: the file size limit (ulimit -f) was reached (" in p.stderr
            and "). Raise the file size limit" in p.stderr), p.stderr  # pyarrow's words for EFBIG between
    assert list(out.iterdir()) == []
