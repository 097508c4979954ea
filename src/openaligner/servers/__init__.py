"""Served models: endpoint logic as plain objects, the PyTriton binding, and the rank-0 loop.

``protocol`` (names, dtypes, shapes) ← ``validation`` / ``batching`` (pure) ← ``distributed``
(rank 0 leads, others follow) ← ``triton`` (PyTriton binding) ← ``reward`` ← ``critic`` (which
serves a :class:`openaligner.trainer.critic.CriticTrainer`).
Import the submodules directly; this package imports nothing heavy on its own.
"""
