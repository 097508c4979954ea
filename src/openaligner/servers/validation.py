"""Request checks that turn malformed inputs into one clear sentence each.

Owns the wording of every "your request is wrong" message (which input, what was expected, what
arrived, how to fix it): functions over plain numpy arrays that return checked arrays or raise
:class:`RequestError`, and :func:`parse_sequence_request` (the inference request the reward and
critic endpoints share). Must not know about PyTriton, torch.distributed or models.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from openaligner.protocol import (
    MESSAGES,
    METADATA,
    REWARD_INPUTS,
    SENTENCES,
    SEQUENCE_LENGTHS,
    TOKENS,
    TensorSpec,
)


class RequestError(ValueError):
    """A request that cannot be served as sent; the message says which input and what to send."""


def check_known_inputs(inputs: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> None:
    """Refuse input names the endpoint does not declare."""
    known = {s.name for s in specs}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise RequestError(f"unexpected input(s) {unknown}; this endpoint accepts {sorted(known)}")


def check_spec(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Check one batched input against its spec (dtype kind and rank); return it unchanged.

    Raises:
        RequestError: wrong dtype, wrong number of dimensions, or a fixed dimension that differs.
    """
    if spec.dtype is np.bytes_:
        if array.dtype.kind not in "SO":
            raise RequestError(
                f"input '{spec.name}': expected {spec.dtype_name} {spec.wire_shape}, got dtype {array.dtype}"
            )
    elif array.dtype != np.dtype(spec.dtype):
        raise RequestError(
            f"input '{spec.name}': expected {spec.dtype_name} {spec.wire_shape}, got dtype {array.dtype}"
        )
    want_ndim = 1 + len(spec.shape)
    fixed_ok = all(d == -1 or d == got for d, got in zip(spec.shape, array.shape[1:], strict=False))
    if array.ndim != want_ndim or not fixed_ok:
        raise RequestError(f"input '{spec.name}': expected shape {spec.wire_shape}, got {list(array.shape)}")
    return array


def check_whole_input(inputs: Mapping[str, np.ndarray], spec: TensorSpec) -> np.ndarray:
    """A required input of a non-batched endpoint (its spec's shape is the whole array's).

    Raises:
        RequestError: the input is missing, or its dtype or number of dimensions is wrong.
    """
    if spec.name not in inputs:
        raise RequestError(
            f"input '{spec.name}' ({spec.dtype_name} {spec.wire_shape}: {spec.doc}) is required"
        )
    array = inputs[spec.name]
    if array.dtype != np.dtype(spec.dtype) or array.ndim != len(spec.shape):
        raise RequestError(
            f"input '{spec.name}': expected {spec.dtype_name} {spec.wire_shape}, got {array.dtype} "
            f"{list(array.shape)}"
        )
    return array


def check_batch_size(rows: int, max_batch_size: int) -> None:
    """At least one row, at most ``max_batch_size``."""
    if rows < 1:
        raise RequestError("request has 0 rows; send at least one")
    if rows > max_batch_size:
        raise RequestError(
            f"request has {rows} rows; this server accepts at most {max_batch_size} per request "
            f"(server.max_batch_size): split it"
        )


