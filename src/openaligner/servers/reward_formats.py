"""The field's reward-server wire formats, answered by the reward model server beside KServe v2.

Owns OpenRLHF's ``POST /get_reward``, slime's ``POST /remote_rm`` and vLLM's / SGLang's
``POST /classify``: each body becomes an ordinary ``reward_model`` request and its answer is
written back in the format; and :class:`TextReading`, the one rule for how their text is read.
Must not know about HTTP (the front serves these routes), Triton or models.
Design notes (bodies, text reading): docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from openaligner.protocol import MESSAGES, METADATA, REWARDS, SENTENCES, SEQUENCE_LENGTHS, TOKENS
from openaligner.servers.reward_function import MAX_METADATA_BYTES
from openaligner.servers.transport.strict_json import (
    check_text,
    first_unreadable,
    is_int,
    kind,
    read_json,
    short,
)
from openaligner.servers.validation import RequestError

OPENRLHF_PATH = "/get_reward"
REMOTE_RM_PATH = "/remote_rm"
CLASSIFY_PATHS = ("/classify", "/v1/classify")

OPENRLHF_EXAMPLE = '{"query": ["Q: 2+2? A: 4"], "prompts": ["Q: 2+2? A:"], "labels": ["4"]}'
REMOTE_RM_EXAMPLE = '{"prompt": "Q: 2+2? A:", "response": " 4", "label": "4"}'
CLASSIFY_EXAMPLE = '{"model": "reward_model", "input": "Q: 2+2? A: 4", "use_activation": false}'

Message = dict[str, str]


# ----------------------------------------------------------------------------- rows → inputs
@dataclass(frozen=True)
class Row:
    """One sample as a client sent it: a ``response`` after a ``prompt`` (a string, or a
    conversation of messages), or — ``prompt`` None — a whole text in ``response``; ``label`` is
    the sample's label (``has_label`` False: none was sent)."""

    response: str
    prompt: str | list[Message] | None = None
    label: Any = None
    has_label: bool = False


@dataclass(frozen=True)
class TextReading:
    """How the served reward reads text (docs/serving.md, "Module notes").

    Attributes:
        function: a reward function scores the rows (it reads ``messages`` and ``metadata``).
        model: a reward model scores them (alone or with the function).
        rendered_prompts: the model was trained with a chat template, so a prompt string is taken
            as already rendered.
    """

    function: bool
    model: bool
    rendered_prompts: bool = False

    def model_reads_whole_text(self, row: Row) -> bool:
        """Whether the model reads ``row`` as one text (``sentences``) rather than a conversation."""
        return row.prompt is None or (isinstance(row.prompt, str) and self.rendered_prompts)


def conversation(row: Row) -> list[Message]:
    """``row`` as a conversation ending with the assistant's response (a whole text: an empty user
    message, then the text)."""
    if isinstance(row.prompt, list):
        return [*row.prompt, {"role": "assistant", "content": row.response}]
    return [{"role": "user", "content": row.prompt or ""}, {"role": "assistant", "content": row.response}]


def whole_text(row: Row) -> str:
    """``row`` as one text: ``prompt + response`` (a prompt string), or the whole text itself."""
    assert not isinstance(row.prompt, list)
    return (row.prompt or "") + row.response


def _bytes_column(texts: Sequence[str]) -> np.ndarray:
    column = np.empty((len(texts), 1), dtype=object)
    column[:, 0] = [t.encode("utf-8") for t in texts]
    return column


def text_inputs(rows: Sequence[Row], reading: TextReading) -> dict[str, np.ndarray]:
    """The ``reward_model`` inputs that score ``rows`` as ``reading`` says: ``messages`` (+
    ``metadata``) for a reward function, and for the model ``sentences`` or ``messages`` [B, 1].

    Raises:
        RequestError: rows the model would read in different ways in one request.
    """
    whole = [reading.model_reads_whole_text(r) for r in rows]
    inputs: dict[str, np.ndarray] = {}
    if reading.model and any(whole):
        if not all(whole):
            raise RequestError(
                "this request mixes conversations with whole texts; send one kind of sample per request"
            )
        inputs[SENTENCES.name] = _bytes_column([whole_text(r) for r in rows])
    if reading.function or not any(whole):
        inputs[MESSAGES.name] = _bytes_column([json.dumps(conversation(r)) for r in rows])
    if reading.function and any(r.has_label for r in rows):
        labels = [{"label": r.label} if r.has_label else {} for r in rows]
        inputs[METADATA.name] = _bytes_column([json.dumps(m) for m in labels])
    return inputs


