"""The typed configuration of a PPO run: the trainer section (NeMo-Aligner's ``trainer.ppo`` keys
plus the math switches) and the run around it (actor, optimizer, data, servers, outputs).

Validation happens here, once, at load time: invalid combinations are refused with a message
naming the key and the fix. Below the trainer's constructor only plain values are used.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast, get_args

from openaligner.algorithms import KL_KINDS, LOSS_AGGREGATIONS, KLKind, LossAggregation
from openaligner.clients.critic import RemoteCriticConfig
from openaligner.data.render import check_chat_template_mode
from openaligner.models.lora import LoraConfig
from openaligner.models.precision import check_precision, check_save_dtype
from openaligner.models.sharding import ActorParallelConfig
from openaligner.models.source import ModelSourceConfig, TokenizerSourceConfig
from openaligner.rollout.config import RolloutConfig
from openaligner.trainer.critic_stall import CRITIC_STALL_MODES, MIN_UPDATE_GAIN
from openaligner.trainer.estimators import ESTIMATORS, Estimator, KLPlacement
from openaligner.trainer.optim import OptimConfig

if TYPE_CHECKING:
    from openaligner.models.generation import SamplingParams


@dataclass
class SamplingConfig:
    """Rollout sampling: the one source of the actor's sampling settings (its log-probs score the
    distribution sampled from: same temperature, same early stop-id ban)."""

    use_greedy: bool = False  # argmax decoding instead of sampling
    temperature: float = 1.0  # logits are divided by this when sampling and when scoring
    top_k: int = 0  # must stay 0 for training: log-probs are of the full distribution
    top_p: float = 1.0  # must stay 1 for training: log-probs are of the full distribution
    stop_token_ids: list[int] | None = None  # ids that end a response besides the tokenizer's EOS
    end_strings: list[str] = field(default_factory=list)  # strings that end a response


@dataclass
class LengthConfig:
    max_length: int = 64  # maximum new tokens per response (stop token included)
    min_length: int = 1  # stop ids are banned (in sampling and in the log-probs) before this many tokens


@dataclass
class ValuePretrainConfig:
    """Value pretraining (VC-PPO): critic-only rollouts of the initial policy before the actor's
    first update, until the critic's held-out explained variance reaches a target or a step cap."""

    max_steps: int = 0  # cap on critic-only rollouts (their prompts count as used); 0 = no pretraining
    # stop once the critic explains this share of the Monte-Carlo returns' variance on a rollout it
    # has not trained on (value/explained_variance_mc, in (0, 1)); null = always max_steps rollouts
    target_explained_variance: float | None = None


@dataclass
class CriticStallConfig:
    """The critic-stall check (trainer/critic_stall.py): after ``updates`` critic updates, a critic
    whose held-out explained variance neither rose by ``min_rise`` nor reached
    ``min_explained_variance`` is reported, unless its updates gained ``min_update_gain`` on their
    own rows on average without an overshoot (docs/ppo.md, *A critic that does not learn*)."""

    mode: str = "warn"  # warn (once) | error (stop the run) | ignore (no check; YAML reads "off" as false)
    updates: int = 15  # critic updates before the verdict (>= 1; serve-critic warms up over 10 by default)
    min_rise: float = 0.2  # rise of the held-out explained variance above its first value: learning
    min_explained_variance: float = 0.5  # a held-out explained variance good enough without a rise
    min_update_gain: float = MIN_UPDATE_GAIN  # own-row gain of the updates (mean, no overshoot): silent


