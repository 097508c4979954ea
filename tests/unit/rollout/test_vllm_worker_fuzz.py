"""A hostile client against the standalone vLLM engine's HTTP side (a fake ``vllm`` module, no
model): every malformed request gets a 4xx JSON error naming what was wrong, nothing bad reaches
``LLM.generate`` or a reload, and after each one the engine still serves its trainer with the
lease intact and no stray file in its directory. test_vllm_worker_server.py covers the good paths."""

from __future__ import annotations

import http.client
import http.server
import json
import select
import socket
import struct
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from openaligner.rollout import vllm_worker

TIMEOUT_S = 5.0  # the engine's --request-timeout-s here: a client that stops sending is dropped


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeLLM:
    """What the worker calls on ``vllm.LLM``; records generate calls and reloads."""

    # vLLM's resolved window (prompt + response), as ``LLM.llm_engine.model_config`` reports it
    llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=64))

    def __init__(self) -> None:
        self.generated: list[tuple[list, list]] = []
        self.reloads: list[str] = []

    def generate(self, prompts: list, sampling_params: list, use_tqdm: bool) -> list:
        self.generated.append((prompts, sampling_params))
        step = types.SimpleNamespace
        return [
            step(
                outputs=[
                    step(
                        token_ids=[7, 2],
                        logprobs=[{7: step(logprob=-0.5)}, {2: step(logprob=-0.25)}],
                        finish_reason="stop",
                    )
                ]
            )
            for _ in prompts
        ]

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.reloads.append(kwargs["weights_path"])

    def reset_prefix_cache(self) -> None:
        return None


