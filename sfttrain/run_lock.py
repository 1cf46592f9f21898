"""One run at a time in a run folder: rank 0 holds flock(2) on `<run folder>/.sfttrain.lock` for its
process's life (the kernel drops it however the process ends; NFS carries it between nodes). Two runs
in one folder would resume and overwrite each other's checkpoints: the second is refused at start-up,
named by the file's holder record. A filesystem without locks is said at start-up.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from sfttrain.distributed import decided_by_rank0
from sfttrain.errors import ConfigError

LOCK_FILE = ".sfttrain.lock"

# filesystems without flock(2) answer with one of these
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def lock_run_folder(run_dir: str, held: dict[str, int]) -> list[str]:
    """Collective, at start-up: rank 0 takes the run folder's lock into `held` (sfttrain.runtime's, released
    when the run ends); if another run holds it, every rank raises the same ConfigError. Returns start-up
    lines (a warning where the filesystem has no locks)."""
    return decided_by_rank0(lambda: _take(run_dir, held))


def check_not_in_use(run_dir: str) -> None:
    """The preflight's look: raises the ConfigError a run would stop on, without keeping the lock."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except OSError:  # no run has held it yet (or it cannot be read: the run's own start-up says what then)
        return
    _flock(run_dir, fd, fcntl.LOCK_SH)  # shared: two preflights do not see each other
    os.close(fd)


def _take(run_dir: str, held: dict[str, int]) -> list[str]:
    """Takes the lock: [] or [a warning where the filesystem has no locks]; a ConfigError where another run holds it."""
    key = os.path.realpath(run_dir)
    if key in held:  # this process holds it already (a second trainer in one process)
        return []
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    if (e := _flock(run_dir, fd, fcntl.LOCK_EX)) is not None:
        os.close(fd)
        return [f"  WARNING: the run folder's filesystem has no file locks ({e.strerror}): a second run started "
                f"in {run_dir} while this one runs would not be refused, and the two would save over each other"]
    os.ftruncate(fd, 0)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "slurm_job": os.environ.get("SLURM_JOB_ID")}
    os.write(fd, json.dumps(holder).encode())
    held[key] = fd
    return []


def _flock(run_dir: str, fd: int, operation: int) -> OSError | None:
    """flock(2) without waiting: None once taken, the error where the filesystem has no locks; where another
    run holds it, fd is closed and the ConfigError raised."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(_in_use_message(run_dir)) from None
    except OSError as e:
        if e.errno not in NO_LOCKS:
            os.close(fd)
            raise
        return e
    return None


def _in_use_message(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, LOCK_FILE)) as f:
            holder = json.load(f)
        who = f"rank 0 on {holder['host']}, pid {holder['pid']}, since {holder['since']}"
        who += f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    except (OSError, ValueError, KeyError, TypeError):  # written just now, or by another version
        who = "its holder did not say who it is"
    return (f"trainer.default_local_dir={run_dir} is in use by another sfttrain run ({who}): two runs in one folder "
            "would resume each other's checkpoints and save the same steps over each other. Let that run finish "
            "or stop it, or give this run another trainer.default_local_dir")
