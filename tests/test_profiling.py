"""trainer.profile_steps (sfttrain/profiling.py): a trace per rank and a summary of the window's
steps, and training that computes what it computes unprofiled; bench.trace_report reads the trace,
bench.memory_peak the allocator's snapshot."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

from sfttrain.config import ConfigError, TrainerConfig, load_config
from bench.memory_peak import allocation_site, describe_peak, live_at_peak
from bench.memory_peak import report as memory_report
from bench.trace_report import report
from sfttrain.profiling import StepProfiler, describe
from tests.conftest import run_sfttrain, train_losses, two_rank_job


def test_profiled_steps_leave_a_trace_per_rank_a_summary_and_the_same_losses(gsm8k_head, tmp_path, two_rank_run):
    """two_rank_job (3 steps) with steps 2-3 profiled: each rank's Chrome trace holds those two
    steps' ranges (not step 1's) with the matrix products inside them, rank 0 prints and writes the
    summary, and the losses are those of conftest's unprofiled run of the same job."""
    run_dir = tmp_path / "run"
    proc = run_sfttrain(2, two_rank_job(gsm8k_head, run_dir, "trainer.profile_steps=[2,3]"))
    assert f"profile             : steps 2-3 (torch.profiler), a trace per rank and a summary in {run_dir}/profile" \
        in proc.stdout
    for rank in (0, 1):
        events = json.loads((run_dir / "profile" / f"steps_2-3_rank{rank}.json").read_text())["traceEvents"]
        steps = sorted(e["name"] for e in events if e["name"].startswith("sfttrain step"))
        assert steps == ["sfttrain step 2", "sfttrain step 3"]
        assert sum(e["name"] in ("aten::mm", "aten::addmm") for e in events) > 0
    summary = (run_dir / "profile" / "summary.txt").read_text()
    assert summary.startswith("wall ") and "ms/step" in summary and "Self CPU" in summary
    trace = json.loads((run_dir / "profile" / "steps_2-3_rank0.json").read_text())["traceEvents"]
    lines = report(trace)
    assert lines[0].startswith("2 steps, host wall ") and lines[1] == (
        "GEMMs by factor shapes (the operators' own time on this CPU), per step:"), lines
    # stories260K's head (64 -> 512) in the loss's chunks, the packed tokens with a target on one side
    assert any(re.search(r"TFLOP/s  \[\d+, 64\] x \[64, 512\]$", line) for line in lines), lines
    assert f"profile of steps 2-3 (trace {run_dir}/profile/steps_2-3_rank0.json)" in proc.stdout
    assert train_losses(run_dir) == train_losses(two_rank_run)


def test_a_resume_inside_the_window_profiles_the_steps_it_runs(tmp_path):
    """Window 2-4, resumed after step 2: steps 3 and 4 are profiled (a matrix product each, standing
    in for a step); resumed after step 4, nothing is, and start-up says so."""
    said = []
    window = TrainerConfig(profile_steps=[2, 3, 4])
    profiler = StepProfiler(window, str(tmp_path), 0, torch.device("cpu"), said.append)
    for step in (3, 4, 5):
        profiler.before_step(step)
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.after_step(step)
    events = json.loads((tmp_path / "profile" / "steps_3-4_rank0.json").read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e["name"].startswith("sfttrain step")) == ["sfttrain step 3",
                                                                                           "sfttrain step 4"]
    assert sum(e["name"] == "aten::mm" for e in events) == 2
    assert len(said) == 1 and said[0].startswith(
        f"profile of steps 3-4 (trace {tmp_path}/profile/steps_3-4_rank0.json)")
    assert describe(window, str(tmp_path), 4, torch.device("cpu")) == [
        "  profile             : steps 2-4 ran before this resume (after step 4): nothing is profiled"]


