"""The critic (value model): the reward model's backbone and head applied at every position.

Same on-disk layout as :mod:`openaligner.models.reward` (a one-label
``*ForSequenceClassification`` directory), so a critic is initialised from a reward-model
checkpoint simply by loading that directory, as NeMo-Aligner does. Must not know about the
value loss, GAE, training or serving: those live in ``algorithms``, ``trainer`` and ``servers``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from openaligner.models.reward import LAST_TOKEN, ScalarHeadModel, Standardization, check_scalar_inputs


class CriticModel(ScalarHeadModel):
    """Backbone + scalar head at every position: values [B, S].

    Raises:
        ValueError: ``hf_model`` is an encoder classifier (BERT, DeBERTa, ...): its head reads the
            pooled sequence, so it has no value per position.
    """

    def __init__(self, hf_model: PreTrainedModel, standardization: Standardization | None = None) -> None:
        super().__init__(hf_model, standardization)
        if self.readout != LAST_TOKEN:
            raise ValueError(
                f"{type(hf_model).__name__} is an encoder classifier (its head reads the sequence pooled at "
                "the first token), so it has no value per position and cannot be a critic; initialise the "
                "critic from a decoder (a causal LM or a decoder reward model)"
            )

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        standardization: Standardization | None = None,
    ) -> CriticModel:
        """As :meth:`ScalarHeadModel.from_pretrained`, with a zero fresh head: a directory without
        one (a causal LM, a backbone) gets a value head whose weight and bias are 0, so every value
        starts at 0 — the same in every process (two critic servers started from one directory give
        the same values), and on the returns' scale rather than the backbone's. A random head
        (``transformers``' normal init, std 0.02) on Gemma 3 270M's hidden states gave values of
        sd 2.9 against returns of sd 0.09: an explained variance of −1036 at the first step, still
        −24 after 7 critic-only steps (docs/real-model.md, *Why PPO failed*). The head's gradient
        does not depend on its own weight, so it trains from 0 at once (the backbone's adapters
        follow from the second step). A directory with a head (a reward or value model) keeps it.
        The caller's random stream is left as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = super().from_pretrained(
                directory, dtype=dtype, device=device, standardization=standardization
            )
        if model.fresh_head:
            with torch.no_grad():
                model.head.weight.zero_()
                if model.head.bias is not None:
                    model.head.bias.zero_()
        return model

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Differentiable values.

        Args:
            tokens: [B, S] int64, right-padded.
            lengths: [B] valid tokens per row (default: all S); padding is masked out of attention.

        Returns:
            [B, S] float32 values (no standardization); positions ≥ length hold garbage.
        """
        return self.apply_head(self.hidden_states(tokens, lengths))

    @torch.no_grad()
    def infer(
        self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Values for serving: eval mode, no grad, computed at the width ``S`` given.

        The caller decides the compute width (the servers strip padding columns to a multiple
        of ``strip_sequence_length_to_multiple`` first).

        Args:
            tokens: [B, S] int64, right-padded (any pad id).
            lengths: [B] int64.
            micro_batch_size: rows per forward pass (default: all at once).

        Returns:
            [B, S] float32 on the model's device, standardized when configured; positions
            ≥ length are 0.
        """
        tokens, lengths = check_scalar_inputs(tokens, lengths, self.device)
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
        if tokens.shape[0] == 0:
            return out
        step = micro_batch_size or tokens.shape[0]
        was_training = self.training
        self.eval()
        try:
            for i in range(0, tokens.shape[0], step):
                # a call, not .forward(): a sharded model gathers its weights in its hooks
                out[i : i + step] = self(tokens[i : i + step], lengths[i : i + step])
        finally:
            self.train(was_training)
        valid = torch.arange(tokens.shape[1], device=self.device) < lengths.unsqueeze(-1)
        return torch.where(valid, self.standardize(out), torch.zeros_like(out))
