"""serve-tinker's service and HTTP front in-process, over raw HTTP (no SDK needed): the API key,
bounded and malformed bodies, deduplication by ``(model_id, seq_id)``, all-or-nothing calls,
sessions that touch only their own models, gradients that add up across calls, checkpoints.

Bodies are what the SDK sends: JSON for most routes, a ``ForwardBackwardRequest`` protobuf for
``forward_backward`` (built with the wire module's schema, which the wire tests check against
the SDK's own bytes).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from openaligner.algorithms.tinker_losses import tinker_loss
from openaligner.cli.serve_tinker import TinkerServerSettings, api_key
from openaligner.config import StartupError
from openaligner.servers.tinker import wire
from openaligner.servers.tinker.app import TinkerHTTP
from openaligner.servers.tinker.service import TinkerService
from openaligner.trainer.tinker_model import AdamStep, TinkerDatum, TinkerLora, TinkerModel

KEY = "unit-key"
VOCAB = 100


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    return tiny.save_causal_lm(directory, "llama", hidden_size=32, num_layers=1, num_heads=2)


@pytest.fixture(scope="module")
def front(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerHTTP]:
    service = TinkerService({"tiny/model": model_dir}, tmp_path_factory.mktemp("ckpt"), tinker_loss)
    http = TinkerHTTP(service, "127.0.0.1", 0, api_key=KEY, max_request_bytes=64 * 1024, poll_hold_s=5.0)
    http.start()
    try:
        yield http
    finally:
        http.stop()
        service.close()


def call(
    front: TinkerHTTP,
    method: str,
    route: str,
    body: Any = None,
    *,
    key: str | None = f"tml-{KEY}",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["X-API-Key"] = key
    conn.request(method, f"/api/v1/{route}", body=raw, headers=sent)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if "protobuf" in (resp.getheader("Content-Type") or ""):
        return resp.status, data
    return resp.status, json.loads(data) if data else None


def result(front: TinkerHTTP, future: dict) -> Any:
    """Poll retrieve_future until done (the server holds each poll)."""
    for _ in range(100):
        status, out = call(front, "POST", "retrieve_future", {"request_id": future["request_id"]})
        assert status == 200, out
        if isinstance(out, dict) and out.get("type") == "try_again":
            continue
        return out
    raise AssertionError("no result")


def session(front: TinkerHTTP) -> str:
    status, out = call(front, "POST", "create_session", {"tags": [], "sdk_version": "0.38.0"})
    assert status == 200
    return str(out["session_id"])


def create_model(front: TinkerHTTP, sid: str, seq: int = 0, **extra: Any) -> str:
    body = {
        "session_id": sid,
        "model_seq_id": seq,
        "base_model": "tiny/model",
        "lora_config": {"rank": 2, "seed": 0},
    }
    status, fut = call(front, "POST", "create_model", {**body, **extra})
    assert status == 200, fut
    out = result(front, fut)
    assert "model_id" in out, out
    return str(out["model_id"])


def fwdbwd_body(
    model_id: str, seq_id: int, tokens: list[int], *, loss: str = "cross_entropy", forward_only: bool = False
) -> bytes:
    msg: Any = wire._ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn=loss, forward_only=forward_only
    )
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    n = len(tokens) - 1
    for name, values, dtype, code in (
        ("target_tokens", tokens[1:], "<i8", wire.DTYPE_INT64),
        ("weights", [1.0] * n, "<f4", wire.DTYPE_FLOAT32),
    ):
        t = datum.loss_fn_inputs[name]
        t.dense = np.asarray(values, dtype).tobytes()
        t.dtype = code
        t.shape.append(n)
    return bytes(msg.SerializeToString())


def post_fwdbwd(front: TinkerHTTP, body: bytes) -> tuple[int, Any]:
    return call(front, "POST", "forward_backward", body, headers={"Content-Type": "application/x-protobuf"})


TOKENS = [10, 20, 30, 40, 50, 60]


# ---------------------------------------------------------------------------- the API key
def test_a_request_without_the_key_is_refused(front):
    status, out = call(front, "POST", "create_session", {}, key=None)
    assert status == 401 and "X-API-Key" in out["error"]
    status, _ = call(front, "POST", "create_session", {}, key="tml-wrong")
    assert status == 401
    assert call(front, "POST", "create_session", {}, key=KEY)[0] == 200  # the bare key works too


def test_listening_beyond_loopback_needs_a_key(monkeypatch):
    monkeypatch.delenv("OPENALIGNER_TOKEN", raising=False)
    with pytest.raises(StartupError, match=r"server\.token"):
        api_key(TinkerServerSettings(host="0.0.0.0"))
    assert api_key(TinkerServerSettings(host="127.0.0.1")) is None
    assert api_key(TinkerServerSettings(host="0.0.0.0", token="s3cret")) == "s3cret"
    monkeypatch.setenv("OPENALIGNER_TOKEN", "from-env")
    assert api_key(TinkerServerSettings(host="0.0.0.0")) == "from-env"


# ---------------------------------------------------------------------------- bad bodies
def test_bad_bodies_get_clear_errors_and_serving_goes_on(front):
    sid = session(front)
    mid = create_model(front, sid)
    status, out = post_fwdbwd(front, b"\xff\xff\xff not protobuf")
    assert status == 400 and "ForwardBackwardRequest" in out["error"]
    status, out = call(
        front,
        "POST",
        "forward_backward",
        b"x" * (64 * 1024 + 1),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert status == 413 and "max_request_bytes" in out["error"]
    status, out = call(
        front,
        "POST",
        "forward_backward",
        b"abc",
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert status == 415
    status, out = call(front, "POST", "get_info", b"{not json")
    assert status == 400 and "JSON" in out["error"]
    status, out = post_fwdbwd(front, fwdbwd_body("nobody:train:0", 1, TOKENS))
    assert status == 400 and "not loaded" in out["error"]
    status, out = post_fwdbwd(front, fwdbwd_body(mid, 1, [*TOKENS[:-1], VOCAB + 5]))
    assert status == 400 and "105 is not a token id" in out["error"]
    status, out = post_fwdbwd(front, fwdbwd_body(mid, 1, [VOCAB + 7, *TOKENS]))
    assert status == 400 and "107" in out["error"] and "vocabulary" in out["error"]
    status, out = post_fwdbwd(front, fwdbwd_body(mid, 1, TOKENS, loss="gspo"))
    assert status == 400 and "gspo" in out["error"] and "cross_entropy" in out["error"]
    status, out = call(front, "POST", "retrieve_future", {"request_id": "no-such-request"})
    assert status == 404
    status, out = call(front, "GET", "no/such/route")
    assert status == 404
    # after every refusal the model trains as before
    status, fut = post_fwdbwd(front, fwdbwd_body(mid, 1, TOKENS))
    assert status == 200
    assert "loss:sum" in wire_metrics(result(front, fut))


def wire_metrics(body: bytes) -> dict[str, float]:
    msg: Any = wire._ForwardBackwardOutput()
    msg.ParseFromString(body)
    return dict(msg.metrics)


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(front):
    """No Content-Length (chunked): the front counts what arrives and refuses past the limit (the
    one bounded reader the Triton servers' front uses too), then serves on."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    chunks = iter([b"x" * 40_000, b"x" * 40_000])
    headers = {"Content-Type": "application/x-protobuf", "X-API-Key": f"tml-{KEY}"}
    conn.request("POST", "/api/v1/forward_backward", body=chunks, headers=headers, encode_chunked=True)
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and "server.max_request_bytes" in out["error"], out
    assert f"more than {64 * 1024} bytes" in out["error"]
    assert call(front, "POST", "create_session", {})[0] == 200


def test_unknown_base_model_is_refused_naming_what_is_served(front):
    sid = session(front)
    status, out = call(
        front, "POST", "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "Qwen/Qwen3-8B"}
    )
    assert status == 400 and "Qwen/Qwen3-8B" in out["error"] and "tiny/model" in out["error"]


def test_a_client_vanishing_mid_upload_leaves_nothing_behind(front):
    sid = session(front)
    mid = create_model(front, sid)
    model = front.service.model(mid)
    body = fwdbwd_body(mid, 1, TOKENS)
    with socket.create_connection(("127.0.0.1", front.port)) as sock:
        head = (
            f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n"
            f"Content-Type: application/x-protobuf\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[: len(body) // 2])
    time.sleep(0.5)  # the server notices the closed connection; nothing was queued
    assert model.trainer.pending_datums == 0
    assert all(p.grad is None for p in model.trainer.params.values())
    status, fut = post_fwdbwd(front, body)  # the same request, whole: served normally
    assert status == 200
    result(front, fut)
    assert model.trainer.pending_datums == 1


# ---------------------------------------------------------------------------- semantics
def test_a_retried_request_is_applied_once_and_a_reused_seq_id_is_refused(front):
    sid = session(front)
    mid = create_model(front, sid)
    body = fwdbwd_body(mid, 1, TOKENS)
    first = post_fwdbwd(front, body)[1]
    second = post_fwdbwd(front, body)[1]
    assert first["request_id"] == second["request_id"]
    result(front, first)
    assert front.service.model(mid).trainer.pending_datums == 1
    status, out = post_fwdbwd(front, fwdbwd_body(mid, 1, TOKENS[::-1]))
    assert status == 400 and "seq_id" in out["error"]


def test_a_retried_sampler_save_with_the_sdks_next_sampling_session_seq_id_is_the_same_request(front):
    """SDK 0.38 draws a new ``sampling_session_seq_id`` each time it retries a
    ``save_weights_for_sampler`` under the same ``seq_id`` (training_client.py, ``_send_request``),
    e.g. after a timeout on a loaded machine; the retry is the same request, not a reuse."""
    sid = session(front)
    mid = create_model(front, sid)
    body = {"model_id": mid, "seq_id": 1, "sampling_session_seq_id": 0, "kind": "snapshot"}
    status, first = call(front, "POST", "save_weights_for_sampler", body)
    assert status == 200
    status, retry = call(front, "POST", "save_weights_for_sampler", {**body, "sampling_session_seq_id": 1})
    assert status == 200, retry
    assert retry["request_id"] == first["request_id"]
    assert result(front, first)["sampling_session_id"] == result(front, retry)["sampling_session_id"]
    # another body under that seq_id is still refused
    status, out = call(front, "POST", "save_weights_for_sampler", {**body, "kind": "inflight"})
    assert status == 400 and "seq_id" in out["error"]


def test_a_session_touches_only_its_own_models(front):
    a, b = session(front), session(front)
    mid_a, mid_b = create_model(front, a), create_model(front, b)
    assert mid_a.startswith(a) and mid_b.startswith(b)
    status, out = call(front, "POST", f"sessions/{a}/finish", {"reason": {"type": "success"}, "detail": None})
    assert status == 200
    status, out = call(front, "POST", "get_info", {"model_id": mid_b})
    assert status == 200 and out["model_id"] == mid_b
    time.sleep(0.2)  # the drop is queued behind the jobs before it
    status, fut = post_fwdbwd(front, fwdbwd_body(mid_a, 1, TOKENS))
    assert status == 400 and "not loaded" in fut["error"]
    status, fut = post_fwdbwd(front, fwdbwd_body(mid_b, 1, TOKENS))
    assert status == 200
    result(front, fut)


def test_a_failing_job_answers_retrieve_future_with_error_and_category(front):
    sid = session(front)
    mid = create_model(front, sid)
    _, fut = call(front, "POST", "save_weights", {"model_id": mid, "path": "twice", "seq_id": 1})
    result(front, fut)
    _, fut = call(front, "POST", "save_weights", {"model_id": mid, "path": "twice", "seq_id": 2})
    out = result(front, fut)
    assert out["category"] == "user" and "twice" in out["error"]


# ---------------------------------------------------------------------------- the trained model
def datum(tokens: list[int]) -> TinkerDatum:
    n = len(tokens) - 1
    return TinkerDatum(
        torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(n)}
    )


def fresh(model_dir: Path) -> TinkerModel:
    from transformers import AutoModelForCausalLM

    return TinkerModel(AutoModelForCausalLM.from_pretrained(str(model_dir)), TinkerLora(rank=2, seed=0))


def test_gradients_add_up_across_calls_and_a_failed_call_is_taken_back(model_dir):
    ce = tinker_loss("cross_entropy")
    one, two = datum(TOKENS), datum([5, 6, 7, 8])
    split = fresh(model_dir)
    split.forward_backward([one], ce, {}, forward_only=False)
    bad = TinkerDatum(two.tokens, {"target_tokens": two.inputs["target_tokens"]})  # no weights: KeyError
    with pytest.raises(KeyError):
        split.forward_backward([two, bad], ce, {}, forward_only=False)
    split.forward_backward([two], ce, {}, forward_only=False)
    whole = fresh(model_dir)
    whole.forward_backward([one, two], ce, {}, forward_only=False)
    for name, p in split.params.items():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, whole.params[name].grad)
    assert split.pending_datums == whole.pending_datums == 2


