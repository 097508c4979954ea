"""Reward server throughput and latency against an offline full-batch forward of the same model.

Workload (/work/shared/bench/workload.md): the canonical GPT-2 reward model (n_layer=4, n_embd=256,
n_head=4, vocab 512, n_positions=256, scalar head), random init with seed 0, fp32,
``torch.set_num_threads(2)`` in the server; sequences of 96 token ids drawn from 3..511 (seed 0).

The server (:class:`RewardModelServer`, a real Triton over HTTP) runs in a child process, as it
would in production; closed-loop clients (one ``tritonclient.http`` connection per thread, each
sending its next request as soon as the last was answered) load it at 1, 8 and 32 concurrent
clients for ``--seconds`` after a 1 s warm-up. Reported per level: requests/s, sequences/s, mean
formed batch (rows per model call, from the server's counters), p50/p99 latency. The limit is an
offline ``RewardModel.infer`` over all 128 sequences in one batch (median of 3); the same
sequences in micro-batches of the server's forward size are reported too, since on a CPU one
huge batch is not always the fastest. Both are measured again right before each level because
the shared machine's load drifts. The ratio server/offline says how much of the model's
throughput the server delivers. Start-up (Triton ready) and shutdown
(Triton stopped) times are measured in the server process.

Prints one JSON object. Usage:
``python benchmarks/bench_reward_server.py [--seconds 5] [--rows-per-request 1 8] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

SEQ_TOKENS = 96
POOL = 128
CONCURRENCY = (1, 8, 32)


def sequences() -> torch.Tensor:
    """The fixed pool of [POOL, 96] token ids (seed 0)."""
    return torch.randint(3, 512, (POOL, SEQ_TOKENS), generator=torch.Generator().manual_seed(0))


def build_model() -> Any:
    from openaligner.models.builders import WORKLOAD_SIZE, build_tiny_reward_model

    return build_tiny_reward_model("gpt2", WORKLOAD_SIZE, seed=0)


def serve(conn: Connection, port: int, threads: int, server_kwargs: dict[str, Any]) -> None:
    """Child process: build the model, serve it, answer 'stats' and 'stop' over ``conn``."""
    os.dup2(2, 1)  # tritonserver inherits stdout and prints to it; keep the parent's JSON clean
    torch.set_num_threads(threads)
    from openaligner.servers.reward import RewardEndpoint, RewardModelServer

    model = build_model()
    server = RewardModelServer(
        infer_fn=model.infer, port=port, vocab_size=512, max_sequence_length=256, **server_kwargs
    )
    endpoint = server.endpoint
    assert isinstance(endpoint, RewardEndpoint)  # no reward function: the model's endpoint
    serve_until_stopped(conn, server, lambda: asdict(endpoint.stats))


def serve_until_stopped(conn: Connection, server: Any, stats: Callable[[], Mapping[str, Any]]) -> None:
    """The child's side of :class:`ChildServer`: start ``server``, send ``{"start_s"}``, then answer
    ``"stats"`` with ``stats()`` (holding ``calls`` and ``rows``) until ``"stop"``."""
    started = time.perf_counter()
    server.start()
    conn.send({"start_s": time.perf_counter() - started})
    while True:
        message = conn.recv()
        if message == "stats":
            conn.send(dict(stats()))
        elif message == "stop":
            started = time.perf_counter()
            server.stop()
            conn.send({"stop_s": time.perf_counter() - started})
            return


def offline_sequences_per_s(model: Any, tokens: torch.Tensor, micro_batch_size: int | None) -> float:
    lengths = torch.full((tokens.shape[0],), SEQ_TOKENS)
    model.infer(tokens[:8], lengths[:8])  # warm-up
    times = []
    for _ in range(3):
        started = time.perf_counter()
        model.infer(tokens, lengths, micro_batch_size=micro_batch_size)
        times.append(time.perf_counter() - started)
    return tokens.shape[0] / statistics.median(times)


def closed_loop(
    concurrency: int, seconds: float, connect: Callable[[], Any], request: Callable[[Any, int], None]
) -> dict[str, Any]:
    """``concurrency`` client threads, each with its own ``connect()``ion (closed with ``.close()``),
    calling ``request(connection, k)`` back to back (``k`` = i, i + concurrency, …) for a 1 s
    warm-up and then ``seconds``. Counts and latencies are of requests started after the warm-up.

    Raises:
        RuntimeError: a client failed (the first failure is named).
    """
    warmup_until = time.monotonic() + 1.0
    stop_at = warmup_until + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    failures: list[BaseException] = []

    def client(i: int) -> None:
        connection = connect()
        k = i
        try:
            while (begin := time.monotonic()) < stop_at:
                request(connection, k)
                k += concurrency
                if begin >= warmup_until:
                    latencies[i].append(time.monotonic() - begin)
        except BaseException as e:
            failures.append(e)
        finally:
            connection.close()

    workers = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if failures:
        raise RuntimeError(f"{len(failures)} client(s) failed, first: {failures[0]!r}")
    flat = sorted(x for per in latencies for x in per)
    return {
        "concurrency": concurrency,
        "requests": len(flat),
        "requests_per_s": len(flat) / seconds,
        # None: no request started after the warm-up finished within the window
        "latency_p50_ms": 1000 * flat[len(flat) // 2] if flat else None,
        "latency_p99_ms": 1000 * flat[min(len(flat) - 1, int(0.99 * len(flat)))] if flat else None,
    }


def triton_load(
    port: int,
    model: str,
    outputs: Mapping[str, tuple[int, ...]],
    concurrency: int,
    rows: int,
    seconds: float,
    pool: np.ndarray,
) -> dict[str, Any]:
    """Closed-loop tritonclient clients sending ``rows`` sequences of ``pool`` per request to
    ``model``, checking each answer's ``outputs`` shapes (``-1`` stands for ``rows``)."""
    import tritonclient.http as triton_http

    lengths = np.full((rows, 1), pool.shape[1], np.int64)

    def request(http: Any, k: int) -> None:
        idx = [(k * rows + j) % len(pool) for j in range(rows)]
        tokens = triton_http.InferInput("tokens", [rows, pool.shape[1]], "INT64")
        tokens.set_data_from_numpy(pool[idx])
        lens = triton_http.InferInput("sequence_lengths", [rows, 1], "INT64")
        lens.set_data_from_numpy(lengths)
        answer = http.infer(model, [tokens, lens])
        for name, shape in outputs.items():
            got = answer.as_numpy(name).shape
            assert got == tuple(rows if d == -1 else d for d in shape), f"{name}: {got}"

    def connect() -> Any:
        return triton_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)

    result = closed_loop(concurrency, seconds, connect, request)
    return {**result, "rows_per_request": rows, "sequences_per_s": result["requests_per_s"] * rows}


