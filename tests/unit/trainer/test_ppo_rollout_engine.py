"""The trainer and its rollout engine: every rollout comes from ``engine.generate`` with per-row
seeds, and the engine gets the new weights after every optimizer step (and after a resume)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from ppo_fakes import make_trainer, ppo_cfg

from openaligner.rollout.engine import RolloutRequest
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.trainer.policy_loss import PolicyLoss, PolicyLossConfig
from openaligner.trainer.ppo import derive_seed


class RecordingEngine(HFRolloutEngine):
    """The hf engine, recording each call into a shared ``calls`` list."""

    shares_weights = False  # as an engine owning its weights: update_weights must be called

    def __init__(self, actor, calls):
        super().__init__(actor)
        self.calls = calls
        self.requests: list[RolloutRequest] = []

    def generate(self, request):
        self.calls.append("generate")
        self.requests.append(request)
        return super().generate(request)

    def update_weights(self, policy, version):
        assert policy is self.actor
        self.calls.append(f"update_weights {version}")


class RecordingLoss(PolicyLoss):
    def __init__(self, cfg, calls):
        super().__init__(cfg)
        self.calls = calls

    def __call__(self, policy, batch):
        self.calls.append("train")
        return super().__call__(policy, batch)


def _recording_trainer(tmp_path, cfg, calls):
    trainer = make_trainer(tmp_path, cfg, loss=RecordingLoss(PolicyLossConfig.from_ppo(cfg), calls))
    trainer.engine = RecordingEngine(trainer.model, calls)
    return trainer


def _compress(calls):
    """Runs of equal calls as one ``name×count``."""
    out: list[str] = []
    for c in calls:
        if out and out[-1].split("×")[0] == c:
            name, _, n = out[-1].partition("×")
            out[-1] = f"{name}×{int(n or 1) + 1}"
        else:
            out.append(c)
    return out


def test_weights_reach_the_engine_after_every_optimizer_step_before_the_next_rollout(tmp_path):
    # 16 rollouts in micro-batches of 8 (2 requests); global batch 8 = 2 optimizer steps of 2
    # micro-batches each per PPO step
    cfg = ppo_cfg(max_steps=2, val_check_interval=0, save_interval=0)
    calls: list[str] = []
    trainer = _recording_trainer(tmp_path, cfg, calls)
    trainer.fit()
    assert _compress(calls) == [
        "generate×2", "train×2", "update_weights 1", "train×2", "update_weights 2",
        "generate×2", "train×2", "update_weights 3", "train×2", "update_weights 4",
    ]  # fmt: skip


def test_requests_carry_the_sampling_settings_and_distinct_per_row_seeds(tmp_path):
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0)
    calls: list[str] = []
    trainer = _recording_trainer(tmp_path, cfg, calls)
    trainer.fit()
    first, second = trainer.engine.requests
    assert first.sampling == trainer.model.sampling and first.prompts.shape[0] == 8
    seeds = torch.cat([first.seeds, second.seeds])
    assert len(set(seeds.tolist())) == 16
    # the first row's seed is the micro-batch's seed of the loop before the seam (the hf engine's)
    assert int(first.seeds[0]) == derive_seed(cfg.seed, 0, 0, 0, 0)
    assert int(second.seeds[0]) == derive_seed(cfg.seed, 0, 0, 0, 1)


def test_a_skipped_optimizer_step_sends_no_weights(tmp_path):
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0, gate_unfinished=False)
    calls: list[str] = []

    class NaNFirstStep(RecordingLoss):
        def __call__(self, policy, batch):
            loss, metrics = super().__call__(policy, batch)
            return (loss * float("nan") if len(calls) <= 4 else loss), metrics

    trainer = make_trainer(tmp_path, cfg, loss=NaNFirstStep(PolicyLossConfig.from_ppo(cfg), calls))
    trainer.engine = RecordingEngine(trainer.model, calls)
    (m,) = trainer.fit()
    assert m["policy/skipped_steps"] == 1.0
    # the first optimizer step (2 micro-batches) was skipped: its weights are the old ones
    assert _compress(calls) == ["generate×2", "train×4", "update_weights 1"]


def test_a_resumed_trainer_sends_the_restored_weights_to_the_engine(tmp_path):
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=1)
    first = make_trainer(tmp_path, cfg)
    first.fit()
    calls: list[str] = []
    resumed = _recording_trainer(tmp_path / "again", cfg, calls)
    resumed.load_checkpoint(first.checkpoints.latest())
    assert calls == ["update_weights 2"]  # the weights after the checkpoint's 2 optimizer steps


def test_the_default_engine_is_hf_over_the_actor(tmp_path):
    trainer = make_trainer(tmp_path, ppo_cfg(max_steps=1))
    assert isinstance(trainer.engine, HFRolloutEngine) and trainer.engine.actor is trainer.model


class ReportingEngine(HFRolloutEngine):
    """The hf engine, reporting log-probs of its own (the trainer's, shifted by ``offset`` on the
    response) and a timing, as an engine in another process would."""

    def __init__(self, actor, offset):
        super().__init__(actor)
        self.offset = offset
        self.compared: list[float] = []

    def generate(self, request):
        out = super().generate(request)
        own = self.actor.get_inference_log_probs(
            out.tokens, out.sequence_lengths, prompt_lengths=out.prompt_lengths
        )
        return dataclasses.replace(out, logprobs=own + self.offset)

    def check_logprobs(self, engine_logprobs, trainer_logprobs, mask):
        stats = super().check_logprobs(engine_logprobs, trainer_logprobs, mask)
        self.compared.append(stats["logprob_diff_mean"])
        return stats

    def pop_metrics(self):
        return {"timing/weight_sync_s": 0.5}


def test_an_engines_own_logprobs_are_compared_with_the_trainers_and_its_metrics_logged(tmp_path):
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0)
    trainer = make_trainer(tmp_path, cfg)
    trainer.engine = ReportingEngine(trainer.model, offset=0.25)
    (m,) = trainer.fit()
    # every response token is 0.25 apart (the padding beyond a response is not compared)
    assert m["rollout/engine_logprob_diff_mean"] == pytest.approx(0.25, abs=1e-5)
    assert m["rollout/engine_logprob_diff_max"] == pytest.approx(0.25, abs=1e-5)
    assert m["rollout/engine_token_prob_error"] == pytest.approx(math.exp(0.25), abs=1e-5)
    assert m["timing/weight_sync_s"] == 0.5
    # the hf engine reports none: no such metrics
    plain = make_trainer(tmp_path / "plain", cfg)
    (m,) = plain.fit()
    assert not any("engine_" in k or "weight_sync" in k for k in m)


@pytest.mark.parametrize(("offset", "weight", "truncated"), [(0.25, math.exp(-0.25), 0.0), (-1.0, 2.0, 1.0)])
def test_truncated_importance_sampling_weighs_the_policy_gradient_by_the_capped_ratio(
    tmp_path, offset, weight, truncated
):
    """trainer.tis_cap=2: each token's policy-gradient term is weighed by min(π_trainer/π_engine, 2).
    The engine's log-probs here are the trainer's + ``offset`` on every response token, so every
    weight is exp(−offset) capped at 2; on the first update the ratio is 1, so the pg loss is the
    plain run's times that weight."""
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0)
    plain = make_trainer(tmp_path / "plain", cfg)
    plain.engine = ReportingEngine(plain.model, offset=offset)
    (m0,) = plain.fit()
    assert not any(k.startswith("rollout/tis_") for k in m0)  # off by default

    tis = make_trainer(tmp_path / "tis", dataclasses.replace(cfg, tis_cap=2.0))
    tis.engine = ReportingEngine(tis.model, offset=offset)
    (m,) = tis.fit()
    assert m["rollout/tis_weight_mean"] == pytest.approx(weight, abs=1e-5)
    assert m["rollout/tis_truncated_fraction"] == pytest.approx(truncated, abs=1e-6)
    assert m["rollout/engine_logprob_diff_mean"] == pytest.approx(abs(offset), abs=1e-5)
    assert m["policy/pg_loss"] == pytest.approx(weight * m0["policy/pg_loss"], rel=1e-4, abs=1e-7)
    assert m0["policy/pg_loss"] != 0


def test_truncated_importance_sampling_without_engine_logprobs_changes_nothing(tmp_path):
    """The hf engine reports no log-probs of its own: no weights, the update is the plain one."""
    cfg = ppo_cfg(max_steps=1, val_check_interval=0, save_interval=0)
    (m0,) = make_trainer(tmp_path / "plain", cfg).fit()
    (m,) = make_trainer(tmp_path / "tis", dataclasses.replace(cfg, tis_cap=2.0)).fit()
    assert not any(k.startswith("rollout/tis_") for k in m)
    assert m["policy/pg_loss"] == m0["policy/pg_loss"]
