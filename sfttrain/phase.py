"""What this rank is doing (start-up, step N, validation, save), said when a collective times out,
and where its threads are, on demand.

A collective that times out (trainer.nccl_timeout) means some rank never arrived: the useful
question is where each rank was. The trainer records its phase here (`enter`); a watchdog thread
says it once a phase outlasts the timeout, with every thread's Python stack, which also covers NCCL,
whose own watchdog takes the process down without a Python exception (a CPU job's gloo raises one,
and `report_timeout` says it there; no watchdog then, as a phase that is merely long is no timeout).
A run that seems stuck before any timeout: `kill -USR1 <pid>` of a rank or of one of its helper
processes (DataLoader workers, checkpoint writer) prints that process's stacks to its log, and it goes
on (`dump_stacks_on_sigusr1`).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time

_lock = threading.Lock()
_phase = {"name": "start-up", "since": time.monotonic(), "reported": False}


def enter(name: str) -> None:
    with _lock:
        _phase.update(name=name, since=time.monotonic(), reported=False)


def current() -> str:
    return _phase["name"]


def _report(rank: int, timeout_s: int) -> None:
    """Prints, once per phase, where this rank was when the timeout ran out."""
    with _lock:
        if _phase["reported"]:
            return
        _phase["reported"] = True
        name, age = _phase["name"], time.monotonic() - _phase["since"]
    print(f"sfttrain: rank {rank} has been in {name} for {age:.0f} s, the collective timeout "
          f"(trainer.nccl_timeout={timeout_s}): if a collective timed out, this rank was waiting there for a rank "
          "that did not arrive; the rank that names another phase (or none: it died) is the cause. Raise "
          "trainer.nccl_timeout if that phase is slow but sound (a large save, a slow file system)", flush=True)
    if sys.__stderr__ is not None:
        faulthandler.dump_traceback(sys.__stderr__, all_threads=True)


def report_timeout(error: BaseException, rank: int, timeout_s: int) -> None:
    """Called with an exception on its way out: says the phase if it is a collective's timeout."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        _report(rank, timeout_s)


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's Python stack to stderr (faulthandler: from the signal handler in
    C, so also while the main thread waits in a collective or on a lock), and the process goes on. A
    DataLoader worker, forked from its rank, inherits it. A handler set before (by whatever runs
    sfttrain in its process) is left as it is. The process's own stderr (file descriptor 2), not a
    sys.stderr that something replaced with a stream of its own (a notebook's, pytest's)."""
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def start_watchdog(rank: int, timeout_s: int) -> None:
    """A daemon thread that reports a phase once it has lasted timeout_s."""
    def watch() -> None:
        while True:
            time.sleep(min(1.0, timeout_s / 10))
            if time.monotonic() - _phase["since"] >= timeout_s:
                _report(rank, timeout_s)

    threading.Thread(target=watch, name="sfttrain-phase-watchdog", daemon=True).start()
