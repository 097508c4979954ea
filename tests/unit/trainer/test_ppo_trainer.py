"""PPOTrainer on a tiny actor with an in-memory stand-in for the reward/critic client."""

import json
import logging
from concurrent.futures import Future

import pytest
import torch
from ppo_fakes import TargetTokenScorer, count_target, make_trainer, ppo_cfg

from openaligner.config import ConfigError, load_config
from openaligner.trainer.ppo_checkpoint import ResumeError, restore_newest_checkpoint
from openaligner.trainer.ppo_config import PPOConfig


def test_fit_logs_reference_metrics_and_trains_critic(tmp_path):
    client = TargetTokenScorer()
    cfg = ppo_cfg(max_steps=2, max_epochs=2, critic_warmup_steps=1)
    t = make_trainer(tmp_path, cfg, client=client, scorer=count_target)
    history = t.fit()
    # the warm-up rollout is a critic-only step of its own (logged, checkpointed), then 2 actor steps
    assert len(history) == 3 and [h["value_pretrain/critic_only"] for h in history] == [1.0, 0.0, 0.0]
    assert not any(k.startswith("policy/") for k in history[0])
    m = history[-1]
    for key in [
        "rollout/rewards",
        "rollout/init_policy_kl",
        "rollout/rewards_with_kl",
        "rollout/advantages_mean",
        "rollout/returns_std",
        "rollout/values_mean",
        "rollout/fraction_of_samples_properly_ended",
        "rollout/generation_length",
        "policy/loss",
        "policy/ppo_ratio",
        "policy/clip_fraction",
        "policy/approx_kl",
        "policy/entropy",
        "policy/grad_norm",
        "policy/lr",
        "value/loss",
        "timing/generate_s",
        "timing/logprobs_s",
        "timing/init_logprobs_s",
        "timing/critic_wait_s",
        "timing/train_s",
        "timing/tokens_per_s",
        "val/rewards",
        "timing/validation_s",
    ]:
        assert key in m, key
    # warm-up: one critic-only rollout first, then one per step; warm-up prompts count
    assert client.train_calls == 3
    assert m["rollout/consumed_samples"] == 48
    # 32 prompts = 2 batches per pass: warm-up and step 2 draw pass 1, step 3 the start of pass 2
    assert [h["rollout/epoch"] for h in history] == [1.0, 1.0, 2.0]
    # 16 samples / global batch 8 = 2 optimizer steps per PPO step
    assert m["policy/optim_step"] == 4
    # the first minibatch of a step sees the rollout policy exactly: ratio starts at 1
    assert abs(history[1]["policy/ppo_ratio"] - 1.0) < 0.05
    # checkpoints at step 2 (save_interval) and at the last step, 3
    assert client.save_calls == 2 and (tmp_path / "ckpt" / "step_2").is_dir()
    assert (tmp_path / "ckpt" / "step_3").is_dir()


def test_resume_matches_uninterrupted_run(tmp_path):
    straight = make_trainer(tmp_path / "a", ppo_cfg(max_steps=4, max_epochs=2)).fit()
    first = make_trainer(tmp_path / "b", ppo_cfg(max_steps=2, max_epochs=2))
    first.fit()
    resumed = make_trainer(tmp_path / "b", ppo_cfg(max_steps=4, max_epochs=2))
    latest = resumed.checkpoints.latest()
    assert latest is not None and latest.name == "step_2"
    resumed.load_checkpoint(latest)
    tail = resumed.fit()
    assert [m["step"] for m in tail] == [3.0, 4.0]
    skip = ("timing/",)
    for a, b in zip(straight[2:], tail, strict=True):
        for k in a:
            if not k.startswith(skip):
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), k


def test_resume_across_epoch_boundary(tmp_path):
    # 32 prompts / 16 per step = 2 steps per epoch; stop at the boundary and resume into epoch 2
    straight = make_trainer(tmp_path / "a", ppo_cfg(max_steps=3, max_epochs=2)).fit()
    make_trainer(tmp_path / "b", ppo_cfg(max_steps=2, max_epochs=2)).fit()
    resumed = make_trainer(tmp_path / "b", ppo_cfg(max_steps=3, max_epochs=2))
    resumed.load_checkpoint(resumed.checkpoints.latest())
    (m,) = resumed.fit()
    assert m["rollout/epoch"] == 2.0
    assert m["rollout/rewards"] == pytest.approx(straight[2]["rollout/rewards"])
    assert m["policy/loss"] == pytest.approx(straight[2]["policy/loss"], rel=1e-6, abs=1e-7)


