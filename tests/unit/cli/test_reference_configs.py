"""Every configs/<command>.yaml names exactly its command's schema keys, with the schema's defaults,
and documents each key with a comment. One test for all reference files."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from openaligner.cli.main import COMMANDS
from openaligner.cli.main import command as command_of
from openaligner.config import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
# The keys a reference file leaves for the user (marked ??? or a choice between sources).
REQUIRED = {
    "train-sft": ["data.train_path=x.jsonl"],
    "train-rm": ["data.train_path=x.jsonl"],
    "train-ppo": ["data.train_path=x.jsonl"],
    "serve-reward": ["model.tiny=gpt2"],
    "serve-critic": ["model.tiny=gpt2"],
    "serve-rollout": ["model=/models/sft"],
    "serve-tinker": [],
}


def schema_keys(cls: type, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys |= schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def yaml_keys(node: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for k, v in node.items():
        # an empty mapping is a key's value ({} as the default of a name -> path table)
        keys |= yaml_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
    return keys


def test_every_reference_file_belongs_to_a_command():
    files = {p.stem.replace("_", "-") for p in CONFIGS.glob("*.yaml")}
    assert files == set(REQUIRED)
    assert files <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_reference_file_has_every_key_with_its_default_and_a_comment(command):
    schema = command_of(command).SCHEMA
    path = CONFIGS / f"{command.replace('-', '_')}.yaml"
    assert yaml_keys(OmegaConf.to_container(OmegaConf.load(path), resolve=False)) == schema_keys(schema)
    required = REQUIRED[command]
    assert load_config(schema, path, required) == load_config(schema, None, required)
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"undocumented key in {path.name}: {line!r}"
