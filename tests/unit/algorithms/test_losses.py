import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate,
    aggregation_units,
    explained_variance,
    ppo_policy_loss,
    value_loss,
)


def test_policy_loss_worked_example():
    # ratios e^{0.1}≈1.105 (inside 0.2), e^{0.5}≈1.649 (above), e^{−0.5}≈0.607 (below)
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.1, 0.5, -0.5]])
    adv = torch.tensor([[1.0, 2.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    # t0: max(−1·1.105, −1·1.105) = −1.105
    # t1: A>0, ratio clipped to 1.2: max(−2·1.649, −2·1.2) = −2.4
    # t2: A<0, ratio clipped to 0.8: max(0.607, 0.8) = 0.8
    expected = (-math.exp(0.1) - 2.4 + 0.8) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats.clip_fraction.item() == pytest.approx(2 / 3)
    assert stats.ratio_mean.item() == pytest.approx((math.exp(0.1) + math.exp(0.5) + math.exp(-0.5)) / 3)
    assert stats.ratio_clamped_mean.item() == pytest.approx((math.exp(0.1) + 1.2 + 0.8) / 3)
    # approx KL (k3 of old‖new): mean of (r − 1) − log r
    k3 = [math.exp(x) - 1 - x for x in (0.1, 0.5, -0.5)]
    assert stats.approx_kl.item() == pytest.approx(sum(k3) / 3, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 0.5))
def test_inside_clip_range_loss_is_minus_advantage_times_ratio(seed, eps):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    # log-ratios well inside (log(1−ε), log(1+ε))
    log_ratio = (torch.rand(3, 5, generator=g, dtype=torch.float64) * 2 - 1) * 0.9 * math.log1p(eps) * 0.9
    new = (old + log_ratio).requires_grad_()
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    mask[0, 0] = 1.0
    loss, stats = ppo_policy_loss(new, old, adv, mask, clip_eps=eps)
    ratio = torch.exp(new - old)
    expected = ((-adv * ratio) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected)
    assert stats.clip_fraction.item() == 0.0
    # and so is the gradient
    (g1,) = torch.autograd.grad(loss, new)
    (g2,) = torch.autograd.grad(expected, new)
    assert torch.allclose(g1, g2)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    new = torch.tensor([[2.0, 2.0]])  # ratio e² ≈ 7.39
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    capped, stats = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    # t0 plain: max(7.39, 1.2) = 7.39; dual-clipped: min(7.39, 3) = 3. t1: −1.2 either way.
    assert plain.item() == pytest.approx((math.exp(2) - 1.2) / 2, rel=1e-6)
    assert capped.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-6)
    assert stats.dual_clip_fraction.item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(new, old, adv, mask, clip_eps=0.2, dual_clip=0.5)


def test_is_weights_weigh_each_tokens_clipped_term_and_carry_no_gradient():
    # the worked example's tokens (pg terms −1.105, −2.4, 0.8), weighted 0.5, 2.0 and 1.0 after
    # clipping; a masked 4th position holds a NaN weight that must change nothing
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.1, 0.5, -0.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights = torch.tensor([[0.5, 2.0, 1.0, float("nan")]], requires_grad=True)
    loss, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2, is_weights=weights)
    expected = (0.5 * -math.exp(0.1) + 2.0 * -2.4 + 0.8) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert weights.grad is None  # the weights are constants of the loss
    assert new.grad is not None
    # t0 is inside the clip range: d/dlogp of −A·w·ratio = −1 · 0.5 · e^0.1 / 3
    assert new.grad[0, 0].item() == pytest.approx(-0.5 * math.exp(0.1) / 3, rel=1e-6)
    assert new.grad[0, 1].item() == 0.0 and new.grad[0, 3].item() == 0.0  # clipped; masked
    ones, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2, is_weights=torch.ones(1, 4))
    plain, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    assert ones.item() == plain.item()


def test_is_end_gating_removes_gradient_of_unfinished_samples():
    old = torch.zeros(2, 3)
    new = torch.zeros(2, 3, requires_grad=True)
    adv = torch.ones(2, 3)
    mask = torch.ones(2, 3)
    loss, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2, is_end=torch.tensor([True, False]))
    loss.backward()
    assert new.grad is not None
    assert new.grad[1].abs().sum().item() == 0.0
    assert new.grad[0].abs().sum().item() > 0.0
    # nobody ended → zero loss and zero gradient, but still differentiable
    new2 = torch.zeros(2, 3, requires_grad=True)
    loss2, _ = ppo_policy_loss(new2, old, adv, mask, clip_eps=0.2, is_end=torch.tensor([False, False]))
    loss2.backward()
    assert loss2.item() == 0.0 and new2.grad is not None and new2.grad.abs().sum().item() == 0.0


