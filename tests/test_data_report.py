"""The start-up data pass: rows that would train on nothing (refused, or dropped on 2 real ranks),
the data report against counts made here straight from the tokenizer, and the length cache."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from sfttrain.plan import main as plan
from tests.conftest import BASE_OVERRIDES, STORIES, read_metrics, run_sfttrain

ROWS, BATCH, MAX_LENGTH = 40, 8, 256
LONG_PROMPTS = (5, 17, 30)  # planted: prompts far over MAX_LENGTH


@pytest.fixture(scope="module")
def data(gsm8k_dir, tmp_path_factory) -> Path:
    rows = pq.read_table(gsm8k_dir / "train.parquet").slice(0, ROWS).to_pylist()
    for i in LONG_PROMPTS:
        rows[i]["question"] = " ".join([rows[i]["question"]] * 4)
    out = tmp_path_factory.mktemp("trunc") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows).select(["question", "answer"]), out, row_group_size=16)
    return out


@pytest.fixture(scope="module")
def expected(data) -> dict:
    """Per row, straight from the tokenizer: tokens before truncation, and supervised tokens once
    truncation=right keeps the first MAX_LENGTH (the response and its EOS come after the prompt)."""
    tok = AutoTokenizer.from_pretrained(STORIES)
    full, loss = [], []
    for row in pq.read_table(data).to_pylist():
        prompt = len(tok(row["question"])["input_ids"])  # BOS + the question
        response = len(tok(row["answer"], add_special_tokens=False)["input_ids"]) + 1  # + EOS
        full.append(prompt + response)
        loss.append(max(0, min(prompt + response, MAX_LENGTH) - prompt))
    return {"full": np.array(full), "loss": np.array(loss)}


def job(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*BASE_OVERRIDES, f"data.train_files={data}", f"trainer.default_local_dir={run_dir}",
            f"data.max_length={MAX_LENGTH}", "data.truncation=right", f"data.train_batch_size={BATCH}",
            "data.micro_batch_size_per_gpu=2", *extra]


def test_rows_with_nothing_to_train_stop_the_run(data, expected, tmp_path):
    empty = np.flatnonzero(expected["loss"] == 0)
    assert set(LONG_PROMPTS) <= set(empty.tolist())
    out = run_sfttrain(1, job(data, tmp_path / "run"), check=False)
    assert out.returncode != 0
    assert f"{len(empty)} training rows have no supervised token" in out.stdout
    assert f"rows {empty.tolist()}" in out.stdout
    assert "data.no_loss_rows=drop" in out.stdout and "raise data.max_length" in out.stdout
    assert not (tmp_path / "run" / "global_step_1").exists()


def test_dropped_rows_never_train_and_the_report_counts(data, expected, tmp_path):
    """2 ranks, drop: each step's token count is that of the next BATCH kept rows in file order
    (shuffle off), so the rows left out are exactly the empty ones and the plan counts from the
    kept rows; the report's numbers equal the ones computed here."""
    run_dir = tmp_path / "run"
    out = run_sfttrain(2, job(data, run_dir, "data.no_loss_rows=drop")).stdout
    kept = np.flatnonzero(expected["loss"] > 0)
    steps = len(kept) // BATCH
    assert f"{ROWS} rows -> {steps} steps per epoch" not in out  # the plan is not of all rows ...
    assert f"{len(kept)} rows -> {steps} steps per epoch" in out  # ... but of the kept ones
    trained = np.minimum(expected["full"], MAX_LENGTH)
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["tokens"] for m in logged] == [int(trained[kept[i * BATCH:(i + 1) * BATCH]].sum()) for i in range(steps)]
    assert [m["loss_tokens"] for m in logged] == \
        [int(expected["loss"][kept[i * BATCH:(i + 1) * BATCH]].sum()) for i in range(steps)]

    report = json.loads((run_dir / "data_report.json").read_text())
    full = expected["full"]
    cut = np.flatnonzero(full > MAX_LENGTH)
    assert report["rows"] == ROWS and report["rows_trained"] == len(kept)
    assert report["rows_dropped_no_loss"] == {"count": ROWS - len(kept),
                                              "rows": np.flatnonzero(expected["loss"] == 0)[:8].tolist()}
    assert report["tokens_before_truncation"]["max"] == full.max()
    assert report["tokens_before_truncation"]["mean"] == pytest.approx(full.mean())
    assert report["tokens_before_truncation"]["p50"] == pytest.approx(np.median(full))
    assert report["tokens"]["max"] == MAX_LENGTH
    assert report["truncated"]["count"] == len(cut) and report["truncated"]["share"] == pytest.approx(len(cut) / ROWS)
    assert report["truncated"]["effect"] == "eos_cut"
    assert report["supervised_tokens_per_epoch"] == sum(m["loss_tokens"] for m in logged)
    assert report["rows_rendered_at_startup"] == ROWS
    assert "data.truncation=right cut the end of" in out and "EOS" in out


