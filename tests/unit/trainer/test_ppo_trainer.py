"""PPOTrainer on a tiny actor with an in-memory stand-in for the reward/critic client.

The stand-in scores a response by its share of one target token and returns zero values; the
real servers are exercised by the integration tests.
"""

import json
import logging
from concurrent.futures import Future

import pytest
import torch

from openaligner.config import ConfigError, load_config
from openaligner.io.checkpoint import CheckpointManager
from openaligner.io.metrics import MetricsLogger
from openaligner.models.actor import GPTActorModel
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.trainer.ppo import PPOTrainer, RunTimer
from openaligner.trainer.ppo_config import PPOConfig
from openaligner.trainer.rollout import MicroBatchIterator, PromptLoader, make_prompt_collate

TARGET = 7
SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class TargetTokenScorer:
    """Reward = share of TARGET among response tokens; values = 0; records critic calls."""

    def __init__(self):
        self.train_calls = 0
        self.save_calls = 0

    def infer_rm_critic(self, batch):
        tokens, lengths, prompts = (
            batch["response_tokens"],
            batch["response_lengths"],
            batch["prompt_lengths"],
        )
        pos = torch.arange(tokens.shape[1])
        resp = (pos >= prompts[:, None]) & (pos < lengths[:, None])
        rewards = ((tokens == TARGET) & resp).sum(-1) / resp.sum(-1).clamp_min(1)
        return _Done((rewards.float(), torch.zeros(tokens.shape[0], tokens.shape[1] - 1)))

    def train(self, data):
        assert set(data) == {"response_tokens", "returns", "values", "mask"}
        self.train_calls += 1
        f = Future()
        f.set_result({"loss": float((data["returns"] * data["mask"]).abs().sum())})
        return f

    def save(self):
        self.save_calls += 1
        f = Future()
        f.set_result(0)
        return f


def _count_target(prompts, responses):
    return [r.split().count(str(TARGET)) for r in responses]


