"""KServe v2 inference requests, read strictly and written back canonically.

Owns both directions of the body format: :func:`parse_infer_request` (strict JSON, declared shapes
checked against the values sent, inputs decoded to numpy; each refusal one :class:`RequestError`
sentence), :meth:`InferRequest.encode` (canonical binary form, so Triton reads what was checked)
and :func:`parse_infer_response`. Must not know about HTTP, Triton's process or what an endpoint
computes. Design notes (what tritonserver trusts): docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from openaligner.servers.transport.strict_json import Unreadable, check_text, read_json
from openaligner.servers.transport.strict_json import is_int as _is_int
from openaligner.servers.transport.strict_json import kind as _kind
from openaligner.servers.transport.strict_json import short as _short
from openaligner.servers.validation import RequestError

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The KServe v2 binary extension header: the byte length of the JSON part of the body."""

EXAMPLE = '{"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]}]}'

_NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
_ITEM_BYTES = {**{name: dtype.itemsize for name, dtype in _NUMPY.items()}, "BF16": 2}
_DATATYPES = (*_ITEM_BYTES, "BYTES")
_INT64 = (-(2**63), 2**63)
_EXPECTED = f"a KServe v2 inference request, e.g. {EXAMPLE}"


def _parse_json(header: bytes) -> dict[str, Any]:
    doc = read_json(header, _EXPECTED)
    if not isinstance(doc, dict):
        raise RequestError(
            f"request body must be a JSON object with 'inputs', got {_kind(doc)}; e.g. {EXAMPLE}"
        )
    return doc


# ----------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class InferInput:
    """One input as this front understood it: ``array`` has ``shape`` (BYTES: an object array of
    ``bytes``); ``raw`` is its value in the binary form Triton receives."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray
    raw: bytes | memoryview


@dataclass(frozen=True)
class InferRequest:
    """One inference request as this front understood it (see :func:`parse_infer_request`)."""

    inputs: tuple[InferInput, ...]
    parameters: dict[str, Any]
    outputs: tuple[dict[str, Any], ...] | None
    id: str | None

    def arrays(self) -> dict[str, np.ndarray]:
        """Input name -> values, as the served model's callable receives them."""
        return {x.name: x.array for x in self.inputs}

    def encode(self) -> tuple[bytes, int]:
        """The request in canonical form — a compact ASCII JSON header, then every input's values
        in binary — and the header's length (the ``Inference-Header-Content-Length``)."""
        doc: dict[str, Any] = {}
        if self.id is not None:
            doc["id"] = self.id
        if self.parameters:
            doc["parameters"] = self.parameters
        doc["inputs"] = [
            {
                "name": x.name,
                "datatype": x.datatype,
                "shape": list(x.shape),
                "parameters": {"binary_data_size": len(x.raw)},
            }
            for x in self.inputs
        ]
        if self.outputs is not None:
            doc["outputs"] = list(self.outputs)
        header = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return b"".join([header, *(x.raw for x in self.inputs)]), len(header)

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> InferRequest:
        """A request carrying ``arrays`` (int64, float32 or object arrays of ``bytes``, each with its
        batch dimension first) and the request ``parameters``."""
        inputs = []
        for name, array in arrays.items():
            if array.dtype == object:
                elements = [bytes(x) for x in array.reshape(-1)]
                raw: bytes = _bytes_elements(elements)
                datatype = "BYTES"
            else:
                datatype = next(k for k, v in _NUMPY.items() if v == array.dtype.newbyteorder("<"))
                array = np.ascontiguousarray(array, dtype=_NUMPY[datatype])
                raw = array.tobytes()
            inputs.append(InferInput(name, datatype, tuple(array.shape), array, raw))
        return cls(tuple(inputs), dict(parameters), None, None)


