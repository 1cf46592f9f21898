"""What a resume does with a changed config: the optimizer and LR schedule follow the new config
(each difference printed), a schedule that ends before the checkpoint is refused, and a data
change is refused unless overridden. Real jobs (conftest.launch) on stories260K; the LR is checked against
the cosine written out here."""

from __future__ import annotations

import json
import math
import re
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sfttrain import checkpoint, resume
from sfttrain.config import ConfigError, load_config
from tests.conftest import (BASE_OVERRIDES, ForkedJob, descendants, job_processes, kill_job, launch,
                            logged_steps, read_metrics, run_sfttrain)

SAVED_STEP = 3


@pytest.fixture(scope="module")
def data(gsm8k_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume_rules") / "train.parquet"
    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 52), out, row_group_size=16)
    return out


def job(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*BASE_OVERRIDES, f"data.train_files={data}", f"trainer.default_local_dir={run_dir}",
            "data.shuffle=true", "data.max_length=128", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
            "optim.lr_scheduler=cosine", "optim.lr_warmup_steps_ratio=0.2", "optim.min_lr_ratio=0.1", *extra]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory) -> Path:
    """A run folder whose last checkpoint is step 3 of a 3-step schedule."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run_sfttrain(1, job(data, run_dir, f"trainer.total_training_steps={SAVED_STEP}"))
    return run_dir


def copy_of(saved: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    return run_dir


def test_raised_total_steps_follow_the_new_schedule(data, saved, tmp_path):
    """The first resumed step runs at the new schedule's LR for step 3 (the old restore gave the
    old schedule's last LR, and the next step jumped), and the start-up lines say what changed.
    The row scan is not repeated: the lengths come from the run folder's cache."""
    run_dir = copy_of(saved, tmp_path)
    out = run_sfttrain(1, job(data, run_dir, "trainer.total_training_steps=8", "optim.lr=2e-3")).stdout
    assert "optim.lr: 0.001 -> 0.002" in out and "total steps: 3 -> 8" in out
    warmup, total = int(0.2 * 8), 8
    lrs = {m["step"]: m["lr"] for m in read_metrics(run_dir) if "lr" in m}
    for step in range(SAVED_STEP, total):  # lr of 0-based step s is logged as step s + 1
        progress = (step - warmup) / (total - warmup)
        assert lrs[step + 1] == pytest.approx(2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert sorted(lrs) == list(range(1, total + 1))
    first = json.loads((saved / "data_report.json").read_text())
    again = json.loads((run_dir / "data_report.json").read_text())
    assert first["rows_rendered_at_startup"] == 52 and again["rows_rendered_at_startup"] == 0
    same = ("rows_rendered_at_startup", "length_cache")  # the copy's cache is in the copied folder
    assert {k: v for k, v in again.items() if k not in same} == {k: v for k, v in first.items() if k not in same}
    assert again["length_cache"].startswith(str(run_dir))
    state = json.loads((run_dir / "global_step_8" / "trainer_state.json").read_text())
    assert state["schedule"]["optim.lr"] == 2e-3 and state["schedule"]["total steps"] == 8


def test_lowered_total_steps_refused(data, saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    out = run_sfttrain(1, job(data, run_dir, "trainer.total_training_steps=2"), check=False)
    assert out.returncode != 0
    assert "is at step 3, but this run's schedule ends at step 2" in out.stdout
    assert "trainer.total_training_steps above 3" in out.stdout and "trainer.resume_mode=disable" in out.stdout


def test_finished_run_started_again_trains_nothing_and_says_so(data, saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    out = run_sfttrain(1, job(data, run_dir, f"trainer.total_training_steps={SAVED_STEP}")).stdout
    assert "nothing left to train" in out


def test_a_resume_path_passed_over_by_auto_is_said(data, saved, tmp_path, capsys):
    """resume_mode=auto with trainer.resume_from_path naming another checkpoint, in a run folder with checkpoints
    of its own: the run folder's latest is resumed (the rule that lets a seeded run restart where it was), and the
    resume line says so, naming the path passed over and how to resume from it; the preflight's line too."""
    from sfttrain import plan

    run_dir = copy_of(saved, tmp_path)
    seed = tmp_path / "seed" / f"global_step_{SAVED_STEP}"
    shutil.copytree(saved / f"global_step_{SAVED_STEP}", seed)
    command = job(data, run_dir, f"trainer.total_training_steps={SAVED_STEP}", f"trainer.resume_from_path={seed}")
    passed_over = (f"; the run folder's latest checkpoint, not trainer.resume_from_path={seed}: "
                   "resume_mode=auto resumes the run folder's own checkpoints first (a restart continues its "
                   "progress) and starts from the path only where the run folder has none; "
                   "trainer.resume_mode=resume_path resumes from the path\n")
    out = run_sfttrain(1, command).stdout
    assert f"  resume              : {run_dir / f'global_step_{SAVED_STEP}'} (step {SAVED_STEP}, run id " in out, out
    assert passed_over in out, out
    assert plan.main([*command, "--nproc", "1"]) == 0
    assert (f"  resume              : from {run_dir / f'global_step_{SAVED_STEP}'} (step {SAVED_STEP}, "
            f"0 of {SAVED_STEP} steps left){passed_over}") in capsys.readouterr().out


def test_a_later_checkpoint_without_its_marker_is_said(data, saved, tmp_path, capsys):
    """global_step_6 as an rsync cut short leaves it (step 3's files, some cut short, no COMPLETE): auto still
    resumes step 3, the last committed one, and start-up and the preflight say why step 6 was passed over,
    leaving it where it is. Alone in the run folder it is a fresh start, said the same way."""
    from sfttrain import plan

    run_dir = copy_of(saved, tmp_path)
    unfinished = run_dir / "global_step_6"
    shutil.copytree(run_dir / f"global_step_{SAVED_STEP}", unfinished)
    (unfinished / "COMPLETE").unlink()
    shard = next(unfinished.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    command = job(data, run_dir, f"trainer.total_training_steps={SAVED_STEP}")
    note = ("    global_step_6 has no COMPLETE marker (a save or copy that did not finish): {}. To resume from it, "
            "finish copying it and start again; else delete it (a save of step 6 would replace it)\n")
    out = run_sfttrain(1, command).stdout
    assert f"  resume              : {run_dir / f'global_step_{SAVED_STEP}'} (step {SAVED_STEP}, run id " in out, out
    assert note.format(f"resuming from global_step_{SAVED_STEP}") in out, out
    assert unfinished.is_dir() and len(shard.read_bytes()) == 100
    assert plan.main([*command, "--nproc", "1"]) == 0
    assert note.format(f"resuming from global_step_{SAVED_STEP}") in capsys.readouterr().out
    shutil.rmtree(run_dir / f"global_step_{SAVED_STEP}")
    assert plan.main([*command, "--nproc", "1"]) == 0
    assert f"  resume              : fresh start\n{note.format('starting afresh')}" in capsys.readouterr().out


def test_changed_data_refused_then_allowed(data, saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    changed = job(data, run_dir, "trainer.total_training_steps=5", "data.max_length=100", "data.shuffle=false")
    out = run_sfttrain(1, changed, check=False)
    assert out.returncode != 0
    assert "data.max_length: 128 -> 100" in out.stdout and "data.shuffle: True -> False" in out.stdout
    assert "trainer.resume_allow_data_change=true" in out.stdout
    out = run_sfttrain(1, [*changed, "trainer.resume_allow_data_change=true"]).stdout
    assert "allowed by trainer.resume_allow_data_change" in out
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2, 3, 4, 5]


def test_data_rewritten_at_the_same_size_is_refused(gsm8k_dir, tmp_path):
    """A JSON Lines file rewritten between runs with the same bytes, rows and name but other rows (each
    digit shifted by one: other answers): a resume would train on them from the old position; the
    rows' tokens are part of the data fingerprint, so it is refused naming them."""
    data = tmp_path / "train.jsonl"
    rows = pq.read_table(gsm8k_dir / "train.parquet").slice(0, 16).to_pylist()
    data.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    keys = [*BASE_OVERRIDES, f"data.train_files={data}", f"trainer.default_local_dir={run_dir}", "data.max_length=128",
            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.prompt_key=question",
            "data.response_key=answer"]
    run_sfttrain(1, [*keys, "trainer.total_training_steps=1"])
    text = data.read_text()
    data.write_text(text.translate(str.maketrans("0123456789", "1234567890")))
    assert data.stat().st_size == len(text.encode())
    out = run_sfttrain(1, [*keys, "trainer.total_training_steps=2"], check=False)
    assert out.returncode == 2, out.stdout[-3000:]
    assert re.search(r"the rows' tokens \(sha256; data files rewritten with other rows\): [0-9a-f]{64} -> [0-9a-f]{64}",
                     out.stdout), out.stdout[-3000:]
    assert "data.train_files" not in out.stdout.split("other data settings")[1].split("\nUse")[0]


def test_checkpoint_of_an_older_sfttrain(tmp_path):
    """No fingerprint nor schedule recorded: resumed with a note; the batch size and seed, which
    it does record, are still checked."""
    cfg = load_config(overrides=["data.train_files=x.parquet", "model.partial_pretrain=m"])
    ckpt = tmp_path / "global_step_4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "global_batch": 256, "seed": 1}))
    current = checkpoint.TrainState(data={"data.train_batch_size": 256, "trainer.seed": 1, "data.max_length": 9},
                                    schedule={"optim.lr": 1e-5, "total steps": 10})
    notes = resume.check_resume(str(ckpt), cfg, current)
    assert any("records no data fingerprint" in n for n in notes)
    assert any("records no optimizer settings" in n for n in notes)
    current.data["trainer.seed"] = 2
    with pytest.raises(ConfigError, match="trainer.seed: 1 -> 2"):
        resume.check_resume(str(ckpt), cfg, current)


def test_a_key_that_a_newer_sfttrain_records_is_not_a_change_of_data(tmp_path):
    """A fingerprint section (data.multiturn) is compared key by key: a key the checkpoint's version did not
    have (system_key, added later) lets the resume through; a key both have, changed, is named alone."""
    cfg = load_config(overrides=["data.train_files=x.parquet", "model.partial_pretrain=m"])
    ckpt = tmp_path / "global_step_4"
    ckpt.mkdir()
    schedule = {"optim.lr": 1e-5, "total steps": 10}
    old = {"data.train_batch_size": 256, "trainer.seed": 1,
           "data.multiturn": {"enable": True, "messages_key": "messages"}}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "global_batch": 256, "seed": 1, "data": old,
                                                              "schedule": schedule}))
    new = {**old, "data.multiturn": {"enable": True, "messages_key": "messages", "system_key": "system"}}
    resume.check_resume(str(ckpt), cfg, checkpoint.TrainState(data=new, schedule=schedule))
    new["data.multiturn"]["messages_key"] = "conversations"
    with pytest.raises(ConfigError, match=r"data.multiturn.messages_key: messages -> conversations\n"):
        resume.check_resume(str(ckpt), cfg, checkpoint.TrainState(data=new, schedule=schedule))


def test_a_checkpoint_without_the_rows_hash_is_resumed_with_what_goes_unchecked(tmp_path):
    """A checkpoint of an sfttrain that did not hash the rows' tokens resumes (nothing it recorded
    changed), with a note that a same-size rewrite of the data cannot be seen, and what to do where
    it was."""
    from sfttrain.data.prepare import ROWS_KEY
    cfg = load_config(overrides=["data.train_files=x.parquet", "model.partial_pretrain=m"])
    ckpt = tmp_path / "global_step_4"
    ckpt.mkdir()
    schedule = {"optim.lr": 1e-5, "total steps": 10}
    old = {"data.train_batch_size": 256, "trainer.seed": 1}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "global_batch": 256, "seed": 1, "data": old,
                                                              "schedule": schedule}))
    notes = resume.check_resume(str(ckpt), cfg, checkpoint.TrainState(data={**old, ROWS_KEY: "0" * 64},
                                                                       schedule=schedule))
    unchecked = [n for n in notes if f"records no '{ROWS_KEY}'" in n]
    assert len(unchecked) == 1 and "rewritten with other rows of the same size" in unchecked[0], notes
    assert "trainer.resume_mode=disable" in unchecked[0]
    assert not [n for n in resume.check_resume(str(ckpt), cfg, checkpoint.TrainState(data=old, schedule=schedule))
                if "records no" in n]


