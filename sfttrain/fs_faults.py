"""What a filesystem refused the run, in the user's words: a full disk (ENOSPC, or a quota's EDQUOT) or a
full shared memory (/dev/shm), the file size limit (EFBIG), a read-only filesystem (EROFS), a failing disk
(EIO), a permission (EACCES, EPERM), the open files limit (EMFILE, ENFILE), a run folder gone. Each is one
message naming what failed where and what to do: sfttrain.run's `explain` asks `filesystem_error` and
`folder_gone_error`, the checkpointer words its save's failure with the same `fault`, the exporter with the
same signs. A leaf: torch-free, it imports nothing of sfttrain's but its errors and the run folder's layout
(sfttrain.checkpoint_folder).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import resource
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

from sfttrain.checkpoint_folder import STEP_DIR, latest_of_newest_run, nearest_existing, size_text, what_auto_does
from sfttrain.errors import CheckpointError, ConfigError, UserError

# EFBIG: a write past the process's file size limit (ulimit -f, RLIMIT_FSIZE), which a job inherits from the
# shell, the Slurm job or the container that started it; handled as a full disk is, with its own words and fix
FILE_TOO_LARGE = ("File too large", "Errno 27", "os error 27")
FULL = ("No space left on device", "Disk quota exceeded", "Errno 28", "Errno 122", "os error 28", "os error 122")
SIZE_LIMIT_FIX = ("Raise the file size limit where the job starts (`ulimit -f` shows it; `ulimit -f unlimited` in the "
                  "shell or the job script, or the limit of the Slurm job or container that sets it)")


def disk_full(error: BaseException) -> bool:
    """A write that found its disk full, its quota used up or the file size limit reached: an OSError,
    or a library's own error that carries the OS's words (safetensors' SafetensorError, tokenizers')."""
    return (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or \
        disk_full_text(str(error))


def disk_full_text(text: str) -> bool:
    """ENOSPC, EDQUOT or EFBIG in an error's text (a rank's error reaches the others as text)."""
    return over_size_limit(text) or any(sign in text for sign in FULL)


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


def filesystem_error(error: BaseException, run_dir: str, where: str) -> Optional[UserError]:
    """A file operation that a filesystem refused (`fault`: a full disk or shared memory, the file size limit,
    a read-only or failing disk, a permission, the open files limit) outside a checkpoint's own save (whose failure
    the checkpointer words): metrics.jsonl, a cache, a trace, a compiled kernel. One message with what failed
    where, what to do, and the checkpoint to resume from: a ConfigError at start-up (nothing trained yet),
    else a CheckpointError (the steps since the last checkpoint cannot be kept). None for any other error."""
    found = fault(error, run_dir)
    if found is None:
        return None
    if where == "start-up":
        return ConfigError(f"{found.cause} in start-up, before any step. {found.fix}, then run the same command")
    last = latest_of_newest_run(run_dir)
    then = what_auto_does(last[1] if last else None)
    lasting = ", as the next checkpoint would fail too" if found.lasting else ""
    return CheckpointError(f"{found.cause} in {where}: training stopped there{lasting}. The steps since the last good "
                           f"checkpoint ({last[1] if last else 'none'}) are lost. {found.fix}, then run the same "
                           f"command: with trainer.resume_mode=auto {then}")


@dataclass(frozen=True)
class Fault:
    """What a filesystem refused, in words: `cause` names what failed where, `fix` what to do (each a
    sentence without its full stop); `lasting`: the next checkpoint would fail too (the run folder's disk
    full, read-only or failing)."""
    cause: str
    fix: str
    lasting: bool
    in_run_folder: bool  # the path that failed is the run folder's (or the error named none)


# the OS's words for each fault, as an error's text carries them (a library's own error, or a rank's error
# that reaches the others as text)
READ_ONLY = ("Read-only file system", "Errno 30", "errno 30", "os error 30")  # EROFS
DENIED = ("Permission denied", "Errno 13", "errno 13", "os error 13", "Operation not permitted")  # EACCES, EPERM
OPEN_FILES = ("Too many open files", "Errno 24", "errno 24", "os error 24", "Errno 23")  # EMFILE, ENFILE
IO_ERROR = ("Input/output error", "[Errno 5]", "(os error 5)")  # EIO: the disk (or its server) failed
SHARED_MEMORY = "unable to allocate shared memory"  # torch's, for a shared memory (/dev/shm) segment it cannot make
SHARED_MEMORY_FIX = ("`df -h /dev/shm` shows its size, which a container limits to 64 MiB unless told (`docker run "
                     "--shm-size=8g`; on Kubernetes an emptyDir of medium Memory mounted at /dev/shm). Give it more, or "
                     "use less of it: data.num_workers=0 (data workers hand their batches to the rank through it), "
                     "trainer.async_save_writer=thread (the checkpoint writer process reads each save's copy from it)")
OPEN_FILES_FIX = ("Raise the open files limit where the job starts (`ulimit -n 65536` in the shell or the job script, "
                  "or the limit of the Slurm job or container that sets it; `ulimit -Hn` is the most it may be raised "
                  "to), or lower data.num_workers (a data worker holds a file descriptor per tensor of the steps it "
                  "hands over)")
# a path in an error's text: one the OS's words follow (a compiler's "when writing output to PATH: No space
# left on device"), else a quoted one (pyarrow's "Failed to open local file '/x'", safetensors' 'at path "/x"')
PATH_BEFORE_WORDS = re.compile(r"(/[^\s'\"]+): (?:No space left|Disk quota|Read-only|Permission denied|Operation not)")
QUOTED_PATH = re.compile(r"""['"](/[^'"\n]+)['"]""")
ALL_SIGNS = (*FULL, *FILE_TOO_LARGE, *READ_ONLY, *IO_ERROR, *DENIED, *OPEN_FILES, SHARED_MEMORY)


def fault(error: BaseException | str, run_dir: Optional[str]) -> Optional[Fault]:
    """`error` (or its text) as a filesystem fault the user can act on, or None. A permission needs the path
    it was refused on (an EPERM without one is a process's, e.g. a signal's); the others without a path are
    said of the run folder, where the run writes (run_dir None: a path that is no run folder's)."""
    text = str(error)
    code = error.errno if isinstance(error, OSError) else None
    line = _words_line(text)
    path = (os.fsdecode(error.filename) if isinstance(error, OSError) and error.filename else _path_in(line))
    what = (f"{error.strerror}{f': {error.filename}' if error.filename else ''}" if isinstance(error, OSError)
            and error.strerror else line[:200] or type(error).__name__)
    in_run = run_dir is not None and (path is None or _inside(path, run_dir))
    place = f"the run folder {run_dir}" if in_run else path
    if SHARED_MEMORY in text or ((path or "").startswith("/dev/shm/") and disk_full(error)):
        return Fault(f"the shared memory (/dev/shm) is full ({what})", SHARED_MEMORY_FIX, False, False)
    if disk_full(error):
        if over_size_limit(what):
            return Fault(f"the file size limit (ulimit -f) was reached ({what})", SIZE_LIMIT_FIX, in_run, in_run)
        return Fault(f"the disk is full ({what})", _free_space_fix(path, run_dir, in_run), in_run and path is not None,
                     in_run)
    if code == errno.EROFS or any(sign in text for sign in READ_ONLY):
        fix = ("It was mounted read-only, or the kernel made it read-only after a disk error (`dmesg` says which; "
               "`mount` shows ro): make it writable again")
        return Fault(f"the filesystem of {place} is read-only ({what})",
                     fix + _elsewhere(in_run, "a folder on a writable disk"), in_run, in_run)
    if code == errno.EIO or any(sign in text for sign in IO_ERROR):
        return Fault(f"the disk of {place} failed ({what})",
                     "A failing disk, its network server, or a filesystem the kernel stopped after an error (`dmesg` "
                     "says which): repair it" + _elsewhere(in_run, "a folder on another disk"), in_run, in_run)
    if path and (code in (errno.EACCES, errno.EPERM) or any(sign in text for sign in DENIED)):
        fix = (f"`ls -ld {nearest_existing(path)}` shows its owner and mode: give this user the right to it (chown or chmod), "
               "or run as the user it belongs to")
        return Fault(f"this user ({_user()}) is not allowed to use {path} ({what})",
                     fix + _elsewhere(in_run, "a folder of this user's own"), False, in_run)
    if code in (errno.EMFILE, errno.ENFILE) or any(sign in text for sign in OPEN_FILES):
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return Fault(f"this process has too many files open ({what}; its limit, `ulimit -n`, is {limit})",
                     OPEN_FILES_FIX, False, True)
    return None


def check_writable(run_dir: str) -> None:
    """ConfigError where this user could not write the run folder (checked at start-up by rank 0 before any
    data is read, and by the preflight): the folder, or the one it would be made in, on a read-only
    filesystem or not this user's to write; or, in a run folder left by another user, a folder in it or a
    file it holds (its lock, metrics.jsonl) that this user may not write, which would stop the run only
    where it first writes there: its lock, the length cache after the row scan, metrics.jsonl once the
    model is loaded."""
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    there = nearest_existing(run_dir)
    if not os.path.isdir(there):
        raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {there} is a file, not a folder; "
                          "name another path, or move the file away")
    paths = _run_folder_paths(run_dir) if there == run_dir else [there]
    denied = [p for p in paths if not os.access(p, os.W_OK)]
    if not denied:
        return
    code = errno.EROFS if os.statvfs(denied[0]).f_flag & os.ST_RDONLY else errno.EACCES
    found = fault(OSError(code, os.strerror(code), denied[0]), run_dir)
    more = f" (and {len(denied) - 1} more of its files and folders)" if len(denied) > 1 and code == errno.EACCES else ""
    fix = found.fix if found.in_run_folder else f"{found.fix}, or set it to a folder this user can write"
    raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {found.cause}{more}. {fix}")


