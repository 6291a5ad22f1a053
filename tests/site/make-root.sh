#!/usr/bin/env bash
# Builds (once per machine) the Debian 12 root that tests/site-lifecycle.sh boots with systemd as
# PID 1: debootstrap from Debian's own archive, with systemd, Slurm (slurmctld, slurmd, munge) and
# what topo's packages depend on. Kept in $TOPO_SITE_ROOT_CACHE (default
# /var/cache/topo-tests/site-root); a stamp file names the package list it was built with, so a
# change of the list builds it again. Prints the root's path. Needs root, debootstrap and network
# access to deb.debian.org (or TOPO_DEBIAN_MIRROR).
set -euo pipefail
me=tests/site/make-root.sh
cache=${TOPO_SITE_ROOT_CACHE:-/var/cache/topo-tests/site-root}
mirror=${TOPO_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# systemd as PID 1 and journalctl; Slurm from Debian (the version topo-slurm is built against on
# this host, both from bookworm); python3 and procps for the test's own checks; man-db for `man`;
# PostgreSQL and the libraries OpenPBS (built on this host by tests/openpbs-build.sh into /opt/pbs,
# and copied in by the test) runs with: the site's PBS server keeps its data in PostgreSQL.
include=systemd,systemd-sysv,dbus,procps,iproute2,python3,slurmctld,slurmd,slurm-client,munge,man-db,util-linux
include=$include,postgresql,libical3,libcjson1,libedit2,libhwloc15,libpython3.11,libtcl8.6,libtk8.6,libxft2,libxss1,libx11-6,libxext6,libssl3,libpq5
stamp="bookworm $include"
if [ -f "$cache/.topo-root-stamp" ] && [ "$(cat "$cache/.topo-root-stamp")" = "$stamp" ]; then
    echo "$cache"
    exit 0
fi
rm -rf "$cache.new"
mkdir -p "$(dirname "$cache")"
echo "$me: debootstrap of Debian 12 into $cache (once per machine, a few minutes)" >&2
if ! debootstrap --variant=minbase --include="$include" bookworm "$cache.new" "$mirror" > "$cache.log" 2>&1; then
    echo "$me: debootstrap failed; the last lines of $cache.log:" >&2
    tail -n 15 "$cache.log" >&2
    exit 1
fi
# A package's post-install may have started its daemon inside the chroot (PostgreSQL's does).
for proc in /proc/[0-9]*; do
    [ "$(readlink "$proc/root" 2>/dev/null)" = "$(realpath "$cache.new")" ] && { kill -KILL "${proc#/proc/}" 2>/dev/null || true; }
done
# No service of the image starts by itself at boot but systemd's own: the test starts each one.
chroot "$cache.new" systemctl disable slurmctld.service slurmd.service munge.service postgresql.service >/dev/null 2>&1 || true
echo "$stamp" > "$cache.new/.topo-root-stamp"
rm -rf "$cache"
mv "$cache.new" "$cache"
echo "$cache"