def check_tokens(
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    vocab_size: int | None,
    max_sequence_length: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate right-padded ``tokens`` [B, S] and ``lengths`` [B, 1] (or [B]).

    Only the valid prefix of each row (``tokens[i, :lengths[i]]``) is checked against the
    vocabulary: padding may hold any id.

    Returns:
        ``tokens`` [B, S'] int64 (``S' = min(S, max_sequence_length)``) and ``lengths`` [B] int64.

    Raises:
        RequestError: naming the row and the bound that was broken.
    """
    rows, width = tokens.shape
    flat = lengths.reshape(-1)
    if flat.shape[0] != rows:
        raise RequestError(
            f"input 'sequence_lengths' has {flat.shape[0]} rows but 'tokens' has {rows}; "
            f"send one length per row"
        )
    if width < 1:
        raise RequestError("input 'tokens' has width 0; send at least one token per row")
    if rows == 0:
        raise RequestError("request has 0 rows; send at least one")
    if max_sequence_length is not None and int(flat.max()) > max_sequence_length:
        row = int(np.argmax(flat))
        raise RequestError(
            f"input 'sequence_lengths': row {row} has {int(flat[row])} tokens, more than the server's "
            f"max_sequence_length {max_sequence_length}; truncate the sequence"
        )
    bad = np.flatnonzero((flat < 1) | (flat > width))
    if bad.size:
        row = int(bad[0])
        raise RequestError(
            f"input 'sequence_lengths': row {row} is {int(flat[row])}; each length must lie in [1, {width}] "
            f"(1 to the width of 'tokens')"
        )
    if vocab_size is not None:
        valid = np.arange(width)[None, :] < flat[:, None]
        outside = valid & ((tokens < 0) | (tokens >= vocab_size))
        if outside.any():
            row, col = (int(i) for i in np.argwhere(outside)[0])
            raise RequestError(
                f"input 'tokens': row {row}, position {col} holds id {int(tokens[row, col])}, outside the "
                f"vocabulary [0, {vocab_size}) of the served model"
            )
    if max_sequence_length is not None and width > max_sequence_length:
        tokens = tokens[:, :max_sequence_length]  # only padding lies beyond every row's length
    return tokens.astype(np.int64, copy=False), flat.astype(np.int64, copy=False)


def decode_sentences(sentences: np.ndarray, name: str = SENTENCES.name) -> list[str]:
    """UTF-8 decode ``sentences`` [B, 1] (bytes or object of bytes) into B strings (``name``: the
    input, for messages)."""
    texts: list[str] = []
    for row, value in enumerate(sentences.reshape(-1)):
        if isinstance(value, str):
            texts.append(value)
            continue
        raw = bytes(value)
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(
                f"input '{name}': row {row} is not valid UTF-8 (byte {raw[e.start]:#04x} at offset "
                f"{e.start}); encode text with UTF-8"
            ) from None
    return texts


class RequestsFailed(Exception):
    """Raised by an endpoint's ``run`` when some requests of a formed batch could not be answered
    (e.g. a served reward function failed on them): their positions in the batch → why. The
    transport answers those requests with the reason and tells the others to resend."""

    def __init__(self, failed: dict[int, str]) -> None:
        super().__init__("; ".join(f"[{i}] {why}" for i, why in failed.items()))
        self.failed = failed


class UnauthorizedError(RequestError):
    """A request to a protected endpoint without the server's token, or with a wrong one."""


def check_aligned_width(tokens: np.ndarray, aligned: Mapping[str, np.ndarray]) -> None:
    """Tensors next-token aligned with ``tokens`` [N, S] must be [N, S-1].

    Raises:
        RequestError: naming the first input whose rows or width differ.
    """
    rows, width = tokens.shape
    if rows < 1:
        raise RequestError("input 'tokens' has 0 rows; send at least one")
    if width < 2:
        raise RequestError(
            f"input 'tokens' has width {width}; training needs at least 2 tokens per row (S ≥ 2)"
        )
    for name, array in aligned.items():
        if array.shape[0] != rows:
            raise RequestError(
                f"input '{name}' has {array.shape[0]} rows but 'tokens' has {rows}; send one row per sequence"
            )
        if array.shape[1] != width - 1:
            raise RequestError(
                f"input '{name}' has width {array.shape[1]} but 'tokens' has width {width}; "
                f"'{name}' is next-token aligned (position t is the value at token t, t < S-1), so it "
                f"must be {width - 1} wide (S-1)"
            )


def check_finite(name: str, array: np.ndarray) -> None:
    """Refuse NaN and ±inf, naming the first offending row and position."""
    bad = ~np.isfinite(array)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise RequestError(
            f"input '{name}': row {row}, position {col} is {array[row, col]}; {name} must be finite "
            f"({int(bad.sum())} non-finite value(s) in all)"
        )


def check_mask(mask: np.ndarray, name: str = "mask") -> None:
    """A mask holds only 0 and 1 and marks at least one position."""
    outside = (mask != 0) & (mask != 1)
    if outside.any():
        row, col = (int(i) for i in np.argwhere(outside)[0])
        raise RequestError(
            f"input '{name}': row {row}, position {col} is {mask[row, col]}; a mask holds only 0 (ignored) "
            f"and 1 (trained)"
        )
    if not mask.any():
        raise RequestError(f"input '{name}' is all zeros: no position would be trained; send at least one 1")


def check_token_ids(tokens: np.ndarray, vocab_size: int | None, name: str = "tokens") -> None:
    """Every id in ``tokens`` lies in ``[0, vocab_size)`` (all positions: training reads them all)."""
    if vocab_size is None:
        return
    outside = (tokens < 0) | (tokens >= vocab_size)
    if outside.any():
        row, col = (int(i) for i in np.argwhere(outside)[0])
        raise RequestError(
            f"input '{name}': row {row}, position {col} holds id {int(tokens[row, col])}, outside the "
            f"vocabulary [0, {vocab_size}) of the served model (padding must be a valid id too, e.g. 0)"
        )


# ----------------------------------------------------------------------------- sequence requests
TokenizeFn = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]
RenderFn = Callable[[list[list[dict[str, str]]], int | None], tuple[torch.Tensor, torch.Tensor]]
"""``(conversations, max_length) -> (tokens [B, S] int64 right-padded, lengths [B] int64)``: each
conversation (its last message the assistant's response) laid out as the model was trained; raises
:class:`RequestError` for a conversation it cannot lay out."""

