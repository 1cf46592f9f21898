"""The one configuration: schema, the names users bring (compat), loading, problems and notes."""

from sfttrain.config.compat import ALIASES, CHECKPOINT_KEYS, IGNORED_VERL_KEYS, NULL_ONLY_VERL_KEYS
from sfttrain.config.load import _flat_keys, load_config, to_yaml
from sfttrain.config.problems import (check_sequence_parallel_size, config_problems, mixed_precision_dtypes,
                                      moot_settings, rendering_problems)
from sfttrain.config.schema import (Config, DataConfig, FSDPConfig, ModelConfig, MultiturnConfig, OptimConfig,
                                    TrainerConfig, as_list, logger_names, shard_group_size)
from sfttrain.errors import ConfigError

__all__ = ["ALIASES", "CHECKPOINT_KEYS", "IGNORED_VERL_KEYS", "NULL_ONLY_VERL_KEYS", "_flat_keys", "load_config",
           "to_yaml", "moot_settings", "check_sequence_parallel_size", "config_problems", "mixed_precision_dtypes",
           "rendering_problems", "Config", "DataConfig", "FSDPConfig", "ModelConfig", "MultiturnConfig",
           "OptimConfig", "TrainerConfig", "as_list", "logger_names", "shard_group_size", "ConfigError"]
