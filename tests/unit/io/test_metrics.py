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
