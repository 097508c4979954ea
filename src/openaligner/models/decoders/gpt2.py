"""The GPT-2 fast decoder: a stock ``GPT2LMHeadModel`` run on its own weights with a plain KV cache.

Owns the decision whether a model is stock enough for it (:func:`gpt2_fast_path_supported`), the
per-layer arithmetic and its reused buffers, and the in-place ``gelu_new``. It is the Hugging Face
block's arithmetic (attention may sum in another order, so logits agree to float rounding) without
the per-call work of its forward (mask construction, cache objects, output dataclasses), which
costs more than the math for small models. Knows nothing of sampling, and nothing of any other
architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module
from transformers import GPT2LMHeadModel
from transformers.activations import NewGELUActivation
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Block
from transformers.pytorch_utils import Conv1D


def gpt2_fast_path_supported(model: nn.Module) -> bool:
    """Whether :class:`GPT2Decoder` computes what ``model``'s forward computes.

    True only for a ``GPT2LMHeadModel`` itself (not a subclass or a PEFT wrapper) in eval mode,
    without cross-attention or upcast-reordered attention, whose layers are the stock modules
    (no adapters or quantised replacements) and carry no forward hooks (no accelerate offloading).
    """
    if type(model) is not GPT2LMHeadModel or model.training:
        return False
    assert isinstance(model, GPT2LMHeadModel)
    config = model.config
    if config.add_cross_attention or config.reorder_and_upcast_attn or not model.dtype.is_floating_point:
        return False
    transformer = model.transformer
    stock = [(transformer.wte, nn.Embedding), (transformer.wpe, nn.Embedding), (model.lm_head, nn.Linear)]
    if any(type(module) is not kind for module, kind in stock) or _gpt2_layers(model) is None:
        return False
    if transformer.wte.max_norm is not None or transformer.wpe.max_norm is not None:
        return False  # the embedding's forward would renormalise rows
    if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
        return False
    return not any(
        m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules()
    )


@dataclass(frozen=True)
class _GPT2Layer:
    """One ``GPT2Block``'s parameters (references to the model's own tensors, not copies)."""

    ln_1: nn.LayerNorm
    c_attn: Conv1D  # weight [E, 3E]: x @ W + b gives query | key | value
    attn_proj: Conv1D  # [E, E]
    scaling: float  # of the attention scores (1/sqrt(D), times 1/(layer+1) if configured)
    ln_2: nn.LayerNorm
    c_fc: Conv1D  # [E, F]
    act: nn.Module  # the configured activation (``gelu_new`` by default)
    act_is_gelu_new: bool  # ``act`` is transformers' stock ``gelu_new``: run as :func:`_gelu_new_`
    mlp_proj: Conv1D  # [F, E]


class GPT2Decoder:
    """``GPT2LMHeadModel`` decoding with the model's own weights and a cache of plain tensors.

    Per layer and step this is the Hugging Face block's arithmetic (``addmm`` for ``Conv1D``, the
    model's activation module, ``layer_norm``, SDPA), minus the per-call work of the Hugging Face
    forward: 4-D mask construction, cache objects, hook and output plumbing. Keys and values are
    [B, H, T, D] per layer; a step writes one column (every row appends in the same column of the
    left-padded buffer) and attends over the columns written so far only, where a Hugging Face
    static cache masks the unwritten ones (the sums differ only in rounding).
    """

    def __init__(self, model: GPT2LMHeadModel, attention: torch.Tensor, total: int) -> None:
        transformer = model.transformer
        self.wte: torch.Tensor = transformer.wte.weight
        self.wpe: torch.Tensor = transformer.wpe.weight
        self.ln_f: nn.LayerNorm = transformer.ln_f
        self.lm_head: nn.Linear = model.lm_head
        layers = _gpt2_layers(model)
        assert layers is not None, "check gpt2_fast_path_supported first"
        self.layers = layers
        config = model.config
        self.heads: int = config.n_head
        self.head_dim: int = config.n_embd // config.n_head
        shape = (attention.shape[0], self.heads, total, self.head_dim)
        self.keys = [self.wte.new_empty(shape) for _ in self.layers]
        self.values = [self.wte.new_empty(shape) for _ in self.layers]
        # The largest per-layer activations (query/key/value [N, 3E], the MLP's [N, F] and the
        # GELU's scratch; N = rows x new tokens), reused by every layer and step: fresh tensors of
        # this size cost page faults whenever the C allocator has given their memory back to the
        # OS, which it does between steps.
        self._buffers: dict[str, torch.Tensor] = {}
        # [B, 1, 1, T] bool, True where a key may be attended to; None when no row is padded.
        valid = attention.bool()
        self.key_mask: torch.Tensor | None = None if bool(valid.all()) else valid[:, None, None, :]

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        mask = None
        if self.key_mask is not None:
            # Causal and not padding; a padding query sees itself so that its softmax is defined
            # (its output is never attended to).
            causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(width, dtype=torch.bool, device=input_ids.device)
            mask = (causal & self.key_mask[..., :width]) | eye
        x = self._forward(input_ids, positions, 0, mask, causal=mask is None)
        return self._logits(x[:, -1])

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        mask = None if self.key_mask is None else self.key_mask[..., : column + 1]
        x = self._forward(tokens.unsqueeze(-1), positions.unsqueeze(-1), column, mask, causal=False)
        return self._logits(x[:, -1])

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """Hidden states [B, S, E] after the last block for ``input_ids`` [B, S] written at cache
        columns ``start .. start+S-1``."""
        x = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            x = self._block(layer, keys, values, x, start, mask, causal)
        return x

    def _block(
        self,
        layer: _GPT2Layer,
        keys: torch.Tensor,
        values: torch.Tensor,
        x: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        batch, width, embed = x.shape
        end = start + width
        h = _layer_norm(layer.ln_1, x).view(-1, embed)
        qkv = _conv1d(layer.c_attn, h, out=self._buffer("qkv", h.shape[0], layer.c_attn.nf))
        qkv = qkv.view(batch, width, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        a = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, is_causal=causal, scale=layer.scaling
        )
        x = _conv1d(layer.attn_proj, a.transpose(1, 2).reshape(-1, embed)).view(batch, width, embed) + x
        h = _layer_norm(layer.ln_2, x).view(-1, embed)
        h = _conv1d(layer.c_fc, h, out=self._buffer("fc", h.shape[0], layer.c_fc.nf))
        if layer.act_is_gelu_new:
            h = _gelu_new_(h, self._buffer("gelu", h.shape[0], layer.c_fc.nf))
        else:
            h = layer.act(h)
        return x + _conv1d(layer.mlp_proj, h).view(batch, width, embed)

    def _buffer(self, name: str, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] view of buffer ``name``, which is sized for the most rows asked so far."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width:
            buffer = self._buffers[name] = self.wte.new_empty(rows, width)
        return buffer[:rows]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_layer_norm(self.ln_f, x), self.lm_head.weight, self.lm_head.bias)


_M = TypeVar("_M", bound=nn.Module)


class _NotStock(Exception):
    """A module of the model is not the stock Hugging Face GPT-2 module."""


def _stock(module: object, kind: type[_M]) -> _M:
    """``module`` if its type is exactly ``kind`` (a subclass may compute something else)."""
    if type(module) is not kind or not isinstance(module, kind):  # isinstance: for the type checker
        raise _NotStock(f"{type(module).__name__} is not {kind.__name__}")
    return module


def _gpt2_layers(model: GPT2LMHeadModel) -> list[_GPT2Layer] | None:
    """Each block's parameters, or ``None`` if any module is not the stock one (e.g. a LoRA layer)."""
    try:
        _stock(model.transformer.ln_f, nn.LayerNorm)
        layers = []
        for module in model.transformer.h:
            block = _stock(module, GPT2Block)
            attn, mlp = _stock(block.attn, GPT2Attention), _stock(block.mlp, GPT2MLP)
            layers.append(
                _GPT2Layer(
                    ln_1=_stock(block.ln_1, nn.LayerNorm),
                    c_attn=_stock(attn.c_attn, Conv1D),
                    attn_proj=_stock(attn.c_proj, Conv1D),
                    scaling=float(attn.scaling),
                    ln_2=_stock(block.ln_2, nn.LayerNorm),
                    c_fc=_stock(mlp.c_fc, Conv1D),
                    act=mlp.act,
                    act_is_gelu_new=_is_stock_gelu_new(mlp.act),
                    mlp_proj=_stock(mlp.c_proj, Conv1D),
                )
            )
    except (_NotStock, AttributeError):
        return None
    return layers


def _is_stock_gelu_new(act: nn.Module) -> bool:
    """``act`` is transformers' ``NewGELUActivation`` with its own forward (not a hub kernel)."""
    forward = getattr(type(act), "forward", None)
    return (
        type(act) is NewGELUActivation
        and "forward" not in vars(act)
        and getattr(forward, "__module__", None) == "transformers.activations"
    )


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``NewGELUActivation()(x)`` written into ``scratch`` (same shape), overwriting ``x``.

    The module's eight elementwise operations with the same operands in the same order (only
    commuted), so the result is bit-identical; but in place, without the module's seven fresh
    [N, F] temporaries.
    """
    y = torch.pow(x, 3.0, out=scratch)
    y.mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_().add_(1.0)
    return y.mul_(x.mul_(0.5))


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def _conv1d(module: Conv1D, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``Conv1D.forward`` on 2-D input [N, in] → [N, out] (the same ``addmm``), optionally into
    ``out``."""
    return torch.addmm(module.bias, x, module.weight, out=out)
