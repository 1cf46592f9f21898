"""Faults of the OS and of other libraries, classified once at sfttrain.run's boundary by exception type
and errno. Where a library gives only text, it is read here and nowhere else. Imports no torch.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from sfttrain.checkpoint_folder import STEP_DIR, choose_resume, latest_of_newest_run, nearest_existing, size_text
from sfttrain.errors import CheckpointError, ConfigError, OutOfMemory, UserError

if TYPE_CHECKING:
    from sfttrain.config import Config, TrainerConfig

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: the file size limit (ulimit -f), said as its own
HANDLED = (*FULL, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE)
# the errno where only text travels: Python's and pyarrow's "[Errno 28]", Rust's "os error 28", "Os { code: 28"
ERRNO_IN_TEXT = re.compile(r"\[[Ee]rrno (\d+)\]|os error (\d+)|Os \{ code: (\d+)")
WORDS = {os.strerror(code): code for code in HANDLED}  # the C library's words, as every library quotes them
# torch's shared memory allocator (libshm) raises a RuntimeError with these words and no errno
SHARED_MEMORY = "unable to allocate shared memory"
# torch.save's C++ writer after a write the disk refused (full, or the file size limit): no errno
SHORT_WRITE = "unexpected pos"
SIZE_LIMIT_FIX = ("Raise the file size limit where the job starts (`ulimit -f` shows it; `ulimit -f unlimited` in the "
                  "shell or the job script, or the limit of the Slurm job or container that sets it)")
SHARED_MEMORY_FIX = ("`df -h /dev/shm` shows its size, which a container limits to 64 MiB unless told (`docker run "
                     "--shm-size=8g`; on Kubernetes an emptyDir of medium Memory mounted at /dev/shm). Give it more, "
                     "or use less of it: data.num_workers=0 (data workers hand their batches to the rank through it), "
                     "trainer.async_save_writer=thread (the checkpoint writer process reads each save's copy from it)")
OPEN_FILES_FIX = ("Raise the open files limit where the job starts (`ulimit -n 65536` in the shell or the job script, "
                  "or the limit of the Slurm job or container that sets it; `ulimit -Hn` is the most it may be raised "
                  "to), or lower data.num_workers (a data worker holds a file descriptor per tensor of the steps it "
                  "hands over)")
# errno: (what failed of a place, the fix, the run folder to set instead)
BROKEN = {errno.EROFS: ("the filesystem of {} is read-only", "It was mounted read-only, or the kernel made it "
                        "read-only after a disk error (`dmesg` says which; `mount` shows ro): make it writable again",
                        "a folder on a writable disk"),
          errno.EIO: ("the disk of {} failed", "A failing disk, its network server, or a filesystem the kernel stopped "
                      "after an error (`dmesg` says which): repair it", "a folder on another disk")}
# a path in an error's text: one the OS's words follow, else a quoted one
PATH_BEFORE_WORDS = re.compile(rf"(/[^\s'\"]+): (?:{'|'.join(map(re.escape, WORDS))})")
QUOTED_PATH = re.compile(r"""['"](/[^'"\n]+)['"]""")


def what_next(t: TrainerConfig) -> str:
    """What the same command does next: the checkpoint its start-up would resume from, or a fresh start."""
    try:
        last = choose_resume(t, t.default_local_dir).path
    except ConfigError as refused:  # a damaged checkpoint
        return f"The same command then stops at start-up: {refused}"
    except OSError as e:  # the run folder's disk failing
        return f"What the same command resumes from is not known: the run folder does not read ({e})"
    if not last and t.resume_mode == "disable":
        return "The same command then starts afresh (trainer.resume_mode=disable)"
    return resumes_from(last)


def resumes_from(last: Optional[str]) -> str:
    """`what_next` from the checkpoint a caller knows to be the last, where the run folder may not answer."""
    if last:
        return f"The same command then resumes from {last}"
    return "The same command then starts afresh: no checkpoint was committed yet"


def classify(error: BaseException, cfg: Config, rank: int, where: str) -> Optional[UserError]:
    """The UserError that ends the run for `error`, raised in `where` (sfttrain.phase); None for a bug."""
    # memory first: a data worker's full /dev/shm is memory run out, as its SIGBUS death is
    return (out_of_memory(error, cfg, rank, where) or killed_worker(error, cfg, rank, where) or
            filesystem_error(error, cfg.trainer, where))


def os_errno(error: BaseException | str) -> Optional[int]:
    """The errno of the first OSError in `error`'s chain (`_chain`), else the number or the OS's words in its text."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
    text = str(error)
    if found := ERRNO_IN_TEXT.search(text):
        return int(found.group(found.lastindex))
    found = [code for words, code in WORDS.items() if words in text]
    return found[0] if found else errno.ENOSPC if SHORT_WRITE in text else None


