"""The ``rollout`` section of train-ppo and the engines it may name.

Owns :class:`RolloutConfig` (which engine, and the ``vllm`` engine's settings) and the table
``ROLLOUT_ENGINES``: ``rollout.engine`` name → the builder of that engine from this section and
the actor. The engines' modules are imported by their builders alone, so that loading a config
imports no engine (nor torch). Adding an engine: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openaligner.rollout.vllm_config import VLLMConfig

if TYPE_CHECKING:
    from openaligner.models.actor import CausalLMActor
    from openaligner.rollout.engine import RolloutEngine


def _hf_engine(cfg: RolloutConfig, actor: CausalLMActor) -> RolloutEngine:
    from openaligner.rollout.hf_engine import HFRolloutEngine

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
