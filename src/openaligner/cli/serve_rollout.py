"""``openaligner serve-rollout [CONFIG] model=DIR [key=value ...]``: a vLLM rollout engine on its
own, which train-ppo runs attach to (``rollout.vllm.url``) instead of starting one each.

Owns the command: check the model directory and the port, start the engine process
(``rollout/vllm_worker.py --standalone`` with the rollout environment's Python) on a directory in
``/dev/shm``, print its URL, and end it (its whole process group, its directory removed) on SIGINT
or SIGTERM. Must not know the engine's endpoints or how weights reach it (``rollout/vllm_engine``).
Design notes: docs/rollout-engine.md, "A standalone engine".
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from openaligner.config import StartupError, as_startup_error
from openaligner.rollout.engine import EngineSetupError
from openaligner.rollout.vllm_config import VLLMProcessConfig
from openaligner.servers.transport.triton import is_loopback

log = logging.getLogger("openaligner.serve_rollout")


@dataclass
class RolloutServerConfig:
    """Where the engine listens, and how long an attached trainer keeps it."""

    host: str = (
        "127.0.0.1"  # address to bind; anything but loopback is logged as a warning (no authentication!)
    )
    port: int = 5557  # HTTP port; 0: any free port (printed)
    lease_ttl_s: float = 60.0  # an attached trainer that sends nothing this long loses the engine to the next

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{{section}}.port must lie in [0, 65535], got {self.port}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"{{section}}.lease_ttl_s must be > 0, got {self.lease_ttl_s}")


@dataclass
class ServeRolloutConfig:
    model: str = "???"  # Hugging Face directory (config.json + weights) the engine starts from
    server: RolloutServerConfig = field(default_factory=RolloutServerConfig)  # where it listens
    vllm: VLLMProcessConfig = field(
        default_factory=VLLMProcessConfig
    )  # the engine (as train-ppo's rollout.vllm)
    log_level: str = "INFO"  # Python logging level of this process


SCHEMA = ServeRolloutConfig
RESUME_KEY = ""  # nothing to resume


def run(cfg: ServeRolloutConfig) -> int:
    """Serve until SIGINT or SIGTERM (0), or until the engine dies by itself (1).

    Raises:
        StartupError: no model at ``model``, no interpreter at ``vllm.python``, or the port is taken.
    """
    from openaligner.rollout.vllm_link import end_group, resolve_python, shm_dir, spawn_worker

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = check_model_dir(cfg.model)
    with as_startup_error(EngineSetupError):
        python = resolve_python(cfg.vllm.python, key="vllm.python")
    host, port = cfg.server.host, check_port_free(cfg.server.host, cfg.server.port)
    if not is_loopback(host):
        log.warning(
            "serving on %s: anyone who reaches it can attach and generate (no authentication); "
            "keep it on a trusted network",
            host,
        )
    stopping = threading.Event()

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("%s received: stopping the engine", signal.Signals(signum).name)
        stopping.set()

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    workdir = shm_dir("openaligner-serve-rollout-")
    extra = ["--standalone", f"--host={host}", f"--port={port}", f"--lease-ttl-s={cfg.server.lease_ttl_s}"]
    proc, ready = spawn_worker(python, model, workdir, cfg.vllm, None, extra)
    try:
        deadline = time.monotonic() + cfg.vllm.start_timeout_s
        while not ready.exists():
            if proc.poll() is not None or stopping.is_set():
                break
            if time.monotonic() > deadline:
                log.error("the engine did not serve within vllm.start_timeout_s=%g", cfg.vllm.start_timeout_s)
                return 1
            stopping.wait(0.2)
        if ready.exists() and not stopping.is_set():
            served = json.loads(ready.read_text())["port"]
            url = f"http://{_display_host(host)}:{served}"
            print(
                f"vllm rollout engine ready at {url} (model {model}, {cfg.vllm.dtype}); attach train-ppo "
                "with "
                f"rollout.engine=vllm rollout.vllm.url={url}; stop with Ctrl-C or SIGTERM",
                flush=True,
            )
        while not stopping.is_set() and proc.poll() is None:
            stopping.wait(0.5)
        if not stopping.is_set():
            log.error(
                "the engine process ended by itself (exit code %s); its output is above", proc.returncode
            )
            return 1
        print("vllm rollout engine stopped", flush=True)
        return 0
    finally:
        end_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_model_dir(path: str) -> Path:
    """``path`` as an absolute directory holding a model's ``config.json``.

    Raises:
        StartupError: naming ``model`` and what a valid value is.
    """
    model = Path(path).expanduser().absolute()
    if not (model / "config.json").is_file():
        raise StartupError(
            f"model={path} is not a Hugging Face model directory (no config.json there): give the directory "
            "of the model the runs will train (e.g. the SFT model train-ppo's actor.path names)"
        )
    return model


def check_port_free(host: str, port: int) -> int:
    """``port`` if it can be bound on ``host`` now (0 stays 0: any free port).

    Raises:
        StartupError: naming ``server.port`` (or ``server.host``).
    """
    if port == 0:
        return 0
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(
                f"server.port={port} cannot be bound on server.host={host} ({e.strerror}): another server "
                "uses it; choose another port, or server.port=0 for any free one"
            ) from None
    return port


def _display_host(host: str) -> str:
    """How a trainer reaches ``host``: this machine's name when it listens on every address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host
