"""RoPE scalings whose frequencies depend on the whole forward (sfttrain/rope.py): the effect itself
on transformers' own rotary embedding, and the start-up check that refuses it where packing
would bring it about (both config.json spellings)."""

from __future__ import annotations

import json

import pytest
import torch

from sfttrain.config import ConfigError, load_config
from sfttrain.rope import batch_dependent_rope, check_rope

COMMON = ["data.train_files=x.parquet", "model.partial_pretrain=m"]


def tiny_phi3_longrope(original: int = 64):
    from transformers import Phi3Config

    half = 4  # head_dim 8 / 2
    return Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=16 * original,
                      original_max_position_embeddings=original,
                      rope_scaling={"type": "longrope", "long_factor": [4.0] * half, "short_factor": [1.0] * half})


def cos_of_first_sample(config, packed_beside: int) -> torch.Tensor:
    """transformers' cos for a 10-token sample's positions, alone (0) or packed beside a sample of
    `packed_beside` tokens (positions restart at 0 per sample, as sfttrain packs them)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    positions = torch.cat([torch.arange(10), torch.arange(packed_beside)])[None]
    cos, _ = Phi3RotaryEmbedding(config)(torch.zeros(1, positions.shape[1], 32), positions)
    return cos[0, :10]


def test_longrope_frequencies_depend_on_the_neighbour():
    """The premise of the check: a short sample's frequencies change with what is packed beside it
    once that is longer than original_max_position_embeddings, and only then."""
    config = tiny_phi3_longrope(original=64)
    alone = cos_of_first_sample(config, 0)
    assert torch.equal(cos_of_first_sample(config, 64), alone)
    assert not torch.allclose(cos_of_first_sample(config, 65), alone)


def test_refused_where_packing_can_exceed_the_limit(tmp_path):
    """transformers' own saved config (its current spelling) and 4.x's hand-written ones."""
    tiny_phi3_longrope(original=64).save_pretrained(tmp_path / "phi3")
    saved = json.loads((tmp_path / "phi3" / "config.json").read_text())
    llama4x = {"model_type": "llama", "max_position_embeddings": 64, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    phi4x = {"model_type": "phi3", "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
             "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}
    per_layer_type = {"max_position_embeddings": 64, "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0}, "sliding_attention": {"rope_type": "default"}}}
    for config in (saved, llama4x, phi4x, per_layer_type):
        refused = batch_dependent_rope(config, load_config(overrides=[*COMMON, "data.max_length=128"]))
        assert refused and "original_max_position_embeddings=64" in refused and "data.max_length<=64" in refused
        for exact in (["data.max_length=64"], ["data.max_length=128", "data.micro_batch_size_per_gpu=1"]):
            assert batch_dependent_rope(config, load_config(overrides=[*COMMON, *exact])) is None, exact
        sp = load_config(overrides=[*COMMON, "data.max_length=128", "data.micro_batch_size_per_gpu=1",
                                    "ulysses_sequence_parallel_size=2"])
        assert batch_dependent_rope(config, sp)  # the sp ranks of one sample could pick different ones
    with pytest.raises(ConfigError, match="rope_parameters rope_type='longrope'"):
        check_rope(load_config(overrides=[*COMMON, "data.max_length=128"]), str(tmp_path / "phi3"))
    plain = {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert batch_dependent_rope(plain, load_config(overrides=[*COMMON, "data.max_length=128"])) is None
