"""A critic or reward model started from a causal LM (no ``score`` head on disk) gets the same fresh
head in every process: two runs from one directory are reproducible (the real-model PPO test found
two serve-critic starts from Gemma giving different values at step 1), and loading leaves the
caller's random stream untouched."""

import torch

from openaligner.models.builders import TinySize, build_tiny_causal_lm
from openaligner.models.critic import CriticModel


def test_a_fresh_head_is_the_same_whatever_the_global_seed(tmp_path):
    build_tiny_causal_lm(
        "llama", TinySize(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    ).save_pretrained(tmp_path)
    torch.manual_seed(1)
    first = CriticModel.from_pretrained(tmp_path).hf_model.score.weight.detach().clone()
    torch.manual_seed(2)
    state = torch.random.get_rng_state()
    second = CriticModel.from_pretrained(tmp_path).hf_model.score.weight.detach().clone()
    assert torch.equal(first, second)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's stream is not consumed
