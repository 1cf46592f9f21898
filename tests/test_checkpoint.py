"""Checkpoints: atomic commit, retention, exact / elastic resume, and SIGKILL fault tolerance.

Every run is a real job (gloo ranks, conftest.launch) on the real stories260K model, fp32 on CPU, with a
real schedule (cosine with warmup, weight decay, shuffled data). The job trains 2 epochs of a
52-row set with a global batch of 8: 6 steps per epoch (4 rows left over each epoch), 12 steps.

One uninterrupted reference run (2 ranks, a checkpoint after every step, none deleted) gives the
per-step losses and the weights/optimizer state at every step; every other run is compared with
it. Same world size: losses and weights equal to 1e-6 (in practice bit for bit: the resumed run
does the same float operations in the same order). Other world size: the step's gradient is summed
in another order (other rank / micro-batch split), so results agree to float32 rounding only; the
job's AdamW is made linear in the gradient (tests/conftest.py LINEAR_ADAM) so that rounding is not
amplified into full-size steps: losses rel 1e-5, and the update since the resume point within 1e-4
of the reference's update, the bars of the trainer's own rank-invariance test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

from sfttrain import checkpoint, checkpoint_folder, resume
from sfttrain.config import ConfigError, TrainerConfig, load_config
from sfttrain.metrics import REWOUND
from tests.conftest import (BASE_OVERRIDES, LINEAR_ADAM, REPO, STORIES, ForkedJob, ForkServer, alive, descendants,
                            forks, kill_job, launch, logged_steps, rank_env, read_metrics, run_sfttrain,
                            running_records, two_rank_job, update_error)

ROWS, BATCH, EPOCHS = 52, 8, 2
STEPS_PER_EPOCH = ROWS // BATCH  # 6
TOTAL = STEPS_PER_EPOCH * EPOCHS  # 12
SAME_WORLD_TOL = 1e-6
ELASTIC_TOL = 1e-5  # losses
ELASTIC_UPDATE_TOL = 1e-4
MANY_IN_FLIGHT = 10**9  # host copies of the tiny model's shards (~1.5 MB each): more than any host's memory holds


@pytest.fixture(scope="module")
def data(gsm8k_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small") / "train.parquet"
    table = pq.read_table(gsm8k_dir / "train.parquet").slice(0, ROWS)
    pq.write_table(table, out, row_group_size=16)  # several row groups: the shuffle crosses them
    return out


def job(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*BASE_OVERRIDES, *LINEAR_ADAM, f"data.train_files={data}", f"trainer.default_local_dir={run_dir}",
            "data.shuffle=true", "data.max_length=128", f"data.train_batch_size={BATCH}",
            "data.micro_batch_size_per_gpu=2", f"trainer.total_epochs={EPOCHS}",
            "optim.lr_scheduler=cosine", "optim.lr_warmup_steps_ratio=0.2", "optim.min_lr_ratio=0.1",
            "optim.weight_decay=0.01", *extra]


@pytest.fixture(scope="module")
def ref(data, tmp_path_factory) -> Path:
    """The uninterrupted run: a checkpoint after every step, all kept; wandb (offline) on. Up to
    10^9 saves may be in flight, more host copies of the shards than the host holds (its log
    is kept beside the run folder as ref.log). The background saves are written by each rank's
    writer process (sfttrain.checkpoint_writer; the default on CUDA), from shared memory: the tests
    that compare its checkpoints with other runs' (synchronous saves, other rank counts) check them."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = run_sfttrain(2, job(data, run_dir, "trainer.save_freq=1", "trainer.logger=[console,wandb]",
                               f"trainer.async_save_in_flight={MANY_IN_FLIGHT}", "trainer.async_save_writer=process"))
    (run_dir.parent / "ref.log").write_text(proc.stdout)
    assert [s for s, _ in checkpoint_folder.complete_checkpoints(str(run_dir))] == list(range(1, TOTAL + 1))
    return run_dir


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """step -> loss of the run's metrics.jsonl; each step must be logged once."""
    records = [m for m in read_metrics(run_dir) if "loss" in m]
    steps = [m["step"] for m in records]
    assert len(steps) == len(set(steps)), f"a step logged twice in {run_dir}: {steps}"
    return {m["step"]: m["loss"] for m in records}


_CACHE: dict[str, dict] = {}


def state(ckpt: Path) -> dict:
    """The whole DCP checkpoint (model and optimizer) as plain tensors, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    key = str(ckpt.resolve())
    if key not in _CACHE:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"sfttrain-test-{os.getpid()}-{len(_CACHE)}.pt"
        dcp_to_torch_save(str(ckpt), str(out))
        _CACHE[key] = torch.load(out, weights_only=False)
        out.unlink()
    return _CACHE[key]


def tensors(sd: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + str(k)] = v
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    a, b = tensors(a), tensors(b)
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest per-tensor ||a - b|| / ||b|| (tests/test_lora.py compares adapters with it)."""
    a, b = tensors(a), tensors(b)
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12)).item()
               for k in a)


def assert_resumed_like_ref(run_dir: Path, ref: Path, first_step: int, tol: float, rel: bool = False) -> None:
    """Steps first_step..TOTAL logged by the resumed run equal the reference's, and so do the
    final weights."""
    got, want = losses_by_step(run_dir), losses_by_step(ref)
    got = {step: loss for step, loss in got.items() if step >= first_step}
    assert sorted(got) == list(range(first_step, TOTAL + 1)), sorted(got)
    for step in got:
        if rel:
            assert got[step] == pytest.approx(want[step], rel=tol), step
        else:
            assert abs(got[step] - want[step]) <= tol, (step, got[step], want[step])
    final, expected = state(run_dir / f"global_step_{TOTAL}")["model"], state(ref / f"global_step_{TOTAL}")["model"]
    start = state(ref / f"global_step_{first_step - 1}")["model"]
    if rel:  # update_error also checks that the weights moved since the resume point
        assert update_error(tensors(final), tensors(expected), tensors(start)) <= ELASTIC_UPDATE_TOL
    else:
        assert max_abs_diff(final, expected) <= tol
        assert max_abs_diff(start, expected) > 1e-3  # a comparison that cannot fail is no test


def trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


# --------------------------------------------------------------------------- exact resume, same world size

@pytest.fixture(scope="module")
def resumed_mid_epoch(data, ref, tmp_path_factory) -> Path:
    """A run folder as a crash leaves it: checkpoints 1..4 (from an earlier attempt of the same
    job), metrics logged up to step 5, and a half-written save of step 5. Step 4 is as a crash in
    the middle of replacing it by a new save of step 4 leaves it: the committed one set aside
    (`.global_step_4.old`), the new one complete in its `.tmp` but not renamed in. Then `auto`
    resume with max_ckpt_to_keep=2: step 4 is put back and resumed from."""
    run_dir = tmp_path_factory.mktemp("mid") / "run"
    run_dir.mkdir()
    for step in range(1, 4):
        shutil.copytree(ref / f"global_step_{step}", run_dir / f"global_step_{step}")
    shutil.copytree(ref / "global_step_4", run_dir / ".global_step_4.old")
    shutil.copytree(ref / "global_step_4", run_dir / ".global_step_4.tmp")
    partial = run_dir / ".global_step_5.tmp"
    shutil.copytree(ref / "global_step_5", partial)
    (partial / checkpoint_folder.COMPLETE).unlink()
    lines = (ref / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] <= 5]
    (run_dir / "metrics.jsonl").write_text("".join(kept) + '{"step": 6, "lo')  # a torn last line
    damage_the_run_files(ref, run_dir)
    proc = run_sfttrain(2, job(data, run_dir, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
                               "trainer.logger=[console,wandb]"))
    assert f"put back {run_dir / 'global_step_4'}" in proc.stdout
    (run_dir.parent / "resume.log").write_text(proc.stdout)
    return run_dir


