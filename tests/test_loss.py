"""LinearCrossEntropy (gradient computed in forward, chunked) against plain autograd through
F.cross_entropy on the full logits."""

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F

from sfttrain.data.pack import IGNORE_INDEX
from sfttrain.config import ConfigError
from sfttrain.loss import (HEAD_FAMILIES, LinearCrossEntropy, OutputHead, chunk_loss_and_grad,
                           liger_chunk_loss_and_grad, liger_unavailable_reason, select_chunk_loss)

CUDA = torch.cuda.is_available()
LIGER_MISSING = liger_unavailable_reason("cuda") if CUDA else "no CUDA device"


def _inputs(tokens=50, hidden=24, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::7] = IGNORE_INDEX  # prompt tokens and sample ends
    return h, w, y


def _reference(h, w, y, dtype=torch.float32):
    logits = (h.to(dtype) @ w.to(dtype).t()).float()
    loss = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("chunk", [16, 4096])  # several chunks (and a ragged last one), one chunk
def test_matches_autograd_fp32(chunk):
    h, w, y = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(h, w, y)
    out = LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.float32, chunk_loss_and_grad, True, chunk)
    (out * 0.37).backward()  # backward scales by the incoming gradient
    torch.testing.assert_close(out, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_dh * 0.37, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_dw * 0.37, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_grad", [True, False])
def test_one_chunk_of_logits_alive_at_a_time(with_grad):
    """The loss's memory is one chunk of logits (and its gradient), as the preflight counts it: when
    a chunk's logits GEMM runs, no earlier chunk's logits or gradient is alive any more."""
    from torch.utils._python_dispatch import TorchDispatchMode

    h, w, y = _inputs(tokens=50, vocab=97)
    made = []  # weak references to every [chunk, vocab] tensor made so far
    gemms = []  # the logits GEMMs seen

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # [chunk, vocab] buffers made by the loss (views such as w.t(), [hidden, vocab], are not)
            if isinstance(out, torch.Tensor) and not func.is_view and out.dim() == 2 and out.shape[1] == 97:
                if func is torch.ops.aten.mm.default:  # a new chunk's logits
                    gemms.append(out.shape[0])
                    assert not [r for r in made if r() is not None], "an earlier chunk's [chunk, vocab] tensor is alive"
                made.append(weakref.ref(out))
            return out

    with Watch():
        LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.float32, chunk_loss_and_grad, with_grad, 16)
    assert gemms == [16, 16, 16, 2]  # 50 tokens in chunks of 16: every logits GEMM was watched


def test_frozen_weight_gets_no_gradient():
    """LoRA's frozen lm_head: the hidden states' gradient as before, none for the weight."""
    h, w, y = _inputs()
    ref_dh = _reference(h, w, y)[1]
    w.requires_grad_(False)
    LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.float32, chunk_loss_and_grad, True, 16).backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, ref_dh, rtol=1e-5, atol=1e-6)


def test_bf16_compute_keeps_fp32_gradients():
    """Mixed precision: bf16 GEMMs, but the fp32 master weight gets an fp32 gradient summed over
    chunks without bf16 rounding of the running sum."""
    h, w, y = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(h, w, y, dtype=torch.bfloat16)
    out = LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.bfloat16, chunk_loss_and_grad, True, 16)
    out.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    torch.testing.assert_close(out, ref_loss, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad, ref_dw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad, ref_dh, rtol=2e-2, atol=2e-2)


def test_no_grad_computes_loss_only():
    h, w, y = _inputs()
    with torch.no_grad():
        out = LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.float32, chunk_loss_and_grad, False, 16)
    torch.testing.assert_close(out, _reference(h, w, y)[0], rtol=1e-5, atol=1e-5)
    assert out.grad_fn is None


def test_all_tokens_ignored_gives_zero_loss_and_gradient():
    h, w, y = _inputs()
    y[:] = IGNORE_INDEX
    out = LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.float32, chunk_loss_and_grad, True, 16)
    out.backward()
    assert out.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


@pytest.mark.parametrize("device,kernel", [
    ("cpu", "torch"),
    pytest.param("cuda", "torch", marks=pytest.mark.skipif(not CUDA, reason="CUDA: the fp32-accumulating bf16 GEMM")),
    pytest.param("cuda", "liger", marks=pytest.mark.skipif(bool(LIGER_MISSING), reason=f"Liger: {LIGER_MISSING}"))])
