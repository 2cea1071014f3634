"""An independent numpy implementation of workerd --data=langid (issue 34):
the word selection, the split, fastText's hashing of character n-grams, the
embedding bag (mean) then softmax regression, trained as workerd --local
trains it (the batcher's epoch order, adam on the dense layer, lazy adam on
the table's rows, the same initial values); and a bag-of-n-grams logistic
regression baseline (one weight per bucket and class on the same mean
features, trained alike).

As a program: langid_ref.py DICT_DIR WORDS_PER_LANG ROWS DIM STEPS BATCH LR SEED
prints a JSON line {"accuracy": ..., "baseline_accuracy": ..., "train": n, "test": n}."""
import json
import os
import sys

import numpy as np

F32 = np.float32
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
LISTS = ["american-english", "ngerman", "french", "spanish", "italian", "dutch", "portuguese", "swedish",
         "bokmaal", "danish", "polish"]


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def fnv64_lines(buf, starts, lens):
    """FNV-1a 64 of the byte strings buf[starts[i]:starts[i]+lens[i]], vectorized (uint64 wraps):
    sorted by length, the strings still going at byte j are a prefix."""
    order = np.argsort(-lens, kind="stable")
    sl, ss = lens[order], starts[order]
    h = np.full(len(lens), 14695981039346656037, np.uint64)
    prime = np.uint64(1099511628211)
    with np.errstate(over="ignore"):
        for j in range(int(sl[0]) if len(sl) else 0):
            k = int(np.searchsorted(-sl, -j, side="left"))  # the strings longer than j bytes
            h[:k] = (h[:k] ^ buf[ss[:k] + j].astype(np.uint64)) * prime
    out = np.empty_like(h)
    out[order] = h
    return out


def select(dict_dir, per_lang):
    """[(hash, word bytes, lang)] as langid.c selects and orders them, split into (train, test)."""
    cands = []
    for lang, name in enumerate(LISTS):
        with open(os.path.join(dict_dir, name), "rb") as f:
            text = f.read()
        buf = np.frombuffer(text, np.uint8)
        nl = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], nl + 1])
        ends = np.concatenate([nl, [len(buf)]])
        ends = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))  # a CR before the LF
        blank = np.concatenate([[0], np.cumsum((buf == 32) | (buf == 9))])
        lens = ends - starts
        ok = (lens >= 2) & (lens <= 32) & (blank[ends] == blank[starts])
        starts, lens = starts[ok], lens[ok]
        h = fnv64_lines(buf, starts, lens)
        for i in np.argsort(h, kind="stable")[:per_lang]:
            cands.append((int(h[i]), text[starts[i]:starts[i] + lens[i]], lang))
    count = {}
    for _, w, _ in cands:
        count[w] = count.get(w, 0) + 1
    kept = sorted((c for c in cands if count[c[1]] == 1), key=lambda c: (c[0], c[2]))
    test = [c for c in kept if (c[0] >> 32) % 10 == 0]
    train = [c for c in kept if (c[0] >> 32) % 10 != 0]
    return train, test


def ngram_ids(word, rows):
    """fastText: n-grams (2..5 characters) of <word>, FNV-1a 32 over signed bytes, mod rows."""
    b = b"<" + word + b">"
    starts = [i for i in range(len(b)) if (b[i] & 0xC0) != 0x80] + [len(b)]
    nc = len(starts) - 1
    out = []
    for n in range(2, 6):
        for i in range(nc - n + 1):
            h = 2166136261
            for c in b[starts[i]:starts[i + n]]:
                h ^= (c - 256 if c > 127 else c) & 0xFFFFFFFF
                h = (h * 16777619) & 0xFFFFFFFF
            out.append(h % rows)
    return out


def epoch_order(n, seed, epoch):
    """idx_epoch_order: Fisher-Yates driven by splitmix64, seeded with rng_stream(seed, epoch)."""
    state = mix64(seed ^ mix64((epoch + GOLDEN) & MASK))
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = MASK - MASK % bound
        while True:
            state = (state + GOLDEN) & MASK
            r = mix64(state)
            if r < limit:
                break
        j = r % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def init_row(seed, scale, idx, dim):
    base = (seed + idx * GOLDEN) & MASK
    out = np.empty(dim, F32)
    for j in range(dim):
        x = mix64((base + (j + 1) * GOLDEN) & MASK)
        out[j] = F32(scale) * (F32(2.0) * (F32(x >> 40) * F32(2.0 ** -24)) - F32(1.0))
    return out


class Adam:
    """tf.compat.v1.train.AdamOptimizer's update, float32."""

    def __init__(self, lr):
        self.lr, self.b1, self.b2, self.eps = F32(lr), F32(0.9), F32(0.999), F32(1e-8)

    def lr_t(self, t):
        return F32(float(self.lr) * np.sqrt(1 - float(self.b2) ** t) / (1 - float(self.b1) ** t))

    def step(self, w, g, m, v, t):
        m[...] = self.b1 * m + (F32(1) - self.b1) * g
        v[...] = self.b2 * v + (F32(1) - self.b2) * g * g
        w -= self.lr_t(t) * m / (np.sqrt(v) + self.eps)


