"""A conversation rendered whole with the reward model's chat template — what verl posts to
``/classify`` — is scored on exactly the ids train-rm made of that conversation, in every format
that carries text: ``/classify``'s ``input`` and ``messages``, OpenRLHF's ``query``, slime's
rendered ``prompt`` + ``response`` and KServe ``sentences``.

Three template families, each with a byte-level BPE tokenizer in its special-token conventions:
ChatML (Qwen2: ``<|im_end|>`` ends a turn and is the EOS; each turn ends ``<|im_end|>\\n``),
Zephyr (``</s>`` ends a turn and is the EOS; each turn ends ``</s>\\n``) and Llama 3 (the template
writes ``{{ bos_token }}``; ``<|eot_id|>`` ends a turn and is the EOS; no text after it). The
expected ids come from train-rm's own data path (``build_preference_pairs`` with a ``Renderer``);
the served ids from the route's translation checked by the reward endpoint, as the server does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from chatml import CHATML
from openaligner.data.formats import PreferenceRecord
from openaligner.data.preference import build_preference_pairs
from openaligner.data.render import Renderer, SequenceLayout
from openaligner.models.tokenizers import train_bpe_tokenizer
from openaligner.servers.reward import RewardEndpoint, make_render_func, make_tokenize_func
from openaligner.servers.reward_formats import ClassifyRoute, OpenRLHFRoute, RemoteRMRoute, TextReading

CHAT = SequenceLayout(chat_template=True)
CHAT_MODEL = TextReading(function=False, model=True, rendered_prompts=True)  # as serve-reward sets it

ZEPHYR = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Zephyr's turn layout (HuggingFaceH4/zephyr-7b-beta): ``<|role|>\\ncontent</s>\\n``."""

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3's turn layout (Llama-3-Instruct), without its default system prompt."""


@dataclass(frozen=True)
class Family:
    template: str
    special_tokens: tuple[str, ...]
    eos: str
    bos: str | None
    pad: str


FAMILIES = {
    "chatml": Family(
        CHATML, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", None, "<|endoftext|>"
    ),
    "zephyr": Family(
        ZEPHYR, ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"), "</s>", "<s>", "<unk>"
    ),
    "llama3": Family(
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        "<|begin_of_text|>",
        "<|end_of_text|>",
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}],
    # a response that starts with blank lines: a BPE that merges "\n\n" tokenizes the whole text
    # differently from train-rm's prompt and response tokenized apart
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sort 3 1 2"},
        {"role": "assistant", "content": "\n\nsorted: 1 2 3"},
    ],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "six, the answer is six"},
    ],
]


def tokenizer_of(family: Family):
    """The family's BPE tokenizer, its merges learnt from the roles and contents (blank lines
    included, so that "\\n\\n" is one token) and its chat template saved with it."""
    corpus = [m["role"] + "\n\n" + m["content"] + "\n" for c in CONVERSATIONS for m in c]
    return train_bpe_tokenizer(
        corpus * 4,
        400,
        family.special_tokens,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token=family.pad,
        chat_template=family.template,
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tokenizer(request):
    return tokenizer_of(FAMILIES[request.param])


def train_rm_ids(tokenizer, conversation) -> list[int]:
    """The ids train-rm trains on for ``conversation`` (its last message the response)."""
    record = PreferenceRecord(tuple(conversation[:-1]), conversation[-1], conversation[-1], "test")
    [pair] = build_preference_pairs([record], Renderer(tokenizer, CHAT), max_length=10_000)
    return pair.chosen


def rendered(tokenizer, conversation) -> str:
    return tokenizer.apply_chat_template(conversation, tokenize=False)


def verl_input(tokenizer, conversation) -> str:
    """What verl's reward loop posts as ``input``: the conversation rendered with the reward
    model's template (``add_generation_prompt=False, tokenize=False``), a leading BOS text cut off."""
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=False)
    bos = tokenizer.bos_token
    return text[len(bos) :] if bos is not None and text.startswith(bos) else text


