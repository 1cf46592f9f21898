"""bench.moe_w4 (tests/bench_run.py says what the bench tests check): sfttrain and TRL on one tiny MoE
folder, and the deadline that bounds TRL's run."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from tests.bench_run import SAMPLE, records, run_bench_here


def test_moe_w4(tmp_path):
    """sfttrain, then TRL (where the bench extra is installed), on one saved tiny MoE folder, then the
    two side by side. TRL's MFU counts the active parameters: its record's FLOPs per token against
    a hand count of the tiny config."""
    trl = importlib.util.find_spec("trl") is not None
    out = tmp_path / "w4.jsonl"
    stale = tmp_path / "runs" / "w4" / "metrics.jsonl"  # an earlier job's in the same --work (another setting)
    stale.parent.mkdir(parents=True)
    stale.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (1, 2, 3)))
    run_bench_here("bench.moe_w4", "--tiny", "--device", "cpu", "--data", SAMPLE, "--work", str(tmp_path),
                   "--out", str(out), "--systems", "sfttrain", *(["trl"] if trl else []))
    (model_dir,) = (str(path) for path in tmp_path.glob("model_*"))  # the one folder, with its weights
    assert (Path(model_dir) / "model.safetensors").is_file()
    sfttrain, *rest = records(out)
    assert sfttrain["variant"] == "w4" and sfttrain["timed_steps"] == "2-3" and sfttrain["real_tokens"] > 0, sfttrain
    assert sfttrain["model_dir"] == model_dir
    if not trl:
        assert rest == []
        return
    trl_record, both = rest
    assert trl_record["system"] == "trl" and trl_record["model_dir"] == model_dir and trl_record["trl_padding_free"]
    assert trl_record["timed_steps"] == "2-3" and trl_record["precision"] == "fp32 weights + bf16 autocast"
    # tiny W4: embedding and head 2 x 151936 x 64, per layer attention (q, o: 64 x 64; k, v: 64 x 32; q/k norms 16
    # each) + 2 norms of 64 + router 8 x 64 + 2 of 8 experts (3 x 64 x 32 each), final norm 64
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 2 * 64 + 8 * 64 + 2 * 3 * 64 * 32
    active = 2 * 151936 * 64 + 2 * layer + 64
    mean_attention = trl_record["flops_per_token"] - 6 * active  # 6 L H Dh sum(s^2)/sum(s) > 0, < 6 L H Dh max(s)
    assert 0 < mean_attention < 6 * 2 * 4 * 16 * 256, trl_record
    assert both["system"] == "sfttrain vs trl" and both["trl_status"] == both["sfttrain_status"] == "trained"
    assert both["sfttrain_over_trl"] == round(sfttrain["real_tokens_per_s"] / trl_record["real_tokens_per_s"], 2)


def test_trl_deadline_ends_the_timed_window():
    """bench.trl_w1's deadline (bench.moe_w4 bounds TRL's run with it): past it, training stops at the
    first step end after a timed step, and the record's window ends there; before it, nothing stops."""
    pytest.importorskip("trl", reason="TRL comes with the bench extra: pip install -e '.[bench]'")
    from transformers import TrainerControl, TrainerState

    from bench.common import StepClock, TokenLedger
    from bench.trl_w1 import Timing

    def train(deadline: float, steps: int = 6) -> tuple[StepClock, TokenLedger, Timing, int]:
        clock, ledger = StepClock("cpu", 2, steps), TokenLedger(2, steps)
        timing, control = Timing(clock, ledger, deadline), TrainerControl()
        step = 0
        while step < steps and not control.should_training_stop:
            step += 1
            ledger.add(step, torch.tensor([3, 4]), torch.tensor(5))
            timing.on_step_end(None, TrainerState(global_step=step), control)
        return clock, ledger, timing, step

    clock, ledger, timing, last = train(deadline=time.monotonic() - 1)  # already past: stops after step 3
    assert (last, timing.stopped_at, len(clock.step_times())) == (3, 3, 1)
    assert ledger.totals() == ([3, 4], 5)
    clock, ledger, timing, last = train(deadline=time.monotonic() + 3600)
    assert (last, timing.stopped_at, len(clock.step_times())) == (6, None, 4)
    assert ledger.totals() == ([3, 4] * 4, 20)
