"""Bradley–Terry reward-model training on preference pairs (``{"prompt", "chosen", "rejected"}`` records).

Owns the reward-model training config and objective: ``loss = −log σ(r_chosen − r_rejected)``
averaged over pairs, with pair accuracy (``r_chosen > r_rejected``) and the mean chosen/rejected
rewards as metrics (NeMo-Aligner's ``loss, acc, rewards_chosen_mean, rewards_rejected_mean``).
The model is a :class:`~openaligner.models.reward.RewardModel`, exported in the layout the reward
server and the critic load, with the sequence layout it was trained on (``sequence_layout.json``,
:class:`~openaligner.data.render.SequenceLayout`) for the server's ``sentences``. Loop,
checkpoints and export come from :mod:`openaligner.trainer.supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from openaligner import distributed as dp
from openaligner.config import as_startup_error
from openaligner.data.formats import preference_record, preference_shape
from openaligner.data.preference import PreferencePair, build_preference_pairs, collate_pairs
from openaligner.data.render import LayoutError, Renderer, check_chat_template_mode
from openaligner.models.precision import (
    MASTER_DTYPE,
)
from openaligner.models.reward import RewardModel
from openaligner.models.source import SourceError, load_reward_model, pick_device, resolve_tokenizer
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
class RMDataConfig:
    train_path: str = "???"  # JSONL or datasets directory of preference records (docs/data.md)
    val_path: str | None = None  # validation pairs; unset = hold out val_fraction of train_path
    val_fraction: float = 0.1  # share of train_path held out for validation when val_path is unset
    split: str = "train"  # split of a datasets directory holding a DatasetDict (train_path)
    val_split: str = "test"  # split of a DatasetDict val_path
    prompt_key: str = "prompt"  # field of the prompt: text or messages (unused by whole conversations)
    chosen_key: str = "chosen"  # preferred response: text, an assistant message, or a whole conversation
    rejected_key: str = "rejected"  # dispreferred response, as chosen_key
    chat_template: str = "auto"  # auto (the tokenizer's template if it has one) | true | false (raw text)
    max_length: int = (
        0  # longest prompt + response (≤ the model's positions; longer are dropped); 0 = its limit
    )
    add_bos: bool = True  # start each sequence with the tokenizer's BOS id (if it has one; never twice)
    add_eos: bool = True  # end each response with the EOS id, as PPO responses end (never twice)

    def __post_init__(self) -> None:
        self.chat_template = check_chat_template_mode(self.chat_template, "data.chat_template")
        check_data_lengths(self.max_length, self.val_fraction)
        if self.chosen_key == self.rejected_key:  # each pair's margin would be 0 whatever the weights
            raise ValueError(
                f"data.rejected_key={self.rejected_key!r} is data.chosen_key too: every pair would compare "
                "a response with itself and the reward model learns nothing; name the dispreferred "
                "response's field (e.g. rejected)"
            )


@dataclass
class RMConfig(SupervisedRunConfig):
    data: RMDataConfig = field(default_factory=RMDataConfig)  # training and validation pairs
    output_dir: str = "runs/rm"  # final HF reward model + tokenizer, checkpoints/ and metrics.jsonl


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
    """Resolve sources, read and tokenize pairs, and wire the trainer (no training yet); under
    torchrun, on every rank after ``dp.init_from_env()``."""
    torch.manual_seed(cfg.trainer.seed)  # the same on every rank: a new head and LoRA start equal
    d = cfg.data
    # data, layout and length are checked before any weights load: a refused run costs nothing
    max_length = resolve_max_length(d.max_length, cfg.model)
    rank_share(cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, dp.world_size())
    with starting(f"reading data.train_path={d.train_path}"):
        records, val_records = load_train_val_records(
            d.train_path,
            d.val_path,
            partial(
                preference_record,
                prompt_key=d.prompt_key,
                chosen_key=d.chosen_key,
                rejected_key=d.rejected_key,
            ),
            preference_shape(d.prompt_key, d.chosen_key, d.rejected_key),
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
        train = build_preference_pairs(
            tokenizing(records, "data.train_path", cfg.progress), renderer, max_length
        )
        held_out = len(val_records) if d.val_path is None else 0
        require_full_batch(
            len(train), len(records), held_out, max_length, cfg.trainer.global_batch_size, "pairs"
        )
        val = build_preference_pairs(
            tokenizing(val_records, "validation data", cfg.progress), renderer, max_length
        )
    device = pick_device(cfg.device)
    model = build_trainable_model(
        partial(load_reward_model, cfg.model, len(tokenizer), dtype=MASTER_DTYPE),
        cfg.parallel,
        device,
        name="reward model",
        tokenizer=tokenizer,
        loading=f"the model ({model_source_name(cfg.model)})",
        lora=cfg.lora,  # adapters on the backbone, the head trained in full
        rank_seed=cfg.trainer.seed,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return SupervisedTrainer.for_run(
        cfg, RMObjective(model), train, val, partial(collate_pairs, pad_id=pad_id), tokenizer, device, layout
    )
