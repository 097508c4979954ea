"""Transport: how a served endpoint reaches the network. You do not need to read this to change
what an endpoint computes.

Owns putting an endpoint (``validate(inputs)``, ``run(requests)``) behind HTTP: ``kserve`` (bodies)
← ``http_guard`` (the front) ← ``triton`` (the PyTriton binding) ← ``lifecycle`` (start, serve,
stop); ``workspace`` (files and processes). Must not know what an endpoint computes, nor about
models. Import the submodules directly.
Design notes: docs/serving.md, "Module notes".
"""
