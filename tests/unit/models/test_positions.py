"""The one position-limit lookup, and reading it from a model source without loading weights."""

import json
from types import SimpleNamespace

import pytest
from transformers import GPT2Config, LlamaConfig

from openaligner.models.positions import position_limit
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    position_limit_key,
    source_position_limit,
)


def test_position_limit_reads_either_attribute_and_none_without_one():
    assert position_limit(GPT2Config(n_positions=64)) == 64
    assert position_limit(LlamaConfig(max_position_embeddings=96)) == 96  # rotary models are limited too
    assert position_limit(SimpleNamespace(max_position_embeddings=32)) == 32
    assert position_limit(SimpleNamespace(hidden_size=8)) is None
    assert position_limit(SimpleNamespace(n_positions=None, max_position_embeddings=0)) is None
    assert position_limit(None) is None


def test_source_limit_of_a_tiny_model_is_its_configured_positions():
    src = ModelSourceConfig(tiny="llama", tiny_max_positions=48)
    assert source_position_limit(src) == 48
    assert position_limit_key(src, "actor") == "actor.tiny_max_positions"


def test_source_limit_of_a_directory_comes_from_config_json_alone(tmp_path):
    GPT2Config(n_positions=40).save_pretrained(tmp_path)  # no weights: nothing is loaded
    src = ModelSourceConfig(path=str(tmp_path))
    assert source_position_limit(src) == 40
    assert position_limit_key(src) == "model.path"


def test_source_limit_of_an_unknown_architecture_reads_the_raw_json(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "not-in-transformers", "n_positions": 12})
    )
    assert source_position_limit(ModelSourceConfig(path=str(tmp_path))) == 12
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-in-transformers"}))
    assert source_position_limit(ModelSourceConfig(path=str(tmp_path))) is None


def test_source_limit_refuses_a_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SourceError, match=r"actor\.path=.*config\.json"):
        source_position_limit(ModelSourceConfig(path=str(tmp_path)), key="actor")
