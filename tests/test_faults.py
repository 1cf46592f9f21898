"""sfttrain.faults, asked directly: each errno and exception type of the OS, torch, pyarrow and safetensors ->
the exit code, the whole message and what the same command does next, for the run folder and for the other
places a run writes (the temporary folder, /dev/shm, another disk). Real exceptions where a real one can be
had (a write to /dev/full, pyarrow's and safetensors' own errors); the free space each disk has is the one
thing given (`shutil.disk_usage`), so that each message is known whole."""

from __future__ import annotations

import collections
import errno
import json
import os
import pwd
import resource
import signal
import tempfile

import pytest

from sfttrain import faults
from sfttrain.checkpoint_folder import STATE_FILE, write_complete
from sfttrain.config import load_config
from sfttrain.errors import CheckpointError, ConfigError, OutOfMemory

Usage = collections.namedtuple("Usage", "total used free")
FREE = {"run": 3_210_000_000, "data": 45_000_000, "tmp": 12_300_000_000, "/dev/shm": 64_000_000}
USER = f"{pwd.getpwuid(os.geteuid()).pw_name}, uid {os.geteuid()}"
SEE_DMESG = "(`dmesg` says which"


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run folder whose disk has FREE["run"] bytes free, with step 2 committed; beside it `data`, a folder of
    another disk, and `tmp`, the temporary folder (TMPDIR), each with its own free space, as /dev/shm."""
    folder = tmp_path / "run"
    (folder / "global_step_2").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # TMPDIR
    (folder / "global_step_2" / STATE_FILE).write_text(json.dumps({"run_id": "r1", "step": 2}))
    write_complete(str(folder / "global_step_2"))

    def disk_usage(path):
        path = str(path)
        place = next(p for p in FREE if path.startswith(p if p.startswith("/") else str(tmp_path / p)))
        return Usage(1 << 40, 0, FREE[place])

    monkeypatch.setattr(faults.shutil, "disk_usage", disk_usage)
    return str(folder)


def config(run_dir: str, *overrides: str):
    return load_config(None, [f"trainer.default_local_dir={run_dir}", "data.train_files=/data/train.parquet",
                              "model.partial_pretrain=/models/m", *overrides])


def os_error(code: int, filename: str | None = None) -> OSError:
    return OSError(code, os.strerror(code), *([filename] if filename else []))


def full_disk_error() -> OSError:
    """A real ENOSPC: a buffered write to /dev/full, whose error names no file (as metrics.jsonl's would)."""
    with pytest.raises(OSError) as caught:
        with open("/dev/full", "w") as f:
            f.write("x")
    return caught.value


def stopped(run_dir: str, cause: str, fix: str, lasting: bool) -> str:
    """A fault between saves, in step 3, with step 2 committed (`filesystem_error`'s one shape)."""
    last = f"{run_dir}/global_step_2"
    return (f"{cause} in step 3: training stopped there{', as the next checkpoint would fail too' * lasting}. The "
            f"steps since the last good checkpoint ({last}) are lost. {fix}. The same command then resumes from {last}")


def cases(run_dir: str) -> dict[str, tuple[BaseException, str]]:
    """name -> (the error, the whole message `filesystem_error` says of it in step 3)."""
    tmp, metrics, data = tempfile.gettempdir(), f"{run_dir}/metrics.jsonl", f"{os.path.dirname(run_dir)}/data"
    here = f"the run folder {run_dir}"
    gb = lambda place: f"{FREE[place] / 1e9:.3g} GB"  # noqa: E731
    read_only = ("It was mounted read-only, or the kernel made it read-only after a disk error (`dmesg` says which; "
                 "`mount` shows ro): make it writable again")
    failing = ("A failing disk, its network server, or a filesystem the kernel stopped after an error (`dmesg` says "
               "which): repair it")
    size_limit = ("Raise the file size limit where the job starts (`ulimit -f` shows it; `ulimit -f unlimited` in the "
                  "shell or the job script, or the limit of the Slurm job or container that sets it)")
    return {
        "ENOSPC in the run folder": (os_error(errno.ENOSPC, metrics), stopped(
            run_dir, f"the disk is full (No space left on device: {metrics})",
            f"{run_dir} has {gb('run')} free. Free space (or set trainer.default_local_dir on a larger disk)", True)),
        "EDQUOT in the run folder": (os_error(errno.EDQUOT, metrics), stopped(
            run_dir, f"the disk is full (Disk quota exceeded: {metrics})",
            f"{run_dir} has {gb('run')} free. Free space (or set trainer.default_local_dir on a larger disk)", True)),
        "ENOSPC naming no file": (full_disk_error(), stopped(
            run_dir, "the disk is full (No space left on device)",
            f"The error names no file: {run_dir} has {gb('run')} free; /dev/shm has {FREE['/dev/shm'] / 1e6:.3g} MB "
            f"free; {tmp} has {gb('tmp')} free. Free space where it ran out: the run folder's disk (or set "
            "trainer.default_local_dir on a larger one), /dev/shm (`df -h /dev/shm`; data.num_workers=0 and "
            "trainer.async_save_writer=thread use none of it) or the temporary folder (TMPDIR)", False)),
        "ENOSPC in TMPDIR": (os_error(errno.ENOSPC, f"{tmp}/no-such-folder-of-sfttrain/k.so"), stopped(
            run_dir, f"the disk is full (No space left on device: {tmp}/no-such-folder-of-sfttrain/k.so)",
            f"{tmp} has {gb('tmp')} free (not the run folder's disk: it is the temporary folder, {tmp}). Free space "
            "there, or set TMPDIR to a folder on a larger disk", False)),
        "ENOSPC on another disk": (os_error(errno.ENOSPC, f"{data}/cache/x"), stopped(
            run_dir, f"the disk is full (No space left on device: {data}/cache/x)",
            f"{data} has {FREE['data'] / 1e6:.3g} MB free (not the run folder's disk). Free space there", False)),
        "ENOSPC in /dev/shm": (os_error(errno.ENOSPC, "/dev/shm/torch_1_2"), stopped(
            run_dir, "the shared memory (/dev/shm) is full (No space left on device: /dev/shm/torch_1_2)",
            faults.SHARED_MEMORY_FIX, False)),
        "EFBIG in the run folder": (os_error(errno.EFBIG, metrics), stopped(
            run_dir, f"the file size limit (ulimit -f) was reached (File too large: {metrics})", size_limit, True)),
        "EROFS in the run folder": (os_error(errno.EROFS, metrics), stopped(
            run_dir, f"the filesystem of {here} is read-only (Read-only file system: {metrics})",
            f"{read_only}, or set trainer.default_local_dir to a folder on a writable disk", True)),
        "EROFS on another disk": (os_error(errno.EROFS, f"{data}/x"), stopped(
            run_dir, f"the filesystem of {data}/x is read-only (Read-only file system: {data}/x)", read_only, False)),
        "EIO in the run folder": (os_error(errno.EIO, metrics), stopped(
            run_dir, f"the disk of {here} failed (Input/output error: {metrics})",
            f"{failing}, or set trainer.default_local_dir to a folder on another disk", True)),
        "EIO naming no file": (os_error(errno.EIO), stopped(
            run_dir, f"the disk of {here} failed (Input/output error)",
            f"{failing}, or set trainer.default_local_dir to a folder on another disk", True)),
        "EIO on another disk": (os_error(errno.EIO, f"{data}/x"), stopped(
            run_dir, f"the disk of {data}/x failed (Input/output error: {data}/x)", failing, False)),
        "EACCES in the run folder": (PermissionError(errno.EACCES, "Permission denied", metrics), stopped(
            run_dir, f"this user ({USER}) is not allowed to use {metrics} (Permission denied: {metrics})",
            f"`ls -ld {run_dir}` shows its owner and mode: give this user the right to it (chown or chmod), or run as "
            "the user it belongs to, or set trainer.default_local_dir to a folder of this user's own", False)),
        "EMFILE": (os_error(errno.EMFILE), stopped(
            run_dir, "this process has too many files open (Too many open files; its limit, `ulimit -n`, is "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]})", faults.OPEN_FILES_FIX, False)),
    }


