#!/usr/bin/env python3
"""An independent reference for `topoctl simulate --policy conservative` on plain one-processor
hosts: conservative backfilling on P identical processors, written from the definition
(Mu'alem and Feitelson 2001) and nothing of topo's code. At every event time, after that
time's ends and submits, every waiting job in submit order is reserved at the earliest start
from which its processors stay free for its estimate, given the running jobs' estimated ends
and the reservations of the jobs before it; the jobs whose start is now start. The profile is
planned again from scratch at every event (slow, simple). The trace's fields are read as
topoctl documents them (processors: field 8 else 5; estimate: field 9 raised to the run,
else the run; partial-execution lines and lines without run or processors left out; a
reservation lasts at least one second; an estimated end already reached counts from the next
second).

Usage: conservative.py TRACE.swf [PROCESSORS]   (default: the header's MaxProcs)
Prints: jobs, mean wait (s), mean bounded slowdown (tau = 10 s)."""
import sys, heapq
path, procs = sys.argv[1], None
jobs = []
for line in open(path):
    line = line.strip()
    if not line:
        continue
    if line.startswith(';'):
        k, _, v = line[1:].partition(':')
        if k.strip() == 'MaxProcs':
            procs = int(v.split()[0])
        continue
    f = [float(x) for x in line.split()]
    jid, submit, run, alloc, req_p, req_t, status = int(f[0]), int(round(f[1])), int(round(f[3])), int(f[4]), int(f[7]), int(round(f[8])), int(f[10])
    if status in (2, 3, 4) or run < 0:
        continue
    p = req_p if req_p > 0 else alloc
    if p <= 0:
        continue
    est = max(req_t, run) if req_t > 0 else run
    jobs.append((max(submit, 0), len(jobs), p, run, est, jid))
if len(sys.argv) > 2:
    procs = int(sys.argv[2])
jobs.sort()
free = procs
running = []  # (est_end, procs)
ends = []     # heap (actual_end, idx)
queue = []
start = {}
i = 0
now = 0
def earliest(profile, need, dur):
    # profile: list of [time, free], time ascending
    k = 0
    while k < len(profile):
        s = profile[k][0]; e = s + dur
        j = k; ok = True
        while j < len(profile) and profile[j][0] < e:
            if profile[j][1] < need:
                ok = False; break
            j += 1
        if ok:
            return k, s
        k = j + 1
    return None, None
def take(profile, s, dur, need):
    e = s + dur
    for t in (s, e):
        idx = 0
        while idx < len(profile) and profile[idx][0] < t:
            idx += 1
        if idx < len(profile) and profile[idx][0] == t:
            continue
        profile.insert(idx, [t, profile[idx - 1][1]])
    for st in profile:
        if s <= st[0] < e:
            st[1] -= need
while i < len(jobs) or ends:
    t_sub = jobs[i][0] if i < len(jobs) else None
    t_end = ends[0][0] if ends else None
    now = min(x for x in (t_sub, t_end) if x is not None)
    while ends and ends[0][0] == now:
        _, idx = heapq.heappop(ends)
        free += jobs[idx][2]
        running = [r for r in running if r[2] != idx]
    while i < len(jobs) and jobs[i][0] == now:
        queue.append(i); i += 1
    # plan every waiting job
    profile = [[now, free]]
    lvl = free
    for est_end, p, idx in sorted(running):
        t = max(est_end, now + 1)
        lvl += p
        if profile[-1][0] == t:
            profile[-1][1] = lvl
        else:
            profile.append([t, lvl])
    left = []
    for idx in queue:
        _, _, p, run, est, _ = jobs[idx]
        dur = max(est, 1)
        k, s = earliest(profile, p, dur)
        if s == now:
            start[idx] = now; free -= p
            running.append((now + est, p, idx))
            heapq.heappush(ends, (now + run, idx))
        else:
            left.append(idx)
        take(profile, s, dur, p)
    queue = left
n = len(jobs)
w = [start[k] - jobs[k][0] for k in range(n)]
b = [max(1, (w[k] + jobs[k][3]) / max(jobs[k][3], 10)) for k in range(n)]
print(n, sum(w) / n, sum(b) / n)
