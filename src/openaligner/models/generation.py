"""Batched sampling from a Hugging Face causal LM with a KV cache: the actor's rollout engine.

Owns the sampling parameters, the token-selection rules (greedy, temperature, top-k, top-p,
min/max new tokens, stop ids, stop strings) and the output layout. Must not know about PPO,
rewards or training.

Layout. Input prompts are right-padded ``prompts`` [B, P] with ``prompt_lengths`` [B]. Internally
prompts are left-padded so that every row appends its next token in the same column of one
preallocated buffer, with per-row position ids (``cumsum(attention_mask) - 1``) and a static KV
cache sized ``max(prompt_lengths) + max_new_tokens``. Rows that have finished are dropped from the
cache (and from the forward passes) once they are a quarter of it. The result is converted back to the
right-padded layout: row ``i`` holds its prompt, immediately followed by its response (the stop
token included), then ``pad_id`` up to the width ``S = max(response_lengths)``.

Decoders. A plain ``GPT2LMHeadModel`` in eval mode is stepped by :class:`_GPT2Decoder`, which calls
the model's own weights and activation directly with a KV cache of plain tensors: the Hugging Face
block's arithmetic (attention may sum in another order, so logits agree to float rounding)
without the per-call work of its forward (mask construction, cache objects, output dataclasses),
which costs more than the math for small models. Every other model (other architectures, PEFT
wrappers, modules with hooks or replaced layers, training mode) goes through the model's own
forward with a Hugging Face cache (:class:`_HFDecoder`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module
from transformers import (
    DynamicCache,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StaticCache,
)
from transformers.activations import NewGELUActivation
from transformers.cache_utils import Cache
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Block
from transformers.pytorch_utils import Conv1D

from openaligner.models.positions import position_limit

CacheKind = Literal["static", "dynamic"]


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

    tokens: torch.Tensor  # [B, S] int64: prompt, response, then pad_id; S = max(response_lengths)
    response_lengths: torch.Tensor  # [B] int64: prompt + response tokens (stop token included)
    prompt_lengths: torch.Tensor  # [B] int64
    is_end: torch.Tensor  # [B] bool: the response ended on a stop token id or a stop string


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
            cache). The GPT-2 decoder keeps its own preallocated cache and ignores it.
        fast_path: step a plain eval-mode ``GPT2LMHeadModel`` with the built-in GPT-2 decoder
            (same tokens, less per-step overhead); ``False`` always uses the model's forward.

    Returns:
        A :class:`Generation` on the model's device. Generation runs under
        ``torch.inference_mode`` (cheaper than ``no_grad``); the results are cloned out of it so
        they can feed autograd later (e.g. as ``input_ids`` of a training forward).
    """
    with torch.inference_mode():
        out = _sample_loop(
            model, prompts, prompt_lengths, params, pad_id, generator, tokenizer, cache, fast_path
        )
    return Generation(
        tokens=out.tokens.clone(),
        response_lengths=out.response_lengths.clone(),
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
) -> Generation:
    """The body of :func:`generate` (inference mode, inference tensors out)."""
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode responses; pass tokenizer=")
    device = next(model.parameters()).device
    prompts = prompts.to(device=device, dtype=torch.long)
    lengths = prompt_lengths.to(device=device, dtype=torch.long).reshape(-1)
    _check_prompts(prompts, lengths, params, model)
    batch = prompts.shape[0]
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
    steps = params.max_new_tokens
    for step in range(params.max_new_tokens):
        banned = stop_ids if step < params.min_new_tokens else None
        token = select_tokens(logits, params, generator, banned)
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
        if step + 1 == params.max_new_tokens or finished == done.numel():
            steps = step + 1
            break
        if finished and 4 * finished >= done.numel():
            keep = (~done).nonzero().squeeze(-1)
            active, token, done = active[keep], token[keep], done[keep]
            next_positions = next_positions[keep]
            decoder.select_rows(keep)
            finished = 0
        logits = decoder.step(token, next_positions, p_max + step)
        next_positions = next_positions + 1

    new_tokens = new_tokens.clamp(max=steps)
    response_lengths = lengths + new_tokens
    tokens = _to_right_padded(buf, p_max - lengths, response_lengths, pad_id)
    return Generation(tokens=tokens, response_lengths=response_lengths, prompt_lengths=lengths, is_end=is_end)


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
) -> torch.Tensor:
    """Pick one token per row from ``logits`` [B, V] → [B] int64.

    ``banned`` ids (e.g. stop ids before ``min_new_tokens``) get probability 0.
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
    return _sample(torch.softmax(x, dim=-1), generator)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from ``probs`` [B, V] by inverting the CDF: [B] int64.

    One uniform number per row instead of ``torch.multinomial``'s V exponential draws per row
    (≈ 0.5 ms per step at B=64, V=512 on CPU). Zero-probability tokens have zero-width intervals
    and are never drawn.
    """
    cdf = probs.cumsum(-1)
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
    buf: torch.Tensor, offset: torch.Tensor, response_lengths: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Shift each row left by its padding ``offset`` [B]: [B, total] → [B, max(response_lengths)]."""
    width = int(response_lengths.max())
    col = torch.arange(width, device=buf.device).unsqueeze(0)
    index = (col + offset.unsqueeze(-1)).clamp(max=buf.shape[1] - 1)
    out = buf.gather(1, index)
    return out.masked_fill(col >= response_lengths.unsqueeze(-1), pad_id)


class Decoder(Protocol):
    """Steps a causal LM over the left-padded token buffer of :func:`generate`, owning its KV cache.

    Rows are the rows of the ``attention`` mask [B, T] the decoder was made with, minus those
    dropped by :meth:`select_rows`; ``T = max(prompt_lengths) + max_new_tokens``.
    """

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts [B, P] at position ids [B, P]; next-token logits [B, V]."""
        ...

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        """Append ``tokens`` [B] at buffer ``column`` with position ids [B]; logits [B, V]."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` [B'] (indices into the current rows) of the cache and the mask."""
        ...


