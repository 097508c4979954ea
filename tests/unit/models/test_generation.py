"""Batched sampling: greedy equals HF ``generate``, stop rules, layout, sampling filters."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from openaligner.models import generation
from openaligner.models.builders import TINY_ARCHS
from openaligner.models.decoders.gpt2 import gpt2_fast_path_supported
from openaligner.models.generation import SamplingParams, generate, select_tokens, stop_string_length

PROMPT_LENGTHS = [5, 9, 3, 7]


def _prompts(
    vocab: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompts [B, P] (pad 0, ids from 3) and lengths [B]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=g)
    lens = torch.tensor(lengths)
    tokens[torch.arange(tokens.shape[1]) >= lens.unsqueeze(-1)] = 0
    return tokens, lens


def _hf_greedy(model, prompts, lengths, new_tokens, eos):
    """Reference: HF generate on left-padded prompts; returns each row's prompt + response list."""
    p_max = int(lengths.max())
    left = torch.zeros(len(lengths), p_max, dtype=torch.long)
    mask = torch.zeros_like(left)
    for i, n in enumerate(lengths.tolist()):
        left[i, p_max - n :] = prompts[i, :n]
        mask[i, p_max - n :] = 1
    with torch.no_grad():
        out = model.generate(
            left,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=eos,
            pad_token_id=0,
        )
    rows = []
    for i, n in enumerate(lengths.tolist()):
        response = out[i, p_max:].tolist()
        if eos in response:
            response = response[: response.index(eos) + 1]
        rows.append(prompts[i, :n].tolist() + response)
    return rows


def _spy_decoders(monkeypatch) -> list:
    """Record every decoder ``generate`` makes, and the rows each ``select_rows`` call keeps."""
    made = []
    make = generation.make_decoder

    def spy(*args, **kwargs):
        decoder = make(*args, **kwargs)
        decoder.compactions = []
        select = decoder.select_rows
        decoder.select_rows = lambda rows: (decoder.compactions.append(rows), select(rows))
        made.append(decoder)
        return decoder

    monkeypatch.setattr(generation, "make_decoder", spy)
    return made


