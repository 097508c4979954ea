"""The general decoder: any Hugging Face causal LM stepped through its own forward with a HF KV cache.

Owns the Hugging Face cache objects (static or dynamic) and their row compaction, and what the
forward is asked for while decoding (logits of the last position; no router logits). Works for
every architecture, PEFT wrapper, hooked or replaced layer and training mode; knows nothing of
sampling.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import Cache

from openaligner.models.decoders.base import CacheKind


class HFDecoder:
    """Any Hugging Face causal LM through its own forward, with a static or dynamic cache."""

    def __init__(self, model: PreTrainedModel, attention: torch.Tensor, total: int, cache: CacheKind) -> None:
        self.model = model
        self.attention = attention
        # A mixture of experts whose config asks for router logits (to train with the
        # load-balancing loss) would reduce a cached step's router logits, which cover the new
        # tokens only, over the whole attention mask, and fail; decoding needs none.
        self.extra: dict[str, bool] = (
            {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
        )
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
            cache=self.cache,  # transformers 5.24's name; past_key_values is removed in 5.40
            use_cache=True,
            logits_to_keep=1,
            **self.extra,
        )
        logits = out.logits
        assert isinstance(logits, torch.Tensor)
        return logits[:, -1]
