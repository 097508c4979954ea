"""The batch-invariant training forward (``server.batch_invariant`` -> ``CriticTrainer(...,
batch_invariant_multiple=...)``): inside ``critic_train``'s forward a row's values are bitwise
those it gets alone, beside any rows and at any padding width up to the client's
``pad_to_length``, fp32 and bf16; the step's loss and update are the plain path's (float
tolerance) and bitwise the same whatever padding and untrained rows the request carried.

The values are read where the loss reads them: a forward hook on the critic inside
:meth:`CriticTrainer.train_pass`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from openaligner.models.fixed_shapes import FixedShapes
from openaligner.models.precision import Precision
from openaligner.trainer.critic import (
    CriticBatch,
    CriticTrainConfig,
    CriticTrainer,
    row_widths,
    trained_groups,
)

ROWS = 8
PAD_TO_LENGTH = 40  # the widest padding a client sends (remote.pad_to_length)
MBS = 3  # train.micro_batch_size: the fixed shapes' rows
MULTIPLE = 16  # server.fixed_width_multiple() with strip_sequence_length_to_multiple null
LENGTHS = [3, 37, 16, 9, 22, 31, 17, 5]  # trained widths 2 … 36: three compute widths
PRECISIONS = {"fp32": Precision("fp32"), "bf16": Precision("bf16-mixed")}


def pool() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ROWS rows of PAD_TO_LENGTH tokens (0 past each length), their returns and prev values, and
    lengths; row i starts with token 3 + i, so a forward's row says which row it is."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 100, (ROWS, PAD_TO_LENGTH), generator=g)
    tokens[:, 0] = 3 + torch.arange(ROWS)
    lengths = torch.tensor(LENGTHS)
    tokens[torch.arange(PAD_TO_LENGTH)[None, :] >= lengths[:, None]] = 0
    returns = torch.randn(ROWS, PAD_TO_LENGTH - 1, generator=g)
    prev = 0.1 * torch.randn(ROWS, PAD_TO_LENGTH - 1, generator=g)
    return tokens, returns, prev, lengths


def batch_of(rows: list[int | None], width: int) -> CriticBatch:
    """The pool's ``rows`` as one critic_train request padded to ``width`` tokens (as the client
    sends it: mask 1 on positions 0 … length-2); None: a row that trains nothing (mask 0)."""
    tokens, returns, prev, lengths = pool()
    n = len(rows)
    out = CriticBatch(
        torch.zeros(n, width, dtype=torch.long),
        torch.zeros(n, width - 1),
        torch.zeros(n, width - 1),
        torch.zeros(n, width - 1),
    )
    for k, i in enumerate(rows):
        if i is None:
            out.tokens[k, :5] = 99  # some tokens, nothing trained
            continue
        length = int(lengths[i])
        out.tokens[k, :length] = tokens[i, :length]
        out.returns[k] = returns[i, : width - 1]
        out.prev_values[k] = prev[i, : width - 1]
        out.mask[k, : length - 1] = 1.0
    return out


def trainer(tiny, invariant: bool, precision: Precision, lr: float = 0.0) -> CriticTrainer:
    critic = tiny.critic()
    cfg = CriticTrainConfig(global_batch_size=ROWS, micro_batch_size=MBS, gradient_clip_val=0)
    optimizer = torch.optim.SGD(critic.parameters(), lr=lr)
    multiple = MULTIPLE if invariant else None
    return CriticTrainer(cfg, critic, optimizer, precision=precision, batch_invariant_multiple=multiple)


def training_values(t: CriticTrainer, batch: CriticBatch) -> dict[int, torch.Tensor]:
    """Pool row -> its values at its trained positions (0 … length-2), as the training forward of
    one ``train_pass`` over ``batch`` computed them."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module, args, values):
        for tokens, row in zip(args[0], values, strict=True):
            i = int(tokens[0]) - 3
            if 0 <= i < ROWS:
                seen[i] = row[: LENGTHS[i] - 1].detach().clone()

    handle = t.model.register_forward_hook(hook)
    try:
        t.train_pass(batch)
    finally:
        handle.remove()
    return seen


