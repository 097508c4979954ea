"""An on-policy update (``PPOConfig.on_policy_update``: one optimizer step per rollout, no KL in
the reward, no tis_cap) skips the rollout log-prob pass of the current policy: the update's own
log-probs, detached, are the ratio's denominator. The update is bitwise the one the pass gives
(every weight, every logged metric, the rollout log), the pass still runs whenever the rollout
is trained on in more than one optimizer step, and the frozen initial policy is still scored."""

import math

import pytest
import torch
from ppo_fakes import make_trainer, ppo_cfg

from openaligner.io.metrics import read_jsonl

ON_POLICY = {
    "advantage_estimator": "grpo",  # kl_in=loss by default: β·KL is a loss term
    "num_rollout_samples": 4,
    "n_samples_per_prompt": 4,
    "global_batch_size": 16,  # the whole rollout of 16 responses in one optimizer step
    "micro_batch_size": 8,
    "rollout_micro_batch_size": 8,
    "max_steps": 2,
    "val_check_interval": 0,
    "save_interval": 0,
    "initial_policy_kl_penalty": 0.05,
    "entropy_bonus": 0.01,
    "length.max_length": 8,
    "sampling.stop_token_ids": "[1,2,3]",
}


class Counting:
    """Counts the actor's rollout log-prob passes and its initial-policy passes."""

    def __init__(self, trainer):
        self.passes = self.init_passes = 0
        model = trainer.model
        inference, init = model.get_inference_log_probs, model.get_init_policy_logprobs

        def counted_inference(*args, **kwargs):
            self.passes += 1
            return inference(*args, **kwargs)

        def counted_init(*args, **kwargs):
            self.init_passes += 1
            return init(*args, **kwargs)

        model.get_inference_log_probs = counted_inference
        model.get_init_policy_logprobs = counted_init


def run(tmp_path, name, lora_rank=0, **over):
    cfg = ppo_cfg(**(ON_POLICY | over))
    arch = "llama" if lora_rank else "gpt2"  # q_proj, v_proj to adapt
    trainer = make_trainer(tmp_path / name, cfg, lora_rank=lora_rank, arch=arch)
    counts = Counting(trainer)
    history = trainer.fit()
    weights = {k: v.clone() for k, v in trainer.model.model.state_dict().items()}
    rollouts = read_jsonl(tmp_path / name / "logs" / "rollouts.jsonl")
    return cfg, history, weights, rollouts, counts


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


PPO_KL_IN_LOSS = {
    "advantage_estimator": "gae",
    "kl_in": "loss",
    "n_samples_per_prompt": 1,
    "num_rollout_samples": 16,
}


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("estimator", [{}, PPO_KL_IN_LOSS], ids=["grpo", "gae"])
def test_skipping_the_pass_is_bitwise_the_same_update(tmp_path, estimator, lora_rank):
    over = estimator | {"lora_rank": lora_rank}
    cfg, skip, w_skip, log_skip, n_skip = run(tmp_path, "skip", **over)
    forced, old, w_old, log_old, n_old = run(tmp_path, "pass", reuse_update_logprobs=False, **over)
    assert cfg.on_policy_update and not forced.on_policy_update
    assert n_skip.passes == 0 and n_old.passes == 2  # one pass per step saved, on every step
    assert n_skip.init_passes == n_old.init_passes == 2  # the KL's reference is still scored
    for a, b in zip(skip, old, strict=True):
        assert "timing/logprobs_s" in b and "timing/logprobs_s" not in a
        keys = {k for k in b if not k.startswith("timing/")}
        assert keys == {k for k in a if not k.startswith("timing/")}  # every figure still logged
        for key in keys:
            assert _same(a[key], b[key]), (key, a[key], b[key])
        assert a["policy/ppo_ratio"] == 1.0 and a["policy/clip_fraction"] == 0.0
        assert a["rollout/init_policy_kl"] != 0.0 or a["step"] == 1  # the KL after the first update
    assert skip[-1]["rollout/init_policy_kl"] > 0  # the policy moved away from its start
    for name, tensor in w_old.items():
        assert torch.equal(w_skip[name], tensor), name
    assert log_skip == log_old  # the rollout log's per-sample KL from the update's log-probs
    assert any(r["kl"] > 0 for r in log_skip)


@pytest.mark.parametrize(
    "over",
    [
        {"ppo_epochs": 2},  # the second epoch's ratio is against the first's weights
        {"global_batch_size": 8},  # two optimizer steps per rollout
        PPO_KL_IN_LOSS | {"kl_in": "reward"},  # the KL enters the advantages
        {"tis_cap": 2.0},  # its weights (from the pass) enter the loss
    ],
)
def test_the_pass_runs_when_the_rollout_is_not_consumed_by_one_on_policy_step(tmp_path, over):
    cfg, history, _, _, counts = run(tmp_path, "run", **(over | {"max_steps": 2}))
    assert not cfg.on_policy_update
    assert counts.passes == 2
    assert all("timing/logprobs_s" in m for m in history)


def test_value_pretraining_steps_keep_the_pass(tmp_path):
    """Critic-only steps train no actor, so nothing else would score their rollouts."""
    over = PPO_KL_IN_LOSS | {"critic_warmup_steps": 1, "max_steps": 1}
    cfg, history, _, _, counts = run(tmp_path, "run", **over)
    assert cfg.on_policy_update
    assert [m["value_pretrain/critic_only"] for m in history] == [1.0, 0.0]
    assert counts.passes == 1  # the critic-only step's; the actor step reused its update's