CASES = list(cases("/x/run"))


@pytest.mark.parametrize("name", CASES)
def test_each_errno_between_saves(run_dir, name):
    """An OSError of each errno, in the run folder or elsewhere: exit code 6, the whole message; the next
    checkpoint said to fail too only where the run folder's disk is what failed."""
    error, message = cases(run_dir)[name]
    stop = faults.classify(error, config(run_dir), 0, "step 3")
    assert isinstance(stop, CheckpointError) and stop.exit_code == 6, stop
    assert str(stop) == message


@pytest.mark.parametrize("name", ["ENOSPC in the run folder", "EROFS in the run folder", "EIO on another disk"])
def test_each_errno_at_start_up(run_dir, name):
    """The same faults before any step: a config error (exit code 2), nothing lost, the same command again."""
    error, message = cases(run_dir)[name]
    cause, fix = message.split(" in step 3: ")[0], message.split(" are lost. ")[1].split(". The same command")[0]
    stop = faults.classify(error, config(run_dir), 0, "start-up")
    assert isinstance(stop, ConfigError) and stop.exit_code == 2, stop
    assert str(stop) == f"{cause} in start-up, before any step. {fix}, then run the same command"


def test_the_errno_is_found_where_a_library_keeps_it(run_dir):
    """A library's own error is read as the OS's error behind it: pyarrow's OSError (its own words, the
    errno set), safetensors' SafetensorError (the OS's error only in its text), torch.save's C++ writer
    ("unexpected pos"), an OSError behind another exception, DCP's CheckpointException holding one rank's
    OSError, and a rank's error gathered as text."""
    import pyarrow as pa
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    # (pq.write_table unlinks a path it failed on)
    with pytest.raises(OSError) as arrow, pa.OSFile("/dev/full", "wb") as f:
        f.write(b"x")
    rust = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                           'on device" })')
    writer = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 0")
    try:
        try:
            raise os_error(errno.EIO, f"{run_dir}/x")
        except OSError as e:
            raise RuntimeError("the step's trace could not be written") from e
    except RuntimeError as e:
        behind = e
    dcp = CheckpointException("Failed to write", {1: _wrap_exception(os_error(errno.EROFS, f"{run_dir}/x"))})
    gathered = f"rank 1: OSError: [Errno 13] Permission denied: '{run_dir}/x'"
    codes = [faults.os_errno(e) for e in (arrow.value, rust, writer, behind, dcp, gathered)]
    assert codes == [errno.ENOSPC, errno.ENOSPC, errno.ENOSPC, errno.EIO, errno.EROFS, errno.EACCES]
    assert str(faults.classify(arrow.value, config(run_dir), 0, "step 3")).startswith(
        "the disk is full (Error writing bytes to file. Detail: [errno 28] No space left on device) in step 3")
    assert faults.fault(gathered, run_dir).cause == f"this user ({USER}) is not allowed to use {run_dir}/x ({gathered})"


