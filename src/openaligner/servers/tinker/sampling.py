"""``asample`` for the Tinker API: the sampling settings a client sends turned into the rollout
engine's, the samples drawn through the :class:`~openaligner.rollout.engine.RolloutEngine`
seam, and the log-probs Tinker returns with them.

Owns :class:`TinkerSampling` (``sampling_params`` read and checked), :class:`SampledSequence`,
:func:`sample` and :func:`sample_many` (several requests as one engine request and one scoring
forward). Must not know HTTP, sessions, the job queue or the wire encoding.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner.rollout.engine import RolloutEngine, RolloutRequest, row_seeds
from openaligner.trainer.tinker_model import LOGITS_BUDGET, TinkerInputError


@dataclass(frozen=True)
class TinkerSampling:
    """``sampling_params`` of an ``asample`` request, checked."""

    max_tokens: int
    temperature: float
    top_k: int  # 0: no limit (Tinker's -1)
    top_p: float
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...] | None  # None: the tokenizer's EOS

    @classmethod
    def parse(cls, params: Mapping[str, Any], *, default_max_tokens: int, vocab_size: int) -> TinkerSampling:
        """Read ``sampling_params`` as the SDK writes them (``stop``: a string, a list of strings
        or a list of token ids; absent: the EOS token; ``[]``: none at all).

        Raises:
            TinkerInputError: a setting out of range, naming it.
        """
        max_tokens = params.get("max_tokens")
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise TinkerInputError(f"sampling_params.max_tokens must be an integer >= 1, got {max_tokens!r}")
        temperature = float(params.get("temperature", 1.0))
        if not math.isfinite(temperature) or temperature < 0:
            raise TinkerInputError(f"sampling_params.temperature must be >= 0, got {temperature}")
        top_k = int(params.get("top_k", -1))
        if top_k < -1 or top_k == 0:
            raise TinkerInputError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {top_k}")
        top_p = float(params.get("top_p", 1.0))
        if not 0.0 < top_p <= 1.0:
            raise TinkerInputError(f"sampling_params.top_p must lie in (0, 1], got {top_p}")
        seed = params.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise TinkerInputError(f"sampling_params.seed must be an integer or null, got {seed!r}")
        stop = params.get("stop")
        strings: tuple[str, ...] = ()
        ids: tuple[int, ...] | None = None
        if isinstance(stop, str):
            strings = (stop,)
        elif isinstance(stop, list):
            if all(isinstance(s, str) for s in stop):
                strings = tuple(stop)
                ids = () if not stop else None
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                ids = tuple(stop)
                bad = [i for i in ids if not 0 <= i < vocab_size]
                if bad:
                    raise TinkerInputError(
                        f"sampling_params.stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                    )
            else:
                raise TinkerInputError("sampling_params.stop must be all strings or all token ids")
        elif stop is not None:
            raise TinkerInputError(
                f"sampling_params.stop must be a string or a list, got {type(stop).__name__}"
            )
        if any(not s for s in strings):
            raise TinkerInputError("sampling_params.stop holds an empty string")
        return cls(max_tokens, temperature, 0 if top_k == -1 else top_k, top_p, seed, strings, ids)


@dataclass(frozen=True)
class SampledSequence:
    """One sample: ``tokens`` [T] int64 (stop token or string included, once), ``logprobs`` [T]
    float32 (each token's log-prob under the distribution it was drawn from), ``stop_reason``
    ``stop`` (a stop id or string ended it) or ``length``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    stop_reason: str


@dataclass(frozen=True)
class SampleRequest:
    """One ``asample`` call as :func:`sample_many` takes it."""

    prompt: torch.Tensor  # [P] int64
    num_samples: int
    params: TinkerSampling
    prompt_logprobs: bool = False  # also the prompt's own log-probs


def merge_key(params: TinkerSampling) -> TinkerSampling:
    """What requests must share to be drawn as one engine request: every setting but the seed
    (one :class:`~openaligner.rollout.engine.RolloutRequest` carries one ``SamplingParams``; the
    seeds are per row)."""
    return replace(params, seed=None)


@torch.no_grad()
def sample(
    engine: RolloutEngine,
    model: PreTrainedModel,
    prompt: torch.Tensor,
    num_samples: int,
    params: TinkerSampling,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt_logprobs: bool,
) -> tuple[list[SampledSequence], torch.Tensor | None]:
    """``num_samples`` continuations of ``prompt`` [P] int64 and, with ``prompt_logprobs``, the
    prompt's own log-probs [P]: :func:`sample_many` of this one request."""
    (out,) = sample_many(
        engine, model, [SampleRequest(prompt, num_samples, params, prompt_logprobs)], tokenizer=tokenizer
    )
    return out


@torch.no_grad()
def sample_many(
    engine: RolloutEngine,
    model: PreTrainedModel,
    requests: Sequence[SampleRequest],
    *,
    tokenizer: PreTrainedTokenizerBase | None,
) -> list[tuple[list[SampledSequence], torch.Tensor | None]]:
    """Every request's ``num_samples`` continuations of its prompt, drawn by ``engine`` as ONE
    engine request (the requests' rows in order), scored by ONE forward of ``model``; per request,
    its samples and, with ``prompt_logprobs``, its prompt's own log-probs [P] (NaN at position 0,
    which nothing predicts).

    Seeds: request ``r``'s rows carry ``row_seeds(r.params.seed, r.num_samples)`` (a random seed
    when None), whoever else is in the batch; an engine that draws each row from its own seed's
    stream (vllm, the Tinker ``hf`` engine) samples a seeded request's rows alike alone or
    batched, up to float rounding of the batched forward (the request's prompts are right-padded to
    the longest, with their lengths; the hf loop left-aligns them itself).

    Log-probs are ``model``'s (one forward over the samples, whichever engine drew them; ``model``
    holds the weights the engine sampled from): of sampled tokens at the sampling temperature
    (before top-k / top-p), of the prompt at temperature 1. The rows are right-padded and start at
    position 0, so a causal model's logits at a row's real positions never see the padding (equal
    to the row's alone, to float tolerance). An engine that reports log-probs of its own (vllm)
    has them compared with these (:meth:`RolloutEngine.check_logprobs`: it raises when, just after
    a weight push, they show it sampled other weights) where they mean the same: without top-k /
    top-p, which renormalise the engine's over the kept tokens.

    Raises:
        ValueError: the requests differ in a setting other than the seed (:func:`merge_key`).
    """
    from openaligner.models.generation import SamplingParams, resolve_stop_ids

    if not requests:
        return []
    params = requests[0].params
    if any(merge_key(r.params) != merge_key(params) for r in requests):
        raise ValueError("requests sampled as one must share every sampling setting but the seed")
    greedy = params.temperature == 0
    sampling = SamplingParams(
        greedy=greedy,
        temperature=1.0 if greedy else params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop_strings,
    )
    # the engine takes resolved stop ids: None (no ids named) is the tokenizer's EOS
    sampling = replace(sampling, stop_token_ids=tuple(resolve_stop_ids(sampling, model, tokenizer)))
    lengths = [int(r.prompt.numel()) for r in requests]
    firsts = [sum(r.num_samples for r in requests[:i]) for i in range(len(requests))]  # first row of each
    rows = sum(r.num_samples for r in requests)
    prompts = torch.zeros((rows, max(lengths)), dtype=torch.int64)
    seeds = []
    for r, p, first in zip(requests, lengths, firsts, strict=True):
        prompts[first : first + r.num_samples, :p] = r.prompt.reshape(1, p)
        seed = r.params.seed if r.params.seed is not None else secrets.randbits(62)
        seeds.append(row_seeds(seed, r.num_samples))
    prompt_lengths = torch.tensor(
        [p for r, p in zip(requests, lengths, strict=True) for _ in range(r.num_samples)], dtype=torch.int64
    )
    out = engine.generate(RolloutRequest(prompts, prompt_lengths, sampling, torch.cat(seeds)))
    device = next(model.parameters()).device
    scale = 1.0 if greedy else params.temperature
    want_prompt = {first for r, first in zip(requests, firsts, strict=True) if r.prompt_logprobs}
    mine, prompt_scored = _score(model, out.tokens.to(device), scale, prompt_lengths, want_prompt)
    results = []
    for r, p, first in zip(requests, lengths, firsts, strict=True):
        sequences = []
        for row in range(first, first + r.num_samples):
            end = int(out.sequence_lengths[row])
            tokens = out.tokens[row, p:end]
            # mine[row, j] is the log-prob of token j + 1: the samples' are p - 1 .. end - 2
            lp = mine[row, p - 1 : end - 1]
            reason = "stop" if bool(out.is_end[row]) else "length"
            sequences.append(SampledSequence(tokens.cpu(), lp.cpu(), reason))
        prompt_lp = None
        if r.prompt_logprobs:
            prompt_lp = torch.cat([torch.tensor([float("nan")]), prompt_scored[first]])
        results.append((sequences, prompt_lp))
    if out.logprobs is not None and params.top_k == 0 and params.top_p == 1.0:
        width = out.tokens.shape[1]
        positions = torch.arange(1, width)[None, :]
        mask = (positions >= prompt_lengths[:, None]) & (positions < out.sequence_lengths[:, None])
        engine.check_logprobs(out.logprobs, mine.cpu(), mask.float())
    return results


def _score(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    scale: float,
    prompt_lengths: torch.Tensor,
    prompt_rows: set[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Log-probs of ``tokens`` [R, W] under ``model``: [R, W - 1] float32, entry ``[i, j]`` that of
    ``tokens[i, j + 1]`` at temperature ``scale``; and for each row of ``prompt_rows`` its prompt's
    own [P - 1] at temperature 1 (positions 1..P-1, on the CPU).

    The forward runs over as many rows at a time as keep its float32 logits under
    :data:`~openaligner.trainer.tinker_model.LOGITS_BUDGET` elements (a merged run of 64 rows of a
    262k vocabulary would otherwise hold several GB of logits at once); a causal model's rows do
    not see each other, so the chunks change nothing but float rounding.
    """
    rows, width = tokens.shape
    vocab = int(getattr(model.config, "vocab_size", 0) or 1)
    step = max(1, LOGITS_BUDGET // max(1, width * vocab))
    mine = torch.empty(rows, width - 1, dtype=torch.float32, device=tokens.device)
    prompt: dict[int, torch.Tensor] = {}
    for start in range(0, rows, step):
        chunk = tokens[start : start + step]
        logits = model(input_ids=chunk).logits.float()
        lp = torch.log_softmax(logits[:, :-1] / scale, dim=-1)
        mine[start : start + len(chunk)] = lp.gather(-1, chunk[:, 1:, None])[..., 0]
        del lp
        for row in prompt_rows:
            if start <= row < start + len(chunk):
                p = int(prompt_lengths[row])
                base = torch.log_softmax(logits[row - start, : p - 1], dim=-1)
                prompt[row] = base.gather(-1, chunk[row - start, 1:p, None])[:, 0].cpu()
    return mine, prompt


def prompt_tokens(prompt: Mapping[str, Any], vocab_size: int) -> torch.Tensor:
    """[P] int64: the ``encoded_text`` chunks of a ``ModelInput`` (JSON), concatenated.

    Raises:
        TinkerInputError: another chunk type (images are not served), an empty prompt, or an id
            outside the vocabulary.
    """
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list):
        raise TinkerInputError(
            "prompt must be a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}"
        )
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise TinkerInputError(
                f"prompt chunk {i} is of type {kind!r}; this server serves text models only (encoded_text)"
            )
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise TinkerInputError(f"prompt chunk {i}: tokens must be a list of integers")
        ids.extend(tokens)
    check_ids(ids, vocab_size, "prompt")
    return torch.tensor(ids, dtype=torch.int64)


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Refuse an empty id list or one with ids outside ``[0, vocab_size)``."""
    if not ids:
        raise TinkerInputError(f"{what} holds no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise TinkerInputError(
            f"{what} token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )
