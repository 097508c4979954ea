"""Sustained load on the deployed servers: 32 concurrent clients on each of reward_model and
critic_infer, every answer checked, resident memory measured after a warm-up.

The servers are ``openaligner serve-reward`` and ``serve-critic`` subprocesses (tiny models, one
torch thread each); the clients are ``tritonclient.http`` connections in threads of this process,
each sending its next request as soon as the last is answered, with 1-4 rows padded to 32 tokens
so that Triton merges them. Each answer must equal, within float tolerance, the one the same
server gave for the same request alone before the load: merged batches must neither fail nor mix
rows. Memory is the resident set (VmRSS) of the server process, and of its whole process tree
(tritonserver and its python-backend stubs included).

``test_load_short`` (a few seconds) runs in every test run; ``test_load_soak`` runs for
``$OPENALIGNER_LOAD_SECONDS`` (default 60) with ``-m reliability`` / ``-m soak`` (see conftest.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.http as triton_http
from support import Memory

pytestmark = pytest.mark.reliability

CLIENTS = 32  # concurrent clients per endpoint
WIDTH = 32  # tokens per row (the clients' pad_to_length)
DISTINCT = 8  # distinct requests per endpoint; client i sends requests i and i+1 (mod DISTINCT) in turn
MAX_RSS_GROWTH = 0.10
SHORT_S, SHORT_WARMUP_S = 6.0, 4.0
SOAK_WARMUP_S = 10.0
MODELS = {"reward_model": ("rewards",), "critic_infer": ("values", "rewards")}


@dataclass
class LoadResult:
    """What a load run saw."""

    seconds: float
    answered: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    after_warmup: dict[str, Memory] = field(default_factory=dict)
    at_end: dict[str, Memory] = field(default_factory=dict)
    peak: dict[str, Memory] = field(default_factory=dict)

    def growth(self, name: str) -> tuple[float, float]:
        """Relative RSS growth from the end of warm-up to the end: (server process, process tree)."""
        a, b = self.after_warmup[name], self.at_end[name]
        return (b.server_kb - a.server_kb) / a.server_kb, (b.tree_kb - a.tree_kb) / a.tree_kb

    def summary(self) -> str:
        parts = [f"{self.seconds:.0f} s measured"]
        for name in self.after_warmup:
            server, tree = self.growth(name)
            parts.append(
                f"{name}: {self.answered[name]} answers ({self.answered[name] / self.seconds:.0f}/s), RSS "
                f"{self.after_warmup[name].server_kb // 1024} -> {self.at_end[name].server_kb // 1024} MB "
                f"({server:+.1%}), tree {self.after_warmup[name].tree_kb // 1024} -> "
                f"{self.at_end[name].tree_kb // 1024} MB ({tree:+.1%}), peak tree "
                f"{self.peak[name].tree_kb // 1024} MB"
            )
        return "; ".join(parts)


def requests_for(model: str) -> list[tuple[list[triton_http.InferInput], int]]:
    """``DISTINCT`` requests of 1-4 rows, right-padded to ``WIDTH``, with their row counts."""
    rng = np.random.default_rng(0 if model == "reward_model" else 1)
    out = []
    for i in range(DISTINCT):
        rows = 1 + i % 4
        lengths = rng.integers(1, WIDTH + 1, (rows, 1)).astype(np.int64)
        tokens = rng.integers(3, 100, (rows, WIDTH)).astype(np.int64)
        tokens[np.arange(WIDTH)[None, :] >= lengths] = 0
        t = triton_http.InferInput("tokens", [rows, WIDTH], "INT64")
        t.set_data_from_numpy(tokens, binary_data=True)
        n = triton_http.InferInput("sequence_lengths", [rows, 1], "INT64")
        n.set_data_from_numpy(lengths, binary_data=True)
        out.append(([t, n], rows))
    return out


def answer(client: triton_http.InferenceServerClient, model: str, inputs: list) -> dict[str, np.ndarray]:
    result = client.infer(model, inputs)
    return {name: result.as_numpy(name) for name in MODELS[model]}


def run_load(ports: dict[str, int], pids: dict[str, int], seconds: float, warmup_s: float) -> LoadResult:
    """``CLIENTS`` closed-loop clients per model for ``warmup_s + seconds``; memory sampled every
    second after the warm-up."""
    requests = {model: requests_for(model) for model in ports}
    reference: dict[str, list[dict[str, np.ndarray]]] = {}
    for model, port in ports.items():  # each request alone, before the load
        client = triton_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
        reference[model] = [answer(client, model, inputs) for inputs, _ in requests[model]]
        client.close()

    result = LoadResult(seconds)
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop(model: str, index: int) -> None:
        client = triton_http.InferenceServerClient(
            f"127.0.0.1:{ports[model]}", connection_timeout=60, network_timeout=60
        )
        mine = [index % DISTINCT, (index + 1) % DISTINCT]
        sent = 0
        try:
            while not stop.is_set():
                which = mine[sent % 2]
                sent += 1
                try:
                    got = answer(client, model, requests[model][which][0])
                    for name, want in reference[model][which].items():
                        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=name)
                except Exception as e:  # every failure is counted, none ends the run
                    with lock:
                        result.errors.append(f"{model} client {index}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                with lock:
                    result.answered[model] += 1
        finally:
            client.close()

    threads = [
        threading.Thread(target=client_loop, args=(model, i), daemon=True)
        for model in ports
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    with lock:
        result.answered.clear()
    result.after_warmup = {m: Memory.of(pid) for m, pid in pids.items()}
    result.peak = dict(result.after_warmup)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(1.0, left))
        for m, pid in pids.items():
            now = Memory.of(pid)
            if now.tree_kb > result.peak[m].tree_kb:
                result.peak[m] = now
    result.at_end = {m: Memory.of(pid) for m, pid in pids.items()}
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    return result


def check(result: LoadResult, min_answers: int) -> None:
    print(result.summary())
    assert not result.errors, f"{len(result.errors)} errors, e.g. {result.errors[:3]}"
    for model in MODELS:
        assert result.answered[model] >= min_answers, result.summary()
        server, tree = result.growth(model)
        assert server < MAX_RSS_GROWTH and tree < MAX_RSS_GROWTH, result.summary()


def _targets(cli_servers) -> tuple[dict[str, int], dict[str, int]]:
    ports = {"reward_model": cli_servers.reward_port, "critic_infer": cli_servers.critic_port}
    pids = {"reward_model": cli_servers.reward.proc.pid, "critic_infer": cli_servers.critic.proc.pid}
    return ports, pids


def test_load_short_no_errors_and_bounded_memory(cli_servers):
    ports, pids = _targets(cli_servers)
    check(run_load(ports, pids, SHORT_S, SHORT_WARMUP_S), min_answers=100)


@pytest.mark.soak
def test_load_soak_no_errors_and_bounded_memory(cli_servers):
    seconds = float(os.environ.get("OPENALIGNER_LOAD_SECONDS", "60"))
    ports, pids = _targets(cli_servers)
    check(run_load(ports, pids, seconds, SOAK_WARMUP_S), min_answers=int(20 * seconds))
