"""The sequence layout: raw text as before, chat templates through the real ``apply_chat_template``,
BOS and EOS never doubled, templates that break the prefix rule refused, the layout record."""

from __future__ import annotations

import json

import pytest
from transformers import BatchEncoding

from openaligner.data.render import (
    LAYOUT_FILE,
    LayoutError,
    Renderer,
    SequenceLayout,
    check_chat_template_mode,
    cut_rendered,
    generation_prompt,
    use_chat_template,
    with_bos,
    with_eos,
)

USER = {"role": "user", "content": "2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
CHAT = SequenceLayout(chat_template=True)
IM_START, IM_END, EOS, BOS = 100, 101, 1, 2


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_raw_text_layout_is_bos_prompt_then_response_eos(tiny):
    tok = tiny.tokenizer
    r = Renderer(tok, SequenceLayout())
    assert r.prompt_ids("ab") == [BOS, *ids(tok, "ab")]
    assert r.example_ids("ab", {"role": "assistant", "content": "c"}) == (
        [BOS, *ids(tok, "ab")],
        [*ids(tok, "c"), EOS],
    )
    bare = Renderer(tok, SequenceLayout(add_bos=False, add_eos=False))
    assert bare.example_ids("ab", {"role": "assistant", "content": "c"}) == (ids(tok, "ab"), ids(tok, "c"))


def test_chat_template_layout_through_the_real_apply_chat_template(chat_tokenizer):
    tok = chat_tokenizer
    prompt, response = Renderer(tok, CHAT).example_ids((USER,), ANSWER)
    prompt_text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == [BOS, *ids(tok, prompt_text)]
    # the assistant turn with its end-of-turn token; not the newline after it (the actor stops at
    # its stop token), then EOS
    assert response == [*ids(tok, "4"), IM_END, EOS]
    # transformers 5: tokenize=True answers a BatchEncoding; our ids are its input_ids, framed
    full = tok.apply_chat_template([USER, ANSWER], tokenize=True)
    assert isinstance(full, BatchEncoding)
    assert prompt[1:] + response[:-1] + ids(tok, "\n") == full["input_ids"]
    with_prompt = tok.apply_chat_template([USER], tokenize=True, add_generation_prompt=True)
    assert prompt[1:] == with_prompt["input_ids"]


def test_prompts_render_the_same_for_ppo_sft_and_rm_and_text_is_one_user_message(chat_tokenizer):
    r = Renderer(chat_tokenizer, CHAT)
    ppo = r.prompt_ids((USER,))
    sft, _ = r.example_ids((USER,), ANSWER)
    rm_chosen, _ = r.example_ids((USER,), ANSWER)
    rm_rejected, _ = r.example_ids((USER,), {"role": "assistant", "content": "5"})
    assert ppo == sft == rm_chosen == rm_rejected
    assert r.prompt_ids("2+2?") == ppo


def test_bos_written_by_the_template_is_not_added_again(chat_tokenizer):
    chat_tokenizer.chat_template = "{{ bos_token }}" + chat_tokenizer.chat_template
    prompt, _ = Renderer(chat_tokenizer, CHAT).example_ids((USER,), ANSWER)
    assert prompt[:2] == [BOS, IM_START]
    assert Renderer(chat_tokenizer, CHAT).prompt_ids("2+2?")[:2] == [BOS, IM_START]


def test_an_end_of_turn_that_is_the_eos_is_not_added_again(chat_tokenizer):
    chat_tokenizer.eos_token = "<|im_end|>"  # as Qwen's chat tokenizers have it
    _, response = Renderer(chat_tokenizer, CHAT).example_ids((USER,), ANSWER)
    assert response == [*ids(chat_tokenizer, "4"), IM_END]


def test_bos_and_eos_helpers():
    assert with_bos([5, 6], 2) == [2, 5, 6] and with_bos([2, 5], 2) == [2, 5] and with_bos([5], None) == [5]
    assert with_eos([5, 6], 1) == [5, 6, 1] and with_eos([5, 1], 1) == [5, 1] and with_eos([], 1) == [1]


def test_a_conversation_rendered_whole_is_cut_where_example_ids_cuts_it(chat_tokenizer, tiny):
    gen = generation_prompt(chat_tokenizer)
    assert gen == "<|im_start|>assistant\n" and generation_prompt(tiny.tokenizer) is None
    talk = [USER, ANSWER, {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    full = chat_tokenizer.apply_chat_template(talk, tokenize=False)
    prompt = chat_tokenizer.apply_chat_template(talk[:-1], add_generation_prompt=True, tokenize=False)
    assert cut_rendered(full, gen) == (prompt, "6<|im_end|>")  # the last assistant turn; no "\n"
    prompt_ids, response_ids = Renderer(chat_tokenizer, CHAT).example_ids(tuple(talk[:-1]), talk[-1])
    assert prompt_ids == [BOS, *ids(chat_tokenizer, prompt)]
    assert response_ids == [*ids(chat_tokenizer, "6<|im_end|>"), EOS]
    assert cut_rendered("no assistant turn here", gen) is None and cut_rendered(full, None) is None
    # a template that cannot render a lone user message has no generation prompt to cut at
    chat_tokenizer.chat_template = "{{ raise_exception('a system message first') }}"
    assert generation_prompt(chat_tokenizer) is None


def test_a_template_whose_prompt_is_not_a_prefix_is_refused(chat_tokenizer):
    # the generation prompt opens an "assistant" turn, but assistant turns are written as "bot" turns
    chat_tokenizer.chat_template = chat_tokenizer.chat_template.replace(
        "<|im_start|>{{ m['role'] }}", "<|im_start|>{{ 'bot' if m['role'] == 'assistant' else m['role'] }}"
    )
    with pytest.raises(
        LayoutError,
        match=r"cannot be cut from it: at character 44 the prompt has 'assistant.*the conversation 'bot",
    ):
        Renderer(chat_tokenizer, CHAT).example_ids((USER,), ANSWER)


def test_conversations_need_a_chat_template(tiny, chat_tokenizer):
    with pytest.raises(
        LayoutError, match=r"needs a chat template .* the built-in tokenizer has no chat template"
    ):
        Renderer(tiny.tokenizer, SequenceLayout()).prompt_ids((USER,))
    with pytest.raises(LayoutError, match=r"needs a chat template .* data.chat_template is false"):
        Renderer(chat_tokenizer, SequenceLayout()).example_ids((USER,), ANSWER)
    with pytest.raises(LayoutError, match="has no chat template to render"):
        Renderer(tiny.tokenizer, CHAT)


def test_chat_template_modes(tiny, chat_tokenizer):
    assert use_chat_template("auto", chat_tokenizer) and not use_chat_template("auto", tiny.tokenizer)
    assert use_chat_template("true", chat_tokenizer) and not use_chat_template("false", chat_tokenizer)
    with pytest.raises(
        LayoutError, match=r"data.chat_template=true but the built-in tokenizer has no chat template"
    ):
        use_chat_template("true", tiny.tokenizer)
    assert [check_chat_template_mode(v, "k") for v in ("True", "false", " AUTO")] == ["true", "false", "auto"]
    with pytest.raises(ValueError, match="k must be one of auto, true, false, got 'yes'"):
        check_chat_template_mode("yes", "k")


def test_apply_chat_template_answers_other_than_text_are_refused_clearly(chat_tokenizer, monkeypatch):
    real = chat_tokenizer.apply_chat_template
    monkeypatch.setattr(chat_tokenizer, "apply_chat_template", lambda *a, **k: [real(*a, **k)])
    assert Renderer(chat_tokenizer, CHAT).prompt_ids("hi")[1] == IM_START  # a one-text list is fine
    monkeypatch.setattr(
        chat_tokenizer, "apply_chat_template", lambda *a, **k: BatchEncoding({"input_ids": [5]})
    )
    with pytest.raises(LayoutError, match=r"apply_chat_template\(tokenize=False\) returned BatchEncoding"):
        Renderer(chat_tokenizer, CHAT).prompt_ids("hi")


def test_layout_record_round_trips_and_is_checked(tmp_path):
    assert SequenceLayout.load(tmp_path) is None
    SequenceLayout(add_bos=False, chat_template=True).save(tmp_path)
    assert SequenceLayout.load(tmp_path) == SequenceLayout(add_bos=False, add_eos=True, chat_template=True)
    (tmp_path / LAYOUT_FILE).write_text(json.dumps({"add_bos": "yes"}))
    with pytest.raises(LayoutError, match="must be a JSON object with the booleans"):
        SequenceLayout.load(tmp_path)


def test_a_required_template_names_the_tokenizer_directory(tmp_path, tiny):
    from openaligner.models.tokenizers import load_tokenizer

    tiny.tokenizer.save_pretrained(str(tmp_path / "tok"))
    with pytest.raises(LayoutError, match=f"the tokenizer in {tmp_path / 'tok'} has no chat template"):
        use_chat_template("true", load_tokenizer(tmp_path / "tok"))
