"""Value pretraining: critic-only steps until the critic's held-out explained variance reaches the
target (or the cap), logged and resumable; decoupled GAE and the value diagnostics in a run."""

import logging
from concurrent.futures import Future

import pytest
import torch
from ppo_fakes import make_trainer, ppo_cfg

from openaligner.config import ConfigError, load_config
from openaligner.trainer.ppo_checkpoint import restore_newest_checkpoint
from openaligner.trainer.ppo_config import PPOConfig


def mean_token(batch) -> torch.Tensor:
    """[B] a reward that differs between any two responses: the mean token id of the response / 32."""
    tokens, lengths, prompts = batch["response_tokens"], batch["response_lengths"], batch["prompt_lengths"]
    pos = torch.arange(tokens.shape[1])
    resp = (pos >= prompts[:, None]) & (pos < lengths[:, None])
    return ((tokens * resp).sum(-1) / resp.sum(-1).clamp_min(1) / 32).float()


class LearningCritic:
    """A critic that learns the reward in 3 updates: its values are ``min(k/3, 1) × reward`` on
    every position after ``k`` critic_train calls (the returns at γ = 1 with no KL yet are the
    reward at every response token), so its explained variance of the returns is
    ``1 − (1 − k/3)²``: 0, 0.556, 0.889, 1. ``save``/``restore`` keep and go back to ``k``."""

    def __init__(self):
        self.critic_step = 0
        self.held: set[int] = set()
        self.sent: list[dict[str, torch.Tensor]] = []

    def infer_rm_critic(self, batch):
        reward = mean_token(batch)
        width = batch["response_tokens"].shape[1] - 1
        values = (min(self.critic_step / 3, 1.0) * reward)[:, None].expand(-1, width).clone()
        f = Future()
        f.set_result((reward, values))
        return f

    def train(self, data):
        self.sent.append(data)
        self.critic_step += 1
        f = Future()
        f.set_result({"loss": 0.0, "critic_step": float(self.critic_step), "critic_optimizer_steps": 1.0})
        return f

    def save(self):
        self.held.add(self.critic_step)
        f = Future()
        f.set_result({"status": 0, "step": self.critic_step})
        return f

    def restore(self, step):
        assert step in self.held
        self.critic_step = step
        f = Future()
        f.set_result({"status": 0, "step": step})
        return f


def _weights(t):
    return [p.detach().clone() for p in t.model.parameters()]


BASE = {"val_check_interval": 0, "save_interval": 1, "max_epochs": 10, "initial_policy_kl_penalty": 0.0}


def test_value_pretraining_stops_at_the_target_and_then_the_same_rollout_trains_the_actor(tmp_path):
    critic = LearningCritic()
    cfg = ppo_cfg(
        max_steps=2,
        **BASE,
        **{"value_pretrain.max_steps": 10, "value_pretrain.target_explained_variance": 0.8},
    )
    t = make_trainer(tmp_path, cfg, client=critic)
    before = _weights(t)
    history = t.fit()
    # held-out EV before each step's critic update: 0 (step 1), 0.556 (step 2) → critic-only;
    # 0.889 ≥ 0.8 at step 3 → pretraining ends and step 3 trains the actor; then 1 more actor step
    evs = [round(m["value/explained_variance_mc"], 3) for m in history]
    assert evs[:3] == [0.0, 0.556, 0.889]
    assert [m["value_pretrain/critic_only"] for m in history] == [1.0, 1.0, 0.0, 0.0]
    assert [m["value_pretrain/steps"] for m in history] == [1.0, 2.0, 2.0, 2.0]
    assert not any(k.startswith("policy/") for k in history[0]) and "policy/loss" in history[2]
    assert t.step == 4 and t.actor_steps == 2 and not t.value_pretraining
    assert len(critic.sent) == 4  # the critic trained on every rollout
    # the actor did not move during pretraining: the checkpoint of step 2 holds the initial weights
    straight = make_trainer(tmp_path / "x", cfg, client=LearningCritic())
    straight.load_checkpoint(tmp_path / "ckpt" / "step_2")
    assert all(torch.equal(a, b) for a, b in zip(_weights(straight), before, strict=True))


def test_value_pretraining_stops_at_its_cap_with_a_warning(tmp_path, caplog):
    critic = LearningCritic()
    cfg = ppo_cfg(
        max_steps=1,
        **BASE,
        **{"value_pretrain.max_steps": 2, "value_pretrain.target_explained_variance": 0.95},
    )
    with caplog.at_level(logging.WARNING):
        history = make_trainer(tmp_path, cfg, client=critic).fit()
    assert [m["value_pretrain/critic_only"] for m in history] == [1.0, 1.0, 0.0]
    assert "stopped at its cap, trainer.value_pretrain.max_steps=2" in caplog.text and "0.556" in caplog.text


def test_critic_warmup_steps_is_a_fixed_count_of_critic_only_steps(tmp_path):
    critic = LearningCritic()
    history = make_trainer(tmp_path, ppo_cfg(max_steps=1, critic_warmup_steps=3, **BASE), client=critic).fit()
    # no target: 3 critic-only steps whatever the explained variance (1 at the third), then the actor
    assert [m["value_pretrain/critic_only"] for m in history] == [1.0, 1.0, 1.0, 0.0]


def test_a_kill_mid_pretraining_resumes_exactly(tmp_path):
    over = {"value_pretrain.max_steps": 4, "value_pretrain.target_explained_variance": 0.95}
    cfg = ppo_cfg(max_steps=2, **BASE, **over)
    straight = make_trainer(tmp_path / "a", cfg, client=LearningCritic()).fit()
    # the same run killed after step 2 (a critic-only one; its checkpoint is written): no step 3
    critic = LearningCritic()
    killed = make_trainer(tmp_path / "b", cfg, client=critic)
    real_step = killed._one_step

    def one_step():
        if killed.step == 2:
            raise KeyboardInterrupt
        return real_step()

    killed._one_step = one_step
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    critic.critic_step = 99  # the critic server moved on (or restarted): the resume sends it back
    resumed = make_trainer(tmp_path / "b", cfg, client=critic)
    path = restore_newest_checkpoint(resumed.checkpoints, critic)
    assert path is not None and path.name == "step_2" and critic.critic_step == 2
    resumed.load_checkpoint(path)
    assert resumed.value_pretraining and resumed.value_pretrain_steps == 2
    rest = resumed.fit()
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("timing/")} for m in ms]  # noqa: E731
    assert strip(rest) == strip(straight[2:])
    assert [m["value_pretrain/critic_only"] for m in straight] == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_value_diagnostics_and_the_initial_value_scale_are_logged(tmp_path):
    critic = LearningCritic()
    cfg = ppo_cfg(max_steps=2, **BASE)
    history = make_trainer(tmp_path, cfg, client=critic).fit()
    first, second = history
    for band in ("early", "middle", "late", "final"):
        assert f"value/error_{band}" in first
    assert "value/wrong_sign_fraction" in first and "value/explained_variance_mc" in first
    # the value head's scale at initialisation: logged once, at the first step of a fresh run
    assert first["value/init_values_std"] == 0.0 and first["value/init_returns_std"] > 0
    assert not any(k.startswith("value/init_") for k in second)


def test_decoupled_critic_lambda_changes_the_critics_targets_only(tmp_path):
    runs = {}
    for name, over in {"coupled": {}, "decoupled": {"critic_gae_lambda": 1.0}}.items():
        critic = LearningCritic()
        cfg = ppo_cfg(max_steps=2, gae_lambda=0.5, **BASE, **over)
        runs[name] = (make_trainer(tmp_path / name, cfg, client=critic).fit(), critic.sent)
    (h_c, sent_c), (h_d, sent_d) = runs["coupled"], runs["decoupled"]
    # step 1: values 0 and no KL, so the only reward is the score at each response's last token.
    # λ_critic = 1: the targets are the Monte-Carlo returns, the score at every response token;
    # coupled (λ = 0.5): 0.5^(tokens to the end) × the score
    mask, returns_d, returns_c = sent_d[0]["mask"], sent_d[0]["returns"], sent_c[0]["returns"]
    last = mask.cumsum(-1).eq(mask.sum(-1, keepdim=True)) & (mask > 0)
    score = (returns_d * last).sum(-1, keepdim=True)
    assert torch.allclose(returns_d * mask, score * mask)
    to_end = (mask.sum(-1, keepdim=True) - mask.cumsum(-1)) * mask
    assert torch.allclose(returns_c * mask, score * 0.5**to_end * mask)
    assert h_d[0]["value/explained_variance"] == pytest.approx(h_d[0]["value/explained_variance_mc"])
    # the policy's advantages (λ = 0.5 in both) and so the actor's updates are the same
    for c, d in zip(h_c, h_d, strict=True):
        assert c["rollout/advantages_mean"] == d["rollout/advantages_mean"]
        assert c["policy/loss"] == d["policy/loss"]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"value_pretrain.max_steps": 2, "value_pretrain.target_explained_variance": 1.0},
            "never be reached",
        ),
        ({"value_pretrain.target_explained_variance": 0.5}, "needs a step cap"),
        ({"value_pretrain.max_steps": 2, "critic_warmup_steps": 2}, "set only one"),
        ({"value_pretrain.max_steps": -1}, "must be ≥ 0"),
        ({"critic_gae_lambda": 1.5}, "must lie in \\[0, 1\\]"),
        ({"gae_lambda_length_alpha": 0}, "must be > 0"),
        ({"advantage_estimator": "grpo", "critic_gae_lambda": 1.0}, "no critic"),
        ({"advantage_estimator": "grpo", "value_pretrain.max_steps": 1}, "nothing to warm up"),
    ],
)
def test_value_pretraining_and_decoupled_gae_settings_that_cannot_work_are_refused(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PPOConfig, None, [f"{k}={v}" for k, v in over.items()])
