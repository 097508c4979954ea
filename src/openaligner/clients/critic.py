"""Client of the critic server (and, when separate, the reward model server) for the PPO actor.

Owns the actor-side view of ``critic_infer`` / ``critic_train`` / ``critic_save``: its config (keys
as NeMo-Aligner's ``remote_critic_rm``), rollout tensors to requests and answers back to torch, the
token sent with train and save, and the rule that an infer or save after a train waits for it.
Transport and errors come from :mod:`openaligner.clients.base`.
Must not know about PPO math or how the servers compute.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from openaligner.clients.base import TritonHTTPClient
from openaligner.clients.errors import BadRequestError
from openaligner.clients.reward import RemoteGPTRMClient, RemoteRMConfig, rollout_arrays
from openaligner.protocol import (
    CLIP_FRACTION,
    CRITIC_DEFAULT_PORT,
    CRITIC_INFER_NAME,
    CRITIC_SAVE_NAME,
    CRITIC_TRAIN_NAME,
    DEFAULT_HOST,
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
    REWARD_DEFAULT_PORT,
    REWARD_MODEL_NAME,
    REWARDS,
    SEQUENCE_LENGTHS,
    STATUS,
    STEP,
    TOKEN_ENV,
    TOKEN_PARAMETER,
    TOKENS,
    VALUES,
    reads_text,
)

ToConversations = Callable[[Mapping[str, torch.Tensor]], list[list[dict[str, str]]]]
"""A rollout micro-batch -> each row as a conversation ``[{"role", "content"}, ...]`` ending with
the assistant's response (see :class:`~openaligner.trainer.rollout.RolloutConversations`)."""

ToMetadata = Callable[[Mapping[str, torch.Tensor]], list[dict[str, Any]]]
"""A rollout micro-batch -> each row's prompt metadata (sent with the conversations to a reward
server, e.g. a reward function's reference answer)."""

CONFIG_KEY = "remote"
"""The key of :class:`RemoteCriticConfig` in train-ppo's config: messages name its keys in full."""
_HINT = (
    "Check that `openaligner serve-critic` is running and has printed its URL, and that "
    f"{CONFIG_KEY}.critic.ip/{CONFIG_KEY}.critic.port/{CONFIG_KEY}.critic.name match the server's "
    "server.host/server.port (Triton needs a few seconds to start; raise "
    f"{CONFIG_KEY}.init_timeout_s if the server is still loading its models)."
)


@dataclass
class RewardModelAddress:
    """Where the separate reward model server is (used only when not combined)."""

    ip: str = DEFAULT_HOST  # host of the reward model server
    port: int = REWARD_DEFAULT_PORT  # its HTTP port
    name: str = REWARD_MODEL_NAME  # Triton model name it serves


@dataclass
class CriticEndpointNames:
    """Triton model names of the critic server's three endpoints."""

    train: str = CRITIC_TRAIN_NAME  # training endpoint
    infer: str = CRITIC_INFER_NAME  # values (and, combined, rewards)
    save: str = CRITIC_SAVE_NAME  # checkpoint endpoint


@dataclass
class CriticAddress:
    """Where the critic server is."""

    ip: str = DEFAULT_HOST  # host of the critic server
    port: int = CRITIC_DEFAULT_PORT  # its HTTP port
    name: CriticEndpointNames = field(default_factory=CriticEndpointNames)  # its endpoint names


