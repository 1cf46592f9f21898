"""Where a checkpoint's model and optimizer shards are written: the host copies of background saves
(Staging), and the write itself (DCP), on a thread of the training process or in a writer process
of this rank's own (trainer.async_save_writer).

Why a process: DCP's write holds the GIL for long stretches (pickling, torch.save), which stalls the
training thread's kernel launches. A writer process shares no GIL; it gets each staging slot's host
copy once, as shared memory (torch.multiprocessing's pickling passes its file descriptors).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import socket
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from multiprocessing import context as mp_context
from multiprocessing import reduction
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import fsync_tree
from sfttrain.faults import disk_full


def writer_kind(setting: str, device: torch.device) -> str:
    """auto: a process on CUDA (kernel launches need the GIL); a thread on CPU, whose long ops release it."""
    if setting != "auto":
        return setting
    return "process" if device.type == "cuda" else "thread"


def write_shards(state_dict: dict, tmp: str, thread_count: int, group, is_main: bool) -> float:
    """This rank's DCP write into `tmp`; rank 0 then fsyncs what DCP does not. Returns its seconds."""
    started = time.perf_counter()
    writer = dcp.FileSystemWriter(tmp, thread_count=thread_count)
    writer.fs = files = KeptErrors()
    dcp.save(state_dict, storage_writer=writer, process_group=group)
    if files.errors:
        raise files.errors[0]
    if is_main:
        fsync_tree(tmp)
    return time.perf_counter() - started


def one_line(error: BaseException) -> str:
    """An exception as one line: the last line of DCP's CheckpointException (every rank's traceback)."""
    if isinstance(error, OneLineError):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    full = [line for line in lines if disk_full(line)]  # the cause, beside the zip writer's symptom
    if full:
        return full[-1][:300]
    text = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"
    return text[:300]


class OneLineError(OSError):
    """An error already worded as one line."""


