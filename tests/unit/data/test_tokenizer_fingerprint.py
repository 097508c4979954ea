"""Tokenizer fingerprints: what decides token ids, stable across save/reload and file paths."""

from __future__ import annotations

from openaligner.data.render import SequenceLayout, tokenizer_fingerprint, tokenizer_identity
from openaligner.models.tokenizers import build_char_tokenizer, load_tokenizer, train_bpe_tokenizer


def test_same_tokenizer_saved_and_reloaded_has_the_same_fingerprint(tmp_path, chat_tokenizer):
    for tok in (build_char_tokenizer(), chat_tokenizer):
        tok.save_pretrained(tmp_path / "tok")
        again = load_tokenizer(tmp_path / "tok")
        assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
        layout = SequenceLayout(chat_template=tok.chat_template is not None)
        assert tokenizer_identity(again, layout)[1:] == tokenizer_identity(tok, layout)[1:]


def test_a_different_vocab_template_or_layout_changes_the_fingerprint(chat_tokenizer):
    char = build_char_tokenizer()
    bpe = train_bpe_tokenizer(["sort 3 1 2: 1 2 3"] * 4, 300, ["<pad>", "<eos>"], eos_token="<eos>")
    assert tokenizer_fingerprint(char) != tokenizer_fingerprint(bpe)
    fewer = build_char_tokenizer("abc")
    assert tokenizer_fingerprint(char) != tokenizer_fingerprint(fewer)
    # the template: in the fingerprint, not in what the ids mean
    other = build_char_tokenizer()
    other.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(chat_tokenizer)
    ids_of = tokenizer_fingerprint(other, template=False)
    assert ids_of == tokenizer_fingerprint(chat_tokenizer, template=False)
    # the layout the model was trained with
    raw, chat = SequenceLayout(), SequenceLayout(chat_template=True)
    assert tokenizer_fingerprint(chat_tokenizer, raw) != tokenizer_fingerprint(chat_tokenizer, chat)


def test_the_pad_token_a_loader_sets_does_not_change_the_fingerprint():
    tok, padded = build_char_tokenizer(), build_char_tokenizer()
    padded.pad_token = padded.eos_token
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(padded)


def test_layout_switches_the_tokenizer_cannot_act_on_do_not_change_the_fingerprint():
    """A BOS asked for by one side but absent from the tokenizer lays text out as not asking does."""
    no_bos = train_bpe_tokenizer(["sort 3 1 2: 1 2 3"] * 4, 300, ["<pad>", "<eos>"], eos_token="<eos>")
    assert no_bos.bos_token_id is None
    assert tokenizer_fingerprint(no_bos, SequenceLayout(add_bos=True)) == tokenizer_fingerprint(
        no_bos, SequenceLayout(add_bos=False)
    )
    assert tokenizer_fingerprint(no_bos, SequenceLayout(add_eos=True)) != tokenizer_fingerprint(
        no_bos, SequenceLayout(add_eos=False)
    )
    # a chat_template switch on a tokenizer without a template renders nothing differently
    assert tokenizer_fingerprint(no_bos, SequenceLayout(chat_template=True)) == tokenizer_fingerprint(
        no_bos, SequenceLayout()
    )