def test_a_checkpoint_of_another_rendering_resumes_only_where_its_rows_tokens_are_the_same(tmp_path):
    """A checkpoint of an sfttrain that rendered rows otherwise (version 1 recorded no version): where
    it recorded its rows' tokens and they are the same, the resume goes on with a note; where they
    differ, or it recorded none, it is refused naming the version and what it changed."""
    from sfttrain.data.prepare import RENDERING_KEY, ROWS_KEY
    cfg = load_config(overrides=["data.train_files=x.parquet", "model.partial_pretrain=m"])
    ckpt = tmp_path / "global_step_4"
    ckpt.mkdir()
    schedule = {"optim.lr": 1e-5, "total steps": 10}
    old = {"data.train_batch_size": 256, "trainer.seed": 1}

    def resume_with(saved: dict, current: dict) -> list[str]:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "global_batch": 256, "seed": 1,
                                                                  "data": saved, "schedule": schedule}))
        return resume.check_resume(str(ckpt), cfg, checkpoint.TrainState(data=current, schedule=schedule))

    now = {**old, ROWS_KEY: "a" * 64, RENDERING_KEY: 2}
    notes = resume_with({**old, ROWS_KEY: "a" * 64}, now)
    assert f"data: {RENDERING_KEY}: 1 -> 2 (the rows' tokens are the same)" in notes, notes
    for saved in ({**old, ROWS_KEY: "b" * 64}, old):
        with pytest.raises(ConfigError, match=re.escape(f"{RENDERING_KEY}: 1 -> 2") +
                           r"[\s\S]*rendered rows otherwise; "
                           r"since version 2, an answer is written as the chat template writes it"):
            resume_with(saved, now)


