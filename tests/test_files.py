"""The user's own data (sfttrain/data/files.py): JSON Lines, JSON, CSV (also compressed) and directories
read through the same streaming Parquet reader, against the rows read here straight from the files."""

import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sfttrain.data import files
from sfttrain.data.files import CONVERTED_DIR, open_source, records
from sfttrain.data.prepare import _files as data_files_of
from sfttrain.data.parquet import ChatMessages, PromptResponse
from sfttrain.errors import DataError
from tests.conftest import ASSETS, REPO, read_metrics, run_sfttrain

GSM8K = [json.loads(line) for line in (ASSETS / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()]
FIELDS = PromptResponse(["question"], ["answer"])


def read_all(source) -> list[tuple]:
    return source.read(source.epoch_order(seed=0, epoch=0, shuffle=False))


def test_jsonl_json_and_a_directory_read_as_their_rows(tmp_path, monkeypatch):
    """The same rows as a JSON Lines file (a blank line in it), a JSON list, a .json of one object per line
    and a directory holding a Parquet file beside a .jsonl: each converted in row groups of 16 rows (memory
    is one group's)."""
    monkeypatch.setattr(files, "ROW_GROUP_ROWS", 16)
    rows = GSM8K[:50]
    lines = [json.dumps(r) for r in rows]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:10] + [""] + lines[10:]) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "c.json").write_text("\n".join(lines))
    folder = tmp_path / "folder"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:20]), folder / "part-0.parquet")
    (folder / "part-1.jsonl").write_text("\n".join(lines[20:]))
    (folder / "notes.txt").write_text("not data")
    want = [(r["question"], r["answer"]) for r in rows]
    for path in ("a.jsonl", "b.json", "c.json", "folder"):
        source = open_source([str(tmp_path / path)], FIELDS, str(tmp_path / "run"))
        assert [(p, r) for p, r, _ in read_all(source)] == want, path
    converted = sorted((tmp_path / "run" / CONVERTED_DIR).glob("*.parquet"))
    assert len(converted) == 4 and all(pq.ParquetFile(f).num_row_groups >= 2 for f in converted)
    assert [line for line, _ in records(str(tmp_path / "a.jsonl"))][9:11] == [10, 12]  # the blank line counted


def test_a_conversion_is_reused_until_the_source_changes(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in GSM8K[:5]))
    run = str(tmp_path / "run")
    first = open_source([str(path)], FIELDS, run).row_groups[0].file
    mtime = os.stat(first).st_mtime_ns
    assert open_source([str(path)], FIELDS, run).row_groups[0].file == first
    assert os.stat(first).st_mtime_ns == mtime  # read, not written again
    path.write_text("\n".join(json.dumps(r) for r in GSM8K[5:8]))
    source = open_source([str(path)], FIELDS, run)
    assert source.row_groups[0].file != first and source.num_rows == 3
    # the data fingerprint (resume checks, the length cache's name) names the user's file
    assert data_files_of(source) == [{"path": str(path), "bytes": path.stat().st_size, "rows": 3}]


