"""Where a checkpoint's model and optimizer shards are written: the host copies of background saves
(Staging), and the write itself (DCP), on a thread of the training process or in a writer process
of this rank's own (trainer.async_save_writer).

Why a process: DCP's write holds the GIL for long stretches (pickling, torch.save), which stalls the
training thread's kernel launches. A writer process shares no GIL; it gets the host copy through
shared memory, sent once per staging slot.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import pickle
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from multiprocessing.reduction import recv_handle, send_handle
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from sfttrain import stop_signal
from sfttrain.checkpoint_folder import fsync_tree


def writer_kind(setting: str, device: torch.device) -> str:
    """auto: a process on CUDA (kernel launches need the GIL); a thread on CPU, whose long ops release it."""
    if setting != "auto":
        return setting
    return "process" if device.type == "cuda" else "thread"


def cuda_room(device: torch.device) -> int:
    """Free memory less a tenth of the whole, left for later steps' higher peaks and fragmentation."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, free - total // 10)


def write_shards(state_dict: dict, tmp: str, thread_count: int, group, is_main: bool,
                 errors: WriterThreadErrors) -> float:
    """This rank's DCP write into `tmp`; rank 0 then fsyncs what DCP does not. Returns its seconds."""
    started = time.perf_counter()
    errors.errors.clear()
    writer = dcp.FileSystemWriter(tmp, thread_count=thread_count)
    dcp.save(state_dict, storage_writer=writer, process_group=group)
    if errors.errors:
        raise errors.errors[0]
    if is_main:
        fsync_tree(tmp)
    return time.perf_counter() - started


def one_line(error: BaseException) -> str:
    """An exception as one line: the last line of DCP's CheckpointException (every rank's traceback)."""
    if isinstance(error, OneLineError):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    full = [line for line in lines if "No space left" in line]  # the cause, beside the zip writer's symptom
    if full:
        return full[-1][:300]
    text = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"
    return text[:300]


class OneLineError(OSError):
    """An error already worded as one line."""


class WriterProcessError(OneLineError):
    """A write that failed in the writer process (its `one_line`), or the process itself gone."""


class WriterThreadErrors:
    """The errors of DCP's extra writer threads (thread_count > 1), which DCP does not notice (a
    checkpoint could be committed without that thread's files): kept here, they fail the save."""

    THREAD = "_write_files_from_queue"  # the target DCP's writer threads run, part of their name

    def __init__(self):
        self.errors: list[BaseException] = []
        self.previous = threading.excepthook
        threading.excepthook = self.hook

    def hook(self, args) -> None:
        if args.thread is not None and self.THREAD in args.thread.name:
            self.errors.append(args.exc_value)
        else:
            self.previous(args)


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

    def write(self, state_dict: dict, slot: Optional[int], tmp: Optional[str] = None, thread_count: int = 0) -> Any:
        """write_shards in the writer process (no `tmp`: only keeps the slot's copy, ahead of its first
        save); a kept slot's copy is sent once."""
        known = slot is not None and self.sent.get(slot) is state_dict
        try:
            self.conn.send((slot, tmp, thread_count))
            send_shared(self.conn, None if known else state_dict)
        except (OSError, ValueError):
            raise self._gone() from None
        if slot is not None:
            self.sent[slot] = state_dict
        return self._receive()

    def exit_code(self) -> Optional[int]:
        return None if self.process.is_alive() else self.process.exitcode

    def stop(self) -> None:
        """At once: another rank's save failed, and this writer may wait for it in a collective."""
        self.process.kill()
        self.process.join()

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
            raise WriterProcessError(value)
        return value

    def _gone(self) -> WriterProcessError:
        self.process.join(timeout=5)
        return WriterProcessError(f"the checkpoint writer process of rank {self.rank} ended (exit code "
                                  f"{self.process.exitcode}; a negative code is the signal that ended it, e.g. -9 "
                                  "for the kernel's out-of-memory killer)")