@dataclass
class PPOConfig:
    """One PPO run: loop lengths, PPO math, batch sizes, sampling."""

    # ---- loop and schedule
    max_epochs: int = 1  # passes over the prompt set
    max_steps: int = -1  # PPO steps cap (≥ 1); -1 = max_epochs whole passes
    max_time_per_run: str | None = None  # wall-clock limit "DD:HH:MM:SS"; the run saves and stops
    val_check_interval: int = 10  # validate every N steps (0 disables; also at the last step)
    save_interval: int = 10  # checkpoint every N steps (0 disables; also at the last step)
    sample_table_interval: int = 1  # log a 4-row prompt/response/reward preview table every N steps
    rollout_log_rows: int | None = None  # responses per step in logs/rollouts.jsonl; null = all, 0 = none
    seed: int = 1234  # seeds sampling, shuffling and minibatching (exact resume relies on it)
    # ---- algorithm (docs/algorithms.md)
    # gae (PPO + critic) | reinforce | rloo | grpo | dr_grpo | reinforce_pp | any registered one
    advantage_estimator: str = "gae"
    n_samples_per_prompt: int | None = None  # responses per prompt; null: 4 (group estimators) or 1
    # ---- rewards and KL
    initial_policy_kl_penalty: float = 0.01  # β of the KL to the initial policy; 0 disables the KL term
    kl_in: str | None = None  # reward (−β·KL in the reward) | loss (+β·KL in the loss); null: per estimator
    use_absolute_kl: bool = True  # |logp − logp_ref| (NeMo-Aligner); ignored when kl_estimator is set
    kl_estimator: str | None = None  # k1 | abs | k2 | k3; null: k3 in the loss, else abs/k1 (use_absolute_kl)
    adaptive_kl: bool = False  # adapt β toward kl_target (Ziegler et al. 2019)
    kl_target: float = 6.0  # adaptive KL: target mean sequence KL
    kl_horizon: float = 10000.0  # adaptive KL: horizon in samples
    missing_eos_penalty: float | None = None  # score given to responses that never ended; null = RM score
    score_clip: float | None = None  # clip RM scores to [−c, c] (c > 0); null = no clipping
    # ---- advantages
    discount_factor: float = (
        1.0  # γ of the policy's advantages (and of the critic's returns unless set below)
    )
    gae_lambda: float = 0.95  # λ of the policy's advantages (and of the critic's returns unless set below)
    critic_discount_factor: float | None = (
        None  # γ of the critic's returns (decoupled GAE); null = discount_factor
    )
    critic_gae_lambda: float | None = None  # λ of the critic's returns (decoupled GAE); null = gae_lambda
    # VAPO's length-adaptive policy λ = 1 − 1/(α·l) per response of l tokens (replaces gae_lambda for
    # the advantages; the critic's returns keep critic_gae_lambda); null = off
    gae_lambda_length_alpha: float | None = None
    normalize_advantages: bool = True  # gae: global masked whitening (the others normalise their own way)
    # ---- policy loss
    ratio_eps: float = 0.2  # PPO clip ε
    ratio_eps_high: float | None = None  # upper ε ("clip-higher"); null = ratio_eps
    dual_clip: float | None = None  # dual-clip constant c > 1; null disables
    entropy_bonus: float = 0.0  # weight of the entropy bonus; 0 = off, < 0 penalises entropy
    loss_aggregation: str | None = None  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    gate_unfinished: bool = True  # samples that never ended get no policy gradient (NeMo-Aligner)
    tis_cap: float = 0.0  # truncated importance sampling: weigh pg by min(π_trainer/π_engine, cap); 0 = off
    gradient_clip_val: float = 1.0  # actor gradient-norm clip (≥ 0); 0 disables
    max_nonfinite_steps_in_a_row: int = 3  # stop after this many inf/NaN-gradient (skipped) steps in a row
    ppo_epochs: int = 1  # passes over each rollout (NeMo-Aligner: 1)
    # one optimizer step per rollout (see on_policy_update): the ratio's denominator is the training
    # forward's own log-probs, detached, instead of a separate rollout log-prob pass; false: the pass
    reuse_update_logprobs: bool = True
    critic_warmup_steps: int = (
        0  # a fixed number of critic-only rollouts first (= value_pretrain.max_steps, no target)
    )
    value_pretrain: ValuePretrainConfig = field(default_factory=ValuePretrainConfig)
    critic_stall: CriticStallConfig = field(default_factory=CriticStallConfig)
    # ---- batch sizes (all global, i.e. summed over data-parallel ranks)
    num_rollout_samples: int = 64  # prompts per step (each sampled n_samples_per_prompt times)
    rollout_micro_batch_size: int = 8  # responses per generation call (per rank)
    forward_micro_batch_size: int | None = None  # rows per log-prob forward; null = rollout_micro_batch_size
    logits_chunk_mb: float | None = 256.0  # largest fp32 logits block (MiB), else the head in chunks
    num_val_samples: int | None = None  # validation prompts; null = num_rollout_samples
    val_rollout_micro_batch_size: int | None = None  # null = rollout_micro_batch_size
    global_batch_size: int = 16  # responses per actor optimizer step
    micro_batch_size: int = 4  # responses per forward/backward (gradient accumulation)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    length: LengthConfig = field(default_factory=LengthConfig)

    def __post_init__(self) -> None:
        self.advantage_estimator = str(self.advantage_estimator).strip().lower()
        estimator = ESTIMATORS.get(self.advantage_estimator)
        if estimator is not None:  # an unknown one is refused by _check_ppo, naming the choices
            if self.n_samples_per_prompt is None:
                self.n_samples_per_prompt = estimator.default_samples_per_prompt
            if self.kl_in is None:
                self.kl_in = estimator.default_kl_in
            if self.loss_aggregation is None:
                self.loss_aggregation = estimator.default_loss_aggregation
        _check_ppo(self)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs the critic server (its registration's ``needs_critic``)."""
        return ESTIMATORS[self.advantage_estimator].needs_critic

    @property
    def critic_gamma(self) -> float:
        """γ of the critic's returns: ``critic_discount_factor``, else ``discount_factor``."""
        return self.discount_factor if self.critic_discount_factor is None else self.critic_discount_factor

    @property
    def critic_lam(self) -> float:
        """λ of the critic's returns: ``critic_gae_lambda``, else ``gae_lambda``."""
        return self.gae_lambda if self.critic_gae_lambda is None else self.critic_gae_lambda

    @property
    def value_pretrain_cap(self) -> int:
        """Critic-only rollouts at most before the actor trains: ``value_pretrain.max_steps``, or
        ``critic_warmup_steps`` (its fixed-count form; both set is refused at load)."""
        return self.value_pretrain.max_steps or self.critic_warmup_steps

    @property
    def value_pretrain_target(self) -> float | None:
        """The held-out explained variance that ends value pretraining early (None: the cap only)."""
        return self.value_pretrain.target_explained_variance

    @property
    def samples_per_prompt(self) -> int:
        """``n_samples_per_prompt``, resolved at load."""
        assert self.n_samples_per_prompt is not None
        return self.n_samples_per_prompt

    @property
    def rollout_rows(self) -> int:
        """Responses per step: ``num_rollout_samples × n_samples_per_prompt`` (global)."""
        return self.num_rollout_samples * self.samples_per_prompt

    @property
    def kl_kind(self) -> KLKind:
        """The KL estimator: ``kl_estimator`` (checked at load), else the default for ``kl_in``."""
        if self.kl_estimator is not None:
            return cast("KLKind", self.kl_estimator)
        if self.kl_in == "loss":
            return "k3"
        return "abs" if self.use_absolute_kl else "k1"

    @property
    def aggregation(self) -> LossAggregation:
        """``loss_aggregation``, resolved and checked at load."""
        assert self.loss_aggregation is not None
        return cast("LossAggregation", self.loss_aggregation)

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in == "reward"

    @property
    def on_policy_update(self) -> bool:
        """Whether the rollout log-prob pass of the current policy is skipped, its log-probs being
        the actor update's own (detached): ``reuse_update_logprobs`` and each rollout consumed by
        exactly one optimizer step (``ppo_epochs`` 1, ``global_batch_size`` the whole rollout), so
        the update's forward runs on the weights that sampled it; and nothing needs the log-probs
        before the update: no KL in the reward (it enters the advantages), no ``tis_cap``
        (its weights enter the loss). The ratio is then exactly 1 and the gradient the same."""
        return (
            self.reuse_update_logprobs
            and self.ppo_epochs == 1
            and self.global_batch_size == self.rollout_rows
            and not (self.kl_in_reward and self.initial_policy_kl_penalty > 0)
            and self.tis_cap == 0
        )

    def sampling_params(self, eos_ids: Sequence[int]) -> SamplingParams:
        """The rollout sampling parameters; responses stop on ``eos_ids`` (the tokenizer's EOS)
        plus ``sampling.stop_token_ids``."""
        # Imported here: loading the config (e.g. `--print-config`) need not import transformers.
        from openaligner.models.generation import SamplingParams

        s = self.sampling
        return SamplingParams(
            greedy=s.use_greedy,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            max_new_tokens=self.length.max_length,
            min_new_tokens=self.length.min_length,
            stop_token_ids=tuple(sorted({*eos_ids, *(s.stop_token_ids or ())})),
            stop_strings=tuple(s.end_strings),
        )

    def total_steps(self, steps_per_epoch: int) -> int:
        """PPO steps of a run: ``max_steps``, bounded by ``max_epochs`` passes over the prompts
        (``steps_per_epoch`` batches each), of which value pretraining's critic-only rollouts draw
        some too (counted at their cap: the run's length and schedule are known before it starts)."""
        by_epochs = max(0, steps_per_epoch * self.max_epochs - self.value_pretrain_cap)
        return by_epochs if self.max_steps < 0 else min(by_epochs, self.max_steps)

    @property
    def val_samples(self) -> int:
        return self.num_val_samples if self.num_val_samples is not None else self.num_rollout_samples

    @property
    def val_micro_batch_size(self) -> int:
        return self.val_rollout_micro_batch_size or self.rollout_micro_batch_size

    def check_world_size(self, world: int) -> None:
        """Batch sizes must split evenly over ``world`` ranks so that no rank runs an extra collective
        (and, with several samples per prompt, so that each prompt's responses stay on one rank)."""
        problems = []
        if self.num_rollout_samples % world:
            problems.append(
                f"num_rollout_samples={self.num_rollout_samples} must be a multiple of ranks = {world}"
            )
        if self.rollout_rows % (world * self.rollout_micro_batch_size):
            rows = (
                f"num_rollout_samples × n_samples_per_prompt = {self.rollout_rows}"
                if self.samples_per_prompt > 1
                else f"num_rollout_samples={self.num_rollout_samples}"
            )
            problems.append(
                f"{rows} must be a multiple of ranks × rollout_micro_batch_size = {world} × "
                f"{self.rollout_micro_batch_size}"
            )
        if self.val_check_interval > 0 and self.val_samples % (world * self.val_micro_batch_size):
            problems.append(
                f"num_val_samples={self.val_samples} must be a multiple of "
                f"ranks × val_rollout_micro_batch_size = {world} × {self.val_micro_batch_size}"
            )
        if self.global_batch_size % (world * self.micro_batch_size):
            problems.append(
                f"global_batch_size={self.global_batch_size} must be a multiple of "
                f"ranks × micro_batch_size = {world} × {self.micro_batch_size}"
            )
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class DataConfig:
    train_path: str = "???"  # JSONL or datasets directory of prompt records (docs/data.md)
    val_path: str | None = None  # validation prompts; null = the first num_val_samples training prompts
    split: str = "train"  # split of a datasets directory holding a DatasetDict (train_path)
    val_split: str = "test"  # split of a DatasetDict val_path
    prompt_key: str = "prompt"  # field of the prompt: text, or a list of {"role", "content"} messages
    messages_key: str = "messages"  # field of the conversation in records without prompt_key
    chat_template: str = "auto"  # auto (the tokenizer's template if it has one) | true | false (raw text)
    seq_length: int = 256  # longest prompt + response (≤ the actor's positions); longer prompts are dropped
    add_bos: bool = True  # start each prompt with the tokenizer's BOS id (if it has one; never twice)
    metadata_keys: list[str] = field(
        default_factory=list
    )  # prompt fields sent to the reward server with each response

    def __post_init__(self) -> None:
        self.chat_template = check_chat_template_mode(self.chat_template, "data.chat_template")


@dataclass
class ExpConfig:
    output_dir: str = "runs/ppo"  # logs, checkpoints and the final actor go here
    save_dtype: str = "auto"  # final actor dtype: auto (as actor.path is stored, fp32 tiny), fp32, bf16, fp16
    keep_last: int = 2  # checkpoints kept besides the best one (0 keeps all)
    resume: bool = True  # continue from the newest checkpoint whose critic the critic server holds
    tensorboard: bool = True  # also write TensorBoard events
    wandb_project: str | None = None  # log to this W&B project when wandb is installed
    progress: bool = True  # progress bar on rank 0
    task_scorer: str | None = None  # a built-in task's gold scorer logged as rollout/score (e.g. sorting)
    # torch threads while the servers compute on the same cores (log-prob passes, update); null: unchanged
    server_overlap_threads: int | None = None


def _schema_ppo() -> PPOConfig:
    """``trainer``'s defaults as the schema holds them, the keys whose null means "the estimator's
    default" still null: ``PPOConfig()`` resolves them for gae at once, and a schema built on that
    would give an estimator named on the command line gae's samples, KL placement and aggregation."""
    c = PPOConfig()
    c.n_samples_per_prompt = c.kl_in = c.loss_aggregation = None
    return c


@dataclass
class TrainPPOConfig:
    # modules imported before this config is validated (a dotted name or a .py path), e.g. a user's
    # estimator registration (docs/algorithms.md); every rank imports them
    plugins: list[str] = field(default_factory=list)
    actor: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # the SFT policy to train
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # the actor's tokenizer
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ... (torchrun: cuda:LOCAL_RANK)
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    trainer: PPOConfig = field(default_factory=lambda: _schema_ppo())
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, betas=[0.9, 0.95]))
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA actor; initial policy = adapters disabled
    parallel: ActorParallelConfig = field(default_factory=ActorParallelConfig)  # ddp replicas or fsdp shards
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # what generates the rollouts
    data: DataConfig = field(default_factory=DataConfig)
    remote: RemoteCriticConfig = field(default_factory=RemoteCriticConfig)
    exp: ExpConfig = field(default_factory=ExpConfig)

    def __post_init__(self) -> None:
        if None in (self.trainer.n_samples_per_prompt, self.trainer.kl_in, self.trainer.loss_aggregation):
            self.trainer.__post_init__()  # built in code, not loaded: the estimator's defaults, as a load
        check_precision(self.precision, "precision")
        self.parallel.check_precision(self.precision)
        check_save_dtype(self.exp.save_dtype, "exp.save_dtype")
        if self.exp.server_overlap_threads is not None and self.exp.server_overlap_threads < 1:
            raise ValueError(
                f"exp.server_overlap_threads must be >= 1 or null, got {self.exp.server_overlap_threads}"
            )
        if self.exp.task_scorer is not None:
            from openaligner.tasks import TASK_SCORERS

            if self.exp.task_scorer not in TASK_SCORERS:
                raise ValueError(f"exp.task_scorer must be one of {sorted(TASK_SCORERS)} or null")
        if self.trainer.tis_cap and self.rollout.engine == "hf":
            raise ValueError(
                "trainer.tis_cap corrects for a rollout engine that samples from other numerics than the "
                "trainer's; the hf engine samples with the trainer's own modules (there is nothing to "
                "correct): set trainer.tis_cap=0, or rollout.engine=vllm"
            )
        if self.lora.enabled and self.lora.dropout > 0:
            raise ValueError(
                f"lora.dropout={self.lora.dropout:g} would never apply: the actor trains in eval mode (its "
                "log-probs must be those of the distribution it sampled from); set lora.dropout=0"
            )
        if self.trainer.length.max_length >= self.data.seq_length:
            raise ValueError(
                f"trainer.length.max_length={self.trainer.length.max_length} leaves no room for prompts in "
                f"data.seq_length={self.data.seq_length}; raise seq_length or lower max_length"
            )