def test_the_allocators_history_replays_to_its_peak():
    """Made-up allocator events: 100 allocated and freed, then 50 and 80 (130, the peak, both live),
    a block from before the window freed (40: the count goes to 90) and 30 allocated (120)."""
    events = [{"action": "alloc", "addr": 1, "size": 100}, {"action": "free_requested", "addr": 1, "size": 100},
              {"action": "free_completed", "addr": 1, "size": 100}, {"action": "alloc", "addr": 2, "size": 50},
              {"action": "alloc", "addr": 3, "size": 80}, {"action": "free_requested", "addr": 9, "size": 40},
              {"action": "alloc", "addr": 4, "size": 30}]
    peak, live = live_at_peak(events)
    assert peak == 130 and sorted(e["addr"] for e in live) == [2, 3]
    peak, live = live_at_peak(events + [{"action": "alloc", "addr": 5, "size": 11}])  # 131: a later peak
    assert peak == 131 and sorted(e["addr"] for e in live) == [2, 3, 4, 5]
    frames = [{"filename": "/site/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
              {"filename": "/site/transformers/models/llama/modeling_llama.py", "line": 171, "name": "forward"}]
    assert allocation_site(frames) == "/site/transformers/models/llama/modeling_llama.py:171 forward"
    assert allocation_site(frames[:1]) == "torch" and allocation_site([]) == "(no stack)"
    # in units of 16 MiB, with 1 GiB allocated before: the peak's live blocks by site, largest first
    # (2 and 3 made by the model, 4 and 5 with no stack)
    made = [{**e, "size": e["size"] * 2**24, **({"frames": frames} if e["addr"] in (2, 3) else {})}
            for e in events + [{"action": "alloc", "addr": 5, "size": 11}]]
    assert describe_peak(made, 2**30) == [
        "peak allocated in the window 3.05 GiB (1.00 GiB allocated before it); of the window's own allocations live "
        "at the peak, by where they were made:",
        "      2.03 GiB in     2 blocks  /site/transformers/models/llama/modeling_llama.py:171 forward",
        "      0.64 GiB in     2 blocks  (no stack)"]
    # the snapshot's segments hold 4 GiB at its end, the events added 131 x 16 MiB: 1.95 GiB before the window
    segments = [{"device": 0, "allocated_size": 3 * 2**30}, {"device": 0, "allocated_size": 2**30},
                {"device": 1, "allocated_size": 2**33}]
    assert memory_report({"device_traces": [made], "segments": segments})[:2] == [
        "cuda:0", "peak allocated in the window 4.00 GiB (1.95 GiB allocated before it); of the window's own "
        "allocations live at the peak, by where they were made:"]


def test_profile_memory_needs_the_window_and_a_gpu():
    with pytest.raises(ConfigError, match=r"trainer.profile_memory=true records memory over trainer.profile_steps"):
        load_config(None, ["data.train_files=x", "model.partial_pretrain=y", "trainer.profile_memory=true"])
    memory = TrainerConfig(profile_steps=[3], profile_memory=True)
    assert "none on this CPU run" in describe(memory, "run", 0, torch.device("cpu"))[0]
    assert "the allocator's history (trainer.profile_memory)" in describe(memory, "run", 0, torch.device("cuda", 0))[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's history is CUDA's")
def test_profile_memory_on_a_gpu_names_the_peak(gsm8k_head, tmp_path):
    """One GPU, steps 2-3 with the allocator's history: a snapshot file whose peak (bench.memory_peak)
    is no lower than what was allocated before the window, with the window's allocations by site."""
    run_dir = tmp_path / "run"
    proc = run_sfttrain(1, two_rank_job(gsm8k_head, run_dir, "trainer.device=cuda", "trainer.profile_steps=[2,3]",
                                        "trainer.profile_memory=true", "model.fsdp_config.mixed_precision=true"),
                        env={"CUDA_VISIBLE_DEVICES": "0"})
    snapshot = run_dir / "profile" / "memory_steps_2-3_rank0.pickle"
    assert f"memory snapshot {snapshot} (" in (run_dir / "profile" / "summary.txt").read_text()
    summary = "\n".join(memory_report(pickle.loads(snapshot.read_bytes())))
    peak, before = map(float, re.search(r"peak allocated in the window ([\d.]+) GiB \(([\d.]+) GiB", summary).groups())
    assert peak >= before > 0 and "blocks" in summary, summary
    text = "\n".join(report(json.loads((run_dir / "profile" / "steps_2-3_rank0.json").read_text())["traceEvents"]))
    assert "GPU kernels" in text and "gemm" in text, proc.stdout[-3000:]
    assert "GEMMs by factor shapes (the kernels each launched), per step:" in text, text  # eager: aten's GEMMs
    assert re.search(r"launched [\d.]+ ms (into it|before)", text), text  # each large gap's cause


@pytest.mark.parametrize("steps", ["[0,1]", "[2,4]", "[3,3]"])
def test_profile_steps_must_be_one_window(steps):
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=.*consecutive step numbers"):
        load_config(None, ["data.train_files=x", "model.partial_pretrain=y", f"trainer.profile_steps={steps}"])
