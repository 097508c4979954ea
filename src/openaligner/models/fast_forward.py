"""Speed tricks for the full-sequence forwards that score tokens and train the policy: fused tanh-GELU.

Owns the module swaps that make those forwards cheaper while computing the same function (to float
rounding), each as a context manager that restores the model on exit, exceptions included.
:func:`openaligner.models.fast_paths.scoring_forward` decides which apply to a model. Knows nothing
of log-probs, losses or generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.activations import NewGELUActivation


class _TanhGELU(nn.Module):
    """``gelu_new`` (GPT-2's activation, the tanh approximation of GELU) as one fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate="tanh")


@contextmanager
def fused_tanh_gelu(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with every ``NewGELUActivation`` replaced by a fused tanh-GELU.

    transformers' ``gelu_new`` is written as eight elementwise tensor ops (and as many saved
    tensors for backward); ``F.gelu(approximate="tanh")`` is the same function in one kernel
    each way, within 2.4e-7 in float32; on CPU that is about 8 % of the actor update. Only the
    scoring and training forwards use it; generation runs the model as it is.
    """
    swapped = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is NewGELUActivation
    ]
    fused = _TanhGELU()
    for parent, name, _ in swapped:
        setattr(parent, name, fused)
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