_DURATION = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_duration_s(text: str | None) -> float | None:
    """``"DD:HH:MM:SS"`` → seconds; ``None`` → ``None`` (no limit)."""
    if text is None:
        return None
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"max_time_per_run must look like DD:HH:MM:SS (e.g. 00:04:00:00), got {text!r}")
    d, h, mi, s = (int(x) for x in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)


def _check_ppo(c: PPOConfig) -> None:
    def bad(key: str, why: str) -> None:
        raise ValueError(f"trainer.{key}: {why}")

    if c.tis_cap != 0 and c.tis_cap < 1:
        # a cap below 1 scales every token's gradient down: training would silently learn less
        bad("tis_cap", f"must be 0 (off) or >= 1 (veRL and slime use 2), got {c.tis_cap:g}")

    if c.advantage_estimator not in ESTIMATORS:
        bad("advantage_estimator", f"must be one of {', '.join(ESTIMATORS)}, got {c.advantage_estimator!r}")
    _check_estimator(c, ESTIMATORS[c.advantage_estimator], bad)

    if c.kl_estimator is not None and c.kl_estimator not in KL_KINDS:
        bad("kl_estimator", f"must be one of {', '.join(KL_KINDS)} or null, got {c.kl_estimator!r}")
    if c.kl_estimator == "k1" and c.kl_in == "loss" and c.initial_policy_kl_penalty > 0:
        # ∇(log π − log π_ref) = ∇log π, of expectation 0 over the tokens sampled from π
        bad(
            "kl_estimator",
            "k1 as a loss term has zero expected gradient, so the KL penalty would do nothing; "
            "use k3 (or k2, or null) with kl_in=loss, or kl_in=reward for k1",
        )
    if c.loss_aggregation not in LOSS_AGGREGATIONS:
        bad("loss_aggregation", f"must be one of {', '.join(LOSS_AGGREGATIONS)}, got {c.loss_aggregation!r}")
    if c.logits_chunk_mb is not None and not c.logits_chunk_mb > 0:
        bad("logits_chunk_mb", f"must be > 0 (MiB) or null (whole logits), got {c.logits_chunk_mb}")
    if c.dual_clip is not None and c.dual_clip <= 1.0:
        bad("dual_clip", f"must be > 1 (e.g. 3.0) or null, got {c.dual_clip}")
    if c.ratio_eps <= 0 or (c.ratio_eps_high is not None and c.ratio_eps_high <= 0):
        bad("ratio_eps", "clip ranges must be > 0")
    if not 0.0 <= c.discount_factor <= 1.0 or not 0.0 <= c.gae_lambda <= 1.0:
        bad("discount_factor", "γ (discount_factor) and λ (gae_lambda) must lie in [0, 1]")
    for key in ("critic_discount_factor", "critic_gae_lambda"):
        if (value := getattr(c, key)) is not None and not 0.0 <= value <= 1.0:
            bad(key, f"must lie in [0, 1], or null (the policy's), got {value}")
    if c.gae_lambda_length_alpha is not None and not c.gae_lambda_length_alpha > 0:
        bad(
            "gae_lambda_length_alpha",
            "must be > 0 (VAPO uses 0.05: λ = 1 − 1/(α·l)), or null (gae_lambda), got "
            f"{c.gae_lambda_length_alpha}",
        )
    _check_value_pretrain(c, bad)
    _check_critic_stall(c.critic_stall, bad)
    if c.adaptive_kl and c.initial_policy_kl_penalty <= 0:
        bad("adaptive_kl", "needs initial_policy_kl_penalty > 0 as the starting β; set it (e.g. 0.05)")
    if c.adaptive_kl and (c.kl_target <= 0 or c.kl_horizon <= 0):
        bad("kl_target", "adaptive KL needs kl_target > 0 and kl_horizon > 0")
    if c.score_clip is not None and not c.score_clip > 0:
        # clipping to [−c, c] with c ≤ 0 gives every response the same score: no reward signal
        bad("score_clip", f"must be > 0 (e.g. 5.0) or null (no clipping), got {c.score_clip}")
    if c.initial_policy_kl_penalty < 0:
        bad("initial_policy_kl_penalty", "must be ≥ 0 (0 disables the KL penalty)")
    if c.max_epochs < 1:
        bad("max_epochs", "must be ≥ 1")
    if c.max_steps == 0 or c.max_steps < -1:
        # 0 would run no step and export the initial policy as if trained
        bad("max_steps", f"must be ≥ 1, or -1 (max_epochs whole passes), got {c.max_steps}")
    if c.ppo_epochs < 1:
        bad("ppo_epochs", "must be ≥ 1")
    if c.gradient_clip_val < 0:
        bad("gradient_clip_val", f"must be ≥ 0 (0 disables clipping, e.g. 1.0), got {c.gradient_clip_val}")
    if c.max_nonfinite_steps_in_a_row < 1:
        bad("max_nonfinite_steps_in_a_row", "must be ≥ 1 (steps with an inf/NaN gradient are always skipped)")
    for key in ("num_rollout_samples", "rollout_micro_batch_size", "global_batch_size", "micro_batch_size"):
        if getattr(c, key) < 1:
            bad(key, "must be ≥ 1")
    for key in ("forward_micro_batch_size", "val_rollout_micro_batch_size", "num_val_samples"):
        if (size := getattr(c, key)) is not None and size < 1:  # 0 would silently mean null
            bad(key, f"must be ≥ 1, or null (its default), got {size}")
    if c.rollout_rows % c.global_batch_size:
        rows = (
            f"num_rollout_samples × n_samples_per_prompt = {c.rollout_rows}"
            if c.samples_per_prompt > 1
            else f"num_rollout_samples={c.num_rollout_samples}"
        )
        bad(
            "global_batch_size",
            f"{rows} must be a multiple of global_batch_size={c.global_batch_size} so every actor step "
            "sees a full batch",
        )
    # the split on one rank, here; on several, check_world_size once the ranks are known
    splits = (
        ("micro_batch_size", c.global_batch_size, "global_batch_size"),
        ("rollout_micro_batch_size", c.rollout_rows, "num_rollout_samples × n_samples_per_prompt"),
        ("val_rollout_micro_batch_size", c.val_samples if c.val_check_interval > 0 else 0, "num_val_samples"),
    )
    for key, n_rows, what in splits:
        size = getattr(c, key) or c.rollout_micro_batch_size  # val_rollout_micro_batch_size: null
        if n_rows % size:
            bad(key, f"must divide {what}={n_rows} (whole micro-batches), got {size}")
    if c.rollout_log_rows is not None and c.rollout_log_rows < 0:
        bad(
            "rollout_log_rows",
            f"must be ≥ 0 (0 = no rollout log) or null (every response), got {c.rollout_log_rows}",
        )
    if c.val_check_interval < 0 or c.save_interval < 0:
        bad("save_interval", "intervals must be ≥ 0 (0 disables)")
    if c.save_interval > 0 and c.val_check_interval > 0 and c.save_interval % c.val_check_interval:
        bad(
            "save_interval",
            f"must be a multiple of val_check_interval={c.val_check_interval} so that every checkpoint "
            "has a validation reward (set save_interval to a multiple, or val_check_interval=0)",
        )
    if c.sampling.temperature <= 0:
        bad("sampling.temperature", "must be > 0; use sampling.use_greedy=true for argmax")
    if c.sampling.top_k != 0 or c.sampling.top_p != 1.0:
        key = "sampling.top_k" if c.sampling.top_k != 0 else "sampling.top_p"
        bad(
            key,
            f"top_k={c.sampling.top_k}, top_p={c.sampling.top_p}: PPO scores rollouts with log-probs of the "
            "full softmax (at the sampling temperature), so sampling from a truncated distribution would "
            "make every ratio and KL estimate wrong without any error (NeMo-Aligner issue #46). Use "
            "top_k=0 and top_p=1.0 for training, and lower sampling.temperature to sample more "
            "conservatively",
        )
    if c.length.max_length < 1 or not 0 <= c.length.min_length <= c.length.max_length:
        bad("length.min_length", "need 0 ≤ min_length ≤ max_length and max_length ≥ 1")
    if c.length.min_length == c.length.max_length and (
        c.gate_unfinished or c.missing_eos_penalty is not None
    ):
        # stop ids are banned before min_length tokens, so no response can end on one
        why = (
            "gate_unfinished=true gives none of them a policy gradient"
            if c.gate_unfinished
            else "missing_eos_penalty gives all of them the same score"
        )
        bad(
            "length.min_length",
            f"min_length = max_length = {c.length.max_length} bans the stop tokens at every position, so "
            f"no response ends and {why}: the policy learns nothing. Set min_length ≤ "
            f"{c.length.max_length - 1} (or, for fixed-length responses, gate_unfinished=false and "
            "missing_eos_penalty=null)",
        )
    if parse_duration_s(c.max_time_per_run) == 0:  # checked after each step: one step, then a stop
        bad("max_time_per_run", "must be longer than 00:00:00:00 (e.g. 00:04:00:00), or null (no limit)")
    # last: an estimator's own refusals may rely on every general check above
    estimator = ESTIMATORS[c.advantage_estimator]
    refusal = estimator.refuse(c) if estimator.refuse is not None else None
    if refusal is not None:
        bad(*refusal)