def test_save_and_load_restore_adapters_and_adam(model_dir, tmp_path):
    ce = tinker_loss("cross_entropy")
    a = fresh(model_dir)
    for _ in range(2):
        a.forward_backward([datum(TOKENS)], ce, {}, forward_only=False)
        a.optim_step(AdamStep(learning_rate=1e-2))
    a.save(tmp_path / "ck", optimizer=True)
    b = fresh(model_dir)
    b.load(tmp_path / "ck", optimizer=True)
    for model in (a, b):
        model.forward_backward([datum(TOKENS)], ce, {}, forward_only=False)
        model.optim_step(AdamStep(learning_rate=1e-2))
    for name, p in a.params.items():
        torch.testing.assert_close(p, b.params[name])
    c = fresh(model_dir)
    c.load(tmp_path / "ck", optimizer=False)  # weights only: a fresh AdamW
    assert not c.optimizer.state


def test_a_load_that_fails_after_writing_the_weights_still_changes_the_version(
    model_dir, tmp_path, monkeypatch
):
    """Samplers' merged copies name weights by version: a load whose optimizer state fails after
    the adapters were copied in has changed the weights, so it must change the version too (else a
    copy keeps sampling the old weights while the log-probs come from the new)."""
    ce = tinker_loss("cross_entropy")
    a = fresh(model_dir)
    a.forward_backward([datum(TOKENS)], ce, {}, forward_only=False)
    a.optim_step(AdamStep(learning_rate=1e-2))
    a.save(tmp_path / "ck", optimizer=True)
    b = fresh(model_dir)
    before = b.version

    def broken(_state: Any) -> None:
        raise ValueError("a broken optimizer state")

    monkeypatch.setattr(b.optimizer, "load_state_dict", broken)
    with pytest.raises(ValueError, match="broken"):
        b.load(tmp_path / "ck", optimizer=True)
    assert any(not torch.equal(p, a.params[n]) for n, p in fresh(model_dir).params.items())
    assert all(torch.equal(p, a.params[n]) for n, p in b.params.items())  # the weights did change
    assert b.version > before


