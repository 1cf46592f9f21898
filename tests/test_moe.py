"""Mixtures of experts (sfttrain/moe.py): parameter counts for MFU and the preflight, the router's
load-balancing loss, LoRA on fused experts, FSDP2 over the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sfttrain.flops import ModelShape
from sfttrain.plan import DenseShape

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
TINY_MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    # layer 0 keeps a dense MLP, layers 1 and 2 are sparse
    "qwen3_moe_mlp_only_layers": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, decoder_sparse_step=2),  # layer 1 sparse only
}
# W4 of bench/WORKLOADS.md: Qwen3-30B-A3B's shape cut to 10 of its 48 layers
W4 = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
          num_hidden_layers=10, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
          num_experts_per_tok=8, tie_word_embeddings=False)


def _config(name: str, **extra):
    family = name if name in ("qwen3_moe", "mixtral", "qwen2_moe") else "qwen3_moe"
    return AutoConfig.for_model(family, **{**TINY, **TINY_MOE.get(name, {}), **extra})


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", TINY_MOE)
def test_preflight_counts_every_expert(name, tmp_path):
    """The preflight's memory estimate counts all expert parameters (each is held, gathered and
    updated), from config.json alone: the same count as the model transformers builds."""
    config = _config(name)
    config.save_pretrained(tmp_path)
    shape = DenseShape.from_config_json(str(tmp_path))
    assert shape.num_params == sum(p.numel() for p in _meta_model(config).parameters())
    assert shape.moe.sparse_layers == {"qwen3_moe_mlp_only_layers": 2, "qwen2_moe": 1}.get(name, 3)


def test_w4_counts(tmp_path):
    """W4's numbers as the issue measured them: 6,853,538,304 parameters, 6,039,797,760 of them in
    128 experts of which 8 run per token; MFU counts 1,191,227,904 (the rest + 8/128 of the experts)."""
    config = AutoConfig.for_model("qwen3_moe", **W4)
    shape = ModelShape.of(_meta_model(config))
    experts = 6_039_797_760
    assert shape.num_params == 6_853_538_304
    assert shape.active_params == 6_853_538_304 - experts + experts * 8 // 128 == 1_191_227_904
    config.save_pretrained(tmp_path)
    assert DenseShape.from_config_json(str(tmp_path)).num_params == 6_853_538_304
