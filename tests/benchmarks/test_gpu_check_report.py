"""benchmarks/gpu_check.py's bookkeeping: how a check's outcome is recorded and rendered."""

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_check import Skip, markdown, run_check


def _fails() -> dict:
    raise RuntimeError("train-sft exited 1: CUDA out of memory")


def _skips() -> dict:
    raise Skip("no CUDA device")


def test_a_check_is_ok_skipped_with_its_reason_or_failed_with_its_error():
    ok = run_check("train_sft", lambda: {"steps": 2})
    assert (ok.status, ok.details, ok.reason, ok.error) == ("ok", {"steps": 2}, None, None)
    skipped = run_check("gpu_tests", _skips)
    assert (skipped.status, skipped.reason) == ("skipped", "no CUDA device")
    failed = run_check("train_rm", _fails)
    assert failed.status == "failed" and "CUDA out of memory" in failed.error
    assert all(c.seconds >= 0 for c in (ok, skipped, failed))


def test_the_table_names_every_check_and_the_engines_figures():
    engine = {
        "engine": "vllm", "shape": "0.5b", "prompts": 64, "samples": 4, "new_tokens": 256, "step_s": 12.5,
        "generate_s": 4.0, "rollout_tokens_per_s": 16384.0, "weight_sync_s": 1.25, "actor_update_s": 6.0,
        "actor_update_mfu": 0.3125, "peak_gpu_bytes": 24 * 2**30,
    }  # fmt: skip
    checks = [
        run_check("gpu_tests", _skips),
        run_check("train_rm", _fails),
        run_check("ppo_vllm", lambda: engine),
    ]
    result = {
        "mode": "gpu",
        "machine": {"device": "NVIDIA H100", "torch": "2.13.0", "python": "3.11.7", "loadavg_1min": 0.5},
        "total_s": 300.0,
        "checks": [asdict(c) for c in checks],
    }
    table = markdown(result)
    assert "| gpu_tests | skipped |" in table and "no CUDA device" in table
    assert "| train_rm | failed |" in table and "CUDA out of memory" in table
    assert "| vllm | 0.5b | 256 × 256 | 12.50 | 4.00 | 16,384 | 1.25 | 6.00 | 31.2% | 24.0 |" in table
