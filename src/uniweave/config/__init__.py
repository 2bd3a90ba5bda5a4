"""Strict run configuration: pydantic schema, YAML loading with `defaults:` inheritance,
schema-typed `dotted.key=value` overrides, one-line `ConfigError`s and a stable hash.

    cfg = load_config("recipes/examples/grpo_tiny.yaml", ["trainer.optimizer.lr=3e-4"])
    print(to_yaml(cfg), config_hash(cfg))
"""

from __future__ import annotations

from uniweave.config.algorithms import (
    AlgorithmConfig,
    BitflipConfig,
    GRPOConfig,
    InformationGainConfig,
    KLConfig,
    OPDConfig,
    SFTConfig,
)
from uniweave.config.base import StrictModel, incompatible
from uniweave.config.errors import COMMAND_LINE, ConfigError, InputError, suggest
from uniweave.config.hashing import (
    canonical_json,
    config_hash,
    diff_configs,
    resume_conflicts,
    short_hash,
    to_yaml,
)
from uniweave.config.loader import config_sources, key_source, load_config
from uniweave.config.overrides import apply_overrides, parse_override
from uniweave.config.schema import (
    DIGITS_TASKS,
    IMAGE_GENERATION_TASKS,
    CheckpointConfig,
    CodecConfig,
    DataConfig,
    DecoderSizes,
    EvaluationConfig,
    HealthConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    RewardPluginConfig,
    RolloutConfig,
    RunConfig,
    Task,
    TinyModelConfig,
    UniweaveConfig,
)
from uniweave.config.trainer import LoRAConfig, OptimizerConfig, SchedulerConfig, TrainerConfig
from uniweave.config.validation import validate_config
from uniweave.config.yaml_io import read_config_tree

__all__ = [
    "COMMAND_LINE",
    "DIGITS_TASKS",
    "IMAGE_GENERATION_TASKS",
    "AlgorithmConfig",
    "BitflipConfig",
    "CheckpointConfig",
    "CodecConfig",
    "ConfigError",
    "InputError",
    "DataConfig",
    "DecoderSizes",
    "EvaluationConfig",
    "HealthConfig",
    "GRPOConfig",
    "InformationGainConfig",
    "KLConfig",
    "LoRAConfig",
    "LoggingConfig",
    "ModelConfig",
    "OPDConfig",
    "OptimizerConfig",
    "RewardConfig",
    "RewardPluginConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SchedulerConfig",
    "StrictModel",
    "Task",
    "TinyModelConfig",
    "TrainerConfig",
    "UniweaveConfig",
    "apply_overrides",
    "canonical_json",
    "config_hash",
    "config_sources",
    "diff_configs",
    "incompatible",
    "key_source",
    "load_config",
    "parse_override",
    "read_config_tree",
    "resume_conflicts",
    "short_hash",
    "suggest",
    "to_yaml",
    "validate_config",
]
