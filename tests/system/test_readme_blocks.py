"""The by-hand command blocks of README.md and docs/*.md, run as written,
twice in a row (issue 37, part 4).

A page marks each such block with `<!-- test: by-hand -->` on the line
before it. The blocks name the cluster and the run's length with shell
variables (PS, WORKERS, STEPS, ...) that a block marked
`<!-- test: settings -->` on the same page sets to the example's values;
this test does not run that block: it sets the same variables to its own
values (free ports of 127.0.0.1, a few steps), and every variable a settings
block sets must be one it knows. Nothing else of a block is changed: it
runs in an empty folder whose `bin` is this build's (RESTPS_BIN_DIR), with
`make` a no-op (the build is the test's) and `curl` wrapped only to say when
it fails (the blocks' `curl -s` would fail silently).

Each block runs twice in the same folder: the second run meets the first's
state (psd's checkpoints in logs/), and must do what the README says of it:
train again, or say "already at step N: nothing to train" and exit 3. After
each run every process the block started must have ended by itself
(within 30 s; the chief stops the ps tasks); any left is named, stopped by
PID, and fails the test."""
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import BIN, ROOT
from procs import free_port

PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
MARK = re.compile(r"^<!-- test: (by-hand|settings) -->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
STEPS = 10


def marked_blocks(rel):
    """[(kind, line, body)] of the blocks a page marks."""
    lines = open(os.path.join(ROOT, rel)).read().split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARK.match(line)
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        assert j < len(lines) and FENCE.match(lines[j]), f"{rel}:{i + 1}: a test mark with no ``` block after it"
        k = j + 1
        while k < len(lines) and lines[k].strip() != "```":
            k += 1
        out.append((m.group(1), j + 1, "\n".join(lines[j + 1:k]) + "\n"))
    return out


def block_values():
    """The test's value of every variable a settings block may set."""
    ports = [free_port() for _ in range(8)]
    a = [f"127.0.0.1:{p}" for p in ports]
    return {"PS": a[0], "WORKERS": f"{a[1]},{a[2]}", "STEPS": str(STEPS),
            "PS2": f"{a[0]},{a[3]}", "WORKERS4": f"{a[1]},{a[2]},{a[4]},{a[5]}"}


def settings_names(rel):
    names = []
    for kind, line, body in marked_blocks(rel):
        if kind == "settings":
            names += re.findall(r"(?:^|\s)([A-Z][A-Z0-9_]*)=", body)
    return names


BLOCKS = [(rel, line) for rel in PAGES for kind, line, _ in marked_blocks(rel) if kind == "by-hand"]

HARNESS = r"""
make() { :; }   # the build is the test's
curl() { command curl "$@"; __c=$?; [ $__c = 0 ] || echo "readme-test: curl $* failed ($__c)" >&2; return $__c; }
%(settings)s
# ---- the block, as written
%(block)s
# ---- the block's end
__rc=$?
__left=$(jobs -p)
__n=0
while [ $__n -lt %(wait)d ]; do
  __alive=""
  for __p in $__left; do kill -0 $__p 2>/dev/null && __alive="$__alive $__p"; done
  [ -z "$__alive" ] && break
  sleep 0.1; __n=$((__n + 1))
done
echo "readme-test: status $__rc; still running:$__alive"
for __p in $__alive; do kill -TERM $__p; done
exit $__rc
"""


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def run_block(script, cwd, timeout=90):
    p = subprocess.Popen(["bash", str(script)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for c in children(p.pid):   # what the block started, by PID
            os.kill(c, signal.SIGKILL)
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"the block did not end in {timeout} s:\n" + out.decode(errors="replace")[-4000:])
    return p.returncode, out.decode(errors="replace")


def check_run(n, rc, out, body, values):
    where = f"run {n}:\n{out[-4000:]}"
    assert "readme-test: curl" not in out, where
    left = re.search(r"readme-test: status \d+; still running:(.*)", out)
    assert left, where
    assert not left.group(1).strip(), "processes the block started were left running: " + where
    done = "training done at global step" in out
    again = re.search(r"already at step (\d+): nothing to train", out)
    # a psd with checkpoints (not --logdir=): the second run meets the first's
    keeps_state = re.search(r"bin/psd(?![^\n]*--logdir=(?:\s|$))", body)
    last = [l for l in body.split("\n") if l.strip() and not l.startswith("#")][-1]
    if "workerd" in body and n == 2 and keeps_state:
        # the README: the same job again says so, and its chief exits 3
        assert again and not done, where
        assert rc == (3 if last.startswith("bin/workerd") else 0), where
    elif "workerd" in body:
        assert done and rc == 0, where
    else:
        assert rc == 0, where
    if "--job_name=evaluator" in body:
        steps = [int(s) for s in re.findall(r"evaluator 0: global step (\d+):", out)]
        assert steps and steps[-1] >= int(values["STEPS"]), "the evaluator's last report is not the end: " + where


@pytest.mark.parametrize("rel,line", BLOCKS, ids=[f"{r}:{l}" for r, l in BLOCKS])
def test_a_by_hand_block_runs_as_written_twice(rel, line, tmp_path):
    body = next(b for k, l, b in marked_blocks(rel) if l == line)
    values = block_values()
    names = settings_names(rel) or settings_names("README.md")
    unknown = [n for n in names if n not in values]
    assert not unknown, f"{rel}: its settings set {unknown}, which this test has no value of"
    used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", body)) - set(re.findall(r"(?:^|\s)([A-Z][A-Z0-9_]*)=", body))
    assert used <= set(names), f"{rel}:{line}: the block uses {sorted(used - set(names))}, which no settings " \
                               "block of the page (or the README) sets"
    os.symlink(os.path.abspath(BIN), tmp_path / "bin")
    settings = " ".join(f"{n}={values[n]}" for n in names)
    script = tmp_path / "block.sh"
    script.write_text(HARNESS % {"settings": settings, "block": body, "wait": 300})
    t0 = time.monotonic()
    for n in (1, 2):
        rc, out = run_block(script, tmp_path)
        check_run(n, rc, out, body, values)
        said = [l for l in out.split("\n") if re.search(r"training done|nothing to train|evaluator 0: global|status", l)]
        print(f"--- {rel}:{line} run {n}:\n" + "\n".join(said))
    print(f"{rel}:{line}: twice in {time.monotonic() - t0:.1f} s")


def test_the_marks_are_there_and_the_checks_see_a_broken_block(tmp_path):
    """The README marks its by-hand blocks, and check_run sees what the
    issue found: a curl after the job ended, a process left running."""
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 2, BLOCKS
    assert set(settings_names("README.md")) >= {"PS", "WORKERS", "STEPS"}
    values = block_values()
    port = free_port()
    script = tmp_path / "broken.sh"
    script.write_text(HARNESS % {"settings": "", "wait": 10,
                                 "block": f"sleep 30 &\ncurl -s http://127.0.0.1:{port}/v1/status\n"})
    t0 = time.monotonic()
    rc, out = run_block(script, tmp_path)
    assert "readme-test: curl" in out and re.search(r"still running: \d+", out), out
    assert time.monotonic() - t0 < 60
    with pytest.raises(AssertionError):
        check_run(1, rc, out, "curl", values)
