import pytest
import torch

from openaligner.algorithms import gae, masked_whiten
from openaligner.trainer.ppo_data import RolloutBatch, compute_ppo_data


def _batch(init=True):
    # Row 0: 2 prompt + 2 response tokens (L=4); row 1: 1 prompt + 3 response (L=4). S = 5, S-1 = 4.
    return RolloutBatch(
        sequence_tokens=torch.tensor([[5, 6, 7, 1, 0], [5, 8, 9, 1, 0]]),
        sequence_lengths=torch.tensor([4, 4]),
        prompt_lengths=torch.tensor([2, 1]),
        is_end=torch.tensor([True, False]),
        logprobs=torch.tensor([[-1.0, -1.0, -0.5, 0.0], [-1.0, -2.0, -1.0, 0.0]]),
        init_logprobs=torch.tensor([[-1.0, -1.5, -1.0, 0.0], [-1.5, -2.0, -2.0, 0.0]]) if init else None,
        rewards=torch.tensor([2.0, -1.0]),
        values=torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.5, 0.5, 9.0]]),
    )


def test_worked_example_rewards_mask_and_metrics():
    data, m = compute_ppo_data(
        _batch(), kl_coef=0.1, kl_kind="abs", gamma=1.0, lam=1.0, normalize_advantages=False
    )
    # masks: row 0 → [1, L-1=3) = [0,1,1,0]; row 1 → [0, 3) = [1,1,1,0]
    assert data.mask.tolist() == [[0, 1, 1, 0], [1, 1, 1, 0]]
    # |Δ| row 0 = [0, .5, .5, 0] → token mean over mask = 0.5; row 1 = [.5, 0, 1, 0] → 0.5
    assert m["init_policy_kl"].item() == pytest.approx(0.5)
    # rewards: −0.1·kl + score at L−2 = 2. Row 0 valid: [−.05, 2 − .05] → mean 0.95
    # row 1 valid: [−.05, 0, −1 − 0.1] → mean −0.3833; mean over samples 0.28333
    assert m["rewards_with_kl"].item() == pytest.approx((0.95 + (-0.05 - 1.1) / 3) / 2)
    # γ = λ = 1: returns at the first valid position = sum of valid rewards
    assert data.returns[0, 1].item() == pytest.approx(1.9)
    assert data.returns[1, 0].item() == pytest.approx(-1.15)


def test_whitening_is_global_masked_and_matches_masked_whiten():
    batch = _batch()
    raw, _ = compute_ppo_data(
        batch, kl_coef=0.1, kl_kind="k3", gamma=0.9, lam=0.8, normalize_advantages=False
    )
    white, m = compute_ppo_data(
        batch, kl_coef=0.1, kl_kind="k3", gamma=0.9, lam=0.8, normalize_advantages=True
    )
    assert torch.allclose(white.advantages, masked_whiten(raw.advantages, raw.mask), atol=1e-6)
    # metrics are reported before whitening
    assert m["advantages_mean"].item() == pytest.approx(
        (raw.advantages * raw.mask).sum().item() / raw.mask.sum().item(), rel=1e-5
    )


def test_missing_eos_penalty_and_no_kl():
    data, m = compute_ppo_data(
        _batch(init=False),
        kl_coef=0.1,
        kl_kind="k1",
        gamma=1.0,
        lam=1.0,
        normalize_advantages=False,
        missing_eos_penalty=-3.0,
    )
    assert m["init_policy_kl"].item() == 0.0
    # row 1 never ended → its score −1 is replaced by −3; with no KL the return is −3 everywhere
    assert torch.allclose(data.returns[1, :3], torch.tensor([-3.0, -3.0, -3.0]))
    ref_adv, _ = gae(_batch().values, torch.zeros(2, 4), data.mask, 1.0, 1.0)
    assert data.advantages.shape == ref_adv.shape


def test_select_rows():
    data, _ = compute_ppo_data(
        _batch(), kl_coef=0.0, kl_kind="k1", gamma=1.0, lam=1.0, normalize_advantages=False
    )
    sub = data.select(torch.tensor([1]))
    assert len(sub) == 1 and torch.equal(sub.mask, data.mask[1:])
