"""The PPO actor as a policy: a Hugging Face causal LM that generates rollouts and scores tokens
(log-probs, entropy); plus its frozen initial policy for the KL penalty.

Owns NeMo-Aligner's ``MegatronGPTActorModel`` contract less the loss: ``infer``,
``get_inference_log_probs``, ``get_init_policy_logprobs`` and ``training_logprobs``. Sequences are
right-padded; log-probs are [B, S-1], next-token aligned, at the sampling temperature. Must not
know the loss, rewards, critics, servers, optimizers or configs.
Design notes (dropout, precision): docs/models.md, "Module notes".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from openaligner import distributed as dp
from openaligner.algorithms import chunked_token_stats, entropy_from_logits, next_token_logprobs
from openaligner.algorithms.logprobs import Head
from openaligner.models.decoders.base import CacheKind
from openaligner.models.fast_paths import scoring_forward
from openaligner.models.generation import (
    SamplingParams,
    config_eos_ids,
    default_eos_ids,
    generate,
    mask_early_stops,
)
from openaligner.models.lora import is_peft_model, merged_export_copy, merged_lora_blocks
from openaligner.models.output_head import (
    LOGITS_CHUNK_MB,
    attention_mask,
    check_logits_chunk_mb,
    check_output_head,
    chunk_columns,
    final_hidden,
    output_head,
)
from openaligner.models.precision import Precision, save_pretrained_as
from openaligner.models.sharding import any_rank_going, compute_device, full_state_dict, gathered, is_sharded

log = logging.getLogger(__name__)


class CausalLMActor:
    """A decoder-only causal LM in the actor role.

    Args:
        model: any ``AutoModelForCausalLM`` (GPT-2, Llama, ...), optionally a PEFT/LoRA model.
        tokenizer: the policy's tokenizer: its EOS id is the default stop id (the token SFT
            appends to every response), and it decodes responses for ``stop_strings``.
        sampling: the sampling parameters of :meth:`infer`; the log-prob passes and the loss
            score tokens under the same distribution (temperature, early stop-id ban of
            ``min_new_tokens``). ``stop_token_ids=None`` is resolved here to the tokenizer's EOS
            id (the model config's without a tokenizer); ``()`` means no stop id. A trainer
            owning the sampling settings assigns :attr:`sampling` (see :meth:`set_sampling`).
        pad_id: id written after each response in ``response_tokens``; default the EOS id (as
            NeMo-Aligner does), else 0.
        forward_micro_batch_size: rows per forward pass in the no-grad log-prob passes
            (default: the whole batch).
        init_policy: the frozen initial policy for the KL penalty. ``None`` deep-copies ``model``
            (or, for a LoRA (``peft``) model, uses ``model`` itself with its adapters disabled: no
            second copy, see :mod:`openaligner.models.lora`); ``False`` keeps no
            initial policy (KL coefficient 0). Pass the SFT model explicitly when resuming, so the
            reference stays the original policy.
        cache: KV cache kind for generation through the HF forward (``static`` or ``dynamic``); plain
            GPT-2 models take the fast decoder, which keeps its own preallocated cache. Under a
            mixed precision generation uses ``dynamic``: Hugging Face's static cache takes one dtype
            from the keys, and under autocast Llama-style rotary embeddings give float32 keys but
            bfloat16 values.
        precision: the autocast every forward runs under (default ``fp32``: none).
        gather_for_generation: a sharded policy (:mod:`openaligner.models.sharding`) generates on
            its whole weights gathered once per :meth:`infer` (True), or layer by layer with every
            rank stepping together (False: the memory of one layer, an all-gather per token).
        logits_chunk_mb: the largest float32 logits block the scoring and training forwards
            build at once, in MiB: above it the output head runs over the final hidden states a
            few positions at a time (:func:`~openaligner.algorithms.chunked_token_stats`; the
            same numbers, without the [B, S, V] logits of a large vocabulary). None: always the
            whole logits. A sharded model always builds the whole logits (FSDP's root module
            owns the output head and gathers it only inside the model's own forward).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        sampling: SamplingParams | None = None,
        *,
        pad_id: int | None = None,
        forward_micro_batch_size: int | None = None,
        init_policy: PreTrainedModel | bool | None = None,
        cache: CacheKind = "static",
        precision: Precision | None = None,
        gather_for_generation: bool = True,
        logits_chunk_mb: float | None = LOGITS_CHUNK_MB,
    ) -> None:
        check_logits_chunk_mb(logits_chunk_mb)
        if forward_micro_batch_size is not None and forward_micro_batch_size < 1:
            raise ValueError(f"forward_micro_batch_size must be ≥ 1, got {forward_micro_batch_size}")
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = default_eos_ids(model, tokenizer)
        """The EOS id(s) responses end with by default (the tokenizer's, else the model config's)."""
        _warn_if_eos_differs(model, tokenizer)
        _warn_if_router_loss_is_asked_for(model)
        self.eos_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.sampling = SamplingParams()
        self.set_sampling(sampling or SamplingParams())
        self.pad_id = pad_id if pad_id is not None else (self.eos_id if self.eos_id is not None else 0)
        self.forward_micro_batch_size = forward_micro_batch_size
        self.cache: CacheKind = cache
        self.precision = precision if precision is not None else Precision()
        self.gather_for_generation = gather_for_generation
        self.logits_chunk_mb = logits_chunk_mb
        self._heads_checked: set[int] = set()  # ids of the models whose chunked head was checked
        self.init_policy: PreTrainedModel | None = self._make_init_policy(init_policy)

    # ------------------------------------------------------------------ construction, I/O
    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        **kwargs: object,
    ) -> CausalLMActor:
        """Load the policy from a local Hugging Face causal-LM directory (offline).

        ``kwargs`` go to the constructor; the initial policy defaults to a copy of what is loaded.
        """
        load_kwargs: dict[str, object] = {"local_files_only": True}
        if dtype is not None:
            load_kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(str(directory), **load_kwargs)
        if device is not None:
            nn.Module.to(model, torch.device(device))
        return cls(model, **kwargs)  # type: ignore[arg-type]

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the policy as a Hugging Face directory (``config.json`` + ``model.safetensors``,
        or several files and an index for a large policy; plus the tokenizer files when a
        tokenizer is attached), with the weights as ``dtype`` (None: as they are, i.e. the
        masters). A LoRA policy writes its adapter directory instead (float32 adapters, see
        :func:`openaligner.models.precision.save_pretrained_as`).

        A sharded policy makes this a collective: every rank calls it with the same
        ``directory``; rank 0 gathers the weights and alone writes."""
        save_pretrained_as(self.model, directory, dtype)
        if self.tokenizer is not None and self._writes():
            self.tokenizer.save_pretrained(str(directory))

    def save_merged(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write a LoRA policy with its adapters merged in as a plain Hugging Face causal-LM
        directory (plus the tokenizer), weights as ``dtype``; the live policy is not changed
        (:func:`openaligner.models.lora.merged_copy`). A collective for a sharded policy, as
        :meth:`save_pretrained`."""
        merged = merged_export_copy(self.model)
        if merged is None:  # not rank 0 of a sharded policy: its shards went to rank 0
            return
        save_pretrained_as(merged, directory, dtype)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))

    def inference_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole weights as a plain causal LM of its architecture holds them, for a
        rollout engine that owns its weights: a LoRA policy's adapters merged in (a copy), a
        sharded policy's shards gathered (a collective: every rank calls it; rank 0 gets the
        dict, the others None). Tied weights appear under each of their names. Otherwise the
        live tensors: copy them before the next optimizer step changes them."""
        if is_peft_model(self.model):
            merged = merged_export_copy(self.model)
            return None if merged is None else merged.state_dict()
        return full_state_dict(self.model)

    def inference_update_state_dict(self) -> dict[str, torch.Tensor] | None:
        """What of :meth:`inference_state_dict` an optimizer step can change, for an engine that
        holds it whole already: a LoRA policy's merged adapted layers with the other tensors of
        their modules (:func:`~openaligner.models.lora.merged_lora_blocks`; CPU copies); None
        when that is everything (no adapters, a sharded policy, other trainable tensors)."""
        if is_peft_model(self.model) and not is_sharded(self.model):
            return merged_lora_blocks(self.model)
        return None

    def _writes(self) -> bool:
        """Whether this process writes the policy's files: rank 0 of a sharded policy, else any."""
        return not is_sharded(self.model) or dp.is_leader()

    @property
    def device(self) -> torch.device:
        """Where the policy computes (a sharded policy's shards may live in CPU memory)."""
        return compute_device(self.model)

    def to(self, device: str | torch.device) -> CausalLMActor:
        """Move the policy and the initial policy."""
        target = torch.device(device)
        nn.Module.to(self.model, target)
        if self.init_policy is not None and self.init_policy is not self.model:
            nn.Module.to(self.init_policy, target)
        return self

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the policy (what the optimizer should update)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def set_sampling(self, sampling: SamplingParams) -> None:
        """Use ``sampling`` for rollouts and for every log-prob pass from now on.

        ``stop_token_ids=None`` becomes the EOS id(s) of :func:`default_eos_ids`, so that the
        early-stop ban of ``min_new_tokens`` is applied to exactly the ids generation bans.
        """
        if sampling.stop_token_ids is None:
            sampling = replace(sampling, stop_token_ids=tuple(self.eos_ids))
        self.sampling = sampling

    # ------------------------------------------------------------------ rollouts
    def infer(
        self,
        inference_batch: Mapping[str, torch.Tensor],
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        draws: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Generate one response per prompt.

        Args:
            inference_batch: ``text`` (or ``tokens``) [B, P] int64 right-padded prompts (values
                beyond a row's length are ignored) and ``length`` [B] int64 prompt lengths.
            sampling: overrides the actor's sampling parameters for this call only (e.g. greedy
                evaluation); the log-prob passes always use :attr:`sampling`, so rollouts for
                training must not override it.
            generator: a seeded ``torch.Generator`` on the model's device makes sampling
                reproducible.
            draws: [B, max_new_tokens] each row's own uniforms
                (:func:`~openaligner.models.generation.row_draws`), used instead of ``generator``.

        Returns:
            ``response_tokens`` [B, S] int64 (prompt + response + ``pad_id``, S = max response
            length), ``response_lengths`` [B] int64 (prompt + response, stop token included),
            ``prompt_lengths`` [B] int64, ``is_end`` [B] bool (ended on a stop token or string).
        """
        key = "text" if "text" in inference_batch else "tokens"
        if key not in inference_batch or "length" not in inference_batch:
            raise KeyError(
                f"inference_batch needs 'text' (or 'tokens') and 'length'; got {sorted(inference_batch)}"
            )
        params = sampling or self.sampling
        self.model.eval()
        # A sharded policy is gathered once for the whole loop (see models.sharding.gathered), or
        # gathers layer by layer in each step's forward with every rank stepping together.
        layerwise = is_sharded(self.model) and not self.gather_for_generation
        with gathered(self.model, whole=not layerwise), self.precision.autocast():
            out = generate(
                self.model,
                inference_batch[key],
                inference_batch["length"],
                params,
                pad_id=self.pad_id,
                generator=generator,
                tokenizer=self.tokenizer,
                cache="dynamic" if self.precision.mixed else self.cache,
                fast_path=not layerwise,  # the fast decoder reads whole weights directly
                step_together=any_rank_going if layerwise else None,
                draws=draws,
            )
        return {
            "response_tokens": out.tokens,
            "response_lengths": out.sequence_lengths,
            "prompt_lengths": out.prompt_lengths,
            "is_end": out.is_end,
        }

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def get_inference_log_probs(
        self,
        response_tokens: torch.Tensor,
        response_lengths: torch.Tensor | None = None,
        forward_micro_batch_size: int | None = None,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-probs of each next token under the current policy.

        Args:
            response_tokens: [B, S] int64, prompt + response, right-padded (the seed API's
                parameter names: elsewhere ``sequence_tokens``).
            response_lengths: [B] valid tokens per row, prompt + response (default: all S).
            forward_micro_batch_size: rows per forward pass (default: the actor's setting).
            prompt_lengths: [B] prompt tokens per row; required when ``min_new_tokens`` > 0
                (with stop ids), so that stop ids are banned where sampling banned them.

        Returns:
            [B, S-1] float32; position ``t`` is ``log p(token[t+1] | tokens[:t+1])`` at the
            sampling temperature (and with the stop ids banned before ``min_new_tokens``
            response tokens when ``prompt_lengths`` is given). Positions at or past
            ``response_lengths - 1`` are unspecified.
        """
        return self._batched_logprobs(
            self.model, response_tokens, response_lengths, forward_micro_batch_size, prompt_lengths
        )

    @torch.no_grad()
    def get_init_policy_logprobs(
        self,
        sequence_tokens: torch.Tensor,
        sequence_lengths: torch.Tensor | None = None,
        forward_micro_batch_size: int | None = None,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like :meth:`get_inference_log_probs`, under the frozen initial policy. [B, S-1]."""
        if self.init_policy is None:
            raise RuntimeError(
                "this actor keeps no initial policy (init_policy=False); the KL penalty needs one"
            )
        with self._init_policy_context():
            return self._batched_logprobs(
                self.init_policy, sequence_tokens, sequence_lengths, forward_micro_batch_size, prompt_lengths
            )

    # ------------------------------------------------------------------ training forward
    def training_logprobs(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None = None,
        prompt_lengths: torch.Tensor | None = None,
        *,
        first_position: int = 0,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the policy for a loss, with gradient: one forward over the
        whole batch (the caller, the trainer's policy loss, splits micro-batches).

        Args:
            tokens: [B, S] int64, right-padded.
            lengths: [B] valid tokens per row, for the attention mask (default: all S).
            prompt_lengths: [B]; required when ``min_new_tokens`` > 0 (with stop ids), as for
                :meth:`get_inference_log_probs`.
            first_position: skip the next-token positions before it (no row scores them): the
                output head and log-softmax run on the last ``S - first_position`` positions only.
            entropy_grad: whether the entropies carry gradient (an entropy bonus); otherwise
                they are computed under ``no_grad``, for the diagnostics.

        Returns:
            ``(logprobs, entropy)``, both [B, S-1-first_position] float32: column ``j`` scores
            token ``first_position + j + 1`` at the sampling temperature (stop ids banned before
            ``min_new_tokens`` as sampling banned them), and the entropy of that distribution.
        """
        temperature = self.sampling.logprob_temperature
        columns = self._chunk_columns(self.model, tokens.shape[0], tokens.shape[1] - 1 - first_position)
        if columns is not None:
            hidden = self._final_hidden(self.model, tokens, lengths, first_position)
            head = self._head(self.model, first_position, prompt_lengths)
            stats = chunked_token_stats(
                hidden, tokens[:, first_position + 1 :], head, temperature, columns, entropy_grad=entropy_grad
            )
            assert stats[1] is not None
            return stats[0], stats[1]
        logits = self._logits(self.model, tokens, lengths, keep=tokens.shape[1] - first_position)
        logits = self._sampled_distribution(logits, first_position, prompt_lengths)
        logprobs = next_token_logprobs(logits, tokens[:, first_position:], temperature)
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(logits[:, :-1], temperature)
        return logprobs, entropy

    # ------------------------------------------------------------------ internals
    def _make_init_policy(self, init_policy: PreTrainedModel | bool | None) -> PreTrainedModel | None:
        if init_policy is False:
            return None
        if isinstance(init_policy, nn.Module):
            frozen = init_policy
        elif is_peft_model(self.model):
            return self.model  # the same weights; adapters are disabled while it scores
        else:
            frozen = copy.deepcopy(self.model)
        frozen.eval()
        frozen.requires_grad_(False)
        return frozen

    def _init_policy_context(self) -> AbstractContextManager[object]:
        if self.init_policy is self.model and is_peft_model(self.model):
            ctx = getattr(self.model, "disable_adapter")()  # noqa: B009 (PEFT API, untyped here)
            assert isinstance(ctx, AbstractContextManager)
            return ctx
        return nullcontext()

    def _sampled_distribution(
        self, logits: torch.Tensor, first_position: int, prompt_lengths: torch.Tensor | None
    ) -> torch.Tensor:
        """``logits`` [B, T, V] (column 0 computed at ``first_position``) as sampling saw them."""
        params = self.sampling
        if params.min_new_tokens == 0 or not params.stop_token_ids:
            return logits
        if prompt_lengths is None:
            raise ValueError(
                f"min_new_tokens={params.min_new_tokens} bans the stop ids early in each response; "
                "scoring needs prompt_lengths [B] to apply the same ban"
            )
        return mask_early_stops(logits, first_position, prompt_lengths, params)

    def _batched_logprobs(
        self,
        model: nn.Module,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None,
        micro_batch_size: int | None,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = tokens.to(self.device)
        step = micro_batch_size or self.forward_micro_batch_size or max(1, tokens.shape[0])
        temperature = self.sampling.logprob_temperature
        parts = []
        for i in range(0, tokens.shape[0], step):
            chunk = tokens[i : i + step]
            chunk_lengths = lengths[i : i + step] if lengths is not None else None
            chunk_prompts = prompt_lengths[i : i + step] if prompt_lengths is not None else None
            columns = self._chunk_columns(model, chunk.shape[0], chunk.shape[1] - 1)
            if columns is not None:
                hidden = self._final_hidden(model, chunk, chunk_lengths, 0)
                head = self._head(model, 0, chunk_prompts)
                logprobs, _ = chunked_token_stats(
                    hidden, chunk[:, 1:], head, temperature, columns, entropy=False
                )
                parts.append(logprobs.float())
                continue
            logits = self._logits(model, chunk, chunk_lengths)
            logits = self._sampled_distribution(logits, 0, chunk_prompts)
            parts.append(next_token_logprobs(logits, chunk, temperature).float())
        if not parts:
            return torch.zeros((0, max(0, tokens.shape[1] - 1)), dtype=torch.float32, device=self.device)
        return torch.cat(parts)

    def _chunk_columns(self, model: nn.Module, rows: int, columns: int) -> int | None:
        """Positions per chunk of the output head for ``rows`` × ``columns`` scored positions, or
        None: the whole logits at once (:func:`~openaligner.models.output_head.chunk_columns`)."""
        fit = chunk_columns(self.logits_chunk_mb, model, rows, columns)
        if fit is not None and id(model) not in self._heads_checked:
            check_output_head(model, self.precision, partial(scoring_forward, model))
            self._heads_checked.add(id(model))
        return fit

    def _final_hidden(
        self, model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None, first_position: int
    ) -> torch.Tensor:
        """:func:`~openaligner.models.output_head.final_hidden` in the scoring forward's context."""
        with scoring_forward(model), self.precision.autocast():
            return final_hidden(model, tokens, lengths, first_position)

    def _head(self, model: nn.Module, first_position: int, prompt_lengths: torch.Tensor | None) -> Head:
        """The output head as :func:`~openaligner.algorithms.chunked_token_stats` calls it: hidden
        columns from ``first_position + c0`` → the logits sampling drew from (stop ids banned early
        as sampling banned them)."""
        raw = output_head(model, self.precision)

        def head(hidden: torch.Tensor, c0: int) -> torch.Tensor:
            return self._sampled_distribution(raw(hidden), first_position + c0, prompt_lengths)

        return head

    def _logits(
        self, model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None, keep: int = 0
    ) -> torch.Tensor:
        """Logits [B, S, V] of right-padded ``tokens`` [B, S] (in the compute dtype: callers take
        log-probs in float32); with ``keep`` > 0 only those of the last ``keep`` positions, [B, keep, V]."""
        attention = attention_mask(tokens, lengths)
        kwargs = {"logits_to_keep": keep} if 0 < keep < tokens.shape[1] else {}
        with scoring_forward(model), self.precision.autocast():
            out = model(input_ids=tokens, attention_mask=attention, use_cache=False, **kwargs)
        logits = out.logits
        assert isinstance(logits, torch.Tensor)
        return logits


GPTActorModel = CausalLMActor
"""The actor's name in NeMo-Aligner's vocabulary (``MegatronGPTActorModel``); it wraps any causal LM."""


def _warn_if_eos_differs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Warn when the tokenizer's EOS id is not among the model config's ``eos_token_id``."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return
    config_ids = config_eos_ids(model)
    if config_ids and int(tokenizer.eos_token_id) not in config_ids:
        log.warning(
            "the tokenizer's EOS id %d (%r) is not the model config's eos_token_id %s: responses end "
            "on the tokenizer's EOS (the token SFT appends), plus any configured stop ids; fix the "
            "model's config.json (eos_token_id) if the model was trained to end otherwise",
            int(tokenizer.eos_token_id),
            tokenizer.eos_token,
            config_ids[0] if len(config_ids) == 1 else config_ids,
        )


def _warn_if_router_loss_is_asked_for(model: PreTrainedModel) -> None:
    """Warn when a mixture of experts' config asks for the router load-balancing loss, which the
    PPO loss does not include (the forwards still compute it; nothing adds it to the loss)."""
    if getattr(model.config, "output_router_logits", False):
        log.warning(
            "the model's config sets output_router_logits (the mixture-of-experts load-balancing loss, "
            "router_aux_loss_coef=%s): the PPO loss does not include that loss",
            getattr(model.config, "router_aux_loss_coef", None),
        )