def test_policy_learns_target_token(tmp_path):
    cfg = ppo_cfg(
        max_steps=12,
        max_epochs=6,
        val_check_interval=0,
        save_interval=0,
        initial_policy_kl_penalty=0.0,
        gate_unfinished="false",
    )
    history = make_trainer(tmp_path, cfg).fit()
    early = sum(m["rollout/rewards"] for m in history[:3]) / 3
    late = sum(m["rollout/rewards"] for m in history[-3:]) / 3
    assert late > early + 0.1, (early, late)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("global_batch_size=5", "multiple of global_batch_size"),
        ("save_interval=3", "multiple of val_check_interval"),
        ("kl_estimator=k9", "kl_estimator"),
        ("dual_clip=0.5", "dual_clip"),
        ("max_time_per_run=4h", "DD:HH:MM:SS"),
        ("adaptive_kl=true", "initial_policy_kl_penalty > 0"),
    ],
)
def test_invalid_combinations_are_refused(override, needle):
    extra = ["initial_policy_kl_penalty=0"] if override.startswith("adaptive") else []
    with pytest.raises(ConfigError, match=needle):
        load_config(PPOConfig, None, [override, *extra])


class SteppingCritic(TargetTokenScorer):
    """Answers like the critic server: each train runs 2 critic optimizer steps; ``save`` keeps the
    step in ``held`` and ``restore`` goes back to a held one (else fails with a ``ValueError``, as
    the client's ``BadRequestError``); ``restart(at)`` sets the step back, as a critic server
    restarted from an older checkpoint would be."""

    def __init__(self, start=0):
        super().__init__()
        self.critic_step = start
        self.held: set[int] = set()
        self.restores: list[int] = []

    def restart(self, at):
        self.critic_step = at

    def train(self, data):
        self.train_calls += 1
        self.critic_step += 2
        f = Future()
        f.set_result({"loss": 0.0, "critic_step": float(self.critic_step), "critic_optimizer_steps": 2.0})
        return f

    def save(self):
        self.save_calls += 1
        self.held.add(self.critic_step)
        f = Future()
        f.set_result({"status": 0, "step": self.critic_step})
        return f

    def restore(self, step):
        self.restores.append(step)
        f = Future()
        if step in self.held:
            self.critic_step = step
            f.set_result({"status": 0, "step": step})
        else:
            f.set_exception(ValueError(f"cannot go back to critic step {step}: holds {sorted(self.held)}"))
        return f


def test_checkpoint_records_the_critic_step_and_a_resume_checks_it(tmp_path, caplog):
    critic = SteppingCritic()
    make_trainer(tmp_path / "run", ppo_cfg(max_steps=2, max_epochs=2), client=critic).fit()
    state = json.loads((tmp_path / "run" / "ckpt" / "step_2" / "trainer_state.json").read_text())
    assert state["critic_step"] == 4 and state["critic_steps_per_train"] == 2
    # resumed with the critic server restarted from the critic saved with step_2: no warning
    resumed = make_trainer(tmp_path / "run", ppo_cfg(max_steps=3, max_epochs=2), client=critic)
    resumed.load_checkpoint(resumed.checkpoints.latest())
    assert resumed.critic_step == 4
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert "expected" not in caplog.text and resumed.critic_step == 6
    # resumed while the critic server kept training (not restarted): the run says so
    critic.restart(at=10)
    again = make_trainer(
        tmp_path / "run",
        ppo_cfg(max_steps=4, max_epochs=2, save_interval=0, val_check_interval=0),
        client=critic,
    )
    again.load_checkpoint(again.checkpoints.latest())
    with caplog.at_level(logging.WARNING):
        again.fit()
    assert "the critic server is at critic step 12 after this step's critic_train, expected 8" in caplog.text
    assert "not an exact continuation" in caplog.text


