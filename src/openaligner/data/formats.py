"""The shapes a PPO prompt, an SFT example and a preference pair may have in a data file, and the
typed records they become.

Owns which shapes are accepted (TRL's "standard" and "conversational" formats) and the errors
that name the record and the shape expected; field names are arguments (``data.*_key``). Must not
know tokenizers or chat templates: :mod:`openaligner.data.render` makes token ids.
Design notes (every shape): docs/data.md, "Module notes".
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from openaligner.data.records import Record

Message = Mapping[str, Any]
"""``{"role": str, "content": str, ...}``."""

Conversation = tuple[Message, ...]
"""Messages in order, at least one."""

Prompt = str | Conversation
"""Raw text, or the conversation the policy answers."""

MESSAGES_SHAPE = '[{"role": str, "content": str}, ...]'


@dataclass(frozen=True)
class PromptRecord:
    """A PPO prompt."""

    prompt: Prompt
    where: str  # the record's place in its file, for errors
    metadata: Mapping[str, Any] = field(default_factory=dict)  # fields carried to a reward function


@dataclass(frozen=True)
class SFTRecord:
    """A prompt and the assistant response the model learns."""

    prompt: Prompt
    response: Message  # an assistant message
    where: str


@dataclass(frozen=True)
class PreferenceRecord:
    """A prompt with a preferred and a dispreferred assistant response."""

    prompt: Prompt
    chosen: Message  # an assistant message
    rejected: Message  # an assistant message
    where: str


def prompt_shape(prompt_key: str = "prompt", messages_key: str = "messages") -> str:
    """The accepted prompt records, for messages."""
    messages = MESSAGES_SHAPE
    return f'{{"{prompt_key}": str}}, {{"{prompt_key}": {messages}}} or {{"{messages_key}": {messages}}}'


def sft_shape(
    prompt_key: str = "prompt", response_key: str = "response", messages_key: str = "messages"
) -> str:
    """The accepted SFT records, for messages."""
    return (
        f'{{"{prompt_key}": str or messages, "{response_key}": str or assistant message}} or '
        f'{{"{messages_key}": {MESSAGES_SHAPE} ending with an assistant turn}}'
    )


def preference_shape(
    prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected"
) -> str:
    """The accepted preference records, for messages."""
    return (
        f'{{"{prompt_key}": str or messages, "{chosen_key}": str or assistant message, "{rejected_key}": '
        f'str or assistant message}} or {{"{chosen_key}": {MESSAGES_SHAPE}, "{rejected_key}": '
        f"{MESSAGES_SHAPE}}} (whole conversations differing only in their last, assistant, turn)"
    )


def prompt_record(
    record: Record,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    metadata_keys: Sequence[str] = (),
) -> PromptRecord:
    """A PPO prompt from ``record``, with its ``metadata_keys`` fields as metadata (e.g. the
    reference answer a served reward function checks responses against).

    Raises:
        DataFileError: naming the record, the problem and :func:`prompt_shape`; or a missing
            metadata field (``data.metadata_keys``).
    """
    shape = prompt_shape(prompt_key, messages_key)
    key = prompt_key if prompt_key in record.fields else messages_key
    if key not in record.fields:
        raise _missing(
            record, {"prompt_key": prompt_key, "messages_key": messages_key}, shape, ["prompt_key"]
        )
    absent = [k for k in metadata_keys if k not in record.fields]
    if absent:
        raise record.error(
            f"missing field {absent} named by data.metadata_keys (fields: {sorted(record.fields)}); every "
            "prompt record must carry the metadata its reward needs"
        )
    metadata = {k: record.fields[k] for k in metadata_keys}
    return PromptRecord(_prompt(record, key, shape), record.where, metadata)


def sft_record(
    record: Record, prompt_key: str = "prompt", response_key: str = "response", messages_key: str = "messages"
) -> SFTRecord:
    """An SFT example from ``record``.

    Raises:
        DataFileError: naming the record, the problem and :func:`sft_shape`.
    """
    shape = sft_shape(prompt_key, response_key, messages_key)
    f = record.fields
    if prompt_key in f or response_key in f:
        if prompt_key not in f or response_key not in f:
            raise _missing(record, {"prompt_key": prompt_key, "response_key": response_key}, shape)
        return SFTRecord(
            _prompt(record, prompt_key, shape), _response(record, response_key, shape), record.where
        )
    if messages_key not in f:
        keys = {"prompt_key": prompt_key, "response_key": response_key, "messages_key": messages_key}
        raise _missing(record, keys, shape, ["prompt_key", "response_key"])
    messages = _conversation(record, messages_key, shape)
    if messages[-1]["role"] != "assistant":
        raise record.error(
            f"field {messages_key!r} must end with the assistant turn to learn, not a "
            f"{messages[-1]['role']!r} turn; expected {shape}"
        )
    return SFTRecord(messages[:-1], messages[-1], record.where)


def preference_record(
    record: Record, prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected"
) -> PreferenceRecord:
    """A preference pair from ``record``.

    Raises:
        DataFileError: naming the record, the problem and :func:`preference_shape`.
    """
    shape = preference_shape(prompt_key, chosen_key, rejected_key)
    f = record.fields
    if chosen_key not in f or rejected_key not in f:
        keys = {"prompt_key": prompt_key, "chosen_key": chosen_key, "rejected_key": rejected_key}
        raise _missing(record, keys, shape, ["chosen_key", "rejected_key"])
    chosen, rejected = f[chosen_key], f[rejected_key]
    if isinstance(chosen, list) and isinstance(rejected, list) and max(len(chosen), len(rejected)) > 1:
        return _implicit_prompt_pair(record, chosen_key, rejected_key, shape)
    if prompt_key not in f:
        keys = {"prompt_key": prompt_key, "chosen_key": chosen_key, "rejected_key": rejected_key}
        raise _missing(record, keys, shape)
    return PreferenceRecord(
        _prompt(record, prompt_key, shape),
        _response(record, chosen_key, shape),
        _response(record, rejected_key, shape),
        record.where,
    )


def _implicit_prompt_pair(record: Record, chosen_key: str, rejected_key: str, shape: str) -> PreferenceRecord:
    chosen = _conversation(record, chosen_key, shape)
    rejected = _conversation(record, rejected_key, shape)
    for key, conv in ((chosen_key, chosen), (rejected_key, rejected)):
        if conv[-1]["role"] != "assistant":
            role = conv[-1]["role"]
            raise record.error(
                f"field {key!r} must end with an assistant turn, not a {role!r} turn; expected {shape}"
            )
    if list(chosen[:-1]) != list(rejected[:-1]):
        differ = next(
            (i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1], strict=False)) if a != b),
            min(len(chosen), len(rejected)) - 1,
        )
        raise record.error(
            f"fields {chosen_key!r} and {rejected_key!r} must be the same conversation up to their last "
            f"(assistant) turn, but differ at turn {differ}; expected {shape}"
        )
    return PreferenceRecord(chosen[:-1], chosen[-1], rejected[-1], record.where)


_SYNONYMS = {
    "prompt_key": ("prompt", "question", "instruction", "query", "input", "context", "problem"),
    "response_key": ("response", "answer", "output", "completion", "target", "solution"),
    "messages_key": ("messages", "conversation", "conversations", "dialog", "chat"),
    "chosen_key": ("chosen", "preferred", "accepted", "better", "winner", "pos", "positive"),
    "rejected_key": ("rejected", "dispreferred", "worse", "loser", "neg", "negative"),
}
"""Field names other datasets use for what each ``data.<role>_key`` names (lower case)."""


def _missing(
    record: Record, keys: Mapping[str, str], shape: str, suggest_for: Sequence[str] | None = None
) -> Exception:
    """The error for a record without the fields ``keys`` (``{"prompt_key": "prompt", ...}``, the
    ``data.*`` keys and the fields they name); where the record has other fields that look like
    the missing ones, it says which ``data.<x>_key=<field>`` to set (for ``suggest_for``, default all)."""
    absent = [f for f in keys.values() if f not in record.fields]
    message = f"missing field {absent} (fields: {sorted(record.fields)}); expected {shape}"
    free = [f for f in record.fields if f not in keys.values()]
    fixes = []
    for role in suggest_for if suggest_for is not None else list(keys):
        if keys[role] in record.fields or not free:
            continue
        field_name = _look_alike(role, free)
        if field_name is not None:
            free.remove(field_name)
            fixes.append(f"data.{role}={field_name}")
    if fixes:
        message += f"; if the data names them differently, set {' '.join(fixes)}"
    return record.error(message)


def _look_alike(role: str, fields: Sequence[str]) -> str | None:
    """The field among ``fields`` most likely to hold what ``role`` names: a known synonym, else a
    close spelling of one; None when none looks like it."""
    synonyms = _SYNONYMS.get(role, ())
    lower = {f.lower(): f for f in fields}
    for name in synonyms:
        if name in lower:
            return lower[name]
    for f in fields:  # e.g. "model_answer", "question_text"
        if any(name in f.lower() for name in synonyms if len(name) > 3):
            return f
    close = difflib.get_close_matches(role.removesuffix("_key"), list(lower), n=1, cutoff=0.7)
    return lower[close[0]] if close else None


def _prompt(record: Record, key: str, shape: str) -> Prompt:
    value = record.fields[key]
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise record.error(
            f"field {key!r} must be a string or a list of messages, got {_kind(value)}; expected {shape}"
        )
    messages = _conversation(record, key, shape)
    if messages[-1]["role"] == "assistant":
        raise record.error(
            f"field {key!r} ends with an assistant turn; a prompt ends with the turn the policy answers "
            f"(expected {shape})"
        )
    return messages


def _response(record: Record, key: str, shape: str) -> Message:
    value = record.fields[key]
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    message = _message(record, key, value, shape) if isinstance(value, Mapping) else None
    if message is None or message["role"] != "assistant":
        raise record.error(
            f"field {key!r} must be a string or one assistant message, got {_kind(value)}; expected {shape}"
        )
    return message


def _conversation(record: Record, key: str, shape: str) -> Conversation:
    value = record.fields[key]
    if not isinstance(value, list) or not value:
        raise record.error(
            f"field {key!r} must be a non-empty list of messages, got {_kind(value)}; expected {shape}"
        )
    return tuple(_message(record, f"{key}[{i}]", m, shape) for i, m in enumerate(value))


def _message(record: Record, key: str, value: Any, shape: str) -> Message:
    if not (
        isinstance(value, Mapping)
        and isinstance(value.get("role"), str)
        and isinstance(value.get("content"), str)
    ):
        raise record.error(
            f'{key} must be a message {{"role": str, "content": str}}, got {_kind(value)}; expected {shape}'
        )
    return dict(value)


def _kind(value: Any) -> str:
    """A short description of a JSON value for messages: its type and a clipped repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
