"""The GPT-2 fast decoder: logits of the model's forward at every step, bit-identical in-place GELU."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN, NewGELUActivation

from openaligner.models.decoders import gpt2
from openaligner.models.generation import _left_pad


def _prompts(vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompts [B, P] (pad 0, ids from 3) and lengths [B]."""
    tokens = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
    lens = torch.tensor(lengths)
    tokens[torch.arange(tokens.shape[1]) >= lens.unsqueeze(-1)] = 0
    return tokens, lens


@pytest.mark.parametrize("activation", ["gelu_new", "relu"])
def test_gpt2_decoder_logits_match_the_model_forward(tiny, activation):
    """Prefill and every step against a full forward of the left-padded sequence so far, with
    the in-place ``gelu_new`` and with any other activation module."""
    model = tiny.causal_lm("gpt2")
    for block in model.transformer.h:
        block.mlp.act = ACT2FN[activation]
    assert gpt2.gpt2_fast_path_supported(model)
    prompts, lengths = _prompts(tiny.size.vocab_size, [5, 9, 3, 7])
    p_max, new = int(lengths.max()), 5
    buf, attention = _left_pad(prompts, lengths, p_max, p_max + new, pad_id=0)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    extra = torch.randint(
        3, tiny.size.vocab_size, (len(lengths), new), generator=torch.Generator().manual_seed(1)
    )
    buf[:, p_max:] = extra
    decoder = gpt2.GPT2Decoder(model, attention, p_max + new)
    valid = attention.bool()
    with torch.inference_mode():
        got = [decoder.prefill(buf[:, :p_max], positions[:, :p_max])]
        got += [decoder.step(buf[:, c], positions[:, c], c) for c in range(p_max, p_max + new - 1)]
        full = model(input_ids=buf, attention_mask=attention, position_ids=positions).logits
    for j, logits in enumerate(got):
        assert torch.allclose(logits, full[:, p_max - 1 + j], atol=1e-5, rtol=1e-5)
    assert not valid.all()  # the padded (masked) path was exercised


def test_in_place_gelu_new_is_bit_identical_to_the_module():
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :4] = torch.tensor([0.0, -1e-30, 1e-30, 40.0])  # zero, tiny values, saturated tanh
    expected = NewGELUActivation()(x)
    got = gpt2._gelu_new_(x.clone(), torch.empty_like(x))
    assert torch.equal(got, expected)
    assert gpt2._is_stock_gelu_new(NewGELUActivation())
    assert not gpt2._is_stock_gelu_new(torch.nn.GELU(approximate="tanh"))
