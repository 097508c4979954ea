"""``trainer.micro_batch_size`` is a memory setting: one PPO step trained in micro-batches of 1
and in one micro-batch of the whole minibatch is the same update, for every advantage estimator
(and so every loss aggregation, with the KL loss term and the entropy bonus), on rollouts whose
responses have very different lengths — the case where a per-micro-batch mean weighs a short
response's tokens more. Two ranks against one process: test_ppo_distributed.py."""

import pytest
import torch
from ppo_fakes import make_trainer, ppo_cfg

from openaligner.trainer.estimators import ESTIMATORS

LR = 0.5
"""Plain SGD (no momentum), so a weight is its start minus lr × its gradient sum: two runs differ
by lr × the rounding of their gradients and nothing amplifies it (AdamW's g / (√v + ε) turns
rounding noise on near-zero gradients into updates of up to lr, and hides a gradient off by a
constant factor)."""

# Tolerances. The two runs differ only in rounding: the per-token losses and log-probs come from
# forwards over different batch shapes (1 row vs 8 rows, other padding widths), and the step's
# loss and gradient are a sum of 8 shares instead of one sum. Each is float32 (unit roundoff
# u = 2⁻²⁴ ≈ 6e-8); a sum of n ≤ 8 terms is off by ≤ n·u ≈ 4.8e-7 relative to the sum of the
# terms' magnitudes, and the forwards add a few ulps per token. So losses and gradient norms
# agree to REL = 1e-6, with ABS = 1e-7 for a loss that cancels to ~0 (grpo's centred advantages:
# measured ≤ 7e-7 relative, ≤ 3e-8 absolute). Weights: w₂ = w₀ − lr·(g₁ + g₂); every gradient
# element ≤ its step's norm ≤ 2 × the logged mean of the two (< 1.5, checked) = 3, so |δw| ≤
# 2 steps × lr 0.5 × 8u × 3 + a rounding of w (|w| < 4: 2.4e-7) ≈ 1.7e-6 → WEIGHTS_ATOL = 2e-6,
# while the steps move the weights by > 1000 × that (checked). Measured: ≤ 6e-8.
REL, ABS = 1e-6, 1e-7
WEIGHTS_ATOL = 2e-6
METRICS = (
    "policy/loss",
    "policy/pg_loss",
    "policy/entropy",
    "policy/kl_loss",
    "policy/grad_norm",
    "policy/ppo_ratio",
    "policy/clip_fraction",
    "policy/approx_kl",
)


def one_step(tmp_path, estimator: str, micro_batch_size: int) -> tuple[dict, dict, dict, list]:
    """One PPO step of 16 responses in 2 optimizer steps of 8: metrics, initial and final weights,
    and the response lengths it trained on."""
    groups = ESTIMATORS[estimator].needs_groups
    cfg = ppo_cfg(
        advantage_estimator=estimator,
        num_rollout_samples=4 if groups else 16,  # prompts; × 4 responses each for group estimators
        global_batch_size=8,
        micro_batch_size=micro_batch_size,
        max_steps=1,
        val_check_interval=0,
        save_interval=0,
        entropy_bonus=0.05,
        gradient_clip_val=0,  # no clipping: the update stays lr × gradient
        **{"length.max_length": 16, "sampling.stop_token_ids": "[1,2,3,4]"},
    )
    trainer = make_trainer(tmp_path / f"{estimator}-{micro_batch_size}", cfg, sgd_lr=LR)
    before = {k: v.clone() for k, v in trainer.model.model.state_dict().items()}
    lengths: list[int] = []
    train = trainer.run_training

    def recording(data):
        lengths.extend(int(n) for n in (data.mask * data.is_end.unsqueeze(-1)).sum(-1))
        return train(data)

    trainer.run_training = recording
    (metrics,) = trainer.fit()
    return metrics, before, trainer.model.model.state_dict(), lengths


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_micro_batches_of_one_train_as_one_micro_batch_of_the_whole_minibatch(tmp_path, estimator):
    one_by_8, before, w_1x8, lengths = one_step(tmp_path, estimator, 1)
    eight_by_1, _, w_8x1, lengths_8 = one_step(tmp_path, estimator, 8)
    assert lengths == lengths_8  # the same rollouts (generation does not depend on micro_batch_size)
    trained = [n for n in lengths if n > 0]
    assert min(trained) <= 3 and max(trained) >= 10, lengths  # very different lengths in each run
    for key in METRICS:
        assert one_by_8[key] == pytest.approx(eight_by_1[key], rel=REL, abs=ABS), key
    assert one_by_8["policy/optim_step"] == eight_by_1["policy/optim_step"] == 2
    assert eight_by_1["policy/grad_norm"] < 1.5  # the bound the weights' tolerance assumes
    moved = max((w_8x1[k] - v).abs().max().item() for k, v in before.items())
    assert moved > 1000 * WEIGHTS_ATOL  # it trained: the tolerance is far under the update
    for name, tensor in w_8x1.items():
        torch.testing.assert_close(w_1x8[name], tensor, rtol=0, atol=WEIGHTS_ATOL, msg=name)
