"""The ``vllm`` engine's processes and links, trainer side: the rollout environment's interpreter,
starting ``vllm_worker.py`` with it (and ending its whole process group), and
:class:`EngineLink`: one engine's URL, its JSON-over-HTTP requests, the lease of an attached one.

Must not import vLLM (it lives in another virtualenv), nor know what a request means to the
rollout (``vllm_engine``) or how weights travel (``weights_*``). The wire: docs/rollout-engine.md.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from openaligner.rollout.engine import EngineSetupError, RolloutEngineError
from openaligner.rollout.vllm_config import VLLMProcessConfig
from openaligner.rollout.weights_collective import CollectiveWeights

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
"""The script the engine process runs (stdlib + vLLM only)."""

LEASE_HEADER = "X-Openaligner-Lease"
"""The header carrying an attached trainer's lease (``vllm_worker.LEASE_HEADER``)."""


def resolve_python(spec: str, key: str = "rollout.vllm.python") -> Path:
    """The rollout environment's interpreter: ``spec`` if absolute, else relative to the working
    directory, else to the source checkout holding this package (where ``make rollout-setup``
    puts ``.venv-rollout``).

    Raises:
        EngineSetupError: no such interpreter, naming the key and the make target.
    """
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, Path(__file__).parents[3] / path]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()  # not resolved: a venv's python is a symlink out of the venv
    raise EngineSetupError(
        f"{key}={spec} is not an interpreter (looked at {', '.join(map(str, candidates))}): "
        f"run `make rollout-setup` (a virtualenv with vLLM in .venv-rollout) or point {key} "
        "at a Python that can import vllm"
    )


