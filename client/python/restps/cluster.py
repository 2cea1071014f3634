"""restps.Cluster: every ps task of a job, as one model.

The variables are spread over the ps tasks by workerd's placement
(client/shards/placement.h): each variable lives on one ps, and one larger
than ``--partition_bytes`` is split by rows into parts named
``NAME/part_I``, one per ps. A pull asks every ps at once and gives the
model's variables whole (parts joined by rows, in part order); a push sends
each ps the gradients of what it holds (a variable's gradient cut into the
rows of its parts), each stamped with the step pulled from that ps, as
workerd does. The map of what is where is learnt from the pulls, so a
push needs a pull first."""
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .client import Client, Params

PART = re.compile(r"^(.+)/part_(\d+)$")


class Cluster:
    """The ps tasks ps_hosts ("host:port" each, ps 0 first); the keyword
    arguments go to every :class:`Client`. ``task_type`` and ``task_index``
    are this process's task (from TF_CONFIG, or None); ``trainer`` is its
    index among the training tasks (the chief first, then the workers), the
    ``worker`` that sync pushes and the data order of workerd use."""

    def __init__(self, ps_hosts: Sequence[str], token: Optional[str] = None, *, task_type: Optional[str] = None,
                 task_index: Optional[int] = None, n_chief: int = 0, n_workers: int = 0, **kw: Any) -> None:
        if not ps_hosts:
            raise ValueError("a cluster needs at least one ps task")
        self.ps_hosts = list(ps_hosts)
        self.clients = [Client(h, token, **kw) for h in self.ps_hosts]
        self.task_type, self.task_index = task_type, task_index
        self.n_chief, self.n_workers = n_chief, n_workers
        self.steps: List[int] = [0] * len(self.clients)   # each ps's global_step in the last pull
        self._where: Dict[str, List[Tuple[int, str, int]]] = {}   # name -> [(ps, piece name, rows)]
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients))

    @classmethod
    def from_tf_config(cls, tf_config: Union[None, str, Mapping[str, Any]] = None, token: Optional[str] = None,
                       **kw: Any) -> "Cluster":
        """The cluster of the ``TF_CONFIG`` environment variable (or the JSON
        string or dict given), in exactly TensorFlow's and Kubeflow TFJob's
        form: ``{"cluster": {"chief": [...], "ps": [...], "worker": [...]},
        "task": {"type": "worker", "index": 0}}``."""
        if tf_config is None:
            tf_config = os.environ.get("TF_CONFIG")
            if not tf_config:
                raise ValueError("TF_CONFIG is not set")
        cfg = json.loads(tf_config) if isinstance(tf_config, str) else dict(tf_config)
        spec = cfg.get("cluster")
        if not isinstance(spec, dict) or not spec.get("ps"):
            raise ValueError("TF_CONFIG: cluster.ps is missing or empty")
        for job, hosts in spec.items():
            if not isinstance(hosts, list) or not all(isinstance(h, str) and ":" in h for h in hosts):
                raise ValueError(f"TF_CONFIG: cluster.{job} is not a list of host:port")
        task = cfg.get("task") or {}
        idx = task.get("index")
        if idx is not None and (not isinstance(idx, int) or idx < 0):
            raise ValueError(f"TF_CONFIG: task.index {idx!r} is not a non-negative integer")
        return cls(spec["ps"], token, task_type=task.get("type"), task_index=idx,
                   n_chief=len(spec.get("chief", [])), n_workers=len(spec.get("worker", [])), **kw)

    @property
    def trainer(self) -> Optional[int]:
        """This task's index among the training tasks, or None (a ps, the evaluator, unknown)."""
        if self.task_index is None:
            return None
        if self.task_type == "chief":
            return self.task_index
        if self.task_type == "worker":
            return self.n_chief + self.task_index
        return None

    @property
    def n_trainers(self) -> int:
        """The training tasks: the chief (if any) and the workers."""
        return self.n_chief + self.n_workers

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _each(self, fn: Any, args: Sequence[Tuple[Any, ...]]) -> List[Any]:
        futs = [self._pool.submit(fn, c, *a) for c, a in zip(self.clients, args)]
        return [f.result() for f in futs]

    def pull(self, names: Optional[Iterable[str]] = None, min_step: Union[None, int, Sequence[Optional[int]]] = None,
             *, timeout_ms: int = 30000, worker: Optional[int] = None, moving_average: bool = False) -> Params:
        """The model's variables from every ps at once, parts joined.
        min_step: one step for every ps, or one per ps (None: no wait);
        ``.global_step`` is ps 0's, ``.steps`` each ps's."""
        per = list(min_step) if isinstance(min_step, (list, tuple)) else [min_step] * len(self.clients)
        got = self._each(lambda c, m: c.pull(None, m, timeout_ms=timeout_ms, worker=worker,
                                             moving_average=moving_average), [(m,) for m in per])
        where: Dict[str, List[Tuple[int, int, str, int]]] = {}
        pieces: Dict[str, np.ndarray] = {}
        for i, p in enumerate(got):
            self.steps[i] = p.global_step
            for name, arr in p.items():
                m = PART.match(name)
                whole, part = (m.group(1), int(m.group(2))) if m else (name, -1)
                where.setdefault(whole, []).append((part, i, name, arr.shape[0] if arr.ndim else 1))
                pieces[name] = arr
        out = Params()
        want = None if names is None else list(names)
        for whole, ps in where.items():
            ps.sort()
            self._where[whole] = [(i, name, rows) for _, i, name, rows in ps]
            if want is None or whole in want:
                arrs = [pieces[name] for _, _, name, _ in ps]
                out[whole] = arrs[0] if len(arrs) == 1 else np.concatenate(arrs, axis=0)
        for n in want or []:
            if n not in out:
                raise KeyError(f"no ps holds a variable {n!r}")
        out.global_step = got[0].global_step
        out.steps = list(self.steps)
        out.metadata = got[0].metadata
        return out

    def push(self, grads: Mapping[str, np.ndarray], step: Union[None, int, Sequence[int]] = None,
             push_id: Optional[str] = None, *, worker: Optional[int] = None, loss: Optional[float] = None,
             batch_size: Optional[int] = None) -> List[Optional[Dict[str, Any]]]:
        """Each ps the gradients of what it holds, at once. step: the step
        for every ps, or one per ps; None: each ps's step in the last pull
        (what a sync worker sends). push_id: the id of this push (each ps
        gets it with "/ps<i>" added; one is made up when None). Returns
        each ps's answer (None for a ps that holds none of grads)."""
        per_ps: List[Dict[str, np.ndarray]] = [{} for _ in self.clients]
        for name, g in grads.items():
            if name not in self._where:
                raise KeyError(f"no ps holds a variable {name!r} (pull first: the pull learns where each one is)")
            g = np.asarray(g, dtype=np.float32)
            row = 0
            for i, piece, rows in self._where[name]:
                per_ps[i][piece] = g if len(self._where[name]) == 1 else g[row:row + rows]
                row += rows
        if step is None:
            steps = list(self.steps)
        elif isinstance(step, int):
            steps = [step] * len(self.clients)
        else:
            steps = [int(s) for s in step]

        def one(c: Client, i: int) -> Optional[Dict[str, Any]]:
            if not per_ps[i]:
                return None
            pid = None if push_id is None else f"{push_id}/ps{i}"
            return c.push(per_ps[i], step=steps[i], push_id=pid, worker=worker, loss=loss, batch_size=batch_size)
        return self._each(one, [(i,) for i in range(len(self.clients))])

    def status(self) -> Dict[str, Any]:
        """ps 0's ``GET /v1/status`` (ps 0 owns global_step and the losses)."""
        return self.clients[0].status()

    def vars(self) -> Dict[str, Any]:
        """Every ps's variables: ``{"global_step": ps 0's, "vars": [...]}``, each entry with its ``ps``."""
        lists = self._each(lambda c: c.vars(), [() for _ in self.clients])
        out: List[Dict[str, Any]] = []
        for i, v in enumerate(lists):
            out += [dict(e, ps=i) for e in v.get("vars", [])]
        return {"global_step": lists[0].get("global_step"), "vars": out}

    def ready(self) -> bool:
        """Every ps is ready (the chief initialized and configured it)."""
        return all(self._each(lambda c: c.ready(), [() for _ in self.clients]))

    def heartbeat(self, worker: int) -> None:
        """Renew worker's lease on every ps."""
        self._each(lambda c: c.heartbeat(worker), [() for _ in self.clients])

    def done(self, worker: int) -> None:
        """Say to every ps that worker finished."""
        self._each(lambda c: c.done(worker), [() for _ in self.clients])