def test_critic_server_restarted_mid_run_is_reported_and_the_run_goes_on(tmp_path, caplog):
    critic = SteppingCritic()
    t = make_trainer(
        tmp_path, ppo_cfg(max_steps=4, max_epochs=2, save_interval=0, val_check_interval=0), client=critic
    )
    original = critic.train

    def train(data):
        if critic.train_calls == 2:
            critic.restart(at=2)  # back to the critic of the first step
        return original(data)

    critic.train = train
    with caplog.at_level(logging.WARNING):
        history = t.fit()
    assert len(history) == 4
    assert "critic step 4 after this step's critic_train, expected 6" in caplog.text
    assert [m["value/critic_step"] for m in history] == [2.0, 4.0, 4.0, 6.0]


def test_warmup_rollouts_count_toward_max_epochs(tmp_path):
    # one pass = 2 batches; the warm-up draws one, so one pass leaves one PPO step
    client = TargetTokenScorer()
    history = make_trainer(tmp_path, ppo_cfg(max_epochs=1, critic_warmup_steps=1), client=client).fit()
    assert [h["value_pretrain/critic_only"] for h in history] == [1.0, 0.0]
    assert history[1]["rollout/consumed_samples"] == 32 and history[1]["rollout/epoch"] == 1.0


@pytest.mark.parametrize(
    ("arch", "lora_rank"),
    [("gpt_neox", 0), ("mixtral", 0), ("llama", 2)],
    ids=["gpt_neox", "mixtral", "lora"],
)
def test_actor_resume_reads_the_checkpoint_as_from_pretrained_does(tmp_path, arch, lora_rank):
    """2 steps straight vs. 1, stop, resume, 1 more, for actors whose saved keys differ from the
    module's (GPT-NeoX's embed_out, Mixtral's per-expert weights) and for a LoRA actor (an adapter
    directory). Metrics and weights bitwise equal: on CPU the resumed run repeats the same float
    operations in the same order."""
    cfg = {"val_check_interval": 0, "save_interval": 1}
    model = {"arch": arch, "lora_rank": lora_rank}
    straight_trainer = make_trainer(tmp_path / "a", ppo_cfg(max_steps=2, **cfg), **model)
    straight = straight_trainer.fit()
    make_trainer(tmp_path / "b", ppo_cfg(max_steps=1, **cfg), **model).fit()
    resumed = make_trainer(tmp_path / "b", ppo_cfg(max_steps=2, **cfg), **model)
    latest = resumed.checkpoints.latest()
    assert latest is not None and latest.name == "step_1"
    assert (latest / "actor" / ("adapter_config.json" if lora_rank else "config.json")).is_file()
    resumed.load_checkpoint(latest)
    (m,) = resumed.fit()
    assert m["step"] == 2.0
    assert {k: v for k, v in m.items() if not k.startswith("timing/")} == {
        k: v for k, v in straight[1].items() if not k.startswith("timing/")
    }
    want = straight_trainer.model.model.state_dict()
    for k, v in resumed.model.model.state_dict().items():
        assert torch.equal(v, want[k]), k


class LateSavingCritic(SteppingCritic):
    """Its critic_save becomes durable only when the trainer waits for it, as late as it can be;
    records the actor checkpoints already published at that moment. ``fail_at`` (a PPO step): that
    save never completes (the critic server went down while saving)."""

    def __init__(self, actor_checkpoints, fail_at=None):
        super().__init__()
        self.actor_checkpoints = actor_checkpoints
        self.fail_at = fail_at
        self.published_before_critic_durable: list[str] = []

    def save(self):
        self.save_calls += 1
        ppo_step, critic_step, critic = self.save_calls, self.critic_step, self

        class Late:
            def result(self):
                if (critic.actor_checkpoints / f"step_{ppo_step}").exists():
                    critic.published_before_critic_durable.append(f"step_{ppo_step}")
                if ppo_step == critic.fail_at:
                    raise ConnectionError("critic server went away during critic_save (simulated)")
                critic.held.add(critic_step)
                return {"status": 0, "step": critic_step}

        return Late()


