"""The critic server: a trainable value model behind ``critic_infer``, ``critic_train`` and ``critic_save``.

Owns the three endpoints' logic (plain objects) and :class:`CriticServerTrainer` (NeMo-Aligner's
name): one lock, the rank-0 / subscriber loop with the FORWARD, TRAIN, SAVE and RESTORE opcodes,
the optional token, and combined mode (a frozen reward model beside the critic). What each rank
does is the :class:`~openaligner.trainer.critic.CriticTrainer`'s. Must not know about PPO, the
actor, the value loss or HTTP details. Shapes: ``tokens`` [N, S]; the rest [N, S-1].
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openaligner import distributed as dp
from openaligner.models.critic import CriticModel
from openaligner.models.positions import position_limit
from openaligner.models.reward import RewardModel
from openaligner.models.sharding import is_sharded
from openaligner.protocol import (
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
    DUMMY_VAR,
    EXPLAINED_VARIANCE,
    EXPLAINED_VARIANCE_AFTER,
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
from openaligner.servers.batching import (
    split_rows,
)
from openaligner.servers.config import ServingConfig
from openaligner.servers.distributed import Opcode, Rank0Dispatcher
from openaligner.servers.sequence_endpoint import SequenceEndpoint
from openaligner.servers.transport.lifecycle import ServerLifecycle
from openaligner.servers.validation import (
    RequestError,
    SequenceRequest,
    TokenizeFn,
    UnauthorizedError,
    check_aligned_width,
    check_finite,
    check_known_inputs,
    check_mask,
    check_token_ids,
    check_whole_input,
)
from openaligner.trainer.critic import CriticBatch, CriticTrainer, TrainResult

LOGGER = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CriticServerConfig(ServingConfig):
    """How the critic server serves: the ``server`` section of ``openaligner serve-critic`` (the
    keys both servers share are :class:`~openaligner.servers.config.ServingConfig`'s; the
    inference keys apply to ``critic_infer``). How the critic trains is
    :class:`~openaligner.trainer.critic.CriticTrainConfig`."""

    port: int = CRITIC_DEFAULT_PORT  # HTTP port
    combine_rm_and_critic_server: bool = True  # also serve rewards from a frozen reward model
    max_train_rows: int = 16384  # most rows per critic_train request
    token: str | None = None  # shared secret for critic_train/critic_save; null: $OPENALIGNER_TOKEN or open

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_train_rows < 1:
            raise ValueError("{section}.max_train_rows must be >= 1")


# ----------------------------------------------------------------------------- infer endpoint
InferForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""``(tokens [B, S], lengths [B]) -> (values [B, S], rewards [B] or None)`` for a shaped batch."""


class CriticInferEndpoint(SequenceEndpoint):
    """``critic_infer``: values at every token, plus rewards in combined mode.

    Inputs as the reward model's endpoint (``sentences`` or ``tokens`` + ``sequence_lengths``,
    validated by the same function); outputs ``values`` [B, S] (0 from each row's length on) and,
    when ``combined``, ``rewards`` [B, 1]. Without ``combined`` the output is *only* ``values``:
    Triton requires every output to share the batch size, so no placeholder is sent.

    Args:
        forward: see :data:`InferForward`; ``B`` is a multiple of ``dp_size``.
        combined: whether ``forward`` also returns rewards.
        model_name, settings: see :class:`~openaligner.servers.sequence_endpoint.SequenceEndpoint`.
    """

    inputs = CRITIC_INFER_INPUTS

    def __init__(
        self,
        forward: InferForward,
        *,
        combined: bool,
        model_name: str = CRITIC_INFER_NAME,
        **settings: Any,
    ) -> None:
        super().__init__(model_name=model_name, **settings)
        self.forward = forward
        self.combined = combined

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return CRITIC_INFER_OUTPUTS_COMBINED if self.combined else CRITIC_INFER_OUTPUTS_SEPARATE

    def run(self, requests: Sequence[SequenceRequest]) -> list[dict[str, np.ndarray]]:
        """Shape the formed batch, forward, then give each request its rows at its own width."""
        width = max(r.tokens.shape[1] for r in requests)
        tokens, lengths = self.shaped_batch(requests)
        values, rewards = self.forward(tokens, lengths)
        values = values.detach().to("cpu", torch.float32)
        values = torch.nn.functional.pad(values, (0, width - values.shape[1]))  # stripped columns are 0
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
def train_outputs(result: TrainResult) -> dict[str, np.ndarray]:
    """A training pass's result as ``critic_train``'s outputs (each [1])."""
    return {
        LOSS_MEAN.name: np.array([result.loss_mean], np.float32),
        CLIP_FRACTION.name: np.array([result.clip_fraction], np.float32),
        EXPLAINED_VARIANCE.name: np.array([result.explained_variance], np.float32),
        EXPLAINED_VARIANCE_AFTER.name: np.array([result.explained_variance_after], np.float32),
        GRAD_NORM.name: np.array([result.grad_norm], np.float32),
        LR.name: np.array([result.lr], np.float32),
        STEP.name: np.array([result.step], np.int64),
        OPTIMIZER_STEPS.name: np.array([result.optimizer_steps], np.int64),
    }


