"""The HTTP front of a served model: judge every request at the edge, forward only what it understood.

Owns :class:`HTTPGuard`, the reverse proxy on the served address (Triton on a private port behind
it): each request judged alone by the endpoint's check and forwarded canonically, refusals as 4xx
without tracebacks, other wire formats on their own paths (:class:`ForeignRoute`), per-request
admission (:data:`Admit`), resending requests Triton rejected beside a failing one, and the
bounded read of a body (:func:`read_bounded_body`, serve-tinker's front uses it too).
Must not know what an endpoint computes, nor how Triton is started. Notes: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import socket
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol
from urllib.parse import quote

import numpy as np

from openaligner.protocol import REQUEST_ID_PARAMETER, ErrorEnvelope
from openaligner.servers.transport.kserve import (
    HEADER_LENGTH,
    InferRequest,
    parse_infer_request,
    parse_infer_response,
)
from openaligner.servers.validation import RequestError, UnauthorizedError

LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20
"""Largest request body accepted by default (256 MiB; a 1,024-row critic_train request of 4,096
tokens is about 84 MB in binary form)."""

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
TOKENIZER_PATH = re.compile(r"^/v2/models/([^/]+)/tokenizer$")
""":data:`~openaligner.protocol.TOKENIZER_ROUTE`, answered by the guard itself."""

RequestCheck = Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], Any]
"""Judges one decoded request — ``(inputs, request parameters)`` — before it is forwarded; raises
:class:`RequestError` (answered 400) or :class:`UnauthorizedError` (answered 403) to refuse it.
What it returns is handed to the model's :data:`Admit`, if any."""

Admit = Callable[[Any], Future[dict[str, str]]]
"""Starts the work a checked request needs before it is forwarded (given what the check returned);
the front awaits the future without holding a thread. It resolves to request parameters forwarded
with the request, or fails with :class:`RequestError` (answered 400): e.g. a served reward
function's call, so that a call that fails or hangs costs only its own request (see
:class:`openaligner.servers.transport.triton.Admitting`)."""

RESENDS_ON_REJECTED_BATCH = 5
"""How often a foreign route's request is resent when Triton merged it with a failing one."""


class Translation(Protocol):
    """One foreign request, translated: the model's ``inputs`` (arrays with the batch dimension
    first) and how to write the format's answer."""

    @property
    def inputs(self) -> Mapping[str, np.ndarray]: ...

    def answer(self, outputs: Mapping[str, np.ndarray], checked: Any) -> Any:
        """The format's answer (a JSON value) from the model's ``outputs`` and what the model's
        check returned for ``inputs``."""

    def explain(self, message: str) -> str:
        """``message``, a refusal of ``inputs`` by the model's check or the model, in the terms of
        the client's request (the client never named the model's inputs)."""


class ForeignRoute(Protocol):
    """A wire format answered on its own paths, in front of the Triton model ``model``."""

    @property
    def paths(self) -> Sequence[str]: ...

    @property
    def model(self) -> str: ...

    @property
    def title(self) -> str:
        """The format's name in messages, e.g. ``OpenRLHF``."""

    def translate(self, body: bytes) -> Translation:
        """Read one request body.

        Raises:
            RequestError: naming the field at fault and what the format expects.
        """

    def error(self, status: int, message: str) -> Any:
        """The format's error answer (a JSON value) for an HTTP ``status``."""


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class BodyRefused(_Refused):
    """A request body refused by :func:`read_bounded_body`: ``status`` 415 (compressed) or 413
    (over the limit), ``message`` naming why and the setting."""


async def read_bounded_body(request: Any, limit: int, limit_key: str, hint: str = "") -> bytes:
    """The whole body of the aiohttp ``request``, read chunk by chunk so that no more than
    ``limit`` bytes (+ one chunk) are ever held.

    Raises:
        BodyRefused: 415 for a compressed body (never inflated: no zip bombs); 413 when it declares
            or turns out to hold more than ``limit`` bytes, naming ``limit_key`` (then ``hint``).
    """
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BodyRefused(
            415,
            f"compressed request bodies (Content-Encoding: {encoding}) are not accepted; send the body "
            f"uncompressed",
        )

    def too_large(size: int | None) -> BodyRefused:
        size_text = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        return BodyRefused(
            413, f"request body is {size_text}, over this server's limit of {limit} bytes ({limit_key}){hint}"
        )

    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(declared)
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise too_large(None)
    return bytes(body)


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "accept-encoding",
}


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def without_traceback(text: str) -> str:
    """A server error text with the Python tracebacks PyTriton wraps around it removed: the last
    exception's type (without its module) and message — the part that says what went wrong."""
    lines = text.splitlines()
    opening = "Traceback (most recent call last):"
    marks = [i for i, line in enumerate(lines) if line.rstrip().endswith(opening)]
    if not marks:
        return text
    kept: list[str] = []
    for line in lines[marks[-1] + 1 :]:
        if not kept and (line.startswith(" ") or not line.strip()):
            continue  # the frames
        if line.strip() == "At:":  # the python backend's own stack follows
            break
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    if not kept:
        return lines[marks[-1]].removesuffix(opening).strip() or text
    kept[0] = re.sub(r"^(?:[\w]+\.)+(\w+: )", r"\1", kept[0])
    return "\n".join(kept)