def damage_the_run_files(ref: Path, run_dir: Path) -> None:
    """The rest of what a crash of the machine (a power loss) leaves of the files the run wrote unsynced: the
    length cache's name with its bytes lost (0 bytes), config.yaml lost, data_report.json cut mid-line, a
    temporary file of an atomic write that never reached its rename, and of the caches' writes (the
    length cache's, a data file's conversion). The
    plot of the torn metrics.jsonl is drawn first (its stderr kept beside the run folder)."""
    from sfttrain import plot

    shutil.copytree(ref / "row_stats", run_dir / "row_stats")
    for cache in (run_dir / "row_stats").iterdir():
        cache.write_bytes(b"")
        (run_dir / "row_stats" / f"{cache.name}.99999.tmp.npz").write_bytes(b"PK")  # the cache's next write, cut short
    (run_dir / "data_cache").mkdir()
    (run_dir / "data_cache" / "rows.0123456789abcdef.parquet.99999.tmp").write_bytes(b"PAR1")  # a conversion's
    report = (ref / "data_report.json").read_text()
    (run_dir / "data_report.json").write_text(report[:len(report) // 2])
    (run_dir / "config.yaml").write_text("")
    (run_dir / "config.yaml.99999.tmp").write_text("trainer:\n")  # write_atomically's file, cut mid-write
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert plot.main([str(run_dir), "--out", str(run_dir.parent / "before.png")]) == 0
    (run_dir.parent / "plot.log").write_text(err.getvalue())


def test_a_crash_s_damage_to_the_run_folder_s_own_files(resumed_mid_epoch, ref):
    """What the crash of `resumed_mid_epoch` left of the run folder's files besides its checkpoints
    (damage_the_run_files): the plot leaves the torn metrics.jsonl line out and says so (it stopped on a
    JSONDecodeError); the resume says that it moved the line aside (it did so without a word) and rebuilds
    the rest: the length cache rendered anew and read back, config.yaml and data_report.json whole, the
    temporary files removed."""
    import numpy as np
    from omegaconf import OmegaConf

    from sfttrain import plot
    from sfttrain.data.loader import STATS

    run_dir = resumed_mid_epoch
    plotted = (run_dir.parent / "plot.log").read_text()
    assert re.fullmatch(rf"sfttrain plot: {run_dir}/metrics.jsonl: line\(s\) \d+ do not read as a JSON record \(cut "
                        r"short by a crash or a full disk while the run wrote them\): left out of the curves\. .*\n",
                        plotted), plotted
    out = (run_dir.parent / "resume.log").read_text()
    assert (f"{run_dir}/metrics.jsonl: 1 line(s) cut short (a crash or a full disk while the run wrote them) moved "
            f"to {REWOUND}") in out, out[-3000:]
    [cache] = (run_dir / "row_stats").iterdir()
    assert f"the length cache {cache} does not read back (EOFError" in out, out[-3000:]
    with np.load(cache) as read:
        assert set(read.files) == set(STATS)
    assert OmegaConf.load(run_dir / "config.yaml").trainer.default_local_dir == str(run_dir)
    assert not (run_dir / "config.yaml.99999.tmp").exists() and not list((run_dir / "data_cache").iterdir())
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report == {**json.loads((ref / "data_report.json").read_text()), "length_cache": str(cache)}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert plot.main([str(run_dir), "--out", str(run_dir.parent / "after.png")]) == 0
    assert err.getvalue() == ""


def test_exact_resume_mid_epoch(resumed_mid_epoch, ref):
    run_dir = resumed_mid_epoch
    assert trainer_state(ref / "global_step_4")["consumed_in_epoch"] == 4 * BATCH  # mid-epoch
    resumed = [m for m in read_metrics(run_dir) if m.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 4 and resumed[0]["from"].endswith("global_step_4")
    # metrics.jsonl reads as one history: 1..4 from before the crash, 5..12 from the resumed run
    # (the crashed attempt's step-5 record and the torn line moved to metrics_rewound.jsonl)
    got = losses_by_step(run_dir)
    assert sorted(got) == list(range(1, TOTAL + 1))
    rewound = (run_dir / REWOUND).read_text().splitlines()
    assert [json.loads(line)["step"] for line in rewound[:-1]] == [5, 5]  # its loss and its checkpoint's record
    assert rewound[-1] == '{"step": 6, "lo'
    assert_resumed_like_ref(run_dir, ref, 5, SAME_WORLD_TOL)
    # the optimizer state too, and the wandb run continues under the same id
    assert max_abs_diff(state(run_dir / f"global_step_{TOTAL}")["optim"],
                        state(ref / f"global_step_{TOTAL}")["optim"]) <= SAME_WORLD_TOL
    wandb_id = trainer_state(ref / "global_step_4")["wandb_id"]
    assert wandb_id and trainer_state(run_dir / f"global_step_{TOTAL}")["wandb_id"] == wandb_id


def test_a_metrics_file_a_crash_lost_is_said_by_the_resume_and_the_plot(tmp_path, caplog):
    """metrics.jsonl lost in a crash (missing, or its name kept and its bytes lost: 0 bytes) under a checkpoint
    of step 4 of this run folder: the resume says the records of steps 1-4 are gone (its curves were drawn from
    step 5 without a word), not for a checkpoint of another folder's; the plot of the empty file is one line,
    not an empty figure."""
    from sfttrain import plot
    from sfttrain.errors import DataError
    from sfttrain.metrics import rewind_metrics

    resumed = {"step": 4, "event": "resumed"}
    rewind_metrics(str(tmp_path), 4, resumed, own=True)
    (tmp_path / "metrics.jsonl").write_text("")
    rewind_metrics(str(tmp_path), 4, resumed, own=True)
    rewind_metrics(str(tmp_path), 4, resumed, own=False)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{tmp_path}/metrics.jsonl {gone} (lost in a crash before it reached the disk, or deleted): the "
                    "records of steps 1-4 are gone, and its curves (python -m sfttrain.plot) start at step 5, where "
                    "this run resumes" for gone in ("is missing", "is empty")], said
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/metrics.jsonl holds no step's record (0 bytes)")):
        plot.read_series(str(tmp_path / "metrics.jsonl"))


def test_retention_across_resumes(resumed_mid_epoch):
    """max_ckpt_to_keep counts what is on disk, including checkpoints this process never wrote;
    the half-written save was cleaned up, never resumed from."""
    run_dir = resumed_mid_epoch
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".global_step", "global_step"))) == \
        [f"global_step_{TOTAL - 1}", f"global_step_{TOTAL}"]
    for step in (TOTAL - 1, TOTAL):
        assert checkpoint_folder.is_complete(str(run_dir / f"global_step_{step}"))


def test_max_ckpt_to_keep_0_keeps_every_checkpoint_and_says_so(data, tmp_path, capsys):
    """trainer.max_ckpt_to_keep=0 reads like "keep none" and keeps every checkpoint, as in verl (and as null
    does): the run keeps its 3 and says so at start-up, as the preflight does; a negative count is refused."""
    from sfttrain import plan

    run_dir = tmp_path / "run"
    command = job(data, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=0")
    line = ("  checkpoints kept    : every one (trainer.max_ckpt_to_keep=0 means what null does, as in verl; N > 0 "
            "keeps this run's newest N)\n")
    out = run_sfttrain(1, command).stdout
    assert line in out, out
    assert [step for step, _ in checkpoint_folder.complete_checkpoints(str(run_dir))] == [1, 2, 3]
    assert plan.main([*command, "--nproc", "1"]) == 0
    assert line in capsys.readouterr().out
    assert plan.main([*command, "trainer.max_ckpt_to_keep=-1", "--nproc", "1"]) == 2
    assert ("trainer.max_ckpt_to_keep=-1: set N > 0 to keep this run's newest N checkpoints, or null (the default; "
            "0 is the same, as in verl) to keep every one") in capsys.readouterr().out.split("problems:")[1]


def test_exact_resume_at_epoch_boundary(data, ref, tmp_path):
    """resume_mode=resume_path from the last step of epoch 0 (into another run folder): the
    resumed run starts epoch 1 (its own shuffled order), nothing replayed or skipped. It saves
    synchronously (trainer.async_save=false): its step-9 checkpoint equals, bit for bit, the
    reference's, which was written in the background while step 10 updated the weights in place
    (so the background write saved a copy taken at step 9, not the live tensors)."""
    boundary = ref / f"global_step_{STEPS_PER_EPOCH}"
    st = trainer_state(boundary)
    assert (st["epoch"], st["consumed_in_epoch"]) == (0, STEPS_PER_EPOCH * BATCH)
    run_dir = tmp_path / "run"
    run_sfttrain(2, job(data, run_dir, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={boundary}",
                        "trainer.async_save=false", "trainer.save_freq=3"))
    assert [m["epoch"] for m in read_metrics(run_dir) if "loss" in m] == [1] * STEPS_PER_EPOCH
    assert_resumed_like_ref(run_dir, ref, STEPS_PER_EPOCH + 1, SAME_WORLD_TOL)
    assert max_abs_diff(state(run_dir / "global_step_9"), state(ref / "global_step_9")) == 0
    assert [(m["step"], m["async"]) for m in read_metrics(run_dir) if m.get("event") == "checkpoint"] == \
        [(9, False), (12, False)]


def test_checkpoint_records(ref):
    """Every committed checkpoint has one record in metrics.jsonl, in step order (saves every step
    queue up to trainer.async_save_in_flight in the background and commit oldest first): its size on
    disk, the stall (and the part of it spent waiting for older saves' writes), the time until
    written, the write's own time (and the GB/s over it) and the time to commit. The periodic ones
    were written in the background; the final one was waited for (its stall is its whole save)."""
    records = [m for m in read_metrics(ref) if m.get("event") == "checkpoint"]
    assert [m["step"] for m in records] == list(range(1, TOTAL + 1))
    assert [m["async"] for m in records] == [True] * (TOTAL - 1) + [False]
    assert [m["staging"] for m in records] == ["host"] * (TOTAL - 1) + [None]  # auto on CPU: host memory
    for m in records:
        folder = Path(m["path"])
        assert m["bytes"] == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) > 0
        assert 0 < m["stall_s"] <= m["commit_s"] and 0 < m["written_s"] <= m["commit_s"]
        assert 0 <= m["waited_previous_s"] <= m["stall_s"]
        assert 0 < m["write_s"] <= m["written_s"]
        assert m["gb_per_s"] == pytest.approx(m["bytes"] / 1e9 / m["write_s"])
    assert records[-1]["stall_s"] == records[-1]["commit_s"] and records[-1]["awaited"]
    # the queue is cut to what host memory holds, at the first save, in one line
    (cap,) = re.findall(rf"trainer.async_save_in_flight={MANY_IN_FLIGHT}, but host memory holds (\d+): .*",
                        (ref.parent / "ref.log").read_text())
    assert 1 <= int(cap) < MANY_IN_FLIGHT


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device, staging", [("cpu", "device"), pytest.param("cuda", "host", marks=NEEDS_CUDA),
                                             pytest.param("cuda", "device", marks=NEEDS_CUDA)])
