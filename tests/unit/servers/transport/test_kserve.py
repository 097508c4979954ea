"""KServe v2 request bodies: strict reading (what tritonserver could read differently is refused,
naming the part at fault) and the canonical binary form forwarded to Triton."""

import json
import struct

import numpy as np
import pytest

from openaligner.servers.transport.kserve import HEADER_LENGTH, parse_infer_request
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
    parse_infer_request(body(tensor(), tensor("sequence_lengths", shape=(1, 1), data=[3])), None)
    parse_infer_request(body(tensor(data=[[5, 6, 7]])), None)  # nested data, row-major
    parse_infer_request(body(tensor("sentences", "BYTES", (1, 1), ["hi"])), None)
    parse_infer_request(
        body(tensor("returns", "FP32", (1, 2), [0.5, -1e300])), None
    )  # inf, as Triton reads it
    payload, n = binary({"tokens": np.ones((2, 3), np.int64)}, {"tokens": "INT64"})
    parse_infer_request(payload, n)


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
        parse_infer_request(payload, header)
    assert needle in str(info.value)


def test_binary_sizes_must_match_the_shape_and_the_body():
    arrays, types = {"tokens": np.ones((1, 3), np.int64)}, {"tokens": "INT64"}
    payload, n = binary(arrays, types, sizes={"tokens": 16})
    with pytest.raises(
        RequestError, match=r"binary_data_size is 16 bytes but shape \[1, 3\] of INT64 needs 24"
    ):
        parse_infer_request(payload, n)
    payload, n = binary(arrays, types)
    with pytest.raises(RequestError, match=r"carries 23 byte\(s\) after its .* add up to 24"):
        parse_infer_request(payload[:-1], n)
    # the binary shape is never trusted for allocation: a huge one is refused by its byte size
    huge, n = binary(arrays, types)
    huge = huge.replace(b"[1, 3]", b"[1, 1000000000000]")
    with pytest.raises(RequestError, match="needs 8000000000000"):
        parse_infer_request(huge, str(int(n) + len("1000000000000") - 1))


def bytes_input(elements, shape, size=None):
    """A binary BYTES input: each element as a 4-byte little-endian length, then its bytes."""
    raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    item = {
        "name": "sentences",
        "datatype": "BYTES",
        "shape": list(shape),
        "parameters": {"binary_data_size": len(raw) if size is None else size},
    }
    header = json.dumps({"inputs": [item]}).encode()
    return header + raw, str(len(header))


@pytest.mark.parametrize(
    ("elements", "shape", "needle"),
    [
        ([b"ab", b"c"], (3, 1), "too few for the 3 BYTES element(s) of shape [3, 1]"),
        ([b"abcdef"], (2, 1), "ends after 1 of the 2 BYTES element(s)"),
        ([b"ab"], (1, 1), None),  # valid
        ([b"ab", b"cd"], (1, 1), "take 6 bytes but binary_data_size is 12"),
    ],
)
def test_binary_bytes_elements_must_match_their_framing(elements, shape, needle):
    payload, n = bytes_input(elements, shape)
    if needle is None:
        assert parse_infer_request(payload, n).arrays()["sentences"].tolist() == [[b"ab"]]
        return
    with pytest.raises(RequestError) as info:
        parse_infer_request(payload, n)
    assert needle in str(info.value) and "input 'sentences'" in str(info.value)


def test_a_binary_bytes_element_longer_than_its_input_is_refused():
    raw = struct.pack("<I", 10**9) + b"abc"
    item = {"name": "sentences", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 7}}
    header = json.dumps({"inputs": [item]}).encode()
    with pytest.raises(RequestError, match="element 0 declares 1000000000 bytes but only 3 remain"):
        parse_infer_request(header + raw, str(len(header)))


# ---------------------------------------------------------------------------- parser differences
GOOD = '{"name": "tokens", "datatype": "INT64", "shape": [1, 3], "data": [5, 8, 7]}'


