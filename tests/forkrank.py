"""A test job's launcher when its ranks are forked from the preloaded server (tests/forkserver.py):
`python tests/forkrank.py SOCKET NPROC PIDFILE -m MODULE ARGS...` (MODULE: sfttrain.run, or a
one-process tool such as sfttrain.export).

It stands where `python -m MODULE` (one rank) or torchrun (several) would, started by the same
Popen call (environment, working folder, output, file size limit): it sends the server its own
environment, working folder, module and arguments, stdout and file size limit (`ulimit -f`, which a
process inherits from its launcher), writes the ranks' pids to PIDFILE (kill_job freezes and kills
them with it), waits for them and exits with their status: one rank's own (a signal as a signal, as
Popen reports a killed `python -m`), or for several the first failing rank's (the server stops the
others, as torchrun does). Its death makes the server kill the job's ranks. It imports no torch: it
costs an interpreter start, not the ~5 CPU-s of torch and transformers that the server paid once.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys

# one message per send on a SOCK_SEQPACKET socket: the request (environment included) fits in this
MESSAGE_BYTES = 1 << 20


def free_port() -> int:
    """A free TCP port on this host: a job's rendezvous port (torchrun's or the forked ranks')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    socket.send_fds(conn, [json.dumps(message).encode()], list(fds))


def receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the file descriptors that came with it; (None, []) when the peer is gone."""
    data, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 1)
    return (json.loads(data) if data else None), fds


def exit_like(status: int) -> None:
    """Exits with a rank's Popen-style status: -N, killed by signal N, is reproduced by dying of N."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def main(argv: list[str]) -> None:
    path, nproc, pid_file, flag, module, *args = argv
    assert flag == "-m", argv
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(path)
        send(conn, {"nproc": int(nproc), "module": module, "argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                    "file_size_limit": resource.getrlimit(resource.RLIMIT_FSIZE)}, [1])
        started, _ = receive(conn)
        if started is None:
            sys.exit("forkrank: the fork server ended the connection (its log is beside its socket)")
        with open(pid_file + ".tmp", "w") as f:
            json.dump(started["pids"], f)
        os.rename(pid_file + ".tmp", pid_file)  # whole, or not there yet
        ended, _ = receive(conn)
    if ended is None:
        sys.exit("forkrank: the fork server died during the job")
    exit_like(ended["status"])


if __name__ == "__main__":
    main(sys.argv[1:])
