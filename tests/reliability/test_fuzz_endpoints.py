"""Generated bad requests against every endpoint over real HTTP; each gets a clear error, none harms.

One reward server and one critic server (combined, token required, checkpoints on) run for the
module. Hypothesis draws requests from families of defects — wrong datatypes, ranks and names,
missing inputs, empty tensors, too many rows, lengths out of range, sequences over the model's
position limit, token ids outside the vocabulary, NaN/inf and bad masks in training data, shapes
that lie about their data (up to 10^15 elements), junk JSON values, garbage bodies, lying framing
headers, compressed bodies, junk parameters, missing or wrong tokens — and sends each as a foreign
client would (raw KServe v2 JSON or binary over ``http.client``), with assorted content types.

For every request: an HTTP 4xx (never a 5xx) whose text names the input (or the part of the
request) at fault and what was expected, without a traceback. After each endpoint's run: the
server still answers a valid request exactly as before, the critic's weights, optimizer state and
step are bit-identical, and no checkpoint was written. Runs are reproducible (``derandomize=True``).

Hand-written cases add what generation does not reach: bodies tritonserver's JSON parser reads
differently from Python's (a key given twice, NaN, numbers of thousands of digits, broken
Unicode, trailing data), protocol abuse (BYTES framing, lying sizes), answers compressed only for
clients that ask, and a 2 MB text that must cost what the server keeps.
"""

from __future__ import annotations

import gzip
import json
import socket
import string
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import free_port
from support import (
    MAX_BATCH,
    MAX_TRAIN_ROWS,
    POSITIONS,
    TOKEN,
    VOCAB,
    Answer,
    array_json,
    binary_body,
    critic_server,
    files_under,
    infer_path,
    json_body,
    post,
    reward_server,
    same_state,
    snapshot,
    valid_infer_body,
    with_token,
)

from openaligner.servers.protocol import TOKEN_PARAMETER

pytestmark = pytest.mark.reliability

EXAMPLES = 200  # generated requests per endpoint
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CONTENT_TYPES = [
    "application/json",
    "application/octet-stream",
    "text/plain",
    "application/xml",
    "multipart/form-data; boundary=x",
    "",
]
NAME_CHARS = string.ascii_letters + string.digits + "_-./"

Needle = str | tuple[str, ...]  # a text the error must contain, or alternatives of which one must


@dataclass
class Case:
    """One bad request and what its error must say."""

    family: str
    body: bytes
    needles: tuple[Needle, ...]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Endpoint:
    """What the families need to know about an endpoint: its model and a valid request."""

    model: str
    valid: Callable[[np.random.Generator, Any], dict[str, np.ndarray]]  # (rng, draw) -> arrays
    parameters: dict[str, Any] | None  # request parameters of a valid request (the token)


def _infer_arrays(rng: np.random.Generator, draw: Any) -> dict[str, np.ndarray]:
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    return {
        "tokens": rng.integers(3, VOCAB, (rows, width)).astype(np.int64),
        "sequence_lengths": rng.integers(1, width + 1, (rows, 1)).astype(np.int64),
    }


def _train_arrays(rng: np.random.Generator, draw: Any, rows: int | None = None) -> dict[str, np.ndarray]:
    rows = rows if rows is not None else draw(st.integers(1, 4))
    width = draw(st.integers(2, 10))
    mask = (rng.random((rows, width - 1)) < 0.7).astype(np.float32)
    mask[0, 0] = 1.0  # at least one trained position
    return {
        "tokens": rng.integers(0, VOCAB, (rows, width)).astype(np.int64),
        "returns": rng.normal(size=(rows, width - 1)).astype(np.float32),
        "prev_values": rng.normal(size=(rows, width - 1)).astype(np.float32),
        "mask": mask,
    }


def _save_arrays(rng: np.random.Generator, draw: Any) -> dict[str, np.ndarray]:
    return {"dummy_var": np.array([draw(st.integers(-(2**63), 2**63 - 1))], np.int64)}


REWARD = Endpoint("reward_model", _infer_arrays, None)
CRITIC_INFER = Endpoint("critic_infer", _infer_arrays, None)
CRITIC_TRAIN = Endpoint("critic_train", _train_arrays, with_token())
CRITIC_SAVE = Endpoint("critic_save", _save_arrays, with_token())


def _encode(
    draw: Any, arrays: dict[str, np.ndarray], parameters: dict[str, Any] | None
) -> tuple[bytes, dict]:
    """JSON or binary, as the test draws."""
    if draw(st.booleans()):
        return json_body([array_json(n, a) for n, a in arrays.items()], parameters), {}
    return binary_body(arrays, parameters)


def _rng(draw: Any) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _name(draw: Any, taken: set[str]) -> str:
    return draw(st.text(NAME_CHARS, min_size=1, max_size=24).filter(lambda s: s not in taken))


