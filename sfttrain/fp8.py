"""model.fp8 through torchao's float8 training: every plain `nn.Linear` of a decoder layer whose dimensions
divide by 16 becomes a `Float8Linear` (same parameters and names: checkpoints resume with FP8 on or off),
its weights all-gathered in FP8 under FSDP2 with tensorwise scaling. LoRA is refused: torchao's float8
linear computes a frozen base's weight gradients too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from sfttrain.config import ConfigError, ModelConfig
from sfttrain.errors import DependencyError
from sfttrain.model import decoder_layers
from sfttrain.moe import routing
from sfttrain.quant import fp8_fits

# below this hidden size `auto` stays off (torchao's own filter leaves smaller GEMMs in bf16)
AUTO_MIN_HIDDEN = 4096
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
INSTALL = "pip install -e '.[fp8]'"


def choose(cfg: ModelConfig, hidden_size: int) -> str:
    if cfg.fp8 != "auto":
        return cfg.fp8
    return "tensorwise" if hidden_size >= AUTO_MIN_HIDDEN else "off"


def check_available(cfg: ModelConfig, device: torch.device) -> None:
    if cfg.fp8 == "off":
        return
    if device.type != "cuda":
        raise ConfigError(f"model.fp8={cfg.fp8} needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: "
                          f"H100/H200, L40S, RTX 4090); this run is on {device.type}: set model.fp8=off")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"model.fp8={cfg.fp8}: {torch.cuda.get_device_name(device)} (compute capability "
                          f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (they start at 8.9: Ada, "
                          "Hopper); set model.fp8=off")
    float8_api()


def float8_api():
    try:
        import torchao.float8 as float8
    except ImportError:
        raise DependencyError(f"model.fp8 needs torchao's float8 training: {INSTALL} (torchao 0.18), or set "
                              "model.fp8=off") from None
    return float8


def apply(model: nn.Module, cfg: ModelConfig, recipe: str, fsdp_all_gather: bool, emulate: bool = False) -> None:
    """The resolved model.fp8 applied to the (meta) model before it is compiled and sharded: its decoder
    layers' convertible linear layers become Float8Linear in place; emulate: without FP8 GEMMs (CPU)."""
    if recipe == "off":
        return
    float8 = float8_api()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")
    if cfg.fp8_fast_accum_grads:
        fast = float8.config.Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    for layer in decoder_layers(model):
        float8.convert_to_float8_training(layer, config=config, module_filter_fn=lambda m, _: fp8_fits(m))


def hidden_size(model: nn.Module) -> int:
    return model.config.get_text_config().hidden_size


def converted_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]


def scale_precompute_hook(model: nn.Module) -> Callable | None:
    """With FP8 all-gather, the optimizer step's post-hook computing every weight's scale in one all-reduce."""
    if not any(m.config.enable_fsdp_float8_all_gather for m in converted_layers(model)):
        return None
    precompute = float8_api().precompute_float8_dynamic_scale_for_fsdp
    return lambda _optimizer, _args, _kwargs: precompute(model)


def describe(model: nn.Module, cfg: ModelConfig, recipe: str) -> list[str]:
    if cfg.fp8 == "off":
        return []
    hidden, converted = hidden_size(model), converted_layers(model)
    reason = f"model.fp8={cfg.fp8}"
    if cfg.fp8 == "auto":
        reason += f": hidden_size {hidden} {'<' if recipe == 'off' else '>='} {AUTO_MIN_HIDDEN}"
    if recipe == "off" or not converted:
        why = (f"{reason}: GEMMs this small lose more to FP8's scaling casts than its faster matmuls save"
               if recipe == "off" else "no linear layer has dimensions that are multiples of 16")
        return [f"  fp8                 : off ({why})"]
    names = sorted({name for layer in decoder_layers(model) for name, m in layer.named_modules() if m in converted})
    config = converted[0].config
    gather = "; weights all-gathered in FP8" if config.enable_fsdp_float8_all_gather else ""
    accum = ("every GEMM" if config.gemm_config_grad_input.use_fast_accum else
             "the forward GEMM only (model.fp8_fast_accum_grads=false)")
    skipped = [m for layer in decoder_layers(model) for m in layer.modules() if type(m) is nn.Linear]  # not fitting
    bf16 = ["lm_head", *(["the experts' grouped GEMMs"] if routing(model.config) else []),
            *([f"{len(skipped)} linear layers with a dimension not a multiple of 16"] if skipped else [])]
    warnings = [*([] if cfg.compile else ["model.compile=false runs FP8's scaling casts as kernels of their own"]),
                *([f"hidden_size {hidden} < {AUTO_MIN_HIDDEN}: GEMMs this small usually run slower in FP8 "
                   "(model.fp8=auto keeps it off)"] if hidden < AUTO_MIN_HIDDEN else [])]
    return [f"  fp8                 : {recipe} scaling ({reason}), {len(converted)} linear layers "
            f"({', '.join(names)}){gather}; fast accumulation in {accum}; bf16: {', '.join(bf16)}"
            + "".join(f"; WARNING: {w}" for w in warnings)]
