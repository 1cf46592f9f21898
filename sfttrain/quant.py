"""model.base_quant: LoRA's frozen linear weights quantized as they load, one at a time on the device, the
same for any number of ranks; embeddings, norms, the output head and the adapters keep their dtypes.
nf4: torchao's NF4Tensor (4-bit NormalFloat in blocks of 64, scales double-quantized, as QLoRA),
dequantized per GEMM by its F.linear; FSDP2 shards and all-gathers it in 4 bits, each rank keeping its rows.
fp8: e4m3 with an fp32 scale per output row, float8 GEMMs (torch._scaled_mm) for the forward and the
input gradient. FSDP2 leaves these out (whole on every rank, never cast or gathered in 2 bytes): sharding
them would need a tensor subclass of their own, and the case they serve is one GPU."""

from __future__ import annotations

import logging

import torch
from torch import nn

from sfttrain.errors import ConfigError, DependencyError

BLOCK = 64  # weights per 4-bit block, each with its own absmax scale (QLoRA, torchtune)
SCALER_BLOCK = 256  # scales per block of their int8 quantization, where the weight's size allows it
# a weight's scale blocks split evenly into this many row shards, so small weights (a test model's)
# still shard; a real model's (dimensions multiples of 128) keep SCALER_BLOCK
SHARDABLE = 4
FP8 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(FP8).max  # 448
FP8_MULTIPLE = 16  # float8 GEMMs (cuBLAS) take dimensions that are multiples of 16
UNFIT = {"nf4": f"their shapes not splitting into {SHARDABLE} row shards of {BLOCK}-weight blocks",
         "fp8": f"a dimension not a multiple of {FP8_MULTIPLE} (float8 GEMMs need it)"}
# how the start-up line names the frozen linear weights
HELD = {"nf4": f"NF4 (linear weights, {BLOCK}-weight blocks",
        "fp8": "float8 e4m3 (linear weights, a scale per output row, float8 GEMMs"}


# held per weight: 4 bits, an int8 scale per block, an fp32 factor per block of scales
BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK + 4 / (BLOCK * SCALER_BLOCK)


def dequantize_bytes_per_weight(dtype: torch.dtype) -> int:
    """Peak temporaries of torchao's dequantize per weight: two int64 index halves, the looked-up and
    scaled halves and their interleaved copy in `dtype`."""
    return 8 + 3 * dtype.itemsize


def torchao_nf4():
    """torchao's to_nf4 (torchao >= 0.18, the fp8 extra's)."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise DependencyError("model.base_quant=nf4 needs torchao: pip install -e '.[fp8]' in the checkout, "
                              "or set model.base_quant=none") from None
    return to_nf4


def scaler_block(shape: torch.Size) -> int | None:
    """The scale-quantization block of a weight of `shape`, None where none fits: its rows and scale
    blocks must divide by SHARDABLE (the same for any shard count that divides their number)."""
    rows, numel = shape[0], shape.numel()
    blocks = numel // BLOCK
    if numel % BLOCK or rows % SHARDABLE or blocks % SHARDABLE:
        return None
    return max(d for d in range(1, SCALER_BLOCK + 1) if blocks // SHARDABLE % d == 0)


def frozen_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers whose weights model.base_quant holds: every frozen nn.Linear but the output head."""
    head = model.get_output_embeddings()
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad]


def quantize_on_meta(model: nn.Module, kind: str) -> None:
    """Each frozen linear weight of the meta model becomes a placeholder of `kind` (nf4, fp8), but those
    of a shape it does not fit (a warning names them)."""
    place = _nf4_on_meta if kind == "nf4" else _fp8_on_meta
    left = [name for name, module in frozen_linears(model) if not place(name, module)]
    if left:
        logging.getLogger("sfttrain").warning(
            f"model.base_quant={kind}: {len(left)} linear weights stay in their dtype, {UNFIT[kind]}: {left[:4]}")


def _nf4_on_meta(name: str, module: nn.Linear) -> bool:
    if (size := scaler_block(module.weight.shape)) is None:
        return False
    shards = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if module.weight.shape[0] % shards or module.weight.numel() // BLOCK // size % shards:
        raise ConfigError(f"model.base_quant=nf4: {name}.weight {tuple(module.weight.shape)} does not split "
                          f"into whole NF4 blocks over {shards} ranks; use fewer ranks or model.base_quant=none")
    module.weight = nn.Parameter(torchao_nf4()(torch.empty_like(module.weight, device="meta"), BLOCK, size),
                                 requires_grad=False)
    return True


def _fp8_on_meta(_name: str, module: nn.Linear) -> bool:
    if fits := fp8_fits(module):
        module.weight = nn.Parameter(torch.empty_like(module.weight, dtype=FP8, device="meta"), requires_grad=False)
        module.register_buffer("weight_scale", torch.ones(module.out_features, 1), persistent=False)
        module.__class__ = Float8BaseLinear
    return fits


