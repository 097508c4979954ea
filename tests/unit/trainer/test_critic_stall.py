"""The critic-stall rule on hand-made explained-variance sequences, its config checks, and a PPO
run whose critic does not learn (an in-process CriticTrainer at a tiny learning rate) warning once."""

import logging
import math

import pytest
import torch
from ppo_fakes import make_trainer, ppo_cfg
from test_value_pretrain import LearningCritic

from openaligner.config import ConfigError, load_config
from openaligner.trainer.critic import CriticBatch, CriticTrainConfig, CriticTrainer
from openaligner.trainer.critic_stall import CriticStallCheck, CriticStallError
from openaligner.trainer.ppo_config import PPOConfig


def verdicts(evs, updates=3, min_rise=0.1, min_ev=0.5):
    check = CriticStallCheck(updates, min_rise, min_ev)
    return [v for v in (check.observe(ev) for ev in evs) if v is not None]


def test_a_flat_explained_variance_stalls_once_at_the_step_after_the_last_update():
    check = CriticStallCheck(3, 0.1, 0.5)
    # before any update 0.30, then after 1, 2, 3 updates: 0.32, 0.29, 0.35 (best 0.35 < 0.30 + 0.1)
    out = []
    for ev in [0.30, 0.32, 0.29, 0.35, 0.30, 0.31]:
        out.append(check.observe(ev))
        check.update(0.30, 0.305)  # each update gained 0.005 on its own rows: it hardly moved
    assert out[:3] == [None, None, None] and out[4:] == [None, None]  # judged once, at the 4th value
    stall = out[3]
    assert (stall.updates, stall.first, stall.best, stall.last) == (3, 0.30, 0.35, 0.35)
    assert stall.update_gain == pytest.approx(0.005) and stall.worst_update_gain == pytest.approx(0.005)
    text = stall.message()
    assert "0.300 → 0.350, at best 0.350" in text and "trainer.critic_stall.mode=ignore" in text
    assert "too small — raise serve-critic's optim.lr" in text


@pytest.mark.parametrize(
    ("gains", "cause"),
    [
        # the demo at 100× its critic lr: its first update lowered its own rows' EV 0.31 → 0.00
        ([(0.31, 0.0), (0.0, 0.01)], "(gain -0.310): the critic's learning rate is likely too large"),
        # at 1/10: a little better on its own rows each time
        ([(0.31, 0.34), (0.34, 0.36)], "moved it only a little even on the rows"),
        # at 1/100: the updates hardly move it, though the rollouts (and the held-out figure) change
        ([(0.11, 0.11), (-0.41, -0.40)], "hardly moved it even on the rows"),
        # a server that does not report its rows' explained variance after the update
        ([(0.31, float("nan"))] * 2, "too small (updates that do not move it) or too large"),
    ],
)
def test_the_cause_follows_the_updates_gain_on_their_own_rows(gains, cause):
    check = CriticStallCheck(2, 0.1, 0.5)
    for ev, (before, after) in zip([0.30, -0.1], gains, strict=True):
        assert check.observe(ev) is None
        check.update(before, after)
    stall = check.observe(-0.2)
    assert stall is not None and cause in stall.message()


def test_a_rise_or_a_good_critic_is_silent():
    assert verdicts([0.30, 0.32, 0.45, 0.31]) == []  # rose by 0.15 ≥ 0.1 once: learning
    assert verdicts([0.80, 0.79, 0.81, 0.80]) == []  # no rise, but already ≥ 0.5
    assert verdicts([0.30, 0.30, 0.30]) == []  # not yet 3 updates
    # the value before the first update does not count toward the best: 0.6 was the start
    assert len(verdicts([0.60, 0.45, 0.40, 0.42], min_ev=0.7)) == 1


# The demo's full mode, seed 1, at its own critic lr (runs of benchmarks/bench_demo_ppo_settings.py):
# the held-out EV before each of the first 16 critic updates, and each update's own-row EV during
# and after it. The gold rose 46.8 → 91.3; the check used to warn "lr too small" here.
DEMO_FULL_SEED1_EV = [0.395, 0.366, 0.311, 0.453, 0.096, 0.099, 0.081, 0.39,
                      0.454, 0.404, 0.276, 0.294, 0.209, 0.389, 0.305, 0.313]  # fmt: skip
