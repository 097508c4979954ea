"""The wire contract between served models and their clients: names, dtypes, shapes, ports, errors.

Owns everything both sides must agree on: Triton model names, tensor names with dtypes and
per-sample shapes (a batched request prepends ``B``), default host and ports, the request-id and
token parameters and the error envelope. Must not know about models, PyTriton or HTTP libraries.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
        wire: the whole shape as written in messages, for tensors of a non-batched endpoint
            (e.g. ``[N, S-1]``); ``None`` derives the batched form from ``shape``.
    """

    name: str
    dtype: type[np.generic]
    shape: tuple[int, ...]
    optional: bool = False
    doc: str = ""
    wire: str | None = None

    @property
    def wire_shape(self) -> str:
        """The shape as written in messages, e.g. ``[B, S]``, ``[B, 1]`` or ``[N, S-1]``."""
        if self.wire is not None:
            return self.wire
        dims = ["S" if d == -1 else str(d) for d in self.shape]
        return "[" + ", ".join(["B", *dims]) + "]"

    @property
    def dtype_name(self) -> str:
        """``int64``, ``float32`` or ``bytes`` (UTF-8)."""
        return "bytes (UTF-8)" if self.dtype is np.bytes_ else np.dtype(self.dtype).name


SENTENCES = TensorSpec(
    "sentences", np.bytes_, (1,), optional=True, doc="UTF-8 text per row; tokenized by the server"
)
MESSAGES = TensorSpec(
    "messages",
    np.bytes_,
    (1,),
    optional=True,
    doc='UTF-8 JSON conversation per row, [{"role", "content"}, ...] ending with the assistant\'s '
    "response; laid out by the server as its model was trained",
)
METADATA = TensorSpec(
    "metadata",
    np.bytes_,
    (1,),
    optional=True,
    doc='UTF-8 JSON object per row (e.g. {"answer": "42"}), with `messages`, for a served reward function',
)
TOKENS = TensorSpec("tokens", np.int64, (-1,), optional=True, doc="right-padded token ids")
SEQUENCE_LENGTHS = TensorSpec(
    "sequence_lengths", np.int64, (1,), optional=True, doc="valid tokens per row, 1 ≤ length ≤ S"
)
REWARDS = TensorSpec("rewards", np.float32, (1,), doc="scalar head at index sequence_length − 1")

REWARD_INPUTS: tuple[TensorSpec, ...] = (SENTENCES, MESSAGES, METADATA, TOKENS, SEQUENCE_LENGTHS)
REWARD_OUTPUTS: tuple[TensorSpec, ...] = (REWARDS,)

# -- critic server ---------------------------------------------------------------------------
# critic_infer is batched (shapes per sample, B prepended); critic_train and critic_save are not
# (shapes are the whole tensor: N rollout rows, S tokens, S-1 next-token-aligned positions).

CRITIC_INFER_NAME = "critic_infer"
CRITIC_TRAIN_NAME = "critic_train"
CRITIC_SAVE_NAME = "critic_save"
CRITIC_DEFAULT_PORT = 5556

VALUES = TensorSpec("values", np.float32, (-1,), doc="value at every token (0 at index ≥ sequence_length)")

CRITIC_INFER_INPUTS: tuple[TensorSpec, ...] = (SENTENCES, TOKENS, SEQUENCE_LENGTHS)
"""The critic scores the policy's token ids (it shares the policy's tokenizer): no ``messages``."""
CRITIC_INFER_OUTPUTS_COMBINED: tuple[TensorSpec, ...] = (VALUES, REWARDS)
CRITIC_INFER_OUTPUTS_SEPARATE: tuple[TensorSpec, ...] = (VALUES,)

TRAIN_TOKENS = TensorSpec("tokens", np.int64, (-1, -1), doc="rollout tokens, right-padded", wire="[N, S]")
RETURNS = TensorSpec("returns", np.float32, (-1, -1), doc="value targets (GAE returns)", wire="[N, S-1]")
PREV_VALUES = TensorSpec("prev_values", np.float32, (-1, -1), doc="values at rollout time", wire="[N, S-1]")
MASK = TensorSpec("mask", np.float32, (-1, -1), doc="1 = position trained, 0 = ignored", wire="[N, S-1]")


def _scalar(name: str, dtype: type[np.generic], doc: str) -> TensorSpec:
    return TensorSpec(name, dtype, (1,), doc=doc, wire="[1]")


