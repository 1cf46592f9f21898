"""Packed-row varlen attention (sfttrain.attention) against per-sample standard attention.

Every backend that runs on this machine is checked on tiny random Llama (MHA) and Qwen2 (GQA)
models: logits and parameter gradients of one packed row equal those of each sample run
separately with transformers' "sdpa" implementation, nothing leaks forward in time or across a
sample boundary, and (negative controls) a bidirectional or boundary-blind kernel is caught.
On CPU only "sdpa_blockmask" runs (fp32, atol 1e-5); on CUDA the flash kernels run in bf16
against a bf16 "sdpa" reference with bf16-sized tolerances.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers import masking_utils

from sfttrain import attention
from sfttrain.attention import ATTN_IMPLEMENTATION, BACKENDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (5, 9, 3, 7)  # packed row of T = 24 tokens
VOCAB = 128
MODELS = ("llama", "qwen2", "qwen2_sliding")

# (dtype, atol, rtol) for comparing against the per-sample reference; fp32 is exact up to
# summation order, bf16 flash kernels differ from the bf16 sdpa reference by bf16 rounding.
TOL = {
    "sdpa_blockmask": (torch.float32, 1e-5, 1e-5),
    "flash_attn": (torch.bfloat16, 2e-2, 2e-2),
    "torch_varlen": (torch.bfloat16, 2e-2, 2e-2),
}
# Logits outside the causal past of an edit must not move at all (same kernels, same shapes,
# the edited keys are masked out exactly); anything above this is a leak.
LEAK_ATOL = 1e-6


def _config(kind: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    if kind == "llama":  # multi-head attention
        return LlamaConfig(num_key_value_heads=4, **common)
    if kind == "qwen2":  # grouped-query attention, 2 query heads per KV head
        return Qwen2Config(num_key_value_heads=2, **common)
    if kind == "qwen2_sliding":  # layer 0 full attention, layer 1 sliding window of 3 tokens
        return Qwen2Config(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=3, max_window_layers=1,
            **common,
        )
    raise ValueError(kind)


def _models(kind: str, dtype: torch.dtype):
    """(reference "sdpa" model, packed model) with identical random weights."""
    torch.manual_seed(0)
    cfg = _config(kind)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=ATTN_IMPLEMENTATION)
    packed.load_state_dict(ref.state_dict())
    assert packed.config._attn_implementation == ATTN_IMPLEMENTATION
    return ref.to(DEVICE, dtype).eval(), packed.to(DEVICE, dtype).eval()


def _samples(seed: int = 1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _pack(samples):
    """The trainer's packed row: ids/positions [1, T], int32 cu_seqlens [n+1], python max."""
    lengths = [len(s) for s in samples]
    ids = torch.cat(samples)[None].to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    return ids, pos, cu, max(lengths)


def _packed_logits(model, samples, backend=None):
    """backend: the attention backend the call asks for (None: "auto" on the device)."""
    ids, pos, cu, m = _pack(samples)
    out = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=m, max_length_k=m, **(attention.call_kwargs(backend) if backend else {}))
    return out.logits[0]


def _reference_logits(model, samples):
    return [model(input_ids=s[None].to(DEVICE)).logits[0] for s in samples]


def _split(x, samples):
    return list(torch.split(x, [len(s) for s in samples]))


def _leaks(model, samples, backend, sample_idx=1, pos=2):
    """Edit token `pos` of sample `sample_idx`; return (future_leak, cross_leak, own_change).

    future_leak: largest change of that sample's logits BEFORE `pos` (must be 0: causality).
    cross_leak: largest change of any other sample's logits (must be 0: boundaries).
    own_change: largest change at/after `pos` (must be large, else the edit proves nothing).
    """
    edited = [s.clone() for s in samples]
    edited[sample_idx][pos] = (edited[sample_idx][pos] + 1) % VOCAB
    with torch.no_grad():
        before = _split(_packed_logits(model, samples, backend).float(), samples)
        after = _split(_packed_logits(model, edited, backend).float(), samples)
    diff = [(a - b).abs() for a, b in zip(after, before)]
    future = diff[sample_idx][:pos].max().item() if pos > 0 else 0.0
    cross = max(d.max().item() for i, d in enumerate(diff) if i != sample_idx)
    own = diff[sample_idx][pos:].max().item()
    return future, cross, own


