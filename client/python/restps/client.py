"""restps.Client: one psd (one ps task) over its HTTP contract
(openapi/openapi.yaml): the bulk pull (``GET /v1/params``, a long poll with
``min_step``), the bulk push (``POST /v1/grads`` with ``X-Push-Id``), the
status, the variable list and one variable (raw float32, ETag)."""
import json
import os
import urllib.parse
from typing import Any, Dict, Iterable, List, Mapping, Optional

import numpy as np

from . import safetensors_io
from .errors import ProtocolError, Unavailable
from .transport import Transport


class Params(Dict[str, np.ndarray]):
    """What a pull gives: name -> float32 array, plus ``global_step`` (the
    shard's step the values are at, from ``X-Global-Step``) and
    ``metadata`` (the body's ``__metadata__``); a Cluster's pull adds
    ``steps``, each ps task's step."""

    global_step: int
    metadata: Dict[str, str]
    steps: List[int]


class Client:
    """One ps task at "host:port" (or "https://host:port").

    token: the bearer token psd's ``--auth_token_file`` holds (sent with every
    request); tls / ca_file: HTTPS (psd ``--tls_cert``), the certificate
    verified against ca_file or the system's CAs; timeout: seconds a request
    may take (a long poll gets its own wait on top); retries, backoff,
    backoff_max, retry_secs: libps's retry policy (see transport.py).

    >>> c = restps.Client("localhost:2222")
    >>> params = c.pull()                  # {"hid_w": array(784, 100), ...}
    >>> params.global_step
    """

    def __init__(self, host: str, token: Optional[str] = None, *, tls: bool = False,
                 ca_file: Optional[str] = None, timeout: float = 30.0, retries: int = 3,
                 backoff: float = 0.1, backoff_max: float = 2.0, retry_secs: float = 0.0) -> None:
        self.transport = Transport(host, token=token, tls=tls, ca_file=ca_file, timeout=timeout, retries=retries,
                                   backoff=backoff, backoff_max=backoff_max, retry_secs=retry_secs)
        self.host = self.transport.host
        self._nonce = os.urandom(4).hex()
        self._pushes = 0
        self.last_etag: Optional[str] = None
        self.last_version: Optional[int] = None

    def close(self) -> None:
        """Close the keep-alive connection (a later call opens another)."""
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"restps.Client({self.host!r})"

    # ------------------------------------------------------------ the bulk routes

    def pull(self, names: Optional[Iterable[str]] = None, min_step: Optional[int] = None, *,
             timeout_ms: int = 30000, worker: Optional[int] = None, moving_average: bool = False) -> Params:
        """Every variable of the shard in one request (``GET /v1/params``),
        as float32 arrays; names: only these (the others are dropped here;
        an unknown name raises KeyError). min_step: a long poll, answered
        when the shard's global_step reaches it, or after timeout_ms with
        the step it is at (check ``.global_step``); worker (sync mode, with
        min_step): answered at once when the shard holds no gradient of
        this worker for its step. moving_average: the averages
        (``--moving_average_decay``) instead of the variables."""
        q: Dict[str, Any] = {}
        wait = 0.0
        if min_step is not None:
            q.update(min_step=int(min_step), timeout_ms=int(timeout_ms))
            wait = timeout_ms / 1000.0
            if worker is not None:
                q["worker"] = int(worker)
        if moving_average:
            q["moving_average"] = 1
        path = "/v1/params" + ("?" + urllib.parse.urlencode(q) if q else "")
        _, h, body = self.transport.request("GET", path, timeout=self.transport.timeout + wait)
        tensors, meta = safetensors_io.decode(body)
        out = Params()
        if names is None:
            out.update(tensors)
        else:
            for n in names:
                if n not in tensors:
                    raise KeyError(f"{self.host} holds no variable {n!r} (it holds {sorted(tensors)})")
                out[n] = tensors[n]
        try:
            out.global_step = int(h.get("x-global-step", meta.get("global_step", "")))
        except ValueError:
            raise ProtocolError(f"{self.host}: GET /v1/params: no X-Global-Step") from None
        out.metadata = meta
        return out

    def push(self, grads: Mapping[str, np.ndarray], step: Optional[int] = None, push_id: Optional[str] = None, *,
             worker: Optional[int] = None, loss: Optional[float] = None, batch_size: Optional[int] = None,
             clock: Optional[int] = None) -> Dict[str, Any]:
        """Gradients of some of the shard's variables as one update
        (``POST /v1/grads``, float32). step: the global_step they were
        computed from (sync: required, with worker); push_id: makes the
        push idempotent, so it is retried safely (one is made up when not
        given). Returns psd's answer: ``{"global_step", "outcome"
        (applied, pending, stale or duplicate), "duplicate"}``."""
        meta: Dict[str, str] = {}
        for k, v in (("worker", worker), ("step", step), ("batch_size", batch_size), ("clock", clock)):
            if v is not None:
                meta[k] = str(int(v))
        if loss is not None:
            meta["loss"] = repr(float(loss))
        if push_id is None:
            push_id = f"py-{self._nonce}-{self._pushes}"
        self._pushes += 1
        body = safetensors_io.encode({k: np.asarray(v, dtype=np.float32) for k, v in grads.items()}, meta)
        _, _, data = self.transport.request("POST", "/v1/grads", body=body, headers={"X-Push-Id": push_id},
                                            idempotent=True)
        out = json.loads(data.decode("utf-8"))
        if not isinstance(out, dict):
            raise ProtocolError(f"{self.host}: POST /v1/grads: the answer is not a JSON object")
        return out

    # ------------------------------------------------------------ the rest of the contract

    def status(self) -> Dict[str, Any]:
        """``GET /v1/status``: global_step, last_loss, mode, workers, sync, ... (a dict)."""
        return self._json("GET", "/v1/status")

    def vars(self) -> Dict[str, Any]:
        """``GET /v1/vars``: ``{"global_step", "vars": [{"name", "shape", "version", ...}]}``."""
        return self._json("GET", "/v1/vars")

    def config(self) -> Dict[str, Any]:
        """``GET /v1/config``: the training configuration the chief sent."""
        return self._json("GET", "/v1/config")

    def configure(self, cfg: Mapping[str, Any]) -> Dict[str, Any]:
        """``PUT /v1/config``: the training configuration (optimizer,
        learning_rate, sync, replicas_to_aggregate, workers, ...), as the chief sends it."""
        return self._json("PUT", "/v1/config", dict(cfg))

    def put(self, name: str, value: np.ndarray, create_only: bool = False) -> bool:
        """``PUT /v1/vars/{name}``: create or replace a variable with value
        (float32); create_only: only if it does not exist (If-None-Match: *;
        PreconditionFailed when it does). True when it was created."""
        a = np.ascontiguousarray(value, dtype="<f4")
        h = {"X-Shape": ",".join(str(d) for d in a.shape), "X-Dtype": "float32"}
        if create_only:
            h["If-None-Match"] = "*"
        status, _, _ = self.transport.request("PUT", "/v1/vars/" + urllib.parse.quote(name, safe=""),
                                              body=a.tobytes(), headers=h)
        return status == 201

    def ready(self) -> bool:
        """``GET /readyz``: the chief has initialized the variables and configured the shard."""
        try:
            self.transport.request("GET", "/readyz", idempotent=True)
            return True
        except Unavailable:
            return False

    def heartbeat(self, worker: int) -> Dict[str, Any]:
        """``POST /v1/heartbeat``: renew this worker's lease (sync membership)."""
        return self._json("POST", "/v1/heartbeat", {"worker": int(worker)})

    def done(self, worker: int) -> Dict[str, Any]:
        """``POST /v1/done``: this worker finished; a sync step no longer waits for it."""
        return self._json("POST", "/v1/done", {"worker": int(worker)})

    def get_var(self, name: str, etag: Optional[str] = None) -> Optional[np.ndarray]:
        """``GET /v1/vars/{name}`` (raw float32, its shape from ``X-Shape``);
        etag: the ETag of a copy the caller holds: None when it is still
        current (304). The answer's ETag and version are then in
        ``self.last_etag`` and ``self.last_version``."""
        h = {"If-None-Match": etag} if etag else {}
        status, rh, body = self.transport.request("GET", "/v1/vars/" + urllib.parse.quote(name, safe=""),
                                                  headers=h, ok=(200, 304))
        self.last_etag = rh.get("etag")
        self.last_version = int(rh["x-version"]) if "x-version" in rh else None
        if status == 304:
            return None
        shape = tuple(int(s) for s in rh.get("x-shape", str(len(body) // 4)).split(",") if s != "")
        return np.frombuffer(body, dtype="<f4").astype(np.float32).reshape(shape)

    def _json(self, method: str, path: str, obj: Optional[object] = None) -> Dict[str, Any]:
        out = self.transport.json(method, path, obj, idempotent=True)
        if not isinstance(out, dict):
            raise ProtocolError(f"{self.host}: {method} {path}: the answer is not a JSON object")
        return out
