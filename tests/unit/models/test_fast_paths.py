"""The one place that picks speed paths: which decoder generation steps, which scoring forward runs."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from openaligner.models.decoders.gpt2 import GPT2Decoder
from openaligner.models.decoders.hf import HFDecoder
from openaligner.models.fast_paths import make_decoder, scoring_forward


@pytest.mark.parametrize(
    ("arch", "train", "fast_path", "expected"),
    [
        ("gpt2", False, True, GPT2Decoder),
        ("gpt2", False, False, HFDecoder),
        ("gpt2", True, True, HFDecoder),  # dropout: only the model's forward computes it
        ("llama", False, True, HFDecoder),
    ],
)
def test_make_decoder_picks_the_fast_decoder_only_where_it_computes_the_forward(
    tiny, arch, train, fast_path, expected
):
    model = tiny.causal_lm(arch).train(train)
    attention = torch.ones(2, 6, dtype=torch.long)
    assert type(make_decoder(model, attention, 6, fast_path=fast_path)) is expected


def test_make_decoder_refuses_an_unknown_cache_kind(tiny):
    with pytest.raises(ValueError, match="unknown cache kind"):
        make_decoder(tiny.causal_lm("gpt2"), torch.ones(1, 4, dtype=torch.long), 4, cache="paged")


def test_scoring_forward_fuses_gelu_new_only_inside_its_scope(tiny):
    model = tiny.causal_lm("gpt2")
    with scoring_forward(model):
        assert not any(type(m) is NewGELUActivation for m in model.modules())
    assert any(type(m) is NewGELUActivation for m in model.modules())
