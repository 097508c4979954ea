"""CriticTrainer on its own (no server): padding, one pass against a reference, checkpoints.

The server's endpoints around it are tested in tests/unit/servers/test_critic_endpoint.py."""

import pytest
import torch

from openaligner.algorithms import value_loss
from openaligner.io.checkpoint import CheckpointManager
from openaligner.trainer import critic as critic_module
from openaligner.trainer.critic import (
    CriticBatch,
    CriticTrainConfig,
    CriticTrainer,
    pad_to_multiple,
    trained_width,
)


def make(tiny, checkpoints=None, **cfg):
    critic = tiny.critic()
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.5)
    settings = {"global_batch_size": 4, "micro_batch_size": 2, **cfg}
    return CriticTrainer(CriticTrainConfig(**settings), critic, optimizer, checkpoints=checkpoints)


def a_batch(rows=3, width=10):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 100, (rows, width), generator=g)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width - 1)[None, :] < (lengths - 1)[:, None]).float()
    returns = torch.randn(rows, width - 1, generator=g)
    return CriticBatch(tokens, returns, 0.1 * torch.randn(rows, width - 1, generator=g), mask)


def test_padding_rows_train_nothing_and_width_follows_the_mask():
    batch = CriticBatch(
        torch.ones(3, 5, dtype=torch.long), torch.ones(3, 4), torch.ones(3, 4), torch.ones(3, 4)
    )
    padded = pad_to_multiple(batch, 4)
    assert padded.tokens.shape == (4, 5) and padded.mask[3].sum() == 0 and padded.tokens[3].sum() == 0
    assert pad_to_multiple(padded, 4) is padded
    assert trained_width(torch.tensor([[1.0, 1, 0, 0], [0, 1, 1, 0]])) == 3
    assert trained_width(torch.zeros(2, 4)) == 0


def test_a_pass_is_one_token_mean_step_whatever_the_micro_batch(tiny):
    batch = a_batch()
    reference = tiny.critic()
    loss, _ = value_loss(reference(batch.tokens)[:, :-1], batch.prev_values, batch.returns, batch.mask, 0.2)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for mbs in (1, 3):
        trainer = make(tiny, micro_batch_size=mbs)
        result = trainer.train_pass(batch)
        assert (result.step, result.optimizer_steps, trainer.step) == (1, 1, 1)
        assert result.loss_mean == pytest.approx(loss.item(), rel=1e-5) and result.lr == 0.5
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(trainer.model.state_dict()[k], v, atol=1e-6, rtol=1e-5)


def test_checkpoints_resume_restore_and_refuse(tiny, tmp_path):
    trainer = make(tiny, CheckpointManager(tmp_path))
    trainer.train_pass(a_batch())
    path = trainer.write_checkpoint({"note": "kept"})
    assert path == tmp_path / "step_1" and (path / "critic" / "config.json").is_file()
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_pass(a_batch())
    assert trainer.step == 2
    again = make(tiny, CheckpointManager(tmp_path))
    assert again.step == 0  # nothing is resumed at construction
    again.resume()
    assert again.step == 1 and all(torch.equal(v, saved[k]) for k, v in again.model.state_dict().items())
    trainer.restore(1)
    assert trainer.step == 1
    assert trainer.restorable(1) is None
    assert "there is no" in (trainer.restorable(3) or "")
    with pytest.raises(ValueError, match="resume_step=3"):
        again.resume(3)
    with pytest.raises(RuntimeError, match="no checkpoint directory"):
        make(tiny).write_checkpoint()


def test_config_checks():
    with pytest.raises(ValueError, match="micro_batch_size"):
        CriticTrainConfig(global_batch_size=4, micro_batch_size=0)
    with pytest.raises(ValueError, match="global_batch_size"):
        CriticTrainConfig(global_batch_size=0)
    with pytest.raises(ValueError, match="gradient_clip_val"):
        CriticTrainConfig(global_batch_size=4, gradient_clip_val=-1)


def test_a_lora_critic_trains_adapters_and_head_and_resumes_from_its_adapter_checkpoint(tiny, tmp_path):
    """What serve-critic runs with `lora.r` set: add_lora on the loaded critic, the optimizer over
    what then requires gradients."""
    pytest.importorskip("peft")
    from openaligner.models.lora import LoraConfig, add_lora
    from openaligner.trainer.optim import OptimConfig, build_optimizer

    def lora_trainer(checkpoints):
        torch.manual_seed(0)  # peft draws the adapters' A matrices from the global RNG
        critic = add_lora(tiny.critic(), LoraConfig(r=4))
        optimizer, scheduler = build_optimizer(critic.parameters(), OptimConfig(lr=1e-2), None)
        cfg = CriticTrainConfig(global_batch_size=4, micro_batch_size=2)
        return CriticTrainer(cfg, critic, optimizer, scheduler, checkpoints=checkpoints)

    straight = lora_trainer(None)
    before = {k: v.clone() for k, v in straight.model.state_dict().items()}
    for _ in range(3):
        straight.train_pass(a_batch())
    changed = {k for k, v in straight.model.state_dict().items() if not torch.equal(v, before[k])}
    assert any("score.modules_to_save" in k for k in changed)
    assert all("lora_" in k or "score.modules_to_save" in k for k in changed)

    stopped = lora_trainer(CheckpointManager(tmp_path))
    for _ in range(2):
        stopped.train_pass(a_batch())
    path = stopped.write_checkpoint()
    assert (path / "critic" / "adapter_config.json").is_file()
    resumed = lora_trainer(CheckpointManager(tmp_path))
    resumed.resume()
    assert resumed.step == 2
    resumed.train_pass(a_batch())
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, straight.model.state_dict()[k]), k


