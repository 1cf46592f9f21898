"""model.base_quant=nf4: LoRA's frozen linear weights held as torchao's NF4Tensor (4-bit NormalFloat
in blocks of 64, their scales double-quantized, as QLoRA), dequantized per GEMM by its F.linear.
Embeddings, norms, the output head and the adapters keep their dtypes. On the meta device each weight
becomes an NF4 placeholder, which FSDP2 shards and all-gathers in 4 bits; sfttrain.weights then
quantizes each full weight on the device (one at a time) and keeps this rank's rows: a weight's
quantization is the same for any number of ranks, and no rank holds the whole model unquantized."""

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
    """The linear layers whose weights NF4 holds: every frozen nn.Linear but the output head."""
    head = model.get_output_embeddings()
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad]


def quantize_on_meta(model: nn.Module) -> None:
    """Each frozen linear weight of the meta model becomes an NF4 placeholder, but those of a shape
    no block fits (a warning names them)."""
    to_nf4 = torchao_nf4()
    shards = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    left = []
    for name, module in frozen_linears(model):
        size = scaler_block(module.weight.shape)
        if size is None:
            left.append(name)
            continue
        if module.weight.shape[0] % shards or module.weight.numel() // BLOCK // size % shards:
            raise ConfigError(f"model.base_quant=nf4: {name}.weight {tuple(module.weight.shape)} does not split "
                              f"into whole NF4 blocks over {shards} ranks; use fewer ranks or model.base_quant=none")
        module.weight = nn.Parameter(to_nf4(torch.empty_like(module.weight, device="meta"), BLOCK, size),
                                     requires_grad=False)
    if left:
        logging.getLogger("sfttrain").warning(
            f"model.base_quant=nf4: {len(left)} linear weights stay in their dtype, their shapes not splitting into "
            f"{SHARDABLE} row shards of {BLOCK}-weight blocks: {left[:4]}")


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def fill_shard(local: torch.Tensor, full: torch.Tensor, rows: slice) -> None:
    """Quantizes the full weight `full` and stores its `rows` (this rank's shard) in the NF4 `local`."""
    to_nf4 = torchao_nf4()
    quantized = to_nf4(full.to(local.device, local.dtype).contiguous(), BLOCK, local.scaler_block_size)
    shard = quantized.split(rows.stop - rows.start)[rows.start // (rows.stop - rows.start)]
    local.copy_(shard)  # the sharded parts; to_empty left the unsharded mean and lookup table empty
    local.scaler_mean, local.nf4 = shard.scaler_mean, shard.nf4


def round_trip(model: nn.Module, dtype: torch.dtype) -> None:
    """Each weight NF4 would hold replaced by its dequantized value, computed as training did from
    `dtype` (the frozen base's): the base its adapters were trained on, in the model's own dtype."""
    to_nf4 = torchao_nf4()
    with torch.no_grad():
        for _, module in frozen_linears(model):
            w = module.weight
            if (size := scaler_block(w.shape)) is not None:
                w.copy_(to_nf4(w.to(dtype).contiguous(), BLOCK, size).get_original_weight())
