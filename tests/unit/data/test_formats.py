"""Record shapes: every accepted prompt / SFT / preference shape parses; malformed ones are refused
naming the record's place and the shape expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from openaligner.data.formats import preference_record, prompt_record, sft_record
from openaligner.data.records import DataFileError, Record

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "2+2?"}
ASSISTANT = {"role": "assistant", "content": "4"}
WRONG = {"role": "assistant", "content": "5"}


def rec(**fields: Any) -> Record:
    return Record(fields, Path("d.jsonl"), line=7)


def test_prompt_shapes():
    assert prompt_record(rec(prompt="hi")).prompt == "hi"
    assert prompt_record(rec(prompt=[SYSTEM, USER])).prompt == (SYSTEM, USER)
    assert prompt_record(rec(messages=[USER])).prompt == (USER,)
    assert prompt_record(rec(q="hi"), prompt_key="q").prompt == "hi"
    assert prompt_record(rec(conv=[USER]), messages_key="conv").prompt == (USER,)
    assert prompt_record(rec(prompt="p")).where == "d.jsonl:7"


def test_sft_shapes():
    text = sft_record(rec(prompt="2+2?", response="4"))
    assert (text.prompt, text.response) == ("2+2?", ASSISTANT)
    explicit = sft_record(rec(prompt=[USER], completion=[ASSISTANT]), response_key="completion")
    assert (explicit.prompt, explicit.response) == ((USER,), ASSISTANT)
    assert sft_record(rec(prompt=[USER], response=ASSISTANT)).response == ASSISTANT
    # messages: the last assistant turn is the response; earlier turns (assistant ones too) the prompt
    multi = sft_record(rec(messages=[SYSTEM, USER, WRONG, USER, ASSISTANT]))
    assert (multi.prompt, multi.response) == ((SYSTEM, USER, WRONG, USER), ASSISTANT)


def test_preference_shapes():
    text = preference_record(rec(prompt="2+2?", chosen="4", rejected="5"))
    assert (text.prompt, text.chosen, text.rejected) == ("2+2?", ASSISTANT, WRONG)
    explicit = preference_record(rec(prompt=[USER], chosen=[ASSISTANT], rejected=[WRONG]))
    assert (explicit.prompt, explicit.chosen, explicit.rejected) == ((USER,), ASSISTANT, WRONG)
    # implicit prompt: whole conversations, the same up to their last turn; a prompt field is unused
    implicit = preference_record(
        rec(prompt="ignored", chosen=[SYSTEM, USER, ASSISTANT], rejected=[SYSTEM, USER, WRONG])
    )
    assert (implicit.prompt, implicit.chosen, implicit.rejected) == ((SYSTEM, USER), ASSISTANT, WRONG)
    renamed = preference_record(
        rec(q="2+2?", good="4", bad="5"), prompt_key="q", chosen_key="good", rejected_key="bad"
    )
    assert renamed.chosen == ASSISTANT


def test_extra_message_keys_are_kept_for_the_template():
    tool = {"role": "assistant", "content": "", "tool_calls": None}
    assert sft_record(rec(messages=[USER, tool])).response == tool


@pytest.mark.parametrize(
    ("read", "fields", "problem"),
    [
        (prompt_record, {"text": "hi"}, r"missing field \['prompt', 'messages'\] \(fields: \['text'\]\)"),
        (prompt_record, {"prompt": 3}, r"field 'prompt' must be a string or a list of messages, got int 3"),
        (prompt_record, {"prompt": []}, r"field 'prompt' must be a non-empty list of messages"),
        (prompt_record, {"prompt": [USER, ASSISTANT]}, r"field 'prompt' ends with an assistant turn"),
        (prompt_record, {"messages": [{"role": "user"}]}, r'messages\[0\] must be a message \{"role": str'),
        (
            prompt_record,
            {"messages": [{"role": "user", "content": ["multi", "modal"]}]},
            r"messages\[0\] must",
        ),
        (sft_record, {"prompt": "p"}, r"missing field \['response'\]"),
        (
            sft_record,
            {"messages": [USER]},
            r"'messages' must end with the assistant turn to learn, not a 'user'",
        ),
        (
            sft_record,
            {"prompt": "p", "response": [ASSISTANT, ASSISTANT]},
            r"'response' must be a string or one",
        ),
        (
            sft_record,
            {"prompt": "p", "response": [USER]},
            r"'response' must be a string or one assistant message",
        ),
        (preference_record, {"prompt": "p", "chosen": "a"}, r"missing field \['rejected'\]"),
        (preference_record, {"chosen": "a", "rejected": "b"}, r"missing field \['prompt'\]"),
        (
            preference_record,
            {"chosen": [USER, ASSISTANT], "rejected": [SYSTEM, USER, WRONG]},
            r"must be the same conversation up to their last \(assistant\) turn, but differ at turn 0",
        ),
        (
            preference_record,
            {"chosen": [USER, ASSISTANT], "rejected": [ASSISTANT, USER]},
            r"field 'rejected' must end with an assistant turn, not a 'user' turn",
        ),
    ],
)
def test_malformed_records_name_the_place_and_the_shape(read, fields, problem):
    with pytest.raises(DataFileError, match=problem) as caught:
        read(rec(**fields))
    message = str(caught.value)
    assert message.startswith("d.jsonl:7: ")
    assert "expected {" in message  # the accepted shapes follow
