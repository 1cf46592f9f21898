"""Nothing untrusted is unpickled, and no remote code runs unless the user asks."""

import random

import numpy as np
import torch

from sfttrain.checkpoint_load import rng_state, set_rng_state


def test_rng_states_round_trip_without_pickle(tmp_path):
    """The per-rank RNG file is tensors, ints and lists only: torch.load(weights_only=True), which
    refuses arbitrary objects, restores every generator exactly."""
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.normal()  # a cached Gaussian in numpy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