def parse_infer_response(payload: bytes) -> dict[str, np.ndarray]:
    """Output name -> values of a Triton answer in JSON form (``{"outputs": [{"name", "datatype",
    "shape", "data"}, ...]}``, as Triton writes it when no output was asked for in binary).

    Raises:
        ValueError: the payload is not such an answer.
    """
    try:
        out = {}
        for o in json.loads(payload)["outputs"]:
            dtype = _NUMPY.get(o["datatype"])
            if dtype is None:
                raise ValueError(f"output {o['name']!r} has datatype {o['datatype']}, not read here")
            out[o["name"]] = np.array(o["data"], dtype=dtype).reshape(o["shape"])
        return out
    except (KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"not a KServe v2 inference answer ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class _Declared:
    """One input as the request declares it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any  # the JSON ``data`` value, or None when the values travel in binary
    binary_size: int | None


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Read one ``POST /v2/models/<name>/infer`` body strictly and decode its inputs.

    ``header_length`` is the request's ``Inference-Header-Content-Length`` (None when absent).
    What the served model itself requires — which inputs, dtypes, ranks, rows, value ranges — is
    left to the endpoint's check; this reads the request and refuses whatever Triton could crash
    on, or read differently from this front.

    Raises:
        RequestError: one sentence naming the part of the request that is wrong (the body, a
            header, ``inputs``, an input by name) and what was expected.
    """
    header, binary_bytes = _split_body(body, header_length)
    doc = _parse_json(header)
    declared = _declared_inputs(doc)
    parameters = _check_parameters(doc.get("parameters"), "'parameters'")
    outputs = _check_outputs(doc.get("outputs"))
    if "id" in doc and not isinstance(doc["id"], str):
        raise RequestError(f"'id' must be a string, got {_kind(doc['id'])}")
    binary_total = sum(d.binary_size or 0 for d in declared)
    for d in declared:
        _check_framing(d, header_length is not None)
    if header_length is not None and binary_total != binary_bytes:
        raise RequestError(
            f"the body carries {binary_bytes} byte(s) after its {len(header)}-byte JSON header, but the "
            f"inputs' parameters.binary_data_size add up to {binary_total}; they must be equal"
        )
    blob = memoryview(body)[len(header) :]
    inputs, offset = [], 0
    for d in declared:
        if d.binary_size is None:
            inputs.append(_from_json(d))
        else:
            inputs.append(_from_binary(d, blob[offset : offset + d.binary_size]))
            offset += d.binary_size
    return InferRequest(tuple(inputs), parameters, outputs, doc.get("id"))


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, int]:
    """The JSON part of ``body`` and the number of binary bytes after it."""
    if header_length is None:
        return body, 0
    digits = header_length.strip()
    n = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 1 <= n <= len(body):
        raise RequestError(
            f"header '{HEADER_LENGTH}' is {header_length!r}; it must be the byte length of the JSON part "
            f"of the body, an integer from 1 to {len(body)} (the body's length)"
        )
    return body[:n], len(body) - n


