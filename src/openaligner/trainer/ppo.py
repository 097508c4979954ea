"""PPOTrainer: the actor-side PPO loop that drives the reward model and critic servers.

Owns the loop and its state (step, consumed samples, optimisation steps, the non-finite-step
policy): rollouts through the engine, rewards and values from the client, advantages by the
registered estimator, the critic's training request, the actor's update, validation, and when to
log and checkpoint. The trainer section is unpacked once, in the constructor (:class:`LoopSettings`).
Must not know the math (``algorithms``, via ``ppo_data``), the checkpoint protocol
(``ppo_checkpoint``), how metrics are reduced and logged (``ppo_metrics``), or the servers beyond
the client's methods. The step, phase by phase: docs/architecture.md; resume: docs/ppo.md.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from openaligner import distributed as dp
from openaligner.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLKind,
    explained_variance,
    masked_mean_var,
    response_mask,
)
from openaligner.io.checkpoint import CheckpointManager
from openaligner.io.metrics import MetricsLogger, PhaseTimer
from openaligner.models.actor import CausalLMActor
from openaligner.rollout.engine import RolloutEngine, RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine
from openaligner.trainer.critic_stall import CriticStallCheck, CriticStallError
from openaligner.trainer.estimators import Estimator, get_estimator
from openaligner.trainer.optim_step import optimizer_step
from openaligner.trainer.policy_loss import PolicyLoss, PolicyLossConfig
from openaligner.trainer.ppo_checkpoint import CriticCheckpoints, PPOCheckpoints
from openaligner.trainer.ppo_config import PPOConfig, parse_duration_s
from openaligner.trainer.ppo_data import PPOData, RolloutBatch, compute_ppo_data, kl_metrics
from openaligner.trainer.ppo_metrics import (
    STEP_SUMS,
    RolloutLog,
    decode_rollouts,
    max_over_ranks,
    progress_postfix,
    rollout_metrics,
    step_metrics,
    step_sums,
)
from openaligner.trainer.rollout import Collate, MicroBatchIterator, pad_and_stack
from openaligner.trainer.rollout_log import DecodedRollouts
from openaligner.trainer.startup import RunEstimate

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """The actor's gradients were inf/NaN in too many optimizer steps in a row."""


class RMCriticFuture(Protocol):
    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rewards [B], values [B, S-1])``; values None from a client without a critic."""
        ...


class RewardClient(Protocol):
    """What the trainer needs of every reward client: one micro-batch's rewards, with the critic's
    values when the client has a critic (``RemoteRewardOnlyClient`` has none)."""

    def infer_rm_critic(self, rollout_batch: dict[str, torch.Tensor]) -> RMCriticFuture: ...


class RMCritic(RewardClient, CriticCheckpoints, Protocol):
    """A reward client with a critic (``RemoteGPTRMCriticClient``): what an estimator that needs a
    critic trains, checkpoints and restores (``save``/``restore``: :class:`CriticCheckpoints`)."""

    def train(self, ppo_rollout_data: dict[str, torch.Tensor]) -> Future[Any]: ...


class RunTimer:
    """Wall-clock limit of one run; rank 0 decides and every rank follows."""

    def __init__(self, max_time_s: float | None) -> None:
        self.max_time_s = max_time_s
        self.start = time.monotonic()

    def start_time(self) -> None:
        self.start = time.monotonic()

    def is_finished(self) -> bool:
        done = self.max_time_s is not None and time.monotonic() - self.start >= self.max_time_s
        return bool(dp.broadcast_object(done))


class PromptBatches(Protocol):
    """``consumed_samples → iterator`` of this rank's prompt batches (lists of token-id lists), one
    per PPO step, e.g. :class:`~openaligner.trainer.rollout.PromptLoader`."""

    @property
    def steps_per_epoch(self) -> int: ...

    def __call__(self, consumed_samples: int) -> Iterator[list[Sequence[int]]]: ...


@dataclass
class Prompts:
    """Where rollout prompts come from and how they become model inputs."""

    train: PromptBatches  # one global batch per PPO step; resumable from a sample position
    val: PromptBatches | None  # validation prompts (not shuffled), or None
    collate: Collate  # prompts → {"text": [B, P], "length": [B]}
    micro_batches: Callable[[Sequence[Sequence[int]], int, Collate], Iterable[dict[str, torch.Tensor]]] = (
        MicroBatchIterator  # (prompts, micro_batch_size, collate) → collated micro-batches
    )


@dataclass
class ActorOptim:
    """What updates the actor: its optimizer, LR schedule (one step per optimizer step) and loss
    scaler (``Precision.grad_scaler()``: dynamic under ``fp16-mixed``; None: none)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    grad_scaler: torch.amp.GradScaler | None = None


@dataclass
class RunOutputs:
    """Where a run reports: metric sinks, checkpoints, sample decoding and an optional task score."""

    logger: MetricsLogger  # metric sinks (only rank 0's write)
    checkpoints: CheckpointManager | None = None  # the actor's checkpoints; None: none are written
    config_yaml: str = ""  # the resolved run config, stored in every checkpoint
    progress: bool = True  # a progress bar on rank 0
    decode: Callable[[Sequence[int]], str] | None = None  # token ids → text (tables, rollout log)
    # (prompts, responses) → per-sample scores on decoded text (e.g. a task's gold scorer); its mean
    # is logged as rollout/score and val/score; needs decode
    response_scorer: Callable[[list[str], list[str]], list[float]] | None = None