def make_decoder(
    model: PreTrainedModel,
    attention: torch.Tensor,
    total: int,
    cache: CacheKind = "static",
    fast_path: bool = True,
) -> Decoder:
    """The GPT-2 decoder when ``fast_path`` and :func:`gpt2_fast_path_supported`, else the model's
    forward with a Hugging Face ``cache``. ``attention`` [B, total]: 0 on left padding, 1 elsewhere."""
    if cache not in ("static", "dynamic"):
        raise ValueError(f"unknown cache kind {cache!r}; expected 'static' or 'dynamic'")
    if fast_path and gpt2_fast_path_supported(model):
        assert isinstance(model, GPT2LMHeadModel)
        return _GPT2Decoder(model, attention, total)
    return _HFDecoder(model, attention, total, cache)


def gpt2_fast_path_supported(model: nn.Module) -> bool:
    """Whether :class:`_GPT2Decoder` computes what ``model``'s forward computes.

    True only for a ``GPT2LMHeadModel`` itself (not a subclass or a PEFT wrapper) in eval mode,
    without cross-attention or upcast-reordered attention, whose layers are the stock modules
    (no adapters or quantised replacements) and carry no forward hooks (no accelerate offloading).
    """
    if type(model) is not GPT2LMHeadModel or model.training:
        return False
    assert isinstance(model, GPT2LMHeadModel)
    config = model.config
    if config.add_cross_attention or config.reorder_and_upcast_attn or not model.dtype.is_floating_point:
        return False
    transformer = model.transformer
    stock = [(transformer.wte, nn.Embedding), (transformer.wpe, nn.Embedding), (model.lm_head, nn.Linear)]
    if any(type(module) is not kind for module, kind in stock) or _gpt2_layers(model) is None:
        return False
    if transformer.wte.max_norm is not None or transformer.wpe.max_norm is not None:
        return False  # the embedding's forward would renormalise rows
    if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
        return False
    return not any(
        m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules()
    )


