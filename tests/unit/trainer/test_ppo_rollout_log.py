"""The per-sample rollout log (``logs/rollouts.jsonl``): every response of a step, stepped as
``metrics.jsonl``, its fields those of the batch the trainer trained on, each step once after a
resume."""

import json

import pytest
import torch
from ppo_fakes import TargetTokenScorer, count_target, make_trainer, ppo_cfg
from test_critic_free_trainer import RewardOnly

from openaligner.algorithms import kl_penalty, masked_mean, masked_sum
from openaligner.config import ConfigError, load_config
from openaligner.io.metrics import read_jsonl, rewind_logs
from openaligner.trainer.ppo_config import PPOConfig


def by_step(rows):
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["step"], []).append(r)
    return out


def capture_ppo_data(trainer):
    """Record every (RolloutBatch, PPOData) the trainer makes, in order."""
    seen = []
    original = trainer.generate_ppo_data

    def wrapped(batch):
        data, metrics = original(batch)
        seen.append((batch, data))
        return data, metrics

    trainer.generate_ppo_data = wrapped
    return seen


def test_rollout_log_and_train_table_are_stepped_as_metrics_and_hold_every_rollout(tmp_path):
    t = make_trainer(tmp_path, ppo_cfg(max_steps=2, max_epochs=2, critic_warmup_steps=1))
    t.fit()
    logs = tmp_path / "logs"
    steps = [m["step"] for m in read_jsonl(logs / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    rollouts = by_step(read_jsonl(logs / "rollouts.jsonl"))
    assert list(rollouts) == steps  # the warm-up rollout is a (critic-only) step of its own, logged too
    for rows in rollouts.values():
        assert [r["sample"] for r in rows] == list(range(16))  # num_rollout_samples=16, 1 response each
    tables = [r for r in read_jsonl(logs / "tables.jsonl") if r["table"] == "table/train_rollouts"]
    assert [r["step"] for r in tables] == steps


def test_rollout_fields_are_those_of_the_batch_the_trainer_used_at_full_precision(tmp_path):
    cfg = ppo_cfg(max_steps=2, max_epochs=2)
    t = make_trainer(tmp_path, cfg, scorer=count_target)
    seen = capture_ppo_data(t)
    t.fit()
    rollouts = by_step(read_jsonl(tmp_path / "logs" / "rollouts.jsonl"))
    assert len(seen) == 2
    for (batch, data), rows in zip(seen, rollouts.values(), strict=True):
        assert len(rows) == len(batch) == 16
        kl = masked_sum(kl_penalty(batch.logprobs, batch.init_logprobs, cfg.kl_kind), data.mask, dim=-1)
        for i, r in enumerate(rows):
            p, n = int(batch.prompt_lengths[i]), int(batch.sequence_lengths[i])
            tokens = batch.sequence_tokens[i].tolist()
            assert r["prompt"] == t.decode(tokens[:p])
            assert r["prompt_tokens"] == p and r["response_tokens"] == n - p
            assert r["ended"] is bool(batch.is_end[i])
            assert r["group"] == i  # one response per prompt
            # exactly the reward the trainer got: not rounded (a share like 1/3 has no 4-digit form)
            assert r["reward"] == float(batch.rewards[i])
            assert r["score"] == count_target([r["prompt"]], [r["response"]])[0]
            assert r["kl"] == pytest.approx(float(kl[i]), rel=1e-12)
            assert r["value"] == pytest.approx(float(masked_mean(data.values[i], data.mask[i])), abs=1e-12)
            assert r["return"] == pytest.approx(float(masked_mean(data.returns[i], data.mask[i])), rel=1e-12)
            adv = float(masked_mean(data.advantages[i], data.mask[i]))
            assert r["advantage"] == pytest.approx(adv, rel=1e-12)
        assert any(r["reward"] != round(r["reward"], 4) for r in rows)
        assert len({r["advantage"] for r in rows}) > 1


def test_critic_free_rollout_log_writes_what_exists(tmp_path):
    cfg = ppo_cfg(advantage_estimator="grpo", num_rollout_samples=4, max_steps=1, save_interval=0)
    t = make_trainer(tmp_path, cfg, client=RewardOnly())
    seen = capture_ppo_data(t)
    t.fit()
    ((batch, data),) = seen
    rows = read_jsonl(tmp_path / "logs" / "rollouts.jsonl")
    assert [r["sample"] for r in rows] == list(range(16))
    assert [r["group"] for r in rows] == [i // 4 for i in range(16)]  # 4 responses per prompt
    assert len({r["prompt"] for r in rows if r["group"] == 0}) == 1
    for i, r in enumerate(rows):
        assert "value" not in r and "return" not in r and "score" not in r  # no critic, no task scorer
        assert r["reward"] == float(batch.rewards[i])
        # GRPO's advantage is one number per response, on every response token
        assert r["advantage"] == pytest.approx(float(data.advantages[i][data.mask[i].bool()][0]), rel=1e-6)
        assert r["kl"] >= 0.0  # kl_in=loss: the rollout's KL to the initial policy is still logged


def test_without_an_init_policy_the_log_has_no_kl(tmp_path):
    cfg = ppo_cfg(max_steps=1, save_interval=0, val_check_interval=0, initial_policy_kl_penalty=0)
    make_trainer(tmp_path, cfg).fit()
    rows = read_jsonl(tmp_path / "logs" / "rollouts.jsonl")
    assert len(rows) == 16 and all("kl" not in r for r in rows)


@pytest.mark.parametrize(("count", "expected"), [(5, 5), (0, 0), (100, 16)])
def test_rollout_log_rows_caps_the_responses_written_per_step(tmp_path, count, expected):
    cfg = ppo_cfg(max_steps=2, max_epochs=2, save_interval=0, val_check_interval=0, rollout_log_rows=count)
    make_trainer(tmp_path, cfg).fit()
    path = tmp_path / "logs" / "rollouts.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    assert [r["sample"] for r in rows] == list(range(expected)) * (2 if expected else 0)


def test_a_negative_rollout_log_rows_is_refused():
    with pytest.raises(ConfigError, match=r"trainer\.rollout_log_rows.*null"):
        load_config(PPOConfig, None, ["rollout_log_rows=-1"])


class FailsSecondSave(TargetTokenScorer):
    """The checkpoint of step 4 never completes: the run dies after logging steps 3 and 4."""

    def save(self):
        if self.save_calls == 1:
            raise RuntimeError("killed")
        return super().save()


def test_resume_leaves_one_set_of_rollout_rows_per_step(tmp_path):
    cut = make_trainer(tmp_path, ppo_cfg(max_steps=4, max_epochs=2), client=FailsSecondSave())
    with pytest.raises(RuntimeError, match="killed"):
        cut.fit()
    cut.logger.close()
    logs = tmp_path / "logs"
    before = by_step(read_jsonl(logs / "rollouts.jsonl"))
    assert list(before) == [1, 2, 3, 4]
    # what train-ppo does on resume: the logs back to the checkpoint's step, then the steps run again
    assert cut.checkpoints.latest().name == "step_2"
    rewind_logs(logs, 2)
    resumed = make_trainer(tmp_path, ppo_cfg(max_steps=4, max_epochs=2))
    resumed.load_checkpoint(resumed.checkpoints.latest())
    resumed.fit()
    after = by_step(read_jsonl(logs / "rollouts.jsonl"))
    assert list(after) == [1, 2, 3, 4] and all(len(rows) == 16 for rows in after.values())
    assert [m["step"] for m in read_jsonl(logs / "metrics.jsonl")] == [1, 2, 3, 4]
    # the steps run again drew the same rollouts (exact resume)
    for step in (3, 4):
        for a, b in zip(before[step], after[step], strict=True):
            assert (a["prompt"], a["response"], a["reward"]) == (b["prompt"], b["response"], b["reward"])


def test_rollout_log_rows_are_json_with_null_for_non_finite_values(tmp_path):
    class NaNReward(TargetTokenScorer):
        def infer_rm_critic(self, batch):
            rewards, values = super().infer_rm_critic(batch).result()
            rewards[0] = float("nan")
            return type("F", (), {"result": lambda self: (rewards, values)})()

    cfg = ppo_cfg(max_steps=1, save_interval=0, val_check_interval=0, max_nonfinite_steps_in_a_row=5)
    make_trainer(tmp_path, cfg, client=NaNReward()).fit()
    lines = (tmp_path / "logs" / "rollouts.jsonl").read_text().splitlines()
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert first["reward"] is None and isinstance(json.loads(lines[1])["reward"], float)
    assert torch.isfinite(torch.tensor(json.loads(lines[1])["reward"]))
