"""bench/'s W2b scripts (tests/bench_run.py says what the bench tests check): LoRA with sfttrain and
TRL on one model folder, the FP8 comparison, the QLoRA baseline's CPU refusal and FLOP count, and the
model folder's name."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.bench_run import SAMPLE, records, run_bench_here
from tests.conftest import REPO


@pytest.fixture(scope="module")
def w2b(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """One bench.lora_w2b call for the tests of its systems (each would draw the model folder and train
    sfttrain's bf16 base again): sfttrain, sfttrain_nf4 and TRL + peft (where the bench extra installs it) on
    the one saved folder (sfttrain_fp8 is the same path with another base: the refusal test below runs it).
    Its --work and each system's record."""
    work = tmp_path_factory.mktemp("w2b")
    out = work / "w2b.jsonl"
    systems = ["sfttrain", "sfttrain_nf4", *(["trl"] if importlib.util.find_spec("trl") else [])]
    run_bench_here("bench.lora_w2b", "--tiny", "--device", "cpu", "--systems", *systems, "--data", SAMPLE, "--work",
                   str(work), "--out", str(out))
    runs = records(out)
    assert len(runs) == len(systems), runs  # one record a system, trained or failed, in their order
    return work, dict(zip(systems, runs))


def test_lora_w2b_and_trl_w1(w2b):
    """sfttrain then TRL + peft (bench.trl_w1 --peft --model_dir) on one saved tiny W2b folder."""
    pytest.importorskip("trl", reason="TRL comes with the bench extra: pip install -e '.[bench]'")
    work, runs = w2b
    sfttrain, trl = runs["sfttrain"], runs["trl"]
    assert sfttrain["variant"] == "lora_w2b" and sfttrain["real_tokens"] > 0
    assert trl["system"] == "trl" and trl["peft"]["r"] == 64 and trl["real_tokens"] > 0
    assert trl["model_dir"] == str(next(work.glob("model_*")))  # the one folder both trained


def test_lora_w2b_sfttrain_nf4_trains_the_same_data(w2b):
    """sfttrain_nf4 is sfttrain's run over the saved base quantized to NF4 as it loads: its record is named
    for it and trained the very tokens the bf16 base's run did."""
    bf16, nf4 = (w2b[1][system] for system in ("sfttrain", "sfttrain_nf4"))
    assert (bf16["variant"], nf4["variant"]) == ("lora_w2b", "lora_w2b_nf4")
    assert "model.base_quant=nf4" in nf4["overrides"]
    assert not any(o.startswith("model.base_quant") for o in bf16["overrides"])
    assert nf4["real_tokens"] == bf16["real_tokens"] > 0


def test_lora_w2b_records_a_refused_system_and_runs_the_next(tmp_path):
    """With model.lora_rank=0 (full fine-tuning) sfttrain refuses model.base_quant=fp8: the call
    records that system as failed and still trains the next."""
    out = tmp_path / "w2b.jsonl"
    run_bench_here("bench.lora_w2b", "--tiny", "--device", "cpu", "--systems", "sfttrain_fp8", "sfttrain", "--data",
                   SAMPLE, "--work", str(tmp_path), "--out", str(out), "--override", "model.lora_rank=0")
    fp8, bf16 = records(out)
    assert fp8["system"] == "sfttrain_fp8" and fp8["status"] == "failed" and fp8["rc"] != 0
    assert bf16["variant"] == "lora_w2b" and bf16["real_tokens"] > 0


def test_lora_w2b_refuses_trl_qlora_on_cpu_before_drawing(tmp_path):
    """The QLoRA baseline measures bitsandbytes' CUDA kernels: on a CPU it stops at its arguments,
    before any model is drawn or any system trains."""
    out = tmp_path / "w2b.jsonl"
    refusal = "TRL's QLoRA baseline needs a CUDA GPU: it measures bitsandbytes' CUDA kernels"
    with pytest.raises(AssertionError, match=refusal):
        run_bench_here("bench.lora_w2b", "--tiny", "--device", "cpu", "--systems", "sfttrain", "trl_qlora", "--data",
                       SAMPLE, "--work", str(tmp_path), "--out", str(out))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_qlora_flops_count_4bit_weights_at_their_shape():
    """bitsandbytes packs two 4-bit weights a byte: the record's FLOPs per token count the quantized
    model as the bf16 one it was made from (its ModelShape), not as half its frozen weights."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes: bench/wheels.sh fetches it for the GPU")
    from transformers import LlamaForCausalLM

    from bench.common import model_shape, w2b_config
    from bench.w1_data import load_tokenizer
    from sfttrain.flops import ModelShape

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizers" / "qwen2.5-instruct"))
    model = LlamaForCausalLM(w2b_config(tokenizer, tiny=True))
    linears = [linear for layer in model.model.layers for linear in (layer.self_attn.q_proj, layer.mlp.down_proj)]
    for linear in linears:  # frozen, as under LoRA
        linear.weight.requires_grad_(False)
    reference = ModelShape.of(model)
    for linear in linears:
        linear.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4").to("cpu")
    assert ModelShape.of(model).num_params < reference.num_params  # packed: what model_shape corrects
    assert model_shape(model) == reference


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
