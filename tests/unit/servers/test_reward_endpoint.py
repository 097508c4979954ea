"""RewardEndpoint and the PyTriton callable, on in-memory arrays (no Triton process)."""

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from openaligner.protocol import REQUEST_ID_PARAMETER, ErrorEnvelope
from openaligner.servers.reward import (
    MAX_CHARS_PER_TOKEN,
    RewardEndpoint,
    RewardModelServer,
    make_tokenize_func,
    micro_batched,
)
from openaligner.servers.transport.lifecycle import StartInterrupted
from openaligner.servers.transport.triton import BatchRejected, TritonCallable, is_loopback, rejection
from openaligner.servers.validation import RequestError, UnauthorizedError


def toy_reward(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reads only the valid prefix: sum of id * position weight, plus the length."""
    weights = torch.arange(1, tokens.shape[1] + 1)
    valid = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return (tokens * weights * valid).sum(1).float() + lengths.float()


def char_tokenize(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [[ord(c) % 100 for c in t] for t in texts]
    width = max(1, *(len(i) for i in ids))
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    for r, row in enumerate(ids):
        tokens[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return tokens, torch.tensor([len(i) for i in ids])


def make_endpoint(**kw) -> tuple[RewardEndpoint, list[int]]:
    seen_rows: list[int] = []

    def forward(tokens, lengths):
        seen_rows.append(tokens.shape[0])
        return micro_batched(toy_reward, 4)(tokens, lengths)

    kw.setdefault("vocab_size", 100)
    kw.setdefault("tokenize_func", char_tokenize)
    return RewardEndpoint(forward, **kw), seen_rows


def tok_request(tokens, lengths):
    return {
        "tokens": np.asarray(tokens, np.int64),
        "sequence_lengths": np.asarray(lengths, np.int64).reshape(-1, 1),
    }


def test_rewards_read_the_valid_prefix_and_come_back_per_request():
    ep, _ = make_endpoint()
    reqs = [ep.validate(tok_request([[1, 2, 3, 9]], [3])), ep.validate(tok_request([[4, 0], [5, 6]], [1, 2]))]
    out = ep.run(reqs)
    # row [1,2,3] len 3: 1*1 + 2*2 + 3*3 + 3 = 17; [4] len 1: 4 + 1 = 5; [5,6] len 2: 5 + 12 + 2 = 19
    assert [o["rewards"].tolist() for o in out] == [[[17.0]], [[5.0], [19.0]]]
    assert out[0]["rewards"].dtype == np.float32


@pytest.mark.parametrize("dp,strip", [(1, None), (2, 4), (3, 1)])
def test_answers_do_not_depend_on_batching(dp, strip):
    ep, seen = make_endpoint(dp_size=dp, strip_sequence_length_to_multiple=strip, forward_micro_batch_size=2)
    g = torch.Generator().manual_seed(0)
    requests = []
    for rows in (1, 3, 2, 5):
        tokens = torch.randint(0, 100, (rows, 12), generator=g)
        lengths = torch.randint(1, 13, (rows,), generator=g)
        requests.append(ep.validate(tok_request(tokens.numpy(), lengths.numpy())))
    alone = [ep.run([r])[0]["rewards"] for r in requests]
    together = [o["rewards"] for o in ep.run(requests)]
    big = ep.validate(
        tok_request(
            torch.cat([r.tokens for r in requests]).numpy(), torch.cat([r.lengths for r in requests]).numpy()
        )
    )
    one_request = ep.run([big])[0]["rewards"]
    for a, t in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, t)
    np.testing.assert_array_equal(np.concatenate(alone), one_request)
    assert all(rows % dp == 0 for rows in seen)  # every forward saw a batch that splits over ranks
    assert ep.stats.calls == 6 and ep.stats.rows == 2 * 11 + 11


def test_sentences_win_over_tokens():
    ep, _ = make_endpoint()
    both = {"sentences": np.array([[b"ab"]], dtype=object), **tok_request([[7, 7, 7]], [3])}
    only_text = {"sentences": np.array([[b"ab"]], dtype=object)}
    got = ep.run([ep.validate(both)])[0]["rewards"]
    want = ep.run([ep.validate(only_text)])[0]["rewards"]
    assert got.tolist() == want.tolist() == [[float(97 % 100 + 2 * (98 % 100) + 2)]]


@pytest.mark.parametrize(
    "inputs,needle",
    [
        ({"sequence_lengths": np.ones((1, 1), np.int64)}, "neither 'tokens' nor 'sentences'"),
        ({"tokens": np.ones((1, 3), np.int64)}, "'sequence_lengths' (int64 [B, 1]) is required"),
        (
            {"tokens": np.ones((1, 3), np.int32), "sequence_lengths": np.ones((1, 1), np.int64)},
            "got dtype int32",
        ),
        (tok_request([[1, 2]], [3]), "row 0 is 3; each length must lie in [1, 2]"),
        (tok_request([[1, 200]], [2]), "holds id 200, outside the vocabulary [0, 100)"),
        (tok_request(np.ones((9, 2)), np.ones(9)), "9 rows; this server accepts at most 8"),
        ({"sentences": np.array([[b"\xff"]], dtype=object)}, "not valid UTF-8"),
        ({"sentences": np.array([[b""]], dtype=object)}, "row 0 has no tokens"),
    ],
)
def test_bad_requests_raise_request_error(inputs, needle):
    ep, _ = make_endpoint(max_batch_size=8)
    with pytest.raises(RequestError) as info:
        ep.validate(inputs)
    assert needle in str(info.value)


def test_sentences_refused_without_tokenizer():
    ep, _ = make_endpoint(tokenize_func=None)
    with pytest.raises(RequestError, match="no tokenizer"):
        ep.validate({"sentences": np.array([[b"hi"]], dtype=object)})


@dataclass
class FakeRequest:
    """Stands in for ``pytriton.proxy.types.Request``: ``data`` plus ``parameters``."""

    data: dict
    parameters: dict = field(default_factory=dict)


def test_triton_callable_answers_good_batches():
    ep, _ = make_endpoint()
    call = TritonCallable(ep, threading.Lock())
    out = call([FakeRequest(tok_request([[1, 2]], [2])), FakeRequest(tok_request([[3]], [1]))])
    assert [o["rewards"].tolist() for o in out] == [[[7.0]], [[4.0]]]
    assert not call.busy


def test_one_invalid_request_names_itself_and_tells_the_valid_ones_to_resend():
    ep, seen = make_endpoint()
    call = TritonCallable(ep, threading.Lock())
    batch = [
        FakeRequest(tok_request([[1, 2]], [2]), {REQUEST_ID_PARAMETER: "good-1"}),
        FakeRequest(tok_request([[1, 2]], [0]), {REQUEST_ID_PARAMETER: "bad"}),
        FakeRequest(tok_request([[1, 2]], [1])),  # an off-the-shelf client sends no id
    ]
    with pytest.raises(BatchRejected) as info:
        call(batch)
    env = ErrorEnvelope.find(str(info.value))
    assert env is not None and env.kind == "rejected_batch"
    assert list(env.invalid) == ["bad"] and "row 0 is 0" in env.invalid["bad"]
    assert env.valid == ("good-1", "#2")
    assert "resend unchanged" in str(info.value)
    assert seen == []  # nothing ran
    # a single bad request is a plain bad_request naming the model
    with pytest.raises(BatchRejected, match=r"reward_model: input 'sequence_lengths': row 0 is 0"):
        call([batch[1]])


def test_the_fronts_check_judges_a_request_as_the_callable_would_without_running_it():
    ep, seen = make_endpoint()

    def authorize(parameters):
        if parameters.get("token") != "t":
            raise UnauthorizedError("wrong token")

    call = TritonCallable(ep, threading.Lock(), authorize)
    call.check(tok_request([[1, 2]], [2]), {"token": "t"})
    with pytest.raises(UnauthorizedError):  # the token first: nothing is said about the inputs
        call.check(tok_request([[1, 2]], [0]), {})
    with pytest.raises(RequestError, match="row 0 is 0"):
        call.check(tok_request([[1, 2]], [0]), {"token": "t"})
    assert seen == []


def test_rejection_when_every_request_is_invalid():
    env = rejection("m", {"#0": "x", "#1": "y"}, [])
    assert env.kind == "bad_request" and "all 2 requests" in env.message


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")


def test_server_config_checks():
    with pytest.raises(ValueError, match=r"max_batch_size=8 is below .* 16 .*max_batch_size=16 or more"):
        RewardModelServer(infer_fn=toy_reward, inference_micro_batch_size=[4, 16], max_batch_size=8)
    srv = RewardModelServer(infer_fn=toy_reward, inference_micro_batch_size=[2, 8])
    assert srv.cfg.preferred_batch_sizes(world_size=1) == (2, 8)
    # without start(), the endpoint computes in-process: usable as a plain callable
    out = srv.endpoint.run([srv.endpoint.validate(tok_request([[1, 2, 3]], [2]))])
    assert out[0]["rewards"].tolist() == [[7.0]]


def test_make_tokenize_func_pads_and_truncates():
    from openaligner.models.tokenizers import build_char_tokenizer

    tok = build_char_tokenizer()
    fn = make_tokenize_func(tok, max_length=4)  # train-rm's layout: BOS + text + EOS
    tokens, lengths = fn(["abcdef", "x"])
    assert lengths.tolist() == [4, 3]
    assert tokens.shape == (2, 4) and tokens[1, 3:].tolist() == [tok.pad_token_id]
    ab = tok("ab", add_special_tokens=False)["input_ids"]
    assert tokens[0].tolist() == [tok.bos_token_id, *ab, tok.eos_token_id]  # the text is cut, not BOS/EOS


class SpyTokenizer:
    """Records the texts it is asked to tokenize; one id per character."""

    pad_token_id = 0

    def __init__(self):
        self.seen: list[list[str]] = []

    def __call__(self, texts, add_special_tokens, truncation, max_length):
        self.seen.append(list(texts))
        return {"input_ids": [[1] * min(len(t), max_length or len(t)) for t in texts]}


def test_a_long_text_is_cut_before_tokenizing_to_what_the_server_can_keep():
    spy = SpyTokenizer()
    fn = make_tokenize_func(spy, max_length=8)
    tokens, lengths = fn(["a" * 2_000_000, "short"])
    assert [len(t) for t in spy.seen[0]] == [8 * MAX_CHARS_PER_TOKEN, 5]
    assert lengths.tolist() == [8, 5] and tokens.shape == (2, 8)
    unlimited = SpyTokenizer()
    make_tokenize_func(unlimited)(["a" * 1000])  # without max_length nothing is cut
    assert len(unlimited.seen[0][0]) == 1000


def test_a_stop_request_during_start_abandons_the_start():
    """A signal handler calling request_stop while Triton starts (in the main thread) interrupts
    the start; the server stops what it had started and returns as stopped."""
    server = RewardModelServer(infer_fn=toy_reward)
    stopped = []

    class Host:
        def start(self):
            server.request_stop()  # what the SIGTERM handler does, inside the start
            raise AssertionError("the start went on after the stop request")

        def stop(self):
            stopped.append(True)

    assert server._start_host(Host()) is False
    assert stopped == [True] and server.triton is None
    server.request_stop()  # outside a start it only asks run_server to return
    with pytest.raises(StartInterrupted):  # the exception is a KeyboardInterrupt, not an Exception
        server._start_interruptible = True
        server.request_stop()
    assert server.start() is False  # a stop was requested: it does not start at all
    server.run_server()  # returns at once, releasing the other ranks
    server.stop()


def test_binding_a_non_loopback_address_warns(caplog):
    from openaligner.servers.transport.triton import TritonHost

    with caplog.at_level("WARNING", logger="openaligner.servers.transport.triton"):
        TritonHost("127.0.0.1", 5555)
    assert not caplog.records
    with caplog.at_level("WARNING", logger="openaligner.servers.transport.triton"):
        host = TritonHost("0.0.0.0", 5555)
    assert host.url == "http://0.0.0.0:5555"
    assert "reachable from other machines" in caplog.text and "no authentication" in caplog.text
