"""What every client of a Triton-served model needs: readiness, timeouts, futures, errors, retries.

Owns one server connection's life: readiness up to ``init_timeout_s``, a pool of worker threads
that turn requests into futures, the error translation into :mod:`openaligner.clients.errors`,
resending requests Triton rejected beside an invalid one, riding out a restart
(``reconnect_grace_s``; a non-idempotent request only when it cannot have run), and a ``close()``
that never hangs. Must not know what any endpoint computes.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from openaligner.clients.errors import (
    AuthenticationError,
    BadRequestError,
    ClientClosedError,
    ClientError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from openaligner.protocol import REQUEST_ID_PARAMETER, ErrorEnvelope, reads_text, tokenizer_route

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

_TRITON_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32"}


@dataclass(frozen=True)
class _Job:
    future: Future[Any]
    model: str
    inputs: Mapping[str, np.ndarray]
    parameters: Mapping[str, Any] | None
    postprocess: Callable[[dict[str, np.ndarray]], Any]
    idempotent: bool


class _ConnectionLost(Exception):
    """Internal: the connection was refused (``sent=False``) or dropped (``sent=True``: the request
    may have reached the server). ``error`` is what the caller gets if nothing is resent."""

    def __init__(self, error: ServerUnavailableError, cause: str, *, sent: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.cause = cause
        self.sent = sent


class _Connection:
    """One worker's ``tritonclient.http`` connection, created on first use and dropped after a failure."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._client: Any = None

    def get(self) -> Any:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


_SENTINEL = None

_GONE_WITHIN_S = 2.0
"""After a dropped connection, how long a server may take to stop listening and still count as gone."""


