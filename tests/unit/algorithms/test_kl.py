import math

import pytest
import torch

from openaligner.algorithms import AdaptiveKLController, FixedKLController, kl_penalty

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])
# Δ = logp − ref = [0.5, −1.0, 0.0]


def test_k1_abs_k2_k3_worked_example():
    assert torch.allclose(kl_penalty(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.allclose(kl_penalty(LOGP, REF, "abs"), torch.tensor([[0.5, 1.0, 0.0]]))
    # ½Δ²: 0.125, 0.5, 0
    assert torch.allclose(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))
    # exp(−Δ) − 1 + Δ: e^-0.5 − 0.5 ≈ 0.10653, e^1 − 2 ≈ 0.71828, 0
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert torch.allclose(kl_penalty(LOGP, REF, "k3"), expected, atol=1e-6)


def test_k3_is_nonnegative_and_unbiased_for_kl():
    # Sampling x ~ p, the mean of k3 (with Δ = log p − log q) estimates KL(p‖q).
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    k3 = kl_penalty(p.log()[x], q.log()[x], "k3")
    true_kl = (p * (p / q).log()).sum()
    assert (k3 >= 0).all()
    assert abs(k3.mean().item() - true_kl.item()) < 5e-3


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="k1, abs, k2, k3"):
        kl_penalty(LOGP, REF, "k4")


def test_fixed_controller_keeps_value():
    c = FixedKLController(0.05)
    assert c.update(100.0, 64) == 0.05


def test_adaptive_controller_moves_toward_target():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # KL above target → error clipped to +0.2 → β · (1 + 0.2 · 64 / 10000)
    assert c.update(12.0, 64) == pytest.approx(0.1 * (1 + 0.2 * 64 / 10_000))
    before = c.value
    # KL below target by half → error −0.5 clipped to −0.2 → β shrinks
    assert c.update(3.0, 64) == pytest.approx(before * (1 - 0.2 * 64 / 10_000))
    state = c.state_dict()
    d = AdaptiveKLController(1.0, target=6.0, horizon=10_000)
    d.load_state_dict(state)
    assert d.value == c.value


def test_k3_stays_finite_for_huge_log_ratios():
    # Δ = logp − ref = −200: exp(200) overflows float32; the estimator is evaluated at Δ = −20
    logp = torch.tensor([[-200.0, -30.0, -1.0, 0.0]])
    ref = torch.zeros(1, 4)
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    bound = math.expm1(20.0) - 20.0
    assert k3[0, 0].item() == pytest.approx(bound, rel=1e-6)
    assert k3[0, 1].item() == pytest.approx(bound, rel=1e-6)
    # exact inside the bound
    assert k3[0, 2].item() == pytest.approx(math.expm1(1.0) - 1.0, rel=1e-6)
    assert k3[0, 3].item() == 0.0
