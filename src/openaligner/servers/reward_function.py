"""A Python reward function served like a reward model: user code isolated in worker processes.

Owns :class:`FunctionRunner` (``module:callable`` in a pool of worker processes, so that a call that
raises, hangs, returns the wrong thing or dies fails only itself) and
:class:`RewardFunctionEndpoint` (scores ``messages`` with the function, alone or weighted with a
reward model, once per request before Triton). Contract: ``fn(prompts, responses, metadata)``.
Must not know HTTP or PyTriton, nor what the function computes.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from openaligner.protocol import (
    MESSAGES,
    METADATA,
    REWARD_INPUTS,
    REWARD_MODEL_NAME,
    REWARD_OUTPUTS,
    SENTENCES,
    text_reader,
    tokenizer_description,
)
from openaligner.servers.batching import split_rows
from openaligner.servers.function_worker import (
    RewardFunctionError,
    RewardFunctionLoadError,
    split_spec,
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

WORKER_MODULE = "openaligner.servers.function_worker"
"""What a worker process runs (``python -m``)."""

MAX_METADATA_BYTES = 65536
"""Largest ``metadata`` object per row (UTF-8 bytes of its JSON)."""


class FunctionRunner:
    """Calls the reward function ``spec`` in a pool of ``workers`` worker processes.

    Each call goes to the first free worker (calls wait in a queue while every worker is busy), so
    a call that hangs holds one worker and the others serve on. A call that runs past ``timeout_s``
    or kills its worker fails; that worker is killed and a new one started in its place, and the
    call's failure is reported only once the new worker is ready — so a client whose calls keep
    failing, one request at a time, holds at most one worker at any moment.

    Args:
        spec: ``module:callable`` or ``path/to/file.py:callable``; imported by each worker (the
            server's ``sys.path`` and working directory), never by the calling process.
        timeout_s: a call that has not answered after this long (from when a worker takes it)
            fails; its worker is killed and a new one started.
        workers: worker processes; up to ``workers - 1`` calls may hang at once without delaying
            the others.
        start_timeout_s: how long a worker may take to import the function.

    Raises:
        RewardFunctionLoadError: at construction, when a worker cannot load the function.
    """

    def __init__(
        self, spec: str, timeout_s: float = 60.0, workers: int = 8, start_timeout_s: float = 120.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"reward.workers must be >= 1, got {workers}")
        split_spec(spec)  # a malformed spec is refused before any process starts
        self.spec = spec
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        """Workers started after the first ones (each after a timeout or a dead worker)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._count_lock = threading.Lock()
        launched = [self._launch() for _ in range(workers)]  # all load at once
        self._workers: list[_Worker | None] = []
        try:
            for process, conn in launched:
                self._workers.append(self._await_ready(process, conn))
        except BaseException:
            for process, conn in launched:
                conn.close()
                _end(process)
            raise
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"openaligner-reward-fn-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        """How many worker processes serve calls."""
        return len(self._workers)

    def _launch(self) -> tuple[subprocess.Popen[bytes], Connection]:
        """Start a worker: a fresh interpreter running :mod:`~openaligner.servers.function_worker`
        on one end of a socket pair. Not ``multiprocessing``: the server runs threads (never fork
        it), and spawn and forkserver children re-run the server's main module (seconds when it
        imports torch) before they start."""
        parent, child = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send((self.spec, list(sys.path)))  # the function is imported as the server would
        return process, conn

    def _await_ready(self, process: subprocess.Popen[bytes], conn: Connection) -> _Worker:
        if not conn.poll(self.start_timeout_s):
            _end(process)
            raise RewardFunctionLoadError(
                f"reward.function={self.spec!r}: the worker did not load it in {self.start_timeout_s:.0f} s"
            )
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RewardFunctionLoadError(
                f"reward.function={self.spec!r}: the worker exited while loading it (code {_end(process)})"
            ) from None
        if kind == "load_error":
            _end(process)
            raise RewardFunctionLoadError(str(value))
        return _Worker(process, conn)

    def submit(
        self, prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]
    ) -> Future[list[float]]:
        """Start a call on ``len(prompts)`` rows; its future resolves to their scores.

        The future fails with :class:`RewardFunctionError` when the function raised, returned a
        wrong value, timed out (``reward.timeout_s``) or its worker died.
        """
        future: Future[list[float]] = Future()
        if self._closed:
            future.set_exception(RewardFunctionError(f"{self.spec}: the server is stopping"))
        else:
            self._jobs.put(_Job(future, (prompts, responses, metadata)))
        return future

    def __call__(
        self, prompts: list[str], responses: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        """Scores of ``len(prompts)`` rows (:meth:`submit`, waited for).

        Raises:
            RewardFunctionError: see :meth:`submit`.
        """
        return self.submit(prompts, responses, metadata).result()

    def _serve(self, slot: int) -> None:
        """One worker's thread: take a call, run it on the worker, replace the worker if it hung or
        died."""
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                kind, value = self._call(slot, job.args)
            except RewardFunctionError as e:
                job.future.set_exception(e)
                continue
            if kind == "ok":
                job.future.set_result(list(value))
            else:
                job.future.set_exception(RewardFunctionError(str(value)))

    def _call(self, slot: int, args: tuple[Any, ...]) -> tuple[str, Any]:
        """One call on ``slot``'s worker; a worker that hung or died is replaced before the call
        fails.

        Raises:
            RewardFunctionError: the call timed out or its worker died (or cannot be replaced).
        """
        worker = self._workers[slot]
        if worker is None:  # its replacement failed to load last time: try again
            worker = self._replace(slot)
        try:
            return worker.call(args, self.timeout_s)
        except _Lost as lost:
            code = lost.exit_code
            why = (
                f"{self.spec}: its worker process died during the call (exit code {code}); restarted"
                if lost.died
                else f"{self.spec} did not answer within reward.timeout_s={self.timeout_s:g} s; its worker "
                "was killed and restarted"
            )
        self._replace(slot)
        raise RewardFunctionError(why)

    def _replace(self, slot: int) -> _Worker:
        """A new worker in ``slot`` (the old one is gone).

        Raises:
            RewardFunctionError: the server is stopping, or the function no longer loads.
        """
        self._workers[slot] = None
        if self._closed:
            raise RewardFunctionError(f"{self.spec}: the server is stopping")
        with self._count_lock:
            self.restarts += 1
        try:
            worker = self._await_ready(*self._launch())
        except RewardFunctionLoadError as e:
            LOGGER.error("could not restart a worker of the reward function: %s", e)
            raise RewardFunctionError(f"{self.spec}: its worker could not be restarted ({e})") from None
        self._workers[slot] = worker
        return worker

    def close(self) -> None:
        """Stop every worker (killed if it does not exit at once); calls still queued fail."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for worker in self._workers:
            if worker is not None:
                worker.stop()
        for thread in self._threads:
            thread.join(5)
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RewardFunctionError(f"{self.spec}: the server is stopping"))


