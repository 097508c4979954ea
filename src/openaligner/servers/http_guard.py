"""The HTTP front of a served model: refuse at the edge what Triton cannot take, pass on the rest.

tritonserver 2.51 (the build PyTriton 0.7 ships) trusts what a request declares. For an input sent
as JSON ``data`` it allocates ``prod(shape) x item size`` bytes before reading a value, so a
150-byte request declaring shape ``[1, 10**12]`` aborts the whole server (``std::bad_alloc``) and
``[1, 10**9]`` makes it fill 8 GB. It has no limit on the body size. A tensor with a zero
dimension passes Triton and fails inside PyTriton's python-backend stub with a message that names
no input, and its own parse errors name no input either.

This module owns the checks that stop such requests before Triton sees them
(:func:`check_infer_request`: body framing, JSON structure, empty tensors, declared shapes against
the values actually sent) and the small reverse proxy that applies them with a body size limit
(:class:`HTTPGuard`): it listens on the served address, Triton on a private loopback port behind
it. It answers refusals as Triton does (a JSON ``{"error": ...}`` with a 4xx status), forwards
``GET``/``HEAD`` under ``/v2`` and ``POST .../infer`` unchanged, and refuses every other route
(Triton's model-control and shared-memory routes stay private) and compressed bodies (never
inflated). Must not know what an endpoint computes, nor how Triton is started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from openaligner.servers.validation import RequestError

LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20
"""Largest request body accepted by default (256 MiB; a 1,024-row critic_train request of 4,096
tokens is about 84 MB in binary form)."""

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The KServe v2 binary extension header: the byte length of the JSON part of the body."""

EXAMPLE = '{"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]}]}'

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/infer$")

_ITEM_BYTES = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
}
_DATATYPES = (*_ITEM_BYTES, "BYTES")
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
}