def test_entropy_bonus_and_aggregation():
    old = torch.zeros(2, 3)
    new = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    tok, st_tok = ppo_policy_loss(new, old, adv, mask, 0.2, entropy=ent, entropy_coef=0.1)
    # token mean: pg = −(1+1+1+4)/4 = −1.75; entropy mean (1+1+1+3)/4 = 1.5 → −1.75 − 0.15
    assert tok.item() == pytest.approx(-1.9)
    assert st_tok.entropy.item() == pytest.approx(1.5)
    seq, _ = ppo_policy_loss(new, old, adv, mask, 0.2, aggregation="seq_mean_token_mean")
    # per sample: −1 and −4 → −2.5
    assert seq.item() == pytest.approx(-2.5)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(adv, mask, "sum")


def test_value_loss_worked_example():
    values = torch.tensor([[1.0, 0.5, 3.0]])
    old = torch.tensor([[0.0, 0.4, 3.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    # t0: V moved 1.0 > 0.2 → V_clip = 0.2; max((0.2−2)², (1−2)²) = max(3.24, 1) = 3.24
    # t1: moved 0.1 → V_clip = V = 0.5; (0.5)² = 0.25. t2 masked.
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25) / 2)
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.25) / 2)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean_pred = torch.full_like(returns, 2.5)
    assert explained_variance(mean_pred, returns, mask).item() == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 4), mask).item())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(-100, 100) | st.sampled_from([math.inf, -math.inf, math.nan]))
def test_losses_ignore_padded_positions(seed, junk):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6)
    new, old, adv = (torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(*shape, generator=g) > 0.4).double()
    pad = ~mask.bool()
    l1, _ = ppo_policy_loss(new, old, adv, mask, 0.2)
    l2, _ = ppo_policy_loss(
        new.masked_fill(pad, junk), old.masked_fill(pad, -junk), adv.masked_fill(pad, junk), mask, 0.2
    )
    assert torch.allclose(l1, l2)
    v1, _ = value_loss(new, old, adv, mask, 0.2)
    v2, _ = value_loss(new.masked_fill(pad, junk), old, adv.masked_fill(pad, junk), mask, 0.2)
    assert torch.allclose(v1, v2)


@pytest.mark.parametrize("junk", [math.inf, -math.inf, math.nan, 1e4])
def test_nonfinite_values_at_masked_positions_leave_loss_gradient_and_stats_finite(junk):
    # e.g. rollout log-probs are unspecified past a row's length: exp(new − old) may overflow there
    g = torch.Generator().manual_seed(0)
    new = torch.randn(2, 5, generator=g, dtype=torch.float64)
    old, adv = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    pad = ~mask.bool()
    clean = new.clone().requires_grad_(True)
    dirty = new.clone().requires_grad_(True)
    l1, s1 = ppo_policy_loss(clean, old, adv.double(), mask, 0.2, entropy=clean.abs(), entropy_coef=0.1)
    l2, s2 = ppo_policy_loss(
        dirty,
        old.masked_fill(pad, -junk),
        adv.double().masked_fill(pad, junk),
        mask,
        0.2,
        entropy=dirty.abs().masked_fill(pad, junk),
        entropy_coef=0.1,
    )
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2) and torch.equal(clean.grad, dirty.grad)
    for field in ("clip_fraction", "approx_kl", "ratio_mean", "ratio_clamped_mean", "entropy"):
        assert torch.equal(getattr(s1, field), getattr(s2, field)), field
    values = new.clone().requires_grad_(True)
    v, vs = value_loss(values, old, adv.double().masked_fill(pad, junk), mask, 0.2)
    v.backward()
    assert torch.isfinite(v) and torch.isfinite(values.grad).all()
    assert torch.isfinite(vs.explained_variance) and torch.isfinite(vs.returns_mean)


