"""The rollout engine seam: a request-level interface that turns a batch of prompts, sampling
settings and per-row seeds into the trainer's :class:`~openaligner.models.generation.Generation`
layout, and takes the policy's new weights after each optimizer step.

Owns the :class:`RolloutEngine` contract (lifecycle, ``generate``, ``update_weights``), the
request type, the errors every engine raises and the rows' seeds. Must not know about rewards,
losses, optimizers or the PPO loop, nor any one engine; log-probs are never an engine's output
(the trainer recomputes them). Adding an engine: docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
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

    def sync_weights(self) -> None:
        """Take the weights :meth:`update_weights` named now (starting the engine if it must),
        rather than at the next :meth:`generate`. Default: nothing (an engine sharing the modules)."""
        return None

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


def row_seeds(seed: int, rows: int) -> torch.Tensor:
    """[rows] int64 seeds ``seed, seed + 1, …`` (modulo 2**63): one per row of a request whose
    first row carries ``seed`` (adjacent integers seed independent streams)."""
    return torch.tensor([(seed + i) % 2**63 for i in range(rows)], dtype=torch.int64)
