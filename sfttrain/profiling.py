"""trainer.profile_steps: torch.profiler over a window of steps.

Every rank writes a Chrome trace (https://ui.perfetto.dev) into <run folder>/profile/; rank 0 writes
and prints torch's operator table (`python -m bench.trace_report TRACE` breaks a trace down further).
trainer.profile_memory (CUDA) also saves the allocator's history for https://pytorch.org/memory_viz
(`python -m bench.memory_peak SNAPSHOT` names what is live at its peak); its stacks slow the host.
The window ends with a device synchronisation so that its last kernels are in the trace.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sfttrain.config import TrainerConfig
from sfttrain.errors import ConfigError

PROFILE_DIR = "profile"
SUMMARY = "summary.txt"
MEMORY_EVENTS = 1_000_000  # allocator events kept at most (several KB each with their stacks)


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
        self.start, self.profiled = 0.0, []

    def before_step(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.prof is None:
            if self.memory:  # private, but the documented way (https://pytorch.org/docs/stable/torch_cuda_memory.html)
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_EVENTS)
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])]
            self.prof = profile(activities=activities, record_shapes=True)  # shapes tell an operator's calls apart
            self.prof.__enter__()
            self.start = time.perf_counter()
        self.step_range = record_function(f"sfttrain step {step}")
        self.step_range.__enter__()
        self.profiled.append(step)

    def after_step(self, step: int) -> bool:
        """True once the window has ended (writing its trace took seconds not the next step's)."""
        if self.step_range is None:
            return False
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step == self.steps[-1]:
            self.stop()
        return step == self.steps[-1]

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels finish inside it
        wall = (time.perf_counter() - self.start) / len(self.profiled)
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        name = window_name(self.profiled)
        trace = os.path.join(self.folder, f"steps_{name}_rank{self.rank}.json")
        self.prof.export_chrome_trace(trace)
        memory = []
        if self.memory:  # private, as _record_memory_history
            snapshot = os.path.join(self.folder, f"memory_steps_{name}_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            memory = [f"memory snapshot {snapshot} (https://pytorch.org/memory_viz draws it; "
                      f"python -m bench.memory_peak {snapshot} names what is live at its peak)"]
        if self.rank == 0:
            sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=70)
            text = "\n".join([f"wall {wall * 1e3:.1f} ms/step", *memory, table])
            with open(os.path.join(self.folder, SUMMARY), "w") as f:
                f.write(text + "\n")
            self.info(f"profile of steps {name} (trace {trace}):\n{text}")
        self.prof = None
