#!/usr/bin/python3
"""The hostile campaign against the other surfaces (issue 37, part 6):
campaign.py throws its requests at psd; this one at the ring's endpoint, a
pipeline stage's endpoint, and the files a user hands over.

- ring: a ring member (bin/ring_allreduce, task 0 of 2) whose neighbour is
  not there yet gets the framing, header, path, method and version cases
  and hostile pieces (NaN and Inf floats, a step far from its own, ring
  steps, offsets and lengths out of range, a body shorter or longer than it
  says, repeated query arguments, huge numbers) and byte mutations of them.
  Each must be refused (never 2xx, never 5xx but 503) and the member must
  answer /healthz, with no sanitizer report and bounded memory. Then the
  real neighbour starts: the all-reduce must end with exactly the sum numpy
  computes, so no refused piece landed in a slot.
- stage: pipeline stage 1 of 2 (workerd --pipeline_stages=2) waiting for
  stage 0's activations gets the same framing cases and hostile messages
  (wrong plan, step, direction, sender, lengths, NaN activations, a loss
  that is no number); after each it must still wait for the same message
  with nothing buffered (GET /v1/pipeline).
- files: --evaluate_model on byte mutations of a real model file, and psd
  started on a --logdir holding byte mutations of a real checkpoint: each
  run ends (evaluate: exit 0 or 2; psd: serves, or exits 2 saying why)
  within its time bound, never by a signal, with no sanitizer report and a
  bounded peak RSS; psd never restores a mutated checkpoint whose CRCs
  fail.

Usage: campaign_endpoints.py [--bin DIR] [--data DIR] [--long] [--seed N]
[--only ring,stage,files]. Exit 0 when every invariant held, 1 with the
findings. Debian's /usr/bin/python3 with numpy runs it;
tests/system/test_hostile_campaign.py runs the short form, make hostile the
long one."""
import argparse
import json
import os
import random
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from campaign import SANITIZER_MARKS, Psd, head, http, mutate, raw, rss_kib  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Target:
    """A process serving HTTP on port, its stderr in a file."""

    def __init__(self, argv, port, workdir, name, env=None):
        self.port, self.name = port, name
        self.err_path = os.path.join(workdir, name + ".err")
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.err, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        while time.time() - t0 < 30:
            try:
                if http("GET", f"http://127.0.0.1:{port}/healthz", timeout=1)[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited {self.proc.returncode}: {self.log()[-2000:]}")
        else:
            raise RuntimeError(f"{name} never served /healthz")
        self.rss0 = rss_kib(self.proc.pid)

    log = Psd.stderr  # its output so far

    def stop(self):
        Psd.stop(self)  # SIGTERM by PID, then SIGKILL after 20 s
        self.err.close()


class Findings:
    def __init__(self):
        self.list, self.counts = [], {}

    def add(self, cat, name, what):
        self.list.append(f"[{cat}] {name}: {what}")

    def count(self, cat, n=1):
        self.counts[cat] = self.counts.get(cat, 0) + n


def framing_cases(method, path, headers, body, refused_path):
    """(name, raw request) built around one request of the surface that it
    would take: every one is malformed HTTP and must be refused. The heads
    that are only large (3000 headers, a 200 KB one) are sent to
    refused_path, a request the surface refuses for what it says: each
    endpoint bounds its heads by its connection's memory (psd's 128 KiB
    answers them 431, the ring's and a stage's 256 KiB may take them)."""
    put = lambda hdrs, b=body, p=path, cl=True: head(method, p, headers + hdrs, b, cl)
    c = [("CL+TE", put(["Transfer-Encoding: chunked"], b"0\r\n\r\n" + body)),
         ("two Content-Length", put([f"Content-Length: {len(body) + 4}"])),
         ("TE gzip", put(["Transfer-Encoding: gzip"], cl=False)),
         ("chunk size overflow", put(["Transfer-Encoding: chunked"], b"ffffffffffffffffff\r\n" + body, cl=False)),
         ("chunked past its length", put(["Transfer-Encoding: chunked", f"Content-Length: {len(body)}"],
                                         b"%x\r\n" % (len(body) + 8) + body + b"\0" * 8 + b"\r\n0\r\n\r\n",
                                         cl=False)),
         ("folded header", head(method, path, headers, None, False)[:-2] +
          b"Content-Length:\r\n %d\r\n\r\n" % len(body) + body),
         ("NUL in the target", head(method, path + "\x00x", headers, body)),
         ("NUL in a header", put(["X-Junk: a\x00b"])),
         ("control byte in a header", put(["X-Junk: a\x01b"])),
         ("header without a colon", put(["NoColonHere"])),
         ("space before the colon", put(["X-Junk : 1"])),
         ("3000 headers", put(["a: b"] * 3000, p=refused_path)),
         ("one 200 KB header", put(["X-Big: " + "a" * 200000], p=refused_path)),
         ("a query of 3000 arguments", head(method, path + "&a" * 3000, headers, body)),
         ("version HTTP/2.0", head(method, path, headers, body).replace(b"HTTP/1.1", b"HTTP/2.0", 1)),
         ("version HTTX/1.1", head(method, path, headers, body).replace(b"HTTP/1.1", b"HTTX/1.1", 1))]
    for v in ("-1", "1e3", "0x4", " 4x", "99999999999999999999999", "+4"):
        c.append((f"Content-Length {v!r}", put([f"Content-Length: {v}"], cl=False)))
    for m in ("PATCH", "DELETE", "PUT", "put", "TRACE", "CONNECT"):
        c.append((f"method {m}", head(m, path, headers, body)))
    for p in (path.replace("/v1/", "/v1/../v1/", 1), path.replace("/v1/", "//v1/", 1), "*",
              "http://x" + path, path.split("?")[0] + "x?" + path.split("?", 1)[1]):
        c.append((f"target {p[:30]}", head(method, p, headers, body)))
    return c


class Surface:
    """Hostile requests at one endpoint with its own check of what a refused
    request may not change."""

    def __init__(self, t, f, cat, state=None, rss_cap_kib=256 * 1024):
        self.t, self.f, self.cat, self.state = t, f, cat, state
        self.before = state() if state else None
        self.rss_cap = rss_cap_kib

    def alive(self, name):
        if self.t.proc.poll() is not None:
            self.f.add(self.cat, name, f"{self.t.name} exited {self.t.proc.returncode}")
            return False
        try:
            st = http("GET", f"http://127.0.0.1:{self.t.port}/healthz", timeout=2)[0]
            if st != 200:
                self.f.add(self.cat, name, f"/healthz answered {st}")
        except OSError as e:
            self.f.add(self.cat, name, f"/healthz unanswered after it: {e!r}")
            return False
        log = self.t.log()
        for m in SANITIZER_MARKS:
            if m in log:
                self.f.add(self.cat, name, "sanitizer report:\n" + log[log.index(m) - 200:][:3000])
                return False
        if rss_kib(self.t.proc.pid) - self.t.rss0 > self.rss_cap:
            self.f.add(self.cat, name, f"RSS {rss_kib(self.t.proc.pid)} KiB")
        return True

    def one(self, name, data, must_refuse=True):
        self.f.count(self.cat)
        try:
            st, got = raw(self.t.port, data)
        except OSError as e:
            st, got = None, repr(e).encode()
        if not self.alive(name):
            return False
        if st is not None and st >= 500 and st not in (503, 505):
            self.f.add(self.cat, name, f"answered {st}: {got[:200]!r}")
        if st is not None and 200 <= st < 300 and must_refuse:
            self.f.add(self.cat, name, f"accepted ({st}): {got[:200]!r}")
        if self.state:
            after = self.state()
            if after != self.before:
                self.f.add(self.cat, name, f"refused ({st}) yet the state changed: {self.before} -> {after}")
                self.before = after
        return True


def f32(a):
    return np.asarray(a, dtype="<f4").tobytes()


def run_ring(bin_dir, wd, f, rng, long_form):
    """A ring member waiting for its neighbour; then the neighbour: the sum."""
    floats, piece = 10, 8
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    out0 = os.path.join(wd, "ring0.out")
    argv = [os.path.join(bin_dir, "ring_allreduce"), f"--worker_hosts={hosts}", f"--floats={floats}",
            f"--piece_bytes={piece}", "--timeout_secs=60"]
    t = Target(argv + ["--task_index=0", f"--output={out0}"], ports[0], wd, "ring0")
    ok = True
    try:
        s = Surface(t, f, "ring")
        # a piece as the left neighbour (task 1) would send one of step 0:
        # every hostile variant below changes one thing that makes it wrong
        q = "step=0&k=0&offset=0&from=1&n=2&floats=10"
        good = f32([1.0, 2.0])
        hdr = ["Content-Type: application/octet-stream"]
        path = "/v1/ring/chunk?" + q
        refused = "/v1/ring/chunk?step=7&k=0&offset=0&from=1&n=2&floats=10"
        cases = framing_cases("POST", path, hdr, good, refused)
        for name, v in (("NaN", [np.nan, 1.0]), ("Inf", [1.0, np.inf]), ("-Inf", [-np.inf, 0.0])):
            cases.append((f"piece with {name}", head("POST", path, hdr, f32(v))))
        for bad in ("step=1000000", "step=-1", "step=99999999999999999999", "k=7", "k=-1", "offset=11",
                    "offset=9", "from=0", "from=5", "n=3", "n=0", "floats=11", "floats=0", "step=1e3",
                    "step=+0", "step=0x0", "step=%200"):
            key = bad.split("=")[0]
            qq = "&".join(p if p.split("=")[0] != key else bad for p in q.split("&"))
            cases.append((f"piece {bad}", head("POST", "/v1/ring/chunk?" + qq, hdr, good)))
        cases.append(("piece step given twice", head("POST", path + "&step=0", hdr, good)))
        cases.append(("piece missing k", head("POST", path.replace("k=0&", ""), hdr, good)))
        cases.append(("piece one float short", head("POST", path, hdr, good[:-4])))
        cases.append(("piece one float over", head("POST", path, hdr, good + f32([1.0]))))
        cases.append(("piece of 3 bytes", head("POST", path, hdr, good[:3])))
        cases.append(("GET the chunk route", head("GET", path, [], None)))
        cases.append(("a shorter body than announced", head("POST", path, hdr + ["Content-Length: 64"], good,
                                                           cl=False)))
        for name, data in cases:
            if not s.one(name, data):
                ok = False
                break
        # byte mutations of a refused piece (step 7: never this member's);
        # a mutation may make it any request but one of step 0 or 1 of ring
        # step 0..1 from task 1, so those that parse to such a piece are
        # skipped, and every other must be refused
        base = head("POST", refused, hdr, good)
        n_mut = 600 if long_form else 60
        for i in range(n_mut if ok else 0):
            m = mutate(rng, base)
            line = m.split(b"\r\n", 1)[0]
            if b"step=0&" in line or b"step=1&" in line or b"step=0 " in line or b"step=1 " in line:
                continue
            if not s.one(f"mutation #{i}", m):
                ok = False
                break
        # the neighbour: the all-reduce must be exactly what numpy sums
        if ok:
            out1 = os.path.join(wd, "ring1.out")
            r1 = subprocess.run(argv + ["--task_index=1", f"--output={out1}"], capture_output=True, text=True,
                                timeout=90)
            t.proc.wait(timeout=30)
            want = sum(np.array([r + 1 + (i % 7) / 8 for i in range(floats)], np.float32) for r in range(2))
            for name, path_, rc in (("task 0", out0, t.proc.returncode), ("task 1", out1, r1.returncode)):
                if rc != 0:
                    f.add("ring", "the all-reduce after the campaign", f"{name} exited {rc}: "
                          f"{(t.log() if name == 'task 0' else r1.stdout + r1.stderr)[-1500:]}")
                    continue
                got = np.fromfile(path_, dtype="<f4")
                if got.shape != want.shape or not np.array_equal(got, want):
                    f.add("ring", "the all-reduce after the campaign",
                          f"{name}'s sum {got.tolist()} is not numpy's {want.tolist()}: a refused piece landed")
            f.count("ring")
    finally:
        t.stop()


def small_data(wd, n_train=7000, n_test=500):
    import gzip
    d = os.path.join(wd, "data")
    os.makedirs(d, exist_ok=True)
    for kind, n in (("train", n_train), ("t10k", n_test)):
        with gzip.open(os.path.join(DATA, f"{kind}-images-idx3-ubyte.gz")) as g:
            img = g.read()
        with gzip.open(os.path.join(DATA, f"{kind}-labels-idx1-ubyte.gz")) as g:
            lab = g.read()
        with open(os.path.join(d, f"{kind}-images-idx3-ubyte"), "wb") as o:
            o.write(struct.pack(">IIII", 0x803, n, 28, 28) + img[16:16 + 784 * n])
        with open(os.path.join(d, f"{kind}-labels-idx1-ubyte"), "wb") as o:
            o.write(struct.pack(">II", 0x801, n) + lab[8:8 + n])
    return d


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def run_stage(bin_dir, wd, data, f, rng, long_form):
    """Stage 1 of 2 waiting for stage 0's first activations."""
    tok = os.path.join(wd, "stage-token")
    with open(tok, "w") as o:
        o.write("stage-token-37\n")
    auth = "Authorization: Bearer stage-token-37"
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    argv = [os.path.join(bin_dir, "workerd"), "--task_index=1", f"--worker_hosts={hosts}", "--pipeline_stages=2",
            "--micro_batches=2", "--pipeline_timeout_secs=120", f"--auth_token_file={tok}", f"--data_dir={data}",
            "--model=mlp:32,16", "--optimizer=sgd", "--train_steps=5", "--batch_size=32", "--log_every=0"]
    t = Target(argv, ports[1], wd, "stage1")
    try:
        url = f"http://127.0.0.1:{ports[1]}/v1/pipeline"
        t0 = time.time()
        while True:
            info = json.loads(http("GET", url)[2])
            if info["waiting_for"] or time.time() - t0 > 20:
                break
            time.sleep(0.05)
        if not info["waiting_for"]:
            f.add("stage", "start", f"stage 1 does not say what it waits for: {info}")
            return

        def state():
            j = json.loads(http("GET", url)[2])
            return (j["buffered"], json.dumps(j["waiting_for"], sort_keys=True), j["current_step"])

        s = Surface(t, f, "stage", state)
        plan = crc32c(info["plan"].encode())
        n = 32 // 2 * 32  # a micro-batch of 16 x the first dense's 32 outputs
        good = f32(np.arange(n) / n)
        hdr = [auth, "Content-Type: application/octet-stream"]
        q = f"mb=0&dir=act&from=0&plan={plan}&example0=0"
        # step 900: past --train_steps, never this stage's: refused, whatever else is right
        refused = f"/v1/pipeline/msg?step=900&{q}"
        real = f"/v1/pipeline/msg?step=0&{q}"
        cases = framing_cases("POST", real, hdr, good, refused)
        bad_act = np.arange(n, dtype=np.float32)
        bad_act[n // 2] = np.nan
        cases += [("activations with a NaN", head("POST", real, hdr, f32(bad_act))),
                  ("activations with an Inf", head("POST", real, hdr, f32(np.full(n, np.inf)))),
                  ("no token", head("POST", real, hdr[1:], good)),
                  ("a wrong token", head("POST", real, ["Authorization: Bearer x"] + hdr[1:], good)),
                  ("one float short", head("POST", real, hdr, good[:-4])),
                  ("one float over", head("POST", real, hdr, good + f32([0.0]))),
                  ("3 bytes", head("POST", real, hdr, good[:3])),
                  ("step given twice", head("POST", real + "&step=0", hdr, good)),
                  ("another plan", head("POST", real.replace(f"plan={plan}", f"plan={plan ^ 1}"), hdr, good)),
                  ("gradients from stage 0", head("POST", real.replace("dir=act", "dir=grad"), hdr, good)),
                  ("a gradient loss that is no number",
                   head("POST", real.replace("dir=act", "dir=grad").replace("from=0", "from=2") + "&loss=nan",
                        hdr, good)),
                  ("ring chunks without replicas", head("POST", real.replace("dir=act", "dir=ring"), hdr, good)),
                  ("sums from replica 0 of 1", head("POST", real.replace("dir=act", "dir=reduce"), hdr, good)),
                  ("no example0", head("POST", real.replace("&example0=0", ""), hdr, good)),
                  ("mb past the micro-batches", head("POST", real.replace("mb=0", "mb=2"), hdr, good)),
                  ("mb huge", head("POST", real.replace("mb=0", "mb=99999999999999999999"), hdr, good)),
                  ("from huge", head("POST", real.replace("from=0", "from=-1"), hdr, good)),
                  ("dir oops", head("POST", real.replace("dir=act", "dir=oops"), hdr, good)),
                  ("a 1 GiB Content-Length", head("POST", real, hdr + ["Content-Length: 1073741824"], b"",
                                                   cl=False))]
        for name, data_ in cases:
            if not s.one(name, data_):
                return
        base = head("POST", refused, hdr, good)
        for i in range(600 if long_form else 60):
            m = mutate(rng, base)
            if b"step=0&" in m.split(b"\r\n", 1)[0]:
                continue  # could be the real message
            if not s.one(f"mutation #{i}", m):
                return
    finally:
        t.stop()


def peak_rss_run(argv, timeout, env=None):
    """(exit status or -signal, output, peak RSS KiB, seconds) of one run."""
    t0 = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        r = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, env=env)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", str(e.stdout or "")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return rc, out, peak if peak > before else None, time.time() - t0


def file_mutations(rng, blob, n):
    """n byte mutations of a file: flipped, cut, grown, its prefix changed."""
    out = []
    L = len(blob)
    hlen = struct.unpack("<Q", blob[:8])[0]
    for i in range(n):
        b = bytearray(blob)
        kind = i % 6
        if kind == 0:  # a byte of the header
            j = 8 + rng.randrange(hlen)
            b[j] = rng.randrange(256)
        elif kind == 1:  # a byte of the data
            j = 8 + hlen + rng.randrange(L - 8 - hlen)
            b[j] ^= 1 << rng.randrange(8)
        elif kind == 2:  # cut
            b = b[:rng.randrange(L)]
        elif kind == 3:  # the prefix says something else
            b[:8] = struct.pack("<Q", rng.choice([0, 1, hlen - 1, hlen + 1, L, 1 << 40, (1 << 64) - 1]))
        elif kind == 4:  # the header's numbers grow
            h = bytes(b[8:8 + hlen])
            h = h.replace(b"784", str(rng.choice([785, 7840000, 2 ** 31])).encode(), 1)
            b = bytearray(struct.pack("<Q", len(h)) + h + bytes(b[8 + hlen:]))
        else:  # junk appended
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        out.append(bytes(b))
    return out


def run_files(bin_dir, wd, data, f, rng, long_form):
    """--evaluate_model and psd's restore on mutated files."""
    asan = "asan" in bin_dir
    rss_cap = (900 if asan else 300) * 1024
    model = os.path.join(wd, "model.safetensors")
    r = subprocess.run([os.path.join(bin_dir, "workerd"), "--local", f"--data_dir={data}", "--model=mlp:16",
                        "--train_steps=5", "--log_every=0", f"--export={model}"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        f.add("files", "setup", f"--local --export exited {r.returncode}: {r.stderr[-1500:]}")
        return
    blob = open(model, "rb").read()
    n = 60 if long_form else 12
    for i, m in enumerate(file_mutations(rng, blob, n)):
        p = os.path.join(wd, f"mut{i}.safetensors")
        with open(p, "wb") as o:
            o.write(m)
        rc, out, peak, took = peak_rss_run([os.path.join(bin_dir, "workerd"), f"--evaluate_model={p}",
                                            f"--data_dir={data}"], timeout=60)
        f.count("files")
        f.count(f"evaluate exit {rc}")
        name = f"--evaluate_model mutation #{i} ({len(m)} bytes)"
        if rc not in (0, 2):
            f.add("files", name, f"exited {rc}: {out[-800:]}")
        if any(mk in out for mk in SANITIZER_MARKS):
            f.add("files", name, "sanitizer report: " + out[-2000:])
        if peak and peak > rss_cap:
            f.add("files", name, f"peak RSS {peak} KiB")
        if rc == 2 and "workerd" not in out:
            f.add("files", name, f"exit 2 without a message: {out[-300:]!r}")
        os.unlink(p)
    # psd's checkpoints: make one, mutate it, start psd on it
    logdir = os.path.join(wd, "logs")
    port = free_port()
    env = dict(os.environ)
    psd = [os.path.join(bin_dir, "psd"), "--job_name=ps", "--task_index=0", f"--ps_hosts=127.0.0.1:{port}",
           f"--logdir={logdir}", "--save_checkpoint_secs=3600"]
    t = Target(psd, port, wd, "psd-ckpt", env)
    try:
        st = http("PUT", f"http://127.0.0.1:{port}/v1/vars/w", f32(np.arange(12)), {"X-Shape": "3,4"})[0]
        st2 = http("PUT", f"http://127.0.0.1:{port}/v1/config", b'{"optimizer":"adam","learning_rate":0.1}')[0]
        st3 = http("POST", f"http://127.0.0.1:{port}/v1/checkpoint")[0]
        if (st, st2) != (201, 200) or st3 not in (200, 202):
            f.add("files", "setup", f"psd's checkpoint: PUT {st}, config {st2}, save {st3}")
            return
        time.sleep(0.5)
    finally:
        t.stop()
    ck_dir = os.path.join(logdir, "ps-0")
    cks = sorted(x for x in os.listdir(ck_dir) if x.startswith("model.ckpt-") and not x.endswith(".tmp"))
    if not cks:
        f.add("files", "setup", f"no checkpoint in {ck_dir}: {os.listdir(ck_dir)}")
        return
    good = open(os.path.join(ck_dir, cks[-1]), "rb").read()
    for i, m in enumerate(file_mutations(rng, good, n)):
        if m == good:
            continue
        d = os.path.join(wd, f"ck{i}")
        os.makedirs(os.path.join(d, "ps-0"))
        with open(os.path.join(d, "ps-0", cks[-1]), "wb") as o:
            o.write(m)
        port = free_port()
        argv = [os.path.join(bin_dir, "psd"), "--job_name=ps", "--task_index=0", f"--ps_hosts=127.0.0.1:{port}",
                f"--logdir={d}", "--save_checkpoint_secs=3600"]
        name = f"psd on checkpoint mutation #{i} ({len(m)} bytes)"
        f.count("files")
        try:
            t = Target(argv, port, wd, f"psd-mut{i}")
        except RuntimeError as e:
            log = str(e)
            f.count("psd exit 2")
            if " exited 2" not in log:
                f.add("files", name, log[-800:])
            continue
        try:
            sts = json.loads(http("GET", f"http://127.0.0.1:{port}/v1/status")[2])
            restored = (sts.get("checkpoint") or {}).get("restored_from")
            f.count("psd restored" if restored else "psd set it aside")
            if restored:
                # a restore must be of a file whose every CRC holds: its tensors as they were
                st, _, b = http("GET", f"http://127.0.0.1:{port}/v1/vars/w")
                if st != 200 or b != f32(np.arange(12)):
                    f.add("files", name, f"restored a mutated checkpoint: w = {np.frombuffer(b, '<f4')[:4]}...")
            log = t.log()
            if any(mk in log for mk in SANITIZER_MARKS):
                f.add("files", name, "sanitizer report: " + log[-2000:])
            if rss_kib(t.proc.pid) > rss_cap:
                f.add("files", name, f"RSS {rss_kib(t.proc.pid)} KiB")
        finally:
            t.stop()
        if t.proc.returncode not in (0, None):
            f.add("files", name, f"psd exited {t.proc.returncode} on SIGTERM: {t.log()[-500:]}")
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--only", default="ring,stage,files")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    f = Findings()
    t0 = time.time()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="hostile-endpoints-") as wd:
        data = small_data(wd) if only & {"stage", "files"} else None
        if "ring" in only:
            run_ring(args.bin, wd, f, rng, args.long)
        if "stage" in only:
            run_stage(args.bin, wd, data, f, rng, args.long)
        if "files" in only:
            run_files(args.bin, wd, data, f, rng, args.long)
    total = sum(v for k, v in f.counts.items() if k in ("ring", "stage", "files"))
    print(f"hostile campaign (endpoints, files): {total} cases in {time.time() - t0:.1f} s "
          f"({', '.join(f'{k} {v}' for k, v in sorted(f.counts.items()))}); {len(f.list)} finding(s)")
    for x in f.list:
        print("  " + x)
    return 1 if f.list else 0


if __name__ == "__main__":
    sys.exit(main())
