"""PPOTrainer(server_overlap_threads=…): the log-prob passes run with that many torch threads while
reward/critic requests are in flight, the update while the critic trains, and the caller's thread
count is back afterwards."""

import pytest
import torch
from ppo_fakes import FakeRMCritic

from openaligner.config import load_config
from openaligner.io.metrics import MetricsLogger
from openaligner.models.actor import CausalLMActor
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.trainer.ppo import ActorOptim, PPOTrainer, Prompts, RunOutputs
from openaligner.trainer.ppo_config import PPOConfig
from openaligner.trainer.rollout import PromptLoader, make_prompt_collate

SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


def zero_critic():
    """Zero rewards and values; ``critic_train`` answers at once."""
    return FakeRMCritic(lambda batch: torch.zeros(batch["response_tokens"].shape[0]))


def _trainer(tmp_path, server_overlap_threads):
    cfg = load_config(
        PPOConfig,
        None,
        [
            "num_rollout_samples=8",
            "rollout_micro_batch_size=8",
            "global_batch_size=8",
            "micro_batch_size=4",
            "length.max_length=4",
            "val_check_interval=0",
            "save_interval=0",
            "max_steps=2",
        ],
    )
    actor = CausalLMActor(build_tiny_causal_lm("gpt2", SIZE, seed=0))
    prompts = [[3 + i, 4, 5] for i in range(16)]
    trainer = PPOTrainer(
        cfg,
        actor,
        ActorOptim(torch.optim.AdamW(actor.parameters(), lr=1e-3)),
        Prompts(
            train=PromptLoader(prompts, cfg.num_rollout_samples, 0, shuffle=True),
            val=None,
            collate=make_prompt_collate(actor.pad_id),
        ),
        zero_critic(),
        RunOutputs(logger=MetricsLogger(tmp_path / "logs", tensorboard=False), progress=False),
        server_overlap_threads=server_overlap_threads,
    )
    seen: dict[str, list[int]] = {}

    def recording(name, fn):
        def call(*args, **kwargs):
            seen.setdefault(name, []).append(torch.get_num_threads())
            return fn(*args, **kwargs)

        return call

    trainer.run_training = recording("update", trainer.run_training)  # type: ignore[method-assign]
    for name in ("infer", "get_inference_log_probs", "get_init_policy_logprobs"):
        setattr(actor, name, recording(name, getattr(actor, name)))
    return trainer, seen


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("server_overlap_threads", "expected"), [(1, 1), (None, 2)])
def test_overlapped_phases_run_with_server_overlap_threads(tmp_path, server_overlap_threads, expected):
    trainer, seen = _trainer(tmp_path, server_overlap_threads)
    history = trainer.fit()
    assert len(history) == 2
    assert seen == {
        "infer": [2, 2],  # generation has the server idle
        "get_inference_log_probs": [expected, expected],
        "get_init_policy_logprobs": [expected, expected],
        "update": [expected, expected],
    }
    assert torch.get_num_threads() == 2


def test_server_overlap_threads_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="server_overlap_threads"):
        _trainer(tmp_path, 0)
