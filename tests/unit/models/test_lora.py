"""LoRA adapters (models/lora.py): what trains, the merged copy, the `lora` section's refusals, and
the optimizer state LoRA saves."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import pytest
import torch

from openaligner.config import ConfigError, load_config
from openaligner.models.lora import (
    LoraConfig,
    LoraError,
    adapter_directory_problem,
    add_lora,
    is_peft_model,
    merged_copy,
    merged_lora_blocks,
)
from openaligner.trainer.optim import OptimConfig, build_optimizer

pytest.importorskip("peft")

TOKENS = torch.tensor([[2, 10, 11, 12, 13, 14, 15, 16], [2, 20, 21, 22, 23, 24, 25, 26]])
LENGTHS = torch.tensor([8, 5])


@dataclass
class Command:
    """A command's schema holding the lora section, as train-sft, train-rm and train-ppo do."""

    lora: LoraConfig = field(default_factory=LoraConfig)


def _perturb_adapters(model: torch.nn.Module) -> None:
    """Give the adapters (initialised as a no-op, B = 0) a non-zero effect, as training would."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def test_r_0_is_no_lora_and_needs_no_peft(tiny, monkeypatch):
    model = tiny.causal_lm()
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    assert add_lora(model, LoraConfig()) is model
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_only_the_adapters_train_on_the_same_base_weights(tiny, arch):
    base = tiny.causal_lm(arch)
    before = base(TOKENS).logits
    base_params = {id(p) for p in base.parameters()}
    model = add_lora(base, LoraConfig(r=4))
    assert is_peft_model(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # the base weights are wrapped, not copied: every one of them is still there, frozen
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    assert base_params == frozen
    # B = 0 at initialisation: the adapted model starts as its base
    assert torch.equal(model(input_ids=TOKENS).logits, before)


@pytest.mark.parametrize("kind", ["reward_model", "critic"])
def test_a_scalar_head_model_trains_adapters_and_its_whole_head(tiny, kind):
    model = getattr(tiny, kind)()
    before = model(TOKENS, LENGTHS)
    assert add_lora(model, LoraConfig(r=4)) is model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    heads = {n for n in trainable if "lora_" not in n}
    assert heads == {"hf_model.base_model.model.score.modules_to_save.default.weight"}
    assert model.head.weight.requires_grad and model.head.weight.dtype == torch.float32
    torch.testing.assert_close(model(TOKENS, LENGTHS), before, rtol=0, atol=0)
    with torch.no_grad():
        model.head.weight.mul_(3.0)  # the trained copy is the head that is applied
    assert not torch.allclose(model(TOKENS, LENGTHS), before)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_merged_copy_has_the_adapted_logits_and_leaves_the_model_alone(tiny, arch):
    model = add_lora(tiny.causal_lm(arch), LoraConfig(r=4))
    _perturb_adapters(model)
    adapted = model(input_ids=TOKENS).logits
    merged = merged_copy(model)
    assert type(merged) is type(tiny.causal_lm(arch)) and not is_peft_model(merged)
    assert merged.device.type == "cpu" and not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(merged(input_ids=TOKENS).logits, adapted, rtol=1e-5, atol=1e-5)
    assert is_peft_model(model) and torch.equal(model(input_ids=TOKENS).logits, adapted)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_merged_lora_blocks_are_the_merged_copy_s_tensors_a_step_changes(tiny, arch):
    """What the vllm engine pushes after an update of a LoRA policy (it holds the rest already):
    bitwise the merged copy's tensors, every one that differs from the base model's among them,
    with the other tensors of the adapted layers' modules (vLLM loads q/k/v as one layer)."""
    base = {k: v.clone() for k, v in tiny.causal_lm(arch).state_dict().items()}
    model = add_lora(tiny.causal_lm(arch), LoraConfig(r=4))
    _perturb_adapters(model)
    merged = merged_copy(model).state_dict()
    blocks = merged_lora_blocks(model)
    assert blocks is not None and set(blocks) < set(merged)
    for name, tensor in blocks.items():
        assert torch.equal(tensor, merged[name]), name
    changed = {k for k, v in merged.items() if not torch.equal(v, base[k])}
    assert changed and changed <= set(blocks)
    assert not any("embed" in n or "wte" in n or "lm_head" in n for n in blocks)  # the bulk of a model
    parents = {n.rsplit(".", 2)[0] for n in changed}  # e.g. model.layers.0.self_attn
    assert set(blocks) == {k for k in merged if any(k.startswith(p + ".") for p in parents)}


