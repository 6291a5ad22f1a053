#!/usr/bin/env bash
# The Debian packages the test suite needs, installed only where missing (needs root for that).
# Each part of the suite adds its packages here, with the reason, so that one apt-get run covers all.
set -euo pipefail

packages=(
    gcc libc6-dev          # the bzip2 crate builds C (the sysfs snapshots are .tar.bz2); the LSF harness is C
    libclang-dev           # bindgen, for the LSF module's bindings (ffi/lsf-sys)
    valgrind               # the LSF harness also runs under memcheck
    # tests/slurm-e2e.sh and tests/slurm-bench.sh: a real single-host Slurm (22.05 on Debian 12)
    # and the SPANK header version the plug-in is built against (slurm/slurm_version.h).
    slurmctld slurmd slurm-client munge libslurm-dev
    # tests/cgroup-v2-vm.sh: a pure cgroup v2 guest (Debian's kernel under QEMU, busybox as its
    # first process) where the v2 backend makes real cpusets.
    qemu-system-x86 linux-image-amd64 busybox-static kmod
)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "tests/install-deps.sh: please install ${missing[*]} (apt-get needs root)" >&2
    exit 1
fi
echo "tests/install-deps.sh: installing ${missing[*]}"
apt-get update -qq
# Services the packages ship (munge, slurmd, ...) must not start on their own: the tests start
# exactly the daemons they need and stop them by pid.
policy=$(mktemp)
printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
cleanup() { rm -f /usr/sbin/policy-rc.d "$policy"; }
[ -e /usr/sbin/policy-rc.d ] || { cp "$policy" /usr/sbin/policy-rc.d; trap cleanup EXIT; }
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
