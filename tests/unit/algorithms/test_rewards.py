import pytest
import torch

from openaligner.algorithms import response_mask, shape_rewards


def test_response_mask_worked_example():
    # 5 tokens, 3 of them prompt: positions predict tokens 1..4; the response tokens 3 and 4 are
    # predicted at positions 2 and 3 → [0 0 1 1]. Second row: 2-token prompt, 4 tokens in all.
    m = response_mask(torch.tensor([3, 2]), torch.tensor([5, 4]), width=4)
    assert m.tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]


def test_shape_rewards_worked_example():
    kl = torch.tensor([[0.0, 0.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    # β = 0.1 → −0.1·kl; score 3 at index 5 − 2 = 3 for row 0, score −1 at index 4 − 2 = 2 for row 1
    r = shape_rewards(torch.tensor([3.0, -1.0]), kl, torch.tensor([5, 4]), beta=0.1)
    assert torch.allclose(r, torch.tensor([[0.0, 0.0, -0.1, 2.8], [-0.1, -0.1, -1.1, -0.1]]))


def test_score_sits_on_last_masked_position():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 5, (8,), generator=g)
    total = prompt + torch.randint(1, 6, (8,), generator=g)
    width = int(total.max()) - 1
    r = shape_rewards(torch.ones(8), torch.zeros(8, width), total, beta=0.0)
    m = response_mask(prompt, total, width)
    last_valid = (m * torch.arange(width)).argmax(dim=-1)
    assert (r.argmax(dim=-1) == last_valid).all()


def test_missing_eos_penalty_and_clip():
    kl = torch.zeros(3, 3)
    scores = torch.tensor([5.0, 5.0, -9.0])
    is_end = torch.tensor([True, False, True])
    r = shape_rewards(
        scores, kl, torch.tensor([4, 4, 4]), beta=0.0, is_end=is_end, missing_eos_penalty=-1.0, score_clip=2.0
    )
    # clipped to [−2, 2] first, then row 1 (never ended) gets the fixed −1
    assert r[:, 2].tolist() == [2.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="is_end"):
        shape_rewards(scores, kl, torch.tensor([4, 4, 4]), beta=0.0, missing_eos_penalty=-1.0)


def test_short_sequence_index_is_clamped():
    # A response length of 1 would give index −1; it is clamped to 0 instead of wrapping around.
    r = shape_rewards(torch.tensor([1.0]), torch.zeros(1, 3), torch.tensor([1]), beta=0.0)
    assert r.tolist() == [[1.0, 0.0, 0.0]]
