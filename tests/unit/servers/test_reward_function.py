"""A served reward function: the isolated worker (raises, hangs, dies, answers wrongly — and serving
goes on), the endpoint on in-memory arrays (metadata, text only, merged requests, weights with a
model), the client's choice of text, and the built-in functions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from openaligner.clients.critic import TokenizerIdentity, TokenizerMismatchError, choose_reward_input
from openaligner.protocol import reads_text, text_reader, tokenizer_description
from openaligner.servers.reward_function import (
    SCORES_PARAMETER,
    FunctionRunner,
    RewardFunctionEndpoint,
    RewardFunctionError,
    RewardFunctionLoadError,
    conversation_texts,
)
from openaligner.servers.validation import (
    RequestError,
    RequestsFailed,
    SequenceRequest,
    parse_sequence_request,
)
from openaligner.tasks.sorting import gold_reward, make_prompt

FUNCTIONS = Path(__file__).parents[2] / "integration" / "critic_free_rewards.py"


@pytest.fixture(scope="module")
def runner():
    r = FunctionRunner(f"{FUNCTIONS}:behave", timeout_s=3.0, workers=2)
    yield r
    r.close()


def call(runner, do=None, rows=2):
    meta = [{"do": do} if do else {} for _ in range(rows)]
    return runner(["p"] * rows, ["ab", "abcd"][:rows] + ["x"] * max(0, rows - 2), meta)


@pytest.mark.parametrize(
    ("do", "needle"),
    [
        ("raise", "behave raised ValueError: this response cannot be scored"),
        ("hang", "did not answer within reward.timeout_s=3 s; its worker was killed and restarted"),
        ("exit", "worker process died during the call (exit code 7); restarted"),
        ("short", "returned 1 scores for 2 responses"),
        ("nan", "returned nan for row 0; expected a finite number"),
    ],
)
def test_a_failing_function_fails_that_call_and_the_next_call_is_served(runner, do, needle):
    with pytest.raises(RewardFunctionError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        call(runner, do)
    assert call(runner) == [2.0, 4.0]  # the same worker, or a restarted one, serves on


def test_the_worker_restarts_only_when_it_had_to(runner):
    before = runner.restarts
    with pytest.raises(RewardFunctionError):
        call(runner, "raise")
    assert runner.restarts == before  # an exception does not cost a restart
    with pytest.raises(RewardFunctionError):
        call(runner, "exit")
    assert runner.restarts == before + 1


def test_a_hanging_call_holds_one_worker_while_the_others_serve():
    r = FunctionRunner(f"{FUNCTIONS}:behave", timeout_s=2.0, workers=2)
    try:
        hung = r.submit(["p"], ["x"], [{"do": "hang"}])
        time.sleep(0.2)  # a worker has taken it
        t0 = time.perf_counter()
        assert [r(["p"], ["ab"], [{}]) for _ in range(5)] == [[2.0]] * 5
        assert time.perf_counter() - t0 < 1.0 and not hung.done()
        with pytest.raises(RewardFunctionError, match=r"did not answer within reward\.timeout_s=2 s"):
            hung.result(10)
        # reported once its replacement was ready: both workers serve again
        assert r.restarts == 1 and all(w is not None and w.process.poll() is None for w in r._workers)
        calls = [r.submit(["p"], ["abc"], [{}]) for _ in range(4)]
        assert [c.result(5) for c in calls] == [[3.0]] * 4
    finally:
        r.close()


def test_a_dead_worker_is_replaced_in_well_under_a_second():
    """A worker imports only the worker module and the function, never the server's main module
    (pytest's here, a CLI's or a benchmark's importing torch elsewhere): a crash costs little."""
    r = FunctionRunner(f"{FUNCTIONS}:behave", timeout_s=5.0, workers=1)
    try:
        t0 = time.perf_counter()
        with pytest.raises(RewardFunctionError, match="exit code 7"):
            call(r, "exit")
        assert time.perf_counter() - t0 < 1.0 and call(r) == [2.0, 4.0]
    finally:
        r.close()


def test_close_fails_queued_calls_instead_of_leaving_them_waiting():
    r = FunctionRunner(f"{FUNCTIONS}:behave", timeout_s=30.0, workers=1)
    hung = r.submit(["p"], ["x"], [{"do": "hang"}])
    queued = r.submit(["p"], ["x"], [{}])
    time.sleep(0.2)
    r.close()
    for future in (hung, queued):
        with pytest.raises(RewardFunctionError, match="stopping"):
            future.result(5)


def test_workers_import_the_function_with_the_servers_sys_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FUNCTIONS.parent))  # not in PYTHONPATH: only this process knows it
    r = FunctionRunner("critic_free_rewards:letter_share", workers=1)
    try:
        assert r(["p"], ["aab"], [{"letter": "a"}]) == [2 / 3]
    finally:
        r.close()


