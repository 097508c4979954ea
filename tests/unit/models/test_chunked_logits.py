"""Log-probs, entropies and their gradients from the output head a few positions at a time equal
those of the whole logits, and the chunked path never builds more than a chunk of logits."""

import copy

import pytest
import torch

from openaligner.algorithms import chunked_token_stats, entropy_from_logits, logprobs_from_logits
from openaligner.models.actor import CausalLMActor
from openaligner.models.generation import SamplingParams
from openaligner.models.lora import LoraConfig, add_lora

ATOL = 1e-5  # float32, as the issue asks: the same numbers as the unchunked path


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_stats_equal_whole_logits_with_gradients(chunk, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7))

    whole = hidden @ weight.T
    lp_ref = logprobs_from_logits(whole, targets, temperature)
    ent_ref = entropy_from_logits(whole, temperature)
    (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
    grads_ref = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    seen: list[int] = []

    def head(h: torch.Tensor, c0: int) -> torch.Tensor:
        seen.append(h.shape[1])
        return h @ weight.T

    lp, ent = chunked_token_stats(hidden, targets, head, temperature, chunk, entropy_grad=True)
    assert ent is not None
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref)
    (lp.sum() + 0.3 * ent.sum()).backward()
    torch.testing.assert_close(hidden.grad, grads_ref[0])
    torch.testing.assert_close(weight.grad, grads_ref[1])
    assert max(seen) == min(chunk, 7)  # forward and recomputation: never more than a chunk


def test_entropy_without_gradient_is_detached_and_can_be_skipped():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    weight = torch.randn(6, 3)
    targets = torch.zeros(1, 4, dtype=torch.long)
    lp, ent = chunked_token_stats(hidden, targets, lambda h, c0: h @ weight.T, 1.0, 2)
    assert lp.requires_grad and ent is not None and not ent.requires_grad
    _, none = chunked_token_stats(hidden, targets, lambda h, c0: h @ weight.T, 1.0, 2, entropy=False)
    assert none is None
    with pytest.raises(ValueError, match="chunk"):
        chunked_token_stats(hidden, targets, lambda h, c0: h @ weight.T, 1.0, 0)


def _budget_for(columns: int, rows: int, vocab: int) -> float:
    """The ``logits_chunk_mb`` that gives ``columns`` positions per chunk."""
    return columns * rows * vocab * 4 / 2**20


def _batch(tiny, rows=3, width=12):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, tiny.size.vocab_size, (rows, width), generator=g)
    lengths = torch.tensor([width, width - 3, width - 5])[:rows]
    prompts = torch.tensor([3, 4, 2])[:rows]
    return tokens, lengths, prompts


# gemma2: soft-capped final logits; LoRA: the adapted body
@pytest.mark.parametrize(
    ("arch", "lora"), [("gpt2", False), ("llama", False), ("gemma2", False), ("llama", True)]
)
def test_actor_chunked_equals_whole_logits_in_scoring_and_training(tiny, arch, lora):
    sampling = SamplingParams(temperature=0.8, min_new_tokens=2, stop_token_ids=(5, 6))
    model = tiny.causal_lm(arch)
    if lora:
        model = add_lora(model, LoraConfig(r=4, target_modules=["all-linear"]))
    tokens, lengths, prompts = _batch(tiny)
    vocab = tiny.size.vocab_size
    whole = CausalLMActor(model, tiny.tokenizer, sampling, init_policy=False, logits_chunk_mb=None)
    budget = _budget_for(3, 3, vocab)
    chunked = CausalLMActor(
        copy.deepcopy(model), tiny.tokenizer, sampling, init_policy=False, logits_chunk_mb=budget
    )
    assert chunked._chunk_columns(chunked.model, 3, 11) == 3

    ref = whole.get_inference_log_probs(tokens, lengths, prompt_lengths=prompts)
    got = chunked.get_inference_log_probs(tokens, lengths, prompt_lengths=prompts)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    for first in (0, 2):
        grads = []
        outs = []
        for actor in (whole, chunked):
            actor.model.zero_grad()
            lp, ent = actor.training_logprobs(
                tokens, lengths, prompts, first_position=first, entropy_grad=True
            )
            (lp.sum() - 0.1 * ent.sum()).backward()
            outs.append((lp.detach(), ent.detach()))
            grads.append({n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=ATOL, rtol=0)
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, atol=ATOL, rtol=1e-4, msg=name)


def test_the_chunked_path_never_builds_the_whole_logits(tiny):
    model = tiny.causal_lm("llama")
    vocab = tiny.size.vocab_size
    actor = CausalLMActor(model, tiny.tokenizer, init_policy=False, logits_chunk_mb=_budget_for(2, 3, vocab))
    tokens, lengths, _ = _batch(tiny)
    widths: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[-2]))
    actor._heads_checked.add(id(model))  # the one-time 8-position check is not the subject here
    lp, ent = actor.training_logprobs(tokens, lengths)
    (lp.sum() + ent.sum()).backward()
    actor.get_inference_log_probs(tokens, lengths)
    hook.remove()
    assert widths and max(widths) == 2, widths


def test_a_model_whose_body_and_head_miss_its_logits_is_refused(tiny):
    model = tiny.causal_lm("gpt2")
    model.config.final_logit_softcapping = 0.5  # GPT-2's forward ignores it; the chunked head would not
    actor = CausalLMActor(model, tiny.tokenizer, init_policy=False, logits_chunk_mb=1e-4)
    tokens, lengths, _ = _batch(tiny)
    with pytest.raises(RuntimeError, match="logits_chunk_mb=null"):
        actor.get_inference_log_probs(tokens, lengths)


def test_small_batches_and_no_budget_use_the_whole_logits(tiny):
    actor = CausalLMActor(tiny.causal_lm(), tiny.tokenizer, init_policy=False)
    assert actor._chunk_columns(actor.model, 64, 128) is None  # 100-token vocabulary: 3 MiB
    actor.logits_chunk_mb = None
    assert actor._chunk_columns(actor.model, 10**6, 10**6) is None
    with pytest.raises(ValueError, match="logits_chunk_mb"):
        CausalLMActor(tiny.causal_lm(), tiny.tokenizer, init_policy=False, logits_chunk_mb=0)
