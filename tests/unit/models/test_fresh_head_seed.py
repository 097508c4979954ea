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


def test_a_critic_from_a_causal_lm_starts_with_zero_values_and_a_value_model_keeps_its_head(tmp_path):
    """A fresh value head drawn at random reads the backbone's hidden states at their own scale
    (on Gemma 3 270M: values of sd 2.9 against returns of sd 0.09, an explained variance of −1036 at
    step 1); a zero head starts every value at 0. A directory that holds a head keeps it."""
    lm_dir, critic_dir = tmp_path / "lm", tmp_path / "critic"
    build_tiny_causal_lm(
        "llama", TinySize(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    ).save_pretrained(lm_dir)
    tokens = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(0))
    fresh = CriticModel.from_pretrained(lm_dir)
    assert fresh.fresh_head
    assert torch.count_nonzero(fresh.head.weight) == 0
    assert torch.equal(fresh.infer(tokens, torch.tensor([7, 5, 2])), torch.zeros(3, 7))
    # the head's gradient does not depend on its weight: one step moves it off zero
    fresh.train()
    fresh(tokens).sum().backward()
    assert fresh.head.weight.grad is not None and torch.count_nonzero(fresh.head.weight.grad) > 0
    with torch.no_grad():
        fresh.head.weight.normal_()
    fresh.save_pretrained(critic_dir)
    kept = CriticModel.from_pretrained(critic_dir)
    assert not kept.fresh_head
    assert torch.equal(kept.head.weight, fresh.head.weight)
