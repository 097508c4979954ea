"""Load a dataclass schema from an optional YAML file plus dotted overrides, via OmegaConf.

Owns the two errors a command refuses a run with: :class:`ConfigError` at load time and
:class:`StartupError` for checks that need more than the config. A section that several schemas
hold under different keys (a model source is ``model`` in train-sft, ``actor`` in train-ppo) cannot
know its own key: its ``__post_init__`` writes ``{section}`` in the message where the key belongs,
and :func:`load_config` replaces it with the key the user wrote (``{section}.path`` →
``actor.path``). A key that a schema renamed is refused with its new name: the schema lists it in
a ``RENAMED_KEYS`` class attribute (see :data:`RENAMED_KEYS`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")

SECTION = "{section}"
"""Stands for the key of the section whose ``__post_init__`` raised, in a ``ValueError`` message."""

RENAMED_KEYS = "RENAMED_KEYS"
"""The class attribute (a ``ClassVar[dict[str, str]]``) in which a schema maps a key it no longer
has — a dotted key, or ``key=value`` for a value no longer meant that way — to what to write
instead; a config file or override that still writes it is refused with ``"<old> is now <new>"``."""
_ABSENT = object()


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


class StartupError(ConfigError):
    """A run refused at start-up, after the config loaded, by a check that needs more than the
    config: a data file, a model's ``config.json``, the prompts that survive filtering. The message
    names the key, the value and the fix; ``openaligner`` prints it as one paragraph and exits 2."""


@contextmanager
def as_startup_error(*errors: type[Exception]) -> Iterator[None]:
    """Re-raise ``errors`` raised inside as :class:`StartupError`: for the typed errors of lower
    layers (e.g. ``models.source.SourceError``) whose messages already name the key and the fix
    but which may not import this package."""
    try:
        yield
    except errors as e:
        raise StartupError(str(e)) from None


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a ``schema`` instance: defaults ← YAML file ← ``key=value`` overrides.

    Unknown keys and wrongly typed values are refused; the dataclass's ``__post_init__`` then
    checks combinations. Every failure raises :class:`ConfigError` naming the key.
    """
    merged = _merge(schema, path, overrides)
    obj = _instantiate(merged)
    assert isinstance(obj, schema)
    return obj


def describe_config(
    schema: type[Any], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[str, list[str]]:
    """``(YAML, missing keys)`` for ``--print-config``: the resolved config, where mandatory values
    not given yet show as ``???`` and are listed. Everything else is checked as by
    :func:`load_config`, down to each section that has no missing value."""
    merged = _merge(schema, path, overrides)
    missing = sorted(OmegaConf.missing_keys(merged))
    if not missing:
        return config_to_yaml(_instantiate(merged)), []
    _check_complete_sections(merged)
    return OmegaConf.to_yaml(merged), missing


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML text."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (for run directories and checkpoints)."""
    Path(path).write_text(config_to_yaml(cfg))


def _merge(schema: type[Any], path: str | Path | None, overrides: Sequence[str]) -> DictConfig:
    """Defaults ← file ← overrides, type-checked by OmegaConf, not yet instantiated."""
    with _as_config_error():
        merged = OmegaConf.structured(schema)
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {p} does not exist")
            from_file = OmegaConf.load(p)
            _refuse_renamed(schema, from_file, f" (in {p})")
            with _suggest_known_key(merged, f" (in {p})"):
                merged = OmegaConf.merge(merged, from_file)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        if overrides:
            dotlist = OmegaConf.from_dotlist(list(overrides))
            _refuse_renamed(schema, dotlist)
            with _suggest_known_key(merged):
                merged = OmegaConf.merge(merged, dotlist)
    assert isinstance(merged, DictConfig)
    return merged


_FAMILIAR_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "max_epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "train_batch_size": "global_batch_size",
    "max_grad_norm": "gradient_clip_val",
    "max_len": "max_length",
}
"""TRL / OpenRLHF / transformers argument names → the name of the key that does the same here."""


