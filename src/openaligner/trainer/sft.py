"""Supervised fine-tuning of a causal LM on ``{"prompt", "response"}`` JSONL: the recipe and its loss.

Owns the SFT config schema and objective (negative log-likelihood of the response tokens only,
token mean over the global batch, in the project's next-token layout: the loss mask is
``[prompt_len-1, len-1)`` as for PPO). The loop, checkpoints and export come from
:mod:`openaligner.trainer.supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from openaligner.algorithms import next_token_logprobs, response_mask
from openaligner.config import as_startup_error
from openaligner.data.sft import SFTExample, build_sft_examples, collate_sft
from openaligner.models.lora import LoraConfig, LoraError, add_lora
from openaligner.models.precision import (
    MASTER_DTYPE,
    Precision,
    check_precision,
    check_save_dtype,
    resolve_save_dtype,
    save_pretrained_as,
)
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    check_vocab,
    load_causal_lm,
    pick_device,
    resolve_tokenizer,
)
from openaligner.trainer.optim import OptimConfig
from openaligner.trainer.supervised import (
    Batch,
    LoopConfig,
    SupervisedTrainer,
    load_train_val_records,
    require_full_batch,
    resolve_max_length,
    special_id,
)


@dataclass
class SFTDataConfig:
    train_path: str = "???"  # JSONL with {"prompt": ..., "response": ...} per line
    val_path: str | None = None  # validation JSONL; unset = hold out val_fraction of train_path
    val_fraction: float = 0.1  # share of train_path held out for validation when val_path is unset
    max_length: int = (
        0  # longest prompt + response (≤ the model's positions; longer are dropped); 0 = its limit
    )
    add_bos: bool = True  # prepend the tokenizer's BOS id to the prompt
    add_eos: bool = True  # append the EOS id to the response (so the model learns to stop)


@dataclass
class SFTConfig:
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # what to fine-tune
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # how to tokenize
    data: SFTDataConfig = field(default_factory=SFTDataConfig)  # training and validation data
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # AdamW and LR schedule
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning
    trainer: LoopConfig = field(default_factory=LoopConfig)  # steps, batch sizes, validation, checkpoints
    output_dir: str = "runs/sft"  # final HF model + tokenizer, checkpoints/ and metrics.jsonl
    resume: bool = True  # continue from the newest complete checkpoint in output_dir
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ...
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    save_dtype: str = "auto"  # final model dtype: auto (as model.path is stored, fp32 tiny), fp32, bf16, fp16
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = False  # also write TensorBoard events under output_dir/tensorboard

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision")
        check_save_dtype(self.save_dtype, "save_dtype")


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
    """Resolve sources, read and tokenize data, and wire the trainer (no training yet)."""
    torch.manual_seed(cfg.trainer.seed)
    # data and length are checked before any weights load: a refused run costs nothing
    max_length = resolve_max_length(cfg.data.max_length, cfg.model)
    records, val_records = load_train_val_records(
        cfg.data.train_path,
        cfg.data.val_path,
        ("prompt", "response"),
        cfg.data.val_fraction,
        cfg.trainer.seed,
    )
    with as_startup_error(SourceError):
        tokenizer = resolve_tokenizer(cfg.model, cfg.tokenizer)
    device = pick_device(cfg.device)
    model = load_causal_lm(cfg.model, len(tokenizer), device, dtype=MASTER_DTYPE)
    with as_startup_error(SourceError):
        check_vocab(tokenizer, model)
    with as_startup_error(LoraError):
        model = add_lora(model, cfg.lora)  # r = 0: the model as it is

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    bos, eos = special_id(tokenizer, "bos", cfg.data.add_bos), special_id(tokenizer, "eos", cfg.data.add_eos)
    train = build_sft_examples(records, encode, max_length, bos, eos)
    held_out = len(val_records) if cfg.data.val_path is None else 0
    require_full_batch(
        len(train), len(records), held_out, max_length, cfg.trainer.global_batch_size, "examples"
    )
    val = build_sft_examples(val_records, encode, max_length, bos, eos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return SupervisedTrainer(
        SFTObjective(model),
        train,
        val,
        lambda items: collate_sft(items, pad_id),
        cfg.trainer,
        cfg.optim,
        cfg.output_dir,
        tokenizer,
        device,
        resume=cfg.resume,
        progress=cfg.progress,
        tensorboard=cfg.tensorboard,
        precision=Precision.resolve(cfg.precision, device),
        save_dtype=resolve_save_dtype(cfg.save_dtype, cfg.model.path),
        export_merged=cfg.lora.merge_on_save,
    )