def _chain(error: BaseException | str) -> list[BaseException]:
    """`error`, its causes and contexts, and the exceptions a DCP CheckpointException holds per rank."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, its traceback)}
        wrapped = [w[0] for w in failures.values() if isinstance(w, tuple)] if isinstance(failures, dict) else []
        todo += [e.__cause__, e.__context__, *wrapped]
    return seen


def disk_full(error: BaseException | str) -> bool:
    return os_errno(error) in FULL


def over_size_limit(error: BaseException | str) -> bool:
    return os_errno(error) == errno.EFBIG


def file_at_size_limit(folder: str) -> Optional[str]:
    """A file in `folder` at this process's file size limit: the one whose write failed, where the error names none."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    return next((os.path.join(parent, name) for parent, _, names in os.walk(folder) for name in names
                 if os.path.getsize(os.path.join(parent, name)) >= limit), None)


def filesystem_error(error: BaseException, t: TrainerConfig, where: str) -> Optional[UserError]:
    """A filesystem's refusal: a ConfigError at start-up, else a CheckpointError (also where the run folder went
    away while it ran); None for other errors."""
    found = fault(error, t.default_local_dir)
    gone = where != "start-up" and isinstance(error, OSError) and folder_gone(t.default_local_dir)
    if found is None and gone:
        return CheckpointError(f"{gone}. Found in {where}" + (f", writing {error.filename}" if error.filename else ""))
    if found is None:
        return None
    if where == "start-up":
        return ConfigError(f"{found.cause} in start-up, before any step. {found.fix}, then run the same command")
    last = latest_of_newest_run(t.default_local_dir)
    lasting = ", as the next checkpoint would fail too" if found.lasting else ""
    return CheckpointError(f"{found.cause} in {where}: training stopped there{lasting}. The steps since the last good "
                           f"checkpoint ({last[1] if last else 'none'}) are lost. {found.fix}. {what_next(t)}")


@dataclass(frozen=True)
class Fault:
    """What a filesystem refused: `cause` and `fix` without their full stop; `lasting`: the next save fails too."""
    cause: str
    fix: str
    lasting: bool
    in_run_folder: bool  # the path that failed is the run folder's (or the error named none)


