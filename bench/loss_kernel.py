"""The loss's pieces on the GPU, alone, on W1's shapes (hidden 896, vocabulary 151936): the
per-chunk softmax kernel (`sfttrain.loss.chunk_loss_and_grad` compiled with inductor options,
against Liger's in-place cross-entropy kernel) and the three lm_head GEMMs of a chunk.

    python3 -m bench.loss_kernel [--tokens 1024 2048]

Prints milliseconds per chunk and, for the softmax, the bandwidth of its ideal traffic (read the
bf16 logits twice, write the bf16 gradient once), after checking each result against an fp32
eager computation.
"""

import argparse

import torch

from sfttrain.loss import IGNORE_INDEX, _add_matmul, chunk_loss_and_grad

HIDDEN, VOCAB = 896, 151936

INDUCTOR_OPTIONS = {
    "inductor": {},
    "inductor_coordinate_descent": {"coordinate_descent_tuning": True},
    "inductor_no_online_softmax": {"online_softmax": False},
}


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


def liger_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor):
    """Liger's kernel: the gradient written over the logits (its wrapper reads counts on the host)."""
    from liger_kernel.ops.cross_entropy import cross_entropy_forward

    loss, _, _, _, grad = cross_entropy_forward(logits, labels, None, IGNORE_INDEX, 0.0, 0.0, "sum", None, False)
    return loss, grad


def softmax_variants(tokens: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(tokens, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, VOCAB, (tokens,), device="cuda")
    labels[torch.rand(tokens, device="cuda") < 0.4] = IGNORE_INDEX
    ref_loss, ref_grad = chunk_loss_and_grad(logits.float(), labels, True)
    ideal_bytes = 3 * logits.numel() * logits.element_size()
    variants = {name: torch.compile(chunk_loss_and_grad, dynamic=True, options=opts)
                for name, opts in INDUCTOR_OPTIONS.items()}
    for name, fn in variants.items():
        try:
            loss, grad = fn(logits, labels, True)
            ms = milliseconds(lambda: fn(logits, labels, True))
        except Exception as e:  # an option this torch does not know
            print(f"softmax {tokens:5d} tokens  {name:28s} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        report(tokens, name, ms, ideal_bytes, loss, grad, ref_loss, ref_grad)
    try:
        work = logits.clone().requires_grad_()  # Liger writes the gradient only for inputs that need one
        loss, grad = liger_loss_and_grad(work, labels)
        ms = milliseconds(lambda: liger_loss_and_grad(work, labels))
        report(tokens, "liger (in place)", ms, ideal_bytes, loss, grad, ref_loss, ref_grad)
    except ImportError:
        print("liger-kernel not installed")


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
    print(torch.__version__, torch.cuda.get_device_name())
    for tokens in args.tokens:
        softmax_variants(tokens)
        gemms(tokens)


if __name__ == "__main__":
    main()