def _assert_close(actual, expected, atol, rtol, what=""):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each backend that runs here (the tests pass it to their calls); skip the others with the reason."""
    try:
        attention.select_backend(request.param, DEVICE)
    except ValueError as e:
        pytest.skip(str(e))
    return request.param


# ---------------------------------------------------------------------------------------------
# Equivalence with per-sample standard attention
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
def test_packed_logits_match_per_sample(backend, kind):
    dtype, atol, rtol = TOL[backend]
    ref, packed = _models(kind, dtype)
    samples = _samples()
    with torch.no_grad():
        got = _split(_packed_logits(packed, samples, backend), samples)
        want = _reference_logits(ref, samples)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_close(g, w, atol, rtol, f"{kind}/{backend} sample {i}")


@pytest.mark.parametrize("kind", ("llama", "qwen2"))
def test_packed_gradients_match_per_sample_sum(backend, kind):
    dtype, atol, rtol = TOL[backend]
    ref, packed = _models(kind, dtype)
    samples = _samples(seed=2)
    g = torch.Generator().manual_seed(3)
    labels = [torch.randint(0, VOCAB, (len(s),), generator=g).to(DEVICE) for s in samples]

    logits = _packed_logits(packed, samples, backend)
    F.cross_entropy(logits.float(), torch.cat(labels), reduction="sum").backward()
    for s, y in zip(samples, labels):  # per-sample forwards, gradients accumulate = sum
        F.cross_entropy(ref(input_ids=s[None].to(DEVICE)).logits[0].float(), y, reduction="sum").backward()

    ref_params = dict(ref.named_parameters())
    for name, p in packed.named_parameters():
        want = ref_params[name].grad
        assert p.grad is not None and want is not None, name
        if dtype == torch.float32:  # another GEMM blocking: equal to rounding, relative to the tensor
            assert (p.grad - want).norm() <= rtol * want.norm(), f"{kind}/{backend} grad {name}"
        else:  # bf16 gradients: compare relative to the tensor's scale
            err = (p.grad.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            assert err <= atol * scale + 1e-4, f"{kind}/{backend} grad {name}: {err} vs scale {scale}"


@pytest.mark.parametrize("kind", MODELS)
def test_no_leak_forward_in_time_or_across_samples(backend, kind):
    dtype, _, _ = TOL[backend]
    _, packed = _models(kind, dtype)
    samples = _samples(seed=4)
    # An edit in the middle of sample 1 (the second of four): its earlier tokens and all of
    # samples 0, 2 and 3 must be untouched.
    future, cross, own = _leaks(packed, samples, backend, sample_idx=1, pos=4)
    assert own > 1e-3, "the edit did not change anything; the check would prove nothing"
    assert future <= LEAK_ATOL, f"later token changed earlier logits by {future} (non-causal)"
    assert cross <= LEAK_ATOL, f"edit in sample 1 changed another sample's logits by {cross}"
    # An edit at the first token of sample 0 must not reach samples 1..3 (boundary-blind causal
    # attention would pass the check above but fail this one).
    future, cross, own = _leaks(packed, samples, backend, sample_idx=0, pos=0)
    assert own > 1e-3
    assert cross <= LEAK_ATOL, f"edit in sample 0 changed a later sample's logits by {cross}"


def _bidirectional_per_sample(q, k, v, cu, max_len, scale, window, softcap):
    b = cu.tolist()
    return torch.cat([
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            is_causal=False, scale=scale, enable_gqa=True,
        ).transpose(0, 1)
        for s, e in zip(b[:-1], b[1:])
    ])


def _causal_whole_row(q, k, v, cu, max_len, scale, window, softcap):
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=True,
    ).transpose(0, 1)


def test_leak_checks_catch_wrong_kernels(monkeypatch):
    """Negative controls: the checks above fail for the two classic mistakes."""
    ref, packed = _models("qwen2", torch.float32)
    samples = _samples()

    # 1. Bidirectional inside each sample (torch varlen_attn's default window_size=(-1, -1)).
    monkeypatch.setitem(attention._KERNELS, "sdpa_blockmask", _bidirectional_per_sample)
    future, cross, _ = _leaks(packed, samples, "sdpa_blockmask", sample_idx=1, pos=4)
    assert future > 1e-3 and cross <= LEAK_ATOL
    with torch.no_grad():
        got = _split(_packed_logits(packed, samples, "sdpa_blockmask"), samples)
        want = _reference_logits(ref, samples)
    assert not all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))

    # 2. Causal over the whole row, ignoring the sample boundaries.
    monkeypatch.setitem(attention._KERNELS, "sdpa_blockmask", _causal_whole_row)
    future, cross, _ = _leaks(packed, samples, "sdpa_blockmask", sample_idx=0, pos=0)
    assert future <= LEAK_ATOL and cross > 1e-3


# ---------------------------------------------------------------------------------------------
# Kernel level: every backend against an fp32 per-sample reference, forward and backward
# ---------------------------------------------------------------------------------------------
def test_kernel_matches_fp32_reference(backend):
    dtype, atol, rtol = TOL[backend]
    torch.manual_seed(5)
    lengths, h, hkv, d = (37, 5, 64, 1, 19), 8, 2, 32
    t = sum(lengths)
    q = torch.randn(1, h, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    cu = torch.tensor((0,) + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    scale = 0.3
    module = torch.nn.Module()  # is_causal defaults to True
    out, weights = attention.varlen_attention_forward(
        module, q, k, v, None, dropout=0.0, scaling=scale,
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
        **attention.call_kwargs(backend),
    )
    assert weights is None and out.shape == (1, t, h, d)
    w = torch.randn(out.shape, device=DEVICE, generator=None)
    (out.float() * w).sum().backward()

    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    parts = []
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        parts.append(F.scaled_dot_product_attention(
            q32[:, :, s:e], k32[:, :, s:e].repeat_interleave(h // hkv, 1),
            v32[:, :, s:e].repeat_interleave(h // hkv, 1), is_causal=True, scale=scale,
        ).transpose(1, 2))
    want = torch.cat(parts, dim=1)
    (want * w).sum().backward()
    kernel_atol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 inputs, fp32 reference
    _assert_close(out, want, kernel_atol, rtol, f"{backend} output")
    for name, a, b in (("q", q, q32), ("k", k, k32), ("v", v, v32)):
        _assert_close(a.grad, b.grad, kernel_atol * 3, rtol, f"{backend} grad {name}")


def test_backward_holds_k_and_v_not_the_fused_projection_they_are_sliced_from(backend):
    """Fused (sfttrain.fuse_projections), q, k and v are column slices of one GEMM's output, and v
    (k too, in a layer without RoPE) reaches attention as such. The kernels save their inputs for
    backward; a slice saved as it is holds the whole output (W1 LoRA: 0.67 GiB at the peak, run CF). What the
    attention saves shares no storage with that output, and its result is the unsliced inputs'."""
    dtype = TOL[backend][0]
    h, hkv, d, t = 8, 2, 32, 40
    torch.manual_seed(0)
    qkv = (torch.randn(1, t, (h + 2 * hkv) * d, device=DEVICE, dtype=dtype).requires_grad_() * 1)
    q, k, v = (x.view(1, t, -1, d).transpose(1, 2) for x in qkv.split([h * d, hkv * d, hkv * d], -1))
    q = q * 1  # RoPE's output: a tensor of its own
    cu = torch.tensor([0, 15, t], dtype=torch.int32, device=DEVICE)
    kwargs = dict(scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=25, max_length_k=25,
                  **attention.call_kwargs(backend))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        out, _ = attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, **kwargs)
    assert saved, "nothing saved for backward was recorded"
    assert not [tuple(s.shape) for s in saved if s.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()]
    apart = attention.varlen_attention_forward(torch.nn.Module(), q, k.clone(), v.clone(), None, **kwargs)[0]
    assert torch.equal(out, apart)