# ---------------------------------------------------------------------------- families of every endpoint
WRONG_DTYPES = [
    np.int32,
    np.int8,
    np.int16,
    np.uint8,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.bool_,
]


@st.composite
def wrong_dtype(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    want = "INT64" if arrays[name].dtype == np.int64 else "FP32"
    choices = [d for d in WRONG_DTYPES if np.dtype(d) != arrays[name].dtype] + [np.bytes_]
    dtype = draw(st.sampled_from(choices))
    if dtype is np.bytes_:
        arrays[name] = np.vectorize(lambda v: str(v).encode(), otypes=[object])(arrays[name])
    else:
        arrays[name] = arrays[name].astype(dtype)
    if dtype is np.float16:  # Triton takes FP16 only in binary form (and says so)
        body, headers = binary_body(arrays, ep.parameters)
    else:
        body, headers = _encode(draw, arrays, ep.parameters)
    expected = f"expected {'int64' if want == 'INT64' else 'float32'}"
    return Case("wrong dtype", body, (f"input '{name}'", expected), headers)


@st.composite
def wrong_rank(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    a = arrays[name]
    arrays[name] = a.reshape(-1) if draw(st.booleans()) and a.ndim > 1 else a.reshape(*a.shape, 1)
    body, headers = _encode(draw, arrays, ep.parameters)
    return Case("wrong rank", body, (f"input '{name}'", ("expected", "Expected [")), headers)


@st.composite
def unknown_input(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    extra = _name(draw, {"tokens", "sequence_lengths", "sentences", *arrays})
    rows = next(iter(arrays.values())).shape[0]
    arrays[extra] = (
        np.array([[b"/tmp/openaligner-fuzz"]] * rows, dtype=object)
        if draw(st.booleans())
        else np.zeros((rows, 1), np.int64)
    )
    body, headers = _encode(draw, arrays, ep.parameters)
    expected = ("unexpected input(s)", "unexpected inference input")
    return Case("unknown input", body, (f"'{extra}'", expected), headers)


@st.composite
def empty_tensor(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    a = arrays[name]
    axis = draw(st.integers(0, a.ndim - 1))
    arrays[name] = np.take(a, [], axis=axis)
    body, headers = _encode(draw, arrays, ep.parameters)
    return Case(
        "empty tensor", body, (f"input '{name}' has shape", "every dimension must be at least 1"), headers
    )


@st.composite
def lying_shape(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    count = arrays[name].size
    shape = draw(
        st.lists(st.integers(1, 10**15), min_size=1, max_size=4).filter(
            lambda s: int(np.prod(s, dtype=object)) != count
        )
    )
    inputs = [array_json(n, a) for n, a in arrays.items()]
    for item in inputs:
        if item["name"] == name:
            item["shape"] = shape
    return Case(
        "lying shape",
        json_body(inputs, ep.parameters),
        (f"input '{name}': shape {shape} needs", "'data' holds"),
    )


JUNK = st.one_of(
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.booleans(),
    st.none(),
    st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
)


@st.composite
def junk_value(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    inputs = [array_json(n, a) for n, a in arrays.items()]
    item = next(i for i in inputs if i["name"] == name)
    index = draw(st.integers(0, len(item["data"]) - 1))
    integer = item["datatype"] == "INT64"
    junk = draw(
        JUNK | st.integers(2**63, 2**80) if integer else JUNK.filter(lambda v: not isinstance(v, float))
    )
    item["data"][index] = junk
    takes = "signed 64-bit integers" if integer else "numbers"
    return Case(
        "junk value",
        json_body(inputs, ep.parameters),
        (f"input '{name}': 'data' holds", f"at index {index}; datatype {item['datatype']} takes {takes}"),
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
BODY_NEEDLE = ("request body", "'inputs'", "inputs[", "input '", "'parameters'", "'outputs'", "'id'")


@st.composite
def garbage_body(draw: Any, ep: Endpoint, kind: str) -> Case:
    if kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif kind == "json":
        body = json_body_raw(draw(JSON_VALUES))
    elif kind == "inputs":
        body = json_body_raw({"inputs": draw(JSON_VALUES.filter(lambda v: not isinstance(v, list) or not v))})
    else:
        item = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": JSON_VALUES,
                    "datatype": JSON_VALUES | st.sampled_from(["INT64", "FP32", "BYTES"]),
                    "shape": JSON_VALUES | st.lists(st.integers(-5, 5), max_size=3),
                    "data": JSON_VALUES,
                },
            )
        )
        body = json_body_raw({"inputs": [item]})
    headers = {"Content-Type": draw(st.sampled_from(CONTENT_TYPES))}
    return Case(f"garbage {kind}", body, (BODY_NEEDLE,), headers)


def json_body_raw(doc: Any) -> bytes:
    return json.dumps(doc).encode()


@st.composite
def lying_header(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    body = json_body([array_json(n, a) for n, a in arrays.items()], ep.parameters)
    value = draw(
        st.one_of(
            st.integers(-(2**40), 0),
            st.integers(len(body) + 1, 2**40),
            st.text(string.ascii_letters + string.punctuation + " ", min_size=1, max_size=12).filter(
                lambda s: not s.strip().lstrip("+-").isdigit()
            ),
        )
    )
    headers = {"Inference-Header-Content-Length": str(value)}
    return Case("lying header", body, ("header 'Inference-Header-Content-Length' is",), headers)


@st.composite
def lying_binary_size(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    if draw(st.booleans()):  # the body holds more or fewer bytes than the inputs declare
        body, headers = binary_body(arrays, ep.parameters)
        binary = sum(a.nbytes for a in arrays.values())
        cut = draw(st.integers(1, min(16, binary)))  # within the binary part: the JSON stays whole
        body = body[:-cut] if draw(st.booleans()) else body + b"\0" * cut
        return Case("lying binary size", body, ("the body carries", "binary_data_size add up to"), headers)
    name = draw(st.sampled_from(sorted(arrays)))
    size = arrays[name].nbytes
    lie = draw(st.integers(0, 2**40).filter(lambda n: n != size))
    body, headers = binary_body(arrays, ep.parameters, sizes={name: lie})
    needle = f"input '{name}': binary_data_size is {lie} bytes but shape {list(arrays[name].shape)}"
    return Case("lying binary size", body, (needle,), headers)


@st.composite
def compressed(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    body, headers = _encode(draw, arrays, ep.parameters)
    encoding = draw(st.sampled_from(["gzip", "deflate", "br", "compress", "zstd", "x-custom"]))
    return Case(
        "compressed", body, (f"Content-Encoding: {encoding}",), {**headers, "Content-Encoding": encoding}
    )


@st.composite
def junk_parameters(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    bad = draw(
        st.one_of(
            st.lists(st.integers(), max_size=3),
            st.text(max_size=5),
            st.dictionaries(
                st.sampled_from([TOKEN_PARAMETER, "openaligner_request_id", "path"]),
                st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers()),
                min_size=1,
                max_size=2,
            ),
        )
    )
    inputs = [array_json(n, a) for n, a in arrays.items()]
    doc = {"inputs": inputs, "parameters": bad}
    return Case(
        "junk parameters",
        json_body_raw(doc),
        ("'parameters'", ("must be a JSON object", "a parameter must be")),
    )


def every_endpoint(ep: Endpoint) -> list[st.SearchStrategy[Case]]:
    return [
        wrong_dtype(ep),
        wrong_rank(ep),
        unknown_input(ep),
        empty_tensor(ep),
        lying_shape(ep),
        junk_value(ep),
        *(garbage_body(ep, kind) for kind in ("bytes", "json", "inputs", "input item")),
        lying_header(ep),
        lying_binary_size(ep),
        compressed(ep),
        junk_parameters(ep),
    ]


# ---------------------------------------------------------------------------- reward_model and critic_infer
@st.composite
def missing_input(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    if draw(st.booleans()):
        del arrays["tokens"]
        needles: tuple[Needle, ...] = ("neither 'tokens' nor 'sentences'",)
    else:
        del arrays["sequence_lengths"]
        needles = ("input 'sequence_lengths' (int64 [B, 1]) is required with 'tokens'",)
    body, headers = _encode(draw, arrays, None)
    return Case("missing input", body, needles, headers)


@st.composite
def rows_differ(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    rows = arrays["tokens"].shape[0]
    other = draw(st.integers(1, MAX_BATCH).filter(lambda r: r != rows))
    arrays["sequence_lengths"] = np.ones((other, 1), np.int64)
    body, headers = _encode(draw, arrays, None)
    needle = f"input 'sequence_lengths' has {other} rows but 'tokens' has {rows}"
    return Case("rows differ", body, (needle,), headers)


@st.composite
def too_many_rows(draw: Any, ep: Endpoint) -> Case:
    rng = _rng(draw)
    rows = draw(st.integers(MAX_BATCH + 1, 4 * MAX_BATCH))
    if draw(st.booleans()):
        arrays = {"sentences": np.array([[b"fuzz"]] * rows, dtype=object)}
    else:
        arrays = {
            "tokens": rng.integers(3, VOCAB, (rows, 4)).astype(np.int64),
            "sequence_lengths": np.full((rows, 1), 4, np.int64),
        }
    body, headers = _encode(draw, arrays, None)
    needle = f"request has {rows} rows; this server accepts at most {MAX_BATCH} per request"
    return Case("too many rows", body, (needle,), headers)


@st.composite
def length_out_of_range(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    rows, width = arrays["tokens"].shape
    row = draw(st.integers(0, rows - 1))
    value = draw(st.integers(-(2**63), 0) | st.integers(width + 1, POSITIONS))
    arrays["sequence_lengths"][row, 0] = value
    body, headers = _encode(draw, arrays, None)
    needle = f"input 'sequence_lengths': row {row} is {value}; each length must lie in [1, {width}]"
    return Case("length out of range", body, (needle,), headers)


@st.composite
def over_position_limit(draw: Any, ep: Endpoint) -> Case:
    rng = _rng(draw)
    rows = draw(st.integers(1, 3))
    width = draw(st.integers(POSITIONS + 1, 8 * POSITIONS))
    lengths = rng.integers(1, POSITIONS + 1, (rows, 1)).astype(np.int64)
    row = draw(st.integers(0, rows - 1))
    lengths[row, 0] = draw(st.integers(POSITIONS + 1, width))
    arrays = {"tokens": rng.integers(3, VOCAB, (rows, width)).astype(np.int64), "sequence_lengths": lengths}
    longest = int(lengths.argmax())
    body, headers = _encode(draw, arrays, None)
    needle = f"row {longest} has {int(lengths.max())} tokens, more than the server's max_sequence_length"
    return Case("over position limit", body, ("input 'sequence_lengths'", needle), headers)


@st.composite
def id_outside_vocabulary(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    rows = arrays["tokens"].shape[0]
    row = draw(st.integers(0, rows - 1))
    col = draw(st.integers(0, int(arrays["sequence_lengths"][row, 0]) - 1))
    value = draw(st.integers(-(2**63), -1) | st.integers(VOCAB, 2**63 - 1))
    arrays["tokens"][row, col] = value
    body, headers = _encode(draw, arrays, None)
    needle = (
        f"input 'tokens': row {row}, position {col} holds id {value}, outside the vocabulary [0, {VOCAB})"
    )
    return Case("id outside vocabulary", body, (needle,), headers)


@st.composite
def bad_sentences(draw: Any, ep: Endpoint) -> Case:
    rows = draw(st.integers(1, 4))
    texts = [draw(st.text(string.ascii_lowercase, min_size=1, max_size=20)).encode() for _ in range(rows)]
    row = draw(st.integers(0, rows - 1))
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(texts[row])))
        texts[row] = texts[row][:cut] + draw(
            st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])
        )
        needle = f"input 'sentences': row {row} is not valid UTF-8"
    else:
        texts[row] = b""
        needle = f"input 'sentences': row {row} has no tokens"
    body, headers = binary_body({"sentences": np.array([[t] for t in texts], dtype=object)})
    return Case("bad sentences", body, (needle,), headers)


def infer_families(ep: Endpoint) -> list[st.SearchStrategy[Case]]:
    own = [
        missing_input(ep),
        rows_differ(ep),
        too_many_rows(ep),
        length_out_of_range(ep),
        over_position_limit(ep),
        id_outside_vocabulary(ep),
        bad_sentences(ep),
    ]
    return every_endpoint(ep) + own


# ---------------------------------------------------------------------------- critic_train
ALIGNED = ["returns", "prev_values", "mask"]


@st.composite
def train_missing_input(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(sorted(arrays)))
    del arrays[name]
    body, headers = _encode(draw, arrays, with_token())
    return Case("missing input", body, (f"input '{name}'", "is required"), headers)


@st.composite
def train_width_differs(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(ALIGNED))
    rows, width = arrays["tokens"].shape
    other = draw(st.integers(1, 3 * width).filter(lambda w: w != width - 1))
    arrays[name] = np.ones((rows, other), np.float32)
    body, headers = _encode(draw, arrays, with_token())
    needle = f"input '{name}' has width {other} but 'tokens' has width {width}"
    return Case("width differs", body, (needle, f"must be {width - 1} wide (S-1)"), headers)


@st.composite
def train_rows_differ(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(ALIGNED))
    rows, width = arrays["tokens"].shape
    other = draw(st.integers(1, MAX_TRAIN_ROWS).filter(lambda r: r != rows))
    arrays[name] = np.ones((other, width - 1), np.float32)
    body, headers = _encode(draw, arrays, with_token())
    return Case("rows differ", body, (f"input '{name}' has {other} rows but 'tokens' has {rows}",), headers)


@st.composite
def train_too_many_rows(draw: Any, ep: Endpoint) -> Case:
    rows = draw(st.integers(MAX_TRAIN_ROWS + 1, 3 * MAX_TRAIN_ROWS))
    arrays = _train_arrays(_rng(draw), draw, rows)
    body, headers = _encode(draw, arrays, with_token())
    needle = f"request has {rows} rows; this server trains on at most {MAX_TRAIN_ROWS} per request"
    return Case("too many rows", body, (needle,), headers)


@st.composite
def train_too_wide(draw: Any, ep: Endpoint) -> Case:
    rng = _rng(draw)
    rows, width = draw(st.integers(1, 2)), draw(st.integers(POSITIONS + 1, 3 * POSITIONS))
    arrays = {
        "tokens": rng.integers(0, VOCAB, (rows, width)).astype(np.int64),
        **{n: np.ones((rows, width - 1), np.float32) for n in ALIGNED},
    }
    body, headers = binary_body(arrays, with_token())
    needle = f"input 'tokens' is {width} wide, more than the server's max_sequence_length {POSITIONS}"
    return Case("too wide", body, (needle,), headers)


@st.composite
def train_id_outside_vocabulary(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    rows, width = arrays["tokens"].shape
    row, col = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
    value = draw(st.integers(-(2**63), -1) | st.integers(VOCAB, 2**63 - 1))
    arrays["tokens"][row, col] = value
    body, headers = _encode(draw, arrays, with_token())
    needle = (
        f"input 'tokens': row {row}, position {col} holds id {value}, outside the vocabulary [0, {VOCAB})"
    )
    return Case("id outside vocabulary", body, (needle,), headers)


@st.composite
def train_not_finite(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    name = draw(st.sampled_from(ALIGNED))
    rows, cols = arrays[name].shape
    row, col = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    arrays[name][row, col] = value
    body, headers = _encode(draw, arrays, with_token())
    needle = f"input '{name}': row {row}, position {col} is {np.float32(value)}; {name} must be finite"
    # JSON has no NaN or infinity: the HTTP front refuses those before the endpoint sees them
    in_json = (
        f"input '{name}': 'data' holds {json.dumps(value)} (not a JSON number) at index {row * cols + col}"
    )
    return Case("not finite", body, ((needle, in_json),), headers)


@st.composite
def train_bad_mask(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    if draw(st.booleans()):
        arrays["mask"][:] = 0.0
        needles: tuple[Needle, ...] = ("input 'mask' is all zeros",)
    else:
        rows, cols = arrays["mask"].shape
        row, col = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        value = draw(
            st.floats(-1e6, 1e6, width=32, allow_subnormal=False).filter(lambda v: v not in (0.0, 1.0))
        )
        arrays["mask"][row, col] = value
        needles = (
            f"input 'mask': row {row}, position {col} is",
            "a mask holds only 0 (ignored) and 1 (trained)",
        )
    body, headers = _encode(draw, arrays, with_token())
    return Case("bad mask", body, needles, headers)


@st.composite
def bad_token(draw: Any, ep: Endpoint) -> Case:
    arrays = ep.valid(_rng(draw), draw)
    if draw(st.booleans()):
        parameters: dict[str, Any] = {}
        needle = f"needs the server's token (request parameter '{TOKEN_PARAMETER}')"
    else:
        wrong = draw(
            st.text(string.printable, max_size=30).filter(lambda t: t != TOKEN)
            | st.integers()
            | st.booleans()
        )
        parameters = {TOKEN_PARAMETER: wrong}
        needle = "the request's token does not match the server's"
    body, headers = _encode(draw, arrays, parameters)
    return Case("bad token", body, (needle,), headers)


def train_families() -> list[st.SearchStrategy[Case]]:
    ep = CRITIC_TRAIN
    own = [
        train_missing_input(ep),
        train_width_differs(ep),
        train_rows_differ(ep),
        train_too_many_rows(ep),
        train_too_wide(ep),
        train_id_outside_vocabulary(ep),
        train_not_finite(ep),
        train_bad_mask(ep),
        bad_token(ep),
    ]
    return every_endpoint(ep) + own


# ---------------------------------------------------------------------------- critic_save
@st.composite
def save_wrong_shape(draw: Any, ep: Endpoint) -> Case:
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3).filter(lambda s: s != [1]))
    body, headers = _encode(draw, {"dummy_var": np.zeros(shape, np.int64)}, with_token())
    return Case("wrong shape", body, ("'dummy_var'", ("Expected [1]", "expected int64 [1]")), headers)


@st.composite
def save_other_input_only(draw: Any, ep: Endpoint) -> Case:
    name = _name(draw, {"dummy_var"})
    body, headers = _encode(draw, {name: np.zeros(1, np.int64)}, with_token())
    return Case("dummy_var missing", body, (f"'{name}'", "unexpected input(s)"), headers)


@st.composite
def save_restore_step_not_held(draw: Any, ep: Endpoint) -> Case:
    # negative, or far beyond any step this module's server reaches: never a checkpoint it holds
    step = draw(st.one_of(st.integers(-(2**63), -1), st.integers(10**6, 2**63 - 1)))
    arrays = {"dummy_var": np.zeros(1, np.int64), "restore_step": np.array([step], np.int64)}
    body, headers = _encode(draw, arrays, with_token())
    return Case("restore_step not held", body, (f"cannot go back to critic step {step}: ",), headers)


def save_families() -> list[st.SearchStrategy[Case]]:
    ep = CRITIC_SAVE
    return [
        *every_endpoint(ep),
        save_wrong_shape(ep),
        save_other_input_only(ep),
        save_restore_step_not_held(ep),
        bad_token(ep),
    ]


# ---------------------------------------------------------------------------- running a fuzz
def contains(text: str, needle: Needle) -> bool:
    return any(n in text for n in needle) if isinstance(needle, tuple) else needle in text


def fuzz(port: int, model: str, families: list[st.SearchStrategy[Case]]) -> Counter[str]:
    """Send at least ``EXAMPLES`` generated cases to ``model``, an equal share from each family;
    each must be refused with a clear error. Returns the number of cases sent per family."""
    seen: Counter[str] = Counter()
    share = -(-EXAMPLES // len(families))

    def check(case: Case) -> None:
        answer = post(port, infer_path(model), case.body, case.headers)
        assert 400 <= answer.status < 500, (case.family, answer.status, answer.body[:300])
        error = answer.error
        assert error and "Traceback" not in error, (case.family, error[:600])
        missing = [n for n in case.needles if not contains(error, n)]
        assert not missing, f"{case.family}: error lacks {missing}:\n{error[:600]}"
        assert TOKEN not in error  # the secret is never echoed
        seen[case.family] += 1

    for family in families:
        settings(FUZZ, max_examples=share)(given(case=family)(check))()
    return seen


def assert_coverage(seen: Counter[str], families: int) -> None:
    assert sum(seen.values()) >= EXAMPLES, seen
    assert len(seen) == families and min(seen.values()) >= 5, f"families tried: {dict(seen)}"


# ---------------------------------------------------------------------------- servers and tests
@pytest.fixture(scope="module")
def reward(tiny):
    server = reward_server(tiny, free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_ckpt")


@pytest.fixture(scope="module")
def critic(tiny, ckpt_dir):
    server = critic_server(tiny, free_port(), ckpt_dir)
    server.start()
    yield server
    server.stop()


def valid_answer(port: int, model: str) -> dict[str, np.ndarray]:
    return post(port, infer_path(model), valid_infer_body()).outputs()


def assert_same_answer(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_reward_model_refuses_generated_bad_requests_and_keeps_serving(reward):
    before = valid_answer(reward.cfg.port, "reward_model")
    seen = fuzz(reward.cfg.port, "reward_model", infer_families(REWARD))
    assert_coverage(seen, families=len(infer_families(REWARD)))
    assert reward.triton is not None and reward.triton.is_alive()
    assert_same_answer(before, valid_answer(reward.cfg.port, "reward_model"))


def test_critic_infer_refuses_generated_bad_requests_and_keeps_serving(critic):
    port = critic.cfg.port
    before, state = valid_answer(port, "critic_infer"), snapshot(critic)
    seen = fuzz(port, "critic_infer", infer_families(CRITIC_INFER))
    assert_coverage(seen, families=len(infer_families(CRITIC_INFER)))
    assert same_state(state, snapshot(critic))
    assert_same_answer(before, valid_answer(port, "critic_infer"))


def test_critic_train_refuses_generated_bad_requests_and_leaves_the_critic_alone(critic, ckpt_dir):
    port = critic.cfg.port
    before, state, files = valid_answer(port, "critic_infer"), snapshot(critic), files_under(ckpt_dir)
    seen = fuzz(port, "critic_train", train_families())
    assert_coverage(seen, families=len(train_families()))
    assert same_state(state, snapshot(critic)), "a refused critic_train request changed the critic"
    assert files_under(ckpt_dir) == files
    assert_same_answer(before, valid_answer(port, "critic_infer"))
    # and training still works afterwards
    rng = np.random.default_rng(0)
    arrays = {
        "tokens": rng.integers(0, VOCAB, (4, 6)).astype(np.int64),
        "returns": np.ones((4, 5), np.float32),
        "prev_values": np.zeros((4, 5), np.float32),
        "mask": np.ones((4, 5), np.float32),
    }
    body, headers = binary_body(arrays, with_token())
    trained = post(port, infer_path("critic_train"), body, headers)
    assert trained.status == 200, trained.error
    assert critic.step == state["step"] + 1


def test_critic_save_refuses_generated_bad_requests_and_writes_nothing(critic, ckpt_dir):
    port = critic.cfg.port
    state, files = snapshot(critic), files_under(ckpt_dir)
    seen = fuzz(port, "critic_save", save_families())
    assert_coverage(seen, families=len(save_families()))
    assert files_under(ckpt_dir) == files, "a refused critic_save request wrote files"
    assert same_state(state, snapshot(critic))
    saved = post(
        port, infer_path("critic_save"), *binary_body({"dummy_var": np.zeros(1, np.int64)}, with_token())
    )
    assert saved.status == 200, saved.error
    assert (ckpt_dir / f"step_{critic.step}").is_dir()


# ---------------------------------------------------------------------------- hand-written hostile requests
TOKENS = '{"name": "tokens", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]}'
LENGTHS = '{"name": "sequence_lengths", "datatype": "INT64", "shape": [1, 1], "data": [3]}'
HUGE_TOKENS = TOKENS.replace("[1, 3]", "[1, 1000000000000]")


def raw_body(*inputs: str, extra: str = "") -> bytes:
    """A JSON body written by hand, exactly as a hostile client would send it."""
    return ('{"inputs": [' + ", ".join(inputs) + "]" + extra + "}").encode()


def sentences_body(*texts: bytes, sizes: dict[str, int] | None = None) -> tuple[bytes, dict[str, str]]:
    return binary_body({"sentences": np.array([[t] for t in texts], dtype=object)}, sizes=sizes)


def bytes_element_longer_than_its_input() -> tuple[bytes, dict[str, str]]:
    body, headers = sentences_body(b"abcd")
    start = body.index(b"\x04\x00\x00\x00abcd")
    return body[:start] + (10**9).to_bytes(4, "little") + body[start + 4 :], headers


HOSTILE: dict[str, tuple[bytes, dict[str, str], tuple[Needle, ...]]] = {
    # parser differences: bodies tritonserver's JSON parser reads differently from Python's (of a
    # key given twice it keeps the first: this 230-byte request used to abort tritonserver)
    "key twice: shape": (
        raw_body(TOKENS.replace('"shape": [1, 3]', '"shape": [1, 1000000000000], "shape": [1, 3]'), LENGTHS),
        {},
        ("the key \"shape\" of 'tokens' more than once",),
    ),
    "key twice: inputs": (
        raw_body(HUGE_TOKENS, extra=f', "inputs": [{TOKENS}, {LENGTHS}]'),
        {},
        ('the key "inputs" more than once',),
    ),
    "key twice: data": (
        raw_body(TOKENS.replace('"data": [5, 6, 7]', '"data": [5], "data": [5, 6, 7]'), LENGTHS),
        {},
        ("the key \"data\" of 'tokens' more than once",),
    ),
    "key twice: name": (raw_body(TOKENS.replace('"name"', '"name": "x", "name"'), LENGTHS), {}, ('"name"',)),
    "NaN": (
        raw_body(TOKENS.replace("[5, 6, 7]", "[5, NaN, 7]"), LENGTHS),
        {},
        ("input 'tokens'", "holds NaN"),
    ),
    "Infinity": (raw_body(TOKENS, LENGTHS.replace("3]", "Infinity]")), {}, ("input 'sequence_lengths'",)),
    "1e400": (raw_body(TOKENS, LENGTHS.replace("3]", "1e400]")), {}, ("input 'sequence_lengths'", "1e400")),
    "4301-digit value": (
        raw_body(TOKENS.replace("[5, 6, 7]", f"[5, {'9' * 4301}, 7]"), LENGTHS),
        {},
        ("input 'tokens'", "an integer of 4301 digits", "signed 64-bit integers"),
    ),
    "5000-digit shape": (
        raw_body(TOKENS.replace("[1, 3]", "[1, " + "9" * 5000 + "]"), LENGTHS),
        {},
        ("input 'tokens'", "'shape' must be a list of non-negative integers"),
    ),
    "invalid UTF-8": (raw_body(TOKENS, LENGTHS).replace(b"tokens", b"tok\xffens"), {}, ("not UTF-8 JSON",)),
    "lone surrogate": (
        raw_body(TOKENS.replace("tokens", "tok\\ud800ens"), LENGTHS),
        {},
        ("lone UTF-16 surrogate",),
    ),
    "byte-order mark": (b"\xef\xbb\xbf" + raw_body(TOKENS, LENGTHS), {}, ("BOM",)),
    "trailing garbage": (raw_body(TOKENS, LENGTHS) + b"}", {}, ("Extra data",)),
    "two documents": (raw_body(TOKENS, LENGTHS) + raw_body(HUGE_TOKENS), {}, ("Extra data",)),
    # content errors, which third-party clients used to get as HTTP 500 with a Python traceback
    "length 0": (
        raw_body(TOKENS, LENGTHS.replace("3]", "0]")),
        {},
        ("input 'sequence_lengths': row 0 is 0",),
    ),
    "id outside the vocabulary": (
        raw_body(TOKENS.replace("[5, 6, 7]", "[5, 600, 7]"), LENGTHS),
        {},
        ("input 'tokens': row 0, position 1 holds id 600",),
    ),
    "tokens without lengths": (raw_body(TOKENS), {}, ("input 'sequence_lengths'", "is required")),
    "text not UTF-8": (*sentences_body(b"ok\xff"), ("input 'sentences': row 0 is not valid UTF-8",)),
    "empty text": (*sentences_body(b""), ("input 'sentences': row 0 has no tokens",)),
    # protocol abuse
    "BYTES element longer than its input": (
        *bytes_element_longer_than_its_input(),
        ("input 'sentences'", "element 0 declares 1000000000 bytes"),
    ),
    "BYTES size overflowing 64 bits": (
        *sentences_body(b"abcd", sizes={"sentences": 2**64}),
        ("input 'sentences'", "binary_data_size"),
    ),
    "header length past the body": (
        raw_body(TOKENS, LENGTHS),
        {"Inference-Header-Content-Length": "9999"},
        ("header 'Inference-Header-Content-Length' is '9999'",),
    ),
}


@pytest.fixture(scope="module")
def infer_ports(reward, critic) -> dict[str, int]:
    return {"reward_model": reward.cfg.port, "critic_infer": critic.cfg.port}


@pytest.fixture(scope="module")
def alone(infer_ports) -> dict[str, dict[str, np.ndarray]]:
    """Each model's answer to the valid request before any hand-written hostile one."""
    return {model: valid_answer(port, model) for model, port in infer_ports.items()}


@pytest.mark.parametrize("model", ["reward_model", "critic_infer"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hand_written_hostile_requests_get_a_4xx_naming_the_problem(infer_ports, alone, model, case):
    body, headers, needles = HOSTILE[case]
    answer = post(infer_ports[model], infer_path(model), body, headers)
    assert 400 <= answer.status < 500, (answer.status, answer.body[:600])
    error = answer.error
    assert "Traceback" not in error and len(error) < 1000, error
    missing = [n for n in needles if not contains(error, n)]
    assert not missing, f"error lacks {missing}:\n{error}"
    assert_same_answer(alone[model], valid_answer(infer_ports[model], model))  # up, and unchanged


# ---------------------------------------------------------------------------- answers and resources
def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` byte for byte on a fresh connection, as curl does; the answer's status,
    headers (lower-case names) and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
            head, _, rest = received.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
            }
            if "content-length" in headers and len(rest) >= int(headers["content-length"]):
                break
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body[: int(headers.get("content-length", len(body)))]


def curl_like(model: str, body: bytes, version: str, extra: str = "") -> bytes:
    """A request as ``curl -d`` sends it: no Accept-Encoding unless ``extra`` adds one."""
    return (
        f"POST {infer_path(model)} {version}\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\n"
        f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


@pytest.mark.parametrize("model", ["reward_model", "critic_infer"])
@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
def test_answers_are_uncompressed_unless_the_client_asks(infer_ports, alone, model, version):
    port, body = infer_ports[model], valid_infer_body()
    status, headers, payload = raw_exchange(port, curl_like(model, body, version, "Connection: close\r\n"))
    assert status == 200 and headers.get("content-encoding", "identity") == "identity", headers
    assert_same_answer(alone[model], Answer(status, payload).outputs())  # plain JSON, as documented
    status, headers, payload = raw_exchange(
        port, curl_like(model, body, version, "Accept-Encoding: gzip\r\nConnection: close\r\n")
    )
    assert status == 200 and headers.get("content-encoding") == "gzip", headers  # asked: labelled
    assert_same_answer(alone[model], Answer(status, gzip.decompress(payload)).outputs())


@pytest.mark.parametrize("model", ["reward_model", "critic_infer"])
def test_a_long_text_costs_what_the_server_keeps(infer_ports, model):
    """A 2 MB text is answered as its first max_sequence_length tokens are, in a fraction of a
    second (the whole text used to be tokenized first: 5-7 s, during which nobody was served)."""
    text = b"the quick brown fox " * 100_000
    started = time.monotonic()
    long = post(infer_ports[model], infer_path(model), *sentences_body(text))
    took = time.monotonic() - started
    cut = post(infer_ports[model], infer_path(model), *sentences_body(text[:POSITIONS]))  # 1 token per char
    assert long.status == 200, long.error
    assert_same_answer(cut.outputs(), long.outputs())
    assert took < 2.0, f"a 2 MB text took {took:.1f} s"
