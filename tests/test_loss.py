"""LinearCrossEntropy (gradient computed in forward, chunked) against plain autograd through
F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F

from sfttrain.data.pack import IGNORE_INDEX
from sfttrain.loss import LinearCrossEntropy, chunk_loss_and_grad


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: the fp32-accumulating bf16 GEMM"))])
def test_compiled_bf16_matches_reference(device):
    """The compiled softmax-and-gradient kernel, over several chunks."""
    h, w, y = (t.detach().to(device) for t in _inputs(tokens=1500, hidden=64, vocab=5000))
    h.requires_grad_(), w.requires_grad_()
    ref_loss, ref_dh, ref_dw = _reference(h, w, y, dtype=torch.bfloat16)
    out = LinearCrossEntropy.apply(h, w, y, torch.bfloat16, torch.compile(chunk_loss_and_grad, dynamic=True), True,
                                   512)
    out.backward()
    torch.testing.assert_close(out, ref_loss, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(w.grad, ref_dw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad, ref_dh, rtol=2e-2, atol=2e-2)
