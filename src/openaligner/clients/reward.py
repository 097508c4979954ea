"""Client of the reward model server: rollout tensors in, a future of rewards out.

Owns the actor-side view of the ``reward_model`` endpoint: the client config, the fixed-width
padding (``pad_to_length``) that lets Triton merge requests from different micro-batches, the
local shape checks, and converting answers back to torch. Must not know about PPO or how the
server computes rewards; transport, readiness and errors come from :mod:`openaligner.clients.base`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openaligner.clients.base import TritonHTTPClient
from openaligner.clients.errors import BadRequestError
from openaligner.protocol import (
    DEFAULT_HOST,
    MESSAGES,
    METADATA,
    REWARD_DEFAULT_PORT,
    REWARD_MODEL_NAME,
    REWARDS,
    SEQUENCE_LENGTHS,
    TOKENS,
)


def _hint(address_prefix: str, config_prefix: str) -> str:
    a = address_prefix
    return (
        f"Check that `openaligner serve-reward` is running and has printed its URL, and that {a}ip/{a}port/"
        f"{a}name match the server's server.host/server.port/server.model_name (Triton needs ~3 s to "
        f"start; raise {config_prefix}init_timeout_s if the server is still loading)."
    )


@dataclass
class RemoteRMConfig:
    """Where the reward model server is and how to talk to it."""

    ip: str = DEFAULT_HOST  # host of the reward model server
    port: int = REWARD_DEFAULT_PORT  # its HTTP port
    name: str = REWARD_MODEL_NAME  # Triton model name it serves
    pad_to_length: int | None = None  # right-pad tokens to this width so Triton can merge requests
    init_timeout_s: float = 60.0  # wait this long for the server to become ready
    request_timeout_s: float = 300.0  # give up on one request after this long
    max_workers: int = 4  # requests in flight at once
    retries_on_rejected_batch: int = 3  # resends of a valid request rejected with an invalid one
    reconnect_grace_s: float = 0.0  # after a lost connection, wait this long for the server to return

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"remote reward model port must be in 1..65535, got {self.port}")
        if self.reconnect_grace_s < 0:
            raise ValueError(
                f"reconnect_grace_s must be >= 0 (0: fail at once), got {self.reconnect_grace_s}"
            )
        if self.pad_to_length is not None and self.pad_to_length < 1:
            raise ValueError(f"pad_to_length must be >= 1 or null, got {self.pad_to_length}")
        if self.init_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("init_timeout_s and request_timeout_s must be > 0")


class RemoteGPTRMClient:
    """Ask a reward model server for rewards, asynchronously.

    Use as a context manager (``with RemoteGPTRMClient(cfg) as rm:``), which waits for the server
    up to ``init_timeout_s`` on entry and closes on exit; without it, the first request waits.

    Args:
        cfg: server address, padding and timeouts.
        address_prefix / config_prefix: where ``cfg``'s address keys (``ip``, ``port``, ``name``) and
            its other keys (``init_timeout_s``, ...) sit in the user's config, for messages (e.g.
            ``remote.reward_model.`` and ``remote.`` in train-ppo).
    """

    def __init__(self, cfg: RemoteRMConfig, *, address_prefix: str = "", config_prefix: str = "") -> None:
        self.cfg = cfg
        self._client = TritonHTTPClient(
            cfg.ip,
            cfg.port,
            server_name="reward model server",
            init_timeout_s=cfg.init_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            max_workers=cfg.max_workers,
            retries_on_rejected_batch=cfg.retries_on_rejected_batch,
            hint=_hint(address_prefix, config_prefix),
            reconnect_grace_s=cfg.reconnect_grace_s,
            config_prefix=config_prefix,
        )

    @property
    def url(self) -> str:
        return self._client.url

    def wait_until_ready(self) -> None:
        """Block until the server serves ``cfg.name``; raises ``ServerTimeoutError`` otherwise."""
        self._client.wait_until_ready([self.cfg.name])

    def tokenizer(self) -> dict[str, Any] | None:
        """The server's tokenizer (see :meth:`~openaligner.clients.base.TritonHTTPClient.tokenizer`)."""
        return self._client.tokenizer(self.cfg.name)

    def infer_rm_conversations(
        self,
        conversations: Sequence[Sequence[Mapping[str, str]]],
        device: torch.device | str = "cpu",
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Future[torch.Tensor]:
        """Request rewards for conversations that the server lays out with its own tokenizer and
        template, as its model was trained (the ``messages`` input), or scores with a reward
        function (which also reads ``metadata``).

        Args:
            conversations: B lists of ``{"role", "content"}``, each ending with the assistant's
                response.
            device: where the rewards are put.
            metadata: B JSON-serialisable objects (e.g. ``{"answer": "42"}``) for a reward
                function; None: none sent.

        Returns:
            A future whose ``result()`` is rewards [B] float32 on ``device``.

        Raises:
            BadRequestError: at once, when ``metadata`` has another number of rows or cannot be
                written as JSON objects.
        """
        rows = [json.dumps([{"role": m["role"], "content": m["content"]} for m in c]) for c in conversations]
        inputs = {MESSAGES.name: _bytes_rows(rows)}
        if metadata is not None:
            inputs[METADATA.name] = _bytes_rows(self._metadata_rows(metadata, len(rows)))
        return self._client.submit(self.cfg.name, inputs, self._to_rewards(len(rows), device))

    def _metadata_rows(self, metadata: Sequence[Mapping[str, Any]], rows: int) -> list[str]:
        def bad(message: str) -> BadRequestError:
            where = self._client.where(self.cfg.name)
            return BadRequestError(f"{where}: {message}", url=self.url, model=self.cfg.name)

        if len(metadata) != rows:
            raise bad(f"metadata has {len(metadata)} rows for {rows} conversations")
        try:
            return [json.dumps(dict(m)) for m in metadata]
        except (TypeError, ValueError) as e:
            raise bad(f"metadata must be JSON objects: {e}") from None

    def _to_rewards(
        self, rows: int, device: torch.device | str
    ) -> Callable[[dict[str, np.ndarray]], torch.Tensor]:
        def to_rewards(outputs: dict[str, np.ndarray]) -> torch.Tensor:
            rewards = outputs.get(REWARDS.name)
            if rewards is None or rewards.shape[0] != rows:
                raise BadRequestError(
                    f"{self._client.where(self.cfg.name)} answered without {rows} "
                    f"'{REWARDS.name}' rows (got {None if rewards is None else rewards.shape}): "
                    f"is it a reward model server?",
                    url=self.url,
                    model=self.cfg.name,
                )
            return torch.from_numpy(np.asarray(rewards, dtype=np.float32).reshape(-1).copy()).to(device)

        return to_rewards

    def infer_rm(self, rollout_batch: Mapping[str, torch.Tensor]) -> Future[torch.Tensor]:
        """Request rewards for a rollout micro-batch.

        Args:
            rollout_batch: ``response_tokens`` [B, S] integer (prompt + response, right-padded)
                and ``response_lengths`` [B] (valid tokens per row, 1 ≤ length ≤ S).

        Returns:
            A future whose ``result()`` is rewards [B] float32 on the device of ``response_tokens``,
            or raises a :class:`openaligner.clients.errors.ClientError`.

        Raises:
            BadRequestError: at once, when the tensors have the wrong shape or do not fit
                ``pad_to_length``.
        """
        tokens, lengths = self._prepare(rollout_batch)
        device = rollout_batch["response_tokens"].device
        inputs = {TOKENS.name: tokens, SEQUENCE_LENGTHS.name: lengths.reshape(-1, 1)}

        return self._client.submit(self.cfg.name, inputs, self._to_rewards(tokens.shape[0], device))

    def _prepare(self, batch: Mapping[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        where = self._client.where(self.cfg.name)
        return rollout_arrays(
            batch,
            self.cfg.pad_to_length,
            lambda msg: BadRequestError(f"{where}: {msg}", url=self.url, model=self.cfg.name),
        )

    def close(self) -> None:
        """Cancel queued requests and stop the workers; returns within a few seconds."""
        self._client.close()

    def __enter__(self) -> RemoteGPTRMClient:
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def rollout_arrays(
    batch: Mapping[str, torch.Tensor], pad_to_length: int | None, bad: Callable[[str], Exception]
) -> tuple[np.ndarray, np.ndarray]:
    """Check a rollout micro-batch and turn it into the wire arrays of an inference request.

    Shared by the reward and critic clients.

    Args:
        batch: ``response_tokens`` [B, S] integer and ``response_lengths`` [B].
        pad_to_length: right-pad ``tokens`` with 0 to this width (None: send as is).
        bad: builds the exception raised for a malformed batch from a message.

    Returns:
        ``tokens`` [B, max(S, pad_to_length)] int64 and ``lengths`` [B] int64.
    """
    if "response_tokens" not in batch or "response_lengths" not in batch:
        raise bad(f"rollout_batch needs 'response_tokens' and 'response_lengths', got {sorted(batch)}")
    tokens, lengths = batch["response_tokens"], batch["response_lengths"].reshape(-1)
    if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise bad(
            f"response_tokens must be an integer [B, S] tensor, got {tokens.dtype} {list(tokens.shape)}"
        )
    if lengths.shape[0] != tokens.shape[0]:
        raise bad(f"response_lengths has {lengths.shape[0]} rows, response_tokens has {tokens.shape[0]}")
    width = tokens.shape[1]
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise bad(
            f"response_lengths must lie in [1, {width}], "
            f"got min {int(lengths.min())} max {int(lengths.max())}"
        )
    if pad_to_length is not None and width > pad_to_length:
        raise bad(
            f"response_tokens is {width} wide, more than pad_to_length={pad_to_length}; raise pad_to_length"
        )
    array = tokens.detach().to("cpu", torch.int64).numpy()
    if pad_to_length is not None and width < pad_to_length:
        array = np.pad(array, ((0, 0), (0, pad_to_length - width)))
    return np.ascontiguousarray(array), lengths.detach().to("cpu", torch.int64).numpy()


def _bytes_rows(rows: Sequence[str]) -> np.ndarray:
    """UTF-8 texts as a BYTES input [B, 1]."""
    return np.array([[r.encode("utf-8")] for r in rows], dtype=np.object_)
