"""Decoupled GAE (the critic's returns and the policy's advantages with their own γ and λ) and the
length-adaptive policy λ: worked examples by hand, and the properties that tie them to plain GAE."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_advantages import _batch, params  # plain GAE's batches: the properties compare against it

from openaligner.algorithms import decoupled_gae, gae, gae_per_row_lambda, length_adaptive_lambda


def test_decoupled_gae_worked_example():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    adv, ret = decoupled_gae(values, rewards, mask, gamma=1.0, lam=0.5, critic_gamma=1.0, critic_lam=1.0)
    # δ_t = r_t + V_{t+1} − V_t: δ0 = 0 + 2 − 1 = 1, δ1 = 0 + 3 − 2 = 1, δ2 = 1 + 0 − 3 = −2
    # policy, λ = 0.5: A2 = −2; A1 = 1 + 0.5·(−2) = 0; A0 = 1 + 0.5·0 = 1
    assert torch.allclose(adv, torch.tensor([[1.0, 0.0, -2.0]]))
    # critic, λ = 1: A2 = −2; A1 = 1 − 2 = −1; A0 = 1 − 1 = 0; returns = A + V = [1, 1, 1],
    # the reward-to-go (the only reward, 1, is at the end), whatever the values
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    # coupled GAE at λ = 0.5 would have trained the critic toward A + V = [2, 2, 1] instead
    assert torch.allclose(gae(values, rewards, mask, 1.0, 0.5)[1], torch.tensor([[2.0, 2.0, 1.0]]))


def test_decoupled_gamma_worked_example():
    values = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # a prompt position, then 3 response tokens
    _, ret = decoupled_gae(values, rewards, mask, gamma=1.0, lam=1.0, critic_gamma=0.5, critic_lam=1.0)
    # V = 0, so returns = Σ γ^k r: position 3: 1; 2: 0.5·1 = 0.5; 1: 0.25; 0 (masked): 0 + 0.5·0.25
    assert torch.allclose(ret * mask, torch.tensor([[0.0, 0.25, 0.5, 1.0]]))


def test_length_adaptive_lambda_worked_example():
    # λ = 1 − 1/(α·l), α = 0.5: l=2 → 1 − 1/1 = 0; l=4 → 1 − 1/2 = 0.5; l=10 → 1 − 1/5 = 0.8;
    # l=1 → 1 − 2 = −1, clamped to 0
    lam = length_adaptive_lambda(torch.tensor([2, 4, 10, 1]), alpha=0.5)
    assert torch.allclose(lam, torch.tensor([0.0, 0.5, 0.8, 0.0], dtype=torch.float64))


def test_length_adaptive_gae_worked_example():
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0], [1.0, 2.0, 3.0, 4.0]])
    rewards = torch.tensor([[0.0, 1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    lam = length_adaptive_lambda(mask.sum(-1), alpha=0.5)  # l = 2 → λ = 0; l = 4 → λ = 0.5
    adv, _ = decoupled_gae(values, rewards, mask, gamma=1.0, lam=lam, critic_gamma=1.0, critic_lam=1.0)
    # row 0 (padding after 2 tokens is masked away): δ0 = 0 + 2 − 1 = 1, δ1 = 1 + 0 − 2 = −1; λ = 0: A = δ
    # row 1: δ = [1, 1, 1, 1 + 0 − 4 = −3]; λ = 0.5: A3 = −3, A2 = 1 − 1.5 = −0.5,
    #        A1 = 1 − 0.25 = 0.75, A0 = 1 + 0.375 = 1.375
    assert torch.allclose(adv[0, :2], torch.tensor([1.0, -1.0]))
    assert torch.allclose(adv[1], torch.tensor([1.375, 0.75, -0.5, -3.0]))


@settings(max_examples=60, deadline=None)
@given(params)
def test_equal_lambdas_are_todays_gae_bitwise(p):
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    adv, ret = decoupled_gae(values, rewards, mask, gamma=gamma, lam=lam, critic_gamma=gamma, critic_lam=lam)
    adv_ref, ret_ref = gae(values, rewards, mask, gamma, lam)
    assert torch.equal(adv, adv_ref) and torch.equal(ret, ret_ref)


@settings(max_examples=60, deadline=None)
@given(params)
def test_critic_lambda_and_gamma_one_give_the_reward_to_go(p):
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    adv, ret = decoupled_gae(values, rewards, mask, gamma=gamma, lam=lam, critic_gamma=1.0, critic_lam=1.0)
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    assert torch.allclose(ret * mask, reward_to_go * mask, atol=1e-9)
    assert torch.equal(adv, gae(values, rewards, mask, gamma, lam)[0])  # the policy's side is untouched


@settings(max_examples=25, deadline=None)
@given(params, st.floats(0.01, 2.0))
def test_padded_positions_never_change_outputs(p, alpha):
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    per_row = length_adaptive_lambda(mask.sum(-1), alpha)
    for policy_lam in (lam, per_row):
        adv, ret = decoupled_gae(
            values, rewards, mask, gamma=gamma, lam=policy_lam, critic_gamma=1.0, critic_lam=1.0
        )
        # garbage (even inf and NaN) where the mask is 0
        junk_v = torch.where(mask > 0, values, torch.full_like(values, float("nan")))
        junk_r = torch.where(mask > 0, rewards, torch.full_like(rewards, float("inf")))
        adv2, ret2 = decoupled_gae(
            junk_v, junk_r, mask, gamma=gamma, lam=policy_lam, critic_gamma=1.0, critic_lam=1.0
        )
        valid = mask > 0
        assert torch.equal(adv[valid], adv2[valid]) and torch.equal(ret[valid], ret2[valid])
        # extra padding columns after the last position change nothing either
        pad = (0, 3)
        adv3, ret3 = decoupled_gae(
            torch.nn.functional.pad(values, pad, value=7.0),
            torch.nn.functional.pad(rewards, pad, value=-5.0),
            torch.nn.functional.pad(mask, pad),
            gamma=gamma,
            lam=policy_lam,
            critic_gamma=1.0,
            critic_lam=1.0,
        )
        assert torch.allclose(adv3[:, :s][valid], adv[valid], atol=1e-12)
        assert torch.allclose(ret3[:, :s][valid], ret[valid], atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(params)
def test_per_row_lambda_equal_on_every_row_is_gae(p):
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    adv, ret = gae_per_row_lambda(values, rewards, mask, gamma, torch.full((b,), lam, dtype=torch.float64))
    adv_ref, ret_ref = gae(values, rewards, mask, gamma, lam)
    assert torch.allclose(adv, adv_ref, atol=1e-9) and torch.allclose(ret, ret_ref, atol=1e-9)


def test_length_adaptive_lambda_refuses_a_bad_alpha_and_a_misshapen_lambda():
    import pytest

    with pytest.raises(ValueError, match="α must be > 0"):
        length_adaptive_lambda(torch.tensor([3]), alpha=0.0)
    values, rewards, mask = _batch(0, 2, 4)
    with pytest.raises(ValueError, match=r"\[B\]"):
        gae_per_row_lambda(values, rewards, mask, 1.0, torch.ones(3))
