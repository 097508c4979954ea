import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openaligner.algorithms import masked_mean, masked_mean_var, masked_var, masked_whiten


def test_masked_mean_worked_example():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # (1 + 2 + 3) / 3 = 2; the 100 at the masked position is ignored.
    assert masked_mean(x, mask).item() == 2.0
    # per-row mean along dim=-1 gives shape [B]
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0]


def test_masked_mean_empty_mask_is_zero_with_zero_grad():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = masked_mean(x, torch.zeros(2))
    out.backward()
    assert out.item() == 0.0
    assert x.grad is not None and x.grad.abs().sum().item() == 0.0


def test_masked_var_worked_example():
    x = torch.tensor([1.0, 2.0, 3.0, -50.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2; squared deviations 1, 0, 1 → biased var 2/3, unbiased 2/2 = 1
    assert torch.isclose(masked_var(x, mask), torch.tensor(2.0 / 3.0))
    assert torch.isclose(masked_var(x, mask, unbiased=True), torch.tensor(1.0))


def test_masked_whiten_worked_example():
    x = torch.tensor([1.0, 3.0, 7.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    # mean 2, var 1 → (x - 2) / 1 = [-1, 1, 5]; the masked 7 is transformed but ignored for stats
    assert torch.allclose(masked_whiten(x, mask), torch.tensor([-1.0, 1.0, 5.0]), atol=1e-6)
    # scale only: the mean is added back
    assert torch.allclose(masked_whiten(x, mask, shift_mean=False), torch.tensor([1.0, 3.0, 7.0]), atol=1e-6)


masked_batches = st.integers(min_value=1, max_value=5).flatmap(
    lambda b: st.integers(min_value=2, max_value=9).flatmap(
        lambda s: st.tuples(
            st.lists(st.floats(-50, 50, allow_nan=False), min_size=b * s, max_size=b * s),
            st.lists(st.booleans(), min_size=b * s, max_size=b * s),
            st.just((b, s)),
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(masked_batches)
def test_whitening_gives_mean_zero_var_one(data):
    values, bits, shape = data
    x = torch.tensor(values, dtype=torch.float64).reshape(shape)
    mask = torch.tensor(bits, dtype=torch.float64).reshape(shape)
    if mask.sum() < 2 or masked_var(x, mask) < 1e-3:
        return  # whitening is only meaningful with spread
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-6
    assert abs(masked_var(w, mask).item() - 1.0) < 1e-5


# Junk at ignored positions includes inf and NaN: masks select, they never multiply (inf·0 = NaN).
JUNK = st.floats(-1e3, 1e3) | st.sampled_from([math.inf, -math.inf, math.nan])


@settings(max_examples=60, deadline=None)
@given(masked_batches, JUNK)
def test_padded_positions_never_change_statistics(data, junk):
    values, bits, shape = data
    x = torch.tensor(values, dtype=torch.float64).reshape(shape)
    mask = torch.tensor(bits, dtype=torch.float64).reshape(shape)
    y = torch.where(mask.bool(), x, torch.full_like(x, junk))
    assert torch.allclose(masked_mean(x, mask), masked_mean(y, mask))
    assert torch.allclose(masked_var(x, mask), masked_var(y, mask))
    assert torch.allclose(masked_mean_var(x, mask)[1], masked_mean_var(y, mask)[1])
    valid = mask.bool()
    assert torch.allclose(masked_whiten(x, mask)[valid], masked_whiten(y, mask)[valid])


def test_nan_at_a_masked_position_keeps_the_mean_and_its_gradient_finite():
    x = torch.tensor([[1.0, 2.0, float("nan"), float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0]])
    mean = masked_mean(x, mask)
    mean.backward()
    assert mean.item() == 1.5
    assert x.grad.tolist() == [[0.5, 0.5, 0.0, 0.0]]


def _two_rank_reduce(other_x, other_mask):
    """A reduce for "rank 0" that adds the partial sums "rank 1" would contribute.

    masked_mean_var calls reduce twice: first [sum, count], then [sum of squared deviations from
    the global mean]; rank 1 computes the second from the same global mean.
    """
    first = torch.stack([(other_x * other_mask).sum(), other_mask.sum()]).double()
    state = {}

    def reduce(t):
        if "mean" not in state:
            total = t + first
            state["mean"] = total[0] / total[1]
            return total
        return t + (((other_x - state["mean"]) ** 2) * other_mask).sum().reshape(1)

    return reduce


def test_global_stats_with_reduce_equal_stats_of_concatenation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mean0, var0 = masked_mean_var(x[:3], mask[:3], reduce=_two_rank_reduce(x[3:], mask[3:]))
    assert torch.allclose(mean0, masked_mean(x, mask))
    assert torch.allclose(var0, masked_var(x, mask))
    w0 = masked_whiten(x[:3], mask[:3], reduce=_two_rank_reduce(x[3:], mask[3:]))
    assert torch.allclose(w0, masked_whiten(x, mask)[:3])
    # the local-only statistics differ, so the test would catch a reduce that is ignored
    assert not torch.allclose(masked_mean(x[:3], mask[:3]), mean0)
