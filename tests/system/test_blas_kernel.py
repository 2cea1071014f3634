"""The OpenBLAS kernel set workerd computes with (client/blas_kernel.c): chosen
from what the cpu can run (cpuid), not from its model name, and checked by a
small sgemm against a plain C product; one that fails is not used; an
OPENBLAS_CORETYPE the user set wins. The training line says which and why.

These tests unset OPENBLAS_CORETYPE only to watch restps choose, and set it
only to check that the user's value wins; RESTPS_BLAS_SELFTEST_FAIL (the test
hook) spoils the self-test of the kernels it names."""
import os
import re
import subprocess

from conftest import binary
from test_train import DATA, needs_data

pytestmark = needs_data
ARGS = ["--local", f"--data_dir={DATA}", "--hidden_units=8", "--batch_size=10", "--log_every=0"]
LINE = re.compile(r"training locally .*; cpu backend \(OpenBLAS (\w+), 1 thread; (kernel: .*)\)$", re.M)
CLASS = {"skylakex": 3, "cooperlake": 3, "sapphirerapids": 3, "haswell": 2, "zen": 2}
EVERY_KERNEL = ("SkylakeX,CooperLake,SapphireRapids,Haswell,Zen,Sandybridge,Bulldozer,Piledriver,"
                "Steamroller,Excavator,Nehalem,Core2,Penryn,Dunnington,Atom,Barcelona,Bobcat,Nano,"
                "Opteron,Opteron_SSE3,Prescott")


def cpu_class():
    """What Linux says the cpu runs (it lists AVX-512 only where the OS saves its state)."""
    with open("/proc/cpuinfo") as f:
        flags = next((set(l.split(":", 1)[1].split()) for l in f if l.startswith("flags")), set())
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return 3
    return 2 if {"avx2", "fma"} <= flags else 0


def env(**extra):
    e = dict(os.environ)
    for k in ("OPENBLAS_CORETYPE", "RESTPS_BLAS_KERNEL", "RESTPS_BLAS_SELFTEST_FAIL", "TF_CONFIG"):
        e.pop(k, None)
    e.update(extra)
    return e


def run(e, steps=2):
    return subprocess.run([binary("workerd"), *ARGS, f"--train_steps={steps}"], capture_output=True,
                          text=True, timeout=120, env=e)


def kernel_of(r):
    assert r.returncode == 0, r.stdout + r.stderr
    m = LINE.search(r.stdout)
    assert m, r.stdout
    return m.group(1), m.group(2)


def test_startup_line_names_the_kernel_and_why():
    kernel, why = kernel_of(run(env()))
    print(f"OpenBLAS {kernel}; {why}")
    assert re.fullmatch(r"kernel: (OpenBLAS's own choice|restps's choice from cpuid)\b.*"
                        r"; sgemm self-test passed", why), why
    if "no DYNAMIC_ARCH" not in why:
        # never a kernel below what the cpu runs (Prescott on an AVX-512 cpu)
        want = cpu_class()
        assert CLASS.get(kernel.lower(), 0) == want, (kernel, want, why)


def test_user_coretype_wins():
    # a marker naming another kernel does not make the user's value restps's
    kernel, why = kernel_of(run(env(OPENBLAS_CORETYPE="Prescott", RESTPS_BLAS_KERNEL="Zen|Haswell")))
    assert kernel == "Prescott"
    assert why == "kernel: OPENBLAS_CORETYPE=Prescott set by the user; sgemm self-test passed", why
    # empty is set too: OpenBLAS reads it as a name it does not know
    kernel, why = kernel_of(run(env(OPENBLAS_CORETYPE="")))
    assert why.startswith("kernel: OPENBLAS_CORETYPE set empty by the user"), why
    # the user's kernel failing the self-test: used anyway, and said
    r = run(env(OPENBLAS_CORETYPE="Prescott", RESTPS_BLAS_SELFTEST_FAIL="Prescott"))
    kernel, why = kernel_of(r)
    assert kernel == "Prescott"
    assert re.search(r"; sgemm self-test FAILED \(off by [0-9.e+-]+\): used anyway", why), why
    assert "workerd: blas: OpenBLAS Prescott (OPENBLAS_CORETYPE=Prescott) failed the sgemm self-test" in r.stderr


def test_failing_kernel_is_refused_in_the_same_process():
    first, why = kernel_of(run(env()))
    e = env(RESTPS_BLAS_SELFTEST_FAIL=first)
    if cpu_class() < 2 or "no DYNAMIC_ARCH" in why:
        r = run(e)  # nothing to fall back to
        assert r.returncode == 1 and "no OpenBLAS kernel passed the sgemm self-test" in r.stderr, r.stderr
        return
    argv = [binary("workerd"), *ARGS, "--train_steps=100000000"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "training locally" in line:
                break
        m = LINE.search("".join(lines))
        assert m, "".join(lines) + p.stderr.read()
        kernel, why = m.groups()
        # the same PID and argv, now with restps's OPENBLAS_CORETYPE and its marker
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:-1] == [a.encode() for a in argv]
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            environ = dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if b"=" in v)
    finally:
        p.kill()  # --local does not stop at SIGTERM
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()
    print(f"{first} spoiled: OpenBLAS {kernel}; {why}")
    assert kernel.lower() != first.lower()
    assert re.search(rf"; {first} refused: its sgemm self-test was off by [0-9.e+-]+; sgemm self-test passed$",
                     why), why
    assert environ["OPENBLAS_CORETYPE"] == kernel
    assert re.fullmatch(rf"\w+\|{first}:[0-9.e+-]+,{kernel}", environ["RESTPS_BLAS_KERNEL"]), environ
    assert sum("training locally" in l for l in lines) == 1  # nothing printed twice


def test_no_kernel_passing_stops_workerd():
    r = run(env(RESTPS_BLAS_SELFTEST_FAIL=EVERY_KERNEL))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("workerd: blas: no OpenBLAS kernel passed the sgemm self-test ("), r.stderr
    assert "set OPENBLAS_CORETYPE to use one anyway" in r.stderr
    assert "training" not in r.stdout
