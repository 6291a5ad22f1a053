#!/usr/bin/env python3
"""Writes a Standard Workload Format trace that made EASY's backfill pass quadratic in the
queue (issue 32): on 64 one-processor hosts, a job holds 63 for a long time and the head waits
for all 64; behind it N jobs that fit the free processor only by count (NEED processors, or one
for longer than the head will wait), then N one-second jobs, one every two seconds, each
backfilled and ended, so that every pass finds the cluster changed.

    tests/easy-worst-case.py OUT.swf [N] [NEED]   (N = 100000, NEED = 1: 200,002 jobs)
"""
import sys


def line(job, submit, run, procs):
    # Fields: number, submit, wait, run, allocated procs, cpu, memory, requested procs,
    # requested time, requested memory, status, user, group, application, queue, partition,
    # preceding job, think time.
    return f"{job} {submit} -1 {run} {procs} -1 -1 {procs} {run} -1 1 1 1 1 1 1 -1 -1\n"


def main():
    out = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    need = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with open(out, "w") as f:
        f.write("; MaxProcs: 64\n")
        f.write(line(1, 0, 10**7, 63))
        f.write(line(2, 1, 100, 64))
        job = 3
        for _ in range(n):
            f.write(line(job, 2, 2 * 10**7, need))
            job += 1
        for k in range(n):
            f.write(line(job, 3 + 2 * k, 1, 1))
            job += 1


if __name__ == "__main__":
    main()
