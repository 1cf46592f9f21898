"""The test suite's preloaded rank server: `python -m tests.forkserver LISTENING_FD PARENT_PIPE_FD`, started by
tests/conftest.py (one per pytest worker, in the environment and folder of the test ranks).

A rank spends ~5 CPU-s importing torch, transformers and sfttrain before its first line of work, and
the suite starts ~190 of them. This process imports all that once, then forks one child per rank a
client (tests/forkrank.py) asks for. The child takes the client's environment (wholesale), working
folder, arguments, stdout and file size limit, and runs the module the client names (sfttrain.run,
or a tool such as sfttrain.export) as `python -m` does: the product's own entry point in a real
process. conftest forks only jobs whose environment and folder equal this server's (nothing read at
import differs, but TORCH_LOGS, which the child has torch read again); the others start the usual way.

For a job of several ranks the child gets torchrun's rendezvous variables, and the server does what
the tests rely on torchrun for: when a rank fails, the others get SIGTERM (SIGKILL 30 s later), and
the job's status is the first failing rank's. Tests of torchrun's own output launch torchrun.
"""

from __future__ import annotations

import os
import resource
import runpy
import selectors
import signal
import socket
import sys
import time

# What a rank imports before its first step (sfttrain.run and its train()). Not sfttrain.run itself:
# runpy runs it as __main__ and warns when it is imported already. No torch op, OpenMP pool or
# process group starts here: a forked child must start from what a fresh interpreter has (the one
# thread besides this one is jemalloc's background thread, which pyarrow starts at import in every
# rank too; jemalloc's own fork handlers keep its allocator sound in the child).
import numpy
import pandas  # noqa: F401  (pyarrow's Parquet reader imports it at a rank's first read)
import sfttrain.config  # noqa: F401
import sfttrain.distributed  # noqa: F401
import sfttrain.errors  # noqa: F401
import sfttrain.help  # noqa: F401
import sfttrain.metrics  # noqa: F401
import sfttrain.runtime  # noqa: F401
import sfttrain.trainer  # noqa: F401
# the model classes of the suite's models (stories260K, the tiny Qwen2) and what transformers imports with
# the first one a rank builds (its masking and generation code): 0.3 CPU-s of each rank's start
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401

from tests.forkrank import free_port, receive, send

STOP_GRACE_S = 30  # torchrun's wait between SIGTERM and SIGKILL of the ranks left when one failed


class Job:
    """One client's ranks: pid -> pidfd while running, and the first failing rank's status."""

    def __init__(self, conn: socket.socket):
        self.conn: socket.socket | None = conn
        self.running: dict[int, int] = {}
        self.status = 0
        self.kill_at: float | None = None


