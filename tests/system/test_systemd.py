"""deploy/systemd (issue 8): the unit files pass `systemd-analyze verify`,
every flag they give exists in the binaries' --help, and their environment
file defines every variable they use. (Running them needs a systemd host;
this machine's tests only check them.)"""
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, binary

UNITS = os.path.join(ROOT, "deploy", "systemd")
pytestmark = pytest.mark.skipif(not shutil.which("systemd-analyze"),
                                reason="systemd-analyze is missing (Debian's systemd package)")


def unit(name):
    return open(os.path.join(UNITS, name)).read()


def exec_start(text):
    return re.search(r"^ExecStart=(.*)$", text, re.M).group(1)


@pytest.mark.parametrize("name,prog", [("psd@.service", "psd"), ("workerd@.service", "workerd")])
def test_unit_verifies_and_uses_real_flags(tmp_path, name, prog):
    text = unit(name)
    # systemd-analyze verify wants the executable to exist: point it at this build
    local = text.replace(f"/usr/local/bin/{prog}", os.path.abspath(binary(prog)))
    path = tmp_path / name.replace("@", "@7")  # an instance, as systemctl start psd@7 would
    path.write_text(local)

    def complaints(p):
        # verify exits 0 on bad settings and only says so, naming the file and line
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(p)], capture_output=True,
                           text=True, timeout=60)
        return r.returncode, [l for l in (r.stdout + r.stderr).splitlines() if str(p) in l]

    rc, problems = complaints(path)
    assert rc == 0 and not problems, problems
    # and the check sees a broken copy
    broken = tmp_path / name.replace("@", "@8")
    broken.write_text(local.replace("ProtectSystem=strict", "ProtectSystem=bogus\nFooBar=1"))
    assert len(complaints(broken)[1]) == 2
    helptext = subprocess.run([binary(prog), "--help"], capture_output=True, text=True).stdout
    flags = re.findall(r"--([a-z_]+)=", exec_start(text))
    assert flags
    for f in flags:
        assert f"--{f}" in helptext, f"{name} passes --{f}, which {prog} --help does not list"
    for key in ("Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                "ReadWritePaths=/var/lib/restps", "User=restps"):
        assert key in text, key
    env = dict(l.split("=", 1) for l in unit("cluster.env").splitlines() if l and not l.startswith("#"))
    for var in re.findall(r"\$\{(\w+)\}", text):
        assert var in env, f"{name} uses ${{{var}}}, which cluster.env does not set"
