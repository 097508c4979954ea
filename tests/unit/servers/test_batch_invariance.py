"""Batch-invariant serving (``server.batch_invariant``): a row's reward and values are bitwise the
ones it gets alone, whatever Triton merged it with — 2 … max_batch_size rows, any position, any
padding width up to the client's ``pad_to_length`` — in fp32 and bf16. The endpoints' callables are
driven in-process, exactly as Triton drives them (one ``run`` per formed batch of validated
requests); the real server path is ``tests/integration/test_critic_server.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openaligner.models.fixed_shapes import FixedShapes
from openaligner.models.precision import Precision
from openaligner.servers.config import ServingConfig
from openaligner.servers.critic import CriticServerConfig, CriticServerTrainer
from openaligner.servers.reward import RewardEndpoint, RewardModelServer
from openaligner.servers.validation import SequenceRequest
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

MAX_BATCH = 8  # the servers' max_batch_size here: formed batches of 1 … 8 rows
PAD_TO_LENGTH = 40  # the widest padding a client sends (remote.pad_to_length)
MBS = 4  # model_forward_micro_batch_size


def pool(vocab: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """MAX_BATCH sequences of 3 to 37 tokens (several compute widths), ids in [3, vocab)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (MAX_BATCH, PAD_TO_LENGTH), generator=g)
    lengths = torch.tensor([3, 37, 16, 9, 22, 31, 17, 5])
    return tokens, lengths


