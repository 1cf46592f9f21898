"""One W1 decoder layer's seven projections (q, k, v, o, gate, up, down at 13,696 tokens, LoRA rank 64),
forward and backward compiled by inductor, per formulation of the LoRA adapters: GPU ms a layer (CUDA
events over 30 calls) and host ms a call. The study behind sfttrain/fuse_projections.py (docs/benchmarks.md,
runs CC, CD, CJ, CL and CM); `kcat_group_fn` is the formulation sfttrain.fuse_projections implements.

    python3 -m bench.lora_linear [--tokens N] [--autotune] [variant ...]

--autotune compiles with inductor's max-autotune (GEMMs as Triton templates where they win, with
the elementwise work that follows them fused in).

Without CUDA it runs on the CPU (its figures the clock's), as the suite's smoke run does with a few tokens.

full / full_fused: trained weights, projections apart / q-k-v and gate-up fused; frozen_fused: frozen
weights without adapters (LoRA's floor); peft: what sfttrain ran (frozen groups and the adapters' A
fused, B apart, summed); kcat: [x | s xA^T] @ [W, B]^T per projection, autograd's backward; kcat_block:
one GEMM a group with a block weight, autograd's backward; merged_bwd: peft's forward, backward's input
gradient through W + s BA; kcat_fn / kcat_group_fn: kcat per projection / per group with a backward
that computes no frozen weight gradient; kcat_group_splitk: kcat_group_fn with the adapters' weight
gradients (K = the tokens) split over the tokens by hand; kcat_overlap: kcat_group_fn with gate/up
over overlapping views of [U_gate | x | U_up], without the block weight's zeros; kcat_merged /
kcat_overlap_merged: kcat_group_fn / kcat_overlap whose backward takes x's gradient from U's GEMM, the
adapters merged into the frozen weight there (g @ [W + s*B@A | B]: no g_U @ A GEMM, no sum)."""
import argparse

import torch
import torch.nn.functional as F

from bench.common import time_calls

T, D, FF, KV, R, S = 13696, 896, 4864, 128, 64, 0.5
dev, bf = "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16
torch.manual_seed(0)


def w(o, i, grad):
    return (torch.randn(o, i, device=dev, dtype=bf) * 0.02).requires_grad_(grad)


def params(lora):
    shapes = {"q": (D, D), "k": (KV, D), "v": (KV, D), "o": (D, D), "g": (FF, D), "u": (FF, D), "d": (D, FF)}
    p = {n: w(*s, grad=not lora) for n, s in shapes.items()}
    if lora:
        for n, (o, i) in shapes.items():
            p["A" + n] = w(R, i, True)
            p["B" + n] = (torch.randn(o, R, device=dev, dtype=bf) * 0.01).requires_grad_(True)
    return p


def plain(p, xa, xo, xm, xd):
    return [F.linear(xa, p[n]) for n in "qkv"] + [F.linear(xo, p["o"])] + [F.linear(xm, p[n]) for n in "gu"] + [
        F.linear(xd, p["d"])]


def fused_plain(p, xa, xo, xm, xd):
    qkv = F.linear(xa, torch.cat([p["q"], p["k"], p["v"]])).split([D, KV, KV], -1)
    gu = F.linear(xm, torch.cat([p["g"], p["u"]])).split([FF, FF], -1)
    return [*qkv, F.linear(xo, p["o"]), *gu, F.linear(xd, p["d"])]


def peft(p, xa, xo, xm, xd):
    """what sfttrain runs now with auto: base groups fused (frozen, small), A's of a group fused, B apart"""
    base = fused_plain(p, xa, xo, xm, xd)
    ha = F.linear(xa, torch.cat([p["Aq"], p["Ak"], p["Av"]])).split(R, -1)
    hm = F.linear(xm, torch.cat([p["Ag"], p["Au"]])).split(R, -1)
    h = {"q": ha[0], "k": ha[1], "v": ha[2], "o": F.linear(xo, p["Ao"]),
         "g": hm[0], "u": hm[1], "d": F.linear(xd, p["Ad"])}
    return [b + F.linear(h[n], p["B" + n]) * S for b, n in zip(base, "qkvogud")]


def kcat(p, xa, xo, xm, xd):
    """exact: y = [x, s*xA^T] @ [W, B]^T, one GEMM per projection (no separate B GEMM or add)"""
    def one(x, names):
        u = F.linear(x, torch.cat([p["A" + n] for n in names])) * S
        us = u.split(R, -1)
        return [F.linear(torch.cat([x, us[i]], -1), torch.cat([p[n], p["B" + n]], 1)) for i, n in enumerate(names)]
    return [*one(xa, "qkv"), *one(xo, "o"), *one(xm, "gu"), *one(xd, "d")]


