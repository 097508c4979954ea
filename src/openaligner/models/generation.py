"""Batched sampling from a Hugging Face causal LM with a KV cache: the actor's rollout engine.

Owns the sampling parameters, the token-selection rules (greedy, temperature, top-k, top-p,
min/max new tokens, stop ids and strings), the sampling loop and the output layout (right-padded
``[B, S]``: prompt, response with its stop token, then ``pad_id``). Must not know about PPO,
rewards or training, nor any architecture (a :class:`~openaligner.models.decoders.base.Decoder`
steps the model). Design notes (the layout): docs/models.md, "Module notes".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openaligner.models.decoders.base import CacheKind
from openaligner.models.fast_paths import make_decoder
from openaligner.models.positions import position_limit
from openaligner.models.sharding import compute_device


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Defaults: plain ancestral sampling at temperature 1, 64 new tokens."""

    greedy: bool = False  # argmax instead of sampling (temperature/top-k/top-p ignored)
    temperature: float = 1.0  # logits are divided by this before top-k/top-p and sampling
    top_k: int = 0  # keep only the k most likely tokens; 0 disables
    top_p: float = 1.0  # nucleus sampling: smallest set with cumulative probability ≥ top_p; 1 disables
    max_new_tokens: int = 64  # response length limit (stop token included)
    min_new_tokens: int = 0  # stop ids are banned and stop strings ignored before this many new tokens
    # a response ends after one of these ids; None: the tokenizer's EOS (see resolve_stop_ids)
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()  # ... or when its decoded text contains one

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must lie in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )

    @property
    def logprob_temperature(self) -> float:
        """The temperature the log-probs of sampled tokens must use (1 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class Generation:
    """The result of :func:`generate`."""

    tokens: torch.Tensor  # [B, S] int64: prompt, response, then pad_id; S = max(sequence_lengths)
    sequence_lengths: torch.Tensor  # [B] int64: prompt + response tokens (stop token included)
    prompt_lengths: torch.Tensor  # [B] int64
    is_end: torch.Tensor  # [B] bool: the response ended on a stop token id or a stop string
    # [B, S-1] float32 or None: an engine's own log-prob of each next token (position t scores
    # tokens[t+1]; only response positions are meaningful) — compared with the trainer's, never used
    logprobs: torch.Tensor | None = None


def generate(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    *,
    pad_id: int,
    generator: torch.Generator | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    cache: CacheKind = "static",
    fast_path: bool = True,
    step_together: Callable[[bool], bool] | None = None,
    draws: torch.Tensor | None = None,
) -> Generation:
    """Sample responses for a batch of prompts of different lengths.

    Args:
        model: a decoder-only causal LM; used as is (call ``eval()`` first for no dropout).
        prompts: [B, P] int64, right-padded (values beyond a row's length are ignored).
        prompt_lengths: [B] int64, each in [1, P].
        params: sampling parameters.
        pad_id: id written after each response.
        generator: seeded generator on the model's device for reproducible sampling.
        tokenizer: decodes responses for ``params.stop_strings``; its EOS id is the default stop id.
        cache: Hugging Face KV cache of the general path: ``"static"`` (preallocated; fastest) or
            ``"dynamic"`` (grows per step; for models whose attention does not support a static
            cache). A fast-path decoder keeps its own preallocated cache and ignores it.
        fast_path: let :func:`~openaligner.models.fast_paths.make_decoder` step a model it
            supports with an architecture-specific decoder (same tokens, less per-step
            overhead); ``False`` always uses the model's forward.
        step_together: for a model whose forwards are collectives (sharded weights gathered layer
            by layer): called once per step on every process with whether this process's rows
            have all ended, it returns whether any process's have not; every process steps until
            none has rows left (a process that has ended feeds padding, discarded). None: stop as
            soon as this process's rows end.
        draws: [B, max_new_tokens] float32 in [0, 1) (:func:`row_draws`): row ``i``'s token at
            step ``t`` is drawn with ``draws[i, t]`` instead of from ``generator``, so a row's
            tokens do not depend on its batch-mates (one stream per row). None: ``generator``.

    Returns:
        A :class:`Generation` on the model's device. Generation runs under
        ``torch.inference_mode`` (cheaper than ``no_grad``; ``no_grad`` with ``step_together``,
        since a sharded model's gathered weights are reused by later training forwards); the
        results are cloned out of it so they can feed autograd later (e.g. as ``input_ids`` of a
        training forward).
    """
    with torch.inference_mode() if step_together is None else torch.no_grad():
        out = _sample_loop(
            model,
            prompts,
            prompt_lengths,
            params,
            pad_id,
            generator,
            tokenizer,
            cache,
            fast_path,
            step_together,
            draws,
        )
    return Generation(
        tokens=out.tokens.clone(),
        sequence_lengths=out.sequence_lengths.clone(),
        prompt_lengths=out.prompt_lengths.clone(),
        is_end=out.is_end.clone(),
    )


def _sample_loop(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    pad_id: int,
    generator: torch.Generator | None,
    tokenizer: PreTrainedTokenizerBase | None,
    cache: CacheKind,
    fast_path: bool,
    step_together: Callable[[bool], bool] | None = None,
    draws: torch.Tensor | None = None,
) -> Generation:
    """The body of :func:`generate` (inference mode, inference tensors out)."""
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode responses; pass tokenizer=")
    device = compute_device(model)
    prompts = prompts.to(device=device, dtype=torch.long)
    lengths = prompt_lengths.to(device=device, dtype=torch.long).reshape(-1)
    _check_prompts(prompts, lengths, params, model)
    batch = prompts.shape[0]
    if draws is not None:
        if draws.shape != (batch, params.max_new_tokens):
            raise ValueError(
                f"draws must be [B, max_new_tokens] = [{batch}, {params.max_new_tokens}], "
                f"got {tuple(draws.shape)}"
            )
        draws = draws.to(device=device, dtype=torch.float32)
    p_max = int(lengths.max())
    total = p_max + params.max_new_tokens

    buf, attention = _left_pad(prompts, lengths, p_max, total, pad_id)
    positions = (attention[:, :p_max].cumsum(-1) - 1).clamp(min=0)
    decoder = make_decoder(model, attention, total, cache, fast_path)
    logits = decoder.prefill(buf[:, :p_max], positions)

    stop_ids = torch.tensor(resolve_stop_ids(params, model, tokenizer), dtype=torch.long, device=device)
    # Without stop ids or strings no row can end early: the per-step stop checks (and their
    # device syncs) are skipped and every row runs max_new_tokens.
    can_stop = stop_ids.numel() > 0 or bool(params.stop_strings)
    new_tokens = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
    is_end = torch.zeros(batch, dtype=torch.bool, device=device)
    # Rows still in the KV cache (original row ids) and which of them have finished since the last
    # compaction. Finished rows are dropped from the cache once they are a quarter of it.
    active = torch.arange(batch, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    finished = 0
    next_positions = lengths.clone()  # [active] position id of the token being appended
    steps: int | None = None  # the step after which this process's rows had all ended
    for step in range(params.max_new_tokens):
        banned = stop_ids if step < params.min_new_tokens else None
        u = None if draws is None else draws[active, step]
        token = select_tokens(logits, params, generator, banned, draws=u)
        if finished:
            token = token.masked_fill(done, pad_id)
        buf[active, p_max + step] = token
        if can_stop:
            hit = torch.isin(token, stop_ids) & ~done
            if params.stop_strings and step + 1 >= params.min_new_tokens:
                assert tokenizer is not None
                generated = buf[active, p_max : p_max + step + 1]
                hit |= _stop_string_hits(generated, done, params.stop_strings, tokenizer)
            new_tokens[active[hit]] = step + 1
            is_end[active[hit]] = True
            done |= hit
            finished = int(done.sum())
        all_ended = finished == done.numel()
        if all_ended and steps is None:
            steps = step + 1
        if step + 1 == params.max_new_tokens:
            break
        if not (step_together(all_ended) if step_together is not None else not all_ended):
            break
        if finished and 4 * finished >= done.numel() and not all_ended:
            keep = (~done).nonzero().squeeze(-1)
            active, token, done = active[keep], token[keep], done[keep]
            next_positions = next_positions[keep]
            decoder.select_rows(keep)
            finished = 0
        logits = decoder.step(token, next_positions, p_max + step)
        next_positions = next_positions + 1

    new_tokens = new_tokens.clamp(max=steps if steps is not None else params.max_new_tokens)
    sequence_lengths = lengths + new_tokens
    tokens = _to_right_padded(buf, p_max - lengths, sequence_lengths, pad_id)
    return Generation(tokens=tokens, sequence_lengths=sequence_lengths, prompt_lengths=lengths, is_end=is_end)


def resolve_stop_ids(
    params: SamplingParams, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> list[int]:
    """The stop ids in effect: ``params.stop_token_ids`` when set, else the default EOS rule.

    The default (``stop_token_ids=None``) is the tokenizer's EOS id — the token SFT appends to
    every response, so the one a fine-tuned policy learned to end with — and only without a
    tokenizer (or one without EOS) the model config's ``eos_token_id`` (one id or a list).
    """
    if params.stop_token_ids is not None:
        return sorted(set(params.stop_token_ids))
    return default_eos_ids(model, tokenizer)


def default_eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> list[int]:
    """The tokenizer's EOS id, else the model config's ``eos_token_id`` id(s), else none."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return config_eos_ids(model)


def config_eos_ids(model: PreTrainedModel) -> list[int]:
    """``model.config.eos_token_id`` as a sorted list of ids (empty when unset)."""
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return sorted({int(e) for e in eos}) if isinstance(eos, list) else [int(eos)]


def mask_early_stops(
    logits: torch.Tensor,
    first_position: int,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """The distribution sampling drew from under ``min_new_tokens``: stop ids banned early.

    :func:`generate` gives the stop ids probability 0 while a response has fewer than
    ``min_new_tokens`` tokens; log-probs scored on the unmasked logits would then differ from
    the sampling distribution (the PPO ratio would be off-policy at those tokens). This applies
    the same ban to scoring logits.

    Args:
        logits: [B, T, V] where column ``c`` predicts the token at position
            ``first_position + c + 1`` of right-padded prompt + response rows.
        first_position: the position of the token column 0 was computed at.
        prompt_lengths: [B] prompt tokens per row.
        params: the sampling parameters used for the rollout; ``params.stop_token_ids`` must be
            resolved (not ``None``).

    Returns:
        ``logits`` (float32) with the stop ids set to −1e30 where the predicted token is one of
        the first ``min_new_tokens`` response tokens — a finite value, so that entropies and
        gradients stay finite, and far below any real logit even after temperature scaling.
        ``logits`` unchanged when nothing is banned.
    """
    stop_ids = params.stop_token_ids or ()
    if params.min_new_tokens == 0 or not stop_ids:
        return logits
    device = logits.device
    predicted = torch.arange(logits.shape[1], device=device) + first_position + 1  # [T]
    index = predicted.unsqueeze(0) - prompt_lengths.to(device).unsqueeze(-1)  # [B, T] response index
    early = (index >= 0) & (index < params.min_new_tokens)  # [B, T]
    is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
    is_stop[torch.tensor(sorted(set(stop_ids)), device=device)] = True
    ban = early.unsqueeze(-1) & is_stop  # [B, T, V]
    return logits.float().masked_fill(ban, -1e30)


def select_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    banned: torch.Tensor | None = None,
    draws: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` [B, V] → [B] int64.

    ``banned`` ids (e.g. stop ids before ``min_new_tokens``) get probability 0. ``draws`` [B] in
    [0, 1): each row's uniform draw (else drawn from ``generator``).
    """
    x = logits.float()
    if banned is not None and banned.numel():
        x = x.index_fill(-1, banned, float("-inf"))
    if params.greedy:
        return x.argmax(-1)
    if params.temperature != 1.0:
        x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = _top_p_filter(x, params.top_p)
    return _sample(torch.softmax(x, dim=-1), generator, draws)


def row_draws(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """[len(seeds), steps] float32 uniforms in [0, 1): row ``i`` from a CPU ``torch.Generator``
    seeded ``seeds[i]`` alone, so a row's draws depend on its seed only (not on the device, its
    batch-mates or their number): :func:`generate`'s ``draws``."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows) if rows else torch.zeros(0, steps)


def _sample(
    probs: torch.Tensor, generator: torch.Generator | None, draws: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row from ``probs`` [B, V] by inverting the CDF: [B] int64 (``draws`` [B]:
    the rows' uniforms; None: drawn from ``generator``).

    One uniform number per row instead of ``torch.multinomial``'s V exponential draws per row
    (≈ 0.5 ms per step at B=64, V=512 on CPU). Zero-probability tokens have zero-width intervals
    and are never drawn.
    """
    cdf = probs.cumsum(-1)
    if draws is not None:
        u = draws.to(cdf.dtype).reshape(-1, 1)
    else:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return index.clamp(max=probs.shape[-1] - 1).squeeze(-1)


def _top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= top_p  # the most likely token always stays (mass before it is 0)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _check_prompts(
    prompts: torch.Tensor, lengths: torch.Tensor, params: SamplingParams, model: PreTrainedModel
) -> None:
    if prompts.dim() != 2 or lengths.shape[0] != prompts.shape[0] or prompts.shape[0] == 0:
        raise ValueError(
            f"expected prompts [B, P] with B ≥ 1 and lengths [B], got {tuple(prompts.shape)} and "
            f"{tuple(lengths.shape)}"
        )
    if int(lengths.min()) < 1 or int(lengths.max()) > prompts.shape[1]:
        raise ValueError(f"prompt lengths must lie in [1, {prompts.shape[1]}], got {lengths.tolist()}")
    limit = position_limit(model.config)
    needed = int(lengths.max()) + params.max_new_tokens
    if limit is not None and needed > limit:
        raise ValueError(
            f"longest prompt ({int(lengths.max())}) + max_new_tokens ({params.max_new_tokens}) = {needed} "
            f"exceeds the model's {limit} positions; lower max_new_tokens or filter long prompts"
        )


def _left_pad(
    prompts: torch.Tensor, lengths: torch.Tensor, p_max: int, total: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token buffer [B, total] (prompts left-padded into the first p_max columns) and the
    attention mask [B, total] (0 on left padding, 1 elsewhere)."""
    batch = prompts.shape[0]
    offset = (p_max - lengths).unsqueeze(-1)
    col = torch.arange(p_max, device=prompts.device).unsqueeze(0)
    source = (col - offset).clamp(min=0)
    is_pad = col < offset
    buf = torch.full((batch, total), pad_id, dtype=torch.long, device=prompts.device)
    buf[:, :p_max] = prompts.gather(1, source).masked_fill(is_pad, pad_id)
    attention = torch.ones((batch, total), dtype=torch.long, device=prompts.device)
    attention[:, :p_max] = (~is_pad).long()
    return buf, attention


def _to_right_padded(
    buf: torch.Tensor, offset: torch.Tensor, sequence_lengths: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Shift each row left by its padding ``offset`` [B]: [B, total] → [B, max(sequence_lengths)]."""
    width = int(sequence_lengths.max())
    col = torch.arange(width, device=buf.device).unsqueeze(0)
    index = (col + offset.unsqueeze(-1)).clamp(max=buf.shape[1] - 1)
    out = buf.gather(1, index)
    return out.masked_fill(col >= sequence_lengths.unsqueeze(-1), pad_id)


def stop_string_length(
    response: Sequence[int],
    stop_strings: Sequence[str],
    min_new_tokens: int,
    tokenizer: PreTrainedTokenizerBase,
) -> int | None:
    """Where the sampling loop above would have ended ``response`` on a stop string: the smallest
    ``n >= max(min_new_tokens, 1)`` whose first ``n`` tokens decode (special tokens kept) to a text
    containing one of ``stop_strings``, or None if no prefix does. For an engine that cannot match
    strings while it samples (``vllm``): it generates on, and the response is cut at ``n`` after."""
    if not stop_strings or not response:
        return None
    if not any(s in tokenizer.decode(list(response), skip_special_tokens=False) for s in stop_strings):
        return None  # the whole response holds none, so no prefix does: one decode, not len(response)
    for n in range(max(min_new_tokens, 1), len(response) + 1):
        text = tokenizer.decode(list(response[:n]), skip_special_tokens=False)
        if any(s in text for s in stop_strings):
            return n
    return None


def _stop_string_hits(
    generated: torch.Tensor,
    done: torch.Tensor,
    stop_strings: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
) -> torch.Tensor:
    """[B] bool: rows not yet done whose decoded response contains a stop string."""
    hits = torch.zeros_like(done)
    rows = (~done).nonzero().flatten().tolist()
    if not rows:
        return hits
    texts = tokenizer.batch_decode(generated[rows].tolist(), skip_special_tokens=False)
    for row, text in zip(rows, texts, strict=True):
        if any(s in text for s in stop_strings):
            hits[row] = True
    return hits
