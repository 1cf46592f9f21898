"""The `sfttrain` command: train, plan, export, plot.

    sfttrain train [--nproc N] [recipe.yaml] key=value ...
    sfttrain plan | export | plot ...   (python -m sfttrain.plan | export | plot with the same arguments)

`train` launches the ranks through torchrun's own launcher, in this process, and ends with the exit code
of the rank that failed (sfttrain/errors.py lists them): the rank's one message is the whole output of a
mistake, without torchrun's ChildFailedError traceback around it. `torchrun -m sfttrain.run` works as ever.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {"plan": "sfttrain.plan", "export": "sfttrain.export", "plot": "sfttrain.plot"}
USAGE = __doc__.split("\n\n")[1]


def train(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if argv and argv[0] in ("-h", "--help"):
        return importlib.import_module("sfttrain.run").main(argv) or 0
    p = argparse.ArgumentParser(prog="sfttrain train", add_help=False)  # one node; several: torchrun itself
    p.add_argument("--nproc", "--nproc_per_node", type=int, default=1)
    known, rest = p.parse_known_args(argv)
    # the launcher's own account of a failed rank (a log line, then ChildFailedError's summary) repeats
    # what the rank said: its message and exit code are the command's
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args([f"--nproc_per_node={known.nproc}", "--standalone", "-m", "sfttrain.run",
                                          *rest]))
    except ChildFailedError as failed:
        _, first = failed.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # killed by a signal: 128 + N
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "train":
        return train(rest)
    if command in COMMANDS:
        return importlib.import_module(COMMANDS[command]).main(rest) or 0
    print(f"usage:\n{USAGE}", file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