def kcat_block(p, xa, xo, xm, xd):
    """exact: one GEMM per group over [x, u_1..u_n] with a block weight [[W_1, B_1, 0..], [W_2, 0, B_2, ..]]"""
    def group(x, names):
        u = F.linear(x, torch.cat([p["A" + n] for n in names])) * S
        rows = []
        for i, n in enumerate(names):
            blocks = [p[n]] + [p["B" + n] if j == i else p["B" + n].new_zeros(p[n].shape[0], R)
                               for j in range(len(names))]
            rows.append(torch.cat(blocks, 1))
        y = F.linear(torch.cat([x, u], -1), torch.cat(rows))
        return list(y.split([p[n].shape[0] for n in names], -1))
    return [*group(xa, "qkv"), *group(xo, "o"), *group(xm, "gu"), *group(xd, "d")]


class MergedBackward(torch.autograd.Function):
    """forward exact (peft's), backward's input gradient through W + s*B@A (one GEMM)"""

    @staticmethod
    def forward(ctx, x, W, A, B):
        h = F.linear(x, A)
        ctx.save_for_backward(x, W, A, B, h)
        return F.linear(x, W) + F.linear(h, B) * S

    @staticmethod
    def backward(ctx, g):
        x, W, A, B, h = ctx.saved_tensors
        gx = g @ (W + (B @ A) * S)
        gh = (g @ B) * S
        return gx, None, gh.t() @ x, (g.t() @ h) * S


def merged_bwd(p, xa, xo, xm, xd):
    xs = {"q": xa, "k": xa, "v": xa, "o": xo, "g": xm, "u": xm, "d": xd}
    return [MergedBackward.apply(xs[n], p[n], p["A" + n], p["B" + n]) for n in "qkvogud"]


class KCat(torch.autograd.Function):
    """exact: y = [x, s*xA^T] @ [W, B]^T; backward computes no frozen-weight gradient"""

    @staticmethod
    def forward(ctx, x, W, A, B):
        u = F.linear(x, A) * S
        y = F.linear(torch.cat([x, u], -1), torch.cat([W, B], 1))
        ctx.save_for_backward(x, u, W, A, B)
        return y

    @staticmethod
    def backward(ctx, g):
        x, u, W, A, B = ctx.saved_tensors
        gxu = g @ torch.cat([W, B], 1)
        d = x.shape[-1]
        gu = gxu[..., d:] * S
        gx = gxu[..., :d] + gu @ A
        return gx, None, gu.t() @ x, g.t() @ u


def kcat_fn(p, xa, xo, xm, xd):
    xs = {"q": xa, "k": xa, "v": xa, "o": xo, "g": xm, "u": xm, "d": xd}
    return [KCat.apply(xs[n], p[n], p["A" + n], p["B" + n]) for n in "qkvogud"]


def over_tokens(a, b):
    """a @ b, a product over the tokens (a weight gradient): cuBLAS's choice"""
    return a @ b


def over_tokens_split(a, b):
    """the same product split over the tokens by hand (bench.adapter_gemms.split_k), 16 slices where they divide"""
    from bench.adapter_gemms import split_k

    return split_k(a, b, 16).to(a.dtype) if a.shape[1] % 16 == 0 else a @ b


def block_diag(Bs):
    """[[B_1, 0, ..], [0, B_2, ..], ..]: each B beside zeros where the other adapters' columns are"""
    return torch.cat([torch.cat([Bi if j == i else Bi.new_zeros(Bi.shape[0], R) for j in range(len(Bs))], 1)
                      for i, Bi in enumerate(Bs)])


class KCatGroup(torch.autograd.Function):
    """exact, one GEMM a group: y = [x, U] @ [[W_1, B_1, 0], [W_2, 0, B_2]]^T with U = s*x[A_1; A_2]^T"""

    @staticmethod
    def forward(ctx, x, Wc, Ac, *Bs):
        U = F.linear(x, Ac) * S
        Wb = torch.cat([Wc, block_diag(Bs)], 1)
        ctx.save_for_backward(x, U, Wc, Ac, *Bs)
        return F.linear(torch.cat([x, U], -1), Wb)

    @staticmethod
    def backward(ctx, g):
        return kcat_group_backward(ctx, g, over_tokens)


