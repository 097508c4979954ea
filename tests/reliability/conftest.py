"""Every test under tests/reliability is marked ``reliability``; the long ``soak`` runs only on request.

A plain ``pytest`` (CI) runs the short versions. ``pytest -m reliability`` (or ``-m soak``, or any
run with ``OPENALIGNER_LOAD_SECONDS`` set) also runs the tests marked ``soak``, e.g. the 60 s load
test. The helpers of ``tests/integration/procs.py`` are importable here as ``procs``.

``cli_servers`` (session-scoped) runs ``openaligner serve-reward`` and ``serve-critic`` as
subprocesses, for tests that need the servers exactly as deployed (load, bind addresses, limits).
"""

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "integration"))  # procs.py: free ports, process trees, CLI servers

from procs import Served, port_of  # noqa: E402  (importable once the path above is set)


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


@dataclass(frozen=True)
class CLIServers:
    """``openaligner serve-reward`` and ``serve-critic`` (tiny models) as the user runs them."""

    reward: Served
    reward_port: int
    critic: Served
    critic_port: int
    critic_ckpt: Path
    token: str


@pytest.fixture(scope="session")
def cli_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CLIServers]:
    """Both CLI servers, started together with ``server.port=0`` (each takes a free port and names it
    when ready; the critic takes its token from ``$OPENALIGNER_TOKEN``) and stopped with SIGINT at
    the end of the session."""
    token = "cli-reliability-token"
    ckpt = tmp_path_factory.mktemp("cli_critic_ckpt")
    common = ["model.tiny=gpt2", "threads=1"]
    reward = Served([sys.executable, "-m", "openaligner", "serve-reward", *common, "server.port=0"])
    critic = Served(
        [
            sys.executable,
            "-m",
            "openaligner",
            "serve-critic",
            *common,
            "server.port=0",
            f"checkpoint.dir={ckpt}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
        ],
        env={"OPENALIGNER_TOKEN": token},
    )
    try:
        reward_port = port_of(reward.wait_ready())
        critic_port = port_of(critic.wait_ready())
        yield CLIServers(reward, reward_port, critic, critic_port, ckpt, token)
    finally:
        for served in (reward, critic):
            if served.proc.poll() is None:
                served.proc.send_signal(signal.SIGINT)
        for served in (reward, critic):
            try:
                served.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                served.kill()
