from dataclasses import dataclass, field

import pytest

from openaligner.config import ConfigError, config_to_yaml, load_config


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
