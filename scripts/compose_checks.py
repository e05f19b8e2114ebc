#!/usr/bin/env python3
"""Cross-file checks for docker/compose.yaml, deploy/prometheus and deploy/grafana.

    compose_checks.py            (run from the repository root)

Checks what a schema cannot: files and folders the compose file mounts or builds from
exist; named volumes and depends_on targets are declared; Prometheus scrapes the
layertap service on its container port; Grafana's provisioning points at the mounted
dashboard folder; the dashboard parses, has unique panel ids and uses one datasource
reference, the DS_PROMETHEUS variable, defaulting to the provisioned datasource uid.
Exit 1 with one line per problem.
"""

from __future__ import annotations

import json
import pathlib
import sys

import yaml

ROOT = pathlib.Path.cwd()
COMPOSE = ROOT / "docker" / "compose.yaml"
errors: list[str] = []


def err(msg: str) -> None:
    errors.append(msg)


def main() -> int:
    compose = yaml.safe_load(COMPOSE.read_text())
    base = COMPOSE.parent
    services = compose.get("services") or {}
    volumes = set((compose.get("volumes") or {}).keys())

    for name, svc in services.items():
        b = svc.get("build")
        if isinstance(b, dict):
            ctx = (base / b.get("context", ".")).resolve()
            if not ctx.is_dir():
                err(f"{name}: build context {ctx} missing")
            df = ctx / b.get("dockerfile", "Dockerfile")
            if not df.is_file():
                err(f"{name}: dockerfile {df} missing")
        for v in svc.get("volumes") or []:
            src = v.split(":")[0] if isinstance(v, str) else v.get("source")
            if src and src.startswith((".", "/")):
                if not (base / src).exists():
                    err(f"{name}: bind mount source {src} does not exist")
            elif src and src not in volumes:
                err(f"{name}: named volume {src} is not declared under volumes:")
        deps = svc.get("depends_on") or {}
        for d in (deps if isinstance(deps, list) else deps.keys()):
            if d not in services:
                err(f"{name}: depends_on unknown service {d}")

    lt = services.get("layertap")
    if not lt:
        err("no layertap service")
        return finish()
    env = lt.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    if env.get("LAYERTAP_API_KEY") == "":
        err("layertap: LAYERTAP_API_KEY is set to an empty string")
    port = "8080"
    container_ports = {str(p).split(":")[-1] for p in lt.get("ports") or []}
    if port not in container_ports:
        err(f"layertap: container port {port} is not published")
    hc = " ".join(lt.get("healthcheck", {}).get("test", []))
    if f":{port}/" not in hc:
        err("layertap: healthcheck does not probe the container port")

    # Prometheus scrapes layertap:8080
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom.get("scrape_configs") or [] for sc in job.get("static_configs") or []
               for t in sc.get("targets") or []]
    if f"layertap:{port}" not in targets:
        err(f"deploy/prometheus/prometheus.yml does not scrape layertap:{port} (targets: {targets})")

    # Grafana provisioning
    gf = services.get("grafana") or {}
    mounts = {}
    for v in gf.get("volumes") or []:
        parts = v.split(":")
        mounts[parts[1]] = parts[0]
    ds_file = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml"
    ds = yaml.safe_load(ds_file.read_text())
    uids = {d.get("uid") for d in ds.get("datasources") or [] if d.get("type") == "prometheus"}
    if not uids:
        err(f"{ds_file}: no prometheus datasource")
    for d in ds.get("datasources") or []:
        if d.get("url") != "http://prometheus:9090":
            err(f"{ds_file}: datasource url {d.get('url')} is not the prometheus service")
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/layertap.yaml").read_text())
    dash_dirs = [p["options"]["path"] for p in prov.get("providers") or []]
    dash_mounts = [dst for dst, src in mounts.items() if src.endswith("layertap-dashboard.json")]
    if not any(m.startswith(d.rstrip("/") + "/") for m in dash_mounts for d in dash_dirs):
        err(f"grafana: the dashboard is mounted at {dash_mounts}, outside the provisioned paths {dash_dirs}")
    if "/etc/grafana/provisioning" not in mounts:
        err("grafana: provisioning folder not mounted on /etc/grafana/provisioning")

    # Dashboard
    dash_path = ROOT / "deploy/grafana/layertap-dashboard.json"
    dash = json.loads(dash_path.read_text())
    for k in ("title", "uid", "panels", "schemaVersion"):
        if k not in dash:
            err(f"{dash_path.name}: no {k}")
    var = next((v for v in dash.get("templating", {}).get("list", []) if v.get("name") == "DS_PROMETHEUS"), None)
    if not var or var.get("type") != "datasource" or var.get("query") != "prometheus":
        err(f"{dash_path.name}: no datasource variable DS_PROMETHEUS of type prometheus")
    elif (var.get("current") or {}).get("value") not in uids:
        err(f"{dash_path.name}: DS_PROMETHEUS defaults to {var['current'].get('value')}, not a provisioned uid {uids}")
    ids = set()

    def walk(panels):
        for p in panels or []:
            if p.get("id") in ids:
                err(f"{dash_path.name}: duplicate panel id {p.get('id')}")
            ids.add(p.get("id"))
            if "gridPos" not in p:
                err(f"{dash_path.name}: panel {p.get('title')} has no gridPos")
            refs = [p.get("datasource")] + [t.get("datasource") for t in p.get("targets") or []]
            for r in refs:
                if p.get("type") == "row" or r is None:
                    continue
                if r != {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}:
                    err(f"{dash_path.name}: panel {p.get('title')} uses datasource {r}")
            if p.get("type") != "row" and not p.get("targets"):
                err(f"{dash_path.name}: panel {p.get('title')} has no query")
            walk(p.get("panels"))

    walk(dash.get("panels"))
    return finish()


def finish() -> int:
    for e in errors:
        print(f"ERROR {e}")
    if not errors:
        print("ok: compose, Prometheus and Grafana files are consistent")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