class _HFDecoder:
    """Any Hugging Face causal LM through its own forward, with a static or dynamic cache."""

    def __init__(self, model: PreTrainedModel, attention: torch.Tensor, total: int, cache: CacheKind) -> None:
        self.model = model
        self.attention = attention
        self.cache: Cache = (
            StaticCache(config=model.config, max_cache_len=total)
            if cache == "static"
            else DynamicCache(config=model.config)
        )

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._last_logits(input_ids, self.attention[:, : input_ids.shape[1]], positions)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        return self._last_logits(
            tokens.unsqueeze(-1), self.attention[:, : column + 1], positions.unsqueeze(-1)
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        self.attention = self.attention[rows]
        for layer in self.cache.layers:  # static and dynamic layers alike
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                    setattr(layer, name, tensor.index_select(0, rows))

    def _last_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits
        assert isinstance(logits, torch.Tensor)
        return logits[:, -1]


@dataclass(frozen=True)
class _GPT2Layer:
    """One ``GPT2Block``'s parameters (references to the model's own tensors, not copies)."""

    ln_1: nn.LayerNorm
    c_attn: Conv1D  # weight [E, 3E]: x @ W + b gives query | key | value
    attn_proj: Conv1D  # [E, E]
    scaling: float  # of the attention scores (1/sqrt(D), times 1/(layer+1) if configured)
    ln_2: nn.LayerNorm
    c_fc: Conv1D  # [E, F]
    act: nn.Module  # the configured activation (``gelu_new`` by default)
    act_is_gelu_new: bool  # ``act`` is transformers' stock ``gelu_new``: run as :func:`_gelu_new_`
    mlp_proj: Conv1D  # [F, E]


class _GPT2Decoder:
    """``GPT2LMHeadModel`` decoding with the model's own weights and a cache of plain tensors.

    Per layer and step this is the Hugging Face block's arithmetic (``addmm`` for ``Conv1D``, the
    model's activation module, ``layer_norm``, SDPA), minus the per-call work of the Hugging Face
    forward: 4-D mask construction, cache objects, hook and output plumbing. Keys and values are
    [B, H, T, D] per layer; a step writes one column (every row appends in the same column of the
    left-padded buffer) and attends over the columns written so far only, where a Hugging Face
    static cache masks the unwritten ones (the sums differ only in rounding).
    """

    def __init__(self, model: GPT2LMHeadModel, attention: torch.Tensor, total: int) -> None:
        transformer = model.transformer
        self.wte: torch.Tensor = transformer.wte.weight
        self.wpe: torch.Tensor = transformer.wpe.weight
        self.ln_f: nn.LayerNorm = transformer.ln_f
        self.lm_head: nn.Linear = model.lm_head
        layers = _gpt2_layers(model)
        assert layers is not None, "check gpt2_fast_path_supported first"
        self.layers = layers
        config = model.config
        self.heads: int = config.n_head
        self.head_dim: int = config.n_embd // config.n_head
        shape = (attention.shape[0], self.heads, total, self.head_dim)
        self.keys = [self.wte.new_empty(shape) for _ in self.layers]
        self.values = [self.wte.new_empty(shape) for _ in self.layers]
        # The largest per-layer activations (query/key/value [N, 3E], the MLP's [N, F] and the
        # GELU's scratch; N = rows x new tokens), reused by every layer and step: fresh tensors of
        # this size cost page faults whenever the C allocator has given their memory back to the
        # OS, which it does between steps.
        self._buffers: dict[str, torch.Tensor] = {}
        # [B, 1, 1, T] bool, True where a key may be attended to; None when no row is padded.
        valid = attention.bool()
        self.key_mask: torch.Tensor | None = None if bool(valid.all()) else valid[:, None, None, :]

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        mask = None
        if self.key_mask is not None:
            # Causal and not padding; a padding query sees itself so that its softmax is defined
            # (its output is never attended to).
            causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(width, dtype=torch.bool, device=input_ids.device)
            mask = (causal & self.key_mask[..., :width]) | eye
        x = self._forward(input_ids, positions, 0, mask, causal=mask is None)
        return self._logits(x[:, -1])

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        mask = None if self.key_mask is None else self.key_mask[..., : column + 1]
        x = self._forward(tokens.unsqueeze(-1), positions.unsqueeze(-1), column, mask, causal=False)
        return self._logits(x[:, -1])

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """Hidden states [B, S, E] after the last block for ``input_ids`` [B, S] written at cache
        columns ``start .. start+S-1``."""
        x = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            x = self._block(layer, keys, values, x, start, mask, causal)
        return x

    def _block(
        self,
        layer: _GPT2Layer,
        keys: torch.Tensor,
        values: torch.Tensor,
        x: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        batch, width, embed = x.shape
        end = start + width
        h = _layer_norm(layer.ln_1, x).view(-1, embed)
        qkv = _conv1d(layer.c_attn, h, out=self._buffer("qkv", h.shape[0], layer.c_attn.nf))
        qkv = qkv.view(batch, width, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        a = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, is_causal=causal, scale=layer.scaling
        )
        x = _conv1d(layer.attn_proj, a.transpose(1, 2).reshape(-1, embed)).view(batch, width, embed) + x
        h = _layer_norm(layer.ln_2, x).view(-1, embed)
        h = _conv1d(layer.c_fc, h, out=self._buffer("fc", h.shape[0], layer.c_fc.nf))
        if layer.act_is_gelu_new:
            h = _gelu_new_(h, self._buffer("gelu", h.shape[0], layer.c_fc.nf))
        else:
            h = layer.act(h)
        return x + _conv1d(layer.mlp_proj, h).view(batch, width, embed)

    def _buffer(self, name: str, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] view of buffer ``name``, which is sized for the most rows asked so far."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width:
            buffer = self._buffers[name] = self.wte.new_empty(rows, width)
        return buffer[:rows]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_layer_norm(self.ln_f, x), self.lm_head.weight, self.lm_head.bias)


_M = TypeVar("_M", bound=nn.Module)


class _NotStock(Exception):
    """A module of the model is not the stock Hugging Face GPT-2 module."""


def _stock(module: object, kind: type[_M]) -> _M:
    """``module`` if its type is exactly ``kind`` (a subclass may compute something else)."""
    if type(module) is not kind or not isinstance(module, kind):  # isinstance: for the type checker
        raise _NotStock(f"{type(module).__name__} is not {kind.__name__}")
    return module


def _gpt2_layers(model: GPT2LMHeadModel) -> list[_GPT2Layer] | None:
    """Each block's parameters, or ``None`` if any module is not the stock one (e.g. a LoRA layer)."""
    try:
        _stock(model.transformer.ln_f, nn.LayerNorm)
        layers = []
        for module in model.transformer.h:
            block = _stock(module, GPT2Block)
            attn, mlp = _stock(block.attn, GPT2Attention), _stock(block.mlp, GPT2MLP)
            layers.append(
                _GPT2Layer(
                    ln_1=_stock(block.ln_1, nn.LayerNorm),
                    c_attn=_stock(attn.c_attn, Conv1D),
                    attn_proj=_stock(attn.c_proj, Conv1D),
                    scaling=float(attn.scaling),
                    ln_2=_stock(block.ln_2, nn.LayerNorm),
                    c_fc=_stock(mlp.c_fc, Conv1D),
                    act=mlp.act,
                    act_is_gelu_new=_is_stock_gelu_new(mlp.act),
                    mlp_proj=_stock(mlp.c_proj, Conv1D),
                )
            )
    except (_NotStock, AttributeError):
        return None
    return layers


def _is_stock_gelu_new(act: nn.Module) -> bool:
    """``act`` is transformers' ``NewGELUActivation`` with its own forward (not a hub kernel)."""
    forward = getattr(type(act), "forward", None)
    return (
        type(act) is NewGELUActivation
        and "forward" not in vars(act)
        and getattr(forward, "__module__", None) == "transformers.activations"
    )


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``NewGELUActivation()(x)`` written into ``scratch`` (same shape), overwriting ``x``.

    The module's eight elementwise operations with the same operands in the same order (only
    commuted), so the result is bit-identical; but in place, without the module's seven fresh
    [N, F] temporaries.
    """
    y = torch.pow(x, 3.0, out=scratch)
    y.mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_().add_(1.0)
    return y.mul_(x.mul_(0.5))


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def _conv1d(module: Conv1D, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``Conv1D.forward`` on 2-D input [N, in] → [N, out] (the same ``addmm``), optionally into
    ``out``."""
    return torch.addmm(module.bias, x, module.weight, out=out)


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
