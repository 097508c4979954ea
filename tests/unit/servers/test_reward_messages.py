"""The reward server's ``messages`` input: a conversation laid out with the reward model's own
tokenizer and template exactly as train-rm laid out its training pairs, and clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from openaligner.data.render import Renderer, SequenceLayout
from openaligner.servers.reward import RewardEndpoint, make_render_func
from openaligner.servers.validation import RequestError

CHAT = SequenceLayout(chat_template=True)
TALK = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "sort 3 1 2"},
    {"role": "assistant", "content": "1 2 3"},
]


def messages(*conversations) -> np.ndarray:
    return np.array([[json.dumps(c).encode()] for c in conversations], dtype=np.object_)


def endpoint(tokenizer, layout, forward=None, **settings) -> RewardEndpoint:
    forward = forward or (lambda tokens, lengths: lengths.float())
    return RewardEndpoint(forward, render_func=make_render_func(tokenizer, layout), **settings)


def test_a_chat_conversation_gets_the_ids_train_rm_gave_it(chat_tokenizer):
    prompt, response = Renderer(chat_tokenizer, CHAT).example_ids(tuple(TALK[:2]), TALK[2])
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    p2, r2 = Renderer(chat_tokenizer, CHAT).example_ids(tuple(short[:1]), short[1])
    request = endpoint(chat_tokenizer, CHAT).validate({"messages": messages(TALK, short)})
    assert request.lengths.tolist() == [len(prompt + response), len(p2 + r2)]
    assert request.tokens[0].tolist() == prompt + response
    assert request.tokens[1, : len(p2 + r2)].tolist() == p2 + r2
    assert set(request.tokens[1, len(p2 + r2) :].tolist()) <= {chat_tokenizer.pad_token_id}


def test_a_raw_text_reward_model_gets_the_ids_and_the_reward_of_training(tiny):
    model = tiny.reward_model()
    ep = endpoint(tiny.tokenizer, SequenceLayout(), forward=model.infer)
    pair = [{"role": "user", "content": "sort b a:"}, {"role": "assistant", "content": " a b"}]
    prompt, response = Renderer(tiny.tokenizer, SequenceLayout()).example_ids("sort b a:", pair[1])
    ids = torch.tensor([prompt + response])
    request = ep.validate({"messages": messages(pair)})
    assert request.tokens.tolist() == ids.tolist()
    [answer] = ep.run([request])
    expected = model.infer(ids, torch.tensor([ids.shape[1]]))
    torch.testing.assert_close(torch.from_numpy(answer["rewards"]).reshape(-1), expected.float())
    with pytest.raises(RequestError, match="trained on raw text"):
        ep.validate({"messages": messages(TALK)})  # a system message: no raw-text layout for it


def test_a_long_conversation_is_cut_keeping_its_last_token(chat_tokenizer):
    prompt, response = Renderer(chat_tokenizer, CHAT).example_ids(tuple(TALK[:2]), TALK[2])
    full = prompt + response
    request = endpoint(chat_tokenizer, CHAT, max_sequence_length=10).validate({"messages": messages(TALK)})
    assert request.tokens[0].tolist() == full[:9] + full[-1:]


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([b"not json"], "row 0 is not JSON"),
        ([json.dumps({"role": "user"}).encode()], "row 0 is"),
        ([json.dumps([{"role": "user", "content": "x"}]).encode()], "the assistant's response"),
        ([json.dumps([{"role": "user", "content": 1}, TALK[2]]).encode()], "row 0"),
        ([json.dumps(TALK[::-1]).encode()], "last, the assistant's response"),
        ([b"\xff"], "not valid UTF-8"),
    ],
)
def test_bad_messages_are_refused_naming_what_was_expected(chat_tokenizer, rows, says):
    ep = endpoint(chat_tokenizer, CHAT)
    with pytest.raises(RequestError, match="input 'messages'") as e:
        ep.validate({"messages": np.array([[r] for r in rows], dtype=np.object_)})
    assert says in str(e.value)


def test_a_server_without_a_tokenizer_refuses_messages(tiny):
    ep = RewardEndpoint(lambda t, n: n.float())
    with pytest.raises(RequestError, match="no tokenizer to lay out conversations"):
        ep.validate({"messages": messages(TALK)})
    assert ep.tokenizer_info == {"tokenizer": None}
