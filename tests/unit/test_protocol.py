"""The error envelope survives Triton's wrapping, and specs describe themselves for messages."""

import json

from openaligner.protocol import REWARDS, SENTENCES, SEQUENCE_LENGTHS, TOKENS, ErrorEnvelope


def test_wire_shapes_and_dtype_names():
    assert TOKENS.wire_shape == "[B, S]" and TOKENS.dtype_name == "int64"
    assert SEQUENCE_LENGTHS.wire_shape == "[B, 1]"
    assert SENTENCES.dtype_name == "bytes (UTF-8)"
    assert REWARDS.dtype_name == "float32" and not REWARDS.optional


def test_envelope_round_trip_inside_an_escaped_traceback():
    env = ErrorEnvelope("rejected_batch", 'm: it\'s "bad"', {"#1": "row 0 is 0"}, ("abc", "#2"))
    # Triton nests the exception text in its own message with quotes escaped
    wrapped = "Traceback ...\\n" + json.dumps(env.render())[1:-1] + "\\n\\nAt: model.py(501)"
    found = ErrorEnvelope.find(wrapped)
    assert found == env
    assert ErrorEnvelope.find(env.render()) == env


def test_envelope_absent_or_broken():
    assert ErrorEnvelope.find("plain error") is None
    assert ErrorEnvelope.find("<<openaligner-error {not json openaligner-error>>") is None
