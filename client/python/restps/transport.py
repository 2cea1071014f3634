"""One keep-alive HTTP(S) connection to one psd, with libps's retry policy
(client/libps/transfer.c): network errors and 503 are retried with
exponential backoff and jitter where a retry cannot apply an update twice
(reads, PUTs, pushes with a push id): ``retries`` extra tries, and for
``retry_secs`` in all when set (a ps restarting). Other requests are retried
only when the connection was never made."""
import http.client
import json
import random
import socket
import ssl
import time
from typing import Dict, Mapping, Optional, Tuple

from .errors import NetworkError, TLSError, http_error


class Transport:
    """Requests to one "host:port". Not for several threads at once: use one
    per thread (a :class:`restps.Client` holds one)."""

    def __init__(self, host: str, token: Optional[str] = None, tls: bool = False, ca_file: Optional[str] = None,
                 timeout: float = 30.0, connect_timeout: float = 3.0, retries: int = 3, backoff: float = 0.1,
                 backoff_max: float = 2.0, retry_secs: float = 0.0) -> None:
        if "://" in host:
            scheme, host = host.split("://", 1)
            tls = tls or scheme == "https"
        host = host.rstrip("/")
        name, sep, port = host.rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"ps address {host!r} is not host:port")
        self.host, self.hostname, self.port = host, name.strip("[]"), int(port)
        self.token = token
        self.tls = bool(tls or ca_file)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.retries, self.backoff, self.backoff_max, self.retry_secs = retries, backoff, backoff_max, retry_secs
        self._ctx = ssl.create_default_context(cafile=ca_file) if self.tls else None
        self._conn: Optional[http.client.HTTPConnection] = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._ctx is not None:
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    self.hostname, self.port, timeout=self.connect_timeout, context=self._ctx)
            else:
                conn = http.client.HTTPConnection(self.hostname, self.port, timeout=self.connect_timeout)
            conn.connect()
            if conn.sock is not None:
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return self._conn

    def request(self, method: str, path: str, body: Optional[bytes] = None,
                headers: Optional[Mapping[str, str]] = None, idempotent: bool = True,
                timeout: Optional[float] = None, ok: Tuple[int, ...] = (200, 201)
                ) -> Tuple[int, Dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of an answer whose
        status is in ok (304 too when asked for); an HTTPError subclass for
        another status, NetworkError or TLSError when no answer came."""
        h = {"Connection": "keep-alive"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            h["Content-Type"] = "application/octet-stream"
        h.update(headers or {})
        start, wait, tries = time.monotonic(), self.backoff, 0
        while True:
            tries += 1
            connected = self._conn is not None
            try:
                conn = self._connect()
                connected = True
                if conn.sock is not None:
                    conn.sock.settimeout(timeout if timeout is not None else self.timeout)
                conn.request(method, path, body=body, headers=h)
                resp = conn.getresponse()
                data = resp.read()
                status, rh = resp.status, {k.lower(): v for k, v in resp.getheaders()}
                if rh.get("connection", "").lower() == "close":
                    self.close()
                if status in ok:
                    return status, rh, data
                if status != 503:
                    raise self._error(status, data, method, path)
                err: Exception = self._error(status, data, method, path)
            except ssl.SSLError as e:
                self.close()
                raise TLSError(f"{self.host}: {method} {path}: TLS: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                self.close()
                err = NetworkError(f"{self.host}: {method} {path}: {type(e).__name__}: {e}")
                if not idempotent and connected:
                    raise err from None   # the request may have been applied: not retried
            if tries > self.retries and time.monotonic() - start >= self.retry_secs:
                raise err
            time.sleep(random.uniform(wait / 2, wait))
            wait = min(wait * 2, self.backoff_max)

    def _error(self, status: int, data: bytes, method: str, path: str) -> Exception:
        body = None
        try:
            body = json.loads(data.decode("utf-8")) if data else None
        except ValueError:
            pass
        err = body.get("error") if isinstance(body, dict) else None
        msg = err if isinstance(err, str) else data.decode("utf-8", "replace").strip()[:500]
        return http_error(status, msg, host=self.host, method=method, path=path,
                          body=body if isinstance(body, dict) else None)

    def json(self, method: str, path: str, obj: Optional[object] = None, idempotent: bool = True) -> object:
        """A JSON exchange: obj sent as JSON (None: no body), the answer parsed."""
        body = None if obj is None else json.dumps(obj).encode()
        h = {"Content-Type": "application/json"} if body is not None else {}
        _, _, data = self.request(method, path, body=body, headers=h, idempotent=idempotent)
        return json.loads(data.decode("utf-8")) if data else None
