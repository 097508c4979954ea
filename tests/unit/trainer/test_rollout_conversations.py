"""Rollouts as conversations for a reward model with its own tokenizer: the prompt as read (found
by its ids), then the response decoded with the policy's tokenizer, special tokens dropped."""

from __future__ import annotations

import pytest
import torch

from openaligner.data.render import Renderer, SequenceLayout
from openaligner.trainer.rollout import RolloutConversations


def test_each_row_is_its_prompt_then_the_decoded_response(chat_tokenizer):
    tok = chat_tokenizer
    chat = SequenceLayout(chat_template=True)
    sources = ["2+2?", ({"role": "system", "content": "terse"}, {"role": "user", "content": "3+3?"})]
    prompts = [Renderer(tok, chat).prompt_ids(s) for s in sources]
    answers = [[*tok("4", add_special_tokens=False)["input_ids"], tok.eos_token_id], tok("6")["input_ids"]]
    rows = [p + a for p, a in zip(prompts, answers, strict=True)]
    tokens = torch.full((2, max(map(len, rows)) + 2), tok.pad_token_id)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    batch = {
        "response_tokens": tokens,
        "prompt_lengths": torch.tensor([len(p) for p in prompts]),
        "response_lengths": torch.tensor([len(r) for r in rows]),
    }
    convert = RolloutConversations(prompts, sources, lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert convert(batch) == [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        [
            {"role": "system", "content": "terse"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
        ],
    ]
    batch["prompt_lengths"] = torch.tensor([1, 1])
    with pytest.raises(KeyError, match="row 0: its prompt ids are not those of any prompt"):
        convert(batch)