class TritonHTTPClient:
    """Futures-based access to the models of one Triton server over HTTP.

    Args:
        host: server address (``ip`` in configs).
        port: server HTTP port.
        server_name: what the server is, for messages ("reward model server").
        init_timeout_s: how long to wait for the server and model to become ready.
        request_timeout_s: how long one request may take (connect + answer).
        max_workers: requests in flight at once.
        retries_on_rejected_batch: resends of a valid request that Triton merged with an invalid one.
        hint: what to check when the server cannot be reached (names the CLI / config keys).
        config_prefix: where ``init_timeout_s`` and ``reconnect_grace_s`` sit in the user's config
            (``"remote."`` in train-ppo), so that messages name the keys as the user writes them.
        reconnect_grace_s: after a refused or dropped connection, how long to wait for the server
            to answer again before failing (0: fail at once). See docs/serving.md, "Module notes", for which
            requests are resent.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        server_name: str,
        init_timeout_s: float,
        request_timeout_s: float,
        max_workers: int = 4,
        retries_on_rejected_batch: int = 3,
        hint: str = "",
        reconnect_grace_s: float = 0.0,
        config_prefix: str = "",
    ) -> None:
        if init_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("init_timeout_s and request_timeout_s must be > 0")
        if reconnect_grace_s < 0:
            raise ValueError("reconnect_grace_s must be >= 0 (0: fail at once when the server goes away)")
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self.host, self.port = host, port
        self.server_name = server_name
        self.init_timeout_s = init_timeout_s
        self.request_timeout_s = request_timeout_s
        self.retries_on_rejected_batch = retries_on_rejected_batch
        self.hint = hint
        self.config_prefix = config_prefix
        self.reconnect_grace_s = reconnect_grace_s
        self._outage: tuple[float, float] | None = None  # (start, deadline) of the current outage
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"openaligner-client-{i}", daemon=True)
            for i in range(max_workers)
        ]
        for w in self._workers:
            w.start()

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def where(self, model: str) -> str:
        """``reward model server http://127.0.0.1:5555 (model 'reward_model')`` — for messages."""
        return f"{self.server_name} {self.url} (model '{model}')"

    def tokenizer(self, model: str) -> dict[str, Any] | None:
        """What the server says of the tokenizer ``model`` lays text out with (GET
        :data:`~openaligner.protocol.TOKENIZER_ROUTE`): ``name``, ``fingerprint`` and
        ``vocab_fingerprint``, plus ``"reads": "text"`` for a server that scores text with a reward
        function (then perhaps alone); None when it has no tokenizer, or is too old to say.

        Raises:
            ServerUnavailableError: the server cannot be reached.
        """
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.request_timeout_s)
        try:
            connection.request("GET", tokenizer_route(model))
            answer = connection.getresponse()
            body = answer.read()
        except (ConnectionError, OSError, http.client.HTTPException) as e:
            raise ServerUnavailableError(
                f"{self.where(model)}: asking for its tokenizer failed ({type(e).__name__}: {e}). "
                f"{self.hint}",
                url=self.url,
                model=model,
            ) from None
        finally:
            connection.close()
        if answer.status != 200:
            return None  # a server from before the tokenizer route
        try:
            doc = json.loads(body)
            info = doc.get("tokenizer")
        except (ValueError, AttributeError):
            return None
        info = info if isinstance(info, dict) else None
        if reads_text(doc):  # a reward function's server: it reads text only (its model's tokenizer, if any)
            return {**(info or {}), "reads": "text"}
        return info

    # -- readiness ---------------------------------------------------------------------------

    def wait_until_ready(self, models: Sequence[str]) -> None:
        """Block until the server answers and every model in ``models`` is ready.

        Raises:
            ServerTimeoutError: not ready within ``init_timeout_s``; says what was last seen.
        """
        todo = [m for m in models if m not in self._ready]
        if not todo:
            return
        reason = self._poll_ready(todo, time.monotonic() + self.init_timeout_s)
        if reason is None:
            return
        raise ServerTimeoutError(
            f"{self.where(todo[0])} was not ready within {self.config_prefix}init_timeout_s="
            f"{self.init_timeout_s:g} s: {reason}. "
            f"{self.hint}",
            url=self.url,
            model=todo[0],
        )

    def _poll_ready(self, models: Sequence[str], deadline: float) -> str | None:
        """None once every model is ready; else, at ``deadline``, what was last seen.

        Raises:
            ClientClosedError: the client was closed meanwhile.
        """
        import tritonclient.http as triton_http

        reason = "no attempt finished"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return reason
            if self._closed:  # nobody waits for the answer any more
                raise ClientClosedError(
                    f"{self.where(models[0])}: client closed while waiting for the server",
                    url=self.url,
                    model=models[0],
                )
            step = max(0.05, min(1.0, remaining))
            try:
                client = triton_http.InferenceServerClient(
                    f"{self.host}:{self.port}", connection_timeout=step, network_timeout=step
                )
            except Exception as e:  # a malformed host is a configuration error, not a wait
                raise ServerUnavailableError(
                    f"{self.where(models[0])}: cannot create a connection ({e}). {self.hint}",
                    url=self.url,
                    model=models[0],
                ) from e
            try:
                if not client.is_server_ready():
                    reason = "the server answers but is not ready yet (still loading)"
                else:
                    missing = [m for m in models if not client.is_model_ready(m)]
                    if not missing:
                        self._ready.update(models)
                        return None
                    reason = (
                        f"the server answers but model {missing[0]!r} is not ready or not served "
                        f"(check that the client's model name matches the server's)"
                    )
            except ConnectionRefusedError:
                reason = "connection refused: nothing is listening on that host and port"
            except TimeoutError:
                reason = "connecting timed out: the host does not answer (wrong address, or a firewall?)"
            except OSError as e:
                reason = f"network error: {e}"
            except Exception as e:
                reason = f"unexpected answer: {e}"
            finally:
                client.close()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        postprocess: Callable[[dict[str, np.ndarray]], T],
        parameters: Mapping[str, str] | None = None,
        *,
        idempotent: bool = True,
    ) -> Future[T]:
        """Send ``inputs`` to ``model`` from a worker thread; the future holds ``postprocess(outputs)``.

        ``parameters`` are extra Triton request parameters (e.g. a token), sent with the request id.
        ``idempotent=False`` marks a request that must not run twice (docs/serving.md, "Module notes").
        The future fails with a :class:`ClientError` subclass; it is never left pending: results,
        errors, or cancellation by :meth:`close`.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise ClientClosedError(
                    f"{self.where(model)}: the client is closed", url=self.url, model=model
                )
            self._pending.add(future)
        future.add_done_callback(self._forget)
        sent = {**(parameters or {}), REQUEST_ID_PARAMETER: uuid.uuid4().hex[:16]}
        self._jobs.put(_Job(future, model, inputs, sent, postprocess, idempotent))
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _work(self) -> None:
        connection = _Connection(self._connect)
        try:
            while True:
                job = self._jobs.get()
                if job is _SENTINEL:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = job.postprocess(self._send(connection, job))
                except BaseException as e:
                    _settle(job.future, exception=e)
                    if isinstance(e, ServerTimeoutError):
                        connection.close()  # a connection that timed out must not be reused
                else:
                    _settle(job.future, result=result)
        finally:
            connection.close()

    def _send(self, connection: _Connection, job: _Job) -> dict[str, np.ndarray]:
        """The job's outputs; waits out a server restart within ``reconnect_grace_s``."""
        while True:
            try:
                outputs = self._infer_with_retries(connection, job)
            except _ConnectionLost as lost:
                connection.close()  # a broken keep-alive connection must not be reused
                self._await_return(job, lost)
                continue
            self._end_outage()
            return outputs

    def _await_return(self, job: _Job, lost: _ConnectionLost) -> None:
        """Return once ``job`` may be resent to a server that answers again; else raise why not."""
        grace = self.reconnect_grace_s
        if grace <= 0:
            raise lost.error
        if lost.sent and not job.idempotent and not self._went_away(min(grace, _GONE_WITHIN_S)):
            raise ServerUnavailableError(
                f"{self.where(job.model)} dropped the connection while the request was in flight "
                f"({lost.cause}), but the server is still up: it may have run the request already, and "
                f"this request must not run twice, so it is not resent. Check the server's log; "
                f"restarting both sides from their checkpoints gives an exact continuation.",
                url=self.url,
                model=job.model,
            )
        now = time.monotonic()
        with self._lock:
            first = self._outage is None
            if self._outage is None:
                self._outage = (now, now + grace)
            started, deadline = self._outage
        if first:
            LOGGER.warning(
                "%s: %s; waiting up to reconnect_grace_s=%g s for the server to answer again",
                self.where(job.model),
                lost.cause,
                grace,
            )
        reason = self._poll_ready([job.model], deadline)
        if reason is not None:
            raise ServerTimeoutError(
                f"{self.where(job.model)} went away ({lost.cause}) and did not answer again within "
                f"{self.config_prefix}reconnect_grace_s={grace:g} s (last seen: {reason}). Restart the "
                f"server, or raise {self.config_prefix}reconnect_grace_s to wait longer for a restart. "
                f"{self.hint}",
                url=self.url,
                model=job.model,
            )
        LOGGER.info(
            "%s answers again after %.1f s; resending the request",
            self.where(job.model),
            time.monotonic() - started,
        )

    def _end_outage(self) -> None:
        with self._lock:
            self._outage = None

    def _went_away(self, within_s: float) -> bool:
        """Whether a TCP connection to the server is refused at some moment in the next ``within_s``.

        A refused connection means no process listens on the port: the server that had the
        request is gone. A dying server may still accept connections for a moment after its
        connections dropped, hence the window rather than one try.
        """
        deadline = time.monotonic() + within_s
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=min(1.0, within_s)):
                    pass
            except ConnectionRefusedError:
                return True
            except OSError:  # no answer or another failure: the server may still be there
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _connect(self) -> Any:
        import tritonclient.http as triton_http

        return triton_http.InferenceServerClient(
            f"{self.host}:{self.port}",
            connection_timeout=self.request_timeout_s,
            network_timeout=self.request_timeout_s,
        )

    def _infer_with_retries(self, connection: _Connection, job: _Job) -> dict[str, np.ndarray]:
        self.wait_until_ready([job.model])  # each worker waits on its own: all fail by the same deadline
        rid = str((job.parameters or {}).get(REQUEST_ID_PARAMETER, ""))
        for attempt in range(self.retries_on_rejected_batch + 1):
            try:
                return self._infer_once(connection.get(), job)
            except _Rejected as r:
                if rid in r.envelope.valid and attempt < self.retries_on_rejected_batch:
                    LOGGER.info("%s: resending %s (merged with an invalid one)", self.where(job.model), rid)
                    continue
                reason = r.envelope.invalid.get(rid, r.envelope.message)
                if r.envelope.kind == "unauthorized":
                    raise AuthenticationError(
                        f"{self.where(job.model)} refused the request: {reason}",
                        url=self.url,
                        model=job.model,
                    ) from None
                raise BadRequestError(
                    f"{self.where(job.model)} refused the request: {reason}", url=self.url, model=job.model
                ) from None
        raise AssertionError("unreachable")

    def _infer_once(self, connection: Any, job: _Job) -> dict[str, np.ndarray]:
        import tritonclient.http as triton_http
        from tritonclient.utils import InferenceServerException

        wire = []
        for name, array in job.inputs.items():
            arr = np.ascontiguousarray(array)
            dtype = "BYTES" if arr.dtype.kind in "SO" else _TRITON_DTYPES.get(arr.dtype)
            if dtype is None:
                raise BadRequestError(
                    f"{self.where(job.model)}: input {name!r} has unsupported dtype {arr.dtype}",
                    url=self.url,
                    model=job.model,
                )
            tensor = triton_http.InferInput(name, list(arr.shape), dtype)
            tensor.set_data_from_numpy(arr, binary_data=True)
            wire.append(tensor)
        try:
            result = connection.infer(job.model, wire, parameters=dict(job.parameters or {}))
        except InferenceServerException as e:
            raise self._translate(e, job.model) from None
        except ConnectionRefusedError:
            raise self._lost(
                job.model, "connection refused: the server is not running (any more)", sent=False
            ) from None
        except TimeoutError:
            raise ServerTimeoutError(
                f"{self.where(job.model)} did not answer within "
                f"request_timeout_s={self.request_timeout_s:g} s: it may be overloaded, stuck or gone — "
                f"check its log, or raise request_timeout_s",
                url=self.url,
                model=job.model,
            ) from None
        except (ConnectionError, OSError, http.client.HTTPException) as e:
            # HTTPException: the server closed the connection before answering (it stopped or crashed)
            raise self._lost(
                job.model, f"the connection dropped ({type(e).__name__}: {e})", sent=True
            ) from None
        outputs = result.get_response().get("outputs", [])
        return {o["name"]: result.as_numpy(o["name"]) for o in outputs}

    def _lost(self, model: str, cause: str, *, sent: bool) -> _ConnectionLost:
        wait = (
            ""
            if self.reconnect_grace_s > 0
            else " (reconnect_grace_s=0: the client does not wait for a restarted server)"
        )
        error = ServerUnavailableError(
            f"{self.where(model)}: {cause}. Did the server stop or crash? Check its log{wait}. {self.hint}",
            url=self.url,
            model=model,
        )
        return _ConnectionLost(error, cause, sent=sent)

    def _translate(self, error: Any, model: str) -> Exception:
        text = str(error.message() or "")
        envelope = ErrorEnvelope.find(text)
        if envelope is not None:
            return _Rejected(envelope)
        status = str(error.status() or "")
        short = _shorten(text).removeprefix(f"{model}: ")  # the server's front names the model too
        if status == "403":  # the server's front refused the request's token
            return AuthenticationError(
                f"{self.where(model)} refused the request: {short}", url=self.url, model=model
            )
        if status.startswith("4"):
            if "unknown model" in text.lower():
                return ServerUnavailableError(
                    f"{self.where(model)}: the server does not serve this model ({short}); "
                    f"check the model name",
                    url=self.url,
                    model=model,
                )
            return BadRequestError(
                f"{self.where(model)} refused the request: {short}", url=self.url, model=model
            )
        return ServerError(
            f"{self.where(model)} failed on a valid request: {short}. Check the server log.",
            url=self.url,
            model=model,
        )

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers; cancel queued requests; fail requests still running after ``timeout_s``.

        Returns within about ``timeout_s`` whatever the server does; afterwards every future this
        client returned is done. Safe to call twice.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        cancelled = 0
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.cancel():
                cancelled += 1
        for _ in self._workers:
            self._jobs.put(_SENTINEL)
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            stuck = list(self._pending)
        for f in stuck:
            _settle(
                f,
                exception=ClientClosedError(
                    f"{self.server_name} {self.url}: client closed while the request was in flight",
                    url=self.url,
                    model="",
                ),
            )
        if cancelled or stuck:
            LOGGER.warning(
                "%s client closed: %d queued request(s) cancelled, %d in flight abandoned",
                self.server_name,
                cancelled,
                len(stuck),
            )

    def __enter__(self) -> TritonHTTPClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Rejected(Exception):
    """Internal: the server's error carried an envelope (bad request or rejected batch)."""

    def __init__(self, envelope: ErrorEnvelope) -> None:
        super().__init__(envelope.message)
        self.envelope = envelope


def _settle(future: Future[Any], *, result: Any = None, exception: BaseException | None = None) -> None:
    """Finish ``future`` unless it already is (close() may have failed it first)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _shorten(text: str, limit: int = 400) -> str:
    """Triton's error text without the traceback noise, at most ``limit`` characters."""
    lines = [ln.strip() for ln in text.replace("\\n", "\n").splitlines() if ln.strip()]
    fallback = lines[-1] if lines else text
    tail = next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), fallback)
    return tail if len(tail) <= limit else tail[: limit - 1] + "…"


__all__ = ["ClientError", "TritonHTTPClient"]
