"""verl keys: each accepted key has its effect or is refused with what to set instead."""

import pytest

from sfttrain.config import ConfigError, load_config

COMMON = ["data.train_files=x.parquet", "model.partial_pretrain=m"]


@pytest.mark.parametrize("override, message", [
    ("data.balance_dp_token=false", "data.balance_dp_token=false: sfttrain always spreads"),
    ("model.strategy=fsdp", "model.strategy='fsdp': sfttrain implements FSDP2"),
    ("model.fsdp_config.mixed_precision.buffer_dtype=bf16", "buffer_dtype='bf16'.*set it to fp32"),
    ("model.fsdp_config.model_dtype=fp16", "fp16 .*needs loss scaling.*use bf16"),
    ("model.fsdp_config.mixed_precision.param_dtype=fp16", "fp16 .*needs loss scaling"),
])
def test_silently_ignored_verl_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, override])


@pytest.mark.parametrize("override", ["data.balance_dp_token=true", "model.strategy=fsdp2",
                                      "model.fsdp_config.mixed_precision.buffer_dtype=fp32"])
def test_values_that_have_their_effect_are_accepted(override):
    load_config(overrides=[*COMMON, override])


@pytest.mark.parametrize("overrides, message", [
    (["model.fsdp_config.fsdp_size=2"], "NO_SHARD .* contradicts fsdp_size=2; .*HYBRID_SHARD"),
    (["model.fsdp_config.cpu_offload=true"], "NO_SHARD .*CPU offload moves FSDP's shards.*FULL_SHARD"),
    (["ulysses_sequence_parallel_size=2"], "NO_SHARD .*Ulysses ranks share one copy.*FULL_SHARD"),
])
def test_no_shard_refuses_what_needs_shards(overrides, message):
    """NO_SHARD is DDP: a shard size, offloaded shards or Ulysses' FSDP group cannot hold."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, "model.fsdp_config.sharding_strategy=NO_SHARD", *overrides])
