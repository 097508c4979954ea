"""The HTTP front: request checks on bytes, and the proxy in front of a stand-in upstream server."""

import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from openaligner.servers.http_guard import HEADER_LENGTH, HTTPGuard, check_infer_request
from openaligner.servers.validation import RequestError


def body(*inputs, **top):
    return json.dumps({"inputs": list(inputs), **top}).encode()


def tensor(name="tokens", datatype="INT64", shape=(1, 3), data=(5, 6, 7), **extra):
    item = {"name": name, "datatype": datatype, "shape": list(shape), **extra}
    if data is not None:
        item["data"] = list(data)
    return item


def binary(arrays, datatypes, *, sizes=None):
    """A binary-extension body: the JSON header, then each array's bytes; and the header length."""
    inputs, blobs = [], b""
    for name, array in arrays.items():
        raw = array.tobytes()
        size = (sizes or {}).get(name, len(raw))
        shape = list(array.shape)
        inputs.append(
            {
                "name": name,
                "datatype": datatypes[name],
                "shape": shape,
                "parameters": {"binary_data_size": size},
            }
        )
        blobs += raw
    header = json.dumps({"inputs": inputs}).encode()
    return header + blobs, str(len(header))


def test_valid_json_and_binary_requests_pass():
    check_infer_request(body(tensor(), tensor("sequence_lengths", shape=(1, 1), data=[3])), None)
    check_infer_request(body(tensor(data=[[5, 6, 7]])), None)  # nested data, row-major
    check_infer_request(body(tensor("sentences", "BYTES", (1, 1), ["hi"])), None)
    check_infer_request(body(tensor("returns", "FP32", (1, 2), [0.5, float("nan")])), None)
    payload, n = binary({"tokens": np.ones((2, 3), np.int64)}, {"tokens": "INT64"})
    check_infer_request(payload, n)


