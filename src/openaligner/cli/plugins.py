"""The ``plugins`` key: a user's modules imported before a command's config is validated, so that
what they register (an advantage estimator, ``trainer/estimators.py``) is a name that config takes.

Owns reading the key ahead of the typed config (from the YAML file, then the overrides) and
importing each entry: a dotted module name (found from the working directory first, as with
``python -m``) or the path of a ``.py`` file. Must not know what a plugin registers.
Design notes: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from openaligner.config import ConfigError

KEY = "plugins"
"""The top-level key of a command's config that lists its plugins (a schema that has it)."""


def declared_plugins(schema: type, path: str | None, overrides: Sequence[str]) -> list[str]:
    """The ``plugins`` list of a command's arguments as given (the file's, then a ``plugins=``
    override's), for a ``schema`` with that key; ``[]`` for one without it, whose config then
    refuses the key as unknown. The typed config reads the key again and keeps it (saved with
    the run, so a rerun of its ``config.yaml`` imports the same plugins).

    Raises:
        ConfigError: the value is not a list of names.
    """
    if KEY not in {f.name for f in dataclasses.fields(schema)}:
        return []
    value: object = None
    try:
        if path is not None and Path(path).is_file():
            from_file = OmegaConf.load(path)
            if isinstance(from_file, DictConfig) and KEY in from_file:
                value = from_file[KEY]
        for override in overrides:
            if override.partition("=")[0].strip() == KEY:
                value = OmegaConf.from_dotlist([override])[KEY]
    except Exception as e:  # OmegaConf's own parse errors: the typed load names them again
        raise ConfigError(f"{KEY}: {_one_line(e)}") from None
    if value is None:
        return []
    names = list(value) if isinstance(value, ListConfig) else None
    if names is None or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            f"{KEY} must be a list of module names or .py paths, e.g. {KEY}=[my_estimators], got {value!r}"
        )
    return [n.strip() for n in names]


def import_plugins(names: Sequence[str]) -> None:
    """Import every entry of ``names`` once (a second call imports nothing again): a ``.py``
    path as a module named after its file, anything else as a dotted module name, with the
    working directory on ``sys.path``.

    Raises:
        ConfigError: one line naming the entry that failed and why (its import raised, or no
            such module or file).
    """
    for name in names:
        try:
            if name.endswith(".py") or os.sep in name:
                _import_file(Path(name))
            else:
                if os.getcwd() not in sys.path and "" not in sys.path:
                    sys.path.insert(0, os.getcwd())  # as `python -m` does; the console script does not
                importlib.import_module(name)
        except Exception as e:
            raise ConfigError(f"{KEY}: cannot import {name}: {type(e).__name__}: {_one_line(e)}") from None


def _import_file(path: Path) -> None:
    """``path`` executed as the module ``path.stem`` (unless that module is this file already)."""
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    loaded = sys.modules.get(path.stem)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
        return
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"
