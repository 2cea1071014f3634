"""Ports and processes of the system tests: a free port to give a process, and
the wait for a process a test started (its exit status and output, killed by
PID when it runs past its time, checked for sanitizer reports).

Imported by the tests (tests/system/conftest.py puts tests/support on sys.path)."""
import socket
import subprocess

from conftest import SANITIZER_MARKS


_given = set()


def free_port():
    """A TCP port on 127.0.0.1 free right now (bound to port 0, then closed),
    never one this process handed out before: the kernel may give a port just
    closed again, and a test that asks for several (a cluster's addresses)
    would get the same one twice."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
    raise RuntimeError("no fresh free port on 127.0.0.1")


def communicate(p, timeout, what="did not finish"):
    """(exit status, decoded stdout) of p once it exits within timeout; else it
    is killed by PID and AssertionError names what happened, with its output's tail."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(what + ":\n" + out.decode()[-3000:])
    return p.returncode, out.decode()


def finish(p, timeout=120):
    """communicate(), and no sanitizer report in the output."""
    rc, out = communicate(p, timeout)
    for mark in SANITIZER_MARKS:
        assert mark not in out, out[-6000:]
    return rc, out


def kill_all(procs):
    """SIGKILL by PID to each of procs still running, and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
