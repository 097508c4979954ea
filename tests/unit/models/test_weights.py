"""load_weights_into: a saved directory restored into live models the way from_pretrained reads it."""

from __future__ import annotations

import pytest
import torch

from openaligner.models.builders import TINY_ARCHS, TinySize, build_tiny_sequence_classifier
from openaligner.models.critic import CriticModel
from openaligner.models.weights import load_weights_into


def _build(tiny, arch: str, role: str, seed: int):
    return tiny.causal_lm(arch, seed=seed) if role == "causal_lm" else tiny.critic(arch, seed=seed)


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("role", ["causal_lm", "critic"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_saved_model_is_restored_in_place_exactly(tiny, tmp_path, arch, role):
    saved, live = _build(tiny, arch, role, seed=1), _build(tiny, arch, role, seed=2)
    saved.save_pretrained(tmp_path)
    params = [id(p) for p in live.parameters()]
    torch.manual_seed(0)
    rng = torch.random.get_rng_state()
    load_weights_into(live, tmp_path)
    _assert_same_state(live, saved)
    assert [id(p) for p in live.parameters()] == params  # an optimizer over them stays valid
    assert torch.equal(torch.random.get_rng_state(), rng)  # loading leaves the caller's RNG alone
    if role == "causal_lm" and live.config.tie_word_embeddings:  # the tied head still is the embedding
        assert live.get_output_embeddings().weight is live.get_input_embeddings().weight


def test_a_sharded_directory_with_an_index_loads(tiny, tmp_path):
    saved, live = tiny.causal_lm("mixtral", seed=1), tiny.causal_lm("mixtral", seed=2)
    saved.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    load_weights_into(live, tmp_path)
    _assert_same_state(live, saved)


def test_a_bfloat16_backbone_keeps_its_float32_head_unrounded(tiny, tmp_path):
    saved = tiny.critic("llama", seed=1)
    saved.hf_model.base_model.to(torch.bfloat16)
    with torch.no_grad():  # a head value that bfloat16 cannot hold
        saved.head.weight[0, 0] = 1.0 + 2.0**-20
    saved.save_pretrained(tmp_path)
    live = tiny.critic("llama", seed=2)
    live.hf_model.base_model.to(torch.bfloat16)
    load_weights_into(live, tmp_path)
    assert live.head.weight.dtype == torch.float32
    _assert_same_state(live, saved)


def test_a_directory_of_another_model_is_refused_with_the_keys(tiny, tmp_path):
    tiny.causal_lm("llama").save_pretrained(tmp_path)
    live = tiny.causal_lm("gpt2")
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{tmp_path}.*missing \['transformer\..*unexpected \['model\."):
        load_weights_into(live, tmp_path)
    assert all(torch.equal(v, live.state_dict()[k]) for k, v in before.items())


def test_a_causal_lm_directory_does_not_silently_give_a_critic_a_fresh_head(tiny, tmp_path):
    tiny.causal_lm("gpt_neox").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['score\.weight'\]"):
        load_weights_into(tiny.critic("gpt_neox"), tmp_path)


def test_weights_of_another_width_are_refused(tiny, tmp_path):
    narrow = TinySize(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4)
    CriticModel(build_tiny_sequence_classifier("llama", narrow)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*mis-shaped \['model\.embed_tokens\.weight'"):
        load_weights_into(tiny.critic("llama"), tmp_path)


# ---------------------------------------------------------------------------- PEFT adapters
def _lora(tiny, rank: int = 2, seed: int = 0):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)  # LoRA's A matrices are drawn from the global RNG
    config = peft.LoraConfig(r=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(tiny.causal_lm("llama"), config)


def test_an_adapter_directory_restores_the_adapters_only(tiny, tmp_path):
    saved, live = _lora(tiny, seed=1), _lora(tiny, seed=2)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and not (tmp_path / "config.json").exists()
    params = [id(p) for p in live.parameters()]
    load_weights_into(live, tmp_path)
    _assert_same_state(live, saved)
    assert [id(p) for p in live.parameters()] == params


def test_an_adapter_of_another_rank_is_refused(tiny, tmp_path):
    _lora(tiny, rank=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_weights_into(_lora(tiny, rank=2), tmp_path)


def test_an_adapter_directory_is_refused_for_a_plain_model(tiny, tmp_path):
    _lora(tiny).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        load_weights_into(tiny.causal_lm("llama"), tmp_path)