@dataclass
class RemoteCriticConfig:
    """How the actor reaches the critic (and reward model) servers; NeMo-Aligner's ``remote_critic_rm``."""

    pad_to_length: int | None = None  # right-pad infer tokens to this width so Triton can merge requests
    combine_rm_and_critic_server: bool = True  # rewards come from the critic server (else reward_model)
    reward_model: RewardModelAddress = field(default_factory=RewardModelAddress)  # separate RM server
    critic: CriticAddress = field(default_factory=CriticAddress)  # the critic server
    init_timeout_s: float = 60.0  # wait this long for the servers to become ready
    request_timeout_s: float = 600.0  # give up on one request after this long (a train pass included)
    token: str | None = None  # shared secret for critic_train/critic_save; null: $OPENALIGNER_TOKEN
    max_workers: int = 4  # requests in flight at once, per server
    retries_on_rejected_batch: int = 3  # resends of a valid request rejected with an invalid one
    reconnect_grace_s: float = 0.0  # after a lost connection, wait this long for a restarted server (0: fail)
    reward_input: str = "auto"  # auto | tokens (policy ids) | text (conversations the RM server lays out)

    def __post_init__(self) -> None:
        self.reward_input = str(self.reward_input).strip().lower()
        if self.reward_input not in REWARD_INPUT_MODES:
            raise ValueError(
                f"reward_input must be one of {', '.join(REWARD_INPUT_MODES)}, got {self.reward_input!r}"
            )
        if self.reconnect_grace_s < 0:
            raise ValueError(
                f"reconnect_grace_s must be >= 0 (0: fail at once), got {self.reconnect_grace_s}"
            )
        for what, port in (("critic.port", self.critic.port), ("reward_model.port", self.reward_model.port)):
            if not 0 < port < 65536:
                raise ValueError(f"{what} must be in 1..65535, got {port}")
        if self.pad_to_length is not None and self.pad_to_length < 2:
            raise ValueError(f"pad_to_length must be >= 2 or null, got {self.pad_to_length}")
        if self.init_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("init_timeout_s and request_timeout_s must be > 0")


REWARD_INPUT_MODES = ("auto", "tokens", "text")
"""``remote.reward_input``: auto = tokens when the reward server's tokenizer and layout are the
policy's, text when they differ; tokens = send the policy's token ids; text = send each rollout as
a conversation that the reward server lays out with its own tokenizer and template."""


class TokenizerMismatchError(ValueError):
    """The servers' tokenizers cannot serve this policy's rollouts; names both tokenizers."""


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer a model lays text out with (see
    :func:`~openaligner.data.render.tokenizer_identity`)."""

    name: str  # where it was loaded from, for messages
    fingerprint: str  # sha256 of the tokenizer, its template and the model's sequence layout
    vocab_fingerprint: str  # sha256 of the vocabulary and special tokens: what the ids mean
    reads_text: bool = False  # the server scores text with a reward function: it reads `messages` only

    @classmethod
    def from_server(cls, info: Mapping[str, Any] | None, where: str) -> TokenizerIdentity | None:
        """From a server's tokenizer description (None: the server has no tokenizer and reads ids)."""
        if info is None:
            return None
        if reads_text(info) and info.get("fingerprint") is None:
            return cls(f"a reward function ({where})", "", "", reads_text=True)
        return cls(
            f"{info.get('name') or 'its tokenizer'} ({where})",
            str(info.get("fingerprint")),
            str(info.get("vocab_fingerprint")),
            reads_text=reads_text(info),
        )


