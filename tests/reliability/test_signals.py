"""SIGINT and SIGTERM: `serve-reward`, `serve-critic` and `train-ppo` exit promptly with the
documented code and leave no process behind (tritonserver and its Python backends included).

Exit codes: the servers exit 0 on either signal (stopping is how a server's run ends); train-ppo
exits 130 on SIGINT and 143 on SIGTERM (128 + the signal: the run did not finish), after saying
which checkpoint the same command resumes from. "Ctrl-C" is SIGINT to the whole process group, as
a terminal sends it, so every child gets it too.

A server signalled while Triton is still starting exits within seconds too, and a server never
exits before every Triton process of its own has (a stuck python backend is killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from fault_procs import CriticServer, RewardServer, Trainer, kill_tree, stop_cleanly, wait_for, write_prompts
from procs import Served, alive, descendants, free_port

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

EXIT_WITHIN_S = 30.0  # a stop waits at most server.exit_timeout_s (3 s) for calls in progress
# A stop while starting: Triton is killed and nothing waits for it but the workspace's own release:
# up to its grace (2 s) for Triton to exit, then SIGKILL and up to 5 s for the kill to land
# (transport/workspace.py). Those 7 s, plus the interpreter's own exit on a loaded 2-core machine,
# is what a correct stop may take; 5 s was inside that, and failed once at load ~5 (5.04 s: SIGTERM,
# 2.1 s grace, kill, exit). The defect this guards against took 123 s (PyTriton waited two minutes
# for a Triton it had not started): 20 s keeps a factor of 6 from it and 13 s of slack over the design.
START_STOP_WITHIN_S = 20.0


def ctrl_c(served: Served, within_s: float = EXIT_WITHIN_S) -> tuple[int, float]:
    """SIGINT to the process group (a terminal's Ctrl-C); (exit code, seconds) once nothing is left."""
    tree = descendants(served.proc.pid)
    started = time.monotonic()
    os.killpg(served.proc.pid, signal.SIGINT)
    code = served.proc.wait(timeout=within_s)
    took = time.monotonic() - started
    wait_for(lambda: not any(alive(p) for p in tree), 10, "the process group to exit")
    return code, took


def test_reward_server_stops_cleanly_on_ctrl_c_and_on_sigterm():
    servers = {"Ctrl-C": RewardServer(), "SIGTERM": RewardServer()}  # started side by side
    try:
        for server in servers.values():
            server.wait_ready()
            assert "tritonserver" in descendants(server.proc.pid).values()
        stopped = {
            "Ctrl-C": ctrl_c(servers["Ctrl-C"]),
            "SIGTERM": stop_cleanly(servers["SIGTERM"], signal.SIGTERM),
        }
    finally:
        for server in servers.values():
            kill_tree(server)
    for how, (code, took) in stopped.items():
        output = servers[how].output
        assert code == 0, (how, output[-3000:])
        assert took < EXIT_WITHIN_S, (how, took)
        assert "reward model server stopped" in output and "Traceback" not in output, (how, output[-3000:])


def test_ctrl_c_stops_the_trainer_then_the_critic_server(tmp_path):
    server = CriticServer(tmp_path / "critic")
    # 200 passes over 48 prompts: the run cannot end on its own before the signal lands
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    run = Trainer(tmp_path / "run", prompts, server.port, 500, "trainer.max_epochs=200")
    try:
        wait_for(lambda: run.latest_step() >= 2, 240, "the run to checkpoint")
        trainer_code, trainer_s = ctrl_c(run)
        server_code, server_s = ctrl_c(server)
    finally:
        kill_tree(run)
        kill_tree(server)
    assert trainer_code == 130, run.output[-3000:]
    assert "openaligner train-ppo: stopped by SIGINT; the same command resumes from" in run.output
    assert "Traceback" not in run.output
    assert server_code == 0, server.output[-3000:]
    assert "SIGINT received: stopping" in server.output and "critic server stopped at step" in server.output
    assert trainer_s < EXIT_WITHIN_S and server_s < EXIT_WITHIN_S


def test_sigterm_stops_a_trainer_waiting_on_a_stuck_critic_server_then_the_server(tmp_path):
    """The critic server is frozen (SIGSTOP) mid-run, so the trainer waits on an answer that will
    not come (request_timeout_s is 600 s); SIGTERM still ends it within seconds."""
    server = CriticServer(tmp_path / "critic")
    run = Trainer(tmp_path / "run", write_prompts(tmp_path / "prompts.jsonl"), server.port, 500)
    try:
        wait_for(lambda: run.latest_step() >= 2, 240, "the run to checkpoint")
        os.killpg(server.proc.pid, signal.SIGSTOP)
        frozen_at = run.latest_step()
        time.sleep(1.5)
        assert run.latest_step() == frozen_at and run.proc.poll() is None  # it waits
        trainer_code, trainer_s = stop_cleanly(run, signal.SIGTERM)
        os.killpg(server.proc.pid, signal.SIGCONT)
        server_code, server_s = stop_cleanly(server, signal.SIGTERM)
    finally:
        kill_tree(run)
        kill_tree(server)
    assert trainer_code == 143, run.output[-3000:]
    assert f"stopped by SIGTERM; the same command resumes from {run.checkpoints / f'step_{frozen_at}'}" in (
        run.output
    )
    assert server_code == 0, server.output[-3000:]
    assert "SIGTERM received: stopping" in server.output
    assert trainer_s < EXIT_WITHIN_S and server_s < EXIT_WITHIN_S


def _critic_cli(*extra: str) -> Served:
    """`openaligner serve-critic` with the tiny models (not waited for)."""
    args = ["model.tiny=gpt2", f"server.port={free_port()}", "threads=1", *extra]
    return Served([sys.executable, "-m", "openaligner", "serve-critic", *args])


def _when(served: Served, program: str, timeout_s: float = 120.0) -> None:
    """Return as soon as a process running ``program`` appears below ``served``."""
    wait_for(lambda: program in descendants(served.proc.pid).values(), timeout_s, f"{program} to start")


@pytest.mark.parametrize(
    ("moment", "signal_to"),
    [
        ("tritonserver", "main process"),  # Triton starting
        ("triton_python_b", "process group"),  # its python backends loading the models
    ],
)
def test_a_server_signalled_while_starting_exits_within_seconds(moment, signal_to):
    """SIGTERM while Triton is still starting used to let the start run on (up to 123 s: a
    SIGTERM to the group stops tritonserver, and PyTriton then waits two minutes for it)."""
    server = _critic_cli()
    try:
        _when(server, moment)
        tree = descendants(server.proc.pid)
        started = time.monotonic()
        if signal_to == "main process":
            server.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)
        code = server.proc.wait(timeout=EXIT_WITHIN_S)
        took = time.monotonic() - started
        wait_for(lambda: not any(alive(p) for p in tree), 10, "the server's Triton processes to exit")
    finally:
        kill_tree(server)
    assert code == 0, server.output[-3000:]
    assert took < START_STOP_WITHIN_S, f"exit took {took:.1f} s\n{server.output[-3000:]}"
    assert "ready at" not in server.output and "Traceback" not in server.output, server.output[-3000:]


def test_a_stuck_python_backend_is_not_left_behind():
    """A python-backend stub that does not exit (here: stopped with SIGSTOP, as one that ignores
    SIGTERM) used to outlive its server, re-parented to init; the server now kills it before it
    exits, and removes its workspace."""
    server = RewardServer()
    try:
        server.wait_ready()
        stubs = [pid for pid, name in descendants(server.proc.pid).items() if name == "triton_python_b"]
        assert stubs, descendants(server.proc.pid)
        program = Path(Path(f"/proc/{stubs[0]}/cmdline").read_bytes().split(b"\0")[0].decode())
        workspace = next(p for p in program.parents if p.name == "workspace").parent
        for pid in stubs:
            os.kill(pid, signal.SIGSTOP)
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=EXIT_WITHIN_S)
        left = [pid for pid in stubs if alive(pid)]
    finally:
        kill_tree(server)
        for pid in stubs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 0, server.output[-3000:]
    assert not left, f"python backend(s) {left} outlived their server"
    assert "killing" in server.output and "triton_python_b" in server.output  # it says what it killed
    assert not workspace.exists()