def test_each_background_save_holds_its_own_step(data, tmp_path, device, staging):
    """Background saves every step, written by the writer process, hold each its own step's
    weights, as the synchronous saves of the same run on the same device do. host: each save's copy
    goes to a host slot of its own (on CUDA pinned, shared with the writer process once, and read
    again at every later save in that slot). device: each save's copy is taken on the device and
    copied by the writer thread into one host slot that every save uses in turn (the reference's
    CPU runs check the host slots). On CPU the runs are the same computation: equal. GPU kernels
    may differ in the last bits between two runs (atomic adds): the bound is 1e-3 of the update
    between consecutive steps, and a stale or later copy would be off by a whole update."""
    env = {"CUDA_VISIBLE_DEVICES": "0"} if device == "cuda" else {}
    common = job(data, tmp_path / "unused", f"trainer.device={device}", "trainer.total_training_steps=5",
                 "trainer.save_freq=1", *(["model.fsdp_config.mixed_precision=true"] if device == "cuda" else []))
    proc = run_sfttrain(1, [*common, f"trainer.default_local_dir={tmp_path}/async", "trainer.async_save_pinned=true",
                            "trainer.async_save_writer=process", "trainer.async_save_in_flight=2",
                            f"trainer.async_save_staging={staging}"], env=env)
    where = f"on {device}" if staging == "device" else "in host memory"
    assert re.search(rf"background saves: each takes a copy .* {where}\b.*; 2 in flight at most", proc.stdout)
    run_sfttrain(1, [*common, f"trainer.default_local_dir={tmp_path}/sync", "trainer.async_save=false"], env=env)
    for step in range(2, 6):
        got, want = (state(tmp_path / run / f"global_step_{step}")["model"] for run in ("async", "sync"))
        before = state(tmp_path / "sync" / f"global_step_{step - 1}")["model"]
        assert update_error(got, want, before) <= (1e-3 if device == "cuda" else 0), step


# --------------------------------------------------------------------------- elastic resume

@pytest.fixture(scope="module")
def on_one_rank(data, ref, tmp_path_factory) -> Path:
    """Ref's step-3 checkpoint (2 ranks) resumed on 1 rank, saving every step."""
    run_dir = tmp_path_factory.mktemp("elastic1") / "run"
    run_sfttrain(1, job(data, run_dir, "trainer.save_freq=1", "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={ref / 'global_step_3'}"))
    return run_dir


def test_elastic_resume_2_to_1(on_one_rank, ref):
    assert trainer_state(ref / "global_step_3")["world_size"] == 2
    assert trainer_state(on_one_rank / "global_step_4")["world_size"] == 1
    assert_resumed_like_ref(on_one_rank, ref, 4, ELASTIC_TOL, rel=True)


def test_elastic_resume_1_to_2(data, on_one_rank, ref, tmp_path):
    """A checkpoint written by 1 rank (mid-epoch 1) resumed on 2."""
    src = on_one_rank / "global_step_8"
    assert trainer_state(src)["world_size"] == 1
    run_dir = tmp_path / "run"
    run_sfttrain(2, job(data, run_dir, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={src}"))
    assert_resumed_like_ref(run_dir, ref, 9, ELASTIC_TOL, rel=True)


def test_elastic_resume_2_to_4(data, ref, tmp_path):
    run_dir = tmp_path / "run"
    run_sfttrain(4, job(data, run_dir, "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={ref / 'global_step_5'}"))
    assert_resumed_like_ref(run_dir, ref, 6, ELASTIC_TOL, rel=True)


def test_resume_across_layouts(data, ref, tmp_path):
    """FSDP2 (ref) -> DDP (NO_SHARD) -> FSDP2 on 2 ranks: sharded and replicated parameters are
    written and read as the same DCP checkpoint. (DDP with compiled layers: tests/test_trainer.py.)"""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    proc = run_sfttrain(2, job(data, ddp, "model.fsdp_config.sharding_strategy=NO_SHARD", "trainer.save_freq=3",
                               "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ref / 'global_step_3'}"))
    assert "DDP: the whole model on each of 2 ranks" in proc.stdout
    assert_resumed_like_ref(ddp, ref, 4, ELASTIC_TOL, rel=True)
    run_sfttrain(2, job(data, fsdp, "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={ddp / 'global_step_6'}"))
    assert_resumed_like_ref(fsdp, ref, 7, ELASTIC_TOL, rel=True)


# --------------------------------------------------------------------------- SIGKILL at random moments

def step_time(run_dir: Path, step: int) -> float:
    return [m["step_time_s"] for m in running_records(run_dir) if m.get("step") == step and "step_time_s" in m][-1]


def wait_until(condition, proc: subprocess.Popen, timeout: float = 240) -> bool:
    """True once condition() holds; False if the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return condition()
        time.sleep(0.003)
    raise TimeoutError("the job made no progress")


def check_checkpoints(run_dir: Path, ref: Path, world_size: int) -> list[int]:
    """No complete-looking broken checkpoint: every visible global_step_N has its marker, all its
    files, loads in full (model and optimizer), and equals the reference's step-N checkpoint."""
    steps = []
    for p in sorted(run_dir.iterdir()):
        m = re.fullmatch(r"global_step_(\d+)", p.name)
        if not m:
            continue
        step = int(m.group(1))
        assert checkpoint_folder.is_complete(str(p)), f"{p} is visible but not complete"
        st = trainer_state(p)
        assert st["step"] == step and st["world_size"] == world_size
        for name in [".metadata", "config.yaml", "hf/config.json", "hf/tokenizer_config.json",
                     *(f"rng/rank_{r}.pt" for r in range(world_size))]:
            assert (p / name).is_file(), f"{p} lacks {name}"
        assert max_abs_diff(state(p), state(ref / p.name)) <= SAME_WORLD_TOL, p
        _CACHE.pop(str(p.resolve()))
        steps.append(step)
    return sorted(steps)


def test_sigkill_at_random_moments_then_auto_resume(data, ref, tmp_path):
    """SIGKILL the whole 2-rank job 4 times, alternately while a checkpoint is being written and
    during a training step (random delays from a seeded generator), resuming with auto each time;
    after each kill the invariant holds, and the finished run equals the uninterrupted one."""
    run_dir = tmp_path / "run"
    keep = 3
    overrides = job(data, run_dir, "trainer.save_freq=2", f"trainer.max_ckpt_to_keep={keep}")
    rng = random.Random(1234)
    history = []
    for attempt in range(4):
        logged = logged_steps(run_dir)
        log = tmp_path / f"attempt{attempt}.log"
        proc = launch(2, overrides, log)
        try:
            # Kill moments are relative to the step time this machine just measured, so that a
            # kill lands where intended on a slow or a fast machine, and never after the run's end.
            if attempt % 2 == 0:  # during a save: once its .tmp folder appears, a random moment later
                target = logged + rng.randint(1, 2)
                target += target % 2  # saves happen at even steps
                what = f"save of step {target}"
                hit = wait_until(lambda: (run_dir / f".global_step_{target}.tmp").exists()
                                 or (run_dir / f"global_step_{target}").exists(), proc)
                fraction = rng.uniform(0.0, 0.5)
            else:  # during a step: an odd step (no save follows) is logged, then a random moment later
                target = logged + rng.randint(1, 2)
                target += 1 - target % 2
                what = f"step {target + 1}"
                hit = wait_until(lambda: logged_steps(run_dir) >= target, proc)
                fraction = rng.uniform(0.05, 0.9)
            delay = fraction * step_time(run_dir, target) if hit else 0.0
            time.sleep(delay)
        finally:
            pids = kill_job(proc)
        assert hit and len(pids) >= 3, f"attempt {attempt} ended before the kill:\n{log.read_text()[-3000:]}"
        steps = check_checkpoints(run_dir, ref, 2)
        assert len(steps) <= keep + 1  # +1: killed between a commit and the retention pass
        history.append((what, f"{delay:.3f}s", logged_steps(run_dir), steps))
    print("kills (moment, delay, last step logged, checkpoints left):", history)
    assert not (run_dir / f"global_step_{TOTAL}").exists() or history[-1][0] == f"save of step {TOTAL}"

    run_sfttrain(2, overrides)  # auto-resumes from the latest complete checkpoint
    resumes = [m for m in read_metrics(run_dir) if m.get("event") == "resumed"]
    assert resumes and resumes[-1]["step"] < TOTAL  # the last run had work left: the kills were real
    steps = check_checkpoints(run_dir, ref, 2)
    assert steps == [TOTAL - 4, TOTAL - 2, TOTAL]
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".global_step")]
    got, want = losses_by_step(run_dir), losses_by_step(ref)
    assert sorted(got) == list(range(1, TOTAL + 1))
    assert max(abs(got[s] - want[s]) for s in got) <= SAME_WORLD_TOL
    assert max_abs_diff(state(run_dir / f"global_step_{TOTAL}")["model"],
                        state(ref / f"global_step_{TOTAL}")["model"]) <= SAME_WORLD_TOL


