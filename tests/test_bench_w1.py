"""bench/'s W1 scripts (tests/bench_run.py says what the bench tests check): the padded baseline,
sfttrain's W1 run (profiled), the data scripts, the summary, loss_kernel's CPU refusal, and the
microbenchmarks of one W1 layer's LoRA projections.
The slowest test first: pytest-xdist hands a worker its next file while the last two tests of
its current one still run."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from omegaconf import OmegaConf

from tests.bench_run import CUDA, SAMPLE, records, run_bench, run_bench_here
from tests.conftest import REPO


def test_padded_w1(tmp_path):
    """The suite's longest test: every sequence padded to 256 tokens and bf16 autocast, whose GEMMs a
    CPU without bf16 instructions runs several times slower than fp32's (8 min on 2 cores shared
    with another suite; past 10 min, the default limit, at the suite's start on busier ones)."""
    out = tmp_path / "padded.jsonl"
    run_bench("bench.padded_w1", "--tiny", "--device", "cpu", "--data", SAMPLE, "--out", str(out), timeout=1200)
    (record,) = records(out)
    assert record["system"] == "padded" and record["timed_samples"] == 2 * 4  # 2 timed steps of 2 x 2


def test_sfttrain_w1_profiled_beside_a_baseline_tree(tmp_path):
    """sfttrain_w1 --tiny prepares the model folder and Parquet and runs sfttrain, with its last
    two steps profiled as on the GPU machine (trainer.profile_steps); with --baseline_tree, first with
    another checkout's code: here a copy of this one's whose default data.pad_to_multiple differs, and
    each run's config.yaml (written by the code that ran) shows which code that was."""
    base = tmp_path / "base"
    shutil.copytree(REPO / "sfttrain", base / "sfttrain", ignore=shutil.ignore_patterns("__pycache__"))
    config = base / "sfttrain" / "config" / "schema.py"
    assert config.read_text().count("pad_to_multiple: int = key(128,") == 1
    config.write_text(config.read_text().replace("pad_to_multiple: int = key(128,", "pad_to_multiple: int = key(96,"))
    out = tmp_path / "w1.jsonl"
    run_bench_here("bench.sfttrain_w1", "--tiny", "--device", "cpu", "--variant", "eager", "--data", SAMPLE,
                   "--work", str(tmp_path), "--out", str(out), "--override", "trainer.profile_steps=[3,4]",
                   "--baseline_tree", str(base))
    baseline, record = records(out)
    assert baseline["code"] == {"tree": str(base), "commit": None} and record["code"]["tree"] == str(REPO)
    for r in (baseline, record):
        assert r["variant"] == "eager" and r["timed_steps"] == "2-4" and r["real_tokens"] > 0
    runs = tmp_path / "runs"
    pads = [OmegaConf.load(runs / name / "config.yaml").data.pad_to_multiple for name in ("eager@baseline", "eager")]
    assert pads == [96, 128]
    profile = runs / "eager" / "profile"
    assert (profile / "steps_3-4_rank0.json").is_file() and "ms/step" in (profile / "summary.txt").read_text()


def test_sfttrain_w1_refuses_a_second_epoch(tmp_path, monkeypatch):
    """W1 is 60 steps of 64 distinct samples: on the 2000-row sample sfttrain would wrap an epoch."""
    from bench import sfttrain_w1

    monkeypatch.setattr(sys, "argv", ["sfttrain_w1", "--variant", "eager", "--data", SAMPLE, "--work", str(tmp_path),
                                      "--out", str(tmp_path / "w1.jsonl")])
    with pytest.raises(SystemExit, match="60 steps of 64 sequences need 3840 samples, .* has 2000"):
        sfttrain_w1.main()
    assert not (tmp_path / "runs").exists()


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
    scale = json.loads((tmp_path / "scale.json").read_text())
    assert scale["scan_read"][0]["rows"] == 2000
    assert [(r["chat_template"], r["rows"]) for r in scale["scan_render"]] == [(False, 50), (True, 50)]


def test_loss_kernel(monkeypatch):
    """On CUDA it runs (one chunk size); without, it refuses in one line instead of a traceback."""
    if CUDA:
        assert "ms" in run_bench("bench.loss_kernel", "--tokens", "1024", gpus=True)
        return
    from bench import loss_kernel

    monkeypatch.setattr(sys, "argv", ["loss_kernel"])
    with pytest.raises(SystemExit, match="CUDA"):
        loss_kernel.main()


def test_lora_layer_benches():
    """lora_linear (the formulation whose compilation costs least on a CPU, 7 s against 22 for the
    folded one) and adapter_gemms on a few tokens: each checks what it times against a reference
    computed another way (the compiled layer's outputs and gradients against the eager one's, each
    split-K product against the plain one), and adapter_gemms reports every product of a layer's four groups."""
    out = run_bench("bench.lora_linear", "--tokens", "64", "full")
    assert "full" in out and "ms/layer" in out
    out = run_bench("bench.adapter_gemms", "--tokens", "64", "--reps", "1").splitlines()
    assert len([line for line in out if " us " in line]) == 4 * 8  # six folded products and two frozen a group
    assert out[-1].startswith("a layer's folded GEMMs: mm ")


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
