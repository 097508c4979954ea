"""The wire contract between served models and their clients: names, dtypes, shapes, ports, errors.

Owns everything both sides must agree on — Triton model names, tensor names with their dtypes and
per-sample shapes, default host and ports, the request-id parameter and the machine-readable error
envelope. Servers and clients import these constants instead of spelling names themselves; the
critic server adds its endpoints here. Must not know about models, PyTriton or HTTP libraries.

Shapes are per sample, as Triton declares them: a batched request prepends the batch dimension
``B``, so ``tokens`` with per-sample shape ``(-1,)`` travels as ``[B, S]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

DEFAULT_HOST = "127.0.0.1"
"""Servers bind loopback unless told otherwise (Triton's own default would be 0.0.0.0)."""

REWARD_MODEL_NAME = "reward_model"
REWARD_DEFAULT_PORT = 5555


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of an endpoint.

    Attributes:
        name: the tensor's name on the wire.
        dtype: numpy dtype (``np.bytes_`` for UTF-8 strings, Triton ``BYTES``).
        shape: per-sample shape; ``-1`` marks a variable dimension.
        optional: whether a request may leave it out.
        doc: one line for error messages and the docs' contract table.
    """

    name: str
    dtype: type[np.generic]
    shape: tuple[int, ...]
    optional: bool = False
    doc: str = ""

    @property
    def wire_shape(self) -> str:
        """The batched shape as written in messages, e.g. ``[B, S]`` or ``[B, 1]``."""
        dims = ["S" if d == -1 else str(d) for d in self.shape]
        return "[" + ", ".join(["B", *dims]) + "]"

    @property
    def dtype_name(self) -> str:
        """``int64``, ``float32`` or ``bytes`` (UTF-8)."""
        return "bytes (UTF-8)" if self.dtype is np.bytes_ else np.dtype(self.dtype).name


SENTENCES = TensorSpec(
    "sentences", np.bytes_, (1,), optional=True, doc="UTF-8 text per row; tokenized by the server"
)
TOKENS = TensorSpec("tokens", np.int64, (-1,), optional=True, doc="right-padded token ids")
SEQUENCE_LENGTHS = TensorSpec(
    "sequence_lengths", np.int64, (1,), optional=True, doc="valid tokens per row, 1 ≤ length ≤ S"
)
REWARDS = TensorSpec("rewards", np.float32, (1,), doc="scalar head at index sequence_length − 1")

REWARD_INPUTS: tuple[TensorSpec, ...] = (SENTENCES, TOKENS, SEQUENCE_LENGTHS)
REWARD_OUTPUTS: tuple[TensorSpec, ...] = (REWARDS,)

REQUEST_ID_PARAMETER = "openaligner_request_id"
"""Optional Triton request parameter naming a request, so that an error about a merged batch can
say which of its requests were invalid and which were only rejected alongside them."""

_ENVELOPE_OPEN = "<<openaligner-error "
_ENVELOPE_CLOSE = " openaligner-error>>"

ErrorKind = Literal["bad_request", "rejected_batch"]


@dataclass(frozen=True)
class ErrorEnvelope:
    """A server error in machine-readable form, carried inside the HTTP error text.

    Triton returns one error text for every request that an inference call was serving, so a
    call that served several merged requests cannot fail only some of them. The envelope lets a
    client find out whether *its* request was at fault.

    Attributes:
        kind: ``bad_request`` (the requests listed in ``invalid`` are wrong) or
            ``rejected_batch`` (the call served several merged requests; those in ``valid`` were
            fine and can be resent unchanged).
        message: the human-readable explanation, the same text that precedes the envelope.
        invalid: request id (or ``#index`` when the request carried no id) → what is wrong.
        valid: ids (or ``#index``) of requests that were valid but rejected with the batch.
    """

    kind: ErrorKind
    message: str
    invalid: dict[str, str] = field(default_factory=dict)
    valid: tuple[str, ...] = ()

    def render(self) -> str:
        """The error text a server raises: the message, then the envelope on one line."""
        body = json.dumps(
            {"kind": self.kind, "message": self.message, "invalid": self.invalid, "valid": list(self.valid)}
        )
        return f"{self.message}\n{_ENVELOPE_OPEN}{body}{_ENVELOPE_CLOSE}"

    @classmethod
    def find(cls, text: str) -> ErrorEnvelope | None:
        """The envelope inside an error text (e.g. Triton's wrapped traceback), or None.

        Triton may escape the text (quotes as ``\\"``) when it nests it in its own message, so
        both forms are tried.
        """
        for candidate in (text, text.replace('\\"', '"').replace("\\\\", "\\")):
            start = candidate.rfind(_ENVELOPE_OPEN)
            end = candidate.find(_ENVELOPE_CLOSE, start + 1)
            if start < 0 or end < 0:
                continue
            try:
                data = json.loads(candidate[start + len(_ENVELOPE_OPEN) : end])
                return cls(
                    kind=data["kind"],
                    message=str(data["message"]),
                    invalid={str(k): str(v) for k, v in data.get("invalid", {}).items()},
                    valid=tuple(str(v) for v in data.get("valid", ())),
                )
            except (ValueError, KeyError, TypeError):
                continue
        return None
