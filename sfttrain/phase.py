"""What this rank is doing (start-up, step N, validation, save), said when a collective times out, and
its threads' stacks on demand. A watchdog says the phase once it outlasts trainer.nccl_timeout, for
NCCL, whose own watchdog ends the process without a Python exception (gloo raises one:
`report_timeout`); `kill -USR1 <pid>` prints a process's stacks and it goes on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from sfttrain.faults import timed_out

# the first line of each dump (bench/jobs.py finds it); not "sfttrain: ", which starts a run's one message
STACKS_HEADER = "Python stacks of process"
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
    print_stacks("at the collective timeout")


def report_timeout(error: BaseException, rank: int, timeout_s: int) -> None:
    """Called with an exception on its way out: says the phase if it is a collective's timeout."""
    if timed_out(error):
        _report(rank, timeout_s)


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's Python stack, and the process goes on. Called first in a process:
    SIGUSR1 is blocked in every thread started later, and a thread of its own takes it (sigwait) and
    prints holding the GIL, also while the main thread waits in a collective (faulthandler could read
    frames that change). A handler set before, or a caller off the main thread, is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, _on_sigusr1)):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    threading.Thread(target=_take_sigusr1, name="sfttrain-stacks", daemon=True).start()


def _on_sigusr1(signum, frame) -> None:
    print_stacks("SIGUSR1; it goes on")


def _take_sigusr1() -> None:
    while True:
        signal.sigwait({signal.SIGUSR1})
        print_stacks("SIGUSR1; it goes on")


def print_stacks(why: str) -> None:
    """Every thread's Python stack to file descriptor 2 (not a replaced sys.stderr), in one write where it fits."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    text = f"{STACKS_HEADER} {os.getpid()} ({why}), most recent call last:\n" + "".join(
        f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items())
    data = text.encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:  # no stderr left to write to
        pass


def start_watchdog(rank: int, timeout_s: int) -> None:
    """A daemon thread that reports a phase once it has lasted timeout_s."""
    def watch() -> None:
        while True:
            time.sleep(min(1.0, timeout_s / 10))
            if time.monotonic() - _phase["since"] >= timeout_s:
                _report(rank, timeout_s)

    threading.Thread(target=watch, name="sfttrain-phase-watchdog", daemon=True).start()
