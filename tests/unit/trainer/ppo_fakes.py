"""Shared fakes for the PPOTrainer tests: a tiny actor and an in-memory reward/critic client.

The stand-in scores a response by its share of one target token and returns zero values; the
real servers are exercised by the integration tests.
"""

from concurrent.futures import Future

import pytest
import torch

from openaligner.config import load_config
from openaligner.io.checkpoint import CheckpointManager
from openaligner.io.metrics import MetricsLogger
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
from openaligner.trainer.ppo_config import PPOConfig
from openaligner.trainer.rollout import PromptLoader, make_prompt_collate

TARGET = 7
SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


class Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def target_share(batch) -> torch.Tensor:
    """[B] float: the share of TARGET among each row's response tokens (a rollout batch's keys)."""
    tokens, lengths, prompts = batch["response_tokens"], batch["response_lengths"], batch["prompt_lengths"]
    pos = torch.arange(tokens.shape[1])
    resp = (pos >= prompts[:, None]) & (pos < lengths[:, None])
    return (((tokens == TARGET) & resp).sum(-1) / resp.sum(-1).clamp_min(1)).float()


def done_future(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


class FakeRMCritic:
    """Rewards from ``reward_fn(batch) -> [B]``, values 0, critic training and saving no-ops."""

    def __init__(self, reward_fn):
        self.reward_fn = reward_fn

    def infer_rm_critic(self, batch):
        tokens = batch["response_tokens"]
        return Done((self.reward_fn(batch), torch.zeros(tokens.shape[0], tokens.shape[1] - 1)))

    def train(self, data):
        return done_future({"loss": 0.0})

    def save(self):
        return done_future(0)


class TargetTokenScorer:
    """Reward = share of TARGET among response tokens; values = 0; records critic calls."""

    def __init__(self):
        self.train_calls = 0
        self.save_calls = 0

    def infer_rm_critic(self, batch):
        tokens = batch["response_tokens"]
        return Done((target_share(batch), torch.zeros(tokens.shape[0], tokens.shape[1] - 1)))

    def train(self, data):
        assert set(data) == {"response_tokens", "returns", "values", "mask"}
        self.train_calls += 1
        return done_future({"loss": float((data["returns"] * data["mask"]).abs().sum())})

    def save(self):
        self.save_calls += 1
        return done_future(0)


def count_target(prompts, responses):
    return [r.split().count(str(TARGET)) for r in responses]


def make_trainer(
    tmp_path,
    cfg: PPOConfig,
    seed=0,
    client=None,
    scorer=None,
    actor=None,
    prompts=None,
    arch="gpt2",
    lora_rank=0,
    grad_scaler=None,
    sgd_lr=None,
    loss=None,
    engine=None,
):
    """A PPOTrainer on a tiny ``arch`` actor (LoRA adapters of ``lora_rank`` when > 0, via peft),
    or on ``actor`` when given; trained with AdamW, or plain SGD at ``sgd_lr`` when given."""
    torch.manual_seed(seed)
    if actor is None:
        model = build_tiny_causal_lm(arch, SIZE, seed=seed)
        if lora_rank:  # a LoRA actor (peft); its initial policy is the model with adapters disabled
            peft = pytest.importorskip("peft")
            lora = peft.LoraConfig(r=lora_rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            model = peft.get_peft_model(model, lora)
        actor = CausalLMActor(model)
    if prompts is None:
        prompts = [[3 + (i % 20), 4 + (i % 7), 5] for i in range(32)]
    if sgd_lr is None:
        opt = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(actor.parameters(), lr=sgd_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return PPOTrainer(
        cfg,
        actor,
        ActorOptim(opt, sched, grad_scaler),
        Prompts(
            train=PromptLoader(prompts, cfg.num_rollout_samples, cfg.seed, shuffle=True),
            val=PromptLoader(prompts[:8], cfg.val_samples, cfg.seed, shuffle=False),
            collate=make_prompt_collate(actor.pad_id),
        ),
        client or TargetTokenScorer(),
        RunOutputs(
            logger=MetricsLogger(tmp_path / "logs", tensorboard=False),
            checkpoints=CheckpointManager(tmp_path / "ckpt"),
            progress=False,
            decode=lambda ids: " ".join(map(str, ids)),
            response_scorer=scorer,
        ),
        loss=loss,
        engine=engine,
    )


def ppo_cfg(**over) -> PPOConfig:
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
