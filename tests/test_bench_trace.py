"""bench.trace_report on made-up traces (microseconds): kernels by kind, GPU idle gaps with their
cause, GEMM time by the shapes of the operator that launched it. tests/test_profiling.py runs it on
the traces a profiled run wrote."""

from __future__ import annotations

from bench.trace_report import gemm_shapes, idle_gaps, kernel_kind, kernel_kinds, report


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


def test_the_report_counts_the_steps_of_the_trace(tmp_path, capsys):
    """Two steps' ranges (0-400, 500-1000: 500 us a step on the host) around a 300 us GEMM kernel
    each: per step, one kernel of 0.30 ms and the GPU idle 0.2 ms between them; the command prints it."""
    import json

    from bench.trace_report import main

    events = [{"cat": "user_annotation", "name": f"sfttrain step {n}", "ts": ts, "dur": dur}
              for n, ts, dur in ((1, 0, 400), (2, 500, 500))]
    events += [{"cat": "kernel", "name": "nvjet_tst", "ts": ts, "dur": 300} for ts in (100, 600)]
    lines = report(events)
    assert lines[:4] == ["2 steps, host wall 0.5 ms/step", "GPU kernels 0.3 ms/step", "kernel time by kind, per step:",
                         "  gemm                0.30 ms        1 kernels"], lines
    assert lines[4].startswith("GPU idle between kernels: 0.1 ms/step") and lines[5:] == [
        "     0.20 ms after 'nvjet_tst' before 'nvjet_tst'"], lines
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    main([str(tmp_path / "trace.json")])
    assert capsys.readouterr().out.splitlines() == lines
