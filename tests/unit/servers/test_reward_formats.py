"""The field's wire formats as the reward server reads and answers them, without a server: each
body becomes the ``reward_model`` inputs that lay its text out as train-rm did, each refusal names
the field, and each answer has the format's shape."""

import json
import math

import numpy as np
import pytest
import torch

from openaligner.servers.reward import RewardServerConfig
from openaligner.servers.reward_formats import (
    ClassifyRoute,
    OpenRLHFRoute,
    RemoteRMRoute,
    TextReading,
    reward_routes,
)
from openaligner.servers.validation import RequestError, SequenceRequest

RAW_MODEL = TextReading(function=False, model=True)
CHAT_MODEL = TextReading(function=False, model=True, rendered_prompts=True)
FUNCTION = TextReading(function=True, model=False)
FUNCTION_AND_CHAT_MODEL = TextReading(function=True, model=True, rendered_prompts=True)


def body(doc):
    return json.dumps(doc).encode()


def column(inputs, name):
    """A BYTES input as strings (JSON-decoded for messages and metadata)."""
    texts = [x.decode() for x in inputs[name].reshape(-1)]
    return texts if name == "sentences" else [json.loads(t) for t in texts]


def chat(prompt, response):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


REWARDS = {"rewards": np.array([[0.25], [-1.5]], dtype=np.float32)}


# ----------------------------------------------------------------------------- OpenRLHF
def test_openrlhf_query_after_its_prompt_is_the_conversation_a_raw_text_model_was_trained_on():
    route = OpenRLHFRoute("reward_model", RAW_MODEL)
    t = route.translate(
        body({"query": ["Q: 2+2? A: 4", "Q: 1? A: 1"], "prompts": ["Q: 2+2? A:", "Q: 1? A:"]})
    )
    assert set(t.inputs) == {"messages"}
    assert column(t.inputs, "messages") == [chat("Q: 2+2? A:", " 4"), chat("Q: 1? A:", " 1")]
    assert t.answer(REWARDS, None) == {"rewards": [0.25, -1.5], "scores": [0.25, -1.5], "extra_logs": {}}


def test_openrlhf_query_is_read_whole_by_a_chat_template_model_and_when_it_does_not_start_with_its_prompt():
    rendered = OpenRLHFRoute("reward_model", CHAT_MODEL).translate(
        body(
            {"query": ["<|user|>hi<|assistant|>yo"], "prompts": ["<|user|>hi<|assistant|>"], "labels": ["x"]}
        )
    )
    assert set(rendered.inputs) == {"sentences"}  # labels go to a function only
    assert column(rendered.inputs, "sentences") == ["<|user|>hi<|assistant|>yo"]
    # one query that does not start with its prompt: every query of the request is read whole
    mixed = OpenRLHFRoute("reward_model", RAW_MODEL).translate(
        body({"query": ["Q: a", "decoded differently"], "prompts": ["Q:", "Q:"]})
    )
    assert column(mixed.inputs, "sentences") == ["Q: a", "decoded differently"]
    alone = OpenRLHFRoute("reward_model", RAW_MODEL).translate(body({"query": "just text"}))
    assert column(alone.inputs, "sentences") == ["just text"]


def test_openrlhf_labels_reach_a_reward_function_as_metadata():
    t = OpenRLHFRoute("reward_model", FUNCTION).translate(
        body(
            {
                "query": ["Q: 2+2? A: 4", "Q: x A: y"],
                "prompts": ["Q: 2+2? A:", "Q: x A:"],
                "labels": ["4", None],
            }
        )
    )
    assert column(t.inputs, "messages") == [chat("Q: 2+2? A:", " 4"), chat("Q: x A:", " y")]
    assert column(t.inputs, "metadata") == [{"label": "4"}, {"label": None}]
    # with a chat-template model too: the model reads the whole text, the function the parts
    both = OpenRLHFRoute("reward_model", FUNCTION_AND_CHAT_MODEL).translate(
        body({"query": ["P:R"], "prompts": ["P:"], "labels": [{"answer": 3}]})
    )
    assert column(both.inputs, "sentences") == ["P:R"]
    assert column(both.inputs, "messages") == [chat("P:", "R")]
    assert column(both.inputs, "metadata") == [{"label": {"answer": 3}}]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "request body is empty; send a JSON object, e.g."),
        (b"[1]", "must be a JSON object, got a list"),
        (b'{"prompts": ["a"]}', "'query' must be a non-empty list of strings, got none"),
        (b'{"query": []}', "'query' must be a non-empty list of strings, got a list []"),
        (b'{"query": ["a", 7]}', "'query'[1] must be a string, got a number 7"),
        (
            b'{"query": ["a"], "prompts": ["a", "b"]}',
            "'prompts' must be a list of 1 item(s), one per 'query', got 2",
        ),
        (
            b'{"query": ["a"], "labels": "x"}',
            "'labels' must be a list of 1 item(s), one per 'query', got a string",
        ),
        (b'{"query": ["a"], "prompts": [null]}', "'prompts'[0] must be a string, got null"),
        (b'{"query": ["a"], "labels": [NaN]}', "'labels'[0] holds NaN (not a JSON number)"),
        (b'{"query": ["\\ud800"]}', "'query'[0] holds a lone UTF-16 surrogate"),
        (b'{"query": ["a"], "query": ["b"]}', 'gives the key "query" more than once'),
        (
            b'{"query": ["a"], "labels": ["' + b"x" * 70000 + b'"]}',
            "'labels'[0] takes 70013 bytes as metadata",
        ),
        (b'{"query": ["a"], "labels": [' + b"[" * 990 + b"]" * 990 + b"]}", "nests JSON too deeply"),
    ],
)
def test_openrlhf_refusals_name_the_field(raw, needle):
    with pytest.raises(RequestError) as caught:
        OpenRLHFRoute("reward_model", FUNCTION).translate(raw)
    assert needle in str(caught.value)


