"""The trainer's reward client for critic-free estimators: rewards from the reward server, no critic.

Owns the adapter that gives :class:`~openaligner.clients.reward.RemoteGPTRMClient` the trainer's
reward-client shape (``infer_rm_critic``, whose answer carries no values), so that GRPO, RLOO and
the REINFORCE variants run the same loop as PPO while talking only to the reward server (a reward
model, a reward function, or both, see ``serve-reward``), as NeMo-Aligner's REINFORCE actor does
through its ``RemoteGPTRMClient``. It has no critic to train, save or restore: the trainer asks
the estimator whether there is one. Must not know about the trainer or its math.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future

import torch

from openaligner.clients.critic import (
    RemoteCriticConfig,
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

    def infer_rm_critic(self, rollout_batch: Mapping[str, torch.Tensor]) -> RewardsFuture:
        """Rewards for a rollout micro-batch (``response_tokens`` [B, S], ``response_lengths`` [B],
        ``prompt_lengths`` [B]); the result's values are None (there is no critic).

        Raises:
            BadRequestError: at once, when the tensors are malformed.
        """
        rewards = request_rewards(self._rm, rollout_batch, self._texts)
        return RewardsFuture(rewards, rollout_batch["response_tokens"].device)

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


class RewardsFuture:
    """The pending answer to one :meth:`RemoteRewardOnlyClient.infer_rm_critic` call:
    ``result()`` is ``(rewards [B] float32 on the batch's device, None)`` — no values."""

    def __init__(self, rewards: Future[torch.Tensor], device: torch.device) -> None:
        self._rewards = rewards
        self._device = device

    def done(self) -> bool:
        return self._rewards.done()

    def result(self, timeout: float | None = None) -> tuple[torch.Tensor, None]:
        """Wait for the rewards.

        Raises:
            ClientError: a subclass naming the reward server.
            TimeoutError: ``timeout`` passed first.
        """
        return self._rewards.result(timeout=timeout).reshape(-1).to(self._device, torch.float32), None
