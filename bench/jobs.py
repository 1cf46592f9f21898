"""The benches' sfttrain jobs as processes: wait for their steps, stop them, and keep why one failed.

A job still running at its timeout is asked for its stacks before it is stopped: every rank and
DataLoader worker under its launcher gets SIGUSR1 (faulthandler: each prints its threads' Python
stacks to the job's log), so the record of a hung job says where it waited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from sfttrain.runtime import STACKS_HEADER

STACKS_WAIT_S = 1  # for a process to write its stacks (faulthandler)
STOP_GRACE_S = 60  # torchrun passes SIGTERM on to its ranks and waits for them; past this, SIGKILL
# the override of every job that stop() ends: sfttrain answers SIGTERM with a checkpoint of its step
# (trainer.save_on_sigterm), one no bench reads (W2b's ~99 GB) and each stop would wait for
NO_SAVE_ON_STOP = "trainer.save_on_sigterm=false"


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]  # a line being written is skipped


def wait_for_steps(proc: subprocess.Popen, metrics: str, steps: int, timeout: float) -> str:
    """'trained' once step `steps` is logged (the job is then stopped), else 'failed' or 'timeout'."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.get("step") == steps and "loss" in m for m in read_jsonl(metrics)):
            stop(proc)
            return "trained"
        if proc.poll() is not None:
            return "failed"
        time.sleep(0.25)  # a read of a short file: a smoke run's job is stopped as soon as it is done
    stop(proc, stacks=True)
    return "timeout"


def stop(proc: subprocess.Popen, stacks: bool = False) -> None:
    """SIGTERM to the launcher (torchrun passes it on), SIGKILL to what is left of the job after
    STOP_GRACE_S. stacks: first each sfttrain process's stacks into the log."""
    if proc.poll() is not None:
        return
    if stacks:
        dump_stacks(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:  # the job's processes of now (the launcher is alive: none orphaned)
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def dump_stacks(launcher: int) -> None:
    """SIGUSR1 to the launcher's sfttrain processes (ranks, their DataLoader workers), not to torchrun's
    agent (whose SIGUSR1 would end it), then a wait while they write. One at a time, a moment apart, so
    that their stacks seldom interleave in the log they share."""
    for pid in descendants(launcher) + [launcher]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"sfttrain.run" in argv and b"torch.distributed.run" not in argv:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(STACKS_WAIT_S)


def descendants(pid: int) -> list[int]:
    """Every process under pid, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def why_it_failed(path: str, chars: int = 8000) -> str:
    """The part of a failed job's log that says why: from a crash's Python stack (faulthandler's
    "Fatal Python error", which torchrun's summary at the end calls only "Signal 11"), else from the
    stacks a timed-out job's processes printed (faulthandler), else from sfttrain's one-line
    message, else from the first traceback (a rank's: torchrun's own comes after it), else the end of the log."""
    with open(path, errors="replace") as f:
        text = f.read()
    markers = ("Fatal Python error", STACKS_HEADER, "sfttrain: ", "Traceback (most recent call last)")
    at = next((at for at in map(text.find, markers) if at >= 0), None)
    start = max(len(text) - chars, 0) if at is None else text.rfind("\n", 0, at) + 1  # from its line's start
    return text[start:start + chars]
