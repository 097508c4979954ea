"""Supervised fine-tuning of a causal LM on prompt/response or ``messages`` data: the recipe and its loss.

Owns the SFT config schema and objective (negative log-likelihood of the response tokens only,
token mean over the global batch, in the project's next-token layout: the loss mask is
``[prompt_len-1, len-1)`` as for PPO). The loop, checkpoints and export come from
:mod:`openaligner.trainer.supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel

from openaligner import distributed as dp
from openaligner.algorithms import next_token_logprobs, response_mask
from openaligner.config import as_startup_error
from openaligner.data.formats import sft_record, sft_shape
from openaligner.data.render import LayoutError, Renderer, check_chat_template_mode
from openaligner.data.sft import SFTExample, build_sft_examples, collate_sft
from openaligner.models.precision import (
    MASTER_DTYPE,
    save_pretrained_as,
)
from openaligner.models.source import SourceError, load_causal_lm, pick_device, resolve_tokenizer
from openaligner.trainer.model_build import build_trainable_model
from openaligner.trainer.startup import model_source_name, starting, tokenizing
from openaligner.trainer.supervised import (
    Batch,
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
class SFTConfig(SupervisedRunConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)  # training and validation data
    output_dir: str = "runs/sft"  # final HF model + tokenizer, checkpoints/ and metrics.jsonl


class SFTObjective:
    """Response-only negative log-likelihood of a causal LM."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    @property
    def module(self) -> PreTrainedModel:
        return self.model

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(sum of response-token NLL, response token count, {"loss": NLL sum})`` for a batch of
        ``tokens`` [B, S], ``lengths`` [B] and ``prompt_lengths`` [B]."""
        tokens, lengths = batch["tokens"], batch["lengths"]
        attention = (torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(-1)).long()
        logits = self.module(input_ids=tokens, attention_mask=attention, use_cache=False).logits
        logprobs = next_token_logprobs(logits, tokens)  # [B, S-1]
        mask = response_mask(batch["prompt_lengths"], lengths, tokens.shape[1] - 1, dtype=logprobs.dtype)
        nll = -(logprobs * mask).sum()
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
    return SupervisedTrainer.for_run(
        cfg, SFTObjective(model), train, val, partial(collate_sft, pad_id=pad_id), tokenizer, device, layout
    )