def test_what_is_no_fault_of_the_filesystem_is_a_bug(run_dir):
    """ENOENT, an EPERM that names no path (a signal's), a plain RuntimeError and a ValueError are bugs (their
    traceback), not a message."""
    for error in (os_error(errno.ENOENT, f"{run_dir}/x"), os_error(errno.EPERM), RuntimeError("boom"),
                  ValueError("Errno-free words")):
        assert faults.classify(error, config(run_dir), 0, "step 3") is None, error


@pytest.mark.parametrize("mode", ["auto", "auto, no checkpoint", "disable", "resume_path", "damaged"])
def test_what_next(tmp_path, mode):
    """The one sentence of what the same command does next, by the resume rule: auto resumes from the run
    folder's last committed checkpoint (or trainer.resume_from_path where it has none), disable starts
    afresh, resume_path resumes from its path, and a damaged checkpoint stops the start-up."""
    folder, seed = tmp_path / "run", tmp_path / "seed" / "global_step_7"
    for step, path in [(2, folder / "global_step_2"), (4, folder / "global_step_4"), (7, seed)]:
        if mode != "auto, no checkpoint" or path == seed:
            path.mkdir(parents=True)
            (path / STATE_FILE).write_text(json.dumps({"run_id": "r1", "step": step}))
            write_complete(str(path))
    if mode == "damaged":
        (folder / "global_step_4" / STATE_FILE).write_text("{}")
    resume = {"disable": "disable", "resume_path": "resume_path"}.get(mode, "auto")
    seeded = [] if mode == "disable" else [f"trainer.resume_from_path={seed}"]
    t = config(str(folder), f"trainer.resume_mode={resume}", *seeded).trainer
    said = faults.what_next(t)
    assert said == {
        "auto": f"The same command then resumes from {folder}/global_step_4",
        "auto, no checkpoint": f"The same command then resumes from {seed}",
        "disable": "The same command then starts afresh (trainer.resume_mode=disable)",
        "resume_path": f"The same command then resumes from {seed}",
    }.get(mode, said), said
    assert mode != "damaged" or said.startswith(f"The same command then stops at start-up: the checkpoint "
                                                f"{folder}/global_step_4 is damaged: "), said


