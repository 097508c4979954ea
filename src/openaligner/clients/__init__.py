"""Clients of the served models: futures over HTTP, typed errors, readiness and timeouts.

``errors`` (the exception tree) ← ``base`` (connection, readiness, workers, retries) ← ``reward``.
Import the submodules directly; this package imports nothing heavy on its own.
"""