def mix64_np(z):
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def init_rows(seed, scale, ids, dim):
    """init_row of many ids at once (uint64 arithmetic wraps as C's)."""
    with np.errstate(over="ignore"):
        base = np.uint64(seed) + ids.astype(np.uint64) * np.uint64(GOLDEN)
        x = mix64_np(base[:, None] + (np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(GOLDEN))[None, :])
    u = (x >> np.uint64(40)).astype(F32) * F32(2.0 ** -24)
    return (F32(scale) * (F32(2.0) * u - F32(1.0))).astype(F32)


def bags_of(split_ids, ex):
    """The concatenated ids of examples ex, each one's example number, the 1/len of each."""
    ids = np.concatenate([split_ids[e] for e in ex]).astype(np.int64)
    lens = np.array([len(split_ids[e]) for e in ex])
    seg = np.repeat(np.arange(len(ex)), lens)
    return ids, seg, (F32(1.0) / lens.astype(F32)).astype(F32)


class LazyTable:
    """Rows by compact index (every id of the data), their adam slots; only touched rows move."""

    def __init__(self, all_ids, values):
        self.all_ids = all_ids  # sorted
        self.w = values
        self.m = np.zeros_like(values)
        self.v = np.zeros_like(values)

    def rows(self, ids):
        return np.searchsorted(self.all_ids, ids)


def train(ds, rows, dim, classes, steps, batch, lr, seed, init_scale, with_dense=True):
    """The embedding bag (mean) + dense softmax (with_dense), or, without, a bag of per-class weights
    (logistic regression on the mean bag-of-n-grams); adam, lazy on the table. Returns test accuracy."""
    (tr_ids, tr_y), (te_ids, te_y) = ds
    all_ids = np.unique(np.concatenate(tr_ids + te_ids))
    width = dim if with_dense else classes
    values = init_rows(seed, init_scale, all_ids, dim) if with_dense else np.zeros((len(all_ids), classes), F32)
    T = LazyTable(all_ids, values)
    W = np.zeros((dim, classes), F32)
    b = np.zeros(classes, F32)
    mW, vW, mb, vb = (np.zeros_like(W), np.zeros_like(W), np.zeros_like(b), np.zeros_like(b))
    opt = Adam(lr)
    tr_y, te_y = np.array(tr_y), np.array(te_y)
    n = len(tr_ids)
    per_epoch = n // batch
    perm, epoch = None, -1

    def forward(split_ids, ex):
        ids, seg, inv = bags_of(split_ids, ex)
        r = T.rows(ids)
        uniq, local = np.unique(r, return_inverse=True)
        first = np.concatenate([[0], np.flatnonzero(np.diff(seg)) + 1])  # every bag is non-empty
        x = (np.add.reduceat(T.w[r], first, axis=0) * inv[:, None]).astype(F32)
        return uniq, local, seg, inv, x

    def logits(x):
        return x @ W + b if with_dense else x + b

    for step in range(steps):
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            perm = epoch_order(n, seed, epoch)
        at = (step % per_epoch) * batch
        ex = perm[at:at + batch]
        uniq, local, seg, inv, x = forward(tr_ids, ex)
        z = logits(x)
        z = z - z.max(1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        dz = p.astype(F32)
        dz[np.arange(len(ex)), tr_y[ex]] -= 1
        dz = (dz / F32(len(ex))).astype(F32)
        t = step + 1
        if with_dense:
            gW, dx = (x.T @ dz).astype(F32), (dz @ W.T).astype(F32)
            opt.step(W, gW, mW, vW, t)
        else:
            dx = dz
        opt.step(b, dz.sum(0).astype(F32), mb, vb, t)
        contrib = dx[seg] * inv[seg][:, None]
        drows = np.stack([np.bincount(local, contrib[:, k], len(uniq)) for k in range(width)], 1).astype(F32)
        w, m, v = T.w[uniq], T.m[uniq], T.v[uniq]
        opt.step(w, drows, m, v, t)
        T.w[uniq], T.m[uniq], T.v[uniq] = w, m, v
    right = 0
    for i0 in range(0, len(te_ids), 1000):
        ex = list(range(i0, min(i0 + 1000, len(te_ids))))
        x = forward(te_ids, ex)[4]
        right += int((logits(x).argmax(1) == te_y[ex]).sum())
    return right / len(te_ids)


def main(argv):
    dict_dir, per_lang, rows, dim, steps, batch, lr, seed = argv[1:9]
    per_lang, rows, dim, steps, batch, seed = int(per_lang), int(rows), int(dim), int(steps), int(batch), int(seed)
    lr = float(lr)
    train_c, test_c = select(dict_dir, per_lang)
    ds = (([np.array(ngram_ids(w, rows), np.int64) for _, w, _ in train_c], [l for _, _, l in train_c]),
          ([np.array(ngram_ids(w, rows), np.int64) for _, w, _ in test_c], [l for _, _, l in test_c]))
    acc = train(ds, rows, dim, len(LISTS), steps, batch, lr, seed, 1.0 / dim)
    # the baseline: logistic regression on the mean bag of n-grams (a weight per bucket and class)
    base = train(ds, rows, dim, len(LISTS), steps, batch, lr, seed, 0.0, with_dense=False)
    print(json.dumps({"accuracy": acc, "baseline_accuracy": base, "train": len(train_c), "test": len(test_c)}))


if __name__ == "__main__":
    main(sys.argv)