def uneven_batch(rows=8, width=14):
    """Rows with valid lengths from 1 to 13 positions, short and long in each global batch of 4."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 13, 2, 11, 13, 1, 3, 12])[:rows]
    mask = (torch.arange(width - 1)[None, :] < lengths[:, None]).float()
    tokens = torch.randint(3, 100, (rows, width), generator=g)
    returns = 2.0 * torch.randn(rows, width - 1, generator=g)
    return CriticBatch(tokens, returns, 0.1 * torch.randn(rows, width - 1, generator=g), mask)


# 1 × 4 vs 4 × 1, two SGD steps, no gradient clipping: w₂ = w₀ − lr·(g₁ + g₂), linear in the
# gradients, so the runs differ only by float32 rounding (u = 2⁻²⁴ ≈ 6e-8): the forwards of 1 row
# vs 4 rows round a few ulps differently per value, and a step's gradient is a sum of 4 shares
# instead of one sum (≤ 4u relative). Loss and gradient norm: rel 1e-6. Weights: |g| elements
# ≤ the gradient norms (< 10 here) → |δw| ≤ 2 steps × lr 0.05 × 4u × 10 ≈ 2.4e-7, plus a rounding
# of w (|w| < 4: 2.4e-7) → atol 1e-6; the two steps move the weights by > 1e-2 (checked).
CRITIC_ATOL = 1e-6


def two_sgd_steps(tiny, micro_batch_size):
    critic = tiny.critic()
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.05)
    cfg = CriticTrainConfig(global_batch_size=4, micro_batch_size=micro_batch_size, gradient_clip_val=0)
    trainer = CriticTrainer(cfg, critic, optimizer)
    result = trainer.train_pass(uneven_batch())
    assert result.optimizer_steps == 2
    return result, before, trainer.model.state_dict()


def test_critic_train_in_micro_batches_of_one_equals_one_micro_batch_of_the_global_batch(tiny, monkeypatch):
    """The value loss is a token mean over each step's whole global batch (every micro-batch and
    rank), so rows of 1 and 13 valid positions weigh per token, not per micro-batch."""
    whole, before, w_whole = two_sgd_steps(tiny, 4)
    ones, _, w_ones = two_sgd_steps(tiny, 1)
    assert ones.loss_mean == pytest.approx(whole.loss_mean, rel=1e-6)
    assert ones.grad_norm == pytest.approx(whole.grad_norm, rel=1e-6)
    assert ones.clip_fraction == pytest.approx(whole.clip_fraction, rel=1e-6)
    assert max((w_whole[k] - v).abs().max().item() for k, v in before.items()) > 1e-2  # it trained
    for name, tensor in w_whole.items():
        torch.testing.assert_close(w_ones[name], tensor, rtol=0, atol=CRITIC_ATOL, msg=name)

    # the comparison catches the defect it exists for: each micro-batch's loss a token mean over
    # its own tokens, divided by the micro-batch count (4 per step)
    def per_micro_batch_mean(values, old, returns, mask, clip, units=None):
        return value_loss(values, old, returns, mask, clip, units=4 * mask.sum())

    monkeypatch.setattr(critic_module, "value_loss", per_micro_batch_mean)
    defect, _, w_defect = two_sgd_steps(tiny, 1)
    assert defect.loss_mean != pytest.approx(whole.loss_mean, rel=1e-3)
    worst = max((w_defect[k] - v).abs().max().item() for k, v in w_whole.items())
    assert worst > 1000 * CRITIC_ATOL


def test_a_pass_reports_the_explained_variance_after_its_update(tiny):
    from openaligner.algorithms import explained_variance

    batch = a_batch(rows=5)
    trainer = make(tiny, micro_batch_size=2)
    result = trainer.train_pass(batch)
    # by hand: the updated critic's values over the same rows, against the same returns
    with torch.no_grad():
        values = trainer.model.standardize(trainer.model(batch.tokens))[:, : batch.returns.shape[1]]
    expected = float(explained_variance(values, batch.returns, batch.mask))
    assert result.explained_variance_after == pytest.approx(expected, abs=1e-5)
    assert result.explained_variance_after != result.explained_variance  # the update moved the values
