import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.algorithms import gae, gae_reference, response_mask, td_errors


def test_gae_worked_example_from_reference():
    values = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.ones(1, 4)
    adv, ret = gae(values, rewards, mask, gamma=0.5, lam=0.0)
    # λ = 0: A_t = δ_t = r_t + γ V_{t+1} − V_t
    # t0: 0 + 0.5·1 − 0 = 0.5; t1: 0 + 0.5·2 − 1 = 0; t2: 1 + 0.5·3 − 2 = 0.5; t3: 0 + 0 − 3 = −3
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, 0.5, -3.0]]))
    assert torch.allclose(ret, adv + values)


def test_gae_worked_example_with_lambda_and_mask():
    values = torch.tensor([[9.0, 1.0, 2.0, 7.0]])
    rewards = torch.tensor([[5.0, 0.0, 1.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(values, rewards, mask, gamma=1.0, lam=0.5)
    # masked: V = [0, 1, 2, 0], r = [0, 0, 1, 0]
    # δ = [0+1−0, 0+2−1, 1+0−2, 0] = [1, 1, −1, 0]
    # A3 = 0; A2 = −1; A1 = 1 + 0.5·(−1) = 0.5; A0 = 1 + 0.5·0.5 = 1.25
    assert torch.allclose(adv, torch.tensor([[1.25, 0.5, -1.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.25, 1.5, 1.0, 0.0]]))


def _batch(seed, b, s):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, s, generator=g, dtype=torch.float64)
    rewards = torch.randn(b, s, generator=g, dtype=torch.float64)
    prompt = torch.randint(1, s + 1, (b,), generator=g)
    total = torch.minimum(prompt + torch.randint(1, s + 1, (b,), generator=g), torch.tensor(s + 1))
    mask = response_mask(prompt, total, s, dtype=torch.float64)
    return values, rewards, mask


params = st.tuples(
    st.integers(0, 10_000),
    st.integers(1, 6),
    st.integers(1, 40),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)


@settings(max_examples=80, deadline=None)
@given(params)
def test_vectorised_equals_reference_loop(p):
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    adv, ret = gae(values, rewards, mask, gamma, lam)
    adv_ref, ret_ref = gae_reference(values, rewards, mask, gamma, lam)
    assert torch.allclose(adv, adv_ref, atol=1e-9)
    assert torch.allclose(ret, ret_ref, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(params)
def test_lambda_zero_is_one_step_td_error(p):
    seed, b, s, gamma, _ = p
    values, rewards, mask = _batch(seed, b, s)
    adv, _ = gae(values, rewards, mask, gamma, 0.0)
    assert torch.allclose(adv, td_errors(values, rewards, mask, gamma), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(params)
def test_gamma_lambda_one_is_reward_to_go_minus_values(p):
    seed, b, s, _, _ = p
    values, rewards, mask = _batch(seed, b, s)
    adv, ret = gae(values, rewards, mask, 1.0, 1.0)
    r = rewards * mask
    reward_to_go = r.flip(-1).cumsum(-1).flip(-1)
    assert torch.allclose(adv * mask, (reward_to_go - values * mask) * mask, atol=1e-9)
    assert torch.allclose(ret * mask, reward_to_go * mask, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(params, st.floats(-100, 100) | st.sampled_from([math.inf, -math.inf, math.nan]))
def test_padded_positions_never_change_masked_outputs(p, junk):
    # inf/NaN included: the discount matmul would spread one along its whole row
    seed, b, s, gamma, lam = p
    values, rewards, mask = _batch(seed, b, s)
    noisy_v = torch.where(mask.bool(), values, values + junk)
    noisy_r = torch.where(mask.bool(), rewards, rewards - junk)
    a1, r1 = gae(values, rewards, mask, gamma, lam)
    a2, r2 = gae(noisy_v, noisy_r, mask, gamma, lam)
    valid = mask.bool()
    assert torch.allclose(a1[valid], a2[valid], atol=1e-9)
    assert torch.allclose(r1[valid], r2[valid], atol=1e-9)
    assert torch.isfinite(a2).all() and torch.isfinite(r2).all()
    a3, r3 = gae_reference(noisy_v, noisy_r, mask, gamma, lam)
    assert torch.allclose(a3[valid], a1[valid], atol=1e-9)
    assert torch.allclose(r3[valid], r1[valid], atol=1e-9)


def test_long_sequences_stay_finite():
    values, rewards, mask = _batch(3, 2, 3000)
    adv, ret = gae(values.float(), rewards.float(), mask.float(), 0.99, 0.95)
    ref, _ = gae_reference(values, rewards, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.allclose(adv.double(), ref, atol=1e-3)
