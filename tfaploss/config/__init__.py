"""Run configurations: YAML files and the shipped recipes (``recipe:NAME``), loaded
safely and validated; the keys: :mod:`tfaploss.config.schema`. Imports neither Keras nor
TensorFlow; :mod:`tfaploss.run` carries a config out.
"""

from tfaploss.config.consistency import ConfigWarning
from tfaploss.config.fields import ConfigError
from tfaploss.config.health import HealthConfig, HealthThresholds
from tfaploss.config.load import (
    apply_overrides,
    config_from_dict,
    config_notes,
    load_config,
    parse_override,
    read_config_file,
)
from tfaploss.config.loss_section import (
    LossConfig,
    loss_class,
    loss_classes,
    loss_defaults,
    loss_parameters,
)
from tfaploss.config.schema import (
    AugmentationConfig,
    Config,
    DataConfig,
    DistributeConfig,
    EvaluationConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainingConfig,
    XBMConfig,
)

__all__ = ["AugmentationConfig", "Config", "ConfigError", "ConfigWarning", "DataConfig",
           "DistributeConfig", "EvaluationConfig", "HealthConfig", "HealthThresholds", "LossConfig",
           "ModelConfig", "OptimizerConfig", "ScheduleConfig", "TrainingConfig", "XBMConfig",
           "apply_overrides", "config_from_dict", "config_notes", "load_config", "loss_class",
           "loss_classes", "loss_defaults", "loss_parameters", "parse_override", "read_config_file"]
