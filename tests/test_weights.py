"""Meta-device loading: each rank materialises only its shards, from the files or a random init.

References: transformers' own from_pretrained (the weights read must be the file's, bit for bit),
a 1-rank run for random init (the same model for any number of ranks), and the process's own
/proc high-water mark for memory."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sfttrain.config import ModelConfig
from sfttrain.model import load_model, materialise_model
from tests.conftest import BASE_OVERRIDES, STORIES, kill_job, launch, load_checkpoint_model, run_sfttrain

CPU = torch.device("cpu")


def _materialised(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    model = load_model(cfg, CPU).model
    assert all(p.is_meta for p in model.parameters())  # nothing built on the host before sharding
    materialise_model(model, cfg, CPU, CPU, seed)
    return model


def test_one_device_reads_the_files_exactly():
    model = _materialised(ModelConfig(partial_pretrain=str(STORIES)))
    ref = AutoModelForCausalLM.from_pretrained(STORIES)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after to_empty
    mine = model.state_dict()
    for name, tensor in ref.state_dict().items():  # parameters and buffers (rotary inv_freq)
        assert torch.equal(mine[name], tensor), name


def test_random_init_follows_the_models_own_init():
    """Linear and embedding weights ~ N(0, initializer_range), norms ones; a seed fixes them."""
    model = _materialised(ModelConfig(partial_pretrain=str(STORIES), random_init=True), seed=3)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.std().item() == pytest.approx(0.02, rel=0.1)  # 4096 samples: the std is within ~2%
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    again = _materialised(ModelConfig(partial_pretrain=str(STORIES), random_init=True), seed=3)
    other = _materialised(ModelConfig(partial_pretrain=str(STORIES), random_init=True), seed=4)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, q)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, q)


def _job(gsm8k_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*BASE_OVERRIDES, f"data.train_files={gsm8k_dir}/train.parquet", f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=1", *extra]


def test_random_init_is_the_same_for_any_rank_count(gsm8k_dir, tmp_path):
    """model.random_init on 2 ranks (sharded, uneven shards included: 172-row MLP matrices over
    2 ranks) gives the weights one device draws for the same seed. lr=0 keeps the step's
    weights the initial ones."""
    run_sfttrain(2, _job(gsm8k_dir, tmp_path, "model.random_init=true", "optim.lr=0", "trainer.seed=5"))
    sharded = load_checkpoint_model(tmp_path / "global_step_1")
    one_device = _materialised(ModelConfig(partial_pretrain=str(STORIES), random_init=True), seed=5).state_dict()
    pretrained = AutoModelForCausalLM.from_pretrained(STORIES).state_dict()
    for name, tensor in sharded.items():
        assert torch.equal(one_device[name], tensor), name
        assert not torch.equal(pretrained[name], tensor) or "norm" in name, name  # not the file's weights


# about 1 GB in fp32: 14 layers of 16.8M parameters (hidden 1024, MLP 4096, full-width k/v)
BIG = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=14,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def test_each_rank_holds_only_its_shard_of_a_1gb_model(gsm8k_dir, tmp_path):
    """Two ranks load a ~0.94 GB fp32 checkpoint. Each rank's high-water mark of resident host
    memory (VmHWM) at start-up, minus its resident memory just before the model was built, is
    what loading cost it: its half of the model (0.47 GB) plus one tensor read at a time (at most
    17 MB here). The bound, 0.75 model sizes, leaves 0.28 GB for the allocator and the file pages
    in flight; a rank that builds the full model (the old loader: 1 copy, and 1.5 with its shard)
    or reads the whole file into memory cannot stay under it."""
    model_dir = tmp_path / "big"
    BIG.save_pretrained(model_dir)
    with torch.device("meta"):  # the names and shapes only
        shapes = {name: p.shape for name, p in LlamaForCausalLM(BIG).named_parameters()}  # tied: once
    g = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()},
              model_dir / "model.safetensors", metadata={"format": "pt"})
    model_bytes = sum(shape.numel() * 4 for shape in shapes.values())
    for f in STORIES.glob("tokenizer*"):
        shutil.copy(f, model_dir)
    shutil.copy(STORIES / "special_tokens_map.json", model_dir)
    log = tmp_path / "log"
    proc = launch(2, _job(gsm8k_dir, tmp_path / "run", f"model.partial_pretrain={model_dir}", "data.max_length=64"),
                  log)
    try:  # the start-up report is all this needs: no training step, no 3 GB checkpoint
        deadline = time.monotonic() + 240
        while "host memory" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        kill_job(proc)
    text = log.read_text()
    found = re.search(r"host memory\s*: peak ([\d., ]+) GiB per rank \(VmHWM\); before the model ([\d., ]+) GiB", text)
    assert found, text[-3000:]
    peaks, before = ([float(x) * 2**30 for x in group.split(",")] for group in found.groups())
    assert len(peaks) == 2
    for peak, base in zip(peaks, before):
        print(f"loading cost {(peak - base) / model_bytes:.2f} model sizes")
        assert peak - base < 0.75 * model_bytes, (peak - base) / model_bytes