DEMO_FULL_SEED1_ROWS = [
    (0.418, 0.604), (0.407, 0.492), (0.345, 0.441), (0.485, 0.544), (0.12, 0.216), (0.122, 0.236),
    (0.099, 0.21), (0.421, 0.462), (0.48, 0.515), (0.429, 0.465), (0.308, 0.358), (0.338, 0.385),
    (0.276, 0.329), (0.427, 0.477), (0.343, 0.37), (0.358, 0.418),
]  # fmt: skip


def judged(evs, rows, **kw):
    check = CriticStallCheck(15, 0.2, 0.5, **kw)
    out = []
    for ev, (before, after) in zip(evs, rows, strict=True):
        out.append(check.observe(ev))
        check.update(before, after)
    return [v for v in out if v is not None]


def test_updates_that_move_the_critic_on_their_own_rows_are_not_a_stalled_rate():
    # best 0.454 after 15 updates, from 0.395: no rise of 0.2, not 0.5 — but every update gained
    # +0.03 to +0.19 on its own rows (mean +0.072): the rate moves the critic; nothing to warn of
    assert judged(DEMO_FULL_SEED1_EV, DEMO_FULL_SEED1_ROWS) == []
    # the same held-out figures with updates that hardly move it (1/100 of the rate) still warn
    small = [(b, b + 0.003) for b, _ in DEMO_FULL_SEED1_ROWS]
    assert len(judged(DEMO_FULL_SEED1_EV, small)) == 1
    # ... and so do large gains with one overshoot among them (too large a rate)
    over = [*DEMO_FULL_SEED1_ROWS[:5], (0.3, 0.1), *DEMO_FULL_SEED1_ROWS[6:]]
    (stall,) = judged(DEMO_FULL_SEED1_EV, over)
    assert "too large" in stall.cause
    # the threshold is a setting: .inf judges on the held-out figure alone, as before
    assert len(judged(DEMO_FULL_SEED1_EV, DEMO_FULL_SEED1_ROWS, min_update_gain=math.inf)) == 1
    # a server that reports no own-row figures: judged on the held-out figure alone
    nan = [(math.nan, math.nan)] * 16
    assert len(judged(DEMO_FULL_SEED1_EV, nan)) == 1


def test_nan_values_count_as_updates_but_are_no_evidence():
    assert len(verdicts([math.nan, 0.30, 0.30, 0.31, 0.30])) == 1  # first finite is the start
    assert verdicts([math.nan] * 5) == []  # nothing to judge
    assert verdicts([0.30, math.nan, math.nan, math.nan]) == []  # no value after an update


def test_config_refuses_what_the_check_cannot_apply():
    assert load_config(PPOConfig, None, []).critic_stall.mode == "warn"
    for over, key in [
        ("critic_stall.mode=loud", "critic_stall.mode"),
        ("critic_stall.updates=0", "critic_stall.updates"),
        ("critic_stall.min_rise=-0.1", "critic_stall.min_rise"),
        ("critic_stall.min_update_gain=-0.1", "critic_stall.min_update_gain"),
        ("critic_stall.min_explained_variance=1.5", "critic_stall.min_explained_variance"),
    ]:
        with pytest.raises((ConfigError, ValueError), match=f"trainer.{key}"):
            load_config(PPOConfig, None, [over])


