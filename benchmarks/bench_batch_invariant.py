"""The cost of batch-invariant serving (``server.batch_invariant``), side by side in one run.

Two servers of the same kind run at once in child processes, one with ``batch_invariant=false``
and one with ``true``, on the canonical workload (/work/shared/bench/workload.md) and the load of
``bench_reward_server.py`` / ``bench_critic_server.py``: closed-loop ``tritonclient`` clients
sending 96-token sequences, ``--rows-per-request`` rows per request, at 1, 8 and 32 concurrent
clients, with the same serving settings (forward micro-batch 32, preferred batch 32, queue delay
2 ms, max batch 256). Each load level is measured on the plain server and then on the invariant
one, back to back (the order alternating from level to level), so that the shared machine's load
drift hits both; only one server is loaded at a time. ``--server critic`` serves critic_infer in
combined mode (values and rewards per request).

Prints one JSON object: per level, sequences/s of each, their ratio (invariant / plain), mean
formed batch and p50 latency. Usage:
``python benchmarks/bench_batch_invariant.py [--server reward|critic] [--seconds 5] [--threads 2]``.

``--formed-batches 1 4 16 8 33 92`` instead times the served callable alone, in this process (no
Triton, no HTTP): the endpoint's ``run`` on formed batches of those sizes — by default the mean
formed batches of the reward server benchmark's six load levels (docs/benchmarks.md) — for the
plain and the invariant endpoint alternately, ``--repeats`` times each, medians. That is the part
of a request's cost the setting changes, measurable when the shared machine is too loaded for the
closed-loop levels (their clients time out).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

import bench_critic_server
import bench_reward_server
from bench_reward_server import ChildServer, free_port, server_settings, versions

CONCURRENCY = (1, 8, 32)


def callable_only(args: argparse.Namespace) -> dict[str, Any]:
    """The endpoints' ``run`` alone on formed batches of ``args.formed_batches`` rows."""
    import statistics
    import time

    import numpy as np

    torch.set_num_threads(args.threads)
    if args.server == "reward":
        from openaligner.servers.reward import RewardModelServer

        model = bench_reward_server.build_model()

        def endpoint(invariant: bool) -> Any:
            settings = {**server_settings(args), "batch_invariant": invariant}
            return RewardModelServer(infer_fn=model.infer, vocab_size=512, **settings).endpoint
    else:
        from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
        from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

        critic, rm = bench_critic_server.build_models()

        def endpoint(invariant: bool) -> Any:
            cfg = CriticServerConfig(port=0, **server_settings(args), batch_invariant=invariant)
            trainer = CriticTrainer(
                CriticTrainConfig(global_batch_size=64),
                critic,
                torch.optim.AdamW(critic.parameters()),
                batch_invariant_multiple=cfg.fixed_width_multiple(),
            )
            return CriticServerTrainer(cfg, trainer, None, reward_model=rm).infer_endpoint

    pool = bench_reward_server.sequences().numpy()
    endpoints = {invariant: endpoint(invariant) for invariant in (False, True)}
    levels = []
    for size in args.formed_batches:
        rows = [pool[i % len(pool)][None] for i in range(size)]
        times: dict[bool, list[float]] = {False: [], True: []}
        for k in range(args.repeats + 1):  # the first of each is a warm-up
            for invariant in (False, True) if k % 2 == 0 else (True, False):
                e = endpoints[invariant]
                requests = [
                    e.validate({"tokens": r, "sequence_lengths": np.full((1, 1), r.shape[1], np.int64)})
                    for r in rows
                ]
                started = time.perf_counter()
                e.run(requests)
                if k:
                    times[invariant].append(time.perf_counter() - started)
        plain, invariant = statistics.median(times[False]), statistics.median(times[True])
        levels.append(
            {
                "formed_batch_rows": size,
                "plain_s": plain,
                "invariant_s": invariant,
                "plain_sequences_per_s": size / plain,
                "invariant_sequences_per_s": size / invariant,
                "ratio_invariant_to_plain_throughput": plain / invariant,
            }
        )
    return {"mode": "callable only (no Triton)", "repeats": args.repeats, "formed_batches": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--server", choices=("reward", "critic"), default="reward")
    add("--seconds", type=float, default=5.0, help="measured seconds per load level and setting")
    add("--rows-per-request", type=int, nargs="+", default=[1, 8], help="sequences per request")
    add("--threads", type=int, default=2, help="torch threads in each server")
    add("--forward-micro-batch", type=int, default=32, help="server model_forward_micro_batch_size")
    add("--preferred", type=int, nargs="+", default=[32], help="server inference_micro_batch_size")
    add("--queue-delay-us", type=int, default=2000, help="server max_queue_delay_microseconds")
    add("--formed-batches", type=int, nargs="*", help="time the served callable alone on these batch sizes")
    add("--repeats", type=int, default=5, help="with --formed-batches: timed runs per size and setting")
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.formed_batches:
        out = callable_only(args)
        print(
            json.dumps(
                {
                    "benchmark": "batch_invariant",
                    "server": args.server,
                    "threads": args.threads,
                    "settings": server_settings(args),
                    **out,
                    "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
                    "versions": versions(),
                },
                indent=2,
            )
        )
        return
    bench: Any = bench_reward_server if args.server == "reward" else bench_critic_server
    base = server_settings(args)
    if args.server == "critic":
        base["train_micro_batch_size"] = 16
    pool = bench.sequences().numpy()
    servers: dict[bool, tuple[ChildServer, int]] = {}
    levels = []
    try:
        for invariant in (False, True):
            port = free_port()
            servers[invariant] = (
                ChildServer(bench.serve, port, args.threads, {**base, "batch_invariant": invariant}),
                port,
            )
        k = 0
        for rows in args.rows_per_request:
            for concurrency in CONCURRENCY:
                level: dict[str, Any] = {"rows_per_request": rows, "concurrency": concurrency}
                for invariant in (False, True) if k % 2 == 0 else (True, False):
                    server, port = servers[invariant]
                    before = server.stats()
                    result = bench.load(port, concurrency, rows, args.seconds, pool)
                    after = server.stats()
                    calls = max(1, after["calls"] - before["calls"])
                    level["invariant" if invariant else "plain"] = {
                        "sequences_per_s": result["sequences_per_s"],
                        "mean_formed_batch_rows": (after["rows"] - before["rows"]) / calls,
                        "latency_p50_ms": result["latency_p50_ms"],
                    }
                level["ratio_invariant_to_plain"] = (
                    level["invariant"]["sequences_per_s"] / level["plain"]["sequences_per_s"]
                )
                levels.append(level)
                k += 1
    finally:
        for server, _ in servers.values():
            server.stop()
    print(
        json.dumps(
            {
                "benchmark": "batch_invariant",
                "server": args.server,
                "threads": args.threads,
                "settings": base,
                "levels": levels,
                "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
                "versions": versions(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
