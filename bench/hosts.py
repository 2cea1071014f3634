"""make bench, the many-hosts section (issue 32): the seed's claim measured.
"In the PS architecture, when there are many workers, the ps node's network
bandwidth becomes the bottleneck; ring all-reduce has no central node."

Every task on its own host (deploy/netns/hosts.sh: network namespaces on one
bridge, each NIC shaped to 1 Gbit/s both ways by tbf), sync training of
mlp:1024,1024 (784-1024-1024-10: 1.86 M parameters, M = 7.5 MB of float32 on
the wire each way) at batch 16 with plain SGD: a step's compute is ~3 ms
of one core while its transfer at 1 Gbit/s is 60 ms or more, so 2 cores can
host 8 workers and the network, not the CPU, sets the pace. For N = 1, 2, 4, 8
workers: 1 ps, k = 2 and 4 ps shards (variables split by rows over the shards:
--partition_bytes=1 MiB, so the shards hold equal bytes), and the ring.

Beside each measured step time, the bandwidth model: PS sync, the busiest ps
link moves 2 N M_k bytes a step (N pulls out, N pushes in, one phase after the
other; M_k the bytes the biggest shard holds, read from its /v1/status), and
each worker's own link 2 M (its pull in, its push out, one after the other):
the step takes the busier of the two, 2 max(N M_k, M) / R; the ring, each
link moves 2 (N-1)/N M each way at once; plus the compute time measured alone
(workerd --local, same model and batch, on one host). R is the tbf rate,
1 Gbit/s = 125 MB/s (TCP's goodput through tbf measured here: ~0.955 of it).

Then one worker's NIC at 1/10 of the others' (4 workers, 1 ps): the step rate
with a backup worker (--replicas_to_aggregate=3) against the all-fast rate.

Then the ring's all-reduce alone (bin/ring_allreduce, no model) of 64 MiB,
N = 2 and 4 tasks, against its bytes' time 2 (N-1)/N x 64 MiB / R (each link
sends that and receives as much at once); target <= 1.6x (issue 33, part 4).

Needs root (network namespaces): elsewhere it says so and skips. Writes
bench/out/hosts.md and prints it. Environment: HOSTS_STEPS (25), HOSTS_N
("1,2,4,8"), RESTPS_BIN_DIR (bin)."""
import json
import os
import re
import subprocess
import sys
import time

from benchlib import BedTask, bed  # noqa: E402
from benchlib import step_secs as bench_step_secs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
HOSTS_SH = os.path.join(ROOT, "deploy", "netns", "hosts.sh")
OUT = os.path.join(ROOT, "bench", "out")
TAG = "restpsbench"
RATE = "1gbit"
R = 1e9 / 8  # bytes/s of RATE
STEPS = int(os.environ.get("HOSTS_STEPS", "25"))
WARM = 5  # steps left out of the timing (connections, first allocations)
NS = [int(x) for x in os.environ.get("HOSTS_N", "1,2,4,8").split(",")]
MODEL = ["--model=mlp:1024,1024", "--batch_size=16", "--optimizer=sgd", "--learning_rate=0.05",
         "--seed=3", "--log_every=1", "--partition_bytes=1048576"]
MAX_PS = 4
port_seq = iter(range(2300, 2999))


def hosts(*args, check=True):
    return bed(HOSTS_SH, TAG, *args, check=check)


def Task(host, argv):
    return BedTask(HOSTS_SH, TAG, host, argv)


def step_secs(task):
    """Seconds a step from the chief's per-step lines, steps WARM..STEPS."""
    return bench_step_secs(task, WARM, STEPS)


def compute_alone():
    t = Task(0, [f"{BIN}/workerd", "--local", *MODEL, f"--train_steps={STEPS}"])
    if t.finish(300) != 0:
        raise RuntimeError("workerd --local failed:\n" + t.text()[-2000:])
    return step_secs(t)


def addr(i):
    return hosts("addr", f"host{i}")


