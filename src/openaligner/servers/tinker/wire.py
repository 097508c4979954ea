"""The Tinker SDK's wire bodies: its protobuf messages (package ``tinker_public``) in a schema of
our own with the SDK's field numbers, and its JSON ``TensorData``.

Owns: decoding a ``forward_backward`` request body into frozen dataclasses of torch tensors,
encoding ``ForwardBackwardOutput`` and ``SampleResponse`` result bodies, reading JSON TensorData,
and :class:`WireError`, the one error every malformed body raises (naming the field and what was
expected; the server answers it with a 4xx). Must not know: models, losses' meaning, sessions,
HTTP routing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

# A densified tensor may hold at most this many elements: a sparse CSR tensor's shape is not
# bounded by the body's size, so a 1-KB request could otherwise ask for terabytes.
MAX_TENSOR_ELEMENTS = 1 << 26

# -- the schema -----------------------------------------------------------------------------------
# Field numbers, types and names as in the SDK's proto (tinker/proto/tinker_public_pb2, 0.38.0):
# the bytes are the contract, so a number here is never reused for something else. Fields the
# server neither reads nor writes (images' dimensions, provenance spans' contents, sampling
# params) are declared anyway where a message we parse contains them, so that they are parsed
# as what they are rather than skipped as unknown.

_PACKAGE = "tinker_public"
_T = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "double": _T.TYPE_DOUBLE,
    "int32": _T.TYPE_INT32,
    "int64": _T.TYPE_INT64,
    "uint32": _T.TYPE_UINT32,
    "bool": _T.TYPE_BOOL,
    "string": _T.TYPE_STRING,
    "bytes": _T.TYPE_BYTES,
}
# message name -> [(number, name, type, flags)]; type is a scalar, "enum:Name" or a message
# name; flags: "repeated", "optional" (proto3 explicit presence), "oneof:<name>", "map:<k>,<v>".
_MESSAGES: dict[str, list[tuple[int, str, str, str]]] = {
    "EncodedTextChunk": [(1, "tokens", "bytes", "")],
    "ImageDimensions": [(1, "width", "uint32", ""), (2, "height", "uint32", "")],
    "ImageChunk": [
        (1, "data", "bytes", ""),
        (2, "format", "string", ""),
        (3, "expected_tokens", "int32", "optional"),
        (4, "override_dimensions", "ImageDimensions", "optional"),
    ],
    "DmelChunk": [(1, "dmel", "bytes", "")],
    "Chunk": [
        (1, "encoded_text", "EncodedTextChunk", "oneof:chunk"),
        (2, "image", "ImageChunk", "oneof:chunk"),
        (3, "dmel", "DmelChunk", "oneof:chunk"),
    ],
    "SparseCsr": [
        (1, "values", "bytes", ""),
        (2, "crow_indices", "bytes", ""),
        (3, "col_indices", "bytes", ""),
    ],
    "Tensor": [
        (1, "dense", "bytes", "oneof:encoding"),
        (2, "sparse_csr", "SparseCsr", "oneof:encoding"),
        (3, "dtype", "enum:DType", ""),
        (4, "shape", "int64", "repeated"),
    ],
    "PromptProvenanceSpan": [
        (1, "sequence_id", "string", ""),
        (2, "offset", "int64", ""),
        (3, "length", "int64", ""),
    ],
    "SampledProvenanceSpan": [
        (1, "sequence_id", "string", ""),
        (2, "offset", "int64", ""),
        (3, "length", "int64", ""),
    ],
    "ProvenanceSpan": [
        (1, "prompt_tokens", "PromptProvenanceSpan", "oneof:span"),
        (2, "sampled_tokens", "SampledProvenanceSpan", "oneof:span"),
    ],
    "Datum": [
        (1, "model_input", "Chunk", "repeated"),
        (2, "loss_fn_inputs", "Tensor", "map:string,Tensor"),
        (3, "model_input_spans", "ProvenanceSpan", "repeated"),
        (4, "loss_fn_input_spans", "ProvenanceSpan", "repeated"),
    ],
    "LossConfigValue": [(1, "number", "double", "oneof:value"), (2, "text", "string", "oneof:value")],
    "ForwardBackwardRequest": [
        (1, "model_id", "string", ""),
        (2, "seq_id", "int32", ""),
        (3, "data", "Datum", "repeated"),
        (4, "loss_fn", "string", ""),
        (5, "loss_fn_config", "double", "map:string,double"),
        (6, "forward_only", "bool", ""),
        (7, "loss_fn_config_v2", "LossConfigValue", "map:string,LossConfigValue"),
    ],
    "BatchedTensor": [
        (1, "data", "bytes", ""),
        (2, "offsets", "bytes", ""),
        (3, "dtype", "enum:DType", ""),
        (4, "trailing_shape", "int64", "repeated"),
    ],
    "ArrayRecord": [
        (1, "type_tag", "string", ""),
        (2, "fields", "BatchedTensor", "map:string,BatchedTensor"),
        (3, "num_datums", "int64", ""),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", "string", ""),
        (2, "loss_fn_outputs", "ArrayRecord", "repeated"),
        (3, "metrics", "double", "map:string,double"),
    ],
    "TopkLogprobs": [
        (1, "token_ids", "bytes", ""),
        (2, "logprobs", "bytes", ""),
        (3, "k", "uint32", ""),
        (4, "length", "uint32", ""),
    ],
    "SampledSequence": [
        (1, "stop_reason", "enum:StopReason", ""),
        (2, "tokens", "bytes", ""),
        (3, "logprobs", "bytes", "optional"),
        (4, "topk_sampled_logprobs", "TopkLogprobs", "optional"),
    ],
    "PromptAltTokens": [(1, "tokens", "Tensor", ""), (2, "logprobs", "Tensor", "")],
    "SampleResponse": [
        (1, "sequences", "SampledSequence", "repeated"),
        (2, "prompt_logprobs", "bytes", "optional"),
        (3, "topk_prompt_logprobs", "TopkLogprobs", "optional"),
        (4, "prompt_cache_hit_tokens", "int32", ""),
        (5, "target_prompt_logprobs", "Tensor", "optional"),
        (6, "prompt_alt_tokens", "PromptAltTokens", "optional"),
    ],
}
_ENUMS = {
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
}
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASONS = {"stop": 0, "length": 1}


def _set_type(field: descriptor_pb2.FieldDescriptorProto, type_: str) -> None:
    if type_ in _SCALARS:
        field.type = _SCALARS[type_]
    elif type_.startswith("enum:"):
        field.type = _T.TYPE_ENUM
        field.type_name = f".{_PACKAGE}.{type_[5:]}"
    else:
        field.type = _T.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{type_}"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="openaligner_tinker_wire.proto", package=_PACKAGE, syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = fdp.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for message_name, fields in _MESSAGES.items():
        msg = fdp.message_type.add(name=message_name)
        oneofs: dict[str, int] = {}
        for number, name, type_, flags in fields:
            field = msg.field.add(name=name, number=number, label=_T.LABEL_OPTIONAL)
            if flags.startswith("map:"):
                key_type, value_type = flags[4:].split(",")
                entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
                entry = msg.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                _set_type(entry.field.add(name="key", number=1, label=_T.LABEL_OPTIONAL), key_type)
                _set_type(entry.field.add(name="value", number=2, label=_T.LABEL_OPTIONAL), value_type)
                field.label = _T.LABEL_REPEATED
                field.type = _T.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{message_name}.{entry_name}"
                continue
            _set_type(field, type_)
            if flags == "repeated":
                field.label = _T.LABEL_REPEATED
            elif flags == "optional" or flags.startswith("oneof:"):
                oneof = flags[6:] if flags.startswith("oneof:") else f"_{name}"
                if oneof not in oneofs:
                    oneofs[oneof] = len(msg.oneof_decl)
                    msg.oneof_decl.add(name=oneof)
                field.oneof_index = oneofs[oneof]
                field.proto3_optional = flags == "optional"
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor())


def _message_class(name: str) -> type[Message]:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


_ForwardBackwardRequest = _message_class("ForwardBackwardRequest")
_ForwardBackwardOutput = _message_class("ForwardBackwardOutput")
_SampleResponse = _message_class("SampleResponse")
_TensorMessage = _message_class("Tensor")


# -- errors and decoded requests ------------------------------------------------------------------


class WireError(ValueError):
    """A body that is not what the SDK sends: ``field`` names where (e.g.
    ``data[2].loss_fn_inputs['weights'].dense``), the message what was expected.
    ``http_status`` is the status to answer with (400, or 415 for an unsupported encoding)."""

    def __init__(self, field: str, message: str, *, http_status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.http_status = http_status


@dataclass(frozen=True)
class WireDatum:
    """One decoded ``Datum``: ``tokens`` [N] int64, its ``encoded_text`` chunks' token ids
    concatenated; ``inputs`` its ``loss_fn_inputs``, dense torch tensors (float32 or int64, the
    shape sent, [N] or [N, K]; CSR densified with 0). Provenance spans are not kept: only
    ``stable_reinforce`` reads them, and it is refused."""

    tokens: torch.Tensor
    inputs: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """A decoded ``POST /api/v1/forward_backward`` body (also ``forward``: ``forward_only``).

    ``loss_fn_config`` is ``loss_fn_config_v2`` when the client sent it (numbers as float, text
    as str), else the legacy map of floats; the SDK writes both for numbers."""

    model_id: str
    seq_id: int
    datums: tuple[WireDatum, ...]
    loss_fn: str
    loss_fn_config: Mapping[str, float | str]
    forward_only: bool


# -- decoding -------------------------------------------------------------------------------------

_WIRE_DTYPES: dict[int, tuple[np.dtype, torch.dtype]] = {
    DTYPE_FLOAT32: (np.dtype("<f4"), torch.float32),
    DTYPE_INT64: (np.dtype("<i8"), torch.int64),
}
_IDENTITY_ENCODINGS = ("", "identity")


def decode_forward_backward_request(
    body: bytes, content_encoding: str | None = None, *, max_tensor_elements: int = MAX_TENSOR_ELEMENTS
) -> ForwardBackwardRequest:
    """Decode a ``forward_backward`` body (``Content-Type: application/x-protobuf``).

    ``content_encoding`` is the request's ``Content-Encoding`` header: the SDK zstd-compresses
    only when client/config sets ``proto_compress_fwdbwd``, which this server never does, and
    it has no zstd decoder: anything but identity is refused (:class:`WireError`, 415). Every
    other problem — not protobuf, a wrong dtype or byte count, a shape that does not fit its
    data, an image chunk, a CSR tensor out of bounds — raises :class:`WireError` naming the
    field.
    """
    encoding = (content_encoding or "").strip().lower()
    if encoding not in _IDENTITY_ENCODINGS:
        raise WireError(
            "Content-Encoding",
            f"{content_encoding!r} is not accepted: send the body uncompressed (this server never sets "
            "proto_compress_fwdbwd in client/config, so the SDK does not compress it)",
            http_status=415,
        )
    msg: Any = _parse(_ForwardBackwardRequest, bytes(body), "ForwardBackwardRequest")
    datums = tuple(_datum(d, f"data[{i}]", max_tensor_elements) for i, d in enumerate(msg.data))
    config: dict[str, float | str] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind is None:
                raise WireError(f"loss_fn_config_v2[{key!r}]", "has neither a number nor a text value")
            config[key] = float(value.number) if kind == "number" else str(value.text)
    else:
        config = {key: float(value) for key, value in msg.loss_fn_config.items()}
    return ForwardBackwardRequest(
        model_id=str(msg.model_id),
        seq_id=int(msg.seq_id),
        datums=datums,
        loss_fn=str(msg.loss_fn),
        loss_fn_config=config,
        forward_only=bool(msg.forward_only),
    )


def _parse(cls: type[Message], body: bytes, what: str) -> Message:
    msg = cls()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # DecodeError, and whatever else the runtime raises on garbage
        raise WireError(what, f"not a valid protobuf {what} ({type(e).__name__}: {e})") from None
    return msg


def _datum(msg: Any, where: str, max_elements: int) -> WireDatum:
    tokens: list[np.ndarray] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            what = "an empty chunk" if kind is None else f"a {kind} chunk"
            raise WireError(
                f"{where}.model_input[{j}]",
                f"is {what}; this server serves text models and takes encoded_text chunks only",
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(
                f"{where}.model_input[{j}].encoded_text.tokens",
                f"has {len(raw)} bytes, expected a multiple of 4 (little-endian int32 token ids)",
            )
        ids = np.frombuffer(raw, dtype="<i4")
        if ids.size and int(ids.min()) < 0:
            raise WireError(f"{where}.model_input[{j}].encoded_text.tokens", "holds a negative token id")
        tokens.append(ids)
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype="<i4")
    inputs = {
        key: _tensor(value, f"{where}.loss_fn_inputs[{key!r}]", max_elements)
        for key, value in sorted(msg.loss_fn_inputs.items())
    }
    return WireDatum(tokens=torch.from_numpy(flat.astype(np.int64)), inputs=inputs)


def decode_tensor(
    body: bytes, *, pad_value: int = 0, max_elements: int = MAX_TENSOR_ELEMENTS
) -> torch.Tensor:
    """A serialized ``Tensor`` message as a dense torch tensor (see :func:`_tensor`)."""
    return _tensor(_parse(_TensorMessage, bytes(body), "Tensor"), "Tensor", max_elements, pad_value)


def _tensor(msg: Any, where: str, max_elements: int, pad_value: int = 0) -> torch.Tensor:
    """A ``Tensor`` message → a dense torch tensor. Dense: the bytes in the declared dtype
    (float32 or int64, little-endian), shaped by ``shape`` (1-D when the client sent none).
    Sparse CSR (2-D only): values in the dtype, crow / col indices int64; every unlisted cell
    is ``pad_value`` (0: what the SDK's ``to_torch`` fills in)."""
    if msg.dtype not in _WIRE_DTYPES:
        raise WireError(
            f"{where}.dtype", f"is {msg.dtype}, expected FLOAT32 (1) or INT64 (2), what the SDK writes"
        )
    np_dtype, torch_dtype = _WIRE_DTYPES[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise WireError(f"{where}.shape", f"{shape} has a negative dimension")
    if math.prod(shape) > max_elements:
        raise WireError(f"{where}.shape", f"{shape} holds more than {max_elements} elements")
    kind = msg.WhichOneof("encoding")
    if kind is None:
        raise WireError(where, "has neither dense nor sparse_csr data")
    if kind == "dense":
        values = _array(msg.dense, np_dtype, f"{where}.dense")
        if not shape:
            shape = [values.size]
        elif math.prod(shape) != values.size:
            raise WireError(
                f"{where}.dense", f"holds {values.size} values, but shape {shape} needs {math.prod(shape)}"
            )
        return torch.from_numpy(values.astype(np_dtype.newbyteorder("="))).reshape(shape).to(torch_dtype)
    return _csr(msg.sparse_csr, shape, np_dtype, torch_dtype, f"{where}.sparse_csr", pad_value)


def _array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(
            where, f"has {len(raw)} bytes, expected a multiple of {dtype.itemsize} ({dtype.name})"
        )
    return np.frombuffer(raw, dtype=dtype)


def _csr(
    msg: Any, shape: list[int], np_dtype: np.dtype, torch_dtype: torch.dtype, where: str, pad_value: int
) -> torch.Tensor:
    if len(shape) != 2:
        raise WireError(f"{where}", f"needs a 2-D shape (rows, columns), got {shape}")
    rows, cols = shape
    values = _array(msg.values, np_dtype, f"{where}.values")
    crow = _array(msg.crow_indices, np.dtype("<i8"), f"{where}.crow_indices").astype(np.int64)
    col = _array(msg.col_indices, np.dtype("<i8"), f"{where}.col_indices").astype(np.int64)
    nnz = values.size
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != nnz or bool((np.diff(crow) < 0).any()):
        raise WireError(
            f"{where}.crow_indices",
            f"expected {rows + 1} non-decreasing row pointers from 0 to the {nnz} values",
        )
    if col.size != nnz:
        raise WireError(f"{where}.col_indices", f"has {col.size} entries, expected one per value ({nnz})")
    row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow))
    if nnz and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(f"{where}.col_indices", f"expected column indices in [0, {cols})")
    if bool(((row_of[1:] == row_of[:-1]) & (col[1:] <= col[:-1])).any()):
        raise WireError(f"{where}.col_indices", "expected strictly increasing column indices within each row")
    dense = torch.full((rows, cols), pad_value, dtype=torch_dtype)
    dense[torch.from_numpy(row_of), torch.from_numpy(col)] = torch.from_numpy(
        values.astype(np_dtype.newbyteorder("="))
    ).to(torch_dtype)
    return dense


