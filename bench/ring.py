"""bench/ring.py - `make bench`: ring all-reduce (workerd --allreduce=ring) against
ps sync mode on loopback, with 2, 3 and 4 workers:

1. bytes each worker sends per all-reduce (bin/ring_allreduce, no model)
   against 2(N-1)/N x the buffer, and the all-reduce's time, for the
   example's model (784-100-10, 318 KB) and a 64 MiB buffer;
2. the training step time, ring vs ps sync, for the example's model (batch
   100) and a 64 MiB model (784-21105-10, batch 10, so the exchange counts);
   steady state: the rate of the last --log_every steps of worker 0;
3. the link load per step: the ps's link in ps mode (measured from psd's
   /metrics: request and response bytes) against each worker's link in ring
   mode (measured from workerd's count), for N up to 4, computed beyond;
4. the all-reduce's time over HTTPS (--tls_cert: a CA and a certificate made
   here with openssl) against HTTP, best of 5 runs each, alternating.

Every process is started here on free 127.0.0.1 ports and stopped by PID.
Prints figures, never fails on one. RESTPS_BIN_DIR picks the build (bin/).
On a 2-core machine the workers share the cores: the step times are a
ratio on this machine, not a claim about a cluster.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchlib import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
DATA = "/usr/share/datasets/fashion-mnist"
MIB = 1 << 20


def hosts(n):
    return ",".join(f"127.0.0.1:{free_port()}" for _ in range(n))


started = []


def start(argv, **kw):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    started.append(p)
    return p


def finish(p, timeout=600):
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out.decode()


def stop_all():
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()
    started.clear()


def allreduce(n, floats, steps, extra=()):
    h = hosts(n)
    ps = [start([f"{BIN}/ring_allreduce", f"--worker_hosts={h}", f"--task_index={r}", f"--floats={floats}",
                 f"--steps={steps}"] + list(extra)) for r in range(n)]
    outs = [finish(p) for p in ps]
    secs, sent = [], []
    for rc, out in outs:
        m = re.search(r"([\d.]+) s each after the first .* ([\d.]+) bytes sent each", out)
        if rc != 0 or not m:
            raise RuntimeError(out)
        secs.append(float(m.group(1)))
        sent.append(float(m.group(2)))
    return max(secs), max(sent)


def timed_lines(p):
    """Read p's output to the end, noting when each log line came: the steady
    step time is the time between the first and the last line over the steps
    between them (so the start, data loading and the first step are out)."""
    seen, lines = [], []
    for raw in p.stdout:
        line = raw.decode()
        lines.append(line)
        m = re.search(r"step \d+ \(global step (\d+)\)", line)
        if m:
            seen.append((int(m.group(1)), time.monotonic()))
    p.wait()
    out = "".join(lines)
    if len(seen) < 2:
        raise RuntimeError("too few log lines:\n" + out[-3000:])
    (s0, t0), (s1, t1) = seen[0], seen[-1]
    return p.returncode, out, (t1 - t0) / (s1 - s0)


def model_args(hidden, batch, steps, log_every):
    return [f"--data_dir={DATA}", f"--hidden_units={hidden}", f"--batch_size={batch}", "--optimizer=sgd",
            "--learning_rate=0.01", f"--train_steps={steps}", f"--log_every={log_every}", "--seed=1"]


def ring_run(n, args, logdir):
    h = hosts(n)
    ps = [start([f"{BIN}/workerd", "--allreduce=ring", f"--worker_hosts={h}", f"--task_index={i}",
                 f"--logdir={logdir}/ring-{n}-{time.time_ns()}", "--save_checkpoint_secs=0"] + args)
          for i in range(n)]
    rc, out, step_secs = timed_lines(ps[0])
    outs = [(rc, out)] + [finish(p) for p in ps[1:]]
    for rc, out in outs:
        if rc != 0:
            raise RuntimeError(out[-3000:])
    m = re.search(r"ring: (\d+) all-reduces, (\d+) bytes sent", outs[0][1])
    return step_secs, int(m.group(2)) / int(m.group(1))


def make_pki(d):
    """A CA and a certificate for 127.0.0.1 in d; ring_allreduce's TLS flags."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=restps bench ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "srv.pem", "-days", "1", "-extfile", "ext.cnf")
    return [f"--tls_cert={d}/srv.pem", f"--tls_key={d}/srv.key", f"--tls_ca={d}/ca.pem"]


