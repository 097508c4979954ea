"""``openaligner serve-tinker [CONFIG] [key=value ...]``: serve the Tinker training API
(``forward_backward``, ``optim_step``, ``save_weights_for_sampler``, ``asample``, ...) on local
Hugging Face models, for the unmodified ``tinker`` SDK and ``tinker-cookbook`` recipes.

Owns the command: check the served models, the address and the API key, build the
:class:`~openaligner.servers.tinker.service.TinkerService` and its HTTP front, print the URL, and
stop on SIGINT or SIGTERM (the job running finishes first: nothing is left half-applied). Must not
know the routes or what they compute.
Design notes: docs/tinker.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from openaligner.config import StartupError
from openaligner.protocol import TOKEN_ENV
from openaligner.rollout.config import RolloutConfig
from openaligner.servers.transport.http_guard import DEFAULT_MAX_REQUEST_BYTES
from openaligner.servers.transport.triton import is_loopback

log = logging.getLogger("openaligner.serve_tinker")


@dataclass
class TinkerServerSettings:
    """Where the server listens and what it accepts."""

    host: str = "127.0.0.1"  # address to bind; beyond loopback the API key (token) is required
    port: int = 8000  # HTTP port (the SDK's base_url is http://HOST:PORT); 0: any free port, printed
    token: str | None = (
        None  # API key clients send as X-API-Key (tml-<token> too); null: $OPENALIGNER_TOKEN or none
    )
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest HTTP request body (HTTP 413 above)
    poll_hold_s: float = (
        30.0  # retrieve_future holds a poll this long, then answers try_again (SDK timeout: 45 s)
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{{section}}.port must lie in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"{{section}}.max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not 0 < self.poll_hold_s < 45:
            raise ValueError(
                f"{{section}}.poll_hold_s must lie in (0, 45): the SDK gives up on a poll after 45 s, got "
                f"{self.poll_hold_s}"
            )


@dataclass
class TinkerModelSettings:
    """Which base models are served and how they train."""

    # base_model name a client sends -> local HF directory, e.g. {Qwen/Qwen3-0.6B: /models/qwen3-0.6b}
    names: dict[str, str] = field(default_factory=dict)
    accept_local_dirs: bool = True  # a base_model that is an absolute path to a HF directory is served too
    max_lora_rank: int = 128  # the largest lora_config.rank create_model accepts
    lora_alpha: float = 32.0  # adapters' output scale is lora_alpha / rank
    max_samples: int = 64  # the most num_samples one asample may ask for
    # the most rows (num_samples summed) of asample calls queued back to back drawn as one engine request
    max_batch_rows: int = 64
    # how long a sampling job waits for the next like call when none is queued behind it, again
    # after each (at most 20x in all: a client's calls sent together arrive ms apart); 0: none
    batch_wait_s: float = 0.05
    max_sampler_snapshots: int = 16  # weight snapshots kept per model for its samplers (older ones expire)
    default_max_tokens: int = 128  # new tokens per sample when sampling_params.max_tokens is null
    device: str = "auto"  # auto: CUDA when there is one, else cpu; or cpu, cuda:1, ...

    def __post_init__(self) -> None:
        sizes = (self.max_lora_rank, self.max_samples, self.max_batch_rows, self.default_max_tokens)
        if min(*sizes, self.max_sampler_snapshots) < 1:
            raise ValueError(
                "{section}.max_lora_rank, max_samples, max_batch_rows, max_sampler_snapshots and "
                "default_max_tokens must be >= 1"
            )
        if self.lora_alpha <= 0:
            raise ValueError(f"{{section}}.lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.batch_wait_s <= 1:
            raise ValueError(f"{{section}}.batch_wait_s must lie in [0, 1] seconds, got {self.batch_wait_s}")


@dataclass
class ServeTinkerConfig:
    server: TinkerServerSettings = field(default_factory=TinkerServerSettings)  # where it listens
    models: TinkerModelSettings = field(default_factory=TinkerModelSettings)  # what it serves
    # what samples: hf (default) or vllm (one engine process per base model), train-ppo's keys
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint_dir: str = "runs/tinker"  # tinker:// paths live here (<dir>/<model_id>/weights/<name>)
    threads: int | None = None  # torch CPU threads; null: torch's default
    log_level: str = "INFO"  # Python logging level of this process


SCHEMA = ServeTinkerConfig
RESUME_KEY = ""  # state comes back from the checkpoints clients load


def served_names(cfg: TinkerModelSettings) -> dict[str, Path]:
    """``models.names`` checked: every directory holds a ``config.json``.

    Raises:
        StartupError: naming the entry and what a valid value is.
    """
    out = {}
    for name, path in cfg.names.items():
        p = Path(path).expanduser().absolute()
        if not (p / "config.json").is_file():
            raise StartupError(
                f"models.names[{name!r}]={path} is not a Hugging Face model directory (no config.json)"
            )
        out[name] = p
    return out


def check_rollout(cfg: RolloutConfig) -> None:
    """The ``rollout`` section as serve-tinker serves it.

    Raises:
        StartupError: ``rollout.vllm.url`` (serve-tinker starts its own engines, one per base
            model: an attached engine holds one model and ties its head as that model does), or no
            interpreter at ``rollout.vllm.python`` (naming ``make rollout-setup``).
    """
    if cfg.engine != "vllm":
        return
    if cfg.vllm.url is not None:
        raise StartupError(
            f"rollout.vllm.url={cfg.vllm.url}: serve-tinker starts its own vllm engines (one per base "
            "model, started at the first sample) and attaches to none; set rollout.vllm.url=null"
        )
    from openaligner.rollout.engine import EngineSetupError
    from openaligner.rollout.vllm_link import resolve_python

    try:
        resolve_python(cfg.vllm.python)
    except EngineSetupError as e:
        raise StartupError(str(e)) from None


def api_key(server: TinkerServerSettings) -> str | None:
    """The API key clients must send (None: open).

    Raises:
        StartupError: listening beyond loopback without one.
    """
    key = server.token or os.environ.get(TOKEN_ENV) or None
    if key is None and not is_loopback(server.host):
        raise StartupError(
            f"server.host={server.host} accepts connections from other machines: set server.token (or "
            f"${TOKEN_ENV}) to an API key, and give clients TINKER_API_KEY=tml-<that key>"
        )
    return key


def run(cfg: ServeTinkerConfig) -> int:
    import torch

    from openaligner.algorithms.tinker_losses import tinker_loss
    from openaligner.models.source import pick_device
    from openaligner.servers.tinker.app import TinkerHTTP
    from openaligner.servers.tinker.engines import TinkerEngines
    from openaligner.servers.tinker.service import TinkerService

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    bases = served_names(cfg.models)
    key = api_key(cfg.server)
    check_rollout(cfg.rollout)
    service = TinkerService(
        bases,
        Path(cfg.checkpoint_dir),
        tinker_loss,
        accept_local_dirs=cfg.models.accept_local_dirs,
        max_lora_rank=cfg.models.max_lora_rank,
        lora_alpha=cfg.models.lora_alpha,
        max_samples=cfg.models.max_samples,
        max_batch_rows=cfg.models.max_batch_rows,
        batch_wait_s=cfg.models.batch_wait_s,
        max_sampler_snapshots=cfg.models.max_sampler_snapshots,
        default_max_tokens=cfg.models.default_max_tokens,
        device=pick_device(cfg.models.device),
        engines=TinkerEngines(cfg.rollout),
    )
    front = TinkerHTTP(
        service,
        cfg.server.host,
        cfg.server.port,
        api_key=key,
        max_request_bytes=cfg.server.max_request_bytes,
        poll_hold_s=cfg.server.poll_hold_s,
    )
    try:
        front.start()
    except OSError as e:
        raise StartupError(
            f"server.port={cfg.server.port} cannot be bound on server.host={cfg.server.host} ({e.strerror}); "
            "choose another port, or server.port=0 for any free one"
        ) from None
    stopping = threading.Event()

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    names = ", ".join(sorted(bases)) or "none by name"
    print(
        f"tinker server ready at http://{cfg.server.host}:{front.port} (base models: {names}"
        f"{'; local directories' if cfg.models.accept_local_dirs else ''}; checkpoints in "
        f"{Path(cfg.checkpoint_dir).absolute()}; sampling engine {cfg.rollout.engine}"
        f"{'; API key required' if key else ''}); "
        "stop with Ctrl-C or SIGTERM",
        flush=True,
    )
    while not stopping.wait(1.0):
        pass
    front.stop()
    service.close()  # the job running finishes
    print("tinker server stopped", flush=True)
    return 0
