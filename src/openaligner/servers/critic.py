"""The critic server: a trainable value model behind ``critic_infer``, ``critic_train`` and ``critic_save``.

Owns the three endpoints' logic (:class:`CriticInferEndpoint`, :class:`CriticTrainEndpoint`,
:class:`CriticSaveEndpoint`: plain objects tested on in-memory arrays) and the server that runs
them (:class:`CriticServerTrainer`): one lock around all three, the rank-0 / subscriber loop of
:mod:`openaligner.servers.distributed` with the FORWARD, TRAIN, SAVE and RESTORE opcodes,
data-parallel critic training, atomic checkpoints with resume, going back to a checkpoint the
trainer names (``critic_save`` with ``restore_step``), and the optional shared-secret token that
guards training, saving and restoring. The value loss comes from :mod:`openaligner.algorithms`;
transport from :mod:`openaligner.servers.transport.triton`. Must not know about PPO, the actor or HTTP
details.

Combined mode (the default, as NeMo-Aligner): the same server also answers rewards from a frozen
:class:`RewardModel` kept next to the critic. Both are resident at once — twice the weights in
memory, in exchange for no weight swapping and a reward model that training can never touch.

Precision (:mod:`openaligner.models.precision`): the critic holds float32 master weights and
optimizer state; its training and inference forwards run under the precision's autocast and its
backward through the precision's loss scaler. The reward model is whatever dtype it was loaded in
(the compute dtype) and runs under the same autocast. Checkpoints hold the masters.

Shapes: ``tokens`` [N, S] int64; ``returns``, ``prev_values``, ``mask`` [N, S-1] float32, next-token
aligned — position t holds the critic's value at token t, and the values trained are
``critic(tokens)[:, :-1]``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from openaligner.algorithms import explained_variance, value_loss
from openaligner.io.checkpoint import CheckpointManager, verify_checkpoint
from openaligner.io.metrics import MetricsLogger
from openaligner.models.critic import CriticModel
from openaligner.models.positions import position_limit
from openaligner.models.precision import Precision
from openaligner.models.reward import RewardModel
from openaligner.models.weights import load_weights_into
from openaligner.servers.batching import merge_rows, pad_rows, padding_multiple, split_rows, strip_columns
from openaligner.servers.distributed import Collective, Opcode, Rank0Dispatcher
from openaligner.servers.protocol import (
    CLIP_FRACTION,
    CRITIC_DEFAULT_PORT,
    CRITIC_INFER_INPUTS,
    CRITIC_INFER_NAME,
    CRITIC_INFER_OUTPUTS_COMBINED,
    CRITIC_INFER_OUTPUTS_SEPARATE,
    CRITIC_SAVE_INPUTS,
    CRITIC_SAVE_NAME,
    CRITIC_SAVE_OUTPUTS,
    CRITIC_TRAIN_INPUTS,
    CRITIC_TRAIN_NAME,
    CRITIC_TRAIN_OUTPUTS,
    DEFAULT_HOST,
    DUMMY_VAR,
    EXPLAINED_VARIANCE,
    GRAD_NORM,
    LOSS_MEAN,
    LR,
    MASK,
    OPTIMIZER_STEPS,
    PREV_VALUES,
    RESTORE_STEP,
    RETURNS,
    REWARDS,
    STATUS,
    STEP,
    TOKEN_ENV,
    TOKEN_PARAMETER,
    TRAIN_TOKENS,
    VALUES,
    TensorSpec,
)
from openaligner.servers.reward import EndpointStats, RewardRequest, TokenizeFn, parse_sequence_request
from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES
from openaligner.servers.transport.lifecycle import ServerLifecycle
from openaligner.servers.transport.triton import Batching, TritonHost
from openaligner.servers.validation import (
    RequestError,
    UnauthorizedError,
    check_aligned_width,
    check_finite,
    check_known_inputs,
    check_mask,
    check_token_ids,
)

LOGGER = logging.getLogger(__name__)

CRITIC_DIR = "critic"
"""Checkpoint sub-directory holding the critic as a Hugging Face directory (safetensors)."""
STATE_FILE = "critic_state.json"
_NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
"""A pass-through loss scaler (``step`` is ``optimizer.step()``)."""


@dataclass
class CriticServerConfig:
    """How the critic server serves and trains (model, optimizer and batch sizes come separately)."""

    host: str = DEFAULT_HOST  # address to bind; anything but loopback is logged as a warning
    port: int = CRITIC_DEFAULT_PORT  # HTTP port
    combine_rm_and_critic_server: bool = True  # also serve rewards from a frozen reward model
    loss_clip_val: float = 0.2  # value clipping around prev_values; 0 disables
    gradient_clip_val: float = 1.0  # clip the global gradient norm; 0 disables
    micro_batch_size: int = 1  # training rows per forward/backward on one rank
    inference_micro_batch_size: int | list[int] = 4  # preferred infer rows per rank (Triton batcher)
    max_queue_delay_microseconds: int = 2000  # how long Triton holds an infer request to merge it
    strip_sequence_length_to_multiple: int | None = None  # compute width multiple (null: longest row)
    max_batch_size: int = 1024  # most rows per infer request and per formed batch
    max_train_rows: int = 16384  # most rows per train request
    max_sequence_length: int | None = None  # longest accepted sequence; None: the critic's position limit
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest HTTP request body (HTTP 413 above)
    token: str | None = None  # shared secret for critic_train/critic_save; None: $OPENALIGNER_TOKEN or open
    heartbeat_s: float | None = 60.0  # idle heartbeat to the other ranks
    exit_timeout_s: int = 3  # at stop, how long calls in progress may take to finish
    log_file: str | None = None  # tritonserver's log file; None: temporary, removed at stop
    workspace_dir: str | None = None  # root of the server's own files; None: <tmp>/openaligner-servers-<uid>

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.loss_clip_val < 0 or self.gradient_clip_val < 0:
            raise ValueError("loss_clip_val and gradient_clip_val must be >= 0 (0 disables)")
        if self.max_train_rows < 1 or self.max_batch_size < 1:
            raise ValueError("max_train_rows and max_batch_size must be >= 1")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")


# ----------------------------------------------------------------------------- infer endpoint
InferForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""``(tokens [B, S], lengths [B]) -> (values [B, S], rewards [B] or None)`` for a shaped batch."""


