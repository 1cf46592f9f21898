"""trainer.profile_steps (sfttrain/profiling.py): a trace per rank and a summary of the window's
steps, and training that computes what it computes unprofiled."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sfttrain.config import ConfigError, TrainerConfig, load_config
from sfttrain.profiling import (StepProfiler, allocation_site, describe, gemm_shapes, idle_gaps, kernel_kind,
                                kernel_kinds, live_at_peak)
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
    # stories260K's head (64 -> 512) in the loss's chunks, the packed tokens with a target on one side
    assert "GEMMs by factor shapes (the operators' own time on this CPU), per step:" in summary
    assert re.search(r"TFLOP/s  \[\d+, 64\] x \[64, 512\]", summary), summary
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


def test_profile_memory_needs_the_window_and_a_gpu():
    with pytest.raises(ConfigError, match=r"trainer.profile_memory=true records memory over trainer.profile_steps"):
        load_config(None, ["data.train_files=x", "model.partial_pretrain=y", "trainer.profile_memory=true"])
    memory = TrainerConfig(profile_steps=[3], profile_memory=True)
    assert "none on this CPU run" in describe(memory, "run", 0, torch.device("cpu"))[0]
    assert "the allocator's history (trainer.profile_memory)" in describe(memory, "run", 0, torch.device("cuda", 0))[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's history is CUDA's")
def test_profile_memory_on_a_gpu_names_the_peak(gsm8k_head, tmp_path):
    """One GPU, steps 2-3 with the allocator's history: a snapshot file, and the summary's peak no
    lower than what was allocated before the window, with the window's allocations by site."""
    run_dir = tmp_path / "run"
    proc = run_sfttrain(1, two_rank_job(gsm8k_head, run_dir, "trainer.device=cuda", "trainer.profile_steps=[2,3]",
                                        "trainer.profile_memory=true", "model.fsdp_config.mixed_precision=true"),
                        env={"CUDA_VISIBLE_DEVICES": "0"})
    assert (run_dir / "profile" / "memory_steps_2-3_rank0.pickle").is_file()
    summary = (run_dir / "profile" / "summary.txt").read_text()
    peak, before = map(float, re.search(r"peak allocated in the window ([\d.]+) GiB \(([\d.]+) GiB", summary).groups())
    assert peak >= before > 0 and "blocks" in summary, summary
    assert "GPU kernels" in summary and "gemm" in summary, proc.stdout[-3000:]
    assert "GEMMs by factor shapes (the kernels each launched), per step:" in summary, summary  # eager: aten's GEMMs
    assert re.search(r"launched [\d.]+ ms (into it|before)", summary), summary  # each large gap's cause


@pytest.mark.parametrize("steps", ["[0,1]", "[2,4]", "[3,3]"])
def test_profile_steps_must_be_one_window(steps):
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=.*consecutive step numbers"):
        load_config(None, ["data.train_files=x", "model.partial_pretrain=y", f"trainer.profile_steps={steps}"])