def test_sigterm_to_every_process_saves_the_same_step_on_every_rank(data, ref, tmp_path):
    """As Slurm ends a job at its time limit: SIGTERM to every process of a torchrun job at once (the
    agent, which passes its own on, the ranks, their DataLoader workers and checkpoint writer
    processes, with a background save after every step) once step 3 is logged. The ranks stop after
    the same step, whose checkpoint is committed, as are those before it, each equal to the
    uninterrupted run's (so a resume from it continues that run: test_exact_resume_mid_epoch); rank 0
    prints one message naming it."""
    run_dir = tmp_path / "run"
    overrides = job(data, run_dir, "trainer.save_freq=1", "trainer.async_save_writer=process", "data.num_workers=1")
    log = tmp_path / "stopped.log"
    proc = launch(2, overrides, log, torchrun=True)
    try:
        # step 1's save committed: the writer processes are up (a SIGTERM in the ~0.2 s of a writer's
        # start, before it leaves SIGTERM to its rank, ends it: sfttrain.stop_signal.helper_main)
        assert wait_until(lambda: logged_steps(run_dir) >= 3 and (run_dir / "global_step_1").exists(), proc), \
            log.read_text()[-3000:]
        everyone = [proc.pid, *descendants(proc.pid)]
        assert len(everyone) >= 1 + 2 * 3, everyone  # the agent; each rank, its worker and its writer
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = log.read_text()
    steps = check_checkpoints(run_dir, ref, 2)
    stopped = steps[-1]
    assert 3 <= stopped < TOTAL and steps == list(range(1, stopped + 1)), (steps, out[-3000:])
    assert out.count(f"sfttrain: stopped: SIGTERM received: training stopped after step {stopped} of {TOTAL}, "
                     f"whose checkpoint {run_dir}/global_step_{stopped} is committed") == 1, out[-3000:]