class CriticInferEndpoint:
    """``critic_infer``: values at every token, plus rewards in combined mode.

    Inputs as the reward model's endpoint (``sentences`` or ``tokens`` + ``sequence_lengths``,
    validated by the same function); outputs ``values`` [B, S] (0 from each row's length on) and,
    when ``combined``, ``rewards`` [B, 1]. Without ``combined`` the output is *only* ``values``:
    Triton requires every output to share the batch size, so no placeholder is sent.

    Args:
        forward: see :data:`InferForward`; ``B`` is a multiple of ``dp_size``.
        combined: whether ``forward`` also returns rewards.
        Others: as :class:`openaligner.servers.reward.RewardEndpoint`.
    """

    inputs = CRITIC_INFER_INPUTS

    def __init__(
        self,
        forward: InferForward,
        *,
        combined: bool,
        model_name: str = CRITIC_INFER_NAME,
        tokenize_func: TokenizeFn | None = None,
        vocab_size: int | None = None,
        max_sequence_length: int | None = None,
        max_batch_size: int = 1024,
        forward_micro_batch_size: int = 4,
        strip_sequence_length_to_multiple: int | None = None,
        dp_size: int = 1,
    ) -> None:
        self.forward = forward
        self.combined = combined
        self.model_name = model_name
        self.tokenize_func = tokenize_func
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.forward_micro_batch_size = forward_micro_batch_size
        self.strip_multiple = strip_sequence_length_to_multiple
        self.dp_size = dp_size
        self.stats = EndpointStats()

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return CRITIC_INFER_OUTPUTS_COMBINED if self.combined else CRITIC_INFER_OUTPUTS_SEPARATE

    def validate(self, inputs: Mapping[str, np.ndarray]) -> RewardRequest:
        """Check one request (see :func:`openaligner.servers.reward.parse_sequence_request`)."""
        return parse_sequence_request(
            inputs,
            tokenize_func=self.tokenize_func,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            max_batch_size=self.max_batch_size,
        )

    def run(self, requests: Sequence[RewardRequest]) -> list[dict[str, np.ndarray]]:
        """Merge, strip, pad rows, forward, then give each request its rows at its own width."""
        tokens, lengths = merge_rows([(r.tokens, r.lengths) for r in requests])
        width = tokens.shape[1]
        tokens = strip_columns(tokens, lengths, self.strip_multiple)
        rows = tokens.shape[0]
        tokens, lengths, extra = pad_rows(
            tokens, lengths, padding_multiple(rows, self.forward_micro_batch_size, self.dp_size)
        )
        values, rewards = self.forward(tokens, lengths)
        values = values.detach().to("cpu", torch.float32)
        values = torch.nn.functional.pad(values, (0, width - values.shape[1]))  # stripped columns are 0
        self.stats.calls += 1
        self.stats.requests += len(requests)
        self.stats.rows += rows
        self.stats.padded_rows += extra
        counts = [r.rows for r in requests]
        answers = [
            {VALUES.name: v[:, : r.tokens.shape[1]].numpy()}
            for v, r in zip(split_rows(values, counts), requests, strict=True)
        ]
        if self.combined:
            assert rewards is not None, "combined mode needs rewards from the forward"
            flat = rewards.detach().to("cpu", torch.float32).reshape(-1)
            for answer, piece in zip(answers, split_rows(flat, counts), strict=True):
                answer[REWARDS.name] = piece.reshape(-1, 1).numpy()
        return answers