def _trainer(tmp_path, cfg: PPOConfig, seed=0, client=None, scorer=None, arch="gpt2", lora_rank=0):
    torch.manual_seed(seed)
    model = build_tiny_causal_lm(arch, SIZE, seed=seed)
    if lora_rank:  # a LoRA actor (peft); its initial policy is the model with adapters disabled
        peft = pytest.importorskip("peft")
        lora = peft.LoraConfig(r=lora_rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
    actor = GPTActorModel(model, clip_eps=cfg.ratio_eps)
    prompts = [[3 + (i % 20), 4 + (i % 7), 5] for i in range(32)]
    opt = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return PPOTrainer(
        cfg=cfg,
        model=actor,
        optimizer=opt,
        scheduler=sched,
        train_dataloader_builder=PromptLoader(prompts, cfg.num_rollout_samples, cfg.seed, shuffle=True),
        val_dataloader_builder=PromptLoader(prompts[:8], cfg.val_samples, cfg.seed, shuffle=False),
        collate_fn=make_prompt_collate(actor.pad_id),
        rm_critic=client or TargetTokenScorer(),
        batch_iterator_cls=MicroBatchIterator,
        logger=MetricsLogger(tmp_path / "logs", tensorboard=False),
        ckpt_callback=CheckpointManager(tmp_path / "ckpt"),
        run_timer=RunTimer(None),
        decode=lambda ids: " ".join(map(str, ids)),
        progress=False,
        response_scorer=scorer,
    )


def _cfg(**over) -> PPOConfig:
    base = [
        "num_rollout_samples=16",
        "rollout_micro_batch_size=8",
        "global_batch_size=8",
        "micro_batch_size=4",
        "length.max_length=6",
        "val_check_interval=2",
        "save_interval=2",
        "num_val_samples=8",
        "initial_policy_kl_penalty=0.01",
        "sampling.stop_token_ids=[1]",
    ]
    return load_config(PPOConfig, None, base + [f"{k}={v}" for k, v in over.items()])


def test_fit_logs_reference_metrics_and_trains_critic(tmp_path):
    client = TargetTokenScorer()
    t = _trainer(tmp_path, _cfg(max_steps=2, critic_warmup_steps=1), client=client, scorer=_count_target)
    history = t.fit()
    assert len(history) == 2
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
    # warm-up: one extra critic-only rollout at step 0, then one per step; warm-up prompts count
    assert client.train_calls == 3
    assert m["rollout/consumed_samples"] == 48
    # 16 samples / global batch 8 = 2 optimizer steps per PPO step
    assert m["policy/optim_step"] == 4
    # the first minibatch of a step sees the rollout policy exactly: ratio starts at 1
    assert abs(history[0]["policy/ppo_ratio"] - 1.0) < 0.05
    assert client.save_calls == 1 and (tmp_path / "ckpt" / "step_2").is_dir()


def test_resume_matches_uninterrupted_run(tmp_path):
    straight = _trainer(tmp_path / "a", _cfg(max_steps=4, max_epochs=2)).fit()
    first = _trainer(tmp_path / "b", _cfg(max_steps=2, max_epochs=2))
    first.fit()
    resumed = _trainer(tmp_path / "b", _cfg(max_steps=4, max_epochs=2))
    latest = resumed.ckpt_callback.latest()
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
    straight = _trainer(tmp_path / "a", _cfg(max_steps=3, max_epochs=2)).fit()
    _trainer(tmp_path / "b", _cfg(max_steps=2, max_epochs=2)).fit()
    resumed = _trainer(tmp_path / "b", _cfg(max_steps=3, max_epochs=2))
    resumed.load_checkpoint(resumed.ckpt_callback.latest())
    (m,) = resumed.fit()
    assert m["rollout/epoch"] == 2.0
    assert m["rollout/rewards"] == pytest.approx(straight[2]["rollout/rewards"])
    assert m["policy/loss"] == pytest.approx(straight[2]["policy/loss"], rel=1e-6, abs=1e-7)


def test_policy_learns_target_token(tmp_path):
    cfg = _cfg(
        max_steps=12,
        max_epochs=6,
        val_check_interval=0,
        save_interval=0,
        initial_policy_kl_penalty=0.0,
        gate_unfinished="false",
    )
    history = _trainer(tmp_path, cfg).fit()
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
    """Answers like the critic server: each train adds 2 critic steps; ``restart(at)`` sets the step
    back, as a critic server restarted from an older checkpoint would be."""

    def __init__(self, start=0):
        super().__init__()
        self.critic_step = start

    def restart(self, at):
        self.critic_step = at

    def train(self, data):
        self.train_calls += 1
        self.critic_step += 2
        f = Future()
        f.set_result({"loss": 0.0, "critic_step": float(self.critic_step)})
        return f

    def save(self):
        self.save_calls += 1
        f = Future()
        f.set_result({"status": 0, "step": self.critic_step})
        return f


def test_checkpoint_records_the_critic_step_and_a_resume_checks_it(tmp_path, caplog):
    critic = SteppingCritic()
    _trainer(tmp_path / "run", _cfg(max_steps=2, max_epochs=2), client=critic).fit()
    state = json.loads((tmp_path / "run" / "ckpt" / "step_2" / "trainer_state.json").read_text())
    assert state["critic_step"] == 4 and state["critic_steps_per_train"] == 2
    # resumed with the critic server restarted from the critic saved with step_2: no warning
    resumed = _trainer(tmp_path / "run", _cfg(max_steps=3, max_epochs=2), client=critic)
    resumed.load_checkpoint(resumed.ckpt_callback.latest())
    assert resumed.critic_step == 4
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert "expected" not in caplog.text and resumed.critic_step == 6
    # resumed while the critic server kept training (not restarted): the run says so
    critic.restart(at=10)
    again = _trainer(
        tmp_path / "run",
        _cfg(max_steps=4, max_epochs=2, save_interval=0, val_check_interval=0),
        client=critic,
    )
    again.load_checkpoint(again.ckpt_callback.latest())
    with caplog.at_level(logging.WARNING):
        again.fit()
    assert "the critic server is at critic step 12 after this step's critic_train, expected 8" in caplog.text
    assert "not an exact continuation" in caplog.text


def test_critic_server_restarted_mid_run_is_reported_and_the_run_goes_on(tmp_path, caplog):
    critic = SteppingCritic()
    t = _trainer(
        tmp_path, _cfg(max_steps=4, max_epochs=2, save_interval=0, val_check_interval=0), client=critic
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
    straight_trainer = _trainer(tmp_path / "a", _cfg(max_steps=2, **cfg), arch=arch, lora_rank=lora_rank)
    straight = straight_trainer.fit()
    _trainer(tmp_path / "b", _cfg(max_steps=1, **cfg), arch=arch, lora_rank=lora_rank).fit()
    resumed = _trainer(tmp_path / "b", _cfg(max_steps=2, **cfg), arch=arch, lora_rank=lora_rank)
    latest = resumed.ckpt_callback.latest()
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
