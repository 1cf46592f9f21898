"""MFU accounting (sfttrain/flops.py) against hand counts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from sfttrain.flops import GPU_BF16_PEAK_FLOPS, H200_BF16_PEAK_FLOPS, ModelShape, count_params, mfu, peak_flops
from tests.conftest import run_on_ranks

# V vocab, D hidden, F MLP, L layers, H query heads, K key/value heads, head size D / H = 8
V, D, F, L, H, K = 128, 32, 64, 2, 4, 2
DH = D // H
SHAPE = dict(
    vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
    num_attention_heads=H, num_key_value_heads=K,
)


def _hand_count(q_kv_bias: bool, tied: bool) -> int:
    attention = D * H * DH + 2 * D * K * DH + H * DH * D  # q, k, v, o projections
    if q_kv_bias:  # Qwen2: q, k and v carry a bias, o does not
        attention += H * DH + 2 * K * DH
    mlp = 3 * D * F  # gate, up, down
    layer = attention + mlp + 2 * D  # two RMSNorms
    embeddings = V * D if tied else 2 * V * D
    return L * layer + D + embeddings  # + final norm


def _model(config_cls, tied):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**SHAPE, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("config_cls,bias", [(Qwen2Config, True), (LlamaConfig, False)])
def test_count_params_matches_hand_count(config_cls, bias, tied):
    model = _model(config_cls, tied)
    assert count_params(model) == _hand_count(bias, tied)
    # the tie really is one tensor: the check above would pass vacuously otherwise
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_count_params_w1_is_qwen25_05b():
    w1 = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )
    with torch.device("meta"):  # shapes only, no 2 GB allocation
        model = AutoModelForCausalLM.from_config(w1)
    assert count_params(model) == 494_032_768  # Qwen2.5-0.5B's published size


def _sharded_counts() -> None:
    """On each of 2 ranks (run_on_ranks): the global count of a model FSDP2 shards over them."""
    from torch.distributed.fsdp import fully_shard

    for tied in (True, False):
        model = _model(Qwen2Config, tied)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < count_params(model)  # really sharded, yet the count is global
        assert count_params(model) == _hand_count(True, tied), tied


def test_count_params_fsdp2_sharded():
    run_on_ranks(2, _sharded_counts)


def _shape(num_params: int, layers: int, heads: int, head_dim: int, trainable: int | None = None) -> ModelShape:
    trainable = num_params if trainable is None else trainable
    return ModelShape(num_params, layers, heads, head_dim, trainable, num_params, trainable, None)


def test_flops_per_token_by_hand():
    # N=100, L=2, H=3, Dh=4, samples of 2 and 4 tokens: sum s = 6, sum s^2 = 20
    attention = 6 * 2 * 3 * 4 * 20 / 6  # = 480
    assert _shape(100, 2, 3, 4).flops_per_token([2, 4]) == pytest.approx(600 + attention)
    # LoRA: 90 frozen weights cost 4 each (no weight gradient), 10 adapter weights 6 each
    assert _shape(100, 2, 3, 4, trainable=10).flops_per_token([2, 4]) == pytest.approx(4 * 90 + 6 * 10 + attention)
    assert _shape(100, 2, 3, 4, trainable=0).flops_per_token([2, 4]) == pytest.approx(400 + attention)
    # one sample of s tokens: attention per token grows linearly with s
    assert _shape(0, 1, 1, 1).flops_per_token([10]) == pytest.approx(60)


def test_mfu_by_hand():
    assert mfu(1080, 1e9, 2, peak_flops=1080e9) == pytest.approx(0.5)
    # the default peak is the H200's dense bf16 989 TFLOP/s
    assert mfu(3e9, 100_000, 1) == pytest.approx(3e14 / 989e12)


def test_gpu_peak_table_names_are_reachable():
    """Every entry is the first match of its own name: none is shadowed by a shorter name listed
    before it (the table is matched by substring, first match wins); no peak for a CPU."""
    for name, peak in GPU_BF16_PEAK_FLOPS:
        assert next(p for key, p in GPU_BF16_PEAK_FLOPS if key in f"NVIDIA {name} 80GB") == peak, name
    assert [p for k, p in GPU_BF16_PEAK_FLOPS if k == "H200"] == [H200_BF16_PEAK_FLOPS]
    assert peak_flops(torch.device("cpu")) is None


# Mixtures of experts: E experts of which TOP_K run per token, expert MLP size FE, shared expert FS
E, TOP_K, FE, FS = 4, 2, 16, 24
MOE_SHAPE = dict(**SHAPE, head_dim=DH, num_experts_per_tok=TOP_K)
MOE_FAMILIES = {
    # family: (config, q/k/v bias, q/k norm, expert size, shared expert size)
    "qwen3_moe": (dict(num_experts=E, moe_intermediate_size=FE), False, True, FE, 0),
    "mixtral": (dict(num_local_experts=E), False, False, F, 0),
    "qwen2_moe": (dict(num_experts=E, moe_intermediate_size=FE, shared_expert_intermediate_size=FS), True, False,
                  FE, FS),
}


def _moe_hand_count(family: str) -> tuple[int, int]:
    """(all parameters, the parameters one token runs) of a MOE_FAMILIES model, untied."""
    _, bias, qk_norm, fe, fs = MOE_FAMILIES[family]
    attention = D * H * DH + 2 * D * K * DH + H * DH * D + ((H * DH + 2 * K * DH) if bias else 0)
    norms = 2 * D + (2 * DH if qk_norm else 0)
    router = E * D
    shared = 3 * D * fs + D if fs else 0  # the shared expert's gate, up, down and its sigmoid gate (D -> 1)
    experts = E * 3 * D * fe  # per layer: gate, up, down of each expert
    other = L * (attention + norms + router + shared) + D + 2 * V * D  # + final norm, embedding, lm_head
    return other + L * experts, other + L * experts * TOP_K // E


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_flops_count_the_active_experts(family):
    """MFU counts what runs for a token: every non-expert parameter (a shared expert in full) and
    TOP_K / E of the routed experts; the memory-relevant total keeps all of them. Full fine-tuning
    6 per active parameter; with the experts frozen they cost 4."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **MOE_SHAPE, **MOE_FAMILIES[family][0])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total, active = _moe_hand_count(family)
    shape = ModelShape.of(model)
    assert (shape.num_params, shape.active_params, shape.active_trainable) == (total, active, active)
    attention = 6 * L * H * DH * 10  # one sample of 10 tokens
    assert shape.flops_per_token([10]) == pytest.approx(6 * active + attention)
    assert shape.attention_coefficient == pytest.approx(L * H * DH / active)
    assert "active per token (2 of 4 experts" in shape.describe_active()
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." not in name)
    shape = ModelShape.of(model)
    assert shape.active_trainable == active - L * E * 3 * D * MOE_FAMILIES[family][3] * TOP_K // E
    assert shape.flops_per_token([10]) == pytest.approx(
        6 * shape.active_trainable + 4 * (active - shape.active_trainable) + attention)


def test_dense_model_shape_has_no_routing():
    shape = ModelShape.of(_model(LlamaConfig, tied=False))
    assert shape.routing is None and shape.describe_active() == ""
    assert shape.active_params == shape.num_params == _hand_count(False, False)
