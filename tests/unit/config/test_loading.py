from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from openaligner.config import ConfigError, config_to_yaml, describe_config, load_config


@dataclass
class Inner:
    lr: float = 1e-5  # learning rate
    name: str = "adam"  # optimizer


@dataclass
class Schema:
    steps: int = 3  # number of steps
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError("steps must be >= 0; set steps=0 to disable")


def test_defaults_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\ninner:\n  name: sgd\n")
    cfg = load_config(Schema, path, ["inner.lr=0.5"])
    assert (cfg.steps, cfg.inner.name, cfg.inner.lr) == (7, "sgd", 0.5)
    assert isinstance(cfg.inner, Inner)
    assert "lr: 0.5" in config_to_yaml(cfg)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["nope=1"], "nope"),
        (["steps=abc"], "steps"),
        (["steps"], "key=value"),
        (["steps=-1"], "steps=0 to disable"),
    ],
)
def test_bad_configs_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(Schema, None, overrides)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Schema, tmp_path / "missing.yaml")


@dataclass
class Shared:
    """A section two schemas hold under different keys."""

    size: int = 1  # must be >= 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"{{section}}.size must be >= 1, got {self.size}; set {{section}}.size=1")


@dataclass
class Nest:
    shared: Shared = field(default_factory=Shared)


@dataclass
class TwoUses:
    first: Shared = field(default_factory=Shared)
    second: Nest = field(default_factory=Nest)
    name: str = "???"  # mandatory


def test_shared_section_errors_name_the_key_the_user_wrote():
    with pytest.raises(ConfigError, match=r"^first\.size must be >= 1, got 0; set first\.size=1$"):
        load_config(TwoUses, None, ["name=x", "first.size=0"])
    with pytest.raises(
        ConfigError, match=r"^second\.shared\.size must be >= 1, got -2; set second\.shared\.size"
    ):
        load_config(TwoUses, None, ["name=x", "second.shared.size=-2"])


def test_describe_config_shows_missing_values_and_still_checks_complete_sections():
    text, missing = describe_config(TwoUses, None, [])
    assert "name: ???" in text and missing == ["name"]
    with pytest.raises(ConfigError, match=r"second\.shared\.size must be"):
        describe_config(TwoUses, None, ["second.shared.size=0"])
    text, missing = describe_config(TwoUses, None, ["name=x", "first.size=3"])
    assert missing == [] and "size: 3" in text


@dataclass
class Renamed:
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "inner.rate": "inner.lr",
        "inner.name=default": "inner.name=adam",
    }

    inner: Inner = field(default_factory=Inner)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["inner.rate=0.1"], "inner.rate is now inner.lr"),
        (["inner.name=default"], "inner.name=default is now inner.name=adam"),
        (["inner.name=DEFAULT"], "inner.name=default is now inner.name=adam"),
    ],
)
def test_renamed_keys_are_refused_naming_the_new_key(overrides, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(Renamed, None, overrides)


def test_renamed_keys_in_a_file_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("inner:\n  rate: 0.1\n")
    with pytest.raises(ConfigError, match=f"inner.rate is now inner.lr \\(in {path}\\)"):
        load_config(Renamed, path)
    assert load_config(Renamed, None, ["inner.name=sgd", "inner.lr=0.1"]).inner.name == "sgd"