@pytest.mark.parametrize("where, error, message", [
    ("step 1", "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
     "of 79.1 GiB of which 1.2 GiB is free. If reserved but unallocated memory is large try setting ...')",
     "rank 1 ran out of GPU memory in step 1 (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 79.1 GiB of which 1.2 GiB is free.). What fills it: a micro-batch's activations and its loss's "
     "logits: lower data.micro_batch_size_per_gpu=4 or model.loss_chunk_tokens=1024"),
    ("start-up", "RuntimeError('[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
     "you tried to allocate 68719476736 bytes.')",
     "rank 1 ran out of host memory in start-up (64.00 GiB asked for). What fills it: the model's weights, "
     "gradients and AdamW state on each rank: shard them over more ranks, train LoRA adapters (model.lora_rank), or "
     "keep them in host memory (model.fsdp_config.offload_params=true)"),
    ("the save of step 2", "MemoryError()",
     "rank 1 ran out of host memory in the save of step 2 (MemoryError). What fills it: a checkpoint's staged copy: "
     "trainer.async_save_staging=host, or a lower trainer.async_save_in_flight"),
])
def test_memory_run_out(run_dir, where, error, message):
    """torch.OutOfMemoryError (the GPU's), c10's CPU allocator's RuntimeError and MemoryError (the host's): exit
    code 9, where, what was asked for, what fills that phase, and the checkpoint to resume from."""
    import torch  # noqa: F401 - the errors above name it

    stop = faults.classify(eval(error), config(run_dir), 1, where)
    assert isinstance(stop, OutOfMemory) and stop.exit_code == 9, stop
    assert str(stop) == (f"{message}. `python -m sfttrain.plan` with the same arguments and --nproc estimates the "
                         f"memory per rank. The same command then resumes from {run_dir}/global_step_2")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGBUS, signal.SIGSEGV])
