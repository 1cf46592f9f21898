"""Causal attention within each sample of a packed row, registered in transformers' AttentionInterface
as "sfttrain_varlen"; the model call's FlashAttentionKwargs (cu_seq_lens_q/k, max_length_q/k) reach it.

Not in AttentionMaskInterface: for an implementation without a mask function masking_utils returns
mask=None before building a [T, T] mask or detecting packed sequences (a host sync per forward). The
name avoids "flash", "sdpa", "flex_attention" and "/", which transformers routes elsewhere.

Backends: flash_attn (the package), torch_varlen (aten::_flash_attention_forward, CUDA; a row of one
sample on cuDNN on Hopper or newer) and sdpa_blockmask (one causal SDPA per sample, any device). The
run's choice travels with each model call (`call_kwargs`), as the row boundaries and the Ulysses group
do: no process-wide state.

Ulysses sequence parallelism over packed rows: each sp rank keeps a slice of every row, and an all-to-all
around attention turns [T/sp, H, D] into [T, H/sp, D] and back. Each rank's loss is its slice's sum,
scaled like every rank's (`sfttrain.loss.step_objective`); FSDP shards over dp_shard x sp, so no loss is
divided by sp anywhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from sfttrain.dtypes import CONFIG_NAMES
from sfttrain.errors import ConfigError

ATTN_IMPLEMENTATION = "sfttrain_varlen"
BACKENDS = ("flash_attn", "torch_varlen", "sdpa_blockmask")  # also the "auto" preference order

CUDNN_HEAD_DIMS = (64, 128)  # where cuDNN's path was measured and tested; others stay on flash


@functools.lru_cache(maxsize=None)
def _flash_attn_importable() -> bool:
    try:  # a wheel built against another torch/CUDA fails at import
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return True


def _unavailable_reason(backend: str, device_type: str) -> str | None:
    if backend == "sdpa_blockmask":
        return None
    if device_type != "cuda":
        return f"{backend!r} needs a CUDA device (got {device_type!r})"
    if backend == "flash_attn" and not _flash_attn_importable():
        return "the flash_attn package is not importable"
    return None  # torch_varlen: every CUDA torch sfttrain takes (>= 2.11) has the windowed op


def available_backends(device_type: str) -> list[str]:
    return [b for b in BACKENDS if _unavailable_reason(b, device_type) is None]


def select_backend(requested: str, device_type: str) -> str:
    """"auto" (the first available of BACKENDS) or a named backend, refused saying why where it cannot run."""
    if requested == "auto":
        return available_backends(device_type)[0]  # sdpa_blockmask is always available
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; expected 'auto' or one of {BACKENDS}")
    reason = _unavailable_reason(requested, device_type)
    if reason is not None:
        raise ConfigError(f"model.attn_implementation={requested}: the backend is not available here: {reason}; set "
                          f"model.attn_implementation=auto or one available for {device_type!r}: "
                          f"{available_backends(device_type)}")
    return requested


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


def call_kwargs(backend: str) -> dict:
    """What a model call passes to reach `backend` (torch_varlen: a row of one sample on cuDNN where it can)."""
    return {"sfttrain_backend": backend,
            "sfttrain_cudnn_rows": backend == "torch_varlen" and cudnn_attention_available()}


def cudnn_attention_available() -> bool:  # Hopper or newer: where it was measured
    return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


def describe_backend(backend: str) -> str:
    return f"{backend} (a row of one sample on cuDNN)" if call_kwargs(backend)["sfttrain_cudnn_rows"] else backend


@functools.lru_cache(maxsize=None)
def kernel_ops() -> frozenset:
    """The attention ops of every backend, whose outputs sfttrain.recompute keeps for backward."""
    aten = torch.ops.aten
    ops = {aten._flash_attention_forward.default, aten._scaled_dot_product_cudnn_attention.default,
           aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    if _flash_attn_importable():  # flash-attn >= 2.6 registers its kernels as torch ops
        flash = getattr(torch.ops, "flash_attn", None)
        ops.update(getattr(flash, name).default for name in ("_flash_attn_varlen_forward", "_flash_attn_forward")
                   if flash is not None and hasattr(flash, name))
    return frozenset(ops)


# The kernels take q [T, H, D], k/v [T, Hkv, D], int32 cu_seqlens [n+1] (the same for keys: self-attention)
# and return [T, H, D]. window is (left, 0), left -1 for plain causal; softcap is Gemma 2's cap * tanh(scores
# / cap), or None.
def _run_flash_attn(q, k, v, cu, max_len, scale, window, softcap):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, dropout_p=0.0, softmax_scale=scale,
                                  causal=True, window_size=window, softcap=softcap or 0.0)


def _run_torch_varlen(q, k, v, cu, max_len, scale, window, softcap):
    if softcap is not None:
        raise ValueError(SOFTCAP_UNSUPPORTED)
    # varlen_attn's op, called directly: inductor's C++ wrapper cannot pass varlen_attn's window list.
    # TRAP: causal is window (-1, 0) WITH is_causal; (-1, -1) without it is bidirectional.
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, tuple(window) == (-1, 0), False,
        scale=scale, window_size_left=window[0], window_size_right=window[1],
    )[0]


def _run_cudnn_one_sample(q, k, v, scale):
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T, D], views
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)[0]
    return out[0].transpose(0, 1)


def _run_sdpa_blockmask(q, k, v, cu, max_len, scale, window, softcap):
    del max_len  # one causal SDPA per sample: nothing crosses a boundary, no [T, T] mask
    bounds = cu.tolist()
    gqa, outs = k.shape[1] != q.shape[1], []
    for start, end in ((a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a):
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]: SDPA's fused kernels
        if softcap is None and not 0 <= window[0] < end - start - 1:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            i = torch.arange(end - start, device=q.device)
            rel = i[:, None] - i[None, :]  # query index minus key index
            visible = (rel >= 0) & ((rel <= window[0]) if window[0] >= 0 else True)
            o = (F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale, enable_gqa=gqa)
                 if softcap is None else _softcapped_attention(qs, ks, vs, scale, visible, softcap))
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _softcapped_attention(q, k, v, scale, visible, softcap):
    """Gemma 2's eager attention (SDPA has no soft-cap), softmax in fp32."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # GQA
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
    return scores.masked_fill(~visible, float("-inf")).float().softmax(dim=-1).to(q.dtype) @ v