LOSS_MEAN = _scalar("loss_mean", np.float32, "clipped value loss, mean over the request's optimizer steps")
CLIP_FRACTION = _scalar("clip_fraction", np.float32, "share of valid positions whose value was clipped")
EXPLAINED_VARIANCE = _scalar(
    "explained_variance", np.float32, "1 − Var(returns − values) / Var(returns), values before each step"
)
EXPLAINED_VARIANCE_AFTER = _scalar(
    "explained_variance_after", np.float32, "the same, of the values after the request's update (same rows)"
)
GRAD_NORM = _scalar("grad_norm", np.float32, "gradient norm before clipping, mean over the steps")
LR = _scalar("lr", np.float32, "learning rate of the request's last step")
STEP = _scalar("step", np.int64, "critic optimizer steps taken so far (all requests)")
OPTIMIZER_STEPS = _scalar(
    "optimizer_steps", np.int64, "optimizer steps this request ran (any skipped for an inf/NaN gradient too)"
)

CRITIC_TRAIN_INPUTS: tuple[TensorSpec, ...] = (TRAIN_TOKENS, RETURNS, PREV_VALUES, MASK)
CRITIC_TRAIN_OUTPUTS: tuple[TensorSpec, ...] = (
    LOSS_MEAN,
    CLIP_FRACTION,
    EXPLAINED_VARIANCE,
    GRAD_NORM,
    LR,
    STEP,
    OPTIMIZER_STEPS,
    EXPLAINED_VARIANCE_AFTER,
)

DUMMY_VAR = _scalar("dummy_var", np.int64, "any value; there because a Triton model needs an input")
RESTORE_STEP = TensorSpec(
    "restore_step",
    np.int64,
    (1,),
    optional=True,
    doc="instead of saving, go back to the server's own checkpoint of this critic step",
    wire="[1]",
)
STATUS = _scalar("status", np.int64, "0 = done: checkpoint written (or restored)")

CRITIC_SAVE_INPUTS: tuple[TensorSpec, ...] = (DUMMY_VAR, RESTORE_STEP)
CRITIC_SAVE_OUTPUTS: tuple[TensorSpec, ...] = (STATUS, STEP)

TOKENIZER_ROUTE = "/v2/models/{model}/tokenizer"
"""GET route the HTTP front answers itself (Triton never sees it) with the JSON
:func:`tokenizer_description` of the tokenizer the model lays text out with."""


def tokenizer_route(model: str) -> str:
    """The :data:`TOKENIZER_ROUTE` of ``model``."""
    return TOKENIZER_ROUTE.format(model=model)


def tokenizer_description(
    name: str | None, fingerprint: str | None, vocab_fingerprint: str | None
) -> dict[str, object]:
    """What a server says of its tokenizer: ``{"tokenizer": null}`` when it has none, else its
    ``name`` (where it was loaded from), ``fingerprint`` (tokenizer + the sequence layout the model
    was trained with) and ``vocab_fingerprint`` (tokenizer alone), sha256 hex digests. A server
    that scores text with a reward function adds ``"reads": "text"`` (:func:`text_reader`)."""
    if fingerprint is None:
        return {"tokenizer": None}
    return {"tokenizer": {"name": name, "fingerprint": fingerprint, "vocab_fingerprint": vocab_fingerprint}}


def text_reader(description: Mapping[str, object]) -> dict[str, object]:
    """The tokenizer description of a server that reads only text (``messages``): a reward
    function's, alone or with a model (whose tokenizer the description still names)."""
    return {**description, "reads": "text"}


def reads_text(description: Mapping[str, object]) -> bool:
    """Whether a tokenizer description is a :func:`text_reader`'s."""
    return description.get("reads") == "text"


TOKEN_PARAMETER = "openaligner_token"
"""Triton request parameter carrying the shared secret that ``critic_train`` / ``critic_save``
require when the server has one."""
TOKEN_ENV = "OPENALIGNER_TOKEN"
"""Environment variable a server and a client read the shared secret from when their config has none."""

REQUEST_ID_PARAMETER = "openaligner_request_id"
"""Optional Triton request parameter naming a request, so that an error about a merged batch can
say which of its requests were invalid and which were only rejected alongside them."""

_ENVELOPE_OPEN = "<<openaligner-error "
_ENVELOPE_CLOSE = " openaligner-error>>"

ErrorKind = Literal["bad_request", "rejected_batch", "unauthorized"]


@dataclass(frozen=True)
class ErrorEnvelope:
    """A server error in machine-readable form, carried inside the HTTP error text.

    Triton returns one error text for every request that an inference call was serving, so a
    call that served several merged requests cannot fail only some of them. The envelope lets a
    client find out whether *its* request was at fault.

    Attributes:
        kind: ``bad_request`` (the requests listed in ``invalid`` are wrong),
            ``rejected_batch`` (the call served several merged requests; those in ``valid`` were
            fine and can be resent unchanged) or ``unauthorized`` (a missing or wrong token).
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
