"""Every bench/ script runs its smoke mode on CPU (tiny models, a few steps), so that none breaks
unnoticed. bench.loss_kernel times CUDA kernels and has no CPU mode (its docstring says why): on a
machine without CUDA its refusal is what runs. The records are checked for what each script
measured, not for how fast: these are CPU runs of shapes no one benchmarks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, kill_job, rank_env

SAMPLE = str(REPO / "assets" / "data" / "gsm8k" / "train.jsonl")  # 2000 rows: --tiny reads the first 64
CUDA = torch.cuda.is_available()


def run_bench(module: str, *args: str, timeout: int = 600) -> str:
    """`python -m bench.X ...` from the checkout, on CPU ranks; its output, or a failure showing its end."""
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=rank_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)  # the torchrun jobs it started go too
            raise AssertionError(f"{module} timed out after {timeout}s")
    assert proc.returncode == 0, f"{module} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sfttrain_w1_then_profile_w1(tmp_path):
    """sfttrain_w1 --tiny prepares the model folder and Parquet and runs sfttrain; profile_w1 --tiny
    profiles steps of that folder, as on the GPU machine."""
    out = tmp_path / "w1.jsonl"
    run_bench("bench.sfttrain_w1", "--tiny", "--device", "cpu", "--variant", "eager", "--data", SAMPLE,
              "--work", str(tmp_path), "--out", str(out))
    (record,) = records(out)
    assert record["variant"] == "eager" and record["timed_steps"] == "2-4" and record["real_tokens"] > 0
    profile = run_bench("bench.profile_w1", "--tiny", "--work", str(tmp_path), "--trace", str(tmp_path / "trace.json"))
    assert "ms/step" in profile and (tmp_path / "trace.json").is_file()


def test_sfttrain_w1_refuses_a_second_epoch(tmp_path, monkeypatch):
    """W1 is 60 steps of 64 distinct samples: on the 2000-row sample sfttrain would wrap an epoch."""
    from bench import sfttrain_w1

    monkeypatch.setattr(sys, "argv", ["sfttrain_w1", "--variant", "eager", "--data", SAMPLE, "--work", str(tmp_path),
                                      "--out", str(tmp_path / "w1.jsonl")])
    with pytest.raises(SystemExit, match="60 steps of 64 sequences need 3840 samples, .* has 2000"):
        sfttrain_w1.main()
    assert not (tmp_path / "runs").exists()


def test_lora_w2b_and_trl_w1(tmp_path):
    """sfttrain then TRL + peft (bench.trl_w1 --peft --model_dir) on one saved tiny W2b folder."""
    pytest.importorskip("trl", reason="TRL comes with the bench extra: pip install -e '.[bench]'")
    out = tmp_path / "w2b.jsonl"
    run_bench("bench.lora_w2b", "--tiny", "--device", "cpu", "--data", SAMPLE, "--work", str(tmp_path),
              "--out", str(out))
    sfttrain, trl = records(out)
    assert sfttrain["variant"] == "lora_w2b" and sfttrain["real_tokens"] > 0
    assert trl["system"] == "trl" and trl["peft"]["r"] == 64 and trl["real_tokens"] > 0
    assert trl["model_dir"] == str(next(tmp_path.glob("model_*")))  # the one folder both trained


def test_lora_w2b_model_folder_is_keyed_by_shape():
    """A --tiny run and a full one in the same --work never share a model folder."""
    from bench.common import model_folder, w2b_config
    from bench.w1_data import load_tokenizer

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizers" / "qwen2.5-instruct"))
    tiny, full = (model_folder("work", w2b_config(tokenizer, tiny=tiny)) for tiny in (True, False))
    assert tiny != full and model_folder("work", w2b_config(tokenizer, tiny=True)) == tiny


def test_moe_w4(tmp_path):
    """sfttrain, then TRL (where the bench extra is installed), on one saved tiny MoE folder, then the
    two side by side. TRL's MFU counts the active parameters: its record's FLOPs per token against
    a hand count of the tiny config."""
    trl = importlib.util.find_spec("trl") is not None
    out = tmp_path / "w4.jsonl"
    run_bench("bench.moe_w4", "--tiny", "--device", "cpu", "--data", SAMPLE, "--work", str(tmp_path), "--out", str(out),
              "--systems", "sfttrain", *(["trl"] if trl else []))
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
    assert trl_record["timed_steps"] == "2-4" and trl_record["precision"] == "fp32 weights + bf16 autocast"
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


def test_padded_w1(tmp_path):
    out = tmp_path / "padded.jsonl"
    run_bench("bench.padded_w1", "--tiny", "--device", "cpu", "--data", SAMPLE, "--out", str(out))
    (record,) = records(out)
    assert record["system"] == "padded" and record["timed_samples"] == 3 * 4  # 3 timed steps of 2 x 2


def test_long_context(tmp_path):
    """One sp=2 job (2 gloo ranks) on 256-token samples."""
    out = tmp_path / "w3.jsonl"
    run_bench("bench.long_context", "--tiny", "--sp", "2", "--lengths", "256", "--work", str(tmp_path),
              "--out", str(out))
    (record,) = records(out)
    assert record["status"] == "trained" and record["sp"] == 2 and record["timed_steps"] == [2, 3]


def test_scale(tmp_path):
    """One run of the part (its W2b run: both model folders prepared, 2 ranks, FULL_SHARD)."""
    out = tmp_path / "scale.jsonl"
    run_bench("bench.scale", "--tiny", "--part", "w2b", "--run", "w2b_full_shard_ckpt", "--data", SAMPLE,
              "--work", str(tmp_path), "--out", str(out))
    (record,) = records(out)
    assert record["steps_logged"] == 4 and record["real_tokens_per_s"] > 0, record


def test_async_ckpt(tmp_path):
    """A background and a synchronous setting, each a run with periodic saves, beside the disk's speed."""
    out = tmp_path / "ckpt.jsonl"
    run_bench("bench.async_ckpt", "--tiny", "--setting", "async_pinned", "sync", "--data", SAMPLE,
              "--work", str(tmp_path), "--out", str(out))
    background, synchronous = records(out)
    assert (background["setting"], synchronous["setting"]) == ("async_pinned", "sync")
    assert [s["async"] for s in background["saves"]] == [True, True] and not synchronous["saves"][0]["async"]
    assert all(r["disk_gb_per_s"] > 0 and r["write_gb_per_s_median"] > 0 for r in (background, synchronous))


