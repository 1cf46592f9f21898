"""FP8 GEMMs for the decoder layers' linear layers (model.fp8), through torchao's float8 training.

What runs in FP8: every `nn.Linear` inside a decoder layer (attention q/k/v/o, the MLP's
gate/up/down) whose two dimensions divide by 16 (the FP8 GEMM's requirement; others stay bf16).
torchao's `Float8Linear` replaces each one: forward and both backward GEMMs take FP8 operands
(e4m3; e5m2 for the output gradient under tensorwise) with scales computed from each tensor's
current amax, and produce bf16. All three accumulate in the tensor cores' fast mode: torchao's
recipes keep the gradient GEMMs in the precise one, which W2b measured slower at no gain in its
loss (docs/benchmarks.md; model.fp8_fast_accum_grads=false restores it). What stays as it was: the
embeddings, norms, attention itself, lm_head (the chunked loss reads its weight directly,
sfttrain.loss) and a mixture of experts' experts (fused 3-D weights run by grouped GEMMs,
sfttrain.experts: not linear layers) and router.

The swap keeps the module tree, the parameter objects and their names: master weights, their
gradients and AdamW state are the tensors a run without FP8 has (fp32 by default), so
checkpoints and exports are the same and resume with FP8 on or off.

Under FSDP2 with tensorwise scaling the weights are all-gathered in FP8 (torchao's
`enable_fsdp_float8_all_gather`: each rank casts its fp32 shard, half of bf16's bytes cross the
wire), and one fused amax over all layers' shards runs after each optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`) instead of one all-reduce per weight in forward.
Rowwise scales the weight along one axis for the forward GEMM and along the other for the
input-gradient GEMM, which one gathered FP8 copy cannot serve (torchao gathers FP8 for tensorwise
only): rowwise gathers in bf16, as does an offloaded model.

The casts and amax reductions around each GEMM are fused into the layer's compiled code with
model.compile=true (the start-up line warns without it: eager, they are kernels of their own).
Converting also applies torchao's workaround for a Triton FP8-store miscompile (inductor's min/max
codegen in its `tl.where` form, numerically the same) for the whole process.

LoRA is refused (sfttrain/config/problems.py): torchao's float8 linear computes every weight's gradient, a frozen
base's too, so the base's GEMMs would do a third more work in FP8 than they skip in bf16.

`auto` turns FP8 on (tensorwise) only for layers wide enough to gain: the casts and amax
reductions are memory-bound work added to every GEMM, and a GEMM of a Qwen2.5-0.5B-sized layer
(hidden 896) is too small for FP8's doubled tensor-core rate to pay for them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sfttrain.config import ConfigError, ModelConfig
from sfttrain.errors import DependencyError
from sfttrain.model import decoder_layers
from sfttrain.moe import routing

# below this hidden size `auto` stays off: torchao's own filter, from its H100 measurements, leaves
# tensorwise GEMMs with K <= 4096 and N <= 1024 in bf16 (slower in FP8), and hidden 4096 is
# Llama-3-8B's, the size torchtitan reports FP8 gains for; W1/W2b figures: docs/benchmarks.md
AUTO_MIN_HIDDEN = 4096
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
INSTALL = "pip install -e '.[fp8]'"


@dataclass(frozen=True)
class Fp8Choice:
    recipe: str | None  # "tensorwise" | "rowwise" | None (off)
    reason: str  # why, for the start-up line


def choose(cfg: ModelConfig, hidden_size: int) -> Fp8Choice:
    """model.fp8 resolved for a model of `hidden_size` (auto decides by it)."""
    if cfg.fp8 == "off":
        return Fp8Choice(None, "model.fp8=off")
    if cfg.fp8 != "auto":
        return Fp8Choice(cfg.fp8, f"model.fp8={cfg.fp8}")
    if hidden_size >= AUTO_MIN_HIDDEN:
        return Fp8Choice("tensorwise", f"model.fp8=auto: hidden_size {hidden_size} >= {AUTO_MIN_HIDDEN}")
    return Fp8Choice(None, f"model.fp8=auto: off, hidden_size {hidden_size} < {AUTO_MIN_HIDDEN} (GEMMs this small "
                           "lose more to FP8's scaling casts than its faster matmuls save)")


def convertible(layers: list[nn.Module]) -> tuple[list[str], list[str]]:
    """(converted, skipped): the qualified names, inside `layers` (the decoder layers, numbered by
    position), of the linear layers FP8 takes and of those it leaves in bf16 (a dimension not a
    multiple of 16). Exact nn.Linear only: a subclass (a LoRA wrapper, an already converted
    layer) is not a plain GEMM."""
    converted, skipped = [], []
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if type(module) is nn.Linear:
                fits = module.in_features % 16 == 0 and module.out_features % 16 == 0
                (converted if fits else skipped).append(f"{i}.{name}")
    return converted, skipped


def check_available(cfg: ModelConfig, device: torch.device) -> None:
    """Refuses model.fp8 where it cannot run, before any data or model is loaded: not CUDA, a GPU
    without FP8 tensor cores, torchao missing. `auto` is checked too (it may turn FP8 on)."""
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
    """torchao.float8, or the DependencyError that says how to install it."""
    # torchao's import logs a warning for each of its compiled extensions that does not load on
    # this machine (its MX and CUTLASS kernels); float8 training uses none of them
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise DependencyError(f"model.fp8 needs torchao's float8 training: {INSTALL} (torchao 0.18), or set "
                              "model.fp8=off") from None
    finally:
        log.setLevel(level)
    return float8


def apply(model: nn.Module, cfg: ModelConfig, fsdp_all_gather: bool) -> None:
    """model.fp8 applied to the (meta) model before it is compiled and sharded: its decoder layers'
    convertible linear layers become Float8Linear; fsdp_all_gather (FSDP2 shards the model, no
    offload): their weights all-gathered in FP8 where the recipe allows (tensorwise)."""
    recipe = choose(cfg, hidden_size(model)).recipe
    if recipe is not None:
        convert(decoder_layers(model), recipe, fsdp_all_gather, cfg.fp8_fast_accum_grads)


def hidden_size(model: nn.Module) -> int:
    return model.config.get_text_config().hidden_size


def convert(layers: list[nn.Module], recipe: str, fsdp_all_gather: bool, fast_accum_grads: bool,
            emulate: bool = False) -> None:
    """Swaps the convertible linear layers of `layers` for torchao's Float8Linear, in place (meta
    parameters too: the weights are materialised afterwards). fsdp_all_gather (tensorwise only):
    FSDP2 all-gathers the weights in FP8. fast_accum_grads: the gradient GEMMs accumulate in the
    tensor cores' fast mode, as the forward's does in torchao's recipes (model.fp8_fast_accum_grads).
    emulate: FP8 arithmetic without FP8 GEMMs (any device; for tests)."""
    float8 = float8_api()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")
    if fast_accum_grads:
        fast = float8.config.Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    converted = set(convertible(layers)[0])
    for i, layer in enumerate(layers):
        float8.convert_to_float8_training(layer, config=config,
                                          module_filter_fn=lambda _module, fqn, i=i: f"{i}.{fqn}" in converted)


def converted_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]


def scale_precompute_hook(model: nn.Module) -> Callable | None:
    """With FP8 all-gather: an optimizer step post-hook computing every FP8 weight's scale from its
    new value in one fused amax and one all-reduce (`torch.optim.Optimizer.register_step_post_hook`);
    None otherwise."""
    if not any(m.config.enable_fsdp_float8_all_gather for m in converted_layers(model)):
        return None
    precompute = float8_api().precompute_float8_dynamic_scale_for_fsdp
    return lambda _optimizer, _args, _kwargs: precompute(model)


def describe(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """The start-up line on FP8 (none with model.fp8=off), read from the model as `apply` left it."""
    if cfg.fp8 == "off":
        return []
    choice, converted = choose(cfg, hidden_size(model)), converted_layers(model)
    if choice.recipe is None or not converted:
        why = choice.reason if choice.recipe is None else "no linear layer has dimensions that are multiples of 16"
        return [f"  fp8                 : off ({why})"]
    ids = {id(m) for m in converted}
    names = sorted({name for layer in decoder_layers(model) for name, m in layer.named_modules() if id(m) in ids})
    config = converted[0].config
    gather = "; weights all-gathered in FP8" if config.enable_fsdp_float8_all_gather else ""
    accum = ("every GEMM" if config.gemm_config_grad_input.use_fast_accum else
             "the forward GEMM only (model.fp8_fast_accum_grads=false)")
    return [f"  fp8                 : {choice.recipe} scaling ({choice.reason}), {len(converted)} linear layers "
            f"({', '.join(names)}){gather}; fast accumulation in {accum}; bf16: {', '.join(_left_in_bf16(model))}"
            + "".join(f"; WARNING: {w}" for w in _warnings(model, cfg))]


def _left_in_bf16(model: nn.Module) -> list[str]:
    skipped = convertible(decoder_layers(model))[1]  # the plain linear layers left: their dimensions do not fit
    return ["lm_head", *(["the experts' grouped GEMMs"] if routing(model.config) else []),
            *([f"{len(skipped)} linear layers with a dimension not a multiple of 16"] if skipped else [])]


def _warnings(model: nn.Module, cfg: ModelConfig) -> list[str]:
    hidden = hidden_size(model)
    return [*([] if cfg.compile else ["model.compile=false runs FP8's scaling casts as kernels of their own"]),
            *([f"hidden_size {hidden} < {AUTO_MIN_HIDDEN}: GEMMs this small usually run slower in FP8 (model.fp8=auto "
               "keeps it off)"] if hidden < AUTO_MIN_HIDDEN else [])]