def test_actor_checkpoint_is_published_only_once_the_critic_checkpoint_is_durable(tmp_path):
    cfg = ppo_cfg(max_steps=2, save_interval=1, val_check_interval=0)
    critic = LateSavingCritic(tmp_path / "ckpt")
    make_trainer(tmp_path, cfg, client=critic).fit()
    assert critic.published_before_critic_durable == []
    for step, critic_step in ((1, 2), (2, 4)):
        state = json.loads((tmp_path / "ckpt" / f"step_{step}" / "trainer_state.json").read_text())
        assert state["critic_step"] == critic_step  # the step the critic server saved
    # the critic server goes down during the second save: no actor step_2 without its critic
    crashed = LateSavingCritic(tmp_path / "crashed" / "ckpt", fail_at=2)
    trainer = make_trainer(tmp_path / "crashed", cfg, client=crashed)
    with pytest.raises(ConnectionError, match="during critic_save"):
        trainer.fit()
    assert crashed.published_before_critic_durable == []
    assert trainer.checkpoints.latest() == tmp_path / "crashed" / "ckpt" / "step_1"
    assert not (tmp_path / "crashed" / "ckpt" / "step_2").exists()


def test_resume_picks_the_newest_step_both_halves_have(tmp_path, caplog):
    """A machine crash between the two halves of step 3: the critic server saved its critic (step
    6) but the actor's step_3 was never published. The resumed run starts from step_2 and sends the
    critic server back to critic step 4, so it continues exactly (no warning)."""
    critic = SteppingCritic()
    cfg = {"max_epochs": 2, "save_interval": 1, "val_check_interval": 0}
    first = make_trainer(tmp_path, ppo_cfg(max_steps=3, **cfg), client=critic)
    real_save_pretrained = first.model.save_pretrained

    def crash_at_step_3(path):
        if first.step == 3:
            raise KeyboardInterrupt  # the machine goes down while the actor's half is written
        real_save_pretrained(path)

    first.model.save_pretrained = crash_at_step_3
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    assert critic.held == {2, 4, 6} and critic.critic_step == 6  # the critic's half of step 3 is there
    resumed = make_trainer(tmp_path, ppo_cfg(max_steps=4, **cfg), client=critic)
    path = restore_newest_checkpoint(resumed.checkpoints, critic)
    assert path == tmp_path / "ckpt" / "step_2" and critic.restores == [4] and critic.critic_step == 4
    resumed.load_checkpoint(path)
    with caplog.at_level(logging.WARNING):
        history = resumed.fit()
    assert [m["value/critic_step"] for m in history] == [6.0, 8.0]
    assert "expected" not in caplog.text

    # the critic server lost its newest critic (its keep_last, a damaged file): one step further back
    critic.held.discard(8)
    critic.restores.clear()
    with caplog.at_level(logging.WARNING):
        path = restore_newest_checkpoint(resumed.checkpoints, critic)
    assert path == tmp_path / "ckpt" / "step_3" and critic.restores == [8, 6] and critic.critic_step == 6
    assert f"not resuming from {tmp_path / 'ckpt' / 'step_4'}: cannot go back to critic step 8" in caplog.text

    # it holds none of them: refused, naming each checkpoint and its critic step
    critic.held.clear()
    with pytest.raises(ResumeError, match=r"holds the critic of none .*step_4 \(critic step 8\), step_3"):
        restore_newest_checkpoint(resumed.checkpoints, critic)


def test_critic_steps_per_train_is_known_after_a_step_1_checkpoint_and_checked_at_the_first_answer(
    tmp_path, caplog
):
    critic = SteppingCritic()
    cfg = {"max_epochs": 2, "save_interval": 1, "val_check_interval": 0}
    make_trainer(tmp_path, ppo_cfg(max_steps=1, **cfg), client=critic).fit()
    state = json.loads((tmp_path / "ckpt" / "step_1" / "trainer_state.json").read_text())
    assert state["critic_step"] == 2 and state["critic_steps_per_train"] == 2  # known after one answer
    critic.restart(at=10)  # a critic server that went on elsewhere, and was not sent back
    resumed = make_trainer(tmp_path, ppo_cfg(max_steps=3, **cfg), client=critic)
    resumed.load_checkpoint(resumed.checkpoints.latest())
    with caplog.at_level(logging.WARNING):
        history = resumed.fit()
    assert [m["value/critic_step"] for m in history] == [12.0, 14.0]
    warnings = [r.getMessage() for r in caplog.records if "after this step's critic_train" in r.getMessage()]
    # the very first answer after the resume is the one that diverged; the next one continues it
    assert (
        len(warnings) == 1 and "at critic step 12 after this step's critic_train, expected 4" in warnings[0]
    )
