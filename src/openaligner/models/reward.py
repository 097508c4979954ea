"""Scalar-head models over a Hugging Face backbone: the reward model (and the critic's base).

Owns the head layout on disk (a plain ``AutoModelForSequenceClassification`` directory with
``num_labels=1``) and the read-out rules (last token for decoders, the classifier's own pooling
for encoders; :func:`scalar_readout`). Inputs are right-padded ``tokens`` [B, S] with ``lengths``
[B]. Must not know about serving, PPO or training loops.
Design notes: docs/models.md, "Module notes".
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

LAST_TOKEN = "last-token"
"""A decoder classifier: the ``score`` head at the last valid token (and at every position)."""
FIRST_TOKEN = "first-token"
"""An encoder classifier: its own pooler and ``classifier`` head, pooled at the first token."""

_M = TypeVar("_M", bound="ScalarHeadModel")


class Float32Linear(nn.Linear):
    """An ``nn.Linear`` computed in float32 with autocast off, whatever its input's dtype: the
    output layer of an encoder classifier, whose own forward calls it (its class is swapped in
    place, so its weights, names and saved keys are those of the ``nn.Linear`` it was)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), bias)


def is_encoder_classifier(config: Any) -> bool:
    """Whether ``config`` (a Hugging Face model config) is a bidirectional encoder, pretrained as a
    masked LM (BERT, RoBERTa, DeBERTa, ELECTRA, ...), whose sequence classifier pools the sequence
    itself; encoder-decoders (BART, T5) are not."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return (
        getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_encoder_decoder", False)
        and not getattr(config, "is_decoder", False)
    )


def _active(module: Any) -> Any:
    """The trained copy of a head ``peft`` keeps (``ModulesToSaveWrapper``), or ``module`` itself."""
    copies = getattr(module, "modules_to_save", None)
    return copies[module.active_adapters[0]] if copies is not None else module


def scalar_readout(hf_model: nn.Module) -> str:
    """How ``hf_model`` (a one-label ``*ForSequenceClassification``, maybe inside a ``peft`` model)
    turns a sequence into one score: :data:`LAST_TOKEN` for a linear ``score`` head (decoders),
    :data:`FIRST_TOKEN` for an encoder's own ``classifier`` (see :func:`is_encoder_classifier`).

    Raises:
        ValueError: neither, naming the class and the two kinds supported.
    """
    base: Any = unwrap(hf_model)
    if isinstance(_active(getattr(base, "score", None)), nn.Linear):
        return LAST_TOKEN
    if getattr(base, "classifier", None) is not None and is_encoder_classifier(base.config):
        return FIRST_TOKEN
    raise ValueError(
        f"{type(base).__name__} is not supported as a reward model: expected a decoder classifier with a "
        "linear `score` head (GPT-2, Llama, Qwen2, ...) or an encoder classifier with its own "
        "`classifier` head (BERT, MiniLM, DeBERTa, RoBERTa, ...)"
    )


def _output_layer(hf_model: nn.Module, readout: str) -> nn.Linear:
    """The one-output ``nn.Linear`` that gives the score: ``score``, or the last layer of an
    encoder's ``classifier`` (itself for BERT and DeBERTa, ``classifier.out_proj`` for RoBERTa)."""
    base: Any = unwrap(hf_model)
    module = _active(base.score if readout == LAST_TOKEN else base.classifier)
    if isinstance(module, nn.Linear):
        return module
    found = [m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features == 1]
    if len(found) != 1:
        raise ValueError(
            f"{type(base).__name__}'s classifier has {len(found)} one-output linear layers; expected one"
        )
    return found[0]