class Ctx(types.SimpleNamespace):
    port: int
    llm: FakeLLM
    engine: vllm_worker.Engine
    workdir: Path
    lease: str


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100}))
    workdir = tmp_path / "work"
    workdir.mkdir()
    args = vllm_worker.parser().parse_args(
        [f"--model={model}", "--ready-file=x", f"--workdir={workdir}", "--standalone", "--lease-ttl-s=60"]
    )
    args.request_timeout_s = TIMEOUT_S
    llm = FakeLLM()
    engine = vllm_worker.Engine(args, llm=llm)
    server = vllm_worker.make_server(engine, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown
    port = server.server_address[1]
    code, reply = call(port, "POST", "/attach", {"client": "fuzz:1"})
    assert code == 200
    c = Ctx(port=port, llm=llm, engine=engine, workdir=workdir, lease=reply["lease"])
    yield c
    server.shutdown()
    server.server_close()


def call(
    port: int, method: str, path: str, body: Any = None, headers: dict | None = None, timeout: float = 10.0
):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, {"not_json": raw[:200].decode(errors="replace")}


def raw_request(port: int, head: bytes, body: bytes = b"", wait_s: float = 10.0) -> tuple[int, dict]:
    """Send bytes as they are (lying headers, cut bodies) and read one JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(head + body)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                length = [
                    int(line.split(b":")[1])
                    for line in data[:head_end].split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if length and len(data) >= head_end + 4 + length[0]:
                    break
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data[data.find(b"\r\n\r\n") + 4 :])


def lease(c: Ctx) -> dict:
    return {vllm_worker.LEASE_HEADER: c.lease}


def good_generate() -> dict:
    return {
        "prompts": [[1, 2, 3], [4, 5]],
        "seeds": [1, 2],
        "greedy": False,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_tokens": 4,
        "min_tokens": 0,
        "stop_token_ids": [2],
    }


def safetensors_bytes(header: Any, data: bytes, raw_header: bytes | None = None) -> bytes:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def a_good_file() -> bytes:
    return safetensors_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 16)


def assert_still_serving(c: Ctx, generated_before: int = 0) -> None:
    """The engine answers, the trainer still holds it, and nothing stray lies in its directory."""
    assert call(c.port, "GET", "/health") == (200, {"ok": True})
    assert call(c.port, "POST", "/heartbeat", {}, lease(c)) == (200, {"ok": True})
    assert call(c.port, "GET", "/info")[1]["lease"]["holder"] == "fuzz:1"
    for _ in range(50):  # a dropped connection's handler may still be cleaning up
        if sorted(p.name for p in c.workdir.iterdir()) == ["local-token", "weights"] and not list(
            (c.workdir / "weights").iterdir()
        ):
            break
        time.sleep(0.1)
    assert sorted(p.name for p in c.workdir.iterdir()) == ["local-token", "weights"]
    assert list((c.workdir / "weights").iterdir()) == []
    code, out = call(c.port, "POST", "/generate", good_generate(), lease(c))
    assert code == 200 and out["token_ids"] == [[7, 2], [7, 2]] and out["logprobs"] == [[-0.5, -0.25]] * 2
    assert len(c.llm.generated) == generated_before + 1


def assert_refused(reply: tuple[int, dict], code: int, *words: str) -> None:
    status, payload = reply
    assert status == code, payload
    assert "error" in payload, payload
    for w in words:
        assert w in payload["error"], (w, payload["error"])


# ---------------------------------------------------------------------------- bodies
POST_PATHS = ["/generate", "/reload_weights", "/attach", "/heartbeat", "/detach"]
NOT_AN_OBJECT = [b"{", b"\xff\xfe\x00", b"[1]", b'"x"', b"null", b"1", b"[" * 100_000, b'{"a": ' * 50_000]


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("body", NOT_AN_OBJECT, ids=lambda b: repr(b[:8]))
def test_a_body_that_is_not_a_json_object_is_refused_at_every_endpoint(ctx, path, body):
    assert_refused(call(ctx.port, "POST", path, body, lease(ctx)), 400, "JSON")
    assert_still_serving(ctx)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
@pytest.mark.parametrize("path", ["/generate", "/heartbeat"])
def test_nan_and_infinity_are_not_json_numbers(ctx, path, constant):
    body = json.dumps({**good_generate(), "temperature": "X"}).encode().replace(b'"X"', constant)
    assert_refused(call(ctx.port, "POST", path, body, lease(ctx)), 400)
    assert ctx.llm.generated == []
    assert_still_serving(ctx)


BAD_GENERATE: list[tuple[str, Any]] = [
    ("prompts", None),
    ("prompts", {}),
    ("prompts", "1 2 3"),
    ("prompts", []),
    ("prompts", [[]]),
    ("prompts", [["1"], [2]]),
    ("prompts", [[1.0], [2]]),
    ("prompts", [[True], [2]]),
    ("prompts", [[-1], [2]]),
    ("prompts", [[100], [2]]),
    ("prompts", [[2**70], [2]]),
    ("prompts", [[1], 2]),
    ("seeds", None),
    ("seeds", [1]),
    ("seeds", [1, 2, 3]),
    ("seeds", ["1", "2"]),
    ("seeds", [1.0, 2.0]),
    ("seeds", [-1, 2]),
    ("seeds", [2**64, 1]),
    ("seeds", [True, 2]),
    ("greedy", None),
    ("greedy", "true"),
    ("greedy", 1),
    ("temperature", None),
    ("temperature", -0.5),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", True),
    ("top_k", 2**70),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", "0.5"),
    ("top_p", None),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", "4"),
    ("max_tokens", True),
    ("max_tokens", 2**70),
    ("min_tokens", -1),
    ("min_tokens", 5),
    ("min_tokens", "0"),
    ("min_tokens", None),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [100]),
    ("stop_token_ids", "2"),
    ("stop_token_ids", [2.0]),
    ("stop_token_ids", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_GENERATE, ids=lambda v: repr(v)[:20])
def test_a_bad_generate_field_is_refused_naming_it_and_never_reaches_vllm(ctx, field, value):
    body = {**good_generate(), field: value}
    if value is None:
        del body[field]
    assert_refused(call(ctx.port, "POST", "/generate", body, lease(ctx)), 400, field)
    assert ctx.llm.generated == []
    assert_still_serving(ctx)


def test_a_prompt_without_room_for_max_tokens_in_the_window_is_refused_naming_the_keys(ctx):
    assert call(ctx.port, "GET", "/info")[1]["max_model_len"] == 64
    fits = {**good_generate(), "prompts": [[5] * 60, [5]], "max_tokens": 4}
    assert call(ctx.port, "POST", "/generate", fits, lease(ctx))[0] == 200  # 60 + 4 = 64 fits
    over = {**fits, "prompts": [[5], [5] * 61]}
    assert_refused(
        call(ctx.port, "POST", "/generate", over, lease(ctx)),
        400,
        "prompts[1] has 61 tokens",
        "max_model_len=64",
        "rollout.vllm.max_model_len",
        "data.seq_length",
    )
    assert len(ctx.llm.generated) == 1  # the refused request never reached vLLM
    assert_still_serving(ctx, generated_before=1)


def test_an_unknown_generate_field_is_refused_naming_it(ctx):
    body = {**good_generate(), "max_new_tokens": 8}
    assert_refused(call(ctx.port, "POST", "/generate", body, lease(ctx)), 400, "max_new_tokens")
    assert ctx.llm.generated == []
    assert_still_serving(ctx)


@pytest.mark.parametrize("value", [5, "", None, {"a": 1}, ["x"]])
@pytest.mark.parametrize("field", ["client", "local_token"])
def test_a_bad_attach_field_is_refused_and_the_holder_keeps_the_engine(ctx, field, value):
    if field == "local_token" and value is None:
        value = 5
    body = {"client": "b:2", field: value}
    status, reply = call(ctx.port, "POST", "/attach", body)
    assert (status in (400, 409) and field in reply["error"]) or "another trainer" in reply["error"]
    assert_still_serving(ctx)


# ---------------------------------------------------------------------------- the lease
@pytest.mark.parametrize("header", [None, "", "not-the-lease", "x" * 8000, "\xff\xfe", "old"])
def test_a_request_without_the_holders_lease_is_refused_and_changes_nothing(ctx, header):
    if header == "old":  # a lease that was someone's, once
        old = ctx.lease
        assert call(ctx.port, "POST", "/detach", {}, lease(ctx))[0] == 200
        ctx.lease = call(ctx.port, "POST", "/attach", {"client": "fuzz:1"})[1]["lease"]
        header = old
    headers = {} if header is None else {vllm_worker.LEASE_HEADER: header}
    for method, path, body in [
        ("POST", "/generate", good_generate()),
        ("POST", "/reload_weights", {}),
        ("POST", "/heartbeat", {}),
        ("POST", "/detach", {}),
        ("PUT", "/weights", a_good_file()),
    ]:
        assert_refused(call(ctx.port, method, path, body, headers), 409, vllm_worker.LEASE_HEADER)
    assert ctx.llm.generated == [] and ctx.llm.reloads == []
    assert_still_serving(ctx)


# ---------------------------------------------------------------------------- methods and paths
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/weights"),
        ("PATCH", "/generate"),
        ("OPTIONS", "/info"),
        ("GET", "/generate"),
        ("POST", "/weights"),
        ("PUT", "/generate"),
        ("GET", "/../../etc/passwd"),
        ("POST", "/generate/../attach"),
        ("GET", "/info?x=1"),
        ("POST", "//generate"),
    ],
)
def test_an_unknown_method_or_path_gets_a_4xx_json_error(ctx, method, path):
    status, reply = call(ctx.port, method, path, {}, lease(ctx))
    assert 400 <= status < 500 and "error" in reply, (status, reply)
    assert path.split("?")[0] in reply["error"] or method in reply["error"]
    assert_still_serving(ctx)


@pytest.mark.parametrize(
    "path",
    [
        "{w}/..",
        "{w}/../..",
        "/etc",
        "/",
        "weights/../../..",
        "{w}/weights/../../x",
        "{w}/link",
        5,
        "a\u0000b",
    ],
)
def test_a_reload_path_outside_the_engines_directory_is_refused(ctx, tmp_path, path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(a_good_file())
    (ctx.workdir / "weights" / "link").symlink_to(outside)  # inside, pointing out
    if isinstance(path, str):
        path = path.format(w=ctx.workdir)
        if path.endswith("/link"):
            path = str(ctx.workdir / "weights" / "link")
    status, reply = call(ctx.port, "POST", "/reload_weights", {"path": path}, lease(ctx))
    assert status == 400 and "path" in reply["error"], reply
    assert ctx.llm.reloads == []
    (ctx.workdir / "weights" / "link").unlink()
    assert (outside / "model.safetensors").exists()  # nothing outside is touched either
    assert_still_serving(ctx)


# ---------------------------------------------------------------------------- sizes and framing
def head(method: str, path: str, c: Ctx, extra: str) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\n{vllm_worker.LEASE_HEADER}: {c.lease}\r\n{extra}\r\n"
    ).encode()


@pytest.mark.parametrize("path", ["/generate", "/heartbeat", "/attach"])
def test_a_json_body_larger_than_the_limit_is_refused_before_it_is_read(ctx, path):
    size = vllm_worker.MAX_JSON_BYTES + 1
    t0 = time.monotonic()
    assert_refused(
        raw_request(ctx.port, head("POST", path, ctx, f"Content-Length: {size}\r\n"), b"{}"),
        413,
        "Content-Length",
        str(vllm_worker.MAX_JSON_BYTES),
    )
    assert time.monotonic() - t0 < TIMEOUT_S  # answered at once, not after waiting for the body
    assert_refused(
        raw_request(ctx.port, head("POST", path, ctx, f"Content-Length: {10**18}\r\n"), b"{}"), 413
    )
    assert_still_serving(ctx)


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/generate"), ("POST", "/heartbeat"), ("PUT", "/weights")]
)
def test_chunked_transfer_encoding_is_refused_naming_content_length(ctx, method, path):
    chunked = b"2\r\n{}\r\n0\r\n\r\n"
    reply = raw_request(ctx.port, head(method, path, ctx, "Transfer-Encoding: chunked\r\n"), chunked)
    assert_refused(reply, 411, "Content-Length")
    assert_still_serving(ctx)


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/generate"), ("POST", "/heartbeat"), ("PUT", "/weights")]
)
def test_a_body_shorter_than_its_content_length_is_answered_408_and_the_server_serves_others(
    ctx, method, path
):
    body = a_good_file() if method == "PUT" else json.dumps(good_generate()).encode()
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=10) as s:
        s.sendall(head(method, path, ctx, f"Content-Length: {len(body) + 1000}\r\n") + body)
        # while that client keeps its connection open and sends nothing more, others are served:
        # the good answer comes while the stalled client has had no answer yet (it is not dropped)
        code, _out = call(ctx.port, "POST", "/generate", good_generate(), lease(ctx), timeout=TIMEOUT_S * 3)
        assert code == 200 and select.select([s], [], [], 0)[0] == []
        data = b""
        while chunk := s.recv(65536):  # the engine closes the connection after its answer
            data += chunk
    status = int(data.split(b" ", 2)[1])
    error = json.loads(data[data.find(b"\r\n\r\n") + 4 :])["error"]
    assert status == 408 and f"of {len(body) + 1000} bytes" in error, data
    assert_still_serving(ctx, generated_before=1)


def test_a_bad_content_length_is_refused(ctx):
    for value in ["-5", "1e3", "0x10", "", "12 34", "١٢"]:
        reply = raw_request(ctx.port, head("POST", "/heartbeat", ctx, f"Content-Length: {value}\r\n"), b"{}")
        assert reply[0] == 400 and "Content-Length" in reply[1]["error"], (value, reply)
    assert_still_serving(ctx)


# ---------------------------------------------------------------------------- uploads
MALFORMED = {
    "header longer than the file": struct.pack("<Q", 10**6) + b"{}",
    "header length 2**64-1": struct.pack("<Q", 2**64 - 1) + b"{}" * 8,
    "header not JSON": safetensors_bytes(None, b"\0" * 8, raw_header=b"not json"),
    "header not UTF-8": safetensors_bytes(None, b"\0" * 8, raw_header=b'{"\xff": 1}'),
    "header nested deep": safetensors_bytes(None, b"\0" * 8, raw_header=b"[" * 100_000),
    "header a list": safetensors_bytes([], b"\0" * 8),
    "only metadata": safetensors_bytes({"__metadata__": {"a": "b"}}, b""),
    "offsets of two types": safetensors_bytes(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": ["8", "16"]},
        },
        b"\0" * 16,
    ),
    "shape larger than its bytes": safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "two tensors in the same bytes": safetensors_bytes(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        },
        b"\0" * 8,
    ),
    "a gap between tensors": safetensors_bytes(
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        b"\0" * 12,
    ),
    "unknown dtype": safetensors_bytes(
        {"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "negative shape": safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "offsets backwards": safetensors_bytes(
        {"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8
    ),
    "tensor not an object": safetensors_bytes({"w": [0, 8]}, b"\0" * 8),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_safetensors_upload_is_refused_and_leaves_nothing(ctx, data):
    assert_refused(call(ctx.port, "PUT", "/weights", data, lease(ctx)), 400, "safetensors")
    assert_still_serving(ctx)
    assert call(ctx.port, "PUT", "/weights", a_good_file(), lease(ctx)) == (
        200,
        {"bytes": len(a_good_file())},
    )
    assert call(ctx.port, "POST", "/reload_weights", {}, lease(ctx))[0] == 200


def test_an_upload_cut_off_mid_body_leaves_no_partial_file_and_keeps_the_last_whole_one(ctx, monkeypatch):
    weights = ctx.workdir / "weights" / "model.safetensors"
    assert call(ctx.port, "PUT", "/weights", a_good_file(), lease(ctx))[0] == 200
    # The cut-off upload gets no answer, so the test learns from the engine when it is done with
    # it: polling the directory alone would race the server's thread (seen before it begins).
    done = threading.Event()
    upload = ctx.engine.upload_weights

    def upload_then_signal(*args: Any) -> dict[str, Any]:
        try:
            return upload(*args)
        finally:
            done.set()

    monkeypatch.setattr(ctx.engine, "upload_weights", upload_then_signal)
    big = safetensors_bytes({"w": {"dtype": "U8", "shape": [1 << 22], "data_offsets": [0, 1 << 22]}}, b"")
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=10) as s:
        s.sendall(
            head("PUT", "/weights", ctx, f"Content-Length: {len(big) + (1 << 22)}\r\n") + big + b"\1" * 65536
        )
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
    assert done.wait(TIMEOUT_S * 10)  # at the latest, the stalled read times out
    assert [p.name for p in weights.parent.iterdir()] == ["model.safetensors"]
    assert weights.read_bytes() == a_good_file()  # the whole upload before it is kept
    assert call(ctx.port, "POST", "/reload_weights", {}, lease(ctx))[0] == 200
    assert_still_serving(ctx)


def test_a_bad_client_does_not_fail_a_good_clients_requests(ctx):
    errors: list[Any] = []

    def bad() -> None:
        for body in [*NOT_AN_OBJECT[:6], json.dumps({**good_generate(), "top_p": 7}).encode()]:
            status, _ = call(ctx.port, "POST", "/generate", body, lease(ctx))
            if status != 400:
                errors.append(status)

    threads = [threading.Thread(target=bad) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(10):
        code, out = call(ctx.port, "POST", "/generate", good_generate(), lease(ctx))
        assert code == 200 and out["finish_reasons"] == ["stop", "stop"]
    for t in threads:
        t.join()
    assert errors == []
    assert_still_serving(ctx, generated_before=10)


# ---------------------------------------------------------------------------- the trainer's side
GOOD_REPLY = {
    "token_ids": [[7, 2], [3]],
    "logprobs": [[-0.5, -0.25], [-1.0]],
    "finish_reasons": ["stop", "length"],
}
BAD_REPLIES = [
    {},
    {**GOOD_REPLY, "token_ids": [[7, 2]]},  # a row short
    {**GOOD_REPLY, "logprobs": [[-0.5], [-1.0]]},  # fewer log-probs than tokens
    {**GOOD_REPLY, "token_ids": [[7, "2"], [3]]},
    {**GOOD_REPLY, "token_ids": [[7, -2], [3]]},
    {**GOOD_REPLY, "logprobs": [[-0.5, None], [-1.0]]},
    {**GOOD_REPLY, "finish_reasons": ["stop", None]},
    {**GOOD_REPLY, "token_ids": "7 2"},
]


@pytest.mark.parametrize("reply", BAD_REPLIES, ids=lambda r: str(r)[:30])
def test_the_trainer_refuses_a_malformed_generate_answer_with_an_engine_error(reply):
    from openaligner.rollout.engine import RolloutEngineError
    from openaligner.rollout.vllm_engine import check_generate_reply

    assert check_generate_reply(GOOD_REPLY, 2, "http://e") is GOOD_REPLY
    with pytest.raises(RolloutEngineError, match=r"http://e answered /generate with other than 2 rows"):
        check_generate_reply(reply, 2, "http://e")


@pytest.mark.parametrize("answer", [b"not json", b"[1, 2]", b"null", b"\xff"])
def test_the_trainer_refuses_an_answer_that_is_not_a_json_object_with_an_engine_error(answer):
    """Not a JSONDecodeError or TypeError: on rank 0 of a multi-rank run only RolloutEngineError
    reaches the other ranks (``_on_leader``); anything else leaves them waiting."""
    from http.server import BaseHTTPRequestHandler

    from openaligner.rollout.engine import RolloutEngineError
    from openaligner.rollout.vllm_link import EngineLink

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        link = EngineLink(f"http://127.0.0.1:{server.server_address[1]}", request_timeout_s=5.0)
        with pytest.raises(RolloutEngineError, match=r"answered /heartbeat with other than a JSON object"):
            link.post("/heartbeat", {})
    finally:
        server.shutdown()
        server.server_close()
