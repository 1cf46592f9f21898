"""The MoE experts as grouped GEMMs (sfttrain/moe.py) against transformers' own per-expert loop."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from sfttrain import moe as experts

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, head_dim=8, moe_intermediate_size=16, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": lambda: Qwen2MoeConfig(**SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                        num_experts=8, num_experts_per_tok=3),
    "mixtral": lambda: MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
}


def build(family: str, implementation: str, layers: int = SMALL["num_hidden_layers"]) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    with torch.no_grad():  # routers drawn wide enough that every expert gets tokens
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def loss_and_grads(model, autocast: bool):
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_experts_compute_what_the_per_expert_loop_does(family, autocast):
    """Same weights, same tokens: the loss and every gradient (the experts' fused weights, the
    router's) equal transformers' eager loop over experts. fp32: only the summation order differs
    (1e-5). bf16 autocast: both run bf16 GEMMs with fp32 accumulation, but round the per-expert
    outputs at different points (the loop adds them into a buffer of the input's dtype expert by
    expert, the grouped path sums each token's K outputs in fp32): 2e-2 of each gradient's norm,
    where routing a token to the wrong expert or dropping its weight is off by O(1). The grouped
    path returns the compute dtype, as a dense MLP does under autocast (the next test); the loop's
    output is cast to it too, so that both residual streams are bf16 and only the experts differ.
    One layer under autocast: a second layer's router would see two residual streams that differ in
    the last bf16 bit, where a token near a tie between two experts can go to either (an O(1)
    difference that is no error)."""
    name = experts.implementation_for(CONFIGS[family]())
    assert name == experts.GROUPED_MM
    layers = 1 if autocast else SMALL["num_hidden_layers"]
    grouped, loop = build(family, name, layers), build(family, "eager", layers)
    assert grouped.config._experts_implementation == name
    for layer in loop.model.layers if autocast else []:
        layer.mlp.experts.register_forward_hook(lambda _module, _args, out: out.to(torch.bfloat16))
    (loss_g, grads_g), (loss_l, grads_l) = loss_and_grads(grouped, autocast), loss_and_grads(loop, autocast)
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss_g, loss_l, rtol=tol, atol=0)
    assert any("experts" in n for n in grads_g)
    for n, g in grads_l.items():
        assert ((grads_g[n] - g).norm() / g.norm()).item() < tol, n


def test_dense_models_keep_their_layers():
    """A model without experts is built as before (no experts implementation asked for)."""
    from transformers import LlamaConfig

    assert experts.implementation_for(LlamaConfig(**SMALL)) is None


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_residual_stream_keeps_the_compute_dtype_through_moe_layers(family):
    """On one device sfttrain computes under bf16 autocast with the embedding's output cast to bf16
    (sfttrain.parallel.single_device), so that the residual stream is bf16 as in a dense model. The
    grouped experts return the compute dtype, as a dense MLP's down_proj does under autocast: every
    decoder layer gets its hidden states in bf16. (Before, the experts returned fp32, the dtype of
    the norm's output, and every layer after the first got fp32: the compiled layers, one code
    object, recompiled for it in W4's first steps.)"""
    model = build(family, experts.implementation_for(CONFIGS[family]()))
    model.get_input_embeddings().register_forward_hook(lambda _module, _args, out: out.to(torch.bfloat16))
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda _module, args, kwargs: seen.append(
            (args[0] if args else kwargs["hidden_states"]).dtype), with_kwargs=True)
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16):
        model(input_ids=ids)
    assert seen == [torch.bfloat16] * len(model.model.layers)


def test_lora_on_compiled_experts_computes_what_eager_does():
    """LoRA on the fused experts (peft's target_parameters) under per-layer compilation, as
    sfttrain compiles: peft registers a torch parametrization at every forward of the adapted
    experts, which dynamo cannot trace (torch 2.11 failed on it with "Guard failed on the same frame
    it was created", W4 under LoRA on the H200), so sfttrain.lora runs those wrappers eager and the
    rest of each layer compiled. fp32: the same loss and adapter gradients as the eager model up to
    summation order (inductor's fused kernels sum in another order: 1e-5)."""
    from sfttrain import lora
    from sfttrain.config import ModelConfig
    from sfttrain.model import decoder_layers
    from sfttrain.parallel import compile_layers

    cfg = ModelConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear")
    models = []
    for compiled in (False, True):
        model = lora.apply_lora(build("qwen3_moe", experts.implementation_for(CONFIGS["qwen3_moe"]())), cfg)
        with torch.no_grad():  # B drawn nonzero (peft starts it at zero): the adapters take part in the loss
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
        if compiled:
            torch._dynamo.reset()
            compile_layers(decoder_layers(model), cpp_wrapper=False)
        models.append(model)
    (loss_e, grads_e), (loss_c, grads_c) = (loss_and_grads(m, autocast=False) for m in models)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
    adapters = [n for n in grads_e if "lora_" in n and ".experts." in n]
    assert adapters
    for n in adapters:
        assert ((grads_c[n] - grads_e[n]).norm() / grads_e[n].norm()).item() < 1e-5, n
