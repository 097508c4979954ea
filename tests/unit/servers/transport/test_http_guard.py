"""The HTTP front: the proxy in front of a stand-in upstream server — canonical forwarding, the
model's own check, compression only when asked, failures without tracebacks, refusals."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from openaligner.servers.transport.http_guard import HTTPGuard, without_traceback
from openaligner.servers.transport.kserve import HEADER_LENGTH, parse_infer_request
from openaligner.servers.validation import RequestError, UnauthorizedError


def body(*inputs, **top):
    return json.dumps({"inputs": list(inputs), **top}).encode()


def tensor(name="tokens", datatype="INT64", shape=(1, 3), data=(5, 6, 7), **extra):
    item = {"name": name, "datatype": datatype, "shape": list(shape), **extra}
    if data is not None:
        item["data"] = list(data)
    return item


PYTRITON_FAILURE = (
    "Failed to process the request(s) for model 'm_0_0', message: TritonModelException: Model execute "
    'error: Traceback (most recent call last):\n  File "/tmp/folderX/1/model.py", line 492, in execute\n'
    "    raise triton_responses_or_error\nc_python_backend_utils.TritonModelException: Traceback (most "
    'recent call last):\n  File "/srv/openaligner/servers/triton.py", line 175, in __call__\n    '
    "return self._serve(requests)\n           ^^^^^^^^^^^\ntorch.OutOfMemoryError: CUDA out of memory\n"
    "<<openaligner-error {} openaligner-error>>\n\n\n\nAt:\n  /tmp/folderX/1/model.py(492): execute\n"
)


def test_tracebacks_are_cut_from_server_failures():
    text = without_traceback(PYTRITON_FAILURE)
    assert text == "OutOfMemoryError: CUDA out of memory\n<<openaligner-error {} openaligner-error>>"
    assert without_traceback("plain message") == "plain message"


# ---------------------------------------------------------------------------- the proxy
class Upstream(BaseHTTPRequestHandler):
    """Answers every request with what it received (method, path, headers, body); answers
    ``/v2/models/failing/infer`` with a PyTriton failure instead."""

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        received = self.rfile.read(n)
        if self.path == "/v2/models/failing/infer":
            status, payload = 500, json.dumps({"error": PYTRITON_FAILURE}).encode()
        else:
            status, payload = (
                200,
                json.dumps(
                    {
                        "method": self.command,
                        "path": self.path,
                        "header_length": self.headers.get(HEADER_LENGTH),
                        "accept_encoding": self.headers.get("Accept-Encoding"),
                        "body": received.hex(),
                    }
                ).encode(),
            )
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header(HEADER_LENGTH, "7")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_m(inputs, parameters):
    """The stand-in model's check: a token parameter, then no zero in ``tokens``."""
    if parameters.get("token") != "s3cret":
        raise UnauthorizedError("wrong token")
    if (inputs["tokens"] == 0).any():
        raise RequestError("input 'tokens' holds a 0")


@pytest.fixture(scope="module")
def guarded():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    guard = HTTPGuard(
        "127.0.0.1", free_port(), upstream.server_address[1], max_request_bytes=4096, checks={"m": check_m}
    )
    guard.start()
    yield guard
    guard.stop()
    upstream.shutdown()
    upstream.server_close()