class Kernels(TorchDispatchMode):
    """The attention kernel ops dispatched while active, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in attention.kernel_ops():
            self.seen.append(func)
        return func(*args, **(kwargs or {}))

@pytest.mark.skipif(not attention.cudnn_attention_available(), reason="cuDNN attention rows: Hopper or newer GPUs")
def test_a_row_of_one_sample_runs_on_cudnn_and_matches_fp32():
    """torch_varlen on a Hopper: a row that is one sample (cu_seqlens of two entries) runs on cuDNN's
    kernel, counted at the dispatcher, and matches the fp32 reference as the flash kernel does (bf16
    inputs: 3e-2, test_kernel_matches_fp32_reference's bound); a row of two samples stays on flash.
    W1's heads: 14 of 64 over 2 key/value heads."""
    torch.manual_seed(7)
    t, h, hkv, d = 2048, 14, 2, 64
    for bounds, kernel in (((0, t), torch.ops.aten._scaled_dot_product_cudnn_attention.default),
                           ((0, 1000, t), torch.ops.aten._flash_attention_forward.default)):
        q = torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        with Kernels() as kernels:
            out, _ = attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=d ** -0.5,
                                                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                                                        max_length_k=longest, **attention.call_kwargs("torch_varlen"))
        assert kernels.seen == [kernel]
        w = torch.randn(out.shape, device="cuda")
        (out.float() * w).sum().backward()
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        want = torch.cat([F.scaled_dot_product_attention(
            q32[:, :, a:b], k32[:, :, a:b].repeat_interleave(h // hkv, 1),
            v32[:, :, a:b].repeat_interleave(h // hkv, 1),
            is_causal=True).transpose(1, 2) for a, b in zip(bounds, bounds[1:])], dim=1)
        (want * w).sum().backward()
        _assert_close(out, want, 3e-2, TOL["torch_varlen"][2], f"{kernel} output")
        for name, a, b in (("q", q, q32), ("k", k, k32), ("v", v, v32)):
            _assert_close(a.grad, b.grad, 9e-2, TOL["torch_varlen"][2], f"{kernel} grad {name}")


@pytest.mark.skipif(not attention.cudnn_attention_available(), reason="cuDNN attention rows: Hopper or newer GPUs")
def test_a_packed_row_of_one_sample_reaches_cudnn_through_the_trainers_path(tmp_path):
    """The path a run takes: load_model's backend choice (auto), pack()'s row of one sample padded to
    data.pad_to_multiple (its pad segment included), the loss module's model call under bf16
    autocast. With heads of 64 that row's attention is cuDNN's in every layer (forward; backward
    dispatches no forward op); a row of two samples, or heads of another size, stay on flash."""
    from sfttrain.config import ModelConfig
    from sfttrain.data.pack import pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss
    from sfttrain.model import load_model, materialise_model

    cuda = torch.device("cuda")
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    flash = torch.ops.aten._flash_attention_forward.default
    for heads, lengths, kernel in ((2, [200], cudnn), (2, [120, 80], flash), (4, [200], flash)):
        folder = tmp_path / f"heads{heads}"
        LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=512
                    ).save_pretrained(folder)
        cfg = ModelConfig(partial_pretrain=str(folder), attn_implementation="auto", random_init=True)
        loaded = load_model(cfg, cuda)
        materialise_model(loaded.model, cfg, cuda, cuda, seed=0)
        lm = CausalLMLoss(loaded.model, fused=False, attention=loaded.attn_backend)
        lm.autocast_dtype = torch.bfloat16
        row = pack([RenderedSample([5] * n, [1] * n, i) for i, n in enumerate(lengths)], pad_to=128)
        assert row.input_ids.shape[1] == 256 and len(row.cu_seqlens) == len(lengths) + 2  # a pad segment
        with Kernels() as kernels:
            lm(row.to(cuda)).backward()
        assert kernels.seen == [kernel] * 2, (heads, lengths, kernels.seen)


def test_torch_varlen_default_window_is_bidirectional():
    """Documents the trap: varlen_attn without window_size=(-1, 0) is NOT causal."""
    try:
        attention.select_backend("torch_varlen", DEVICE)
    except ValueError as e:
        pytest.skip(str(e))
    from torch.nn.attention.varlen import varlen_attn

    torch.manual_seed(6)
    q, k, v = (torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device="cuda")
    full = varlen_attn(q, k, v, cu, cu, 9, 9)
    causal = varlen_attn(q, k, v, cu, cu, 9, 9, window_size=(-1, 0))
    assert (full - causal).abs().max() > 1e-2
    # ... and our wrapper gives the causal one.
    assert torch.equal(attention._run_torch_varlen(q, k, v, cu, 9, None, (-1, 0), None), causal)


# ---------------------------------------------------------------------------------------------
# Integration with transformers: name accepted, no mask built, clear errors
# ---------------------------------------------------------------------------------------------
def test_name_registered_and_mask_creation_skipped(monkeypatch):
    assert ATTN_IMPLEMENTATION in transformers.AttentionInterface._global_mapping
    # Not in the mask interface: masking_utils then returns before building any mask...
    assert ATTN_IMPLEMENTATION not in masking_utils.AttentionMaskInterface._global_mapping
    cfg = _config("qwen2")
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    emb = torch.zeros(1, 24, 64)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    # positional args: (config, inputs_embeds, attention_mask, cache / past_key_values, position_ids)
    assert masking_utils.create_causal_mask(cfg, emb, None, None, pos) is None
    # ... and before the packed-sequence detection (a diff/cumsum and a host sync per forward).
    def boom(*a, **k):
        raise AssertionError("find_packed_sequence_indices was called")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", boom)
    _, packed = _models("qwen2_sliding", torch.float32)  # exercises the sliding-window mask too
    with torch.no_grad():
        _packed_logits(packed, _samples(), "sdpa_blockmask")


def test_from_pretrained_accepts_name(tmp_path):
    ref, _ = _models("qwen2", torch.float32)
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    samples = _samples()
    with torch.no_grad():
        got = _split(_packed_logits(model.to(DEVICE).eval(), samples, "sdpa_blockmask"), samples)
        want = _reference_logits(ref, samples)
    for g, w in zip(got, want):
        _assert_close(g, w, 1e-5, 1e-5, "from_pretrained")


def test_errors():
    _, packed = _models("llama", torch.float32)
    ids, pos, cu, m = _pack(_samples())
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed(input_ids=ids, position_ids=pos)
    kw = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=m, max_length_k=m, **attention.call_kwargs("sdpa_blockmask"))
    with torch.no_grad():
        plain = packed(**kw).logits
        # transformers drops a 2D mask for implementations without a mask function (documented
        # in sfttrain.attention): same logits. A 4D mask reaches us and is rejected.
        assert torch.equal(packed(attention_mask=torch.ones_like(ids), **kw).logits, plain)
    t = ids.shape[1]
    with pytest.raises(ValueError, match="attention_mask"):
        packed(attention_mask=torch.zeros(1, 1, t, t), **kw)
    packed.config.attention_dropout = 0.1
    for layer in packed.model.layers:
        layer.self_attn.attention_dropout = 0.1
    packed.train()
    with pytest.raises(ValueError, match="dropout"):
        packed(**kw)
    packed.eval()  # transformers passes dropout=0 in eval: fine
    with torch.no_grad():
        packed(**kw)


