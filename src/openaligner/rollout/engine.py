"""The rollout engine seam: a request-level interface that turns a batch of prompts, sampling
settings and per-row seeds into the trainer's :class:`~openaligner.models.generation.Generation`
layout, and takes the policy's new weights after each optimizer step.

Owns the :class:`RolloutEngine` contract (lifecycle, ``generate``, ``update_weights``), the
request type, the ``rollout`` config section and the ``hf`` engine (the project's own sampling
loop over the actor's modules). Must not know about rewards, losses, optimizers or the PPO loop;
log-probs are never an engine's output (the trainer recomputes them). Imports nothing heavy at
module level, so that loading a config does not import transformers. Adding an engine:
docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import Generation, SamplingParams


class EngineSetupError(ValueError):
    """The configured engine cannot run here (its environment is missing, a setting it does not
    support); the message names the key and the fix. The recipe refuses the run with it."""


class RolloutEngineError(RuntimeError):
    """The engine failed while the run used it (its process died, refused a request, or generated
    from other weights than the trainer's); the message names the engine and what happened."""

    status: int | None = None  # the HTTP status of an engine's refusal, if it was one


@dataclass(frozen=True)
class RolloutRequest:
    """One batch of prompts to sample a response for each (row ``i`` of every field is one request)."""

    prompts: torch.Tensor  # [B, P] int64, right-padded (values beyond a row's length are ignored)
    prompt_lengths: torch.Tensor  # [B] int64, each in [1, P]
    sampling: SamplingParams  # stop ids resolved (``stop_token_ids`` not None)
    seeds: torch.Tensor  # [B] int64: row i's seed (see RolloutEngine.generate for what each engine does)

    def __post_init__(self) -> None:
        b = self.prompts.shape[0]
        if self.prompts.dim() != 2 or self.prompt_lengths.shape != (b,) or self.seeds.shape != (b,):
            raise ValueError(
                f"a rollout request needs prompts [B, P], prompt_lengths [B] and seeds [B]; got "
                f"{tuple(self.prompts.shape)}, {tuple(self.prompt_lengths.shape)}, {tuple(self.seeds.shape)}"
            )


class WeightSource(Protocol):
    """Where an engine that owns its weights reads the policy's (the actor)."""

    def inference_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole weights as a plain causal LM of its architecture holds them (LoRA
        merged, shards gathered: a collective for a sharded policy, None on ranks other than 0)."""
        ...


class RolloutEngine(ABC):
    """What generates the trainer's rollouts.

    Lifecycle: :meth:`start` before the first :meth:`generate` (spawn a process, load weights;
    idempotent), :meth:`stop` to release what it holds while keeping the engine restartable,
    :meth:`close` once at the end (also on errors; idempotent). The engine is a context manager
    (``start`` … ``close``). Every rank of a run calls every method at the same points, so an
    engine may use collectives in them.

    An engine that owns its weights (another process, vLLM) must have the trainer's latest weights
    before it generates: the trainer calls :meth:`update_weights` after every optimizer step that
    changed them (and after restoring a checkpoint). An engine that pays per transfer may record
    the version and pull the weights at its next :meth:`generate` (the ``policy`` object is live).
    """

    name: ClassVar[str]
    shares_weights: ClassVar[bool]
    """True: the engine generates with the trainer's own modules, so :meth:`update_weights` is a
    no-op."""

    def start(self) -> None:
        """Make the engine ready to generate (default: nothing to do)."""
        return None

    @abstractmethod
    def generate(self, request: RolloutRequest) -> Generation:
        """One response per row of ``request``.

        Returns:
            A :class:`~openaligner.models.generation.Generation` on the CPU: ``tokens`` [B, S]
            int64 (prompt, response, then the policy's pad id; S = max response length),
            ``response_lengths`` [B] (prompt + response, stop token included), ``prompt_lengths``
            [B], ``is_end`` [B] bool (ended on a stop id or stop string). Rows keep the request's
            order. The same request and weights give the same tokens; how seeds map to random
            streams is the engine's (documented on each engine).
        """

    def update_weights(self, policy: WeightSource, version: int) -> None:
        """The policy's weights changed: they are those after ``version`` optimizer steps. The next
        :meth:`generate` must sample from them. Default: nothing (an engine sharing the modules)."""
        if not self.shares_weights:
            raise NotImplementedError(f"the {self.name} engine owns its weights and must take new ones")

    def check_logprobs(
        self, engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """Compare the log-probs an engine reported (``Generation.logprobs``) with the trainer's
        own of the same tokens, and say how far apart they are.

        Args:
            engine_logprobs: [B, S-1] the engine's log-prob of each next token.
            trainer_logprobs: [B, S-1] the trainer's (:meth:`CausalLMActor.get_inference_log_probs`).
            mask: [B, S-1] 1 on response positions.

        Returns:
            ``{"logprob_diff_mean", "logprob_diff_max", "token_prob_error"}`` (see
            :func:`~openaligner.algorithms.logprobs.logprob_mismatch`); an engine may raise
            instead when they show it generated from other weights than the trainer's.
        """
        from openaligner.algorithms.logprobs import logprob_mismatch

        return {k: float(v) for k, v in logprob_mismatch(engine_logprobs, trainer_logprobs, mask).items()}

    def pop_metrics(self) -> dict[str, float]:
        """The engine's own measurements since the last call (e.g. ``timing/weight_sync_s``);
        the trainer adds them to the step's metrics. Default: none."""
        return {}

    def stop(self) -> None:
        """Release what the engine holds (processes, memory); :meth:`start` may bring it back."""
        return None

    def close(self) -> None:
        """Release everything for good (default: :meth:`stop`)."""
        self.stop()

    def __enter__(self) -> RolloutEngine:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class HFRolloutEngine(RolloutEngine):
    """The project's own sampling loop (:func:`~openaligner.models.generation.generate`) over the
    actor's modules: generation is :meth:`CausalLMActor.infer <openaligner.models.actor.CausalLMActor.infer>`
    (sharded policies gathered or stepped layer by layer, the precision's autocast, the fast
    decoders), so new weights are seen at once and :meth:`update_weights` does nothing.

    Seeds: a request is sampled as one batch from one ``torch.Generator`` on the actor's device
    seeded with ``seeds[0]``; the rows share that random stream, so a row's tokens depend on its
    batch-mates (as they always have: this keeps rollouts bit-identical to the loop before the
    seam). The other seeds are not read.
    """

    name = "hf"
    shares_weights = True

    def __init__(self, actor: CausalLMActor) -> None:
        self.actor = actor

    def generate(self, request: RolloutRequest) -> Generation:
        from openaligner.models.generation import Generation

        device = self.actor.device
        generator = torch.Generator(device=device).manual_seed(int(request.seeds[0]))
        batch = {"text": request.prompts.to(device), "length": request.prompt_lengths.to(device)}
        out = self.actor.infer(batch, request.sampling, generator=generator)
        return Generation(
            tokens=out["response_tokens"].cpu(),
            sequence_lengths=out["response_lengths"].cpu(),
            prompt_lengths=out["prompt_lengths"].cpu(),
            is_end=out["is_end"].cpu(),
        )


def _hf_engine(cfg: RolloutConfig, actor: CausalLMActor) -> RolloutEngine:
    return HFRolloutEngine(actor)


def _vllm_engine(cfg: RolloutConfig, actor: CausalLMActor) -> RolloutEngine:
    from openaligner.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(actor, cfg.vllm)


ROLLOUT_ENGINES: dict[str, Callable[[RolloutConfig, CausalLMActor], RolloutEngine]] = {
    "hf": _hf_engine,
    "vllm": _vllm_engine,
}
"""``rollout.engine`` name → the engine's builder from the ``rollout`` section and the actor it
generates for."""


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


@dataclass
class RolloutConfig:
    """The ``rollout`` section of train-ppo: what generates the rollouts."""

    engine: str = "hf"  # hf: the project's own sampling loop; vllm: a vLLM engine in its own process
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the vllm engine's settings

    def __post_init__(self) -> None:
        if self.engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"rollout.engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {self.engine!r}"
            )
        if self.vllm.url is not None and self.engine != "vllm":
            raise ValueError(
                f"rollout.vllm.url is set but rollout.engine={self.engine}: set rollout.engine=vllm to "
                "attach to that engine, or rollout.vllm.url=null"
            )


def build_rollout_engine(cfg: RolloutConfig, actor: CausalLMActor) -> RolloutEngine:
    """The engine ``cfg`` names, generating for ``actor`` (not started)."""
    return ROLLOUT_ENGINES[cfg.engine](cfg, actor)


def row_seeds(seed: int, rows: int) -> torch.Tensor:
    """[rows] int64 seeds ``seed, seed + 1, …`` (modulo 2**63): one per row of a request whose
    first row carries ``seed`` (adjacent integers seed independent streams)."""
    return torch.tensor([(seed + i) % 2**63 for i in range(rows)], dtype=torch.int64)
