#!/usr/bin/env python3
"""Check that every metric a Grafana dashboard queries is exported.

    check_dashboard_metrics.py DASHBOARD.json METRICS.txt [--allow NAME ...] [--list]

DASHBOARD.json: a Grafana dashboard (panel targets' "expr", nested row panels, and
templating queries such as label_values(metric, label) are read).
METRICS.txt: a Prometheus text exposition, e.g. `curl -s host:port/metrics > METRICS.txt`.

Every metric name referenced by the PromQL is extracted (functions, aggregation
operators, keywords, label matchers, label lists, durations, numbers and Grafana
variables are ignored); _bucket/_sum/_count are stripped to the histogram's base name.
Exit 0 when all are present, 1 listing the missing ones, 2 on bad input (unreadable
files, or a dashboard that references no metric at all).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

HIST_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that are followed by "(" but are not functions, or are bare keywords.
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2", "inf", "nan", "start", "end", "step",
}

IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
DURATION = re.compile(r"(?<![\w.])(?:\d+(?:ms|[smhdwy]))+(?![\w])")
NUMBER = re.compile(r"(?<![\w.])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
NAME_MATCHER = re.compile(r'__name__\s*=\s*"([A-Za-z_:][A-Za-z0-9_:]*)"')
LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by one PromQL expression."""
    names = set(NAME_MATCHER.findall(expr))
    s = GRAFANA_VAR.sub(" ", expr)
    s = STRING.sub('""', s)
    s = re.sub(r"\{[^{}]*\}", " ", s)            # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)          # range / subquery selectors
    s = LABEL_LIST.sub(" ", s)                   # by (...), on (...), ...
    s = re.sub(r"#[^\n]*", " ", s)               # comments
    s = DURATION.sub(" ", s)                     # offset 1h, @ durations
    s = NUMBER.sub(" ", s)
    for m in IDENT.finditer(s):
        word = m.group(1)
        rest = s[m.end():].lstrip()
        if word.lower() in KEYWORDS:
            continue
        if rest.startswith("("):                 # a function or aggregation operator
            continue
        names.add(word)
    return names


def template_exprs(query: str) -> list[str]:
    """PromQL inside a Grafana Prometheus variable query."""
    q = query.strip()
    m = re.fullmatch(r"label_values\((.*),\s*[A-Za-z_]\w*\s*\)", q, re.DOTALL)
    if m:
        return [m.group(1)]
    if re.fullmatch(r"label_values\(\s*[A-Za-z_]\w*\s*\)", q) or q.startswith("label_names("):
        return []
    m = re.fullmatch(r"query_result\((.*)\)", q, re.DOTALL)
    if m:
        return [m.group(1)]
    m = re.fullmatch(r"metrics\((.*)\)", q, re.DOTALL)
    if m:
        return []                                # a regex over names, not a reference
    return [q]


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) for every query in the dashboard."""
    out: list[tuple[str, str]] = []

    def walk_panels(panels, path):
        for p in panels or []:
            title = p.get("title") or f"panel {p.get('id')}"
            for t in p.get("targets") or []:
                if isinstance(t, dict) and isinstance(t.get("expr"), str) and t["expr"].strip():
                    out.append((f"{path}{title} [{t.get('refId', '?')}]", t["expr"]))
            walk_panels(p.get("panels"), f"{path}{title} / ")

    walk_panels(dash.get("panels"), "")
    for r in dash.get("rows") or []:                       # pre-5.0 layout
        walk_panels(r.get("panels"), f"{r.get('title', 'row')} / ")
    for v in (dash.get("templating") or {}).get("list") or []:
        if v.get("type") != "query":
            continue
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str) and q.strip():
            for e in template_exprs(q):
                out.append((f"variable ${v.get('name')}", e))
    return out


def exposition_names(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP", "UNIT"):
                names.add(parts[2])
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)", line)
        if m:
            names.add(m.group(1))
    return names


def base_name(name: str) -> str:
    for suf in HIST_SUFFIXES:
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dashboard")
    ap.add_argument("metrics")
    ap.add_argument("--allow", action="append", default=[],
                    help="a metric name not expected in the exposition (e.g. up); repeatable")
    ap.add_argument("--list", action="store_true", help="print every referenced metric")
    a = ap.parse_args(argv)
    try:
        with open(a.dashboard, encoding="utf-8") as f:
            dash = json.load(f)
        with open(a.metrics, encoding="utf-8") as f:
            exported = exposition_names(f.read())
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "dashboard" in dash and "panels" not in dash:      # API export wrapper
        dash = dash["dashboard"]

    used: dict[str, set[str]] = defaultdict(set)
    for where, expr in dashboard_exprs(dash):
        for n in metric_names(expr):
            b = base_name(n)
            # A histogram is checked by its base name; a name that merely ends in
            # _count/_sum (and is exported as such) is checked as it is.
            used[n if n in exported and b not in exported else b].add(where)
    if not used:
        print(f"error: no metric referenced in {a.dashboard}", file=sys.stderr)
        return 2
    if not exported:
        print(f"error: no metric in {a.metrics}", file=sys.stderr)
        return 2

    missing = sorted(n for n in used if n not in exported and n not in a.allow)
    if a.list:
        for n in sorted(used):
            print(f"{'MISSING' if n in missing else 'ok':8} {n}")
    if missing:
        print(f"{len(missing)} of {len(used)} metrics used by {a.dashboard} are not in {a.metrics}:")
        for n in missing:
            print(f"  {n}  (used by: {'; '.join(sorted(used[n]))})")
        return 1
    print(f"ok: all {len(used)} metrics used by {a.dashboard} are in {a.metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
