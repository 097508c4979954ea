"""The scoring forward's speed trick: the fused tanh-GELU is swapped in only inside its scope."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from openaligner.models.fast_forward import fused_tanh_gelu


def test_fused_gelu_is_swapped_in_only_inside_the_scope(tiny):
    model = tiny.causal_lm("gpt2")
    originals = [m.mlp.act for m in model.transformer.h]
    assert all(type(a) is NewGELUActivation for a in originals)
    x = torch.randn(3, 5, 64)
    with fused_tanh_gelu(model):
        assert not any(type(m) is NewGELUActivation for m in model.modules())
        fused = model.transformer.h[0].mlp.act(x)
    torch.testing.assert_close(fused, originals[0](x), rtol=0, atol=1e-6)
    assert [m.mlp.act for m in model.transformer.h] == originals

    with pytest.raises(RuntimeError, match="boom"), fused_tanh_gelu(model):
        raise RuntimeError("boom")
    assert [m.mlp.act for m in model.transformer.h] == originals
