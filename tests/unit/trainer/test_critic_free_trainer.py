"""The critic-free estimators in PPOTrainer's loop: groups of responses per prompt, no critic calls,
KL in the reward or in the loss, exact resume, and the settings refused because they learn nothing."""

import pytest
from ppo_fakes import Done, make_trainer, ppo_cfg, target_share

from openaligner.config import ConfigError, load_config
from openaligner.trainer.ppo_checkpoint import ACTOR_FILES
from openaligner.trainer.ppo_config import PPOConfig

ESTIMATORS = ["reinforce", "rloo", "grpo", "dr_grpo", "reinforce_pp"]


class RewardOnly:
    """A reward server's client in the trainer's shape (as ``RemoteRewardOnlyClient``): rewards =
    share of the target token, no values; records every micro-batch's prompts. It has no critic
    (no ``train`` / ``save`` / ``restore``): a trainer calling one fails."""

    def __init__(self):
        self.prompt_rows: list[list[int]] = []

    def infer_rm_critic(self, batch):
        tokens = batch["response_tokens"]
        for i, p in enumerate(batch["prompt_lengths"].tolist()):
            self.prompt_rows.append(tokens[i, :p].tolist())
        return Done((target_share(batch), None))


def cfg(estimator, **over):
    base = {"advantage_estimator": estimator, "num_rollout_samples": 4}
    if estimator == "reinforce_pp":
        base["n_samples_per_prompt"] = 4
    return ppo_cfg(**(base | over))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_samples_groups_talks_only_to_the_reward_server_and_resumes_exactly(
    tmp_path, estimator
):
    client = RewardOnly()
    straight = make_trainer(tmp_path / "a", cfg(estimator, max_steps=4, max_epochs=2), client=client).fit()
    # 4 prompts × 4 responses a step; a prompt's 4 responses are contiguous rows
    rows = client.prompt_rows[:16]
    assert [rows[i] for i in range(0, 16, 4)] == [rows[i + 1] for i in range(0, 16, 4)]
    assert all(rows[i] == rows[i + 3] for i in range(0, 16, 4))
    assert len({tuple(r) for r in rows}) == 4
    m = straight[0]
    assert m["rollout/rollout_size"] == 16 and m["rollout/consumed_samples"] == 4
    assert m["policy/optim_step"] == 2  # 16 responses / global batch 8
    assert not any(k.startswith("value/") for k in m), sorted(k for k in m if k.startswith("value/"))
    # checkpoints without a critic step: the trainer asked the estimator, not a critic
    for step in (2, 4):
        assert ACTOR_FILES.read_state(tmp_path / "a" / "ckpt" / f"step_{step}")["critic_step"] is None
    first = make_trainer(tmp_path / "b", cfg(estimator, max_steps=2, max_epochs=2), client=RewardOnly())
    first.fit()
    resumed = make_trainer(tmp_path / "b", cfg(estimator, max_steps=4, max_epochs=2), client=RewardOnly())
    resumed.load_checkpoint(resumed.checkpoints.latest())
    tail = resumed.fit()
    assert [t["step"] for t in tail] == [3.0, 4.0]
    for a, b in zip(straight[2:], tail, strict=True):
        for k in a:
            if not k.startswith("timing/"):
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), k


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_learn_the_target_token(tmp_path, estimator):
    c = cfg(
        estimator,
        max_steps=12,
        max_epochs=12,
        val_check_interval=0,
        save_interval=0,
        initial_policy_kl_penalty=0.0,
        gate_unfinished="false",
    )
    history = make_trainer(tmp_path, c, client=RewardOnly()).fit()
    early = sum(m["rollout/rewards"] for m in history[:3]) / 3
    late = sum(m["rollout/rewards"] for m in history[-3:]) / 3
    assert late > early + 0.1, (early, late)


def test_kl_as_a_loss_term_leaves_the_reward_alone_and_enters_the_loss(tmp_path):
    over = {"max_steps": 2, "max_epochs": 2, "initial_policy_kl_penalty": 0.5, "val_check_interval": 0}
    in_loss = make_trainer(tmp_path / "l", cfg("grpo", kl_in="loss", **over), client=RewardOnly()).fit()
    in_reward = make_trainer(tmp_path / "r", cfg("grpo", kl_in="reward", **over), client=RewardOnly()).fit()
    # step 1 samples from the initial policy: the same rollouts either way
    assert in_loss[0]["rollout/rewards"] == in_reward[0]["rollout/rewards"]
    # in the loss: the estimator's reward is the score alone; the KL term shows in the update
    assert in_loss[1]["rollout/rewards_with_kl"] == pytest.approx(in_loss[1]["rollout/rewards"], abs=1e-6)
    assert in_loss[1]["rollout/init_policy_kl"] > 0
    assert in_loss[1]["policy/kl_loss"] > 0
    # in the reward: the reward carries −β·KL and the loss has no KL term
    assert in_reward[1]["rollout/rewards_with_kl"] < in_reward[1]["rollout/rewards"]
    assert in_reward[1]["policy/kl_loss"] == 0.0