def https_vs_http(tmp):
    print("== ring all-reduce alone over HTTPS (--tls_cert, psd's priorities) vs HTTP: best of 5, alternating")
    tls = make_pki(tmp)
    small = (784 * 100 + 100 + 100 * 10 + 10 + 1) * 4
    print(f"{'buffer':>10} {'N':>2} {'HTTP':>10} {'HTTPS':>10} {'HTTPS/HTTP time':>16}")
    for label, floats, steps in (("318 KB", small // 4, 50), ("64 MiB", 16 * MIB, 6)):
        for n in (2, 3):
            best = {}
            for _ in range(5):
                for mode, extra in (("http", []), ("https", tls)):
                    secs, _ = allreduce(n, floats, steps, extra)
                    best[mode] = min(best.get(mode, secs), secs)
            print(f"{label:>10} {n:>2} {best['http'] * 1000:>8.2f}ms {best['https'] * 1000:>8.2f}ms "
                  f"{best['https'] / best['http']:>16.2f}", flush=True)


def metric_sum(text, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{") or
               l.startswith(name + " "))


def ps_run(n, args, logdir):
    psd = subprocess.Popen([f"{BIN}/psd", "--port=0", "--bind=127.0.0.1", "--logdir="],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    started.append(psd)
    line = psd.stdout.readline().decode()
    url = line.split("listening on ", 1)[1].strip()
    ps_host = url.split("//", 1)[1]
    h = hosts(n)
    ws = [start([f"{BIN}/workerd", f"--ps_hosts={ps_host}", f"--worker_hosts={h}", f"--task_index={i}",
                 "--sync=1", "--keep_ps"] + args) for i in range(n)]
    rc, out, step_secs = timed_lines(ws[0])
    outs = [(rc, out)] + [finish(p) for p in ws[1:]]
    for rc, out in outs:
        if rc != 0:
            raise RuntimeError(out[-3000:])
    steps = int(re.search(r"finished after (\d+) local steps", outs[0][1]).group(1))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(url + "/metrics", timeout=10).read().decode()
    link = metric_sum(text, "restps_received_bytes_total") + metric_sum(text, "restps_sent_bytes_total")
    psd.kill()
    psd.wait()
    return step_secs, link / steps


def main():
    for f in ("workerd", "psd", "ring_allreduce"):
        if not os.path.exists(f"{BIN}/{f}"):
            print(f"bench/ring.py: {BIN}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if not os.path.isdir(DATA):
        print(f"bench/ring.py: {DATA} is missing (make deps)", file=sys.stderr)
        return 1
    small = (784 * 100 + 100 + 100 * 10 + 10 + 1) * 4  # the example's gradients + the loss
    big_hidden = 21105
    big = (784 * big_hidden + big_hidden + big_hidden * 10 + 10 + 1) * 4
    tmp = tempfile.mkdtemp(prefix="restps-ring-bench-")
    try:
        print("== ring all-reduce alone (bin/ring_allreduce): bytes each worker sends vs 2(N-1)/N x buffer")
        print(f"{'buffer':>10} {'N':>2} {'sent/worker':>14} {'2(N-1)/N x buf':>15} {'ratio':>6} {'time':>10}")
        for label, floats, steps in (("318 KB", small // 4, 50), ("64 MiB", 16 * MIB, 4)):
            for n in (2, 3, 4):
                secs, sent = allreduce(n, floats, steps)
                want = 2 * (n - 1) / n * floats * 4
                print(f"{label:>10} {n:>2} {sent:>14,.0f} {want:>15,.0f} {sent / want:>6.3f} {secs * 1000:>8.1f}ms")
        print()
        print("== training step, ring vs ps sync (steady state, worker 0; sgd)")
        print(f"{'model':>22} {'N':>2} {'ring step':>10} {'ps step':>10} {'ps/ring':>8} "
              f"{'ring link/worker':>17} {'ps link (ps)':>14}")
        links = {}
        for label, hidden, batch, steps, every, mbytes in (
                ("784-100-10 (318 KB)", 100, 100, 300, 50, small),
                (f"784-{big_hidden}-10 (64 MiB)", big_hidden, 10, 10, 1, big)):
            args = model_args(hidden, batch, steps, every)
            for n in (2, 3, 4):
                r_step, r_sent = ring_run(n, args, tmp)
                p_step, p_link = ps_run(n, args, tmp)
                # a worker's link carries what it sends and as much again coming in
                links[(label, n)] = (2 * r_sent, p_link)
                print(f"{label:>22} {n:>2} {r_step * 1000:>8.1f}ms {p_step * 1000:>8.1f}ms {p_step / r_step:>8.2f} "
                      f"{2 * r_sent / MIB:>13.2f} MiB {p_link / MIB:>10.2f} MiB")
        print()
        print("== link load per step, 64 MiB model: the ps's link (ps mode) vs each worker's link (ring)")
        print("   ps: N gradients in + N parameter copies out = 2N x M; ring: 2(N-1)/N x M out and as much in")
        print(f"{'N':>4} {'ps link':>12} {'ring link/worker':>17} {'ps/ring':>8}  source")
        label = f"784-{big_hidden}-10 (64 MiB)"
        for n in (2, 3, 4, 8, 16, 32, 64):
            ps_c, ring_c = 2 * n * big, 2 * 2 * (n - 1) / n * big
            if (label, n) in links:
                ring_m, ps_m = links[(label, n)]
                print(f"{n:>4} {ps_m / MIB:>8.0f} MiB {ring_m / MIB:>13.0f} MiB {ps_m / ring_m:>8.2f}  measured "
                      f"(computed {ps_c / MIB:.0f} / {ring_c / MIB:.0f} MiB)")
            else:
                print(f"{n:>4} {ps_c / MIB:>8.0f} MiB {ring_c / MIB:>13.0f} MiB {ps_c / ring_c:>8.2f}  computed")
        print()
        https_vs_http(tmp)
    finally:
        stop_all()
        subprocess.run(["rm", "-rf", tmp])
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup
    sys.exit(main())
