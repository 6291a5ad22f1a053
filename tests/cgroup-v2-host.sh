#!/usr/bin/env bash
# The real-kernel cgroup tests on a pure cgroup v2 host (cpuset and memory controllers in the
# unified hierarchy), where the v1-only tests skip and every job-life test, the daemon tests and
# the crash test run on the v2 backend. tests/cgroup-v2-vm.sh runs the same tests in a guest.
# Usage, as root: tests/cgroup-v2-host.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mount=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
if [ -z "$mount" ]; then
    echo "tests/cgroup-v2-host.sh: no cgroup v2 hierarchy is mounted here" >&2
    exit 1
fi
if ! grep -qw cpuset "$mount/cgroup.controllers"; then
    echo "tests/cgroup-v2-host.sh: $mount offers no cpuset controller (controllers: $(cat "$mount/cgroup.controllers"))" >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "tests/cgroup-v2-host.sh: run it as root" >&2
    exit 1
fi
cargo test --locked -p topod --test cgroup_real --test cgroup_foreign --test daemon --test daemon_crash -- --test-threads=1 --nocapture
