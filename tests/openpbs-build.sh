#!/usr/bin/env bash
# Builds and installs a real OpenPBS into /opt/pbs from the unmodified source snapshot in the
# project's shared folder ($TOPO_SHARED_DIR/pbs, see its README for the facts used here), once per
# machine: when /opt/pbs already holds a build of that exact snapshot (its sha256 is recorded in
# /opt/pbs/.topo-source-sha256), nothing is done. Needs root. Exit 77: cannot be done here (not
# root, no snapshot), which it says.
#
# The build takes about 3-10 minutes on 2 cores. Nothing of OpenPBS is in this repository; only
# this recipe, which runs upstream's own autogen/configure/make on the shared snapshot.
set -euo pipefail
cd "$(dirname "$0")/.."
me=tests/openpbs-build.sh
shared="${TOPO_SHARED_DIR:-../shared}"
tarball="$shared/pbs/openpbs-cd7ab5eda.tar.xz"
prefix=/opt/pbs
stamp="$prefix/.topo-source-sha256"
build_dir=${TOPO_OPENPBS_BUILD_DIR:-/var/cache/topo-tests/openpbs-build}

if [ "$(id -u)" -ne 0 ]; then
    echo "$me: SKIPPED: building and installing OpenPBS needs root" >&2
    exit 77
fi
if [ ! -f "$tarball" ]; then
    echo "$me: SKIPPED: no OpenPBS source at $tarball (the project's shared folder, see tests/run-all.sh)" >&2
    exit 77
fi
sha=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha" ] && [ -x "$prefix/sbin/pbs_server" ]; then
    echo "$me: $prefix already holds OpenPBS built from $(basename "$tarball"); not rebuilding"
    exit 0
fi

# Build dependencies, from shared/pbs/README (tests/install-deps.sh installs them without
# upgrading anything already installed).
tests/install-deps.sh

start=$(date +%s)
rm -rf "$build_dir"
mkdir -p "$build_dir"
tar -xJf "$tarball" -C "$build_dir"
src="$build_dir/openpbs"
log="$build_dir/build.log"
echo "$me: building OpenPBS in $src (log: $log)"
(
    cd "$src"
    ./autogen.sh
    # The system Python: configure otherwise takes the first python3 on PATH (a pyenv one here).
    ./configure --prefix="$prefix" PYTHON=/usr/bin/python3
    make -j"$(nproc)"
    make install
) > "$log" 2>&1 || { tail -40 "$log" >&2; echo "$me: the OpenPBS build failed; the whole log is $log" >&2; exit 1; }

# What the RPM's post-install does and a plain `make install` does not (shared/pbs/README).
"$prefix/libexec/pbs_postinstall" >> "$log" 2>&1
chmod 4755 "$prefix/sbin/pbs_iff" "$prefix/sbin/pbs_rcp"
echo "$sha" > "$stamp"
echo "$me: OpenPBS installed in $prefix in $(( $(date +%s) - start )) s"
rm -rf "$src"