# ---------------------------------------------------------------------------- sampling settings
def test_sampling_params_as_the_sdk_writes_them():
    from openaligner.servers.tinker.sampling import TinkerSampling

    def parse(**p: Any) -> TinkerSampling:
        return TinkerSampling.parse(p, default_max_tokens=16, vocab_size=VOCAB)

    default = parse()
    assert (default.max_tokens, default.top_k, default.stop_token_ids, default.stop_strings) == (
        16,
        0,
        None,
        (),
    )
    assert parse(stop="\n\nUser:").stop_strings == ("\n\nUser:",)
    assert parse(stop=["a", "b"]).stop_token_ids is None  # strings, and the EOS still stops
    assert parse(stop=[]).stop_token_ids == ()  # nothing stops
    assert parse(stop=[7, 9]).stop_token_ids == (7, 9)
    for bad, word in (
        ({"stop": [VOCAB]}, "vocabulary"),
        ({"stop": ["a", 3]}, "all strings"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
    ):
        with pytest.raises(ValueError, match=word):
            parse(**bad)


# ---------------------------------------------------------------------------- the critic
def test_the_critic_trains_the_clipped_value_loss_summed_over_tokens(model_dir, tmp_path):
    from openaligner.models.critic import CriticModel
    from openaligner.trainer.tinker_model import TinkerCritic

    def critic() -> TinkerCritic:
        hf = CriticModel.from_pretrained(model_dir).hf_model
        return TinkerCritic(hf, TinkerLora(rank=2, seed=0))

    c = critic()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        v = c.values(tokens)
    old = v + torch.tensor([0.5, -0.5, 0.0, 0.1, 0.0, 0.3])  # two positions beyond the clip (0.2)
    returns = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 0.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    d = TinkerDatum(tokens, {"values": old, "returns": returns, "mask": mask})
    clip = c.check_critic_inputs([d], "ppo", {"value_clip": 0.2})
    outputs, metrics = c.critic_forward_backward([d], clip, forward_only=False)
    clipped = old + (v - old).clamp(-0.2, 0.2)
    expected = 0.5 * (torch.maximum((clipped - returns) ** 2, (v - returns) ** 2) * mask).sum()
    assert metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(outputs[0]["values"], v)
    assert c.pending_datums == 1
    with pytest.raises(ValueError, match="returns"):
        c.check_critic_inputs([TinkerDatum(tokens, {"values": old, "mask": mask})], "ppo", {})
    with pytest.raises(ValueError, match="ppo"):
        c.check_critic_inputs([d], "cross_entropy", {})
    c.optim_step(AdamStep(learning_rate=1e-2))
    c.save(tmp_path / "critic", optimizer=True)
    again = critic()
    again.load(tmp_path / "critic", optimizer=True)
    with torch.no_grad():
        torch.testing.assert_close(again.values(tokens), c.values(tokens))


# ---------------------------------------------------------------------------- samplers
def sample_prompt_logprobs(front: TinkerHTTP, sampler_id: str) -> tuple[int, Any]:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "sampling_params": {"max_tokens": 1, "seed": 0},
        "prompt_logprobs": True,
    }
    status, fut = call(front, "POST", "asample", body)
    assert status == 200 and len(fut["sample_sequence_ids"]) == 1, fut
    out = result(front, fut)
    if isinstance(out, dict):
        return 400, out
    msg: Any = wire._SampleResponse()
    msg.ParseFromString(out)
    return 200, np.frombuffer(msg.prompt_logprobs, "<f4")[1:].tolist()