# ----------------------------------------------------------------------------- train endpoint
@dataclass(frozen=True)
class TrainRequest:
    """One validated training request."""

    tokens: torch.Tensor  # [N, S] int64
    returns: torch.Tensor  # [N, S-1] float32
    prev_values: torch.Tensor  # [N, S-1] float32
    mask: torch.Tensor  # [N, S-1] float32, 0 or 1


@dataclass(frozen=True)
class TrainResult:
    """What one training request did (answered as ``critic_train``'s outputs)."""

    loss_mean: float  # clipped value loss, mean over this request's optimizer steps
    clip_fraction: float  # share of valid positions whose value moved more than the clip
    explained_variance: float  # of the values before each step against the returns
    grad_norm: float  # gradient norm before clipping, mean over the steps
    lr: float  # learning rate of the last step
    step: int  # optimizer steps taken so far, all requests included
    optimizer_steps: int  # steps taken by this request

    def outputs(self) -> dict[str, np.ndarray]:
        return {
            LOSS_MEAN.name: np.array([self.loss_mean], np.float32),
            CLIP_FRACTION.name: np.array([self.clip_fraction], np.float32),
            EXPLAINED_VARIANCE.name: np.array([self.explained_variance], np.float32),
            GRAD_NORM.name: np.array([self.grad_norm], np.float32),
            LR.name: np.array([self.lr], np.float32),
            STEP.name: np.array([self.step], np.int64),
            OPTIMIZER_STEPS.name: np.array([self.optimizer_steps], np.int64),
        }


def _check_whole(inputs: Mapping[str, np.ndarray], spec: TensorSpec) -> np.ndarray:
    """A required input of a non-batched endpoint, with its dtype and number of dimensions."""
    if spec.name not in inputs:
        raise RequestError(
            f"input '{spec.name}' ({spec.dtype_name} {spec.wire_shape}: {spec.doc}) is required"
        )
    array = inputs[spec.name]
    if array.dtype != np.dtype(spec.dtype) or array.ndim != len(spec.shape):
        raise RequestError(
            f"input '{spec.name}': expected {spec.dtype_name} {spec.wire_shape}, got {array.dtype} "
            f"{list(array.shape)}"
        )
    return array


class CriticTrainEndpoint:
    """``critic_train`` (not batched): one request is one training pass.

    Args:
        train: runs the pass on a validated request (usually every rank's TRAIN).
        vocab_size: every token id must lie in ``[0, vocab_size)``; None skips the check.
        max_rows: most rows per request.
        max_sequence_length: widest accepted ``tokens``; None skips the check.
    """

    inputs = CRITIC_TRAIN_INPUTS
    outputs = CRITIC_TRAIN_OUTPUTS

    def __init__(
        self,
        train: Callable[[TrainRequest], TrainResult],
        *,
        model_name: str = CRITIC_TRAIN_NAME,
        vocab_size: int | None = None,
        max_rows: int = 16384,
        max_sequence_length: int | None = None,
    ) -> None:
        self.train = train
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.max_sequence_length = max_sequence_length

    def validate(self, inputs: Mapping[str, np.ndarray]) -> TrainRequest:
        """Check dtypes, shapes (``[N, S]`` and three ``[N, S-1]``), ids, finiteness and the mask.

        Raises:
            RequestError: naming the input, and the row and position where it matters.
        """
        check_known_inputs(inputs, self.inputs)
        tokens = _check_whole(inputs, TRAIN_TOKENS)
        aligned = {spec.name: _check_whole(inputs, spec) for spec in (RETURNS, PREV_VALUES, MASK)}
        check_aligned_width(tokens, aligned)
        if tokens.shape[0] > self.max_rows:
            raise RequestError(
                f"request has {tokens.shape[0]} rows; this server trains on at most {self.max_rows} per "
                f"request (server.max_train_rows): split it"
            )
        if self.max_sequence_length is not None and tokens.shape[1] > self.max_sequence_length:
            raise RequestError(
                f"input 'tokens' is {tokens.shape[1]} wide, more than the server's max_sequence_length "
                f"{self.max_sequence_length}"
            )
        check_token_ids(tokens, self.vocab_size)
        for name, array in aligned.items():
            check_finite(name, array)
        check_mask(aligned[MASK.name])
        return TrainRequest(
            tokens=torch.from_numpy(np.array(tokens, dtype=np.int64)),
            returns=torch.from_numpy(np.array(aligned[RETURNS.name], dtype=np.float32)),
            prev_values=torch.from_numpy(np.array(aligned[PREV_VALUES.name], dtype=np.float32)),
            mask=torch.from_numpy(np.array(aligned[MASK.name], dtype=np.float32)),
        )

    def run(self, requests: Sequence[TrainRequest]) -> list[dict[str, np.ndarray]]:
        """Train on each request in turn (a non-batched endpoint gets exactly one)."""
        return [self.train(r).outputs() for r in requests]