def fault(error: BaseException | str, run_dir: Optional[str]) -> Optional[Fault]:
    """`error` as a filesystem fault the user can act on, or None; without a path, the run folder's."""
    code, text = os_errno(error), str(error)
    if code not in HANDLED and SHARED_MEMORY not in text:
        return None
    own = next((e for e in _chain(error) if isinstance(e, OSError) and e.errno is not None), None)
    # the line of the text with the OS's words in it (after a traceback, say), else its first line
    lines = [line.strip() for line in text.strip().splitlines()]
    worded = [line for line in lines if ERRNO_IN_TEXT.search(line) or SHARED_MEMORY in line or
              any(words in line for words in WORDS)]
    line = (worded or lines or [""])[-1 if worded else 0]
    named = PATH_BEFORE_WORDS.search(line) or QUOTED_PATH.search(line)
    path = os.fsdecode(own.filename) if own is not None and own.filename else named and named.group(1)
    what = (f"{own.strerror}{f': {own.filename}' if own.filename else ''}" if own is not None and own.strerror
            else line[:200] or type(error).__name__)
    in_run = run_dir is not None and (path is None or _inside(path, run_dir))
    if SHARED_MEMORY in text or ((path or "").startswith("/dev/shm/") and code in FULL):
        return Fault(f"the shared memory (/dev/shm) is full ({what})", SHARED_MEMORY_FIX, False, False)
    if code == errno.EFBIG:
        return Fault(f"the file size limit (ulimit -f) was reached ({what})", SIZE_LIMIT_FIX, in_run, in_run)
    if code in FULL:
        return Fault(f"the disk is full ({what})", _free_space_fix(path, run_dir, in_run), in_run and path is not None,
                     in_run)
    if code in BROKEN:
        cause, fix, instead = BROKEN[code]
        place = f"the run folder {run_dir}" if in_run else path
        return Fault(f"{cause.format(place)} ({what})", fix + _elsewhere(in_run, instead), in_run, in_run)
    if code in (errno.EACCES, errno.EPERM):
        if not path:
            return None
        fix = (f"`ls -ld {nearest_existing(path)}` shows its owner and mode: give this user the right to it (chown or "
               "chmod), or run as the user it belongs to")
        return Fault(f"this user ({_user()}) is not allowed to use {path} ({what})",
                     fix + _elsewhere(in_run, "a folder of this user's own"), False, in_run)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # EMFILE, ENFILE
    return Fault(f"this process has too many files open ({what}; its limit, `ulimit -n`, is {limit})",
                 OPEN_FILES_FIX, False, True)


def check_writable(run_dir: str) -> None:
    """ConfigError where this user could not write the run folder or a file in it, before any data is read."""
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    there = nearest_existing(run_dir)
    if not os.path.isdir(there):
        raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {there} is a file, not a folder; "
                          "name another path, or move the file away")
    paths = {there}  # the run folder, its files and every folder in it but the checkpoints' (kept read-only, say)
    for parent, names, files in os.walk(run_dir):
        names[:] = [name for name in names if not (parent == run_dir and STEP_DIR.match(name))]
        paths |= {os.path.join(parent, name) for name in names + (files if parent == run_dir else [])}
    denied = [p for p in sorted(paths) if not os.access(p, os.W_OK)]
    if not denied:
        return
    code = errno.EROFS if os.statvfs(denied[0]).f_flag & os.ST_RDONLY else errno.EACCES
    found = fault(OSError(code, os.strerror(code), denied[0]), run_dir)
    more = f" (and {len(denied) - 1} more of its files and folders)" if len(denied) > 1 and code == errno.EACCES else ""
    fix = found.fix if found.in_run_folder else f"{found.fix}, or set it to a folder this user can write"
    raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {found.cause}{more}. {fix}")


def unreadable(paths: list[str]) -> Optional[str]:
    """Why this user may not read the first of `paths` it may not, and how many more; None where each reads."""
    denied = [p for p in paths if os.path.lexists(p) and
              not os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0))]
    if not denied:
        return None
    found = fault(PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied[0]), None)
    more = f" (and {len(denied) - 1} more)" if len(denied) > 1 else ""
    return f"{found.cause}{more}. {found.fix}"


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(folder)]) == os.path.abspath(folder)


def out_of_memory(error: BaseException, cfg: Config, rank: int, where: str) -> Optional[OutOfMemory]:
    """A rank out of memory as one message: where, what was asked for, what shrinks that phase; else None."""
    torch = sys.modules.get("torch")  # not loaded: no torch error
    text = str(error)
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        device, asked = "GPU", text.split(" If reserved")[0].split(" See documentation")[0]
    # c10's CPU allocator raises a plain RuntimeError (c10::Error) naming itself and the bytes asked for
    elif isinstance(error, MemoryError) or "DefaultCPUAllocator" in text:
        size = re.search(r"allocate (\d+) bytes", text)
        device, asked = "host", f"{int(size.group(1)) / 2**30:.2f} GiB asked for" if size else "MemoryError"
    else:
        return None
    return OutOfMemory(f"rank {rank} ran out of {device} memory in {where} ({asked}). What fills it: "
                       f"{_what_fills(cfg, where)}. `python -m sfttrain.plan` with the same arguments and --nproc "
                       f"estimates the memory per rank. {what_next(cfg.trainer)}")


