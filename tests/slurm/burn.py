#!/usr/bin/env python3
"""A job's work for tests/slurm-timeshare.sh: spins on one CPU until it has had CPU_SECONDS of CPU
time (a stopped or frozen process gets none, so it ends only after it was resumed), writing to
OUT its pid, the CPUs it may run on at its start and end, and the wall-clock times.

Usage: burn.py OUT CPU_SECONDS"""
import os
import sys
import time


def allowed():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return "?"


out, cpu_s = sys.argv[1], float(sys.argv[2])
with open(out, "a") as f:
    f.write(f"pid={os.getpid()}\nallowed_start={allowed()}\nstart={time.time():.6f}\n")
while time.process_time() < cpu_s:
    pass
with open(out, "a") as f:
    f.write(f"allowed_end={allowed()}\nend={time.time():.6f}\n")