@dataclass(frozen=True)
class LoopSettings:
    """The trainer section's values the loop reads, resolved once from :class:`PPOConfig`."""

    seed: int  # sampling seeds and minibatch order derive from it (exact resume)
    # ---- rollouts (sizes global, micro-batches per rank)
    num_rollout_samples: int  # prompts per step
    samples_per_prompt: int  # responses per prompt: contiguous rows, the estimator's group
    rollout_rows: int  # responses per step
    rollout_micro_batch_size: int  # responses per generation request
    val_samples: int  # validation prompts
    val_micro_batch_size: int  # responses per validation generation request
    forward_micro_batch_size: int | None  # rows per log-prob forward; None: the actor's default
    value_pretrain_cap: int  # critic-only rollouts at most before the first actor update
    value_pretrain_target: float | None  # held-out explained variance that ends them early
    # ---- advantages (:func:`compute_ppo_data`)
    kl_in_reward: bool  # −β·KL in the reward (else +β·KL in the loss)
    kl_kind: KLKind  # the KL estimator
    discount_factor: float  # γ of the policy's advantages
    gae_lambda: float  # λ of the policy's advantages
    critic_gamma: float  # γ of the critic's returns
    critic_lam: float  # λ of the critic's returns
    gae_lambda_length_alpha: float | None  # the length-adaptive policy λ's α (None: gae_lambda)
    normalize_advantages: bool
    missing_eos_penalty: float | None
    score_clip: float | None
    tis_cap: float  # truncated importance sampling on the engine's log-probs; 0 = off
    on_policy_update: bool  # one optimizer step per rollout: its log-probs are the update's own
    # ---- actor update
    ppo_epochs: int
    global_batch_size: int  # responses per optimizer step
    micro_batch_size: int  # responses per forward/backward
    gradient_clip_val: float
    max_nonfinite_steps_in_a_row: int
    # ---- schedule
    val_check_interval: int
    save_interval: int

    @classmethod
    def of(cls, cfg: PPOConfig) -> LoopSettings:
        """Each field is the :class:`PPOConfig` field or resolved property of the same name."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


class PPOTrainer:
    """The PPO loop (NeMo-Aligner's ``PPOTrainer`` contract).

    Args:
        cfg: the ``trainer`` section (:class:`PPOConfig`); also the one source of the actor's
            sampling settings (set on the actor here).
        model: the actor.
        optim: the actor's optimizer, schedule and loss scaler.
        prompts: training and validation prompts.
        rm_critic: the reward client; an :class:`RMCritic` when the estimator needs a critic.
        outputs: metrics, checkpoints and sample decoding.
        loss: the actor's policy loss (default: :class:`PolicyLoss` of ``cfg``'s loss settings,
            as the recipe builds it).
        engine: what generates the rollouts (default: the ``hf`` engine over ``model``); started
            and closed by the caller. It gets the new weights after every optimizer step.
        run_timer: the run's wall-clock limit (default: none).
        server_overlap_threads: torch threads for the actor's log-prob passes while reward/critic
            requests are in flight and for its update while the critic trains, or ``None`` to
            leave the thread count alone. When the servers share this machine's cores,
            ``cores − server threads`` keeps the processes from oversubscribing them (an OpenMP
            pool that loses a core to another process stalls at every barrier).
    """

    def __init__(
        self,
        cfg: PPOConfig,
        model: CausalLMActor,
        optim: ActorOptim,
        prompts: Prompts,
        rm_critic: RewardClient,
        outputs: RunOutputs,
        *,
        loss: PolicyLoss | None = None,
        engine: RolloutEngine | None = None,
        run_timer: RunTimer | None = None,
        server_overlap_threads: int | None = None,
    ) -> None:
        cfg.check_world_size(dp.world_size())
        self.settings = LoopSettings.of(cfg)
        """The trainer section's values, the only ones read below the constructor."""
        self.estimator = get_estimator(cfg.advantage_estimator)
        """The registered advantage estimator; whether the run has a critic is its ``needs_critic``."""
        self.model = model
        self.optimizer = optim.optimizer
        self.scheduler = optim.scheduler
        self.grad_scaler = optim.grad_scaler or torch.amp.GradScaler(enabled=False)
        self.prompts = prompts
        self.rm_critic = rm_critic
        self.loss = loss or PolicyLoss(PolicyLossConfig.from_ppo(cfg))
        self.engine = engine or HFRolloutEngine(model)
        self.critic = critic_of(rm_critic, self.estimator)
        """The critic's client, or None when the estimator needs no critic (none is called then)."""
        self.logger = outputs.logger
        self.checkpoints = outputs.checkpoints
        """The actor's checkpoint directories (None: none are written)."""
        self.checkpointer = PPOCheckpoints(
            outputs.checkpoints, self.critic, model, self.optimizer, self.scheduler, outputs.config_yaml
        )
        """The two-phase checkpoint (critic first, then the actor) and what a resume reads back."""
        self.rollout_log = RolloutLog(
            outputs.logger,
            sample_table_interval=cfg.sample_table_interval,
            rollout_log_rows=cfg.rollout_log_rows,
            kl_kind=cfg.kl_kind,
            group_size=cfg.samples_per_prompt,
            with_values=self.estimator.needs_critic,
        )
        self.progress = outputs.progress and dp.rank() == 0
        self.decode = outputs.decode
        self.response_scorer = outputs.response_scorer
        self.run_timer = run_timer or RunTimer(None)
        if server_overlap_threads is not None and server_overlap_threads < 1:
            raise ValueError(f"server_overlap_threads must be ≥ 1 or None, got {server_overlap_threads}")
        self.server_overlap_threads = server_overlap_threads
        if self.response_scorer is not None and self.decode is None:
            raise ValueError("response_scorer needs decode (token ids → text)")

        self.step = 0
        self.consumed_samples = 0
        self.ppo_optimization_step = 0
        self.nonfinite_in_a_row = 0
        """Actor optimizer steps skipped for an inf/NaN gradient since the last finite one."""
        self.nonfinite_steps = 0
        """Actor optimizer steps skipped for an inf/NaN gradient in the whole run."""
        self.steps_per_epoch = int(prompts.train.steps_per_epoch)
        self.max_steps = cfg.total_steps(self.steps_per_epoch)
        self.kl_controller: FixedKLController | AdaptiveKLController = (
            AdaptiveKLController(cfg.initial_policy_kl_penalty, cfg.kl_target, cfg.kl_horizon)
            if cfg.adaptive_kl
            else FixedKLController(cfg.initial_policy_kl_penalty)
        )
        # The config is the one source of the sampling settings: the actor samples rollouts with
        # them and scores every log-prob (rollout, initial policy, loss) under the same distribution.
        model.set_sampling(cfg.sampling_params(model.eos_ids))
        self._timer = PhaseTimer()
        self._pending_critic_train: Future[Any] | None = None
        self._critic_train_in_flight = False
        """On every rank: a ``critic_train`` was sent (by rank 0) and its answer not yet shared."""
        self.critic_step: int | None = None
        """The critic server's optimizer steps after the last ``critic_train`` answered (or saved
        with the checkpoint this run resumed from)."""
        self.critic_steps_per_train: int | None = None
        """How many optimizer steps one ``critic_train`` runs (the last answer's; recorded in
        checkpoints)."""
        self._train_iter: Iterator[list[Sequence[int]]] | None = None
        self._update_logprobs: torch.Tensor | None = None
        """[N, S-1] the global batch's log-probs from the last on-policy update's forwards (every
        rank's rows), or None: the rollout pass computed them."""
        self._step_rollouts: tuple[RolloutBatch, PPOData, DecodedRollouts | None] | None = None
        """This rank's rollouts of the step being run and their training data, for the rollout log."""
        self._loss_kl_coef = self.kl_controller.value
        self.history: list[dict[str, float]] = []
        self.value_pretrain_steps = 0
        """Critic-only steps run (value pretraining); the actor has trained ``step − this`` times."""
        self.value_pretraining = self.settings.value_pretrain_cap > 0 and self.critic is not None
        """Whether the next step is still one of value pretraining's critic-only steps."""
        stall = cfg.critic_stall
        self.critic_stall_error = stall.mode == "error"
        self.critic_stall: CriticStallCheck | None = (
            CriticStallCheck(
                stall.updates, stall.min_rise, stall.min_explained_variance, stall.min_update_gain
            )
            if self.critic is not None and stall.mode != "ignore"
            else None
        )
        """Watches the held-out explained variance of this run's first critic updates (None: mode
        ignore, no critic, or a resumed run, see :meth:`fit`)."""

    # ------------------------------------------------------------------ properties
    @property
    def epoch(self) -> int:
        """Whole passes over the prompts so far (critic warm-up rollouts draw prompts too)."""
        return self.consumed_samples // (self.steps_per_epoch * self.settings.num_rollout_samples)

    @property
    def actor_steps(self) -> int:
        """Steps that trained the actor (value pretraining's critic-only steps not counted)."""
        return self.step - self.value_pretrain_steps

    @property
    def compute_init_policy_kl(self) -> bool:
        return self.kl_controller.value > 0

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        """Run PPO steps until max_steps, max_epochs or the wall-clock limit; returns step metrics."""
        self.run_timer.start_time()
        self._train_iter = self.prompts.train(self.consumed_samples)
        bar = _progress(
            self.progress, initial=self.step, total=self._planned_steps(), desc=f"{self.estimator.title} step"
        )
        estimate = RunEstimate(self.step, self._planned_steps())
        if self.step > 0:  # a resumed run: its critic's first updates were judged (or not) before
            self.critic_stall = None
        try:
            while self.actor_steps < self.max_steps:
                metrics = self._one_step()
                self.step += 1
                bar.total = estimate.total_steps = self._planned_steps()
                time_exceeded = self.run_timer.is_finished()
                is_last = self.actor_steps >= self.max_steps or time_exceeded
                if self._due(self.settings.val_check_interval, is_last):
                    metrics |= self.run_validation()
                self._log(metrics)
                self._log_rollouts()
                # the postfix first: update() draws the bar, and it should show this step's metrics
                bar.set_postfix_str(progress_postfix(metrics), refresh=False)
                bar.update(1)
                estimate.step_done(self.step)
                if self._due(self.settings.save_interval, is_last):
                    self.save(metrics)
                if time_exceeded:
                    log.info("max_time_per_run reached at step %d; checkpoint saved, stopping", self.step)
                    break
        finally:
            bar.close()
            self._drain_critic_train()
        return self.history

    def _planned_steps(self) -> int:
        """Steps this run takes: ``max_steps`` actor steps plus the critic-only ones (those left of
        value pretraining counted at its cap)."""
        left = self.settings.value_pretrain_cap - self.value_pretrain_steps if self.value_pretraining else 0
        return self.max_steps + self.value_pretrain_steps + left

    def _one_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        # (1)-(4) rollouts, rewards, values, advantages
        data, metrics = self.generate_rollouts()
        # a critic that has not learned after its first updates is reported (or stops the run)
        self._check_critic_stall(metrics)
        # (0) value pretraining: until the critic explains enough of this rollout's returns (one it
        # has not trained on), or for value_pretrain_cap rollouts, the step trains the critic only
        critic_only = self.value_pretraining and not self._value_pretrain_done(metrics)
        # every rank holds the whole global batch from here on (as NeMo-Aligner's rebalancing)
        global_data = self._gather_global(data)
        # (5) critic training runs on the server while the actor trains
        self._send_critic_train(global_data)
        # (6) actor update
        if not critic_only:
            with self._timer("train"), self._threads_beside_server(self._critic_train_in_flight):
                metrics |= self.run_training(global_data)
            if data.prev_logprobs is None:  # the rollout pass was skipped: its figures from the update's
                metrics |= self._on_policy_rollout_metrics()
        # the critic must finish before the next step's values are requested
        with self._timer("critic_train_wait"):
            metrics |= self._wait_critic_train()
        if self.critic_stall is not None:  # the update's gain on its own rows, for a verdict's cause
            self.critic_stall.update(
                metrics.get("value/train_explained_variance", float("nan")),
                metrics.get("value/explained_variance_after", float("nan")),
            )
        if critic_only:
            self.value_pretrain_steps += 1
            self.value_pretraining = self.value_pretrain_steps < self.settings.value_pretrain_cap
            if not self.value_pretraining and self.settings.value_pretrain_target is not None:
                log.warning(
                    "value pretraining stopped at its cap, trainer.value_pretrain.max_steps=%d, with the "
                    "critic's held-out explained variance at %.3f, below target_explained_variance=%g: "
                    "the actor trains from here on a critic that explains less than asked",
                    self.settings.value_pretrain_cap,
                    metrics.get("value/explained_variance_mc", float("nan")),
                    self.settings.value_pretrain_target,
                )
        metrics["value_pretrain/critic_only"] = float(critic_only)
        metrics["value_pretrain/steps"] = float(self.value_pretrain_steps)
        step_s = time.perf_counter() - t0
        timings = max_over_ranks(self._timer.pop())
        tokens = metrics.pop("_tokens", 0.0)
        timings["timing/step_s"] = step_s
        timings["timing/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
        return metrics | timings | self.engine.pop_metrics()  # e.g. timing/weight_sync_s

    def _check_critic_stall(self, metrics: dict[str, float]) -> None:
        """Feed this rollout's held-out explained variance (a global figure, the same on every rank)
        to the critic-stall check; warn once, or raise :class:`CriticStallError`, on its verdict."""
        if self.critic_stall is None:
            return
        stall = self.critic_stall.observe(metrics.get("value/explained_variance_mc", float("nan")))
        if stall is None:
            return
        if self.critic_stall_error:
            raise CriticStallError(stall.message())
        log.warning("%s", stall.message())

    def _value_pretrain_done(self, metrics: dict[str, float]) -> bool:
        """Whether value pretraining ends before this step's rollout (then trains the actor too):
        its target is set and the critic's explained variance of this rollout's Monte-Carlo
        returns — measured before the critic trains on it — reaches it."""
        target = self.settings.value_pretrain_target
        ev = metrics.get("value/explained_variance_mc", float("nan"))
        if target is None or not ev >= target:  # NaN (returns of zero variance) never reaches it
            return False
        self.value_pretraining = False
        log.info(
            "value pretraining done after %d critic-only step(s): held-out explained variance %.3f ≥ %g",
            self.value_pretrain_steps,
            ev,
            target,
        )
        return True

    # ------------------------------------------------------------------ (1)-(4)
    def generate_rollouts(self) -> tuple[PPOData, dict[str, float]]:
        """One rollout of ``num_rollout_samples`` prompts, each sampled ``n_samples_per_prompt``
        times → training data and rollout metrics."""
        assert self._train_iter is not None, "generate_rollouts runs inside fit()"
        prompts = next(self._train_iter)
        epoch = self.epoch  # the pass these prompts come from
        s = self.settings
        # A prompt's responses are contiguous rows of this rank: the group its estimator compares.
        rows = [p for p in prompts for _ in range(s.samples_per_prompt)]
        batch, metrics, decoded = self._run_inference(rows, s.rollout_micro_batch_size, is_validation=False)
        self.consumed_samples += s.num_rollout_samples
        data, ppo_metrics = self.generate_ppo_data(batch)
        self._step_rollouts = (batch, data, decoded)  # the last one of a step is the step's (after warm-up)
        metrics |= ppo_metrics
        metrics["rollout/consumed_samples"] = float(self.consumed_samples)
        metrics["rollout/epoch"] = float(epoch + 1)
        return data, metrics

    def generate_ppo_data(self, rollout_batch: RolloutBatch) -> tuple[PPOData, dict[str, float]]:
        """Advantages by the run's registered estimator (global statistics over ranks), plus their
        metrics (:func:`compute_ppo_data`): KL-shaped rewards, GAE and whitening for PPO (``gae``);
        a critic-free estimator's baseline otherwise. With the KL as a loss term, the initial
        policy's log-probs go with the data to the update instead of into the reward."""
        s = self.settings
        reward_kl_coef = self.kl_controller.value if s.kl_in_reward else 0.0
        data, stats = compute_ppo_data(
            rollout_batch,
            estimator=self.estimator.name,
            group_size=s.samples_per_prompt,
            kl_coef=reward_kl_coef,
            kl_kind=s.kl_kind,
            gamma=s.discount_factor,
            lam=s.gae_lambda,
            critic_gamma=s.critic_gamma,
            critic_lam=s.critic_lam,
            lam_length_alpha=s.gae_lambda_length_alpha,
            normalize_advantages=s.normalize_advantages,
            missing_eos_penalty=s.missing_eos_penalty,
            score_clip=s.score_clip,
            tis_cap=s.tis_cap,
            reduce=dp.all_reduce_sum,
        )
        if not s.kl_in_reward:
            data.init_logprobs = rollout_batch.init_logprobs
        # β of a KL loss term: the one in effect for these rollouts (before an adaptive update below)
        self._loss_kl_coef = self.kl_controller.value
        # the estimator's statistics are rollout/ figures; the critic's diagnostics come named value/
        metrics = {(k if "/" in k else f"rollout/{k}"): float(v) for k, v in stats.items()}
        if self.estimator.needs_critic:
            # Explained variance of the rollout values against the returns they are trained toward,
            # before the critic trains on them.
            ev = explained_variance(rollout_batch.values, data.returns, data.mask, reduce=dp.all_reduce_sum)
            metrics["value/explained_variance"] = float(ev)
            if self.step == 0 and self.critic_step is None:  # a fresh run, before any critic update
                metrics |= self._value_scale_at_init(rollout_batch.values, data)
        metrics["rollout/kl_coef"] = self.kl_controller.value
        if isinstance(self.kl_controller, AdaptiveKLController) and "sequence_kl" in stats:
            # (on-policy, the KL is known after the update: _on_policy_rollout_metrics updates β)
            # Ziegler et al. track the sequence-level KL: the mean over every rank's samples of each
            # sample's summed KL (a global statistic, so that every rank keeps the same β).
            self.kl_controller.update(float(stats["sequence_kl"]), s.num_rollout_samples)
        return data, metrics

    def _value_scale_at_init(self, values: torch.Tensor, data: PPOData) -> dict[str, float]:
        """The value head's output scale before any update (logged once, at the first step of a
        fresh run): the values' mean, standard deviation and mean magnitude over every rank's
        response tokens, beside the returns' standard deviation they should match."""
        v_mean, v_var = masked_mean_var(values, data.mask, reduce=dp.all_reduce_sum)
        _, r_var = masked_mean_var(data.returns, data.mask, reduce=dp.all_reduce_sum)
        abs_mean, _ = masked_mean_var(values.abs(), data.mask, reduce=dp.all_reduce_sum)
        return {
            "value/init_values_mean": float(v_mean),
            "value/init_values_std": float(v_var.clamp_min(0).sqrt()),
            "value/init_values_abs_mean": float(abs_mean),
            "value/init_returns_std": float(r_var.clamp_min(0).sqrt()),
        }

    def _run_inference(
        self, prompts: Sequence[Sequence[int]], micro_batch_size: int, is_validation: bool
    ) -> tuple[RolloutBatch, dict[str, float], DecodedRollouts | None]:
        """This rank's rollouts of ``prompts`` with their rewards and values, the rollout metrics
        (``val/`` or ``rollout/``), and their texts and task scores (None without ``decode``)."""
        self._wait_critic_train()  # values must come from the critic after its last update
        outs: list[dict[str, torch.Tensor]] = []
        engine_logprobs: list[torch.Tensor | None] = []  # the engine's own, to compare with ours
        futures: list[RMCriticFuture] = []
        with self._timer("validation" if is_validation else "generate"):
            micro_batches = self.prompts.micro_batches(prompts, micro_batch_size, self.prompts.collate)
            for i, mb in enumerate(micro_batches):
                request = RolloutRequest(
                    mb["text"],
                    mb["length"],
                    self.model.sampling,
                    self._seeds(i, len(mb["length"]), is_validation),
                )
                generation = self.engine.generate(request)
                engine_logprobs.append(generation.logprobs)
                out = {
                    "response_tokens": generation.tokens,
                    "response_lengths": generation.sequence_lengths,
                    "prompt_lengths": generation.prompt_lengths,
                    "is_end": generation.is_end,
                }
                futures.append(self.rm_critic.infer_rm_critic(out))  # overlaps the next generation
                outs.append(out)
        eos = int(self.model.pad_id)
        tokens = pad_and_stack([o["response_tokens"] for o in outs], eos)
        lengths = torch.cat([o["response_lengths"] for o in outs])
        prompt_lengths = torch.cat([o["prompt_lengths"] for o in outs])
        is_end = torch.cat([o["is_end"] for o in outs]).bool()
        phase = "validation" if is_validation else "logprobs"
        server_busy = bool(futures)  # the reward/critic requests are being answered meanwhile
        # On-policy (one optimizer step per rollout), the update's forward scores these tokens with
        # these very weights: its log-probs, detached, are the ratio's denominator and fill in
        # batch.logprobs afterwards (_on_policy_rollout_metrics). Critic-only steps train no actor.
        on_policy = not is_validation and self.settings.on_policy_update and not self.value_pretraining
        logprobs = None
        if not on_policy:
            with self._timer(phase), self._threads_beside_server(server_busy):
                logprobs = self.model.get_inference_log_probs(
                    tokens, lengths, self.settings.forward_micro_batch_size, prompt_lengths
                ).cpu()
        init_logprobs = None
        if not is_validation and self.compute_init_policy_kl:
            with self._timer("init_logprobs"), self._threads_beside_server(server_busy):
                init_logprobs = self.model.get_init_policy_logprobs(
                    tokens, lengths, self.settings.forward_micro_batch_size, prompt_lengths
                ).cpu()
        with self._timer("validation" if is_validation else "critic_wait"):
            results = [f.result() for f in futures]
        rewards = torch.cat([r.float().reshape(-1) for r, _ in results])
        width = tokens.shape[1] - 1
        if self.critic is None:  # the estimator needs no critic: there are no values
            values = torch.zeros(len(rewards), width)
        else:
            values = pad_and_stack([_critic_values(v, self.estimator.name) for _, v in results], 0.0)
            values = torch.nn.functional.pad(values, (0, width - values.shape[1]))[:, :width]
        engine_lp = None
        if engine_logprobs and all(lp is not None for lp in engine_logprobs):
            engine_lp = pad_and_stack([lp for lp in engine_logprobs if lp is not None], 0.0)[:, :width]
            engine_lp = torch.nn.functional.pad(engine_lp, (0, width - engine_lp.shape[1]))
        batch = RolloutBatch(
            sequence_tokens=tokens,
            sequence_lengths=lengths,
            prompt_lengths=prompt_lengths,
            is_end=is_end,
            logprobs=logprobs,
            init_logprobs=init_logprobs,
            rewards=rewards,
            values=values,
            engine_logprobs=engine_lp,
        )
        decoded = None
        if self.decode is not None:
            stop_ids = self.model.sampling.stop_token_ids or ()
            decoded = decode_rollouts(batch, self.decode, stop_ids, self.response_scorer)
        prefix = "val" if is_validation else "rollout"
        metrics = rollout_metrics(batch, prefix, decoded)
        if engine_lp is not None and logprobs is not None:
            metrics |= self._engine_check(batch, prefix)
        return batch, metrics, decoded

    def _engine_check(self, batch: RolloutBatch, prefix: str) -> dict[str, float]:
        """The engine's log-probs against ours (``{prefix}/engine_*``), both set in ``batch``."""
        assert batch.engine_logprobs is not None and batch.logprobs is not None
        mask = response_mask(batch.prompt_lengths, batch.sequence_lengths, batch.logprobs.shape[1])
        stats = self.engine.check_logprobs(batch.engine_logprobs, batch.logprobs, mask)
        return {f"{prefix}/engine_{k}": v for k, v in stats.items()}

    def _on_policy_rollout_metrics(self) -> dict[str, float]:
        """After an on-policy update: this rank's rows of its log-probs become the step's rollout
        log-probs (for the rollout log), and the figures that needed them are computed as the
        rollout pass would have: the KL metrics, the adaptive β's update, the engine check."""
        assert self._step_rollouts is not None and self._update_logprobs is not None
        batch = self._step_rollouts[0]
        n, width = len(batch), batch.values.shape[1]
        rank = dp.rank()  # the global batch is every rank's rows, rank-major
        batch.logprobs = self._update_logprobs[rank * n : (rank + 1) * n, :width].contiguous()
        self._update_logprobs = None
        stats = kl_metrics(batch, self.settings.kl_kind, reduce=dp.all_reduce_sum)
        metrics = {f"rollout/{k}": float(v) for k, v in stats.items()}
        if isinstance(self.kl_controller, AdaptiveKLController):
            self.kl_controller.update(float(stats["sequence_kl"]), self.settings.num_rollout_samples)
        if batch.engine_logprobs is not None:
            metrics |= self._engine_check(batch, "rollout")
        return metrics

    def _seeds(self, micro_batch: int, rows: int, is_validation: bool) -> torch.Tensor:
        """[rows] int64 per-row seeds of one generation request: consecutive from its micro-batch's."""
        # A fresh seed per (step, rank, micro-batch) makes sampling independent of history, so a
        # resumed run draws exactly the tokens an uninterrupted one would.
        # The index is global (rank-major), so N ranks draw what one process would on the same batch.
        s = self.settings
        mbs = s.val_micro_batch_size if is_validation else s.rollout_micro_batch_size
        samples = s.val_samples if is_validation else s.rollout_rows
        index = dp.rank() * (samples // dp.world_size() // mbs) + micro_batch
        seed = derive_seed(s.seed, int(is_validation), self.step, self.consumed_samples, index)
        return row_seeds(seed, rows)

    # ------------------------------------------------------------------ (5) critic
    def _gather_global(self, data: PPOData) -> PPOData:
        """Every rank's rollout rows, in rank order, on every rank (identity on one process)."""
        if dp.world_size() == 1:
            return data
        with self._timer("gather"):
            return PPOData(
                sequence_tokens=dp.all_gather_rows(data.sequence_tokens, pad_value=int(self.model.pad_id)),
                prompt_lengths=dp.all_gather_rows(data.prompt_lengths),
                is_end=dp.all_gather_rows(data.is_end.to(torch.uint8)).bool(),
                mask=dp.all_gather_rows(data.mask),
                prev_logprobs=(
                    dp.all_gather_rows(data.prev_logprobs) if data.prev_logprobs is not None else None
                ),
                advantages=dp.all_gather_rows(data.advantages),
                returns=dp.all_gather_rows(data.returns),
                values=dp.all_gather_rows(data.values),
                init_logprobs=(
                    dp.all_gather_rows(data.init_logprobs) if data.init_logprobs is not None else None
                ),
                is_weights=dp.all_gather_rows(data.is_weights) if data.is_weights is not None else None,
            )

    def _send_critic_train(self, data: PPOData) -> None:
        """Rank 0 sends the global batch to ``critic_train``; the answer is awaited later. Nothing
        without a critic (critic-free estimators)."""
        if self.critic is None:
            return
        self._wait_critic_train()
        if dp.rank() == 0:
            payload = {
                "response_tokens": data.sequence_tokens,
                "returns": data.returns,
                "values": data.values,
                "mask": data.mask,
            }
            self._pending_critic_train = self.critic.train(payload)
        self._critic_train_in_flight = True

    @contextmanager
    def _threads_beside_server(self, server_busy: bool) -> Iterator[None]:
        """``server_overlap_threads`` torch threads for the block when ``server_busy``."""
        if self.server_overlap_threads is None or not server_busy:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.server_overlap_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _wait_critic_train(self) -> dict[str, float]:
        """The last ``critic_train`` answer as ``value/*`` metrics, on every rank ({} if none).

        Every rank calls this at the same points; rank 0 awaits the future and shares the
        outcome, so that a failed request stops every rank at once (instead of leaving the
        others blocked in their next collective until its timeout).
        """
        if not self._critic_train_in_flight:
            return {}
        self._critic_train_in_flight = False
        pending, self._pending_critic_train = self._pending_critic_train, None
        result = dp.run_guarded(
            lambda: pending.result() if pending is not None else None, "critic_train", leader_only=True
        )
        if isinstance(result, dict):
            if "critic_step" in result:
                self._follow_critic_step(int(result["critic_step"]), int(result["critic_optimizer_steps"]))
            return {f"value/{k}": float(v) for k, v in result.items()}
        return {"value/loss": float(result)} if result is not None else {}

    def _drain_critic_train(self) -> None:
        """On the way out (no collectives: other ranks may be elsewhere), let a request finish."""
        pending, self._pending_critic_train = self._pending_critic_train, None
        self._critic_train_in_flight = False
        if pending is not None and not pending.done():
            try:
                pending.result()
            except Exception as e:  # the run is already ending; its own error is the one to report
                log.warning("critic_train still in flight at exit failed: %s", e)

    def _follow_critic_step(self, step: int, steps_run: int) -> None:
        """Record the critic server's step after a ``critic_train`` that ran ``steps_run`` optimizer
        steps; warn when the server did not start it from the step recorded last (the last answer,
        or the checkpoint this run resumed from): checked from the very first answer."""
        last = self.critic_step
        self.critic_step, self.critic_steps_per_train = step, steps_run
        if last is not None and step != last + steps_run:
            log.warning(
                "the critic server is at critic step %d after this step's critic_train, expected %d (%d "
                "+ the %d optimizer steps it ran): it does not hold the critic this run trained last — "
                "it restarted from another checkpoint, or was sent back to one by another trainer (or a "
                "step was skipped for a non-finite gradient). The run goes on, but is not an exact "
                "continuation; for one, rerun train-ppo: it resumes from its last checkpoint and sends "
                "the critic server back to the critic saved with it.",
                step,
                last + steps_run,
                last,
                steps_run,
            )

    # ------------------------------------------------------------------ (6) actor
    def run_training(self, data: PPOData) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches with gradient accumulation.

        ``data`` is the global batch (the same on every rank). Each minibatch of
        ``global_batch_size`` rows is drawn from one global permutation; rank r takes its r-th
        contiguous share. The loss of an optimizer step is normalised over the whole minibatch:
        its denominator (:func:`~openaligner.algorithms.aggregation_units` — valid tokens for
        ``token_mean``, samples for the ``seq_mean_*`` aggregations) is counted over every rank's
        share once per step, each micro-batch's loss is its share of the step's, and the ranks'
        gradients are summed. So the gradient, and every ``policy/`` metric, is that of the
        minibatch in one piece, whatever ``micro_batch_size`` and the number of ranks.

        Returns:
            ``policy/*`` metrics, each the mean over this call's optimizer steps of the step's
            value: ``loss``, ``pg_loss``, ``entropy``, ``kl_loss`` as the step's loss is
            aggregated; ``ppo_ratio``, ``ppo_ratio_clamped``, ``clip_fraction``, ``approx_kl`` as
            means over the step's response tokens, ``dual_clip_fraction`` over those with a
            negative advantage; ``grad_norm``, ``lr`` (and ``loss_scale``); ``skipped_steps`` (a
            count) and ``optim_step``.
        """
        s = self.settings
        world, rank = dp.world_size(), dp.rank()
        local_gbs = s.global_batch_size // world
        n_micro = local_gbs // s.micro_batch_size
        params = self.model.parameters()
        sums_per_step: list[torch.Tensor] = []  # this rank's STEP_SUMS of every optimizer step
        # on-policy (no prev_logprobs): the forwards' own log-probs, every row once (one step)
        own = torch.zeros(len(data), data.mask.shape[1]) if data.prev_logprobs is None else None
        same_on_ranks: dict[str, float] = defaultdict(float)  # sums over steps of rank-equal values
        count = 0
        for ppo_epoch in range(s.ppo_epochs):
            g = torch.Generator().manual_seed(derive_seed(s.seed, 2, self.step, ppo_epoch))
            order = torch.randperm(len(data), generator=g)
            for global_start in range(0, len(data), s.global_batch_size):
                mine = order[global_start + rank * local_gbs : global_start + (rank + 1) * local_gbs]
                # the step's denominator: every rank's units, summed once
                rows = data.select(mine)
                units = dp.all_reduce_sum(self.loss.units(rows.mask, rows.is_end).reshape(1))[0]
                self.optimizer.zero_grad(set_to_none=True)
                sums = torch.zeros(len(STEP_SUMS), dtype=torch.float64)
                for m in range(n_micro):
                    picked = mine[m * s.micro_batch_size : (m + 1) * s.micro_batch_size]
                    mb = data.select(picked)
                    policy = self.model if own is None else _KeepingLogprobs(self.model, own, picked)
                    loss, metrics = self.loss(policy, self._loss_batch(mb, units))
                    self.grad_scaler.scale(loss).backward()  # this micro-batch's share of the step
                    sums += step_sums(metrics)
                sums_per_step.append(sums)
                outcome = optimizer_step(
                    params,
                    self.optimizer,
                    self.scheduler,
                    self.grad_scaler,
                    max_grad_norm=s.gradient_clip_val,
                    gradients="sum",  # each rank's loss is its rows' share of the minibatch's
                )
                grad_norm = outcome.grad_norm
                if outcome.stepped:
                    self.ppo_optimization_step += 1
                    self.nonfinite_in_a_row = 0
                    # the rollout engine samples the next rollouts from these weights
                    self.engine.update_weights(self.model, self.ppo_optimization_step)
                else:
                    self._skip_nonfinite_step(grad_norm, outcome.loss_scale)
                    same_on_ranks["skipped_steps"] += 1.0
                same_on_ranks["grad_norm"] += grad_norm
                same_on_ranks["lr"] += float(self.optimizer.param_groups[0]["lr"])
                if self.grad_scaler.is_enabled():
                    same_on_ranks["loss_scale"] += float(self.grad_scaler.get_scale())
                count += 1
        self.optimizer.zero_grad(set_to_none=True)
        if own is not None:  # each rank filled its rows (the others are 0): the sum is every row's
            assert count == 1, "an on-policy update is one optimizer step"
            self._update_logprobs = dp.all_reduce_sum(own) if world > 1 else own
        per_step = step_metrics(dp.all_reduce_sum(torch.stack(sums_per_step)))  # one collective
        out = {f"policy/{k}": float(v.mean()) for k, v in per_step.items()}
        out |= {f"policy/{k}": v / count for k, v in same_on_ranks.items()}
        out["policy/skipped_steps"] = same_on_ranks.get("skipped_steps", 0.0)  # a count, not a mean
        out["policy/optim_step"] = float(self.ppo_optimization_step)
        return out

    def _loss_batch(self, mb: PPOData, units: torch.Tensor) -> dict[str, torch.Tensor]:
        """The policy loss's inputs for micro-batch ``mb`` of a step whose loss divides by ``units``."""
        batch = {
            "sequence_tokens": mb.sequence_tokens,
            "prompt_lengths": mb.prompt_lengths,
            "advantages": mb.advantages,
            "mask": mb.mask,
            "is_end": mb.is_end,
            "loss_units": units,
        }
        if mb.prev_logprobs is not None:  # else on-policy: the loss's own forward, detached
            batch["prev_logprobs"] = mb.prev_logprobs
        if mb.is_weights is not None:  # truncated importance sampling
            batch["is_weights"] = mb.is_weights
        if mb.init_logprobs is not None:  # the KL as a loss term
            batch["init_logprobs"] = mb.init_logprobs
            batch["kl_coef"] = torch.tensor(self._loss_kl_coef, dtype=torch.float64)
        return batch

    def _skip_nonfinite_step(self, grad_norm: float, loss_scale: float) -> None:
        """Leave the weights, optimizer and schedule as they are; stop after too many in a row.

        Under fp16 loss scaling an overflow is routine while the scale is still high (the
        scaler halves it after each): such steps are skipped and counted in
        ``policy/skipped_steps`` but not toward the limit until the scale has fallen below 1,
        where the gradients are non-finite on their own.
        """
        self.nonfinite_steps += 1
        if self.grad_scaler.is_enabled() and loss_scale >= 1.0:
            log.info("PPO step %d: fp16 gradients overflowed; step skipped, loss scale lowered", self.step)
            return
        self.nonfinite_in_a_row += 1
        limit = self.settings.max_nonfinite_steps_in_a_row
        log.warning(
            "PPO step %d: the actor's gradient norm is %s; optimizer step skipped (%d in a row, limit %d)",
            self.step,
            grad_norm,
            self.nonfinite_in_a_row,
            limit,
        )
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteTrainingError(
                f"the actor's gradient was inf/NaN in {self.nonfinite_in_a_row} optimizer steps in a row "
                f"(trainer.max_nonfinite_steps_in_a_row={limit}), so training stopped instead of going on "
                "without learning. Usual causes: a learning rate too high for the model, fp16 without "
                "loss scaling, or a reward/critic server returning inf/NaN. Lower optim.lr or "
                "trainer.gradient_clip_val, check the rollout/rewards and value/ metrics, and resume from "
                "the last checkpoint"
            )

    # ------------------------------------------------------------------ (7) validation, logs
    def run_validation(self) -> dict[str, float]:
        if self.prompts.val is None:
            return {}
        t0 = time.perf_counter()
        prompts = next(iter(self.prompts.val(0)))
        batch, metrics, decoded = self._run_inference(
            prompts, self.settings.val_micro_batch_size, is_validation=True
        )
        self.rollout_log.table("table/val_rollouts", self.step, batch, decoded)
        self._timer.pop()  # validation phases are reported as one figure below
        metrics["timing/validation_s"] = time.perf_counter() - t0
        return metrics

    def _due(self, interval: int, is_last: bool) -> bool:
        return interval > 0 and (self.step % interval == 0 or is_last)

    def _log(self, metrics: dict[str, float]) -> None:
        metrics = {k: v for k, v in metrics.items() if not k.startswith("_")}
        metrics["step"] = float(self.step)
        self.history.append(metrics)
        self.logger.log(metrics, self.step)

    def _log_rollouts(self) -> None:
        """The step just run (``self.step``, as its metrics): its rollouts to the rollout log and
        the preview table. Called on every rank."""
        assert self._step_rollouts is not None, "a step's rollouts are logged after the step"
        (batch, data, decoded), self._step_rollouts = self._step_rollouts, None
        self.rollout_log.step(self.step, batch, data, decoded)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loop's state a checkpoint records (``trainer_state.json``)."""
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "ppo_optimization_step": self.ppo_optimization_step,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_steps": self.nonfinite_steps,
            "kl_controller": self.kl_controller.state_dict(),
            "critic_step": self.critic_step,
            "critic_steps_per_train": self.critic_steps_per_train,
            "value_pretrain_steps": self.value_pretrain_steps,
            "value_pretraining": self.value_pretraining,
        }

    def save(self, metrics: dict[str, float]) -> None:
        """Checkpoint the critic and the actor (:meth:`PPOCheckpoints.save`: the actor's half is
        published once the critic's is durable), with the trainer state. Every rank calls this."""
        self._wait_critic_train()
        self.checkpointer.save(self.step, metrics, self.state_dict())

    def load_checkpoint(self, path: Path) -> None:
        """Restore the actor, optimizer, scheduler, trainer state and RNGs from ``path``
        (:meth:`PPOCheckpoints.load`), and hand the restored weights to the engine; every rank
        calls it."""
        self.load_state_dict(self.checkpointer.load(path))
        self.engine.update_weights(self.model, self.ppo_optimization_step)  # the restored weights
        log.info("resumed from %s at step %d (%d samples consumed)", path, self.step, self.consumed_samples)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The trainer state :meth:`state_dict` wrote (a checkpoint's ``trainer_state.json``)."""
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.ppo_optimization_step = int(state["ppo_optimization_step"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.critic_step = state.get("critic_step")
        self.critic_steps_per_train = state.get("critic_steps_per_train")
        # a checkpoint from before value pretraining was resumable warmed up inside its first step
        self.value_pretrain_steps = int(state.get("value_pretrain_steps", 0))
        self.value_pretraining = bool(
            state.get("value_pretraining", self.value_pretraining and self.step == 0)
        )


class _KeepingLogprobs:
    """The actor as the policy loss scores with it, keeping the log-probs of its training forward
    (detached) in rows ``rows`` of ``into`` [N, S-1] (columns before ``first_position`` left as
    they are): an on-policy update's log-probs, which the rollout pass would have computed."""

    def __init__(self, actor: CausalLMActor, into: torch.Tensor, rows: torch.Tensor) -> None:
        self.actor, self.into, self.rows = actor, into, rows

    @property
    def device(self) -> torch.device:
        return self.actor.device

    def training_logprobs(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None = None,
        prompt_lengths: torch.Tensor | None = None,
        *,
        first_position: int = 0,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor.training_logprobs(
            tokens, lengths, prompt_lengths, first_position=first_position, entropy_grad=entropy_grad
        )
        self.into[self.rows, first_position:] = out[0].detach().to(self.into)
        return out


def _critic_values(values: torch.Tensor | None, estimator: str) -> torch.Tensor:
    if values is None:
        raise TypeError(
            f"trainer.advantage_estimator={estimator} needs a critic, but the reward client returned no "
            "values: use a client with a critic (RemoteGPTRMCriticClient)"
        )
    return values.float()


def critic_of(client: RewardClient, estimator: Estimator) -> RMCritic | None:
    """``client`` as the critic's client when ``estimator`` needs a critic (it must then be an
    :class:`RMCritic`), else None: a run without a critic calls none."""
    return cast(RMCritic, client) if estimator.needs_critic else None


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on ``parts`` (unlike ``hash``, stable across processes)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _progress(enabled: bool, initial: int, total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True)


def max_time_s(cfg: PPOConfig) -> float | None:
    return parse_duration_s(cfg.max_time_per_run)