def request(endpoint, tokens: torch.Tensor, lengths: torch.Tensor, width: int) -> SequenceRequest:
    """The rows as a client sends them: right-padded with 0 to ``width``, lengths [b, 1]."""
    padded = torch.zeros(tokens.shape[0], width, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        padded[i, :n] = tokens[i, :n]
    return endpoint.validate(
        {"tokens": padded.numpy(), "sequence_lengths": lengths.numpy().reshape(-1, 1).astype(np.int64)}
    )


def formed_batches(tokens: torch.Tensor, lengths: torch.Tensor):
    """(row, position, batch size, the rows of each request, each request's padding width) for
    every batch size 2 … MAX_BATCH with the row first, in the middle and last: the other rows are
    the pool's next ones, split into requests of 1 … 3 rows, each padded to its own width (its
    longest row, the client's pad_to_length, or in between)."""
    n = tokens.shape[0]
    for size in range(2, MAX_BATCH + 1):
        for position in sorted({0, size // 2, size - 1}):
            row = size % n
            others = [(row + k) % n for k in range(1, size)]
            order = [*others[:position], row, *others[position:]]
            requests, at, k = [], 0, 0
            while at < size:
                part = order[at : at + 1 + (k + size) % 3]
                longest = int(lengths[part].max())
                width = (longest, PAD_TO_LENGTH, (longest + PAD_TO_LENGTH) // 2)[k % 3]
                requests.append((part, width))
                at += len(part)
                k += 1
            yield row, position, size, requests


def served_alone_and_merged(endpoint, tokens, lengths, outputs):
    """Each row's outputs alone (a request of its own at its own length), and every merged
    batch's answer for that row: a list of (what, alone, merged) per output name."""
    alone = {}
    for i in range(tokens.shape[0]):
        (answer,) = endpoint.run([request(endpoint, tokens[i : i + 1], lengths[i : i + 1], int(lengths[i]))])
        alone[i] = answer
    found = []
    for row, position, size, parts in formed_batches(tokens, lengths):
        reqs = [request(endpoint, tokens[p], lengths[p], w) for p, w in parts]
        answers = endpoint.run(reqs)
        for (p, _), answer in zip(parts, answers, strict=True):
            if row in p:
                got = {name: answer[name][p.index(row)] for name in outputs}
        n = int(lengths[row])
        for name in outputs:
            want = alone[row][name][0]
            merged = got[name][:n] if name == "values" else got[name]
            found.append((f"{name} of row {row} at {position} of {size}", want, merged))
            if name == "values":  # nothing past the row's length
                assert not got[name][n:].any()
    return found


def reward_server(model, batch_invariant: bool) -> RewardEndpoint:
    server = RewardModelServer(
        infer_fn=model.infer,
        vocab_size=100,
        max_batch_size=MAX_BATCH,
        model_forward_micro_batch_size=MBS,
        inference_micro_batch_size=[MBS],
        batch_invariant=batch_invariant,
    )
    assert isinstance(server.endpoint, RewardEndpoint)
    return server.endpoint


def critic_server(tiny, precision: Precision, batch_invariant: bool) -> CriticServerTrainer:
    critic = tiny.critic()
    cfg = CriticServerConfig(
        max_batch_size=MAX_BATCH,
        model_forward_micro_batch_size=MBS,
        inference_micro_batch_size=[MBS],
        batch_invariant=batch_invariant,
    )
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=4),
        critic,
        torch.optim.AdamW(critic.parameters(), lr=1e-3),
        precision=precision,
        batch_invariant_multiple=cfg.fixed_width_multiple(),
    )
    return CriticServerTrainer(cfg, trainer, None, reward_model=tiny.reward_model())


def differences(found) -> list[str]:
    return [what for what, want, got in found if not np.array_equal(want, got)]


PRECISIONS = {
    "fp32": Precision("fp32"),
    "bf16": Precision("bf16-mixed"),  # the critic server's bf16: its forwards under bf16 autocast
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_rows_reward_is_bitwise_the_same_alone_and_merged_in_every_batch(tiny, precision):
    model = tiny.reward_model()
    if precision == "bf16":  # a reward model served in bf16 (serve-reward loads it in the compute dtype)
        model.hf_model.to(torch.bfloat16)
        model.head.float()
    tokens, lengths = pool()
    invariant = served_alone_and_merged(reward_server(model, True), tokens, lengths, ["rewards"])
    assert len(invariant) == 2 + 3 * (MAX_BATCH - 2)
    for what, want, got in invariant:
        np.testing.assert_array_equal(got, want, err_msg=what)  # rtol=0, atol=0
    # what the setting removes: without it the same batches move some row's reward
    assert differences(served_alone_and_merged(reward_server(model, False), tokens, lengths, ["rewards"]))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_rows_values_and_reward_are_bitwise_the_same_alone_and_merged_in_every_batch(tiny, precision):
    tokens, lengths = pool()
    server = critic_server(tiny, PRECISIONS[precision], batch_invariant=True)
    invariant = served_alone_and_merged(server.infer_endpoint, tokens, lengths, ["values", "rewards"])
    for what, want, got in invariant:
        np.testing.assert_array_equal(got, want, err_msg=what)  # rtol=0, atol=0
    plain = critic_server(tiny, PRECISIONS[precision], batch_invariant=False)
    assert differences(served_alone_and_merged(plain.infer_endpoint, tokens, lengths, ["values", "rewards"]))


def test_fixed_shapes_group_rows_by_width_in_whole_micro_batches():
    shapes = FixedShapes(rows=2, multiple=8)
    lengths = torch.tensor([3, 9, 8, 1, 16, 12, 5])
    assert [shapes.width(n) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert shapes.groups(lengths) == [([0, 2], 8), ([3, 6], 8), ([1, 4], 16), ([5], 16)]
    seen: list[tuple[int, int]] = []

    def forward(tokens: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(tokens.shape))
        return n.float() * 10

    out = shapes.run(forward, torch.ones(7, 20, dtype=torch.long), lengths)
    assert seen == [(2, 8), (2, 8), (2, 16), (2, 16)]  # every forward 2 rows, filler rows included
    assert out.tolist() == [30.0, 90.0, 80.0, 10.0, 160.0, 120.0, 50.0]
    # two ranks: rank 0's share [3, 9, 8] needs 2 forwards, rank 1's [1, 16, 12] 2 as well
    assert shapes.forwards(lengths[:6], 2) == 2
    seen.clear()
    shapes.run(forward, torch.ones(1, 4, dtype=torch.long), torch.tensor([4]), forwards=3)
    assert seen == [(2, 8), (2, 8), (2, 8)]  # topped up with filler forwards (collectives)


def test_the_setting_is_documented_with_its_width_multiple():
    cfg = ServingConfig(port=0, batch_invariant=True, model_forward_micro_batch_size=8)
    assert cfg.fixed_shapes() == FixedShapes(rows=8, multiple=16)
    cfg = ServingConfig(port=0, batch_invariant=True, strip_sequence_length_to_multiple=32)
    assert cfg.fixed_shapes() == FixedShapes(rows=4, multiple=32)
    assert ServingConfig(port=0, batch_invariant=False).fixed_shapes() is None
    assert ServingConfig(port=0, batch_invariant=False).fixed_width_multiple() is None


def test_a_critic_server_refuses_a_trainer_whose_training_forward_is_not_in_its_fixed_shapes(tiny):
    """server.batch_invariant=true with a trainer built without it would train on values of
    other shapes than the ones served; the mismatch is refused at construction, naming the fix."""
    critic = tiny.critic()
    optimizer = torch.optim.SGD(critic.parameters())
    plain = CriticTrainer(CriticTrainConfig(global_batch_size=4), critic, optimizer)
    cfg = CriticServerConfig(batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant_multiple=16"):
        CriticServerTrainer(cfg, plain, None)
