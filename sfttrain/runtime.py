"""The process-wide state of one run, made by sfttrain.run and undone when the run ends: what the rank is
doing (its phase, said when a collective times out), the signals noted for a save and stop, the run
folder's lock, the watchdog thread and the signal handlers.

trainer.save_on_sigterm: inside `noting`, a SIGTERM or a first Ctrl-C is noted; the note travels in each
step's all-reduce, so every rank stops after the same step and saves it. A second Ctrl-C, ECHO_S or more
later, stops the rank at once (exit code 130). A rank blocked in a collective runs no handler until it
returns. `kill -USR1 <pid>` prints every thread's stack (faulthandler, also while a collective blocks).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Iterator

ECHO_S = 2.0  # a second Ctrl-C sooner than this is torchrun passing the first on
PR_SET_PDEATHSIG = 1  # prctl(2)
# the first line of each thread's stack in a dump (bench/jobs.py finds it)
STACKS_HEADER = "(most recent call first)"


class Runtime:
    def __init__(self):
        self.phase, self.since, self._reported = "start-up", time.monotonic(), False
        self.received: list[str] = []  # the signals noted for a save and stop, in order, in words
        self.interrupted = False  # a Ctrl-C stopped the rank at once
        self.locks: dict[str, int] = {}  # run folder (its real path) -> the descriptor holding its lock
        self._ctrl_c_at: float | None = None
        self._guard, self._closed = threading.Lock(), threading.Event()
        self._previous: dict[int, object] = {}
        _open.append(self)

    def start(self) -> Runtime:
        """From the main thread, first thing: stacks on SIGUSR1; SIGTERM when torchrun dies; Ctrl-C outside
        `noting` stops the rank at once, and is remembered; SIGTERM ends the rank as by default, unless a
        Ctrl-C came first (the rank must live to say its line)."""
        faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
        for signum, handler in ((signal.SIGINT, self._interrupt), (signal.SIGTERM, self._end_unless_interrupted)):
            self._previous[signum] = signal.signal(signum, handler)
        if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
            launcher = os.getppid()  # a killed torchrun must leave no orphans training on
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != launcher:  # it died before the call
                signal.raise_signal(signal.SIGTERM)
        return self

    def close(self) -> None:
        """Restores the signal handlers, stops the watchdog and releases the run folder's lock."""
        self._closed.set()
        faulthandler.unregister(signal.SIGUSR1)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        for fd in self.locks.values():
            os.close(fd)
        self.locks.clear()
        if self in _open:
            _open.remove(self)

    def enter(self, name: str) -> None:
        with self._guard:
            self.phase, self.since, self._reported = name, time.monotonic(), False

    def report_phase(self, rank: int, timeout_s: int) -> None:
        """Prints, once per phase, where this rank was when the collective timeout ran out."""
        with self._guard:
            if self._reported:
                return
            self._reported = True
            name, age = self.phase, time.monotonic() - self.since
        print(f"sfttrain: rank {rank} has been in {name} for {age:.0f} s, the collective timeout "
              f"(trainer.nccl_timeout={timeout_s}): if a collective timed out, this rank was waiting there for a "
              "rank that did not arrive; the rank that names another phase (or none: it died) is the cause. Raise "
              "trainer.nccl_timeout if that phase is slow but sound (a large save, a slow file system)", flush=True)
        faulthandler.dump_traceback(file=2, all_threads=True)

    def start_watchdog(self, rank: int, timeout_s: int) -> None:
        """For NCCL, whose own watchdog ends the process without a Python exception: says the phase once
        it has lasted timeout_s."""
        def watch() -> None:
            while not self._closed.wait(min(1.0, timeout_s / 10)):
                if time.monotonic() - self.since >= timeout_s:
                    self.report_phase(rank, timeout_s)

        threading.Thread(target=watch, name="sfttrain-phase-watchdog", daemon=True).start()

    def _interrupt(self, signum: int, frame) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def _end_unless_interrupted(self, signum: int, frame) -> None:
        if not self.interrupted:
            self.end_if_told(always=True)

    def end_if_told(self, always: bool = False) -> None:
        """After the loop ended on an error: a SIGTERM it noted (torchrun's, once another rank failed)
        ends this rank now."""
        if always or "SIGTERM" in self.received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def _note(self, signum: int, frame) -> None:
        self.received.append(signal.Signals(signum).name)

    def _note_ctrl_c(self, signum: int, frame) -> None:
        if self._ctrl_c_at is None:
            self._ctrl_c_at = time.monotonic()
            self.received.append("Ctrl-C (SIGINT)")
        elif time.monotonic() - self._ctrl_c_at >= ECHO_S:
            self._interrupt(signum, frame)

    @contextlib.contextmanager
    def noting(self, enabled: bool) -> Iterator[None]:
        """SIGTERM and Ctrl-C are noted inside the block (when enabled); outside it they act as before."""
        if not enabled:
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._note), signal.signal(signal.SIGINT, self._note_ctrl_c)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


_open: list[Runtime] = []


def _close_locks_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies: an orphan must not keep a folder locked."""
    for runtime in _open:
        for fd in runtime.locks.values():
            os.close(fd)
        runtime.locks.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)
