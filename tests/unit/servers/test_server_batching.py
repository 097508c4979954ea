"""Batch shaping: worked examples, and the property that shaping never changes any row's answer."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.servers.batching import (
    PAD_ROW_LENGTH,
    merge_rows,
    pad_rows,
    padding_multiple,
    split_rows,
    strip_columns,
)


def test_padding_multiple_worked_examples():
    # mbs 4, dp 2: up to 8 rows fit in one micro-batch per rank -> pad to a multiple of dp only
    assert padding_multiple(5, 4, 2) == 2  # 5 -> 6 rows, 3 per rank
    assert padding_multiple(8, 4, 2) == 2
    # more rows than one micro-batch per rank -> whole micro-batches on every rank
    assert padding_multiple(11, 4, 2) == 8  # 11 -> 16 rows, 2 micro-batches of 4 per rank
    assert padding_multiple(3, 4, 1) == 1  # single rank, small batch: no padding at all


def test_pad_rows_adds_legal_filler_rows():
    tokens = torch.arange(10).reshape(5, 2)
    lengths = torch.tensor([1, 2, 2, 1, 2])
    t, n, extra = pad_rows(tokens, lengths, 4)
    assert extra == 3 and t.shape == (8, 2)
    assert torch.equal(t[:5], tokens) and torch.equal(n[:5], lengths)
    assert torch.all(n[5:] == PAD_ROW_LENGTH)  # filler rows stay valid for models that refuse 0


def test_strip_columns_to_multiple():
    tokens = torch.zeros(2, 16, dtype=torch.long)
    lengths = torch.tensor([3, 5])
    assert strip_columns(tokens, lengths, 4).shape == (2, 8)  # ceil(5 / 4) * 4
    assert strip_columns(tokens, lengths, None).shape == (2, 5)  # exactly the longest row
    assert strip_columns(tokens, torch.tensor([15, 1]), 8).shape == (2, 16)  # never widens


def test_merge_rows_right_pads_narrow_parts():
    a = (torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    b = (torch.tensor([[8], [9]]), torch.tensor([1, 1]))
    tokens, lengths = merge_rows([a, b])
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0], [9, 0, 0]]
    assert lengths.tolist() == [3, 1, 1]


def test_split_rows_drops_padding_and_refuses_short_results():
    values = torch.arange(7.0)
    parts = split_rows(values, [2, 3])
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    try:
        split_rows(torch.arange(3.0), [2, 3])
    except ValueError as e:
        assert "3 result rows for 5" in str(e)
    else:
        raise AssertionError("expected ValueError")


def _row_answer(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A deterministic 'reward' that reads only each row's valid prefix."""
    weights = torch.arange(1, tokens.shape[1] + 1)
    valid = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return (tokens * weights * valid).sum(1).float() + lengths.float() * 0.5


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1, max_size=5),
    mbs=st.integers(1, 4),
    dp=st.integers(1, 3),
    strip=st.sampled_from([None, 1, 4, 8]),
    seed=st.integers(0, 1000),
)
def test_shaping_never_changes_a_rows_answer(sizes, mbs, dp, strip, seed):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for rows, width in sizes:
        tokens = torch.randint(0, 50, (rows, width), generator=g)
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        parts.append((tokens, lengths))
    tokens, lengths = merge_rows(parts)
    tokens = strip_columns(tokens, lengths, strip)
    tokens, lengths, _ = pad_rows(tokens, lengths, padding_multiple(tokens.shape[0], mbs, dp))
    assert tokens.shape[0] % dp == 0
    per_rank = tokens.shape[0] // dp
    assert per_rank <= mbs or per_rank % mbs == 0  # each rank runs whole micro-batches
    answers = split_rows(_row_answer(tokens, lengths), [t.shape[0] for t, _ in parts])
    for (t, n), got in zip(parts, answers, strict=True):
        assert torch.equal(got, _row_answer(t, n))


@pytest.mark.parametrize(("multiple", "width"), [(4, 8), (None, 5)])
def test_models_compute_at_the_stripped_width(tiny, multiple, width):
    """strip_sequence_length_to_multiple sets the width the reward model and critic compute at."""
    from openaligner.servers.critic import CriticInferEndpoint
    from openaligner.servers.reward import RewardEndpoint

    rm, critic = tiny.reward_model(), tiny.critic()
    seen: list[int] = []
    for model in (rm, critic):
        model.backbone.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
    tokens = np.full((2, 16), 5, dtype=np.int64)
    request = {"tokens": tokens, "sequence_lengths": np.array([[3], [5]], dtype=np.int64)}
    reward = RewardEndpoint(rm.infer, strip_sequence_length_to_multiple=multiple)
    values = CriticInferEndpoint(
        lambda t, n: (critic.infer(t, n), None), combined=False, strip_sequence_length_to_multiple=multiple
    )
    (r,) = reward.run([reward.validate(request)])
    (v,) = values.run([values.validate(request)])
    assert seen == [width, width]
    # stripping changes no answer: same as the forward over the exact rows
    exact = torch.tensor(tokens[:, :5])
    assert np.allclose(r["rewards"].reshape(-1), rm.infer(exact, torch.tensor([3, 5])).numpy(), atol=1e-5)
    assert v["values"].shape == (2, 16) and np.allclose(v["values"][:, 5:], 0.0)
