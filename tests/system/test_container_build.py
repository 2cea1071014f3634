"""deploy/container's Dockerfiles, built natively (issue 8; no container engine
runs here): the build stage's COPY and make steps are done as written, in a
temporary copy of the build context (the tree less the .dockerignore), with the
stage's absolute paths moved under a temporary root; then, with dpkg's
records of this Debian 12 machine:
- every header the compiler read and every library the linker took belongs to
  the build stage's packages (or what they depend on);
- every shared library the built psd and workerd load (ldd) belongs to the
  runtime stage's packages, their dependencies, or the Essential packages every
  Debian image has; each library they name directly (NEEDED) to a package the
  stage names or an Essential one;
- every path a COPY takes exists: in the context, in the build's outputs, or
  in a package its stage installs.
Dockerfile.cuda's stages are on Ubuntu 22.04 (NVIDIA's images), which names
these libraries' packages as Debian 12 does; they are checked against this
machine's Debian records. Run once, on the normal build."""
import functools
import os
import re
import subprocess

import pytest

from conftest import BIN, ROOT
from deployhelp import (CONTAINER, DOCKERFILES, apt_packages, copy_context, copy_parts,
                        dockerignore, parse_dockerfile)

pytestmark = pytest.mark.skipif("asan" in BIN, reason="the image's build is checked once, "
                                "on the normal build (it builds its own binaries)")


@functools.lru_cache(maxsize=None)
def installed():
    """{package: (essential, [dependency groups: [alternatives]], [provides])} of dpkg."""
    out = subprocess.run(["dpkg-query", "-W", "-f",
                          "${Package}\t${db:Status-Abbrev}\t${Essential}\t${Pre-Depends}, ${Depends}\t${Provides}\n"],
                         capture_output=True, text=True, check=True).stdout
    pkgs = {}
    for line in out.splitlines():
        name, status, essential, deps, provides = line.split("\t")
        if not status.startswith("ii"):
            continue
        groups = [[re.sub(r"[:\s(].*", "", alt.strip()) for alt in g.split("|")]
                  for g in deps.split(",") if g.strip()]
        prov = [re.sub(r"[\s(].*", "", p.strip()) for p in provides.split(",") if p.strip()]
        pkgs[name] = (essential == "yes", groups, prov)
    return pkgs


def closure(names):
    """The packages names need, with every installed alternative and provider."""
    pkgs = installed()
    providers = {}
    for n, (_, _, prov) in pkgs.items():
        for p in prov:
            providers.setdefault(p, []).append(n)
    seen, todo = set(), list(names)
    while todo:
        n = todo.pop()
        for real in ([n] if n in pkgs else providers.get(n, [])):
            if real not in seen:
                seen.add(real)
                todo += [alt for g in pkgs[real][1] for alt in g]
    return seen


@functools.lru_cache(maxsize=None)
def essential():
    return frozenset(closure([n for n, (ess, _, _) in installed().items() if ess]))


@functools.lru_cache(maxsize=None)
def dpkg_files():
    """{path: package} from dpkg's file lists (what dpkg -S reads, read once)."""
    owners = {}
    info = "/var/lib/dpkg/info"
    for f in os.listdir(info):
        if f.endswith(".list"):
            with open(os.path.join(info, f), errors="replace") as lines:
                for line in lines:
                    owners.setdefault(line.rstrip("\n"), f[:-5].split(":")[0])
    return owners


def owner(path):
    """The package that installed a file (through usrmerge and alternatives
    links); None for a file of no package."""
    tries = [path, os.path.realpath(path)]
    tries += [t[4:] if t.startswith("/usr/") else "/usr" + t for t in list(tries)]
    return next((dpkg_files()[t] for t in tries if t in dpkg_files()), None)


def from_cuda_image(stage, path):
    """A file of NVIDIA's CUDA toolkit, which NVIDIA's images have in /usr/local/cuda."""
    return stage["base"].startswith("nvidia/cuda:") and \
        os.path.realpath(path).startswith(os.path.realpath("/usr/local/cuda") + "/")