def _check_estimator(c: PPOConfig, estimator: Estimator, bad: Callable[[str, str], None]) -> None:
    """Refuse estimator settings that would learn nothing, or less than asked, without an error."""
    name = c.advantage_estimator
    n = c.samples_per_prompt
    if n < 1:
        bad("n_samples_per_prompt", f"must be ≥ 1, got {n}")
    if estimator.needs_groups and n < 2:
        bad(
            "n_samples_per_prompt",
            f"{name} scores each response against the other responses to the same prompt; with "
            f"n_samples_per_prompt={n} there is none, every advantage is 0 and the policy learns nothing. "
            "Set it to 2 or more (e.g. 4)",
        )
    if estimator.needs_groups and c.sampling.use_greedy:
        bad(
            "sampling.use_greedy",
            f"greedy decoding gives {name} the same response n_samples_per_prompt times, so every "
            "advantage is 0 and the policy learns nothing; sample (use_greedy=false)",
        )
    if c.kl_in not in KL_PLACEMENTS:
        bad("kl_in", f"must be reward, loss or null (the estimator's default), got {c.kl_in!r}")
    if not estimator.needs_critic and c.value_pretrain_cap:
        key = "critic_warmup_steps" if c.critic_warmup_steps else "value_pretrain.max_steps"
        bad(key, f"{name} uses no critic, so there is nothing to warm up; set {key}=0")
    if not estimator.needs_critic:
        for key in ("critic_discount_factor", "critic_gae_lambda", "gae_lambda_length_alpha"):
            if getattr(c, key) is not None:
                bad(key, f"{name} has no critic and no GAE, so {key} would do nothing; set it to null")
    if c.loss_aggregation == "seq_mean_token_sum_norm" and c.length.max_length < 1:
        bad("loss_aggregation", "seq_mean_token_sum_norm divides by length.max_length, which must be ≥ 1")