def kcat_group_backward(ctx, g, weight_grad):
    x, U, Wc, Ac, *Bs = ctx.saved_tensors
    d = x.shape[-1]
    gxu = g @ torch.cat([Wc, block_diag(Bs)], 1)
    gU = gxu[..., d:] * S
    gx = gxu[..., :d] + gU @ Ac
    outs = [Bi.shape[0] for Bi in Bs]
    gBs = [weight_grad(gi.t(), U[..., i * R:(i + 1) * R]) for i, gi in enumerate(g.split(outs, -1))]
    return (gx, None, weight_grad(gU.t(), x), *gBs)


class KCatGroupSplitK(KCatGroup):
    """KCatGroup with the adapters' weight gradients split over the tokens by hand"""

    @staticmethod
    def backward(ctx, g):
        return kcat_group_backward(ctx, g, over_tokens_split)


class KCatGroupMerged(KCatGroup):
    """KCatGroup whose backward gives x's gradient from the same GEMM as U's: g @ [Wc + s*BD@Ac | BD], the
    adapters merged into the frozen block (BD the block diagonal of the B's), no g_U @ Ac GEMM or sum"""

    @staticmethod
    def backward(ctx, g):
        x, U, Wc, Ac, *Bs = ctx.saved_tensors
        BD, d = block_diag(Bs), x.shape[-1]
        gxu = g @ torch.cat([Wc + (BD * S) @ Ac, BD], 1)
        gU = gxu[..., d:] * S
        gBs = [gi.t() @ U[..., i * R:(i + 1) * R] for i, gi in enumerate(g.split([Bi.shape[0] for Bi in Bs], -1))]
        return (gxu[..., :d], None, gU.t() @ x, *gBs)


class KCatOverlap(torch.autograd.Function):
    """exact, a two-projection group without KCatGroup's zero blocks: over Z = [U_1 | x | U_2], y_1 =
    Z[:, :R+D] @ [B_1, W_1]^T and y_2 = Z[:, R:] @ [W_2, B_2]^T, two GEMMs on overlapping views of one buffer"""

    @staticmethod
    def forward(ctx, x, W1, W2, Ac, B1, B2):
        U = F.linear(x, Ac) * S
        Z = torch.cat([U[..., :R], x, U[..., R:]], -1)
        ctx.save_for_backward(x, Z, W1, W2, Ac, B1, B2)
        return F.linear(Z[..., :-R], torch.cat([B1, W1], 1)), F.linear(Z[..., R:], torch.cat([W2, B2], 1))

    @staticmethod
    def backward(ctx, g1, g2):
        x, Z, W1, W2, Ac, B1, B2 = ctx.saved_tensors
        d1, d2 = g1 @ torch.cat([B1, W1], 1), g2 @ torch.cat([W2, B2], 1)
        gU = torch.cat([d1[..., :R], d2[..., -R:]], -1) * S
        gx = d1[..., R:] + d2[..., :-R] + gU @ Ac
        return gx, None, None, gU.t() @ x, g1.t() @ Z[..., :R], g2.t() @ Z[..., -R:]


class KCatOverlapMerged(KCatOverlap):
    """KCatOverlap whose backward merges each adapter into its frozen block, as KCatGroupMerged"""

    @staticmethod
    def backward(ctx, g1, g2):
        x, Z, W1, W2, Ac, B1, B2 = ctx.saved_tensors
        A1, A2 = Ac.split(R)
        d1 = g1 @ torch.cat([B1, W1 + (B1 * S) @ A1], 1)
        d2 = g2 @ torch.cat([W2 + (B2 * S) @ A2, B2], 1)
        gU = torch.cat([d1[..., :R], d2[..., -R:]], -1) * S
        return d1[..., R:] + d2[..., :-R], None, None, gU.t() @ x, g1.t() @ Z[..., :R], g2.t() @ Z[..., -R:]


def kcat_group(p, x, names, fn=KCatGroup):
    y = fn.apply(x, torch.cat([p[n] for n in names]), torch.cat([p["A" + n] for n in names]),
                 *[p["B" + n] for n in names])
    return list(y.split([p[n].shape[0] for n in names], -1))


def kcat_group_fn(p, xa, xo, xm, xd, fn=KCatGroup):
    return [*kcat_group(p, xa, "qkv", fn), *kcat_group(p, xo, "o", fn), *kcat_group(p, xm, "gu", fn),
            *kcat_group(p, xd, "d", fn)]


