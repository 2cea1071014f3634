"""Typed errors of the restps client.

Every error is a :class:`RestpsError`. When psd answered, the error is an
:class:`HTTPError` (or the subclass for its status) carrying the status, psd's
own message (the ``error`` of its JSON body ``{"error": "..."}``) and the
shard that answered, as libps's ``ps_error()`` does::

    try:
        c.pull(["nope"])
    except restps.NotFound as e:
        print(e.status, e.message)   # 404 no variable 'nope'
"""
from typing import Any, Dict, Optional, Type


class RestpsError(Exception):
    """Base of every error this package raises."""


class NetworkError(RestpsError):
    """No answer (connect failure, timeout, reset), after the retries."""


class TLSError(NetworkError):
    """TLS failed: the certificate is not trusted, the wrong name, the handshake (not retried)."""


class ProtocolError(RestpsError):
    """The answer is not what the contract says (a bad safetensors body, a missing header, ...)."""


class HTTPError(RestpsError):
    """psd refused the request: ``status``, ``message`` (psd's JSON ``error``),
    ``body`` (the whole parsed JSON body, or None), ``host``, ``method`` and ``path``."""

    def __init__(self, status: int, message: str, host: str = "", method: str = "", path: str = "",
                 body: Optional[Dict[str, Any]] = None) -> None:
        self.status = status
        self.message = message
        self.host = host
        self.method = method
        self.path = path
        self.body = body
        super().__init__(f"{host}: {method} {path}: HTTP {status}: {message}")


class BadRequest(HTTPError):
    """400: the request was malformed (psd names what was wrong); nothing changed."""


class Unauthorized(HTTPError):
    """401: the bearer token is missing or wrong."""


class NotFound(HTTPError):
    """404: no such variable or route."""


class Conflict(HTTPError):
    """409: e.g. a sync push for a step the shard has not reached."""


class PreconditionFailed(HTTPError):
    """412: a create-only PUT of a variable that exists."""


class TooLarge(HTTPError):
    """413: the body is over psd's limit."""


class Unavailable(HTTPError):
    """503: psd is not ready, or is stopping (retried before it is raised)."""


_BY_STATUS: Dict[int, Type[HTTPError]] = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict,
                                          412: PreconditionFailed, 413: TooLarge, 503: Unavailable}


def http_error(status: int, message: str, **kw: Any) -> HTTPError:
    """The HTTPError subclass for status."""
    return _BY_STATUS.get(status, HTTPError)(status, message, **kw)
