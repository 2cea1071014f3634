"""Line coverage of restps's C code (server/, client/, common/) from gcov
data: the lines the full normal run reached against the lines the sanitizer
run's subset reached (tests/coverage.sh, make coverage).

usage: coverage.py BUILD FULL_ROOT SUBSET_ROOT OUT_DIR

BUILD is the --coverage build (its .gcno files); FULL_ROOT and SUBSET_ROOT
the GCOV_PREFIX folders the two runs wrote their .gcda files under. Writes
OUT_DIR/lines-full.txt, lines-subset.txt and lines-only-full.txt ("file:line"
each), prints the figures, and ends with a "summary:" line (what
tests/coverage.txt keeps and make test prints). Exit 1 when the subset covers
less than 95% of the full run's lines.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THRESHOLD = 0.95


def full_root_of(prefix_root):
    """The folder holding both runs' GCOV_PREFIX folders."""
    return os.path.dirname(os.path.abspath(prefix_root))


def covered(build, prefix_root, out_json):
    """(covered lines, instrumented lines) as sets of (file, line)."""
    build_abs = os.path.abspath(build)
    tree = prefix_root + build_abs  # where GCOV_PREFIX put this build's .gcda files
    if not os.path.isdir(tree):
        sys.exit(f"coverage: no .gcda files under {tree}: did the run use the coverage build?")
    skip = (os.path.abspath(full_root_of(prefix_root)), os.path.abspath(prefix_root))
    for d, dirs, files in os.walk(build_abs):
        # not into the GCOV_PREFIX folders themselves (coverage.sh keeps them in the build)
        dirs[:] = [x for x in dirs if not os.path.join(d, x).startswith(skip)]
        for f in files:
            if f.endswith(".gcno"):
                dst = os.path.join(tree, os.path.relpath(d, build_abs))
                os.makedirs(dst, exist_ok=True)
                shutil.copy(os.path.join(d, f), dst)
    subprocess.run(["gcovr", "--root", ROOT, "--filter", "server/", "--filter", "client/",
                    "--filter", "common/", "--json", out_json, tree], check=True, cwd=ROOT,
                   stderr=subprocess.DEVNULL)
    with open(out_json) as f:
        data = json.load(f)
    cov, inst = set(), set()
    for fe in data["files"]:
        for ln in fe["lines"]:
            if ln.get("gcovr/noncode"):
                continue
            inst.add((fe["file"], ln["line_number"]))
            if ln["count"] > 0:
                cov.add((fe["file"], ln["line_number"]))
    return cov, inst


def write_lines(path, lines):
    with open(path, "w") as f:
        for fn, n in sorted(lines):
            f.write(f"{fn}:{n}\n")


def main():
    build, full_root, subset_root, out = sys.argv[1:5]
    os.makedirs(out, exist_ok=True)
    full, inst = covered(build, full_root, os.path.join(out, "gcovr-full.json"))
    subset, _ = covered(build, subset_root, os.path.join(out, "gcovr-subset.json"))
    only = full - subset
    write_lines(os.path.join(out, "lines-full.txt"), full)
    write_lines(os.path.join(out, "lines-subset.txt"), subset)
    write_lines(os.path.join(out, "lines-only-full.txt"), only)
    both = full & subset
    ratio = len(both) / len(full) if full else 0.0
    print(f"instrumented lines of C (server/, client/, common/): {len(inst)}")
    print(f"full normal run (unit + system tests): {len(full)} lines ({100 * len(full) / len(inst):.1f}%)"
          f" -> {out}/lines-full.txt")
    print(f"sanitizer run's subset (unit + system tests): {len(subset)} lines -> {out}/lines-subset.txt")
    print(f"reached by the full run only: {len(only)} lines -> {out}/lines-only-full.txt")
    for fn, n in Counter(fn for fn, _ in only).most_common(12):
        print(f"  {n:5d}  {fn}")
    print(f"summary: the sanitizer run reaches {len(both)} of the {len(full)} lines of C the full run "
          f"reaches ({100 * ratio:.1f}%, at least {100 * THRESHOLD:.0f}% required); "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    return 0 if ratio >= THRESHOLD else 1


if __name__ == "__main__":
    sys.exit(main())
