"""``trainer.micro_batch_size`` is a memory setting for train-sft and train-rm too: two optimizer
steps in micro-batches of 1 and in one micro-batch of the global batch are the same run — the SFT
response NLL is a token mean over the whole global batch, the RM pair loss a mean over its pairs —
on data whose responses have very different lengths. Two ranks (replicas and shards) against one
process: test_supervised_distributed.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openaligner.config import load_config
from openaligner.trainer import supervised
from openaligner.trainer.rm import RMConfig, RMObjective, build_rm_trainer
from openaligner.trainer.sft import SFTConfig, SFTObjective, build_sft_trainer

LR = 0.1
LENGTHS = (1, 40, 2, 31, 3, 24, 1, 37)
"""Response lengths in characters (tokens of the tiny char tokenizer): short and long in every
global batch of 8."""

# Tolerances. Plain SGD without clipping: w₂ = w₀ − lr·(g₁ + g₂), linear in the gradients, so the
# runs differ only by float32 rounding (u = 2⁻²⁴ ≈ 6e-8): forwards over 1 row vs 8 rows (other
# padding widths) round a few ulps differently, and a step's gradient sums 8 micro-batch
# gradients instead of one batch's (≤ 8u ≈ 4.8e-7 relative to the terms). Losses and gradient
# norms: rel 1e-6, and abs 1e-6 for means of terms of size ~1 that cancel (rewards_chosen_mean
# ≈ 0.09 is a mean of rewards of either sign; measured 1.1e-7 apart, 1.2e-6 of it). Weights:
# every gradient element ≤ the logged norm (< 10) → |δw| ≤ 2 steps × lr 0.1 × 8u × 10 ≈ 1e-6 in
# the worst case, plus a rounding of w (|w| < 4: 2.4e-7) → atol 2e-6, while the two steps move
# the weights by > 1e-2 (checked). The defects these tests exist for move them by more than
# 1000 × ATOL (checked below).
REL, ABS = 1e-6, 1e-6
ATOL = 2e-6


def sgd(params, cfg, run_steps):
    """Plain SGD at ``cfg.lr`` with a constant schedule, in place of AdamW."""
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=cfg.lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def write_data(directory: Path) -> tuple[Path, Path]:
    sft, rm = directory / "sft.jsonl", directory / "rm.jsonl"
    with sft.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"q{i}:", "response": "ab"[i % 2] * LENGTHS[i % 8]}) + "\n")
    with rm.open("w") as f:
        for i in range(16):
            chosen, rejected = "y" * LENGTHS[i % 8], "n" * LENGTHS[(i + 3) % 8]
            f.write(json.dumps({"prompt": f"q{i}?", "chosen": chosen, "rejected": rejected}) + "\n")
    return sft, rm


def two_steps(tmp_path: Path, objective: str, micro_batch_size: int) -> tuple[list[dict], dict, dict]:
    """Two SGD steps of 8 examples (pairs): each step's metrics, initial and final weights."""
    sft, rm = write_data(tmp_path)
    cls, build = (SFTConfig, build_sft_trainer) if objective == "sft" else (RMConfig, build_rm_trainer)
    cfg = load_config(
        cls,
        overrides=[
            f"data.train_path={sft if objective == 'sft' else rm}",
            f"data.val_path={sft if objective == 'sft' else rm}",
            f"output_dir={tmp_path / f'{objective}-{micro_batch_size}'}",
            "model.tiny=gpt2" if objective == "sft" else "model.tiny=llama",
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
            "model.tiny_num_heads=2",
            "model.tiny_max_positions=64",
            "trainer.max_steps=2",
            "trainer.global_batch_size=8",
            f"trainer.micro_batch_size={micro_batch_size}",
            "trainer.val_check_interval=0",
            "trainer.save_interval=0",
            "trainer.gradient_clip_val=0",
            f"optim.lr={LR}",
            "progress=false",
            "device=cpu",
            "resume=false",
        ],
    )
    trainer = build(cfg)
    before = {k: v.clone() for k, v in trainer.objective.module.state_dict().items()}
    history = trainer.fit()
    return history, before, trainer.objective.module.state_dict()


def assert_same_run(a: tuple[list[dict], dict, dict], b: tuple[list[dict], dict, dict]) -> None:
    (h_a, before, w_a), (h_b, _, w_b) = a, b
    assert [m.keys() for m in h_a] == [m.keys() for m in h_b]
    for m_a, m_b in zip(h_a, h_b, strict=True):
        for key in m_a:
            if key.startswith(("train/", "val/")):
                assert m_a[key] == pytest.approx(m_b[key], rel=REL, abs=ABS), key
    assert all(m["train/grad_norm"] < 10 for m in h_b)  # the bound the tolerance assumes
    assert max((w_b[k] - v).abs().max().item() for k, v in before.items()) > 1e-2  # it trained
    for name, tensor in w_b.items():
        torch.testing.assert_close(w_a[name], tensor, rtol=0, atol=ATOL, msg=name)


def per_micro_batch_mean(loss):
    """A defect on purpose: each micro-batch's loss its own mean, the step's the mean of those."""

    def defective(self, batch):
        loss_sum, count, sums = loss(self, batch)
        return loss_sum / count, torch.tensor(1.0), {k: v / count for k, v in sums.items()}

    return defective


def micro_batch_counted_once(loss):
    """A defect on purpose: a micro-batch counted as one unit whatever it holds (its sum over the
    number of micro-batches)."""

    def defective(self, batch):
        loss_sum, _, sums = loss(self, batch)
        return loss_sum, torch.tensor(1.0), sums

    return defective


@pytest.mark.parametrize("objective", ["sft", "rm"])
def test_micro_batches_of_one_train_as_one_micro_batch_of_the_global_batch(tmp_path, monkeypatch, objective):
    monkeypatch.setattr(supervised, "build_optimizer", sgd)
    whole = two_steps(tmp_path, objective, 8)
    ones = two_steps(tmp_path, objective, 1)
    assert_same_run(ones, whole)
    # the comparison catches the defects it exists for. SFT: a per-micro-batch token mean (short
    # responses' tokens weigh more). RM: a pair is its unit, so equal micro-batches' pair means
    # average to the global one; what can go wrong is the count (micro-batches of 2 pairs
    # counted as one unit each: gradients 2× too large).
    cls = SFTObjective if objective == "sft" else RMObjective
    defective = per_micro_batch_mean if objective == "sft" else micro_batch_counted_once
    monkeypatch.setattr(cls, "loss", defective(cls.loss))
    defect = two_steps(tmp_path, objective, 1 if objective == "sft" else 2)
    with pytest.raises(AssertionError):
        assert_same_run(defect, whole)
    assert max((defect[2][k] - v).abs().max().item() for k, v in whole[2].items()) > 1000 * ATOL
