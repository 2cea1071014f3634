"""Many hosts on one machine for the system tests: deploy/netns/hosts.sh makes
N network namespaces on one bridge (host0.., each its own address and a NIC
shaped by tbf), and a HostBed starts psd and workerd on them unchanged
(`hosts.sh exec`), cuts, restores and slows their links, and reads their
logs. Every test's set has a name of its own (xdist runs tests side by side);
`with HostBed(...)` removes the set and stops every process it started, by
PID, also when the test fails. refused() says why a machine cannot make them."""
import itertools
import json
import os
import shutil
import subprocess
import time

from conftest import ROOT, SANITIZER_MARKS

HOSTS_SH = os.path.join(ROOT, "deploy", "netns", "hosts.sh")
_seq = itertools.count()


def refused():
    """None where this machine makes network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); not root here"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"iproute2's {tool} is not installed"
    probe = f"rpsprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if r.returncode != 0:
        return f"this machine refuses network namespaces: ip netns add: {r.stderr.decode().strip()}"
    r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                        "tbf", "rate", "1gbit", "burst", "64k", "latency", "100ms"],
                       capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode != 0:
        return f"this kernel refuses tc's tbf qdisc: {r.stderr.decode().strip()}"
    return None


class HostBed:
    """N hosts (host0..host(N-1)) at rate each way; names: more names for them."""

    def __init__(self, n, tmp_path, rate="1gbit", names=None):
        self.n = n
        self.tmp = tmp_path
        self.rate = rate
        self.names = names or []
        self.tag = f"t{os.getpid() % 100000}x{next(_seq)}"
        self.procs = {}
        self.logs = {}

    def sh(self, *args, check=True, timeout=60):
        r = subprocess.run([HOSTS_SH, f"--name={self.tag}", *args], capture_output=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"hosts.sh {' '.join(args)}: {r.stderr.decode().strip()}")
        return r.stdout.decode()

    def __enter__(self):
        extra = [f"--names={','.join(self.names)}"] if self.names else []
        self.sh("up", str(self.n), f"--rate={self.rate}", *extra)
        return self

    def __exit__(self, *exc):
        self.stop_all()
        self.sh("down", check=False)
        for f in self.logs.values():
            f.close()
        return False

    def addr(self, i):
        return self.sh("addr", f"host{i}").strip()

    def cut(self, i):
        self.sh("cut", f"host{i}")

    def restore(self, i):
        self.sh("restore", f"host{i}")

    def set_rate(self, i, rate):
        self.sh("rate", f"host{i}", rate)

    def start(self, name, host, argv, env=None):
        """argv on host (an index), its output into tmp_path/NAME.log."""
        self.logs[name] = open(self.tmp / f"{name}.log", "w+b")
        self.procs[name] = subprocess.Popen(
            [HOSTS_SH, f"--name={self.tag}", "exec", f"host{host}", *argv],
            stdout=self.logs[name], stderr=subprocess.STDOUT, env=env)
        return self.procs[name]

    def log(self, name):
        self.logs[name].flush()
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs_tail(self, n=1500):
        return "\n".join(f"--- {k}\n{self.log(k)[-n:]}" for k in self.procs)

    def wait(self, name, timeout):
        """name's exit status once it exits within timeout, else AssertionError with the logs."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish within {timeout} s\n{self.logs_tail()}")

    def wait_for(self, cond, timeout, what):
        t0 = time.time()
        while True:
            v = cond()
            if v:
                return v
            if time.time() - t0 > timeout:
                raise AssertionError(f"{what}: not within {timeout} s\n{self.logs_tail()}")
            time.sleep(0.1)

    def curl(self, host, url, *args, timeout=10):
        """curl's (exit status, stdout) for url, run on host, as a user would."""
        r = subprocess.run([HOSTS_SH, f"--name={self.tag}", "exec", f"host{host}", "curl", "-sS",
                            "--max-time", str(timeout), *args, url], capture_output=True,
                           timeout=timeout + 30)
        return r.returncode, r.stdout

    def get(self, host, url, timeout=10):
        """GET url as JSON from host; None where it got no answer."""
        rc, out = self.curl(host, url, timeout=timeout)
        return json.loads(out) if rc == 0 else None

    def no_sanitizer_reports(self):
        for name in self.procs:
            text = self.log(name)
            assert not any(m in text for m in SANITIZER_MARKS), f"{name}:\n{text[-3000:]}"

    def stop_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
