"""The exceptions a client of a served model can raise.

Owns the small exception tree (:class:`ClientError` and its subclasses, each also the matching
builtin: ``TimeoutError``, ``ConnectionError``, ``ValueError``, ``PermissionError``) and the rule
that every message names the server (``host:port``) and the model, what happened and what to
check. Must not know about HTTP libraries or particular endpoints.
Design notes (the tree): docs/serving.md, "Module notes".
"""

from __future__ import annotations


class ClientError(Exception):
    """Base class; ``url`` and ``model`` say which server and model the error is about."""

    def __init__(self, message: str, *, url: str, model: str) -> None:
        super().__init__(message)
        self.url = url
        self.model = model


class ServerUnavailableError(ClientError, ConnectionError):
    """The server refused or dropped the connection: is it running, on that host and port?"""


class ServerTimeoutError(ClientError, TimeoutError):
    """The server was not ready within ``init_timeout_s``, or did not answer within ``request_timeout_s``."""


class BadRequestError(ClientError, ValueError):
    """The request was refused as invalid; the message says which input and what was expected."""


class AuthenticationError(ClientError, PermissionError):
    """A protected endpoint (``critic_train``, ``critic_save``) refused the request's token."""


class ServerError(ClientError):
    """The server failed while serving a valid request; its log has the details."""


class ClientClosedError(ClientError):
    """The client was closed before this request was sent or answered."""