def test_defaults_follow_the_estimator():
    grpo = load_config(PPOConfig, None, ["advantage_estimator=grpo"])
    assert (grpo.n_samples_per_prompt, grpo.kl_in, grpo.kl_kind) == (4, "loss", "k3")
    assert grpo.loss_aggregation == "seq_mean_token_mean"
    dr = load_config(PPOConfig, None, ["advantage_estimator=dr_grpo"])
    assert dr.loss_aggregation == "seq_mean_token_sum_norm"
    ppo = load_config(PPOConfig, None, [])
    assert (ppo.n_samples_per_prompt, ppo.kl_in, ppo.kl_kind, ppo.uses_critic) == (1, "reward", "abs", True)
    rloo = load_config(PPOConfig, None, ["advantage_estimator=RLOO", "n_samples_per_prompt=2"])
    assert (rloo.advantage_estimator, rloo.rollout_rows, rloo.uses_critic) == ("rloo", 128, False)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["advantage_estimator=grpo", "n_samples_per_prompt=1"], "learns nothing"),
        (["advantage_estimator=rloo", "n_samples_per_prompt=1"], "learns nothing"),
        (["advantage_estimator=grpo", "sampling.use_greedy=true"], "same response"),
        (["advantage_estimator=grpo", "critic_warmup_steps=1"], "no critic"),
        (["advantage_estimator=ppo"], "advantage_estimator"),
        (["kl_in=logits"], "kl_in"),
        (["advantage_estimator=grpo", "global_batch_size=24"], "n_samples_per_prompt = 256"),
    ],
)
def test_settings_that_would_learn_nothing_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(PPOConfig, None, overrides)


def test_groups_stay_on_one_rank():
    c = load_config(
        PPOConfig,
        None,
        [
            "advantage_estimator=grpo",
            "num_rollout_samples=6",
            "rollout_micro_batch_size=4",
            "global_batch_size=8",
            "val_check_interval=0",
        ],
    )
    with pytest.raises(ValueError, match="num_rollout_samples=6 must be a multiple of ranks = 4"):
        c.check_world_size(4)
    c.check_world_size(2)  # 3 prompts × 4 responses per rank, 3 micro-batches of 4


@pytest.mark.parametrize(("estimator", "name"), [("grpo", "GRPO"), ("rloo", "RLOO"), ("gae", "PPO")])
def test_the_progress_bar_and_the_closing_line_name_the_algorithm_that_runs(
    tmp_path, capsys, estimator, name
):
    from openaligner.cli.train_ppo import closing_line

    client = RewardOnly() if estimator != "gae" else None
    settings = cfg(estimator, max_steps=1, max_epochs=2) if client else ppo_cfg(max_steps=1, max_epochs=2)
    trainer = make_trainer(tmp_path, settings, client=client)
    trainer.progress = True
    trainer.fit()
    assert f"{name} step" in capsys.readouterr().err
    line = closing_line(estimator, trainer, tmp_path / "actor")
    assert line.startswith(f"train-ppo: {name}, steps 0 → 1; rollout/rewards=")
    assert line.endswith(f"; actor saved to {tmp_path / 'actor'}")


def test_the_progress_bar_shows_each_steps_own_metrics_when_it_advances(tmp_path, monkeypatch):
    """update() draws the bar: the postfix set after it showed the step before (it lagged a step)."""
    from openaligner.trainer import ppo
    from openaligner.trainer.ppo_metrics import progress_postfix

    class Bar:
        def __init__(self) -> None:
            self.postfix, self.shown = "", []

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def update(self, n=1):
            self.shown.append(self.postfix)  # what the drawn line carries at this step

        def close(self):
            pass

    bar = Bar()
    monkeypatch.setattr(ppo, "_progress", lambda *args, **kwargs: bar)
    trainer = make_trainer(tmp_path, cfg("grpo", max_steps=2, max_epochs=2), client=RewardOnly())
    history = trainer.fit()
    assert bar.shown == [progress_postfix(m) for m in history]
    assert bar.shown[0] != bar.shown[1]