def _run_folder_paths(run_dir: str) -> list[str]:
    """The run folder, the files directly in it (the lock, metrics.jsonl and the others the run writes again)
    and every folder in it but the committed checkpoints' (one may have been made read-only to keep it)."""
    top = [os.path.join(run_dir, name) for name in sorted(os.listdir(run_dir))]
    folders = []
    for parent, names, _ in os.walk(run_dir):
        names[:] = [name for name in names if not (parent == run_dir and STEP_DIR.match(name))]
        folders += [os.path.join(parent, name) for name in names]
    return [run_dir, *sorted(set(folders) | {p for p in top if not os.path.isdir(p)})]


def check_open_files(need: int) -> None:
    """Raises this process's open files limit to its hard limit, as a process may (the data workers and the
    checkpoint writer it starts inherit it): a job's soft limit, `ulimit -n` (often 1024), is no ceiling of
    its own. A ConfigError where even the hard limit is below `need`: at the first step that did not fit,
    torch's handover of a worker's tensors failed on the worker's server thread, which printed the error
    in a loop (gigabytes of log) and never answered the rank, which waited for the step forever."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit: the kernel's nr_open caps it
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20),
                                                     hard))
    if problem := open_files_problem(need):
        raise ConfigError(problem)


def open_files_problem(need: int) -> Optional[str]:
    """Why this process's hard open files limit (what a job started from it gets) is below `need`; None where it
    is not. The preflight's check too, which raises no limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= need:
        return None
    return (f"the open files limit of this job is {hard} (`ulimit -Hn`, the most `ulimit -n` may be raised to), and "
            f"a rank and each of its data workers need up to about {need} here. {OPEN_FILES_FIX}")


