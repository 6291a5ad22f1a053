#!/usr/bin/env python3
"""How long moving a process into a cgroup v1 cpuset takes, two ways (root, v1 cpuset mounted):

  by pid:  a parent writes the child's pid to cgroup.procs (what topod's join does);
  itself:  the single-threaded child writes 0 to tasks (what topod::client::join_self does).

Each move is preceded by a pause (default 100 ms) as between job steps, so that the kernel's
cgroup migration lock starts cold each time. Prints the median and the maximum, in ms.

Usage: tests/cgroup-join-bench.py [MOVES] [PAUSE_MS]   (defaults 12 and 100)
"""
import os
import statistics
import sys
import time

MOVES = int(sys.argv[1]) if len(sys.argv) > 1 else 12
PAUSE = (int(sys.argv[2]) if len(sys.argv) > 2 else 100) / 1000

mount = next((line.split()[1] for line in open("/proc/mounts") if line.split()[0] == "cgroup" and "cpuset" in line.split()[3].split(",")), None)
if os.geteuid() != 0 or mount is None:
    sys.exit("tests/cgroup-join-bench.py: needs root and a cgroup v1 cpuset hierarchy")
base = os.path.join(mount, f"topo-join-bench-{os.getpid()}")
target = os.path.join(base, "job")
for d in (base, target):
    os.mkdir(d)
    for f in ("cpuset.cpus", "cpuset.mems"):
        with open(os.path.join(d, f), "w") as out:
            out.write(open(os.path.join(mount, f)).read())


def by_pid():
    pid = os.fork()
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    t = time.perf_counter()
    with open(os.path.join(target, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    took = time.perf_counter() - t
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return took


def itself():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        t = time.perf_counter()
        with open(os.path.join(target, "tasks"), "w") as f:
            f.write("0")
        os.write(w, repr(time.perf_counter() - t).encode())
        os._exit(0)
    os.close(w)
    took = float(os.read(r, 64))
    os.close(r)
    os.waitpid(pid, 0)
    return took


try:
    for name, move in (("by pid (cgroup.procs)", by_pid), ("itself (tasks, 0)", itself)) * 2:
        times = []
        for _ in range(MOVES):
            time.sleep(PAUSE)
            times.append(move() * 1000)
        print(f"{name:24} median {statistics.median(times):6.2f} ms   max {max(times):6.2f} ms   ({MOVES} moves, {PAUSE * 1000:.0f} ms apart)")
finally:
    os.rmdir(target)
    os.rmdir(base)
