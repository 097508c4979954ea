"""The exceptions a client of a served model can raise.

Owns the small exception tree and the rule that every message names the server (``host:port``)
and the model, says what happened and what to check. Each class also derives from the matching
builtin (``TimeoutError``, ``ConnectionError``, ``ValueError``) so generic handlers work.
Must not know about HTTP libraries or particular endpoints.

    ClientError
    ├── ServerUnavailableError  (ConnectionError)  nothing listening, or the server went away
    ├── ServerTimeoutError      (TimeoutError)     not ready in init_timeout_s / no answer in time
    ├── BadRequestError         (ValueError)       the server (or the client's own checks) refused the request
    ├── AuthenticationError     (PermissionError)  a protected endpoint refused a missing or wrong token
    ├── ServerError                                the server failed on a valid request
    └── ClientClosedError                          the client was closed before the request finished
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
