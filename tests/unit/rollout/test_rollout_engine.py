"""The rollout engine seam: the hf engine is the actor's sampling loop bit for bit; requests are
checked; lifecycle; the weights an engine that owns its own would receive."""

from __future__ import annotations

import pytest
import torch

from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.rollout.config import RolloutConfig, build_rollout_engine
from openaligner.rollout.engine import RolloutEngine, RolloutRequest, row_seeds
from openaligner.rollout.hf_engine import HFRolloutEngine

LENGTHS = torch.tensor([4, 7, 2, 6])


def _prompts(vocab: int) -> torch.Tensor:
    text = torch.randint(3, vocab, (4, 7), generator=torch.Generator().manual_seed(0))
    text[torch.arange(7) >= LENGTHS.unsqueeze(-1)] = 1
    return text


@pytest.fixture
def actor(tiny):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=(5, 6, 7, 8, 9, 10))
    return CausalLMActor(tiny.causal_lm("llama"), sampling=sampling, init_policy=False)


def test_hf_engine_is_the_actors_sampling_loop_bit_for_bit(actor, tiny):
    prompts = _prompts(tiny.size.vocab_size)
    seeds = row_seeds(1234, 4)
    out = build_rollout_engine(RolloutConfig(), actor).generate(
        RolloutRequest(prompts, LENGTHS, actor.sampling, seeds)
    )
    direct = actor.infer({"text": prompts, "length": LENGTHS}, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(out.tokens, direct["response_tokens"])
    assert torch.equal(out.sequence_lengths, direct["response_lengths"])
    assert torch.equal(out.prompt_lengths, LENGTHS) and torch.equal(out.is_end, direct["is_end"])
    assert out.tokens.device.type == "cpu"
    # the request's sampling settings are used (greedy here), not the actor's
    greedy = HFRolloutEngine(actor).generate(
        RolloutRequest(prompts, LENGTHS, SamplingParams(greedy=True, max_new_tokens=3), seeds)
    )
    assert int((greedy.sequence_lengths - LENGTHS).max()) <= 3


def test_per_row_streams_sample_a_row_alike_alone_and_among_other_prompts(actor, tiny):
    """With per_row_streams a row's tokens follow from its prompt and seed only: the same alone and
    left-padded into a batch beside longer and shorter prompts (not so with one stream per request)."""
    prompts, seeds = _prompts(tiny.size.vocab_size), row_seeds(99, 4)
    engine = HFRolloutEngine(actor, per_row_streams=True)
    batched = engine.generate(RolloutRequest(prompts, LENGTHS, actor.sampling, seeds))
    for i in range(4):
        p = int(LENGTHS[i])
        alone = engine.generate(
            RolloutRequest(prompts[i : i + 1, :p], LENGTHS[i : i + 1], actor.sampling, seeds[i : i + 1])
        )
        end = int(batched.sequence_lengths[i])
        assert torch.equal(alone.tokens[0, : int(alone.sequence_lengths[0])], batched.tokens[i, :end])
        assert bool(alone.is_end[0]) == bool(batched.is_end[i])
    shared = HFRolloutEngine(actor).generate(RolloutRequest(prompts, LENGTHS, actor.sampling, seeds))
    assert not torch.equal(shared.tokens, batched.tokens)  # the default: one stream for the request


def test_row_draws_depend_on_each_rows_seed_only():
    from openaligner.models.generation import row_draws

    both = row_draws([3, 4], 5)
    assert both.shape == (2, 5) and both.dtype == torch.float32
    assert torch.equal(row_draws([4], 5)[0], both[1]) and not torch.equal(both[0], both[1])
    assert ((both >= 0) & (both < 1)).all()


def test_a_request_with_mismatched_shapes_is_refused():
    with pytest.raises(ValueError, match=r"seeds \[B\]"):
        RolloutRequest(
            torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 3]), SamplingParams(), row_seeds(0, 3)
        )


def test_row_seeds_are_consecutive_and_wrap_below_2_63():
    assert row_seeds(5, 3).tolist() == [5, 6, 7]
    assert row_seeds(2**63 - 1, 2).tolist() == [2**63 - 1, 0]
    assert row_seeds(0, 0).shape == (0,)


def test_unknown_engine_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"rollout\.engine must be one of hf, vllm, got 'sglang'"):
        RolloutConfig(engine="sglang")
    assert RolloutConfig(engine="vllm").vllm.dtype == "float32"


def test_lifecycle_and_an_engine_that_owns_its_weights_must_take_them(actor):
    events: list[str] = []

    class Remote(RolloutEngine):
        name = "remote"
        shares_weights = False

        def start(self):
            events.append("start")

        def generate(self, request):
            raise AssertionError("not called")

        def stop(self):
            events.append("stop")

    with Remote() as engine, pytest.raises(NotImplementedError, match="owns its weights"):
        engine.update_weights(actor, 1)
    assert events == ["start", "stop"]  # close() stops by default
    HFRolloutEngine(actor).update_weights(actor, 1)  # sharing the modules: nothing to do


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_inference_state_dict_is_the_policy_as_a_plain_model(tiny, arch):
    actor = CausalLMActor(tiny.causal_lm(arch), init_policy=False)
    with torch.no_grad():  # trained away from its initial weights, the LM head included
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    other = tiny.causal_lm(arch, seed=1)
    tokens = _prompts(tiny.size.vocab_size)
    assert not torch.allclose(_logits(other, tokens), _logits(actor.model, tokens), atol=1e-3)
    other.load_state_dict(actor.inference_state_dict())
    torch.testing.assert_close(_logits(other, tokens), _logits(actor.model, tokens))


def test_inference_state_dict_of_a_lora_policy_has_its_adapters_merged(tiny):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    actor = CausalLMActor(peft.get_peft_model(tiny.causal_lm("llama"), config), init_policy=False)
    state = actor.inference_state_dict()
    assert state is not None and not any("lora" in k for k in state)
    plain = tiny.causal_lm("llama")
    tokens = _prompts(tiny.size.vocab_size)
    assert not torch.allclose(_logits(plain, tokens), _logits(actor.model, tokens), atol=1e-4)
    plain.load_state_dict(state)
    torch.testing.assert_close(_logits(plain, tokens), _logits(actor.model, tokens), rtol=1e-5, atol=1e-5)
