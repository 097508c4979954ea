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
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.models.generation import Generation, SamplingParams


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
            response_lengths=out["response_lengths"].cpu(),
            prompt_lengths=out["prompt_lengths"].cpu(),
            is_end=out["is_end"].cpu(),
        )


ROLLOUT_ENGINES: dict[str, Callable[[CausalLMActor], RolloutEngine]] = {"hf": HFRolloutEngine}
"""``rollout.engine`` name → the engine's builder from the actor it generates for."""


@dataclass
class RolloutConfig:
    """The ``rollout`` section of train-ppo: what generates the rollouts."""

    engine: str = "hf"  # hf: the project's own sampling loop over the actor's modules

    def __post_init__(self) -> None:
        if self.engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"rollout.engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {self.engine!r}"
            )


def build_rollout_engine(cfg: RolloutConfig, actor: CausalLMActor) -> RolloutEngine:
    """The engine ``cfg`` names, generating for ``actor`` (not started)."""
    return ROLLOUT_ENGINES[cfg.engine](actor)


def row_seeds(seed: int, rows: int) -> torch.Tensor:
    """[rows] int64 seeds ``seed, seed + 1, …`` (modulo 2**63): one per row of a request whose
    first row carries ``seed`` (adjacent integers seed independent streams)."""
    return torch.tensor([(seed + i) % 2**63 for i in range(rows)], dtype=torch.int64)