def _serve(conn, rank: int, world_size: int, timeout_s: int) -> None:
    """The writer process: writes what it is sent until None; quietly ends once its rank is gone (which says why)."""
    # a DTensor's mesh arrives without its groups, which the write never uses: torch would warn per DTensor
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        _join_writers(conn, rank, world_size, datetime.timedelta(seconds=timeout_s))
        _write_requests(conn, rank)
    except (EOFError, ConnectionError):  # the training process is gone (a closed pipe, read or written)
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_writers(conn, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    if rank == 0:
        host = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        conn.send(("ok", host.port))
    addr, port = conn.recv()
    store = host if rank == 0 else dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    conn.send(("ok", None))


def _write_requests(conn, rank: int) -> None:
    errors, kept = WriterThreadErrors(), {}
    while (request := conn.recv()) is not None:
        slot, tmp, thread_count = request
        state_dict = receive_shared(conn)
        if state_dict is None:  # a kept slot's copy: sent once, then only named
            state_dict = kept[slot]
        elif slot is not None:
            kept[slot] = state_dict
        if tmp is None:  # sent ahead of its first save
            conn.send(("ok", None))
            continue
        try:
            result = ("ok", write_shards(state_dict, tmp, thread_count, None, rank == 0, errors))
        except BaseException as e:  # noqa: BLE001 - the training process words it for every rank
            result = ("error", one_line(e))
        conn.send(result)
        del state_dict


def send_shared(conn, obj: Any) -> None:
    """Sends a state dict in shared memory (or None) over a local pipe: storages as file descriptors,
    the rest pickled. (multiprocessing's tensor pickling serves descriptors from a thread that prints a
    traceback when the receiver dies.)"""
    storages: dict[int, tuple[int, torch.UntypedStorage]] = {}  # data pointer -> (index, storage): each sent once

    class StoragesApart(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, torch.storage.TypedStorage):
                storage = value._untyped_storage
                index, _ = storages.setdefault(storage.data_ptr(), (len(storages), storage))
                return index, value.dtype
            return None

    payload = io.BytesIO()
    StoragesApart(payload, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    conn.send((len(storages), payload.getvalue()))
    for _, storage in storages.values():
        fd, size = storage._share_fd_cpu_()  # the storage's own descriptor: the pipe passes a duplicate
        conn.send(size)
        send_handle(conn, fd, None)


def receive_shared(conn) -> Any:
    """The other end of send_shared."""
    count, payload = conn.recv()
    storages = []
    for _ in range(count):
        size = conn.recv()
        fd = recv_handle(conn)
        storages.append(torch.UntypedStorage._new_shared_fd_cpu(fd, size))
        os.close(fd)  # the storage maps the memory; the descriptor is no longer needed

    class StoragesApart(pickle.Unpickler):
        def persistent_load(self, pid):
            index, dtype = pid
            return torch.storage.TypedStorage(wrap_storage=storages[index], dtype=dtype, _internal=True)

    return StoragesApart(io.BytesIO(payload)).load()


class DeviceCopy:
    """A background save's copy on the training device (milliseconds), copied to host memory by the
    writer thread when the save's turn comes (Staging.to_host)."""

    def __init__(self, state_dict: dict, device: torch.device):
        self.state_dict: Optional[dict] = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state_dict)
        self.ready = None  # on CUDA: the training stream's point after the copies
        if device.type == "cuda":
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(device))


class Staging:
    """The copies of background saves, taken before save() returns (the next steps change the
    weights); one per save in flight. On the host, a slot per save; on the device
    (trainer.async_save_staging), a GPU copy that the writer thread copies into one host slot on a
    stream of its own. Host copies are shared where a writer process reads them, and pinned with
    trainer.async_save_pinned; such copies are kept and reused. Page locking is slow and slows the
    steps beside it, so pinned slots are allocated once, between the first and second step."""

    def __init__(self, device: torch.device, pinned: bool, shared: bool):
        self.device, self.pinned, self.shared = device, pinned, shared
        self.keeps = pinned or shared
        self.kept: dict[int, dict] = {}  # slot -> its kept host copy
        self.on_device = False  # decided by reserve, after the first step
        self.stream: Optional[torch.cuda.Stream] = None  # the writer thread's device-to-host copies

    def reserve(self, template: dict, slots: int, on_device: bool) -> list[int]:
        """Pinned: allocates the slots' host copies now, shaped like `template`. Returns the slots allocated."""
        self.on_device = on_device
        if not self.pinned:
            return []
        for slot in range(1 if on_device else slots):
            self.kept[slot] = _create_cpu_state_dict(template, True, self.shared)
        return list(self.kept)

    def stage(self, state_dict: dict, busy: set) -> tuple[dict | DeviceCopy, int]:
        """On the training thread: a copy of `state_dict` and its host slot, one not in `busy`."""
        if self.on_device:
            return DeviceCopy(state_dict, self.device), 0
        slot = min(set(range(len(busy) + 1)) - busy)
        staged = self._host_copy(slot, like=state_dict)
        _copy_state_dict(state_dict, staged, type_check=False)
        return staged, slot

    def to_host(self, staged: dict | DeviceCopy, slot: int) -> dict:
        if not isinstance(staged, DeviceCopy):
            return staged
        on_device, staged.state_dict = staged.state_dict, None  # the device copy is freed once copied
        host = self._host_copy(slot, like=on_device)
        if staged.ready is None:
            _copy_state_dict(on_device, host, type_check=False)
            return host
        with torch.cuda.device(self.device):
            self.stream = self.stream or torch.cuda.Stream()
            with torch.cuda.stream(self.stream):  # not the training stream: its kernels go on beside the copy
                self.stream.wait_event(staged.ready)
                _copy_state_dict(on_device, host, non_blocking=True, type_check=False)
            self.stream.synchronize()  # before the device copy is freed and the host copy written
        return host

    def _host_copy(self, slot: int, like: dict) -> dict:
        host = self.kept.get(slot) or _create_cpu_state_dict(like, self.pinned, self.shared)
        if self.keeps:
            self.kept[slot] = host
        return host


def tensor_bytes(state_dict: dict, on: Optional[str] = None) -> int:
    """The bytes of a state dict's tensors (a DTensor's local shard); with `on`, those on that device type."""
    tensors = [t for t in tree_leaves(state_dict) if isinstance(t, torch.Tensor)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if on is None or t.device.type == on)
