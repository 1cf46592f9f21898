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
