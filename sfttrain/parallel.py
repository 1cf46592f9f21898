"""Parallelism applied to the meta-device model, then its weights materialised. Three layouts, whose
checkpoints resume in any other: sharded (each decoder layer a `fully_shard` unit, the root
`CausalLMLoss` the rest), single (one rank, no CPU offload: unwrapped, under autocast), replicated
(shard groups of one rank: DDP)."""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from sfttrain import fp8, fuse_projections, quant, recompute
from sfttrain.config import Config, ConfigError, mixed_precision_dtypes
from sfttrain.distributed import World
from sfttrain.loss import CausalLMLoss
from sfttrain.model import DTYPE, decoder_layers, materialise_model
from sfttrain.resolved import Resolved, why_python_wrapper



Layout = Literal["single", "replicated", "sharded"]


def parallelize(lm: CausalLMLoss, world: World, cfg: Config, resolved: Resolved) -> Layout:
    # what the layout needs of the device (check_device) was checked at start-up (sfttrain.checks)
    offload = cfg.model.fsdp_config.offloaded()
    layout = choose_layout(world.world_size, world.mesh["dp_shard"].size(), world.sp_size, offload)
    # before FSDP wraps the weights it all-gathers; offloaded shards are gathered as they are
    fp8.apply(lm.model, cfg.model, resolved.fp8, fsdp_all_gather=layout == "sharded" and not offload)
    if cfg.model.enable_gradient_checkpointing:
        recompute.apply(lm.model, decoder_layers(lm.model), cfg.model, not resolved.recompute_attention)
    if world.sp_size > 1:  # what Ulysses needs of the model was checked at start-up (attention.check_ulysses)
        lm.call_kwargs["sfttrain_sp_group"] = world.mesh["sp"].get_group()
    if cfg.model.compile:  # before FSDP's hooks and the weights: the layers are compiled at their first forward
        compile_layers(decoder_layers(lm.model), resolved.compile_cpp_wrapper, fuse_projections.graph_pass(
            cfg.model, lm.model.config, resolved.fuse_projections, resolved.fold_lora))
    if layout == "sharded":
        shard(lm, world, cfg, offload)
        return layout
    single_device(lm, world, cfg)
    if layout == "replicated":
        replicate_model(lm, world, cfg)
    return layout


def choose_layout(world_size: int, dp_shard: int, sp_size: int, offload: bool) -> Layout:
    if offload or (world_size > 1 and (dp_shard > 1 or sp_size > 1)):
        return "sharded"
    return "single" if world_size == 1 else "replicated"


def check_device(cfg: Config, layout: Layout, device_type: str) -> None:
    if cfg.model.fsdp_config.offloaded() and device_type != "cuda":
        raise ConfigError("model.fsdp_config.cpu_offload/offload_params need a CUDA device; set them to false")
    if layout == "replicated" and cfg.model.base_quant != "none":
        why = ("corrupts the NF4 tensors' scales" if cfg.model.base_quant == "nf4" else
               "sends the float8 weights, which every rank quantized itself, a second time")
        raise ConfigError(f"model.base_quant={cfg.model.base_quant} with DDP (NO_SHARD or fsdp_size=1): DDP's first "
                          f"forward broadcasts every weight, which {why}; use "
                          "model.fsdp_config.sharding_strategy=FULL_SHARD (FSDP2 holds the quantized base)")
    if cfg.model.base_quant == "fp8" and cfg.model.fsdp_config.offloaded():
        raise ConfigError("model.base_quant=fp8 with CPU offload: FSDP2 leaves the float8 weights out (whole on each "
                          "GPU) and would not bring them from the host; set cpu_offload/offload_params=false")
    if layout == "replicated" and _bf16_reduce(cfg) and device_type != "cuda":
        raise ConfigError("model.fsdp_config.mixed_precision.reduce_dtype=bf16 with DDP (NO_SHARD or fsdp_size=1) "
                          "compresses gradients through NCCL, on GPUs only; set reduce_dtype=fp32")


def describe_sharding(world: World, cfg: Config, layout: Layout) -> str:
    fsdp = cfg.model.fsdp_config
    moot = ("; model.fsdp_config.forward_prefetch=true ignored: nothing is gathered (it applies to sharded models)"
            if fsdp.forward_prefetch and layout != "sharded" else "")
    if layout == "single":
        return f"one device, not sharded{moot}"
    if layout == "replicated":
        dtypes = mixed_precision_dtypes(fsdp)
        return (f"DDP: the whole model on each of {world.dp_size} ranks (model.fsdp_config.sharding_strategy="
                f"{fsdp.sharding_strategy}, fsdp_size={fsdp.fsdp_size}), gradients all-reduced in "
                f"{dtypes[1] if dtypes else fsdp.model_dtype} buckets during backward{moot}")
    replicas, dp_shards = world.mesh["dp_replicate"].size(), world.mesh["dp_shard"].size()
    shards = dp_shards * world.sp_size  # FSDP shards over the sequence-parallel ranks too
    kind = "ZeRO-2 style: kept gathered from forward to backward" if fsdp.sharding_strategy == "SHARD_GRAD_OP" else \
        "resharded after forward"
    offload = ", parameters/gradients/optimizer offloaded to CPU" if fsdp.offloaded() else ""
    if replicas > 1:
        return (f"HSDP: {replicas} replicas x {shards} shards (model.fsdp_config.fsdp_size={dp_shards} < "
                f"{world.dp_size} data-parallel ranks; gradients reduce-scattered in a shard group, all-reduced across "
                f"replicas), {kind}{offload}")
    return f"FSDP2 over {shards} ranks, {kind}{offload}"


