"""Presets: TOML files read into one frozen, typed ``Config`` (see :mod:`.schema` for the keys and
:mod:`.loader` for reading, checking and migrating them)."""

from ..errors import ConfigError
from .loader import FamilyCatalog, from_dict, load, moved_keys, parse_override_value
from .keys import field_help, resume_safe_keys
from .schema import (REQUIRED, SCHEMA_VERSION, SECTIONS, BudgetConfig, CacheConfig, Config, DataConfig, DType,
                     DataSetConfig, EvalConfig, ExportConfig, LoraConfig, MemoryConfig, ModelConfig, RunConfig,
                     TrainConfig, setting)
from .toml_io import dumps_toml

__all__ = [
    "REQUIRED", "SCHEMA_VERSION", "SECTIONS", "BudgetConfig", "CacheConfig", "Config", "ConfigError", "DType", "DataConfig",
    "DataSetConfig",
    "EvalConfig", "ExportConfig", "FamilyCatalog", "LoraConfig", "MemoryConfig", "ModelConfig", "RunConfig",
    "TrainConfig", "dumps_toml", "field_help", "from_dict", "load", "moved_keys", "parse_override_value",
    "resume_safe_keys", "setting",
]