def tensor_from_json(
    obj: Any, field: str, *, pad_value: int = 0, max_elements: int = MAX_TENSOR_ELEMENTS
) -> torch.Tensor:
    """A JSON ``TensorData`` (``{"data": [...], "dtype": "float32"|"int64", "shape"?: [...],
    "sparse_crow_indices"?: [...], "sparse_col_indices"?: [...]}``) as a dense torch tensor.

    ``field`` names it in errors. Dense ``data`` is the flattened tensor (1-D when ``shape`` is
    absent); sparse CSR needs a 2-D ``shape``, and its unlisted cells are ``pad_value`` (e.g. -1
    for ``target_prompt_logprobs``, whose -1 cells request nothing). int64 data must be
    integers; float32 data numbers (the SDK writes finite ones).
    """
    if not isinstance(obj, Mapping):
        raise WireError(
            field, f"expected a TensorData object {{data, dtype, shape?}}, got {type(obj).__name__}"
        )
    unknown = sorted(set(obj) - {"data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices"})
    if unknown:
        raise WireError(field, f"has unknown key(s) {unknown}")
    dtype = obj.get("dtype")
    if dtype not in ("float32", "int64"):
        raise WireError(f"{field}.dtype", f"is {dtype!r}, expected 'float32' or 'int64'")
    is_int = dtype == "int64"
    data = _json_numbers(obj.get("data"), f"{field}.data", integers=is_int)
    shape_obj = obj.get("shape")
    shape = None if shape_obj is None else _json_numbers(shape_obj, f"{field}.shape", integers=True)
    if shape is not None and any(s < 0 for s in shape):
        raise WireError(f"{field}.shape", f"{shape} has a negative dimension")
    if shape is not None and math.prod(shape) > max_elements:
        raise WireError(f"{field}.shape", f"{shape} holds more than {max_elements} elements")
    np_dtype = np.dtype("<i8") if is_int else np.dtype("<f4")
    if is_int and any(not -(2**63) <= v < 2**63 for v in data):
        raise WireError(f"{field}.data", "holds an integer outside int64")
    values = np.asarray(data, dtype=np_dtype.newbyteorder("="))
    crow_obj, col_obj = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    if crow_obj is None and col_obj is None:
        shape = [values.size] if shape is None else shape
        if math.prod(shape) != values.size:
            raise WireError(
                f"{field}.data", f"holds {values.size} values, but shape {shape} needs {math.prod(shape)}"
            )
        return torch.from_numpy(values).reshape(shape)
    if crow_obj is None or col_obj is None or shape is None:
        raise WireError(
            field, "a sparse CSR TensorData needs sparse_crow_indices, sparse_col_indices and shape"
        )
    crow = np.asarray(_json_numbers(crow_obj, f"{field}.sparse_crow_indices", integers=True), dtype="<i8")
    col = np.asarray(_json_numbers(col_obj, f"{field}.sparse_col_indices", integers=True), dtype="<i8")
    parts = _CsrParts(values.astype(np_dtype).tobytes(), crow.tobytes(), col.tobytes())
    return _csr(parts, shape, np_dtype, torch.int64 if is_int else torch.float32, field, pad_value)