# ----------------------------------------------------------------------------- slime remote_rm
def test_remote_rm_reads_a_prompt_string_or_conversation_and_answers_a_number_or_the_keyed_object():
    route = RemoteRMRoute("reward_model", RAW_MODEL)
    t = route.translate(body({"prompt": "Q: 2+2? A:", "response": " 4", "label": "4"}))
    assert column(t.inputs, "messages") == [chat("Q: 2+2? A:", " 4")]
    assert t.answer({"rewards": np.array([[0.5]], np.float32)}, None) == 0.5
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    c = RemoteRMRoute("reward_model", CHAT_MODEL, reward_key="score").translate(
        body({"prompt": conversation, "response": "hello"})
    )
    assert column(c.inputs, "messages") == [[*conversation, {"role": "assistant", "content": "hello"}]]
    assert c.answer({"rewards": np.array([[0.5]], np.float32)}, None) == {"score": 0.5}
    f = RemoteRMRoute("reward_model", FUNCTION).translate(body({"prompt": "p", "response": "r", "label": 7}))
    assert column(f.inputs, "metadata") == [{"label": 7}]


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"prompt": "p"}, "has no 'response' (the text to score)"),
        ({"prompt": "p", "response": 3}, "'response' must be a string, got a number 3"),
        ({"prompt": 3, "response": "r"}, "'prompt' must be a string, got a number 3"),
        ({"prompt": [], "response": "r"}, "'prompt' must be a non-empty list of messages"),
        ({"prompt": [{"role": "user"}], "response": "r"}, "'prompt'[0] must be a message"),
        ("just a string", "must be a JSON object, got a string"),
    ],
)
def test_remote_rm_refusals_name_the_field(doc, needle):
    with pytest.raises(RequestError) as caught:
        RemoteRMRoute("reward_model", RAW_MODEL).translate(body(doc))
    assert needle in str(caught.value)


# ----------------------------------------------------------------------------- classify
def test_classify_reads_texts_token_ids_and_conversations():
    route = ClassifyRoute("reward_model", CHAT_MODEL)
    assert column(route.translate(body({"input": "whole"})).inputs, "sentences") == ["whole"]
    assert column(route.translate(body({"input": ["a", "b"]})).inputs, "sentences") == ["a", "b"]
    ids = route.translate(body({"input": [5, 6, 7]})).inputs
    assert ids["tokens"].tolist() == [[5, 6, 7]] and ids["sequence_lengths"].tolist() == [[3]]
    ragged = route.translate(body({"input": [[5, 6, 7], [8]]})).inputs
    assert ragged["tokens"].tolist() == [[5, 6, 7], [8, 0, 0]] and ragged["sequence_lengths"].tolist() == [
        [3],
        [1],
    ]
    conversation = chat("hi", "hello")
    c = route.translate(body({"messages": conversation}))
    assert column(c.inputs, "messages") == [conversation]
    # a function reads a whole text as the response to an empty prompt
    f = ClassifyRoute("reward_model", FUNCTION).translate(body({"input": "whole"}))
    assert column(f.inputs, "messages") == [chat("", "whole")]
    with pytest.raises(RequestError, match="scores text with a reward function, so 'input' must be text"):
        ClassifyRoute("reward_model", FUNCTION).translate(body({"input": [[5, 6]]}))