def test_a_snapshot_sampler_keeps_its_weights_and_old_ones_expire(front):
    sid = session(front)
    mid = create_model(front, sid)
    kept = front.service.max_sampler_snapshots
    front.service.max_sampler_snapshots = 2
    try:

        def snapshot_sampler(seq: int) -> str:
            body = {"model_id": mid, "seq_id": seq, "sampling_session_seq_id": seq, "kind": "snapshot"}
            status, fut = call(front, "POST", "save_weights_for_sampler", body)
            assert status == 200, fut
            return str(result(front, fut)["sampling_session_id"])

        def train(seq: int) -> None:
            result(front, post_fwdbwd(front, fwdbwd_body(mid, seq, TOKENS))[1])
            _, fut = call(
                front,
                "POST",
                "optim_step",
                {"model_id": mid, "seq_id": seq + 1, "adam_params": {"learning_rate": 0.05}},
            )
            result(front, fut)

        first = snapshot_sampler(1)
        status, before = sample_prompt_logprobs(front, first)
        train(2)
        second = snapshot_sampler(4)
        assert sample_prompt_logprobs(front, first) == (200, before)  # still the weights it was made with
        status, after = sample_prompt_logprobs(front, second)
        assert status == 200 and after != pytest.approx(before, abs=1e-6)  # the trained ones
        train(5)
        snapshot_sampler(7)  # a third version: the first one's snapshot is forgotten
        status, out = sample_prompt_logprobs(front, first)
        assert status == 400 and out["category"] == "user" and "max_sampler_snapshots" in out["error"]
        assert sample_prompt_logprobs(front, second) == (200, after)
    finally:
        front.service.max_sampler_snapshots = kept


