"""decided_by_rank0 and agree_on_errors on real ranks: what rank 0 alone decides, and what any one
rank alone found, reaches every rank."""

import os

import pytest
import torch.distributed as dist

from sfttrain.distributed import agree_on_errors, decided_by_rank0
from sfttrain.errors import DataError
from tests.conftest import run_on_ranks


def _decide_on_rank0_alone(marker: str) -> None:
    """Rank 0's value reaches rank 1, whose own `decide` never runs; rank 0's DataError is raised on
    rank 1 as itself; an error found on rank 1 alone is known to rank 0."""
    rank = dist.get_rank()

    def decide() -> str:
        with open(marker, "a") as f:
            f.write(f"{rank}\n")
        return f"chosen by rank {rank}"

    assert decided_by_rank0(decide) == "chosen by rank 0"
    with open(marker) as f:
        assert f.read() == "0\n"

    def refuse() -> None:
        raise DataError(f"row 3 is bad (found by rank {rank})")

    with pytest.raises(DataError, match=r"^row 3 is bad \(found by rank 0\)$"):
        decided_by_rank0(refuse)
    assert agree_on_errors("rank 1's disk is full" if rank == 1 else None) == ["rank 1's disk is full"]
    assert agree_on_errors(None) == []


def test_rank0_decides_and_every_rank_learns_each_error(tmp_path):
    run_on_ranks(2, _decide_on_rank0_alone, str(tmp_path / "decided"))


def test_without_a_process_group_this_process_decides():
    assert not dist.is_initialized()
    assert decided_by_rank0(lambda: os.getpid()) == os.getpid()
    with pytest.raises(DataError, match="bad"):
        decided_by_rank0(lambda: (_ for _ in ()).throw(DataError("bad")))
    assert agree_on_errors("mine") == ["mine"]
