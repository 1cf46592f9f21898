"""bench/base_quant_loss.py (tests/bench_run.py says what the bench tests check): LoRA over stories260K's
base as it is and in NF4, 3 steps on a CPU, and the step-1 losses the two records hold.

Step 1's loss is the base's own (LoRA's B starts at zero), on the same batch in both runs, so the two
differ only by NF4's error on the frozen linear weights. Bound: eps * loss, eps the relative RMS error
NF4 puts on those weights (torchao's round trip, ~0.09 here): a first-order estimate of the largest
move, every layer's error pushing the loss one way; NF4 costs far less in practice (QLoRA). Not equal:
the runs are deterministic on a CPU, so a base left unquantized would give the very same loss, and
fp32's reduction noise (~1e-6 relative) is far below the 1e-4 asked.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.bench_run import SAMPLE, records, run_bench_here
from tests.conftest import STORIES


def nf4_relative_error() -> float:
    from tests.test_nf4 import SCALER_BLOCKS, dequantized_base

    weights, dequantized = load_file(STORIES / "model.safetensors"), dequantized_base()
    linear = [name for name in weights if name.split(".")[-2] in SCALER_BLOCKS]
    error = sum((weights[n] - dequantized[n]).square().sum() for n in linear)
    return float((error / sum(weights[n].square().sum() for n in linear)).sqrt())


def test_base_quant_loss_records_none_and_nf4(tmp_path):
    out = tmp_path / "bq.jsonl"
    run_bench_here("bench.base_quant_loss", "--device", "cpu", "--model", str(STORIES), "--steps", "3", "--rows", "64",
                   "--data", SAMPLE, "--work", str(tmp_path), "--out", str(out))
    none, nf4 = records(out)
    assert (none["base_quant"], nf4["base_quant"]) == ("none", "nf4")
    assert "model.base_quant=nf4" in nf4["overrides"]
    for r in (none, nf4):
        assert r["status"] == "trained" and sorted(r["loss_by_step"]) == ["1", "2", "3"]
        assert r["loss_last_step"] == r["loss_by_step"]["3"]
        assert r["loss_mean_last"] == pytest.approx(sum(r["loss_by_step"].values()) / 3)
    assert "rel_diff_last_step" not in none
    assert nf4["rel_diff_last_step"] == pytest.approx(nf4["loss_last_step"] / none["loss_last_step"] - 1, abs=1e-5)
    first, first_nf4 = none["loss_by_step"]["1"], nf4["loss_by_step"]["1"]
    assert 1e-4 * first < abs(first_nf4 - first) < nf4_relative_error() * first
    assert nf4["rel_diff_mean_last"] == pytest.approx(nf4["loss_mean_last"] / none["loss_mean_last"] - 1, abs=1e-5)
