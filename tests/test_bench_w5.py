"""bench/qlora_w5.py (tests/bench_run.py says what the bench tests check): W5's record and its shape."""

from __future__ import annotations

import json

import torch

from tests.bench_run import SAMPLE, records, run_bench_here
from tests.conftest import REPO, needs_cpu_fp8


def test_qlora_w5_records_a_run_over_an_nf4_base(tmp_path):
    out = tmp_path / "w5.jsonl"
    run_bench_here("bench.qlora_w5", "--tiny", "--device", "cpu", "--data", SAMPLE, "--work", str(tmp_path),
                   "--out", str(out))
    (record,) = records(out)
    assert record["workload"] == "W5" and record["status"] == "trained" and record["timed_steps"] == "2-3"
    assert "model.base_quant=nf4" in record["overrides"] and record["real_tokens"] > 0
    assert 0 < record["startup_s"]
    assert "frozen base in NF4" in (tmp_path / "qlora_w5.log").read_text()


@needs_cpu_fp8
def test_qlora_w5_records_a_run_over_an_fp8_base(tmp_path):
    out = tmp_path / "w5.jsonl"
    run_bench_here("bench.qlora_w5", "--tiny", "--device", "cpu", "--base_quant", "fp8", "--data", SAMPLE, "--work",
                   str(tmp_path), "--out", str(out))
    (record,) = records(out)
    assert record["variant"] == "qlora_w5_fp8" and record["status"] == "trained" and record["real_tokens"] > 0
    assert "model.base_quant=fp8" in record["overrides"] and "model.base_quant=nf4" not in record["overrides"]
    assert "frozen base in float8 e4m3" in (tmp_path / "qlora_w5_fp8.log").read_text()


def test_w5_is_llama_3_1_70b_shaped(tmp_path):
    """The folder's config.json: Llama-3.1-70B's layers with the Qwen2.5 tokenizer's vocabulary, the
    parameter count docs/workloads.md states."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.qlora_w5 import save_config
    from bench.w1_data import load_tokenizer

    folder = save_config(str(tmp_path), load_tokenizer(str(REPO / "assets" / "tokenizers" / "qwen2.5-instruct")),
                         tiny=False)
    config = json.loads((tmp_path / folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == \
        (80, 8192, 28672, 64, 8, 151936)
    with torch.device("meta"):  # the parameter count transformers builds from the folder
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 70.9
