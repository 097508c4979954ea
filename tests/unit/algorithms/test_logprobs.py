import pytest
import torch

from openaligner.algorithms import (
    entropy_from_logits,
    logprob_mismatch,
    logprobs_from_logits,
    next_token_logprobs,
    truncated_is_weights,
)


def _slow_reference(logits, tokens, temperature):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_gathered_logprobs_equal_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g) * 5
    tokens = torch.randint(0, 11, (3, 7), generator=g)
    for temperature in (1.0, 0.7, 1.5):
        assert torch.allclose(
            logprobs_from_logits(logits, tokens, temperature),
            _slow_reference(logits, tokens, temperature),
            atol=1e-5,
        )


def test_next_token_alignment():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g)
    tokens = torch.randint(0, 6, (2, 4), generator=g)
    lp = next_token_logprobs(logits, tokens)
    assert lp.shape == (2, 3)
    # position t scores token t+1 with the logits of position t
    assert torch.isclose(lp[1, 2], torch.log_softmax(logits[1, 2], -1)[tokens[1, 3]])


def test_stable_for_huge_logits_and_half_precision():
    logits = torch.tensor([[[1e4, 0.0, -1e4]]])
    lp = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert torch.isfinite(lp).all() and lp.item() == -1e4
    bf = logprobs_from_logits(logits.bfloat16(), torch.tensor([[0]]))
    assert bf.dtype == torch.float32 and bf.item() == 0.0


def test_entropy_worked_example():
    # uniform over 4 → log 4; one-hot-ish → ≈ 0
    assert torch.isclose(entropy_from_logits(torch.zeros(4)), torch.log(torch.tensor(4.0)))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() < 1e-6
    # temperature sharpens
    x = torch.tensor([1.0, 0.0, -1.0])
    assert entropy_from_logits(x, temperature=0.5) < entropy_from_logits(x)


def test_logprob_mismatch_worked_example():
    # d = |engine - trainer| on the masked positions = [0.0, 0.1, 0.3]; the 4th position is masked
    engine = torch.tensor([[-1.0, -2.1, -0.7, -9.0]])
    trainer = torch.tensor([[-1.0, -2.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = logprob_mismatch(engine, trainer, mask)
    assert float(out["logprob_diff_mean"]) == pytest.approx(0.4 / 3, abs=1e-6)
    assert float(out["logprob_diff_max"]) == pytest.approx(0.3, abs=1e-6)
    # (e^0 + e^0.1 + e^0.3) / 3 = (1 + 1.10517 + 1.34986) / 3
    assert float(out["token_prob_error"]) == pytest.approx(1.151677, abs=1e-5)


def test_logprob_mismatch_ignores_masked_positions_and_is_neutral_when_equal():
    a = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(5) < torch.tensor([[2], [5], [0]])).float()
    noisy = a + 100.0 * (1 - mask)  # only unmasked positions differ
    out = logprob_mismatch(noisy, a, mask)
    assert float(out["logprob_diff_mean"]) == 0.0 and float(out["logprob_diff_max"]) == 0.0
    assert float(out["token_prob_error"]) == 1.0
    empty = logprob_mismatch(a, a + 1, torch.zeros_like(a))
    assert [float(v) for v in empty.values()] == [0.0, 0.0, 1.0]


def test_truncated_is_weights_worked_example():
    # the docstring's example: ratios exp(0.1) and exp(-1.0) stay, a ratio of 3 is capped at 2
    trainer = torch.tensor([[-1.0, -2.0, -1.0]])
    engine = torch.tensor([[-1.1, -1.0, -1.0 - float(torch.log(torch.tensor(3.0)))]])
    w = truncated_is_weights(trainer, engine, cap=2.0)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert w.tolist()[0] == pytest.approx([1.105171, 0.367879, 2.0], abs=1e-6)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(trainer, engine, cap=0.0)