def arrangements():
    """(what, rows, width): each pool row beside 1 … 7 others, first / in the middle / last,
    sometimes between rows that train nothing, padded to the longest row, to pad_to_length, or
    between."""
    for size in range(2, ROWS + 1):
        for position in sorted({0, size // 2, size - 1}):
            row = size % ROWS
            others: list[int | None] = [(row + k) % ROWS for k in range(1, size)]
            if size % 2:
                others.insert(len(others) // 2, None)
            rows = [*others[:position], row, *others[position:]]
            longest = max(LENGTHS[i] for i in rows if i is not None)
            width = (longest, PAD_TO_LENGTH, (longest + PAD_TO_LENGTH) // 2)[(size + position) % 3]
            yield f"row {row} at {position} of {len(rows)} rows, width {width}", rows, width


def alone_and_beside_others(t: CriticTrainer) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, values alone, values beside others) for every row of every arrangement."""
    alone = {i: training_values(t, batch_of([i], LENGTHS[i]))[i] for i in range(ROWS)}
    for what, rows, width in arrangements():
        values = training_values(t, batch_of(rows, width))
        assert sorted(values) == sorted(i for i in rows if i is not None), what
        yield from ((f"{what}: row {i}", alone[i], v) for i, v in values.items())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_rows_training_values_are_bitwise_the_same_alone_and_beside_any_rows(tiny, precision):
    invariant = list(alone_and_beside_others(trainer(tiny, True, PRECISIONS[precision])))  # lr 0
    assert len(invariant) > 50
    for what, want, got in invariant:
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    # what the setting removes: without it the same requests move some row's training values
    plain = alone_and_beside_others(trainer(tiny, False, PRECISIONS[precision]))
    assert any(not torch.equal(want, got) for _, want, got in plain)


def one_step(tiny, invariant: bool, rows: list[int | None], width: int):
    t = trainer(tiny, invariant, PRECISIONS["fp32"], lr=1.0)  # SGD, lr 1, no clipping: update = -gradient
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    result = t.train_pass(batch_of(rows, width))
    assert result.optimizer_steps == 1
    return result, {k: before[k] - v for k, v in t.model.state_dict().items()}


def test_a_batch_invariant_step_is_the_plain_steps_update_and_ignores_padding_and_untrained_rows(tiny):
    rows: list[int | None] = list(range(ROWS))
    plain, plain_update = one_step(tiny, False, rows, PAD_TO_LENGTH)
    fixed, fixed_update = one_step(tiny, True, rows, PAD_TO_LENGTH)
    # the same token-mean loss and gradient, summed in other groupings
    assert fixed.loss_mean == pytest.approx(plain.loss_mean, rel=1e-6)
    assert fixed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    assert fixed.clip_fraction == pytest.approx(plain.clip_fraction, rel=1e-6)
    assert fixed.explained_variance == pytest.approx(plain.explained_variance, rel=1e-5)
    assert max(u.abs().max().item() for u in plain_update.values()) > 1e-3  # it trained
    for name, u in plain_update.items():
        torch.testing.assert_close(fixed_update[name], u, rtol=1e-4, atol=1e-7, msg=name)
    # rows 0 … 5 alone in a request, between untrained rows, or padded to another width (the
    # global batch always 8 rows): bitwise the same loss and update in fixed shapes ...
    reference, reference_update = one_step(tiny, True, [0, 1, 2, 3, 4, 5], PAD_TO_LENGTH)
    between: list[int | None] = [0, None, 1, 2, 3, None, 4, 5]
    for arrangement, width in ((between, PAD_TO_LENGTH), ([0, 1, 2, 3, 4, 5, None, None], 37)):
        again, update = one_step(tiny, True, arrangement, width)
        assert again.loss_mean == reference.loss_mean, (arrangement, width)
        for name, u in reference_update.items():
            torch.testing.assert_close(update[name], u, rtol=0, atol=0, msg=f"{name} {arrangement} {width}")
    # ... which the plain path is not: its micro-batches change with the untrained rows
    _, plain_reference = one_step(tiny, False, [0, 1, 2, 3, 4, 5], PAD_TO_LENGTH)
    _, plain_between = one_step(tiny, False, between, PAD_TO_LENGTH)
    assert any(not torch.equal(plain_between[k], u) for k, u in plain_reference.items())


def test_training_forwards_group_trained_rows_by_their_own_width_in_whole_micro_batches():
    shapes = FixedShapes(rows=2, multiple=8)
    mask = torch.zeros(6, 20)
    for i, width in enumerate([3, 0, 9, 8, 1, 0]):
        mask[i, :width] = 1.0
    mask[3, 2] = 0.0  # a hole: the width is still up to the last trained position
    assert row_widths(mask).tolist() == [3, 0, 9, 8, 1, 0]
    assert trained_groups(shapes, mask) == [([0, 3], 8), ([4], 8), ([2], 16)]  # untrained rows in none
    assert trained_groups(shapes, torch.zeros(4, 20)) == []


def test_a_sharded_critic_runs_as_many_forwards_on_every_rank(tiny, monkeypatch):
    """Every forward and backward of a sharded critic is a collective: with fixed shapes each rank
    runs as many as the busiest rank's share needs (filler forwards on the others)."""
    from openaligner import distributed as dp

    t = trainer(tiny, True, PRECISIONS["fp32"])
    t._sharded = True  # the count a sharded critic runs, here on one process
    monkeypatch.setattr(dp, "world_size", lambda: 2)
    step_mask = batch_of([1, 2, 3, 5, None, None, None, None], PAD_TO_LENGTH).mask
    # rank 0's share: trained widths 36, 15, 8, 30 -> forwards at 48, 16 (two rows), 32; rank 1: none
    assert t._forwards_per_rank(step_mask) == 3
    assert t._forwards_per_rank(torch.zeros(8, 39)) == 1
    joined: list[int] = []
    monkeypatch.setattr(t, "_join_shards", lambda tokens: joined.append(tokens.shape[0]))
    local = batch_of([None, None, None, None], PAD_TO_LENGTH)
    t._accumulate(local, torch.tensor(1.0, dtype=torch.float64), [], forwards=3)
    assert joined == [MBS] * 3  # rank 1 (nothing to train) joins each of rank 0's forwards