@dataclass(frozen=True)
class _CsrParts:
    """A JSON CSR tensor's parts as the proto ``SparseCsr`` holds them, so one check serves both."""

    values: bytes
    crow_indices: bytes
    col_indices: bytes


def _json_numbers(obj: Any, field: str, *, integers: bool) -> list[Any]:
    if not isinstance(obj, list):
        raise WireError(field, f"expected a list of numbers, got {type(obj).__name__}")
    for i, v in enumerate(obj):
        ok = (
            isinstance(v, int) and not isinstance(v, bool)
            if integers
            else isinstance(v, int | float) and not isinstance(v, bool)
        )
        if not ok:
            expected = "an integer" if integers else "a number"
            raise WireError(f"{field}[{i}]", f"is {v!r}, expected {expected}")
    return obj


# -- encoding -------------------------------------------------------------------------------------


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, torch.Tensor]],
    metrics: Mapping[str, float],
    *,
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """A ``ForwardBackwardOutput`` body: ``outputs[i]`` is datum i's tensors by name (e.g.
    ``logprobs`` and ``elementwise_loss``, float32 [N] or [N, K]), ``metrics`` keys
    ``"name:reduction"``.

    Each field becomes a ``BatchedTensor``: every datum's bytes concatenated, int64 byte offsets
    (n + 1), the dtype (FLOAT32 for floating tensors, INT64 for integer ones) and the trailing
    shape. Consecutive datums whose fields share trailing shapes and dtypes go into one
    ``ArrayRecord``; a change starts the next (the SDK concatenates records in order). Raises
    ValueError (a server bug, not the client's) when the datums' field names differ or a
    metric key is not ``"name:reduction"``.
    """
    from openaligner.algorithms.tinker_losses import check_metric_key

    for key in metrics:
        check_metric_key(key)
    names = sorted(outputs[0]) if outputs else []
    prepared: list[list[tuple[str, int, tuple[int, ...], np.ndarray]]] = []
    for i, datum in enumerate(outputs):
        if sorted(datum) != names:
            raise ValueError(f"datum {i} has output fields {sorted(datum)}, datum 0 has {names}")
        prepared.append([_batched_part(name, datum[name]) for name in names])
    msg: Any = _ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    start = 0
    while start < len(prepared):
        signature = [(dtype, trailing) for _, dtype, trailing, _ in prepared[start]]
        end = start + 1
        while end < len(prepared) and [(d, t) for _, d, t, _ in prepared[end]] == signature:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=end - start)
        for f, (name, dtype, trailing) in enumerate((n, d, t) for n, d, t, _ in prepared[start]):
            parts = [prepared[i][f][3] for i in range(start, end)]
            batched = record.fields[name]
            batched.data = b"".join(p.tobytes() for p in parts)
            batched.offsets = (
                np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64).astype("<i8").tobytes()
            )
            batched.dtype = dtype
            batched.trailing_shape.extend(trailing)
        start = end
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return bytes(msg.SerializeToString(deterministic=True))


