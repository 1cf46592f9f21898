"""Mixtures of experts (sfttrain/moe.py): parameter counts for MFU and the preflight, the router's
load-balancing loss, LoRA on fused experts, FSDP2 over the experts."""

from __future__ import annotations

import re
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
def test_preflight_finds_the_sparse_layers(name, tmp_path):
    """The preflight's activation model reads which layers are sparse from config.json (its parameters
    are counted on the model built on the meta device)."""
    config = _config(name)
    config.save_pretrained(tmp_path)
    shape = DenseShape.from_config_json(str(tmp_path))
    assert shape.moe.sparse_layers == {"qwen3_moe_mlp_only_layers": 2, "qwen2_moe": 1}.get(name, 3)


def test_w4_counts(tmp_path):
    """W4's numbers as the issue measured them: 6,853,538,304 parameters, 6,039,797,760 of them in
    128 experts of which 8 run per token; MFU counts 1,191,227,904 (the rest + 8/128 of the experts)."""
    config = AutoConfig.for_model("qwen3_moe", **W4)
    shape = ModelShape.of(_meta_model(config))
    experts = 6_039_797_760
    assert shape.num_params == 6_853_538_304
    assert shape.active_params == 6_853_538_304 - experts + experts * 8 // 128 == 1_191_227_904


ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # a coefficient that shows in the gradients


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_router_loss_equals_the_models_own(name):
    """The step's objective with output_router_logits=true against the Hugging Face model's own:
    each sample alone through model(..., labels, output_router_logits=True) gives its mean
    cross-entropy + coef x aux (the model's `loss`, `aux_loss`); the step weights the
    cross-entropy by loss tokens and aux by tokens (sfttrain.moe). Values and every parameter's
    gradient (routers included) agree; the packed row's pad segment counts in no expert's load.
    fp32 both sides, random parameters."""
    from sfttrain import attention
    from sfttrain.data.loader import StepBatch
    from sfttrain.data.pack import IGNORE_INDEX, pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss, step_objective

    config = _config(name, vocab_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, **ROUTER)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    model = AutoModelForCausalLM.from_config(_config(name, vocab_size=96, max_position_embeddings=256, **ROUTER),
                                             attn_implementation=attention.ATTN_IMPLEMENTATION).float()
    model.load_state_dict(ref.state_dict())

    g = torch.Generator().manual_seed(1)
    samples = [RenderedSample(torch.randint(3, 96, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4), i)
               for i, n in enumerate([17, 30, 9])]
    lengths = [len(s.input_ids) for s in samples]
    targets = [n - 4 for n in lengths]
    coef = config.router_aux_loss_coef
    ref_objective, ref_aux = 0.0, 0.0
    for s, n_tokens, n_targets in zip(samples, lengths, targets):
        labels = torch.tensor([[t if m else IGNORE_INDEX for t, m in zip(s.input_ids, s.loss_mask)]])
        out = ref(input_ids=torch.tensor([s.input_ids]), labels=labels, output_router_logits=True)
        cross_entropy = out.loss - coef * out.aux_loss
        ref_objective = (ref_objective + cross_entropy * n_targets / sum(targets)
                         + coef * out.aux_loss * n_tokens / sum(lengths))
        ref_aux += out.aux_loss.item() * n_tokens / sum(lengths)
    ref_objective.backward()

    lm = CausalLMLoss(model, fused=False, chunk_tokens=16)
    row = pack(samples, pad_to=16)  # 56 tokens + a pad segment of 8
    assert row.input_ids.shape[1] == 64
    step = StepBatch(0, 0, [row], sum(targets), lengths, [0, 1, 2])
    objective = step_objective(lm, lm(row), step, grad_ranks=1)
    objective.backward()
    torch.testing.assert_close(objective, ref_objective.detach(), rtol=1e-5, atol=0)
    stats = lm.router.step_stats(torch.device("cpu")).tolist()
    metrics = lm.router.metrics(stats, sum(lengths))
    assert metrics["router_aux"] == pytest.approx(ref_aux, rel=1e-5)
    # every real token picks top_k experts in each sparse layer; the 8 pad tokens none
    load = torch.tensor(stats[1:]).view(-1, 4)
    assert load.sum(-1).tolist() == [2 * 56] * load.shape[0]
    assert metrics["expert_load"] == pytest.approx((load.max(-1).values / load.mean(-1)).max().item())
    ref_params = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        want = ref_params[pname].grad
        assert (p.grad - want).norm() <= 1e-5 * want.norm(), (pname, (p.grad - want).norm() / want.norm())


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A Qwen3-MoE of random weights (4 experts, 2 per token, the router's loss on) beside
    stories260K's tokenizer."""
    from transformers import AutoTokenizer

    from tests.conftest import STORIES

    out = tmp_path_factory.mktemp("tiny_moe")
    tok = AutoTokenizer.from_pretrained(STORIES)
    config = _config("qwen3_moe", vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=512,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **ROUTER)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _job(gsm8k_head, model_dir, run_dir, *extra):
    from tests.conftest import BASE_OVERRIDES, LINEAR_ADAM

    return [*BASE_OVERRIDES, *LINEAR_ADAM, f"model.partial_pretrain={model_dir}",
            f"data.train_files={gsm8k_head}", f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=16", "trainer.total_training_steps=3", *extra]


def test_sharded_moe_trains_like_one_rank(gsm8k_head, tiny_moe_dir, tmp_path):
    """FSDP2 over the fused expert tensors, the router's loss on, fp32: 2 ranks x 2 micro-batches
    train as 1 rank x 1 (losses, router_aux, updates: the objective's normalisation does not
    depend on the split; tolerances as tests/test_trainer.py's, sums in another order only).
    The 2-rank step-1 checkpoint resumed on 1 rank continues like the reference, and the 2-rank
    run's export has the trained weights and logits."""
    from tests.conftest import load_checkpoint_model, read_metrics, run_sfttrain, update_error

    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    log = run_sfttrain(1, _job(gsm8k_head, tiny_moe_dir, one, "data.micro_batch_size_per_gpu=16")).stdout
    run_sfttrain(2, _job(gsm8k_head, tiny_moe_dir, two, "data.micro_batch_size_per_gpu=4", "trainer.save_freq=1",
                         "trainer.save_hf=true"))
    run_sfttrain(1, _job(gsm8k_head, tiny_moe_dir, resumed, "data.micro_batch_size_per_gpu=8",
                         "trainer.resume_mode=resume_path", f"trainer.resume_from_path={two / 'global_step_1'}"))
    assert "active per token (2 of 4 experts" in log
    assert re.search(r"router_aux \S+ \| expert_load \S+", log)
    steps = {name: [m for m in read_metrics(d) if "loss" in m] for name, d in
             (("one", one), ("two", two), ("resumed", resumed))}
    assert [m["step"] for m in steps["resumed"]] == [2, 3]
    for key in ("loss", "router_aux", "expert_load"):
        ref = [m[key] for m in steps["one"]]
        assert [m[key] for m in steps["two"]] == pytest.approx(ref, rel=1e-5), key
        assert [m[key] for m in steps["resumed"]] == pytest.approx(ref[1:], rel=1e-5), key
    assert all(1 <= m["expert_load"] <= 2 for m in steps["one"])  # 4 experts, 2 per token: at most 4 / 2

    start = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).state_dict()
    weights = {name: load_checkpoint_model(d / "global_step_3") for name, d in
               (("one", one), ("two", two), ("resumed", resumed))}
    start = {k: start[k] for k in weights["one"]}
    assert any(".experts." in k for k in start)
    for name in ("two", "resumed"):
        assert update_error(weights[name], weights["one"], start) < 1e-4, name

    exported = AutoModelForCausalLM.from_pretrained(two / "global_step_3" / "huggingface").eval()
    trained = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()
    trained.load_state_dict(weights["two"], strict=True)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_per_expert_checkpoint_fills_fused_experts(name, tmp_path):
    """Checkpoints store one weight per expert (Mixtral's under block_sparse_moe, w1/w3/w2), the
    model fuses them: sfttrain's reader fills the fused tensors as transformers' own loader does,
    and a shard's slice of experts alone equals the slice of the whole."""
    from sfttrain import moe, weights

    config = _config(name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)
    with weights.parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    weights.materialise(model, torch.device("cpu"), torch.device("cpu"), 0, str(tmp_path))
    for pname, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[pname], p), pname
    fused = "model.layers.1.mlp.experts.gate_up_proj"  # sparse in every family here
    half = (slice(2, 4), slice(0, ref.state_dict()[fused].shape[1]), slice(0, 32))
    files = weights._tensor_files(str(tmp_path))
    assert fused not in files
    assert torch.equal(moe.read_per_expert(files, fused, half, weights._read_slice), ref.state_dict()[fused][half])


LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.target_modules=all-linear"]


def test_lora_adapts_the_fused_experts(gsm8k_head, tiny_moe_dir, tmp_path):
    """LoRA (all-linear) on a Qwen3-MoE adapts the fused experts through peft's target_parameters
    and says so; 2 FSDP ranks train as 1 (fp32: losses and adapter updates as in
    test_sharded_moe_trains_like_one_rank), and the merged export computes what the base with
    the peft adapter folder computes."""
    from peft import PeftModel

    from tests.conftest import load_checkpoint_model, read_metrics, run_sfttrain, update_error

    one, two = tmp_path / "one", tmp_path / "two"
    log = run_sfttrain(1, _job(gsm8k_head, tiny_moe_dir, one, *LORA, "data.micro_batch_size_per_gpu=16",
                               "trainer.total_training_steps=2")).stdout
    run_sfttrain(2, _job(gsm8k_head, tiny_moe_dir, two, *LORA, "data.micro_batch_size_per_gpu=4",
                         "trainer.total_training_steps=2", "trainer.save_hf=true"))
    assert "routed experts adapted per expert (down_proj rank 4, gate_up_proj rank " in log
    losses = {d: [m["loss"] for m in read_metrics(d) if "loss" in m] for d in (one, two)}
    assert losses[two] == pytest.approx(losses[one], rel=1e-5)
    adapters = {d: load_checkpoint_model(d / "global_step_2") for d in (one, two)}
    assert any(".experts." in k and "lora_B" in k for k in adapters[one]), list(adapters[one])
    start = {k: torch.zeros_like(v) if "lora_B" in k else None for k, v in adapters[one].items()}
    # lora_A starts as drawn (the same on both runs): compare the B update, which starts at zero
    b_only = {k: v for k, v in start.items() if v is not None}
    assert update_error({k: adapters[two][k] for k in b_only}, {k: adapters[one][k] for k in b_only}, b_only) < 1e-4

    out = two / "global_step_2" / "huggingface"
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_moe_dir), out / "adapter").eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = with_adapter(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(tiny_moe_dir)(ids).logits, want, atol=1e-3)


