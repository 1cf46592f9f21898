"""bench/'s W2b scripts (tests/bench_run.py says what the bench tests check): LoRA with sfttrain and
TRL on one model folder, the FP8 comparison, and the model folder's name."""

from __future__ import annotations

import os

import pytest

from tests.bench_run import SAMPLE, records, run_bench_here
from tests.conftest import REPO


def test_lora_w2b_and_trl_w1(tmp_path):
    """sfttrain then TRL + peft (bench.trl_w1 --peft --model_dir) on one saved tiny W2b folder."""
    pytest.importorskip("trl", reason="TRL comes with the bench extra: pip install -e '.[bench]'")
    out = tmp_path / "w2b.jsonl"
    run_bench_here("bench.lora_w2b", "--tiny", "--device", "cpu", "--data", SAMPLE, "--work", str(tmp_path),
                   "--out", str(out))
    sfttrain, trl = records(out)
    assert sfttrain["variant"] == "lora_w2b" and sfttrain["real_tokens"] > 0
    assert trl["system"] == "trl" and trl["peft"]["r"] == 64 and trl["real_tokens"] > 0
    assert trl["model_dir"] == str(next(tmp_path.glob("model_*")))  # the one folder both trained


def test_fp8_w2b_runs_bf16_and_reports_the_fp8_refusal_on_cpu(tmp_path):
    """bench.fp8_w2b --tiny (W2b's part; W1's runs the same code on another folder): the bf16 run
    trains and is summarised (loss at the last step); the FP8 run stops at start-up with the CPU
    refusal, which is recorded, and the summary says so."""
    out = tmp_path / "fp8.jsonl"
    run_bench_here("bench.fp8_w2b", "--tiny", "--device", "cpu", "--parts", "w2b", "--data", SAMPLE, "--work",
                   str(tmp_path), "--out", str(out))
    bf16, fp8, summary = records(out)
    assert bf16["status"] == "trained" and bf16["timed_steps"] == "2-3" and bf16["real_tokens"] > 0
    assert bf16["loss_last_step"] > 0 and bf16["fp8_line"] is None  # model.fp8=off: no start-up line
    assert fp8["status"] == "failed" and fp8["rc"] == 2
    assert "model.fp8=tensorwise needs a CUDA GPU with FP8 tensor cores" in fp8["error"]
    assert summary.pop("host")["cpus"] == os.cpu_count()  # every record says where it was taken
    assert summary == {"summary": "w2b", "bf16_real_tokens_per_s": bf16["real_tokens_per_s"],
                       "bf16_loss_last_step": bf16["loss_last_step"],
                       "w2b_fp8_tensorwise": {"status": "failed", "error": fp8["error"]}}


def test_lora_w2b_model_folder_is_keyed_by_shape():
    """A --tiny run and a full one in the same --work never share a model folder."""
    from bench.common import model_folder, w2b_config
    from bench.w1_data import load_tokenizer

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizers" / "qwen2.5-instruct"))
    tiny, full = (model_folder("work", w2b_config(tokenizer, tiny=tiny)) for tiny in (True, False))
    assert tiny != full and model_folder("work", w2b_config(tokenizer, tiny=True)) == tiny
