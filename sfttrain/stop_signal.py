"""trainer.save_on_sigterm: a SIGTERM during training saves the step in flight and stops the run.

SIGTERM is how a job is ended from outside: Slurm at its time limit or a preemption (SIGKILL follows
after the cluster's KillWait, 30 s by default), Kubernetes at an eviction (its grace period, 30 s by
default), `kill`, and torchrun, which passes a SIGTERM it receives on to its ranks and kills them
30 s later (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, or --shutdown_timeout, raises that on the torch versions
that have them). A rank that dies at once loses every step since the last save.

The handler only notes the signal; another one changes nothing (Slurm may signal every process of
the job while torchrun passes its own on: SIGKILL is what ends a rank at once). The note travels in
the all-reduce each step makes anyway (one more number in it, `StopVote.flag`), so every rank reads
the same sum at the same step, however the signals fell between the ranks, and all of them stop
after the same step: the trainer saves it, waits for the commit, and the run ends with exit code 8
(StoppedBySignal) and a message naming the checkpoint. The vote is read with the step's loss, a
step later (sfttrain/trainer.py keeps the device a step ahead of the host): the run stops one to two
steps after the signal. A save that outlasts the grace period is killed before its commit, which
leaves the previous checkpoint the one a resume takes (sfttrain/checkpoint_folder.py).

Noted only while the training loop runs (`noting`): during start-up there is nothing to save, and
after an error the rank must die when torchrun ends the job. The cost: a rank blocked in a
collective (another rank has died) runs no Python handler, so it dies at torchrun's SIGKILL, up to
30 s after its SIGTERM, instead of at once.
"""

from __future__ import annotations

import contextlib
import signal
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

_received: list[str] = []  # the names of the signals noted, in order


def _note(signum: int, frame) -> None:
    _received.append(signal.Signals(signum).name)


@contextlib.contextmanager
def noting(enabled: bool) -> Iterator[None]:
    """SIGTERM is noted inside the block (when enabled) and has its previous action outside it."""
    if not enabled:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def received() -> str | None:
    """The first signal noted, if any."""
    return _received[0] if _received else None


def restore_default() -> None:
    """SIGTERM ends the rank at once again: for the ways out after an error, where torchrun's SIGTERM
    must not wait for a step boundary that will not come. (This module imports torch only for
    StopVote, so the entry point calls this before torch loads.)"""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class StopVote:
    """This rank's vote to stop, a number in the step's all-reduce: 1 once a signal was noted."""

    def __init__(self, device: torch.device):
        import torch

        self.vote = torch.zeros(1, device=device)
        self.cast = False

    def flag(self) -> torch.Tensor:
        if _received and not self.cast:
            self.vote.fill_(1.0)  # the value travels with the kernel's launch: no wait on the device
            self.cast = True
        return self.vote
