"""LinearCrossEntropy (gradient computed in forward, chunked) against plain autograd through
F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F

from sfttrain.data.pack import IGNORE_INDEX
from sfttrain.config import ConfigError
from sfttrain.loss import (LinearCrossEntropy, chunk_loss_and_grad, liger_chunk_loss_and_grad, liger_unavailable_reason,
                           select_chunk_loss)

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
    out = LinearCrossEntropy.apply(h, w, y, torch.float32, chunk_loss_and_grad, True, chunk)
    (out * 0.37).backward()  # backward scales by the incoming gradient
    torch.testing.assert_close(out, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_dh * 0.37, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_dw * 0.37, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_gradient():
    """LoRA's frozen lm_head: the hidden states' gradient as before, none for the weight."""
    h, w, y = _inputs()
    ref_dh = _reference(h, w, y)[1]
    w.requires_grad_(False)
    LinearCrossEntropy.apply(h, w, y, torch.float32, chunk_loss_and_grad, True, 16).backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, ref_dh, rtol=1e-5, atol=1e-6)


def test_bf16_compute_keeps_fp32_gradients():
    """Mixed precision: bf16 GEMMs, but the fp32 master weight gets an fp32 gradient summed over
    chunks without bf16 rounding of the running sum."""
    h, w, y = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(h, w, y, dtype=torch.bfloat16)
    out = LinearCrossEntropy.apply(h, w, y, torch.bfloat16, chunk_loss_and_grad, True, 16)
    out.backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    torch.testing.assert_close(out, ref_loss, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad, ref_dw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad, ref_dh, rtol=2e-2, atol=2e-2)


def test_no_grad_computes_loss_only():
    h, w, y = _inputs()
    with torch.no_grad():
        out = LinearCrossEntropy.apply(h, w, y, torch.float32, chunk_loss_and_grad, False, 16)
    torch.testing.assert_close(out, _reference(h, w, y)[0], rtol=1e-5, atol=1e-5)
    assert out.grad_fn is None


def test_all_tokens_ignored_gives_zero_loss_and_gradient():
    h, w, y = _inputs()
    y[:] = IGNORE_INDEX
    out = LinearCrossEntropy.apply(h, w, y, torch.float32, chunk_loss_and_grad, True, 16)
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
    out = LinearCrossEntropy.apply(h, w, y, torch.bfloat16, chunk_loss, True, 512)
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
