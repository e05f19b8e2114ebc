#!/usr/bin/env python3
"""Runs a command and reports the CPU time another process (the server) spent meanwhile, per thread
name, user and system apart, from /proc/PID/task/*/stat.

    python3 bench/gpu/thread_cpu.py --pid SERVER_PID -- COMMAND [ARGS...]

The command's stdout passes through; when its last line is a JSON object, the figures are added to
it as "server_cpu" ({"total": {"user": s, "system": s}, "threads": {name: {"user", "system",
"count"}}, "exited": ...}); otherwise one JSON line of them follows. Threads that ended during the
command are counted under "exited" (the process's totals include them, so "exited" is the total less
the live threads). The kernel splits each figure into user and system time by estimate, separately for
the process and for each thread, so "exited" can show a small negative user or system share while its
sum stays right. layertap names its threads:
layertap-http (the runtime's workers: sockets, HTTP), layertap-encode (its blocking threads:
tokenizing, encoding answers), layertap-<device> (launching batches), finish-<device> (waiting for a
batch's results and handing them out), layertap-trim (returning idle memory).
"""
import argparse
import json
import os
import subprocess
import sys

TICK = os.sysconf("SC_CLK_TCK")


def fields(path):
    """(comm, utime, stime) in seconds from a /proc stat file; None when it is gone."""
    try:
        with open(path) as f:
            raw = f.read()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    # Fields 14 and 15 of stat(5); rest[0] is field 3.
    return comm, int(rest[11]) / TICK, int(rest[12]) / TICK


def snapshot(pid):
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        got = fields(f"/proc/{pid}/task/{tid}/stat")
        if got:
            threads[tid] = got
    return fields(f"/proc/{pid}/stat"), threads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        sys.exit("give the command to run after --")
    (_, u0, s0), before = snapshot(a.pid)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    (_, u1, s1), after = snapshot(a.pid)
    groups = {}
    live_u = live_s = 0.0
    for tid, (comm, u, s) in after.items():
        bu, bs = before.get(tid, (comm, 0.0, 0.0))[1:]
        g = groups.setdefault(comm, {"user": 0.0, "system": 0.0, "count": 0})
        g["user"] += u - bu
        g["system"] += s - bs
        g["count"] += 1
        live_u += u - bu
        live_s += s - bs
    # Threads that ended meanwhile: the process's totals hold all they did, and the live threads'
    # differences leave exactly that.
    report = {
        "total": {"user": round(u1 - u0, 2), "system": round(s1 - s0, 2)},
        "threads": {k: {"user": round(v["user"], 2), "system": round(v["system"], 2), "count": v["count"]}
                    for k, v in sorted(groups.items(), key=lambda kv: -(kv[1]["user"] + kv[1]["system"]))},
        "exited": {"user": round(u1 - u0 - live_u, 2), "system": round(s1 - s0 - live_s, 2)},
    }
    lines = out.stdout.rstrip("\n").split("\n") if out.stdout else []
    last = None
    if lines:
        try:
            last = json.loads(lines[-1])
        except ValueError:
            last = None
    if isinstance(last, dict):
        last["server_cpu"] = report
        lines[-1] = json.dumps(last)
        print("\n".join(lines))
    else:
        if lines:
            print("\n".join(lines))
        print(json.dumps({"server_cpu": report}))
    sys.exit(out.returncode)


if __name__ == "__main__":
    main()