def test_kernels_are_grouped_by_kind_and_idle_gaps_measured():
    """A made-up timeline of one step (microseconds): a GEMM, a gap of 50, attention, a gap of 200, a
    Triton kernel overlapping an NCCL kernel; the kinds by name (cuDNN's attention says sdpa)."""
    names = ["sm90_xmma_gemm_bf16bf16", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
             "triton_poi_fused__scaled_dot_product_cudnn_attention_transpose_0",
             "ncclDevKernel_AllReduce_Sum_f32", "Memcpy DtoH (Device -> Pinned)", "void at::native::elementwise_kernel"]
    assert [kernel_kind(n) for n in names] == ["gemm", "attention", "triton", "communication", "copy", "other"]
    timeline = [{"cat": "kernel", "name": names[0], "ts": 0, "dur": 100},
                {"cat": "kernel", "name": names[1], "ts": 150, "dur": 100, "args": {"correlation": 2}},
                {"cat": "kernel", "name": names[2], "ts": 450, "dur": 100, "args": {"correlation": 3}},
                {"cat": "kernel", "name": names[3], "ts": 500, "dur": 300}]
    assert kernel_kinds(timeline, 1)[1:] == ["  communication       0.30 ms        1 kernels",
                                             "  gemm                0.10 ms        1 kernels",
                                             "  attention           0.10 ms        1 kernels",
                                             "  triton              0.10 ms        1 kernels"]
    # the host: the attention kernel queued at 70 (before the GPU fell idle at 100); the Triton
    # kernel queued at 440, 190 into the 200 us gap, the host meanwhile in a copy (60 us of it in
    # the gap) and a compiled region (100), both inside a step's range (the context)
    host = [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 70, "dur": 5, "tid": 1,
             "args": {"correlation": 2}},
            {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 440, "dur": 5, "tid": 1,
             "args": {"correlation": 3}},
            {"cat": "user_annotation", "name": "sfttrain step 1", "ts": 0, "dur": 900, "tid": 1},
            {"cat": "cpu_op", "name": "aten::copy_", "ts": 200, "dur": 110, "tid": 1,
             "args": {"Input Dims": [[13568, 896], [13568, 896], []]}},
            {"cat": "cpu_op", "name": "Torch-Compiled Region: 0/1", "ts": 330, "dur": 200, "tid": 1},
            {"cat": "cpu_op", "name": "aten::mm", "ts": 300, "dur": 50, "tid": 2}]  # another thread's
    gaps = idle_gaps(timeline + host, 1)
    assert gaps[0] == "GPU idle between kernels: 0.2 ms/step (1 gaps over 100 us per step); largest:"
    assert gaps[1].strip().startswith("0.20 ms after 'cudnn_generated") and "before 'triton_poi" in gaps[1]
    assert gaps[2].strip() == ("launched 0.19 ms into it: the host was late, meanwhile in "
                               "Torch-Compiled Region: 0/1 0.11 ms, "
                               "aten::copy_ [13568, 896] x [13568, 896] x [] 0.06 ms")
    assert gaps[3].strip().startswith("0.05 ms after 'sm90_xmma")
    assert gaps[4].strip() == "launched 0.03 ms before: the device waited, not the host"


def test_gemm_time_goes_to_the_shapes_of_the_operator_that_launched_it():
    """A made-up trace of one step (microseconds): an mm [100, 200] x [200, 300] launching one kernel
    (20 us), an addmm of the same factors launching a split-K GEMM and its reduction (30 + 5 us), a
    bmm on the backward's thread (8 us), and a GEMM kernel launched outside any GEMM operator (12 us,
    as inductor's C++ wrapper calls cuBLAS), beside a Triton kernel that is no GEMM."""
    ops = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 1,
            "args": {"Input Dims": [[100, 200], [200, 300]]}},
           {"cat": "cpu_op", "name": "aten::addmm", "ts": 100, "dur": 50, "tid": 1,
            "args": {"Input Dims": [[300], [100, 200], [200, 300], [], []]}},
           {"cat": "cpu_op", "name": "aten::bmm", "ts": 200, "dur": 40, "tid": 2,
            "args": {"Input Dims": [[4, 100, 200], [4, 200, 300]]}}]
    launched = [(1, 1, 10, "nvjet_tst_128x64", 20), (2, 1, 110, "sm90_xmma_gemm_splitK", 30),
                (3, 1, 120, "splitKreduce_kernel", 5), (4, 2, 210, "nvjet_tst_64x8", 8),
                (5, 1, 300, "sm90_xmma_gemm_bf16", 12), (6, 1, 310, "triton_poi_fused_mul_0", 7)]
    trace = ops + [e for corr, tid, ts, name, dur in launched for e in (
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
         "args": {"correlation": corr}},
        {"cat": "kernel", "name": name, "ts": 1000 + ts, "dur": dur, "args": {"correlation": corr}})]
    # 2 x 100 x 300 x 200 = 12 MFLOP a product: twice in 55 us; the bmm's 4 x 12 MFLOP in 8 us
    assert gemm_shapes(trace, 1) == [
        "GEMMs by factor shapes (the kernels each launched), per step:",
        "       0.06 ms       2 calls      0.4 TFLOP/s  [100, 200] x [200, 300]",
        "       0.01 ms       1 calls      6.0 TFLOP/s  [4, 100, 200] x [4, 200, 300]",
        "       0.06 ms       3 calls      1.1 TFLOP/s  all 2 shapes",
        "       0.01 ms of GEMM kernels launched outside a GEMM operator (inductor's C++ wrapper; "
        "model.compile_cpp_wrapper=false names their shapes)"]
    # a CPU run: the operators' own time
    assert gemm_shapes(ops, 2)[1] == "       0.05 ms       1 calls      0.2 TFLOP/s  [100, 200] x [200, 300]"
