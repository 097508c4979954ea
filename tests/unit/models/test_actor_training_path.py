"""CausalLMActor's training forward: the fused tanh-GELU and the skipped prompt positions give the
loss, metrics and gradients of a plain full-sequence reference."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from openaligner.algorithms import ppo_policy_loss
from openaligner.models.actor import CausalLMActor, _first_scored_position


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 rows × 12 tokens, prompts of 5..7 tokens: no row scores positions 0..3."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (4, 12), generator=g)
    prompts = torch.tensor([5, 7, 6, 5])
    lengths = torch.tensor([12, 10, 12, 9])
    col = torch.arange(11)
    mask = ((col >= (prompts - 1).unsqueeze(-1)) & (col < (lengths - 1).unsqueeze(-1))).float()
    return {
        "response_tokens": tokens,
        "response_lengths": lengths,
        "mask": mask,
        "advantages": torch.randn(4, 11, generator=g) * mask,
        "prev_logprobs": torch.randn(4, 11, generator=g) * 0.1 - 4.0,
        "is_end": torch.tensor([True, False, True, True]),
    }


def _reference(actor: CausalLMActor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss from the model's own full-sequence forward (transformers' gelu_new, every position)."""
    tokens, lengths = batch["response_tokens"], batch["response_lengths"]
    attention = (torch.arange(tokens.shape[1]) < lengths.unsqueeze(-1)).long()
    logits = actor.model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
    logprobs = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1).float()
    loss, _ = ppo_policy_loss(
        logprobs,
        batch["prev_logprobs"],
        batch["advantages"],
        batch["mask"],
        actor.clip_eps,
        is_end=batch["is_end"],
    )
    return loss


def test_loss_and_gradients_match_the_full_sequence_reference(tiny):
    actor = CausalLMActor(tiny.causal_lm("gpt2"), init_policy=False)
    assert any(isinstance(m, NewGELUActivation) for m in actor.model.modules())
    batch = _batch(tiny.size.vocab_size)
    assert _first_scored_position(batch["mask"]) == 4

    loss, metrics = actor.get_loss_and_metrics(batch)
    loss.backward()
    fast_grads = [p.grad.clone() for p in actor.parameters()]
    actor.model.zero_grad()
    reference = _reference(actor, batch)
    reference.backward()

    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-5, atol=1e-6)
    assert metrics["loss"] == pytest.approx(float(reference.detach()), rel=1e-5, abs=1e-6)
    for fast, ref in zip(fast_grads, (p.grad for p in actor.parameters()), strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-6)
    assert sum(float(g.abs().sum()) for g in fast_grads) > 0


def test_first_scored_position():
    assert _first_scored_position(torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]])) == 1
    assert _first_scored_position(torch.zeros(2, 3)) == 0
