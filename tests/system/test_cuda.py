"""workerd's --device choice and the CUDA backend (issue 7).

Runs everywhere: --device=cuda with no device (CUDA_VISIBLE_DEVICES="" hides
any) is one clear line on stderr and exit 2, before any data is read;
--device=auto then says on its first line that it took the cpu; bad --device
and --gpu values are refused. Needs a device (skipped, with the reason, where
there is none; they see the GPUs conftest.py hides from the rest of the
suite): the CUDA backend against the CPU on random inputs
(tests/gpu/cuda_vs_cpu.c), and --local training on cuda tracking the cpu's
losses. tests/gpu/check.sh is the fuller check on a GPU machine."""
import os
import re
import subprocess

import pytest

from conftest import BIN, binary, gpu_env

DATA = "/usr/share/datasets/fashion-mnist"
ASAN = "asan" in BIN
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


def run(args, env=None, timeout=120):
    e = gpu_env()  # conftest hides the GPUs from the rest of the suite
    e.pop("TF_CONFIG", None)
    if env:
        e.update(env)
    return subprocess.run([binary("workerd")] + args, capture_output=True, text=True,
                          env=e, timeout=timeout)


def built_with_cuda():
    return "built without CUDA" not in run(["--help"]).stdout


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # hides every device, where there are some


def test_device_cuda_without_device_exits_2():
    r = run(["--device=cuda", "--local", "--data_dir=/nonexistent", "--train_steps=1"], env=NO_GPU)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"want one line on stderr, got {r.stderr!r}"
    want = "no CUDA device" if built_with_cuda() else "built without CUDA"
    assert lines[0].startswith("workerd: --device=cuda: ") and want in lines[0], lines[0]
    assert "training" not in r.stdout, r.stdout  # refused before anything ran


def test_device_auto_without_device_says_cpu():
    # the data folder is missing: workerd stops there (exit 2), after its first line
    r = run(["--local", "--data_dir=/nonexistent"], env=NO_GPU)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    first = r.stdout.splitlines()[0]
    assert first.startswith("workerd: using the cpu backend (--device=auto: "), first
    assert ("no CUDA device" if built_with_cuda() else "built without CUDA") in first, first
    r = run(["--device=cpu", "--local", "--data_dir=/nonexistent"])
    assert r.stdout.splitlines()[0] == "workerd: using the cpu backend (--device=cpu)", r.stdout


@needs_data
def test_device_auto_trains_on_cpu():
    r = run(["--local", f"--data_dir={DATA}", "--train_steps=20", "--log_every=10",
             "--hidden_units=16"], env=NO_GPU)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("workerd: using the cpu backend"), lines[0]
    assert "; cpu backend (OpenBLAS " in lines[1], lines[1]
    assert any(re.search(r"step 20 loss [0-9.]+", l) for l in lines), r.stdout


def test_the_rest_of_the_suite_runs_on_the_cpu():
    """conftest.py hides the GPUs from every other test's processes: on a GPU
    machine too, --device=auto then takes the cpu."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    r = subprocess.run([binary("workerd"), "--local", "--data_dir=/nonexistent"],
                       capture_output=True, text=True, env=e, timeout=60)
    assert r.stdout.splitlines()[0].startswith("workerd: using the cpu backend (--device=auto: "), r.stdout


@pytest.mark.parametrize("args,want", [
    (["--device=gpu"], "--device must be auto, cpu or cuda"),
    (["--device=cuda", "--gpu=-1"], "--gpu=-1 is negative"),
])
def test_bad_device_flags(args, want):
    r = run(args + ["--local", "--data_dir=/nonexistent"])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert want in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def gpu_tool(name):
    if ASAN:
        pytest.skip("the ASan build is CPU-only (CUDA=0): no CUDA backend to test")
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing: this build has no CUDA backend (no nvcc, or make CUDA=0)")
    return path


def skip_without_device(r):
    if r.returncode == 77:
        reason = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "no CUDA device"
        pytest.skip(reason.removeprefix("SKIP: "))


def test_cuda_matches_cpu():
    r = subprocess.run([gpu_tool("cuda_vs_cpu")], capture_output=True, text=True, timeout=300,
                       env=gpu_env())
    skip_without_device(r)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all agree" in r.stdout, r.stdout


@needs_data
def test_cuda_training_tracks_cpu():
    r = subprocess.run([gpu_tool("cuda_vs_cpu"), "--probe"], capture_output=True, text=True,
                       timeout=60, env=gpu_env())
    skip_without_device(r)
    common = ["--local", f"--data_dir={DATA}", "--train_steps=100", "--log_every=20",
              "--optimizer=sgd", "--learning_rate=0.1"]
    losses = {}
    for dev in ("cpu", "cuda"):
        out = run(common + [f"--device={dev}"])
        assert out.returncode == 0, (dev, out.stdout, out.stderr)
        assert out.stdout.splitlines()[0].startswith(f"workerd: using the {dev} backend"), out.stdout
        losses[dev] = [float(m) for m in re.findall(r"step \d+ loss ([0-9.]+)", out.stdout)]
    assert len(losses["cpu"]) == 5 and len(losses["cuda"]) == 5, losses
    assert losses["cuda"][-1] < losses["cuda"][0], losses
    for a, b in zip(losses["cpu"], losses["cuda"]):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), losses