def _check_value_pretrain(c: PPOConfig, bad: Callable[[str, str], None]) -> None:
    """Refuse value-pretraining settings that cannot work: negative counts, both forms at once, a
    target with no cap to bound it, or a target the explained variance cannot reach."""
    v = c.value_pretrain
    if c.critic_warmup_steps < 0:
        bad("critic_warmup_steps", "must be ≥ 0")
    if v.max_steps < 0:
        bad("value_pretrain.max_steps", f"must be ≥ 0 (0 = no value pretraining), got {v.max_steps}")
    if c.critic_warmup_steps and v.max_steps:
        bad(
            "critic_warmup_steps",
            f"critic_warmup_steps={c.critic_warmup_steps} is the fixed-count form of "
            f"value_pretrain.max_steps={v.max_steps}; set only one (value_pretrain.max_steps with a "
            "target_explained_variance stops early)",
        )
    target = v.target_explained_variance
    if target is None:
        return
    if not c.value_pretrain_cap:
        bad(
            "value_pretrain.target_explained_variance",
            f"{target} needs a step cap: set value_pretrain.max_steps ≥ 1 (critic-only rollouts at most)",
        )
    if not 0.0 < target < 1.0:
        # EV = 1 − Var(G − V)/Var(G) ≤ 1, and = 1 only for a critic without any error: a target at or
        # above 1 is never reached and would spend every capped rollout without the actor learning
        bad(
            "value_pretrain.target_explained_variance",
            f"must lie in (0, 1): explained variance is at most 1 (a critic without error), so {target} "
            "would never be reached and every capped rollout would go to the critic; e.g. 0.5",
        )


