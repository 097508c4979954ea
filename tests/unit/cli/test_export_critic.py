"""``openaligner export-critic``: a critic checkpoint written by one process (a Hugging Face
directory inside it) exported with its values; what cannot be exported is refused in one line
with exit code 2. The sharded layouts are exported in ``tests/unit/trainer/test_sharded_files.py``."""

import json

import torch
from transformers import AutoModelForSequenceClassification

from openaligner.cli.main import main
from openaligner.io.checkpoint import CheckpointManager
from openaligner.models.builders import TinySize, build_tiny_critic
from openaligner.models.critic import CriticModel
from openaligner.models.lora import LoraConfig, add_lora
from openaligner.trainer.critic import CriticTrainConfig, CriticTrainer

SIZE = TinySize(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2)
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 31, 0, 6]])


def checkpoint_of(critic, root):
    """``critic`` after one AdamW step, and the step_1 checkpoint a one-process server writes."""
    optimizer = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=0.05)
    critic(TOKENS).square().mean().backward()
    optimizer.step()
    trainer = CriticTrainer(
        CriticTrainConfig(global_batch_size=2), critic, optimizer, checkpoints=CheckpointManager(root)
    )
    trainer.step = 1
    return trainer.write_checkpoint()


def values(critic):
    with torch.no_grad():
        return critic.eval()(TOKENS)


def test_a_one_process_checkpoint_exports_with_the_critics_values_in_the_dtype_asked(tmp_path):
    critic = build_tiny_critic("llama", SIZE, seed=3)
    step = checkpoint_of(critic, tmp_path / "checkpoints")
    assert main(["export-critic", str(step), str(tmp_path / "hf")]) == 0
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert torch.equal(values(CriticModel(loaded)), values(critic))
    assert main(["export-critic", str(step), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_what_cannot_be_exported_is_refused_in_one_line(tmp_path, capsys):
    assert main(["export-critic", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "holds no critic: neither critic/ nor critic.dcp/" in capsys.readouterr().err
    lora = add_lora(build_tiny_critic("llama", SIZE, seed=3), LoraConfig(r=2))
    step = checkpoint_of(lora, tmp_path / "lora")
    assert main(["export-critic", str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "is a LoRA critic's checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()
