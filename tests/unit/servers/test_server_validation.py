"""Every malformed request gets one sentence naming the input, what was expected and what came."""

import numpy as np
import pytest

from openaligner.protocol import REWARD_INPUTS, SENTENCES, SEQUENCE_LENGTHS, TOKENS
from openaligner.servers.validation import (
    RequestError,
    check_batch_size,
    check_known_inputs,
    check_spec,
    check_tokens,
    decode_sentences,
)


def test_check_spec_wrong_dtype_names_input_and_expectation():
    with pytest.raises(RequestError, match=r"input 'tokens': expected int64 \[B, S\], got dtype int32"):
        check_spec(np.zeros((2, 3), np.int32), TOKENS)


def test_check_spec_wrong_rank_and_fixed_dim():
    with pytest.raises(RequestError, match=r"input 'tokens': expected shape \[B, S\], got \[2, 3, 1\]"):
        check_spec(np.zeros((2, 3, 1), np.int64), TOKENS)
    with pytest.raises(RequestError, match=r"'sequence_lengths': expected shape \[B, 1\], got \[2, 2\]"):
        check_spec(np.zeros((2, 2), np.int64), SEQUENCE_LENGTHS)
    with pytest.raises(RequestError, match=r"'sentences': expected bytes \(UTF-8\) \[B, 1\]"):
        check_spec(np.zeros((2, 1), np.float32), SENTENCES)
    ok = np.array([[b"hi"]], dtype=object)
    assert check_spec(ok, SENTENCES) is ok


def test_unknown_inputs_are_named():
    with pytest.raises(RequestError, match=r"unexpected input\(s\) \['foo'\]"):
        check_known_inputs({"foo": np.zeros(1), "tokens": np.zeros(1)}, REWARD_INPUTS)


def test_batch_size_limits():
    check_batch_size(4, 4)
    with pytest.raises(RequestError, match="0 rows"):
        check_batch_size(0, 4)
    with pytest.raises(RequestError, match=r"5 rows; this server accepts at most 4 .*server.max_batch_size"):
        check_batch_size(5, 4)


def test_lengths_out_of_range_name_the_row():
    tokens = np.ones((3, 4), np.int64)
    with pytest.raises(RequestError, match=r"row 1 is 0; each length must lie in \[1, 4\]"):
        check_tokens(tokens, np.array([[2], [0], [1]]), vocab_size=None, max_sequence_length=None)
    with pytest.raises(RequestError, match=r"row 2 is 5; each length must lie in \[1, 4\]"):
        check_tokens(tokens, np.array([[2], [1], [5]]), vocab_size=None, max_sequence_length=None)
    with pytest.raises(RequestError, match="has 2 rows but 'tokens' has 3"):
        check_tokens(tokens, np.array([[2], [1]]), vocab_size=None, max_sequence_length=None)


def test_vocabulary_is_checked_on_valid_prefix_only():
    tokens = np.array([[3, 4, 999], [5, 700, 0]], np.int64)
    # row 0's 999 is padding (length 2): allowed; row 1's 700 at position 1 is inside length 2
    with pytest.raises(
        RequestError, match=r"row 1, position 1 holds id 700, outside the vocabulary \[0, 512\)"
    ):
        check_tokens(tokens, np.array([[2], [2]]), vocab_size=512, max_sequence_length=None)
    t, n = check_tokens(tokens, np.array([[2], [1]]), vocab_size=512, max_sequence_length=None)
    assert n.tolist() == [2, 1] and t.dtype == np.int64
    with pytest.raises(RequestError, match="id -1"):
        check_tokens(np.array([[-1]], np.int64), np.array([[1]]), vocab_size=512, max_sequence_length=None)


def test_max_sequence_length_refuses_long_rows_and_trims_padding():
    tokens = np.ones((2, 10), np.int64)
    with pytest.raises(
        RequestError, match="row 1 has 9 tokens, more than the server's max_sequence_length 8"
    ):
        check_tokens(tokens, np.array([[3], [9]]), vocab_size=None, max_sequence_length=8)
    t, _ = check_tokens(tokens, np.array([[3], [8]]), vocab_size=None, max_sequence_length=8)
    assert t.shape == (2, 8)  # columns past every length are padding and are dropped


def test_decode_sentences_utf8_and_errors():
    assert decode_sentences(np.array([[b"caf\xc3\xa9"], [b""]], dtype=object)) == ["café", ""]
    with pytest.raises(
        RequestError, match=r"'sentences': row 1 is not valid UTF-8 \(byte 0xff at offset 2\)"
    ):
        decode_sentences(np.array([[b"ok"], [b"ab\xff"]], dtype=object))