def test_a_row_whose_counts_changed_since_the_scan_stops_the_run(data, tmp_path):
    """The loss normaliser comes from the length cache; a cache that no longer matches the rows
    (here one supervised count tampered with, row 3 of the first step) stops the step that renders
    the row, naming it and what to do, also when a DataLoader worker builds the step."""
    import torch.distributed as dist

    from sfttrain.config import load_config
    from sfttrain.data.render import build_renderer
    from sfttrain.data.files import open_source
    from sfttrain.data.prepare import data_fingerprint, rendering_key
    from sfttrain.data.loader import _save_stats, digest
    from sfttrain.data.pack import loss_tokens
    from sfttrain.data.parquet import row_fields
    from sfttrain.data.prepare import LENGTHS_DIR
    from sfttrain.model import load_tokenizer

    run_dir = tmp_path / "run"
    overrides = job(data, run_dir, "data.truncation=left", "data.num_workers=1")
    cfg = load_config(None, overrides)
    tokenizer = load_tokenizer(cfg.model)
    source = open_source([str(data)], row_fields(cfg.data), str(run_dir))
    renderer = build_renderer(cfg.data, tokenizer, None)
    samples = [renderer.render(*row) for row in source.read(np.arange(source.num_rows))]
    columns = [np.array(c) for c in zip(*((len(s.input_ids), loss_tokens(s), s.full_length, digest(s))
                                          for s in samples))]
    columns[1][3] += 1
    assert not dist.is_initialized()
    _save_stats(str(run_dir / LENGTHS_DIR / f"{rendering_key(data_fingerprint(cfg, source, tokenizer))}.npz"), columns)
    out = run_sfttrain(1, overrides, check=False)
    assert out.returncode == 3, out.stdout[-3000:]
    assert "every row's length read from" in out.stdout  # the counts came from the cache
    n, loss = len(samples[3].input_ids), loss_tokens(samples[3])
    assert (f"{data} row 3 renders now to {n} tokens, {loss} supervised, but the start-up row scan "
            f"counted {n} and {loss + 1}") in out.stdout, out.stdout[-3000:]
    assert f"delete {run_dir / LENGTHS_DIR}/" in out.stdout and "Traceback" not in out.stdout
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)


def test_a_length_cache_of_the_users_renders_the_data_once_for_a_sweep(data, expected, tmp_path):
    """data.length_cache_dir: the preflight renders the rows and fills the cache with their counts (those
    of the tokenizer here); two runs in other run folders, with another learning rate each, read them
    and render no row at start-up; another max_length is another rendering, so another file. A cache
    folder that cannot be made is refused before the scan, naming the key."""
    cache = tmp_path / "cache"

    def sweep(run: str, *extra: str) -> list[str]:
        return job(data, tmp_path / run, "data.no_loss_rows=drop", f"data.length_cache_dir={cache}", *extra)

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan([*sweep("a"), "--nproc", "2"]) == 0, out.getvalue()
    [written] = cache.iterdir()
    with np.load(written) as counts:
        assert counts["full_lengths"].tolist() == expected["full"].tolist()
        assert counts["lengths"].tolist() == np.minimum(expected["full"], MAX_LENGTH).tolist()
        assert counts["loss_tokens"].tolist() == expected["loss"].tolist()
    assert not (tmp_path / "a").exists()  # the preflight writes nothing into the run folder

    for run, lr in (("a", "1e-3"), ("b", "3e-4")):
        out = run_sfttrain(2, sweep(run, f"optim.lr={lr}"))
        report = json.loads((tmp_path / run / "data_report.json").read_text())
        assert report["rows_rendered_at_startup"] == 0 and report["length_cache"] == str(written), out.stdout[-2000:]
        assert not (tmp_path / run / "row_stats").exists()

    run_sfttrain(1, sweep("c", "data.max_length=200", "trainer.total_training_steps=1"))
    report = json.loads((tmp_path / "c" / "data_report.json").read_text())
    assert report["rows_rendered_at_startup"] == ROWS and len(list(cache.iterdir())) == 2

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    out = run_sfttrain(1, job(data, tmp_path / "d", f"data.length_cache_dir={not_a_folder}"), check=False)
    assert out.returncode == 2 and f"data.length_cache_dir='{not_a_folder}': cannot keep the row lengths" in out.stdout
    assert not (tmp_path / "d" / "data_report.json").exists()  # stopped before the scan's end