@dataclass(frozen=True)
class _Job:
    future: Future[list[float]]
    args: tuple[list[str], list[str], list[dict[str, Any]]]


class _Lost(Exception):
    """A worker that died during a call (``died``), or did not answer in time."""

    def __init__(self, died: bool, exit_code: int | None) -> None:
        super().__init__("died" if died else "timed out")
        self.died = died
        self.exit_code = exit_code


class _Worker:
    """One worker process and its pipe, owned by one thread of :class:`FunctionRunner`."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn

    def call(self, args: tuple[Any, ...], timeout_s: float) -> tuple[str, Any]:
        """``("ok", scores)`` or ``("error", message)`` from the worker.

        Raises:
            _Lost: no answer within ``timeout_s``, or the worker died; the worker is then stopped
                and must be replaced.
        """
        try:
            self.conn.send(args)
            if self.conn.poll(timeout_s):
                outcome: tuple[str, Any] = self.conn.recv()
                return outcome
        except (EOFError, OSError):
            self.conn.close()
            raise _Lost(died=True, exit_code=_end(self.process, grace_s=2.0)) from None
        self.stop()
        raise _Lost(died=False, exit_code=None)

    def stop(self) -> None:
        self.conn.close()
        _end(self.process)


def _end(process: subprocess.Popen[bytes], grace_s: float = 0.0) -> int | None:
    """Wait up to ``grace_s`` for ``process`` to exit, then kill it; its exit code (negative: the
    signal that ended it; None: it outlived even the kill)."""
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
    try:
        return process.wait(5)
    except subprocess.TimeoutExpired:
        return None


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
"""``(prompts, responses, metadata) -> scores``, one per row: a :class:`FunctionRunner` (whose
``submit`` starts a call without waiting for it), or any callable, called in place."""

ShapeBatch = Callable[[Sequence[SequenceRequest]], tuple[torch.Tensor, torch.Tensor]]
"""Requests' model rows → ``(tokens [B', S'], lengths [B'])`` with their rows first (padded after)."""

SCORES_PARAMETER = "openaligner_function_scores"
"""Request parameter the HTTP front forwards with a request whose function call it awaited: the
ticket under which :meth:`RewardFunctionEndpoint.resume` finds the call's scores."""


