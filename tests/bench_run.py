"""What the tests of bench/ share (tests/test_bench_*.py, one file a theme so that pytest-xdist's
workers share them). Every bench/ script runs its smoke mode on CPU (tiny models, a few steps), so
that none breaks unnoticed. bench.loss_kernel times CUDA kernels and has no CPU mode (its docstring
says why): on a machine without CUDA its refusal is what runs. The records are checked for what
each script measured, not for how fast: these are CPU runs of shapes no one benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import REPO, kill_job, rank_env

SAMPLE = str(REPO / "assets" / "data" / "gsm8k" / "train.jsonl")  # 2000 rows: --tiny reads the first 64
CUDA = torch.cuda.is_available()

# glibc malloc settings for the bench jobs: keep freed memory in the process instead of handing it
# back. A tiny model with Qwen's 151,936-entry vocabulary allocates logits and their gradients of
# hundreds of MB at every step; glibc serves blocks that large by mmap and unmaps them when freed,
# so every step faulted them in again, page by page, in system time. With mmap off
# (MALLOC_MMAP_MAX_=0) they come from the heap, which the trim threshold keeps. Not for the rest of
# the suite, where it measured slower (the figures: docs/benchmarks.md, sixteenth session).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def run_bench(module: str, *args: str, timeout: int = 600) -> str:
    """`python -m bench.X ...` from the checkout, on CPU ranks; its output, or a failure showing its end."""
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=rank_env(KEEP_FREED_MEMORY),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)  # the torchrun jobs it started go too
            raise AssertionError(f"{module} timed out after {timeout}s")
    assert proc.returncode == 0, f"{module} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
