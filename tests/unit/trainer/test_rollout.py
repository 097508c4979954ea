"""Rollout texts: prompt and response split at the prompt length, an ending stop id left out."""

from __future__ import annotations

import torch

from openaligner.trainer.rollout import rollout_texts


def test_rollout_texts_split_prompts_and_responses_and_drop_an_ending_stop_id():
    tokens = torch.tensor(
        [
            [5, 6, 7, 2, 0],  # prompt [5, 6], response [7] then stop id 2
            [5, 8, 9, 9, 4],  # prompt [5], response ran to the length limit: nothing dropped
            [5, 6, 7, 3, 0],  # a stop string ended the response on 3: it stays in the text
        ]
    )
    prompts, responses = rollout_texts(
        tokens,
        prompt_lengths=torch.tensor([2, 1, 2]),
        sequence_lengths=torch.tensor([4, 5, 4]),
        is_end=torch.tensor([True, False, True]),
        stop_ids=(2,),
        decode=lambda ids: " ".join(map(str, ids)),
    )
    assert prompts == ["5 6", "5", "5 6"]
    assert responses == ["7", "8 9 9 4", "7 3"]
