"""Typed configuration: dataclasses hold every default; Hydra YAML under `conf/` states the variants."""
from .loader import (as_node, compose_config, config_from_yaml, list_recipes, load_config, save_config, to_object,
                     to_yaml, with_overrides)
from .typed import ConfigError
from .schema import (CacheConfig, DataConfig, DeepSpecConfig, DraftConfig, EvalConfig, LossConfig,
                     ScheduleConfig, TargetConfig, TrainConfig)

__all__ = [
    "ConfigError", "as_node", "compose_config", "config_from_yaml", "list_recipes", "load_config",
    "save_config", "to_object", "to_yaml", "with_overrides", "DeepSpecConfig", "TargetConfig", "DraftConfig",
    "LossConfig", "DataConfig", "CacheConfig", "TrainConfig", "EvalConfig", "ScheduleConfig",
]