def _what_fills(cfg: Config, where: str) -> str:
    m, d = cfg.model, cfg.data
    if where == "start-up":
        return ("the model's weights, gradients and AdamW state on each rank: shard them over more ranks, train LoRA "
                "adapters (model.lora_rank), or keep them in host memory (model.fsdp_config.offload_params=true)")
    if where.startswith(("step", "validation")):
        budget = (f"data.max_token_len_per_gpu={d.max_token_len_per_gpu}" if d.max_token_len_per_gpu
                  else f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}")
        return (f"a micro-batch's activations and its loss's logits: lower {budget} or model.loss_chunk_tokens="
                f"{m.loss_chunk_tokens}" + ("" if m.enable_gradient_checkpointing else ", or recompute activations in "
                                           "backward (model.enable_gradient_checkpointing=true)"))
    if where.startswith("the save"):
        return "a checkpoint's staged copy: trainer.async_save_staging=host, or a lower trainer.async_save_in_flight"
    return "what this phase holds"


# torch says a worker's death only in text, the signal in strsignal's words
KILLED_FIX = {
    signal.SIGKILL: ("most often the host's out-of-memory killer (`dmesg` or `journalctl -k` names what it killed; a "
                     "cgroup's or Slurm job's memory limit kills the same way). Each of a rank's data.num_workers={n} "
                     "workers is a process holding the steps it builds ahead: lower data.num_workers (0 builds them in "
                     "the rank itself), or give the job more host memory"),
    signal.SIGBUS: ("most often a full shared memory: the workers hand their batches to the rank through /dev/shm, "
                    "which a container limits to 64 MiB unless told (`docker run --shm-size=8g`; on Kubernetes an "
                    "emptyDir of medium Memory mounted at /dev/shm; `df -h /dev/shm` shows its size). Or set "
                    "data.num_workers=0 (now {n}): the rank then builds its batches itself, without shared memory"),
}
WORKER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.\n]+)")


def data_worker_died(error: BaseException) -> Optional[re.Match]:
    """torch's DataLoader raises this wherever the rank is when a worker dies: (its pid, the signal's words)."""
    return next((found for e in _chain(error) if (found := WORKER_KILLED.search(str(e)))), None)


def killed_worker(error: BaseException, cfg: Config, rank: int, where: str) -> Optional[OutOfMemory]:
    """A DataLoader worker killed by SIGKILL or SIGBUS, or with /dev/shm full, as memory run out."""
    then = what_next(cfg.trainer)
    # the worker's own error, re-raised in the rank as a RuntimeError with its traceback as text
    if re.search(r"in DataLoader worker process \d+", str(error)) and SHARED_MEMORY in str(error):
        full = fault(error, None)
        return OutOfMemory(f"rank {rank}'s DataLoader worker could not hand a step over in {where}: {full.cause}. "
                           f"{full.fix}. {then}")
    sig = {signal.strsignal(s): s for s in KILLED_FIX}.get((killed := data_worker_died(error)) and killed.group(2))
    if sig is None:
        return None
    return OutOfMemory(f"rank {rank}'s DataLoader worker (pid {killed.group(1)}) was killed by {sig.name} in "
                       f"{where}: {KILLED_FIX[sig].format(n=cfg.data.num_workers)}. {then}")


def timed_out(error: BaseException) -> bool:
    """A collective's timeout: gloo's and NCCL's errors say it only in their text."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def peer_lost(text: str) -> bool:
    """A collective's error saying another rank's process is gone (only its text tells)."""
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "remote process exited"))


def _free_space_fix(path: Optional[str], run_dir: Optional[str], in_run: bool) -> str:
    """A full disk's fix: the free space where it filled, or of each place the run writes where no file is named."""
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
    """What stops a run whose folder went away while it ran; None while it is there."""
    if os.path.isdir(run_dir):
        return None
    return (f"the run folder {run_dir} (trainer.default_local_dir) is gone: deleted, moved or unmounted while the "
            "run ran, its checkpoints with it, so no later one can be saved. If it was moved, move it back and run "
            "the same command: it resumes from its last checkpoint; else the same command starts afresh")

