#!/usr/bin/env python3
"""Queries a Prometheus that scrapes layertap, for scripts/prometheus-scrape-test.sh.

    prom_query_check.py --prom http://127.0.0.1:P --layertap http://127.0.0.1:L
                        [--timeout 60] [--dashboard deploy/grafana/layertap-dashboard.json]

Until every check passes or --timeout seconds pass, it sends one small request to
layertap (so counters keep moving between scrapes) and evaluates:
  up{job="layertap"} == 1, layertap_tokens_total > 0, a rate over it > 0,
  p95 of layertap_request_duration_seconds for /v1/hidden-states > 0, encoded bytes > 0.
Then every PromQL query of the dashboard (Grafana variables replaced) must evaluate
without error. Exit 0 on success, 1 otherwise. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

CHECKS = [
    ("target up", 'up{job="layertap"}', lambda v: v == 1),
    ("tokens counter", "layertap_tokens_total", lambda v: v > 0),
    ("tokens/s", "sum(rate(layertap_tokens_total[10s]))", lambda v: v > 0),
    ("p95 latency /v1/hidden-states",
     'histogram_quantile(0.95, sum by (le) (rate(layertap_request_duration_seconds_bucket{route="/v1/hidden-states"}[10s])))',
     lambda v: v > 0),
    ("requests 200", 'sum(layertap_requests_total{route="/v1/hidden-states",status="200"})', lambda v: v > 0),
    ("encoded bytes", 'sum(layertap_hidden_state_bytes_total{stage="encoded"})', lambda v: v > 0),
    ("batch tokens mean", "sum(rate(layertap_batch_tokens_sum[10s])) / sum(rate(layertap_batch_tokens_count[10s]))",
     lambda v: v > 0),
]


def http_json(url: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 10):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"error": body.decode(errors="replace")}


def query(prom: str, q: str):
    status, body = http_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    if status != 200 or body.get("status") != "success":
        return None, body.get("error", f"HTTP {status}")
    return body["data"], None


def scalar(data) -> float | None:
    if not data:
        return None
    res = data["result"]
    if data["resultType"] == "scalar":
        return float(res[1])
    if not res:
        return None
    return float(res[0]["value"][1])


def send_request(layertap: str, i: int) -> int:
    body = json.dumps({"inputs": [{"input_ids": [1 + i % 7, 2, 3, 4]}, {"input_ids": [5, 6]}], "layers": [1, -1]})
    req = urllib.request.Request(f"{layertap}/v1/hidden-states", data=body.encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status


def dashboard_queries(path: str) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels or []:
            for t in p.get("targets") or []:
                if isinstance(t.get("expr"), str) and t["expr"].strip():
                    out.append((f"{p.get('title')} [{t.get('refId')}]", t["expr"]))
            walk(p.get("panels"))

    walk(dash.get("panels"))
    return out


def grafana_to_promql(expr: str) -> str:
    subs = {"__rate_interval": "10s", "__interval": "5s", "__range": "1m", "__range_s": "60",
            "__interval_ms": "5000"}
    def var(m):
        name = m.group(1) or m.group(2)
        return subs.get(name, ".*")          # template variables: match everything
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", var, expr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prom", required=True)
    ap.add_argument("--layertap", required=True)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--dashboard")
    a = ap.parse_args()
    for url in (a.prom, a.layertap):
        host = urllib.parse.urlparse(url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit(f"refusing a non-loopback address: {url}")

    deadline = time.monotonic() + a.timeout
    results: dict[str, tuple[float | None, str | None]] = {}
    i = 0
    # One request per round: a series first scraped after all requests were sent would
    # show a rate of 0, so counters must move between scrapes.
    while True:
        code = send_request(a.layertap, i)
        i += 1
        if code != 200:
            print(f"request {i}: HTTP {code}")
        results = {}
        for name, q, ok in CHECKS:
            data, err = query(a.prom, q)
            v = scalar(data) if data else None
            results[name] = (v, err)
        if all(results[name][0] is not None and not math.isnan(results[name][0]) and ok(results[name][0])
               for name, _, ok in CHECKS):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(1)

    failed = 0
    for name, q, ok in CHECKS:
        v, err = results[name]
        good = err is None and v is not None and not math.isnan(v) and ok(v)
        failed += not good
        shown = f"error: {err}" if err else v
        print(f"{'PASS' if good else 'FAIL'} {name}: {q} = {shown}")
    print(f"({i} requests sent to layertap)")

    if a.dashboard:
        qs = dashboard_queries(a.dashboard)
        empty, bad = [], 0
        for where, expr in qs:
            data, err = query(a.prom, grafana_to_promql(expr))
            if err:
                bad += 1
                print(f"FAIL dashboard query {where}: {err}\n     {expr}")
            elif not data["result"]:
                empty.append(where)
        failed += bad
        print(f"{'FAIL' if bad or not qs else 'PASS'} dashboard: {len(qs)} queries evaluated by Prometheus, "
              f"{bad} invalid, {len(qs) - bad - len(empty)} with data")
        failed += not qs
        for where in empty:
            print(f"     no data (valid query, no matching series yet): {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
