"""A rank's helper processes (the checkpoint writer, DataLoader workers) under a SIGTERM: they outlive one
from outside by GRACE_S, so that the rank's save and stop (sfttrain.runtime) can still use them. A save
that outlasts the launcher's grace before SIGKILL keeps nothing.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import threading
import time

GRACE_S = 30.0  # the time after a SIGTERM that torchrun, Slurm and Kubernetes give by default before SIGKILL


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
    anyone but its rank (Slurm signals every process) ends the helper GRACE_S later; its rank's at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit the mask
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
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
