"""Encoder reward models (BERT, MiniLM, DeBERTa: a sequence classifier with its own pooler and head,
pooled at the first token): the reward is the classifier's own logit, padding never changes it,
the head stays float32, the layout is the tokenizer's ``[CLS] … [SEP]``, and such a model is
refused as a critic. Before, ``RewardModel`` refused every classifier without a ``score`` head."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from openaligner.data.render import Renderer, SequenceLayout
from openaligner.models.critic import CriticModel
from openaligner.models.reward import FIRST_TOKEN, LAST_TOKEN, RewardModel, scalar_readout
from tiny_bert import tiny_bert_classifier, tiny_bert_dir, tiny_bert_tokenizer


def _right_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows) + 2  # extra padding columns too
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, torch.tensor([len(r) for r in rows])


def test_an_encoder_reward_is_the_classifiers_own_logit_whatever_the_padding():
    hf = tiny_bert_classifier(vocab_size=30)
    rm = RewardModel(hf).eval()
    assert rm.readout == FIRST_TOKEN and scalar_readout(hf) == FIRST_TOKEN
    rows = [[2, 5, 6, 7, 8, 3], [2, 9, 3], [2, 10, 11, 12, 3]]
    tokens, lengths = _right_padded(rows)
    rewards = rm.infer(tokens, lengths)
    with torch.no_grad():
        alone = torch.cat([hf(input_ids=torch.tensor([r])).logits.reshape(-1) for r in rows])
    torch.testing.assert_close(rewards, alone, rtol=0, atol=1e-6)
    # another pad id in the padding columns changes nothing: they are masked out of attention
    tokens[tokens == 0] = 17
    torch.testing.assert_close(rm.infer(tokens, lengths), rewards, rtol=0, atol=1e-6)


def test_the_first_token_is_what_the_encoder_pools():
    rm = RewardModel(tiny_bert_classifier(vocab_size=30)).eval()
    tokens, lengths = _right_padded([[2, 5, 6, 3], [4, 5, 6, 3]])
    rewards = rm.infer(tokens, lengths)
    assert not torch.allclose(rewards[0], rewards[1])


def test_the_encoder_head_stays_float32_under_a_bf16_autocast():
    rm = RewardModel(tiny_bert_classifier(vocab_size=30)).eval()
    assert rm.head.weight.dtype == torch.float32
    tokens, lengths = _right_padded([[2, 5, 6, 3], [2, 7, 3]])
    pooled: list[torch.Tensor] = []
    rm.head.register_forward_hook(lambda _m, args, _out: pooled.append(args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rewards = rm.infer(tokens, lengths)
    assert rewards.dtype == torch.float32
    # the head's own product in float32, not rounded to bf16's 8 significant bits
    expected = (pooled[0].float() @ rm.head.weight.float().T + rm.head.bias.float()).reshape(-1)
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-7)


def test_a_saved_encoder_reward_model_loads_in_transformers_with_the_same_scores(tmp_path):
    rm = RewardModel(tiny_bert_classifier(vocab_size=30, seed=3)).eval()
    rm.save_pretrained(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "rm"), local_files_only=True
    ).eval()
    again = RewardModel.from_pretrained(tmp_path / "rm")
    tokens, lengths = _right_padded([[2, 5, 6, 3], [2, 7, 8, 9, 3]])
    with torch.no_grad():
        offline = hf(input_ids=tokens, attention_mask=RewardModel.attention_mask(tokens, lengths)).logits
    torch.testing.assert_close(again.infer(tokens, lengths), offline.reshape(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(rm.infer(tokens, lengths), offline.reshape(-1), rtol=0, atol=1e-6)


def test_a_decoder_classifier_keeps_its_last_token_readout(tiny):
    assert tiny.reward_model().readout == LAST_TOKEN


def test_an_encoder_is_refused_as_a_critic():
    with pytest.raises(ValueError, match="cannot be a critic"):
        CriticModel(tiny_bert_classifier(vocab_size=30))


def test_a_classifier_of_neither_kind_is_refused_naming_both():
    from transformers import BartConfig, BartForSequenceClassification

    config = BartConfig(
        vocab_size=30, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_labels=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"BartForSequenceClass\w+ is not supported.*score.*classifier"):
        RewardModel(BartForSequenceClassification(config))


def test_a_bert_tokenizer_lays_text_out_as_cls_text_sep(tmp_path):
    tok = tiny_bert_tokenizer(tmp_path / "tok")
    assert tok.bos_token_id is None and tok.eos_token_id is None
    layout = SequenceLayout()  # train-rm's default: no data.add_eos=false needed
    assert layout.special_ids(tok) == (tok.cls_token_id, tok.sep_token_id)
    prompt_ids, response_ids = Renderer(tok, layout).example_ids(
        "sort 3 1 2 :", {"role": "assistant", "content": " 1 2 3"}
    )
    # what the tokenizer itself writes for the whole text, the layout the encoder was trained on
    assert prompt_ids + response_ids == tok("sort 3 1 2 : 1 2 3")["input_ids"]


def test_the_tiny_bert_directory_loads_as_a_reward_model(tmp_path):
    rm = RewardModel.from_pretrained(tiny_bert_dir(tmp_path / "bert"))
    assert rm.readout == FIRST_TOKEN
