"""What a filesystem refused the run, in the user's words: a full disk (ENOSPC, or a quota's EDQUOT), the
file size limit (EFBIG), a run folder gone. Each is one message naming what filled (or went) and what to do;
sfttrain.run's `explain` asks `disk_full_error` and `folder_gone_error`, the checkpointer and the exporter
word their own failures with the same signs. A leaf: torch-free, it imports nothing of sfttrain's but its
errors and the run folder's layout (sfttrain.checkpoint_folder).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from typing import Optional

from sfttrain.checkpoint_folder import latest_of_newest_run, size_text, what_auto_does
from sfttrain.errors import CheckpointError, ConfigError, UserError

# EFBIG: a write past the process's file size limit (ulimit -f, RLIMIT_FSIZE), which a job inherits from the
# shell, the Slurm job or the container that started it; handled as a full disk is, with its own words and fix
FILE_TOO_LARGE = ("File too large", "Errno 27", "os error 27")
SIZE_LIMIT_FIX = ("Raise the file size limit where the job starts (`ulimit -f` shows it; `ulimit -f unlimited` in the "
                  "shell or the job script, or the limit of the Slurm job or container that sets it)")


def disk_full(error: BaseException) -> bool:
    """A write that found its disk full, its quota used up or the file size limit reached: an OSError,
    or a library's own error that carries the OS's words (safetensors' SafetensorError, tokenizers')."""
    return (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or \
        disk_full_text(str(error))


def disk_full_text(text: str) -> bool:
    """ENOSPC, EDQUOT or EFBIG in an error's text (a rank's error reaches the others as text)."""
    return over_size_limit(text) or any(sign in text for sign in (
        "No space left on device", "Disk quota exceeded", "Errno 28", "Errno 122", "os error 28", "os error 122"))


def over_size_limit(text: str) -> bool:
    """EFBIG in an error's text."""
    return any(sign in text for sign in FILE_TOO_LARGE)


def file_at_size_limit(folder: str) -> Optional[str]:
    """A file in `folder` as large as this process's file size limit lets it grow: the one whose write
    failed on it, where the error names none (torch.save's "unexpected pos", tokenizers' os error 27)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    return next((os.path.join(parent, name) for parent, _, names in os.walk(folder) for name in names
                 if os.path.getsize(os.path.join(parent, name)) >= limit), None)


def disk_full_error(error: BaseException, run_dir: str, where: str) -> Optional[UserError]:
    """A write that found its disk full (ENOSPC, or a quota's EDQUOT) or met the file size limit (EFBIG)
    outside a checkpoint's own save (whose failure the checkpointer words): metrics.jsonl, a cache, a
    trace. One message with what filled, the run folder's free space (or the limit) and the checkpoint
    to resume from: a ConfigError at start-up (nothing trained yet), else a CheckpointError (the steps
    since the last checkpoint cannot be kept). None for any other error."""
    if not disk_full(error):
        return None
    what = (f"{error.strerror}{f': {error.filename}' if error.filename else ''}" if isinstance(error, OSError)
            else str(error).strip().splitlines()[0][:200])  # a library's own error, the OS's words in it
    if over_size_limit(what):
        cause, fix = f"the file size limit (ulimit -f) was reached ({what})", SIZE_LIMIT_FIX
    else:
        free = f"{run_dir} has {size_text(shutil.disk_usage(run_dir).free)} free" if os.path.isdir(run_dir) else ""
        cause = f"the disk is full ({what})"
        fix = f"{free}. Free space (or set trainer.default_local_dir on a larger disk)"
    if where == "start-up":
        return ConfigError(f"{cause} in start-up, before any step. {fix}, then run the same command")
    last = latest_of_newest_run(run_dir)
    then = what_auto_does(last[1] if last else None)
    return CheckpointError(f"{cause} in {where}: training stopped there, as the next checkpoint would fail too. The "
                           f"steps since the last good checkpoint ({last[1] if last else 'none'}) are lost. {fix}, "
                           f"then run the same command: with trainer.resume_mode=auto {then}")


def folder_gone(run_dir: str) -> Optional[str]:
    """What stops a run whose folder was deleted (or moved, or its disk unmounted) while it ran; None
    while the folder is there."""
    if os.path.isdir(run_dir):
        return None
    return (f"the run folder {run_dir} (trainer.default_local_dir) is gone: deleted, moved or unmounted while the "
            "run ran, its checkpoints with it, so no later one can be saved. If it was moved, move it back and run "
            "the same command: it resumes from its last checkpoint; else the same command starts afresh")


def folder_gone_error(error: BaseException, run_dir: str, where: str) -> Optional[CheckpointError]:
    """A file of the run folder (metrics.jsonl, a trace) that failed because the folder is gone, as one
    message (exit code 6: the steps since the last checkpoint cannot be kept). Not at start-up, where a
    run folder not made yet is no folder gone. None for any other error."""
    gone = folder_gone(run_dir)
    if not gone or where == "start-up" or not isinstance(error, OSError):
        return None
    return CheckpointError(f"{gone}. Found in {where}" + (f", writing {error.filename}" if error.filename else ""))
