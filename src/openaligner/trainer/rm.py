"""Bradley–Terry reward-model training on ``{"prompt", "chosen", "rejected"}`` JSONL.

Owns the reward-model training config and objective: ``loss = −log σ(r_chosen − r_rejected)``
averaged over pairs, with pair accuracy (``r_chosen > r_rejected``) and the mean chosen/rejected
rewards as metrics (NeMo-Aligner's ``loss, acc, rewards_chosen_mean, rewards_rejected_mean``).
The model is a :class:`~openaligner.models.reward.RewardModel`, exported in the layout the reward
server and the critic load. Loop, checkpoints and export come from
:mod:`openaligner.trainer.supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from openaligner.config import as_startup_error
from openaligner.data.preference import PreferencePair, build_preference_pairs, collate_pairs
from openaligner.models.lora import LoraConfig, LoraError, add_lora
from openaligner.models.precision import (
    MASTER_DTYPE,
    Precision,
    check_precision,
    check_save_dtype,
    resolve_save_dtype,
)
from openaligner.models.reward import RewardModel
from openaligner.models.source import (
    ModelSourceConfig,
    SourceError,
    TokenizerSourceConfig,
    check_vocab,
    load_reward_model,
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

KEYS = ("prompt", "chosen", "rejected")


@dataclass
class RMDataConfig:
    train_path: str = "???"  # JSONL with {"prompt": ..., "chosen": ..., "rejected": ...} per line
    val_path: str | None = None  # validation JSONL; unset = hold out val_fraction of train_path
    val_fraction: float = 0.1  # share of train_path held out for validation when val_path is unset
    max_length: int = (
        0  # longest prompt + response (≤ the model's positions; longer are dropped); 0 = its limit
    )
    add_bos: bool = True  # prepend the tokenizer's BOS id to the prompt
    add_eos: bool = True  # append the EOS id to each response (as the PPO actor's responses end)


@dataclass
class RMConfig:
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)  # backbone (+ head) to train
    tokenizer: TokenizerSourceConfig = field(default_factory=TokenizerSourceConfig)  # how to tokenize
    data: RMDataConfig = field(default_factory=RMDataConfig)  # training and validation pairs
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))  # AdamW and LR schedule
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning
    trainer: LoopConfig = field(
        default_factory=LoopConfig
    )  # steps, batch sizes (in pairs), validation, checkpoints
    output_dir: str = "runs/rm"  # final HF reward model + tokenizer, checkpoints/ and metrics.jsonl
    resume: bool = True  # continue from the newest complete checkpoint in output_dir
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:1, ...
    precision: str = "auto"  # auto (bf16-mixed on CUDA, else fp32) | fp32 | bf16-mixed | fp16-mixed
    save_dtype: str = "auto"  # final model dtype: auto (as model.path is stored, fp32 tiny), fp32, bf16, fp16
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = False  # also write TensorBoard events under output_dir/tensorboard

    def __post_init__(self) -> None:
        check_precision(self.precision, "precision")
        check_save_dtype(self.save_dtype, "save_dtype")


class RMObjective:
    """Bradley–Terry loss over chosen/rejected pairs."""

    def __init__(self, model: RewardModel) -> None:
        self.model = model

    @property
    def module(self) -> RewardModel:
        return self.model

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Sums over the B pairs of a batch: ``tokens`` [2B, S] (chosen rows first), ``lengths`` [2B]."""
        rewards = self.module(batch["tokens"], batch["lengths"])
        chosen, rejected = rewards.chunk(2)
        margin = chosen - rejected
        loss = -F.logsigmoid(margin).sum()
        count = torch.tensor(float(chosen.shape[0]))
        sums = {
            "loss": loss.detach(),
            "accuracy": (margin > 0).float().sum(),
            "rewards_chosen_mean": chosen.detach().sum(),
            "rewards_rejected_mean": rejected.detach().sum(),
        }
        return loss, count, sums

    def save(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        self.module.save_pretrained(directory, dtype)


def build_rm_trainer(cfg: RMConfig) -> SupervisedTrainer[PreferencePair]:
    """Resolve sources, read and tokenize pairs, and wire the trainer (no training yet)."""
    torch.manual_seed(cfg.trainer.seed)  # also seeds a freshly initialised head
    # data and length are checked before any weights load: a refused run costs nothing
    max_length = resolve_max_length(cfg.data.max_length, cfg.model)
    records, val_records = load_train_val_records(
        cfg.data.train_path, cfg.data.val_path, KEYS, cfg.data.val_fraction, cfg.trainer.seed
    )
    with as_startup_error(SourceError):
        tokenizer = resolve_tokenizer(cfg.model, cfg.tokenizer)
    device = pick_device(cfg.device)
    model = load_reward_model(cfg.model, len(tokenizer), device, dtype=MASTER_DTYPE)
    with as_startup_error(SourceError):
        check_vocab(tokenizer, model.hf_model)
    with as_startup_error(LoraError):
        model = add_lora(model, cfg.lora)  # adapters on the backbone, the head trained in full

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    bos, eos = special_id(tokenizer, "bos", cfg.data.add_bos), special_id(tokenizer, "eos", cfg.data.add_eos)
    train = build_preference_pairs(records, encode, max_length, bos, eos)
    held_out = len(val_records) if cfg.data.val_path is None else 0
    require_full_batch(len(train), len(records), held_out, max_length, cfg.trainer.global_batch_size, "pairs")
    val = build_preference_pairs(val_records, encode, max_length, bos, eos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return SupervisedTrainer(
        RMObjective(model),
        train,
        val,
        lambda items: collate_pairs(items, pad_id),
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
