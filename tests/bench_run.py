"""What the tests of bench/ share (tests/test_bench_*.py, one file a theme so that pytest-xdist's
workers share them). Every bench/ script runs its smoke mode on CPU (tiny models, a few steps), so
that none breaks unnoticed. bench.loss_kernel times CUDA kernels and has no CPU mode (its docstring
says why): on a machine without CUDA its refusal is what runs. The records are checked for what
each script measured, not for how fast: these are CPU runs of shapes no one benchmarks."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from tests.conftest import REPO, ForkServer, descendants, kill_job, rank_env

SAMPLE = str(REPO / "assets" / "data" / "gsm8k" / "train.jsonl")  # 2000 rows: --tiny reads the first 64
CUDA = torch.cuda.is_available()

# glibc malloc settings for the bench jobs: keep freed memory in the process instead of handing it
# back. A tiny model with Qwen's 151,936-entry vocabulary allocates logits and their gradients of
# hundreds of MB at every step; glibc serves blocks that large by mmap and unmaps them when freed,
# so every step faulted them in again, page by page, in system time. With mmap off
# (MALLOC_MMAP_MAX_=0) they come from the heap, which the trim threshold keeps. Not for the rest of
# the suite, where it measured slower (the figures: docs/benchmarks.md, sixteenth session).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def run_bench(module: str, *args: str, timeout: int = 600, gpus: bool = False) -> str:
    """`python -m bench.X ...` from the checkout, on CPU ranks (gpus: seeing the GPUs this process sees, which
    rank_env hides); its output, or a failure showing its end."""
    env = rank_env(KEEP_FREED_MEMORY)
    if gpus:  # this process's own setting back, or none
        del env["CUDA_VISIBLE_DEVICES"]
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
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


def run_bench_here(module: str, *args: str, timeout: int = 600) -> None:
    """`bench.X`'s main() with these arguments in this process, as `python -m bench.X` runs it from the
    checkout: for the scripts that train nothing themselves but start sfttrain (and TRL) as
    processes of their own. Such a script's own process spent its ~3-6 CPU-s importing torch and
    transformers (and drawing its model with them), which this process has done already; its
    processes start as before, in the same environment (rank_env(KEEP_FREED_MEMORY): os.environ is
    theirs while it runs) and folder. At `timeout` the processes it started are killed (the rank
    server's aside), which ends it with a failure."""
    env, cwd, argv = dict(os.environ), os.getcwd(), sys.argv
    bench_env = rank_env(KEEP_FREED_MEMORY)
    expired = threading.Event()

    def kill_its_processes() -> None:
        expired.set()
        server = ForkServer._running.proc.pid if ForkServer._running else None
        spared = {server, *descendants(server)} if server else set()
        for pid in descendants(os.getpid()):
            if pid not in spared:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill_its_processes)
    os.environ.clear()
    os.environ.update(bench_env)
    os.chdir(REPO)
    sys.argv = [module, *args]
    timer.start()
    try:
        importlib.import_module(module).main()
    except SystemExit as e:  # a refusal: the test's failure, not pytest's exit
        raise AssertionError(f"{module} exited: {e}") from e
    finally:
        timer.cancel()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = argv
    assert not expired.is_set(), f"{module} timed out after {timeout}s"