def test_a_killed_torchrun_stops_its_ranks_with_a_save(data, ref, tmp_path):
    """torchrun killed at once (SIGKILL: nothing passed on) left its ranks training as orphans to the end.
    Each rank now gets SIGTERM at its launcher's death: every rank stops after the same step, saves it
    (equal to the uninterrupted run's) and exits."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc, ranks = launch(2, job(data, run_dir), log, torchrun=True), []
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 2, proc), log.read_text()[-3000:]
        ranks = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 120
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        kill_job(proc)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = log.read_text()
    (step,) = check_checkpoints(run_dir, ref, 2)
    assert 2 <= step < TOTAL and f"training stopped after step {step} of {TOTAL}" in out, out[-3000:]


def sigterm_to_rank_1_after_step_2(data: Path, run_dir: Path, log: Path, *extra: str) -> tuple[str, int]:
    """A 2-rank job whose rank 1 alone gets SIGTERM (as `kill` sends it) once step 2 is logged: its
    log and exit code (the forked job's, or from torchrun's summary where SFTTRAIN_TEST_FORK=0)."""
    from tests.test_errors import rank_pid

    proc = launch(2, job(data, run_dir, *extra), log)
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 2, proc), log.read_text()[-3000:]
        os.kill(rank_pid(proc, 1), signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = log.read_text()
    return out, code if isinstance(proc, ForkedJob) else int(re.findall(r"exitcode\s+: (-?\d+)", out)[0])


def test_a_sigterm_during_validation_stops_it_and_saves_the_step(data, ref, gsm8k_dir, tmp_path):
    """Validation can outlast the grace before SIGKILL. SIGTERM to rank 1 as the validation after step 2
    starts (all 7473 GSM8K training rows: seconds on 2 CPU ranks): every rank leaves the validation after
    the same micro-batch, saves step 2 (equal to the uninterrupted run's) and exits with code 8; no
    validation loss is logged for the cut validation."""
    run_dir = tmp_path / "run"
    out, code = sigterm_to_rank_1_after_step_2(data, run_dir, tmp_path / "log",
                                               f"data.val_files={gsm8k_dir / 'train.parquet'}", "trainer.test_freq=2")
    assert check_checkpoints(run_dir, ref, 2) == [2], out[-3000:]
    assert f"another rank received SIGTERM: training stopped after step 2 of {TOTAL}" in out and code == 8, out[-3000:]
    assert not [m for m in read_metrics(run_dir) if "val/loss" in m], out[-3000:]


def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step(data, ref, tmp_path):
    """SIGTERM to rank 1 alone: rank 0 learns it from a step's all-reduce, both save the same step (equal
    to the uninterrupted run's) and exit with code 8, and rank 0 says that another rank received the signal."""
    run_dir = tmp_path / "run"
    out, code = sigterm_to_rank_1_after_step_2(data, run_dir, tmp_path / "log")
    (step,) = check_checkpoints(run_dir, ref, 2)
    assert f"sfttrain: stopped: another rank received SIGTERM: training stopped after step {step} of {TOTAL}" in out
    assert code == 8, out[-3000:]


@pytest.mark.parametrize("save_on_sigterm", [True, False])
def test_a_write_over_half_the_grace_is_said_once(tmp_path, caplog, monkeypatch, save_on_sigterm):
    """A stop needs a step or two and then the save: a write over half the default grace is worth a
    warning, logged once (after the first commit that measured it), and only where a SIGTERM saves
    (trainer.save_on_sigterm). A grace of 0 s makes every write of three real saves one such write."""
    from sfttrain import stop_signal

    assert stop_signal.grace_warning(stop_signal.GRACE_S / 2) is None
    warning = stop_signal.grace_warning(16.0)
    assert warning.startswith("a checkpoint took 16 s to write") and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in warning
    monkeypatch.setattr(stop_signal, "GRACE_S", 0.0)
    with one_rank_checkpointer(tmp_path / "run", f"trainer.save_on_sigterm={save_on_sigterm}") as saver:
        for step in (1, 2, 3):
            saver.save(checkpoint.TrainState(step=step), final=True)
    said = [r for r in caplog.records if re.match(r"a checkpoint took \d+ s to write", r.getMessage())]
    assert len(said) == (1 if save_on_sigterm else 0), [r.getMessage() for r in said]
    assert checkpoint_folder.is_complete(str(tmp_path / "run" / "global_step_3"))


@contextlib.contextmanager
def one_rank_checkpointer(run_dir: Path, *overrides: str):
    """A real Checkpointer of a one-rank gloo group in this process, for stories260K on CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sfttrain.checkpoint_writer import writer_kind
    from sfttrain.distributed import World

    run_dir.mkdir(exist_ok=True)
    cfg = load_config(overrides=["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}",
                                 f"trainer.default_local_dir={run_dir}", *overrides])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = World(0, 0, 1, torch.device("cpu"), init_device_mesh("cpu", (1,)))
        model = AutoModelForCausalLM.from_pretrained(STORIES)
        saver = checkpoint.Checkpointer(str(run_dir), world, cfg, "run", lambda record, line: None, model,
                                        torch.optim.AdamW(model.parameters()), AutoTokenizer.from_pretrained(STORIES),
                                        writer_kind(cfg.trainer.async_save_writer, world.device))
        yield saver
        saver.close()
    finally:
        dist.destroy_process_group()


def test_a_lone_rank_stops_on_its_own_note(data, tmp_path):
    """One rank (no vote to wait for) gets SIGTERM once step 2 is logged: it saves the step it is in or
    the next, the checkpoint is committed, and it exits with code 8."""
    from tests.test_errors import rank_pid

    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = launch(1, job(data, run_dir), log)
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 2, proc), log.read_text()[-3000:]
        os.kill(rank_pid(proc, 0) if isinstance(proc, ForkedJob) else proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = log.read_text()
    (stopped,) = [step for step, _ in checkpoint_folder.complete_checkpoints(str(run_dir))]
    assert 2 < stopped < TOTAL and code == 8, out[-3000:]
    assert f"sfttrain: stopped: SIGTERM received: training stopped after step {stopped} of {TOTAL}" in out


# --------------------------------------------------------------------------- the folder logic, in-process

def _fake(run_dir: Path, step: int, complete: bool = True) -> Path:
    p = run_dir / f"global_step_{step}"
    p.mkdir(parents=True)
    if complete:
        (p / checkpoint_folder.COMPLETE).write_text("")
    return p


def test_find_resume_modes_and_errors(tmp_path):
    run_dir = tmp_path / "run"
    for step in (2, 10):
        _fake(run_dir, step)
    _fake(run_dir, 12, complete=False)  # never picked
    (run_dir / ".global_step_14.tmp").mkdir()
    auto = TrainerConfig(default_local_dir=str(run_dir))
    assert resume.find_resume(auto, str(run_dir)).path == str(run_dir / "global_step_10")
    assert resume.find_resume(TrainerConfig(resume_mode="disable"), str(run_dir)).path is None
    assert resume.find_resume(TrainerConfig(), str(tmp_path / "empty")).path is None
    by_path = TrainerConfig(resume_mode="resume_path", resume_from_path=str(run_dir / "global_step_2"))
    assert resume.find_resume(by_path, str(tmp_path / "elsewhere")).path == str(run_dir / "global_step_2")
    branch = resume.find_resume(by_path, str(run_dir))  # into its own run folder, which has step 10 already
    assert branch.path == str(run_dir / "global_step_2")
    assert "steps 2..10 (2 checkpoints) of another run" in branch.notes[0], branch.notes
    # auto: the run folder's own latest first (crash recovery), resume_from_path only to start it
    seeded = TrainerConfig(resume_from_path=str(run_dir / "global_step_2"))
    assert resume.find_resume(seeded, str(run_dir)).path == str(run_dir / "global_step_10")
    assert resume.find_resume(seeded, str(tmp_path / "new")).path == str(run_dir / "global_step_2")
    by_run = TrainerConfig(resume_mode="resume_path", resume_from_path=str(run_dir))
    assert resume.find_resume(by_run, str(tmp_path)).path == str(run_dir / "global_step_10")
    for bad in (run_dir / "global_step_12", run_dir / ".global_step_14.tmp", tmp_path / "missing"):
        with pytest.raises(ConfigError, match="resume_from_path"):
            resume.find_resume(TrainerConfig(resume_mode="resume_path", resume_from_path=str(bad)), str(run_dir))
    checkpoint_folder.remove_stale_tmp(str(run_dir))
    assert not (run_dir / ".global_step_14.tmp").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == ["global_step_10", "global_step_12", "global_step_2"]


def test_a_resume_path_without_a_checkpoint_says_what_it_holds(tmp_path):
    """trainer.resume_from_path at what a verl user has: a verl checkpoint (its shards, a huggingface/
    folder beside them without weights, then with), a Hugging Face model, an unfinished save,
    nothing: each is refused naming what it is and what to set instead."""
    verl = tmp_path / "verl" / "global_step_50"
    (verl / "huggingface").mkdir(parents=True)
    for name in ("model_world_size_2_rank_0.pt", "optim_world_size_2_rank_0.pt", "huggingface/config.json"):
        (verl / name).write_text("")

    def refused(path: Path) -> str:
        with pytest.raises(ConfigError, match=f"^trainer.resume_from_path: '{path}' ") as e:
            resume.find_resume(TrainerConfig(resume_mode="resume_path", resume_from_path=str(path)), str(tmp_path))
        return str(e.value)

    assert re.search(rf"is a verl checkpoint .*`python -m verl.model_merger merge --backend fsdp --local_dir {verl} "
                     r"--target_dir OUT`\) and set model.partial_pretrain=OUT, without trainer.resume_from_path$",
                     refused(verl))
    (verl / "huggingface" / "model.safetensors").write_text("")
    assert f"set model.partial_pretrain={verl / 'huggingface'} (its weights, saved beside the shards)" in refused(verl)
    assert f"is a Hugging Face model folder, not a checkpoint: to start from its weights, set " \
           f"model.partial_pretrain={STORIES};" in refused(STORIES)
    assert "has no COMPLETE marker: its save (or copy) did not finish" in refused(_fake(tmp_path / "run", 4, False))
    assert refused(tmp_path / "missing").endswith("does not exist")


def test_fresh_start_moves_old_metrics_aside(tmp_path):
    """A crash before the first checkpoint: the rerun starts fresh and its steps are not
    appended after the dead attempt's records."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert resume.find_resume(TrainerConfig(), str(run_dir)).path is None
    assert (run_dir / "metrics.jsonl").read_text() == ""
    assert len((run_dir / REWOUND).read_text().splitlines()) == 2


def test_config_spellings():
    common = ["data.train_files=x.parquet", "model.partial_pretrain=m"]
    assert load_config(overrides=[*common, "trainer.save_interval=3"]).trainer.save_freq == 3  # verl's name
    with pytest.raises(ConfigError, match="resume_from_path"):
        load_config(overrides=[*common, "trainer.resume_mode=resume_path"])


def test_resume_refuses_another_model(ref):
    """A checkpoint of another model is refused with names and shapes before DCP is asked."""
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(STORIES).state_dict()
    ckpt = str(ref / "global_step_1")
    checkpoint.check_same_model(ckpt, sd)  # the same model: fine
    with pytest.raises(ConfigError, match="another model"):
        checkpoint.check_same_model(ckpt, {k: v[:1] if v.ndim else v for k, v in sd.items()})
    with pytest.raises(ConfigError, match="1 weights missing"):
        checkpoint.check_same_model(ckpt, {**sd, "model.extra.weight": torch.zeros(2)})


def test_a_damaged_checkpoint_is_refused_and_the_one_before_it_resumes(data, ref, tmp_path):
    """Steps 9 and 10 of the reference, step 10 then damaged after its commit. A shard cut short or
    an RNG file missing (COMPLETE lists each file's size) is refused before the model loads; rank 1's
    RNG file, or a shard, of the right size with its end overwritten, when it is read. Each ends every rank
    with one message (exit code 2) naming the damage and step 9, the intact checkpoint before it;
    the override the message gives resumes from step 9 and trains what the reference trained. The
    exporter refuses the damaged checkpoint too."""
    from sfttrain import export

    run_dir = tmp_path / "run"
    for step in (9, 10):
        shutil.copytree(ref / f"global_step_{step}", run_dir / f"global_step_{step}")
    damaged, intact = run_dir / "global_step_10", run_dir / "global_step_9"
    shard, rng = damaged / "__1_0.distcp", damaged / "rng" / "rank_1.pt"
    whole = shard.read_bytes()
    command = job(data, run_dir)

    def refused(damage: str) -> str:
        message = one_message(run_sfttrain(2, command, check=False), 2)
        assert f"the checkpoint {damaged} is damaged: {damage}" in message, message
        assert f"The newest intact checkpoint before it is {intact}" in message, message
        assert not any(m.get("event") == "resumed" for m in running_records(run_dir)), "a refused checkpoint was loaded"
        return message

    shard.write_bytes(whole[:1000])
    refused(f"__1_0.distcp has 1000 bytes, {len(whole)} when it was committed")
    shard.write_bytes(whole)
    rng.rename(tmp_path / "rng_1.pt")
    refused("rng/rank_1.pt is missing")
    (tmp_path / "rng_1.pt").rename(rng)
    states = rng.read_bytes()
    rng.write_bytes(states[:-64] + bytes(64))  # rank 1's alone, at its size: every rank stops on it
    refused("it does not read back (rank 1's RNG file: ")
    rng.write_bytes(states)
    # the size kept, the end (a zip directory) of one of the shard's model weights overwritten
    storage = dcp.FileSystemReader(str(damaged)).read_metadata().storage_data
    end = max(info.offset + info.length for index, info in storage.items()
              if info.relative_path == shard.name and index.fqn.startswith("model."))
    shard.write_bytes(whole[:end - 64] + bytes(64) + whole[end:])
    message = refused("its shards do not read back (")
    with pytest.raises(SystemExit, match=f"the checkpoint {damaged} is damaged: its shards do not read back"):
        export.main([str(damaged), str(tmp_path / "hf")])

    override = re.search(r"\(to resume from it: (trainer\.resume_mode=\S+ trainer\.resume_from_path=\S+?);", message)
    run_sfttrain(2, [*command, *override.group(1).split()])
    assert_resumed_like_ref(run_dir, ref, 10, SAME_WORLD_TOL)


def test_a_state_file_garbled_at_its_size_is_a_damaged_checkpoint(gsm8k_head, two_rank_run, tmp_path):
    """Steps 2 and 3 of conftest's two-rank run, step 3's trainer_state.json then garbled in place (its
    last 40 bytes: the size kept, which COMPLETE's list cannot see, and no longer JSON). The preflight
    lists it as a problem and the resume refuses it with one message (exit code 2), both naming the
    file and step 2, the intact checkpoint before it."""
    from sfttrain.plan import main as plan

    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_run, run_dir)
    state_file = run_dir / "global_step_3" / checkpoint_folder.STATE_FILE
    text = state_file.read_bytes()
    state_file.write_bytes(text[:-40] + b"#" * 40)
    damage = f"the checkpoint {run_dir / 'global_step_3'} is damaged: trainer_state.json does not read back as JSON ("
    intact = f"The newest intact checkpoint before it is {run_dir / 'global_step_2'}"
    command = two_rank_job(gsm8k_head, run_dir, "trainer.total_training_steps=4")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = plan([*command, "--nproc", "2"])
    problems = printed.getvalue().split("problems:")[-1]
    assert code == 2 and damage in problems and intact in problems, printed.getvalue()
    message = one_message(run_sfttrain(2, command, check=False), 2)
    assert damage in message and intact in message, message


# --------------------------------------------------------------------------- several runs in one folder

