"""Served models: endpoint logic as plain objects, the rank-0 loop, and the two servers.

:mod:`openaligner.protocol` (the wire contract, shared with the clients) ← ``validation`` /
``batching`` (pure) ← ``distributed`` (rank 0 leads, others follow) ← ``reward`` / ``critic`` (the
endpoints as plain ``validate()``/``run()`` objects and the server classes that deploy them; the
critic server runs a :class:`openaligner.trainer.critic.CriticTrainer`). Everything that puts an
endpoint on the network — HTTP front, KServe v2 bodies, the PyTriton binding, workspaces and
process lifecycle — lives in :mod:`openaligner.servers.transport`, which a change to what an
endpoint computes never needs to read.
Import the submodules directly; this package imports nothing heavy on its own.
"""