def test_data_benches(tmp_path, monkeypatch, capsys):
    """The scripts that run no training, in this process: W1's token statistics and Parquet, the
    cost of building a W1 step, and the data-at-scale reader on a small file."""
    from bench import data_cost_w1, data_scale, w1_data

    tokenizer = str(REPO / "assets" / "tokenizers" / "qwen2.5-instruct")
    for argv in (["w1_data", "--data", SAMPLE, "--tokenizer", tokenizer, "--parquet", str(tmp_path / "w1.parquet")],
                 ["data_cost_w1", "--data", SAMPLE, "--tokenizer", tokenizer, "--steps", "1"],
                 ["data_scale", "--rows", "2000", "--group_rows", "500", "--render_rows", "50", "--train_rows", "1000",
                  "--batch", "64", "--budget_s", "30", "--data", str(tmp_path / "scale.parquet"),
                  "--out", str(tmp_path / "scale.json")]):
        monkeypatch.setattr(sys, "argv", argv)
        {"w1_data": w1_data, "data_cost_w1": data_cost_w1, "data_scale": data_scale}[argv[0]].main()
    stats = json.loads(capsys.readouterr().out.splitlines()[0])
    assert stats["samples"] == 2000 and stats["truncated"] == 0
    assert json.loads((tmp_path / "scale.json").read_text())["scan_read"][0]["rows"] == 2000


def test_loss_kernel(monkeypatch):
    """On CUDA it runs (one chunk size); without, it refuses in one line instead of a traceback."""
    if CUDA:
        assert "ms" in run_bench("bench.loss_kernel", "--tokens", "1024")
        return
    from bench import loss_kernel

    monkeypatch.setattr(sys, "argv", ["loss_kernel"])
    with pytest.raises(SystemExit, match="CUDA"):
        loss_kernel.main()


def test_fp8_w2b_runs_bf16_and_reports_the_fp8_refusal_on_cpu(tmp_path):
    """bench.fp8_w2b --tiny (W2b's part; W1's runs the same code on another folder): the bf16 run
    trains and is summarised (loss at the last step); the FP8 run stops at start-up with the CPU
    refusal, which is recorded, and the summary says so."""
    out = tmp_path / "fp8.jsonl"
    run_bench("bench.fp8_w2b", "--tiny", "--device", "cpu", "--parts", "w2b", "--data", SAMPLE, "--work",
              str(tmp_path), "--out", str(out))
    bf16, fp8, summary = records(out)
    assert bf16["status"] == "trained" and bf16["timed_steps"] == "2-3" and bf16["real_tokens"] > 0
    assert bf16["loss_last_step"] > 0 and bf16["fp8_line"] is None  # model.fp8=off: no start-up line
    assert fp8["status"] == "failed" and fp8["rc"] == 2
    assert "model.fp8=tensorwise needs a CUDA GPU with FP8 tensor cores" in fp8["error"]
    assert summary == {"summary": "w2b", "bf16_real_tokens_per_s": bf16["real_tokens_per_s"],
                       "bf16_loss_last_step": bf16["loss_last_step"],
                       "w2b_fp8_tensorwise": {"status": "failed", "error": fp8["error"]}}


def test_summary_names_the_slow_steps(tmp_path):
    """A bench summary of a run whose timed window holds one slow step (W4's run AD: a ~16 s step
    among 0.6 s ones): the window's figures count it, and the record names it."""
    from types import SimpleNamespace

    from bench.sfttrain_w1 import summarise

    times = {1: 30.0, 2: 0.5, 3: 0.6, 4: 5.0, 5: 0.5, 6: 0.7}  # step 1: warm-up, not timed
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, seconds in times.items():
            f.write(json.dumps({"step": step, "loss": 1.0, "step_time_s": seconds, "tokens": 100, "loss_tokens": 50,
                                "data_wait_s": 0.0, "mfu": 0.1}) + "\n")
    args = SimpleNamespace(warmup=1, steps=6, override=[], device="cpu")
    record = summarise("w1", args, str(tmp_path), [])
    assert record["timed_steps"] == "2-6" and record["median_s_per_step"] == 0.6
    assert record["real_tokens_per_s"] == round(500 / 7.3, 1)  # the slow step counts in the window
    assert record["slow_steps"] == {4: 5.0}