def shm_dir(prefix: str) -> Path:
    """A new private directory in ``/dev/shm`` (memory, not disk) when there is one, else in the
    temporary directory."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))


def spawn_worker(
    python: Path,
    model_dir: Path,
    workdir: Path,
    cfg: VLLMProcessConfig,
    stdout: Any,
    extra: list[str],
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``vllm_worker.py`` with ``python`` on ``model_dir``, in its own session (its process
    group is ended as one by :func:`end_group`), exiting by itself when this process is gone.
    Returns the process and the ready file it writes once it serves (``{"port": N}``)."""
    ready = workdir / "ready.json"
    cmd = [
        str(python),
        "-I",  # no PYTHONPATH, no user site, and not this package's directory on sys.path
        str(WORKER),
        f"--model={model_dir}",
        f"--ready-file={ready}",
        f"--dtype={cfg.dtype}",
        f"--tensor-parallel-size={cfg.tensor_parallel_size}",
        f"--gpu-memory-utilization={cfg.gpu_memory_utilization}",
        f"--max-model-len={cfg.max_model_len}",
        "--enforce-eager" if cfg.enforce_eager else "--no-enforce-eager",
        f"--parent-pid={os.getpid()}",
        f"--workdir={workdir}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib)}
    if cfg.tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the server's process
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, ready


class EngineLink(CollectiveWeights):
    """One engine process the run talks to (rank 0 only): its URL and, for an engine the run
    started, its process and log; for an attached one, its ``GET /info``, the lease every request
    carries (kept by a heartbeat thread) and its weights directory when it is on this machine;
    with ``weight_transfer=collective``, the process group with it (:class:`CollectiveWeights`)."""

    def __init__(self, url: str, request_timeout_s: float, info: dict[str, Any] | None = None) -> None:
        self.url = url  # as engine_urls gives it (no trailing slash); "" until a started engine serves
        self.request_timeout_s = request_timeout_s
        self.info: dict[str, Any] = info or {}
        self.proc: subprocess.Popen[bytes] | None = None  # started by the run: its process
        self.log_path: Path | None = None
        self.lease = ""  # attached: the lease every request carries
        self.local_dir: Path | None = None  # attached: the engine's weights directory, if writable here
        self._beating: threading.Event | None = None  # set to stop the heartbeat thread

    # ------------------------------------------------------------------ attaching
    def attach(self, weight_transfer: str) -> None:
        """Take the engine's lease; the weights go through its directory when it is on this
        machine (this process can read the engine's token file there) and ``weight_transfer`` is
        ``auto``, else as an upload."""
        token: str | None = None
        with contextlib.suppress(OSError, TypeError, KeyError):
            token = (Path(self.info["workdir"]) / "local-token").read_text().strip()
        out = self.post("/attach", {"client": f"{socket.gethostname()}:{os.getpid()}", "local_token": token})
        self.lease = str(out["lease"])
        weights_dir = Path(out["weights_dir"])
        local = bool(out["local"]) and weight_transfer == "auto" and os.access(weights_dir, os.W_OK)
        self.local_dir = weights_dir if local else None
        every = max(1.0, float(self.info.get("lease_ttl_s", 60.0)) / 4)
        self._beating = threading.Event()
        beat = (self._beating, every, self.url, self.lease)
        threading.Thread(target=self._heartbeat, args=beat, name="vllm-lease", daemon=True).start()
        how = {"collective": "broadcast over a process group", "http": "uploaded over HTTP"}.get(
            weight_transfer, f"written into {weights_dir}" if local else "uploaded over HTTP"
        )
        log.info("vllm rollout engine: attached to %s (weights %s)", self.url, how)

    @staticmethod
    def _heartbeat(stop: threading.Event, every: float, url: str, lease: str) -> None:
        """Keep the lease while the run is busy elsewhere (long training phases); a beat that
        fails is only skipped (the run's own next request says what is wrong)."""
        while not stop.wait(every):
            req = urllib.request.Request(
                url + "/heartbeat", data=b"{}", headers={LEASE_HEADER: lease}, method="POST"
            )
            with contextlib.suppress(Exception), urllib.request.urlopen(req, timeout=every):
                pass

    def detach(self) -> None:
        """Give the lease back (the engine keeps serving); a no-op when none is held."""
        self._end_collective()
        if self._beating is not None:
            self._beating.set()
            self._beating = None
        if self.lease:
            with contextlib.suppress(RolloutEngineError):
                self.post("/detach", {}, timeout=30.0)
            log.info("vllm rollout engine: detached from %s (it keeps serving)", self.url)
        self.lease = ""

    # ------------------------------------------------------------------ transport
    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """``POST path`` with the JSON ``body``; its JSON object answer, or a
        :class:`RolloutEngineError` naming this engine (a refusal's message, an engine that died,
        one that did not answer within ``timeout``, or an answer that is not a JSON object)."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.lease:
            headers[LEASE_HEADER] = self.lease
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            refused = RolloutEngineError(f"the vllm rollout engine at {self.url} refused {path}: {detail}")
            refused.status = e.code
            raise refused from None
        except (OSError, http.client.HTTPException) as e:
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=2.0)  # a connection reset arrives before the exit status
            if self.proc is not None and self.proc.poll() is not None:
                raise RolloutEngineError(
                    f"the vllm rollout engine died during {path}: {self.describe_exit()}"
                ) from None
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} did not answer {path} "
                f"({type(e).__name__}: {e}; rollout.vllm.request_timeout_s={self.request_timeout_s:g})"
            ) from None
        try:
            reply = json.loads(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            # a KeyError or JSONDecodeError here would leave the other ranks waiting in _on_leader
            raise RolloutEngineError(
                f"the vllm rollout engine at {self.url} answered {path} with other than a JSON object: "
                f"{raw[:200]!r}"
            )
        return reply

    def describe_exit(self) -> str:
        assert self.proc is not None
        rc = self.proc.returncode
        how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
        return f"process {self.proc.pid} ended ({how}); its log ends:\n{self.log_tail()}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            assert self.log_path is not None
            text = self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to ``proc``'s process group (it leads its own session), then SIGKILL if it is
    still there after ``grace_s``; reaps ``proc``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; anything it spawned into its group goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        break
    if proc.poll() is None:
        proc.wait(timeout=10.0)