def test_runs_in_one_folder(data, ref, tmp_path, capsys):
    """A fresh 6-step run (resume_mode=disable, max_ckpt_to_keep=2) in a folder that holds steps
    2..10 of another run: retention counts this run's checkpoints only (the other run's 8 and 10
    are kept, this run's 4 and 6 too), start-up says what it found, `auto` resume and the export
    of the folder take this run's latest."""
    from sfttrain import export

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in (2, 4, 6, 8, 10):
        shutil.copytree(ref / f"global_step_{step}", run_dir / f"global_step_{step}")
    other = trainer_state(ref / "global_step_2")["run_id"]
    proc = run_sfttrain(1, job(data, run_dir, "trainer.resume_mode=disable", "trainer.total_training_steps=6",
                               "trainer.save_freq=2", "trainer.max_ckpt_to_keep=2"))
    assert f"found steps 2..10 (5 checkpoints) of another run (id {other})" in proc.stdout
    ids = {p.name: trainer_state(p)["run_id"] for p in run_dir.glob("global_step_*")}
    mine = ids["global_step_6"]
    assert ids == {"global_step_4": mine, "global_step_6": mine, "global_step_8": other, "global_step_10": other}
    assert mine != other
    assert resume.find_resume(TrainerConfig(), str(run_dir)).path == str(run_dir / "global_step_6")
    export.main([str(run_dir), str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    assert f"exporting the latest of the run that saved last (id {mine}), global_step_6" in printed
    assert printed.strip().endswith(f"{run_dir / 'global_step_6'} -> {tmp_path / 'hf'}")


# --------------------------------------------------------------------------- a full disk

@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A real size-limited filesystem (tmpfs) at `path`; needs root."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield lambda new_size: subprocess.run(["mount", "-o", f"remount,size={new_size}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def ext4(path: Path, size: int = 64 << 20):
    """A real ext4 filesystem at `path` (a loop-mounted image beside it) that the kernel makes read-only at
    its first error, as a failing disk's (errors=remount-ro); yields (a function that raises such an error,
    ext4's own trigger, and one that mounts it anew, read-write, as after a repair). Needs root."""
    image = path.with_suffix(".img")
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root (CI runs as root)")
    with open(image, "wb") as f:
        f.truncate(size)
    made = subprocess.run(["mkfs.ext4", "-q", str(image)], capture_output=True)
    mount = ["mount", "-o", "loop,errors=remount-ro", str(image), str(path)]
    mounted = subprocess.run(mount, capture_output=True) if made.returncode == 0 else made
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image here: {mounted.stderr.decode().strip()}")
    device = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True, text=True).stdout
    trigger = Path("/sys/fs/ext4") / Path(device.strip()).name / "trigger_fs_error"

    def mount_anew() -> None:
        subprocess.run(["umount", str(path)], check=True)
        subprocess.run(mount, check=True)

    try:
        yield lambda: trigger.write_text("test\n"), mount_anew
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def one_message(proc, code: int) -> str:
    """The job's one message (printed once, no traceback but torchrun's own) and its exit code: the
    first failing rank's status, which the suite's forked ranks return as the job's (torchrun's
    summary, where SFTTRAIN_TEST_FORK=0 starts it, names it as the root cause; tests/test_errors.py
    checks that summary for every kind of error)."""
    from tests.test_errors import launcher_traceback_only

    # a DataLoader worker's own last words (torch's, on SIGBUS) end in the C string's NUL
    printed = [line for line in proc.stdout.splitlines() if line.lstrip("\0").startswith("sfttrain: ")]
    assert len(printed) == 1, proc.stdout[-4000:]
    assert launcher_traceback_only(proc.stdout), proc.stdout[-4000:]
    root_cause = proc.stdout.split("Root Cause (first observed failure):")[1:]
    status = int(re.findall(r"exitcode\s+: (-?\d+)", root_cause[0])[0]) if root_cause else proc.returncode
    assert status == code, proc.stdout[-3000:]
    return printed[0].lstrip("\0")


def test_full_disk(data, ref, tmp_path):
    """Saves into a tmpfs that really fills (2 ranks, nothing mocked). C is one checkpoint's size, E
    the start-up's estimate of it (the tensors' bytes: below C by DCP's overhead and the small files).
    0.5 C: refused at start-up, before a step; free space between E and C: the first save (in the
    background, by each rank's writer process) fails mid-write; 1.5 C: step 2 commits and the save
    of step 4 is refused before it starts; 2.1 C: step 4 commits, its Hugging Face export (a third
    of C) does not fit; 10 C: the same command resumes and exports; then sfttrain.export into the same
    disk without room for its folder. Each failure ends every rank with one message and an exit code
    of its own, and leaves no partial folder."""
    size = next(m["bytes"] for m in read_metrics(ref) if m.get("event") == "checkpoint")
    run_dir = tmp_path / "disk"
    command = job(data, run_dir / "run", "trainer.total_training_steps=4", "trainer.save_freq=2",
                  "trainer.save_hf=true", "trainer.async_save_writer=process")
    with tmpfs(run_dir, size // 2) as resize:
        message = one_message(run_sfttrain(2, command, check=False), 2)
        estimate = re.search(r"this run's first checkpoint will take about ([\d.]+) MB", message)
        assert estimate and "the next save would fail, and the training before it would be lost" in message, message
        assert not any("loss" in m for m in read_metrics(run_dir / "run"))  # stopped before step 1
        estimate = float(estimate.group(1)) * 1e6
        assert estimate < size, (estimate, size)

        resize(shutil.disk_usage(run_dir).used + int(estimate + size) // 2)  # the run folder's files stay
        message = one_message(run_sfttrain(2, command, check=False), 6)
        assert "checkpoint not saved: the checkpoint of step 2 was not saved: the disk is full" in message, message
        assert "the last good checkpoint is none" in message and "starts afresh" in message, message
        assert not [p.name for p in (run_dir / "run").iterdir() if "global_step" in p.name]

        resize(size * 3 // 2)
        proc = run_sfttrain(2, command, check=False)
        message = one_message(proc, 6)
        last = run_dir / "run" / "global_step_2"
        assert "the checkpoint of step 4 was not saved: it needs about" in message, message
        assert f"the last good checkpoint is {last}" in message and f"resumes from {last}" in message, message
        assert "the next save will not fit" in proc.stdout
        assert sorted(p.name for p in (run_dir / "run").iterdir() if "global_step" in p.name) == ["global_step_2"]

        resize(size * 21 // 10)
        message = one_message(run_sfttrain(2, command, check=False), 7)
        final = run_dir / "run" / "global_step_4"
        assert f"export failed: the Hugging Face export of {final} failed" in message, message
        assert checkpoint_folder.is_complete(str(final)) and not list(final.glob("*huggingface*"))

        resize(size * 10)
        proc = run_sfttrain(2, command)
        assert (final / "huggingface" / "config.json").is_file()
        resumed = [m for m in read_metrics(run_dir / "run") if m.get("event") == "resumed"]
        assert [m["step"] for m in resumed] == [2, 4]

        # sfttrain.export into a folder on a disk without room for it: one line, no partial folder left
        from sfttrain import export

        resize(shutil.disk_usage(run_dir).used + size // 10)
        with pytest.raises(SystemExit, match=f"the disk of {run_dir / 'hf'} is full: nothing was exported"):
            export.main([str(final), str(run_dir / "hf")])
        assert not (run_dir / "hf").exists() and not (run_dir / "hf.tmp").exists()


def under_size_limit(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    """`python -m ...argv` whose files may grow to `limit` bytes (RLIMIT_FSIZE, which `ulimit -f` sets): a
    write past it fails with EFBIG, "File too large" (Python ignores the SIGXFSZ that comes with it). Forked
    from the rank server where the suite forks (its launcher passes the limit on); the output comes
    through a pipe, which the limit does not bound (a log file it would)."""
    import resource

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    module, *args = argv
    command = ForkServer.get().command(1, args, module)[0] if forks() else [sys.executable, "-m", *argv]
    return subprocess.run(command, cwd=REPO, env=rank_env(), preexec_fn=limit_files, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_a_file_size_limit_is_said_as_a_full_disk_is(data, tmp_path):
    """EFBIG, a file size limit reached (ulimit -f), is handled as a full disk: one message naming the
    file, the limit and how to raise it, and no partial file left. 1 KB: the length cache's write at
    start-up (exit code 2); 500 KB: the save of step 2, whose shards are larger (torch.save's error names
    no file; exit code 6); then sfttrain.export of the checkpoint a run without the limit writes."""
    run_dir = tmp_path / "run"
    command = ["sfttrain.run", *job(data, run_dir, "trainer.total_training_steps=2", "trainer.save_freq=2")]
    message = one_message(under_size_limit(command, 1000), 2)
    assert re.search(rf"the file size limit \(ulimit -f\) was reached \(File too large: {run_dir}/row_stats/\w+\.npz\) "
                     r"in start-up, before any step. Raise the file size limit", message), message
    assert not list((run_dir / "row_stats").iterdir())  # no temporary file left

    message = one_message(under_size_limit(command, 500_000), 6)
    assert re.search(rf"the checkpoint of step 2 was not saved: the file size limit \(ulimit -f\) was reached "
                     rf"\({run_dir}/\.global_step_2\.tmp/__0_\d\.distcp: ", message), message
    assert "Raise the file size limit" in message and "the last good checkpoint is none" in message, message
    assert not [p.name for p in run_dir.iterdir() if "global_step" in p.name]

    run_sfttrain(1, command[1:])
    out = under_size_limit(["sfttrain.export", str(run_dir), str(tmp_path / "hf")], 500_000)
    assert out.returncode == 1 and "Traceback" not in out.stdout, out.stdout[-3000:]
    assert (f"sfttrain.export: a file of {tmp_path / 'hf'} reached the file size limit (ulimit -f): nothing was "
            "exported (the partial folder was removed). Raise the file size limit") in out.stdout, out.stdout[-3000:]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_a_disk_that_fills_between_saves_ends_the_job_with_one_message(data, tmp_path):
    """The run folder's disk (a real tmpfs) fills between saves: once step 15's checkpoint is committed,
    a filler file takes every free page. The next metrics.jsonl record that needs a new page fails
    (records are 277 bytes or more, so at most 14 fit in the file's last 4 KiB page, and the next save
    is 15 steps away): every rank ends with one message (exit code 6, not a traceback per rank) naming
    the file, the step, and step 15's checkpoint to resume from; the disk freed, the same command
    resumes there and finishes."""
    run_dir = tmp_path / "disk"
    command = job(data, run_dir / "run", "trainer.total_training_steps=30", "trainer.save_freq=15")
    with tmpfs(run_dir, 64 << 20):
        log = tmp_path / "job.log"
        proc = launch(2, command, log)
        try:
            assert wait_until(lambda: (run_dir / "run" / "global_step_15").exists(), proc), log.read_text()[-3000:]
            with open(run_dir / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(bytes(1 << 16))
            proc.wait(timeout=120)
        finally:
            kill_job(proc)
        out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout=log.read_text())
        message = one_message(out, 6)
        last = run_dir / "run" / "global_step_15"
        assert re.search(r"the disk is full \(No space left on device: \S+/metrics.jsonl\) in step (1[6-9]|2\d)",
                         message), message
        assert (f"the last good checkpoint ({last})" in message
                and f"The same command then resumes from {last}" in message), message
        (run_dir / "filler").unlink()
        run_sfttrain(2, command)
        assert [m["step"] for m in read_metrics(run_dir / "run") if m.get("event") == "resumed"] == [15]
        assert checkpoint_folder.is_complete(str(run_dir / "run" / "global_step_30"))


def test_a_run_folder_deleted_mid_run_ends_the_job_with_one_message(data, tmp_path):
    """A running 2-rank job's metrics.jsonl is deleted: a new one takes the next records. Then the
    whole run folder is deleted (`rm -rf`), long before the next save: the next record's write fails,
    and every rank ends with one message (exit code 6) naming the folder, not a traceback at the save."""
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proc = launch(2, job(data, run_dir, "trainer.total_training_steps=100000", "trainer.save_freq=50000"), log)
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 2, proc), log.read_text()[-3000:]
        (run_dir / "metrics.jsonl").unlink()
        assert wait_until(lambda: logged_steps(run_dir) >= 1, proc, timeout=60), log.read_text()[-3000:]
        shutil.rmtree(run_dir)
        proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout=log.read_text())
    message = one_message(out, 6)
    assert f"the run folder {run_dir} (trainer.default_local_dir) is gone" in message, message
    assert re.search(rf"Found in step \d+, writing {run_dir}/metrics.jsonl$", message), message


def test_a_disk_turned_read_only_mid_run_ends_with_one_message_and_resumes(data, tmp_path):
    """The run folder's disk (a real ext4) turns read-only mid-run, as the kernel makes a disk that failed:
    once step 2's checkpoint is committed, ext4 is told of an error, and what the run wrote unsynced since
    its last fsync is lost. The next write (a metrics.jsonl record, or a save) fails with EROFS: one message
    (exit code 6, not a traceback) naming the run folder, what happened and the checkpoint to resume from,
    which the same command resumes from once the disk is mounted anew; the conversion of its JSON Lines data
    (data_cache/), written at start-up, reads back. Then sfttrain.export onto that disk, which fails again
    as the export writes: one line naming what happened and what to do (exit code 1), not a traceback."""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in pq.read_table(data).to_pylist()))
    run_dir, log = tmp_path / "disk" / "run", tmp_path / "job.log"
    command = [*job(data, run_dir, "trainer.total_training_steps=8", "trainer.save_freq=2"), f"data.train_files={rows}"]
    with ext4(tmp_path / "disk") as (fail, mount_anew):
        proc = launch(1, command, log)
        try:
            committed = lambda: any(m.get("event") == "checkpoint" for m in running_records(run_dir))  # noqa: E731
            assert wait_until(committed, proc), log.read_text()[-3000:]  # (its rename fsynced)
            fail()
            proc.wait(timeout=120)
        finally:
            kill_job(proc)
        message = one_message(subprocess.CompletedProcess(proc.args, proc.returncode, stdout=log.read_text()), 6)
        # the write after ext4's error meets the read-only remount (EROFS), or, where the kernel's writeback of
        # records written just before the error failed first, that failure (EIO, reported to the next write):
        # which comes first is timing (EIO in 1 fresh-clone CI run of 3, on 2 loaded cores)
        read_only = f"the filesystem of the run folder {run_dir} is read-only ("
        failed = f"the disk of the run folder {run_dir} failed (Input/output error"
        assert read_only in message or failed in message, message
        assert "`dmesg` says which" in message, message
        assert ("make it writable again" if read_only in message else "repair it") in message, message
        last = re.search(rf"The same command then resumes from {run_dir}/global_step_(\d+)$", message)
        assert last, message
        mount_anew()
        run_sfttrain(1, command)
        assert [m["step"] for m in read_metrics(run_dir) if m.get("event") == "resumed"] == [int(last[1])]
        assert checkpoint_folder.is_complete(str(run_dir / "global_step_8"))

        # sfttrain.export onto the same disk, which fails again once the export has made its folder
        from sfttrain import export

        hf = tmp_path / "disk" / "hf"
        watcher = threading.Thread(target=lambda: wait_for_path(hf.with_suffix(".tmp")) and fail())
        watcher.start()
        with pytest.raises(SystemExit,
                           match=re.escape(f"sfttrain.export: writing {hf} failed: the ") + "(filesystem|disk) of "):
            export.main([str(run_dir), str(hf)])
        watcher.join()


def wait_for_path(path: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def test_a_save_into_a_run_folder_that_is_gone_is_one_message(tmp_path):
    """The save itself finds the run folder gone (deleted after the step's metrics record): a
    CheckpointError naming the folder (one rank's gloo group in this process, a real Checkpointer)."""
    from sfttrain.errors import CheckpointError

    run_dir = tmp_path / "run"
    with one_rank_checkpointer(run_dir) as saver:
        shutil.rmtree(run_dir)
        with pytest.raises(CheckpointError, match=re.escape(
                f"the checkpoint of step 1 was not saved: the run folder {run_dir} "
                "(trainer.default_local_dir) is gone")):
            saver.save(checkpoint.TrainState(step=1), final=True)


def _add_one_in_place(conn) -> None:
    """A writer's side of send_with_fds: its tensors are the sender's memory."""
    from sfttrain.checkpoint_writer import FdAfter
    FdAfter.sock = __import__("socket").socket(fileno=os.dup(conn.fileno()))
    message = conn.recv()
    for t in [message["a"], *message["b"]]:
        t.add_(1)
    conn.send(sorted(message))


def test_a_writer_process_maps_the_staging_copy_sent_by_the_saving_thread_itself():
    """The writer's shared memory comes with its message, from the thread that sends it (no resource_sharer
    thread, whose traceback a writer killed mid-handshake printed beside the job's one message): the writer
    adds 1 in place to three tensors (one a view of another's storage), and the sender sees it."""
    from multiprocessing import resource_sharer

    from sfttrain.checkpoint_writer import send_with_fds
    sharer = resource_sharer._resource_sharer._listener
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_add_one_in_place, args=(child,))
    process.start()
    a, b = torch.arange(6.0).share_memory_(), torch.zeros(2, 3).share_memory_()
    send_with_fds(conn, {"a": a, "b": [b, b[1]], "step": 3})
    assert conn.recv() == ["a", "b", "step"]
    process.join(30)
    assert a.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert b.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]  # b[1] maps the same memory as b
    assert resource_sharer._resource_sharer._listener is sharer


def test_a_killed_writer_process_ends_the_job_with_one_message(data, tmp_path):
    """A rank's writer process (trainer.async_save_writer=process) is a process the kernel's
    out-of-memory killer may pick. Killed once the first checkpoint is committed, the next save fails
    on every rank with one message naming it and the last good checkpoint (exit code 6), without a
    wait for the collective timeout: the other rank's writer, waiting for the dead one in DCP's
    collectives, is stopped. Before that, the other writer is asked for its stacks (SIGUSR1, as any
    process of a rank): it prints them into the log and lives on."""
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proc = launch(2, job(data, run_dir, "trainer.save_freq=1", "trainer.async_save_writer=process",
                         "trainer.nccl_timeout=600"), log)
    try:
        assert wait_until(lambda: (run_dir / "global_step_1").exists(), proc), log.read_text()[-3000:]
        writers = writer_processes(proc)
        os.kill(writers[1], signal.SIGUSR1)
        assert wait_until(lambda: "sfttrain/checkpoint_writer.py" in log.read_text(), proc), log.read_text()[-3000:]
        # killed mid-write (a writer lost between saves is replaced: the next test): stopped first, then
        # killed once a save's folder lacks its rank's shard, a save that cannot finish before the kill
        os.kill(writers[0], signal.SIGSTOP)
        rank = int(re.search(rb"\0RANK=(\d+)\0", b"\0" + Path(f"/proc/{writers[0]}/environ").read_bytes())[1])
        assert wait_until(lambda: any(tmp.name.endswith(".tmp") and not list(tmp.glob(f"__{rank}_*.distcp"))
                                      and tmp.is_dir() for tmp in run_dir.glob(".global_step_*")), proc)
        os.kill(writers[0], signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        kill_job(proc)
    out = log.read_text()
    message = one_message(subprocess.CompletedProcess(proc.args, proc.returncode, stdout=out), 6)
    assert re.search(r"the checkpoint of step \d+ was not saved: the checkpoint writer process of rank \d ended "
                     r"\(exit code -9;", message), message
    assert "the last good checkpoint is " + str(run_dir / "global_step_") in message, message
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".global_step")]


def test_a_stuck_write_ends_the_run_with_one_message(data, tmp_path):
    """A checkpoint write that never finishes (here the writer process stopped with SIGSTOP; in life a network
    filesystem that stopped answering) hung the run for good, without a word: the ranks' agreement on the
    write answered every second, so no collective timed out. Past trainer.nccl_timeout (the tiny model's
    checkpoint takes far less at 20 MB/s) the run stops with one message naming the step, the limit and
    the last good checkpoint (exit code 6), the writer killed and waited for by its rank (ended before the
    rank: a process left behind would hold its memory, pinned on a GPU machine)."""
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proc = launch(1, job(data, run_dir, "trainer.save_freq=1", "trainer.async_save_writer=process",
                         "trainer.total_epochs=100", "trainer.nccl_timeout=8"), log)
    writer = None
    try:
        assert wait_until(lambda: (run_dir / "global_step_2").exists(), proc), log.read_text()[-3000:]
        ranks = proc.ranks() if isinstance(proc, ForkedJob) else [proc.pid]
        [writer] = [pid for rank in ranks for pid in descendants(rank)
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(writer, signal.SIGSTOP)
        code = proc.wait(timeout=120)
        ended = not alive(writer)  # at once: the rank waited for it
    finally:
        kill_job(proc)
        if writer is not None and alive(writer):
            os.kill(writer, signal.SIGKILL)
    out = log.read_text()
    message = one_message(subprocess.CompletedProcess(proc.args, code, stdout=out), 6)
    last = max(step for step, _ in checkpoint_folder.complete_checkpoints(str(run_dir)))
    assert re.search(r"the checkpoint of step \d+ was not saved: its write has not finished \d+ s after it began "
                     r"\(the longest a write may take here: 8 s, the larger of trainer.nccl_timeout=8 and a rank's "
                     r"share of the checkpoint at 20 MB/s\): it is stuck", message), message
    assert f"the last good checkpoint is {run_dir / f'global_step_{last}'}. " in message, message
    assert ended


def writer_processes(proc) -> list[int]:
    """The job's checkpoint writer processes, one per rank (spawned: multiprocessing's spawn_main)."""
    ranks = proc.ranks() if isinstance(proc, ForkedJob) else [proc.pid]  # forked, or torchrun's children
    writers = [pid for rank in ranks for pid in descendants(rank)
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(writers) == 2, writers
    return writers


def test_a_writer_process_lost_between_saves_is_replaced(data, tmp_path):
    """A writer process killed between saves (the out-of-memory killer picks any process) does not
    cost the next save and the steps before it: every rank's writer is replaced before that save,
    with a warning naming the rank and the exit code, and the run ends with every checkpoint. Killed
    within milliseconds of step 20's commit, 10 and 16 steps before the saves of steps 30 and 36, with one save
    in flight at a time: the first save spawns the writers (an interpreter importing torch, seconds), and on a
    machine of fast steps the saves behind it committed with it, while the next one was being written (an H100
    machine's 16 cores: 30 steps in 7 s, step 15 committed 4.3 s after its save began; with two saves in
    flight the kill after step 20's commit hit step 30's write, exit code 6)."""
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proc = launch(2, job(data, run_dir, "trainer.async_save_writer=process", "trainer.total_epochs=6",
                         "trainer.save_freq=10", "trainer.async_save_in_flight=1"), log)
    try:
        assert wait_until(lambda: (run_dir / "global_step_20").exists(), proc), log.read_text()[-3000:]
        os.kill(writer_processes(proc)[1], signal.SIGKILL)
        code = proc.wait(timeout=240)
    finally:
        kill_job(proc)
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert [s for s, _ in checkpoint_folder.complete_checkpoints(str(run_dir))] == [10, 20, 30, 36], out[-3000:]
    assert re.search(r"the checkpoint writer process of rank\(s\) \[\d\] had ended \(exit code\(s\) \[-9\]",
                     out), out[-3000:]


def test_a_data_worker_s_death_that_lands_in_a_save_is_passed_on():
    """torch raises a dead worker's RuntimeError in the rank wherever it is (its SIGCHLD handler). Landing
    in a save (the kill below, 1 fresh-clone CI run of a few), it was worded as the checkpoint not saved
    (exit code 6) instead of the worker's death (exit code 9): the save passes it on; its own errors it keeps
    for every rank to agree on."""
    from sfttrain.checkpoint import _attempt

    def fail(error):
        def work():
            raise error
        return work

    died = RuntimeError("DataLoader worker (pid 4916) is killed by signal: Bus error. It is possible that dataloader's "
                        "workers are out of shared memory. Please try to raise your shared memory limit.")
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid 4916\) is killed by signal"):
        _attempt(fail(died))
    full = OSError(28, "No space left on device")
    assert _attempt(fail(full)) == (None, full) and _attempt(fail(RuntimeError("DCP failed")))[1] is not None
    assert _attempt(lambda: 3) == (3, None)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGBUS])
def test_a_killed_data_worker_ends_the_job_with_one_message(data, tmp_path, sig):
    """Rank 0's DataLoader worker (data.num_workers=1) is killed once step 2's checkpoint is committed:
    with SIGKILL, as the host's out-of-memory killer kills, or SIGBUS, as a worker dies writing a
    batch into a full /dev/shm. One message and exit code 9 (memory run out), naming the rank, the
    worker, the signal, its likely cause and fix, and the checkpoint the same command resumes from; no
    traceback (torch's own error named only the pid and the signal). The kill may come while the rank
    reads a batch from that worker, whose connection then fails first, or while it saves step 4 (see
    test_a_data_worker_s_death_that_lands_in_a_save_is_passed_on): the message is the same."""
    from tests.test_errors import rank_pid

    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proc = launch(2, job(data, run_dir, "trainer.total_training_steps=100000", "trainer.save_freq=2",
                         "data.num_workers=1"), log)
    try:
        assert wait_until(lambda: (run_dir / "global_step_2").exists(), proc), log.read_text()[-3000:]
        [worker] = descendants(rank_pid(proc, 0))
        os.kill(worker, sig)
        proc.wait(timeout=120)
    finally:
        kill_job(proc)
    message = one_message(subprocess.CompletedProcess(proc.args, proc.returncode, stdout=log.read_text()), 9)
    assert re.search(rf"out of memory: rank 0's DataLoader worker \(pid {worker}\) was killed by {sig.name} in "
                     r"step \d+: ", message), message
    fix = {signal.SIGKILL: "lower data.num_workers (0 builds them in the rank itself), "
                           "or give the job more host memory",
           signal.SIGBUS: "`docker run --shm-size=8g`"}[sig]
    assert fix in message, message
    assert re.search(rf"The same command then resumes from {run_dir}/global_step_\d+$", message), message


def test_non_finite_loss_lets_the_save_in_flight_commit(data, tmp_path):
    """lr=1e30 without clipping: step 1's update is applied and saved in the background, step 2's
    loss is not finite (exit 4). The save of step 1 commits before the run stops, and the message
    sends the user there. Its write is still in flight when step 2 ends (the first background save
    of a run with writer processes starts them, a process each importing torch: seconds), which its
    record shows: the loop waited for its write (awaited), where a save written before step 2's end
    commits at that step's boundary."""
    run_dir = tmp_path / "run"
    proc = run_sfttrain(2, job(data, run_dir, "optim.lr=1e30", "optim.clip_grad=0", "trainer.save_freq=1",
                               "trainer.async_save_writer=process"),
                        check=False)
    message = one_message(proc, 4)
    assert "non-finite loss" in message and "at step 2 " in message, message
    expected = f"check those rows. The same command then resumes from {run_dir / 'global_step_1'}"
    assert message.endswith(expected), message
    assert checkpoint_folder.is_complete(str(run_dir / "global_step_1"))
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".global_step")]
    [record] = [m for m in read_metrics(run_dir) if m.get("event") == "checkpoint"]
    assert record["step"] == 1 and record["async"] and record["awaited"], record


def test_a_dcp_writer_thread_that_fails_fails_the_write(tmp_path, capfd):
    """DCP's extra writer threads (trainer.save_thread_count > 1) died with a traceback, and DCP committed
    without their items: write_shards raises the file's error instead, and no traceback is printed. One
    file of the four is a folder (its open fails); which thread takes it varies, so each is tried."""
    from sfttrain.checkpoint_writer import write_shards

    state_dict = {f"w{i}": torch.full((1000,), float(i)) for i in range(8)}
    for blocked in range(4):
        tmp = tmp_path / str(blocked)
        (tmp / f"__0_{blocked}.distcp").mkdir(parents=True)
        with pytest.raises(IsADirectoryError, match=f"__0_{blocked}.distcp"):
            write_shards(state_dict, str(tmp), 4, None, True)
    assert "Traceback" not in capfd.readouterr().err
    written = write_shards(state_dict, str(tmp_path / "whole"), 4, None, True)
    assert written > 0 and sorted(p.name for p in (tmp_path / "whole").glob("*.distcp")) == \
        [f"__0_{i}.distcp" for i in range(4)]