class CriticSaveEndpoint:
    """``critic_save`` (not batched): write a checkpoint, or go back to one; the client cannot
    choose where.

    Without ``restore_step`` the server writes a checkpoint of its current step and answers once
    it is durable. With ``restore_step`` it writes nothing: it loads its own checkpoint of that
    critic step (weights, optimizer, scheduler, step), so that a resumed trainer continues with
    the critic saved with its checkpoint; a step it does not hold complete is refused, naming the
    steps it holds. Both are idempotent (sent twice, they leave the same state).

    Args:
        save: writes the checkpoint and returns the step it holds.
        restore: loads the checkpoint of a critic step and returns that step.
        restorable: ``None`` when the checkpoint of a step can be restored, else why not.
        enabled: False when the server has no checkpoint directory; requests are then refused.
    """

    inputs = CRITIC_SAVE_INPUTS
    outputs = CRITIC_SAVE_OUTPUTS

    def __init__(
        self,
        save: Callable[[], int],
        restore: Callable[[int], int],
        restorable: Callable[[int], str | None],
        *,
        enabled: bool,
        model_name: str = CRITIC_SAVE_NAME,
    ) -> None:
        self.save = save
        self.restore = restore
        self.restorable = restorable
        self.enabled = enabled
        self.model_name = model_name

    def validate(self, inputs: Mapping[str, np.ndarray]) -> int | None:
        """The critic step to restore, or ``None`` to save.

        Raises:
            RequestError: no checkpoint directory, or a ``restore_step`` the server cannot restore.
        """
        check_known_inputs(inputs, self.inputs)
        _check_whole(inputs, DUMMY_VAR)
        if not self.enabled:
            raise RequestError(
                "this critic server has no checkpoint directory, so nothing can be saved; start it with "
                "checkpoint.dir=<directory>"
            )
        if RESTORE_STEP.name not in inputs:
            return None
        array = _check_whole(inputs, RESTORE_STEP)
        if array.size != 1:
            raise RequestError(f"input '{RESTORE_STEP.name}': expected int64 [1], got {list(array.shape)}")
        step = int(array[0])
        problem = self.restorable(step)
        if problem is not None:
            name = RESTORE_STEP.name
            raise RequestError(f"input '{name}': cannot go back to critic step {step}: {problem}")
        return step

    def run(self, requests: Sequence[int | None]) -> list[dict[str, np.ndarray]]:
        answers = []
        for restore_step in requests:
            step = self.save() if restore_step is None else self.restore(restore_step)
            answers.append({STATUS.name: np.array([0], np.int64), STEP.name: np.array([step], np.int64)})
        return answers


# ----------------------------------------------------------------------------- training math
def pad_to_multiple(request: TrainRequest, multiple: int) -> TrainRequest:
    """Append rows (token 0, mask 0: they train nothing) so N is a multiple of ``multiple``."""
    extra = -request.tokens.shape[0] % multiple
    if extra == 0:
        return request

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((extra, t.shape[1]))])

    return TrainRequest(
        grow(request.tokens), grow(request.returns), grow(request.prev_values), grow(request.mask)
    )


def trained_width(mask: torch.Tensor) -> int:
    """Tokens a forward needs for ``mask`` [n, S-1]: up to the last valid position (0 if none)."""
    used = mask.any(0).nonzero()
    return int(used[-1]) + 1 if used.numel() else 0