def test_bf16_kernels_match_reference(device, kernel):
    """The compiled softmax-and-gradient kernel and Liger's, over several chunks."""
    h, w, y = (t.detach().to(device) for t in _inputs(tokens=1500, hidden=64, vocab=5000))
    h.requires_grad_(), w.requires_grad_()
    ref_loss, ref_dh, ref_dw = _reference(h, w, y, dtype=torch.bfloat16)
    chunk_loss, _ = select_chunk_loss(kernel, device, compile_torch=True)
    out = LinearCrossEntropy.apply(h, w, None, y, OutputHead(), torch.bfloat16, chunk_loss, True, 512)
    out.backward()
    torch.testing.assert_close(out, ref_loss, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(w.grad, ref_dw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad, ref_dh, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(bool(LIGER_MISSING), reason=f"Liger: {LIGER_MISSING}")
@pytest.mark.parametrize("with_grad", [True, False])
def test_liger_chunk_matches_torch_chunk(with_grad):
    """One chunk at W1's vocabulary (two passes of 32768-wide blocks, a partial last block)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(300, 151936, generator=g, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, 151936, (300,), generator=g, device="cuda")
    labels[::5] = IGNORE_INDEX
    ref_loss, ref_grad = chunk_loss_and_grad(logits.float(), labels, with_grad)
    loss, grad = liger_chunk_loss_and_grad(logits.clone(), labels, with_grad)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    if with_grad:
        torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=4e-3)
    else:
        assert grad is None


def test_select_chunk_loss_on_cpu():
    assert select_chunk_loss("auto", "cpu", compile_torch=False) == (chunk_loss_and_grad, "torch")
    assert select_chunk_loss("auto", "cpu", compile_torch=True)[1] == "torch (compiled)"
    with pytest.raises(ConfigError, match="model.loss_kernel=liger.*CUDA"):
        select_chunk_loss("liger", "cpu", compile_torch=False)


# Head settings that make each family's head do something (their defaults are often the identity);
# few experts for the MoE families (their defaults have 60-128).
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
HEAD_SETTINGS = {"qwen2_moe": {**MOE, "shared_expert_intermediate_size": 16}, "qwen3_moe": MOE,
                 "mixtral": {"num_local_experts": 4},
                 "granite": {"logits_scaling": 4.0}, "cohere": {"logit_scale": 0.25},
                 "gemma2": {"final_logit_softcapping": 2.0, "attn_logit_softcapping": 3.0},
                 "gemma3_text": {"final_logit_softcapping": 2.0}}


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_loss_equals_the_models_own_loss(family):
    """For every family the trainer accepts: sfttrain's loss and every parameter's gradient on a
    packed row equal the Hugging Face model's own (its forward with labels over the full logits,
    eager attention, one sample at a time, summed by token count): the head's logits only at the
    positions with a target lose nothing. Every parameter is drawn at random, biases included (a
    zero bias hides a dropped one). fp32 on both sides: the two differ only in summation order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sfttrain import attention
    from sfttrain.data.pack import pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss

    config = AutoConfig.for_model(family, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **HEAD_SETTINGS.get(family, {}))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    # a copy of the config: from_config records the attention implementation in the config object
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention.ATTN_IMPLEMENTATION)
    model.float()
    model.load_state_dict(ref.state_dict())

    g = torch.Generator().manual_seed(1)
    samples = [RenderedSample(torch.randint(3, 96, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4), i)
               for i, n in enumerate([17, 30, 9])]
    ref_total = 0.0
    for s in samples:
        labels = torch.tensor([[t if m else IGNORE_INDEX for t, m in zip(s.input_ids, s.loss_mask)]])
        n_targets = int((labels[0, 1:] != IGNORE_INDEX).sum())
        ref_total = ref_total + ref(input_ids=torch.tensor([s.input_ids]), labels=labels).loss * n_targets
    ref_total.backward()

    # several chunks; the backend named as a run names it: its call kwargs pass through every family's layers
    lm = CausalLMLoss(model, fused=False, chunk_tokens=16, attention="sdpa_blockmask")
    ours = lm(pack(samples, pad_to=8))
    ours.backward()
    torch.testing.assert_close(ours, ref_total.detach(), rtol=1e-5, atol=0)
    want_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got, want = p.grad, want_grads[name].grad
        if want is None:  # a parameter the loss does not reach (e.g. an MoE's unrouted expert)
            assert got is None or got.abs().max() == 0, name
            continue
        assert (got - want).norm() <= 1e-5 * want.norm(), (name, (got - want).norm() / want.norm())


def test_unknown_family_is_refused():
    from transformers import AutoConfig

    from sfttrain.loss import output_head

    with pytest.raises(ConfigError, match="'gpt2'.*Use a supported family"):
        output_head(AutoConfig.for_model("gpt2"))