def _lora_model(family: str, **lora):
    from sfttrain import lora as sft_lora
    from sfttrain.config import ModelConfig

    cfg = ModelConfig(**{"lora_rank": 4, "lora_alpha": 8, **lora})
    return sft_lora.apply_lora(AutoModelForCausalLM.from_config(_config(family)), cfg), cfg


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_lora_on_experts_says_what_it_adapts(family):
    """all-linear reaches the fused experts in every MoE family (peft's own conversion only covers
    some); FLOPs count the adapted experts' active share at 6 (their weight W + BA gets a weight
    gradient) and the idle ones not at all; a list of linear names leaves the experts frozen and
    says so; dropout, which peft's parameter adapters refuse, is a ConfigError naming the fix."""
    from sfttrain import moe
    from sfttrain.config import ConfigError

    model, cfg = _lora_model(family)
    line = " ".join(moe.describe_lora(model, cfg))
    assert "routed experts adapted per expert (down_proj rank 4, gate_up_proj rank" in line
    shape = ModelShape.of(model)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n)
    adapters = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    expert_adapters = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n)
    assert expert_adapters > 0
    assert shape.active_trainable == adapters - expert_adapters + round((routed + expert_adapters) * 2 / 4)

    model, cfg = _lora_model(family, target_modules=["q_proj", "v_proj"])
    assert "routed experts NOT adapted (model.target_modules=['q_proj', 'v_proj'] names linear layers only" in \
        " ".join(moe.describe_lora(model, cfg))
    assert all(".experts." not in n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ConfigError, match="model.lora_dropout=0.1 .* set model.lora_dropout=0"):
        _lora_model(family, lora_dropout=0.1)


def test_router_loss_under_ulysses_is_refused():
    """Per-sample router statistics would need each sample's tokens from every sp rank: refused
    at start-up, naming both ways out."""
    from sfttrain.attention import check_ulysses
    from sfttrain.config import ConfigError

    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2.*output_router_logits=false"):
        check_ulysses(_config("qwen3_moe", **ROUTER), 2)
