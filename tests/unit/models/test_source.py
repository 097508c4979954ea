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
from openaligner.models.tokenizers import build_char_tokenizer

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


def gapped_tokenizer():
    """Four tokens numbered with a gap: ``len`` is 4, yet ``b`` encodes as id 500."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<unk>": 1, "a": 2, "b": 500}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def test_a_tokenizer_with_ids_past_the_embedding_table_is_refused_naming_both_sizes(tiny):
    from openaligner.models.source import check_vocab, tokenizer_id_count

    model = tiny.causal_lm()  # 100 embedding rows, as many as the char tokenizer's ids
    check_vocab(tiny.tokenizer, model)
    tok = build_char_tokenizer()  # a fresh one: the shared fixture's stays as it is
    tok.add_tokens(["<extra>"], special_tokens=True)  # id 100: no row for it
    with pytest.raises(
        SourceError, match=r"101 token ids \(0\.\.100\) but actor embeds only 100 .*ids 100\.\.100"
    ):
        check_vocab(tok, model, key="actor")
    # a vocabulary with gaps emits ids beyond its length: the highest id counts, not len()
    gapped = gapped_tokenizer()
    assert len(gapped) == 4 and gapped("a b")["input_ids"] == [2, 500]
    assert tokenizer_id_count(gapped) == 501
    with pytest.raises(SourceError, match=r"501 token ids .* embeds only 100"):
        check_vocab(gapped, model)


def test_an_embedding_table_padded_past_the_tokenizer_is_fine(tiny):
    from openaligner.models.builders import TinySize, build_tiny_causal_lm
    from openaligner.models.source import check_vocab

    padded = build_tiny_causal_lm("gpt2", TinySize(vocab_size=128, hidden_size=32, num_heads=2), seed=0)
    check_vocab(tiny.tokenizer, padded)  # 100 ids, 128 rows: the 28 spare rows are never read
    with pytest.raises(SourceError, match="tiny_vocab_size to at least 501"):
        check_vocab(gapped_tokenizer(), padded)
