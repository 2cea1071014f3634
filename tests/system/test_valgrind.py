"""valgrind --leak-check=full over a short training run: psd (with its
checkpoint thread) and one workerd (the chief: it creates the variables,
trains 30 steps of a small model, evaluates, exports, stops psd). Neither may
have a definite leak or any memory error. No suppression file: at the time
of writing both end with every heap block freed, libraries included, so a
suppression would only hide something new. (Should one become needed for a
library's one-time allocation, add tests/system/valgrind.supp with a comment
per entry saying why, and pass it with --suppressions.)"""
import os
import re
import shutil
import subprocess

import pytest

from conftest import BIN, binary
from procs import free_port
from test_train import DATA, needs_data

ASAN = "asan" in BIN
pytestmark = [
    needs_data,
    pytest.mark.skipif(ASAN, reason="valgrind cannot run AddressSanitizer binaries: "
                                    "the optimized build runs it"),
    pytest.mark.skipif(shutil.which("valgrind") is None,
                       reason="valgrind is missing: make deps installs it"),
]
VG = ["valgrind", "--leak-check=full", "--errors-for-leak-kinds=definite", "--error-exitcode=99",
      "--track-fds=no", "--num-callers=30"]


def check_log(path, who):
    text = open(path, errors="replace").read()
    m = re.search(r"definitely lost: ([\d,]+) bytes", text)
    lost = int(m.group(1).replace(",", "")) if m else 0
    errs = re.search(r"ERROR SUMMARY: (\d+) errors", text)
    assert errs, f"{who}: no valgrind summary:\n{text[-3000:]}"
    assert lost == 0 and errs.group(1) == "0", f"{who} under valgrind:\n{text[-8000:]}"
    heap = re.search(r"in use at exit: ([\d,]+) bytes in ([\d,]+) blocks", text)
    return heap.group(0) if heap else "in use at exit: 0 bytes"


def test_training_run_under_valgrind(tmp_path):
    ps, w = free_port(), free_port()
    psd_log, w_log = str(tmp_path / "psd.vg"), str(tmp_path / "workerd.vg")
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    with open(tmp_path / "psd.err", "wb") as err:
        psd = subprocess.Popen(VG + [f"--log-file={psd_log}", binary("psd"),
                                     f"--ps_hosts=127.0.0.1:{ps}", f"--logdir={tmp_path}/logs"],
                               stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        line = psd.stdout.readline().decode()
        assert line.startswith("psd: listening on "), line
        out = subprocess.run(VG + [f"--log-file={w_log}", binary("workerd"),
                                   f"--ps_hosts=127.0.0.1:{ps}", f"--worker_hosts=127.0.0.1:{w}",
                                   f"--data_dir={DATA}", "--hidden_units=8", "--batch_size=10",
                                   "--train_steps=30", "--log_every=10",
                                   f"--export={tmp_path}/model.safetensors"],
                             capture_output=True, timeout=240, env=env)
        text = out.stdout.decode() + out.stderr.decode()
        assert out.returncode == 0, f"workerd exited {out.returncode}:\n{text[-3000:]}"
        assert "training done at global step 30" in text, text[-3000:]
        rc = psd.wait(timeout=60)  # the chief stops it
        assert rc == 0, f"psd exited {rc}:\n{(tmp_path / 'psd.err').read_text()[-3000:]}"
    finally:
        if psd.poll() is None:
            psd.kill()
            psd.wait()
        psd.stdout.close()
    a, b = check_log(psd_log, "psd"), check_log(w_log, "workerd")
    print(f"valgrind: psd {a}; workerd {b}; no definite leak, no error")