# ----------------------------------------------------------------------------- the proxy
class HTTPGuard:
    """A reverse proxy on ``host:port`` in front of Triton on ``127.0.0.1:upstream_port``.

    It runs an asyncio loop (aiohttp) in a daemon thread of this process, so it lives and dies
    with the server. Each inference request is read whole (up to ``max_request_bytes``), parsed by
    :func:`parse_infer_request` and judged by ``checks[model]`` (when there is one) on a small pool
    of worker threads, so a slow request never holds the others; what passes is forwarded to
    Triton in canonical form (:meth:`InferRequest.encode`). Triton's answers come back with their
    status and headers.

    Args:
        host: address to listen on.
        port: port to listen on.
        upstream_port: Triton's HTTP port on 127.0.0.1.
        max_request_bytes: largest accepted request body.
        checks: model name -> its :data:`RequestCheck`; requests for other models are only parsed.
        admissions: model name -> its :data:`Admit`, awaited after the check, before forwarding.
        workers: threads that parse and check requests.
        tokenizers: model name -> what ``GET /v2/models/<name>/tokenizer`` answers (JSON), for
            the models that have such a route.
        routes: other wire formats answered on their own paths (see :class:`ForeignRoute`).
        sock: a socket already bound to ``host:port`` (see
            :func:`~openaligner.servers.transport.triton.claim_port`), listened on instead of binding
            anew; the guard owns it from here on.
    """

    def __init__(
        self,
        host: str,
        port: int,
        upstream_port: int,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        checks: Mapping[str, RequestCheck] | None = None,
        admissions: Mapping[str, Admit] | None = None,
        workers: int = 4,
        tokenizers: Mapping[str, Mapping[str, object]] | None = None,
        routes: Sequence[ForeignRoute] = (),
        sock: socket.socket | None = None,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.host, self.port = host, port
        self.upstream = f"http://127.0.0.1:{upstream_port}"
        self.max_request_bytes = max_request_bytes
        self.checks = dict(checks or {})
        self.admissions = dict(admissions or {})
        self.tokenizers = {name: json.dumps(info).encode() for name, info in (tokenizers or {}).items()}
        self.routes = {path: route for route in routes for path in route.paths}
        self.refused = 0
        """Requests answered by the guard itself with an error."""
        self.resent = 0
        """Foreign requests resent because Triton merged them with a failing one."""
        self._ids = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="openaligner-http-check")
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._session: Any = None
        self._sock = sock

    def start(self, timeout_s: float = 10.0) -> None:
        """Listen on ``host:port``; returns once connections are accepted.

        Raises:
            OSError: the address cannot be bound.
        """
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._run, name="openaligner-http-guard", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"the HTTP front {self.host}:{self.port} did not start within {timeout_s} s")
        if self._error is not None:
            self._thread.join()
            raise self._error

    def is_alive(self) -> bool:
        """Whether the guard's loop is running."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening and close every connection; safe to call twice."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
        if self._sock is not None:  # never listened on (a start that failed), or already closed
            self._sock.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start(); the thread must not die silently
            self._error = e
            self._started.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._stop = asyncio.Event()
        # No decompression and no timeout of ours on Triton's answers (a critic_train request may
        # run for minutes; the client sets its own limit).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=self.max_request_bytes + 1)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # auto_decompress=False: a compressed body is refused unread, never inflated (a zip bomb)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, auto_decompress=False, shutdown_timeout=1.0
        )
        await runner.setup()
        try:
            site: web.BaseSite
            if self._sock is not None:
                site = web.SockSite(runner, self._sock)
            else:
                site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            await self._session.close()
            raise
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    async def _handle(self, request: Any) -> Any:
        method, path = request.method, request.path
        tokenizer = TOKENIZER_PATH.match(path)
        if method == "GET" and tokenizer is not None and tokenizer.group(1) in self.tokenizers:
            from aiohttp import web

            described = self.tokenizers[tokenizer.group(1)]
            return web.Response(status=200, body=described, content_type="application/json")
        if method in ("GET", "HEAD") and (path == "/v2" or path.startswith("/v2/")):
            return await self._forward(request, request.raw_path, None, {})
        route = self.routes.get(path)
        if route is not None:
            return await self._foreign(request, route)
        match = INFER_PATH.match(path)
        if method != "POST" or match is None:
            others = "".join(f", POST on {p} ({r.title})" for p, r in self.routes.items())
            return self._refuse(
                405,
                f"{method} {path} is not served here; this server answers GET on /v2 (health, model "
                f"metadata) and POST on /v2/models/<name>/infer{others}",
            )
        try:
            body = await self._read_body(request)
        except _Refused as e:
            return self._refuse(e.status, e.message)
        model, version = match.group(1), match.group(2)
        loop = asyncio.get_running_loop()
        try:
            parsed, admission = await loop.run_in_executor(
                self._executor, self._prepare, model, body, request.headers.get(HEADER_LENGTH)
            )
            if admission is not None:
                admitted: dict[str, str] = await asyncio.wrap_future(admission)
                parsed.parameters.update(admitted)
            payload, header_length = await loop.run_in_executor(self._executor, parsed.encode)
        except UnauthorizedError as e:
            return self._refuse(403, f"{model}: {e}")
        except RequestError as e:
            return self._refuse(400, f"{model}: {e}")
        except Exception as e:  # a failure of ours, not the client's: its traceback goes to our log only
            LOGGER.exception("the HTTP front failed on a request for %s", model)
            failure = type(e).__name__
            return self._refuse(500, f"{model}: the server failed while reading the request ({failure})")
        target = f"/v2/models/{quote(model, safe='')}"
        if version is not None:
            target += f"/versions/{quote(version, safe='')}"
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(header_length)}
        return await self._forward(request, target + "/infer", payload, headers)

    async def _read_body(self, request: Any) -> bytes:
        """The whole request body, refused (:class:`BodyRefused`) when compressed or over the limit."""
        return await read_bounded_body(
            request, self.max_request_bytes, "max_request_bytes", "; send fewer rows per request"
        )

    # -- foreign wire formats --------------------------------------------------------------------
    async def _foreign(self, request: Any, route: ForeignRoute) -> Any:
        """Answer one request of another wire format: translate, check, send to Triton as a KServe
        request (resent when rejected only for a merged failing request), translate the answer."""
        if request.method != "POST":
            return self._refuse_as(route, 405, f"{request.method} {request.path} is not served; send POST")
        try:
            body = await self._read_body(request)
        except _Refused as e:
            return self._refuse_as(route, e.status, e.message)
        rid = f"{route.title.lower()}-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        try:
            translation, checked, infer, admission = await loop.run_in_executor(
                self._executor, self._prepare_foreign, route, body, rid
            )
            if admission is not None:
                try:
                    admitted: dict[str, str] = await asyncio.wrap_future(admission)
                    infer.parameters.update(admitted)
                except RequestError as e:
                    raise RequestError(translation.explain(str(e))) from None
            payload, header_length = await loop.run_in_executor(self._executor, infer.encode)
        except UnauthorizedError as e:
            return self._refuse_as(route, 403, f"{route.model}: {e}")
        except RequestError as e:
            return self._refuse_as(route, 400, f"{route.model}: {e}")
        except Exception as e:  # a failure of ours: its traceback goes to our log only
            LOGGER.exception("the HTTP front failed on a %s request", route.title)
            failure = type(e).__name__
            return self._refuse_as(
                route, 500, f"{route.model}: the server failed while reading the request ({failure})"
            )
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(header_length)}
        target = f"{self.upstream}/v2/models/{quote(route.model, safe='')}/infer"
        for attempt in range(RESENDS_ON_REJECTED_BATCH + 1):
            try:
                status, answer = await self._post_upstream(target, payload, headers)
            except _Refused as e:
                return self._refuse_as(route, e.status, e.message)
            if status == 200:
                return self._foreign_answer(route, translation, answer, checked)
            text = _error_text(answer)
            envelope = ErrorEnvelope.find(text)
            if envelope is not None and rid in envelope.valid and attempt < RESENDS_ON_REJECTED_BATCH:
                self.resent += 1
                continue
            if envelope is not None and rid in envelope.invalid:
                why = translation.explain(envelope.invalid[rid])
                return self._refuse_as(route, 400, f"{route.model}: {why}")
            return self._refuse_as(route, 500 if status >= 500 else status, without_traceback(text))
        raise AssertionError("unreachable")  # the last attempt always returns

    def _prepare_foreign(
        self, route: ForeignRoute, body: bytes, rid: str
    ) -> tuple[Translation, Any, InferRequest, Future[dict[str, str]] | None]:
        """Translate and judge one foreign request, and start its admission if the model has one
        (on a worker thread)."""
        translation = route.translate(body)
        check = self.checks.get(route.model)
        try:
            checked = check(translation.inputs, {}) if check is not None else None
        except RequestError as e:
            raise RequestError(translation.explain(str(e))) from None
        infer = InferRequest.from_arrays(translation.inputs, {REQUEST_ID_PARAMETER: rid})
        admit = self.admissions.get(route.model)
        return translation, checked, infer, admit(checked) if admit is not None else None

    async def _post_upstream(self, target: str, payload: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        import aiohttp

        try:
            async with self._session.post(
                target, data=payload, headers={**headers, "Accept-Encoding": "identity"}
            ) as upstream:
                return upstream.status, await upstream.read()
        except aiohttp.ClientError as e:
            raise _Refused(
                503,
                f"tritonserver behind this address does not answer ({type(e).__name__}): it may have "
                f"stopped; check the server log",
            ) from None

    def _foreign_answer(
        self, route: ForeignRoute, translation: Translation, answer: bytes, checked: Any
    ) -> Any:
        from aiohttp import web

        try:
            outputs = parse_infer_response(answer)
            body = json.dumps(translation.answer(outputs, checked), allow_nan=False).encode()
        except ValueError as e:  # e.g. a reward model that produced NaN: the server's failure
            LOGGER.error("could not answer a %s request: %s", route.title, e)
            return self._refuse_as(route, 500, f"{route.model}: the server could not write its answer: {e}")
        return web.Response(status=200, body=body, content_type="application/json")

    def _refuse_as(self, route: ForeignRoute, status: int, message: str) -> Any:
        from aiohttp import web

        self.refused += 1
        LOGGER.warning("%s", message)
        body = json.dumps(route.error(status, message)).encode()
        return web.Response(status=status, body=body, content_type="application/json")

    def _prepare(
        self, model: str, body: bytes, header_length: str | None
    ) -> tuple[InferRequest, Future[dict[str, str]] | None]:
        """Parse and judge one request, and start its admission if the model has one (on a worker
        thread)."""
        parsed = parse_infer_request(body, header_length)
        check = self.checks.get(model)
        checked = check(parsed.arrays(), parsed.parameters) if check is not None else None
        admit = self.admissions.get(model)
        return parsed, admit(checked) if admit is not None else None

    def _refuse(self, status: int, message: str) -> Any:
        from aiohttp import web

        self.refused += 1
        LOGGER.warning("%s", message)
        return web.Response(status=status, body=_error_body(message), content_type="application/json")

    async def _forward(self, request: Any, target: str, body: bytes | None, headers: dict[str, str]) -> Any:
        import aiohttp
        from aiohttp import web

        if body is None:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        # Triton compresses its answer when asked; ask only for what the client asked for (aiohttp
        # would otherwise ask for gzip on every client's behalf).
        headers["Accept-Encoding"] = request.headers.get("Accept-Encoding", "identity")
        try:
            async with self._session.request(
                request.method, self.upstream + target, data=body, headers=headers, allow_redirects=False
            ) as upstream:
                payload = await upstream.read()
                out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
                if upstream.status >= 500:
                    payload, out = _clean_failure(payload, out)
                return web.Response(status=upstream.status, body=payload, headers=out)
        except aiohttp.ClientError as e:
            return self._refuse(
                503,
                f"tritonserver behind this address does not answer ({type(e).__name__}): it may have "
                f"stopped; check the server log",
            )


def _error_text(payload: bytes) -> str:
    """The ``error`` text of a Triton error answer (the payload itself when it is not JSON)."""
    try:
        text = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return payload.decode("utf-8", "replace")
    return text if isinstance(text, str) else json.dumps(text)


def _clean_failure(payload: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """A server failure's ``{"error": ...}`` without PyTriton's tracebacks (server file paths)."""
    encoding = next((v.strip().lower() for k, v in headers.items() if k.lower() == "content-encoding"), "")
    try:
        if encoding in ("gzip", "deflate"):
            payload = zlib.decompress(payload, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        elif encoding not in ("", "identity"):
            return payload, headers
        text = json.loads(payload)["error"]
    except (zlib.error, ValueError, KeyError, TypeError):
        return payload, headers
    if not isinstance(text, str):
        return payload, headers
    kept = {k: v for k, v in headers.items() if k.lower() not in ("content-encoding", "content-type")}
    kept["Content-Type"] = "application/json"
    return _error_body(without_traceback(text)), kept
