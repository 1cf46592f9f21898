"""The GEMMs of one W1 layer's folded LoRA adapters (sfttrain/fuse_projections.py), one at a time: their time and
FLOP rate as cuBLAS runs them, and for the weight gradients (a product over the tokens, K = 13,696, into a
rank-wide matrix) split over the tokens into a batched GEMM whose partial products are summed (split-K by
hand), and with --autotune as inductor's max-autotune picks (Triton templates, its own split-K).

    python3 -m bench.adapter_gemms [--tokens N] [--autotune]

Why: a W1 layer's seven projections ran 2.56 ms folded against 1.45 ms frozen alone (docs/benchmarks.md,
run CD), where the adapters' FLOPs add ~22% to the frozen GEMMs'. The skinny products are the suspects:
a weight gradient with a [64..192, 896] output and K = 13,696 fills a few of the H200's 132 SMs unless
the product is split along K. Each operand has the layout the compiled layer gives it (a transposed view
of the output gradient, the adapters' input gradient as a slice of the widened input gradient).

On a machine without CUDA it runs the same on the CPU (timed by the clock) with --tokens 64, so that
the script is checked (tests/test_bench_w1.py); the figures are then the CPU's."""
from __future__ import annotations

import argparse

import torch

from bench.common import time_calls
from bench.lora_linear import D, FF, KV, R, T

# group: (input width, output width, projections): q/k/v, o, gate/up, down (sfttrain.fuse_projections's groups)
GROUPS = {"qkv": (D, D + 2 * KV, 3), "o": (D, D, 1), "gate_up": (D, 2 * FF, 2), "down": (FF, D, 1)}
SPLITS = (2, 4, 8, 16, 32)
FROZEN = ("frozen alone: x W^T", "frozen alone: g W")  # the same group without adapters, for comparison
TILE, SMS = 128 * 128, 132  # an output tile of a Hopper GEMM kernel; the H200's SMs


def operands(tokens: int, d_in: int, d_out: int, n: int, device, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A group's six products as (a, b) of a @ b, in the layouts of the compiled layer (fuse_projections' op)."""
    r = n * R

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, x_wide, a_cat, w_wide = rand(tokens, d_in), rand(tokens, d_in + r), rand(r, d_in), rand(d_out, d_in + r)
    g, u, grad_wide = rand(tokens, d_out), rand(tokens, r), rand(tokens, d_in + r)
    du = grad_wide[:, d_in:]  # the adapters' input gradient: a slice of the widened GEMM's input gradient
    w = w_wide[:, :d_in]
    return {"fwd U = x A^T": (x, a_cat.t()), "fwd y = [x|U] Wb^T": (x_wide, w_wide.t()),
            "bwd [dx|dU] = g Wb": (g, w_wide), "bwd dB = g^T U": (g.t(), u),
            "bwd dA = dU^T x": (du.t(), x), "bwd dx += dU A": (du, a_cat),
            FROZEN[0]: (x, w.contiguous().t()), FROZEN[1]: (g, w.contiguous())}


def split_k(a: torch.Tensor, b: torch.Tensor, splits: int) -> torch.Tensor:
    """a @ b as `splits` products over slices of K, batched, summed in fp32."""
    k = a.shape[1]
    a3 = a.unflatten(1, (splits, k // splits)).transpose(0, 1)
    b3 = b.unflatten(0, (splits, k // splits))
    if a.is_cuda and "dtype" in torch.ops.aten.bmm.overloads():  # the partial products kept in fp32
        partial = torch.bmm(a3, b3, out_dtype=torch.float32)
    else:  # a CPU, or a torch without bmm's out_dtype: partials rounded to a's dtype
        partial = torch.bmm(a3, b3).float()
    return partial.sum(0)


def study(a: torch.Tensor, b: torch.Tensor, autotune: bool, reps: int) -> dict:
    """torch.mm's time (cuBLAS's on a GPU); for a product over the tokens, the best split-K (checked against cuBLAS's
    product: bf16 operands summed in fp32 either way, so they agree to bf16's output rounding)."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    out = {"shape": f"[{a.shape[0]}, {a.shape[1]}] x [{b.shape[0]}, {b.shape[1]}]", "flops": flops,
           "mm_s": time_calls(lambda: a @ b, reps)[1]}
    if a.shape[0] * b.shape[1] < SMS * TILE and a.shape[1] > max(a.shape[0], b.shape[1]):  # fewer tiles than SMs
        reference = (a @ b).float()
        best = None
        for splits in (s for s in SPLITS if a.shape[1] % s == 0):
            err = ((split_k(a, b, splits) - reference).abs().max() / reference.abs().max()).item()
            assert err < 2e-2, f"split-K {splits} of {out['shape']}: relative error {err:.1e}"
            seconds = time_calls(lambda: split_k(a, b, splits), reps)[1]
            if best is None or seconds < best[1]:
                best = (splits, seconds)
        if best is not None:
            out["split_k"], out["split_k_s"] = best
        if autotune:
            compiled = torch.compile(lambda x, y: x @ y, mode="max-autotune-no-cudagraphs", dynamic=False)
            out["autotune_s"] = time_calls(lambda: compiled(a, b), reps)[1]
            torch._dynamo.reset()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=T, help="tokens of the micro-batch (W1's 13,696)")
    ap.add_argument("--autotune", action="store_true", help="also inductor's max-autotune for the weight gradients")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"{device}: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"{args.tokens} tokens, rank {R}, bf16", flush=True)
    total = {"mm": 0.0, "best": 0.0, "frozen": 0.0}
    for group, (d_in, d_out, n) in GROUPS.items():
        for name, (a, b) in operands(args.tokens, d_in, d_out, n, device, torch.bfloat16).items():
            r = study(a, b, args.autotune, args.reps)
            rate = r["flops"] / r["mm_s"] / 1e12
            line = f"{group:8s} {name:20s} {r['shape']:28s} mm {r['mm_s'] * 1e6:8.1f} us {rate:6.1f} TFLOP/s"
            best = r["mm_s"]
            if "split_k" in r:
                line += f" | split-K {r['split_k']:2d}: {r['split_k_s'] * 1e6:8.1f} us"
                best = min(best, r["split_k_s"])
            if "autotune_s" in r:
                line += f" | autotune {r['autotune_s'] * 1e6:8.1f} us"
                best = min(best, r["autotune_s"])
            if name in FROZEN:
                total["frozen"] += r["mm_s"]
            else:
                total["mm"] += r["mm_s"]
                total["best"] += best
            print(line, flush=True)
    print(f"a layer's folded GEMMs: mm {total['mm'] * 1e3:.3f} ms, the best of each {total['best'] * 1e3:.3f} ms; "
          f"its frozen GEMMs alone {total['frozen'] * 1e3:.3f} ms (x24 layers: {total['mm'] * 24e3:.1f}, "
          f"{total['best'] * 24e3:.1f} and {total['frozen'] * 24e3:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