@dataclass(frozen=True)
class _Declared:
    """One input as the request declares it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any  # the JSON ``data`` value, or None when the values travel in binary
    binary_size: int | None


class _Overflow(float):
    """A JSON number too large for a 64-bit float (Triton refuses it; Python would read inf)."""

    text: str

    def __new__(cls, text: str) -> _Overflow:
        value = super().__new__(cls, math.inf)
        value.text = text
        return value


def _parse_float(text: str) -> float:
    value = float(text)
    return _Overflow(text) if math.isinf(value) else value


def check_infer_request(body: bytes, header_length: str | None) -> None:
    """Check one ``POST /v2/models/<name>/infer`` body before it reaches Triton.

    ``header_length`` is the request's ``Inference-Header-Content-Length`` (None when absent).
    What Triton checks well itself — input names, datatypes and ranks against the model, batch
    sizes — is left to it; this catches what it crashes on or answers without naming the input.

    Raises:
        RequestError: one sentence naming the part of the request that is wrong (the body, a
            header, ``inputs``, an input by name) and what was expected.
    """
    header, binary_bytes = _split_body(body, header_length)
    doc = _parse_json(header)
    declared = _declared_inputs(doc)
    _check_parameters(doc.get("parameters"), "'parameters'")
    _check_outputs(doc.get("outputs"))
    if "id" in doc and not isinstance(doc["id"], str):
        raise RequestError(f"'id' must be a string, got {_kind(doc['id'])}")
    binary_total = 0
    for d in declared:
        _check_values(d, header_length is not None)
        binary_total += d.binary_size or 0
    if header_length is not None and binary_total != binary_bytes:
        raise RequestError(
            f"the body carries {binary_bytes} byte(s) after its {len(header)}-byte JSON header, but the "
            f"inputs' parameters.binary_data_size add up to {binary_total}; they must be equal"
        )


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, int]:
    """The JSON part of ``body`` and the number of binary bytes after it."""
    if header_length is None:
        return body, 0
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 1 <= n <= len(body):
        raise RequestError(
            f"header '{HEADER_LENGTH}' is {header_length!r}; it must be the byte length of the JSON part "
            f"of the body, an integer from 1 to {len(body)} (the body's length)"
        )
    return body[:n], len(body) - n


def _parse_json(header: bytes) -> dict[str, Any]:
    if not header.strip():
        raise RequestError(f"request body is empty; send a KServe v2 inference request, e.g. {EXAMPLE}")
    try:
        doc = json.loads(header.decode("utf-8"), parse_float=_parse_float)
    except UnicodeDecodeError as e:
        raise RequestError(
            f"request body is not UTF-8 JSON (byte {header[e.start]:#04x} at offset {e.start}); send a "
            f"KServe v2 inference request, e.g. {EXAMPLE}"
        ) from None
    except json.JSONDecodeError as e:
        raise RequestError(
            f"request body is not valid JSON ({e.msg} at offset {e.pos}); send a KServe v2 inference "
            f"request, e.g. {EXAMPLE}"
        ) from None
    except RecursionError:
        raise RequestError("request body nests JSON too deeply; send a KServe v2 inference request") from None
    if not isinstance(doc, dict):
        raise RequestError(
            f"request body must be a JSON object with 'inputs', got {_kind(doc)}; e.g. {EXAMPLE}"
        )
    return doc


def _declared_inputs(doc: Mapping[str, Any]) -> list[_Declared]:
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        got = "none" if inputs is None else _kind(inputs)
        raise RequestError(
            f"'inputs' must be a non-empty list of input objects, got {got}; see GET /v2/models/<name> "
            f"for the model's inputs, e.g. {EXAMPLE}"
        )
    declared = []
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise RequestError(
                f"inputs[{i}] must be an object with 'name', 'datatype' and 'shape', got {_kind(item)}"
            )
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"inputs[{i}] has no 'name' (a non-empty string), got {_kind(name)}")
        datatype = item.get("datatype")
        if datatype not in _DATATYPES:
            raise RequestError(
                f"input '{name}': 'datatype' must be one of {', '.join(_DATATYPES)}, got {datatype!r}"
            )
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise RequestError(
                f"input '{name}': 'shape' must be a list of non-negative integers, got {_short(shape)}"
            )
        if 0 in shape:
            raise RequestError(
                f"input '{name}' has shape {shape}: empty tensors are not accepted; every dimension must "
                f"be at least 1"
            )
        params = item.get("parameters")
        _check_parameters(params, f"input '{name}': 'parameters'")
        binary = (params or {}).get("binary_data_size")
        if binary is not None and not (_is_int(binary) and binary >= 0):
            raise RequestError(
                f"input '{name}': parameters.binary_data_size must be a non-negative integer, got "
                f"{_short(binary)}"
            )
        declared.append(_Declared(name, datatype, tuple(shape), item.get("data"), binary))
    names = [d.name for d in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RequestError(f"input(s) {twice} appear more than once; send each input once")
    return declared


def _check_parameters(params: Any, where: str) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestError(f"{where} must be a JSON object, got {_kind(params)}")
    for key, value in params.items():
        if not isinstance(value, str | int):
            raise RequestError(
                f"{where}: '{key}' is {_kind(value)}; a parameter must be a string, an integer or a boolean"
            )


def _check_outputs(outputs: Any) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise RequestError(f"'outputs' must be a list of objects with a 'name', got {_short(outputs)}")
    for o in outputs:
        _check_parameters(o.get("parameters"), f"output '{o['name']}': 'parameters'")


def _check_values(d: _Declared, has_binary_part: bool) -> None:
    """The values sent match the declared shape (before Triton allocates by that shape)."""
    count = math.prod(d.shape)
    if d.data is not None and d.binary_size is not None:
        raise RequestError(
            f"input '{d.name}' has both 'data' and parameters.binary_data_size; send its values one way"
        )
    if d.binary_size is not None:
        if not has_binary_part:
            raise RequestError(
                f"input '{d.name}' declares binary_data_size but the request has no '{HEADER_LENGTH}' "
                f"header saying where the JSON part ends"
            )
        item = _ITEM_BYTES.get(d.datatype)
        if item is not None and d.binary_size != count * item:
            raise RequestError(
                f"input '{d.name}': binary_data_size is {d.binary_size} bytes but shape {list(d.shape)} of "
                f"{d.datatype} needs {count * item}"
            )
        return
    if d.data is None:
        raise RequestError(
            f"input '{d.name}' carries no values; give 'data' (JSON) or parameters.binary_data_size "
            f"(binary, with the '{HEADER_LENGTH}' header)"
        )
    held = 0
    for held, value in enumerate(_flatten(d.data), start=1):
        if held > count:
            break
        problem = _value_problem(value, d.datatype)
        if problem is not None:
            raise RequestError(
                f"input '{d.name}': 'data' holds {_short(value)} at index {held - 1}; datatype "
                f"{d.datatype} takes {problem}"
            )
    if held != count:
        raise RequestError(
            f"input '{d.name}': shape {list(d.shape)} needs {count} value(s) but 'data' holds "
            f"{'more' if held > count else held}; send a shape that matches the data"
        )


def _flatten(data: Any) -> Iterator[Any]:
    """The scalars of a (possibly nested) JSON list, row-major; a scalar is one value."""
    if not isinstance(data, list):
        yield data
        return
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            yield item
        else:
            stack.pop()


def _value_problem(value: Any, datatype: str) -> str | None:
    """What ``datatype`` takes, if ``value`` is not that; None when it is."""
    if datatype == "BYTES":
        return None if isinstance(value, str) else "strings"
    if datatype == "BOOL":
        return None if isinstance(value, bool) else "true or false"
    if datatype.startswith(("INT", "UINT")):
        unsigned = datatype.startswith("U")
        bits = int(datatype.removeprefix("U").removeprefix("INT"))
        low, high = (0, 2**bits) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1))
        if _is_int(value) and low <= value < high:
            return None
        return f"{'unsigned' if unsigned else 'signed'} {bits}-bit integers"
    if isinstance(value, _Overflow):
        return "numbers that fit a 64-bit float"
    return None if isinstance(value, int | float) and not isinstance(value, bool) else "numbers"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _short(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, cut to ``limit`` characters (for messages)."""
    if isinstance(value, _Overflow):
        return value.text
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):
        return _kind(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class HTTPGuard:
    """A reverse proxy on ``host:port`` in front of Triton on ``127.0.0.1:upstream_port``.

    It runs an asyncio loop (aiohttp) in a daemon thread of this process, so it lives and dies
    with the server. Each inference request is read whole (up to ``max_request_bytes``) and
    checked by :func:`check_infer_request` before it is forwarded; Triton's answer comes back
    unchanged.

    Args:
        host: address to listen on.
        port: port to listen on.
        upstream_port: Triton's HTTP port on 127.0.0.1.
        max_request_bytes: largest accepted request body.
    """

    def __init__(
        self,
        host: str,
        port: int,
        upstream_port: int,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.host, self.port = host, port
        self.upstream = f"http://127.0.0.1:{upstream_port}"
        self.max_request_bytes = max_request_bytes
        self.refused = 0
        """Requests answered by the guard itself with an error."""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._session: Any = None

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
        # Triton's own answers pass through byte for byte: no decompression, no timeout of ours
        # (a critic_train request may run for minutes; the client sets its own limit).
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
        if method in ("GET", "HEAD") and (path == "/v2" or path.startswith("/v2/")):
            return await self._forward(request, None)
        match = INFER_PATH.match(path)
        if method != "POST" or match is None:
            return self._refuse(
                405,
                f"{method} {path} is not served here; this server answers GET on /v2 (health, model "
                f"metadata) and POST on /v2/models/<name>/infer",
            )
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return self._refuse(
                415,
                f"compressed request bodies (Content-Encoding: {encoding}) are not accepted; send the body "
                f"uncompressed",
            )
        declared = request.content_length
        if declared is not None and declared > self.max_request_bytes:
            return self._too_large(declared)
        body = bytearray()
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > self.max_request_bytes:
                return self._too_large(None)
        model = match.group(1)
        try:
            check_infer_request(bytes(body), request.headers.get(HEADER_LENGTH))
        except RequestError as e:
            return self._refuse(400, f"{model}: {e}")
        return await self._forward(request, bytes(body))

    def _too_large(self, size: int | None) -> Any:
        size_text = f"{size} bytes" if size is not None else f"more than {self.max_request_bytes} bytes"
        return self._refuse(
            413,
            f"request body is {size_text}, over this server's limit of {self.max_request_bytes} bytes "
            f"(max_request_bytes); send fewer rows per request",
        )

    def _refuse(self, status: int, message: str) -> Any:
        from aiohttp import web

        self.refused += 1
        LOGGER.warning("%s", message)
        return web.Response(status=status, body=_error_body(message), content_type="application/json")

    async def _forward(self, request: Any, body: bytes | None) -> Any:
        import aiohttp
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            async with self._session.request(
                request.method,
                self.upstream + request.raw_path,
                data=body,
                headers=headers,
                allow_redirects=False,
            ) as upstream:
                payload = await upstream.read()
                out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
                return web.Response(status=upstream.status, body=payload, headers=out)
        except aiohttp.ClientError as e:
            return self._refuse(
                503,
                f"tritonserver behind this address does not answer ({type(e).__name__}): it may have "
                f"stopped; check the server log",
            )
