"""Tiny builders: seeded determinism, special ids, no global RNG side effects."""

from __future__ import annotations

import pytest
import torch

from openaligner.models.builders import (
    TINY_ARCHS,
    SpecialIds,
    TinySize,
    build_tiny_causal_lm,
    build_tiny_reward_model,
    build_tiny_sequence_classifier,
    tiny_config,
)
from openaligner.models.source import ModelSourceConfig

SMALL = TinySize(vocab_size=40, hidden_size=32, num_layers=1, num_heads=2)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_same_weights_other_seed_other_weights(arch):
    a, b, c = (build_tiny_causal_lm(arch, SMALL, seed=s) for s in (0, 0, 1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_reward_model("llama", SMALL, seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_special_ids_and_sizes(arch):
    config = tiny_config(arch, SMALL)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (0, 1, 2)
    model = build_tiny_causal_lm(arch, SMALL)
    assert model.get_input_embeddings().weight.shape == (40, 32)
    assert not model.training


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_architecture_builds_both_roles_from_the_config_name(arch):
    source = ModelSourceConfig(tiny=arch)
    assert source.tiny_arch == arch
    classifier = build_tiny_sequence_classifier(source.tiny_arch, SMALL)
    assert type(classifier).__name__.endswith("ForSequenceClassification")
    assert classifier.config.num_labels == 1 and classifier.score.weight.shape == (1, 32)


GQA = {"llama", "mistral", "qwen2", "gemma2", "mixtral"}  # 2 key/value heads for 4 query heads
TIED = {"gpt2", "qwen2", "gemma", "gemma2", "opt"}  # LM head is the input embedding
SLIDING = {"mistral": ["sliding_attention"] * 2, "gemma2": ["sliding_attention", "full_attention"]}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_architecture_keeps_its_family_feature_on(arch):
    size = TinySize(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4)
    model = build_tiny_causal_lm(arch, size)
    config = model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    assert kv_heads == (2 if arch in GQA else 1 if arch == "gemma" else 4)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (arch in TIED)
    if arch in SLIDING:  # a window shorter than the test sequences, so that it acts
        assert config.sliding_window == size.sliding_window < 16
        assert list(getattr(config, "layer_types", None) or ["sliding_attention"] * 2) == SLIDING[arch]
    if arch == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)


def test_special_ids_of_another_tokenizer_are_written_into_the_config():
    ids = SpecialIds(pad=None, eos=7, bos=None)
    for arch in ("gpt2", "qwen2", "opt"):
        config = tiny_config(arch, SMALL, ids)
        assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (None, 7, None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_config("llama", SMALL, SpecialIds(eos=40))


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="num_heads"):
        TinySize(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        tiny_config("bert")  # type: ignore[arg-type]