def test_a_data_file_rewritten_while_the_run_trains_stops_it_naming_the_file(gsm8k_dir, tmp_path):
    """Row groups are read lazily after the start-up scan (here all of them: a resume reads the counts from
    the run folder's length cache). The training file rewritten mid-run with other rows, as a data_prep
    script run again into its folder does (here every digit replaced by the next: the same token counts, which
    the trainer's count check alone let train silently to the end), stops the run at the next row group it
    reads, in a data worker: one message naming the file and the checkpoint to resume from, exit code 3, no
    traceback."""
    import time

    from tests.conftest import BASE_OVERRIDES, kill_job, launch, logged_steps

    data, run_dir, log = tmp_path / "train.parquet", tmp_path / "run", tmp_path / "log"
    rows = pq.read_table(gsm8k_dir / "train.parquet", columns=["question", "answer"])
    pq.write_table(rows, data, row_group_size=16)  # 2 steps a group: the run reads a group from disk every 2 steps
    job = [*BASE_OVERRIDES, f"data.train_files={data}", f"trainer.default_local_dir={run_dir}", "data.max_length=64",
           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8", "trainer.save_freq=2"]
    run_sfttrain(1, [*job, "trainer.total_training_steps=2"])  # the scan, the length cache, global_step_2
    proc = launch(1, [*job, "trainer.total_training_steps=240", "data.num_workers=1"], log)
    try:
        deadline = time.monotonic() + 120
        while logged_steps(run_dir) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and logged_steps(run_dir) >= 4, log.read_text()[-3000:]
        next_digit = str.maketrans("0123456789", "1234567890")  # other numbers, the same tokens (a digit each)
        other = {k: [text.translate(next_digit) for text in rows[k].to_pylist()] for k in rows.column_names}
        pq.write_table(pa.table(other), data, row_group_size=16)
        code = proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = log.read_text()
    said = [line for line in out.splitlines() if line.startswith("sfttrain: ")]
    assert code == 3 and len(said) == 1 and "Traceback" not in out, out[-3000:]
    last = max(int(p.name.split("_")[-1]) for p in run_dir.glob("global_step_*"))
    assert said[0].startswith(f"sfttrain: data error: data file {data} changed while the run trained: "), said[0]
    assert f"The same command then resumes from {run_dir / f'global_step_{last}'}" in said[0], said[0]
    assert logged_steps(run_dir) < 240


def test_nested_keys_and_messages_keep_their_json_values(tmp_path):
    """Rows of one file with different keys, shapes and types: each row reads back as written."""
    rows = [{"data": {"q": "one", "a": "1"}, "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]},
            {"data": {"q": "two", "a": "2", "extra": [1, 2]},
             "messages": [{"role": "user", "content": "x"},
                          {"role": "assistant", "content": "", "tool_calls": [{"arguments": {"n": 5}}]}],
             "tools": [{"name": "calc", "parameters": {"x": "string"}}]}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    nested = open_source([str(path)], PromptResponse(["data", "q"], ["data", "a"]), str(tmp_path / "run"))
    assert [(p, r) for p, r, _ in read_all(nested)] == [("one", "1"), ("two", "2")]
    chat = open_source([str(path)], ChatMessages(["messages"], "tools", None), str(tmp_path / "run"))
    assert [(m, k) for m, k, _ in read_all(chat)] == [(rows[0]["messages"], {}),
                                                      (rows[1]["messages"], {"tools": rows[1]["tools"]})]


@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"question": "q", "answer": "a"}\n\n{"question": "q", "answer": }\n',
     r"bad.jsonl line 3: not valid JSON \(Expecting value, column 29\)"),
    ("list.jsonl", '{"question": "q", "answer": "a"}\n[1, 2]\n', r"list.jsonl line 2: a row is a JSON object"),
    ("bad.json", '[\n {"question": "q", "answer": "a"},\n {"question": "q" "answer": "a"}\n]',
     r"bad.json line 3: not valid JSON \(Expecting ',' delimiter, column 19\); fix"),
    ("comma.json", '[{"question": "q", "answer": "a"}\n {"question": "q", "answer": "a"}]',
     r"comma.json line 2: not valid JSON \(Expecting ',' delimiter, column 2\)"),
    ("object.json", '{\n "rows": []\n}', r"object.json line 1: not valid JSON .*a .json file holds a list of objects"),
    ("empty.jsonl", "\n", r"empty.jsonl: the file has no rows"),
])
def test_malformed_files_are_named_with_their_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        open_source([str(tmp_path / name)], FIELDS, str(tmp_path / "run"))
    assert not list((tmp_path / "run").rglob("*.parquet"))  # nothing written


