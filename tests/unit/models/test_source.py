"""models/source: a source that names no model, tokenizers a server can do without, the device."""

import pytest
import torch

from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    find_tokenizer,
    load_reward_model,
    pick_device,
    resolve_tokenizer,
    source_position_limit,
)

NONE = ModelSourceConfig(tiny=None)


def test_a_source_that_names_no_model_is_refused_naming_both_keys():
    for load in (
        lambda: resolve_tokenizer(NONE, TokenizerSourceConfig(), key="actor"),
        lambda: find_tokenizer(NONE, TokenizerSourceConfig(), key="actor"),
        lambda: source_position_limit(NONE, key="actor"),
    ):
        with pytest.raises(SourceError, match=r"set actor\.path=<HF directory> or actor\.tiny=gpt2"):
            load()
    with pytest.raises(SourceError, match="no model is named"):
        load_reward_model(NONE, 100, torch.device("cpu"))


def test_a_model_directory_without_a_tokenizer(tmp_path, tiny):
    tiny.reward_model().save_pretrained(str(tmp_path))
    source = ModelSourceConfig(path=str(tmp_path))
    assert find_tokenizer(source, TokenizerSourceConfig()) is None  # a server takes token ids then
    with pytest.raises(SourceError, match=r"holds no tokenizer; set tokenizer\.path"):
        resolve_tokenizer(source, TokenizerSourceConfig())
    tiny.tokenizer.save_pretrained(str(tmp_path))
    found = find_tokenizer(source, TokenizerSourceConfig())
    assert found is not None and found.get_vocab() == tiny.tokenizer.get_vocab()


def test_auto_and_cuda_mean_the_current_cuda_device(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # torchrun's LOCAL_RANK, say
    assert pick_device("auto") == pick_device("cuda") == torch.device("cuda", 3)
    assert pick_device("cuda:1") == torch.device("cuda", 1)  # as given
