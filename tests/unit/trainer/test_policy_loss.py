"""PolicyLoss, the actor's policy loss as a component: its loss and diagnostics on a real policy's
rollouts, its settings, and the training forward (fused tanh-GELU, skipped prompt positions)
against a plain full-sequence reference."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from openaligner.algorithms import masked_mean, ppo_policy_loss, response_mask
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.trainer.policy_loss import PolicyLoss, PolicyLossConfig, first_scored_position
from openaligner.trainer.ppo_config import PPOConfig

LOSS = PolicyLoss(PolicyLossConfig())


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 rows × 12 tokens, prompts of 5..7 tokens: no row scores positions 0..3."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (4, 12), generator=g)
    prompts = torch.tensor([5, 7, 6, 5])
    lengths = torch.tensor([12, 10, 12, 9])
    col = torch.arange(11)
    mask = ((col >= (prompts - 1).unsqueeze(-1)) & (col < (lengths - 1).unsqueeze(-1))).float()
    return {
        "sequence_tokens": tokens,
        "sequence_lengths": lengths,
        "mask": mask,
        "advantages": torch.randn(4, 11, generator=g) * mask,
        "prev_logprobs": torch.randn(4, 11, generator=g) * 0.1 - 4.0,
        "is_end": torch.tensor([True, False, True, True]),
    }


def _reference(actor: CausalLMActor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss from the model's own full-sequence forward (transformers' gelu_new, every position)."""
    tokens, lengths = batch["sequence_tokens"], batch["sequence_lengths"]
    attention = (torch.arange(tokens.shape[1]) < lengths.unsqueeze(-1)).long()
    logits = actor.model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
    logprobs = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1).float()
    loss, _ = ppo_policy_loss(
        logprobs,
        batch["prev_logprobs"],
        batch["advantages"],
        batch["mask"],
        LOSS.cfg.clip_eps,
        is_end=batch["is_end"],
    )
    return loss


def test_loss_and_gradients_match_the_full_sequence_reference(tiny):
    actor = CausalLMActor(tiny.causal_lm("gpt2"), init_policy=False)
    assert any(isinstance(m, NewGELUActivation) for m in actor.model.modules())
    batch = _batch(tiny.size.vocab_size)
    assert first_scored_position(batch["mask"]) == 4

    loss, metrics = LOSS(actor, batch)
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


def testfirst_scored_position():
    assert first_scored_position(torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]])) == 1
    assert first_scored_position(torch.zeros(2, 3)) == 0


PROMPT_LENGTHS = [4, 7, 2, 6]


@pytest.fixture
def actor(tiny):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=(5, 6, 7, 8, 9, 10))
    return CausalLMActor(tiny.causal_lm("llama"), sampling=sampling)


def _rollout(actor: CausalLMActor, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, vocab, (4, 7), generator=g)
    length = torch.tensor(PROMPT_LENGTHS)
    text[torch.arange(7) >= length.unsqueeze(-1)] = 1
    return actor.infer({"text": text, "length": length}, generator=torch.Generator().manual_seed(seed))


def _ppo_batch(out, prev_logprobs, advantages=None):
    width = out["response_tokens"].shape[1] - 1
    mask = response_mask(out["prompt_lengths"], out["response_lengths"], width)
    if advantages is None:
        advantages = torch.linspace(-1, 2, width).expand(len(mask), width).clone()
    return {
        "sequence_tokens": out["response_tokens"],
        "sequence_lengths": out["response_lengths"],
        "advantages": advantages,
        "mask": mask,
        "prev_logprobs": prev_logprobs,
        "is_end": torch.tensor([True, True, False, True]),
    }


def test_loss_at_ratio_one_is_minus_mean_advantage(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    prev = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    batch = _ppo_batch(out, prev)
    loss, metrics = LOSS(actor, batch)
    gated = batch["mask"] * batch["is_end"].float().unsqueeze(-1)
    expected = -masked_mean(batch["advantages"], gated)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert metrics["ppo_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["entropy"] > 0
    assert {"loss", "pg_loss", "ppo_ratio_clamped", "dual_clip_fraction"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    grads = [p.grad for p in actor.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0


def test_far_off_policy_tokens_are_clipped(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    prev = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    _, metrics = LOSS(actor, _ppo_batch(out, prev + 1.0))  # ratio = e^-1 < 1 - 0.2
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert metrics["ppo_ratio"] == pytest.approx(float(torch.exp(torch.tensor(-1.0))), rel=1e-4)
    assert metrics["ppo_ratio_clamped"] == pytest.approx(0.8, rel=1e-5)


def test_entropy_bonus_lowers_the_loss(tiny, actor):
    out = _rollout(actor, tiny.size.vocab_size)
    prev = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    batch = _ppo_batch(out, prev)
    plain, m = LOSS(actor, batch)
    bonus, _ = PolicyLoss(PolicyLossConfig(entropy_coef=0.1))(actor, batch)
    torch.testing.assert_close(bonus.detach(), plain.detach() - 0.1 * m["entropy"], rtol=1e-5, atol=1e-6)


def test_a_negative_entropy_bonus_trains_toward_lower_entropy(tiny, actor):
    """The entropy term's gradient is ``-coef × ∇entropy`` for either sign of ``trainer.entropy_bonus``
    (a negative one used to add no gradient at all: the entropy was computed under no_grad)."""
    out = _rollout(actor, tiny.size.vocab_size)
    prev = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    batch = _ppo_batch(out, prev)

    def grads(coef: float) -> torch.Tensor:
        actor.model.zero_grad(set_to_none=True)
        loss, _ = PolicyLoss(PolicyLossConfig(entropy_coef=coef))(actor, batch)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None])

    plain = grads(0.0)
    bonus, penalty = grads(0.1) - plain, grads(-0.1) - plain
    assert bonus.abs().max() > 1e-6
    # differences of fp32 gradients: compared up to a small share of their largest entry
    torch.testing.assert_close(penalty, -bonus, rtol=0, atol=1e-3 * float(bonus.abs().max()))


def test_gate_unfinished_decides_which_rows_train_and_count(actor, tiny):
    """``gate_unfinished``: rows that never ended add no units and no gradient; off, they do."""
    out = _rollout(actor, tiny.size.vocab_size)
    prev = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    batch = _ppo_batch(out, prev)  # row 2 did not end
    gated, open_ = LOSS, PolicyLoss(PolicyLossConfig(gate_unfinished=False))
    per_row = batch["mask"].sum(-1)
    assert float(gated.units(batch["mask"], batch["is_end"])) == float(per_row.sum() - per_row[2])
    assert float(open_.units(batch["mask"], batch["is_end"])) == float(per_row.sum())
    everything = batch["mask"]
    expected = -masked_mean(batch["advantages"], everything)
    loss, _ = open_(actor, batch)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_config_from_the_trainer_section_and_refusals():
    c = PPOConfig(
        ratio_eps=0.1,
        ratio_eps_high=0.3,
        dual_clip=3.0,
        entropy_bonus=0.01,
        advantage_estimator="dr_grpo",
        gate_unfinished=False,
    )
    cfg = PolicyLossConfig.from_ppo(c)
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.dual_clip, cfg.entropy_coef) == (0.1, 0.3, 3.0, 0.01)
    assert (cfg.aggregation, cfg.norm_length, cfg.kl_kind) == ("seq_mean_token_sum_norm", 64, "k3")
    assert cfg.gate_unfinished is False
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation"):
        PolicyLossConfig(aggregation="sum")
