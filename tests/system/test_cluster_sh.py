"""deploy/local/cluster.sh, the launcher `make demo` uses: a whole cluster on
this machine, every log in one folder, a clean stop at the end and on a signal."""
import os
import re
import signal
import subprocess
import time

from conftest import BIN, ROOT, SANITIZER_MARKS

SCRIPT = os.path.join(ROOT, "deploy", "local", "cluster.sh")
SMALL = ["--hidden_units=16", "--batch_size=50", "--log_every=0"]


def launched(logdir):
    """name -> (pid, url) from the 'cluster' file the launcher writes."""
    out = {}
    with open(os.path.join(logdir, "cluster")) as f:
        for line in f:
            name, pid, url = line.split()
            out[name] = (int(pid), url)
    return out


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_ps_three_sync_workers_train_and_everything_stops(tmp_path):
    logdir = tmp_path / "logs"
    r = subprocess.run(["sh", SCRIPT, "--ps", "2", "--workers", "3", "--sync", "--bin", BIN,
                        "--logdir", str(logdir), "--"] + SMALL + ["--train_steps=200"],
                       capture_output=True, timeout=300)
    out = r.stdout.decode()
    assert r.returncode == 0, out[-3000:] + r.stderr.decode()[-2000:]
    procs = launched(logdir)
    assert set(procs) == {"ps0", "ps1", "worker0", "worker1", "worker2"}
    for name, (pid, _) in procs.items():
        assert not running(pid), f"{name} ({pid}) still running after the launcher ended"
        log = (logdir / f"{name}.log").read_text(errors="replace")
        assert not any(m in log for m in SANITIZER_MARKS), log[-3000:]
    # the chief's lines were shown here; the ps ran sync with all 3 workers and both saved
    assert "training done at global step 200" in out, out[-2000:]
    for i in (0, 1):
        assert "sync, replicas_to_aggregate 3 of 3 workers" in (logdir / f"ps{i}.log").read_text()
        assert list((logdir / f"ps-{i}").glob("model.ckpt-200.safetensors")), os.listdir(logdir / f"ps-{i}")
    # both ps tasks hold variables: the model was split across them
    assert "created 4 variables" in out and "on 2 ps" in out
    urls = [l.split()[1] for l in out.splitlines() if l.strip().startswith("curl http")]
    assert urls and urls[0].startswith(procs["ps0"][1])


def test_sigterm_stops_every_process_it_started(tmp_path):
    logdir = tmp_path / "logs"
    p = subprocess.Popen(["sh", SCRIPT, "--workers", "2", "--evaluator", "--bin", BIN,
                          "--logdir", str(logdir), "--"] + SMALL + ["--train_steps=100000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = b""
    deadline = time.time() + 60
    while b"training async" not in seen and time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen += line
    assert b"training async" in seen, seen.decode()
    procs = launched(logdir)
    assert set(procs) == {"ps0", "worker0", "worker1", "evaluator"}
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    rest, _ = p.communicate(timeout=60)
    took = time.time() - t0
    assert p.returncode == 130, (seen + rest).decode()[-2000:]
    assert b"stopping everything" in rest
    for name, (pid, _) in procs.items():
        assert not running(pid), f"{name} ({pid}) left behind"
    # a clean stop: psd saved its final checkpoint, the workers left
    assert "saved global step" in (logdir / "ps0.log").read_text()
    print(f"SIGTERM to the launcher: all {len(procs)} processes stopped in {took:.1f} s")


def test_bad_options_say_what_is_wrong_and_help_lists_every_option():
    for argv, words in ((["--ps", "0"], "--ps must be a whole number >= 1, not '0'"),
                        (["--workers", "two"], "--workers must be a whole number >= 1, not 'two'"),
                        (["--frobnicate"], "unknown option '--frobnicate'"),
                        (["--bin", "/nonexistent"], "/nonexistent/psd not found")):
        r = subprocess.run(["sh", SCRIPT] + argv, capture_output=True, timeout=30)
        assert r.returncode == 2, (argv, r.stderr)
        assert words in r.stderr.decode(), (argv, r.stderr)
    r = subprocess.run(["sh", SCRIPT, "--help"], capture_output=True, timeout=30)
    assert r.returncode == 0
    helptext = r.stdout.decode()
    # every option the script parses is in --help, and every option in --help is parsed
    src = open(SCRIPT).read()
    parsed = set(re.findall(r"^\s+(--[a-z_]+)[)=|]", src, re.M))
    shown = set(re.findall(r"^\s+(--[a-z_]+)", helptext, re.M))
    assert parsed == shown, (parsed ^ shown)
