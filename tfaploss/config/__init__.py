"""Run configurations: the YAML recipes of ``configs/``, loaded safely and validated.

See :mod:`tfaploss.config.schema` for the keys. This package only describes a run and
imports neither Keras nor TensorFlow; :mod:`tfaploss.run` carries it out
(:mod:`tfaploss.run.build` turns a config into a model, a loss and an optimizer).
"""

from tfaploss.config.health import HealthThresholds
from tfaploss.config.schema import (
    AugmentationConfig,
    Config,
    ConfigError,
    ConfigWarning,
    DataConfig,
    DistributeConfig,
    EvaluationConfig,
    HealthConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainingConfig,
    XBMConfig,
    apply_overrides,
    config_from_dict,
    config_notes,
    load_config,
    loss_class,
    loss_classes,
    loss_defaults,
    loss_parameters,
    parse_override,
    read_config_file,
)

__all__ = [
    "AugmentationConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "DistributeConfig",
    "EvaluationConfig",
    "HealthConfig",
    "HealthThresholds",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "XBMConfig",
    "apply_overrides",
    "config_from_dict",
    "config_notes",
    "load_config",
    "loss_class",
    "loss_classes",
    "loss_defaults",
    "loss_parameters",
    "parse_override",
    "read_config_file",
]
