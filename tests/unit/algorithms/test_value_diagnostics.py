"""The critic's error by response position and the wrong-sign share, on hand-made rollouts."""

import math

import torch

from openaligner.algorithms import (
    gae,
    position_bands,
    returns_to_go,
    value_error_by_position,
    wrong_sign_fraction,
)


def test_position_bands_by_hand():
    # one prompt position, then responses of 4, 1 and 3 tokens (the rest padding)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.float32)
    bands = {k: v.int().tolist() for k, v in position_bands(mask).items()}
    # l = 4: r = k/3 → k=0 early (0 < 1/3), k=1 middle (1/3), k=2, 3 late (≥ 2/3); final k=3
    # l = 1: its only token is late and final; l = 3: r = 0, 1/2, 1 → early, middle, late
    assert bands["early"] == [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert bands["middle"] == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0]]
    assert bands["late"] == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]
    assert bands["final"] == [[0, 0, 0, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]


def test_value_error_by_position_on_a_hand_made_rollout():
    # two responses of 3 tokens after one prompt position; the score (1 and 0) on the last token
    mask = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 1]])
    rewards = torch.tensor([[9.0, 0, 0, 1], [9.0, 0, 0, 0]])  # 9 at the prompt position is masked away
    values = torch.tensor([[5.0, 0.0, 1.0, 2.0], [5.0, 0.5, 0.5, 0.5]])
    g = returns_to_go(rewards, mask, 1.0)  # [·, 1, 1, 1] and [·, 0, 0, 0]
    err = value_error_by_position(values, g, mask)
    # |V − G|: row 0: |0−1|, |1−1|, |2−1| = 1, 0, 1; row 1: 0.5, 0.5, 0.5
    # early (k=0): (1 + 0.5)/2 = 0.75; middle (k=1): (0 + 0.5)/2 = 0.25; late = final (k=2): 0.75
    assert {k: round(float(v), 6) for k, v in err.items()} == {
        "early": 0.75,
        "middle": 0.25,
        "late": 0.75,
        "final": 0.75,
    }
    # a band no response reaches is NaN (responses of 1 token have no early token)
    one = torch.tensor([[0.0, 1.0]])
    assert math.isnan(float(value_error_by_position(one, one, one)["early"]))


def test_wrong_sign_fraction_on_a_hand_made_rollout():
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    advantages = torch.tensor([[0.5, -0.2, 0.1, 0.0, 7.0]])
    values = torch.zeros(1, 5)
    g = torch.tensor([[1.0, 1.0, -1.0, 1.0, -9.0]])
    # A_MC = G − V = G; A·A_MC = 0.5, −0.2, −0.1, 0 (and the masked −63 does not count): 2 of 4
    assert float(wrong_sign_fraction(advantages, values, g, mask)) == 0.5


def test_wrong_sign_from_a_biased_critic_under_gae():
    # one response of 3 tokens, score 1 at the end, so G = [1, 1, 1]
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    g = returns_to_go(rewards, mask, 1.0)
    # an accurate critic (V = G): A_MC = 0 everywhere, nothing counts as wrong
    adv, _ = gae(g, rewards, mask, 1.0, 0.0)
    assert float(wrong_sign_fraction(adv, g, g, mask)) == 0.0
    # a critic biased at the first token: V = [0.5, 0, 0]. λ = 0 bootstraps from V_{t+1}:
    # δ = [0 + 0 − 0.5, 0 + 0 − 0, 1 + 0 − 0] = [−0.5, 0, 1]; A_MC = G − V = [0.5, 1, 1]
    # products −0.25 (wrong), 0 (not counted), 1 → 1 of 3 tokens has the wrong sign
    values = torch.tensor([[0.5, 0.0, 0.0]])
    adv, _ = gae(values, rewards, mask, 1.0, 0.0)
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.0, 1.0]]))
    assert math.isclose(float(wrong_sign_fraction(adv, values, g, mask)), 1 / 3)
    # λ = 1 is the Monte-Carlo advantage itself: never a wrong sign
    adv, _ = gae(values, rewards, mask, 1.0, 1.0)
    assert float(wrong_sign_fraction(adv, values, g, mask)) == 0.0
