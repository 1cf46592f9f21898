"""trainer.save_on_sigterm: a SIGTERM or a first Ctrl-C during training saves the step in flight and
stops the run (exit code 8, StoppedBySignal); a second Ctrl-C, ECHO_S or more later, stops it at once.

The handler only notes the signal (only while the training loop runs: `noting`); the note travels in
each step's all-reduce (`StopVote.flag`), so every rank stops after the same step, saves it and waits
for the commit. A save that outlasts the launcher's grace before SIGKILL (GRACE_S) keeps nothing. A
rank blocked in a collective runs no handler until it returns (`end_if_told`); its helper processes
outlive a SIGTERM from outside by GRACE_S (`leave_to_the_rank`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterator

from sfttrain import phase

if TYPE_CHECKING:
    import torch

_received: list[str] = []  # the signals noted for a save and stop (SIGTERM, a first Ctrl-C's SIGINT), in order
_ctrl_c: list[float] = []  # when the first Ctrl-C was noted (time.monotonic)
_interrupted: list[bool] = []  # a Ctrl-C stopped the rank at once
ECHO_S = 2.0  # a second Ctrl-C sooner than this is torchrun passing the first on
PR_SET_PDEATHSIG = 1  # prctl(2)
GRACE_S = 30.0  # the time after a SIGTERM that torchrun, Slurm and Kubernetes give by default before SIGKILL


def _note(signum: int, frame) -> None:
    _received.append(signal.Signals(signum).name)


def _note_ctrl_c(signum: int, frame) -> None:
    """A first Ctrl-C is noted as a SIGTERM is; a second one, ECHO_S or more later, stops the rank at once."""
    if not _ctrl_c:
        _ctrl_c.append(time.monotonic())
        _received.append("Ctrl-C (SIGINT)")
    elif time.monotonic() - _ctrl_c[0] >= ECHO_S:
        _interrupt(signum, frame)


@contextlib.contextmanager
def noting(enabled: bool) -> Iterator[None]:
    """SIGTERM and Ctrl-C are noted inside the block (when enabled) and have their previous actions outside it."""
    if not enabled:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _note), signal.signal(signal.SIGINT, _note_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def follow_the_launcher() -> None:
    """Under torchrun: SIGTERM to this rank when torchrun dies (the parent-death signal), so that a
    killed torchrun leaves no orphans training on."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:  # it died before the call
        signal.raise_signal(signal.SIGTERM)


def end_if_told() -> None:
    """After the loop ended on an error: a SIGTERM it noted (torchrun's, once another rank failed) ends this
    rank now."""
    if "SIGTERM" in _received:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def note_interrupts() -> None:
    """For the whole run: Ctrl-C outside `noting` stops the rank at once, and is remembered; SIGTERM ends
    the rank as by default, unless a Ctrl-C came first."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _end_unless_interrupted)


def _end_unless_interrupted(signum: int, frame) -> None:
    """A rank blocked in a collective handles the Ctrl-C and the launcher's SIGTERM once it returns, SIGINT
    first: it must live to say its line."""
    if not interrupted():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _interrupt(signum: int, frame) -> None:
    _interrupted.append(True)
    raise KeyboardInterrupt


def interrupted() -> bool:
    return bool(_interrupted)


def received() -> str | None:
    """The first signal noted for a save and stop, in words ("SIGTERM", "Ctrl-C (SIGINT)"), if any."""
    return _received[0] if _received else None


def grace_warning(write_s: float) -> str | None:
    """A warning once a checkpoint's write took over half the default grace before SIGKILL."""
    if write_s <= GRACE_S / 2:
        return None
    return (f"a checkpoint took {write_s:.0f} s to write: a SIGTERM's save (trainer.save_on_sigterm) also waits for a "
            f"step or two, and must end within the grace before SIGKILL ({GRACE_S:.0f} s by default for torchrun, "
            "Slurm and Kubernetes). Give it more (TORCH_ELASTIC_SHUTDOWN_TIMEOUT for torchrun; Slurm's "
            "--signal=TERM@<seconds>, see slurm/sft_multinode.sbatch), or a stop loses the steps since the last save")


def leave_to_the_rank() -> None:
    """In a rank's helper process, from its main thread: Ctrl-C is the rank's to answer; a SIGTERM from
    anyone but its rank (Slurm signals every process) ends the helper GRACE_S later, so that the rank's
    stop can still use it; its rank's at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit the mask
    phase.dump_stacks_on_sigusr1()  # its thread after the mask: a SIGTERM it took would end the helper at once
    threading.Thread(target=_take_sigterm, args=(os.getppid(),), name="sfttrain-sigterm", daemon=True).start()


def helper_main(module: str, function: str, *args) -> None:
    """A spawned helper's entry (the checkpoint writer): SIGTERM left to its rank before the helper imports
    torch (seconds in which a SIGTERM would end it)."""
    leave_to_the_rank()
    getattr(importlib.import_module(module), function)(*args)


def _take_sigterm(rank_pid: int) -> None:
    deadline = None
    while True:
        if deadline is None:
            info = signal.sigwaitinfo({signal.SIGTERM})
        else:
            info = signal.sigtimedwait({signal.SIGTERM}, max(deadline - time.monotonic(), 0.0))
        if info is None or info.si_pid == rank_pid:  # the grace is over, or its rank ends it
            os._exit(128 + signal.SIGTERM)  # the shell's code for a SIGTERM death
        deadline = deadline or time.monotonic() + GRACE_S


class StopVote:
    """This rank's vote to stop, a number in the step's all-reduce: 1 once a signal was noted."""

    def __init__(self, device: torch.device):
        import torch

        self.vote = torch.zeros(1, device=device)
        self.voted = False

    def flag(self) -> torch.Tensor:
        if received() and not self.voted:
            self.vote.fill_(1.0)  # the value travels with the kernel's launch: no wait on the device
            self.voted = True
        return self.vote
