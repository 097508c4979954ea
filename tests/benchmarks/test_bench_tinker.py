"""benchmarks/bench_tinker.py: runs are interleaved with the order rotated each round, ratios are
paired per round with the warm-up round dropped, and the in-process rows are the ones the SDK
client builds."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_tinker import batch_rows, interleaved, paired_ratio


def test_every_runner_runs_once_per_round_in_a_rotated_order():
    order = []
    runners = {n: (lambda n=n: order.append(n) or {"s": 1.0}) for n in ("a", "b", "c")}
    results = interleaved(3, runners)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {n: len(v) for n, v in results.items()} == {"a": 3, "b": 3, "c": 3}


def test_paired_ratio_drops_the_warmup_round_and_takes_the_median():
    results = {
        "x": [{"s": 100.0}, {"s": 2.0}, {"s": 6.0}, {"s": 3.0}],
        "y": [{"s": 1.0}, {"s": 1.0}, {"s": 2.0}, {"s": 1.0}],
    }
    assert paired_ratio(results, "x", "y") == 3.0  # ratios 2, 3, 3 after the warm-up


def test_rows_match_the_sdk_clients_generator():
    spec = {"prompt_tokens": 3, "response_tokens": 2, "datums": 2, "vocab": 100}
    rng = random.Random(0)  # what tinker_bench_client.py draws, in its order
    expected = [[rng.randrange(3, 100) for _ in range(6)] for _ in range(2)]
    assert batch_rows(spec) == expected
