"""Where a profiled step's time went, from a Chrome trace that trainer.profile_steps wrote.

    python -m bench.trace_report RUN_DIR/profile/steps_6-7_rank0.json

Kernel time by kind, GEMMs by factor shapes with the FLOP rate each reached, and the GPU's idle
gaps with their cause: whether the host launched late (inside which operators) or the device
waited. The steps are the trace's `sfttrain step N` ranges; on CPU only the GEMMs are reported.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math

DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of what the GPU runs
HOST_LAUNCH = ("cuda_runtime", "cuda_driver")  # the host's calls that queue it
# kernel kinds by name, first match wins: inductor's triton_... kernels may be named after an attention op they feed
KINDS = (("triton", ("triton",)), ("attention", ("flash", "fmha", "sdpa", "attn")), ("communication", ("nccl",)),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitk")), ("copy", ("memcpy", "memset")))
# the matrix-product operators and the positions of their two factors among "Input Dims"
GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                 "aten::_scaled_mm": (0, 1)}


def report(events: list[dict]) -> list[str]:
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("sfttrain step")]
    steps = max(len(ranges), 1)
    device = [e for e in events if e.get("cat") in DEVICE_ACTIVITY]
    lines = []
    if ranges:
        wall = (max(e["ts"] + e["dur"] for e in ranges) - min(e["ts"] for e in ranges)) / steps
        lines.append(f"{steps} steps, host wall {wall / 1e3:.1f} ms/step")
    if device:
        busy = sum(e.get("dur", 0) for e in device) / steps
        lines.append(f"GPU kernels {busy / 1e3:.1f} ms/step")
        lines += kernel_kinds(device, steps)
    lines += gemm_shapes(events, steps)
    return lines + (idle_gaps(events, steps) if device else [])


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lower for m in marks)), "other")


def kernel_kinds(device: list[dict], steps: int) -> list[str]:
    time_of, count_of = collections.Counter(), collections.Counter(kernel_kind(e["name"]) for e in device)
    for e in device:
        time_of[kernel_kind(e["name"])] += e.get("dur", 0)
    return ["kernel time by kind, per step:"] + [
        f"  {kind:14s} {us / 1e3 / steps:9.2f} ms  {count_of[kind] / steps:7.0f} kernels"
        for kind, us in time_of.most_common()]


def gemm_shapes(events: list[dict], steps: int, top: int = 12) -> list[str]:
    """GEMM time by factor shapes with the FLOP rate reached: on a GPU the kernels each GEMM operator
    launched (split-K's reduction too), on CPU the operator's own time. Inductor's C++ wrapper calls
    cuBLAS with no operator recorded: those kernels are counted apart."""
    ops = [e for e in events if e.get("cat") == "cpu_op" and e["name"] in GEMM_OPERANDS and gemm_factors(e)]
    device = [e for e in events if e.get("cat") in DEVICE_ACTIVITY]
    calls = collections.Counter(gemm_factors(op) for op in ops)
    time_of, unattributed = collections.Counter(), 0
    for op in ops if not device else []:
        time_of[gemm_factors(op)] += op.get("dur", 0)
    launcher = LaunchingOperator(events, ops)
    for kernel in device:
        op = launcher.of(kernel)
        if op is not None:
            time_of[gemm_factors(op)] += kernel.get("dur", 0)
        elif kernel_kind(kernel["name"]) == "gemm":
            unattributed += kernel.get("dur", 0)
    if not time_of:
        return []
    where = "the kernels each launched" if device else "the operators' own time on this CPU"
    lines = [f"GEMMs by factor shapes ({where}), per step:"]
    for factors, us in time_of.most_common(top):
        lines.append(f"  {us / 1e3 / steps:9.2f} ms  {calls[factors] / steps:6.0f} calls  "
                     f"{gemm_flops(factors) * calls[factors] / max(us, 1e-9) / 1e6:7.1f} TFLOP/s  "
                     f"{' x '.join(str(list(f)) for f in factors)}")
    total, products = sum(time_of.values()), sum(gemm_flops(f) * n for f, n in calls.items())
    lines.append(f"  {total / 1e3 / steps:9.2f} ms  {sum(calls.values()) / steps:6.0f} calls  "
                 f"{products / max(total, 1e-9) / 1e6:7.1f} TFLOP/s  all {len(time_of)} shapes")
    if unattributed:
        lines.append(f"  {unattributed / 1e3 / steps:9.2f} ms of GEMM kernels launched outside a GEMM operator "
                     "(inductor's C++ wrapper; model.compile_cpp_wrapper=false names their shapes)")
    return lines


def gemm_factors(op: dict) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    dims = op.get("args", {}).get("Input Dims", [])
    a, b = GEMM_OPERANDS[op["name"]]
    if len(dims) <= b or len(dims[a]) not in (2, 3) or len(dims[b]) != len(dims[a]):
        return None
    return tuple(dims[a]), tuple(dims[b])


def gemm_flops(factors: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    return 2 * math.prod(factors[0]) * factors[1][-1]


class LaunchingOperator:
    """The GEMM operator around a kernel's launch call on its thread (GEMMs do not nest: the last one
    begun before the launch, if it still runs)."""

    def __init__(self, events: list[dict], ops: list[dict]):
        self.launches = launches_by_correlation(events)
        self.by_thread: dict = collections.defaultdict(list)
        for op in sorted(ops, key=lambda e: e["ts"]):
            self.by_thread[op.get("tid")].append(op)
        self.starts = {tid: [op["ts"] for op in thread] for tid, thread in self.by_thread.items()}

    def of(self, kernel: dict) -> dict | None:
        launch = self.launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None or launch.get("tid") not in self.by_thread:
            return None
        thread = self.by_thread[launch["tid"]]
        i = bisect.bisect_right(self.starts[launch["tid"]], launch["ts"]) - 1
        if i < 0 or thread[i]["ts"] + thread[i].get("dur", 0) < launch["ts"]:
            return None
        return thread[i]


def idle_gaps(events: list[dict], steps: int, top: int = 8) -> list[str]:
    """The GPU's idle time between activities per step, and the largest gaps with their cause."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_ACTIVITY), key=lambda e: e["ts"])
    gaps, end, before = [], device[0]["ts"] + device[0].get("dur", 0), device[0]
    for e in device[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, before["name"], e))
        if e["ts"] + e.get("dur", 0) > end:
            end, before = e["ts"] + e.get("dur", 0), e
    lines = [f"GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3 / steps:.1f} ms/step "
             f"({sum(g[0] > 100 for g in gaps) / steps:.0f} gaps over 100 us per step); largest:"]
    launches = launches_by_correlation(events)
    host_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    for gap, start, before_name, after in sorted(gaps, key=lambda g: g[0], reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:7.2f} ms after {before_name[:60]!r} before {after['name'][:60]!r}")
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None:
            lines.append(f"            {gap_cause(start, launch, host_ops)}")
    return lines


