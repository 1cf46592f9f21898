"""`python -m tests.rank_function MODULE FUNCTION [ARGS...]`: MODULE.FUNCTION(*ARGS) on every rank of a job,
in a gloo process group of its ranks, for the tests of code that needs several processes but not the
trainer (tests/conftest.py run_on_ranks). Started as the suite starts its jobs: ranks forked from the
rank server (tests/forkserver.py: torch and transformers imported already) or by torchrun, whose
rendezvous variables both set. A failing rank (an assertion) fails the job, with its traceback in
the job's output."""

from __future__ import annotations

import importlib
import sys

import torch.distributed as dist


def main(module: str, function: str, *args: str) -> None:
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    try:
        getattr(importlib.import_module(module), function)(*args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
