"""RewardModel and CriticModel: read-out positions, padding invariance, fp32 head, HF directory I/O."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from openaligner.models.critic import CriticModel
from openaligner.models.reward import RewardModel

LENGTHS = torch.tensor([10, 4, 7])


def _tokens(vocab: int, pad: int = 0) -> torch.Tensor:
    tokens = torch.randint(3, vocab, (3, 10), generator=torch.Generator().manual_seed(0))
    tokens[torch.arange(10) >= LENGTHS.unsqueeze(-1)] = pad
    return tokens


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reward_is_the_head_at_the_last_valid_token(tiny, arch):
    rm = tiny.reward_model(arch)
    tokens = _tokens(tiny.size.vocab_size)
    rewards = rm.infer(tokens, LENGTHS)
    assert rewards.shape == (3,) and rewards.dtype == torch.float32
    for i, n in enumerate(LENGTHS.tolist()):
        hidden = rm.backbone(input_ids=tokens[i : i + 1, :n]).last_hidden_state[0, -1]
        expected = hidden.float() @ rm.head.weight[0].float()
        torch.testing.assert_close(rewards[i], expected, rtol=1e-5, atol=1e-5)
    assert len(set(rewards.tolist())) == 3


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padding_changes_nothing(tiny, arch):
    rm, critic = tiny.reward_model(arch), tiny.critic(arch)
    a, b = _tokens(tiny.size.vocab_size, pad=0), _tokens(tiny.size.vocab_size, pad=5)
    wide = torch.cat([b, torch.full((3, 6), 9)], dim=1)
    torch.testing.assert_close(rm.infer(a, LENGTHS), rm.infer(wide, LENGTHS), rtol=1e-5, atol=1e-6)
    values_a, values_wide = critic.infer(a, LENGTHS), critic.infer(wide, LENGTHS)
    assert values_wide.shape == (3, 16) and values_a.dtype == torch.float32
    valid = torch.arange(10) < LENGTHS.unsqueeze(-1)
    torch.testing.assert_close(values_a[valid], values_wide[:, :10][valid], rtol=1e-5, atol=1e-6)
    assert (values_a[~valid] == 0).all() and (values_wide[:, 10:] == 0).all()


def test_critic_from_reward_checkpoint_matches_reward_at_last_token(tiny, tmp_path):
    rm = tiny.reward_model("llama")
    rm.save_pretrained(tmp_path)
    critic = CriticModel.from_pretrained(tmp_path)
    tokens = _tokens(tiny.size.vocab_size)
    values, rewards = critic.infer(tokens, LENGTHS), rm.infer(tokens, LENGTHS)
    last = values[torch.arange(3), LENGTHS - 1]
    torch.testing.assert_close(last, rewards, rtol=1e-5, atol=1e-6)


def test_forward_is_differentiable_and_micro_batching_is_exact(tiny):
    rm, critic = tiny.reward_model(), tiny.critic()
    tokens = _tokens(tiny.size.vocab_size)
    rm.forward(tokens, LENGTHS).sum().backward()
    critic.forward(tokens, LENGTHS).sum().backward()
    assert rm.head.weight.grad is not None and rm.head.weight.grad.abs().sum() > 0
    assert critic.head.weight.grad is not None and critic.head.weight.grad.abs().sum() > 0
    torch.testing.assert_close(rm.infer(tokens, LENGTHS, micro_batch_size=1), rm.infer(tokens, LENGTHS))
    torch.testing.assert_close(
        critic.infer(tokens, LENGTHS, micro_batch_size=2), critic.infer(tokens, LENGTHS)
    )


def test_standardization_is_applied_in_infer_only(tiny):
    rm = tiny.reward_model()
    tokens = _tokens(tiny.size.vocab_size)
    raw = rm.infer(tokens, LENGTHS)
    rm.standardization = (0.5, 2.0)
    torch.testing.assert_close(rm.infer(tokens, LENGTHS), (raw - 0.5) / 2.0)
    torch.testing.assert_close(rm.forward(tokens, LENGTHS).detach(), raw)
    with pytest.raises(ValueError, match="std"):
        RewardModel(rm.hf_model, standardization=(0.0, 0.0))


@pytest.mark.parametrize("cls_name", ["reward", "critic"])
def test_save_load_round_trip_is_bitwise(tiny, tmp_path, cls_name):
    model = tiny.reward_model("gpt2") if cls_name == "reward" else tiny.critic("gpt2")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["score.weight"].shape == (1, tiny.size.hidden_size)
    assert stored["score.weight"].dtype == torch.float32
    loaded = type(model).from_pretrained(tmp_path)
    original_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert original_state.keys() == loaded_state.keys()
    for key, value in original_state.items():
        assert torch.equal(value, loaded_state[key]), key
    tokens = _tokens(tiny.size.vocab_size)
    assert torch.equal(model.infer(tokens, LENGTHS), loaded.infer(tokens, LENGTHS))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_plain_hf_sequence_classifier_loads_as_reward_model(tiny, tmp_path, arch):
    hf = tiny.reward_model(arch).hf_model  # a plain transformers *ForSequenceClassification
    assert type(hf).__name__.endswith("ForSequenceClassification")
    hf.save_pretrained(tmp_path)
    rm = RewardModel.from_pretrained(tmp_path)
    tokens = torch.randint(3, tiny.size.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    # Without pad tokens HF reads its score at the last position, as we do.
    with torch.no_grad():
        expected = AutoModelForSequenceClassification.from_pretrained(tmp_path)(tokens).logits[:, 0]
    torch.testing.assert_close(rm.infer(tokens, torch.tensor([6, 6])), expected, rtol=1e-5, atol=1e-6)


def test_head_stays_float32_with_a_bfloat16_backbone(tiny, tmp_path):
    tiny.reward_model().save_pretrained(tmp_path)
    rm = RewardModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert rm.head.weight.dtype == torch.float32
    assert next(rm.backbone.parameters()).dtype == torch.bfloat16
    assert rm.infer(_tokens(tiny.size.vocab_size), LENGTHS).dtype == torch.float32


def test_causal_lm_directory_loads_with_a_fresh_head(tiny, tmp_path):
    lm = tiny.causal_lm()
    lm.save_pretrained(tmp_path)
    rm = RewardModel.from_pretrained(tmp_path)
    backbone = rm.backbone.state_dict()
    for key, value in lm.transformer.state_dict().items():
        assert torch.equal(backbone[key], value), key


def test_bad_inputs_are_refused(tiny, tmp_path):
    rm = tiny.reward_model()
    tokens = _tokens(tiny.size.vocab_size)
    with pytest.raises(ValueError, match="lengths"):
        rm.infer(tokens, torch.tensor([11, 4, 7]))
    with pytest.raises(ValueError, match="rows"):
        rm.infer(tokens, torch.tensor([4, 7]))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        RewardModel.from_pretrained(tmp_path)