SOFTCAP_UNSUPPORTED = ("this model soft-caps its attention logits (attn_logit_softcapping), which PyTorch's varlen "
                       "attention cannot do: install flash-attn (model.attn_implementation=flash_attn), or use "
                       "model.attn_implementation=sdpa_blockmask (exact, slow on GPU)")


def check_model(config, backend: str, compute_dtype: torch.dtype) -> None:
    if getattr(config, "attn_logit_softcapping", None) is not None and backend == "torch_varlen":
        raise ConfigError(SOFTCAP_UNSUPPORTED)
    if backend != "sdpa_blockmask" and compute_dtype not in (torch.float16, torch.bfloat16):
        dtype = CONFIG_NAMES.get(compute_dtype, compute_dtype)
        raise ConfigError(f"model.attn_implementation: {backend} computes in fp16/bf16 only, and this run computes "
                          f"in {dtype}: set model.fsdp_config.mixed_precision=true (bf16 compute, fp32 weights), or "
                          "model.attn_implementation=sdpa_blockmask (slow on a GPU)")


_KERNELS = {"flash_attn": _run_flash_attn, "torch_varlen": _run_torch_varlen, "sdpa_blockmask": _run_sdpa_blockmask}


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             sfttrain_backend: str | None = None, sfttrain_cudnn_rows: bool = False,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa_attention_forward contract: query [1, H, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, H, D], None). Causal only, without attention sinks: the families sfttrain.loss takes.
    Keys share the `_q` boundaries (self-attention); sfttrain_*: `call_kwargs` (none: "auto" on the device)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the packed-row boundaries: call the "
                         "model with cu_seq_lens_q= (int32 [n+1], 0 .. T) and max_length_q= (int). Without them "
                         "samples would attend across boundaries.")
    cu, max_len = cu_seq_lens_q.to(device=query.device, dtype=torch.int32), int(max_length_q)
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} takes no attention_mask: packed rows have "
                         "no padding and the sample boundaries come from cu_seq_lens_q. Pass attention_mask=None.")
    if dropout and dropout > 0.0:  # torch's varlen attention has none: backends would disagree
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} does not implement attention dropout (got {dropout}); set the "
                         "model config's attention_dropout to 0 for training")
    if query.dim() != 4 or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} takes one packed row (batch 1) without a KV cache "
                         f"(use_cache=False), got query {tuple(query.shape)}, key {tuple(key.shape)}")
    backend = sfttrain_backend or select_backend("auto", query.device.type)
    # the flash kernels take fp16/bf16 of one dtype: cast back where autocast's RoPE promoted q and k to
    # fp32 (as transformers' flash integration does); fp32 outside autocast is an error
    flash, half, dev = backend != "sdpa_blockmask", (torch.float16, torch.bfloat16), query.device.type
    if flash and torch.is_autocast_enabled(dev) and (target := torch.get_autocast_dtype(dev)) in half:
        query, key, value = query.to(target), key.to(target), value.to(target)
    elif flash and not (query.dtype in half and key.dtype == query.dtype and value.dtype == query.dtype):
        raise ValueError(f"attention backend {backend!r} needs fp16/bf16 query/key/value of one dtype, got "
                         f"{query.dtype}/{key.dtype}/{value.dtype}; run the model in bf16 (or under autocast), "
                         "or configure 'sdpa_blockmask'")
    # a query sees keys with q - k < sliding_window
    window = (-1, 0) if sliding_window is None else (int(sliding_window) - 1, 0)

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D] views
    # The kernels save k and v for backward; where projections are fused they are column slices of
    # the q/k/v GEMM's output, a view that would keep all of it alive: a copy keeps only their columns.
    k, v = k.contiguous(), v.contiguous()
    # one sample (with the row's pad) fills the row: told by a shape, without a host sync
    if (sfttrain_cudnn_rows and backend == "torch_varlen" and cu.shape[0] == 2
            and window == (-1, 0) and q.shape[-1] in CUDNN_HEAD_DIMS):
        return _run_cudnn_one_sample(q, k, v, scaling).unsqueeze(0), None
    out = _KERNELS[backend](q, k, v, cu, max_len, scaling, window, softcap)
    return out.unsqueeze(0), None



