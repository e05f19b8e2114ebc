#!/usr/bin/env python3
"""Helpers for scripts/validate-k8s.sh.

  k8s_manifest_checks.py render K8S_DIR            > rendered.yaml
      Renders the kustomization without kustomize, for the subset k8s/ uses
      (resources, namespace, labels without selectors, images). Used only when
      kubectl (which bundles kustomize) is not installed.
  k8s_manifest_checks.py extract RENDERED KIND     > docs.json
      Writes the documents of one kind as a JSON list (for the CRD validator).
  k8s_manifest_checks.py servicemonitor RENDERED
      Structural check of monitoring.coreos.com/v1 ServiceMonitors (required fields
      and types); the fallback when the CRD schema validator cannot run.
  k8s_manifest_checks.py consistency K8S_DIR RENDERED
      Cross-object checks no schema can make: selectors match pod labels, named
      ports exist, probes hit the service's routes, grace period covers preStop +
      shutdown timeout, references resolve, every manifest is in the kustomization
      (but the standalone ones, STANDALONE).
  k8s_manifest_checks.py bulkjob K8S_DIR RENDERED
      Checks of the standalone `layertap bulk` Job (bulk-job.yaml, with its claim in
      bulk-data-pvc.yaml) against the rendered kustomization: an Indexed Job whose
      completions, parallelism and --shard denominator agree, pointing at a Service
      (name and port) that exists and selects the server pods, not its own, writing
      --input/--out on a mounted ReadWriteMany claim, non-root, with resources.
Exit status 1 with one line per problem.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import yaml


def load_all(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render(k8s_dir: str) -> int:
    root = pathlib.Path(k8s_dir)
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    supported = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    unknown = set(kust) - supported
    if unknown:
        print(f"render: kustomization fields {sorted(unknown)} need real kustomize (install kubectl)", file=sys.stderr)
        return 1
    images = {i["name"]: i for i in kust.get("images") or []}
    docs = []
    for res in kust.get("resources") or []:
        for d in load_all(root / res):
            md = d.setdefault("metadata", {})
            if kust.get("namespace") and d.get("kind") != "Namespace":
                md["namespace"] = kust["namespace"]
            for entry in kust.get("labels") or []:
                if entry.get("includeSelectors"):
                    print("render: labels.includeSelectors needs real kustomize", file=sys.stderr)
                    return 1
                md.setdefault("labels", {}).update(entry.get("pairs") or {})
                if entry.get("includeTemplates") and d.get("kind") == "Deployment":
                    d["spec"]["template"]["metadata"].setdefault("labels", {}).update(entry["pairs"])
            pod = (d.get("spec") or {}).get("template", {}).get("spec") if d.get("kind") == "Deployment" else None
            for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name in images:
                    i = images[name]
                    c["image"] = f"{i.get('newName', name)}:{i.get('newTag', tag or 'latest')}"
            docs.append(d)
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


def extract(rendered: str, kind: str) -> int:
    json.dump([d for d in load_all(rendered) if d.get("kind") == kind], sys.stdout)
    return 0


DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")


def servicemonitor(rendered: str) -> int:
    errors = []
    sms = [d for d in load_all(rendered) if d.get("kind") == "ServiceMonitor"]
    for d in sms:
        name = (d.get("metadata") or {}).get("name")
        where = f"ServiceMonitor/{name}"
        if d.get("apiVersion") != "monitoring.coreos.com/v1":
            errors.append(f"{where}: apiVersion must be monitoring.coreos.com/v1")
        if not isinstance(name, str) or not name:
            errors.append(f"{where}: metadata.name is required")
        spec = d.get("spec")
        if not isinstance(spec, dict):
            errors.append(f"{where}: spec is required")
            continue
        sel = spec.get("selector")
        if not isinstance(sel, dict):
            errors.append(f"{where}: spec.selector is required")
        elif not (sel.get("matchLabels") or sel.get("matchExpressions")):
            errors.append(f"{where}: spec.selector selects every Service (no matchLabels/matchExpressions)")
        eps = spec.get("endpoints")
        if not isinstance(eps, list) or not eps:
            errors.append(f"{where}: spec.endpoints must be a non-empty list")
            continue
        for i, ep in enumerate(eps):
            if not isinstance(ep, dict):
                errors.append(f"{where}: endpoints[{i}] must be an object")
                continue
            if not (isinstance(ep.get("port"), str) or "targetPort" in ep):
                errors.append(f"{where}: endpoints[{i}] needs port (a Service port name) or targetPort")
            for k in ("interval", "scrapeTimeout"):
                if k in ep and not (isinstance(ep[k], str) and DURATION.match(ep[k])):
                    errors.append(f"{where}: endpoints[{i}].{k} {ep[k]!r} is not a duration")
            if "path" in ep and not str(ep["path"]).startswith("/"):
                errors.append(f"{where}: endpoints[{i}].path must start with /")
    if not sms:
        errors.append("no ServiceMonitor in the rendered manifests")
    for e in errors:
        print(f"ERROR {e}")
    if not errors:
        print(f"ok: {len(sms)} ServiceMonitor(s) pass the structural check")
    return 1 if errors else 0


# Applied on their own, not by `kubectl apply -k` (a Job runs once): see k8s/README.md.
STANDALONE = ("bulk-job.yaml", "bulk-data-pvc.yaml")


def _selects(selector: dict, labels: dict) -> bool:
    ml = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    return bool(ml) and all(labels.get(k) == v for k, v in ml.items())


def _seconds(s: str) -> int:
    return int(s)


# resource.Quantity, as the Kubernetes API parses it (the JSON schemas do not check it).
QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")


def consistency(k8s_dir: str, rendered: str) -> int:
    errors: list[str] = []
    docs = load_all(rendered)
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    # every manifest file is part of the kustomization
    root = pathlib.Path(k8s_dir)
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    listed = set(kust.get("resources") or [])
    for f in sorted(root.glob("*.y*ml")):
        if f.name in STANDALONE:
            if f.name in listed:
                errors.append(f"{f} is applied on its own (STANDALONE) but listed in {root}/kustomization.yaml")
            continue
        if f.name not in listed and f.name not in ("kustomization.yaml", "kustomization.yml"):
            errors.append(f"{f} is not listed in {root}/kustomization.yaml resources")

    deps = by_kind.get("Deployment", [])
    if len(deps) != 1:
        errors.append(f"expected one Deployment, found {len(deps)}")
    for dep in deps:
        name = dep["metadata"]["name"]
        tpl = dep["spec"]["template"]
        pod_labels = tpl["metadata"].get("labels", {})
        if not _selects(dep["spec"]["selector"], pod_labels):
            errors.append(f"Deployment/{name}: selector does not match its pod template labels")
        pod = tpl["spec"]
        cms = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
        pvcs = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
        for v in pod.get("volumes", []):
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in pvcs:
                errors.append(f"Deployment/{name}: volume {v['name']} uses PVC {claim}, not in the manifests")
        main = next((c for c in pod["containers"] if c["name"] == "layertap"), None)
        if main is None:
            errors.append(f"Deployment/{name}: no container named layertap")
            continue
        env = {}
        for ef in main.get("envFrom", []):
            ref = (ef.get("configMapRef") or {}).get("name")
            if ref:
                if ref not in cms:
                    errors.append(f"Deployment/{name}: envFrom ConfigMap {ref} not in the manifests")
                else:
                    env.update(cms[ref].get("data") or {})
        for e in main.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
        secret_env = [e for e in main.get("env", []) if (e.get("valueFrom") or {}).get("secretKeyRef")]
        if not any(e["name"] == "LAYERTAP_API_KEY" for e in secret_env):
            errors.append(f"Deployment/{name}: LAYERTAP_API_KEY must come from a secretKeyRef")
        if "LAYERTAP_API_KEY" in env:
            errors.append(f"Deployment/{name}: LAYERTAP_API_KEY set in plain text (ConfigMap or value)")
        ports = {p.get("name"): p["containerPort"] for p in main.get("ports", [])}
        listen = int(env.get("LAYERTAP_PORT", 8080))
        if ports.get("http") != listen:
            errors.append(f"Deployment/{name}: container port http={ports.get('http')} but LAYERTAP_PORT={listen}")
        want = {"startupProbe": None, "readinessProbe": "/ready", "livenessProbe": "/health"}
        for probe, path in want.items():
            p = main.get(probe)
            if not p or "httpGet" not in p:
                errors.append(f"Deployment/{name}: {probe} (httpGet) missing")
                continue
            if path and p["httpGet"].get("path") != path:
                errors.append(f"Deployment/{name}: {probe} path {p['httpGet'].get('path')} != {path}")
            if p["httpGet"].get("port") not in ("http", listen):
                errors.append(f"Deployment/{name}: {probe} port {p['httpGet'].get('port')} is not the http port")
        sp = main.get("startupProbe") or {}
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        if budget < 300:
            errors.append(f"Deployment/{name}: startupProbe allows {budget}s for the model load (< 300s)")
        pre = ((main.get("lifecycle") or {}).get("preStop") or {})
        pre_s = 0
        if "sleep" in pre:
            pre_s = int(pre["sleep"]["seconds"])
        elif "exec" in pre:
            cmd = pre["exec"].get("command", [])
            if len(cmd) == 2 and cmd[0] == "sleep":
                pre_s = int(cmd[1])
        if pre_s <= 0:
            errors.append(f"Deployment/{name}: no preStop sleep (endpoint removal races SIGTERM)")
        shutdown = _seconds(env.get("LAYERTAP_SHUTDOWN_TIMEOUT", "30"))
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= pre_s + shutdown:
            errors.append(f"Deployment/{name}: terminationGracePeriodSeconds {grace} <= preStop {pre_s}s + "
                          f"LAYERTAP_SHUTDOWN_TIMEOUT {shutdown}s")
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            for section in ("requests", "limits"):
                for res, q in ((c.get("resources") or {}).get(section) or {}).items():
                    if not QUANTITY.match(str(q)):
                        errors.append(f"Deployment/{name}: container {c['name']} {section}.{res} {q!r} is not a quantity")
        limits = (main.get("resources") or {}).get("limits") or {}
        if str(limits.get("nvidia.com/gpu")) != "1":
            errors.append(f"Deployment/{name}: limits nvidia.com/gpu must be 1")
        if not str(env.get("LAYERTAP_DEVICE", "cpu")).startswith("cuda"):
            errors.append(f"Deployment/{name}: a GPU is requested but LAYERTAP_DEVICE is {env.get('LAYERTAP_DEVICE', 'cpu')}")
        if not (main.get("resources") or {}).get("requests", {}).get("cpu"):
            errors.append(f"Deployment/{name}: no CPU request (the CPU metric of the HPA needs one)")

        svcs = [s for s in by_kind.get("Service", []) if _selects(s["spec"].get("selector", {}), pod_labels)]
        if not svcs:
            errors.append(f"Deployment/{name}: no Service selects its pods")
        for s in svcs:
            for sp_ in s["spec"]["ports"]:
                tp = sp_.get("targetPort", sp_["port"])
                if isinstance(tp, str) and tp not in ports:
                    errors.append(f"Service/{s['metadata']['name']}: targetPort {tp} is not a container port name")
        for pdb in by_kind.get("PodDisruptionBudget", []):
            if not _selects(pdb["spec"].get("selector", {}), pod_labels):
                errors.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selector matches no pod of Deployment/{name}")
        for hpa in by_kind.get("HorizontalPodAutoscaler", []):
            ref = hpa["spec"]["scaleTargetRef"]
            if (ref.get("kind"), ref.get("name")) != ("Deployment", name):
                errors.append(f"HorizontalPodAutoscaler/{hpa['metadata']['name']}: targets {ref.get('kind')}/{ref.get('name')}")
            lo, hi = hpa["spec"].get("minReplicas", 1), hpa["spec"]["maxReplicas"]
            if lo > hi:
                errors.append(f"HorizontalPodAutoscaler/{hpa['metadata']['name']}: minReplicas > maxReplicas")
            for pdb in by_kind.get("PodDisruptionBudget", []):
                ma = pdb["spec"].get("minAvailable")
                if isinstance(ma, int) and ma >= lo:
                    errors.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: minAvailable {ma} >= minReplicas {lo} blocks drains")
        for sm in by_kind.get("ServiceMonitor", []):
            matched = [s for s in svcs if _selects(sm["spec"].get("selector", {}), s["metadata"].get("labels", {}))]
            if not matched:
                errors.append(f"ServiceMonitor/{sm['metadata']['name']}: selector matches no Service of Deployment/{name}")
            for ep in sm["spec"].get("endpoints", []):
                for s in matched:
                    if ep.get("port") and ep["port"] not in {p.get("name") for p in s["spec"]["ports"]}:
                        errors.append(f"ServiceMonitor/{sm['metadata']['name']}: port {ep['port']} not on Service/{s['metadata']['name']}")
                if ep.get("path", "/metrics") != "/metrics":
                    errors.append(f"ServiceMonitor/{sm['metadata']['name']}: path {ep.get('path')} (layertap serves /metrics)")
    for e in errors:
        print(f"ERROR {e}")
    if not errors:
        print(f"ok: consistency checks pass ({len(docs)} objects)")
    return 1 if errors else 0


def _flag(args: list[str], name: str) -> str | None:
    """The value of --name in a command line (--name V or --name=V), the last one given."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def bulkjob(k8s_dir: str, rendered: str) -> int:
    errors: list[str] = []
    root = pathlib.Path(k8s_dir)
    docs = load_all(rendered)
    own = [d for f in STANDALONE if (root / f).exists() for d in load_all(root / f)]
    jobs = [d for d in own if d.get("kind") == "Job"]
    pvcs = {d["metadata"]["name"]: d for d in docs + own if d.get("kind") == "PersistentVolumeClaim"}
    services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
    deployments = [d for d in docs if d.get("kind") == "Deployment"]
    secrets_used = {
        ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
        for dep in deployments
        for c in dep["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    if len(jobs) != 1:
        errors.append(f"expected one Job in {', '.join(STANDALONE)}, found {len(jobs)}")
    for job in jobs:
        where = f"Job/{job['metadata']['name']}"
        spec = job["spec"]
        if job.get("apiVersion") != "batch/v1":
            errors.append(f"{where}: apiVersion must be batch/v1")
        if spec.get("completionMode") != "Indexed":
            errors.append(f"{where}: completionMode must be Indexed (JOB_COMPLETION_INDEX picks the shard)")
        n, par = spec.get("completions"), spec.get("parallelism")
        if not isinstance(n, int) or n < 1:
            errors.append(f"{where}: completions must be a whole number >= 1, not {n!r}")
        if par != n:
            errors.append(f"{where}: parallelism {par!r} != completions {n!r} (one pod per shard, all at once)")
        if not isinstance(spec.get("backoffLimitPerIndex"), int):
            errors.append(f"{where}: no backoffLimitPerIndex (a failed shard should be retried on its own)")
        tpl = spec["template"]
        pod = tpl["spec"]
        pod_labels = (tpl.get("metadata") or {}).get("labels") or {}
        if pod.get("restartPolicy") != "Never":
            errors.append(f"{where}: restartPolicy must be Never (podFailurePolicy and per-index backoff need it)")
        sc = pod.get("securityContext") or {}
        if sc.get("runAsNonRoot") is not True or not sc.get("runAsUser"):
            errors.append(f"{where}: the pod must run as non-root (securityContext runAsNonRoot, runAsUser)")
        mounts_ok = {}
        for v in pod.get("volumes", []):
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                if claim not in pvcs:
                    errors.append(f"{where}: volume {v['name']} uses PVC {claim}, not in the manifests")
                elif isinstance(n, int) and n > 1 and "ReadWriteMany" not in pvcs[claim]["spec"].get("accessModes", []):
                    errors.append(f"{where}: PVC {claim} is not ReadWriteMany, but {n} pods write to it")
                mounts_ok[v["name"]] = claim
        bulk = [c for c in pod.get("containers", []) if (c.get("args") or [None])[0] == "bulk"]
        if len(bulk) != 1:
            errors.append(f"{where}: expected one container running `layertap bulk` (args starting with bulk)")
            continue
        c = bulk[0]
        args = [str(a) for a in c.get("args", [])]
        shard = _flag(args, "--shard")
        m = re.fullmatch(r"\$\(JOB_COMPLETION_INDEX\)/(\d+)", shard or "")
        if not m:
            errors.append(f"{where}: --shard must be $(JOB_COMPLETION_INDEX)/N, not {shard!r}")
        elif int(m.group(1)) != n:
            errors.append(f"{where}: --shard denominator {m.group(1)} != completions {n}: shards would be lost or overlap")
        if any(e.get("name") == "JOB_COMPLETION_INDEX" for e in c.get("env", [])):
            errors.append(f"{where}: JOB_COMPLETION_INDEX is set by the Job controller; do not override it")
        server = _flag(args, "--server")
        if not server:
            errors.append(f"{where}: no --server")
        for url in (server or "").split(","):
            um = re.fullmatch(r"http://([a-z0-9-]+)(\.[a-z0-9.-]+)?:(\d+)/?", url.strip())
            if not um:
                errors.append(f"{where}: --server {url!r} is not http://SERVICE:PORT")
                continue
            name, port = um.group(1), int(um.group(3))
            svc = services.get(name)
            if svc is None:
                errors.append(f"{where}: --server {url} names Service {name}, not in the kustomization")
                continue
            if port not in [p["port"] for p in svc["spec"]["ports"]]:
                errors.append(f"{where}: --server {url}: Service {name} has no port {port}")
            if _selects(svc["spec"].get("selector", {}), pod_labels):
                errors.append(f"{where}: Service {name} selects the Job's own pods")
            if not any(_selects(svc["spec"].get("selector", {}), d["spec"]["template"]["metadata"].get("labels", {}))
                       for d in deployments):
                errors.append(f"{where}: Service {name} selects no server pods")
        mounts = {vm["mountPath"].rstrip("/"): vm for vm in c.get("volumeMounts", [])}
        for flag in ("--input", "--out"):
            path = _flag(args, flag)
            if not path:
                errors.append(f"{where}: no {flag}")
                continue
            mount = next((mp for mp in mounts if path == mp or path.startswith(mp + "/")), None)
            if mount is None or mounts[mount]["name"] not in mounts_ok:
                errors.append(f"{where}: {flag} {path} is not on a mounted PersistentVolumeClaim")
            elif flag == "--out" and mounts[mount].get("readOnly"):
                errors.append(f"{where}: --out {path} is on a read-only mount")
        input_path = _flag(args, "--input") or ""
        if input_path.endswith(".parquet"):
            cols = [f for f in ("--text-column", "--messages-column", "--ids-column") if _flag(args, f)]
            if len(cols) != 1:
                errors.append(f"{where}: a Parquet --input needs exactly one of --text-column, --messages-column, "
                              f"--ids-column (has {cols})")
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if e.get("name") == "LAYERTAP_API_KEY" and ref and ref.get("name") not in secrets_used:
                errors.append(f"{where}: LAYERTAP_API_KEY from Secret {ref.get('name')}, which no server uses")
            if e.get("name") == "LAYERTAP_API_KEY" and "value" in e:
                errors.append(f"{where}: LAYERTAP_API_KEY set in plain text")
        res = c.get("resources") or {}
        for section, keys in (("requests", ("cpu", "memory")), ("limits", ("memory",))):
            for k in keys:
                q = (res.get(section) or {}).get(k)
                if q is None:
                    errors.append(f"{where}: container {c['name']} has no {section}.{k}")
                elif not QUANTITY.match(str(q)):
                    errors.append(f"{where}: container {c['name']} {section}.{k} {q!r} is not a quantity")
        csc = c.get("securityContext") or {}
        if csc.get("allowPrivilegeEscalation") is not False:
            errors.append(f"{where}: container {c['name']} must set allowPrivilegeEscalation: false")
    for e in errors:
        print(f"ERROR {e}")
    if not errors:
        print(f"ok: bulk Job checks pass ({len(jobs)} Job)")
    return 1 if errors else 0


def main(argv: list[str]) -> int:
    cmds = {"render": (render, 1), "extract": (extract, 2), "servicemonitor": (servicemonitor, 1),
            "consistency": (consistency, 2), "bulkjob": (bulkjob, 2)}
    if len(argv) < 1 or argv[0] not in cmds or len(argv) - 1 != cmds[argv[0]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    fn, _ = cmds[argv[0]]
    return fn(*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
