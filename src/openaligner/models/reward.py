"""Scalar-head models over a Hugging Face decoder backbone: the reward model (and the critic's base).

Owns the head layout on disk and the read-out rules:

* A model is stored as a plain Hugging Face ``AutoModelForSequenceClassification`` directory
  (``config.json`` with ``num_labels=1`` + ``model.safetensors``): backbone weights under the
  architecture's base-model prefix (``transformer.`` for GPT-2, ``model.`` for Llama) and the head
  as ``score.weight`` [1, H] (no bias). Any such directory saved by ``transformers`` loads here, and
  what is saved here loads in ``transformers``. The head is kept and computed in float32.
* The reward of a sequence is the head applied to the last valid token's hidden state
  (index ``length - 1``); the critic (``critic.py``) applies the same head at every position.
* With LoRA (:func:`openaligner.models.lora.add_lora`) ``hf_model`` is a ``peft`` model wrapping
  the classifier: the backbone's layers carry the adapters, the head is trained in full, and
  ``save_pretrained`` writes the adapter directory (adapters and head).
* Inputs are right-padded: ``tokens`` [B, S] int64 with ``lengths`` [B] valid tokens per row.
  Under the causal mask, padding after a row's length cannot change any valid position; the
  padding is also masked out of attention (``attention_mask`` built from ``lengths``).

Must not know about serving, PPO or training loops; those call ``forward`` / ``infer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from openaligner.models.lora import unwrap
from openaligner.models.precision import save_pretrained_as
from openaligner.models.sharding import compute_device

Standardization = tuple[float, float]
"""Fixed ``(mean, std)``: ``infer`` returns ``(r - mean) / std``."""

_M = TypeVar("_M", bound="ScalarHeadModel")


class ScalarHeadModel(nn.Module):
    """A decoder backbone plus a linear scalar head, stored as a ``*ForSequenceClassification``.

    Args:
        hf_model: a Hugging Face sequence-classification model with ``num_labels == 1`` and a
            ``score`` head (GPT-2, Llama, Mistral, Qwen2, ... all use that name).
        standardization: optional fixed ``(mean, std)`` applied by ``infer`` (not by
            ``forward``); not stored on disk, the serving config supplies it.
    """

    def __init__(self, hf_model: PreTrainedModel, standardization: Standardization | None = None) -> None:
        super().__init__()
        if getattr(hf_model.config, "num_labels", None) != 1:
            raise ValueError(
                f"expected a sequence-classification model with num_labels=1, got "
                f"num_labels={getattr(hf_model.config, 'num_labels', None)}"
            )
        head = getattr(hf_model, "score", None)
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(hf_model).__name__} has no linear `score` head; it is not supported")
        if standardization is not None and standardization[1] <= 0:
            raise ValueError(f"standardization std must be > 0, got {standardization[1]}")
        head.float()
        self.hf_model = hf_model
        self.standardization = standardization

    @property
    def backbone(self) -> nn.Module:
        """The decoder without the head (e.g. ``GPT2Model``, ``LlamaModel``; with LoRA, the same
        decoder, whose layers carry the adapters)."""
        module = unwrap(self.hf_model).base_model
        assert isinstance(module, nn.Module)
        return module

    @property
    def head(self) -> nn.Linear:
        """The float32 scalar head, weight [1, H] (with LoRA, the trained copy ``peft`` keeps)."""
        head: Any = unwrap(self.hf_model).score
        if not isinstance(head, nn.Linear):  # peft's ModulesToSaveWrapper: the active adapter's copy
            head = head.modules_to_save[head.active_adapters[0]]
        assert isinstance(head, nn.Linear)
        return head

    @property
    def device(self) -> torch.device:
        """Where the model computes (a sharded model's shards may live in CPU memory)."""
        return compute_device(self)

    def hidden_states(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Last-layer hidden states of right-padded ``tokens`` [B, S] (``lengths`` [B]) → [B, S, H]."""
        if lengths is None:
            mask = torch.ones_like(tokens)
        else:
            mask = torch.arange(tokens.shape[1], device=tokens.device) < lengths.to(tokens.device).unsqueeze(
                -1
            )
        out = self.backbone(input_ids=tokens, attention_mask=mask.long(), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        assert isinstance(hidden, torch.Tensor)
        return hidden

    def apply_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head in float32: [..., H] → [...], also inside an autocast region (which would
        otherwise round the rewards and values to the compute dtype's 8 or 11 significant bits)."""
        w = self.head.weight.float()
        b = self.head.bias.float() if self.head.bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), w, b).squeeze(-1)

    def standardize(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the fixed standardization, if any."""
        if self.standardization is None:
            return x
        mean, std = self.standardization
        return (x - mean) / std

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write a Hugging Face directory (``config.json`` + ``model.safetensors``), with the
        weights as ``dtype`` (None: as they are; see
        :func:`openaligner.models.precision.save_pretrained_as`). A collective for a sharded
        model: every rank calls it, rank 0 writes."""
        save_pretrained_as(self.hf_model, directory, dtype)

    @classmethod
    def from_pretrained(
        cls: type[_M],
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        standardization: Standardization | None = None,
    ) -> _M:
        """Load from a local Hugging Face directory (offline).

        The directory may hold a ``*ForSequenceClassification`` with one label (its ``score``
        head is loaded) or a plain causal LM / backbone (the head is then freshly initialised by
        ``transformers``, e.g. to start reward-model training from an SFT model).

        Args:
            dtype: backbone dtype (default: as stored); the head stays float32.
            device: where to put the model (default CPU).
        """
        p = Path(directory)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json; expected a Hugging Face model directory")
        kwargs: dict[str, object] = {"num_labels": 1, "local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        hf = AutoModelForSequenceClassification.from_pretrained(str(p), **kwargs)
        model = cls(hf, standardization=standardization)
        if device is not None:
            model.to(device)
        return model


class RewardModel(ScalarHeadModel):
    """Backbone + scalar head read at the last valid token: one reward per sequence."""

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Differentiable rewards.

        Args:
            tokens: [B, S] int64, right-padded.
            lengths: [B] int64 valid tokens per row (1 ≤ length ≤ S).

        Returns:
            [B] float32 rewards (no standardization).
        """
        hidden = self.hidden_states(tokens, lengths)
        index = (lengths.to(hidden.device).long() - 1).clamp(min=0)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), index]
        return self.apply_head(last)

    @torch.no_grad()
    def infer(
        self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Rewards for serving: eval mode, no grad, computed at the width ``S`` given.

        The caller decides the compute width (the servers strip padding columns to a multiple
        of ``strip_sequence_length_to_multiple`` first, see :func:`strip_columns`).

        Args:
            tokens: [B, S] int64, right-padded (any pad id).
            lengths: [B] int64.
            micro_batch_size: rows per forward pass (default: all at once).

        Returns:
            [B] float32 on the model's device, standardized when configured.
        """
        tokens, lengths = check_scalar_inputs(tokens, lengths, self.device)
        if tokens.shape[0] == 0:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        step = micro_batch_size or tokens.shape[0]
        was_training = self.training
        self.eval()
        try:
            # a call, not .forward(): a sharded model gathers its weights in its hooks
            parts = [
                self(tokens[i : i + step], lengths[i : i + step]) for i in range(0, tokens.shape[0], step)
            ]
        finally:
            self.train(was_training)
        return self.standardize(torch.cat(parts))


def check_scalar_inputs(
    tokens: torch.Tensor, lengths: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``tokens`` [B, S] / ``lengths`` [B] and move them to ``device`` as int64."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
    lengths = lengths.reshape(-1)
    if lengths.shape[0] != tokens.shape[0]:
        raise ValueError(f"lengths has {lengths.shape[0]} rows, tokens has {tokens.shape[0]}")
    if tokens.shape[0] and (int(lengths.min()) < 1 or int(lengths.max()) > tokens.shape[1]):
        raise ValueError(f"lengths must lie in [1, {tokens.shape[1]}], got {lengths.tolist()}")
    return tokens.to(device=device, dtype=torch.long), lengths.to(device=device, dtype=torch.long)
