"""Parallelism applied to the unmodified model: activation checkpointing (sfttrain.recompute),
compilation and FSDP2, then the weights materialised into it (the model arrives with its
parameters on the meta device).

Three layouts (`Layout`):
- sharded (several ranks, or CPU offload): every decoder layer is one `fully_shard` unit (its
  all-gather overlaps the previous layer's compute); the root (`CausalLMLoss`) holds the rest:
  embeddings, final norm, lm_head.
- single (one rank): FSDP would shard nothing and reduce nothing, yet still run its per-layer
  copy/cast hooks in Python twice per step, so the model runs unwrapped with mixed precision by
  autocast (as torchtitan does on one device).
- replicated (shard groups of one rank: fsdp_size=1 or NO_SHARD): each rank runs the one-device
  model, and DDP all-reduces the gradients in buckets while backward still runs (as torchtitan
  does without a shard dimension). FSDP's replicas of a one-rank shard would run the same
  per-layer hooks as on one rank, and gather nothing.
Checkpoints are the same DCP format in all three, and resume in any other.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.torch_version import TorchVersion

from sfttrain import fp8, fuse_projections, recompute, sequence_parallel
from sfttrain.config import Config, ConfigError, mixed_precision_dtypes
from sfttrain.distributed import World
from sfttrain.loss import CausalLMLoss
from sfttrain.model import DTYPE, decoder_layers, materialise_model
from sfttrain.moe import routing


Layout = Literal["single", "replicated", "sharded"]


def parallelize(lm: CausalLMLoss, world: World, cfg: Config) -> Layout:
    offload = cfg.model.fsdp_config.offloaded()
    layout = choose_layout(world.world_size, world.mesh["dp_shard"].size(), world.sp_size, offload)
    check_device(cfg, layout, world.device.type)
    # before FSDP wraps the weights it all-gathers; offloaded shards are gathered as they are
    fp8.apply(lm.model, cfg.model, fsdp_all_gather=layout == "sharded" and not offload)
    if cfg.model.enable_gradient_checkpointing:
        recompute.apply(lm.model, decoder_layers(lm.model), cfg.model, cfg.data.max_length)
    apply_sequence_parallel(lm, world)
    if layout == "sharded":
        shard(lm, world, cfg, offload)
        return layout
    single_device(lm, world, cfg)
    if layout == "replicated":
        replicate_model(lm, world, cfg)
    return layout


def choose_layout(world_size: int, dp_shard: int, sp_size: int, offload: bool) -> Layout:
    """The layout of world_size ranks in shard groups of dp_shard (the mesh's dimension; the preflight,
    sfttrain.plan, has it from distributed.check_world without any process group)."""
    if world_size == 1 and not offload:
        return "single"
    if dp_shard == 1 and sp_size == 1 and not offload:
        return "replicated"
    return "sharded"


def check_device(cfg: Config, layout: Layout, device_type: str) -> None:
    """What the layout needs of the device, refused before the model is built (and by the preflight,
    sfttrain.plan): offloading is FSDP's CPUOffloadPolicy, which moves shards between the host and a
    GPU; DDP's bf16 reduce is a compression hook that runs through NCCL (`replicate_model`)."""
    fsdp = cfg.model.fsdp_config
    if fsdp.offloaded() and device_type != "cuda":
        raise ConfigError("model.fsdp_config.cpu_offload/offload_params need a CUDA device; set them to false")
    dtypes = mixed_precision_dtypes(fsdp)
    if layout == "replicated" and dtypes is not None and dtypes[1] == "bf16" and device_type != "cuda":
        raise ConfigError("model.fsdp_config.mixed_precision.reduce_dtype=bf16 with DDP (NO_SHARD or fsdp_size=1) "
                          "compresses gradients through NCCL, on GPUs only; set reduce_dtype=fp32")