class KeptErrors(FileSystem):
    """DCP's files, whose errors are kept for the write to raise: DCP does not watch its extra writer threads
    (thread_count > 1), whose death would print a traceback and leave their items out of a checkpoint that
    looks whole. A file that cannot be opened is written nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[Exception] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        try:
            with contextlib.ExitStack() as files:
                try:
                    stream = files.enter_context(super().create_stream(path, mode))
                except Exception as e:  # noqa: BLE001 - raised by write_shards, in the rank's own thread
                    self.errors.append(e)
                    stream = io.BytesIO()
                yield stream
        except Exception as e:  # noqa: BLE001 - as above
            self.errors.append(e)


class WriterProcess:
    """This rank's writer process (spawned). The writers of all ranks form a gloo group of their own
    for DCP's collectives, met through a TCPStore that rank 0's writer hosts."""

    def __init__(self, rank: int, world_size: int, group, timeout_s: int):
        ctx = mp.get_context("spawn")  # the training process has CUDA and threads: no fork
        self.conn, child = ctx.Pipe()
        self.rank = rank
        # SIGTERM is left to the rank: a save in flight as it stops the run is written (sfttrain.stop_signal)
        self.process = ctx.Process(target=stop_signal.helper_main, daemon=True,
                                   name=f"sfttrain-checkpoint-writer-{rank}",
                                   args=(__name__, _serve.__name__, child, rank, world_size, timeout_s))
        self.process.start()
        child.close()
        port = [self._receive() if rank == 0 else None]
        dist.broadcast_object_list(port, src=0, group=group)
        self.conn.send((os.environ.get("MASTER_ADDR", "127.0.0.1"), port[0]))
        self._receive()  # every rank's writer has joined the group
        self.sent: dict[int, dict] = {}  # slot -> the host copy the writer keeps for it

    def write(self, state_dict: dict, slot: int, tmp: Optional[str] = None, thread_count: int = 0) -> Any:
        """write_shards in the writer process (no `tmp`: only sends the slot's copy ahead of its first save).
        A slot's copy is sent once: its tensors are shared memory, which later saves copy into."""
        known = self.sent.get(slot) is state_dict
        try:
            send_with_fds(self.conn, (slot, tmp, thread_count, None if known else state_dict))
        except (OSError, ValueError):
            raise self._gone() from None
        self.sent[slot] = state_dict
        return self._receive()

    def exit_code(self) -> Optional[int]:
        return None if self.process.is_alive() else self.process.exitcode

    def stop(self, timeout: Optional[float] = None) -> None:
        """At once: another rank's save failed, and this writer may wait for it in a collective. A write
        stuck in the kernel (a filesystem that stopped answering) ends only once that call returns."""
        self.process.kill()
        self.process.join(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.stop()

    def _receive(self) -> Any:
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if kind == "error":
            raise OneLineError(value)
        return value

    def _gone(self) -> OneLineError:
        self.process.join(timeout=5)
        return OneLineError(f"the checkpoint writer process of rank {self.rank} ended (exit code "
                            f"{self.process.exitcode}; a negative code is the signal that ended it, e.g. -9 "
                            "for the kernel's out-of-memory killer)")


def _serve(conn, rank: int, world_size: int, timeout_s: int) -> None:
    """The writer process: writes what it is sent until None; quietly ends once its rank is gone (which says why)."""
    # a DTensor's mesh arrives without its groups, which the write never uses: torch would warn per DTensor
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            host = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
            conn.send(("ok", host.port))
        addr, port = conn.recv()
        store = host if rank == 0 else dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        conn.send(("ok", None))
        FdAfter.sock = socket.socket(fileno=os.dup(conn.fileno()))
        kept: dict[int, dict] = {}
        while (request := conn.recv()) is not None:
            slot, tmp, thread_count, state_dict = request
            if state_dict is None:  # a slot's copy is sent once, then only named
                state_dict = kept[slot]
            kept[slot] = state_dict
            try:
                result = ("ok", tmp and write_shards(state_dict, tmp, thread_count, None, rank == 0))
            except BaseException as e:  # noqa: BLE001 - the training process words it for every rank
                result = ("error", one_line(e))
            conn.send(result)
            del state_dict
    except (EOFError, ConnectionError):  # the training process is gone (a closed pipe, read or written)
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class FdAfter:
    """A pickled storage's file descriptor, received after its message (send_with_fds), in pickling order:
    torch rebuilds a storage (detach) as unpickling reaches it, and closes the fd once it is mapped."""
    sock: Optional[socket.socket] = None  # the writer's end of the pipe

    def __init__(self, fd: int):
        del fd  # the receiver's own number comes with the fd

    def detach(self) -> int:
        assert FdAfter.sock is not None
        return reduction.recvfds(FdAfter.sock, 1)[0]


class FdCollector:
    """multiprocessing's hook for a spawn's fds, which reduction.DupFd asks while it is set for this thread."""
    DupFd = FdAfter

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return fd


def send_with_fds(conn, message: Any) -> None:
    """`message`, then the file descriptors of its shared tensors, sent by this thread one per SCM_RIGHTS
    message on the pipe's socket. (By default a resource_sharer thread serves each fd to the receiver, and
    prints a traceback when the receiver dies mid-handshake, e.g. at the OOM killer's hand.)"""
    collector = FdCollector()
    mp_context.set_spawning_popen(collector)  # type: ignore[arg-type]  # (the two methods DupFd uses)
    try:
        data = reduction.ForkingPickler.dumps(message)
    finally:
        mp_context.set_spawning_popen(None)
    conn.send_bytes(data)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        for fd in collector.fds:
            reduction.sendfds(sock, [fd])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` of each tensor of a state dict (nested dicts and lists), in a new one; other values kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return type(obj)(_map(v, fn) for v in obj) if isinstance(obj, (list, tuple)) else obj


@torch.no_grad()
def _copy(src: Any, dst: Any) -> None:
    """`src`'s tensors into `dst`'s, matched by key (non_blocking: the caller synchronizes)."""
    if isinstance(src, torch.Tensor):
        _local(dst).copy_(_local(src), non_blocking=True)
    elif isinstance(src, (dict, list, tuple)):
        for key in (src if isinstance(src, dict) else range(len(src))):
            _copy(src[key], dst[key])


def host_state_dict(state_dict: dict, pinned: bool, shared: bool) -> dict:
    """Host memory for a copy of `state_dict`'s tensors (a DTensor keeps its spec, its shard on the host):
    shared where a writer process reads it, page-locked with `pinned` (in place where shared)."""
    def host(t: torch.Tensor) -> torch.Tensor:
        copy = torch.empty_like(t, device="cpu", pin_memory=pinned and not shared)
        if shared:
            local = _local(copy).share_memory_()
            if pinned and local.numel():
                cudart = torch.cuda.cudart()
                if code := int(cudart.cudaHostRegister(local.data_ptr(), local.numel() * local.element_size(), 1)):
                    raise RuntimeError(f"page-locking a staging slot failed (CUDA error {code})")
                weakref.finalize(copy, cudart.cudaHostUnregister, local.data_ptr())  # before it is freed
        return copy

    return _map(state_dict, host)


class DeviceCopy:
    """A background save's copy on the training device (milliseconds), copied to host memory by the
    writer thread when the save's turn comes (Staging.to_host); on CUDA, `ready` after the copies."""

    def __init__(self, state_dict: dict, device: torch.device):
        self.state_dict: dict = _map(state_dict, lambda t: t.detach().clone())
        self.ready = torch.cuda.Event() if device.type == "cuda" else None
        if self.ready is not None:
            self.ready.record(torch.cuda.current_stream(device))


class Staging:
    """The copies of background saves, taken before save() returns; one per save in flight. On the host,
    a slot per save; on the device (trainer.async_save_staging), a GPU copy that the writer thread copies
    into one host slot on a stream of its own. Host copies are kept and reused: shared where a writer
    process reads them, pinned with trainer.async_save_pinned (allocated once, before the second step)."""

    def __init__(self, device: torch.device, pinned: bool, shared: bool):
        self.device, self.pinned, self.shared = device, pinned, shared
        self.kept: dict[int, dict] = {}  # slot -> its host copy
        self.on_device = False  # decided by reserve, after the first step
        self.stream: Optional[torch.cuda.Stream] = None  # the writer thread's device-to-host copies

    def reserve(self, template: dict, slots: int, on_device: bool) -> list[int]:
        """Pinned: allocates the slots' host copies now, shaped like `template`. Returns the slots allocated."""
        self.on_device = on_device
        if not self.pinned:
            return []
        for slot in range(1 if on_device else slots):
            self.kept[slot] = host_state_dict(template, True, self.shared)
        return list(self.kept)

    def stage(self, state_dict: dict, busy: set) -> tuple[dict | DeviceCopy, int]:
        """On the training thread: a copy of `state_dict` and its host slot, one not in `busy`."""
        if self.on_device:
            return DeviceCopy(state_dict, self.device), 0
        slot = min(set(range(len(busy) + 1)) - busy)
        return self._into_host(state_dict, slot), slot

    def to_host(self, staged: DeviceCopy, slot: int) -> dict:
        on_device, staged.state_dict = staged.state_dict, {}  # the device copy is freed once copied
        if staged.ready is None:
            return self._into_host(on_device, slot)
        with torch.cuda.device(self.device):
            self.stream = self.stream or torch.cuda.Stream()
            with torch.cuda.stream(self.stream):  # not the training stream: its kernels go on beside the copy
                self.stream.wait_event(staged.ready)
                return self._into_host(on_device, slot)  # (synchronized: before the device copy is freed)

    def _into_host(self, state_dict: dict, slot: int) -> dict:
        if (host := self.kept.get(slot)) is None:
            host = self.kept[slot] = host_state_dict(state_dict, self.pinned, self.shared)
        _copy(state_dict, host)
        if self.device.type == "cuda":  # the copies into pinned memory are asynchronous
            torch.cuda.current_stream(self.device).synchronize()
        return host


def tensor_bytes(state_dict: dict, on: Optional[str] = None) -> int:
    """The bytes of a state dict's tensors (a DTensor's local shard); with `on`, those on that device type."""
    local: list[torch.Tensor] = []
    _map(state_dict, lambda t: local.append(_local(t)))
    return sum(t.numel() * t.element_size() for t in local if on is None or t.device.type == on)
