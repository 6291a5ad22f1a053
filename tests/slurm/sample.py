#!/usr/bin/env python3
"""Samples the jobs' processes of tests/slurm-timeshare.sh through /proc every 20 ms, until the
file STOP exists: for each pair of jobs, the samples in which both were runnable (state R) while
allowed on a common CPU, which would be two jobs on one CPU at once. Each job's process is named by
the `pid=` line its burn.py writes to DIR/<job>.out. Prints one JSON object: samples, per job the
samples it was seen runnable and stopped, and every clash (time, jobs, CPUs).

Usage: sample.py DIR STOP"""
import json
import os
import sys
import time


def cpus(text):
    out = set()
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def state_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            allowed = next(l for l in f if l.startswith("Cpus_allowed_list:")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return None
    # The state is the first field after the command name, which is in parentheses.
    return stat[stat.rindex(")") + 2], cpus(allowed)


directory, stop = sys.argv[1], sys.argv[2]
pids, seen, clashes, samples = {}, {}, [], 0
while not os.path.exists(stop):
    for name in os.listdir(directory):
        if name.endswith(".out") and name[:-4] not in pids:
            try:
                with open(os.path.join(directory, name)) as f:
                    pid = next((l.split("=", 1)[1].strip() for l in f if l.startswith("pid=")), None)
            except OSError:
                pid = None
            if pid:
                pids[name[:-4]] = int(pid)
    now = {job: state_of(pid) for job, pid in pids.items()}
    now = {job: s for job, s in now.items() if s}
    samples += 1
    for job, (state, _) in now.items():
        count = seen.setdefault(job, {"runnable": 0, "stopped": 0})
        count["runnable" if state == "R" else "stopped" if state in "TtD" else "other"] = \
            count.get("runnable" if state == "R" else "stopped" if state in "TtD" else "other", 0) + 1
    running = sorted((job, allowed) for job, (state, allowed) in now.items() if state == "R")
    for i, (a, ca) in enumerate(running):
        for b, cb in running[i + 1:]:
            if ca & cb:
                clashes.append({"t": round(time.time(), 3), "jobs": [a, b], "cpus": sorted(ca & cb)})
    time.sleep(0.02)
print(json.dumps({"samples": samples, "jobs": seen, "clashes": clashes}))
