"""The HTTP front of ``openaligner serve-tinker``: the routes of the Tinker API (``/api/v1/...``) as
the ``tinker`` SDK calls them, on aiohttp in a thread of the server process.

Owns the routes, the API key check (``X-API-Key``, compared in constant time), the request-size
bound and the refusal of compressed bodies, the long poll of ``retrieve_future`` (held at most
``poll_hold_s``, then ``try_again``), and how failures reach the client: a refused request
answers 4xx ``{"error": ...}`` at once; a job that fails answers ``retrieve_future`` with 200
``{"error", "category"}`` (the SDK's ``RequestFailedError``). Must not know what a call computes
(:mod:`~openaligner.servers.tinker.service`) nor the protobuf layout
(:mod:`~openaligner.servers.tinker.wire`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openaligner.servers.tinker import wire
from openaligner.servers.tinker.futures import UserError
from openaligner.servers.tinker.service import TinkerService
from openaligner.servers.transport.http_guard import BodyRefused, read_bounded_body
from openaligner.trainer.tinker_model import TinkerDatum, TinkerInputError

LOGGER = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,  # the API key is checked as sent; no JWT exchange
    # one forward_backward request at a time per model, so that its chunks arrive in seq_id order
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,  # compressed bodies are refused (no zip bombs)
    "use_pyqwest_transport": False,  # plain httpx: its timeouts are the ones the long poll is sized for
}
"""What ``/api/v1/client/config`` answers."""

Handler = Callable[[Any], Awaitable[Any]]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TinkerHTTP:
    """The routes on ``host:port`` in front of ``service``.

    Args:
        service: what the calls do.
        host, port: where to listen (port 0: a free one, see :attr:`port` after :meth:`start`).
        api_key: the key clients must send as ``X-API-Key`` (``tml-<key>`` is accepted too, the
            SDK's prefix); None: none asked for (loopback only; the command refuses otherwise).
        max_request_bytes: largest request body (HTTP 413 above).
        poll_hold_s: how long ``retrieve_future`` holds a poll before answering ``try_again``
            (under the SDK's 45 s client timeout).
    """

    def __init__(
        self,
        service: TinkerService,
        host: str,
        port: int,
        *,
        api_key: str | None,
        max_request_bytes: int,
        poll_hold_s: float = 30.0,
        sock: socket.socket | None = None,
    ) -> None:
        self.service = service
        self.host, self.port = host, port
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.poll_hold_s = poll_hold_s
        self._sock = sock
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="openaligner-tinker-http")
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 10.0) -> None:
        """Listen; returns once connections are accepted (raises OSError when it cannot bind)."""
        self._thread = threading.Thread(target=self._run, name="openaligner-tinker-front", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(
                f"the Tinker front on {self.host}:{self.port} did not start within {timeout_s} s"
            )
        if self._error is not None:
            raise self._error

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> None:
        """Block until the front stops."""
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start()
            self._error = e
            self._started.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        from aiohttp import web

        self._stop = asyncio.Event()
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await runner.setup()
        site: web.BaseSite
        if self._sock is not None:
            site = web.SockSite(runner, self._sock)
        else:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    # ------------------------------------------------------------------ dispatch
    def _routes(self) -> dict[tuple[str, str], Handler]:
        s = self.service
        return {
            ("POST", "client/config"): self._const(CLIENT_CONFIG),
            ("POST", "client/dynamic_config"): self._const({}),
            ("POST", "create_session"): self._json(s.create_session),
            ("POST", "session_heartbeat"): self._json(s.heartbeat),
            ("POST", "telemetry"): self._const({"status": "accepted"}),
            ("GET", "healthz"): self._const({"status": "ok"}),
            ("GET", "get_server_capabilities"): self._const_fn(s.capabilities),
            ("POST", "create_model"): self._json(s.create_model),
            ("POST", "get_info"): self._json(s.get_info),
            ("POST", "forward_backward"): self._forward_backward,
            ("POST", "optim_step"): self._json(s.optim_step),
            ("POST", "save_weights"): self._json(s.save_weights),
            ("POST", "save_weights_for_sampler"): self._json(s.save_weights_for_sampler),
            ("POST", "load_weights"): self._json(s.load_weights),
            ("POST", "create_sampling_session"): self._json(s.create_sampling_session),
            ("POST", "asample"): self._json(lambda body: s.asample(body, wire.encode_sample_response)),
            ("POST", "retrieve_future"): self._retrieve_future,
        }

    async def _dispatch(self, request: Any) -> Any:
        from aiohttp import web

        path = request.path
        try:
            self._authorize(request)
            if not path.startswith("/api/v1/"):
                raise _Refused(
                    404, f"{path} is not a Tinker API route; the SDK's base_url is http://HOST:PORT"
                )
            route = path[len("/api/v1/") :]
            handler = self._routes().get((request.method, route))
            if handler is None:
                handler = self._session_route(request.method, route)
            if handler is None:
                raise _Refused(404, f"{request.method} {path} is not served by this Tinker server")
            return await handler(request)
        except _Refused as e:
            LOGGER.warning("%s %s refused: %s", request.method, path, e)
            return web.json_response({"error": str(e)}, status=e.status)
        except Exception as e:  # ours: the traceback to our log, the type to the client
            LOGGER.exception("%s %s failed", request.method, path)
            return web.json_response(
                {"error": f"the server failed on this request ({type(e).__name__})"}, status=500
            )

    def _session_route(self, method: str, route: str) -> Handler | None:
        parts = route.split("/")
        if method == "POST" and len(parts) == 3 and parts[0] == "sessions" and parts[2] == "finish":
            return self._json(lambda body: self.service.finish_session(parts[1]), body_required=False)
        if method == "GET" and len(parts) == 2 and parts[0] == "samplers":
            return self._const_fn(lambda: self.service.get_sampler(parts[1]))
        return None

    def _authorize(self, request: Any) -> None:
        if self.api_key is None:
            return
        sent = request.headers.get("X-API-Key", "")
        good = (self.api_key.encode(), f"tml-{self.api_key}".encode())
        # both compared, so the time does not say which form was close
        matches = [hmac.compare_digest(sent.encode(), g) for g in good]
        if not any(matches):
            raise _Refused(
                401, "this server needs its API key in X-API-Key (TINKER_API_KEY=tml-<server.token>)"
            )

    # ------------------------------------------------------------------ handler builders
    async def _body(self, request: Any) -> bytes:
        try:
            return await read_bounded_body(request, self.max_request_bytes, "server.max_request_bytes")
        except BodyRefused as e:
            raise _Refused(e.status, e.message) from None

    async def _json_body(self, request: Any, required: bool = True) -> dict[str, Any]:
        raw = await self._body(request)
        if not raw and not required:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise _Refused(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the request body must be a JSON object")
        return body

    def _const(self, answer: dict[str, Any]) -> Handler:
        async def handle(request: Any) -> Any:
            from aiohttp import web

            await self._body(request)
            return web.json_response(answer)

        return handle

    def _const_fn(self, fn: Callable[[], dict[str, Any]]) -> Handler:
        async def handle(request: Any) -> Any:
            from aiohttp import web

            try:
                return web.json_response(fn())
            except KeyError as e:
                raise _Refused(404, str(e.args[0])) from None

        return handle

    def _json(self, fn: Callable[[dict[str, Any]], dict[str, Any]], body_required: bool = True) -> Handler:
        async def handle(request: Any) -> Any:
            from aiohttp import web

            body = await self._json_body(request, body_required)
            loop = asyncio.get_running_loop()
            try:
                answer = await loop.run_in_executor(self._executor, fn, body)
            except KeyError as e:
                raise _Refused(404, str(e.args[0])) from None
            except (UserError, TinkerInputError) as e:
                raise _Refused(400, str(e)) from None
            return web.json_response(answer)

        return handle

    async def _forward_backward(self, request: Any) -> Any:
        from aiohttp import web

        raw = await self._body(request)
        if PROTOBUF not in request.headers.get("Content-Type", ""):
            raise _Refused(
                415, f"forward_backward takes a protobuf body (Content-Type: {PROTOBUF}), as the SDK sends"
            )
        loop = asyncio.get_running_loop()

        def submit() -> dict[str, Any]:
            try:
                decoded = wire.decode_forward_backward_request(raw, request.headers.get("Content-Encoding"))
            except wire.WireError as e:
                raise _Refused(e.http_status, f"malformed ForwardBackwardRequest: {e}") from None
            return self.service.forward_backward(
                decoded.model_id,
                decoded.seq_id,
                [TinkerDatum(d.tokens, d.inputs) for d in decoded.datums],
                decoded.loss_fn,
                decoded.loss_fn_config,
                decoded.forward_only,
                wire.encode_forward_backward_output,
                raw,
            )

        try:
            answer = await loop.run_in_executor(self._executor, submit)
        except (UserError, TinkerInputError) as e:
            raise _Refused(400, str(e)) from None
        return web.json_response(answer)

    async def _retrieve_future(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._json_body(request)
        request_id = body.get("request_id")
        future = self.service.jobs.get(request_id) if isinstance(request_id, str) else None
        if future is None:
            raise _Refused(404, f"request {request_id!r} is unknown to this server (or its result expired)")
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.poll_hold_s)
        except TimeoutError:
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except (UserError, TinkerInputError) as e:
            return web.json_response({"error": str(e), "category": "user"})
        except Exception as e:
            return web.json_response(
                {
                    "error": f"the server failed on this request ({type(e).__name__}: {e})",
                    "category": "server",
                }
            )
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTOBUF)
        return web.json_response(result)
