"""The ``vllm`` engine's settings: how its process runs (``VLLMProcessConfig``, also
``openaligner serve-rollout``'s ``vllm`` section), and how a run reaches it (``VLLMConfig``,
``rollout.vllm``: attach URLs, weight transfer, limits), each checked at load.

Owns the checks of those keys and of engine URLs; must not start, reach or know an engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VLLMProcessConfig:
    """How a vLLM engine process runs: ``rollout.vllm`` of train-ppo (the engine it starts) and
    ``vllm`` of ``openaligner serve-rollout`` (docs/rollout-engine.md)."""

    # the rollout environment's interpreter (`make rollout-setup`); a relative path is looked up
    # from the working directory, then from the source checkout
    python: str = ".venv-rollout/bin/python"
    dtype: str = "float32"  # the engine's weights and compute (float32 | bfloat16 | float16)
    tensor_parallel_size: int = 1  # GPUs the engine shards the model over (tensor parallel)
    # share of each GPU's memory vLLM may take; 0 = vLLM's default (0.9); leave the trainer room
    # when both share a GPU
    gpu_memory_utilization: float = 0.0
    max_model_len: int = 0  # longest prompt + response the engine serves; 0 = the model's limit
    enforce_eager: bool = True  # no CUDA graphs (the CPU build needs it; a GPU is faster without)
    cpu_kv_cache_gib: int = 1  # KV cache of the CPU build, GiB (VLLM_CPU_KVCACHE_SPACE)
    start_timeout_s: float = 600.0  # the engine's start-up limit (importing vLLM alone: 30-90 s)

    def __post_init__(self) -> None:
        # {section}: this section's key in the command's schema (rollout.vllm, vllm)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"{{section}}.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"{{section}}.tensor_parallel_size must be ≥ 1, got {self.tensor_parallel_size}")
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise ValueError(
                f"{{section}}.gpu_memory_utilization must lie in [0, 1) (0: vLLM's default), got "
                f"{self.gpu_memory_utilization}"
            )
        for key in ("start_timeout_s", "cpu_kv_cache_gib"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{{section}}.{key} must be > 0, got {getattr(self, key)}")
        if self.max_model_len < 0:
            raise ValueError(f"{{section}}.max_model_len must be ≥ 0, got {self.max_model_len}")


WEIGHT_TRANSFERS = ("auto", "http", "collective")
"""``rollout.vllm.weight_transfer``'s values (docs/rollout-engine.md, "Weight transfer")."""


@dataclass
class VLLMConfig(VLLMProcessConfig):
    """``rollout.vllm``: the vLLM engine train-ppo starts, or the one it attaches to (``url``)."""

    # http://HOST:PORT of an engine started with `openaligner serve-rollout` (or several, comma-
    # separated: the rollouts are shared among them): attach to it instead of starting one (the
    # settings above are then that engine's, and refused here); null: start one
    url: str | None = None
    # how pushed weights reach the engine: auto = a file in its directory in /dev/shm (an attached
    # engine on another machine: uploaded over HTTP); http = always uploaded (attached only);
    # collective = broadcast over a process group of the trainer and the engine (gloo on CPU,
    # NCCL when the engine has a GPU)
    weight_transfer: str = "auto"
    request_timeout_s: float = 600.0  # limit of one generate or weight push
    # mean |engine − trainer log-prob| on the first rollout after a weight push above which the
    # run stops (the weights did not arrive); 0 = never
    max_logprob_diff: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.request_timeout_s <= 0:
            raise ValueError(f"{{section}}.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_logprob_diff < 0:
            raise ValueError(f"{{section}}.max_logprob_diff must be ≥ 0, got {self.max_logprob_diff}")
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(
                f"{{section}}.weight_transfer must be one of {', '.join(WEIGHT_TRANSFERS)}, got "
                f"{self.weight_transfer!r}"
            )
        if self.weight_transfer == "http" and self.url is None:
            raise ValueError(
                "{section}.weight_transfer=http uploads to an engine of openaligner serve-rollout "
                "({section}.url); an engine the run starts reads its weights from /dev/shm (auto) or "
                "takes them over a process group (collective)"
            )
        if self.url is not None:
            engine_urls(self.url, "{section}.url")
            spawn_only = VLLMProcessConfig()
            for key in VLLMProcessConfig.__dataclass_fields__:
                if getattr(self, key) != getattr(spawn_only, key):
                    raise ValueError(
                        f"{{section}}.{key} is a setting of an engine train-ppo starts; with "
                        "{section}.url the engine's own apply (give them to openaligner serve-rollout): "
                        f"leave {{section}}.{key} at its default ({getattr(spawn_only, key)!r}) or "
                        "{section}.url unset"
                    )


def engine_urls(urls: str, key: str = "rollout.vllm.url") -> list[str]:
    """The engine URLs of ``urls`` (``http://HOST:PORT``, several comma-separated), without
    trailing slashes; a ``ValueError`` naming ``key`` for a malformed or repeated one (an engine
    named twice would take two shares of each rollout and two pushes of each step's weights)."""
    out = [u.strip().rstrip("/") for u in urls.split(",")]
    for u in out:
        check_engine_url(u, key)
    repeated = sorted({u for u in out if out.count(u) > 1})
    if repeated:
        raise ValueError(f"{key} names {', '.join(repeated)} more than once: list each engine once")
    return out


def check_engine_url(url: str, key: str) -> tuple[str, int]:
    """``(host, port)`` of an engine URL ``http://HOST:PORT``; a ``ValueError`` naming ``key``
    for anything else."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if parts.scheme != "http" or not host or port is None or parts.path not in ("", "/"):
        raise ValueError(
            f"{key} must be http://HOST:PORT (what openaligner serve-rollout prints), got {url!r}"
        )
    return host, port