def endpoint(tokenizer) -> RewardEndpoint:
    return RewardEndpoint(
        lambda tokens, lengths: lengths.float(),
        tokenize_func=make_tokenize_func(tokenizer, max_length=512, layout=CHAT),
        render_func=make_render_func(tokenizer, CHAT),
        vocab_size=len(tokenizer),
        max_sequence_length=512,
    )


def served_ids(tokenizer, inputs) -> list[list[int]]:
    """The ids the reward endpoint scores for a route's ``reward_model`` inputs."""
    request = endpoint(tokenizer).validate(inputs)
    return [request.tokens[i, : int(n)].tolist() for i, n in enumerate(request.lengths)]


def body(doc) -> bytes:
    return json.dumps(doc).encode()


def sentences(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "blank-lines", "two-turns"])
def test_every_format_scores_a_rendered_conversation_on_train_rms_ids(tokenizer, conversation):
    want = train_rm_ids(tokenizer, conversation)
    full = rendered(tokenizer, conversation)
    prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    classify, openrlhf, remote_rm = (
        ClassifyRoute("rm", CHAT_MODEL),
        OpenRLHFRoute("rm", CHAT_MODEL),
        RemoteRMRoute("rm", CHAT_MODEL),
    )
    verl = {"model": "/models/rm", "input": verl_input(tokenizer, conversation), "use_activation": False}
    cases = {
        "classify input (verl)": classify.translate(body(verl)).inputs,
        "classify input, BOS text kept": classify.translate(body({"input": [full]})).inputs,
        "classify messages": classify.translate(body({"messages": conversation})).inputs,
        "openrlhf query": openrlhf.translate(body({"query": [full], "prompts": [prompt]})).inputs,
        "remote_rm rendered prompt": remote_rm.translate(
            body({"prompt": prompt, "response": full[len(prompt) :]})
        ).inputs,
        "kserve sentences": {"sentences": sentences(full)},
    }
    got = {name: served_ids(tokenizer, inputs) for name, inputs in cases.items()}
    assert got == {name: [want] for name in cases}


def test_a_rendered_conversation_never_gets_a_second_eos_nor_the_text_after_its_end_of_turn():
    tok = tokenizer_of(FAMILIES["chatml"])
    conversation = CONVERSATIONS[0]
    [ids] = served_ids(tok, {"sentences": sentences(rendered(tok, conversation))})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")  # ChatML's end of turn, and Qwen's EOS
    four = tok("four", add_special_tokens=False)["input_ids"]
    assert ids[-1 - len(four) :] == [*four, im_end]  # not [..., <|im_end|>, \n, <|im_end|>]


def test_a_batch_of_rendered_texts_and_plain_texts_each_get_their_layout(tokenizer):
    """Rows of one request are laid out alone: a text with no assistant turn (nothing to cut) is
    the whole sequence between BOS and EOS, less the whitespace after its last turn."""
    conversation = CONVERSATIONS[2]
    bos, eos = CHAT.special_ids(tokenizer)
    plain = "just some text  \n"
    plain_ids = tokenizer(plain.rstrip(), add_special_tokens=False)["input_ids"]
    plain_want = ([bos] if bos is not None else []) + plain_ids + [eos]
    got = served_ids(tokenizer, {"sentences": sentences(rendered(tokenizer, conversation), plain)})
    assert got == [train_rm_ids(tokenizer, conversation), plain_want]


def test_a_rendered_conversation_longer_than_the_limit_keeps_its_first_ids_and_its_last():
    tok = tokenizer_of(FAMILIES["chatml"])
    conversation = CONVERSATIONS[2]
    want = train_rm_ids(tok, conversation)
    limit = len(want) - 5
    tokens, lengths = make_tokenize_func(tok, max_length=limit, layout=CHAT)([rendered(tok, conversation)])
    assert lengths.tolist() == [limit]
    assert tokens[0].tolist() == want[: limit - 1] + want[-1:]  # as a long `messages` row is cut
    assert torch.equal(tokens, make_render_func(tok, CHAT)([conversation], limit)[0])
