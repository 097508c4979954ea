"""A toy sequence task that exercises the whole PPO math core without any language model.

The policy is a table of logits per position over a tiny vocabulary; a "response" is a fixed
number of sampled tokens; the score is the share of a target token. The critic is a table of
values per position. One step runs the same math as the real trainer: KL-shaped rewards, GAE,
advantage whitening, the clipped policy loss and the clipped value loss. Knows nothing of
transformers, servers or configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openaligner.algorithms import (
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    shape_rewards,
    value_loss,
)


@dataclass(frozen=True)
class ToyStepMetrics:
    step: int
    score: float  # mean share of the target token in the responses
    kl: float  # mean per-token KL to the initial policy
    value_loss: float
    clip_fraction: float


def run_toy_ppo(
    steps: int = 30,
    seed: int = 0,
    vocab: int = 8,
    length: int = 6,
    batch: int = 64,
    beta: float = 0.05,
    lr: float = 0.1,
) -> list[ToyStepMetrics]:
    """Train the toy policy with PPO for ``steps`` steps; returns per-step metrics."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(length, vocab, requires_grad=True)
    init_logits = logits.detach().clone()
    values = torch.zeros(length, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=lr)
    critic_opt = torch.optim.Adam([values], lr=lr)
    target = vocab - 1
    # Layout as in the real trainer: a 1-token prompt, `length` response tokens, S-1 = length.
    response_lengths = torch.full((batch,), length + 1)
    mask = torch.ones(batch, length)
    history = []
    for step in range(steps):
        with torch.no_grad():
            probs = torch.softmax(logits, -1)
            tokens = torch.multinomial(probs, batch, replacement=True, generator=g).T  # [B, length]
            old_logprobs = torch.log_softmax(logits, -1).gather(-1, tokens.T).T
            ref_logprobs = torch.log_softmax(init_logits, -1).gather(-1, tokens.T).T
            old_values = values.detach().expand(batch, length)
            scores = (tokens == target).float().mean(-1)
            kl = kl_penalty(old_logprobs, ref_logprobs, "k3")
            rewards = shape_rewards(scores, kl, response_lengths, beta)
            advantages, returns = gae(old_values, rewards, mask, gamma=1.0, lam=0.95)
            advantages = masked_whiten(advantages, mask)
        for _ in range(4):
            new_logprobs = torch.log_softmax(logits, -1).gather(-1, tokens.T).T
            loss, stats = ppo_policy_loss(new_logprobs, old_logprobs, advantages, mask, clip_eps=0.2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            v_loss, _ = value_loss(values.expand(batch, length), old_values, returns, mask, clip=0.2)
            critic_opt.zero_grad()
            v_loss.backward()
            critic_opt.step()
        history.append(
            ToyStepMetrics(
                step=step,
                score=float(scores.mean()),
                kl=float(masked_mean(kl, mask)),
                value_loss=float(v_loss.detach()),
                clip_fraction=float(stats.clip_fraction),
            )
        )
    return history