def choose_reward_input(
    mode: str,
    policy: TokenizerIdentity,
    *,
    reward: TokenizerIdentity | None,
    critic: TokenizerIdentity | None,
    combined: bool,
) -> str:
    """``tokens`` or ``text``: how rollouts reach the reward model under ``remote.reward_input``.

    The critic scores the policy's token ids, so its tokenizer must mean the same ids
    (``vocab_fingerprint``); in combined mode the reward model does too, and under ``auto`` it
    must also lay sequences out as the policy's prompts are (``fingerprint``). With a separate reward
    server, ``auto`` picks ``tokens`` when its tokenizer and layout are the policy's
    (``fingerprint``) and ``text`` when they differ; a server that says nothing of its tokenizer
    (none loaded, or from before the tokenizer route) gets ``tokens``, as before. A server that
    scores text with a reward function (``reads_text``) gets ``text``, and ``tokens`` is refused.

    Args:
        mode: ``auto``, ``tokens`` or ``text``.
        policy: the policy's tokenizer with the prompts' layout.
        reward: the separate reward server's (None: it has none, or the reward comes from the critic).
        critic: the critic server's (None: it has none).
        combined: the critic server also answers rewards.

    Raises:
        TokenizerMismatchError: naming both tokenizers and what to change.
    """
    if critic is not None and critic.vocab_fingerprint != policy.vocab_fingerprint:
        what = "the critic and reward model score" if combined else "the critic scores"
        raise TokenizerMismatchError(
            f"the critic server uses {critic.name}, which differs from the policy's {policy.name}: {what} "
            "the policy's token ids, so they must share its tokenizer and its embeddings; start the critic "
            "from the policy's model: serve-critic model.path=<the policy's SFT directory> (a fresh value "
            "head on the policy's backbone; tokenizer.path alone would read the policy's ids through "
            "the other model's embeddings)"
            + (
                ", with server.combine_rm_and_critic_server=false; and serve the reward model apart "
                "(serve-reward model.path=<reward model>; here remote.combine_rm_and_critic_server=false, "
                "remote.reward_input=auto) so that it reads text"
                if combined
                else ""
            )
        )
    if combined:
        if mode == "text":
            raise TokenizerMismatchError(
                "remote.reward_input=text needs a separate reward model server "
                "(remote.combine_rm_and_critic_server=false, remote.reward_model.*): the combined critic "
                f"server scores the policy's token ids ({policy.name})"
            )
        if mode == "auto" and critic is not None and critic.fingerprint != policy.fingerprint:
            # same ids, another layout (BOS/EOS or chat template): the reward model would score
            # sequences laid out unlike the ones it was trained on
            raise TokenizerMismatchError(
                f"the combined critic server's reward model lays sequences out with {critic.name} unlike "
                f"the policy's prompts ({policy.name}: BOS/EOS or chat template differ), so it would score "
                "a layout it was not trained on; serve the reward model apart "
                "(remote.combine_rm_and_critic_server=false) so that it reads text, align data.add_bos / "
                "data.chat_template with train-rm's, or set remote.reward_input=tokens to send the ids anyway"
            )
        return "tokens"
    if reward is not None and reward.reads_text:
        if mode == "tokens":
            raise TokenizerMismatchError(
                f"remote.reward_input=tokens, but {reward.name} serves a reward function, which reads text: "
                "set remote.reward_input=text (or auto)"
            )
        return "text"
    if mode == "tokens":
        return "tokens"
    if reward is None:
        if mode == "text":
            raise TokenizerMismatchError(
                "remote.reward_input=text but the reward model server says it has no tokenizer (start "
                "serve-reward with tokenizer.path, or from a model directory with its tokenizer), so it "
                "cannot lay out text; or set remote.reward_input=tokens to send the policy's ids "
                f"({policy.name})"
            )
        return "tokens"
    if mode == "text":
        return "text"
    return "tokens" if reward.fingerprint == policy.fingerprint else "text"


@dataclass(frozen=True)
class RolloutTexts:
    """How rollouts become the text a reward server reads (``remote.reward_input=text``)."""

    conversations: ToConversations
    metadata: ToMetadata | None = None  # None: no metadata is sent


def request_rewards(
    rm: RemoteGPTRMClient, rollout_batch: Mapping[str, torch.Tensor], texts: RolloutTexts | None
) -> Future[torch.Tensor]:
    """Ask the reward server for a micro-batch's rewards: its token ids (``texts`` None) or its
    conversations, with their metadata when ``texts`` has some."""
    if texts is None:
        return rm.infer_rm(rollout_batch)
    device = rollout_batch["response_tokens"].device
    metadata = texts.metadata(rollout_batch) if texts.metadata is not None else None
    return rm.infer_rm_conversations(texts.conversations(rollout_batch), device, metadata=metadata)


def reward_client_config(cfg: RemoteCriticConfig) -> RemoteRMConfig:
    """The separate reward server's client settings (``remote.reward_model`` and the shared keys)."""
    return RemoteRMConfig(
        ip=cfg.reward_model.ip,
        port=cfg.reward_model.port,
        name=cfg.reward_model.name,
        pad_to_length=cfg.pad_to_length,
        init_timeout_s=cfg.init_timeout_s,
        request_timeout_s=cfg.request_timeout_s,
        max_workers=cfg.max_workers,
        retries_on_rejected_batch=cfg.retries_on_rejected_batch,
        reconnect_grace_s=cfg.reconnect_grace_s,
    )


def remote_reward_client(cfg: RemoteCriticConfig) -> RemoteGPTRMClient:
    """The separate reward server's client, its messages naming train-ppo's keys
    (``remote.reward_model.port``, ``remote.init_timeout_s``)."""
    prefix = f"{CONFIG_KEY}."
    return RemoteGPTRMClient(
        reward_client_config(cfg), address_prefix=f"{prefix}reward_model.", config_prefix=prefix
    )