def curl_json(host, url):
    r = subprocess.run([HOSTS_SH, f"--name={TAG}", "exec", f"host{host}", "curl", "-s", "--max-time", "5", url],
                       capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout else None


def ps_job(n, k, extra=(), slow=None):
    """Sync job, k ps on hosts 0..k-1, n workers on hosts MAX_PS..: (step secs, busiest shard's bytes)."""
    port = next(port_seq)
    ps = ",".join(f"{addr(i)}:{port}" for i in range(k))
    wk = ",".join(f"{addr(MAX_PS + i)}:{port}" for i in range(n))
    cluster = [f"--ps_hosts={ps}", f"--worker_hosts={wk}"]
    psd = [Task(i, [f"{BIN}/psd", "--job_name=ps", f"--task_index={i}", *cluster, "--logdir=",
                    "--worker_lease_secs=60"]) for i in range(k)]
    if slow is not None:
        hosts("rate", f"host{MAX_PS + slow}", "100mbit")
    workers = [Task(MAX_PS + i, [f"{BIN}/workerd", "--job_name=worker", f"--task_index={i}", *cluster, *MODEL,
                                 "--sync=1", f"--train_steps={STEPS}", *extra]) for i in reversed(range(n))][::-1]
    biggest = 0
    deadline = time.time() + 600
    while workers[0].p.poll() is None and time.time() < deadline:
        # the shards' bytes grow while the chief initializes them, then stay
        for i in range(k):
            s = curl_json(0, f"http://{addr(i)}:{port}/v1/status")
            if s:
                biggest = max(biggest, s["bytes"])
        time.sleep(0.2)
    try:
        for w in workers:
            if w.finish(120) != 0:
                raise RuntimeError("a worker failed:\n" + w.text()[-2000:])
        for p in psd:
            p.finish(30)
    finally:
        if slow is not None:
            hosts("rate", f"host{MAX_PS + slow}", RATE)
        for t in psd + workers:
            if t.p.poll() is None:
                t.p.kill()
    return step_secs(workers[0]), biggest


def ring_job(n):
    port = next(port_seq)
    wk = ",".join(f"{addr(MAX_PS + i)}:{port}" for i in range(n))
    workers = [Task(MAX_PS + i, [f"{BIN}/workerd", "--allreduce=ring", f"--task_index={i}", f"--worker_hosts={wk}",
                                 *MODEL, f"--train_steps={STEPS}", "--logdir=", "--save_checkpoint_secs=0"])
               for i in reversed(range(n))][::-1]
    for w in workers:
        if w.finish(600) != 0:
            raise RuntimeError("a ring worker failed:\n" + w.text()[-2000:])
    m = re.search(r"2\(N-1\)/N x (\d+) bytes", workers[0].text())
    return step_secs(workers[0]), int(m.group(1)) if m else None


def ring_alone(n, floats=16 << 20, steps=7, warmup=2):
    """The slower task's median all-reduce of `floats` floats over n tasks (secs)."""
    port = next(port_seq)
    wk = ",".join(f"{addr(MAX_PS + i)}:{port}" for i in range(n))
    tasks = [Task(MAX_PS + i, [f"{BIN}/ring_allreduce", f"--worker_hosts={wk}", f"--task_index={i}",
                               f"--floats={floats}", f"--steps={steps}", f"--warmup={warmup}"]) for i in range(n)]
    worst = 0.0
    for t in tasks:
        if t.finish(300) != 0:
            raise RuntimeError("ring_allreduce failed:\n" + t.text()[-2000:])
        m = re.search(r"median ([\d.]+) s over", t.text())
        if not m:
            raise RuntimeError("no median in:\n" + t.text()[-2000:])
        worst = max(worst, float(m.group(1)))
    return worst


def cpu_times():
    """(busy, total) jiffies of every core so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def busy_during(fn, *args, **kw):
    """fn's result and the share of the machine's cores busy while it ran (every process: the
    tasks, the kernel moving their bytes through veth, bridge and tbf, and whatever else runs)."""
    b0, t0 = cpu_times()
    out = fn(*args, **kw)
    b1, t1 = cpu_times()
    return out, (b1 - b0) / max(1, t1 - t0)


def ratio_cell(measured, model):
    r = measured / model
    return f"{measured * 1e3:.0f} ms ({1 / measured:.1f}/s), model {model * 1e3:.0f}: {r:.2f}x"


def main():
    if os.geteuid() != 0:
        print("bench/hosts.py: skipped: network namespaces need root (run make bench as root)")
        return 0
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    n_hosts = MAX_PS + max(NS)
    hosts("down", check=False)
    hosts("up", str(n_hosts), f"--rate={RATE}")
    try:
        return run_all()
    finally:
        hosts("down", check=False)


def run_all():
    c = compute_alone()
    print(f"hosts: compute alone (workerd --local, one host): {c * 1e3:.1f} ms a step", flush=True)
    rows = []
    m_full = None
    for n in NS:
        row = {"n": n}
        for k in (1, 2, 4):
            (t, mk), busy = busy_during(ps_job, n, k)
            if k == 1:
                m_full = mk
            model = 2 * max(n * mk, m_full or mk) / R + c
            row[f"ps{k}"] = (t, model, busy)
            print(f"hosts: N={n} ps={k}: {ratio_cell(t, model)} (busiest shard {mk / 1e6:.2f} MB; "
                  f"cores {busy * 100:.0f}% busy)", flush=True)
        (t, m_ring), busy = busy_during(ring_job, n)
        m_ring = m_ring or m_full
        model = 2 * (n - 1) / n * m_ring / R + c
        row["ring"] = (t, model, busy)
        print(f"hosts: N={n} ring: {ratio_cell(t, model)} (cores {busy * 100:.0f}% busy)", flush=True)
        rows.append(row)

    lines = [f"Sync training of mlp:1024,1024 (M = {m_full / 1e6:.2f} MB), batch 16, SGD, each task its own "
             f"host with a 1 Gbit/s NIC (tbf), {os.cpu_count()} cores shared by every task; step time over "
             f"steps {WARM}..{STEPS}; model = bytes on the busiest link (ps or worker) / 125 MB/s + compute alone "
             f"({c * 1e3:.1f} ms); cores: how busy the machine's cores were during the job (startup included).", "",
             "| N workers | 1 ps | 2 ps shards | 4 ps shards | ring |", "|---|---|---|---|---|"]
    worst = 0.0
    for row in rows:
        cells = []
        for key in ("ps1", "ps2", "ps4", "ring"):
            t, model, busy = row[key]
            cells.append(f"{ratio_cell(t, model)}; cores {busy * 100:.0f}%")
            if row["n"] > 1:
                worst = max(worst, abs(t / model - 1))
        lines.append(f"| {row['n']} | " + " | ".join(cells) + " |")
    # a ring of one moves nothing (it is local training): the crossover counts from N = 2
    cross = [r["n"] for r in rows if r["n"] > 1 and r["ring"][0] < r["ps1"][0]]
    lines += ["", f"The ring is faster than 1 ps from N = {cross[0]} workers on." if cross else
              "The ring was not faster than 1 ps at any N >= 2 here."]
    for row in rows:
        n = row["n"]
        if n == 1:
            continue
        keep = [k for k in (1, 2, 4) if row[f"ps{k}"][0] <= row["ring"][0] * 1.1]
        best = min((row[f"ps{k}"][0], k) for k in (1, 2, 4))
        lines.append(f"- N = {n}: " + (f"{keep[0]} ps shard{'s' if keep[0] > 1 else ''} keep within 10% of the ring"
                                      if keep else f"no shard count here keeps up with the ring; the best, "
                                      f"{best[1]} shards, takes {best[0] / row['ring'][0]:.2f}x its step"))
    lines += [f"Largest distance from the model (N >= 2): {worst * 100:.0f}% (target: within 25%).",
              "With every NIC at the same rate, k >= N shards bring a ps job down to its workers' own links "
              "(2 M / R a step: a pull in, then a push out), still N/(N-1) times the ring's 2 (N-1)/N M / R, "
              "which sends and receives at once."]

    # one slow NIC among 4 workers
    if 4 in NS:
        fast, _ = ps_job(4, 1)
        slow_all, _ = ps_job(4, 1, slow=3)
        slow_backup, _ = ps_job(4, 1, extra=("--replicas_to_aggregate=3",), slow=3)
        lines += ["", "One worker's NIC at 100 Mbit/s, the others' at 1 Gbit/s (4 workers, 1 ps):",
                  f"- all fast: {1 / fast:.2f} steps/s",
                  f"- one slow, every step waits for it: {1 / slow_all:.2f} steps/s = {fast / slow_all:.2f}x the "
                  f"all-fast rate",
                  f"- one slow, --replicas_to_aggregate=3 (a backup worker): {1 / slow_backup:.2f} steps/s "
                  f"= {fast / slow_backup:.2f}x the all-fast rate (target >= 0.8x)"]
    lines += ["", "The ring's all-reduce of 64 MiB alone (bin/ring_allreduce, median of 5 after 2, the slower task), "
              "against its bytes' time 2 (N-1)/N x 64 MiB / 125 MB/s (target <= 1.6x):"]
    for n in (2, 4):
        if n > max(NS):
            continue
        (t, busy) = busy_during(ring_alone, n)
        limit = 2 * (n - 1) / n * (64 << 20) / R
        lines.append(f"- N = {n}: {t * 1e3:.0f} ms, bytes' time {limit * 1e3:.0f} ms: {t / limit:.2f}x "
                     f"({'PASS' if t / limit <= 1.6 else 'BELOW'}; cores {busy * 100:.0f}% busy)")
    text = "\n".join(lines)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "hosts.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