def test_the_flash_backends_refuse_an_fp32_run_at_start_up():
    """An fp32 run (no mixed precision) would fail in its first forward on a flash backend: refused
    before, naming the keys; the per-sample path and bf16 compute pass. Gemma 2's soft-cap likewise."""
    config = LlamaConfig()
    for backend in ("flash_attn", "torch_varlen"):
        with pytest.raises(ValueError, match="model.fsdp_config.mixed_precision=true"):
            attention.check_model(config, backend, torch.float32)
        attention.check_model(config, backend, torch.bfloat16)
    attention.check_model(config, "sdpa_blockmask", torch.float32)
    config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-caps"):
        attention.check_model(config, "torch_varlen", torch.bfloat16)


def test_select_backend():
    assert attention.select_backend("auto", "cpu") == "sdpa_blockmask"
    assert attention.select_backend("sdpa_blockmask", "cpu") == "sdpa_blockmask"
    assert attention.available_backends("cpu") == ["sdpa_blockmask"]
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(ValueError, match="not available"):
            attention.select_backend(name, "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.select_backend("flash_attention_2", "cpu")
    if DEVICE == "cuda":
        assert attention.select_backend("auto", "cuda") in ("flash_attn", "torch_varlen")


@pytest.mark.parametrize("backend", ("flash_attn", "torch_varlen"), indirect=True)  # sdpa_blockmask runs fp32 as is
@pytest.mark.parametrize("kind", ("llama", "qwen2"))
def test_autocast_with_fp32_weights(backend, kind):
    """fp32 weights under bf16 autocast: RoPE leaves q/k in fp32 and v in bf16; the flash
    backends must cast all three to the autocast dtype instead of failing."""
    _, atol, rtol = TOL[backend]
    ref, packed = _models(kind, torch.float32)
    samples = _samples()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = _split(_packed_logits(packed, samples, backend), samples)
        want = _reference_logits(ref, samples)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_close(g, w, atol, rtol, f"{kind}/{backend} autocast sample {i}")



def test_the_backend_travels_with_the_model_call(monkeypatch):
    """The backend a CausalLMLoss is made with reaches every layer's attention through its model call, as
    the row boundaries do: two losses over one model in one process each get their own, nothing to undo.
    (flash_attn's kernel stood in for by the per-sample one, which runs here: same numbers.)"""
    from sfttrain.data.pack import pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss

    seen = []
    monkeypatch.setitem(attention._KERNELS, "flash_attn",
                        lambda *args: seen.append(args[0].dtype) or attention._run_sdpa_blockmask(*args))
    _, packed = _models("llama", torch.bfloat16)
    row = pack([RenderedSample(s.tolist(), [1] * len(s), i) for i, s in enumerate(_samples())]).to(DEVICE)
    with torch.no_grad():
        chosen = CausalLMLoss(packed, fused=False, attention="flash_attn")(row)
        assert seen == [torch.bfloat16] * 2  # both layers
        other = CausalLMLoss(packed, fused=False, attention="sdpa_blockmask")(row)
    assert len(seen) == 2 and torch.equal(chosen, other)
