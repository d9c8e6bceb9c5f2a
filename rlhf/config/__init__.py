"""Typed run configuration: dataclass schema (OmegaConf structured configs), YAML presets, dotted overrides."""

from rlhf.config.load import load_config, save_config
from rlhf.config.schema import RunConfig

__all__ = ["RunConfig", "load_config", "save_config"]
