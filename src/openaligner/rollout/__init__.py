"""Rollout engines: what generates the trainer's rollouts (the ``RolloutEngine`` seam, the ``hf``
engine over the actor's modules, and the ``vllm`` engine: its trainer side and its own process).

Imports ``models`` (the actor, generation) and ``algorithms``; never ``trainer``, ``servers``,
``clients``, ``config`` or ``cli``.
"""
