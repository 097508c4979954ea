"""JSON request bodies read strictly, for every wire format the HTTP front answers.

Owns :func:`read_json` (a key twice, ``NaN``/``Infinity``, lone surrogates refused with one
:class:`RequestError` sentence; numbers no 64-bit type holds kept as :class:`Unreadable`) and
:func:`kind` / :func:`short` for messages. Must not know any wire format's fields, nor HTTP.
Design notes: docs/serving.md, "Module notes".
"""

from __future__ import annotations

import json
import math
from typing import Any

from openaligner.servers.validation import RequestError

MAX_INT_DIGITS = 20
"""No 64-bit integer has more digits; longer ones are never converted (Python refuses over 4,300)."""


class Unreadable:
    """A JSON number no 64-bit type holds, or a non-standard literal (``NaN``, ``Infinity``); kept
    as text so that the check of the field it belongs to can name it."""

    def __init__(self, text: str, problem: str) -> None:
        self.text = text
        self.problem = problem


def _parse_int(text: str) -> int | Unreadable:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return Unreadable(text, f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _parse_float(text: str) -> float | Unreadable:
    value = float(text)
    return Unreadable(text, "a number too large for a 64-bit float") if math.isinf(value) else value


def _parse_constant(text: str) -> Unreadable:
    return Unreadable(text, "not a JSON number")


def check_text(text: str, where: str = "request body") -> None:
    """Refuse a string that cannot be encoded as UTF-8 (a lone UTF-16 surrogate from ``\\ud800``).

    Raises:
        RequestError: naming ``where``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{where} holds a lone UTF-16 surrogate ({text[e.start]!r}) in a string; send valid Unicode"
        ) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's keys, each at most once, and no string another parser could read differently."""
    seen: set[str] = set()
    for key, value in pairs:
        if key in seen:
            name = next((v for k, v in pairs if k == "name" and isinstance(v, str)), None)
            where = f" of '{name}'" if name is not None and key != "name" else ""
            raise RequestError(
                f"request body gives the key {short(key)}{where} more than once in one object; JSON "
                f"parsers disagree on which one counts (Triton keeps the first, Python the last), so "
                f"send each key once"
            )
        seen.add(key)
        check_text(key)
        if isinstance(value, str):
            check_text(value)
    return dict(pairs)


def read_json(body: bytes, expected: str) -> Any:
    """The JSON document ``body`` holds, read strictly (docs/serving.md, "Module notes").

    Args:
        body: the request body (UTF-8 JSON, no byte-order mark, nothing after the document).
        expected: what the route takes, ending the refusals' "send ..." (e.g. ``a JSON object with
            'query', e.g. {...}``).

    Raises:
        RequestError: the body is empty, not UTF-8, not JSON, nests too deeply, gives a key twice or
            holds a lone surrogate.
    """
    if not body.strip():
        raise RequestError(f"request body is empty; send {expected}")
    try:
        return json.loads(
            body.decode("utf-8"),
            object_pairs_hook=_unique_keys,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except UnicodeDecodeError as e:
        raise RequestError(
            f"request body is not UTF-8 JSON (byte {body[e.start]:#04x} at offset {e.start}); send {expected}"
        ) from None
    except json.JSONDecodeError as e:
        raise RequestError(
            f"request body is not valid JSON ({e.msg} at offset {e.pos}); send {expected}"
        ) from None
    except RecursionError:
        raise RequestError(f"request body nests JSON too deeply; send {expected}") from None


def first_unreadable(value: Any, depth: int = 0) -> Unreadable | None:
    """The first :class:`Unreadable` inside a JSON value (lists and objects searched), or None."""
    if isinstance(value, Unreadable):
        return value
    if depth > 64:
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = first_unreadable(item, depth + 1)
        if found is not None:
            return found
    return None


def is_int(value: Any) -> bool:
    """Whether a JSON value is an integer (booleans are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def kind(value: Any) -> str:
    """What a JSON value is, for messages: ``an object``, ``a list``, ``a string``, ..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def short(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, cut to ``limit`` characters (for messages)."""
    if isinstance(value, Unreadable):
        text = value.text if len(value.text) <= limit else f"{value.text[: limit - 3]}..."
        return f"{text} ({value.problem})"
    try:
        text = json.dumps(value, default=lambda v: v.text if isinstance(v, Unreadable) else str(v))
    except (RecursionError, ValueError):
        return kind(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
