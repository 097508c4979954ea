"""train-ppo's log rewind on resume: records of steps run again, and a line cut short by a crash,
are dropped so that every step appears once."""

import json

from openaligner.io.metrics import read_jsonl, rewind_logs


def test_rewind_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    metrics = [{"step": s, "rollout/rewards": s / 10} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in metrics) + '{"step": 4, "rollout/rew'  # killed mid-write
    )
    tables = [{"step": s, "table": "table/train_rollouts", "rows": []} for s in (2, 3)]
    (tmp_path / "tables.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tables))
    rollouts = [{"step": s, "sample": i, "reward": 0.1} for s in (1, 2, 3) for i in range(2)]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    assert rewind_logs(tmp_path, 2) == 5
    assert read_jsonl(tmp_path / "metrics.jsonl") == metrics[:2]
    assert read_jsonl(tmp_path / "tables.jsonl") == tables[:1]
    assert read_jsonl(tmp_path / "rollouts.jsonl") == rollouts[:4]
    assert rewind_logs(tmp_path, 2) == 0  # nothing more to drop


def test_rewind_to_zero_empties_the_logs_of_a_run_that_never_checkpointed(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert rewind_logs(tmp_path, 0) == 1
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert rewind_logs(tmp_path / "missing", 0) == 0
