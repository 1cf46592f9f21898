"""trainer.profile_steps: where a step's time goes, from torch.profiler over a window of steps.

Every rank records its host operators and (on CUDA) its kernels over the consecutive steps named,
writes a Chrome trace (open it in https://ui.perfetto.dev) into <run folder>/profile/, and rank 0
prints a summary: wall time and kernel time per step, kernel time by kind (GEMM, attention,
Triton, communication, copies), the top kernels, and where the GPU sat idle between them. Each
step is a range of its own in the trace ("sfttrain step N").

The window ends with a device synchronisation, so that its last kernels are in the trace: the step
after it starts with an empty queue (one step's worth of the host/device overlap is lost).
"""

from __future__ import annotations

import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sfttrain.errors import ConfigError

PROFILE_DIR = "profile"
SUMMARY = "summary.txt"
# kernel kinds by name, first match wins (cuDNN's attention kernels are named ...sdpa...; cuBLAS's
# GEMMs nvjet/sm90_xmma/cutlass; inductor's own kernels triton_...)
KINDS = (("attention", ("flash", "fmha", "sdpa", "attn")), ("communication", ("nccl",)),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitk")), ("triton", ("triton",)),
         ("copy", ("memcpy", "memset")))


def check_window(steps: list[int] | None, total_steps: int) -> None:
    """The window lies within the run (it is known once the data is planned)."""
    if steps and max(steps) > total_steps:
        raise ConfigError(f"trainer.profile_steps={steps}: the run has {total_steps} steps; name steps within it")


def describe(steps: list[int] | None, run_dir: str, steps_done: int) -> list[str]:
    """The start-up line (none when off)."""
    if not steps:
        return []
    where = os.path.join(run_dir, PROFILE_DIR)
    if max(steps) <= steps_done:
        return [f"  profile             : steps {window_name(steps)} ran before this resume (after step {steps_done}): "
                "nothing is profiled"]
    return [f"  profile             : steps {window_name(steps)} (torch.profiler), a trace per rank and a summary in "
            f"{where}"]


def window_name(steps: list[int]) -> str:
    return f"{min(steps)}-{max(steps)}" if len(steps) > 1 else str(steps[0])


class StepProfiler:
    """Starts the profiler before the window's first step run (a resume may start inside it) and
    stops it after its last."""

    def __init__(self, steps: list[int] | None, run_dir: str, rank: int, device: torch.device, info):
        self.steps = sorted(steps or [])
        self.folder = os.path.join(run_dir, PROFILE_DIR)
        self.rank, self.device, self.info = rank, device, info
        self.prof = self.step_range = None
        self.start, self.profiled = 0.0, []

    def before_step(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.prof is None:
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])]
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.start = time.perf_counter()
        self.step_range = record_function(f"sfttrain step {step}")
        self.step_range.__enter__()
        self.profiled.append(step)

    def after_step(self, step: int) -> None:
        if self.step_range is None:
            return
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step == self.steps[-1]:
            self.stop()

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels finish inside it
        wall = (time.perf_counter() - self.start) / len(self.profiled)
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        name = window_name(self.profiled)
        trace = os.path.join(self.folder, f"steps_{name}_rank{self.rank}.json")
        self.prof.export_chrome_trace(trace)
        if self.rank == 0:
            text = summarise(self.prof, trace, wall, len(self.profiled))
            with open(os.path.join(self.folder, SUMMARY), "w") as f:
                f.write(text + "\n")
            self.info(f"profile of steps {name} (trace {trace}):\n{text}")
        self.prof = None


def summarise(prof, trace: str, wall: float, steps: int) -> str:
    """Rank 0's summary: kernels by kind and the idle gaps from the trace, the top operators."""
    with open(trace) as f:
        device = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = [f"wall {wall * 1e3:.1f} ms/step"]
    if device:
        busy = sum(e.get("dur", 0) for e in device) / 1e6 / steps
        lines[0] += f", GPU kernels {busy * 1e3:.1f} ms/step ({100 * busy / wall:.0f}% of the wall time)"
        lines += kernel_kinds(device, steps) + idle_gaps(device, steps)
        sort_by = "self_device_time_total"
    else:
        sort_by = "self_cpu_time_total"  # a CPU run: the host's operators are the work
    lines.append(prof.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=70))
    return "\n".join(lines)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lower for m in marks)), "other")


def kernel_kinds(device: list[dict], steps: int) -> list[str]:
    time_of, count_of = collections.Counter(), collections.Counter()
    for e in device:
        kind = kernel_kind(e["name"])
        time_of[kind] += e.get("dur", 0)
        count_of[kind] += 1
    return ["kernel time by kind, per step:"] + [
        f"  {kind:14s} {us / 1e3 / steps:9.2f} ms  {count_of[kind] / steps:7.0f} kernels"
        for kind, us in time_of.most_common()]


def idle_gaps(device: list[dict], steps: int, top: int = 8) -> list[str]:
    """Where the GPU waits: the gaps between consecutive device activities, in total per step
    and the largest ones with the kernels on either side."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in device)
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    lines = [f"GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3 / steps:.1f} ms/step "
             f"({sum(g[0] > 100 for g in gaps) / steps:.0f} gaps over 100 us per step); largest:"]
    lines += [f"  {gap / 1e3:7.2f} ms after {before[:60]!r} before {after[:60]!r}"
              for gap, before, after in sorted(gaps, reverse=True)[:top]]
    return lines
