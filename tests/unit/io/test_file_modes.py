"""Weight files get the mode of their directory's other files (0o666 less the umask): safetensors
writes through a temporary file, created 0o600, so exported models, LoRA adapters, merged models,
checkpoints and converted GGUF directories held 0o600 weights beside 0o644 configs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from safetensors.torch import save_file

from openaligner.io.checkpoint import CheckpointManager, give_default_modes
from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.precision import save_pretrained_as


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_exported_weights_and_adapters_are_0644_like_their_configs(tmp_path, umask_022):
    import torch

    model = build_tiny_causal_lm("llama", TinySize(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2))
    save_pretrained_as(model, tmp_path / "full", torch.bfloat16)
    modes = _modes(tmp_path / "full")
    assert modes["model.safetensors"] == modes["config.json"] == umask_022, modes
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    save_pretrained_as(adapted, tmp_path / "adapter")
    modes = _modes(tmp_path / "adapter")
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"] == umask_022, modes


def test_a_checkpoints_weight_files_are_0644_and_the_mode_follows_the_umask(tmp_path, umask_022):
    import torch

    def write(d: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        (d / "state.json").write_text("{}")

    path = CheckpointManager(tmp_path / "ckpt").save(1, write)
    assert set(_modes(path).values()) == {umask_022}, _modes(path)
    os.umask(0o077)  # a private umask is kept private
    other = tmp_path / "private"
    other.mkdir()
    save_file({"w": torch.zeros(2)}, str(other / "x.safetensors"))
    os.chmod(other / "x.safetensors", 0o644)
    give_default_modes(other)
    assert _modes(other) == {"x.safetensors": 0o600}