def unreadable(paths: list[str]) -> Optional[str]:
    """Why this user may not read the first of `paths` it may not (a folder: list it and enter it), and how
    many more; None where each reads, or is not there (the caller says what that means)."""
    denied = [p for p in paths if os.path.lexists(p) and
              not os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0))]
    if not denied:
        return None
    found = fault(PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied[0]), None)
    more = f" (and {len(denied) - 1} more)" if len(denied) > 1 else ""
    return f"{found.cause}{more}. {found.fix}"


def _words_line(text: str) -> str:
    """The line of an error's text with the OS's words in it (a DataLoader worker's error carries its whole
    traceback, a compiler's its command line before them), else its first line."""
    lines = [line.strip() for line in text.strip().splitlines()]
    worded = [line for line in lines if any(sign in line for sign in ALL_SIGNS)]
    return (worded or lines or [""])[-1 if worded else 0]


def _path_in(line: str) -> Optional[str]:
    found = PATH_BEFORE_WORDS.search(line) or QUOTED_PATH.search(line)
    return found.group(1) if found else None


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(folder)]) == os.path.abspath(folder)


def _free_space_fix(path: Optional[str], run_dir: Optional[str], in_run: bool) -> str:
    """A full disk's fix: the free space of the run folder, or of the other place that filled (the temporary
    folder, where torch.compile writes its kernels, said as TMPDIR); where the error names no file, that of
    each place the run writes (Python's semaphores, which the data workers' queues use, live in /dev/shm)."""
    if path is None:
        places = [place for place in (run_dir, "/dev/shm", tempfile.gettempdir()) if place and os.path.isdir(place)]
        free = "; ".join(f"{place} has {size_text(shutil.disk_usage(place).free)} free" for place in places)
        return (f"The error names no file: {free}. Free space where it ran out: the run folder's disk (or set "
                "trainer.default_local_dir on a larger one), /dev/shm (`df -h /dev/shm`; data.num_workers=0 and "
                "trainer.async_save_writer=thread use none of it) or the temporary folder (TMPDIR)")
    if in_run:
        free = f"{run_dir} has {size_text(shutil.disk_usage(run_dir).free)} free" if os.path.isdir(run_dir) else ""
        return f"{free}. Free space (or set trainer.default_local_dir on a larger disk)"
    there = nearest_existing(path)
    temporary = _inside(path, tempfile.gettempdir())
    return (f"{there} has {size_text(shutil.disk_usage(there).free)} free (not the run folder's disk" +
            (f": it is the temporary folder, {tempfile.gettempdir()}" if temporary else "") + "). Free space there" +
            (", or set TMPDIR to a folder on a larger disk" if temporary else ""))


def _elsewhere(in_run: bool, what: str) -> str:
    return f", or set trainer.default_local_dir to {what}" if in_run else ""


def _user() -> str:
    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


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
