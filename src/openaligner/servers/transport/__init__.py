"""Transport: how a served endpoint reaches the network. You do not need to read this to change
what an endpoint computes.

An endpoint is a plain object with ``validate(inputs)`` and ``run(requests)`` (see
:class:`openaligner.servers.transport.triton.Endpoint`); this package puts it behind HTTP and keeps
every client from breaking it:

``kserve`` (KServe v2 bodies, read strictly, written back canonically) ← ``http_guard`` (the HTTP
front on the served address: each request judged alone by the endpoint's own ``validate``)
← ``triton`` (the PyTriton binding: Triton on a private loopback port, the per-call path)
← ``lifecycle`` (start on rank 0, serve until asked, stop everything); ``workspace`` (each server's
directory and processes on this machine, and what dead servers left) is used by ``triton``.

Must not know what an endpoint computes, nor about models. Import the submodules directly.
"""
