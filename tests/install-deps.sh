#!/usr/bin/env bash
# The Debian packages the test suite needs, installed only where missing (needs root for that).
# Each part of the suite adds its packages here, with the reason, so that one apt-get run covers all.
#
# Nothing already installed is upgraded: the packages below pull in nothing that needs a newer
# version of an installed one on Debian 12, and the one that did (linux-image-amd64, through
# initramfs-tools and udev, upgraded systemd) is no longer installed: the cgroup v2 guest's kernel
# is unpacked from its .deb into $TOPO_GUEST_KERNEL_DIR instead. apt is asked first what it would
# do, and any upgrade it still plans is named before it happens.
set -euo pipefail

packages=(
    gcc libc6-dev          # the bzip2 crate builds C (the sysfs snapshots are .tar.bz2); the LSF harness is C
    libclang-dev           # bindgen, for the LSF module's bindings (ffi/lsf-sys)
    valgrind               # the LSF harness also runs under memcheck
    # tests/slurm-e2e.sh and tests/slurm-bench.sh: a real single-host Slurm (22.05 on Debian 12)
    # and the SPANK header version the plug-in is built against (slurm/slurm_version.h).
    slurmctld slurmd slurm-client munge libslurm-dev
    # tests/cgroup-v2-vm.sh: a pure cgroup v2 guest (QEMU, busybox as its first process, kmod's
    # modprobe to list the kernel modules it needs).
    qemu-system-x86 busybox-static kmod
    # tests/openpbs-build.sh: a real OpenPBS built from the shared source snapshot (the build
    # dependencies shared/pbs/README lists; PBS runs its own PostgreSQL from these binaries).
    g++ make libtool autoconf automake m4 libx11-dev libxt-dev libedit-dev libical-dev
    libncurses-dev perl python3-dev tcl-dev tk-dev swig libexpat1-dev libssl-dev libxext-dev
    libxft-dev libhwloc-dev libcjson-dev postgresql libpq-dev
    # tests/deb-roundtrip.sh: the Debian packages (cargo-deb runs dpkg-shlibdeps; the build
    # installs cargo-deb itself from crates.io), lintian on them, `man topod` once installed, and
    # the unit's capability bounding set applied with setpriv.
    dpkg-dev lintian man-db util-linux
    # tests/site-lifecycle.sh: a Debian 12 root made with debootstrap, booted with systemd as
    # PID 1 by systemd-nspawn (systemd-container may bring this host's systemd package to the
    # same point release; systemd is not this host's PID 1).
    systemd-container debootstrap
    # topod/tests/metrics_missized.rs: a topod scrape parsed by Prometheus's own Python parser.
    python3-prometheus-client
)
me=tests/install-deps.sh
guest_kernel_dir=${TOPO_GUEST_KERNEL_DIR:-/var/cache/topo-tests/guest-kernel}

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
need_kernel=1
ls "$guest_kernel_dir"/boot/vmlinuz-* >/dev/null 2>&1 && need_kernel=0
[ "${#missing[@]}" -eq 0 ] && [ "$need_kernel" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "$me: please install ${missing[*]} (apt-get needs root)" >&2
    exit 1
fi
apt-get update -qq

if [ "${#missing[@]}" -gt 0 ]; then
    echo "$me: installing ${missing[*]}"
    # "Inst pkg [installed-version] (new-version ...)" is apt's way of saying it would upgrade pkg.
    upgrades=$(apt-get -s install --no-install-recommends "${missing[@]}" | awk '$1 == "Inst" && $3 ~ /^\[/ { print $2 }' | tr '\n' ' ')
    if [ -n "$upgrades" ]; then
        echo "$me: note: apt would also upgrade these installed packages, which the suite's packages need newer: $upgrades" >&2
    fi
    # Services the packages ship (munge, slurmd, ...) must not start on their own: the tests start
    # exactly the daemons they need and stop them by pid.
    policy=$(mktemp)
    printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
    cleanup() { rm -f /usr/sbin/policy-rc.d "$policy"; }
    [ -e /usr/sbin/policy-rc.d ] || { cp "$policy" /usr/sbin/policy-rc.d; trap cleanup EXIT; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ "$need_kernel" -eq 1 ]; then
    # Debian's current kernel package, the one linux-image-amd64 names, unpacked (not installed).
    kpkg=$(apt-cache depends linux-image-amd64 | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }')
    if [ -z "$kpkg" ]; then
        echo "$me: apt does not know linux-image-amd64, so the cgroup v2 guest has no kernel (it will skip)" >&2
        exit 0
    fi
    echo "$me: unpacking $kpkg into $guest_kernel_dir for the cgroup v2 guest"
    download=$(mktemp -d)
    (cd "$download" && apt-get download -qq -o APT::Sandbox::User=root "$kpkg")
    rm -rf "$guest_kernel_dir.new"
    mkdir -p "$guest_kernel_dir.new"
    dpkg-deb -x "$download"/*.deb "$guest_kernel_dir.new"
    # The package's own postinst would write modules.dep; modprobe needs it to list dependencies.
    for modules in "$guest_kernel_dir.new"/lib/modules/*; do
        depmod -b "$guest_kernel_dir.new" "${modules##*/}"
    done
    rm -rf "$download" "$guest_kernel_dir"
    mv "$guest_kernel_dir.new" "$guest_kernel_dir"
fi