@pytest.mark.parametrize("where", ["run folder", "data.length_cache_dir"])
def test_a_damaged_length_cache_is_said_and_rendered_again(data, expected, tmp_path, where):
    """A length cache cut short (a copy interrupted, a failing disk) is only a cache: the next start
    says so in one line, renders every row again and writes the cache anew, and trains."""
    cache = tmp_path / "run" / "row_stats" if where == "run folder" else tmp_path / "cache"
    command = job(data, tmp_path / "run", "data.no_loss_rows=drop", "trainer.total_training_steps=1",
                  *([f"data.length_cache_dir={cache}"] if where != "run folder" else []))
    run_sfttrain(1, command)
    [written] = cache.iterdir()
    written.write_bytes(written.read_bytes()[:-40])
    out = run_sfttrain(1, [*command, "trainer.resume_mode=disable"]).stdout
    said = [line for line in out.splitlines() if "does not read back" in line]
    assert said == [f"the length cache {written} does not read back (BadZipFile: File is not a zip file): ignored; "
                    "every row is rendered again and the cache written anew"], out[-3000:]
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["rows_rendered_at_startup"] == ROWS and report["length_cache"] == str(written)
    assert list(cache.iterdir()) == [written]  # written over, no temporary file left
    with np.load(written) as counts:
        assert counts["full_lengths"].tolist() == expected["full"].tolist()


def test_rows_trained_twice_and_validation_rows_seen_in_training_are_reported(gsm8k_dir, tmp_path):
    """Training rows 7 and 20 repeat rows 2 and 11, rows 13 and 30 have an empty answer; validation rows 1
    and 4 are training rows 11 and 5, its other rows are not (the reference: the same question and answer
    text). 2 ranks, each rendering half of the validation rows: the report and the preflight name the
    same pairs and rows, and both warn. An `input` column that no key names is listed as not read. The
    training rows are two files: the warnings name each row by its file and row there (row ids count
    through both)."""
    rows = pq.read_table(gsm8k_dir / "train.parquet").slice(0, ROWS).select(["question", "answer"]).to_pylist()
    rows[7], rows[20] = rows[2], rows[11]
    rows[13]["answer"] = rows[30]["answer"] = ""
    for row in rows:
        row["input"] = "context the prompt key does not name"  # Alpaca's column beside instruction, unread
    val = pq.read_table(gsm8k_dir / "train.parquet").slice(ROWS, 6).select(["question", "answer"]).to_pylist()
    val[1], val[4] = rows[11], rows[5]
    for name, table in (("train_a", rows[:16]), ("train_b", rows[16:]), ("val", val)):
        pq.write_table(pa.Table.from_pylist(table), tmp_path / f"{name}.parquet")
    train_a, train_b = tmp_path / "train_a.parquet", tmp_path / "train_b.parquet"
    first = {}
    text = [(r["question"], r["answer"]) for r in rows]
    for i, t in enumerate(text):
        first.setdefault(t, i)
    repeated = [i for i, t in enumerate(text) if first[t] != i]
    twins = [(v, first[t]) for v, t in enumerate((r["question"], r["answer"]) for r in val) if t in first]
    assert repeated == [7, 20] and twins == [(1, 11), (4, 5)]

    overrides = job(f"[{train_a},{train_b}]", tmp_path / "run", f"data.val_files={tmp_path / 'val.parquet'}",
                    "data.truncation=left", "trainer.total_training_steps=1")
    out = run_sfttrain(2, overrides).stdout
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["duplicate_rows"] == {"count": len(repeated), "rows": repeated,  # row ids over both files
                                        "at": [f"{train_a} row 7", f"{train_b} row 4"]}
    assert report["columns_not_read"] == ["input"] and "  columns not read    : input (data.prompt_key" in out
    assert report["unread_text"] == {"prompt_key": ["question"], "rows": {"input": ROWS}}
    assert f"column input in {ROWS} of {ROWS} rows. A column" in out and "data.prompt_key=[question,input]" in out
    empty = [i for i, r in enumerate(rows) if not r["answer"]]
    assert empty == [13, 30] and report["empty_responses"] == {"count": 2, "rows": empty,
                                                               "at": [f"{train_a} row 13", f"{train_b} row 14"]}
    assert report["validation"] == {"rows": len(val), "in_training": {
        "count": len(twins), "rows": [v for v, _ in twins], "training_rows": [t for _, t in twins]}}
    warning = "WARNING: validation rows [1, 4] (2 of 6) are training rows [11, 5] (the same tokens)"
    assert warning in out and f"rows [{train_a} row 7, {train_b} row 4] (2 in all) repeat an earlier row's" in out

    with contextlib.redirect_stdout(io.StringIO()) as preflight:
        assert plan([*overrides, "--nproc", "2"]) == 0, preflight.getvalue()
    empty_warning = (f"WARNING: rows [{train_a} row 13, {train_b} row 14] (2 in all) have an empty response: the end "
                     "token alone is trained on them")
    assert warning in preflight.getvalue() and empty_warning in preflight.getvalue(), preflight.getvalue()
    assert empty_warning in out, out


def test_a_list_of_rows_cut_short_says_so():
    """A warning shows the first rows of many: the list says there are more (the count beside it says how many)."""
    from sfttrain.data.prepare import _listed

    assert (_listed([1, 4], 2), _listed([1, 4], 16)) == ("[1, 4]", "[1, 4, ...]")
