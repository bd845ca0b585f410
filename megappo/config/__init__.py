"""Config: typed schema (schema.py), YAML defaults chain + dotted overrides (loader.py), cross-key
validation (validate.py), the one error type (errors.py)."""

from megappo.config.errors import ConfigError
from megappo.config.loader import load_config, to_dict, to_yaml
from megappo.config.schema import MegappoConfig
from megappo.config.validate import model_dims, pool_size, validate_config

__all__ = ["ConfigError", "MegappoConfig", "load_config", "model_dims", "pool_size", "to_dict", "to_yaml",
           "validate_config"]
