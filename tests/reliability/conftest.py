"""Every test under tests/reliability is marked ``reliability``; the long ``soak`` runs only on request.

A plain ``pytest`` (CI) runs the short versions. ``pytest -m reliability`` (or ``-m soak``, or any
run with ``OPENALIGNER_LOAD_SECONDS`` set) also runs the tests marked ``soak``, e.g. the 60 s load
test. The helpers of ``tests/integration/procs.py`` are importable here as ``procs``.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "integration"))  # procs.py: free ports, process trees, CLI servers


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "soak: long reliability runs (minutes); run with -m reliability, -m soak or OPENALIGNER_LOAD_SECONDS",
    )


def soak_requested(config: pytest.Config) -> bool:
    """Whether this run asked for the long runs (see the module docstring)."""
    expression = config.option.markexpr or ""
    return "OPENALIGNER_LOAD_SECONDS" in os.environ or "soak" in expression or "reliability" in expression


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marker added here must count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_soak = pytest.mark.skip(
        reason="soak test: run with -m reliability, -m soak, or OPENALIGNER_LOAD_SECONDS set"
    )
    long_runs = soak_requested(config)
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.reliability)
        if item.get_closest_marker("soak") is not None and not long_runs:
            item.add_marker(skip_soak)