class CriticTrainEndpoint:
    """``critic_train`` (not batched): one request is one training pass.

    Args:
        train: runs the pass on a validated request (usually every rank's TRAIN).
        vocab_size: every token id must lie in ``[0, vocab_size)``; None skips the check.
        max_rows: most rows per request.
        max_sequence_length: widest accepted ``tokens``; None skips the check.
        refusal: says why the server cannot train now (checked before the inputs), or None.
    """

    inputs = CRITIC_TRAIN_INPUTS
    outputs = CRITIC_TRAIN_OUTPUTS

    def __init__(
        self,
        train: Callable[[CriticBatch], TrainResult],
        *,
        model_name: str = CRITIC_TRAIN_NAME,
        vocab_size: int | None = None,
        max_rows: int = 16384,
        max_sequence_length: int | None = None,
        refusal: Callable[[], str | None] | None = None,
    ) -> None:
        self.train = train
        self.refusal = refusal
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.max_sequence_length = max_sequence_length

    def validate(self, inputs: Mapping[str, np.ndarray]) -> CriticBatch:
        """Check dtypes, shapes (``[N, S]`` and three ``[N, S-1]``), ids, finiteness and the mask.

        Raises:
            RequestError: naming the input, and the row and position where it matters; or the
                server's :attr:`refusal`.
        """
        why = self.refusal() if self.refusal is not None else None
        if why is not None:
            raise RequestError(why)
        check_known_inputs(inputs, self.inputs)
        tokens = check_whole_input(inputs, TRAIN_TOKENS)
        aligned = {spec.name: check_whole_input(inputs, spec) for spec in (RETURNS, PREV_VALUES, MASK)}
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
        return CriticBatch(
            tokens=torch.from_numpy(np.array(tokens, dtype=np.int64)),
            returns=torch.from_numpy(np.array(aligned[RETURNS.name], dtype=np.float32)),
            prev_values=torch.from_numpy(np.array(aligned[PREV_VALUES.name], dtype=np.float32)),
            mask=torch.from_numpy(np.array(aligned[MASK.name], dtype=np.float32)),
        )

    def run(self, requests: Sequence[CriticBatch]) -> list[dict[str, np.ndarray]]:
        """Train on each request in turn (a non-batched endpoint gets exactly one)."""
        return [train_outputs(self.train(r)) for r in requests]


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
        check_whole_input(inputs, DUMMY_VAR)
        if not self.enabled:
            raise RequestError(
                "this critic server has no checkpoint directory, so nothing can be saved; start it with "
                "checkpoint.dir=<directory>"
            )
        if RESTORE_STEP.name not in inputs:
            return None
        array = check_whole_input(inputs, RESTORE_STEP)
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