def _batched_part(name: str, tensor: torch.Tensor) -> tuple[str, int, tuple[int, ...], np.ndarray]:
    t = tensor.detach().cpu()
    if t.dim() == 0:
        raise ValueError(f"output field {name!r} is a scalar; per-datum outputs are [N, ...] tensors")
    if t.is_floating_point():
        return name, DTYPE_FLOAT32, tuple(t.shape[1:]), t.to(torch.float32).contiguous().numpy().astype("<f4")
    return name, DTYPE_INT64, tuple(t.shape[1:]), t.to(torch.int64).contiguous().numpy().astype("<i8")


class SampledSequenceLike(Protocol):
    """What :func:`encode_sample_response` reads of one sample: ``tokens`` [T] int (the stop
    token included once, when it stopped on one), ``logprobs`` [T] float, ``stop_reason``
    ``"stop"`` or ``"length"``."""

    @property
    def tokens(self) -> torch.Tensor: ...
    @property
    def logprobs(self) -> torch.Tensor: ...
    @property
    def stop_reason(self) -> str: ...


@dataclass(frozen=True)
class TopkLogprobs:
    """Top-k per position: ``token_ids`` [L, k] int and ``logprobs`` [L, k] float, empty cells
    token 0 with log-prob -99999 (the SDK's sentinel; a row of them reads as None)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor


TOPK_EMPTY_LOGPROB = -99999.0


def encode_sample_response(
    sequences: Sequence[SampledSequenceLike],
    prompt_logprobs: torch.Tensor | None = None,
    *,
    topk_prompt_logprobs: TopkLogprobs | None = None,
    topk_sample_logprobs: Sequence[TopkLogprobs] | None = None,
) -> bytes:
    """A ``SampleResponse`` body.

    ``prompt_logprobs`` [P] float: the prompt's log-probs, NaN where undefined (position 0,
    which nothing predicts; the SDK reads NaN as None), or None when not asked for.
    ``topk_prompt_logprobs`` [P, k] and ``topk_sample_logprobs`` (one [T_i, k] per sequence)
    are optional. A sequence of zero tokens sends empty logprobs, which the SDK reads as None.
    Raises ValueError (a server bug) for a stop reason other than stop / length or tokens and
    logprobs of different lengths.
    """
    msg: Any = _SampleResponse()
    if topk_sample_logprobs is not None and len(topk_sample_logprobs) != len(sequences):
        raise ValueError(f"{len(topk_sample_logprobs)} top-k entries for {len(sequences)} sequences")
    for i, seq in enumerate(sequences):
        if seq.stop_reason not in STOP_REASONS:
            raise ValueError(f"sequence {i}: stop_reason {seq.stop_reason!r}, expected 'stop' or 'length'")
        tokens = _flat(seq.tokens, "<i4", torch.int64)
        logprobs = _flat(seq.logprobs, "<f4", torch.float32)
        if tokens.size != logprobs.size:
            raise ValueError(f"sequence {i}: {tokens.size} tokens but {logprobs.size} logprobs")
        out = msg.sequences.add(stop_reason=STOP_REASONS[seq.stop_reason], tokens=tokens.tobytes())
        out.logprobs = logprobs.tobytes()
        if topk_sample_logprobs is not None:
            _write_topk(out.topk_sampled_logprobs, topk_sample_logprobs[i], tokens.size, f"sequence {i}")
    if prompt_logprobs is not None:
        msg.prompt_logprobs = _flat(prompt_logprobs, "<f4", torch.float32).tobytes()
    if topk_prompt_logprobs is not None:
        rows = None if prompt_logprobs is None else int(prompt_logprobs.numel())
        _write_topk(msg.topk_prompt_logprobs, topk_prompt_logprobs, rows, "prompt")
    return bytes(msg.SerializeToString(deterministic=True))


def _flat(t: torch.Tensor, dtype: str, via: torch.dtype) -> np.ndarray:
    return t.detach().cpu().reshape(-1).to(via).numpy().astype(dtype)


def _write_topk(out: Any, topk: TopkLogprobs, rows: int | None, what: str) -> None:
    ids, lps = topk.token_ids, topk.logprobs
    if ids.dim() != 2 or ids.shape != lps.shape or (rows is not None and ids.shape[0] != rows):
        raise ValueError(
            f"{what}: top-k token_ids {list(ids.shape)} and logprobs {list(lps.shape)} "
            f"must both be [{rows}, k]"
        )
    out.token_ids = _flat(ids, "<i4", torch.int64).tobytes()
    out.logprobs = _flat(lps, "<f4", torch.float32).tobytes()
    out.length, out.k = int(ids.shape[0]), int(ids.shape[1])


__all__ = [
    "MAX_TENSOR_ELEMENTS",
    "TOPK_EMPTY_LOGPROB",
    "ForwardBackwardRequest",
    "SampledSequenceLike",
    "TopkLogprobs",
    "WireDatum",
    "WireError",
    "decode_forward_backward_request",
    "decode_tensor",
    "encode_forward_backward_output",
    "encode_sample_response",
    "tensor_from_json",
]
