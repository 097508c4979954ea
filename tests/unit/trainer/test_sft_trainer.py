"""SFT trainer: response-only loss, exact gradient accumulation, learning, resume after a crash."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from openaligner.cli.main import main
from openaligner.config import ConfigError, load_config
from openaligner.data.sft import collate_sft
from openaligner.models.tokenizers import load_tokenizer
from openaligner.trainer.sft import SFTConfig, SFTObjective, build_sft_trainer
from openaligner.trainer.supervised import SupervisedTrainer


def _write_sft(path: Path, n: int = 48) -> Path:
    with path.open("w") as f:
        for i in range(n):
            d = i % 10
            f.write(json.dumps({"prompt": f"repeat {d}:", "response": f" {d}{d}{d}"}) + "\n")
    return path


def _cfg(tmp_path: Path, *overrides: str) -> SFTConfig:
    data = (
        _write_sft(tmp_path / "sft.jsonl")
        if not (tmp_path / "sft.jsonl").exists()
        else tmp_path / "sft.jsonl"
    )
    return load_config(
        SFTConfig,
        overrides=[
            f"data.train_path={data}",
            f"output_dir={tmp_path / 'out'}",
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


def test_loss_covers_response_tokens_only(tiny):
    model = tiny.causal_lm()
    from openaligner.data.sft import SFTExample

    examples = [SFTExample([2, 10, 11, 12, 20, 21, 1], 4), SFTExample([2, 13, 22, 23, 24, 1], 2)]
    batch = collate_sft(examples, pad_id=0)
    nll, count, _ = SFTObjective(model).loss(batch)
    assert int(count) == 3 + 4
    expected = 0.0
    with torch.no_grad():
        for e in examples:
            logp = torch.log_softmax(model(torch.tensor([e.tokens])).logits[0], -1)
            for t in range(e.prompt_length, len(e.tokens)):
                expected -= float(logp[t - 1, e.tokens[t]])
    assert float(nll.detach()) == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_is_exact(tmp_path):
    def one_step(micro: int) -> dict[str, torch.Tensor]:
        cfg = _cfg(tmp_path, f"trainer.micro_batch_size={micro}", "trainer.max_steps=1", "resume=false")
        trainer = build_sft_trainer(cfg)
        trainer.fit()
        return {k: v.clone() for k, v in trainer.objective.module.state_dict().items()}

    a, b = one_step(8), one_step(2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_sft_lowers_validation_loss_and_exports_hf_model(tmp_path):
    cfg = _cfg(tmp_path, "trainer.max_steps=25", "trainer.val_check_interval=0")
    trainer = build_sft_trainer(cfg)
    before = trainer.validate()["val/loss"]
    history = trainer.fit()
    after = history[-1]["val/loss"]
    assert after < 0.5 * before
    out = Path(cfg.output_dir)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = load_tokenizer(out)
    assert len(tokenizer) == 100
    saved, trained = model.state_dict(), trainer.objective.module.state_dict()
    assert all(torch.equal(saved[k], trained[k].cpu()) for k in saved)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 25 and "val/loss" in records[-1] and "train/lr" in records[-1]


def test_resume_after_a_crash_continues_from_the_saved_step(tmp_path):
    overrides = (
        "trainer.max_steps=6",
        "trainer.save_interval=2",
        "trainer.keep_last=0",
        "optim.scheduler=cosine",
        "optim.warmup_steps=2",
    )
    full = build_sft_trainer(_cfg(tmp_path, *overrides))
    full.fit()
    final = {k: v.clone() for k, v in full.objective.module.state_dict().items()}
    ckpts = Path(full.output_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_2", "step_4", "step_6"]
    # Simulate a crash after step 4: the step-6 checkpoint never became complete.
    (ckpts / "step_6" / "manifest.json").unlink()
    shutil.rmtree(ckpts / "step_6" / "model")

    resumed = build_sft_trainer(_cfg(tmp_path, *overrides))
    history = resumed.fit()
    assert resumed.start_step == 4 and resumed.state.step == 6
    assert len(history) == 2 and resumed.state.consumed_samples == 6 * 8
    for k, v in resumed.objective.module.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0)


def test_cli_runs_and_rejects_bad_batch_sizes(tmp_path, capsys):
    data = _write_sft(tmp_path / "sft.jsonl", n=20)
    out = tmp_path / "cli"
    args = [
        f"data.train_path={data}",
        f"output_dir={out}",
        "model.tiny_hidden_size=32",
        "model.tiny_num_layers=1",
        "trainer.max_steps=2",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "progress=false",
        "device=cpu",
    ]
    assert main(["train-sft", *args]) == 0
    assert "steps 0 → 2" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    assert main(["train-sft", *args, "trainer.micro_batch_size=3"]) == 2
    assert "trainer.micro_batch_size" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"model\.tiny"):
        load_config(SFTConfig, overrides=[f"data.train_path={data}", "model.tiny=bert"])


def _resume_from_step_2(tmp_path: Path, *overrides: str, shard: bool = False) -> None:
    """4 steps straight vs. 2 steps, stop, resume from step_2, 2 more: the same final weights.

    Bitwise (tolerance 0): on CPU the resumed run repeats the same float operations in the
    same order, so any difference would mean something was not restored. ``shard`` makes every
    save a sharded one (``model.safetensors.index.json``), as large models are saved.
    """
    overrides = ("trainer.max_steps=4", "trainer.save_interval=2", "trainer.keep_last=0", *overrides)

    def build() -> SupervisedTrainer:
        trainer = build_sft_trainer(_cfg(tmp_path, *overrides))
        if shard:  # files of at most 20 KB, whatever size the caller asks for
            model = trainer.objective.module
            save = partial(type(model).save_pretrained, model)
            model.save_pretrained = lambda *args, **kwargs: save(*args, **kwargs | {"max_shard_size": "20KB"})
        return trainer

    full = build()
    full.fit()
    final = {k: v.clone() for k, v in full.objective.module.state_dict().items()}
    ckpts = Path(full.output_dir) / "checkpoints"
    assert (ckpts / "step_2" / "model" / "model.safetensors.index.json").is_file() == shard
    shutil.rmtree(ckpts / "step_4")
    (ckpts / "latest").write_text("step_2\n")

    resumed = build()
    resumed.fit()
    assert resumed.start_step == 2 and resumed.state.step == 4
    for k, v in resumed.objective.module.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gpt_neox", "mixtral"])
def test_resume_with_checkpoint_key_conversions(tmp_path, arch):
    """GPT-NeoX stores its head as embed_out, Mixtral its experts one by one: resume reads them
    the way from_pretrained does."""
    _resume_from_step_2(tmp_path, f"model.tiny={arch}")


def test_resume_from_a_sharded_checkpoint(tmp_path):
    _resume_from_step_2(tmp_path, shard=True)


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "trainer.max_steps=1", "resume=false", "trainer.val_check_interval=0")
    trainer = build_sft_trainer(cfg)
    before = {k: v.clone() for k, v in trainer.objective.module.state_dict().items()}
    loss = trainer.objective.loss

    def nan_loss(batch):
        loss_sum, count, metrics = loss(batch)
        return loss_sum * float("nan"), count, metrics

    monkeypatch.setattr(trainer.objective, "loss", nan_loss)
    history = trainer.fit()
    assert history[0]["train/grad_norm"] != history[0]["train/grad_norm"]  # NaN, reported as such
    after = trainer.objective.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.scheduler.last_epoch == 0  # the schedule did not advance either


# ---------------------------------------------------------------------------- LoRA
def test_lora_trains_the_adapters_only_and_exports_adapter_and_merged_model(tmp_path):
    pytest.importorskip("peft")
    cfg = _cfg(tmp_path, "lora.r=4", "lora.merge_on_save=true", "trainer.max_steps=3")
    trainer = build_sft_trainer(cfg)
    module = trainer.objective.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == trainable
    history = trainer.fit()
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    after = module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # the base weights did not move
    out = Path(cfg.output_dir)
    # the adapter directory (+ tokenizer) is the export; checkpoints hold the adapters too
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert (out / "checkpoints" / "step_3" / "model" / "adapter_config.json").is_file()
    # the merged directory is a plain model that loads with the adapted model's logits
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True)
    assert len(load_tokenizer(out / "merged")) == 100
    tokens = torch.tensor([[2, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(tokens).logits, module(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )
    # a next stage is pointed at the merged directory
    with pytest.raises(ConfigError, match=f"use the merged directory {out / 'merged'}"):
        _cfg(tmp_path, f"model.path={out}")


def test_lora_resume_from_an_adapter_checkpoint_equals_the_uninterrupted_run(tmp_path):
    pytest.importorskip("peft")
    _resume_from_step_2(tmp_path, "lora.r=4", "lora.dropout=0.1")


def test_a_checkpoint_resumes_only_a_run_with_the_same_lora_setting(tmp_path):
    pytest.importorskip("peft")
    from openaligner.config import StartupError

    for run in ("lora", "full"):
        (tmp_path / run).mkdir()
    build_sft_trainer(_cfg(tmp_path / "lora", "lora.r=4", "trainer.max_steps=1")).fit()
    with pytest.raises(StartupError, match=r"resume=true cannot continue .* written with LoRA"):
        build_sft_trainer(_cfg(tmp_path / "lora", "trainer.max_steps=2")).fit()
    build_sft_trainer(_cfg(tmp_path / "full", "trainer.max_steps=1")).fit()
    with pytest.raises(StartupError, match=r"written without LoRA cannot resume a run with lora\.r > 0"):
        build_sft_trainer(_cfg(tmp_path / "full", "lora.r=4", "trainer.max_steps=2")).fit()
