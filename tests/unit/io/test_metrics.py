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