def fp8_fits(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not (module.in_features % FP8_MULTIPLE or module.out_features % FP8_MULTIPLE)


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def is_quantized(tensor: torch.Tensor) -> bool:
    return is_nf4(tensor) or tensor.dtype == FP8


def full_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a weight is drawn in before it is quantized (fp8 quantizes the fp32 value)."""
    return torch.float32 if tensor.dtype == FP8 else tensor.dtype


def fill_shard(local: torch.Tensor, full: torch.Tensor, rows: slice, module: nn.Module) -> None:
    """Quantizes `module`'s full weight `full` and stores its `rows` (this rank's shard) in `local`."""
    if local.dtype == FP8:  # whole on every rank
        weight, scale = rowwise(full.to(local.device))
        local.copy_(weight)
        module.weight_scale.copy_(scale)
        return
    quantized = torchao_nf4()(full.to(local.device, local.dtype).contiguous(), BLOCK, local.scaler_block_size)
    shard = quantized.split(rows.stop - rows.start)[rows.start // (rows.stop - rows.start)]
    local.copy_(shard)  # the sharded parts; to_empty left the unsharded mean and lookup table empty
    local.scaler_mean, local.nf4 = shard.scaler_mean, shard.nf4


def round_trip(model: nn.Module, dtype: torch.dtype, kind: str) -> None:
    """Each weight `kind` would hold replaced by its dequantized value, computed as training did (nf4
    from `dtype`, the frozen base's): the base its adapters were trained on, in the model's own dtype."""
    with torch.no_grad():
        for _, module in frozen_linears(model):
            w = module.weight
            if kind == "fp8" and fp8_fits(module):
                weight, scale = rowwise(w)
                w.copy_(weight.float() * scale)
            elif kind == "nf4" and (size := scaler_block(w.shape)) is not None:
                w.copy_(torchao_nf4()(w.to(dtype).contiguous(), BLOCK, size).get_original_weight())


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (rows, n) in e4m3 and its fp32 scale per row: the row's largest magnitude maps to e4m3's largest."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (t / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale  # e4m3fn has no inf: out of range is NaN


def scaled_mm(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a (..., k), quantized per row as it comes, times the e4m3 (k, n) `b` (column-major, as cuBLAS
    takes it) with its scales (1, n); in bf16, the one output dtype of rowwise-scaled float8 GEMMs."""
    q, scale = rowwise(a.reshape(-1, a.shape[-1]))
    return torch._scaled_mm(q, b, scale, b_scale, out_dtype=torch.bfloat16).view(*a.shape[:-1], b.shape[1])


# an op of its own for torch.compile (an autograd.Function twice in a checkpointed layer breaks dynamo)
@torch.library.custom_op("sfttrain::float8_linear", mutates_args=())
def float8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a frozen e4m3 W (scales per output row); its backward: the input gradient in float8
    too, no weight gradient, nothing of x saved."""
    return scaled_mm(x, weight.t(), scale.t()).to(x.dtype)


@float8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _input_gradient(ctx, grad: torch.Tensor):
    weight, scale = ctx.saved_tensors
    # W's row scales lie along this GEMM's inner dimension: folded into the gradient before it is quantized
    # (to e4m3 too: a scale per row spans its range, and e4m3's third mantissa bit halves e5m2's rounding)
    ones = scale.new_ones(1, weight.shape[1])
    return scaled_mm(grad * scale.t(), weight.t().contiguous().t(), ones).to(grad.dtype), None, None


float8_linear.register_autograd(_input_gradient, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(
    *inputs[1:]))


class Float8BaseLinear(nn.Linear):
    """A frozen nn.Linear held in e4m3 with an fp32 scale per output row (`weight_scale`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = float8_linear(x, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias


def fp8_bytes(model: nn.Module) -> int:
    """What model.base_quant=fp8's weights hold on each rank: a byte per weight, 4 per row's scale."""
    return sum(m.weight.nbytes + m.weight_scale.nbytes for m in model.modules() if isinstance(m, Float8BaseLinear))


def check_fp8(base_quant: str, device: str) -> None:
    """Refuses model.base_quant=fp8 where torch runs no float8 GEMM with rowwise scales on `device`."""
    if base_quant != "fp8" or device == "cuda" and not torch.cuda.is_available():
        return  # planned here for GPUs elsewhere: checked where it starts
    q, ones = torch.zeros(16, 16, dtype=FP8, device=device), torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(q, q.t(), ones, ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"model.base_quant=fp8 needs float8 GEMMs with a scale per row (torch._scaled_mm), which "
                          f"torch {torch.__version__} does not run on {device} ({str(e).splitlines()[0]}); GPUs "
                          "have them from compute capability 8.9 (H100, H200): use model.base_quant=nf4") from None