def request(guard, method, path, payload=None, headers=None):
    conn = http.client.HTTPConnection(guard.host, guard.port, timeout=10)
    try:
        conn.request(method, path, body=payload, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_proxy_forwards_reads_unchanged_and_inference_in_canonical_form(guarded):
    status, _, answer = request(guarded, "GET", "/v2/health/ready")
    assert status == 200 and json.loads(answer)["path"] == "/v2/health/ready"
    sent = body(tensor(data=[[5, 6, 7]]), parameters={"token": "s3cret"})
    status, headers, answer = request(guarded, "POST", "/v2/models/m/versions/1/infer", sent)
    seen = json.loads(answer)
    assert status == 200 and seen["path"] == "/v2/models/m/versions/1/infer"
    forwarded = parse_infer_request(bytes.fromhex(seen["body"]), seen["header_length"])
    np.testing.assert_array_equal(forwarded.arrays()["tokens"], [[5, 6, 7]])
    assert forwarded.parameters == {"token": "s3cret"}
    assert b'"data"' not in bytes.fromhex(seen["body"])  # values travel in binary, as the front read them
    assert headers[HEADER_LENGTH] == "7"  # the upstream's own headers come back


def test_proxy_asks_for_compression_only_when_the_client_did(guarded):
    for sent, expected in (
        (None, "identity"),
        ("gzip", "gzip"),
        ("br;q=1, gzip;q=0.5", "br;q=1, gzip;q=0.5"),
    ):
        headers = {"Accept-Encoding": sent} if sent is not None else {}
        for method, path, payload in (
            ("GET", "/v2/models/m", None),
            ("POST", "/v2/models/m/infer", body(tensor(), parameters={"token": "s3cret"})),
        ):
            conn = http.client.HTTPConnection(guarded.host, guarded.port, timeout=10)
            conn.putrequest(method, path, skip_accept_encoding=True)  # http.client adds "identity"
            for key, value in {**headers, "Content-Length": str(len(payload or b""))}.items():
                conn.putheader(key, value)
            conn.endheaders(payload)
            seen = json.loads(conn.getresponse().read())
            conn.close()
            assert seen["accept_encoding"] == expected, (method, sent, seen)


def test_proxy_runs_the_models_own_check_before_forwarding(guarded):
    status, _, answer = request(guarded, "POST", "/v2/models/m/infer", body(tensor(data=[5, 0, 7])))
    assert status == 403 and json.loads(answer)["error"] == "m: wrong token"
    sent = body(tensor(data=[5, 0, 7]), parameters={"token": "s3cret"})
    status, _, answer = request(guarded, "POST", "/v2/models/m/infer", sent)
    assert status == 400 and json.loads(answer)["error"] == "m: input 'tokens' holds a 0"
    # another model has no check of its own: parsed, then forwarded
    status, _, answer = request(guarded, "POST", "/v2/models/other/infer", body(tensor(data=[5, 0, 7])))
    assert status == 200 and json.loads(answer)["path"] == "/v2/models/other/infer"


def test_proxy_answers_server_failures_without_tracebacks(guarded):
    status, _, answer = request(guarded, "POST", "/v2/models/failing/infer", body(tensor()))
    error = json.loads(answer)["error"]
    assert status == 500 and error.startswith("OutOfMemoryError: CUDA out of memory")
    assert "Traceback" not in error and "/srv/" not in error and "model.py" not in error


def test_proxy_refuses_bad_bodies_other_routes_compression_and_size(guarded):
    refused = guarded.refused
    status, _, answer = request(guarded, "POST", "/v2/models/m/infer", body(tensor(shape=(1, 10**12))))
    assert status == 400 and "m: input 'tokens': shape [1, 1000000000000]" in json.loads(answer)["error"]
    status, _, answer = request(guarded, "POST", "/v2/repository/models/m/unload", b"{}")
    assert status == 405 and "is not served here" in json.loads(answer)["error"]
    status, _, answer = request(guarded, "DELETE", "/v2/models/m/infer")
    assert status == 405
    status, _, answer = request(guarded, "POST", "/v2/models/m/infer", b"x", {"Content-Encoding": "gzip"})
    assert status == 415 and "Content-Encoding: gzip" in json.loads(answer)["error"]
    status, _, answer = request(guarded, "POST", "/v2/models/m/infer", b" " * 5000)
    assert status == 413 and "over this server's limit of 4096 bytes" in json.loads(answer)["error"]
    assert guarded.refused == refused + 5
    assert request(guarded, "GET", "/v2")[0] == 200  # and it goes on serving


def test_proxy_says_when_the_upstream_is_gone():
    guard = HTTPGuard("127.0.0.1", free_port(), free_port())
    guard.start()
    try:
        status, _, answer = request(guard, "GET", "/v2/health/ready")
        assert status == 503 and "does not answer" in json.loads(answer)["error"]
        assert guard.is_alive()
    finally:
        guard.stop()
    assert not guard.is_alive()


def test_a_taken_port_is_reported_at_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        guard = HTTPGuard("127.0.0.1", taken.getsockname()[1], free_port())
        with pytest.raises(OSError):
            guard.start()


# ---------------------------------------------------------------------------- foreign wire formats
class Scored:
    """A foreign route's translation: one ``sentences`` row; the answer is ``{"score": reward}``."""

    def __init__(self, text):
        self.inputs = {"sentences": np.array([[text.encode()]], dtype=object)}

    def answer(self, outputs, checked):
        return {"score": float(outputs["rewards"].reshape(-1)[0]), "checked": checked}

    def explain(self, message):
        return message.replace("input 'sentences'", "the body")


class ScoreRoute:
    """A stand-in wire format on ``/score``: the body is the text to score."""

    paths = ("/score",)
    model = "m"
    title = "score"

    def translate(self, raw):
        if raw == b"unreadable":
            raise RequestError("the body must be text")
        return Scored(raw.decode())

    def error(self, status, message):
        return {"problem": message, "status": status}


def envelope(kind, rid, why="the function raised"):
    from openaligner.protocol import ErrorEnvelope

    invalid = {rid: why} if kind == "bad_request" else {"other": why}
    valid = (rid,) if kind == "rejected_batch" else ()
    return ErrorEnvelope(kind, f"m: {why}", invalid, valid).render()


class ScoringUpstream(BaseHTTPRequestHandler):
    """Triton stand-in for the foreign route: answers by the text of the request's one row."""

    seen: list = []  # noqa: RUF012 — shared across requests on purpose

    def do_POST(self):
        from openaligner.protocol import REQUEST_ID_PARAMETER

        received = self.rfile.read(int(self.headers["Content-Length"]))
        parsed = parse_infer_request(received, self.headers.get(HEADER_LENGTH))
        text = parsed.arrays()["sentences"][0, 0].decode()
        rid = parsed.parameters[REQUEST_ID_PARAMETER]
        self.seen.append((text, rid))
        tries = sum(1 for t, r in self.seen if r == rid)
        rewards = {"outputs": [{"name": "rewards", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}
        status, doc = 200, rewards
        if text == "merged" and tries <= 2:  # rejected twice alongside a failing request, then served
            status, doc = (
                500,
                {
                    "error": PYTRITON_FAILURE.replace(
                        "<<openaligner-error {} openaligner-error>>", envelope("rejected_batch", rid)
                    )
                },
            )
        elif text == "fails":
            status, doc = 500, {"error": envelope("bad_request", rid)}
        elif text == "odd":
            status, doc = 500, {"error": envelope("bad_request", rid, "input 'sentences': row 0 is odd")}
        elif text == "crash":
            status, doc = 500, {"error": PYTRITON_FAILURE}
        payload = json.dumps(doc).encode()
        if text == "nan":
            payload = payload.replace(b"1.5", b"NaN")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def check_sentences(inputs, parameters):
    if inputs["sentences"][0, 0] == b"refuse":
        raise RequestError("input 'sentences' says refuse")
    return "checked"


@pytest.fixture(scope="module")
def foreign():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), ScoringUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    guard = HTTPGuard(
        "127.0.0.1",
        free_port(),
        upstream.server_address[1],
        max_request_bytes=4096,
        checks={"m": check_sentences},
        routes=[ScoreRoute()],
    )
    guard.start()
    yield guard
    guard.stop()
    upstream.shutdown()
    upstream.server_close()


def test_a_foreign_format_is_checked_sent_as_kserve_and_answered_in_its_own_shape(foreign):
    status, headers, answer = request(foreign, "POST", "/score", b"hello")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(answer) == {"score": 1.5, "checked": "checked"}  # what the model's check returned
    text, rid = ScoringUpstream.seen[-1]
    assert text == "hello" and rid.startswith("score-")


def test_a_foreign_request_rejected_only_for_a_merged_failing_one_is_resent(foreign):
    resent = foreign.resent
    status, _, answer = request(foreign, "POST", "/score", b"merged")
    assert status == 200 and json.loads(answer)["score"] == 1.5
    assert foreign.resent == resent + 2


@pytest.mark.parametrize(
    ("method", "payload", "headers", "status", "needle"),
    [
        ("POST", b"unreadable", {}, 400, "m: the body must be text"),
        ("POST", b"refuse", {}, 400, "m: the body says refuse"),  # in the client's terms
        ("POST", b"fails", {}, 400, "m: the function raised"),
        ("POST", b"odd", {}, 400, "m: the body: row 0 is odd"),
        ("POST", b"crash", {}, 500, "OutOfMemoryError: CUDA out of memory"),
        ("POST", b"nan", {}, 500, "the server could not write its answer"),
        ("GET", None, {}, 405, "GET /score is not served; send POST"),
        ("POST", b"x", {"Content-Encoding": "gzip"}, 415, "Content-Encoding: gzip"),
        ("POST", b" " * 5000, {}, 413, "over this server's limit of 4096 bytes"),
    ],
)
def test_foreign_refusals_and_failures_come_in_the_formats_error_shape(
    foreign, method, payload, headers, status, needle
):
    got, _, answer = request(foreign, method, "/score", payload, headers)
    doc = json.loads(answer)
    assert got == status and doc["status"] == status and needle in doc["problem"], doc
    assert "Traceback" not in doc["problem"] and "model.py" not in doc["problem"]
    assert request(foreign, "POST", "/score", b"hello")[0] == 200  # and it serves on


def test_the_405_for_unknown_routes_lists_the_foreign_ones(foreign):
    status, _, answer = request(foreign, "POST", "/nowhere", b"{}")
    assert status == 405 and "POST on /score (score)" in json.loads(answer)["error"]


# ---------------------------------------------------------------------------- admissions
def admit_tokens(checked):
    """A stand-in admission (e.g. a reward function's call): first token 9 fails, 8 takes 1 s,
    others pass at once; resolves to a parameter naming the first token."""
    first = int(checked["tokens"][0, 0])
    future = Future()
    if first == 9:
        future.set_exception(RequestError("the function raised ValueError: no 9s"))
    elif first == 8:
        threading.Timer(1.0, future.set_result, [{"ticket": "t8"}]).start()
    else:
        future.set_result({"ticket": f"t{first}"})
    return future


@pytest.fixture(scope="module")
def admitting():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    guard = HTTPGuard(
        "127.0.0.1",
        free_port(),
        upstream.server_address[1],
        checks={"m": lambda inputs, parameters: inputs},
        admissions={"m": admit_tokens},
    )
    guard.start()
    yield guard
    guard.stop()
    upstream.shutdown()
    upstream.server_close()


def test_an_admission_runs_before_forwarding_and_its_parameters_go_with_the_request(admitting):
    status, _, answer = request(admitting, "POST", "/v2/models/m/infer", body(tensor(data=(5, 6, 7))))
    assert status == 200
    forwarded = json.loads(answer)
    raw = bytes.fromhex(forwarded["body"])
    parsed = parse_infer_request(raw, forwarded["header_length"])
    assert parsed.parameters == {"ticket": "t5"}


def test_a_failing_admission_refuses_its_request_alone_and_a_slow_one_holds_only_its_own(admitting):
    status, _, answer = request(admitting, "POST", "/v2/models/m/infer", body(tensor(data=(9, 6, 7))))
    assert status == 400 and json.loads(answer)["error"] == "m: the function raised ValueError: no 9s"
    slow: dict[str, float] = {}

    def ask_slow():
        t0 = time.perf_counter()
        request(admitting, "POST", "/v2/models/m/infer", body(tensor(data=(8, 6, 7))))
        slow["s"] = time.perf_counter() - t0

    threads = [threading.Thread(target=ask_slow) for _ in range(6)]  # more than the front's threads
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    status, _, _ = request(admitting, "POST", "/v2/models/m/infer", body(tensor(data=(5, 6, 7))))
    assert status == 200 and time.perf_counter() - t0 < 0.5
    for t in threads:
        t.join(10)
    assert slow["s"] >= 0.9