# ----------------------------------------------------------------------------- the server
class CriticServerTrainer(ServerLifecycle):
    """Serve a trainable critic (and, combined, a frozen reward model) on Triton.

    Create it on every rank after ``torch.distributed`` is initialised (if used at all); every
    rank holds a replica of the critic, its optimizer state and (combined) the reward model.
    Construction resumes from the latest complete checkpoint under ``ckpt_callback`` (unless
    ``resume=False``) and makes every rank's critic equal to rank 0's.

    Args:
        cfg: serving and training settings.
        model: the critic (initialised from a reward model).
        optimizer: over ``model``'s parameters.
        scheduler: stepped once per optimizer step; None keeps the learning rate.
        logger: receives ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/step_time_s``,
            ``train/clip_fraction`` per optimizer step (rank 0 only); None logs nothing.
        ckpt_callback: where ``critic_save`` writes, restores from and where start-up resumes
            from; None disables all three (``critic_save`` is then refused).
        tokenize_func: for ``sentences`` infer requests; None refuses them.
        gbs: rows per optimizer step (global batch, over all ranks).
        model_forward_micro_batch_size: infer rows per forward pass on one rank.
        reward_model: the frozen reward model served in combined mode (required there).
        collective: the world; default: the torch.distributed default group, or a world of one.
        resume: load the latest complete checkpoint of ``ckpt_callback`` at construction.
        precision: autocast of every forward and loss scaling of the critic's backward (default
            ``fp32``: neither).
        resume_step: with ``resume``, load the checkpoint of this critic step instead of the
            latest; construction fails, naming the steps held, when it is not complete.
    """

    _describe = "the critic server"

    def __init__(
        self,
        cfg: CriticServerConfig,
        model: CriticModel,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        logger: MetricsLogger | None,
        ckpt_callback: CheckpointManager | None,
        tokenize_func: TokenizeFn | None,
        gbs: int,
        model_forward_micro_batch_size: int,
        *,
        reward_model: RewardModel | None = None,
        collective: Collective | None = None,
        resume: bool = True,
        precision: Precision | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.logger = logger
        self.ckpt_callback = ckpt_callback
        self.gbs = gbs
        self.collective = collective if collective is not None else Collective()
        self.combined = cfg.combine_rm_and_critic_server
        world = self.collective.world_size
        if gbs < 1 or gbs % world:
            raise ValueError(f"global batch size {gbs} must be a positive multiple of the {world} rank(s)")
        if model_forward_micro_batch_size < 1:
            raise ValueError("model_forward_micro_batch_size must be >= 1")
        if self.combined and reward_model is None:
            raise ValueError("combine_rm_and_critic_server=True needs the reward_model to serve")
        self.reward_model = reward_model if self.combined else None
        if self.reward_model is not None:
            self.reward_model.eval().requires_grad_(False)
        self.forward_micro_batch_size = model_forward_micro_batch_size
        self.precision = precision if precision is not None else Precision()
        self.scaler = self.precision.grad_scaler()
        self.token = cfg.token or os.environ.get(TOKEN_ENV) or None
        self.step = 0
        self.lock = threading.Lock()
        """The one lock: at most one of infer, train and save runs at a time."""
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._init_lifecycle()

        vocab_size = int(model.hf_model.config.vocab_size)
        limits = [position_limit(m.hf_model.config) for m in (model, self.reward_model) if m is not None]
        known = [n for n in limits if n is not None]
        self.max_sequence_length = cfg.max_sequence_length or (min(known) if known else None)
        """Longest accepted sequence: the config's, else the models' position limit (None: unknown)."""
        self.infer_endpoint = CriticInferEndpoint(
            self._forward_from_rank0,
            combined=self.combined,
            tokenize_func=tokenize_func,
            vocab_size=vocab_size,
            max_sequence_length=self.max_sequence_length,
            max_batch_size=cfg.max_batch_size,
            forward_micro_batch_size=model_forward_micro_batch_size,
            strip_sequence_length_to_multiple=cfg.strip_sequence_length_to_multiple,
            dp_size=world,
        )
        self.train_endpoint = CriticTrainEndpoint(
            self._train_from_rank0,
            vocab_size=vocab_size,
            max_rows=cfg.max_train_rows,
            max_sequence_length=self.max_sequence_length,
        )
        self.save_endpoint = CriticSaveEndpoint(
            self._save_from_rank0,
            self._restore_from_rank0,
            self.restorable,
            enabled=ckpt_callback is not None,
        )
        if resume:
            self.resume(resume_step)
        self._sync_replicas()

    # -- plain-callable entry points (what the endpoints do, without HTTP) -------------------
    def run_inference(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """``critic_infer`` on one request's arrays: ``values`` [B, S] (+ ``rewards`` [B, 1])."""
        request = self.infer_endpoint.validate(inputs)
        with self.lock:
            return self.infer_endpoint.run([request])[0]

    def run_training(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """``critic_train`` on one request's arrays: ``loss_mean`` [1] and the diagnostics."""
        request = self.train_endpoint.validate(inputs)
        with self.lock:
            return self.train_endpoint.run([request])[0]

    def save(self) -> int:
        """``critic_save``: write a checkpoint now; returns its step."""
        self.save_endpoint.validate({DUMMY_VAR.name: np.zeros(1, np.int64)})
        with self.lock:
            return self._save_from_rank0()

    def restore(self, step: int) -> int:
        """``critic_save`` with ``restore_step``: go back to the checkpoint of critic ``step``."""
        inputs = {DUMMY_VAR.name: np.zeros(1, np.int64), RESTORE_STEP.name: np.array([step], np.int64)}
        request = self.save_endpoint.validate(inputs)
        assert request is not None
        with self.lock:
            return self._restore_from_rank0(request)

    # -- serving --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def handlers(self) -> dict[int, Callable[[Any], Any]]:
        """The opcode table every rank runs."""
        return {
            Opcode.FORWARD: self._forward_all_ranks,
            Opcode.TRAIN: self._train_all_ranks,
            Opcode.SAVE: self._save_all_ranks,
            Opcode.RESTORE: self._restore_all_ranks,
        }

    def start(self) -> bool:
        """Rank 0: start Triton and return True once it answers, or False when a stop request came
        first or interrupted the start (see :meth:`request_stop`). Other ranks: nothing (see
        run_server)."""
        if not self.collective.is_leader or self._host is not None or self._stop_requested.is_set():
            return self._host is not None
        cfg = self.cfg
        if self._dispatcher is None:
            self._dispatcher = Rank0Dispatcher(self.collective, self.handlers(), heartbeat_s=cfg.heartbeat_s)
        host = TritonHost(
            cfg.host,
            cfg.port,
            exit_timeout_s=cfg.exit_timeout_s,
            log_file=cfg.log_file,
            max_request_bytes=cfg.max_request_bytes,
            workspace_dir=cfg.workspace_dir,
        )
        sizes = cfg.inference_micro_batch_size
        per_rank = [sizes] if isinstance(sizes, int) else list(sizes)
        batching = Batching(
            max_batch_size=cfg.max_batch_size,
            preferred_batch_sizes=tuple(int(s) * self.collective.world_size for s in per_rank),
            max_queue_delay_microseconds=int(cfg.max_queue_delay_microseconds),
        )
        guard = self._authorize if self.token is not None else None
        host.bind(self.infer_endpoint, batching, self.lock)
        host.bind(self.train_endpoint, None, self.lock, guard)
        host.bind(self.save_endpoint, None, self.lock, guard)
        try:
            return self._start_host(host)
        except BaseException:
            self._dispatcher.stop()
            raise

    def __enter__(self) -> CriticServerTrainer:
        self.start()
        return self

    def _authorize(self, parameters: Mapping[str, Any]) -> None:
        assert self.token is not None
        sent = parameters.get(TOKEN_PARAMETER)
        if sent is None:
            raise UnauthorizedError(
                f"this endpoint needs the server's token (request parameter '{TOKEN_PARAMETER}'); set the "
                f"client's token (or ${TOKEN_ENV}) to the server's"
            )
        if not hmac.compare_digest(str(sent).encode(), self.token.encode()):
            raise UnauthorizedError("the request's token does not match the server's")

    def _call(self, opcode: Opcode, payload: Any) -> Any:
        if self._dispatcher is not None:
            return self._dispatcher.call(opcode, payload)
        if self.collective.world_size > 1:
            raise RuntimeError("with several ranks, call start() (or run_server()) on rank 0 first")
        return self.handlers()[opcode](payload)

    # -- FORWARD -------------------------------------------------------------------------------
    def _forward_from_rank0(
        self, tokens: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        result: tuple[torch.Tensor, torch.Tensor | None] = self._call(Opcode.FORWARD, (tokens, lengths))
        return result

    def _forward_all_ranks(
        self, batch: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FORWARD on every rank: receive the batch, compute this rank's rows, gather all rows."""
        c = self.collective
        tokens = c.local_rows(c.broadcast_tensor(batch[0] if batch is not None else None))
        lengths = c.local_rows(c.broadcast_tensor(batch[1] if batch is not None else None))
        mbs = self.forward_micro_batch_size

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            values = self.model.infer(tokens, lengths, micro_batch_size=mbs).to(c.device)
            if self.reward_model is None:
                return values, None
            return values, self.reward_model.infer(tokens, lengths, micro_batch_size=mbs).to(c.device)

        values, rewards = c.run_guarded(self.precision.autocast_fn(forward))
        return c.gather_rows(values), (c.gather_rows(rewards) if rewards is not None else None)

    # -- TRAIN ---------------------------------------------------------------------------------
    def _train_from_rank0(self, request: TrainRequest) -> TrainResult:
        result: TrainResult = self._call(Opcode.TRAIN, request)
        return result

    def _train_all_ranks(self, request: TrainRequest | None) -> TrainResult:
        """TRAIN on every rank: receive the batch, then one pass of ``gbs``-row optimizer steps."""
        c = self.collective
        parts = (
            (None,) * 4
            if request is None
            else (request.tokens, request.returns, request.prev_values, request.mask)
        )
        received = TrainRequest(*(c.broadcast_tensor(p) for p in parts))
        return self.train_pass(received)

    def train_pass(self, batch: TrainRequest) -> TrainResult:
        """One pass over ``batch`` in order: ``ceil(N / gbs)`` optimizer steps (on every rank).

        The batch is padded to a multiple of ``gbs`` with mask-0 rows. Within a step, each rank
        takes an equal contiguous share of the ``gbs`` rows and accumulates gradients over
        micro-batches of ``micro_batch_size`` rows; each micro-batch's loss is weighted by its
        share of the step's valid tokens, so the summed gradient — after the sum over ranks — is
        the gradient of the token-mean loss over the whole global batch, whatever the number of
        ranks and the micro-batch size. Then: clip the gradient norm, optimizer and scheduler step.
        """
        c = self.collective
        batch = pad_to_multiple(batch, self.gbs)
        share = self.gbs // c.world_size
        device = self.model.device
        losses, norms = [], []
        lr = self._lr()
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        clipped = torch.zeros(2, dtype=torch.float64, device=c.device)  # [clipped positions, positions]
        self.model.eval()  # no dropout: the values regressed are those critic_infer serves
        for start in range(0, batch.tokens.shape[0], self.gbs):
            started = time.perf_counter()
            rows = slice(start + c.rank * share, start + (c.rank + 1) * share)
            total = batch.mask[start : start + self.gbs].sum().to(torch.float64)
            local = TrainRequest(
                *(t[rows].to(device) for t in (batch.tokens, batch.returns, batch.prev_values, batch.mask))
            )
            self.optimizer.zero_grad(set_to_none=True)
            sums = c.run_guarded(partial(self._accumulate, local, total, kept))
            sums = c.all_reduce_sum_(sums.to(c.device))
            self._all_reduce_grads()
            # A step of mask-0 rows only has no gradient, and a loss scaler cannot step or update
            # without having checked one for overflow: that step goes without it.
            scaler = self.scaler if any(p.grad is not None for p in self._params) else _NO_SCALER
            scaler.unscale_(self.optimizer)
            norm = self._clip_gradients()
            lr = self._lr()
            if np.isfinite(norm):
                scaler.step(self.optimizer)
                if self.scheduler is not None:
                    self.scheduler.step()
                self.step += 1
            elif scaler.is_enabled():  # fp16: the loss scale was too high; update() lowers it
                LOGGER.info("critic step %d: fp16 gradients overflowed; step skipped", self.step)
            else:  # inputs are checked finite, so only an overflow in the model gets here
                LOGGER.warning("critic step %d: gradient norm is %s; step skipped", self.step, norm)
            scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            loss = float(sums[0])
            clipped += sums[1:3]
            losses.append(loss)
            norms.append(norm)
            step_s = time.perf_counter() - started
            if self.logger is not None and c.is_leader:
                self.logger.log(
                    {
                        "train/loss": loss,
                        "train/grad_norm": norm,
                        "train/lr": lr,
                        "train/step_time_s": step_s,
                        "train/clip_fraction": float(sums[1] / sums[2].clamp_min(1.0)),
                    },
                    step=self.step,
                )
        return TrainResult(
            loss_mean=float(np.mean(losses)),
            clip_fraction=float(clipped[0] / clipped[1].clamp_min(1.0)),
            explained_variance=self._explained_variance(kept),
            grad_norm=float(np.mean(norms)),
            lr=lr,
            step=self.step,
            optimizer_steps=len(losses),
        )

    def _accumulate(
        self,
        local: TrainRequest,
        total_tokens: torch.Tensor,
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Forward/backward over this rank's micro-batches; returns [loss share, clipped, positions]."""
        mbs = self.cfg.micro_batch_size
        sums = torch.zeros(3, dtype=torch.float64)
        weight_denominator = total_tokens.clamp_min(1.0)
        for i in range(0, local.tokens.shape[0], mbs):
            mask = local.mask[i : i + mbs]
            width = trained_width(mask)
            if width == 0:  # padding rows only: nothing to learn
                continue
            mask = mask[:, :width]
            returns = local.returns[i : i + mbs, :width]
            prev = local.prev_values[i : i + mbs, :width]
            # values at tokens 0..width-1 = critic(tokens)[:, :-1] restricted to those positions
            with self.precision.autocast():
                values = self.model.standardize(self.model(local.tokens[i : i + mbs, :width]))
                loss, stats = value_loss(values, prev, returns, mask, self.cfg.loss_clip_val)
            tokens = mask.sum().to(torch.float64)
            self.scaler.scale(loss * (tokens / weight_denominator).to(loss.dtype)).backward()
            sums += torch.stack(
                [
                    loss.detach().to(torch.float64).cpu() * tokens.cpu() / weight_denominator.cpu(),
                    stats.clip_fraction.detach().to(torch.float64).cpu() * tokens.cpu(),
                    tokens.cpu(),
                ]
            )
            kept.append((values.detach().float(), returns, mask))
        return sums

    def _all_reduce_grads(self) -> None:
        """Sum every parameter's gradient over ranks (missing gradients count as zero)."""
        c = self.collective
        if not c.distributed:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(c.device)
        c.all_reduce_sum_(flat)
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype)
            offset += n

    def _clip_gradients(self) -> float:
        grads = [p for p in self._params if p.grad is not None]
        if not grads:
            return 0.0
        max_norm = self.cfg.gradient_clip_val if self.cfg.gradient_clip_val > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _explained_variance(self, kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
        """Explained variance over every rank's trained positions (values before each step)."""
        c = self.collective

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return c.all_reduce_sum_(t.to(c.device)).cpu()

        if kept:
            values = torch.cat([v.reshape(-1) for v, _, _ in kept]).cpu()
            returns = torch.cat([r.reshape(-1) for _, r, _ in kept]).cpu()
            mask = torch.cat([m.reshape(-1) for _, _, m in kept]).cpu()
        else:  # this rank trained only padding; it still joins the reductions
            values = returns = mask = torch.zeros(1)
        return float(explained_variance(values, returns, mask, reduce=reduce))

    # -- SAVE / resume -------------------------------------------------------------------------
    def _save_from_rank0(self) -> int:
        step: int = self._call(Opcode.SAVE, None)
        return step

    def _save_all_ranks(self, _payload: None) -> int:
        """SAVE on every rank: rank 0 writes (replicas are equal); a failure is raised on all."""
        c = self.collective

        def write() -> None:
            if c.is_leader:
                self.write_checkpoint()

        c.run_guarded(write)
        return self.step

    def write_checkpoint(self) -> Path:
        """Write ``step_<N>`` atomically: critic (HF safetensors), optimizer, scheduler, state."""
        if self.ckpt_callback is None:
            raise RuntimeError("no checkpoint directory configured")

        def write(d: Path) -> None:
            self.model.save_pretrained(d / CRITIC_DIR)
            torch.save(self.optimizer.state_dict(), d / "optimizer.pt")
            if self.scheduler is not None:
                torch.save(self.scheduler.state_dict(), d / "scheduler.pt")
            state = {"step": self.step, "combine_rm_and_critic_server": self.combined}
            (d / STATE_FILE).write_text(json.dumps(state))

        path = self.ckpt_callback.save(self.step, write, metrics={"step": float(self.step)})
        LOGGER.info("critic checkpoint written to %s", path)
        return path

    def _restore_from_rank0(self, step: int) -> int:
        restored: int = self._call(Opcode.RESTORE, step)
        return restored

    def _restore_all_ranks(self, step: int | None) -> int:
        """RESTORE on every rank: load rank 0's (validated) step; a failure is raised on all."""
        c = self.collective
        step = c.broadcast_int(step)
        assert self.ckpt_callback is not None
        path = self.ckpt_callback.root / f"step_{step}"
        c.run_guarded(lambda: self.load_checkpoint(path))
        return self.step

    def restorable(self, step: int) -> str | None:
        """``None`` when this server holds a complete checkpoint of critic ``step``, else why not
        (naming the steps it holds)."""
        if self.ckpt_callback is None:
            return "this server has no checkpoint directory"
        root = self.ckpt_callback.root
        path = root / f"step_{step}"
        if step < 0:
            problem = "steps are >= 0"
        elif not path.is_dir():
            problem = f"there is no {path}"
        else:
            incomplete = verify_checkpoint(path)
            if incomplete is None:
                return None
            problem = f"{path} is not complete ({incomplete})"
        held = [s for s, _ in self.ckpt_callback.checkpoints()]
        kept = self.ckpt_callback.keep_last
        return (
            f"{problem}; this server holds checkpoints of critic steps {held} under {root} "
            f"(checkpoint.keep_last={kept} keeps {'every one' if kept <= 0 else f'the newest {kept}'})"
        )

    def resume(self, step: int | None = None) -> None:
        """Load the latest complete checkpoint, or that of critic ``step`` (rank 0 picks it; every
        rank loads the same one).

        Raises:
            ValueError: ``step`` was named and this server cannot restore it.
        """
        c = self.collective
        refused = -2  # every rank learns that rank 0 refused, so that none waits in a collective
        chosen, problem = -1, "refused on rank 0"
        if c.is_leader and step is not None:
            why = self.restorable(step)
            chosen, problem = (step, problem) if why is None else (refused, why)
        elif c.is_leader and self.ckpt_callback is not None:
            latest = self.ckpt_callback.latest()
            if latest is not None:
                chosen = int(json.loads((latest / STATE_FILE).read_text())["step"])
        chosen = c.broadcast_int(chosen)
        if chosen == refused:
            raise ValueError(f"checkpoint.resume_step={step}: {problem}")
        if chosen < 0 or self.ckpt_callback is None:
            return
        self.load_checkpoint(self.ckpt_callback.root / f"step_{chosen}")

    def load_checkpoint(self, path: Path) -> None:
        """Critic weights, optimizer, scheduler and step from a directory :meth:`write_checkpoint` made."""
        load_weights_into(self.model, path / CRITIC_DIR)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.model.device))
        if self.scheduler is not None and (path / "scheduler.pt").is_file():
            self.scheduler.load_state_dict(torch.load(path / "scheduler.pt"))
        self.step = int(json.loads((path / STATE_FILE).read_text())["step"])
        LOGGER.info("critic resumed from %s at step %d", path, self.step)

    def _sync_replicas(self) -> None:
        """Every rank's critic takes rank 0's weights (replicas must start equal)."""
        c = self.collective
        if not c.distributed:
            return
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(c.broadcast_tensor(p.detach() if c.is_leader else None).to(p.device, p.dtype))