def test_a_file_not_in_utf8_is_named(tmp_path):
    """A CSV that Excel saved in the system's code page (GBK), one whose bad byte lies past the reader's
    first block (pyarrow's CSV reader finds it), and a JSON Lines file that PowerShell's `>` wrote
    (UTF-16) stop naming the file and how to write it as UTF-8, not with a UnicodeDecodeError."""
    rows = [f"question {i},answer {i}" for i in range(2000)]
    (tmp_path / "gbk.csv").write_bytes("question,answer\nq,a\n问题,答案\n".encode("gbk"))
    (tmp_path / "late.csv").write_bytes("\n".join(["question,answer", *rows[:1500], "Café?,oui", *rows[1500:]])
                                        .encode("latin-1"))
    (tmp_path / "ps.jsonl").write_text('{"question": "q", "answer": "a"}\n', encoding="utf-16")
    for name, found in (("gbk.csv", "invalid UTF8"), ("late.csv", "invalid UTF8"), ("ps.jsonl", "can't decode")):
        with pytest.raises(DataError, match=rf"{name}: not a readable .* file \(.*{found}.*\); text files are read as "
                                            r"UTF-8 \(Excel: Save As 'CSV UTF-8'"):
            open_source([str(tmp_path / name)], FIELDS, str(tmp_path / "run"))


def test_a_pattern_reads_the_files_it_matches_and_a_folder_of_splits_is_refused(tmp_path):
    """A hub dataset's layout: data/ holds train-0000{0,1}-of-00002.parquet and test-00000-of-00001.parquet.
    The folder read whole would train on the test rows too: refused, with a pattern per split. The
    train pattern reads the two train files' rows, in name order; a pattern matching no data file is named."""
    data = tmp_path / "data"
    data.mkdir()
    rows = {name: [{"question": f"{name} q{i}", "answer": f"a{i}"} for i in range(3)]
            for name in ("train-00001-of-00002", "train-00000-of-00002", "test-00000-of-00001")}
    for name, table in rows.items():
        pq.write_table(pa.Table.from_pylist(table), data / f"{name}.parquet")
    (data / "README.md").write_text("not data")
    run_dir = str(tmp_path / "run")
    with pytest.raises(DataError, match=rf"{data}: its files are named for several splits.*test: "
                                        rf"{data / 'test-00000-of-00001.parquet'}; train: {data / 'train-0000'}\*$"):
        open_source([str(data)], FIELDS, run_dir)
    source = open_source([f"{data}/train-*"], FIELDS, run_dir)
    expected = rows["train-00000-of-00002"] + rows["train-00001-of-00002"]
    assert source.read(np.arange(6)) == [(r["question"], r["answer"], i) for i, r in enumerate(expected)]
    with pytest.raises(DataError, match=rf"{data}/valid\*: no data file .* matches this pattern"):
        open_source([f"{data}/valid*"], FIELDS, run_dir)
    for name in ("gsm8k-train.arrow", "gsm8k-test.arrow"):  # datasets' cache names them so
        (tmp_path / "cache" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "cache" / name).write_bytes(b"")
    with pytest.raises(DataError, match="its files are named for several splits"):
        open_source([str(tmp_path / "cache")], FIELDS, run_dir)


def test_a_bad_cell_is_named_with_its_line(tmp_path):
    """A null, a row without the key, a number: each named with its line, and what to do about it."""
    path = tmp_path / "cells.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n\n{"question": "q", "answer": null}\n'
                    '{"question": "q", "answer": 5}\n{"answer": "a"}\n')
    source = open_source([str(path)], FIELDS, str(tmp_path / "run"))
    with pytest.raises(DataError, match=rf"{path} line 3: answer is null, expected a string; this row has no value "
                                        r"for it \(or no key 'answer' at all\): fill it in, or remove the row"):
        source.read(np.array([1]))
    with pytest.raises(DataError, match=rf"{path} line 4: answer is int, expected a string$"):
        source.read(np.array([2]))
    with pytest.raises(DataError, match=rf"{path} line 5: question is null, expected a string; this row has no value "
                                        r"for it \(or no key 'question' at all\)"):
        source.read(np.array([3]))
    listed = tmp_path / "cells.json"  # a JSON list's rows are named by their place in it
    listed.write_text(json.dumps([{"question": "q", "answer": "a"}, {"question": "q", "answer": None}], indent=1))
    with pytest.raises(DataError, match=rf"{listed} row 1: answer is null"):
        open_source([str(listed)], FIELDS, str(tmp_path / "run")).read(np.array([1]))


