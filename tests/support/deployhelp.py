"""Helpers of the deploy tests (test_deploy_files.py, test_container_build.py,
test_deploy_run.py): the binaries' flags as --help lists them, the flags that
files name, a small Dockerfile parser, and the entrypoint and the Slurm script
run with a made-up environment."""
import os
import re
import shutil
import subprocess

from conftest import BIN, ROOT, binary

DEPLOY = os.path.join(ROOT, "deploy")
CONTAINER = os.path.join(DEPLOY, "container")
K8S = os.path.join(DEPLOY, "k8s")
ENTRYPOINT = os.path.join(CONTAINER, "restps-entrypoint")
SBATCH = os.path.join(DEPLOY, "slurm", "restps.sbatch")
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
PROGRAMS = ("psd", "workerd")

_help = {}


def help_flags(prog):
    """The flag names `prog --help` lists."""
    if prog not in _help:
        out = subprocess.run([binary(prog), "--help"], capture_output=True, text=True,
                             timeout=30).stdout
        _help[prog] = set(re.findall(r"^\s+--([a-z_]+)", out, re.M))
        assert len(_help[prog]) > 5, f"{prog} --help lists no flags:\n{out}"
    return _help[prog]


def flag_names(args):
    """["--a=1", "--b", "x"] -> ["a", "b"]"""
    return [re.match(r"--([^=\s]*)", a).group(1) for a in args if a.startswith("--")]


def flags_in_text(text):
    """(prog, flag) for each --flag that follows psd or workerd on a line, up to
    the end of that command (#, ;, |, &&, `); flags after restps.sbatch are
    workerd's (the script hands its arguments to every worker)."""
    found = []
    for line in text.splitlines():
        for m in re.finditer(r"(?<![\w/.@-])(?:[\w./$-]*/)?(psd|workerd|restps\.sbatch)(?![\w@.-])(.*)", line):
            prog = "workerd" if m.group(1) == "restps.sbatch" else m.group(1)
            rest = re.split(r"\s#|;|\||&&|`", m.group(2))[0]
            found += [(prog, f) for f in re.findall(r"(?<![\w-])--([a-z][a-z_]*)", rest)]
    return found


def unknown_flags(uses):
    """uses: (where, prog, flag) triples; the ones prog --help does not list."""
    return [f"{where}: {prog} has no --{flag}" for where, prog, flag in uses
            if flag not in help_flags(prog)]


# ------------------------------------------------------------------ Dockerfiles

def parse_dockerfile(path):
    """The stages of a Dockerfile: [{"name", "base", "steps": [(INSTRUCTION, text)]}];
    continuation lines joined, comments dropped. Enough for the files here."""
    logical, cur = [], ""
    for line in open(path).read().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1].rstrip() + " "
            continue
        logical.append(cur + s)
        cur = ""
    assert not cur, f"{path}: ends inside a continued line"
    stages = []
    for line in logical:
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, f"{path}: FROM {rest}"
            stages.append({"base": m.group(1), "name": m.group(2) or str(len(stages)), "steps": []})
        else:
            assert stages, f"{path}: {instr} before FROM"
            stages[-1]["steps"].append((instr, rest))
    return stages


def copy_parts(text):
    """COPY's text -> (options dict, sources, destination)."""
    words = text.split()
    opts = {}
    while words and words[0].startswith("--"):
        k, _, v = words.pop(0)[2:].partition("=")
        opts[k] = v
    return opts, words[:-1], words[-1]


def apt_packages(stage):
    """The packages a stage's RUN lines give to apt-get install."""
    pkgs = []
    for instr, text in stage["steps"]:
        if instr != "RUN":
            continue
        for part in text.split("&&"):
            words = part.split()
            if "apt-get" in words and "install" in words:
                pkgs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return pkgs


def dockerignore(name):
    """The patterns of deploy/container/<name>.dockerignore (plain paths here)."""
    path = os.path.join(CONTAINER, name + ".dockerignore")
    return [l.strip().strip("/") for l in open(path) if l.strip() and not l.startswith("#")]


def copy_context(dest, ignore):
    """The build context as `docker build .` from the root sends it: the tree
    less the .dockerignore patterns (plain paths, matched from the root)."""
    def skip(folder, names):
        rel = os.path.relpath(folder, ROOT)
        return [n for n in names if os.path.normpath(os.path.join(rel, n)) in ignore]
    shutil.copytree(ROOT, dest, ignore=skip, symlinks=True)


# ------------------------------------------------- the entrypoint, the sbatch script

def bin_path():
    """PATH with the build under test first (the image has psd and workerd on PATH)."""
    return os.path.abspath(BIN) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")


def run_entrypoint(args, env, timeout=30):
    """Run restps-entrypoint with only the given variables (and PATH)."""
    e = {"PATH": bin_path()}
    e.update(env)
    return subprocess.run(["sh", ENTRYPOINT] + list(args), capture_output=True, text=True,
                          env=e, timeout=timeout)


def dry_run_argv(stdout):
    """The argv lines of a RESTPS_DRY_RUN=1 run (entrypoint or sbatch script)."""
    return [l[len("argv: "):] for l in stdout.splitlines() if l.startswith("argv: ")]