@contextmanager
def _suggest_known_key(schema: DictConfig, where: str = "") -> Iterator[None]:
    """Refuse a key ``schema`` does not have (OmegaConf's ``ConfigKeyError``) naming the dotted
    keys it may have meant: those ending in the same name (``lr`` → ``optim.lr``), else those
    spelled alike. OmegaConf's own guess compares only the keys of one section (``lr`` → ``lora``)."""
    try:
        yield
    except ConfigKeyError as e:
        given = str(e.full_key or e.key)
        known = list(_dotted_keys(schema))
        name = given.rsplit(".", 1)[-1]
        name = _FAMILIAR_NAMES.get(name, name)
        same_name = [k for k in known if k.rsplit(".", 1)[-1] == name]
        guesses = same_name or difflib.get_close_matches(given, known, n=3, cutoff=0.6)
        if not guesses:
            by_name = {k.rsplit(".", 1)[-1]: k for k in known}
            guesses = [by_name[n] for n in difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.75)]
        hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
        raise ConfigError(
            f"unknown key {given!r}{where}{hint} (keys are dotted, section.key=value; --print-config "
            "shows them all)"
        ) from None


def _dotted_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """Every leaf key of ``node``, dotted (``optim.lr``)."""
    for key in node:
        dotted = f"{prefix}{key!s}"
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from _dotted_keys(child, dotted + ".")
        else:
            yield dotted


def _refuse_renamed(schema: type[Any], given: Any, where: str = "") -> None:
    """Refuse ``given`` (a file's or the overrides' raw config) if it writes a key, or a
    ``key=value``, that ``schema``'s :data:`RENAMED_KEYS` lists, naming what replaced it."""
    for old, new in getattr(schema, RENAMED_KEYS, {}).items():
        key, _, value = old.partition("=")
        found = OmegaConf.select(given, key, default=_ABSENT) if isinstance(given, DictConfig) else _ABSENT
        if found is not _ABSENT and (not value or str(found).lower() == value):
            raise ConfigError(f"{old} is now {new}{where}")


def _instantiate(node: DictConfig, key: str = "") -> Any:
    """``node`` (at dotted ``key``) as its dataclass, running every ``__post_init__``, inner
    sections first."""
    with _as_config_error():
        try:
            return OmegaConf.to_object(node)
        except ValueError as e:
            if SECTION not in str(e):
                raise
            section = ".".join(k for k in (key, _failing_section(node)) if k)
            message = str(e).replace(SECTION + ".", f"{section}." if section else "")
            raise ConfigError(message.replace(SECTION, section)) from None


def _check_complete_sections(node: DictConfig, key: str = "") -> None:
    """Instantiate, and so check, every section below ``node`` that has no missing value."""
    for name, child in _sections(node):
        dotted = f"{key}.{name}" if key else name
        if OmegaConf.missing_keys(child):
            _check_complete_sections(child, dotted)
        else:
            _instantiate(child, dotted)


def _sections(node: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    """``(key, section)`` for each sub-config of ``node``, in key order."""
    for key in node:
        if not OmegaConf.is_missing(node, key) and isinstance(child := node[key], DictConfig):
            yield str(key), child


def _failing_section(node: DictConfig) -> str:
    """The dotted key, below ``node``, of the section whose ``__post_init__`` raised a ``{section}``
    message when ``node`` was instantiated; "" for ``node`` itself. OmegaConf builds sections
    depth-first in key order, so the first one that fails on its own is the one."""
    for key, child in _sections(node):
        try:
            OmegaConf.to_object(child)
        except ValueError as e:
            if SECTION not in str(e):
                continue
            inner = _failing_section(child)
            return f"{key}.{inner}" if inner else str(key)
    return ""


@contextmanager
def _as_config_error() -> Iterator[None]:
    """Turn OmegaConf errors and the schemas' ``ValueError``/``TypeError`` into :class:`ConfigError`."""
    try:
        yield
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        where = f" (key {key!r})" if key else ""
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"invalid configuration{where}: {first_line}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
