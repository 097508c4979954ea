"""A Python reward function served like a reward model: user code isolated in a worker process.

Owns (1) :class:`FunctionRunner`, which loads ``module:callable`` (or ``path/to/file.py:callable``)
in a worker process of its own and calls it one batch at a time, so that a function that raises,
hangs past its timeout, returns the wrong thing or kills its process fails only that call — the
worker is restarted and serving goes on; (2) :class:`RewardFunctionEndpoint`, the ``reward_model``
endpoint that scores ``messages`` (with optional per-row ``metadata``) with the function, alone or
combined with a reward model (``model_weight · model score + function_weight · function score``).
Must not know HTTP or PyTriton (see :mod:`openaligner.servers.transport.triton`), nor what the
function computes.

The function's contract: ``fn(prompts: list[str], responses: list[str], metadata: list[dict])
-> Sequence[float]`` with one finite score per row; a function whose signature takes two
positional parameters is called without ``metadata``. A row's *prompt* is the conversation before
its last message: the content of a single user message, else each message as a ``role: content``
line; its *response* is the last (assistant) message's content; its metadata is the row's JSON
object from the ``metadata`` input, ``{}`` without one.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from openaligner.servers.batching import split_rows
from openaligner.servers.function_worker import (
    RewardFunctionError,
    RewardFunctionLoadError,
    split_spec,
    worker_main,
)
from openaligner.servers.protocol import (
    MESSAGES,
    METADATA,
    REWARD_INPUTS,
    REWARD_MODEL_NAME,
    REWARD_OUTPUTS,
    SENTENCES,
    text_reader,
    tokenizer_description,
)
from openaligner.servers.validation import (
    RenderFn,
    RequestError,
    RequestsFailed,
    SequenceRequest,
    TokenizeFn,
    check_batch_size,
    check_known_inputs,
    check_spec,
    decode_messages,
    decode_sentences,
    parse_sequence_request,
)

LOGGER = logging.getLogger(__name__)

MAX_METADATA_BYTES = 65536
"""Largest ``metadata`` object per row (UTF-8 bytes of its JSON)."""


class FunctionRunner:
    """Calls the reward function ``spec`` in a worker process, one call at a time.

    Args:
        spec: ``module:callable`` or ``path/to/file.py:callable``; imported by the worker (the
            server's ``sys.path`` and working directory), never by the calling process.
        timeout_s: a call that has not answered after this long fails; its worker is killed and a
            new one started.
        start_timeout_s: how long the worker may take to import the function.

    Raises:
        RewardFunctionLoadError: at construction, when the worker cannot load the function.
    """

    def __init__(self, spec: str, timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        split_spec(spec)  # a malformed spec is refused before any process starts
        self.spec = spec
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        """Workers started after the first (each after a timeout or a dead worker)."""
        self._lock = threading.Lock()
        self._context = multiprocessing.get_context("spawn")  # the server runs threads: never fork it
        self._process: Any = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=worker_main, args=(self.spec, child), daemon=True)
        process.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            process.kill()
            raise RewardFunctionLoadError(
                f"reward.function={self.spec!r}: the worker did not load it in {self.start_timeout_s:.0f} s"
            )
        try:
            kind, value = parent.recv()
        except EOFError:
            process.join(5)
            raise RewardFunctionLoadError(
                f"reward.function={self.spec!r}: the worker exited while loading it (code {process.exitcode})"
            ) from None
        if kind == "load_error":
            process.join(5)
            raise RewardFunctionLoadError(str(value))
        self._process, self._conn = process, parent

    def _restart(self) -> None:
        self.close()
        self.restarts += 1
        self._start()

    def __call__(
        self, prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        """Scores of ``len(prompts)`` rows.

        Raises:
            RewardFunctionError: the function raised, returned a wrong value, timed out
                (``reward.timeout_s``) or its worker died; the worker is ready again afterwards.
        """
        with self._lock:
            assert self._conn is not None
            try:
                self._conn.send((prompts, responses, metadata))
                answered = self._conn.poll(self.timeout_s)
                outcome = self._conn.recv() if answered else None
            except (EOFError, OSError, BrokenPipeError):
                code = None
                if self._process is not None:
                    self._process.join(2)  # reap it, for its exit code
                    code = self._process.exitcode
                self._restart()
                raise RewardFunctionError(
                    f"{self.spec}: its worker process died during the call (exit code {code}); restarted"
                ) from None
            if outcome is None:
                self._restart()
                raise RewardFunctionError(
                    f"{self.spec} did not answer within reward.timeout_s={self.timeout_s:g} s; its worker "
                    "was killed and restarted"
                )
        kind, value = outcome
        if kind != "ok":
            raise RewardFunctionError(str(value))
        return list(value)

    def close(self) -> None:
        """Stop the worker (killed if it does not exit at once)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(5)
            self._process = None


# -------------------------------------------------------------------------------- the endpoint
def conversation_texts(conversation: Sequence[Mapping[str, str]]) -> tuple[str, str]:
    """``(prompt, response)`` of one conversation ending with the assistant's response: the prompt
    is a single user message's content, else every message before the response as a
    ``role: content`` line."""
    before, last = conversation[:-1], conversation[-1]
    if len(before) == 1 and before[0]["role"] == "user":
        prompt = before[0]["content"]
    else:
        prompt = "\n".join(f"{m['role']}: {m['content']}" for m in before)
    return prompt, last["content"]


def decode_metadata(array: np.ndarray, rows: int) -> list[dict[str, Any]]:
    """The ``metadata`` input [B, 1]: one UTF-8 JSON object per row.

    Raises:
        RequestError: naming the row and what was expected.
    """
    if array.shape[0] != rows:
        raise RequestError(
            f"input '{METADATA.name}' has {array.shape[0]} rows but '{MESSAGES.name}' has {rows}; send one "
            "JSON object per conversation"
        )
    out = []
    for row, text in enumerate(decode_sentences(array, METADATA.name)):
        if len(text.encode("utf-8")) > MAX_METADATA_BYTES:
            raise RequestError(f"input '{METADATA.name}': row {row} is over {MAX_METADATA_BYTES} bytes")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(
                f"input '{METADATA.name}': row {row} is not JSON ({e.msg} at character {e.pos}); send "
                'one JSON object per row, e.g. {"answer": "42"}'
            ) from None
        if not isinstance(value, dict):
            raise RequestError(
                f"input '{METADATA.name}': row {row} is a JSON {type(value).__name__}; send a JSON "
                'object per row, e.g. {"answer": "42"}'
            )
        out.append(value)
    return out


ScoreTexts = Callable[[list[str], list[str], list[dict[str, Any]]], Sequence[float]]
"""``(prompts, responses, metadata) -> scores``, one per row (a :class:`FunctionRunner`)."""

ShapeBatch = Callable[[Sequence[SequenceRequest]], tuple[torch.Tensor, torch.Tensor]]
"""Requests' model rows → ``(tokens [B', S'], lengths [B'])`` with their rows first (padded after)."""


@dataclass(frozen=True)
class TextRequest:
    """One validated request: its rows' texts and metadata, and, when a reward model is combined,
    the rows laid out for it."""

    prompts: list[str]
    responses: list[str]
    metadata: list[dict[str, Any]]
    sequences: SequenceRequest | None  # tokens [b, S] and lengths [b] for the model; None: no model

    @property
    def rows(self) -> int:
        return len(self.prompts)


class RewardFunctionEndpoint:
    """The ``reward_model`` endpoint scoring text with a reward function (and, optionally, a model).

    Args:
        function: ``(prompts, responses, metadata) -> scores`` (usually a :class:`FunctionRunner`).
        name: the function's name for messages (``reward.function``).
        model_forward: ``(tokens [B, S], lengths [B]) -> rewards [B]`` of a reward model combined
            with the function, or None (function only).
        render_func: lays ``messages`` out for the model (required with ``model_forward``).
        tokenize_func: lays out ``sentences`` for the model: whole texts, already rendered, sent
            beside ``messages`` when the model reads the texts whole (None refuses them).
        model_weight, function_weight: reward = model_weight · model + function_weight · function.
        model_name: the Triton model name.
        tokenizer_info: what the tokenizer route says (the model's tokenizer, or none) — ``reads``
            is set to ``text`` here.
        max_batch_size: most rows per request.
        max_sequence_length: longest sequence the model is given (rendered rows are cut).
        prepare_model_batch: shapes the merged model rows for ``model_forward`` (padding to whole
            micro-batches on every rank); returns tokens and lengths with the requests' rows first.
    """

    inputs = REWARD_INPUTS
    outputs = REWARD_OUTPUTS

    def __init__(
        self,
        function: ScoreTexts,
        *,
        name: str,
        model_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        render_func: RenderFn | None = None,
        tokenize_func: TokenizeFn | None = None,
        prepare_model_batch: ShapeBatch | None = None,
        model_weight: float = 1.0,
        function_weight: float = 1.0,
        model_name: str = REWARD_MODEL_NAME,
        tokenizer_info: Mapping[str, object] | None = None,
        max_batch_size: int = 1024,
        max_sequence_length: int | None = None,
    ) -> None:
        if model_forward is not None and (render_func is None or prepare_model_batch is None):
            raise ValueError("a reward model combined with a function needs its tokenizer to lay text out")
        self.function = function
        self.name = name
        self.model_forward = model_forward
        self.render_func = render_func
        self.tokenize_func = tokenize_func
        self.prepare_model_batch = prepare_model_batch
        self.model_weight = model_weight
        self.function_weight = function_weight
        self.model_name = model_name
        self.tokenizer_info = text_reader(tokenizer_info or tokenizer_description(None, None, None))
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.failed_calls = 0
        """Calls of the function that failed (each failed its requests only)."""

    def validate(self, inputs: Mapping[str, np.ndarray]) -> TextRequest:
        """Check one request: ``messages`` (and optional ``metadata``; with a model, optional
        ``sentences``: the model's whole texts, one per conversation); tokens are refused.

        Raises:
            RequestError: naming the input and what was expected.
        """
        check_known_inputs(inputs, REWARD_INPUTS)
        if MESSAGES.name not in inputs:
            sent = sorted(inputs)
            raise RequestError(
                f"this server scores text with the reward function {self.name}: it reads '{MESSAGES.name}' "
                f"({MESSAGES.dtype_name} {MESSAGES.wire_shape}: a JSON conversation per row ending with the "
                f"assistant's response) with optional '{METADATA.name}' (a JSON object per row); got {sent}"
            )
        messages = check_spec(inputs[MESSAGES.name], MESSAGES)
        check_batch_size(messages.shape[0], self.max_batch_size)
        conversations = decode_messages(messages)
        metadata: list[dict[str, Any]] = [{} for _ in conversations]
        if METADATA.name in inputs:
            metadata = decode_metadata(check_spec(inputs[METADATA.name], METADATA), len(conversations))
        texts = [conversation_texts(c) for c in conversations]
        sequences = None
        if SENTENCES.name in inputs:
            sequences = self._model_sentences(inputs[SENTENCES.name], len(conversations))
        elif self.model_forward is not None:
            assert self.render_func is not None
            tokens, lengths = self.render_func(conversations, self.max_sequence_length)
            sequences = SequenceRequest(tokens.to(torch.int64), lengths.reshape(-1).to(torch.int64))
        return TextRequest([p for p, _ in texts], [r for _, r in texts], metadata, sequences)

    def _model_sentences(self, array: np.ndarray, rows: int) -> SequenceRequest:
        """The model's rows from ``sentences``: whole texts, each already rendered (the function
        still reads ``messages``)."""
        if self.model_forward is None or self.tokenize_func is None:
            raise RequestError(
                f"input '{SENTENCES.name}' gives the texts a reward model combined with the function reads; "
                f"this server has {'no model' if self.model_forward is None else 'no tokenizer'}: send "
                f"'{MESSAGES.name}' alone"
            )
        if array.shape[0] != rows:
            raise RequestError(
                f"input '{SENTENCES.name}' has {array.shape[0]} rows but '{MESSAGES.name}' has {rows}; send "
                "one text per conversation"
            )
        return parse_sequence_request(
            {SENTENCES.name: array},
            tokenize_func=self.tokenize_func,
            vocab_size=None,
            max_sequence_length=self.max_sequence_length,
            max_batch_size=self.max_batch_size,
        )

    def run(self, requests: Sequence[TextRequest]) -> list[dict[str, np.ndarray]]:
        """Score a formed batch. When the function fails on it, each request is scored alone so that
        only the failing ones fail: the answer then names them, and the others are listed as
        valid, to be resent by their clients (Triton gives every request of a call one answer).

        Raises:
            RequestsFailed: the function failed on some requests (their positions → why).
        """
        scores = self._function_scores(requests)
        rewards = self.function_weight * torch.tensor(scores, dtype=torch.float64)
        if self.model_forward is not None:
            assert self.prepare_model_batch is not None
            seqs = [r.sequences for r in requests]
            assert all(s is not None for s in seqs)
            tokens, lengths = self.prepare_model_batch([s for s in seqs if s is not None])
            model = self.model_forward(tokens, lengths).detach().to("cpu", torch.float64).reshape(-1)
            rewards = rewards + self.model_weight * model[: len(scores)]
        pieces = split_rows(rewards.to(torch.float32), [r.rows for r in requests])
        return [{"rewards": p.reshape(-1, 1).numpy()} for p in pieces]

    def _function_scores(self, requests: Sequence[TextRequest]) -> list[float]:
        def call(rs: Sequence[TextRequest]) -> list[float]:
            return list(
                self.function(
                    [p for r in rs for p in r.prompts],
                    [x for r in rs for x in r.responses],
                    [m for r in rs for m in r.metadata],
                )
            )

        try:
            return call(requests)
        except RewardFunctionError as e:
            self.failed_calls += 1
            first_error = str(e)
        if len(requests) > 1:  # Triton merged several clients' requests: find the failing ones alone
            failed: dict[int, str] = {}
            for i, r in enumerate(requests):
                try:
                    call([r])
                except RewardFunctionError as e:
                    failed[i] = str(e)
            if failed:
                LOGGER.warning("function failed on %d of %d merged requests", len(failed), len(requests))
                raise RequestsFailed(failed)
        # one request, or it failed only when merged (e.g. a flaky function): fail the call as one
        raise RequestsFailed(dict.fromkeys(range(len(requests)), first_error))