def test_batched_logprobs_equal_one_datum_at_a_time(model_dir, monkeypatch):
    """The padded forward over several datums against a plain log_softmax + gather per datum,
    also when the logits budget splits the datums into several forwards."""
    from openaligner.trainer import tinker_model

    model = fresh(model_dir)
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    datums = [datum(r) for r in rows]
    reference = []
    with torch.no_grad():
        for d in datums:
            logits = model.model(input_ids=d.tokens[None]).logits[0]
            reference.append(
                torch.log_softmax(logits, -1).gather(-1, d.inputs["target_tokens"][:, None])[:, 0]
            )
    ce = tinker_loss("cross_entropy")
    for budget in (tinker_model.LOGITS_BUDGET, 4 * VOCAB):  # one forward; then one or two rows each
        monkeypatch.setattr(tinker_model, "LOGITS_BUDGET", budget)
        outputs, _ = model.forward_backward(datums, ce, {}, forward_only=True)
        for out, ref in zip(outputs, reference, strict=True):
            torch.testing.assert_close(out["logprobs"], ref, atol=1e-5, rtol=1e-5)
    assert len(model.micro_batches(datums)) > 1


def test_a_save_cut_short_leaves_no_checkpoint(model_dir, tmp_path, monkeypatch):
    from openaligner.trainer import tinker_model

    model = fresh(model_dir)

    def crash(src: object, dst: object) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(tinker_model.os, "replace", crash)
    with pytest.raises(OSError):
        model.save(tmp_path / "ck", optimizer=True, extra={"base_model": "tiny/model"})
    assert not (tmp_path / "ck").exists()  # only the hidden .tmp-<pid> directory beside it
    monkeypatch.undo()
    model.save(tmp_path / "ck", optimizer=True, extra={"base_model": "tiny/model"})
    assert tinker_model.read_checkpoint_meta(tmp_path / "ck")["base_model"] == "tiny/model"


