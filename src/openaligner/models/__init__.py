"""Models over Hugging Face causal LMs: the PPO actor, the reward model, the critic, tokenizers and
tiny builders.

Imports ``algorithms`` (for log-prob and loss math) and ``transformers``; never ``trainer``,
``servers``, ``clients``, ``config`` or ``cli``.
"""

from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel, ScalarHeadModel

__all__ = ["CriticModel", "RewardModel", "ScalarHeadModel"]
