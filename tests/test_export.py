"""Export: a trained checkpoint becomes a Hugging Face folder that transformers loads and runs.

One real 2-rank training run (stories260K, fp32, 3 steps, trainer.save_hf=true) provides the
checkpoint. "The trained model" is the base model with the checkpoint's weights put in by
torch's own DCP reader (dcp_to_torch_save), a path independent of sfttrain.export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfttrain import export
from sfttrain.data.pack import IGNORE_INDEX, shifted_labels
from sfttrain.data.render import Renderer
from tests.conftest import BASE_OVERRIDES, STORIES, load_checkpoint_model, read_metrics, run_sfttrain

STEPS = 3
PROMPT = "Natalia sold clips to 48 of her friends in April"


@pytest.fixture(scope="module")
def trained(gsm8k_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    train, val = root / "train.parquet", root / "val.parquet"
    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 32), train)
    pq.write_table(pq.read_table(gsm8k_dir / "test.parquet").slice(0, 12), val)
    run_dir = root / "run"
    run_sfttrain(2, [*BASE_OVERRIDES, f"data.train_files={train}", f"data.val_files={val}",
                     f"trainer.default_local_dir={run_dir}", "data.max_length=128", "data.train_batch_size=8",
                     "data.micro_batch_size_per_gpu=2", f"trainer.total_training_steps={STEPS}",
                     "trainer.save_hf=true"])
    return run_dir


@pytest.fixture(scope="module")
def trained_model(trained):
    """The base model with the final checkpoint's weights, read by torch's DCP converter."""
    sd = load_checkpoint_model(trained / f"global_step_{STEPS}")
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    model.load_state_dict(sd, strict=True)
    return model.eval(), sd


def _ids(tokenizer) -> torch.Tensor:
    return tokenizer(PROMPT, return_tensors="pt").input_ids


def _load(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def test_save_hf_round_trip(trained, trained_model):
    """trainer.save_hf=true: the final checkpoint holds huggingface/, whose model has the trained
    weights exactly (fp32): same logits, same greedy generation, and on the validation set the
    same loss the trainer reported at its last step."""
    out = trained / f"global_step_{STEPS}" / "huggingface"
    assert (out / "model.safetensors").is_file()  # 1 MB: a single shard
    assert not (trained / f"global_step_{STEPS - 1}" / "huggingface").exists()  # only at the end
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["use_cache"] is True and config["tie_word_embeddings"]
    model, tokenizer = _load(out), AutoTokenizer.from_pretrained(out)
    ref, ref_sd = trained_model
    # tied embeddings: lm_head.weight is not stored, and transformers ties it back
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_sd[name]), name
    start = AutoModelForCausalLM.from_pretrained(STORIES).state_dict()
    assert max((start[k] - ref_sd[k]).abs().max().item() for k in start) > 1e-3  # training moved the weights

    ids = _ids(tokenizer)
    assert torch.equal(ids, _ids(AutoTokenizer.from_pretrained(STORIES)))  # the tokenizer came along
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    generated = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    assert torch.equal(generated, ref.generate(ids, max_new_tokens=12, do_sample=False))

    # the validation loss the trainer logged at the last step, recomputed by plain transformers
    val_loss = [m["val/loss"] for m in read_metrics(trained) if "val/loss" in m][-1]
    renderer = Renderer(tokenizer, max_length=128, truncation="left", apply_chat_template=False)
    table = pq.read_table(trained.parent / "val.parquet").to_pylist()
    total, count = 0.0, 0
    with torch.no_grad():
        for row, r in enumerate(table):
            sample = renderer.render(r["question"], r["answer"], row)
            labels = torch.tensor([shifted_labels(sample)])
            logits = model(torch.tensor([sample.input_ids])).logits
            total += F.cross_entropy(logits[0].double(), labels[0], ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    assert total / count == pytest.approx(val_loss, rel=1e-5)


def test_cli_bf16_sharded(trained, trained_model, tmp_path):
    """`python -m sfttrain.export RUN_DIR OUT --dtype bf16 --max_shard_size 100KB`: the run
    folder resolves to its latest checkpoint; several shards of at most 100 KB plus an index."""
    out = tmp_path / "hf_bf16"
    run_sfttrain(1, [str(trained), str(out), "--dtype", "bf16", "--max_shard_size", "100KB"], module="sfttrain.export")
    index = json.loads((out / export.INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size <= 100_000 + 8192 for p in shards)  # + the safetensors header
    ref, ref_sd = trained_model
    assert set(index["weight_map"]) == set(ref_sd) - {"lm_head.weight"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    model, tokenizer = _load(out), AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_sd[name].to(torch.bfloat16)), name
    ids = _ids(tokenizer)
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()  # bf16 rounding, not garbage
    assert model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 8


def test_export_streams_model_tensors_only(trained, trained_model, tmp_path, monkeypatch):
    """Each read asks DCP for at most LOAD_BUDGET_BYTES of model tensors (never the optimizer),
    and the result is still exact."""
    budget = 40_000
    monkeypatch.setattr(export, "LOAD_BUDGET_BYTES", budget)
    reads: list[dict] = []
    real_load = export.dcp.load

    def recording_load(state_dict, **kwargs):
        reads.append({k: v.numel() * v.element_size() for k, v in state_dict.items()})
        return real_load(state_dict, **kwargs)

    monkeypatch.setattr(export.dcp, "load", recording_load)
    out = tmp_path / "hf"
    export.export(str(trained / f"global_step_{STEPS}"), str(out), dtype="fp32", max_shard_size="300KB")
    largest = 512 * 64 * 4  # the embedding matrix, 131 KB: read on its own
    assert len(reads) > 5
    assert all(sum(r.values()) <= budget or len(r) == 1 for r in reads)
    assert max(sum(r.values()) for r in reads) == largest
    assert all(k.startswith("model.") for r in reads for k in r)
    _, ref_sd = trained_model
    model = _load(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_sd[name]), name


def test_export_split_over_ranks(trained, trained_model, tmp_path):
    """As in trainer.save_hf on N ranks: rank r writes shards r, r + N, ...; together they make
    the same folder one process writes."""
    ckpt, out, single = str(trained / f"global_step_{STEPS}"), tmp_path / "split", tmp_path / "single"
    for rank in (1, 0):
        export.export(ckpt, str(out), max_shard_size="150KB", rank=rank, world_size=2)
    export.export(ckpt, str(single), max_shard_size="150KB")
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in single.iterdir()) and len(list(out.glob("model-*"))) >= 4
    for name in files:
        assert (out / name).read_bytes() == (single / name).read_bytes(), name
    _, ref_sd = trained_model
    for name, tensor in _load(out).state_dict().items():
        assert torch.equal(tensor, ref_sd[name]), name


def test_cli_errors(trained, tmp_path):
    incomplete = tmp_path / "global_step_9"
    incomplete.mkdir()
    with pytest.raises(SystemExit, match="has no COMPLETE marker: its save \\(or copy\\) did not finish"):
        export.main([str(incomplete), str(tmp_path / "out")])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        export.main([str(trained), str(busy)])
    # said before the export's work (it ended in a traceback once written whole, or at its first file)
    with pytest.raises(SystemExit, match=f"{busy / 'keep.txt'} is a file, not a folder"):
        export.main([str(trained), str(busy / "keep.txt")])
    with pytest.raises(SystemExit, match=rf"cannot create {busy / 'keep.txt' / 'out.tmp'} \(Not a directory\)"):
        export.main([str(trained), str(busy / "keep.txt" / "out")])  # as a read-only or another user's folder is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "global_step_9"]  # nothing left behind
    # the sizes --max_shard_size understands (transformers' own parser, decimal and binary units)
    parse = export.convert_file_size_to_int
    assert parse("5GB") == 5 * 10**9 and parse("100KB") == 100_000
    assert parse("2GiB") == 2 * 2**30 and parse(123) == 123


def test_a_base_model_trained_on_the_template_stops_at_its_end_of_turn(tiny_qwen_dir, gsm8k_dir, tmp_path):
    """A base model (Qwen2.5-0.5B's tokenizer and generation_config.json: EOS <|endoftext|>, greedy,
    2048 new tokens at most) fine-tuned on prompt/response pairs through the chat template: each
    answer is trained to end with <|im_end|>, as the template writes it, and the export's
    generation_config.json stops at it besides EOS, keeping the folder's other settings (which
    from_config, reading config.json alone, would drop)."""
    from transformers import GenerationConfig

    base = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(tiny_qwen_dir).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_qwen_dir, eos_token="<|endoftext|>").save_pretrained(base)
    GenerationConfig(bos_token_id=151643, eos_token_id=151643, do_sample=False,
                     max_new_tokens=2048).save_pretrained(base)
    train = tmp_path / "train.parquet"
    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 8), train)
    run_dir = tmp_path / "run"
    proc = run_sfttrain(1, [*BASE_OVERRIDES, f"model.partial_pretrain={base}", "data.apply_chat_template=true",
                            f"data.train_files={train}", f"trainer.default_local_dir={run_dir}",
                            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8",
                            "trainer.total_training_steps=1", "trainer.save_hf=true"])
    assert ("answers end with    : <|im_end|> (the chat template's end of turn; the tokenizer's EOS is "
            "<|endoftext|>); generation_config.json stops at ids [151643, 151645] (<|endoftext|>, <|im_end|>)"
            in proc.stdout), proc.stdout[-3000:]
    exported = run_dir / "global_step_1" / export.HF_EXPORT_DIR
    config = GenerationConfig.from_pretrained(exported)
    assert (config.eos_token_id, config.do_sample, config.max_new_tokens) == ([151643, 151645], False, 2048)
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|endoftext|>"