def describe_sharding(world: World, cfg: Config, layout: Layout) -> str:
    """One start-up line on how the weights are laid out; HSDP in particular, which a verl user gets
    from fsdp_size below the world size even with sharding_strategy=FULL_SHARD."""
    fsdp = cfg.model.fsdp_config
    # verl's forward_prefetch prefetches FSDP's next all-gather: a model not sharded gathers nothing
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


def apply_sequence_parallel(lm: CausalLMLoss, world: World) -> None:
    """Ulysses' all-to-all around attention, over the mesh's sp dimension (sfttrain.sequence_parallel)."""
    if world.sp_size > 1:
        sequence_parallel.apply(lm, world.mesh["sp"].get_group(), world.sp_size)


def single_device(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    materialise_model(lm.model, cfg.model, world.device, world.device, cfg.trainer.seed)
    dtypes = mixed_precision_dtypes(cfg.model.fsdp_config)
    if dtypes:
        dtype = lm.autocast_dtype = DTYPE[dtypes[0]]  # gradients stay in the fp32 parameters' dtype
        # the residual stream in the compute dtype, as FSDP's param_dtype makes it: under autocast
        # alone the embedding output, and so every residual add and norm input, would stay fp32
        # (and be saved for backward in fp32)
        lm.model.get_input_embeddings().register_forward_hook(lambda _module, _args, out: out.to(dtype))
    if cfg.model.compile:
        compile_layers(decoder_layers(lm.model), cpp_wrapper(cfg, world.device.type, lm.model.config),
                       fuse_projections.graph_pass(cfg.model, lm.model.config))


def replicate_model(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    """DDP over the data-parallel ranks, on the one-device model (`single_device`). Gradients are
    all-reduced (averaged, as FSDP's reduce-scatter averages) in 100 MB buckets as backward
    produces them; the buckets are the gradients' own storage (no second copy). A bf16 reduce
    dtype halves the traffic through DDP's bf16 compression hook (NCCL only)."""
    dtypes = mixed_precision_dtypes(cfg.model.fsdp_config)
    bf16_reduce = dtypes is not None and dtypes[1] == "bf16"  # on GPUs only (`check_device`)
    # each compiled layer is an autograd node of its own, so the buckets' all-reduces already start
    # layer by layer during backward; dynamo's DDP optimizer would only split the layers' graphs
    torch._dynamo.config.optimize_ddp = False
    replicate(lm, process_group=world.mesh["dp_replicate"].get_group(), bucket_cap_mb=100,
              gradient_as_bucket_view=True)
    if bf16_reduce:
        lm.register_comm_hook(None, bf16_compress_hook)


def compile_layers(layers: list[torch.nn.Module], cpp_wrapper: bool,
                   fuse: fuse_projections.FuseSharedInputProjections | None = None) -> None:
    """torch.compile each decoder layer. The layers share one forward, so dynamo traces and inductor
    compiles it once and every other layer reuses that code: start-up is a fraction of compiling the
    whole decoder as one graph, at the same step time (the only fusions lost are at the layer
    boundaries; figures in docs/benchmarks.md). Dynamic shapes: every step's
    packed row has another length, and a specialise-then-recompile cycle per length would be a
    storm. Under FSDP the per-layer graphs also leave FSDP's hooks between the layers.
    cpp_wrapper: the compiled code launches its kernels from C++ (model.compile_cpp_wrapper).
    fuse: the graph pass that runs projections of one input as one GEMM (model.fuse_projections)."""
    # inductor fuses a norm's row and column reductions (its backward) only above a size it checks
    # against the first compile's token count, and guards on that check: a later micro-batch on the
    # other side of it (under 10240 tokens after one above, for a 512-wide k_norm) recompiles every
    # layer mid-run. The non-strict mode skips those size checks, so one compilation serves all lengths
    options = {"triton.mix_order_reduction_non_strict_mode": True, **({"cpp_wrapper": True} if cpp_wrapper else {}),
               **({"pre_grad_custom_pass": fuse} if fuse is not None else {})}
    allow_side_effects_in_checkpoints()
    for layer in layers:
        layer.compile(dynamic=True, options=options)


def allow_side_effects_in_checkpoints() -> None:
    """A checkpoint inside a layer (sfttrain.recompute) may not hold a side effect, or dynamo breaks the
    graph there and runs the layer eagerly, recomputing parts of it several times (stories260K with LoRA
    on the CPU: 586 GEMMs a step instead of 371). transformers 5.25 (not 5.17) routes kernel functions
    through a context variable set and reset around each attention module's forward (the `kernels`
    package's new_forward): nothing the recomputation needs to replay. torchtitan sets the same."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


# the longest micro-batch `auto` gives the C++ wrapper: the longest it was measured to run at (W2b with
# LoRA, 65,536 tokens); at 131,072 it crashed inside a compiled backward (docs/benchmarks.md)
CPP_WRAPPER_MAX_TOKENS = 65536


def cpp_wrapper(cfg: Config, device_type: str, model_config) -> bool:
    """Whether inductor's C++ wrapper launches the compiled layers' kernels (model.compile_cpp_wrapper).
    GPUs only: there the host just launches kernels and can fall behind them (W1, full fine-tuning
    or LoRA, is host-bound); on CPU the kernels are the host's own work, and the wrapper's C++ build
    would only cost start-up. auto: not for micro-batches over CPP_WRAPPER_MAX_TOKENS, whose steps
    take seconds, nor for a mixture of experts before torch 2.12, whose C++ wrapper cannot call the
    experts' grouped GEMM, nor with FP8 GEMMs (model.fp8), measured on the Python wrapper only
    (docs/benchmarks.md), nor for checkpointed layers that rerun attention
    (recompute.reruns_attention_compiled: the C++ wrapper cannot build them, and W2b with LoRA ran
    slower with the checkpoint around C++-wrapped layers). An explicit true that cannot be built is refused (the preflight checks it too)."""
    if device_type != "cuda":
        return False
    setting, blocked = cfg.model.compile_cpp_wrapper, _grouped_gemm_without_cpp_call(model_config)
    reruns_attention = _reruns_attention(cfg, model_config)
    if setting == "auto":
        return (cfg.micro_batch_tokens() <= CPP_WRAPPER_MAX_TOKENS and not blocked and cfg.model.fp8 == "off"
                and not reruns_attention)
    if setting and blocked:
        raise ConfigError(f"model.compile_cpp_wrapper=true: inductor's C++ wrapper in torch {torch.__version__} has no "
                          "call for the grouped GEMM this mixture of experts runs (torch >= 2.12 has one); set "
                          "model.compile_cpp_wrapper=auto (the Python wrapper here)")
    if setting and reruns_attention:
        raise ConfigError("model.compile_cpp_wrapper=true: the checkpointed layers rerun attention under compilation, "
                          "whose RNG-state call inductor's C++ wrapper cannot emit (sfttrain/recompute.py); set "
                          "model.compile_cpp_wrapper=auto (the Python wrapper) or model.recompute_attention=false "
                          "(attention outputs kept: more memory)")
    return setting


def _reruns_attention(cfg: Config, model_config) -> bool:
    # LoRA on a MoE may adapt the experts, which then run outside the compiled graph (sfttrain.lora)
    eager_parts = cfg.model.lora_rank > 0 and routing(model_config) is not None
    return recompute.reruns_attention_compiled(cfg.model, cfg.data.max_length, eager_parts)


def _grouped_gemm_without_cpp_call(model_config) -> bool:
    """A MoE (transformers 5 runs its experts through sfttrain.experts' torch._grouped_mm) under a
    torch whose C++ wrapper has no C shim for that op (added in 2.12: torchgen/aoti/fallback_ops.py):
    the wrapper's build fails there."""
    return routing(model_config) is not None and TorchVersion(torch.__version__) < "2.12"


def describe_compile(cfg: Config, world: World, model_config) -> str:
    """The start-up line on compilation."""
    if not cfg.model.compile:
        return "off (eager)"
    wrapper = "C++" if cpp_wrapper(cfg, world.device.type, model_config) else "Python"
    why = ""
    if wrapper == "Python" and world.device.type == "cuda" and cfg.model.compile_cpp_wrapper == "auto":
        why = f" ({why_python_wrapper(cfg, model_config)})"
    if world.device.type != "cuda" and cfg.model.compile_cpp_wrapper is True:  # `cpp_wrapper`: GPUs only
        why = (f" (model.compile_cpp_wrapper=true ignored on {world.device.type}: the C++ wrapper launches GPU "
               "kernels; on CPU the kernels are the host's own work)")
    fuse = fuse_projections.graph_pass(cfg.model, model_config)
    fused = "" if fuse is None else f"; projections sharing an input run as one GEMM{fuse.describe()} (model.fuse_projections)"
    return f"each decoder layer, dynamic shapes, kernels launched by inductor's {wrapper} wrapper{why}{fused}"


def why_python_wrapper(cfg: Config, model_config) -> str:
    """Why model.compile_cpp_wrapper=auto left a CUDA run on the Python wrapper (`cpp_wrapper`)."""
    if _grouped_gemm_without_cpp_call(model_config):
        return "the C++ one cannot call this torch's grouped GEMM of the experts"
    if cfg.model.fp8 != "off":
        return "FP8 runs were measured on it"
    if _reruns_attention(cfg, model_config):
        return "the checkpointed layers rerun attention compiled, which the C++ one cannot build"
    return f"micro-batches over {CPP_WRAPPER_MAX_TOKENS} tokens: model.compile_cpp_wrapper=auto"


def shard(lm: CausalLMLoss, world: World, cfg: Config, offload: bool) -> None:
    fsdp = cfg.model.fsdp_config
    dtypes = mixed_precision_dtypes(fsdp)
    # 1-D mesh: plain FSDP; 2-D (replicate x shard): HSDP, shards within a group, replicas across
    common = dict(mesh=world.fsdp_mesh(), reshard_after_forward=fsdp.sharding_strategy != "SHARD_GRAD_OP")
    if dtypes:
        common["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPE[dtypes[0]], reduce_dtype=DTYPE[dtypes[1]])
    if offload:
        common["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(lm.model)
    if cfg.model.compile:
        compile_layers(layers, cpp_wrapper(cfg, world.device.type, lm.model.config),
                       fuse_projections.graph_pass(cfg.model, lm.model.config))
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by backward (as torchtitan does)
        last = i == len(layers) - 1
        fully_shard(layer, **{**common, "reshard_after_forward": common["reshard_after_forward"] and not last})
    # the root's parameters are needed again at once by backward: keep them gathered
    fully_shard(lm, **{**common, "reshard_after_forward": False})
    if fsdp.forward_prefetch:
        for layer, nxt in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    # offloaded parameters live on the host (FSDP copies them to the device per layer)
    materialise_model(lm.model, cfg.model, torch.device("cpu") if offload else world.device, world.device,
                      cfg.trainer.seed)


def gradient_sync(lm: CausalLMLoss, last_micro_batch: bool) -> None:
    """HSDP: gradients are reduce-scattered within the shard group after every micro-batch, but
    all-reduced across the replicas only after the step's last one (FSDP2 accumulates the
    reduce-scattered partial sums meanwhile): one all-reduce per step instead of one per
    micro-batch, the same sum. DDP: gradients accumulate locally and are all-reduced in the last
    micro-batch's backward. No-op on one device."""
    if isinstance(lm, FSDPModule):
        lm.set_requires_all_reduce(last_micro_batch)
    elif isinstance(lm, DDP):
        lm.set_requires_gradient_sync(last_micro_batch)