class InProcessCritic:
    """The real CriticTrainer in the trainer's process behind the critic client's methods: values of
    a tiny critic model with a zero head (rewards from ``reward``), ``critic_train`` one pass at
    Adam ``lr``: a constant value has explained variance 0 on every rollout until the head learns."""

    def __init__(self, tiny, lr, reward):
        model = tiny.critic()
        with torch.no_grad():  # a fresh value head starts at 0 (CriticModel.from_pretrained): EV 0
            model.head.weight.zero_()
            if model.head.bias is not None:
                model.head.bias.zero_()
        self.trainer = CriticTrainer(
            CriticTrainConfig(global_batch_size=16, micro_batch_size=16),
            model,
            torch.optim.Adam(model.parameters(), lr=lr),
        )
        self.reward = reward
        self.updates = 0

    def infer_rm_critic(self, batch):
        from concurrent.futures import Future

        tokens = batch["response_tokens"]
        with torch.no_grad():
            values = self.trainer.model.standardize(self.trainer.model(tokens))[:, : tokens.shape[1] - 1]
        f = Future()
        f.set_result((self.reward(batch), values.float()))
        return f

    def train(self, data):
        from concurrent.futures import Future

        batch = CriticBatch(data["response_tokens"], data["returns"], data["values"], data["mask"])
        r = self.trainer.train_pass(batch)
        self.updates += 1
        f = Future()  # the figures the critic client returns (clients/critic.py)
        f.set_result(
            {
                "loss": r.loss_mean,
                "train_explained_variance": r.explained_variance,
                "explained_variance_after": r.explained_variance_after,
            }
        )
        return f

    def save(self):
        from concurrent.futures import Future

        f = Future()
        f.set_result({"status": 0, "step": self.updates})
        return f


def first_token(batch):
    """[B] a reward the critic can learn at every position: the prompt's first token (3..22) / 22."""
    return (batch["response_tokens"][:, 0] / 22).float()


CFG = {
    "val_check_interval": 0,
    "save_interval": 0,
    "max_epochs": 10,
    "initial_policy_kl_penalty": 0.0,
    "critic_stall.min_rise": 0.1,
    "critic_stall.min_explained_variance": 0.9,
}


def stall_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "the critic is not learning" in r.getMessage()]


def test_a_ppo_run_whose_critic_does_not_learn_warns_once(tiny, tmp_path, caplog):
    critic = InProcessCritic(tiny, 1e-9, first_token)
    cfg = ppo_cfg(max_steps=5, **CFG, **{"critic_stall.updates": 3})
    with caplog.at_level(logging.WARNING, logger="openaligner.trainer.ppo"):
        history = make_trainer(tmp_path, cfg, client=critic).fit()
    evs = [m["value/explained_variance_mc"] for m in history]
    assert max(abs(ev) for ev in evs) < 1e-3  # a constant critic explains nothing, and stays so
    (warning,) = stall_warnings(caplog)  # once, though 5 steps ran
    assert "after 3 critic updates" in warning and "too small — raise serve-critic's optim.lr" in warning
    assert critic.updates == 5  # a warning: the run went on


def test_a_ppo_run_whose_critic_learns_is_silent(tmp_path, caplog):
    critic = LearningCritic()  # held-out explained variance 0, 0.556, 0.889, 1 after 0..3 updates
    cfg = ppo_cfg(max_steps=5, **CFG, **{"critic_stall.updates": 3})
    with caplog.at_level(logging.WARNING, logger="openaligner.trainer.ppo"):
        make_trainer(tmp_path, cfg, client=critic).fit()
    assert stall_warnings(caplog) == []


def test_ignore_is_silent(tiny, tmp_path, caplog):
    critic = InProcessCritic(tiny, 1e-9, first_token)
    cfg = ppo_cfg(max_steps=4, **CFG, **{"critic_stall.updates": 2, "critic_stall.mode": "ignore"})
    with caplog.at_level(logging.WARNING, logger="openaligner.trainer.ppo"):
        make_trainer(tmp_path, cfg, client=critic).fit()
    assert stall_warnings(caplog) == []


def test_error_mode_stops_the_run_naming_the_setting(tiny, tmp_path):
    critic = InProcessCritic(tiny, 1e-9, first_token)
    over = {"critic_stall.updates": 2, "critic_stall.mode": "error"}
    with pytest.raises(CriticStallError, match=r"trainer\.critic_stall\.mode=ignore"):
        make_trainer(tmp_path, ppo_cfg(max_steps=5, **CFG, **over), client=critic).fit()
    assert critic.updates == 2  # stopped at the third step's rollout, before its updates