_MESSAGES_SHAPE = (
    'a JSON list of {"role": str, "content": str} objects, at least a user message and, last, the '
    "assistant's response"
)


def decode_messages(messages: np.ndarray) -> list[list[dict[str, str]]]:
    """The conversations of ``messages`` [B, 1]: one UTF-8 JSON list of ``{"role", "content"}``
    per row, ending with the assistant's response.

    Raises:
        RequestError: naming the row and what was expected.
    """
    conversations: list[list[dict[str, str]]] = []
    for row, text in enumerate(decode_sentences(messages, MESSAGES.name)):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(
                f"input '{MESSAGES.name}': row {row} is not JSON ({e.msg} at character {e.pos}); "
                f"send {_MESSAGES_SHAPE}"
            ) from None
        ok = (
            isinstance(value, list)
            and len(value) >= 2
            and all(
                isinstance(m, dict)
                and set(m) == {"role", "content"}
                and isinstance(m["role"], str)
                and isinstance(m["content"], str)
                for m in value
            )
        )
        if not ok or value[-1]["role"] != "assistant":
            raise RequestError(f"input '{MESSAGES.name}': row {row} is {text[:80]!r}; send {_MESSAGES_SHAPE}")
        conversations.append([{"role": m["role"], "content": m["content"]} for m in value])
    return conversations


"""``texts -> (tokens [B, S] int64 right-padded, lengths [B] int64)``."""


