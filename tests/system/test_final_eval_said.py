"""The chief's final evaluation is never a long silence (issue 37): a
pipeline chief of the CNN computed the validation cross-entropy and the
test accuracy on 15,000 examples for about 40 s (on a loaded machine)
without a word between its last training line and the result. Now, past 2 s
it says what it computes and how far it is, every 5 s (final_report in
client/workerd/role_common.c, which every chief shares). The test reads
the chief's lines as they come and measures the longest gap before the
result."""
import os
import re
import subprocess
import threading
import time

import pytest

from conftest import binary
from procs import free_port, kill_all

DATA = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


def timed_lines(p, out):
    for raw in iter(p.stdout.readline, b""):
        out.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))


@needs_data
def test_a_pipeline_chief_says_what_it_computes_at_the_end():
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    flags = ["--pipeline_stages=2", "--micro_batches=4", f"--worker_hosts={hosts}", "--model=cnn",
             "--train_steps=3", f"--data_dir={DATA}", "--log_every=0"]
    procs, lines = [], []
    try:
        procs.append(subprocess.Popen([binary("workerd")] + flags + ["--task_index=1"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT))
        chief = subprocess.Popen([binary("workerd")] + flags + ["--task_index=0"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
        procs.append(chief)
        reader = threading.Thread(target=timed_lines, args=(chief, lines), daemon=True)
        reader.start()
        assert chief.wait(timeout=240) == 0, "\n".join(l for _, l in lines)[-3000:]
        reader.join(timeout=10)
        assert procs[0].wait(timeout=30) == 0
    finally:
        kill_all(procs)
    text = "\n".join(l for _, l in lines)
    done = [i for i, (_, l) in enumerate(lines) if "training done at global step 3" in l]
    assert done, text[-3000:]
    trained = [i for i, (_, l) in enumerate(lines) if "stage 0 steady state" in l or "stage 0 finished" in l]
    assert trained and trained[-1] < done[0], text[-3000:]
    # from the end of training to the result: what the chief said, and the longest silence
    part = lines[trained[-1]:done[0] + 1]
    evaluation = part[-1][0] - part[0][0]
    said = [l for _, l in part if re.search(r"computing the validation cross-entropy and the test accuracy of "
                                            r"global step 3: \d+ of 15000 examples in \d+ s", l)]
    gap = max(b[0] - a[0] for a, b in zip(part, part[1:]))
    print(f"final evaluation {evaluation:.1f} s, {len(said)} progress lines, longest silence {gap:.1f} s")
    if evaluation > 3:
        assert said, text[-3000:]
    # 2 s before the first line, then one every 5 s, each at the end of a piece of ~1,000 examples
    assert gap < 12, (gap, text[-3000:])