def test_a_bad_cell_of_a_csv_or_arrow_file_is_named_with_its_row(tmp_path):
    """Files converted without line numbers (CSV, Arrow) name a bad cell's row in the user's file."""
    (tmp_path / "rows.csv").write_text('question,messages\nq,"[]"\nq,not json\n')
    chat = open_source([str(tmp_path / "rows.csv")], ChatMessages(["messages"], None, None), str(tmp_path / "run"))
    with pytest.raises(DataError, match=r"rows.csv row 1 \(from 0, the header row not counted\): messages .*JSON"):
        chat.read(np.array([1]))
    table = pa.table({"question": ["q"] * 3, "answer": ["a", "a", None]})
    with pa.ipc.new_stream(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    source = open_source([str(tmp_path / "rows.arrow")], FIELDS, str(tmp_path / "run"))
    with pytest.raises(DataError, match=r"rows.arrow row 2: answer is null, expected a string"):
        source.read(np.array([2]))


def test_an_empty_directory_is_named(tmp_path):
    """A folder without data files is named; one whose data files lie in a subfolder (a hub dataset's
    snapshot: README.md beside data/) names that subfolder."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory without data files"):
        open_source([str(tmp_path / "empty")], FIELDS, str(tmp_path / "run"))
    (tmp_path / "snapshot" / "data").mkdir(parents=True)
    (tmp_path / "snapshot" / "README.md").write_text("# a dataset\n")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "snapshot" / "data" / "train.parquet")
    with pytest.raises(DataError, match=rf"snapshot: a directory without data files .*; its subfolder "
                                        rf"{tmp_path}/snapshot/data holds some \(a folder's files are read, not those"):
        open_source([str(tmp_path / "snapshot")], FIELDS, str(tmp_path / "run"))


def readme_commands() -> list[list[str]]:
    """The commands of the README's "Your own data" section, as argument lists."""
    section = (REPO / "README.md").read_text().split("### Your own data")[1].split("\n### ")[0]
    block = section.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_readme_commands_train_on_the_example_files(tiny_qwen_dir, tmp_path):
    """Each command as the README gives it, from the repository root, with only the hub model
    replaced by a tiny local Qwen2 (same tokenizer and template) and the run folder put here."""
    commands = readme_commands()
    assert len(commands) == 5 and all(c[:3] == ["python", "-m", "sfttrain.run"] for c in commands)

    def run(i: int) -> None:
        args = [a.replace("Qwen/Qwen2.5-0.5B-Instruct", str(tiny_qwen_dir)) for a in commands[i][3:]]
        args = [f"trainer.default_local_dir={tmp_path / str(i)}" if a.startswith("trainer.default_local_dir=") else a
                for a in args]
        run_sfttrain(1, args, cwd=REPO)

    with ThreadPoolExecutor(len(commands)) as pool:  # mostly start-up: overlapped
        list(pool.map(run, range(len(commands))))
    for i, command in enumerate(commands):
        assert [m["step"] for m in read_metrics(tmp_path / str(i)) if "loss" in m] == [1, 2], command
        assert len(list((tmp_path / str(i) / CONVERTED_DIR).glob("*.parquet"))) == 1  # the example converted once


def test_a_row_that_does_not_render_is_named_with_its_line(tmp_path):
    """The start-up scan (one real gloo rank) names a render error with the file and line first, and
    no other row: the renderer's row id counts through all the files (here 3, the second file's row 1)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from sfttrain.data.loader import render_share
    from sfttrain.data.render import Renderer
    from tests.conftest import STORIES

    first, path = tmp_path / "a.jsonl", tmp_path / "long.jsonl"
    first.write_text('{"question": "q", "answer": "a"}\n' * 2)
    path.write_text('{"question": "q", "answer": "a"}\n\n' + json.dumps({"question": "q " * 100, "answer": "a"}) + "\n")
    renderer = Renderer(AutoTokenizer.from_pretrained(STORIES), max_length=32, truncation="error",
                        apply_chat_template=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(DataError, match=rf"{path} line 3: the row has \d+ tokens .* more than data.max_length=32"):
            render_share(open_source([str(first), str(path)], FIELDS, str(tmp_path / "run")), renderer, 0, 1)
    finally:
        dist.destroy_process_group()


def test_a_file_with_several_bad_rows_names_the_first_few_at_once(tmp_path, monkeypatch):
    """Bad cells and rows that do not render, in blocks of the start-up scan (one real gloo rank): the
    first is said in full, the next ones by their lines and the count, so that one start finds them
    rather than one start per row; the scan stops after the block that brings five (a column of nulls
    is not rendered to its end), its count then a lower bound, and fewer are counted exactly."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from sfttrain.data import loader
    from sfttrain.data.loader import render_share
    from sfttrain.data.render import Renderer
    from tests.conftest import STORIES

    rows = [{"question": "q", "answer": "a"} for _ in range(16)]
    for i in (2, 5, 9, 10):
        rows[i]["answer"] = None
    rows[7]["question"] = "q " * 100  # over data.max_length
    rows[11]["answer"] = 5
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    renderer = Renderer(AutoTokenizer.from_pretrained(STORIES), max_length=32, truncation="error",
                        apply_chat_template=False)
    monkeypatch.setattr(loader, "SCAN_BLOCK_ROWS", 4)  # the fourth is not rendered while 5 are found
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(DataError, match=rf"^{path} line 3: answer is null, expected a string; .* \(6 or more bad "
                                            rf"rows; the next: line 6, line 8, line 10, line 11\)$"):
            render_share(open_source([str(path)], FIELDS, str(tmp_path / "run")), renderer, 0, 1)
        rows[11]["answer"], rows[10]["answer"] = "a", "a"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(DataError, match=r"line 3: answer is null, .* \(4 bad rows; the next: line 6, line 8, "
                                            r"line 10\)$"):
            render_share(open_source([str(path)], FIELDS, str(tmp_path / "run")), renderer, 0, 1)
    finally:
        dist.destroy_process_group()


def test_text_rows_train_every_token(tmp_path):
    """data.prompt_key=null: a row is its text alone, rendered as the tokenizer encodes the text (its
    BOS first) and EOS, every token but the first trained. The default keys on a file of that form
    name the keys to set; a chat template with no prompt is refused."""
    from transformers import AutoTokenizer

    from sfttrain.config import ConfigError, load_config
    from sfttrain.data.render import Renderer
    from tests.conftest import STORIES

    path = REPO / "examples" / "data" / "text.jsonl"
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    source = open_source([str(path)], PromptResponse(None, ["text"]), str(tmp_path / "run"))
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    renderer = Renderer(tokenizer, max_length=4096, truncation="error", apply_chat_template=False)
    for (prompt, response, row), text in zip(source.read(np.arange(source.num_rows)), texts, strict=True):
        sample = renderer.render(prompt, response, row)
        assert sample.input_ids == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        assert sample.loss_mask == [0] + [1] * (len(sample.input_ids) - 1)
    with pytest.raises(DataError, match="data.prompt_key=null data.response_key=text data.apply_chat_template=false"):
        open_source([str(path)], FIELDS, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="set data.apply_chat_template=false"):
        load_config(None, [f"data.train_files={path}", "model.partial_pretrain=m", "data.prompt_key=null"])


def test_a_folder_that_save_to_disk_wrote_reads_as_its_rows(tmp_path):
    """A dataset folder written by datasets' save_to_disk (several Arrow files, state.json,
    dataset_info.json) reads as the rows datasets' own load_from_disk gives, in order, through the
    Parquet conversion of each Arrow file: prompt/response and message columns alike. The folder of
    a DatasetDict names its splits."""
    import datasets

    rows = [{"question": f"question {i}", "answer": f"answer {i}",
             "messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(2500)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved), max_shard_size="100KB")
    assert len(json.loads((saved / "state.json").read_text())["_data_files"]) > 1
    expected = datasets.load_from_disk(str(saved)).to_list()
    run_dir = str(tmp_path / "run")
    source = open_source([str(saved)], FIELDS, run_dir)
    order = np.arange(source.num_rows)
    assert source.num_rows == len(expected)
    assert source.read(order) == [(r["question"], r["answer"], i) for i, r in enumerate(expected)]
    chat = open_source([str(saved)], ChatMessages(["messages"], None, None), run_dir)
    assert [messages for messages, _, _ in chat.read(order)] == [r["messages"] for r in expected]

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[:2])}
                         ).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(DataError, match=f"a DatasetDict .*: {tmp_path / 'splits' / 'test'}, "
                                        f"{tmp_path / 'splits' / 'train'}"):
        open_source([str(tmp_path / "splits")], FIELDS, run_dir)
    (saved / "state.json").write_text("{")  # damaged: named, with the fix, not a traceback
    with pytest.raises(DataError, match=f"{saved}: datasets' load_from_disk cannot read it .*save the dataset again"):
        open_source([str(saved)], FIELDS, run_dir)


