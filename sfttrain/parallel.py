"""Parallelism applied to the unmodified model: activation checkpointing, compilation and FSDP2.

Several ranks (or CPU offload): every decoder layer is one `fully_shard` unit (its all-gather
overlaps the previous layer's compute); the root (`CausalLMLoss`) holds the rest: embeddings,
final norm, lm_head. One rank: FSDP would shard nothing and reduce nothing, yet still run its
per-layer copy/cast hooks in Python twice per step, so the model runs unwrapped with mixed
precision by autocast (as torchtitan does on one device); checkpoints are the same DCP format.
"""

from __future__ import annotations

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from sfttrain import sequence_parallel
from sfttrain.config import Config, ConfigError, mixed_precision_dtypes
from sfttrain.distributed import World
from sfttrain.loss import CausalLMLoss
from sfttrain.model import DTYPE, decoder_layers


def parallelize(lm: CausalLMLoss, world: World, cfg: Config) -> bool:
    """Returns whether the model is FSDP-sharded."""
    fsdp = cfg.model.fsdp_config
    if cfg.model.enable_gradient_checkpointing:
        # non-reentrant: works with FSDP2's hooks and with inputs that need no grad
        lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload = fsdp.cpu_offload or fsdp.offload_params
    if offload and world.device.type != "cuda":
        raise ConfigError("model.fsdp_config.cpu_offload/offload_params need a CUDA device; set them to false")
    apply_sequence_parallel(lm, world)
    if world.world_size == 1 and not offload:
        single_device(lm, world, cfg)
        return False
    shard(lm, world, cfg, offload)
    return True


def apply_sequence_parallel(lm: CausalLMLoss, world: World) -> None:
    """Ulysses' all-to-all around attention, over the mesh's sp dimension (sfttrain.sequence_parallel)."""
    if world.sp_size > 1:
        sequence_parallel.apply(lm, world.mesh["sp"].get_group(), world.sp_size)


def single_device(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    dtypes = mixed_precision_dtypes(cfg.model.fsdp_config)
    if dtypes:
        dtype = lm.autocast_dtype = DTYPE[dtypes[0]]  # gradients stay in the fp32 parameters' dtype
        # the residual stream in the compute dtype, as FSDP's param_dtype makes it: under autocast
        # alone the embedding output, and so every residual add and norm input, would stay fp32
        # (and be saved for backward in fp32)
        lm.model.get_input_embeddings().register_forward_hook(lambda _module, _args, out: out.to(dtype))
    if cfg.model.compile:
        # the whole decoder at once, not layer by layer (dynamic: every step's packed row has
        # another length, and a specialise-then-recompile cycle per length would be a storm)
        lm.model.get_decoder().compile(dynamic=True)
    lm.to(world.device)


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
    for layer in layers:
        if cfg.model.compile:
            layer.compile(dynamic=True)  # per layer: FSDP's hooks run between the layers
        fully_shard(layer, **common)
    # the root's parameters are needed again at once by backward: keep them gathered
    fully_shard(lm, **{**common, "reshard_after_forward": False})
    if fsdp.forward_prefetch:
        for layer, nxt in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    if not offload:
        lm.to(world.device)
