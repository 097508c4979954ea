"""The PyTriton binding: start a real Triton server and connect endpoint logic to it.

Owns everything PyTriton-specific: the runtime fixes that let Triton start on a fresh machine, the
model configuration (dynamic batcher), the HTTP front clients reach, and the thin per-call path
(decode, validate, lock, call the :class:`Endpoint`, encode). Must not know what an endpoint
computes, nor about models or torch.distributed.
Design notes (per-request errors): docs/serving.md, "Module notes".
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from openaligner.protocol import DEFAULT_HOST, REQUEST_ID_PARAMETER, ErrorEnvelope, TensorSpec
from openaligner.servers.transport.http_guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    Admit,
    ForeignRoute,
    HTTPGuard,
    RequestCheck,
)
from openaligner.servers.transport.workspace import ServerWorkspace, default_root
from openaligner.servers.validation import RequestError, RequestsFailed, UnauthorizedError

LOGGER = logging.getLogger(__name__)


class Endpoint(Protocol):
    """Endpoint logic as a plain object: per-request validation, then one call per formed batch."""

    @property
    def model_name(self) -> str:
        """Triton model name."""
        ...

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        """Declared inputs (per-sample shapes)."""
        ...

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        """Declared outputs (per-sample shapes)."""
        ...

    def validate(self, inputs: Mapping[str, np.ndarray]) -> Any:
        """Check and convert one request's inputs; raise :class:`RequestError` if it is wrong."""
        ...

    def run(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        """Answer validated requests (the values ``validate`` returned), one dict per request."""
        ...


@runtime_checkable
class Admitting(Protocol):
    """An endpoint that starts work on each checked request before Triton sees it (optional).

    The HTTP front awaits ``admit`` after the check; a request whose admission fails with
    :class:`RequestError` is refused alone (400), like an invalid one, and Triton never merges it
    with others. Triton's call then gives each request to ``resume`` with its parameters.
    """

    def admit(self, checked: Any) -> Future[dict[str, str]]:
        """Start the work on what ``validate`` returned; resolves to request parameters to forward."""
        ...

    def resume(self, checked: Any, parameters: Mapping[str, Any]) -> Any:
        """What ``run`` is given for the request: ``checked`` with the admitted work's result."""
        ...


@dataclass(frozen=True)
class Batching:
    """Triton dynamic batcher settings for one endpoint.

    Attributes:
        max_batch_size: most rows per request and per formed batch (Triton refuses more).
        preferred_batch_sizes: batch sizes the batcher tries to form right away.
        max_queue_delay_microseconds: how long a request may wait for others to merge with.
    """

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_microseconds: int


class BatchRejected(Exception):
    """Raised into PyTriton when a formed batch holds invalid requests; becomes an HTTP 500 whose
    text carries an :class:`ErrorEnvelope`. (Never ``PyTritonUnrecoverableError``: that would
    stop the server.)"""


def prepare_environment() -> None:
    """Make the Triton python-backend stub load *this* interpreter's libpython.

    The stub links ``libpython3.X.so``; without this, the dynamic loader may pick a system copy of
    another patch release and model loading fails deep inside ``multiprocessing``. PyTriton copies
    ``os.environ`` into the tritonserver process, so setting it here, before start, suffices.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        LOGGER.warning(
            "this Python was built without a shared libpython; Triton's python backend needs one "
            "(e.g. pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
        )
    if not libdir:
        return
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if current.split(":")[0] != libdir:
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def claim_port(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` (0: a free port the system picks) and return the bound, not yet listening
    socket, which holds the port until the HTTP front listens on it.

    Held from the start of a server's start-up, the port is never handed to another process: a
    Triton started meanwhile by a neighbouring server picks its own port with
    :func:`free_loopback_port`, which skips bound ports. Checking the port and binding it later
    left that window open, and two servers started side by side then took each other's port.

    Raises:
        OSError: the port is taken (the message names it and the key to change).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton does: TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"cannot bind {host}:{port} ({e.strerror}); another server is probably running there: "
            f"stop it or choose another server.port (0: any free port)",
        ) from None
    return sock


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Authorize = Callable[[Mapping[str, Any]], None]
"""Checks a request's Triton parameters; raises :class:`UnauthorizedError` to refuse it."""


class TritonCallable:
    """What PyTriton calls for one model: decode, authorize and validate each request, lock, run,
    encode."""

    def __init__(
        self,
        endpoint: Endpoint,
        lock: threading.Lock | threading.RLock,
        authorize: Authorize | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.lock = lock
        self.authorize = authorize
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self.rejected_calls = 0
        """Calls refused because at least one of their requests was invalid."""
        self.rejected_valid_requests = 0
        """Valid requests refused only because Triton merged them with an invalid one."""
        self._resume = endpoint.resume if isinstance(endpoint, Admitting) else None

    @property
    def busy(self) -> bool:
        """Whether a call is being served right now."""
        return self._in_flight > 0

    def check(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> Any:
        """Judge one request, without running it: the HTTP front's check and, per request, the
        first step of :meth:`__call__`. Returns what the endpoint's ``validate`` returned.

        Raises:
            UnauthorizedError: ``authorize`` refused the request's parameters (checked first: an
                unauthorized client learns nothing about its inputs).
            RequestError: the endpoint's ``validate`` refused the inputs.
        """
        if self.authorize is not None:
            self.authorize(parameters)
        return self.endpoint.validate(inputs)

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        with self._count_lock:
            self._in_flight += 1
        try:
            return self._serve(requests)
        finally:
            with self._count_lock:
                self._in_flight -= 1

    def _serve(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        decoded = [(_request_id(r, i), dict(r.data)) for i, r in enumerate(requests)]
        parsed: list[Any] = []
        invalid: dict[str, str] = {}
        unauthorized: dict[str, str] = {}
        for (rid, inputs), request in zip(decoded, requests, strict=True):
            parameters = getattr(request, "parameters", None) or {}
            try:
                checked = self.check(inputs, parameters)
                parsed.append(self._resume(checked, parameters) if self._resume is not None else checked)
            except UnauthorizedError as e:
                unauthorized[rid] = str(e)
            except RequestError as e:
                invalid[rid] = str(e)
        if unauthorized or invalid:
            valid = [rid for rid, _ in decoded if rid not in invalid and rid not in unauthorized]
            if unauthorized:
                listed = "; ".join(unauthorized.values())
                message = f"{self.endpoint.model_name}: {listed}"
                envelope = ErrorEnvelope("unauthorized", message, unauthorized | invalid, tuple(valid))
            else:
                envelope = rejection(self.endpoint.model_name, invalid, valid)
            with self._count_lock:
                self.rejected_calls += 1
                self.rejected_valid_requests += len(valid)
            LOGGER.warning("%s", envelope.message)
            raise BatchRejected(envelope.render())
        with self.lock:
            try:
                outputs = self.endpoint.run(parsed)
            except RequestsFailed as e:
                rids = [rid for rid, _ in decoded]
                failed = {rids[i]: why for i, why in e.failed.items()}
                envelope = rejection(self.endpoint.model_name, failed, [r for r in rids if r not in failed])
                LOGGER.warning("%s", envelope.message)
                raise BatchRejected(envelope.render()) from None
        return [self._encode(o) for o in outputs]

    def _encode(self, output: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return {s.name: np.asarray(output[s.name], dtype=s.dtype) for s in self.endpoint.outputs}


def rejection(model_name: str, invalid: Mapping[str, str], valid: Sequence[str]) -> ErrorEnvelope:
    """The error for a formed batch in which the requests named in ``invalid`` are wrong."""
    if not valid and len(invalid) == 1:
        ((_, reason),) = invalid.items()
        return ErrorEnvelope("bad_request", f"{model_name}: {reason}", dict(invalid))
    listed = "; ".join(f"[{rid}] {reason}" for rid, reason in invalid.items())
    total = len(invalid) + len(valid)
    if not valid:
        return ErrorEnvelope(
            "bad_request",
            f"{model_name}: all {total} requests merged into this call are invalid: {listed}",
            dict(invalid),
        )
    message = (
        f"{model_name}: Triton merged {total} requests into one call and {len(invalid)} of them are invalid, "
        f"so none was run (Triton gives every request of a call the same answer). Invalid: {listed}. "
        f"Valid, rejected only because they were merged with an invalid one — resend unchanged "
        f"(RemoteGPTRMClient does this by itself): {', '.join(valid)}"
    )
    return ErrorEnvelope("rejected_batch", message, dict(invalid), tuple(valid))


def _request_id(request: Any, index: int) -> str:
    params = getattr(request, "parameters", None) or {}
    rid = params.get(REQUEST_ID_PARAMETER)
    return str(rid) if rid is not None else f"#{index}"


class TritonHost:
    """One Triton server process (HTTP only) serving the endpoints bound to it.

    Clients reach an :class:`~openaligner.servers.transport.http_guard.HTTPGuard` on ``host:port``. It reads
    each inference request, has it checked in full by the endpoint's own ``validate`` (and
    ``authorize``), refuses it with a 4xx naming the input when it is wrong, and forwards the
    request exactly as it understood it to Triton, on a private port of 127.0.0.1. Every request is
    so judged on its own: Triton's dynamic batcher only ever merges valid requests.

    Everything of the server lives in one directory under ``workspace_dir`` (see
    :mod:`openaligner.servers.transport.workspace`), and :meth:`stop` returns only once every Triton process
    has exited.

    Args:
        host: address to bind; loopback by default. Any other address is logged as a warning:
            the server has no authentication on its inference routes.
        port: HTTP port; 0: a free port, picked at :meth:`start` (then :attr:`port` and
            :attr:`url` say which).
        max_request_bytes: largest request body accepted (HTTP 413 above it).
        exit_timeout_s: at stop, how long calls already being served may take to finish.
            Triton's own exit timeout is set to 0: it otherwise waits its full length on every
            stop, even when idle (30 s by default once a keep-alive client has connected).
        log_verbose: tritonserver verbosity (0 = info, warnings and errors).
        log_file: where tritonserver writes its log; None: a private file, deleted at stop
            (its tail is quoted when Triton fails to start).
        workspace_dir: the root under which this server makes its directory; None: the default
            of :func:`openaligner.servers.transport.workspace.default_root`.
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = 8000,
        *,
        exit_timeout_s: int = 3,
        log_verbose: int = 0,
        log_file: str | Path | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        workspace_dir: str | Path | None = None,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        if not is_loopback(host):
            LOGGER.warning(
                "binding %s:%d, which is reachable from other machines; the inference routes have no "
                "authentication — use 127.0.0.1 unless clients run elsewhere on a trusted network",
                host,
                port,
            )
        self.host, self.port = host, port
        self.exit_timeout_s = exit_timeout_s
        self.log_verbose = log_verbose
        self.log_file = Path(log_file) if log_file is not None else None
        self.max_request_bytes = max_request_bytes
        self.workspace_dir = workspace_dir
        self.triton_port: int | None = None
        """Triton's own HTTP port on 127.0.0.1 (behind the guard), once started."""
        self.guard: HTTPGuard | None = None
        self._front: socket.socket | None = None  # the claimed port, until the guard listens on it
        self._bindings: list[
            tuple[Endpoint, Batching | None, threading.Lock | threading.RLock, Authorize | None]
        ] = []
        self._callables: list[TritonCallable] = []
        self._routes: list[ForeignRoute] = []
        self._triton: Any = None
        self._workspace: ServerWorkspace | None = None
        self.start_time_s: float | None = None
        self.stop_time_s: float | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def bind(
        self,
        endpoint: Endpoint,
        batching: Batching | None,
        lock: threading.Lock | threading.RLock,
        authorize: Authorize | None = None,
        routes: Sequence[ForeignRoute] = (),
    ) -> None:
        """Serve ``endpoint`` as Triton model ``endpoint.model_name`` (before :meth:`start`).

        ``batching=None`` declares a model without a batch dimension (one request per call).
        Endpoints bound with the same ``lock`` never run at the same time. ``authorize``, when
        given, sees each request's Triton parameters before anything else and may refuse it.
        ``routes`` are other wire formats the HTTP front answers for this model (see
        :class:`~openaligner.servers.transport.http_guard.ForeignRoute`).
        """
        if self._triton is not None:
            raise RuntimeError("bind endpoints before start()")
        self._bindings.append((endpoint, batching, lock, authorize))
        self._routes.extend(routes)

    def start(self) -> None:
        """Start tritonserver and the HTTP front; return once every bound model is ready (about 3 s).

        Whatever interrupts the start — a failure, or an exception raised into it by a signal
        handler (see :class:`openaligner.servers.transport.lifecycle.StartInterrupted`) — first stops
        everything started so far (see :meth:`stop`), then propagates.

        Raises:
            OSError: the served address cannot be bound.
            RuntimeError: Triton failed to start (the end of its log is quoted).
        """
        if self._triton is not None or self._workspace is not None:
            raise RuntimeError("already started")
        _pass_interrupts_quietly()
        started = time.perf_counter()
        self._front = claim_port(self.host, self.port)
        self.port = int(self._front.getsockname()[1])
        try:
            self._start()
        except Exception as e:
            tail = self.log_tail()
            self.stop()
            if isinstance(e, OSError):
                raise
            raise RuntimeError(f"Triton failed to start at {self.url}: {e}\nend of its log:\n{tail}") from e
        except BaseException:
            self.stop()
            raise
        self.start_time_s = time.perf_counter() - started
        LOGGER.info("Triton serving %s at %s", [b[0].model_name for b in self._bindings], self.url)
        for route in self._routes:
            LOGGER.info("also answering %s for %s: POST %s", route.title, route.model, ", ".join(route.paths))

    def _start(self) -> None:
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy

        prepare_environment()
        _quiet_expected_rejections()
        self._workspace = workspace = ServerWorkspace.create(self.workspace_dir)
        _check_socket_paths(workspace.triton_dir, [b[0].model_name for b in self._bindings])
        self.triton_port = free_loopback_port()
        config = TritonConfig(
            http_address="127.0.0.1",
            http_port=self.triton_port,
            allow_http=True,
            allow_grpc=False,
            allow_metrics=False,
            exit_timeout_secs=0,
            log_verbose=self.log_verbose,
            log_file=self.log_path,
        )
        # A local model store: Triton loads the models from the workspace at start. Loading them
        # through its model-control API instead makes it copy each to /tmp/folderXXXXXX, which it
        # never removes.
        local_store = TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=True)
        triton = Triton(config=config, workspace=workspace.triton_dir, triton_lifecycle_policy=local_store)
        self._triton = triton
        checks: dict[str, RequestCheck] = {}
        admissions: dict[str, Admit] = {}
        tokenizers: dict[str, Mapping[str, object]] = {}
        for endpoint, batching, lock, authorize in self._bindings:
            if batching is None:
                model_config = ModelConfig(batching=False)
            else:
                model_config = ModelConfig(
                    batching=True,
                    max_batch_size=batching.max_batch_size,
                    batcher=DynamicBatcher(
                        max_queue_delay_microseconds=batching.max_queue_delay_microseconds,
                        preferred_batch_size=list(batching.preferred_batch_sizes),
                    ),
                )
            call = TritonCallable(endpoint, lock, authorize)
            self._callables.append(call)
            checks[endpoint.model_name] = call.check
            if isinstance(endpoint, Admitting):
                admissions[endpoint.model_name] = endpoint.admit
            info = getattr(endpoint, "tokenizer_info", None)
            if info is not None:
                tokenizers[endpoint.model_name] = info
            triton.bind(
                model_name=endpoint.model_name,
                infer_func=call,
                inputs=[_tensor(Tensor, s) for s in endpoint.inputs],
                outputs=[_tensor(Tensor, s) for s in endpoint.outputs],
                config=model_config,
            )
        triton.run()
        workspace.started()
        # After Triton is ready: until then clients see a refused connection, as before.
        front, self._front = self._front, None
        self.guard = HTTPGuard(
            self.host,
            self.port,
            self.triton_port,
            sock=front,
            max_request_bytes=self.max_request_bytes,
            checks=checks,
            admissions=admissions,
            tokenizers=tokenizers,
            routes=self._routes,
        )
        self.guard.start()

    @property
    def callables(self) -> tuple[TritonCallable, ...]:
        """The bound callables (one per endpoint), for their counters."""
        return tuple(self._callables)

    @property
    def log_path(self) -> Path | None:
        """The tritonserver log file (None before start when no ``log_file`` was given)."""
        if self.log_file is not None:
            return self.log_file
        return self._workspace.log_path if self._workspace is not None else None

    @property
    def workspace_path(self) -> Path | None:
        """This server's directory under the workspace root (None unless started)."""
        return self._workspace.path if self._workspace is not None else None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the tritonserver log ('' if there is none)."""
        path = self.log_path
        if path is None or not path.is_file():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def is_alive(self) -> bool:
        """Whether tritonserver, its models and the HTTP front are still up."""
        guard_up = self.guard is not None and self.guard.is_alive()
        return guard_up and self._triton is not None and bool(self._triton.is_alive())

    def stop(self) -> None:
        """Stop the HTTP front and tritonserver, and return only once every process of this
        server's Triton tree has exited (stragglers are killed) and its workspace is removed.

        Safe to call twice, and on a start that was interrupted half-way.
        """
        triton, self._triton = self._triton, None
        workspace, self._workspace = self._workspace, None
        started = time.perf_counter()
        known = workspace.processes() if workspace is not None else []
        if triton is not None:
            deadline = time.monotonic() + self.exit_timeout_s
            drained = False
            while any(c.busy for c in self._callables) and time.monotonic() < deadline:
                drained = True
                time.sleep(0.02)
            if drained:  # the answer still has to pass through Triton and the guard to the client
                time.sleep(0.25)
        if self.guard is not None:
            self.guard.stop()
        if self._front is not None:  # a start that failed before the guard took the port
            self._front.close()
            self._front = None
        if triton is not None:
            _hide_console_output(triton)
            noise = logging.getLogger("pytriton.server.triton_server")
            expected_exit = _DropMessage("exited with failure")  # a stop we asked for is no failure
            noise.addFilter(expected_exit)
            try:
                triton.stop()
            except Exception as e:  # shutdown must finish even if Triton misbehaves
                LOGGER.warning("error while stopping Triton: %s", e)
            finally:
                noise.removeFilter(expected_exit)
        if workspace is not None:
            workspace.release(known)
        if triton is not None:
            self.stop_time_s = time.perf_counter() - started

    def kill(self) -> None:
        """End this server's Triton tree at once (SIGKILL) and remove its workspace: for a stop that
        must not wait on Triton or PyTriton (see ``ServerLifecycle.request_stop``)."""
        workspace = self._workspace
        if workspace is not None:
            workspace.release(grace_s=0.0)

    def __enter__(self) -> TritonHost:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


_MAX_SOCKET_PATH = 107
"""Longest path of a Unix socket (``sun_path`` holds 108 bytes with the final NUL)."""


def _check_socket_paths(triton_dir: Path, model_names: Sequence[str]) -> None:
    """PyTriton's sockets live in its workspace; a longer path makes every model fail to load, and
    Triton's start then times out after two minutes instead of saying why."""
    longest = max((str(triton_dir / f"{name}_0_0-server.sock") for name in model_names), key=len, default="")
    if len(longest.encode()) > _MAX_SOCKET_PATH:
        raise OSError(
            f"the server's workspace {triton_dir.parent} is too deep: Triton's socket {longest} would be "
            f"{len(longest.encode())} bytes long, over the {_MAX_SOCKET_PATH} a Unix socket path may have; "
            f"choose a shorter server.workspace_dir (the default is {default_root()})"
        )


class _DropMessage(logging.Filter):
    """Drops log records whose message contains ``needle``."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def _hide_console_output(triton: Any) -> None:
    """Stop echoing tritonserver's stdout/stderr to the console, for a stop we asked for.

    Stopping prints what looks like faults and is not: tritonserver's "Signal (2) received", the
    python backend stub's "Non-graceful termination detected" (``exit_timeout_secs=0``), and the
    stub's ``resource_tracker: ... leaked shared_memory`` warning — the stub attaches to PyTriton's
    shared-memory tensor store, its interpreter registers what it attaches (Python < 3.13), and
    when the stub is ended its resource tracker unlinks those segments itself and warns. The
    stub's interpreter runs isolated (``-I``), so no warning filter reaches it. PyTriton echoes the
    server's output line by line while its ``_verbose`` is set (checked per line); nothing else
    reads that flag. Output before the stop (start-up failures) is still shown."""
    server = getattr(triton, "_triton_server", None)
    if server is not None and hasattr(server, "_verbose"):
        server._verbose = False


def _quiet_expected_rejections() -> None:
    """PyTriton logs every failed call with a full traceback; a rejected request is expected
    traffic, already logged in one line by :class:`TritonCallable`."""
    logger = logging.getLogger("pytriton.proxy.inference")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(BatchRejected.__name__))


def _tensor(tensor_cls: Any, spec: TensorSpec) -> Any:
    dtype: Any = bytes if spec.dtype is np.bytes_ else spec.dtype
    return tensor_cls(name=spec.name, dtype=dtype, shape=spec.shape, optional=spec.optional)


def _pass_interrupts_quietly() -> None:
    """Let a stop that arrives during the start reach it without a printed traceback.

    PyTriton waits for Triton on gevent; a signal handler's stop (a ``KeyboardInterrupt``) raised
    while this thread's gevent hub runs is printed by the hub as an error before the hub passes it
    on to the start. It is how a stop arrives, not an error: the hub passes it on without printing.
    """
    try:
        from gevent import get_hub
    except ImportError:  # no gevent: nothing prints
        return
    hub = get_hub()
    if not issubclass(KeyboardInterrupt, hub.NOT_ERROR):
        hub.NOT_ERROR = (*hub.NOT_ERROR, KeyboardInterrupt)