def _rank_0(proc) -> int:
    """The first rank the rank server forked, or torchrun's child whose environment says RANK=0."""
    if isinstance(proc, ForkedJob):
        return proc.ranks()[0]
    for pid in descendants(proc.pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if b"\0RANK=0\0" in b"\0" + f.read():
                return pid
    raise AssertionError("no rank 0")


def _holds(pid: int, path: Path) -> bool:
    """Whether the process has `path` open."""
    fds = f"/proc/{pid}/fd"
    return any(os.readlink(f"{fds}/{fd}") == str(path) for fd in os.listdir(fds))


def test_a_second_run_in_a_busy_run_folder_is_refused(data, tmp_path, capsys):
    """Run A (2 ranks, a DataLoader worker each) trains in a folder. Once it has logged a step, its rank
    0 and that rank's worker are asked for their stacks (SIGUSR1): each prints its threads' Python stacks
    to the log and trains on. Then every process of it is frozen (SIGSTOP: it holds the folder as a
    running job does). The same command
    again, run B, ends every rank with one message naming A's rank 0 (host, pid) and exit code 2, and the
    preflight lists it. Rank 0 alone holds the lock's file open (its DataLoader worker, forked after the
    lock was taken, closed its copy: an orphaned worker cannot keep the folder locked). Killed, A
    leaves nothing to clean up: B's command trains in the folder."""
    from sfttrain import plan
    from sfttrain.resume import LOCK_FILE, check_not_in_use
    from sfttrain.runtime import STACKS_HEADER
    from tests.test_checkpoint import one_message, wait_until

    run_dir = tmp_path / "run"
    command = job(data, run_dir, "trainer.total_training_steps=300", "data.num_workers=1")
    a = launch(2, command, tmp_path / "a.log")
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 1, a), (tmp_path / "a.log").read_text()[-3000:]
        rank_0 = _rank_0(a)
        (worker,) = descendants(rank_0)
        log = lambda: (tmp_path / "a.log").read_text()  # noqa: E731
        # each one's stacks (faulthandler's: a header per thread), one process at a time
        for pid in (rank_0, worker):
            seen = log().count(STACKS_HEADER)
            os.kill(pid, signal.SIGUSR1)
            assert wait_until(lambda: log().count(STACKS_HEADER) > seen, a), log()[-3000:]
        steps = logged_steps(run_dir)
        assert wait_until(lambda: logged_steps(run_dir) > steps, a), log()[-3000:]  # training went on
        for pid in job_processes(a):
            os.kill(pid, signal.SIGSTOP)
        assert _holds(rank_0, run_dir / LOCK_FILE) and not _holds(worker, run_dir / LOCK_FILE)

        message = one_message(run_sfttrain(2, command, check=False), 2)
        assert (f"trainer.default_local_dir={run_dir} is in use by another sfttrain run (rank 0 on "
                f"{socket.gethostname()}, pid {rank_0}, since ") in message, message
        assert plan.main([*command, "--nproc", "2"]) == 2
        assert message.removeprefix("sfttrain: config error: ") in capsys.readouterr().out
    finally:
        kill_job(a)
    # A's rank 0 dead and reaped: every thread of it has exited and dropped the process's descriptors (its
    # group leader shows as a zombie, which kill_job waits for, while its other threads may still be exiting)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{rank_0}") and time.monotonic() < deadline:
        time.sleep(0.01)
    check_not_in_use(str(run_dir))
    run_sfttrain(2, [*command, "trainer.total_training_steps=3"])
    assert logged_steps(run_dir) == 3


def test_a_filesystem_without_locks_is_said_at_start_up(tmp_path, monkeypatch):
    """Where flock(2) fails as on a filesystem without locks (Lustre mounted without `flock`: ENOLCK or
    ENOSYS), the run goes on with a warning that a second run would not be caught; the preflight passes."""
    import errno
    import fcntl

    from sfttrain.resume import check_not_in_use, lock_run_folder

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    (warning,) = lock_run_folder(str(tmp_path), {})
    assert warning.startswith("  WARNING: the run folder's filesystem has no file locks (No locks available)")
    check_not_in_use(str(tmp_path))