def test_csv_and_tsv_files_read_as_the_rows_written(tmp_path):
    """Rows written by Python's csv module (commas, quotes, line breaks, digits, non-ASCII text in the
    cells; a conversation as its JSON text) read back as written: every cell as text, a
    conversation's as its messages; the same rows tab-separated (.tsv). A file of a header alone
    is named."""
    import csv

    messages = [{"role": "user", "content": "2+2, please"}, {"role": "assistant", "content": "4"}]
    rows = [{"question": 'He said "hi", then left.\nWhy?', "answer": "42", "messages": json.dumps(messages)},
            {"question": "Ça coûte 3,50 €", "answer": "line one\nline two", "messages": json.dumps(messages[::-1])}]
    run_dir = str(tmp_path / "run")
    for name, delimiter in (("rows.csv", ","), ("rows.tsv", "\t")):
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
        source = open_source([str(tmp_path / name)], FIELDS, run_dir)
        assert source.read(np.arange(2)) == [(r["question"], r["answer"], i) for i, r in enumerate(rows)], name
        chat = open_source([str(tmp_path / name)], ChatMessages(["messages"], None, None), run_dir)
        assert [m for m, _, _ in chat.read(np.arange(2))] == [messages, messages[::-1]], name
    (tmp_path / "header.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match="header.csv: the file has no rows"):
        open_source([str(tmp_path / "header.csv")], FIELDS, run_dir)


def test_compressed_text_files_read_as_their_rows(tmp_path):
    """JSON Lines in gzip, a JSON list in bz2, CSV in zstd (written here by Python's gzip and bz2 and by
    pyarrow's zstd stream) and a folder holding a .jsonl.gz read as the rows written; a bad line inside
    is named with its line; a file cut short, or not compressed as its name says, is named."""
    import bz2
    import csv
    import gzip
    import io

    rows = GSM8K[:30]
    want = [(r["question"], r["answer"]) for r in rows]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "b.json.bz2").write_bytes(bz2.compress(json.dumps(rows, indent=1).encode()))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=["question", "answer"])
    writer.writeheader()
    writer.writerows({"question": q, "answer": a} for q, a in want)
    with pa.output_stream(str(tmp_path / "c.csv.zst"), compression="detect") as f:
        f.write(text.getvalue().encode())
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "part.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    run_dir = str(tmp_path / "run")
    for name in ("a.jsonl.gz", "b.json.bz2", "c.csv.zst", "folder"):
        assert [(p, r) for p, r, _ in read_all(open_source([str(tmp_path / name)], FIELDS, run_dir))] == want, name

    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress((lines + "{not json\n").encode()))
    with pytest.raises(DataError, match=f"bad.jsonl.gz line {len(rows) + 1}: not valid JSON"):
        open_source([str(tmp_path / "bad.jsonl.gz")], FIELDS, run_dir)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines.encode())[:200])
    (tmp_path / "plain.jsonl.gz").write_text(lines)
    for name in ("cut.jsonl.gz", "plain.jsonl.gz"):
        with pytest.raises(DataError, match=f"{name}: cannot be decompressed"):
            open_source([str(tmp_path / name)], FIELDS, run_dir)
    assert not list((tmp_path / "run" / CONVERTED_DIR).glob("*.tmp"))  # no partial conversion left


