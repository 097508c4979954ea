"""SFT and RM training from a bfloat16-stored model: float32 master weights that learn as much as
from a float32-stored copy of the same weights; checkpoints hold the masters, the final export
the source's stored dtype (``save_dtype: auto``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from openaligner.config import load_config
from openaligner.models.builders import TinySize, build_tiny_causal_lm, build_tiny_sequence_classifier
from openaligner.models.tokenizers import build_char_tokenizer
from openaligner.trainer.rm import RMConfig, build_rm_trainer
from openaligner.trainer.sft import SFTConfig, build_sft_trainer

COMMANDS = {"sft": (SFTConfig, build_sft_trainer), "rm": (RMConfig, build_rm_trainer)}


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """``<sft|rm>/<bf16|fp32>/``: a tiny Llama (causal LM / reward model) with the char tokenizer,
    saved in bfloat16 and, the same weights, in float32; plus ``sft.jsonl`` and ``rm.jsonl``."""
    root = tmp_path_factory.mktemp("stored")
    tokenizer = build_char_tokenizer()
    size = TinySize(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, max_positions=64)
    for kind, model in [
        ("sft", build_tiny_causal_lm("llama", size, seed=0)),
        ("rm", build_tiny_sequence_classifier("llama", size, seed=0)),
    ]:
        model = model.to(torch.bfloat16)
        for name, dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
            model.to(dtype).save_pretrained(root / kind / name)
            tokenizer.save_pretrained(str(root / kind / name))
    with (root / "sft.jsonl").open("w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"repeat {i % 10}:", "response": f" {i % 10}" * 3}) + "\n")
    with (root / "rm.jsonl").open("w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"q{i}?", "chosen": "yes" * (1 + i % 3), "rejected": "no"}) + "\n")
    return root


def train(stored: Path, kind: str, source: str, out: Path, *overrides: str):
    """3 optimizer steps at lr 1e-5 from ``stored/<kind>/<source>``: (share of the weights changed,
    the trained module)."""
    schema, build = COMMANDS[kind]
    cfg = load_config(
        schema,
        overrides=[
            f"model.path={stored / kind / source}",
            f"data.train_path={stored / f'{kind}.jsonl'}",
            f"output_dir={out}",
            "trainer.max_steps=3",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=0",
            "trainer.save_interval=0",
            "optim.lr=1e-5",
            "progress=false",
            "device=cpu",
            *overrides,
        ],
    )
    trainer = build(cfg)
    module = trainer.objective.module
    before = [p.detach().clone() for p in module.parameters()]
    trainer.fit()
    params = list(module.parameters())
    changed = sum(int((p.detach() != b.to(p.dtype)).sum()) for p, b in zip(params, before, strict=True))
    return changed / sum(p.numel() for p in params), module


def stored_dtypes(directory: Path) -> set[torch.dtype]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_a_bf16_stored_model_trains_fp32_masters_that_learn_as_much(stored, tmp_path, kind):
    from_bf16, module = train(stored, kind, "bf16", tmp_path / "bf16")
    from_fp32, _ = train(stored, kind, "fp32", tmp_path / "fp32")
    assert from_fp32 > 0.3
    assert from_bf16 >= from_fp32 - 0.03, f"bf16-stored changed {from_bf16:.1%}, fp32-stored {from_fp32:.1%}"
    assert {p.dtype for p in module.parameters()} == {torch.float32}


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_bf16_mixed_learns_as_much_and_saves_masters_then_the_stored_dtype(stored, tmp_path, kind):
    from_bf16, module = train(stored, kind, "bf16", tmp_path / "bf16", "precision=bf16-mixed")
    from_fp32, _ = train(stored, kind, "fp32", tmp_path / "fp32", "precision=fp32")
    assert from_bf16 >= from_fp32 - 0.03, f"bf16-mixed changed {from_bf16:.1%}, fp32 {from_fp32:.1%}"
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    # resume checkpoints hold the float32 masters; the export is in the source's stored dtype
    checkpoint = tmp_path / "bf16" / "checkpoints" / "step_3" / "model"
    assert stored_dtypes(checkpoint) == {torch.float32}
    assert stored_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_dtypes(tmp_path / "fp32") == {torch.float32}


def test_save_dtype_overrides_the_stored_dtype(stored, tmp_path):
    train(stored, "sft", "bf16", tmp_path, "trainer.max_steps=1", "save_dtype=fp32")
    assert stored_dtypes(tmp_path) == {torch.float32}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_lora_under_bf16_mixed_keeps_float32_adapters_and_exports_the_merged_model_as_stored(
    stored, tmp_path, kind
):
    pytest.importorskip("peft")
    changed, module = train(
        stored, kind, "bf16", tmp_path, "precision=bf16-mixed", "lora.r=4", "lora.merge_on_save=true"
    )
    assert 0 < changed < 0.2  # the adapters (and a reward model's head) moved, nothing else
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    # adapters are written as the float32 masters; the merged model in the stored dtype
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118
    assert stored_dtypes(tmp_path / "merged") == {torch.bfloat16}
