"""The longest sequence a Hugging Face model can take, read from its config.

The one position-limit lookup of the project: generation, the SFT/RM trainers, the servers and the
start-up checks of every command use it. Knows config attributes only, nothing of weights.
"""

from __future__ import annotations

# n_positions: GPT-2 style learned position embeddings; max_position_embeddings: most others,
# Llama's rotary embeddings included (past it, rotary models run on silently but degrade).
_LIMIT_ATTRIBUTES = ("n_positions", "max_position_embeddings")


def position_limit(config: object) -> int | None:
    """The longest sequence a model with this Hugging Face ``config`` allows: its ``n_positions``
    or ``max_position_embeddings``; None when it states neither (no limit to check)."""
    for name in _LIMIT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
