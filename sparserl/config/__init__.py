"""The one typed config of a training run: YAML file + `key.sub=value` overrides -> TrainConfig.

Every field carries a help string (`metadata={"help": ...}`); `sparserl train --help` prints them all.
Loading is strict: an unknown key is an error listing the valid keys, a value that does not fit the field's
type is an error naming the key (and the file and line when it came from YAML).
"""

from sparserl.config.loading import (
    coerce,
    config_from_dict,
    flatten,
    format_help,
    iter_fields,
    list_run_presets,
    load_config,
    parse_override,
    resolve_config_path,
    save_config,
)
from sparserl.config.model import DTYPES, ModelConfig
from sparserl.config.sections import (
    CONFIG_DIR,
    DEFAULT_PRESET,
    SCHEDULES,
    AlgoSection,
    ConfigError,
    EngineConfig,
    LoggingConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_PRESET",
    "DTYPES",
    "SCHEDULES",
    "AlgoSection",
    "ConfigError",
    "EngineConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "TrainConfig",
    "TrainerConfig",
    "coerce",
    "config_from_dict",
    "flatten",
    "format_help",
    "iter_fields",
    "list_run_presets",
    "load_config",
    "parse_override",
    "resolve_config_path",
    "save_config",
]
