"""Typed configuration: dataclass schemas loaded from YAML with dotted ``key=value`` overrides.

Owns loading, merging, validation errors and saving resolved configs. Schemas for each component
live next to the code that consumes them; constructors receive plain values, never this module.
"""

from openaligner.config.loading import (
    ConfigError,
    StartupError,
    as_startup_error,
    config_to_yaml,
    describe_config,
    load_config,
    save_config,
)

__all__ = [
    "ConfigError",
    "StartupError",
    "as_startup_error",
    "config_to_yaml",
    "describe_config",
    "load_config",
    "save_config",
]