def token_inputs(rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """``tokens`` [B, S] (right-padded with 0) and ``sequence_lengths`` [B, 1] of token-id rows."""
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    lengths = np.array([[len(r)] for r in rows], dtype=np.int64)
    return {TOKENS.name: tokens, SEQUENCE_LENGTHS.name: lengths}


def rewards_of(outputs: Mapping[str, np.ndarray]) -> list[float]:
    """The ``rewards`` output [B, 1] as one float per row."""
    return [float(x) for x in np.asarray(outputs[REWARDS.name]).reshape(-1)]


def tokens_scored(checked: Any) -> int:
    """Tokens the model read for a request, from what the endpoint's check returned (0 when no
    model read any)."""
    sequences = getattr(checked, "sequences", checked)
    lengths = getattr(sequences, "lengths", None)
    return int(lengths.sum()) if lengths is not None else 0


# ----------------------------------------------------------------------------- field checks
def _object(doc: Any, example: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RequestError(f"request body must be a JSON object, got {kind(doc)}; e.g. {example}")
    return doc


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {kind(value)} {short(value)}")
    check_text(value, where)
    return value


def _strings(value: Any, where: str, example: str) -> list[str]:
    """A non-empty list of strings (a single string is one)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        got = "none" if value is None else f"{kind(value)} {short(value)}"
        raise RequestError(f"'{where}' must be a non-empty list of strings, got {got}; e.g. {example}")
    return [_string(v, f"'{where}'[{i}]") for i, v in enumerate(value)]


def _same_length(value: Any, where: str, rows: int, of: str) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != rows:
        got = f"{len(value)} items" if isinstance(value, list) else f"{kind(value)} {short(value)}"
        raise RequestError(f"'{where}' must be a list of {rows} item(s), one per '{of}', got {got}")
    return value


def _label(value: Any, where: str) -> Any:
    """A sample's label: plain JSON that fits the function's ``metadata`` row."""
    bad = first_unreadable(value)
    if bad is not None:
        raise RequestError(f"{where} holds {short(bad)}; a label must be plain JSON")
    try:
        size = len(json.dumps({"label": value}).encode("utf-8"))
    except RecursionError:
        raise RequestError(f"{where} nests JSON too deeply") from None
    if size > MAX_METADATA_BYTES:
        raise RequestError(f"{where} takes {size} bytes as metadata, over the limit of {MAX_METADATA_BYTES}")
    return value


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            f'{where} must be a non-empty list of messages, each {{"role": str, "content": str}}, got '
            f"{kind(value)} {short(value)}"
        )
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise RequestError(
                f'{where}[{i}] must be a message {{"role": str, "content": str}}, got {short(m)}'
            )
        out.append(
            {
                "role": _string(m["role"], f"{where}[{i}].role"),
                "content": _string(m["content"], f"{where}[{i}].content"),
            }
        )
    return out


def _flag(doc: Mapping[str, Any], key: str) -> bool | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true, false or null, got {kind(value)} {short(value)}")
    return value


# ----------------------------------------------------------------------------- the formats
_MODEL_INPUT = re.compile(r"input '(?:\w+)'(?:: row (\d+)(?:, position (\d+))?)?")
"""A refusal's name for the ``reward_model`` input (and row, position) at fault."""


@dataclass(frozen=True)
class _Translation:
    """``inputs`` for the model, how to ``write`` the answer, and the client's names for them:
    ``fields[row]`` names where row ``row`` came from (e.g. ``'query'[2]``); ``text`` is how the
    format sends a sample as plain text."""

    inputs: Mapping[str, np.ndarray]
    write: Callable[[Mapping[str, np.ndarray], Any], Any]
    fields: Sequence[str]
    text: str

    def answer(self, outputs: Mapping[str, np.ndarray], checked: Any) -> Any:
        return self.write(outputs, checked)

    def explain(self, message: str) -> str:
        """``message`` (a refusal of the model's inputs) in the client's terms: ``input 'tokens':
        row 1, position 4`` becomes ``'input'[1], token 4,`` — the client never sent ``tokens``."""

        def field(match: re.Match[str]) -> str:
            if match.group(1) is None:  # the whole input: the client's field without an index
                return re.sub(r"\[\d+\]$", "", self.fields[0])
            name = self.fields[min(int(match.group(1)), len(self.fields) - 1)]
            return name if match.group(2) is None else f"{name}, token {match.group(2)},"

        return _MODEL_INPUT.sub(field, message).replace(f"'{SENTENCES.name}'", self.text)


@dataclass(frozen=True)
class OpenRLHFRoute:
    """OpenRLHF's remote reward model: ``POST /get_reward``.

    A ``query`` is the whole sequence (prompt and response, decoded by the trainer); when it starts
    with its entry of ``prompts``, the rest is the response. ``labels`` reach a reward function as
    ``metadata["label"]``. Every query of one request is read the same way: if one does not start
    with its prompt, all are read as whole texts.
    """

    model: str
    reading: TextReading
    paths: tuple[str, ...] = (OPENRLHF_PATH,)
    title: str = "OpenRLHF"

    def translate(self, body: bytes) -> _Translation:
        doc = _object(read_json(body, f"a JSON object, e.g. {OPENRLHF_EXAMPLE}"), OPENRLHF_EXAMPLE)
        queries = _strings(doc.get("query"), "query", OPENRLHF_EXAMPLE)
        prompts = _same_length(doc.get("prompts"), "prompts", len(queries), "query")
        labels = _same_length(doc.get("labels"), "labels", len(queries), "query")
        if prompts is not None:
            prompts = [_string(p, f"'prompts'[{i}]") for i, p in enumerate(prompts)]
        split = prompts is not None and all(q.startswith(p) for q, p in zip(queries, prompts, strict=True))
        rows = []
        for i, query in enumerate(queries):
            label = (
                {} if labels is None else {"label": _label(labels[i], f"'labels'[{i}]"), "has_label": True}
            )
            if split:
                assert prompts is not None
                rows.append(Row(query[len(prompts[i]) :], prompts[i], **label))
            else:
                rows.append(Row(query, None, **label))
        fields = [f"'query'[{i}]" for i in range(len(queries))]
        return _Translation(text_inputs(rows, self.reading), self._write, fields, "a 'query'")

    @staticmethod
    def _write(outputs: Mapping[str, np.ndarray], checked: Any) -> Any:
        rewards = rewards_of(outputs)
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    @staticmethod
    def error(status: int, message: str) -> Any:
        return {"error": message}


@dataclass(frozen=True)
class RemoteRMRoute:
    """slime's ``remote_rm``: one sample per request, ``POST /remote_rm``; answers the reward as a
    bare number, or ``{reward_key: number}`` when ``reward_key`` is set (slime's ``--reward-key``)."""

    model: str
    reading: TextReading
    reward_key: str | None = None
    paths: tuple[str, ...] = (REMOTE_RM_PATH,)
    title: str = "remote_rm"

    def translate(self, body: bytes) -> _Translation:
        doc = _object(read_json(body, f"a JSON object, e.g. {REMOTE_RM_EXAMPLE}"), REMOTE_RM_EXAMPLE)
        if "response" not in doc:
            raise RequestError(f"the request has no 'response' (the text to score); e.g. {REMOTE_RM_EXAMPLE}")
        response = _string(doc["response"], "'response'")
        raw_prompt = doc.get("prompt", "")
        prompt: str | list[Message] = (
            _messages(raw_prompt, "'prompt'")
            if isinstance(raw_prompt, list)
            else _string(raw_prompt, "'prompt'")
        )
        label = {"label": _label(doc["label"], "'label'"), "has_label": True} if "label" in doc else {}
        rows = [Row(response, prompt, **label)]
        field = "'prompt'" if isinstance(prompt, list) else "the sample ('prompt' + 'response')"
        return _Translation(text_inputs(rows, self.reading), self._write, [field], "a string 'prompt'")

    def _write(self, outputs: Mapping[str, np.ndarray], checked: Any) -> Any:
        (reward,) = rewards_of(outputs)
        return reward if self.reward_key is None else {self.reward_key: reward}

    @staticmethod
    def error(status: int, message: str) -> Any:
        return {"error": message}


@dataclass(frozen=True)
class ClassifyRoute:
    """vLLM's (and SGLang's) classification API: ``POST /classify``.

    ``input`` is a text, a list of texts, a list of token ids or a list of such lists; or
    ``messages`` is one conversation ending with the assistant's response. ``model`` is echoed back
    (any name is accepted). ``add_special_tokens`` is accepted and has no effect: the layout the
    reward model was trained with decides BOS and EOS.
    """

    model: str
    reading: TextReading
    paths: tuple[str, ...] = CLASSIFY_PATHS
    title: str = "classify"

    def translate(self, body: bytes) -> _Translation:
        doc = _object(read_json(body, f"a JSON object, e.g. {CLASSIFY_EXAMPLE}"), CLASSIFY_EXAMPLE)
        name = doc.get("model")
        if name is not None:
            name = _string(name, "'model'")
        use, old = _flag(doc, "use_activation"), _flag(doc, "activation")
        if use is not None and old is not None and use != old:
            raise RequestError("'use_activation' and 'activation' disagree; send one of them")
        activation = next((v for v in (use, old) if v is not None), True)
        _flag(doc, "add_special_tokens")
        if ("input" in doc) == ("messages" in doc):
            raise RequestError(
                f"send exactly one of 'input' (a text, texts or token ids) and 'messages' (a conversation); "
                f"e.g. {CLASSIFY_EXAMPLE}"
            )
        if "messages" in doc:
            messages = _messages(doc["messages"], "'messages'")
            if messages[-1]["role"] != "assistant" or len(messages) < 2:
                raise RequestError(
                    "'messages' must end with the assistant's response to score, after at least one message"
                )
            inputs = text_inputs([Row(messages[-1]["content"], messages[:-1])], self.reading)
            fields = ["'messages'"]
        else:
            inputs, fields = self._input(doc["input"])
        return _Translation(
            inputs,
            lambda outputs, checked: self._write(outputs, checked, name, activation),
            fields,
            "a text 'input'",
        )

    def _input(self, value: Any) -> tuple[dict[str, np.ndarray], list[str]]:
        """The model's inputs for ``input``, and the client's name for each of its rows."""
        # a flat list with no text in it is token ids, so its bad element is named as a token id
        flat = isinstance(value, list) and value and not any(isinstance(v, (str, list, dict)) for v in value)
        ids = flat and any(is_int(v) for v in value)
        nested = isinstance(value, list) and value and all(isinstance(v, list) for v in value)
        if (ids or nested) and self.reading.function:
            raise RequestError(
                "this server scores text with a reward function, so 'input' must be text (a string or a "
                "list of strings) or 'messages' a conversation, not token ids"
            )
        if ids:
            return token_inputs([self._ids(value, "'input'")]), ["'input'"]
        each = [f"'input'[{i}]" for i in range(len(value))] if isinstance(value, list) else ["'input'"]
        if nested:
            return token_inputs([self._ids(v, f"'input'[{i}]") for i, v in enumerate(value)]), each
        texts = _strings(value, "input", CLASSIFY_EXAMPLE)
        return text_inputs([Row(t) for t in texts], self.reading), each

    @staticmethod
    def _ids(value: list[Any], where: str) -> list[int]:
        if not value:
            raise RequestError(f"{where} is an empty list of token ids; send at least one")
        for i, v in enumerate(value):
            if not is_int(v) or not -(2**63) <= v < 2**63:
                raise RequestError(f"{where}[{i}] must be a token id (an integer), got {short(v)}")
        return value

    def _write(
        self, outputs: Mapping[str, np.ndarray], checked: Any, name: str | None, activation: bool
    ) -> Any:
        rewards = rewards_of(outputs)
        tokens = tokens_scored(checked)
        data = [
            {
                "index": i,
                "label": "LABEL_0",
                "probs": [1.0 / (1.0 + math.exp(-r)) if activation else r],
                "num_classes": 1,
            }
            for i, r in enumerate(rewards)
        ]
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": name if name is not None else self.model,
            "data": data,
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }

    @staticmethod
    def error(status: int, message: str) -> Any:
        kinds = {
            400: "BadRequestError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
            405: "MethodNotAllowed",
        }
        kinds |= {413: "RequestEntityTooLarge", 415: "UnsupportedMediaType"}
        return {
            "error": {
                "message": message,
                "type": kinds.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
                "param": None,
                "code": status,
            }
        }


def reward_routes(
    model: str, reading: TextReading, remote_rm_reward_key: str | None = None
) -> list[OpenRLHFRoute | RemoteRMRoute | ClassifyRoute]:
    """The three formats, in front of the Triton model ``model`` that reads text as ``reading``."""
    return [
        OpenRLHFRoute(model, reading),
        RemoteRMRoute(model, reading, remote_rm_reward_key),
        ClassifyRoute(model, reading),
    ]
