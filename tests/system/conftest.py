"""Shared fixtures for the system tests: real psd processes on free ports.

RESTPS_BIN_DIR picks the build under test (bin/ by default, build/asan/bin for
the sanitizer run). Every process a test starts is stopped by PID at teardown,
and must exit 0 on SIGTERM with no sanitizer report on stderr.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

# What the tests import beside this file: tests/support (the shared helpers:
# syshelp, deployhelp, ckpt_check, procs, sanitizer_subset, st_hooks) and
# tests/helpers (the programs the tests run, cnn_ref among them, imported too).
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(TESTS, "support")
HELPERS = os.path.join(TESTS, "helpers")
for _d in (HELPERS, SUPPORT):
    if _d not in sys.path:
        sys.path.insert(0, _d)

# The suite runs on the CPU even on a GPU machine: workerd's --device=auto
# would otherwise put every test's worker on the GPU, where results that the
# tests compare bit for bit with the CPU (or with numpy at 1e-5) differ. The
# devices the run was given are kept in RESTPS_TEST_GPUS ("all" when
# CUDA_VISIBLE_DEVICES was unset) for the tests that want them: gpu_env().
if "RESTPS_TEST_GPUS" not in os.environ:
    os.environ["RESTPS_TEST_GPUS"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env():
    """os.environ with the run's GPUs visible again (see above)."""
    e = dict(os.environ)
    gpus = e.get("RESTPS_TEST_GPUS", "all")
    if gpus == "all":
        e.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        e["CUDA_VISIBLE_DEVICES"] = gpus
    return e


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")
# The sanitizer run: a build folder whose path names asan (tests/run.sh's
# build/asan/bin, and the coverage build standing in for it in make coverage).
SANITIZER_RUN = "asan" in BIN


def pytest_collection_modifyitems(config, items):
    """On the sanitizer build, the tests tests/support/sanitizer_subset.py
    leaves to the normal build are skipped, each with its reason."""
    if not SANITIZER_RUN:
        return
    from sanitizer_subset import normal_build_only
    for item in items:
        reason = normal_build_only(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason="normal build only: " + reason))


@pytest.fixture(autouse=True)
def _own_cwd(tmp_path, monkeypatch):
    """Each test runs in its own empty folder, so a psd started without
    --logdir writes its checkpoints (./logs/ps-N) there and never restores
    another test's."""
    monkeypatch.chdir(tmp_path)


def binary(name):
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: run make (or make asan) first")
    return path


class Psd:
    """One psd process started with --port=0 (unless args say otherwise)."""

    def __init__(self, args=(), env=None, port0=True, own_logdir=True):
        self.stderr = tempfile.NamedTemporaryFile(prefix="psd-", suffix=".err", delete=False)
        argv = [binary("psd")] + (["--port=0"] if port0 else []) + list(args)
        if own_logdir and not any(a.startswith("--logdir") for a in args):
            # a fresh folder: two psd of one test never restore each other's checkpoints
            argv.append("--logdir=" + tempfile.mkdtemp(prefix="psd-logs-", dir=os.getcwd()))
        e = dict(os.environ)
        e.pop("TF_CONFIG", None)
        if env:
            e.update(env)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, env=e)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("psd: listening on "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"psd did not start: {line!r}\n{self.read_stderr()}")
        self.url = line.split("listening on ", 1)[1].strip()
        self.host_port = self.url.split("//", 1)[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def read_stderr(self):
        with open(self.stderr.name, errors="replace") as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=20):
        """SIGTERM by PID; returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("psd did not stop within %ss of SIGTERM" % timeout)
        self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture
def start_psd():
    started = []

    def start(*args, env=None, port0=True, own_logdir=True):
        p = Psd(args, env=env, port0=port0, own_logdir=own_logdir)
        started.append(p)
        return p

    yield start
    problems = []
    for p in started:
        rc = p.stop()
        err = p.read_stderr()
        os.unlink(p.stderr.name)
        if rc != 0:
            problems.append(f"psd exited {rc} on SIGTERM:\n{err[-3000:]}")
        for mark in SANITIZER_MARKS:
            if mark in err:
                problems.append(f"sanitizer report from psd:\n{err[-6000:]}")
                break
    assert not problems, "\n".join(problems)


@pytest.fixture
def psd(start_psd):
    return start_psd()


def http(method, url, body=None, headers=None, timeout=10):
    """(status, headers dict with lower-case keys, body bytes); never raises on HTTP errors."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def curl(*args, timeout=20):
    """Run the real curl; returns CompletedProcess (stdout bytes)."""
    return subprocess.run(["curl", "-sS", "--noproxy", "*"] + list(args), capture_output=True,
                          timeout=timeout)