def single_device(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    materialise_model(lm.model, cfg.model, world.device, world.device, cfg.trainer.seed)
    dtypes = mixed_precision_dtypes(cfg.model.fsdp_config)
    if dtypes:
        dtype = lm.autocast_dtype = DTYPE[dtypes[0]]  # gradients stay in the fp32 parameters' dtype
        # the residual stream in the compute dtype, as FSDP's param_dtype makes it (autocast alone
        # would leave it, and what backward saves of it, in fp32)
        lm.model.get_input_embeddings().register_forward_hook(lambda _module, _args, out: out.to(dtype))


def replicate_model(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    """DDP over the data-parallel ranks: gradients averaged in 100 MB buckets as backward makes them,
    bf16-compressed where reduce_dtype is bf16."""
    # the compiled layers are autograd nodes of their own: the all-reduces already start per layer
    torch._dynamo.config.optimize_ddp = False
    replicate(lm, process_group=world.mesh["dp_replicate"].get_group(), bucket_cap_mb=100,
              gradient_as_bucket_view=True)
    if _bf16_reduce(cfg):
        assert isinstance(lm, DDP)  # replicate gave lm a DDP subclass of its class
        lm.register_comm_hook(None, bf16_compress_hook)


def _bf16_reduce(cfg: Config) -> bool:
    dtypes = mixed_precision_dtypes(cfg.model.fsdp_config)
    return dtypes is not None and dtypes[1] == "bf16"


def compile_layers(layers: list[torch.nn.Module], cpp_wrapper: bool,
                   fuse: fuse_projections.FuseSharedInputProjections | None = None) -> None:
    """torch.compile each decoder layer (one forward, compiled once; FSDP's hooks stay between them),
    dynamic shapes: every packed row has another length. fuse: model.fuse_projections' pre-grad pass."""
    # inductor's mixed-order reduction guards on the first compile's token count: in strict mode a
    # later micro-batch on the other side of it recompiles every layer
    options = {"triton.mix_order_reduction_non_strict_mode": True, **({"cpp_wrapper": True} if cpp_wrapper else {}),
               **({"pre_grad_custom_pass": fuse} if fuse is not None else {})}
    allow_side_effects_in_checkpoints()
    for layer in layers:
        layer.compile(dynamic=True, options=options)


def allow_side_effects_in_checkpoints() -> None:
    """A side effect inside a checkpoint (transformers >= 5.25 sets a context variable around
    attention) would break the layer's graph; the recomputation need not replay it (torchtitan's too)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def describe_compile(cfg: Config, world: World, model_config, resolved: Resolved) -> str:
    if not cfg.model.compile:
        return "off (eager)"
    wrapper = "C++" if resolved.compile_cpp_wrapper else "Python"
    why = ""
    if wrapper == "Python" and world.device.type == "cuda" and cfg.model.compile_cpp_wrapper == "auto":
        why = f" ({why_python_wrapper(cfg, model_config)})"
    if world.device.type != "cuda" and cfg.model.compile_cpp_wrapper is True:  # `cpp_wrapper`: GPUs only
        why = (f" (model.compile_cpp_wrapper=true ignored on {world.device.type}: the C++ wrapper launches GPU "
               "kernels; on CPU the kernels are the host's own work)")
    fuse = fuse_projections.graph_pass(cfg.model, model_config, resolved.fuse_projections, resolved.fold_lora)
    fused = ("" if fuse is None
             else f"; projections sharing an input run as one GEMM{fuse.describe()} (model.fuse_projections)")
    return f"each decoder layer, dynamic shapes, kernels launched by inductor's {wrapper} wrapper{why}{fused}"


def shard(lm: CausalLMLoss, world: World, cfg: Config, offload: bool) -> None:
    fsdp = cfg.model.fsdp_config
    dtypes = mixed_precision_dtypes(fsdp)
    mesh = world.fsdp_mesh()  # 1-D mesh: FSDP; 2-D (replicate x shard): HSDP
    reshard = fsdp.sharding_strategy != "SHARD_GRAD_OP"
    mp_policy = (MixedPrecisionPolicy(param_dtype=DTYPE[dtypes[0]], reduce_dtype=DTYPE[dtypes[1]]) if dtypes
                 else MixedPrecisionPolicy())
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    layers, fp8_base = decoder_layers(lm.model), {p for p in lm.parameters() if p.dtype == quant.FP8} or None
    # backward needs the last layer's and the root's parameters again at once: kept gathered
    sharded = [fully_shard(layer, mesh=mesh, reshard_after_forward=reshard and i < len(layers) - 1,
                           mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=fp8_base)
               for i, layer in enumerate(layers)]
    fully_shard(lm, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy,
                ignored_params=fp8_base)
    if fsdp.forward_prefetch:
        for layer, nxt in zip(sharded, sharded[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    # offloaded parameters live on the host (FSDP copies them to the device per layer)
    materialise_model(lm.model, cfg.model, torch.device("cpu") if offload else world.device, world.device,
                      cfg.trainer.seed)


def gradient_sync(lm: CausalLMLoss, last_micro_batch: bool) -> None:
    """Gradients all-reduced across replicas (HSDP, DDP) in the step's last micro-batch only."""
    if isinstance(lm, FSDPModule):
        lm.set_requires_all_reduce(last_micro_batch)
    elif isinstance(lm, DDP):
        lm.set_requires_gradient_sync(last_micro_batch)
