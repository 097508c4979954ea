"""Supervised fine-tuning of a causal LM on prompt/response or ``messages`` data: the recipe and its loss.

Owns the SFT config schema and objective (negative log-likelihood of the response tokens only,
token mean over the global batch, in the project's next-token layout: the loss mask is
``[prompt_len-1, len-1)`` as for PPO), through the output head in chunks when a micro-batch's
logits would be large (:mod:`openaligner.models.output_head`, as the actor scores). The loop,
checkpoints and export come from :mod:`openaligner.trainer.supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel

from openaligner import distributed as dp
from openaligner.algorithms import chunked_token_stats, next_token_logprobs, response_mask
from openaligner.config import as_startup_error
from openaligner.data.formats import sft_record, sft_shape
from openaligner.data.render import LayoutError, Renderer, check_chat_template_mode
from openaligner.data.sft import SFTExample, build_sft_examples, collate_sft
from openaligner.models.output_head import (
    LOGITS_CHUNK_MB,
    check_logits_chunk_mb,
    check_output_head,
    chunk_columns,
    final_hidden,
    output_head,
)
from openaligner.models.precision import (
    MASTER_DTYPE,
    Precision,
    save_pretrained_as,
)
from openaligner.models.source import SourceError, load_causal_lm, pick_device, resolve_tokenizer
from openaligner.trainer.model_build import build_trainable_model
from openaligner.trainer.startup import model_source_name, starting, tokenizing
from openaligner.trainer.supervised import (
    Batch,
    LoopConfig,
    SupervisedRunConfig,
    SupervisedTrainer,
    check_data_lengths,
    load_train_val_records,
    rank_share,
    require_full_batch,
    resolve_max_length,
    sequence_layout,
)


@dataclass
class SFTDataConfig:
    train_path: str = "???"  # JSONL or datasets directory of SFT records (docs/data.md)
    val_path: str | None = None  # validation data; unset = hold out val_fraction of train_path
    val_fraction: float = 0.1  # share of train_path held out for validation when val_path is unset
    split: str = "train"  # split of a datasets directory holding a DatasetDict (train_path)
    val_split: str = "test"  # split of a DatasetDict val_path
    prompt_key: str = "prompt"  # field of the prompt: text, or a list of {"role", "content"} messages
    response_key: str = "response"  # field of the response: text, or one assistant message
    messages_key: str = "messages"  # field of a whole conversation (records without prompt_key)
    chat_template: str = "auto"  # auto (the tokenizer's template if it has one) | true | false (raw text)
    max_length: int = (
        0  # longest prompt + response (≤ the model's positions; longer are dropped); 0 = its limit
    )
    add_bos: bool = True  # start each prompt with the tokenizer's BOS id (if it has one; never twice)
    add_eos: bool = True  # end each response with the EOS id so the model learns to stop (never twice)

    def __post_init__(self) -> None:
        self.chat_template = check_chat_template_mode(self.chat_template, "data.chat_template")
        check_data_lengths(self.max_length, self.val_fraction)


@dataclass
class SFTLoopConfig(LoopConfig):
    logits_chunk_mb: float | None = LOGITS_CHUNK_MB  # largest fp32 logits block (MiB); null = whole

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logits_chunk_mb is not None and not self.logits_chunk_mb > 0:
            got = self.logits_chunk_mb
            raise ValueError(f"trainer.logits_chunk_mb: must be > 0 (MiB) or null (whole logits), got {got}")


@dataclass
class SFTConfig(SupervisedRunConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)  # training and validation data
    trainer: SFTLoopConfig = field(default_factory=SFTLoopConfig)  # steps, batches, logits budget
    output_dir: str = "runs/sft"  # final HF model + tokenizer, checkpoints/ and metrics.jsonl


class SFTObjective:
    """Response-only negative log-likelihood of a causal LM.

    Args:
        model: the causal LM (optionally LoRA-wrapped or FSDP-sharded).
        logits_chunk_mb: the largest float32 logits block a forward builds at once, in MiB: above
            it the output head runs over the final hidden states a few positions at a time, each
            chunk recomputed in the backward (:func:`~openaligner.algorithms.chunked_token_stats`,
            as the actor scores; the same loss and gradients without the [B, S, V] logits). None:
            always the model's own forward and its whole logits, as do a sharded model and batches
            whose logits fit the budget.
        precision: the autocast the trainer runs the loss under (the chunked head runs under it
            too; its compute dtype sets the tolerance of the one-time head check).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        logits_chunk_mb: float | None = LOGITS_CHUNK_MB,
        precision: Precision | None = None,
    ) -> None:
        check_logits_chunk_mb(logits_chunk_mb)
        self.model = model
        self.logits_chunk_mb = logits_chunk_mb
        self.precision = precision if precision is not None else Precision()
        self._head_checked = False

    @property
    def module(self) -> PreTrainedModel:
        return self.model

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(sum of response-token NLL, response token count, {"loss": NLL sum})`` for a batch of
        ``tokens`` [B, S], ``lengths`` [B] and ``prompt_lengths`` [B]."""
        tokens, lengths, prompts = batch["tokens"], batch["lengths"], batch["prompt_lengths"]
        mask = response_mask(prompts, lengths, tokens.shape[1] - 1, dtype=torch.float32)
        # no row scores a position before its prompt's last token: the chunked head skips them
        first = max(0, int(prompts.min()) - 1) if tokens.shape[0] else 0
        columns = chunk_columns(
            self.logits_chunk_mb, self.module, tokens.shape[0], tokens.shape[1] - 1 - first
        )
        if columns is None:
            attention = (torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(-1)).long()
            logits = self.module(input_ids=tokens, attention_mask=attention, use_cache=False).logits
            logprobs = next_token_logprobs(logits, tokens)  # [B, S-1]
        else:
            if not self._head_checked:
                check_output_head(self.module, self.precision)
                self._head_checked = True
            head = output_head(self.module, self.precision)
            hidden = final_hidden(self.module, tokens, lengths, first)  # [B, S-1-first, H]
            logprobs, _ = chunked_token_stats(
                hidden, tokens[:, first + 1 :], lambda h, c0: head(h), 1.0, columns, entropy=False
            )
            mask = mask[:, first:]
        nll = -(logprobs * mask.to(logprobs.dtype)).sum()
        return nll, mask.sum(), {"loss": nll.detach()}

    def save(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        save_pretrained_as(self.module, directory, dtype)


def build_sft_trainer(cfg: SFTConfig) -> SupervisedTrainer[SFTExample]:
    """Resolve sources, read and tokenize data, and wire the trainer (no training yet); under
    torchrun, on every rank after ``dp.init_from_env()``."""
    torch.manual_seed(cfg.trainer.seed)  # the same on every rank: LoRA adapters start equal
    d = cfg.data
    # data, layout and length are checked before any weights load: a refused run costs nothing
    max_length = resolve_max_length(d.max_length, cfg.model)
    rank_share(cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, dp.world_size())
    with starting(f"reading data.train_path={d.train_path}"):
        records, val_records = load_train_val_records(
            d.train_path,
            d.val_path,
            partial(
                sft_record, prompt_key=d.prompt_key, response_key=d.response_key, messages_key=d.messages_key
            ),
            sft_shape(d.prompt_key, d.response_key, d.messages_key),
            d.val_fraction,
            cfg.trainer.seed,
            d.split,
            d.val_split,
        )
    with as_startup_error(SourceError):
        tokenizer = resolve_tokenizer(cfg.model, cfg.tokenizer)
    layout = sequence_layout(tokenizer, d.chat_template, d.add_bos, d.add_eos)
    with as_startup_error(LayoutError):
        renderer = Renderer(tokenizer, layout)
        train = build_sft_examples(tokenizing(records, "data.train_path", cfg.progress), renderer, max_length)
        held_out = len(val_records) if d.val_path is None else 0
        require_full_batch(
            len(train), len(records), held_out, max_length, cfg.trainer.global_batch_size, "examples"
        )
        val = build_sft_examples(
            tokenizing(val_records, "validation data", cfg.progress), renderer, max_length
        )
    device = pick_device(cfg.device)
    model = build_trainable_model(
        partial(load_causal_lm, cfg.model, len(tokenizer), dtype=MASTER_DTYPE),
        cfg.parallel,
        device,
        name="model",
        tokenizer=tokenizer,
        loading=f"the model ({model_source_name(cfg.model)})",
        lora=cfg.lora,
        rank_seed=cfg.trainer.seed,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    objective = SFTObjective(
        model, logits_chunk_mb=cfg.trainer.logits_chunk_mb, precision=Precision.resolve(cfg.precision, device)
    )
    return SupervisedTrainer.for_run(
        cfg, objective, train, val, partial(collate_sft, pad_id=pad_id), tokenizer, device, layout
    )
