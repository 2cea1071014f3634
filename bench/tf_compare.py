"""make bench, part 4 (issue 24): restps beside TensorFlow itself.

TensorFlow's distributed MNIST example (bench/tf_distributed.py: ClusterSpec,
Server, replica_device_setter, Supervisor, SyncReplicasOptimizer; compat.v1,
graph mode) and restps (psd + workerd) train the same model on the same data
with the same optimizer and batch: 784-100-10, Adam 0.01, batch 100 per
worker, Fashion-MNIST, 1 ps + 2 workers on 127.0.0.1, async and sync, one
intra/inter-op (BLAS) thread per process. For each side, mode and seed:

- steps/s: global steps from the first update to the chief's end; examples/s
  = steps/s x batch x (2 in sync: one update averages both workers' batches);
- first-step latency: from starting the ps to the first update (restps: psd's
  /v1/status polled every 20 ms; TensorFlow: the chief's first run that sees
  global_step >= 1);
- the chief's final test accuracy (mean, sample sd, min-max over the seeds);
- the ps's peak RSS (VmHWM of the ps process at the end).

Then, in sync mode, two failures: worker 1 killed (SIGKILL) mid-run, and the
ps killed (SIGKILL) and started again on the same port and logdir (checkpoints
every second on both sides). Every process is started here and stopped by its
PID. Prints one table with restps/TF ratios and PASS/BELOW per target, and
writes it to bench/out/tf_compare.md. Exit status non-zero only when
something broke, never for a figure.

Run with the bench venv's python (build/bench-venv, tensorflow-cpu from
bench/requirements.txt). Environment: TFCMP_SEEDS (default "1 2 3"),
TFCMP_STEPS (global steps per run, default 2000), TFCMP_KILL_STEPS (default
1500), TFCMP_HANG_SECS (seconds without a step that count as a hang, default
30), RESTPS_BIN_DIR (default bin)."""
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from benchlib import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
TFPROG = os.path.join(ROOT, "bench", "tf_distributed.py")
DATA = "/usr/share/datasets/fashion-mnist"
SEEDS = [int(s) for s in os.environ.get("TFCMP_SEEDS", "1 2 3").split()]
STEPS = int(os.environ.get("TFCMP_STEPS", "2000"))
KILL_STEPS = int(os.environ.get("TFCMP_KILL_STEPS", "1500"))
HANG = float(os.environ.get("TFCMP_HANG_SECS", "30"))
LEASE = 5        # psd --worker_lease_secs in the worker-kill run
BATCH = 100
LOG_EVERY = 50
RUN_TIMEOUT = 600