def test_a_two_argument_function_is_called_without_metadata():
    r = FunctionRunner(f"{FUNCTIONS}:two_arguments", workers=1)
    try:
        assert r(["abc", "a"], ["x", "y"], [{}, {}]) == [3.0, 1.0]
    finally:
        r.close()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_colon", "must look like"),
        ("openaligner.no_such_module:f", "importing 'openaligner.no_such_module' failed"),
        ("openaligner.tasks.sorting:no_such_function", "has no callable 'no_such_function'"),
        ("openaligner.tasks.sorting:PROMPT_WORD", "has no callable 'PROMPT_WORD' \\(it is a str\\)"),
    ],
)
def test_a_function_that_cannot_load_is_refused_at_start(spec, needle):
    with pytest.raises(RewardFunctionLoadError, match=needle):
        FunctionRunner(spec, workers=2).close()


def messages(*rows):
    return np.array(
        [
            [json.dumps([{"role": "user", "content": p}, {"role": "assistant", "content": r}]).encode()]
            for p, r in rows
        ],
        dtype=np.object_,
    )


def metadata(*objects):
    return np.array(
        [[json.dumps(o).encode() if not isinstance(o, bytes) else o] for o in objects], dtype=np.object_
    )


class Recorder:
    """An in-process function: scores len(response) + metadata "bonus"; fails rows whose response is "bad"."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, responses, meta):
        self.calls.append((prompts, responses, meta))
        if "bad" in responses:
            raise RewardFunctionError("cannot score 'bad'")
        return [len(r) + m.get("bonus", 0) for r, m in zip(responses, meta, strict=True)]


def test_endpoint_passes_prompts_responses_and_metadata_and_splits_answers():
    fn = Recorder()
    ep = RewardFunctionEndpoint(fn, name="recorder")
    a = ep.validate(
        {"messages": messages(("q1", "aa"), ("q2", "bbb")), "metadata": metadata({"bonus": 10}, {})}
    )
    b = ep.validate({"messages": messages(("q3", "c"))})
    out = ep.run([a, b])
    assert [o["rewards"].reshape(-1).tolist() for o in out] == [[12.0, 3.0], [1.0]]
    # one call per request: a call that fails fails only its own request
    assert fn.calls == [(["q1", "q2"], ["aa", "bbb"], [{"bonus": 10}, {}]), (["q3"], ["c"], [{}])]
    assert reads_text(ep.tokenizer_info)


def test_only_the_failing_request_of_a_merged_batch_fails():
    fn = Recorder()
    ep = RewardFunctionEndpoint(fn, name="recorder")
    good = ep.validate({"messages": messages(("q", "fine"))})
    bad = ep.validate({"messages": messages(("q", "bad"))})
    with pytest.raises(RequestsFailed) as caught:
        ep.run([good, bad, good])
    assert caught.value.failed == {1: "cannot score 'bad'"}  # requests 0 and 2 are resent by their clients
    with pytest.raises(RequestsFailed) as alone:
        ep.run([bad])
    assert alone.value.failed == {0: "cannot score 'bad'"}


def test_admission_scores_a_request_before_triton_and_refuses_a_failing_one_alone():
    fn = Recorder()
    ep = RewardFunctionEndpoint(fn, name="recorder")
    good = ep.validate({"messages": messages(("q", "fine"), ("q", "ok"))})
    bad = ep.validate({"messages": messages(("q", "bad"))})
    with pytest.raises(RequestError, match="cannot score 'bad'"):
        ep.admit(bad).result()
    parameters = ep.admit(good).result()
    calls = len(fn.calls)
    resumed = ep.resume(good, parameters)
    assert resumed.scores == (4.0, 2.0) and len(ep.tickets) == 0  # taken once
    out = ep.run([resumed, ep.resume(good, {})])  # the second was never admitted: scored now
    assert [o["rewards"].reshape(-1).tolist() for o in out] == [[4.0, 2.0], [4.0, 2.0]]
    assert len(fn.calls) == calls + 1
    assert ep.resume(good, {SCORES_PARAMETER: "forged"}).scores is None


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        (
            {"tokens": np.zeros((1, 3), np.int64), "sequence_lengths": np.ones((1, 1), np.int64)},
            "reads 'messages'",
        ),
        ({"sentences": np.array([[b"hi"]], dtype=np.object_)}, "reads 'messages'"),
        ({"messages": messages(("q", "r")), "metadata": metadata(b"{not json")}, "row 0 is not JSON"),
        (
            {"messages": messages(("q", "r")), "metadata": metadata([1, 2])},
            "is a JSON list; send a JSON object",
        ),
        ({"messages": messages(("q", "r")), "metadata": metadata({}, {})}, "has 2 rows but 'messages' has 1"),
        ({"messages": messages(("q", "r")), "metadata": metadata({"a": "x" * 70000})}, "over 65536 bytes"),
    ],
)
def test_endpoint_refuses_what_it_cannot_score(inputs, needle):
    with pytest.raises(RequestError, match=needle):
        RewardFunctionEndpoint(Recorder(), name="recorder").validate(inputs)


def test_a_model_server_refuses_metadata():
    with pytest.raises(RequestError, match="read by a server that scores text with a reward function"):
        parse_sequence_request(
            {"messages": messages(("q", "r")), "metadata": metadata({})},
            tokenize_func=None,
            vocab_size=None,
            max_sequence_length=None,
            max_batch_size=8,
        )


def test_combined_with_a_model_the_reward_is_the_weighted_sum():
    def render(conversations, max_length):
        lengths = torch.tensor([len(c[-1]["content"]) for c in conversations])
        return torch.ones(len(conversations), int(lengths.max())), lengths

    def shape(requests: list[SequenceRequest]):  # the model rows, then one padding row
        tokens = torch.cat([r.tokens for r in requests])
        lengths = torch.cat([r.lengths for r in requests])
        return torch.cat([tokens, tokens[:1]]), torch.cat([lengths, lengths[:1]])

    ep = RewardFunctionEndpoint(
        Recorder(),
        name="recorder",
        model_forward=lambda tokens, lengths: 100.0 * lengths.float(),  # "model score" = 100·length
        render_func=render,
        prepare_model_batch=shape,
        model_weight=0.5,
        function_weight=2.0,
    )
    r = ep.validate({"messages": messages(("q", "ab"), ("q", "abc"))})
    (out,) = ep.run([r])
    # 0.5·100·len + 2·len
    assert out["rewards"].reshape(-1).tolist() == [0.5 * 200 + 2 * 2, 0.5 * 300 + 2 * 3]


def test_combined_with_a_model_whole_texts_feed_the_model_and_conversations_the_function():
    """Another framework's prompt string that is already rendered: the model reads the whole text
    (``sentences``), the function the prompt and response (``messages``)."""
    seen = []

    def tokenize(texts):
        seen.extend(texts)
        lengths = torch.tensor([len(t) for t in texts])
        return torch.ones(len(texts), int(lengths.max()), dtype=torch.int64), lengths

    def render(conversations, max_length):  # must not be used when sentences are given
        raise AssertionError("rendered")

    ep = RewardFunctionEndpoint(
        Recorder(),
        name="recorder",
        model_forward=lambda tokens, lengths: 100.0 * lengths.float(),
        render_func=render,
        tokenize_func=tokenize,
        prepare_model_batch=lambda rs: (
            torch.cat([r.tokens for r in rs]),
            torch.cat([r.lengths for r in rs]),
        ),
    )
    whole = np.array([[b"<s>q</s>ab"], [b"<s>q</s>abc"]], dtype=np.object_)
    r = ep.validate({"messages": messages(("q", "ab"), ("q", "abc")), "sentences": whole})
    (out,) = ep.run([r])
    assert seen == ["<s>q</s>ab", "<s>q</s>abc"]
    assert out["rewards"].reshape(-1).tolist() == [100 * 10 + 2, 100 * 11 + 3]
    with pytest.raises(RequestError, match="has 2 rows but 'messages' has 1"):
        ep.validate({"messages": messages(("q", "ab")), "sentences": whole})
    alone = RewardFunctionEndpoint(Recorder(), name="recorder")
    with pytest.raises(RequestError, match="this server has no model: send 'messages' alone"):
        alone.validate({"messages": messages(("q", "ab")), "sentences": whole[:1]})


def test_conversation_texts():
    assert conversation_texts(
        [{"role": "user", "content": "sort 3 1"}, {"role": "assistant", "content": "1 3"}]
    ) == (
        "sort 3 1",
        "1 3",
    )
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    assert conversation_texts(chat) == ("system: be brief\nuser: hi", "yo")


def test_a_text_reading_server_gets_text_and_refuses_tokens():
    policy = TokenizerIdentity("char", "f", "v")
    function_only = TokenizerIdentity.from_server({"reads": "text"}, "http://h:1")
    assert function_only is not None and function_only.reads_text
    assert choose_reward_input("auto", policy, reward=function_only, critic=None, combined=False) == "text"
    with pytest.raises(TokenizerMismatchError, match="serves a reward function, which reads text"):
        choose_reward_input("tokens", policy, reward=function_only, critic=None, combined=False)
    # a model with the policy's own tokenizer, combined with a function: still text
    combined = TokenizerIdentity.from_server(
        text_reader(tokenizer_description("char", "f", "v"))["tokenizer"] | {"reads": "text"}, "http://h:1"
    )
    assert combined is not None and combined.reads_text
    assert choose_reward_input("auto", policy, reward=combined, critic=None, combined=False) == "text"


def test_the_sorting_gold_reward_is_the_gold_score_as_a_share():
    prompt = make_prompt([3, 1, 2])
    assert gold_reward([prompt, prompt], ["1 2 3", "1 3 2"]) == [1.0, pytest.approx(1 / 3)]


def test_the_math_verifier_compares_answers_and_names_the_metadata_key():
    pytest.importorskip("math_verify")
    from openaligner.tasks.math_answer import verify

    scores = verify(
        ["q"] * 3,
        ["so the answer is \\boxed{1/2}", "It is 0.5.", "I think 3"],
        [{"answer": "0.5"}, {"answer": "\\frac{1}{2}"}, {"answer": "4"}],
    )
    assert scores == [1.0, 1.0, 0.0]
    # other frameworks send the reference answer as the sample's label
    assert verify(["q", "q"], ["\\boxed{4}", "5"], [{"label": "4"}, {"label": 4}]) == [1.0, 0.0]
    with pytest.raises(KeyError, match=r"data.metadata_keys=\[answer\]"):
        verify(["q"], ["1"], [{}])
    with pytest.raises(KeyError, match="send the answer as the sample's label"):
        verify(["q"], ["1"], [{"label": None}])