def test_merged_lora_blocks_are_none_when_more_than_the_adapters_trains(tiny):
    model = add_lora(tiny.reward_model(), LoraConfig(r=4))  # its head trains whole
    assert merged_lora_blocks(model.hf_model) is None


def test_merged_copy_of_a_reward_model_keeps_its_trained_head(tiny):
    model = add_lora(tiny.reward_model(), LoraConfig(r=4))
    _perturb_adapters(model)
    with torch.no_grad():
        model.head.weight.mul_(3.0)
    merged = merged_copy(model)
    assert type(merged).__name__ == "GPT2ForSequenceClassification"
    from openaligner.models.reward import RewardModel

    torch.testing.assert_close(RewardModel(merged)(TOKENS, LENGTHS), model(TOKENS, LENGTHS))


def test_lora_shrinks_the_optimizer_state(tiny):
    """AdamW keeps two float32 moments per trained element: LoRA keeps them for the adapters only."""

    def state_bytes(model: torch.nn.Module) -> int:
        optimizer, _ = build_optimizer(model.parameters(), OptimConfig(lr=1e-3), None)
        model(input_ids=TOKENS).logits.float().square().mean().backward()
        optimizer.step()
        return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())

    full = state_bytes(tiny.causal_lm())
    lora = state_bytes(add_lora(tiny.causal_lm(), LoraConfig(r=4)))
    assert 0 < lora < 0.1 * full


def test_section_refusals_name_the_key(monkeypatch):
    for overrides, key in [
        (["lora.r=-1"], "lora.r must be >= 0"),
        (["lora.merge_on_save=true"], "lora.merge_on_save=true needs lora.r > 0"),
        (["lora.r=4", "lora.target_modules=[all-linear,q_proj]"], "lora.target_modules"),
        (["lora.r=4", "lora.target_modules=[]"], "lora.target_modules"),
        (["lora.r=4", "lora.alpha=0"], "lora.alpha"),
        (["lora.r=4", "lora.dropout=1.0"], "lora.dropout"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(Command, overrides=overrides)
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"lora\.r=4 needs the peft package.*openaligner\[lora\]"):
        load_config(Command, overrides=["lora.r=4"])
    assert load_config(Command).lora.r == 0  # off needs no peft


def test_missing_peft_and_unmatched_layers_are_refused_when_wrapping(tiny, monkeypatch):
    with pytest.raises(LoraError, match=r"lora.target_modules=\['q_proj'\] matches no layer.*c_attn"):
        add_lora(tiny.causal_lm("gpt2"), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="not a causal LM"):
        add_lora(tiny.reward_model().hf_model, LoraConfig(r=4))
    cfg = LoraConfig(r=4)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(LoraError, match="needs the peft package"):
        add_lora(tiny.causal_lm(), cfg)


def test_an_adapter_directory_is_not_a_model_path(tiny, tmp_path):
    from openaligner.trainer.sft import SFTConfig

    adapter = tmp_path / "sft"
    add_lora(tiny.causal_lm(), LoraConfig(r=2)).save_pretrained(str(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 2
    assert "lora.merge_on_save=true" in (adapter_directory_problem(adapter) or "")
    with pytest.raises(ConfigError, match=r"model\.path=.* holds a LoRA adapter.*merge_on_save"):
        load_config(SFTConfig, overrides=["data.train_path=x.jsonl", f"model.path={adapter}"])
    tiny.causal_lm().save_pretrained(str(adapter / "merged"))
    with pytest.raises(ConfigError, match=f"use the merged directory {adapter / 'merged'}"):
        load_config(SFTConfig, overrides=["data.train_path=x.jsonl", f"model.path={adapter}"])
    assert adapter_directory_problem(adapter / "merged") is None


def test_wrapping_prints_no_is_gradient_checkpointing_future_warning_and_silences_nothing_else():
    """peft reads the property transformers deprecates while it wraps a model: every LoRA command
    printed the FutureWarning at start. The silencing is scoped to peft's wrapping."""
    import warnings

    from openaligner.models.builders import TinySize, build_tiny_causal_lm

    model = build_tiny_causal_lm("llama", TinySize(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = add_lora(model, LoraConfig(r=2))
        merged_copy(wrapped)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], caught
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        assert model.is_gradient_checkpointing is False  # outside the wrapping: shown as before