def test_units_make_micro_batch_losses_shares_of_the_whole_batch_worked_example():
    # one sample of 4 tokens with loss 1 each, one of 1 token with loss 5 (token_mean)
    long, short = torch.tensor([[1.0, 1, 1, 1]]), torch.tensor([[5.0, 0, 0, 0]])
    long_mask, short_mask = torch.ones(1, 4), torch.tensor([[1.0, 0, 0, 0]])
    # alone, each is its own mean: 1 and 5; averaging those (3) weighs the short one's token 4×
    assert aggregate(long, long_mask, "token_mean").item() == 1.0
    assert aggregate(short, short_mask, "token_mean").item() == 5.0
    # with the whole batch's 5 tokens as units: 4/5 + 5/5 = 9/5, the mean of all five tokens
    units = aggregation_units(torch.cat([long_mask, short_mask]), "token_mean")
    assert units.item() == 5.0
    shares = aggregate(long, long_mask, "token_mean", units=units) + aggregate(
        short, short_mask, "token_mean", units=units
    )
    assert shares.item() == pytest.approx(9 / 5)
    # the seq_mean_* aggregations count samples that have a valid token: here 2 of 3
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregation_units(mask, "seq_mean_token_mean").item() == 2.0
    assert aggregation_units(mask, "seq_mean_token_sum_norm").item() == 2.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregation_units(mask, "sum")


@settings(max_examples=25, deadline=None)
@given(
    aggregation=st.sampled_from(LOSS_AGGREGATIONS),
    cuts=st.lists(st.integers(1, 7), min_size=0, max_size=3, unique=True),
    seed=st.integers(0, 2**16),
)
def test_shares_over_any_split_sum_to_the_whole_batch_loss_and_gradient(aggregation, cuts, seed):
    """Split 8 rows of very different lengths anywhere: the micro-batches' losses with the whole
    batch's units add up to the whole batch's loss, and so do their gradients (float64, so the
    only difference is the summation order: rel 1e-12)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 8, 12
    lengths = torch.tensor([1, 12, 2, 9, 0, 5, 12, 3])[torch.randperm(rows, generator=g)]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    new = torch.randn(rows, width, generator=g, dtype=torch.float64)
    old = new.detach() + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    ref = new.detach() + 0.2 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    is_end = torch.rand(rows, generator=g) > 0.25
    loss_mask = mask * is_end.double()[:, None]

    def loss(lo: int, hi: int, params: torch.Tensor, units) -> tuple[torch.Tensor, object]:
        return ppo_policy_loss(
            params[lo:hi],
            old[lo:hi],
            adv[lo:hi],
            mask[lo:hi],
            0.2,
            aggregation=aggregation,
            norm_length=width,
            is_end=is_end[lo:hi],
            entropy=params[lo:hi].abs(),
            entropy_coef=0.1,
            init_logprobs=ref[lo:hi],
            kl_coef=0.05,
            units=units,
        )

    whole_params = new.clone().requires_grad_(True)
    whole, whole_stats = loss(0, rows, whole_params, None)
    whole.backward()
    units = aggregation_units(loss_mask, aggregation)
    split_params = new.clone().requires_grad_(True)
    bounds = [0, *sorted(cuts), rows]
    parts = [loss(lo, hi, split_params, units) for lo, hi in itertools.pairwise(bounds)]
    total = sum(p for p, _ in parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(split_params.grad, whole_params.grad, rtol=1e-12, atol=1e-15)
    for field in ("pg_loss", "entropy", "kl_loss"):
        summed = sum(getattr(s, field).item() for _, s in parts)
        assert summed == pytest.approx(getattr(whole_stats, field).item(), rel=1e-12, abs=1e-15), field
    # token means weighted by their token counts combine to the whole batch's
    tokens = sum(s.tokens.item() for _, s in parts)
    assert tokens == whole_stats.tokens.item() == mask.sum().item()
    ratio = sum(s.ratio_mean.item() * s.tokens.item() for _, s in parts) / tokens
    assert ratio == pytest.approx(whole_stats.ratio_mean.item(), rel=1e-12)
    # the value loss: the same with the whole batch's token count
    values = new.clone().requires_grad_(True)
    v_whole, _ = value_loss(values, old, adv, mask, 0.2)
    v_units = aggregation_units(mask, "token_mean")
    v_split = sum(
        value_loss(new[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], 0.2, units=v_units)[0]
        for lo, hi in itertools.pairwise(bounds)
    )
    assert float(v_split) == pytest.approx(v_whole.item(), rel=1e-12, abs=1e-15)
