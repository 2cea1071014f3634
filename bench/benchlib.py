"""bench/benchlib.py - what the Python benchmarks share."""
import re
import socket
import subprocess
import threading
import time


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def bed(hosts_sh, tag, *args, check=True):
    """deploy/netns/hosts.sh --name=tag ARGS: its output (raises on failure with check)."""
    r = subprocess.run([hosts_sh, f"--name={tag}", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"hosts.sh {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


class Lines:
    """A process whose output lines (stdout and stderr) are kept with their arrival times."""

    def __init__(self, argv, env=None):
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def text(self):
        return "\n".join(s for _, s in self.lines)

    def finish(self, timeout):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.t.join(timeout=5)
        return self.p.returncode


class BedTask(Lines):
    """A process on a host of the test bed (deploy/netns/hosts.sh exec)."""

    def __init__(self, hosts_sh, tag, host, argv, env=None):
        super().__init__([hosts_sh, f"--name={tag}", "exec", f"host{host}", *argv], env=env)


def step_secs(task, warm, last):
    """Seconds a step from a task's per-step lines (': step N '), steps warm..last."""
    at = {}
    for t, s in task.lines:
        m = re.search(r": step (\d+) ", s)
        if m:
            at.setdefault(int(m.group(1)), t)
    if warm not in at or last not in at:
        raise RuntimeError("no step lines:\n" + task.text()[-2000:])
    return (at[last] - at[warm]) / (last - warm)
