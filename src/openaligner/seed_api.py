"""NeMo-Aligner's names for openaligner's objects (the seed API), kept in this one place.

Owns the aliases a user of NeMo-Aligner's PPO reaches for: each name here *is* the openaligner
object (``seed_api.MegatronGPTActorModel is CausalLMActor``), the methods the seed pages document
(:data:`SEED_METHODS`) and the keys of the seed's rollout dicts (:data:`ROLLOUT_BATCH_KEYS`).
Must not define behaviour of its own, and nothing in openaligner imports it.
The table, with what each name is in openaligner's vocabulary: docs/architecture.md, "The seed
API's names".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openaligner.clients.critic import RemoteGPTRMCriticClient, RMCriticFutureResult
from openaligner.clients.reward import RemoteGPTRMClient
from openaligner.models.actor import CausalLMActor
from openaligner.models.critic import CriticModel
from openaligner.servers.critic import CriticServerTrainer
from openaligner.servers.reward import RewardModelServer
from openaligner.trainer.ppo import PPOTrainer

MegatronGPTActorModel = CausalLMActor
"""The actor: NeMo-Aligner's ``MegatronGPTActorModel`` contract (less the loss, which is the trainer's)."""

MegatronGPTCriticModel = CriticModel
"""The critic: a value head at every position over a Hugging Face backbone."""

ROLLOUT_BATCH_KEYS: tuple[str, ...] = ("response_tokens", "response_lengths", "prompt_lengths", "is_end")
"""The keys of ``MegatronGPTActorModel.infer``'s rollout dict, as the seed documents them, which the
reward and critic clients take: ``response_tokens`` [B, S] and ``response_lengths`` [B] hold the
whole sequence, prompt + response (openaligner's own name for that is ``sequence_*``)."""

SEED_METHODS: dict[str, Callable[..., Any]] = {
    "MegatronGPTActorModel.infer": CausalLMActor.infer,
    "MegatronGPTActorModel.get_inference_log_probs": CausalLMActor.get_inference_log_probs,
    "RemoteGPTRMCriticClient.infer_rm_critic": RemoteGPTRMCriticClient.infer_rm_critic,
    "RemoteGPTRMCriticClient.train": RemoteGPTRMCriticClient.train,
    "RemoteGPTRMCriticClient.save": RemoteGPTRMCriticClient.save,
    "RemoteGPTRMClient.infer_rm": RemoteGPTRMClient.infer_rm,
    "CriticServerTrainer.run_server": CriticServerTrainer.run_server,
    "CriticServerTrainer.run_inference": CriticServerTrainer.run_inference,
    "CriticServerTrainer.run_training": CriticServerTrainer.run_training,
    "RewardModelServer.run_server": RewardModelServer.run_server,
    "PPOTrainer.fit": PPOTrainer.fit,
    "PPOTrainer.generate_rollouts": PPOTrainer.generate_rollouts,
    "PPOTrainer.generate_ppo_data": PPOTrainer.generate_ppo_data,
}
"""``"Class.method"`` as the seed pages write it → the method it is in openaligner."""

__all__ = [
    "ROLLOUT_BATCH_KEYS",
    "SEED_METHODS",
    "CriticServerTrainer",
    "MegatronGPTActorModel",
    "MegatronGPTCriticModel",
    "PPOTrainer",
    "RMCriticFutureResult",
    "RemoteGPTRMClient",
    "RemoteGPTRMCriticClient",
    "RewardModelServer",
]
