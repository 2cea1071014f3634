"""make bench, part 3 (issue 4): how training modes and push/pull scale.

1. steps/s and seconds to reach a test accuracy target for async, sync, sync
   with one backup worker and stale-synchronous (staleness 3), with 1, 2 and 4
   workers and 1 and 2 ps tasks, on loopback (the example's 784-100-10 model,
   Adam 0.003, batch 100); an evaluator reports the accuracy every 0.25 s.
2. one step's push + pull time (bench_pushpull: every shard at once) for
   models of 1 to 256 MiB with 1 and 2 ps tasks, and whether it grows
   linearly with the bytes.
Writes bench/out/scale.md (markdown tables) and bench/out/scale.png (gnuplot,
when installed), and prints the tables. Everything runs on this machine's
cores: with 4 workers + ps + evaluator on 2 cores, the rates say as much about
the CPU as about the protocol (the table says how many cores there were)."""
import os
import shutil
import subprocess
import sys

from benchlib import Lines, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "bin")
DATA = "/usr/share/datasets/fashion-mnist"
OUT = os.path.join(ROOT, "bench", "out")
TARGET = 0.80
STEPS = int(os.environ.get("SCALE_STEPS", "1500"))


def run(mode, n_workers, n_ps):
    ps_ports = [free_port() for _ in range(n_ps)]
    ps = ",".join(f"127.0.0.1:{p}" for p in ps_ports)
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_workers))
    psds = [subprocess.Popen([f"{BIN}/psd", f"--ps_hosts={ps}", f"--task_index={i}", "--logdir="],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n_ps)]
    args = [f"--ps_hosts={ps}", f"--worker_hosts={workers}", f"--data_dir={DATA}",
            "--hidden_units=100", "--optimizer=adam", "--learning_rate=0.003", "--batch_size=100",
            f"--train_steps={STEPS}", "--log_every=0", "--seed=1"]
    if mode == "async":
        args.append("--sync=0")
    elif mode == "sync":
        args.append("--sync=1")
    elif mode == "sync+backup":
        args += ["--sync=1", f"--replicas_to_aggregate={n_workers - 1}"]
    elif mode == "staleness 3":
        args += ["--sync=0", "--staleness=3"]
    ev = Lines([f"{BIN}/workerd", "--job_name=evaluator", "--eval_secs=0.25"] + args)
    procs = [Lines([f"{BIN}/workerd", f"--task_index={i}"] + args) for i in range(n_workers - 1, -1, -1)]
    for p in procs + [ev]:
        p.p.wait(timeout=600)
        p.t.join(timeout=10)
    for p in psds:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    chief = procs[-1].lines
    t_start = next((t for t, l in chief if ": training " in l), None)
    t_end = next((t for t, l in chief if " finished after " in l), None)
    acc = next((float(l.rsplit("test accuracy", 1)[1]) for t, l in chief if "test accuracy" in l), None)
    reach = None
    for t, l in ev.lines:
        if "test accuracy" in l and "global step" in l and float(l.rsplit("test accuracy", 1)[1]) >= TARGET:
            reach = t - t_start if t_start else None
            break
    rate = STEPS / (t_end - t_start) if t_start and t_end else float("nan")
    return rate, reach, acc


def pushpull(mib, n_ps):
    ports = [free_port() for _ in range(n_ps)]
    ps = ",".join(f"127.0.0.1:{p}" for p in ports)
    psds = [subprocess.Popen([f"{BIN}/psd", f"--ps_hosts={ps}", f"--task_index={i}", "--logdir="],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for i in range(n_ps)]
    for p in psds:
        p.stdout.readline()
    reps = 9 if mib <= 64 else 5
    r = subprocess.run([f"{BIN}/bench_pushpull", f"--hosts={ps}", f"--mib={mib}", f"--reps={reps}"],
                       capture_output=True, text=True)
    for p in psds:
        p.terminate()
        p.wait()
    if r.returncode != 0:
        return None
    n, m, push, pull, gbs = r.stdout.split()
    return float(push), float(pull), float(gbs)


def main():
    os.makedirs(OUT, exist_ok=True)
    cores = os.cpu_count()
    md = [f"# restps scaling on this machine ({cores} cores, loopback; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')})", "",
          f"## Training modes: 784-100-10, Adam 0.003, batch 100 per worker, {STEPS} global steps",
          "", f"| mode | workers | ps | steps/s | s to test accuracy {TARGET} | final accuracy |",
          "|---|---|---|---|---|---|"]
    print("\n".join(md[-5:]))
    for mode in ("async", "sync", "sync+backup", "staleness 3"):
        for nw in (1, 2, 4):
            if mode == "sync+backup" and nw < 2:
                continue
            for nps in (1, 2):
                rate, reach, acc = run(mode, nw, nps)
                row = (f"| {mode} | {nw} | {nps} | {rate:.0f} | "
                       f"{'%.1f' % reach if reach is not None else 'not reached'} | "
                       f"{'%.4f' % acc if acc is not None else '-'} |")
                md.append(row)
                print(row, flush=True)
    md += ["", "## One step's push + pull (every shard at once), by model size", "",
           "| MiB | ps | push ms | pull ms | GB/s (both ways) | ms per MiB (push+pull) |",
           "|---|---|---|---|---|---|"]
    print("\n".join(md[-5:]))
    series = {1: [], 2: []}
    for nps in (1, 2):
        for mib in (1, 4, 16, 64, 256):
            got = pushpull(mib, nps)
            if not got:
                md.append(f"| {mib} | {nps} | failed | | | |")
                continue
            push, pull, gbs = got
            series[nps].append((mib, push + pull))
            row = f"| {mib} | {nps} | {push:.2f} | {pull:.2f} | {gbs:.2f} | {(push + pull) / mib:.2f} |"
            md.append(row)
            print(row, flush=True)
    notes = ["", "Linearity: ms per MiB against the 64 MiB figure of the same row set "
             "(within 30% counts as linear):"]
    for nps, pts in series.items():
        ref = dict(pts).get(64)
        for mib, ms in pts:
            if ref:
                ratio = (ms / mib) / (ref / 64)
                if abs(ratio - 1) > 0.3:
                    notes.append(f"- {nps} ps, {mib} MiB: {ratio:.2f}x the 64 MiB cost per MiB "
                                 f"({'fixed per-request costs dominate' if mib < 64 else 'memory/page faults grow'})")
    if len(notes) == 2:
        notes.append("- every size within 30%: linear")
    md += notes
    print("\n".join(notes))
    with open(os.path.join(OUT, "scale.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    if shutil.which("gnuplot"):
        dat = os.path.join(OUT, "scale.dat")
        with open(dat, "w") as f:
            for nps, pts in series.items():
                for mib, ms in pts:
                    f.write(f"{mib} {ms}\n")
                f.write("\n\n")
        script = (f"set terminal png size 800,500; set output '{OUT}/scale.png'; set logscale xy; "
                  "set xlabel 'model MiB'; set ylabel 'push + pull ms'; set key left; "
                  f"plot '{dat}' index 0 with linespoints title '1 ps', "
                  f"'{dat}' index 1 with linespoints title '2 ps', x*{series[1][0][1] if series[1] else 1} "
                  "title 'linear' dashtype 2")
        subprocess.run(["gnuplot", "-e", script], check=False)
        print(f"bench: wrote {OUT}/scale.md and {OUT}/scale.png")
    else:
        print(f"bench: wrote {OUT}/scale.md (gnuplot is missing: no plot; make deps installs gnuplot-nox)")


if __name__ == "__main__":
    sys.exit(main())
