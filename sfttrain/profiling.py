"""trainer.profile_steps: where a step's time goes, from torch.profiler over a window of steps.

Every rank writes a Chrome trace (https://ui.perfetto.dev) into <run folder>/profile/; rank 0 prints
a summary: kernel time by kind, GEMMs by operand shapes with the FLOP rate each reached, the top
operators, and for the largest idle gaps whether the host launched late (inside which operators) or
the device waited. trainer.profile_memory (CUDA) also saves the allocator's history for
https://pytorch.org/memory_viz and names what is live at the window's peak; its stacks slow the host.
The window ends with a device synchronisation so that its last kernels are in the trace.
"""

from __future__ import annotations

import bisect
import collections
import json
import math
import os
import pickle
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sfttrain.config import TrainerConfig
from sfttrain.errors import ConfigError

PROFILE_DIR = "profile"
SUMMARY = "summary.txt"
MEMORY_EVENTS = 1_000_000  # allocator events kept at most (several KB each with their stacks)
GIB = 2**30
DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of what the GPU runs
HOST_LAUNCH = ("cuda_runtime", "cuda_driver")  # the host's calls that queue it
# kernel kinds by name, first match wins: inductor's triton_... kernels may be named after an attention op they feed
KINDS = (("triton", ("triton",)), ("attention", ("flash", "fmha", "sdpa", "attn")), ("communication", ("nccl",)),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitk")), ("copy", ("memcpy", "memset")))

# the matrix-product operators and the positions of their two factors among "Input Dims"
GEMM_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                 "aten::_scaled_mm": (0, 1)}


def check_window(steps: list[int] | None, total_steps: int) -> None:
    if steps and max(steps) > total_steps:
        raise ConfigError(f"trainer.profile_steps={steps}: the run has {total_steps} steps; name steps within it")


def describe(t: TrainerConfig, run_dir: str, steps_done: int, device: torch.device) -> list[str]:
    steps = t.profile_steps
    if not steps:
        return []
    if passed := window_passed(steps, steps_done):
        return [f"  profile             : {passed}"]
    memory = ""
    if t.profile_memory:
        memory = (", the allocator's history (trainer.profile_memory)" if device.type == "cuda" else
                  "; trainer.profile_memory records a CUDA allocator's history: none on this CPU run")
    return [f"  profile             : steps {window_name(steps)} (torch.profiler{memory}), a trace per rank and a "
            f"summary in {os.path.join(run_dir, PROFILE_DIR)}"]


def window_passed(steps: list[int] | None, steps_done: int) -> str | None:
    if steps and max(steps) <= steps_done:
        return f"steps {window_name(steps)} ran before this resume (after step {steps_done}): nothing is profiled"
    return None


def window_name(steps: list[int]) -> str:
    return f"{min(steps)}-{max(steps)}" if len(steps) > 1 else str(steps[0])


class StepProfiler:
    """From the window's first step run (a resume may start inside it) through its last."""

    def __init__(self, t: TrainerConfig, run_dir: str, rank: int, device: torch.device, info):
        self.steps = sorted(t.profile_steps or [])
        self.memory = t.profile_memory and device.type == "cuda"
        self.folder = os.path.join(run_dir, PROFILE_DIR)
        self.rank, self.device, self.info = rank, device, info
        self.prof = self.step_range = None
        self.start, self.profiled, self.allocated_before = 0.0, [], 0

    def before_step(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.prof is None:
            self.start_window()
        self.step_range = record_function(f"sfttrain step {step}")
        self.step_range.__enter__()
        self.profiled.append(step)

    def start_window(self) -> None:
        if self.memory:
            self.allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_EVENTS)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])]
        self.prof = profile(activities=activities, record_shapes=True)  # the shapes tell one operator's calls apart
        self.prof.__enter__()
        self.start = time.perf_counter()

    def after_step(self, step: int) -> bool:
        """True once the window has ended (writing its trace took seconds not the next step's)."""
        if self.step_range is None:
            return False
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step == self.steps[-1]:
            self.stop()
            return True
        return False

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels finish inside it
        wall = (time.perf_counter() - self.start) / len(self.profiled)
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        name = window_name(self.profiled)
        trace = os.path.join(self.folder, f"steps_{name}_rank{self.rank}.json")
        self.prof.export_chrome_trace(trace)
        memory = self.stop_memory(name) if self.memory else []
        if self.rank == 0:
            text = "\n".join([summarise(self.prof, trace, wall, len(self.profiled)), *memory])
            with open(os.path.join(self.folder, SUMMARY), "w") as f:
                f.write(text + "\n")
            self.info(f"profile of steps {name} (trace {trace}):\n{text}")
        self.prof = None

    def stop_memory(self, name: str) -> list[str]:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        path = os.path.join(self.folder, f"memory_steps_{name}_rank{self.rank}.pickle")
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        events = snapshot["device_traces"][self.device.index or 0]
        return [f"memory snapshot {path} (open it in https://pytorch.org/memory_viz)",
                *describe_peak(events, self.allocated_before)]


def describe_peak(events: list[dict], allocated_before: int, top: int = 10) -> list[str]:
    """The window's peak allocated memory and, by where they were made, its allocations live then."""
    peak, live = live_at_peak(events)
    by_place: dict[str, list[int]] = collections.defaultdict(list)
    for event in live:
        by_place[allocation_site(event.get("frames", []))].append(event["size"])
    lines = [f"peak allocated in the window {(allocated_before + peak) / GIB:.2f} GiB ({allocated_before / GIB:.2f} "
             f"GiB allocated before it); of the window's own allocations live at the peak, by where they were made:"]
    largest = sorted(by_place.items(), key=lambda item: -sum(item[1]))[:top]
    lines += [f"  {sum(sizes) / GIB:8.2f} GiB in {len(sizes):5d} blocks  {place}" for place, sizes in largest]
    return lines


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """The most bytes allocated beyond the window's start (alloc and free_requested events, as
    memory_allocated counts them) and the window's allocations live then."""
    current, peak, peak_at, live = 0, 0, -1, {}
    for i, event in enumerate(events):
        current += {"alloc": 1, "free_requested": -1}.get(event["action"], 0) * event["size"]
        if current > peak:
            peak, peak_at = current, i
    for event in events[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, list(live.values())


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame outside torch, as file:line function."""
    for frame in frames:
        if f"{os.sep}torch{os.sep}" not in frame["filename"]:
            return f"{frame['filename']}:{frame['line']} {frame['name']}"
    return "torch" if frames else "(no stack)"


def summarise(prof, trace: str, wall: float, steps: int) -> str:
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("cat") in DEVICE_ACTIVITY]
    lines = [f"wall {wall * 1e3:.1f} ms/step"]
    if device:
        busy = sum(e.get("dur", 0) for e in device) / 1e6 / steps
        lines[0] += f", GPU kernels {busy * 1e3:.1f} ms/step ({100 * busy / wall:.0f}% of the wall time)"
    lines += (kernel_kinds(device, steps) if device else []) + gemm_shapes(events, steps)
    lines += idle_gaps(events, steps) if device else []
    sort_by = "self_device_time_total" if device else "self_cpu_time_total"  # on CPU the operators are the work
    lines.append(prof.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=70))
    return "\n".join(lines)


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