def doc(*items: str, extra: str = "") -> bytes:
    return ('{"inputs": [' + ", ".join(items) + "]" + extra + "}").encode()


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        # Triton's parser keeps the first of a key given twice, Python's the last
        (
            doc('{"name": "t", "datatype": "INT64", "shape": [1, 9], "shape": [1, 3], "data": [5, 6, 7]}'),
            "gives the key \"shape\" of 't' more than once",
        ),
        (
            b'{"inputs": [' + GOOD.encode() + b'], "inputs": [' + GOOD.encode() + b"]}",
            'gives the key "inputs" more than once',
        ),
        (doc('{"name": "a", "name": "tokens", "datatype": "INT64", "shape": [1], "data": [1]}'), '"name"'),
        (doc(GOOD, extra=', "parameters": {"p": 1, "p": 2}'), 'gives the key "p" more than once'),
        (doc(GOOD, extra=', "outputs": [{"name": "r", "parameters": {"b": 1, "b": 1}}]'), '"b" more than'),
        # numbers only one side reads
        (doc(GOOD.replace("8", "NaN")), "holds NaN (not a JSON number) at index 1"),
        (doc(GOOD.replace("8", "Infinity")), "holds Infinity (not a JSON number)"),
        (doc(GOOD.replace("8", "-Infinity")), "holds -Infinity (not a JSON number)"),
        (doc(GOOD.replace("8", "1e400")), "holds 1e400 (a number too large for a 64-bit float)"),
        (doc(GOOD.replace("8", "9" * 4301)), "(an integer of 4301 digits) at index 1; datatype INT64"),
        (doc(GOOD.replace("[1, 3]", "[1, " + "9" * 5000 + "]")), "input 'tokens': 'shape' must be a list"),
        (doc(GOOD, extra=', "parameters": {"p": ' + "9" * 30 + "}"), "'p' is a number; a parameter must"),
        (doc(GOOD, extra=', "parameters": {"p": 18446744073709551615}'), "an integer parameter must fit 64"),
        (doc(GOOD.replace("[5, 8, 7]", "[5, 8, 7.5e400]")), "too large for a 64-bit float"),
        # text only one side reads
        (b'{"inputs": [{"name": "tok\xffens"}]}', "not UTF-8 JSON (byte 0xff at offset 25)"),
        (b'{"inputs": [{"name": "tok\xed\xa0\x80"}]}', "not UTF-8 JSON (byte 0xed"),
        (doc(GOOD.replace('"tokens"', '"tok\\ud800"')), "lone UTF-16 surrogate"),
        (doc(GOOD, extra=', "id": "\\udc00"'), "lone UTF-16 surrogate"),
        (
            doc('{"name": "sentences", "datatype": "BYTES", "shape": [1, 1], "data": ["a\\ud83d"]}'),
            "input 'sentences': 'data' at index 0 holds a lone UTF-16 surrogate",
        ),
        (b"\xef\xbb\xbf" + doc(GOOD), "Unexpected UTF-8 BOM"),
        (doc(GOOD) + b" x", "Extra data"),
        (doc(GOOD) + doc(GOOD), "Extra data"),
        (doc(GOOD.replace('"INT64"', '"BF16"')), "datatype BF16 is not accepted by this server"),
    ],
)
def test_bodies_triton_could_read_differently_are_refused(payload, needle):
    with pytest.raises(RequestError) as info:
        parse_infer_request(payload, None)
    assert needle in str(info.value)


def test_the_canonical_form_holds_the_same_values_in_binary():
    items = [
        {"name": "tokens", "datatype": "INT64", "shape": [2, 2], "data": [[1, -2], [3, 2**62]]},
        {"name": "x", "datatype": "FP32", "shape": [3], "data": [0.5, -1e300, 3]},
        {"name": "u", "datatype": "UINT8", "shape": [2], "data": [0, 255]},
        {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
        {"name": "sentences", "datatype": "BYTES", "shape": [2, 1], "data": ["héllo", "\u0000"]},
    ]
    parsed = parse_infer_request(body(*items, parameters={"p": "q"}, outputs=[{"name": "r"}], id="7"), None)
    payload, n = parsed.encode()
    header = json.loads(payload[:n])
    assert header["id"] == "7" and header["parameters"] == {"p": "q"} and header["outputs"] == [{"name": "r"}]
    assert all("data" not in i and i["parameters"]["binary_data_size"] > 0 for i in header["inputs"])
    again = parse_infer_request(payload, str(n))
    for name, array in parsed.arrays().items():
        np.testing.assert_array_equal(again.arrays()[name], array)
    arrays = parsed.arrays()
    assert arrays["x"].dtype == np.float32 and np.isinf(arrays["x"][1])  # as Triton casts it
    assert arrays["sentences"].tolist() == [["héllo".encode()], [b"\x00"]]
    assert again.encode() == (payload, n)  # canonical: encoding it again changes nothing


def test_binary_bool_is_forwarded_as_0_and_1():
    header = json.dumps(
        {"inputs": [{"name": "b", "datatype": "BOOL", "shape": [3], "parameters": {"binary_data_size": 3}}]}
    ).encode()
    parsed = parse_infer_request(header + b"\x00\x07\x01", str(len(header)))
    payload, n = parsed.encode()
    assert payload[n:] == b"\x00\x01\x01"