class Proc:
    """A process whose stdout lines are kept with their arrival times; stderr to a file."""

    def __init__(self, argv, name, tmp, env=None):
        self.name = name
        self.err_path = os.path.join(tmp, name.replace(" ", "_") + ".err")
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        self.lines = []
        self.cv = threading.Condition()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            with self.cv:
                self.lines.append((time.monotonic(), line.rstrip()))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait_line(self, pred, timeout):
        """(time, line) of the first line for which pred holds, else None at timeout or exit."""
        end = time.monotonic() + timeout
        i = 0
        with self.cv:
            while True:
                while i < len(self.lines):
                    if pred(self.lines[i][1]):
                        return self.lines[i]
                    i += 1
                left = end - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self.t.is_alive()):
                    return None
                self.cv.wait(min(left, 0.5))

    def find(self, pred):
        return next(((t, l) for t, l in list(self.lines) if pred(l)), None)

    def last(self, pred):
        return next(((t, l) for t, l in reversed(list(self.lines)) if pred(l)), None)

    def peak_rss_mib(self):
        try:
            with open(f"/proc/{self.p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stderr_tail(self, n=3, pred=None):
        self.err.flush()
        with open(self.err_path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip() and (pred is None or pred(l))]
        return lines[-n:]

    def stop(self, sig=signal.SIGTERM):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.t.join(timeout=5)
        self.err.close()


# ---- the two sides: how to start a cluster, and what their lines say ---------------

class Restps:
    label = "restps"

    def __init__(self, sync, seed, steps, tmp, logdir="", lease=10):
        self.sync, self.tmp, self.logdir, self.lease = sync, tmp, logdir, lease
        self.port = free_port()
        workers = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
        self.common = [f"--ps_hosts=127.0.0.1:{self.port}", f"--worker_hosts={workers}", f"--data_dir={DATA}",
                       "--hidden_units=100", "--optimizer=adam", "--learning_rate=0.01",
                       f"--batch_size={BATCH}", f"--train_steps={steps}", f"--sync={1 if sync else 0}",
                       f"--seed={seed}", f"--log_every={LOG_EVERY}", "--threads=1", "--keep_ps"]

    def start_ps(self, n=0):
        argv = [os.path.join(BIN, "psd"), f"--ps_hosts=127.0.0.1:{self.port}", "--task_index=0",
                f"--logdir={self.logdir}", f"--worker_lease_secs={self.lease}"]
        if self.logdir:
            argv.append("--save_checkpoint_secs=1")
        self.ps = Proc(argv, f"restps-ps-{n}", self.tmp)
        if not self.ps.wait_line(lambda l: l.startswith("psd: listening on"), 30):
            raise RuntimeError(f"psd did not start: {self.ps.stderr_tail(5)}")
        return self.ps

    def start_worker(self, i, n=0):
        return Proc([os.path.join(BIN, "workerd"), f"--task_index={i}"] + self.common,
                    f"restps-worker-{i}-{n}", self.tmp)

    def wait_first_update(self, t0, timeout=120):
        url = f"http://127.0.0.1:{self.port}/v1/status"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if json.load(r).get("global_step", 0) >= 1:
                        return time.monotonic() - t0
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        return None

    @staticmethod
    def is_end(l):
        return " finished after " in l

    @staticmethod
    def step_of(l):
        """global step in a progress line, else None."""
        if "(global step " in l:
            return int(l.split("(global step ", 1)[1].split(")", 1)[0])
        return None


class TF:
    label = "TensorFlow"

    def __init__(self, sync, seed, steps, tmp, logdir=""):
        self.sync, self.tmp, self.logdir = sync, tmp, logdir
        self.port = free_port()
        workers = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
        self.common = [f"--ps_hosts=127.0.0.1:{self.port}", f"--worker_hosts={workers}", f"--data_dir={DATA}",
                       "--hidden_units=100", "--learning_rate=0.01", f"--batch_size={BATCH}",
                       f"--train_steps={steps}", f"--issync={1 if sync else 0}", f"--seed={seed}",
                       f"--log_every={LOG_EVERY}", "--threads=1", f"--logdir={logdir}", "--save_model_secs=1"]

    def start_ps(self, n=0):
        self.ps = Proc([sys.executable, TFPROG, "--job_name=ps", "--task_index=0"] + self.common,
                       f"tf-ps-{n}", self.tmp)
        return self.ps

    def start_worker(self, i, n=0):
        self.first_line = None
        return Proc([sys.executable, TFPROG, "--job_name=worker", f"--task_index={i}"] + self.common,
                    f"tf-worker-{i}-{n}", self.tmp)

    @staticmethod
    def is_end(l):
        return ": finished at global step " in l

    @staticmethod
    def step_of(l):
        if ": global step " in l:
            return int(l.rsplit("global step ", 1)[1])
        return None


def tf_error(proc):
    """The exception a TensorFlow process died of, with the line after it."""
    lines = proc.stderr_tail(400)
    for k in range(len(lines) - 1, -1, -1):
        if "errors_impl." in lines[k] and "Error" in lines[k]:
            cls = lines[k].split("errors_impl.", 1)[1].split(":", 1)[0]
            more = next((l.strip() for l in lines[k + 1:]
                         if l.strip() and not l.startswith("=") and not l.rstrip().endswith(":")), "")
            return f"{cls}: {more}"[:80]
    return "no error message"


def accuracy_of(proc):
    got = proc.last(lambda l: "test accuracy" in l)
    return float(got[1].rsplit("test accuracy", 1)[1].strip()) if got else None


# ---- one training run: speed, first-step latency, accuracy, ps RSS ---------------------

def train_run(side_cls, sync, seed, tmp):
    side = side_cls(sync, seed, STEPS, tmp)
    t0 = time.monotonic()
    ps = side.start_ps()
    workers = [side.start_worker(1), side.start_worker(0)]
    chief = workers[1]
    procs = [ps] + workers
    try:
        if side_cls is Restps:
            first = side.wait_first_update(t0)
            t_first = t0 + first if first is not None else None
        else:
            got = chief.wait_line(lambda l: "first update" in l, 180)
            t_first = got[0] if got else None
            first = t_first - t0 if got else None
        end = chief.wait_line(side.is_end, RUN_TIMEOUT)
        chief.wait_line(lambda l: "test accuracy" in l, 60)
        if end is None or t_first is None:
            raise RuntimeError(f"{side.label} {'sync' if sync else 'async'} seed {seed}: no end; chief's "
                               f"stderr: {chief.stderr_tail(5)}")
        rate = (STEPS - 1) / (end[0] - t_first)
        info = [l for _, l in chief.lines[:4] if "OpenBLAS" in l or "TensorFlow" in l]
        return dict(rate=rate, first=first, acc=accuracy_of(chief), rss=ps.peak_rss_mib(), info=info)
    finally:
        workers[0].wait_line(side.is_end, 10)
        for p in procs:
            p.stop()


# ---- failures, sync mode ------------------------------------------------------------------

def progress(procs, side):
    """[(time, global step)] from every worker's progress lines, in time order."""
    pts = []
    for p in procs:
        for t, l in list(p.lines):
            s = side.step_of(l)
            if s is not None:
                pts.append((t, s))
    return sorted(pts)


def wait_step(procs, side, step, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pts = progress(procs, side)
        if pts and pts[-1][1] >= step:
            return True
        time.sleep(0.05)
    return False


def after(procs, side, t_kill, secs):
    """Watch for secs after t_kill: (highest step before, highest step after,
    seconds from the kill to the first higher step or None)."""
    end = t_kill + secs
    while time.monotonic() < end:
        if any(side.is_end(l) for p in procs for _, l in list(p.lines)):
            break
        time.sleep(0.2)
    pts = progress(procs, side)
    before = max((s for t, s in pts if t <= t_kill), default=0)
    later = [(t, s) for t, s in pts if t > t_kill and s > before]
    return before, max((s for _, s in later), default=before), (later[0][0] - t_kill) if later else None


def kill_worker(side_cls, tmp):
    """Sync, 2 workers; worker 1 SIGKILLed at about a third of the run."""
    kw = dict(lease=LEASE) if side_cls is Restps else {}
    side = side_cls(True, 1, KILL_STEPS, tmp, **kw)
    ps = side.start_ps(1)
    w1, w0 = side.start_worker(1, 1), side.start_worker(0, 1)
    procs = [ps, w1, w0]
    try:
        if not wait_step([w0, w1], side, KILL_STEPS // 3, RUN_TIMEOUT):
            return f"did not reach step {KILL_STEPS // 3}"
        w1.p.kill()
        t_kill = time.monotonic()
        before, later, stall = after([w0], side, t_kill, HANG)
        if stall is None:
            return f"hangs: global step {before} when worker 1 died, no step in the {HANG:.0f} s after"
        end = w0.wait_line(side.is_end, RUN_TIMEOUT)
        if end:
            return (f"moves on: {stall:.1f} s without a step after the kill (lease {LEASE} s), "
                    f"then worker 0 alone to step {KILL_STEPS} ({end[0] - t_kill:.0f} s after the kill)")
        return f"stalled {stall:.1f} s, then step {later} but did not finish"
    finally:
        for p in procs:
            p.stop()


def wait_checkpoint(logdir, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for _, _, files in os.walk(logdir):
            if any(f.startswith("model.ckpt-") and not f.endswith(".tmp") for f in files):
                return True
        time.sleep(0.05)
    return False


def kill_ps(side_cls, tmp):
    """Sync, 2 workers, checkpoints every second; the ps SIGKILLed at about a
    third of the run, once a checkpoint exists, and started again 1 s later on
    the same port and logdir."""
    logdir = tempfile.mkdtemp(dir=tmp, prefix="logdir-")
    side = side_cls(True, 1, KILL_STEPS, tmp, logdir=logdir)
    ps = side.start_ps(2)
    w1, w0 = side.start_worker(1, 2), side.start_worker(0, 2)
    procs = [ps, w1, w0]
    try:
        if not wait_step([w0, w1], side, KILL_STEPS // 3, RUN_TIMEOUT):
            return f"did not reach step {KILL_STEPS // 3}", None
        if not wait_checkpoint(logdir, 30):
            return "no checkpoint in 30 s", None
        ps.p.kill()
        t_kill = time.monotonic()
        time.sleep(1)
        ps2 = side.start_ps(3)
        procs.append(ps2)
        before, later, stall = after([w0, w1], side, t_kill, HANG)
        if side_cls is Restps:
            restored = ps2.stderr_tail(1, lambda l: "restor" in l)
            end = w0.wait_line(side.is_end, RUN_TIMEOUT)
            w0.wait_line(lambda l: "test accuracy" in l, 30)
            if end and stall is not None:
                rs = (restored[0].split("restored ", 1)[-1].rsplit("/", 1)[-1].split(",")[0]
                      if restored else "no restore line")
                return (f"recovers: killed near global step {before}, back 1 s later, restored {rs}; "
                        f"the workers retried and went on "
                        f"{stall:.1f} s after the kill, to step {KILL_STEPS}, test accuracy "
                        f"{accuracy_of(w0)}"), True
            return f"did not recover: step {before} at the kill, {later} {HANG:.0f} s later", False
        # TensorFlow
        states = []
        for p in (w1, w0):
            i = p.name.split("-")[2]
            if p.p.poll() is None:
                states.append(f"worker {i} blocked")
            else:
                states.append(f"worker {i} exit {p.p.returncode} ({tf_error(p)})")
        what = f"{', '.join(states)}; global step {before} at the kill, {later} {HANG:.0f} s later"
        if later > before:
            return f"{what}; training went on to step {later}", True
        # What a TensorFlow operator does: start the workers again; the chief's
        # Supervisor restores the newest checkpoint in its logdir.
        for p in (w0, w1):
            p.stop(signal.SIGKILL)
        t_re = time.monotonic()
        w1b, w0b = side.start_worker(1, 3), side.start_worker(0, 3)
        procs += [w1b, w0b]
        ready = w0b.wait_line(lambda l: "session ready at global step" in l, 120)
        end = w0b.wait_line(side.is_end, RUN_TIMEOUT)
        if ready and end:
            return (f"{what}; it went on only when both workers were started again by hand: the chief "
                    f"restored global step {ready[1].rsplit(' ', 1)[1]} from its logdir and finished "
                    f"{end[0] - t_re:.0f} s later"), False
        return f"{what}; restarting the workers did not finish: {w0b.stderr_tail(2)}", False
    finally:
        for p in procs:
            p.stop()


# ---- the table --------------------------------------------------------------------------

def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan"), float("nan"), float("nan")
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return statistics.mean(xs), sd, min(xs), max(xs)


def tf_build_info():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    r = subprocess.run([sys.executable, "-c", "import tensorflow as tf; print('TensorFlow', tf.__version__)"],
                       capture_output=True, text=True, env=env, timeout=120)
    keep = [l.split("] ", 1)[-1].strip() for l in (r.stdout + r.stderr).splitlines()
            if "oneDNN" in l or "instructions" in l or l.startswith("TensorFlow")]
    return [l for l in keep if l]


def main():
    for f in ("psd", "workerd"):
        if not os.access(os.path.join(BIN, f), os.X_OK):
            print(f"bench-tf: {BIN}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if importlib.util.find_spec("tensorflow") is None:
        print(f"bench-tf: {sys.executable} has no tensorflow (make bench installs bench/requirements.txt "
              "into build/bench-venv)", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="restps-tfcmp-")
    t_all = time.monotonic()
    kernel = platform.release()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"== restps vs TensorFlow: 784-100-10, Adam 0.01, batch {BATCH} per worker, 1 ps + 2 workers "
          f"on 127.0.0.1, {STEPS} global steps, seeds {SEEDS}; {os.cpu_count()} cores ({cpu}), "
          f"Linux {kernel}, OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    for l in tf_build_info():
        print(f"TensorFlow build: {l}")
    res = {}
    info = {}
    for seed in SEEDS:
        for sync in (False, True):
            for side in (Restps, TF):
                r = train_run(side, sync, seed, tmp)
                res.setdefault((side.label, sync), []).append(r)
                for l in r["info"]:
                    info.setdefault(side.label, l)
                print(f"seed {seed} {'sync ' if sync else 'async'} {side.label:10s} {r['rate']:7.1f} steps/s  "
                      f"first update {r['first']:5.2f} s  test accuracy {r['acc']}  ps peak RSS "
                      f"{r['rss']:.0f} MiB", flush=True)
    for label, l in info.items():
        print(f"{label} uses: {l}")
    kills = {}
    for side in (Restps, TF):
        kills[(side.label, "worker")] = kill_worker(side, tmp)
        print(f"sync, worker 1 killed, {side.label}: {kills[(side.label, 'worker')]}", flush=True)
        kills[(side.label, "ps")] = kill_ps(side, tmp)
        print(f"sync, ps killed and restarted, {side.label}: {kills[(side.label, 'ps')][0]}", flush=True)

    def med(label, sync, key):
        return statistics.median(r[key] for r in res[(label, sync)])

    rows = ["| | restps | TensorFlow | restps/TF |", "|---|---|---|---|"]
    verdicts = []
    for sync in (False, True):
        m = "sync" if sync else "async"
        per = 2 if sync else 1
        rr, rt = med("restps", sync, "rate"), med("TensorFlow", sync, "rate")
        rows.append(f"| {m}: steps/s (median of {len(SEEDS)}) | {rr:.0f} | {rt:.0f} | {rr / rt:.2f} |")
        rows.append(f"| {m}: examples/s | {rr * BATCH * per:,.0f} | {rt * BATCH * per:,.0f} | {rr / rt:.2f} |")
        fr, ft = med("restps", sync, "first"), med("TensorFlow", sync, "first")
        rows.append(f"| {m}: first-step latency, s (median) | {fr:.2f} | {ft:.2f} | {fr / ft:.2f} |")
        ar = stats([r["acc"] for r in res[("restps", sync)]])
        at = stats([r["acc"] for r in res[("TensorFlow", sync)]])
        rows.append(f"| {m}: test accuracy, mean ± sd (min-max) | {ar[0]:.4f} ± {ar[1]:.4f} "
                    f"({ar[2]:.4f}-{ar[3]:.4f}) | {at[0]:.4f} ± {at[1]:.4f} ({at[2]:.4f}-{at[3]:.4f}) | "
                    f"{ar[0] / at[0]:.3f} |")
        sr, st = med("restps", sync, "rss"), med("TensorFlow", sync, "rss")
        rows.append(f"| {m}: ps peak RSS, MiB | {sr:.0f} | {st:.0f} | {sr / st:.2f} |")
        verdicts.append(f"restps >= 2x TensorFlow's steps/s, {m}: {rr / rt:.2f}x "
                        f"{'PASS' if rr >= 2 * rt else 'BELOW'}")
        spread = max(ar[3] - ar[2], at[3] - at[2])
        verdicts.append(f"accuracy equal within the seed-to-seed spread, {m}: |{ar[0]:.4f} - {at[0]:.4f}| = "
                        f"{abs(ar[0] - at[0]):.4f} vs the wider min-max range {spread:.4f} "
                        f"{'PASS' if abs(ar[0] - at[0]) <= spread else 'BELOW'}")
    rows.append(f"| sync, worker 1 killed mid-run | {kills[('restps', 'worker')]} | "
                f"{kills[('TensorFlow', 'worker')]} | |")
    rows.append(f"| sync, ps killed and restarted | {kills[('restps', 'ps')][0]} | "
                f"{kills[('TensorFlow', 'ps')][0]} | |")
    rec = kills[("restps", "worker")].startswith("moves on") and kills[("restps", "ps")][1]
    verdicts.append(f"restps recovers from both kills: {'PASS' if rec else 'BELOW'}; TensorFlow: worker kill "
                    f"{'hangs' if kills[('TensorFlow', 'worker')].startswith('hangs') else 'does not hang'}, "
                    f"ps kill {'recovers by itself' if kills[('TensorFlow', 'ps')][1] else 'needs the workers restarted'}")
    table = "\n".join(rows)
    print()
    print(table)
    print()
    for label, l in info.items():
        print(f"- {label}: {l}")
    for v in verdicts:
        print(f"- {v}")
    secs = time.monotonic() - t_all
    print(f"(bench-tf: {secs / 60:.1f} min; {os.cpu_count()} cores shared by 3 processes per run: "
          "compare the ratios, measured in the same run)")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "tf_compare.md"), "w") as f:
        f.write(f"# restps vs TensorFlow, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores ({cpu}), "
                f"Linux {kernel}, {STEPS} steps, seeds {SEEDS}\n\n{table}\n\n")
        for label, l in info.items():
            f.write(f"- {label}: {l}\n")
        for l in tf_build_info():
            f.write(f"- TensorFlow build: {l}\n")
        for v in verdicts:
            f.write(f"- {v}\n")
    subprocess.run(["rm", "-rf", tmp], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
