"""README.md and every docs/*.md page, checked as text: every relative link
points at a file of the repo (and a #fragment at a heading of that page);
every repo path a page names in backticks, or as a bare source path, exists;
no page names a path outside the repo (someone's checkout: /work/, /home/,
...; /tmp/ only inside a command block, or as a default the build itself
uses); every ```sh / ```bash / ```console block parses with `bash -n`; every
--flag a command gives psd or workerd is one their --help lists (the deploy
tests' helpers); every `make X` names a target of the Makefile. Each check is
also run on a broken page, to show it sees the mistake. Then the README's
curl tour runs for real against a psd on a free port."""
import functools
import glob
import os
import re
import subprocess

import pytest

from conftest import BIN, ROOT
from deployhelp import flags_in_text, unknown_flags
from procs import free_port

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
COMMAND_LANGS = ("sh", "bash", "console")
# folders a page may name that a build or a run makes (not in the repo)
GENERATED = ("bin/", "build/", "logs/", "tests/out/", "bench/out/", "bench/results/")
REPO_DIRS = "client|server|common|tests|bench|deploy|scripts|openapi|web|docs"
BARE_PATH = re.compile(rf"(?<![\w/.-])(?:{REPO_DIRS})/[\w./-]*\w\.(?:c|h|cu|py|sh|md|yaml|txt|in|mk)\b")
CODE_PATH = re.compile(rf"(?:{REPO_DIRS})/[\w./-]*")
OUTSIDE = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/\S*")
TMP = re.compile(r"(?<![\w.~-])/tmp/[\w./-]*")
FENCE = re.compile(r"^( *)```(\S*)\s*$")


def fences(text):
    """(lang, body, line number) of each fenced block, its indentation removed
    (a block inside a list item is indented)."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start, body = len(m.group(1)), m.group(2), i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        assert i < len(lines), f"line {start}: a ``` block that never ends"
        out.append((lang, "\n".join(body) + "\n", start))
        i += 1
    return out


def prose(text):
    """The page without its fenced blocks."""
    keep, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            keep.append(line)
    return "\n".join(keep)


def code_spans(text):
    return re.findall(r"`([^`\n]+)`", prose(text))


def commands(text):
    """The command blocks' bodies, prompts removed: in a console block only the
    "$ " lines are commands (the rest is output)."""
    out = []
    for lang, body, line in fences(text):
        if lang not in COMMAND_LANGS:
            continue
        lines = body.split("\n")
        if lang == "console" or any(l.startswith("$ ") for l in lines):
            lines = [l[2:] for l in lines if l.startswith("$ ")] if lang == "console" else \
                    [l[2:] if l.startswith("$ ") else l for l in lines]
        out.append(("\n".join(lines) + "\n", line))
    return out


def slug(heading):
    """GitHub's anchor of a heading."""
    h = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return h.replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    for line in prose(text).split("\n"):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(rel, text):
    out, folder = [], os.path.dirname(os.path.join(ROOT, rel))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        if not path:
            if frag not in anchors(text):
                out.append(f"{rel}: link ({target}): this page has no heading #{frag}")
            continue
        full = os.path.normpath(os.path.join(folder, path))
        if not full.startswith(ROOT + os.sep) or not os.path.exists(full):
            out.append(f"{rel}: link ({target}) points at no file of the repo")
        elif frag and full.endswith(".md") and frag not in anchors(open(full).read()):
            out.append(f"{rel}: link ({target}): {os.path.relpath(full, ROOT)} has no heading #{frag}")
    return out


def path_problems(rel, text):
    """Repo paths named in backticks (written from the repo's root) or bare
    source paths in the prose: each must exist."""
    names = set(BARE_PATH.findall(prose(text)))
    for span in code_spans(text):
        m = CODE_PATH.fullmatch(span.strip().rstrip("/.,"))
        if m:
            names.add(m.group(0).rstrip("/"))
    out = []
    for p in sorted(names):
        if re.search(r"[<>*{}$]", p) or (p + "/").startswith(GENERATED):
            continue
        if not os.path.exists(os.path.join(ROOT, p)):
            out.append(f"{rel}: names {p}, which is not in the repo")
    return out


@functools.lru_cache(None)
def build_files_text():
    """What the build's own files say: a /tmp path one of them uses is a
    default of the tools, not a path of someone's machine."""
    paths = [os.path.join(ROOT, "Makefile"), *glob.glob(os.path.join(ROOT, "**", "*.mk"), recursive=True),
             *glob.glob(os.path.join(ROOT, "scripts", "*")), os.path.join(ROOT, "tests", "run.sh")]
    return "\n".join(open(p, errors="replace").read() for p in paths if os.path.isfile(p))


def outside_problems(rel, text):
    out = [f"{rel}: names {m}, a path outside the repo" for m in OUTSIDE.findall(text)]
    for m in TMP.findall(prose(text)):
        if m.rstrip("/") not in build_files_text():
            out.append(f"{rel}: names {m} outside a command block (a path of one machine)")
    return out


def syntax_problems(rel, text, tmp_path):
    out = []
    for i, (body, line) in enumerate(commands(text)):
        script = tmp_path / f"block{i}.sh"
        script.write_text(body)
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            out.append(f"{rel}: the command block at line {line} does not parse: {r.stderr.strip()}")
    return out