@dataclass(frozen=True)
class SequenceRequest:
    """One validated inference request of the reward model or the critic: ``tokens`` [b, S] int64,
    ``lengths`` [b] int64."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


def parse_sequence_request(
    inputs: Mapping[str, np.ndarray],
    *,
    tokenize_func: TokenizeFn | None,
    vocab_size: int | None,
    max_sequence_length: int | None,
    max_batch_size: int,
    render_func: RenderFn | None = None,
) -> SequenceRequest:
    """Check one ``sentences``, ``messages`` or ``tokens`` + ``sequence_lengths`` request and
    convert it to tensors; shared by the reward model's and the critic's inference endpoints
    (``sentences`` wins over ``messages``, which wins over ``tokens``).

    Raises:
        RequestError: which input is wrong and what was expected.
    """
    check_known_inputs(inputs, REWARD_INPUTS)
    if METADATA.name in inputs:
        raise RequestError(
            f"input '{METADATA.name}' is read by a server that scores text with a reward function "
            "(serve-reward reward.function=...); this one scores with a model alone: leave it out"
        )
    if SENTENCES.name in inputs:
        sentences = check_spec(inputs[SENTENCES.name], SENTENCES)
        return _from_sentences(sentences, tokenize_func, max_sequence_length, max_batch_size)
    if MESSAGES.name in inputs:
        messages = check_spec(inputs[MESSAGES.name], MESSAGES)
        if render_func is None:
            raise RequestError(
                f"this server has no tokenizer to lay out conversations with, so '{MESSAGES.name}' "
                f"cannot be served; send '{TOKENS.name}' with '{SEQUENCE_LENGTHS.name}' instead"
            )
        check_batch_size(messages.shape[0], max_batch_size)
        rendered, rendered_lengths = render_func(decode_messages(messages), max_sequence_length)
        return SequenceRequest(rendered.to(torch.int64), rendered_lengths.reshape(-1).to(torch.int64))
    if TOKENS.name not in inputs:
        raise RequestError(
            f"request has neither '{TOKENS.name}' nor '{SENTENCES.name}'; send '{TOKENS.name}' "
            f"({TOKENS.dtype_name} {TOKENS.wire_shape}) with '{SEQUENCE_LENGTHS.name}' "
            f"({SEQUENCE_LENGTHS.dtype_name} {SEQUENCE_LENGTHS.wire_shape}), or '{SENTENCES.name}' "
            f"({SENTENCES.dtype_name} {SENTENCES.wire_shape})"
        )
    tokens = check_spec(inputs[TOKENS.name], TOKENS)
    if SEQUENCE_LENGTHS.name not in inputs:
        raise RequestError(
            f"input '{SEQUENCE_LENGTHS.name}' ({SEQUENCE_LENGTHS.dtype_name} "
            f"{SEQUENCE_LENGTHS.wire_shape}) is required with '{TOKENS.name}': the number of valid "
            f"tokens in each row"
        )
    lengths = check_spec(inputs[SEQUENCE_LENGTHS.name], SEQUENCE_LENGTHS)
    check_batch_size(tokens.shape[0], max_batch_size)
    tokens, flat = check_tokens(
        tokens, lengths, vocab_size=vocab_size, max_sequence_length=max_sequence_length
    )
    return SequenceRequest(torch.from_numpy(np.array(tokens)), torch.from_numpy(np.array(flat)))


def _from_sentences(
    sentences: np.ndarray,
    tokenize_func: TokenizeFn | None,
    max_sequence_length: int | None,
    max_batch_size: int,
) -> SequenceRequest:
    if tokenize_func is None:
        raise RequestError(
            f"this server has no tokenizer, so '{SENTENCES.name}' cannot be served; send "
            f"'{TOKENS.name}' with '{SEQUENCE_LENGTHS.name}' instead"
        )
    check_batch_size(sentences.shape[0], max_batch_size)
    texts = decode_sentences(sentences)
    tokens, lengths = tokenize_func(texts)
    lengths = lengths.reshape(-1).to(torch.int64)
    empty = (lengths < 1).nonzero()
    if empty.numel():
        raise RequestError(
            f"input '{SENTENCES.name}': row {int(empty[0])} has no tokens; send non-empty text"
        )
    if max_sequence_length is not None and tokens.shape[1] > max_sequence_length:
        tokens = tokens[:, :max_sequence_length]
        lengths = lengths.clamp(max=max_sequence_length)
    return SequenceRequest(tokens.to(torch.int64), lengths)