def signal_ranks(pids, sig: int) -> None:
    """Each rank leads a session of its own (its DataLoader workers are in it): signal the group."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # not yet its own group leader, or already gone
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class Server:
    def __init__(self, listener: socket.socket, parent_alive: int):
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(parent_alive, selectors.EVENT_READ, "parent")  # readable: pytest is gone
        self.jobs: list[Job] = []

    def serve(self) -> dict:
        """Serves until killed; returns only in a forked child: the rank's request."""
        try:
            while True:
                for key, _ in self.selector.select(self.timeout()):
                    if key.fileobj is self.listener:
                        conn, _ = self.listener.accept()
                        self.selector.register(conn, selectors.EVENT_READ, Job(conn))
                    elif key.data == "parent":
                        sys.exit(0)
                    elif isinstance(key.data, Job):
                        child = self.on_client(key.data)
                        if child is not None:
                            return child
                    else:
                        self.on_exit(*key.data)
                self.kill_stragglers()
        except BaseException:
            for job in self.jobs:
                signal_ranks(job.running, signal.SIGKILL)
            raise

    def timeout(self) -> float | None:
        deadlines = [job.kill_at for job in self.jobs if job.kill_at is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def on_client(self, job: Job) -> dict | None:
        """The client's request (fork its ranks), or its end (kill them: nobody waits for them)."""
        request, fds = receive(job.conn)
        if request is None:
            self.close_client(job)
            signal_ranks(job.running, signal.SIGKILL)
            self.finish_if_done(job)
            return None
        self.jobs.append(job)
        port = free_port() if request["nproc"] > 1 else None
        for rank in range(request["nproc"]):
            sys.stdout.flush(), sys.stderr.flush()  # nothing buffered here is written twice
            pid = os.fork()
            if pid == 0:
                self.close_in_child()
                become_rank(request, rank, port, fds[0])
                return request
            pidfd = os.pidfd_open(pid)
            job.running[pid] = pidfd
            self.selector.register(pidfd, selectors.EVENT_READ, (job, pid))
        os.close(fds[0])
        send(job.conn, {"pids": list(job.running)})
        return None

    def close_client(self, job: Job) -> None:
        self.selector.unregister(job.conn)
        job.conn.close()
        job.conn = None

    def on_exit(self, job: Job, pid: int) -> None:
        pidfd = job.running.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status != 0 and job.status == 0:
            job.status = status
            signal_ranks(job.running, signal.SIGTERM)
            job.kill_at = time.monotonic() + STOP_GRACE_S
        self.finish_if_done(job)

    def finish_if_done(self, job: Job) -> None:
        """Once every rank of the job has ended: its status to the client, if it still waits."""
        if job.running:
            return
        if job.conn is not None:
            try:
                send(job.conn, {"status": job.status})
            except OSError:  # the client is gone already
                pass
            self.close_client(job)
        if job in self.jobs:
            self.jobs.remove(job)

    def kill_stragglers(self) -> None:
        for job in self.jobs:
            if job.kill_at is not None and time.monotonic() >= job.kill_at:
                signal_ranks(job.running, signal.SIGKILL)
                job.kill_at = None

    def close_in_child(self) -> None:
        """A rank keeps none of the server's files (a client must see its end when its own ranks end)
        and knows no other job's ranks."""
        self.jobs = []
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()  # the listener, the clients
            else:
                os.close(key.fd)  # pidfds, the pipe from pytest
        self.selector.close()


def become_rank(request: dict, rank: int, port: int | None, out_fd: int) -> None:
    """This child as `python -m MODULE` started by the client's launcher: its own session (as
    torchrun starts ranks, as launch starts one), output, folder, environment, arguments and file
    size limit (a process inherits its launcher's)."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_FSIZE, tuple(request["file_size_limit"]))
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(request["cwd"])
    env = dict(request["env"])
    nproc = request["nproc"]
    if nproc > 1:  # torchrun's rendezvous variables, all one node
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_RANK="0", GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch_logs = os.environ.get("TORCH_LOGS")
    os.environ.clear()
    os.environ.update(env)
    if env.get("TORCH_LOGS") != torch_logs:  # torch reads it at import: read again, as that import would have
        import torch._logging._internal

        torch._logging._internal._init_logs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # numpy's global RNG (a rank saves its state in each checkpoint) is drawn from the OS in a fresh
    # interpreter, as Python's `random` is (CPython reseeds that one in a forked child itself).
    # The one thing a fork cannot redraw is str hashing's seed: forked ranks share it (the torchrun
    # jobs, test_multinode's two agents for one, keep ranks with seeds of their own in the suite).
    numpy.random.seed()
    sys.argv = [sys.argv[0], *request["argv"]]
    # a module imported here already (sfttrain.export, through the trainer's imports) runs anew as
    # __main__, as in a fresh `python -m`, where nothing imported it before (runpy warns otherwise)
    sys.modules.pop(request["module"], None)


def on_sigterm(signum, frame):
    sys.exit(0)  # serve() kills the ranks still running on its way out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    request = Server(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2])).serve()
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
