"""The loss's pieces on the GPU, alone, on W1's shapes (hidden 896, vocabulary 151936): the
per-chunk softmax kernels of `model.loss_kernel` (`chunk_loss_and_grad` compiled by inductor,
Liger's in-place cross-entropy kernel) and the three lm_head GEMMs of a chunk.

    python3 -m bench.loss_kernel [--tokens 1024 2048]

Prints milliseconds per chunk and, for the softmax, the bandwidth of its ideal traffic (read the
bf16 logits twice, write the bf16 gradient once), after checking each result against an fp32
eager computation.

CUDA only, with no CPU smoke mode: it times CUDA kernels with CUDA events, and Liger's kernel is
Triton's (tests/test_loss.py checks both kernels' results against PyTorch's where CUDA runs them).
"""

import argparse

import torch

from sfttrain.loss import (IGNORE_INDEX, _add_matmul, chunk_loss_and_grad, liger_chunk_loss_and_grad,
                           liger_unavailable_reason, select_chunk_loss)

HIDDEN, VOCAB = 896, 151936


def milliseconds(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def softmax_variants(tokens: int, variants: dict) -> None:
    torch.manual_seed(0)
    logits = torch.randn(tokens, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, VOCAB, (tokens,), device="cuda")
    labels[torch.rand(tokens, device="cuda") < 0.4] = IGNORE_INDEX
    ref_loss, ref_grad = chunk_loss_and_grad(logits.float(), labels, True)
    ideal_bytes = 3 * logits.numel() * logits.element_size()
    for name, fn in variants.items():
        loss, grad = fn(logits.clone(), labels, True)  # a copy: Liger's kernel writes over its input
        work = logits.clone()
        ms = milliseconds(lambda: fn(work, labels, True))
        report(tokens, name, ms, ideal_bytes, loss, grad, ref_loss, ref_grad)


def report(tokens, name, ms, ideal_bytes, loss, grad, ref_loss, ref_grad) -> None:
    loss_err = abs(loss.float().item() - ref_loss.item()) / abs(ref_loss.item())
    grad_err = (grad.float() - ref_grad).abs().max().item()
    print(f"softmax {tokens:5d} tokens  {name:28s} {ms:7.3f} ms  {ideal_bytes / ms / 1e9:6.2f} TB/s  "
          f"loss rel err {loss_err:.1e}  grad max err {grad_err:.1e}")


def gemms(tokens: int) -> None:
    h = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(tokens, VOCAB, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(VOCAB, HIDDEN, device="cuda", dtype=torch.float32)
    flops = 2 * tokens * HIDDEN * VOCAB
    for name, fn in {"logits h @ w.T": lambda: h @ w.t(), "d hidden g @ w": lambda: g @ w,
                     "d weight acc += g.T @ h (fp32)": lambda: _add_matmul(acc, g.t(), h)}.items():
        ms = milliseconds(fn)
        print(f"gemm    {tokens:5d} tokens  {name:30s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 2048])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.loss_kernel times CUDA kernels: run it on a machine with a CUDA GPU")
    print(torch.__version__, torch.cuda.get_device_name())
    variants = {"torch (inductor)": select_chunk_loss("torch", "cuda", compile_torch=True)[0]}
    if liger_unavailable_reason("cuda") is None:
        variants["liger (sfttrain's launch)"] = liger_chunk_loss_and_grad
    for tokens in args.tokens:
        softmax_variants(tokens, variants)
        gemms(tokens)


if __name__ == "__main__":
    main()