@torch.compiler.disable  # eager under model.compile: a graph break around the collective, not a trace of it
def _exchange(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of dim 0 to rank j; chunk i of the result from rank i (autograd: back in backward)."""
    return all_to_all_single(torch.empty_like(send, memory_format=torch.contiguous_format), send.contiguous(),
                             group=group)


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, sfttrain_sp_group: dist.ProcessGroup | None = None, **kwargs):
    """The registered function: `varlen_attention_forward`, or with Ulysses (the call passes its sp group) the
    same contract on this rank's slice of the row, query [1, H, T/sp, D], key/value [1, Hkv, T/sp, D] ->
    ([1, T/sp, H, D], None), attention over the whole row for its share of the heads."""
    if sfttrain_sp_group is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
    group, size = sfttrain_sp_group, sfttrain_sp_group.size()
    # KV heads fewer than sp repeated, so that query head group j meets KV head j
    key, value = (t if t.shape[1] % size == 0 else t.repeat_interleave(size // t.shape[1], dim=1)
                  for t in (key, value))
    # [1, H, T/sp, D] -> [1, H/sp, T, D]: head group j to rank j, whose tokens arrive i-th from rank i
    query, key, value = (_exchange(t[0].reshape(size, t.shape[1] // size, *t.shape[2:]), group)
                         .transpose(0, 1).reshape(1, t.shape[1] // size, -1, t.shape[3])
                         for t in (query, key, value))
    out, _ = varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # [1, T, H/sp, D] -> [1, T/sp, H, D]: token slice j to rank j, head group i from rank i
    recv = _exchange(out[0].reshape(size, -1, *out.shape[2:]), group)
    return recv.permute(1, 0, 2, 3).reshape(1, recv.shape[1], -1, out.shape[3]), None


def check_ulysses(model_config, sp: int) -> None:
    """What Ulysses over sp ranks needs of the model's config (a start-up check): heads that split, and no
    router loss (its per-sample statistics would need each sample's tokens from all sp ranks)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % sp:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {heads} attention heads do not "
                          f"split over {sp} ranks; use a size that divides {heads}")
    if kv_heads % sp and sp % kv_heads:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the model's {kv_heads} key/value heads neither "
                          f"split over {sp} ranks nor repeat evenly to {sp}; use a divisor or a multiple of "
                          f"{kv_heads} that divides {heads}")
    if getattr(model_config, "output_router_logits", False):
        raise ConfigError(f"ulysses_sequence_parallel_size={sp}: the router's load-balancing loss "
                          "(output_router_logits=true) is computed per sample and does not run under sequence "
                          "parallelism yet; set ulysses_sequence_parallel_size=1 or output_router_logits=false")



register()
