"""Load a dataclass schema from an optional YAML file plus dotted overrides, via OmegaConf."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a ``schema`` instance: defaults ← YAML file ← ``key=value`` overrides.

    Unknown keys and wrongly typed values are refused; the dataclass's ``__post_init__`` then
    checks combinations. Every failure raises :class:`ConfigError` naming the key.
    """
    try:
        merged = OmegaConf.structured(schema)
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {p} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(p))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        where = f" (key {key!r})" if key else ""
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"invalid configuration{where}: {first_line}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None
    assert isinstance(obj, schema)
    return obj


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML text."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (for run directories and checkpoints)."""
    Path(path).write_text(config_to_yaml(cfg))
