"""What serving a reward function in its own worker process costs per call.

For a trivial function (the length of each response) and for the built-in sorting gold reward, on
batches of B rows: the median seconds of a direct in-process call, of a call through
:class:`openaligner.servers.reward_function.FunctionRunner` (pickled over a socket to a worker and
back), and the worker's start and restart time (what a timeout or a crash costs). Prints one JSON
object. Usage: ``python benchmarks/bench_reward_function.py [--rows 16 64] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from openaligner.servers.reward_function import FunctionRunner
from openaligner.tasks.sorting import gold_reward, make_prompt

FUNCTIONS = {"gold_reward": ("openaligner.tasks.sorting:gold_reward", gold_reward)}


def _median_s(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    t0 = time.perf_counter()
    runner = FunctionRunner("openaligner.tasks.sorting:gold_reward", workers=1)
    start_s = time.perf_counter() - t0  # the fork server's start, then the first worker's
    t0 = time.perf_counter()
    # what a timeout or a dead worker costs, besides the timeout itself: one worker forked from
    # the fork server that is already running, importing the function
    FunctionRunner("openaligner.tasks.sorting:gold_reward", workers=1).close()
    restart_s = time.perf_counter() - t0
    results = []
    for rows in args.rows:
        prompts = [make_prompt([3, 1, 2, 5, 4]) for _ in range(rows)]
        responses = ["1 2 3 4 5"] * rows
        metadata = [{} for _ in range(rows)]
        direct = _median_s(lambda: gold_reward(prompts, responses), args.calls)  # noqa: B023
        isolated = _median_s(lambda: runner(prompts, responses, metadata), args.calls)  # noqa: B023
        results.append(
            {
                "rows": rows,
                "direct_ms": round(direct * 1e3, 4),
                "isolated_ms": round(isolated * 1e3, 4),
                "overhead_ms": round((isolated - direct) * 1e3, 4),
            }
        )
    runner.close()
    print(
        json.dumps(
            {
                "function": "openaligner.tasks.sorting:gold_reward",
                "calls": args.calls,
                "worker_start_s": round(start_s, 3),
                "worker_restart_s": round(restart_s, 3),
                "results": results,
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