class RMCriticFutureResult:
    """The pending answer to one ``infer_rm_critic`` call.

    ``result()`` returns ``(rewards [B] float32, values [B, S-1] float32)`` on the device of the
    batch's ``response_tokens``, ``S`` being the batch's own width (before ``pad_to_length``).
    """

    def __init__(
        self,
        critic: Future[tuple[torch.Tensor, torch.Tensor | None]],
        rewards: Future[torch.Tensor] | None,
        width: int,
        device: torch.device,
    ) -> None:
        self._critic = critic
        self._rewards = rewards
        self._width = width
        self._device = device

    def done(self) -> bool:
        return self._critic.done() and (self._rewards is None or self._rewards.done())

    def result(self, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for both answers; raises the first failure (after the other answer settled).

        Raises:
            ClientError: a subclass naming the server that failed.
            TimeoutError: ``timeout`` passed first.
        """
        pending: list[Future[Any]] = [self._critic]
        if self._rewards is not None:
            pending.append(self._rewards)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        if not_done:
            raise TimeoutError(f"critic/reward answers not ready within {timeout} s")
        values, rewards = self._critic.result()
        if self._rewards is not None:
            rewards = self._rewards.result()
        assert rewards is not None
        return (
            rewards.reshape(-1).to(self._device, torch.float32),
            values[:, : self._width - 1].to(self._device, torch.float32),
        )


class RemoteGPTRMCriticClient:
    """Values and rewards for rollouts, critic training and checkpointing, over HTTP.

    Use as a context manager (``with RemoteGPTRMCriticClient(cfg) as rm_critic:``), which waits
    up to ``init_timeout_s`` for every endpoint on entry and closes on exit; without it, the first
    request waits. Call from the process that sends (the PPO trainer sends ``train`` / ``save``
    from rank 0 only).

    Ordering: an ``infer_rm_critic`` or ``save`` issued after ``train`` is sent only once that
    train has been answered (successfully or not), so it sees the critic after the update; the
    train's own future still reports its result or error.

    Args:
        cfg: server addresses, padding, timeouts, token.
    """

    def __init__(self, cfg: RemoteCriticConfig) -> None:
        self.cfg = cfg
        self.token = cfg.token or os.environ.get(TOKEN_ENV) or None
        self._critic = TritonHTTPClient(
            cfg.critic.ip,
            cfg.critic.port,
            server_name="critic server",
            init_timeout_s=cfg.init_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            max_workers=cfg.max_workers,
            retries_on_rejected_batch=cfg.retries_on_rejected_batch,
            hint=_HINT,
            reconnect_grace_s=cfg.reconnect_grace_s,
            config_prefix=f"{CONFIG_KEY}.",
        )
        self._rm: RemoteGPTRMClient | None = None
        if not cfg.combine_rm_and_critic_server:
            self._rm = remote_reward_client(cfg)
        self._last_train: Future[dict[str, float]] | None = None
        self._order = threading.Lock()
        self._texts: RolloutTexts | None = None
        self.reward_input = "tokens"
        """How rollouts reach the reward model: ``tokens`` until :meth:`configure_reward_input`."""

    def configure_reward_input(
        self,
        policy: TokenizerIdentity,
        to_conversations: ToConversations,
        to_metadata: ToMetadata | None = None,
    ) -> str:
        """Ask the servers for their tokenizers and settle ``cfg.reward_input`` (see
        :func:`choose_reward_input`); in ``text`` mode rollouts then reach the reward server as the
        conversations ``to_conversations(rollout_batch)`` gives, with ``to_metadata``'s per-row
        metadata when given. Returns ``tokens`` or ``text``.

        Raises:
            TokenizerMismatchError: the servers' tokenizers cannot serve this policy's rollouts.
            ServerUnavailableError: a server cannot be reached.
        """
        infer = self.cfg.critic.name.infer
        critic = TokenizerIdentity.from_server(self._critic.tokenizer(infer), self._critic.where(infer))
        reward = None
        if self._rm is not None:
            reward = TokenizerIdentity.from_server(self._rm.tokenizer(), self._rm.url)
        self.reward_input = choose_reward_input(
            self.cfg.reward_input,
            policy,
            reward=reward,
            critic=critic,
            combined=self.cfg.combine_rm_and_critic_server,
        )
        self._texts = RolloutTexts(to_conversations, to_metadata) if self.reward_input == "text" else None
        return self.reward_input

    @property
    def url(self) -> str:
        """The critic server's ``http://host:port``."""
        return self._critic.url

    def wait_until_ready(self) -> None:
        """Block until every endpoint is served; raises ``ServerTimeoutError`` otherwise."""
        names = self.cfg.critic.name
        self._critic.wait_until_ready([names.infer, names.train, names.save])
        if self._rm is not None:
            self._rm.wait_until_ready()

    # -- infer ---------------------------------------------------------------------------------
    def infer_rm_critic(self, rollout_batch: Mapping[str, torch.Tensor]) -> RMCriticFutureResult:
        """Request values (and rewards) for a rollout micro-batch.

        Args:
            rollout_batch: ``response_tokens`` [B, S] integer (prompt + response, right-padded)
                and ``response_lengths`` [B]; other keys (``prompt_lengths``, ``is_end``) are ignored.

        Returns:
            A :class:`RMCriticFutureResult`; its ``result()`` gives rewards [B] and values [B, S-1].

        Raises:
            BadRequestError: at once, when the tensors are malformed or wider than ``pad_to_length``.
        """
        model = self.cfg.critic.name.infer
        tokens, lengths = rollout_arrays(rollout_batch, self.cfg.pad_to_length, self._bad(model))
        rows, width = int(tokens.shape[0]), int(rollout_batch["response_tokens"].shape[1])
        if width < 2:
            raise self._bad(model)(f"response_tokens must be at least 2 wide (values are S-1), got {width}")
        combined = self.cfg.combine_rm_and_critic_server
        where = self._critic.where(model)

        def decode(outputs: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
            values = outputs.get(VALUES.name)
            rewards = outputs.get(REWARDS.name)
            if values is None or values.shape[0] != rows or (combined and rewards is None):
                wanted = f"'{VALUES.name}'" + (f" and '{REWARDS.name}'" if combined else "")
                raise BadRequestError(
                    f"{where} answered without {rows} rows of {wanted} (got {sorted(outputs)}): is "
                    f"combine_rm_and_critic_server the same on the client and the server?",
                    url=self.url,
                    model=model,
                )
            v = torch.from_numpy(np.array(values, dtype=np.float32))
            r = torch.from_numpy(np.array(rewards, dtype=np.float32).reshape(-1)) if combined else None
            return v, r

        self._after_train()
        inputs = {TOKENS.name: tokens, SEQUENCE_LENGTHS.name: lengths.reshape(-1, 1)}
        critic = self._critic.submit(model, inputs, decode)
        try:
            rewards = self._infer_rewards(rollout_batch)
        except BaseException:
            critic.cancel()  # nobody will read it: leave no future behind
            raise
        return RMCriticFutureResult(critic, rewards, width, rollout_batch["response_tokens"].device)

    def _infer_rewards(self, rollout_batch: Mapping[str, torch.Tensor]) -> Future[torch.Tensor] | None:
        if self._rm is None:
            return None
        return request_rewards(self._rm, rollout_batch, self._texts)

    # -- train ---------------------------------------------------------------------------------
    def train(self, ppo_rollout_data: Mapping[str, torch.Tensor]) -> Future[dict[str, float]]:
        """Send one batch for a critic training pass.

        Args:
            ppo_rollout_data: ``response_tokens`` [N, S] integer; ``returns``, ``values`` (sent as
                ``prev_values``) and ``mask`` [N, S-1] float. Other keys are ignored.

        Returns:
            A future of ``{"loss": loss_mean, "clip_fraction", "train_explained_variance",
            "grad_norm", "lr", "critic_step", "critic_optimizer_steps"}`` (floats): the server's
            step after this request and the optimizer steps the request ran; plus
            ``"explained_variance_after"`` (of the values after the update) from a server that
            sends it.

        Raises:
            BadRequestError: at once, when keys, shapes or values are wrong.
        """
        model = self.cfg.critic.name.train
        bad = self._bad(model)
        missing = [k for k in ("response_tokens", "returns", "values", "mask") if k not in ppo_rollout_data]
        if missing:
            raise bad(f"ppo_rollout_data lacks {missing}; it needs response_tokens, returns, values, mask")
        tokens = ppo_rollout_data["response_tokens"]
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise bad(
                f"response_tokens must be an integer [N, S] tensor, got {tokens.dtype} {list(tokens.shape)}"
            )
        rows, width = tokens.shape
        inputs = {TOKENS.name: tokens.detach().to("cpu", torch.int64).numpy()}
        for key, name in (("returns", RETURNS.name), ("values", PREV_VALUES.name), ("mask", MASK.name)):
            t = ppo_rollout_data[key]
            if tuple(t.shape) != (rows, width - 1):
                raise bad(
                    f"{key} must be [N, S-1] = [{rows}, {width - 1}] (next-token aligned with "
                    f"response_tokens [{rows}, {width}]), got {list(t.shape)}"
                )
            array = t.detach().to("cpu", torch.float32).numpy()
            if not np.isfinite(array).all():
                raise bad(f"{key} holds NaN or inf; the critic cannot train on it")
            inputs[name] = array

        def decode(outputs: dict[str, np.ndarray]) -> dict[str, float]:
            answer = {
                "loss": _scalar(outputs, LOSS_MEAN.name, bad),
                "clip_fraction": _scalar(outputs, CLIP_FRACTION.name, bad),
                "train_explained_variance": _scalar(outputs, EXPLAINED_VARIANCE.name, bad),
                "grad_norm": _scalar(outputs, GRAD_NORM.name, bad),
                "lr": _scalar(outputs, LR.name, bad),
                "critic_step": _scalar(outputs, STEP.name, bad),
                "critic_optimizer_steps": _scalar(outputs, OPTIMIZER_STEPS.name, bad),
            }
            if EXPLAINED_VARIANCE_AFTER.name in outputs:  # a server from before it was added has none
                answer["explained_variance_after"] = _scalar(outputs, EXPLAINED_VARIANCE_AFTER.name, bad)
            return answer

        self._after_train()
        # One more optimizer pass if it ran twice: resent after a lost connection only when the
        # server cannot have kept its effect (see openaligner.clients.base).
        future = self._critic.submit(model, inputs, decode, self._token_parameter(), idempotent=False)
        with self._order:
            self._last_train = future
        return future

    # -- save ----------------------------------------------------------------------------------
    def save(self) -> Future[dict[str, int]]:
        """Ask the critic server to write a checkpoint (where is the server's choice).

        Returns:
            A future of ``{"status": 0, "step": critic optimizer steps saved}``, settled once the
            checkpoint is durable on the server.
        """
        return self._save({DUMMY_VAR.name: np.zeros(1, np.int64)})

    def restore(self, step: int) -> Future[dict[str, int]]:
        """Ask the critic server to go back to its own checkpoint of critic ``step``.

        Returns:
            A future of ``{"status": 0, "step": step}``; it fails with a
            :class:`~openaligner.clients.errors.BadRequestError` naming the steps the server holds
            when it has no complete checkpoint of ``step``.
        """
        return self._save(
            {DUMMY_VAR.name: np.zeros(1, np.int64), RESTORE_STEP.name: np.array([step], np.int64)}
        )

    def _save(self, inputs: dict[str, np.ndarray]) -> Future[dict[str, int]]:
        model = self.cfg.critic.name.save
        bad = self._bad(model)

        def decode(outputs: dict[str, np.ndarray]) -> dict[str, int]:
            status, step = _scalar(outputs, STATUS.name, bad), _scalar(outputs, STEP.name, bad)
            return {"status": int(status), "step": int(step)}

        self._after_train()
        return self._critic.submit(model, inputs, decode, self._token_parameter())

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel queued requests and stop the workers of both connections; never hangs."""
        try:
            self._critic.close()
        finally:
            if self._rm is not None:
                self._rm.close()

    def __enter__(self) -> RemoteGPTRMCriticClient:
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _after_train(self) -> None:
        """Wait until the last train request is answered (its outcome stays in its future)."""
        with self._order:
            last = self._last_train
        if last is not None:
            concurrent.futures.wait([last])

    def _token_parameter(self) -> dict[str, str] | None:
        return {TOKEN_PARAMETER: self.token} if self.token is not None else None

    def _bad(self, model: str) -> _BadRequestFactory:
        return _BadRequestFactory(self._critic.where(model), self.url, model)


@dataclass(frozen=True)
class _BadRequestFactory:
    where: str
    url: str
    model: str

    def __call__(self, message: str) -> BadRequestError:
        return BadRequestError(f"{self.where}: {message}", url=self.url, model=self.model)


def _scalar(outputs: Mapping[str, np.ndarray], name: str, bad: _BadRequestFactory) -> float:
    value = outputs.get(name)
    if value is None or value.size != 1:
        raise bad(f"the answer lacks the scalar output '{name}' (got {sorted(outputs)}); a critic server?")
    return float(value.reshape(-1)[0])
