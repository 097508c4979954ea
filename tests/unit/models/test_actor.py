"""CausalLMActor: rollouts, log-probs vs a slow reference, the training forward, initial policy,
alignment, I/O."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openaligner.algorithms import response_mask
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams

PROMPT_LENGTHS = [4, 7, 2, 6]


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(3, vocab, (4, 7), generator=g)
    length = torch.tensor(PROMPT_LENGTHS)
    text[torch.arange(7) >= length.unsqueeze(-1)] = 1
    return {"text": text, "length": length}


def _rollout(actor: CausalLMActor, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return actor.infer(_batch(vocab), generator=torch.Generator().manual_seed(seed))


def _slow_logprobs(model, tokens, lengths, temperature):
    """Reference: per-row unpadded forward, log_softmax(logits / T), gather of the next token."""
    rows = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    with torch.no_grad():
        for i, n in enumerate(lengths.tolist()):
            logits = model(tokens[i : i + 1, :n]).logits[0] / temperature
            logp = torch.log_softmax(logits.double(), -1)
            rows[i, : n - 1] = logp[:-1].gather(-1, tokens[i, 1:n].unsqueeze(-1)).squeeze(-1).float()
    return rows


@pytest.fixture
def actor(tiny):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=(5, 6, 7, 8, 9, 10))
    return CausalLMActor(tiny.causal_lm("llama"), sampling=sampling)


def test_infer_returns_the_documented_keys_and_layout(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    assert set(out) == {"response_tokens", "response_lengths", "prompt_lengths", "is_end"}
    assert out["prompt_lengths"].tolist() == PROMPT_LENGTHS
    assert out["response_tokens"].shape[1] == int(out["response_lengths"].max())
    assert out["is_end"].dtype == torch.bool
    assert actor.pad_id == 1  # the EOS id of the tiny models
    with pytest.raises(KeyError, match="length"):
        actor.infer({"text": torch.ones(1, 2, dtype=torch.long)})


def test_default_stop_id_is_the_eos_of_the_model(tiny):
    actor = CausalLMActor(
        tiny.causal_lm(), sampling=SamplingParams(greedy=True, max_new_tokens=6), init_policy=False
    )
    model = actor.model
    with torch.no_grad():  # final hidden state = all ones, and EOS (id 1) has the largest row sum
        nn.init.zeros_(model.transformer.ln_f.weight)
        nn.init.ones_(model.transformer.ln_f.bias)
        model.lm_head.weight[1] = 1.0
    out = actor.infer(_batch(tiny.size.vocab_size))
    assert out["is_end"].all()
    assert out["response_lengths"].tolist() == [n + 1 for n in PROMPT_LENGTHS]


def test_log_probs_match_slow_reference_with_temperature(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    fast = actor.get_inference_log_probs(tokens, lengths)
    slow = _slow_logprobs(actor.model, tokens, lengths, 0.7)
    assert fast.shape == (4, tokens.shape[1] - 1) and fast.dtype == torch.float32
    valid = torch.arange(tokens.shape[1] - 1) < (lengths - 1).unsqueeze(-1)
    torch.testing.assert_close(fast[valid], slow[valid], rtol=1e-5, atol=1e-5)
    # Temperature matters: at T=1 the values differ.
    assert not torch.allclose(
        fast[valid], _slow_logprobs(actor.model, tokens, lengths, 1.0)[valid], atol=1e-3
    )


def test_log_probs_ignore_right_padding_and_micro_batching(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    padded = torch.cat([tokens, torch.full((4, 5), 17)], dim=1)
    base = actor.get_inference_log_probs(tokens, lengths)
    wide = actor.get_inference_log_probs(padded, lengths, forward_micro_batch_size=3)
    valid = torch.arange(tokens.shape[1] - 1) < (lengths - 1).unsqueeze(-1)
    torch.testing.assert_close(wide[:, : base.shape[1]][valid], base[valid], rtol=1e-5, atol=1e-6)


def test_init_policy_is_a_frozen_copy(actor, tiny):
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    before = actor.get_inference_log_probs(tokens, lengths)
    assert torch.equal(actor.get_init_policy_logprobs(tokens, lengths), before)
    assert actor.init_policy is not None and actor.init_policy is not actor.model
    assert not any(p.requires_grad for p in actor.init_policy.parameters())
    init_ids = {id(p) for p in actor.init_policy.parameters()}
    assert not init_ids & {id(p) for p in actor.parameters()}

    opt = torch.optim.SGD(actor.parameters(), lr=1.0)
    logprobs, _ = actor.training_logprobs(tokens, lengths)
    logprobs.sum().backward()
    opt.step()
    assert not torch.allclose(actor.get_inference_log_probs(tokens, lengths), before)
    assert torch.equal(actor.get_init_policy_logprobs(tokens, lengths), before)


def test_no_init_policy_when_disabled(tiny):
    actor = CausalLMActor(tiny.causal_lm(), init_policy=False)
    with pytest.raises(RuntimeError, match="initial policy"):
        actor.get_init_policy_logprobs(torch.ones(1, 3, dtype=torch.long))


def test_alignment_conventions_on_a_real_rollout(actor, tiny):
    """mask = [prompt_len-1, response_len-1) scores exactly the response tokens; index
    response_len-2 predicts the last token (the stop token when is_end)."""
    out = _rollout(actor, tiny.size.vocab_size, seed=3)
    tokens, lengths, prompts = out["response_tokens"], out["response_lengths"], out["prompt_lengths"]
    assert out["is_end"].any() and not out["is_end"].all()
    logprobs = actor.get_inference_log_probs(tokens, lengths)
    mask = response_mask(prompts, lengths, tokens.shape[1] - 1)
    assert mask.sum(-1).tolist() == (lengths - prompts).tolist()
    for i in range(4):
        p, n = int(prompts[i]), int(lengths[i])
        with torch.no_grad():
            logits = actor.model(tokens[i : i + 1, :n]).logits[0, p - 1 : n - 1] / 0.7
        response_lp = torch.log_softmax(logits, -1).gather(-1, tokens[i, p:n].unsqueeze(-1)).sum()
        torch.testing.assert_close((logprobs[i] * mask[i]).sum(), response_lp, rtol=1e-5, atol=1e-5)
        score_index = n - 2
        assert mask[i, score_index] == 1 and (
            score_index + 1 == tokens.shape[1] - 1 or mask[i, score_index + 1] == 0
        )
        if out["is_end"][i]:
            assert int(tokens[i, score_index + 1]) in actor.sampling.stop_token_ids


def test_dropout_stays_off_during_training(tiny):
    model = tiny.causal_lm()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.5
    actor = CausalLMActor(model, sampling=SamplingParams(max_new_tokens=4), init_policy=False)
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    a, _ = actor.training_logprobs(tokens, lengths)
    b, _ = actor.training_logprobs(tokens, lengths)
    assert not actor.model.training
    assert torch.equal(a, b)
    valid = torch.arange(tokens.shape[1] - 1) < (lengths - 1).unsqueeze(-1)
    torch.testing.assert_close(a.detach()[valid], actor.get_inference_log_probs(tokens, lengths)[valid])


def test_training_logprobs_skip_leading_positions_and_carry_gradient(actor, tiny):
    """``first_position`` drops the leading columns without changing the others; the log-probs
    carry gradient, the entropies only with ``entropy_grad``."""
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    full, entropy = actor.training_logprobs(tokens, lengths)
    assert full.shape == entropy.shape == (4, tokens.shape[1] - 1)
    assert full.requires_grad and not entropy.requires_grad
    part, part_entropy = actor.training_logprobs(tokens, lengths, first_position=2, entropy_grad=True)
    assert part.shape == (4, tokens.shape[1] - 3) and part_entropy.requires_grad
    valid = (torch.arange(tokens.shape[1] - 1) < (lengths - 1).unsqueeze(-1))[:, 2:]
    torch.testing.assert_close(part[valid], full[:, 2:][valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_entropy[valid], entropy[:, 2:][valid], rtol=1e-5, atol=1e-6)


def test_save_load_round_trip_is_bitwise(actor, tiny, tmp_path):
    actor.tokenizer = tiny.tokenizer
    actor.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    loaded = CausalLMActor.from_pretrained(tmp_path, sampling=actor.sampling)
    original, restored = actor.model.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    out_a = _rollout(actor, tiny.size.vocab_size, seed=5)
    out_b = _rollout(loaded, tiny.size.vocab_size, seed=5)
    assert all(torch.equal(out_a[k], out_b[k]) for k in out_a)
    tokens, lengths = out_a["response_tokens"], out_a["response_lengths"]
    assert torch.equal(
        actor.get_inference_log_probs(tokens, lengths), loaded.get_inference_log_probs(tokens, lengths)
    )


def test_peft_init_policy_disables_adapters(tiny):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny.causal_lm("llama"), config)
    actor = CausalLMActor(model, sampling=SamplingParams(max_new_tokens=4))
    assert actor.init_policy is actor.model
    out = _rollout(actor, tiny.size.vocab_size)
    tokens, lengths = out["response_tokens"], out["response_lengths"]
    base = CausalLMActor(
        tiny.causal_lm("llama"), sampling=SamplingParams(max_new_tokens=4), init_policy=False
    )
    torch.testing.assert_close(
        actor.get_init_policy_logprobs(tokens, lengths), base.get_inference_log_probs(tokens, lengths)
    )
    assert not torch.allclose(
        actor.get_inference_log_probs(tokens, lengths), base.get_inference_log_probs(tokens, lengths)
    )


def test_a_mixture_of_experts_asking_for_router_logits_rolls_out_scores_and_warns(tiny, caplog):
    """``output_router_logits: true`` (saved by MoE fine-tuning recipes): rollouts and the PPO loss
    work, and the log says that the load-balancing loss it asks for is not part of the PPO loss."""
    model = tiny.causal_lm("mixtral")
    model.config.output_router_logits = True
    with caplog.at_level("WARNING", logger="openaligner.models.actor"):
        actor = CausalLMActor(model, sampling=SamplingParams(max_new_tokens=5, stop_token_ids=()))
    assert "output_router_logits" in caplog.text and "does not include" in caplog.text
    out = _rollout(actor, tiny.size.vocab_size)
    logprobs = actor.get_inference_log_probs(out["response_tokens"], out["response_lengths"])
    assert torch.equal(
        logprobs, actor.get_init_policy_logprobs(out["response_tokens"], out["response_lengths"])
    )
