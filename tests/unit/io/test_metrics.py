import json
import math

from openaligner.io.metrics import MetricsLogger, read_jsonl


def test_jsonl_and_tensorboard_sinks(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"rollout/rewards": 1.5, "policy/loss": float("nan")}, step=3)
    logger.log_table("table/train_rollouts", [{"prompt": "p", "response": "r", "reward": 0.5}], step=3)
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 3, "rollout/rewards": 1.5, "policy/loss": None}]
    tables = read_jsonl(tmp_path / "tables.jsonl")
    assert tables[0]["rows"][0]["response"] == "r"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (event,) = acc.Scalars("rollout/rewards")
    assert event.step == 3 and math.isclose(event.value, 1.5)


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "x", enabled=False)
    logger.log({"a": 1.0}, step=0)
    logger.close()
    assert not (tmp_path / "x").exists()


def test_rollout_records_go_to_their_own_jsonl_with_null_for_non_finite_floats(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"rollout/rewards": 1.0}, step=1)
    assert not (tmp_path / "rollouts.jsonl").exists()  # opened by the first rollout records only
    logger.log_rollouts(
        [{"step": 1, "sample": 0, "reward": 1 / 3}, {"step": 1, "sample": 1, "reward": math.nan}]
    )
    logger.close()
    lines = (tmp_path / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=_not_json) for line in lines] == [
        {"step": 1, "sample": 0, "reward": 1 / 3},
        {"step": 1, "sample": 1, "reward": None},
    ]


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def _tensorboard_steps(log_dir) -> dict[str, list[int]]:
    """Every scalar tag's steps over all event files under ``log_dir/tensorboard``, sorted (two
    files written within one second may sort either way by name)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps: dict[str, list[int]] = {}
    for path in sorted((log_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    return {tag: sorted(s) for tag, s in steps.items()}


def test_a_resumed_run_rewinds_tensorboard_so_no_step_appears_twice(tmp_path):
    """A run killed after step 5 whose newest checkpoint is step 3 runs steps 4 and 5 again: the
    first run's events of those steps are gone from its event file, the JSONL likewise."""
    from openaligner.io.metrics import open_run_logs

    first = open_run_logs(tmp_path, None)
    for step in range(1, 6):
        first.log({"train/loss": 1.0 / step}, step)
    first.close()
    again = open_run_logs(tmp_path, 3)
    for step in (4, 5):
        again.log({"train/loss": 2.0 / step}, step)
    again.close()
    assert _tensorboard_steps(tmp_path) == {"train/loss": [1, 2, 3, 4, 5]}
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # a fresh run (nothing resumed) starts its logs over
    open_run_logs(tmp_path, None).close()
    assert _tensorboard_steps(tmp_path) == {} and read_jsonl(tmp_path / "metrics.jsonl") == []
