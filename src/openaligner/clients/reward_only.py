"""The trainer's reward client for critic-free estimators: rewards from the reward server, no critic.

Owns the adapter that gives :class:`~openaligner.clients.reward.RemoteGPTRMClient` the shape of
the PPO trainer's reward/critic client (``infer_rm_critic`` / ``train`` / ``save`` / ``restore``),
so that GRPO, RLOO and the REINFORCE variants run the same loop as PPO while talking only to the
reward server (a reward model, a reward function, or both, see ``serve-reward``), as NeMo-Aligner's
REINFORCE actor does through its ``RemoteGPTRMClient``. Values are zeros (nothing reads them), and
there is no critic to train, save or restore. Must not know about the trainer or its math.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from openaligner.clients.critic import (
    RemoteCriticConfig,
    RMCriticFutureResult,
    RolloutTexts,
    ToConversations,
    TokenizerIdentity,
    ToMetadata,
    choose_reward_input,
    remote_reward_client,
    request_rewards,
)


class RemoteRewardOnlyClient:
    """Rewards for rollouts from the reward server at ``cfg.reward_model`` (``remote.reward_model``);
    the critic keys of ``cfg`` are not used.

    Use as a context manager, which waits up to ``init_timeout_s`` for the server on entry.

    Args:
        cfg: the ``remote`` section of train-ppo.
    """

    def __init__(self, cfg: RemoteCriticConfig) -> None:
        self.cfg = cfg
        self._rm = remote_reward_client(cfg)
        self._texts: RolloutTexts | None = None
        self.reward_input = "tokens"
        """How rollouts reach the reward server: ``tokens`` until :meth:`configure_reward_input`."""

    @property
    def url(self) -> str:
        return self._rm.url

    def configure_reward_input(
        self,
        policy: TokenizerIdentity,
        to_conversations: ToConversations,
        to_metadata: ToMetadata | None = None,
    ) -> str:
        """Settle ``cfg.reward_input`` from the reward server's tokenizer, as
        :meth:`~openaligner.clients.critic.RemoteGPTRMCriticClient.configure_reward_input` does for
        a separate reward server. Returns ``tokens`` or ``text``.

        Raises:
            TokenizerMismatchError: the server cannot read this policy's rollouts as asked.
        """
        reward = TokenizerIdentity.from_server(self._rm.tokenizer(), self._rm.url)
        self.reward_input = choose_reward_input(
            self.cfg.reward_input, policy, reward=reward, critic=None, combined=False
        )
        self._texts = RolloutTexts(to_conversations, to_metadata) if self.reward_input == "text" else None
        return self.reward_input

    def infer_rm_critic(self, rollout_batch: Mapping[str, torch.Tensor]) -> RMCriticFutureResult:
        """Rewards for a rollout micro-batch (``response_tokens`` [B, S], ``response_lengths`` [B],
        ``prompt_lengths`` [B]); the result's values are zeros [B, S-1].

        Raises:
            BadRequestError: at once, when the tensors are malformed.
        """
        tokens = rollout_batch["response_tokens"]
        rows, width = int(tokens.shape[0]), int(tokens.shape[1])
        rewards = request_rewards(self._rm, rollout_batch, self._texts)
        values: Future[tuple[torch.Tensor, torch.Tensor | None]] = Future()
        values.set_result((torch.zeros(rows, max(width - 1, 0)), None))
        return RMCriticFutureResult(values, rewards, width, tokens.device)

    def train(self, ppo_rollout_data: Mapping[str, torch.Tensor]) -> Future[Any]:
        """There is no critic to train; the trainer never calls this for a critic-free estimator."""
        raise RuntimeError("a critic-free estimator has no critic to train (trainer.advantage_estimator)")

    def save(self) -> Future[Any]:
        """Nothing to save on a server: a settled future naming no critic step."""
        return _settled({"status": 0, "step": None})

    def restore(self, step: int) -> Future[Any]:
        """Nothing to restore (checkpoints of critic-free runs record no critic step)."""
        return _settled({"status": 0, "step": step})

    def wait_until_ready(self) -> None:
        self._rm.wait_until_ready()

    def close(self) -> None:
        self._rm.close()

    def __enter__(self) -> RemoteRewardOnlyClient:
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _settled(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future