@pytest.mark.parametrize(
    ("payload", "header", "needle"),
    [
        (b"", None, "request body is empty"),
        (b"\x00\xff", None, "not UTF-8 JSON (byte 0xff at offset 1)"),
        (b"{not json", None, "request body is not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object with 'inputs', got a list"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nests JSON too deeply"),
        (body(), None, "'inputs' must be a non-empty list"),
        (json.dumps({"inputs": [7]}).encode(), None, "inputs[0] must be an object"),
        (body({"datatype": "INT64", "shape": [1], "data": [1]}), None, "inputs[0] has no 'name'"),
        (body(tensor(datatype="INT128")), None, "input 'tokens': 'datatype' must be one of"),
        (
            body(tensor(shape=(-1, 3))),
            None,
            "input 'tokens': 'shape' must be a list of non-negative integers",
        ),
        (body(tensor(shape="13")), None, "input 'tokens': 'shape' must be a list"),
        (body(tensor(shape=(1, 0), data=[])), None, "input 'tokens' has shape [1, 0]: empty tensors"),
        (body(tensor(), tensor()), None, "input(s) ['tokens'] appear more than once"),
        (body(tensor(data=None)), None, "input 'tokens' carries no values"),
        (
            body(tensor(shape=(1, 2))),
            None,
            "input 'tokens': shape [1, 2] needs 2 value(s) but 'data' holds more",
        ),
        (
            body(tensor(shape=(1, 10**12))),
            None,
            "input 'tokens': shape [1, 1000000000000] needs 1000000000000",
        ),
        (
            body(tensor(data=[5, "6", 7])),
            None,
            "input 'tokens': 'data' holds \"6\" at index 1; datatype INT64",
        ),
        (body(tensor(data=[5, 2**63, 7])), None, "datatype INT64 takes signed 64-bit integers"),
        (body(tensor(datatype="UINT8", data=[5, -1, 7])), None, "UINT8 takes unsigned 8-bit integers"),
        (body(tensor(data=[5, 6.0, 7])), None, "holds 6.0 at index 1"),
        (body(tensor(data=[True, 6, 7])), None, "holds true at index 0"),
        (body(tensor("m", "FP32", data=[1, None, 2])), None, "input 'm': 'data' holds null at index 1"),
        (body(tensor("s", "BYTES", (1, 1), [3])), None, "datatype BYTES takes strings"),
        (body(tensor("b", "BOOL", (1, 1), [1])), None, "datatype BOOL takes true or false"),
        (
            b'{"inputs": [{"name": "r", "datatype": "FP64", "shape": [1], "data": [1e999]}]}',
            None,
            "holds 1e999",
        ),
        (body(tensor(), parameters=[1]), None, "'parameters' must be a JSON object, got a list"),
        (
            body(tensor(), parameters={"x": {"a": 1}}),
            None,
            "'parameters': 'x' is an object; a parameter must be",
        ),
        (body(tensor(parameters={"x": 1.5})), None, "input 'tokens': 'parameters': 'x' is a number"),
        (body(tensor(), outputs="rewards"), None, "'outputs' must be a list of objects with a 'name'"),
        (body(tensor(), id=5), None, "'id' must be a string, got a number"),
        (body(tensor()), "abc", f"header '{HEADER_LENGTH}' is 'abc'"),
        (body(tensor()), "99999", "an integer from 1 to"),
        (
            body(tensor(parameters={"binary_data_size": 24})),
            None,
            "has both 'data' and parameters.binary_data_size",
        ),
        (
            body(tensor(data=None, parameters={"binary_data_size": -8})),
            None,
            "binary_data_size must be a non-negative",
        ),
        (
            body(tensor(data=None, parameters={"binary_data_size": 24})),
            None,
            f"has no '{HEADER_LENGTH}' header",
        ),
    ],
)
def test_malformed_requests_are_named(payload, header, needle):
    with pytest.raises(RequestError) as info:
        check_infer_request(payload, header)
    assert needle in str(info.value)


def test_binary_sizes_must_match_the_shape_and_the_body():
    arrays, types = {"tokens": np.ones((1, 3), np.int64)}, {"tokens": "INT64"}
    payload, n = binary(arrays, types, sizes={"tokens": 16})
    with pytest.raises(
        RequestError, match=r"binary_data_size is 16 bytes but shape \[1, 3\] of INT64 needs 24"
    ):
        check_infer_request(payload, n)
    payload, n = binary(arrays, types)
    with pytest.raises(RequestError, match=r"carries 23 byte\(s\) after its .* add up to 24"):
        check_infer_request(payload[:-1], n)
    # the binary shape is never trusted for allocation: a huge one is refused by its byte size
    huge, n = binary(arrays, types)
    huge = huge.replace(b"[1, 3]", b"[1, 1000000000000]")
    with pytest.raises(RequestError, match="needs 8000000000000"):
        check_infer_request(huge, str(int(n) + len("1000000000000") - 1))


# ---------------------------------------------------------------------------- the proxy
class Upstream(BaseHTTPRequestHandler):
    """Answers every request with what it received (method, path, two headers, body length)."""

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        received = self.rfile.read(n)
        payload = json.dumps(
            {
                "method": self.command,
                "path": self.path,
                "header_length": self.headers.get(HEADER_LENGTH),
                "bytes": len(received),
            }
        ).encode()
        self.send_response(200)
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


@pytest.fixture(scope="module")
def guarded():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    guard = HTTPGuard("127.0.0.1", free_port(), upstream.server_address[1], max_request_bytes=4096)
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


def test_proxy_forwards_reads_and_valid_inference_unchanged(guarded):
    status, _, answer = request(guarded, "GET", "/v2/health/ready")
    assert status == 200 and json.loads(answer)["path"] == "/v2/health/ready"
    payload, n = binary({"tokens": np.ones((2, 3), np.int64)}, {"tokens": "INT64"})
    status, headers, answer = request(
        guarded, "POST", "/v2/models/m/versions/1/infer", payload, {HEADER_LENGTH: n}
    )
    seen = json.loads(answer)
    assert status == 200 and seen["bytes"] == len(payload) and seen["header_length"] == n
    assert headers[HEADER_LENGTH] == "7"  # the upstream's own headers come back


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