def _check_critic_stall(s: CriticStallConfig, bad: Callable[[str, str], None]) -> None:
    """Refuse critic-stall settings the check cannot apply: an unknown mode, no update to judge
    after, a negative rise or update gain, or a level explained variance (at most 1) never reaches."""
    if s.mode not in CRITIC_STALL_MODES:
        bad("critic_stall.mode", f"must be one of {', '.join(CRITIC_STALL_MODES)}, got {s.mode!r}")
    if s.updates < 1:
        bad("critic_stall.updates", f"must be ≥ 1 (critic updates before the verdict), got {s.updates}")
    if not s.min_rise >= 0:
        bad("critic_stall.min_rise", f"must be ≥ 0, got {s.min_rise}")
    if not s.min_update_gain >= 0:
        bad("critic_stall.min_update_gain", f"must be ≥ 0 (.inf: never silent), got {s.min_update_gain}")
    if not s.min_explained_variance <= 1:
        bad(
            "critic_stall.min_explained_variance",
            "must be ≤ 1 (explained variance is at most 1, a critic without error), got "
            f"{s.min_explained_variance}",
        )


def algorithm_name(estimator: str) -> str:
    """The name of the algorithm ``trainer.advantage_estimator=estimator`` runs (``grpo`` → GRPO)."""
    found = ESTIMATORS.get(estimator)
    return found.title if found is not None else estimator
