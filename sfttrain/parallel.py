"""Parallelism applied to the unmodified model: activation checkpointing and FSDP2.

Every decoder layer is one `fully_shard` unit (its all-gather overlaps the previous layer's
compute); the root (`CausalLMLoss`) holds the rest: embeddings, final norm, lm_head.
"""

from __future__ import annotations

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from sfttrain.config import Config, ConfigError, mixed_precision_dtypes
from sfttrain.distributed import World
from sfttrain.loss import CausalLMLoss
from sfttrain.model import DTYPE, decoder_layers


def parallelize(lm: CausalLMLoss, world: World, cfg: Config) -> None:
    fsdp = cfg.model.fsdp_config
    if cfg.model.enable_gradient_checkpointing:
        # non-reentrant: works with FSDP2's hooks and with inputs that need no grad
        lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dtypes = mixed_precision_dtypes(fsdp)
    offload = fsdp.cpu_offload or fsdp.offload_params
    if offload and world.device.type != "cuda":
        raise ConfigError("model.fsdp_config.cpu_offload/offload_params need a CUDA device; set them to false")
    # 1-D mesh: plain FSDP; 2-D (replicate x shard): HSDP, shards within a group, replicas across
    mesh = world.mesh if world.mesh["dp_replicate"].size() > 1 else world.mesh["dp_shard"]
    common = dict(mesh=mesh, reshard_after_forward=fsdp.sharding_strategy != "SHARD_GRAD_OP")
    if dtypes:
        common["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPE[dtypes[0]], reduce_dtype=DTYPE[dtypes[1]])
    if offload:
        common["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(lm.model)
    for layer in layers:
        if cfg.model.compile:
            # dynamic from the start: every step's packed row has another length, and a
            # specialise-then-recompile cycle per new length would be a recompilation storm
            layer.compile(dynamic=True)
        fully_shard(layer, **common)
    # the root's parameters are needed again at once by backward: keep them gathered
    fully_shard(lm, **{**common, "reshard_after_forward": False})
    if fsdp.forward_prefetch:
        for layer, nxt in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    if not offload:
        lm.to(world.device)