def load(port: int, concurrency: int, rows: int, seconds: float, pool: np.ndarray) -> dict[str, Any]:
    """Closed-loop clients on reward_model; latencies of requests that started after the warm-up."""
    return triton_load(port, "reward_model", {"rewards": (-1, 1)}, concurrency, rows, seconds, pool)


def server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The serving settings the benchmarks' ``--forward-micro-batch``, ``--preferred`` and
    ``--queue-delay-us`` give (and ``max_batch_size`` 256)."""
    return {
        "inference_micro_batch_size": list(args.preferred),
        "model_forward_micro_batch_size": args.forward_micro_batch,
        "max_queue_delay_microseconds": args.queue_delay_us,
        "max_batch_size": 256,
    }


def against_offline(
    result: dict[str, Any],
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    offline_full: float,
    offline_mbs: float,
) -> None:
    """Add to a load level's ``result`` its mean formed batch (from the server's counters
    ``before`` and ``after`` it) and its ratios to the offline full-batch and micro-batched rates."""
    calls = after["calls"] - before["calls"]
    result["mean_formed_batch_rows"] = (after["rows"] - before["rows"]) / max(1, calls)
    result["offline_full_batch_sequences_per_s"] = offline_full
    result["ratio_to_offline_full_batch"] = result["sequences_per_s"] / offline_full
    result["offline_micro_batched_sequences_per_s"] = offline_mbs
    result["ratio_to_offline_micro_batched"] = result["sequences_per_s"] / offline_mbs


class ChildServer:
    """A server started by ``serve(conn, *args)`` in a spawned child process and driven over a
    pipe: ``serve`` first sends ``{"start_s": seconds}``, then answers ``"stats"`` with its counters
    and ``"stop"`` with ``{"stop_s": seconds}`` before it returns."""

    def __init__(self, serve: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        spawned = time.perf_counter()
        self._proc = ctx.Process(target=serve, args=(child, *args))
        self._proc.start()
        self.start_s: float = self._conn.recv()["start_s"]
        self.ready_s = time.perf_counter() - spawned

    def stats(self) -> dict[str, Any]:
        """The server's counters now."""
        self._conn.send("stats")
        return self._conn.recv()

    def stop(self) -> float:
        """Stop the server; the seconds its stop took."""
        self._conn.send("stop")
        stop_s: float = self._conn.recv()["stop_s"]
        self._proc.join(timeout=30)
        return stop_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def versions() -> dict[str, str]:
    from importlib.metadata import version

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "nvidia-pytriton": version("nvidia-pytriton"),
        "tritonclient": version("tritonclient"),
        "cpu": cpu,
        "cores": str(mp.cpu_count()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seconds", type=float, default=5.0, help="measured seconds per load level")
    add("--rows-per-request", type=int, nargs="+", default=[1, 8], help="sequences per request")
    add("--threads", type=int, default=2, help="torch threads, here and in the server")
    add("--forward-micro-batch", type=int, default=32, help="server model_forward_micro_batch_size")
    add("--preferred", type=int, nargs="+", default=[32], help="server inference_micro_batch_size")
    add("--queue-delay-us", type=int, default=2000, help="server max_queue_delay_microseconds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    pool = sequences()
    model = build_model()

    server_kwargs = server_settings(args)
    port = free_port()
    server = ChildServer(serve, port, args.threads, server_kwargs)

    levels = []
    try:
        for rows in args.rows_per_request:
            for concurrency in CONCURRENCY:
                offline_full = offline_sequences_per_s(model, pool, None)
                offline_mbs = offline_sequences_per_s(model, pool, args.forward_micro_batch)
                before = server.stats()
                result = load(port, concurrency, rows, args.seconds, pool.numpy())
                after = server.stats()
                against_offline(result, before, after, offline_full, offline_mbs)
                levels.append(result)
    finally:
        stop_s = server.stop()

    print(
        json.dumps(
            {
                "benchmark": "reward_server",
                "workload": "GPT-2 n_layer=4 n_embd=256 n_head=4 vocab=512, scalar head; 96-token sequences",
                "threads": args.threads,
                "server": server_kwargs,
                "levels": levels,
                "startup_s": server.start_s,
                "process_ready_s": server.ready_s,
                "shutdown_s": stop_s,
                "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
                "versions": versions(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