def test_prompt_columns_are_joined_where_they_hold_text(tmp_path):
    """data.prompt_key=[instruction,input]: the input follows the instruction a line apart; an input that
    is empty, null or absent adds nothing; one that is not text is named with its line."""
    path = tmp_path / "alpaca.jsonl"
    path.write_text('{"instruction": "Add.", "input": "5, 8", "output": "13"}\n{"instruction": "Hi.", "input": "", '
                    '"output": "a"}\n{"instruction": "Hi.", "input": null, "output": "b"}\n{"instruction": "Hi.", '
                    '"output": "c"}\n{"instruction": "Add.", "input": [5, 8], "output": "13"}\n')
    source = open_source([str(path)], PromptResponse(["instruction"], ["output"], ["input"]), str(tmp_path / "run"))
    assert [(p, r) for p, r, _ in source.read(np.arange(4))] == [("Add.\n5, 8", "13"), ("Hi.", "a"), ("Hi.", "b"),
                                                                 ("Hi.", "c")]
    with pytest.raises(DataError, match=rf"{path} line 5: input is list, expected a string"):
        source.read(np.array([4]))


def test_alpaca_input_is_joined_to_the_instruction_or_warned_about(tmp_path):
    """An Alpaca-shaped JSON list (instruction, input, output; input empty in most rows, as in Alpaca)
    on stories260K. With data.prompt_key=instruction the input is not read: a warning counts the rows
    whose input holds text. With data.prompt_key=[instruction,input] each step's token counts are those
    of the instruction and the non-empty input joined by a line break, counted here straight from the
    tokenizer (BOS + prompt, then response + EOS)."""
    from transformers import AutoTokenizer

    from tests.conftest import BASE_OVERRIDES, STORIES

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    short = [r for r in GSM8K if len(tokenizer(f"Solve.\n{r['question']} {r['answer']}")["input_ids"]) < 500][:16]
    rows = [{"instruction": "Solve.", "input": r["question"], "output": r["answer"]} if i % 3 == 0
            else {"instruction": r["question"], "input": "", "output": r["answer"]} for i, r in enumerate(short)]
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(rows, indent=4))
    job = [*BASE_OVERRIDES, f"data.train_files={path}", "data.response_key=output", "data.max_length=512",
           "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=4"]
    out = run_sfttrain(1, [*job, "data.prompt_key=instruction", f"trainer.default_local_dir={tmp_path / 'a'}",
                           "trainer.total_training_steps=1"]).stdout
    assert "WARNING: text the run does not read, beside the prompt: column input in 6 of 16 rows." in out, out[-3000:]
    assert "data.prompt_key=[instruction,input]" in out
    out = run_sfttrain(1, [*job, "data.prompt_key=[instruction,input]", f"trainer.default_local_dir={tmp_path / 'b'}"])
    assert "WARNING: text the run does not read" not in out.stdout
    prompts = [len(tokenizer("\n".join(filter(None, (r["instruction"], r["input"]))))["input_ids"]) for r in rows]
    answers = [len(tokenizer(r["output"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    assert len(rows) == 16 and max(p + a for p, a in zip(prompts, answers)) <= 512  # none truncated
    logged = [m for m in read_metrics(tmp_path / "b") if "loss" in m]
    assert [(m["tokens"], m["loss_tokens"]) for m in logged] == \
        [(sum(prompts[i:i + 4]) + sum(answers[i:i + 4]), sum(answers[i:i + 4])) for i in range(0, 16, 4)]