def test_a_data_worker_killed(tmp_path, sig):
    """torch's error for a dead DataLoader worker (its only sign is the text), behind the next read's error:
    SIGKILL and SIGBUS are memory run out (exit code 9) with their fixes, in a folder with no checkpoint yet;
    another signal is a crash, whose traceback is the bug's."""
    died = RuntimeError(f"DataLoader worker (pid 4916) is killed by signal: {signal.strsignal(sig)}. ")
    try:
        try:
            raise died
        except RuntimeError as e:
            raise ConnectionResetError(104, "Connection reset by peer") from e
    except ConnectionResetError as e:
        error = e
    (tmp_path / "run").mkdir()
    stop = faults.classify(error, config(str(tmp_path / "run"), "data.num_workers=2"), 0, "step 7")
    if sig == signal.SIGSEGV:
        assert stop is None
        return
    fix = {signal.SIGKILL: (
        "most often the host's out-of-memory killer (`dmesg` or `journalctl -k` names what it killed; a cgroup's or "
        "Slurm job's memory limit kills the same way). Each of a rank's data.num_workers=2 workers is a process "
        "holding the steps it builds ahead: lower data.num_workers (0 builds them in the rank itself), or give the "
        "job more host memory"), signal.SIGBUS: (
        "most often a full shared memory: the workers hand their batches to the rank through /dev/shm, which a "
        "container limits to 64 MiB unless told (`docker run --shm-size=8g`; on Kubernetes an emptyDir of medium "
        "Memory mounted at /dev/shm; `df -h /dev/shm` shows its size). Or set data.num_workers=0 (now 2): the rank "
        "then builds its batches itself, without shared memory")}[sig]
    assert isinstance(stop, OutOfMemory) and stop.exit_code == 9, stop
    assert str(stop) == (f"rank 0's DataLoader worker (pid 4916) was killed by {sig.name} in step 7: {fix}. The same "
                         "command then starts afresh: no checkpoint was committed yet")


def test_a_data_worker_that_finds_shared_memory_full(run_dir):
    """A worker's own error (libshm's RuntimeError, no errno) re-raised in the rank with its traceback as text."""
    error = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                         "last):\n  File \"x.py\", line 1\nRuntimeError: unable to allocate shared memory(shm) "
                         "for file </torch_7_1>: Resource temporarily unavailable (11)")
    stop = faults.classify(error, config(run_dir), 0, "step 1")
    assert isinstance(stop, OutOfMemory), stop
    assert str(stop) == ("rank 0's DataLoader worker could not hand a step over in step 1: the shared memory "
                         "(/dev/shm) is full (RuntimeError: unable to allocate shared memory(shm) for file "
                         "</torch_7_1>: Resource "
                         f"temporarily unavailable (11)). {faults.SHARED_MEMORY_FIX}. The same command then resumes "
                         f"from {run_dir}/global_step_2")


@pytest.mark.parametrize("left", [True, False])
def test_an_export_that_a_filesystem_refused(run_dir, tmp_path, left):
    """sfttrain.export's line for a read-only disk, a full one and the file size limit: what is left of the
    partial folder as it is (removed, or left where the disk refused its removal), and the fix."""
    from sfttrain.export import refused_message

    out, tmp = str(tmp_path / "data" / "hf"), str(tmp_path / "data" / "hf.tmp")
    if left:
        os.mkdir(tmp)
    partial = f"its partial folder {tmp} is left: delete it" if left else "the partial folder was removed"
    read_only = os_error(errno.EROFS, f"{tmp}/model.safetensors")
    assert refused_message(read_only, faults.fault(read_only, None), out, tmp) == (
        f"writing {out} failed: the filesystem of {tmp}/model.safetensors is read-only (Read-only file system: "
        f"{tmp}/model.safetensors). Nothing was exported ({partial}). It was mounted read-only, or the kernel made it "
        "read-only after a disk error (`dmesg` says which; `mount` shows ro): make it writable again, or export to "
        "another folder")
    full = os_error(errno.ENOSPC, f"{tmp}/model.safetensors")
    assert refused_message(full, faults.fault(full, None), out, tmp) == (
        f"the disk of {out} is full: nothing was exported ({partial}); {tmp_path / 'data'} has 45 MB free. Free "
        "space, or export to another folder; --dtype bf16 halves an fp32 checkpoint's export")
    limit = os_error(errno.EFBIG, f"{tmp}/model.safetensors")
    assert refused_message(limit, faults.fault(limit, None), out, tmp) == (
        f"a file of {out} reached the file size limit (ulimit -f): nothing was exported ({partial}). "
        f"{faults.SIZE_LIMIT_FIX}, or export smaller files (--max_shard_size)")