def stages_of(name):
    return {s["name"]: s for s in parse_dockerfile(os.path.join(CONTAINER, name))}


def make_stage(stages):
    """The stage whose RUN runs make."""
    found = [s for s in stages.values() if any(i == "RUN" and re.match(r"make\b", t)
                                               for i, t in s["steps"])]
    assert len(found) == 1, [s["name"] for s in found]
    return found[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(name): does the build stage's COPY and make steps in a temporary
    root, once per Dockerfile; returns (that root, the make stage's name, its
    WORKDIR, make's BUILD folder)."""
    done = {}

    def build(name):
        if name not in done:
            done[name] = build_stage(name, str(tmp_path_factory.mktemp("image-" + name)))
        return done[name]
    return build


def build_stage(name, root):
    stages = stages_of(name)
    stage = make_stage(stages)
    context = os.path.join(root, ".context")
    copy_context(context, set(dockerignore(name)))
    workdir = "/"
    for instr, text in stage["steps"]:
        if instr == "WORKDIR":
            workdir = os.path.join(workdir, text)
            os.makedirs(root + workdir, exist_ok=True)
        elif instr == "COPY":
            opts, srcs, dest = copy_parts(text)
            assert not opts, f"{name}: the build stage copies from the context only: {text}"
            target = root + os.path.join(workdir, dest)
            for src in srcs:
                subprocess.run(["cp", "-a", os.path.join(context, src) + ("/." if src == "." else ""),
                                target], check=True)
        elif instr == "RUN" and re.match(r"make\b", text):
            # the stage's absolute paths, moved under the temporary root
            cmd = re.sub(r"(^|[\s=])/(?=\w)", lambda m: m.group(1) + root + "/", text)
            r = subprocess.run(["sh", "-c", cmd], cwd=root + workdir, capture_output=True,
                               text=True, timeout=240)
            assert r.returncode == 0, f"{name}: {cmd}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            build_dir = re.search(r"\bBUILD=(\S+)", text).group(1)
    return root, stage["name"], workdir, build_dir


def outputs(name, built):
    """The binaries the last stage copies from the build stage, as built here."""
    root, build, _, _ = built(name)
    paths = []
    for instr, text in parse_dockerfile(os.path.join(CONTAINER, name))[-1]["steps"]:
        opts, srcs, _ = copy_parts(text) if instr == "COPY" else ({}, [], None)
        if opts.get("from") == build:
            paths += [root + s for s in srcs]
    return paths


def needed(binary_path):
    out = subprocess.run(["readelf", "-d", binary_path], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def loaded(binary_path):
    out = subprocess.run(["ldd", binary_path], capture_output=True, text=True, check=True).stdout
    assert "not found" not in out, out
    # "libx.so.1 => /path (address)", and the loader's own line: "/path (address)"
    return [a or b for a, b in re.findall(r"=> (/\S+)|^\s*(/\S+) \(", out, re.M)]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_stage_builds_with_its_own_packages(name, built):
    stages = stages_of(name)
    stage = make_stage(stages)
    pkgs = apt_packages(stage)
    missing = [p for p in pkgs if p not in installed()]
    assert not missing, f"not installed here, so the build cannot be checked: {missing}"
    have = closure(pkgs) | essential()
    root, _, workdir, build_dir = built(name)
    bins = outputs(name, built)
    assert sorted(os.path.basename(b) for b in bins) == ["psd", "workerd"]
    # every header the compiler reads for each object built (-M: system ones too)
    src, obj = root + workdir, root + build_dir
    objs = [os.path.relpath(os.path.join(f, o), obj) for f, _, files in os.walk(obj)
            for o in files if o.endswith(".o")]
    sources = [os.path.join(src, o[:-2] + ".c") for o in objs if os.path.exists(os.path.join(src, o[:-2] + ".c"))]
    assert len(sources) > 20, objs
    # the Makefile's include folders, $(BUILD) the image's (generated headers: onnx.pb-c.h)
    makefile = open(os.path.join(src, "Makefile")).read()
    includes = [i.replace("$(BUILD)", obj) for i in re.findall(r"-I\$\(BUILD\)[^\s,)$]*|-I[^\s,)$]+", makefile)]
    deps = subprocess.run(["gcc", "-std=c11", "-D_GNU_SOURCE", *includes, "-M", *sources], cwd=src,
                          capture_output=True, text=True, check=True).stdout
    headers = {w for w in deps.replace("\\\n", " ").split() if w.startswith("/usr/") and w.endswith(".h")}
    assert any("microhttpd.h" in h for h in headers) and any("cblas.h" in h for h in headers), headers
    # every library the linker took: lib<x>.so of each NEEDED soname
    libs = set()
    for b in bins:
        assert os.access(b, os.X_OK), b
        for soname in needed(b):
            if soname.startswith("ld-linux"):
                continue  # the dynamic loader (libc6), which no -l names
            dev = subprocess.run(["gcc", f"-print-file-name={soname.split('.so')[0]}.so"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            assert os.path.isabs(dev), f"the linker finds no {soname.split('.so')[0]}.so"
            libs.add(dev)
    wrong = sorted({f"{f} ({owner(f)})" for f in headers | libs
                    if owner(f) not in have and not from_cuda_image(stage, f)})
    assert not wrong, f"{name}: the build stage's packages {pkgs} do not provide {wrong}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_stage_provides_every_shared_library(name, built):
    stage = parse_dockerfile(os.path.join(CONTAINER, name))[-1]
    pkgs = apt_packages(stage)
    have = closure(pkgs) | essential()
    problems = []
    for b in outputs(name, built):
        prog = os.path.basename(b)
        for lib in loaded(b):
            if owner(lib) not in have and not from_cuda_image(stage, lib):
                problems.append(f"{prog} loads {lib} of {owner(lib)}, which no package of the stage brings")
        for soname in needed(b):
            lib = [p for p in loaded(b) if os.path.basename(p) == soname]
            assert lib, (prog, soname)
            if owner(lib[0]) not in set(pkgs) | essential() and not from_cuda_image(stage, lib[0]):
                problems.append(f"{prog} links {soname} of {owner(lib[0])}: name it in the stage")
    assert not problems, f"{name} runtime packages {pkgs}:\n" + "\n".join(problems)
    # and the check sees a missing one
    short = [p for p in pkgs if p != "libopenblas0-pthread"]
    assert owner([l for b in outputs(name, built) for l in loaded(b) if "openblas" in l][0]) \
        not in closure(short) | essential()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists(name, built):
    stages = stages_of(name)
    root, build, _, _ = built(name)
    ignored = set(dockerignore(name))
    checked = 0
    for stage in stages.values():
        for instr, text in stage["steps"]:
            if instr != "COPY":
                continue
            opts, srcs, _ = copy_parts(text)
            for src in srcs:
                checked += 1
                if "from" not in opts:
                    assert os.path.exists(os.path.join(ROOT, src)), f"{name}: COPY {src}: no such path"
                    assert not any(src == i or src.startswith(i + "/") for i in ignored), \
                        f"{name}: COPY {src}, which the .dockerignore leaves out"
                elif opts["from"] == build:
                    assert os.path.exists(root + src), f"{name}: COPY --from={build} {src}: not built"
                else:
                    assert opts["from"] in stages, f"{name}: COPY --from={opts['from']}: no such stage"
                    assert owner(src) in apt_packages(stages[opts["from"]]), \
                        f"{name}: COPY --from={opts['from']} {src}: that stage installs no such path"
    assert checked >= 4
    # the entrypoint the image runs is one it copies, executable
    last = parse_dockerfile(os.path.join(CONTAINER, name))[-1]
    assert ("COPY", "deploy/container/restps-entrypoint /usr/local/bin/") in last["steps"]
    assert os.access(os.path.join(CONTAINER, "restps-entrypoint"), os.X_OK)