def kcat_group_splitk(p, xa, xo, xm, xd):
    return kcat_group_fn(p, xa, xo, xm, xd, fn=KCatGroupSplitK)


def kcat_overlap(p, xa, xo, xm, xd, group_fn=KCatGroup, pair_fn=KCatOverlap):
    """kcat_group_fn, but gate/up over overlapping views instead of a block weight with zeros"""
    gate, up = pair_fn.apply(xm, p["g"], p["u"], torch.cat([p["Ag"], p["Au"]]), p["Bg"], p["Bu"])
    return [*kcat_group(p, xa, "qkv", group_fn), *kcat_group(p, xo, "o", group_fn), gate, up,
            *kcat_group(p, xd, "d", group_fn)]


def kcat_merged(p, xa, xo, xm, xd):
    return kcat_group_fn(p, xa, xo, xm, xd, fn=KCatGroupMerged)


def kcat_overlap_merged(p, xa, xo, xm, xd):
    return kcat_overlap(p, xa, xo, xm, xd, KCatGroupMerged, KCatOverlapMerged)


VARIANTS = {"full": (False, plain), "full_fused": (False, fused_plain), "frozen_fused": (True, fused_plain),
            "peft": (True, peft), "kcat": (True, kcat), "kcat_block": (True, kcat_block),
            "merged_bwd": (True, merged_bwd),
            "kcat_fn": (True, kcat_fn), "kcat_group_fn": (True, kcat_group_fn),
            "kcat_group_splitk": (True, kcat_group_splitk), "kcat_overlap": (True, kcat_overlap),
            "kcat_merged": (True, kcat_merged), "kcat_overlap_merged": (True, kcat_overlap_merged)}


def run(name, tokens, autotune=False):
    lora, fn = VARIANTS[name]
    p = params(lora)
    if name == "frozen_fused":
        p = {k: v for k, v in p.items() if k[0] not in "AB"}
    xs = [torch.randn(tokens, n, device=dev, dtype=bf, requires_grad=True) for n in (D, D, D, FF)]
    gouts = None

    cstep = torch.compile(fn, mode="max-autotune-no-cudagraphs" if autotune else None)

    def cstep_full():
        outs = cstep(p, *xs)
        nonlocal gouts
        if gouts is None:
            gouts = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, gouts)

    host, gpu = (seconds * 1e3 for seconds in time_calls(cstep_full, 30, warmup=5))
    # reference check against eager peft (or the plain layer): outputs, and the gradients of the same outputs' loss
    reference = peft if lora and "A" + "q" in p else plain
    (out_c, grads_c), (out_e, grads_e) = (outputs_and_grads(f, p, xs, gouts) for f in (cstep, reference))
    err = relative_error(out_c, out_e)
    grad_err = relative_error(grads_c, grads_e)
    # bf16 results rounded after sums in another order: a few of bf16's 2^-8 at the largest value (CC, CD:
    # 7.8e-3 at most, forward); a formulation that computed something else would be off by O(1)
    assert err < 2e-2 and grad_err < 2e-2, (f"{name}: relative errors {err:.2e}, {grad_err:.2e} (gradients) "
                                            f"against {reference.__name__}")
    print(f"{name:14s} {'gpu' if dev == 'cuda' else 'cpu'} {gpu:7.3f} ms/layer  x24 {gpu * 24:6.1f} ms  "
          f"host {host:6.3f} ms/call  "
          f"rel err vs peft/plain {err:.2e} (gradients {grad_err:.2e})", flush=True)


def outputs_and_grads(fn, p, xs, gouts):
    leaves = [v for v in [*p.values(), *xs] if v.requires_grad]
    for v in leaves:
        v.grad = None
    outs = fn(p, *xs)
    torch.autograd.backward(outs, gouts)
    return [o.detach() for o in outs], [v.grad for v in leaves]


def relative_error(got, want):
    """The largest difference of any pair, against that tensor's largest value."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want))

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=T, help="tokens of the micro-batch (W1's 13,696)")
    ap.add_argument("--autotune", action="store_true", help="inductor's max-autotune (minutes of compilation)")
    ap.add_argument("variants", nargs="*", help=f"the formulations to time (default: all): {', '.join(VARIANTS)}")
    args = ap.parse_args()
    if set(args.variants) - VARIANTS.keys():
        ap.error(f"unknown variants {sorted(set(args.variants) - VARIANTS.keys())}; choose from {list(VARIANTS)}")
    for name in args.variants or VARIANTS:
        run(name, args.tokens, args.autotune)
        torch._dynamo.reset()