def test_topk_cross_entropy_targets_train_end_to_end_over_http(front, model_dir):
    """cross_entropy's top-K form as the SDK sends it (target_tokens int64 [N, K], weights
    float32 [N, K]): answered with logprobs [N, K] equal to a plain log_softmax + gather, the
    loss the weighted sum of their negatives, and gradients that an optim_step applies."""
    sid = session(front)
    mid = create_model(front, sid)
    inputs, k = TOKENS[:-1], 3
    n = len(inputs)
    targets = [[(t + j) % VOCAB for j in range(k)] for t in TOKENS[1:]]
    weights = [[1.0, 0.5, 0.25]] * n
    msg: Any = wire._ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(inputs, "<i4").tobytes()
    for name, values, dtype, code in (
        ("target_tokens", targets, "<i8", wire.DTYPE_INT64),
        ("weights", weights, "<f4", wire.DTYPE_FLOAT32),
    ):
        t = datum.loss_fn_inputs[name]
        t.dense = np.asarray(values, dtype).tobytes()
        t.dtype = code
        t.shape.extend([n, k])
    status, fut = post_fwdbwd(front, bytes(msg.SerializeToString()))
    assert status == 200, fut
    body = result(front, fut)
    assert isinstance(body, bytes), body
    out: Any = wire._ForwardBackwardOutput()
    out.ParseFromString(body)
    field = out.loss_fn_outputs[0].fields["logprobs"]
    assert list(field.trailing_shape) == [k]
    got = torch.from_numpy(np.frombuffer(field.data, "<f4").reshape(n, k).copy())
    with torch.no_grad():
        logits = fresh(model_dir).model(input_ids=torch.tensor([inputs])).logits[0]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(targets))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # LoRA B starts at zero
    expected_loss = float(-(want * torch.tensor(weights)).sum())
    assert dict(out.metrics)["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    status, fut = call(
        front, "POST", "optim_step", {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}}
    )
    assert status == 200, fut
    assert "error" not in result(front, fut)


def test_a_prompt_and_max_tokens_over_the_models_positions_is_the_clients_error(front):
    """The tiny model has 256 positions: 6 prompt tokens + max_tokens 251 do not fit. The client
    is told so at asample (a 400 naming both numbers), not with a server failure from the
    engine later; a request that fits samples on."""
    sid = session(front)
    status, out = call(
        front,
        "POST",
        "create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny/model"},
    )
    assert status == 200, out
    body = {
        "sampling_session_id": out["sampling_session_id"],
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "sampling_params": {"max_tokens": 251, "seed": 0},
    }
    status, out = call(front, "POST", "asample", body)
    assert status == 400, out
    assert "6 prompt tokens" in out["error"] and "max_tokens 251" in out["error"] and "256" in out["error"]
    status, fut = call(front, "POST", "asample", {**body, "sampling_params": {"max_tokens": 250, "seed": 0}})
    assert status == 200, fut
    assert isinstance(result(front, fut), bytes)