def flag_uses(text):
    """(prog, flag) for each flag a command block or an inline command gives
    psd or workerd, with the flags of a shell variable (P="--a --b") counted
    for the psd or workerd line that expands it."""
    uses = []
    for body, _ in commands(text):
        uses += flags_in_text(body)
        for name, value in re.findall(r"^\s*([A-Za-z_]\w*)=[\"']([^\"']*)[\"']", body, re.M):
            for prog, rest in re.findall(r"\b(psd|workerd)\b(.*)", body):
                if re.search(rf"\${{?{name}\b", rest):
                    uses += [(prog, f) for f in re.findall(r"(?<![\w-])--([a-z][a-z_]*)", value)]
    for span in code_spans(text):
        uses += flags_in_text(span)
    return uses


def flag_problems(rel, text):
    return unknown_flags([(rel, prog, f) for prog, f in flag_uses(text) if f != "help"])


@functools.lru_cache(None)
def make_targets():
    """Every target the Makefile (with what it includes) defines: make's own
    database, read without running anything."""
    r = subprocess.run(["make", "-pRrq", "-C", ROOT, ":"], capture_output=True, text=True, timeout=120)
    targets = set(re.findall(r"^([A-Za-z0-9][^$#/\t=:]*):(?!=)", r.stdout, re.M))
    assert {"all", "test", "demo"} <= targets, f"make's database lists no targets: {r.stderr[-2000:]}"
    return targets


def make_uses(text):
    chunks = [b for b, _ in commands(text)] + code_spans(text)
    out = []
    for chunk in chunks:
        for m in re.finditer(r"(?:^|[\s;&|(])make((?:[ \t]+(?:-\S+|[A-Z_]+=\S*))*)((?:[ \t]+[a-z][\w.-]*)*)", chunk, re.M):
            out += m.group(2).split()
    return out


def make_problems(rel, text):
    return [f"{rel}: make {t}: the Makefile has no such target" for t in make_uses(text)
            if t not in make_targets()]


CHECKS = {
    "links": lambda rel, text, tmp: link_problems(rel, text),
    "paths": lambda rel, text, tmp: path_problems(rel, text),
    "outside": lambda rel, text, tmp: outside_problems(rel, text),
    "syntax": syntax_problems,
    "flags": lambda rel, text, tmp: flag_problems(rel, text),
    "make": lambda rel, text, tmp: make_problems(rel, text),
}


def read(rel):
    return open(os.path.join(ROOT, rel)).read()


# ------------------------------------------------------------------------ tests

def test_the_pages_are_there():
    assert len(PAGES) >= 5, PAGES
    readme = read("README.md")
    # the two commands, word for word
    assert "make demo     # installs what is missing, builds, trains on Fashion-MNIST, shows where to look\n" in readme
    assert "make test     # installs what is missing (apt-get, pip), builds, runs every test\n" in readme
    for rel in PAGES[1:]:
        assert f"]({rel})" in readme, f"the README's links name no {rel}"


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("rel", PAGES)
def test_page(rel, check, tmp_path):
    problems = CHECKS[check](rel, read(rel), tmp_path)
    assert not problems, "\n".join(problems)


GOOD = """# A page

## Run it

See [the README](../README.md#the-two-commands), [below](#run-it) and
`client/libps/libps.h`; `make test` writes `tests/out/`.

```sh
$ bin/psd --port=0 --logdir= &
P="--train_steps=10"
bin/workerd $P --local
```
"""
BROKEN = {
    "links": [("", "[x](nothing.md)"), ("(#run-it)", "(#no-such-heading)"),
              ("README.md#the-two-commands", "README.md#no-such-section")],
    "paths": [("client/libps/libps.h", "client/libps.h")],
    "outside": [("`make test`", "/work/main/bin/psd, `make test`"), ("and\n", "and /tmp/mine/\n")],
    "syntax": [("--logdir= &", "--logdir= & (")],
    "flags": [("--port=0", "--no_such_flag"), ("--train_steps=10", "--no_such_step=10")],
    "make": [("`make test`", "`make no-such-target`")],
}


@pytest.mark.parametrize("check,old,new", [(c, o, n) for c, pairs in BROKEN.items() for o, n in pairs])
def test_each_check_sees_a_broken_page(check, old, new, tmp_path):
    rel = "docs/synthetic.md"
    assert not CHECKS[check](rel, GOOD, tmp_path), "the good page should pass"
    assert old in GOOD
    broken = GOOD + "\n" + new if old == "" else GOOD.replace(old, new)
    assert CHECKS[check](rel, broken, tmp_path), f"{check} misses {new!r}"


def test_the_readmes_curl_tour_runs(tmp_path):
    """The README's curl block, as written, against this build's psd on a free
    port (instead of 8000), in an empty folder; one wait for psd's port is put
    after its start, since the block's reader types slower than bash runs."""
    readme = read("README.md")
    body = next(b for b, _ in commands(readme) if "bin/psd --port=8000 &" in b)
    port = str(free_port())
    lines = []
    for line in body.split("\n"):
        if line.strip() == "make":
            continue
        line = line.replace("8000", port).replace("bin/psd", os.path.join(BIN, "psd"))
        lines.append(line.replace("curl ", "curl -sS --fail-with-body ", 1) if line.startswith("curl") else line)
        if "/psd " in line:
            lines.append(f"for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:{port}/healthz && break; "
                         "sleep 0.1; done")
    script = tmp_path / "tour.sh"
    # whatever fails, the psd the block started is stopped when the script ends
    script.write_text("set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"
                      + "\n".join(lines) + "\nwait\n")
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"global_step":1' in r.stdout.replace(" ", ""), r.stdout
    assert (tmp_path / "params.safetensors").stat().st_size > 24