class ScalarHeadModel(nn.Module):
    """A backbone plus a scalar head, stored as a ``*ForSequenceClassification``.

    Args:
        hf_model: a Hugging Face sequence-classification model with ``num_labels == 1``: a decoder
            with a ``score`` head (GPT-2, Llama, Mistral, Qwen2, ... all use that name) or an
            encoder with its own pooler and ``classifier`` (BERT, DeBERTa, ...), see
            :func:`scalar_readout`.
        standardization: optional fixed ``(mean, std)`` applied by ``infer`` (not by
            ``forward``); not stored on disk, the serving config supplies it.

    Raises:
        ValueError: ``num_labels`` is not 1, the classifier is of neither kind, or ``std <= 0``.
    """

    def __init__(self, hf_model: PreTrainedModel, standardization: Standardization | None = None) -> None:
        super().__init__()
        if getattr(hf_model.config, "num_labels", None) != 1:
            raise ValueError(
                f"expected a sequence-classification model with num_labels=1, got "
                f"num_labels={getattr(hf_model.config, 'num_labels', None)}"
            )
        self.readout = scalar_readout(hf_model)
        """:data:`LAST_TOKEN` or :data:`FIRST_TOKEN`."""
        if standardization is not None and standardization[1] <= 0:
            raise ValueError(f"standardization std must be > 0, got {standardization[1]}")
        head = _output_layer(hf_model, self.readout)
        head.float()
        if self.readout == FIRST_TOKEN:
            # the model's own forward calls this layer: computed in float32 there too, so that the
            # reward is not rounded to an autocast compute dtype (what apply_head does for `score`)
            head.__class__ = Float32Linear
        self.hf_model = hf_model
        self.standardization = standardization
        self.fresh_head = False
        """True when :meth:`from_pretrained` found no head on disk and the head was drawn fresh."""

    @property
    def backbone(self) -> nn.Module:
        """The model without the head (e.g. ``GPT2Model``, ``LlamaModel``, ``BertModel``; with LoRA,
        the same model, whose layers carry the adapters)."""
        module = unwrap(self.hf_model).base_model
        assert isinstance(module, nn.Module)
        return module

    @property
    def head(self) -> nn.Linear:
        """The float32 output layer, weight [1, H] (with LoRA, the trained copy ``peft`` keeps)."""
        return _output_layer(self.hf_model, self.readout)

    @property
    def device(self) -> torch.device:
        """Where the model computes (a sharded model's shards may live in CPU memory)."""
        return compute_device(self)

    @staticmethod
    def attention_mask(tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """[B, S] int64, 1 on the first ``lengths`` positions of each row (all ones without lengths)."""
        if lengths is None:
            return torch.ones_like(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return (positions < lengths.to(tokens.device).unsqueeze(-1)).long()

    def hidden_states(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Last-layer hidden states of right-padded ``tokens`` [B, S] (``lengths`` [B]) → [B, S, H]."""
        mask = self.attention_mask(tokens, lengths)
        out = self.backbone(input_ids=tokens, attention_mask=mask, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        assert isinstance(hidden, torch.Tensor)
        return hidden

    def pooled_scores(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """An encoder classifier's own forward (pooler + ``classifier``) on right-padded ``tokens``
        [B, S] with ``lengths`` [B] → [B] float32: its one logit per row."""
        out = self.hf_model(input_ids=tokens, attention_mask=self.attention_mask(tokens, lengths))
        logits = out.logits if hasattr(out, "logits") else out[0]
        assert isinstance(logits, torch.Tensor)
        return logits.float().reshape(-1)

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

        The directory may hold a ``*ForSequenceClassification`` with one label (its head is
        loaded) or a plain causal LM / backbone (the head is then freshly initialised by
        ``transformers``, e.g. to start reward-model training from an SFT model, or from an
        encoder such as a sentence-transformers ``BertModel``).

        Args:
            dtype: backbone dtype (default: as stored); the head stays float32.
            device: where to put the model (default CPU).
        """
        p = Path(directory)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json; expected a Hugging Face model directory")
        kwargs: dict[str, object] = {"num_labels": 1, "local_files_only": True, "output_loading_info": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        hf, info = AutoModelForSequenceClassification.from_pretrained(str(p), **kwargs)
        model = cls(hf, standardization=standardization)
        head = model.head
        head_keys = {f"{name}.weight" for name, module in hf.named_modules() if module is head}
        model.fresh_head = bool(head_keys & set(info.get("missing_keys", ())))
        if device is not None:
            model.to(device)
        return model


class RewardModel(ScalarHeadModel):
    """Backbone + scalar head read at the last valid token (decoders) or pooled at the first
    (encoders): one reward per sequence."""

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Differentiable rewards: the head at the last valid token, or an encoder's own pooled
        score (docs/models.md, "Module notes").

        Args:
            tokens: [B, S] int64, right-padded.
            lengths: [B] int64 valid tokens per row (1 ≤ length ≤ S).

        Returns:
            [B] float32 rewards (no standardization).
        """
        if self.readout == FIRST_TOKEN:
            return self.pooled_scores(tokens, lengths)
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