@pytest.mark.parametrize(
    ("arch", "cache", "fast_path", "decoder"),
    [
        ("gpt2", "static", True, "GPT2Decoder"),
        ("gpt2", "static", False, "HFDecoder"),
        ("gpt2", "dynamic", False, "HFDecoder"),
        ("llama", "static", True, "HFDecoder"),
        ("llama", "dynamic", True, "HFDecoder"),
    ],
)
def test_greedy_matches_hf_generate_token_for_token(tiny, arch, cache, fast_path, decoder, monkeypatch):
    model = tiny.causal_lm(arch)
    prompts, lengths = _prompts(tiny.size.vocab_size)
    # A stop id that row 0 produces mid-way, so that rows end at different steps.
    free = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=()), pad_id=1
    )
    stop = int(free.tokens[0, PROMPT_LENGTHS[0] + 4])

    made = _spy_decoders(monkeypatch)
    out = generate(
        model,
        prompts,
        lengths,
        SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=(stop,)),
        pad_id=1,
        cache=cache,
        fast_path=fast_path,
    )
    expected = _hf_greedy(model, prompts, lengths, 12, stop)
    for i, row in enumerate(expected):
        n = int(out.sequence_lengths[i])
        assert out.tokens[i, :n].tolist() == row
        assert bool(out.is_end[i]) == (stop in row[PROMPT_LENGTHS[i] :])
    assert bool(out.is_end[0])
    assert [type(d).__name__ for d in made] == [decoder]
    assert made[0].compactions  # finished rows were dropped from the cache on the way


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_are_the_argmax_of_a_full_forward_for_every_architecture(
    tiny, arch, cache, monkeypatch
):
    """The KV-cached, left-padded sampling loop against the plainest reference: one row at a time
    through the model's forward without a cache. Rows run past Mistral's and Gemma2's sliding
    window (8 tokens) and one ends early, so that finished rows are dropped from the (windowed)
    cache layers; OPT's offset positions and Gemma's scaled embeddings are checked on the way."""
    model = tiny.causal_lm(arch)
    prompts, lengths = _prompts(tiny.size.vocab_size)
    free = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=()), pad_id=0
    )
    stop = int(free.tokens[0, PROMPT_LENGTHS[0] + 3])  # row 0 ends after 4 tokens
    made = _spy_decoders(monkeypatch)
    params = SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=(stop,))
    out = generate(model, prompts, lengths, params, pad_id=0, cache=cache)
    assert made[0].compactions
    assert int(out.sequence_lengths.max()) > tiny.size.sliding_window
    for i, n in enumerate(out.sequence_lengths.tolist()):
        row = out.tokens[i : i + 1, :n]
        with torch.no_grad():
            logits = model(input_ids=row).logits[0]
        p = PROMPT_LENGTHS[i]
        assert row[0, p:].tolist() == logits[p - 1 : n - 1].argmax(-1).tolist(), i


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_hf_decoder_hands_the_model_its_cache_by_the_current_name(tiny, arch, cache):
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` and removes the old
    name in 5.40, where a model would take it into ``**kwargs`` and decode without a cache. Passed
    by the new name, nothing warns (the tokens are checked against a full forward above)."""
    model = tiny.causal_lm(arch)
    prompts, lengths = _prompts(tiny.size.vocab_size)
    params = SamplingParams(greedy=True, max_new_tokens=3, stop_token_ids=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, prompts, lengths, params, pad_id=0, cache=cache, fast_path=False)
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_mixture_of_experts_configured_to_output_router_logits_generates(tiny, cache):
    """``output_router_logits: true`` in a config (as MoE fine-tuning recipes save it, to train with
    the load-balancing loss) made every cached decoding step fail: the step's router logits cover
    the new token only, while the load-balancing loss reduces them over the whole attention mask.
    Generation needs no router logits and asks for none."""
    model = tiny.causal_lm("mixtral")
    prompts, lengths = _prompts(tiny.size.vocab_size)
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=())
    expected = generate(model, prompts, lengths, params, pad_id=0, cache=cache)
    model.config.output_router_logits = True
    out = generate(model, prompts, lengths, params, pad_id=0, cache=cache)
    assert torch.equal(out.tokens, expected.tokens)


def _modified_gpt2(tiny, how):
    model = tiny.causal_lm("gpt2")
    if how == "train":
        model.train()
    elif how == "hook":
        model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    elif how == "replaced_layer":
        block = model.transformer.h[1].attn

        class Doubled(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return 2 * self.inner(x)

        block.c_proj = Doubled(block.c_proj)
    return model


@pytest.mark.parametrize("how", ["train", "hook", "replaced_layer"])
def test_non_stock_gpt2_falls_back_to_the_model_forward(tiny, how, monkeypatch):
    model = _modified_gpt2(tiny, how)
    assert gpt2_fast_path_supported(tiny.causal_lm("gpt2"))
    assert not gpt2_fast_path_supported(model)
    assert not gpt2_fast_path_supported(tiny.causal_lm("llama"))
    prompts, lengths = _prompts(tiny.size.vocab_size)
    made = _spy_decoders(monkeypatch)
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=())
    out = generate(model, prompts, lengths, params, pad_id=1)
    forward = generate(model, prompts, lengths, params, pad_id=1, fast_path=False)
    assert [type(d).__name__ for d in made] == ["HFDecoder", "HFDecoder"]
    assert torch.equal(out.tokens, forward.tokens)


def test_gpt2_decoder_samples_what_the_model_forward_samples(tiny):
    """Same seed, same random stream: the fast path draws the tokens the general path draws,
    through stop ids, min_new_tokens, row compaction, temperature and top-k."""
    model = tiny.causal_lm("gpt2")
    prompts, lengths = _prompts(tiny.size.vocab_size)
    params = SamplingParams(
        max_new_tokens=16, min_new_tokens=2, temperature=0.7, top_k=20, stop_token_ids=tuple(range(3, 11))
    )

    def run(fast_path):
        g = torch.Generator().manual_seed(2)
        return generate(model, prompts, lengths, params, pad_id=1, generator=g, fast_path=fast_path)

    fast, forward = run(True), run(False)
    assert torch.equal(fast.tokens, forward.tokens)
    assert torch.equal(fast.sequence_lengths, forward.sequence_lengths)
    assert torch.equal(fast.is_end, forward.is_end)
    assert fast.is_end.any() and not fast.is_end.all()  # rows ended at different steps


def test_output_layout_prompt_then_response_then_pad(tiny):
    model = tiny.causal_lm()
    prompts, lengths = _prompts(tiny.size.vocab_size)
    out = generate(
        model,
        prompts,
        lengths,
        SamplingParams(max_new_tokens=6, stop_token_ids=()),
        pad_id=7,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.tokens.dtype == torch.long
    assert out.tokens.shape == (4, int(out.sequence_lengths.max()))
    assert out.prompt_lengths.tolist() == PROMPT_LENGTHS
    assert out.sequence_lengths.tolist() == [n + 6 for n in PROMPT_LENGTHS]
    assert not out.is_end.any()
    for i, n in enumerate(PROMPT_LENGTHS):
        assert torch.equal(out.tokens[i, :n], prompts[i, :n])
        assert (out.tokens[i, n + 6 :] == 7).all()


def test_stop_tokens_set_is_end_and_lengths(tiny):
    model = tiny.causal_lm("llama")
    prompts, lengths = _prompts(tiny.size.vocab_size)
    free = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=()), pad_id=1
    )
    stops = (int(free.tokens[1, 9 + 2]), int(free.tokens[2, 3 + 5]))
    out = generate(
        model,
        prompts,
        lengths,
        SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stops),
        pad_id=1,
    )
    for i, n in enumerate(PROMPT_LENGTHS):
        response = free.tokens[i, n : n + 10].tolist()
        hits = [j for j, t in enumerate(response) if t in stops]
        expected_new = hits[0] + 1 if hits else 10
        assert int(out.sequence_lengths[i]) == n + expected_new
        assert bool(out.is_end[i]) == bool(hits)
        if hits:
            assert int(out.tokens[i, n + expected_new - 1]) in stops
    assert out.is_end[1] and out.is_end[2]


def test_stop_strings_end_on_the_token_completing_the_string(tiny):
    model = tiny.causal_lm()
    tok = tiny.tokenizer
    prompts, lengths = _prompts(tiny.size.vocab_size)
    free = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=()), pad_id=1
    )
    n0 = PROMPT_LENGTHS[0]
    stop = tok.decode(free.tokens[0, n0 + 3 : n0 + 5].tolist())  # two characters generated by row 0
    assert len(stop) == 2
    out = generate(
        model,
        prompts,
        lengths,
        SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=(), stop_strings=(stop,)),
        pad_id=1,
        tokenizer=tok,
    )
    for i, n in enumerate(PROMPT_LENGTHS):
        response = free.tokens[i, n : n + 10].tolist()
        ends = [j + 1 for j in range(10) if stop in tok.decode(response[: j + 1])]
        expected_new = ends[0] if ends else 10
        assert int(out.sequence_lengths[i]) == n + expected_new
        assert bool(out.is_end[i]) == bool(ends)
    assert out.is_end[0]
    assert int(out.sequence_lengths[0]) <= n0 + 5


@pytest.mark.parametrize("min_new", [0, 4])
def test_cutting_a_finished_response_at_its_stop_string_is_what_the_loop_does(tiny, min_new):
    """stop_string_length (the vllm engine's rule: it cannot match strings while sampling) cuts
    greedy responses generated without stop strings exactly where the loop with them ended."""
    model = tiny.causal_lm()
    tok = tiny.tokenizer
    prompts, lengths = _prompts(tiny.size.vocab_size)
    base = SamplingParams(greedy=True, max_new_tokens=10, min_new_tokens=min_new, stop_token_ids=())
    free = generate(model, prompts, lengths, base, pad_id=1)
    n0 = PROMPT_LENGTHS[0]
    stops = (tok.decode(free.tokens[0, n0 + 3 : n0 + 5].tolist()), "never-generated")
    with_stops = dataclasses.replace(base, stop_strings=stops)
    out = generate(model, prompts, lengths, with_stops, pad_id=1, tokenizer=tok)
    for i, n in enumerate(PROMPT_LENGTHS):
        cut = stop_string_length(free.tokens[i, n : n + 10].tolist(), stops, min_new, tok)
        assert int(out.sequence_lengths[i]) == n + (cut if cut is not None else 10)
        assert bool(out.is_end[i]) == (cut is not None)
    assert stop_string_length(free.tokens[0, n0 : n0 + 10].tolist(), stops, min_new, tok) is not None


def test_stop_strings_need_a_tokenizer(tiny):
    prompts, lengths = _prompts(tiny.size.vocab_size)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(tiny.causal_lm(), prompts, lengths, SamplingParams(stop_strings=("x",)), pad_id=1)


def test_min_new_tokens_bans_stops_early(tiny):
    model = tiny.causal_lm()
    prompts, lengths = _prompts(tiny.size.vocab_size)
    free = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=()), pad_id=1
    )
    # Every row's first generated token as a stop id: without min_new_tokens all rows end at once.
    stops = tuple(sorted({int(free.tokens[i, n]) for i, n in enumerate(PROMPT_LENGTHS)}))
    early = generate(
        model, prompts, lengths, SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=stops), pad_id=1
    )
    assert early.sequence_lengths.tolist() == [n + 1 for n in PROMPT_LENGTHS]
    out = generate(
        model,
        prompts,
        lengths,
        SamplingParams(greedy=True, max_new_tokens=8, min_new_tokens=4, stop_token_ids=stops),
        pad_id=1,
    )
    for i, n in enumerate(PROMPT_LENGTHS):
        new = int(out.sequence_lengths[i]) - n
        assert new >= 4
        assert not set(out.tokens[i, n : n + 4].tolist()) & set(stops)
        assert bool(out.is_end[i]) == (int(out.tokens[i, n + new - 1]) in stops)


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny):
    model = tiny.causal_lm()
    prompts, lengths = _prompts(tiny.size.vocab_size)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(), temperature=1.5)

    def run(seed):
        return generate(
            model, prompts, lengths, params, pad_id=1, generator=torch.Generator().manual_seed(seed)
        )

    assert torch.equal(run(3).tokens, run(3).tokens)
    assert not torch.equal(run(3).tokens, run(4).tokens)


def test_max_positions_is_checked(tiny):
    prompts, lengths = _prompts(tiny.size.vocab_size)
    with pytest.raises(ValueError, match="positions"):
        generate(
            tiny.causal_lm(),
            prompts,
            lengths,
            SamplingParams(max_new_tokens=tiny.size.max_positions),
            pad_id=1,
        )


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(select_tokens(logits, SamplingParams(top_k=1), g), greedy)
    assert torch.equal(select_tokens(logits, SamplingParams(top_p=1e-6), g), greedy)


def test_filters_keep_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    g = torch.Generator().manual_seed(0)
    top_k = select_tokens(logits, SamplingParams(top_k=2), g)
    assert set(top_k.tolist()) == {0, 1}
    # top_p=0.7: 0.5 alone is not enough, 0.5+0.3 is; token 2 and 3 are cut.
    top_p = select_tokens(logits, SamplingParams(top_p=0.7), g)
    assert set(top_p.tolist()) == {0, 1}
    banned = select_tokens(logits, SamplingParams(), g, banned=torch.tensor([0]))
    assert 0 not in set(banned.tolist())


def test_sampler_frequencies_match_temperature_scaled_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    temperature = 2.0
    draws = select_tokens(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    expected = torch.softmax(logits[0] / temperature, -1)
    # Binomial standard error at n=20000 is ≤ 0.0036; 0.015 is > 4 sigma.
    assert torch.allclose(freq, expected, atol=0.015)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"max_new_tokens": 0}, {"min_new_tokens": 99}],
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
