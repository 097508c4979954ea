"""pyproject's dependency ranges hold the versions the tests run on."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_transformers_has_a_ceiling_and_the_tested_version_is_inside_the_range():
    """Forward's arguments change between transformers releases (past_key_values became cache in
    5.24 and goes in 5.40): the range admits only releases the tests have run on."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (transformers,) = [r for r in map(Requirement, dependencies) if r.name == "transformers"]
    assert any(spec.operator == "<" for spec in transformers.specifier), transformers
    assert transformers.specifier.contains(version("transformers")), (transformers, version("transformers"))
