"""Reward-model trainer: Bradley–Terry loss, accuracy on a separable set, export, resume."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from openaligner.config import load_config
from openaligner.data.preference import PreferencePair, collate_pairs
from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel
from openaligner.trainer.rm import RMConfig, RMObjective, build_rm_trainer


def _write_pairs(path: Path, n: int = 80, seed: int = 0) -> Path:
    """Separable: the chosen response says "yes" in some form, the rejected one "no"."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt = f"q{rng.randint(0, 99)}?"
            chosen = rng.choice(["yes", "yes!", "yes.", "sure yes"])
            rejected = rng.choice(["no", "no!", "no.", "nope no"])
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def _cfg(tmp_path: Path, *overrides: str) -> RMConfig:
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        _write_pairs(data)
    return load_config(
        RMConfig,
        overrides=[
            f"data.train_path={data}",
            "data.val_fraction=0.25",
            f"output_dir={tmp_path / 'out'}",
            "model.tiny=llama",
            "model.tiny_hidden_size=32",
            "model.tiny_num_layers=1",
            "model.tiny_num_heads=2",
            "model.tiny_max_positions=64",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "optim.lr=3e-3",
            "progress=false",
            "device=cpu",
            *overrides,
        ],
    )


def test_bradley_terry_loss_and_metrics(tiny):
    rm = tiny.reward_model()
    pairs = [PreferencePair([2, 10, 11, 1], [2, 10, 12, 13, 1]), PreferencePair([2, 14, 1], [2, 15, 1])]
    batch = collate_pairs(pairs, pad_id=0)
    assert batch["tokens"].shape == (4, 5) and batch["lengths"].tolist() == [4, 3, 5, 3]
    loss, count, sums = RMObjective(rm).loss(batch)
    rewards = rm.infer(batch["tokens"], batch["lengths"])
    margin = rewards[:2] - rewards[2:]
    assert float(count) == 2
    assert float(loss.detach()) == pytest.approx(float(-F.logsigmoid(margin).sum()), rel=1e-5)
    assert float(sums["accuracy"]) == float((margin > 0).sum())
    assert float(sums["rewards_chosen_mean"]) == pytest.approx(float(rewards[:2].sum()), rel=1e-5)


def test_rm_learns_a_separable_set_and_exports_a_reward_model(tmp_path):
    cfg = _cfg(tmp_path, "trainer.max_steps=20", "trainer.val_check_interval=10")
    trainer = build_rm_trainer(cfg)
    history = trainer.fit()
    last = history[-1]
    assert last["val/accuracy"] > 0.9
    assert last["val/rewards_chosen_mean"] > last["val/rewards_rejected_mean"]
    assert {
        "train/loss",
        "train/accuracy",
        "train/rewards_chosen_mean",
        "train/rewards_rejected_mean",
    } <= set(last)
    out = Path(cfg.output_dir)
    rm, critic = RewardModel.from_pretrained(out), CriticModel.from_pretrained(out)
    batch = collate_pairs(trainer.val_items, pad_id=0)
    torch.testing.assert_close(
        rm.infer(batch["tokens"], batch["lengths"]),
        trainer.objective.module.infer(batch["tokens"], batch["lengths"]),
    )
    values = critic.infer(batch["tokens"], batch["lengths"])
    torch.testing.assert_close(
        values[torch.arange(len(values)), batch["lengths"] - 1],
        rm.infer(batch["tokens"], batch["lengths"]),
        rtol=1e-5,
        atol=1e-5,
    )


def _resume_from_step_2(tmp_path: Path, *extra: str) -> Path:
    """Train 4 steps, drop the step-4 checkpoint, resume from step 2: the weights must equal the
    uninterrupted run's bit for bit. Returns the checkpoints directory."""
    overrides = ("trainer.max_steps=4", "trainer.save_interval=2", "trainer.keep_last=0", *extra)
    full = build_rm_trainer(_cfg(tmp_path, *overrides))
    full.fit()
    final = {k: v.clone() for k, v in full.objective.module.state_dict().items()}
    ckpts = Path(full.output_dir) / "checkpoints"
    shutil.rmtree(ckpts / "step_4")
    (ckpts / "latest").write_text("step_2\n")

    resumed = build_rm_trainer(_cfg(tmp_path, *overrides))
    resumed.fit()
    assert resumed.start_step == 2 and resumed.state.step == 4
    for k, v in resumed.objective.module.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0)
    return ckpts


def test_resume_after_a_crash_continues_from_the_saved_step(tmp_path):
    _resume_from_step_2(tmp_path)


def test_reward_model_directory_can_be_the_starting_point(tmp_path, tiny):
    start = tmp_path / "start"
    tiny.reward_model("gpt2").save_pretrained(start)
    tiny.tokenizer.save_pretrained(start)
    trainer = build_rm_trainer(_cfg(tmp_path, f"model.path={start}", "trainer.max_steps=1"))
    loaded = trainer.objective.module.head.weight
    assert torch.equal(loaded, tiny.reward_model("gpt2").head.weight)


@pytest.mark.parametrize("arch", ["gpt_neox", "mixtral"])
def test_resume_with_checkpoint_key_conversions(tmp_path, arch):
    """4 steps straight vs. 2, stop, resume, 2 more, for architectures whose saved keys differ from
    the module's (Mixtral's experts are fused in the module, one by one on disk). Bitwise
    (tolerance 0): on CPU the resumed run repeats the same float operations in the same order."""
    overrides = ("trainer.max_steps=4", "trainer.save_interval=2", "trainer.keep_last=0")
    overrides += (f"model.tiny={arch}",)
    full = build_rm_trainer(_cfg(tmp_path, *overrides))
    full.fit()
    final = {k: v.clone() for k, v in full.objective.module.state_dict().items()}
    ckpts = Path(full.output_dir) / "checkpoints"
    shutil.rmtree(ckpts / "step_4")
    (ckpts / "latest").write_text("step_2\n")

    resumed = build_rm_trainer(_cfg(tmp_path, *overrides))
    resumed.fit()
    assert resumed.start_step == 2 and resumed.state.step == 4
    assert resumed.objective.module.head.weight.dtype == torch.float32
    for k, v in resumed.objective.module.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0)


# ---------------------------------------------------------------------------- LoRA
def test_lora_trains_adapters_and_the_head_and_exports_a_merged_reward_model(tmp_path):
    pytest.importorskip("peft")
    cfg = _cfg(tmp_path, "lora.r=4", "lora.merge_on_save=true", "trainer.max_steps=3")
    trainer = build_rm_trainer(cfg)
    module = trainer.objective.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.fit()
    after = module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("score.modules_to_save" in k for k in changed)  # the head trains in full
    assert all("lora_" in k or "score.modules_to_save" in k for k in changed)  # the base does not move
    out = Path(cfg.output_dir)
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    # the merged directory is what serve-reward and serve-critic load
    merged = RewardModel.from_pretrained(out / "merged")
    critic = CriticModel.from_pretrained(out / "merged")
    tokens, lengths = torch.tensor([[2, 40, 41, 42, 43, 44]]), torch.tensor([6])
    torch.testing.assert_close(merged.infer(tokens, lengths), module.infer(tokens, lengths))
    assert torch.equal(critic.head.weight, merged.head.weight)


def test_lora_resume_from_an_adapter_checkpoint_equals_the_uninterrupted_run(tmp_path):
    pytest.importorskip("peft")
    ckpts = _resume_from_step_2(tmp_path, "lora.r=4")
    assert (ckpts / "step_2" / "model" / "adapter_config.json").is_file()