def launches_by_correlation(events: list[dict]) -> dict:
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in HOST_LAUNCH and "correlation" in e.get("args", {})}


def gap_cause(gap_start: float, launch: dict, host_ops: list[dict], top: int = 3) -> str:
    """A kernel launched after the GPU fell idle waited for the host: the launching thread's operators
    in that interval (not those around all of it) by time. One launched before waited on the device."""
    late = launch["ts"] - gap_start
    if late <= 0:
        return f"launched {-late / 1e3:.2f} ms before: the device waited, not the host"
    overlap = collections.Counter()
    for op in host_ops:
        op_start, op_end = op["ts"], op["ts"] + op.get("dur", 0)
        if op.get("tid") != launch.get("tid") or op_end <= gap_start or op_start >= launch["ts"]:
            continue
        if op_start <= gap_start and op_end >= launch["ts"]:
            continue  # around the whole interval: the context, not the cause
        overlap[op_label(op)] += min(op_end, launch["ts"]) - max(op_start, gap_start)
    busy = ", ".join(f"{name} {us / 1e3:.2f} ms" for name, us in overlap.most_common(top)) or "no operator"
    return f"launched {late / 1e3:.2f} ms into it: the host was late, meanwhile in {busy}"


def op_label(op: dict) -> str:
    """`aten::mul [13568, 896] x []`: the shapes tell one operator's calls apart."""
    dims = [d for d in op.get("args", {}).get("Input Dims", []) if isinstance(d, list)]
    shapes = " x ".join(str(d) for d in dims[:3])
    return f"{op['name'][:50]} {shapes}".rstrip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace from <run folder>/profile/")
    with open(ap.parse_args(argv).trace) as f:
        print("\n".join(report(json.load(f)["traceEvents"])))


if __name__ == "__main__":
    main()
