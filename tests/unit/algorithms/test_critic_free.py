"""The critic-free estimators: worked examples, the vectorised forms against plain loops, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.algorithms import (
    aggregate,
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    grpo_advantages_reference,
    kl_penalty,
    masked_mean,
    masked_mean_var,
    ppo_policy_loss,
    reinforce_pp_advantages,
    response_mask,
    returns_to_go,
    returns_to_go_reference,
    rloo_advantages,
    rloo_advantages_reference,
    sequence_kl,
)


def test_sequence_kl_worked_example_ignores_masked_positions():
    kl = torch.tensor([[0.1, 0.2, float("nan")], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(sequence_kl(kl, mask, "sum"), torch.tensor([0.3, 0.0]))  # 0.1 + 0.2; none
    assert torch.allclose(sequence_kl(kl, mask, "mean"), torch.tensor([0.15, 0.0]))  # 0.3 / 2; none
    with pytest.raises(ValueError, match="reduction"):
        sequence_kl(kl, mask, "max")


def test_rloo_worked_example():
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0])
    # G = 2: each row's baseline is its group-mate: [0, 1, 1, 2] → [1−0, 0−1, 2−1, 1−2]
    assert torch.equal(rloo_advantages(scores, 2), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # NeMo-Aligner: only responses that ended enter baselines. Row 3's only mate (row 4) did not
    # end → no baseline → 0; row 4 is judged against row 3: 1 − 2 = −1
    valid = torch.tensor([True, True, True, False])
    assert torch.equal(rloo_advantages(scores, 2, valid), torch.tensor([1.0, -1.0, 0.0, -1.0]))


def test_rloo_group_of_three_worked_example():
    scores = torch.tensor([3.0, 0.0, 0.0])
    # baselines: (0+0)/2 = 0, (3+0)/2 = 1.5, 1.5 → [3, −1.5, −1.5], summing to 0
    assert torch.allclose(rloo_advantages(scores, 3), torch.tensor([3.0, -1.5, -1.5]))


def test_grpo_worked_example_and_dr_grpo():
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(((0.5)² + (0.5)²) / 1) = 0.7071 → ±0.5 / 0.7071 = ±0.7071
    # group 2: all equal → 0 (no division by zero)
    a = grpo_advantages(scores, 2)
    assert torch.allclose(a, torch.tensor([math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0]), atol=1e-5)
    assert torch.equal(grpo_advantages(scores, 2, scale_by_std=False), torch.tensor([0.5, -0.5, 0.0, 0.0]))


@pytest.mark.parametrize("fn", [rloo_advantages, grpo_advantages])
def test_group_sizes_are_checked(fn):
    with pytest.raises(ValueError, match="at least 2"):
        fn(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        fn(torch.zeros(4), 3)


def test_returns_to_go_worked_example():
    rewards = torch.tensor([[0.0, -0.1, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # γ = 1: G = [0 − 0.1 + 1, −0.1 + 1, 1, (masked) 0]
    assert torch.allclose(returns_to_go(rewards, mask, 1.0), torch.tensor([[0.9, 0.9, 1.0, 0.0]]))
    # γ = 0.5: G2 = 1, G1 = −0.1 + 0.5, G0 = 0 + 0.5·0.4
    assert torch.allclose(returns_to_go(rewards, mask, 0.5), torch.tensor([[0.2, 0.4, 1.0, 0.0]]))


def test_reinforce_pp_worked_example():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    # returns [[1, 1], [3, 3]] → mean 2, variance 1 → [[−1, −1], [1, 1]]
    a = reinforce_pp_advantages(rewards, mask, 1.0)
    assert torch.allclose(a, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]), atol=1e-6)


def test_broadcast_to_tokens_worked_example():
    mask = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    assert torch.equal(
        broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask), torch.tensor([[0.0, 2.0], [-1.0, -1.0]])
    )


groups = st.tuples(st.integers(1, 4), st.integers(2, 5), st.integers(0, 10_000))


@settings(max_examples=40, deadline=None)
@given(groups, st.booleans())
def test_rloo_equals_the_loop_and_sums_to_zero_per_group(shape, with_valid):
    n_groups, g, seed = shape
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_groups * g, generator=gen, dtype=torch.float64)
    valid = torch.rand(n_groups * g, generator=gen) > 0.3 if with_valid else None
    fast = rloo_advantages(scores, g, valid)
    assert torch.allclose(fast, rloo_advantages_reference(scores, g, valid))
    if valid is None:  # Σ_i (r_i − (S − r_i)/(G−1)) = S − (G·S − S)/(G−1) = 0
        assert torch.allclose(
            fast.reshape(-1, g).sum(-1), torch.zeros(n_groups, dtype=torch.float64), atol=1e-9
        )


@settings(max_examples=40, deadline=None)
@given(groups, st.booleans())
def test_grpo_equals_the_loop_with_mean_zero_and_unit_std(shape, scale):
    n_groups, g, seed = shape
    scores = torch.randn(n_groups * g, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    fast = grpo_advantages(scores, g, scale_by_std=scale, eps=0.0)
    assert torch.allclose(fast, grpo_advantages_reference(scores, g, scale_by_std=scale, eps=0.0))
    per_group = fast.reshape(-1, g)
    assert torch.allclose(per_group.mean(-1), torch.zeros(n_groups, dtype=torch.float64), atol=1e-9)
    if scale:
        assert torch.allclose(per_group.std(-1), torch.ones(n_groups, dtype=torch.float64))
    else:  # Dr. GRPO is GRPO without the division
        std = scores.reshape(-1, g).std(-1, keepdim=True)
        assert torch.allclose(per_group / std, grpo_advantages(scores, g, eps=0.0).reshape(-1, g))


def _tokens(seed, b, s):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, s, generator=gen, dtype=torch.float64)
    prompt = torch.randint(1, s + 1, (b,), generator=gen)
    total = torch.minimum(prompt + torch.randint(1, s + 1, (b,), generator=gen), torch.tensor(s + 1))
    return rewards, response_mask(prompt, total, s, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_returns_to_go_equals_the_loop_and_gae_without_values(b, s, gamma, seed):
    rewards, mask = _tokens(seed, b, s)
    fast = returns_to_go(rewards, mask, gamma)
    assert torch.allclose(fast, returns_to_go_reference(rewards, mask, gamma))
    adv, _ = gae(torch.zeros_like(rewards), rewards, mask, gamma, 1.0)
    assert torch.allclose(select(fast, mask), select(adv, mask))
    if gamma == 1.0:  # reverse cumulative sum of the masked rewards
        masked = rewards * mask
        assert torch.allclose(select(fast, mask), select(masked.flip(-1).cumsum(-1).flip(-1), mask))


def select(x, mask):
    return x[mask.bool()]


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(2, 9), st.integers(0, 10_000))
def test_reinforce_pp_whitens_and_ignores_padding(b, s, seed):
    rewards, mask = _tokens(seed, b, s)
    a = reinforce_pp_advantages(rewards, mask, 1.0, eps=0.0)
    mean, var = masked_mean_var(a, mask)
    if mask.sum() > 1 and float(masked_mean_var(returns_to_go(rewards, mask, 1.0), mask)[1]) > 1e-6:
        assert abs(float(mean)) < 1e-9 and abs(float(var) - 1) < 1e-6
    poisoned = torch.where(mask.bool(), rewards, torch.full_like(rewards, float("nan")))
    assert torch.equal(reinforce_pp_advantages(poisoned, mask, 1.0, eps=0.0), a)
    assert torch.all(a[~mask.bool()] == 0)


def test_token_sum_norm_aggregation_worked_example():
    loss = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # each sample's token sum / 4: 2/4 and 2/4 → mean 0.5 (token_mean would give 4/3)
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm", norm_length=4)) == 0.5
    assert float(aggregate(loss, mask, "token_mean")) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(loss, mask, "seq_mean_token_sum_norm")


def _loss_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(2, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = -torch.rand(2, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    return logprobs, ref, adv, mask


def test_the_kl_loss_term_adds_beta_times_the_masked_kl_and_its_gradient():
    logprobs, ref, adv, mask = _loss_inputs()
    old = logprobs.detach()
    plain, stats0 = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    off, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, init_logprobs=ref, kl_coef=0.0)
    assert torch.equal(plain, off) and float(stats0.kl_loss) == 0.0
    with_kl, stats = ppo_policy_loss(
        logprobs, old, adv, mask, 0.2, init_logprobs=ref, kl_coef=0.5, kl_kind="k3"
    )
    k3 = masked_mean(kl_penalty(old, ref, "k3"), mask)
    assert torch.allclose(stats.kl_loss, k3) and torch.allclose(with_kl, plain + 0.5 * k3)
    # k1: d(β·mean(logπ − logπ_ref))/d logπ_t = β / (valid tokens) on every valid token, 0 elsewhere
    (grad_plain,) = torch.autograd.grad(plain, logprobs)
    k1, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, init_logprobs=ref, kl_coef=0.5, kl_kind="k1")
    (grad_k1,) = torch.autograd.grad(k1, logprobs)
    assert torch.allclose(grad_k1 - grad_plain, 0.5 * mask / mask.sum())
    # inf/NaN reference log-probs at masked positions change nothing
    poisoned = torch.where(mask.bool(), ref, torch.full_like(ref, float("nan")))
    again, _ = ppo_policy_loss(
        logprobs, old, adv, mask, 0.2, init_logprobs=poisoned, kl_coef=0.5, kl_kind="k3"
    )
    assert torch.equal(again, with_kl)