# ----------------------------------------------------------------------------- the server
class CriticServerTrainer(ServerLifecycle):
    """Serve a trainable critic (and, combined, a frozen reward model) on Triton.

    Create it on every rank after ``torch.distributed`` is initialised (if used at all), with
    that rank's :class:`~openaligner.trainer.critic.CriticTrainer`: every rank holds a replica of
    the critic, its optimizer state and (combined) the reward model, or its shard of each (see
    :mod:`openaligner.models.sharding`). Construction resumes the trainer from its latest complete
    checkpoint (unless ``resume=False``) and makes every rank's replica equal to rank 0's.

    Args:
        cfg: serving settings (``max_sequence_length`` None: the models' position limit).
        trainer: the critic, how it trains and where its checkpoints go: ``critic_train`` runs its
            :meth:`~openaligner.trainer.critic.CriticTrainer.train_pass`; ``critic_save`` writes,
            restores from and start-up resumes from its checkpoints (none: ``critic_save`` is
            refused). Its precision's autocast also runs every inference forward.
        tokenize_func: for ``sentences`` infer requests; None refuses them.
        tokenizer_info: what the tokenizer route of ``critic_infer`` says (see
            :func:`~openaligner.protocol.tokenizer_description`); None: no tokenizer.
        reward_model: the frozen reward model served in combined mode (required there).
        resume: load the trainer's latest complete checkpoint at construction.
        resume_step: with ``resume``, load the checkpoint of this critic step instead of the
            latest; construction fails, naming the steps held, when it is not complete.

    Raises:
        ValueError: the preferred batch sizes on this many ranks exceed ``cfg.max_batch_size``
            (see :meth:`~openaligner.servers.config.ServingConfig.check_batching`); or the
            trainer's ``batch_invariant_multiple`` is not ``cfg.fixed_width_multiple()`` (the
            training forward must be batch-invariant exactly when serving is).
    """

    _describe = "the critic server"

    def __init__(
        self,
        cfg: CriticServerConfig,
        trainer: CriticTrainer,
        tokenize_func: TokenizeFn | None,
        *,
        reward_model: RewardModel | None = None,
        resume: bool = True,
        resume_step: int | None = None,
        tokenizer_info: Mapping[str, object] | None = None,
    ) -> None:
        cfg.check_batching(dp.world_size(), key="server")  # Triton crashes on what it refuses
        if trainer.batch_invariant_multiple != cfg.fixed_width_multiple():
            # a critic_train forward in other shapes than the setting says would not be invariant
            raise ValueError(
                f"server.batch_invariant={str(cfg.batch_invariant).lower()} needs the CriticTrainer built "
                f"with batch_invariant_multiple={cfg.fixed_width_multiple()} (the server config's "
                f"fixed_width_multiple()), got {trainer.batch_invariant_multiple}"
            )
        self.cfg = cfg
        self.trainer = trainer
        self.combined = cfg.combine_rm_and_critic_server
        if self.combined and reward_model is None:
            raise ValueError("combine_rm_and_critic_server=True needs the reward_model to serve")
        self.reward_model = reward_model if self.combined else None
        if self.reward_model is not None:
            self.reward_model.eval().requires_grad_(False)
        self.token = cfg.token or os.environ.get(TOKEN_ENV) or None
        self.lock = threading.Lock()
        """The one lock: at most one of infer, train and save runs at a time."""
        self._init_lifecycle()

        model = trainer.model
        vocab_size = int(model.hf_model.config.vocab_size)
        limits = [position_limit(m.hf_model.config) for m in (model, self.reward_model) if m is not None]
        known = [n for n in limits if n is not None]
        self.max_sequence_length = cfg.max_sequence_length or (min(known) if known else None)
        """Longest accepted sequence: the config's, else the models' position limit (None: unknown)."""
        self.infer_endpoint = CriticInferEndpoint(
            self._forward_from_rank0,
            combined=self.combined,
            tokenize_func=tokenize_func,
            tokenizer_info=tokenizer_info,
            vocab_size=vocab_size,
            max_sequence_length=self.max_sequence_length,
            max_batch_size=cfg.max_batch_size,
            forward_micro_batch_size=cfg.model_forward_micro_batch_size,
            strip_sequence_length_to_multiple=cfg.strip_sequence_length_to_multiple,
            dp_size=dp.world_size(),
            batch_invariant=cfg.batch_invariant,
        )
        self.train_endpoint = CriticTrainEndpoint(
            self._train_from_rank0,
            vocab_size=vocab_size,
            max_rows=cfg.max_train_rows,
            max_sequence_length=self.max_sequence_length,
            refusal=self._spent_schedule,
        )
        self.save_endpoint = CriticSaveEndpoint(
            self._save_from_rank0,
            self._restore_from_rank0,
            trainer.restorable,
            enabled=trainer.checkpoints is not None,
        )
        if resume:
            trainer.resume(resume_step)
        trainer.sync_replicas()

    @property
    def model(self) -> CriticModel:
        """The served critic (the trainer's)."""
        return self.trainer.model

    @property
    def step(self) -> int:
        """The critic's optimizer steps so far (the trainer's)."""
        return self.trainer.step

    # -- plain-callable entry points (what the endpoints do, without HTTP) -------------------
    def run_inference(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """``critic_infer`` on one request's arrays: ``values`` [B, S] (+ ``rewards`` [B, 1])."""
        request = self.infer_endpoint.validate(inputs)
        with self.lock:
            return self.infer_endpoint.run([request])[0]

    def _spent_schedule(self) -> str | None:
        """Why ``critic_train`` is refused once the learning rate has decayed to 0 for good: a pass
        would change nothing, and the PPO run would go on with a critic that no longer learns."""
        if not self.trainer.schedule_spent():
            return None
        return (
            f"the critic's learning rate has decayed to 0 (critic step {self.trainer.step}: the decay "
            "to optim.min_lr=0 ended at optim.decay_steps), so critic_train would change nothing; "
            "restart serve-critic (it resumes from its checkpoint) with optim.decay_steps ≥ the "
            "critic steps the run needs, or optim.min_lr > 0"
        )

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
        """``http://host:port`` of the HTTP endpoint (with ``port=0``, the port picked at start once
        started)."""
        return self._host.url if self._host is not None else f"http://{self.cfg.host}:{self.cfg.port}"

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
        if not dp.is_leader() or self._host is not None or self._stop_requested.is_set():
            return self._host is not None
        cfg = self.cfg
        if self._dispatcher is None:
            self._dispatcher = Rank0Dispatcher(self.handlers(), heartbeat_s=cfg.heartbeat_s)
        host = cfg.triton_host()
        guard = self._authorize if self.token is not None else None
        host.bind(self.infer_endpoint, cfg.batching(dp.world_size()), self.lock)
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
        if dp.world_size() > 1:
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
        tokens = dp.broadcast_tensor(batch[0] if batch is not None else None)
        every_length = dp.broadcast_tensor(batch[1] if batch is not None else None)
        tokens, lengths = dp.local_rows(tokens), dp.local_rows(every_length)
        mbs = self.cfg.model_forward_micro_batch_size
        device = dp.collective_device()
        shapes = self.cfg.fixed_shapes()
        # with fixed shapes, every rank runs as many forwards (a sharded model's are collectives)
        forwards = shapes.forwards(every_length, dp.world_size()) if shapes is not None else 0

        def infer(model: CriticModel | RewardModel) -> torch.Tensor:
            if shapes is None:
                return model.infer(tokens, lengths, micro_batch_size=mbs).to(device)
            return shapes.run(model.infer, tokens, lengths, forwards).to(device)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            values = infer(self.model)
            if self.reward_model is None:
                return values, None
            return values, infer(self.reward_model)

        values, rewards = dp.run_guarded(self.trainer.precision.autocast_fn(forward))
        return (
            dp.all_gather_rows(values, same_shape=True),
            dp.all_gather_rows(rewards, same_shape=True) if rewards is not None else None,
        )

    # -- TRAIN ---------------------------------------------------------------------------------
    def _train_from_rank0(self, batch: CriticBatch) -> TrainResult:
        result: TrainResult = self._call(Opcode.TRAIN, batch)
        return result

    def _train_all_ranks(self, batch: CriticBatch | None) -> TrainResult:
        """TRAIN on every rank: receive the batch, then one training pass."""
        parts = (None,) * 4 if batch is None else (batch.tokens, batch.returns, batch.prev_values, batch.mask)
        return self.trainer.train_pass(CriticBatch(*(dp.broadcast_tensor(p) for p in parts)))

    # -- SAVE / RESTORE ------------------------------------------------------------------------
    def _save_from_rank0(self) -> int:
        step: int = self._call(Opcode.SAVE, None)
        return step

    def _save_all_ranks(self, _payload: None) -> int:
        """SAVE on every rank: rank 0 writes (replicas are equal), or every rank writes its shards
        into the same checkpoint (a sharded critic); a failure is raised on all."""
        writes = dp.is_leader() or is_sharded(self.model)

        def write() -> None:
            if writes:
                self.trainer.write_checkpoint({"combine_rm_and_critic_server": self.combined})

        dp.run_guarded(write)
        return self.trainer.step

    def _restore_from_rank0(self, step: int) -> int:
        restored: int = self._call(Opcode.RESTORE, step)
        return restored

    def _restore_all_ranks(self, step: int | None) -> int:
        """RESTORE on every rank: load rank 0's (validated) step (each rank its replica, or its
        shards of a sharded critic); a failure is raised on all."""
        chosen = dp.broadcast_int(step)
        dp.run_guarded(lambda: self.trainer.restore(chosen))
        return self.trainer.step
