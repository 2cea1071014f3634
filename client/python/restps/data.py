"""workerd's data, in numpy: the Fashion-MNIST (MNIST-format IDX) splits as
workerd loads them (client/data/idx.c) and the order its training tasks take
them in (client/data/batcher.c), so that a Python worker in a job with C
workers computes on the batch a C worker of its --task_index would.

- the splits: the first ``validation_size`` (5,000) training images are the
  validation set, the rest the training set (no shuffle before the split, as
  TensorFlow's read_data_sets); pixels are float32 ``uint8 * float32(1/255)``.
- the order: each epoch is one permutation of the training set, a
  Fisher-Yates shuffle drawn from splitmix64 (``rng_stream(seed, epoch)``,
  unbiased ``rng_below``); the N training tasks take turns along it in blocks
  of one batch: task t's batch k is positions ``[(k' N + t) b, (k' N + t + 1) b)``
  of epoch ``k // P``, where P = the rounds of N blocks in an epoch and
  ``k' = k % P`` (sync training: k is the global step)."""
import gzip
import os
import struct
from typing import Dict, Tuple

import numpy as np

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


def mix64(z: int) -> int:
    """splitmix64's finalizer (common/rng.h rng_mix64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of range(n) workerd trains epoch `epoch` in (idx_epoch_order)."""
    order = list(range(n))
    st = mix64((seed ^ mix64((epoch + GOLDEN) & M64)) & M64)
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = M64 - (M64 % bound)
        while True:
            st = (st + GOLDEN) & M64
            r = mix64(st)
            if r < limit:
                break
        j = r % bound
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)


class Batches:
    """Batch k of training task `trainer` of `n_trainers`, batch size `batch`,
    over n training examples with `seed` (workerd's --seed, default 1)."""

    def __init__(self, n: int, seed: int, trainer: int, n_trainers: int, batch: int) -> None:
        self.n, self.seed, self.trainer, self.n_trainers, self.batch = n, seed, trainer, n_trainers, batch
        self._epoch, self._order = -1, np.empty(0, np.int64)

    def indices(self, k: int) -> Tuple[np.ndarray, int]:
        """(the training-set indices of batch k, the first one's place in the
        epoch order: what dropout's mask depends on)."""
        rnd = self.n_trainers * self.batch
        per_epoch = self.n // rnd
        epoch = k // per_epoch
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.n, self.seed, epoch)
        at = (k % per_epoch) * rnd + self.trainer * self.batch
        return self._order[at:at + self.batch], epoch * self.n + at


def read_idx(path: str) -> np.ndarray:
    """An IDX file (raw or .gz) as a uint8 array of its shape."""
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
            ndim = raw[3]
            dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
            return np.frombuffer(raw, np.uint8, int(np.prod(dims)), 4 + 4 * ndim).reshape(dims)
    raise FileNotFoundError(f"{path}[.gz] is missing")


def load(data_dir: str = DEFAULT_DATA, validation_size: int = 5000) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{"train", "validation", "test"}: (images float32 [n, 28, 28, 1] NHWC, labels uint8 [n])."""
    scale = np.float32(1.0 / 255.0)
    out = {}
    for kind, split in (("train", None), ("t10k", "test")):
        img = read_idx(os.path.join(data_dir, f"{kind}-images-idx3-ubyte"))
        lab = read_idx(os.path.join(data_dir, f"{kind}-labels-idx1-ubyte"))
        x = img.reshape(len(img), img.shape[1], img.shape[2], 1).astype(np.float32) * scale
        if split is None:
            out["validation"] = (x[:validation_size], lab[:validation_size])
            out["train"] = (x[validation_size:], lab[validation_size:])
        else:
            out["test"] = (x, lab)
    return out