def test_classify_answers_as_vllm_sigmoid_unless_activation_is_off_with_usage_from_the_tokens_read():
    route = ClassifyRoute("reward_model", RAW_MODEL)
    checked = SequenceRequest(torch.zeros(2, 4, dtype=torch.int64), torch.tensor([4, 3]))
    default = route.translate(body({"model": "my-rm", "input": ["a", "b"]})).answer(REWARDS, checked)
    assert (
        default["object"] == "list" and default["model"] == "my-rm" and default["id"].startswith("classify-")
    )
    assert [d["index"] for d in default["data"]] == [0, 1]
    assert default["data"][0]["probs"] == pytest.approx([1 / (1 + math.exp(-0.25))])
    assert all(d["num_classes"] == 1 and isinstance(d["label"], str) for d in default["data"])
    assert default["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 7,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    for off in ({"use_activation": False}, {"activation": False}):
        raw = route.translate(body({"input": ["a", "b"], **off})).answer(REWARDS, checked)
        assert raw["data"][-1]["probs"][-1] == -1.5  # what verl reads
        assert raw["model"] == "reward_model"


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"model": "m"}, "send exactly one of 'input'"),
        ({"input": "a", "messages": chat("q", "r")}, "send exactly one of 'input'"),
        ({"input": "a", "use_activation": "no"}, "'use_activation' must be true, false or null"),
        (
            {"input": "a", "use_activation": True, "activation": False},
            "'use_activation' and 'activation' disagree",
        ),
        ({"input": [[1, 2], []]}, "'input'[1] is an empty list of token ids"),
        ({"input": [[1, 2.5]]}, "'input'[0][1] must be a token id (an integer), got 2.5"),
        ({"input": [1, "a"]}, "'input'[0] must be a string, got a number 1"),
        ({"input": [5, 2.5]}, "'input'[1] must be a token id (an integer), got 2.5"),  # no text: ids
        ({"input": {"text": "a"}}, "'input' must be a non-empty list of strings, got an object"),
        ({"input": "a", "model": 5}, "'model' must be a string"),
        (
            {"messages": [{"role": "user", "content": "only a prompt"}]},
            "must end with the assistant's response",
        ),
    ],
)
def test_classify_refusals_name_the_field(doc, needle):
    with pytest.raises(RequestError) as caught:
        ClassifyRoute("reward_model", RAW_MODEL).translate(body(doc))
    assert needle in str(caught.value)


@pytest.mark.parametrize(
    ("route", "doc", "refusal", "explained"),
    [
        (
            OpenRLHFRoute("m", RAW_MODEL),
            {"query": ["a", "b"]},
            "input 'sentences': row 1 has no tokens; send non-empty text",
            "'query'[1] has no tokens; send non-empty text",
        ),
        (
            ClassifyRoute("m", RAW_MODEL),
            {"input": [5, 600]},
            "input 'tokens': row 0, position 1 holds id 600, outside the vocabulary",
            "'input', token 1, holds id 600, outside the vocabulary",
        ),
        (
            ClassifyRoute("m", RAW_MODEL),
            {"input": [[5], [6, 7]]},
            "input 'tokens' is 300 wide, more than the server's max_sequence_length 256",
            "'input' is 300 wide, more than the server's max_sequence_length 256",
        ),
        (
            ClassifyRoute("m", RAW_MODEL),
            {"input": [[5], [6, 7]]},
            "input 'sequence_lengths': row 1 has 300 tokens",
            "'input'[1] has 300 tokens",
        ),
        (
            RemoteRMRoute("m", CHAT_MODEL),
            {"prompt": "", "response": ""},
            "input 'sentences': row 0 has no tokens; send non-empty text",
            "the sample ('prompt' + 'response') has no tokens; send non-empty text",
        ),
        (
            RemoteRMRoute("m", RAW_MODEL),
            {
                "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                "response": "a",
            },
            "input 'messages': row 0 has 2 message(s) before the response, but ...: send one user message "
            "and the assistant's response, or 'sentences'",
            "'prompt' has 2 message(s) before the response, but ...: send one user message and the "
            "assistant's response, or a string 'prompt'",
        ),
    ],
)
def test_a_refusal_of_the_models_inputs_is_explained_in_the_clients_fields(route, doc, refusal, explained):
    assert route.translate(body(doc)).explain(refusal) == explained


@pytest.mark.parametrize(
    ("setting", "chat_template", "rendered"),
    [("auto", True, True), ("auto", False, False), ("raw", True, False), ("rendered", False, True)],
)
def test_server_prompt_strings_says_how_prompt_strings_are_read(setting, chat_template, rendered):
    cfg = RewardServerConfig(prompt_strings=setting)
    assert cfg.prompts_rendered(chat_template) is rendered
    reading = TextReading(function=False, model=True, rendered_prompts=cfg.prompts_rendered(chat_template))
    inputs = (
        RemoteRMRoute("reward_model", reading).translate(body({"prompt": "2+2?", "response": "4"})).inputs
    )
    # raw: the user's message, laid out with the model's own template; rendered: the text as it stands
    assert set(inputs) == ({"sentences"} if rendered else {"messages"})


def test_an_unknown_prompt_strings_setting_is_refused():
    with pytest.raises(ValueError, match="prompt_strings must be one of auto, rendered, raw, got 'chat'"):
        RewardServerConfig(prompt_strings="chat")


def test_each_format_writes_errors_its_clients_read():
    openrlhf, remote_rm, classify = reward_routes("reward_model", RAW_MODEL)
    assert openrlhf.error(400, "why") == {"error": "why"} == remote_rm.error(400, "why")
    assert classify.error(400, "why") == {
        "error": {"message": "why", "type": "BadRequestError", "param": None, "code": 400}
    }
    assert classify.error(503, "gone")["error"]["type"] == "InternalServerError"
    paths = [p for r in (openrlhf, remote_rm, classify) for p in r.paths]
    assert paths == ["/get_reward", "/remote_rm", "/classify", "/v1/classify"]