def _declared_inputs(doc: Mapping[str, Any]) -> list[_Declared]:
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        got = "none" if inputs is None else _kind(inputs)
        raise RequestError(
            f"'inputs' must be a non-empty list of input objects, got {got}; see GET /v2/models/<name> "
            f"for the model's inputs, e.g. {EXAMPLE}"
        )
    declared = []
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise RequestError(
                f"inputs[{i}] must be an object with 'name', 'datatype' and 'shape', got {_kind(item)}"
            )
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"inputs[{i}] has no 'name' (a non-empty string), got {_kind(name)}")
        datatype = item.get("datatype")
        if datatype not in _DATATYPES:
            raise RequestError(
                f"input '{name}': 'datatype' must be one of {', '.join(_DATATYPES)}, got {_short(datatype)}"
            )
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise RequestError(
                f"input '{name}': 'shape' must be a list of non-negative integers, got {_short(shape)}"
            )
        if 0 in shape:
            raise RequestError(
                f"input '{name}' has shape {shape}: empty tensors are not accepted; every dimension must "
                f"be at least 1"
            )
        params = _check_parameters(item.get("parameters"), f"input '{name}': 'parameters'")
        binary = params.get("binary_data_size")
        if binary is not None and not (_is_int(binary) and binary >= 0):
            raise RequestError(
                f"input '{name}': parameters.binary_data_size must be a non-negative integer, got "
                f"{_short(binary)}"
            )
        declared.append(_Declared(name, datatype, tuple(shape), item.get("data"), binary))
    names = [d.name for d in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RequestError(f"input(s) {twice} appear more than once; send each input once")
    return declared


def _check_parameters(params: Any, where: str) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RequestError(f"{where} must be a JSON object, got {_kind(params)}")
    for key, value in params.items():
        if not isinstance(value, str | int):
            raise RequestError(
                f"{where}: '{key}' is {_kind(value)}; a parameter must be a string, an integer or a boolean"
            )
        if isinstance(value, int) and not _INT64[0] <= value < _INT64[1]:
            raise RequestError(f"{where}: '{key}' is {value}; an integer parameter must fit 64 bits")
    return params


def _check_outputs(outputs: Any) -> tuple[dict[str, Any], ...] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise RequestError(f"'outputs' must be a list of objects with a 'name', got {_short(outputs)}")
    checked = []
    for o in outputs:
        params = _check_parameters(o.get("parameters"), f"output '{o['name']}': 'parameters'")
        checked.append({"name": o["name"], **({"parameters": params} if params else {})})
    return tuple(checked)


def _check_framing(d: _Declared, has_binary_part: bool) -> None:
    """The input sends its values one way, and a binary size fits its shape (before anything is
    allocated by that shape)."""
    count = math.prod(d.shape)
    if d.data is not None and d.binary_size is not None:
        raise RequestError(
            f"input '{d.name}' has both 'data' and parameters.binary_data_size; send its values one way"
        )
    if d.binary_size is None:
        if d.data is None:
            raise RequestError(
                f"input '{d.name}' carries no values; give 'data' (JSON) or parameters.binary_data_size "
                f"(binary, with the '{HEADER_LENGTH}' header)"
            )
        return
    if not has_binary_part:
        raise RequestError(
            f"input '{d.name}' declares binary_data_size but the request has no '{HEADER_LENGTH}' "
            f"header saying where the JSON part ends"
        )
    item = _ITEM_BYTES.get(d.datatype)
    if item is not None and d.binary_size != count * item:
        raise RequestError(
            f"input '{d.name}': binary_data_size is {d.binary_size} bytes but shape {list(d.shape)} of "
            f"{d.datatype} needs {count * item}"
        )
    if d.datatype == "BYTES" and d.binary_size < 4 * count:
        raise RequestError(
            f"input '{d.name}': binary_data_size is {d.binary_size} bytes, too few for the {count} "
            f"BYTES element(s) of shape {list(d.shape)} (each takes a 4-byte length, then its bytes)"
        )


def _numpy_dtype(d: _Declared) -> np.dtype:
    dtype = _NUMPY.get(d.datatype)
    if dtype is None:  # BF16: numpy has no such type, and no endpoint here takes it
        raise RequestError(f"input '{d.name}': datatype {d.datatype} is not accepted by this server")
    return dtype


def _from_json(d: _Declared) -> InferInput:
    """Check every JSON value against the datatype and the shape, and decode them."""
    count = math.prod(d.shape)
    values: list[Any] = []
    more = False
    for value in _flatten(d.data):
        if len(values) == count:
            more = True
            break
        problem = _value_problem(value, d.datatype)
        if problem is not None:
            raise RequestError(
                f"input '{d.name}': 'data' holds {_short(value)} at index {len(values)}; datatype "
                f"{d.datatype} takes {problem}"
            )
        values.append(value)
    if more or len(values) != count:
        raise RequestError(
            f"input '{d.name}': shape {list(d.shape)} needs {count} value(s) but 'data' holds "
            f"{'more' if more else len(values)}; send a shape that matches the data"
        )
    if d.datatype == "BYTES":
        encoded = []
        for i, text in enumerate(values):
            check_text(text, f"input '{d.name}': 'data' at index {i}")
            encoded.append(text.encode("utf-8"))
        array = np.empty(count, dtype=object)
        array[:] = encoded
        array = array.reshape(d.shape)
        return InferInput(d.name, d.datatype, d.shape, array, _bytes_elements(encoded))
    with np.errstate(over="ignore"):  # a float beyond FP16/FP32 becomes inf, as Triton reads it
        array = np.array(values, dtype=_numpy_dtype(d)).reshape(d.shape)
    return InferInput(d.name, d.datatype, d.shape, array, array.tobytes())


def _from_binary(d: _Declared, raw: memoryview) -> InferInput:
    """Decode an input's binary values (their size already matches the shape)."""
    count = math.prod(d.shape)
    if d.datatype == "BYTES":
        elements = _split_bytes_elements(d, raw, count)
        array = np.empty(count, dtype=object)
        array[:] = elements
        return InferInput(d.name, d.datatype, d.shape, array.reshape(d.shape), raw)
    dtype = _numpy_dtype(d)
    if d.datatype == "BOOL":  # any non-zero byte is true; forward the canonical 0/1
        array = (np.frombuffer(raw, dtype=np.uint8) != 0).reshape(d.shape)
        return InferInput(d.name, d.datatype, d.shape, array, array.tobytes())
    array = np.frombuffer(raw, dtype=dtype, count=count).reshape(d.shape)
    return InferInput(d.name, d.datatype, d.shape, array, raw)


def _split_bytes_elements(d: _Declared, raw: memoryview, count: int) -> list[bytes]:
    """The elements of a binary BYTES input: each a 4-byte little-endian length, then the bytes."""
    elements, offset = [], 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise RequestError(
                f"input '{d.name}': its binary data ends after {i} of the {count} BYTES element(s) its "
                f"shape {list(d.shape)} needs (each takes a 4-byte length, then its bytes)"
            )
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if size > len(raw) - offset:
            raise RequestError(
                f"input '{d.name}': BYTES element {i} declares {size} bytes but only {len(raw) - offset} "
                f"remain of its binary_data_size {len(raw)}"
            )
        elements.append(bytes(raw[offset : offset + size]))
        offset += size
    if offset != len(raw):
        raise RequestError(
            f"input '{d.name}': its {count} BYTES element(s) take {offset} bytes but binary_data_size "
            f"is {len(raw)}; they must be equal"
        )
    return elements


def _bytes_elements(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _flatten(data: Any) -> Iterator[Any]:
    """The scalars of a (possibly nested) JSON list, row-major; a scalar is one value."""
    if not isinstance(data, list):
        yield data
        return
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            yield item
        else:
            stack.pop()


def _value_problem(value: Any, datatype: str) -> str | None:
    """What ``datatype`` takes, if ``value`` is not that; None when it is."""
    if datatype == "BYTES":
        return None if isinstance(value, str) else "strings"
    if datatype == "BOOL":
        return None if isinstance(value, bool) else "true or false"
    if datatype.startswith(("INT", "UINT")):
        unsigned = datatype.startswith("U")
        bits = int(datatype.removeprefix("U").removeprefix("INT"))
        low, high = (0, 2**bits) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1))
        if _is_int(value) and low <= value < high:
            return None
        return f"{'unsigned' if unsigned else 'signed'} {bits}-bit integers"
    if isinstance(value, Unreadable):
        return "finite JSON numbers that fit a 64-bit float (send NaN or infinities in binary form)"
    return None if isinstance(value, int | float) and not isinstance(value, bool) else "numbers"