class ScoreTickets:
    """Function scores computed before a request reached Triton, kept until its call takes them.

    Args:
        max_age_s: a ticket not taken after this long is dropped (its request never reached the
            model: e.g. Triton stopped).
    """

    def __init__(self, max_age_s: float = 600.0) -> None:
        self.max_age_s = max_age_s
        self._scores: dict[str, tuple[float, list[float]]] = {}
        self._lock = threading.Lock()

    def put(self, scores: list[float]) -> str:
        """A new, unguessable ticket for ``scores``."""
        ticket = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            stale = [t for t, (at, _) in self._scores.items() if now - at > self.max_age_s]
            for t in stale:
                del self._scores[t]
            self._scores[ticket] = (now, scores)
        return ticket

    def take(self, ticket: str) -> list[float] | None:
        """The scores of ``ticket``, once (None: unknown, taken or dropped)."""
        with self._lock:
            kept = self._scores.pop(ticket, None)
        return kept[1] if kept is not None else None

    def __len__(self) -> int:
        return len(self._scores)


@dataclass(frozen=True)
class TextRequest:
    """One validated request: its rows' texts and metadata, and, when a reward model is combined,
    the rows laid out for it."""

    prompts: list[str]
    responses: list[str]
    metadata: list[dict[str, Any]]
    sequences: SequenceRequest | None  # tokens [b, S] and lengths [b] for the model; None: no model
    scores: tuple[float, ...] | None = None  # [b] the function's scores, when computed at admission

    @property
    def rows(self) -> int:
        return len(self.prompts)


class RewardFunctionEndpoint:
    """The ``reward_model`` endpoint scoring text with a reward function (and, optionally, a model).

    The function is called once per request, never on several clients' requests at once, so that a
    call that fails fails only its own request. Behind the HTTP front the call is made before the
    request reaches Triton (:meth:`admit`): a failing call is refused like an invalid request, a
    hanging one holds only its own request, and Triton merges only requests already scored.

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
        """Calls of the function that failed (each failed its own request only)."""
        self.tickets = ScoreTickets()
        """Scores of admitted requests, until their Triton call takes them."""

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

    def admit(self, request: TextRequest) -> Future[dict[str, str]]:
        """Start the function's call on one checked request before it is sent to Triton (the HTTP
        front awaits it, holding no thread). Resolves to the request parameters that let
        :meth:`resume` find the scores in Triton's call; fails with :class:`RequestError` naming
        the function's error, so that the request is refused alone, never merged with others."""
        admitted: Future[dict[str, str]] = Future()

        def done(call: Future[list[float]]) -> None:
            try:
                scores = call.result()
            except RewardFunctionError as e:
                self.failed_calls += 1
                admitted.set_exception(RequestError(str(e)))
            except BaseException as e:  # e.g. cancelled: the front answers 500, it must not wait
                admitted.set_exception(e)
            else:
                admitted.set_result({SCORES_PARAMETER: self.tickets.put(scores)})

        self._submit(request).add_done_callback(done)
        return admitted

    def resume(self, request: TextRequest, parameters: Mapping[str, Any]) -> TextRequest:
        """``request`` with the scores :meth:`admit` computed for it, found by its parameters
        (unchanged when it has none: sent to Triton directly, or resent after being taken)."""
        ticket = parameters.get(SCORES_PARAMETER)
        scores = self.tickets.take(ticket) if isinstance(ticket, str) else None
        if scores is None or len(scores) != request.rows:
            return request
        return replace(request, scores=tuple(scores))

    def run(self, requests: Sequence[TextRequest]) -> list[dict[str, np.ndarray]]:
        """Score a formed batch: the function's scores of each request (computed at admission, or
        now, one call per request at once), combined with the model's when there is one.

        Raises:
            RequestsFailed: the function failed on some requests (their positions → why); only
                requests that reached Triton without admission can fail here.
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

    def _submit(self, request: TextRequest) -> Future[list[float]]:
        """The function's call on one request (running in a worker, or already done in place)."""
        submit = getattr(self.function, "submit", None)
        if submit is not None:
            started: Future[list[float]] = submit(request.prompts, request.responses, request.metadata)
            return started
        done: Future[list[float]] = Future()
        try:
            done.set_result(list(self.function(request.prompts, request.responses, request.metadata)))
        except RewardFunctionError as e:
            done.set_exception(e)
        return done

    def _function_scores(self, requests: Sequence[TextRequest]) -> list[float]:
        calls = {i: self._submit(r) for i, r in enumerate(requests) if r.scores is None}
        scores: list[float] = []
        failed: dict[int, str] = {}
        for i, r in enumerate(requests):
            try:
                scores.extend(r.scores if r.scores is not None else calls[i].result())
            except RewardFunctionError as e:
                failed[i] = str(e)
        if failed:
            self.failed_calls += len(failed)
            LOGGER.warning("function failed on %d of %d merged requests", len(failed), len(requests))
            raise RequestsFailed(failed)
        return scores
