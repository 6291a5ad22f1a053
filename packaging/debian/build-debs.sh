#!/usr/bin/env bash
# Builds topo's four Debian packages from the workspace, with cargo-deb (the metadata is in each
# crate's Cargo.toml, [package.metadata.deb]):
#
#   topod       topod, topoctl, topo-exec, the systemd unit (packaging/systemd/topod.service as
#               it is, with a drop-in naming the manual pages), /etc/topo/topod.toml (a
#               conffile: packaging/topod.toml), the manual pages and shell completions (made
#               here by `topoctl man` and `topoctl completions`), the protocol schema
#   topo-lsf    /usr/lib/topo/schmod_topo.so, /usr/lib/topo/libtopo.so, topo.h, LSF examples
#   topo-slurm  spank_topo.so built against the installed Slurm headers; Depends on the Slurm
#               major.minor of the installed libslurm-dev (read with dpkg-query here)
#   topo-pbs    the hook, /etc/topo/pbs/topo.json (a conffile pointing at the topod package's
#               programs), install-hooks.sh made of packaging/pbs/README's qmgr commands
#
# Usage: packaging/debian/build-debs.sh [OUTDIR]     (default: target/debian; prints the .debs)
# TOPO_DEB_VERSION=V gives the packages version V (with its revision, e.g. 0.1.0+up1-1) instead of
# the crates' version: tests/site-lifecycle.sh builds an upgrade that way from the same tree.
# Needs cargo-deb (`cargo install --locked cargo-deb`; installed here when missing), dpkg-dev and
# libslurm-dev (tests/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
me=packaging/debian/build-debs.sh
out=${1:-target/debian}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if ! cargo deb --version >/dev/null 2>&1; then
    # The version the packages were made and checked with (lintian clean); a newer one may
    # change what it writes or need a newer Rust than CI's.
    echo "$me: installing cargo-deb 3.8.0 from crates.io" >&2
    cargo install --locked --quiet cargo-deb --version 3.8.0
fi

# The Slurm the plug-in is built for: the headers' package, and the version its headers say.
slurm_pkg=libslurm-dev
slurm_version=$(dpkg-query -W -f='${Version}' "$slurm_pkg" 2>/dev/null || true)
if [ -z "$slurm_version" ]; then
    echo "$me: $slurm_pkg is not installed: topo-slurm is built against the installed Slurm (tests/install-deps.sh installs it)" >&2
    exit 1
fi
# SLURM_VERSION_NUMBER 0x160508 is 22.05.8 (what plugin/slurm/build.rs reads).
number=$(awk '$2 == "SLURM_VERSION_NUMBER" { print $3 }' "${SLURM_INCLUDE_DIR:-/usr/include}/slurm/slurm_version.h")
header_version=$(printf '%d.%02d.%d' $((number >> 16)) $(((number >> 8) & 255)) $((number & 255)))
upstream=${slurm_version#*:}
upstream=${upstream%%-*}
if [ "$header_version" != "$upstream" ]; then
    echo "$me: slurm_version.h says $header_version but $slurm_pkg is $slurm_version" >&2
    exit 1
fi
major_minor=$(echo "$upstream" | cut -d. -f1,2)
next_minor=$(echo "$major_minor" | awk -F. '{ printf "%s.%02d", $1, $2 + 1 }')
# Slurm loads a SPANK plug-in only into its own major.minor (plugin_version): every Slurm
# program that loads it (slurmd, srun, sbatch, ...) depends on slurm-wlm-basic-plugins of its
# exact version, so that is the package to pin: at least the version built against, below the
# next major.minor.
slurm_depends="slurm-wlm-basic-plugins (>= $slurm_version), slurm-wlm-basic-plugins (<< $next_minor~)"

# The programs and libraries, each crate with its own features (as the tests build them: the
# plug-ins without topod's daemon code).
TOPO_REQUIRE_SLURM=1 cargo build --quiet --release --locked -p spank-topo
cargo build --quiet --release --locked -p topo-lsf -p topo-capi
cargo build --quiet --release --locked -p topod --bins

target_dir=$(cargo metadata --format-version 1 --no-deps --locked | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
assets=$target_dir/release/topo-deb
rm -rf "$assets"
mkdir -p "$assets/man" "$assets/completions" "$assets/pbs"
"$target_dir/release/topoctl" man --out "$assets/man" >/dev/null
"$target_dir/release/topoctl" completions bash > "$assets/completions/topoctl"
"$target_dir/release/topoctl" completions zsh > "$assets/completions/_topoctl"
"$target_dir/release/topoctl" completions fish > "$assets/completions/topoctl.fish"

# topo-pbs: the hook's configuration as it is (it names the package's programs, as every guide
# does: tests/installed-paths.sh).
cp packaging/pbs/topo.json "$assets/pbs/topo.json"
# install-hooks.sh: README's installation and removal blocks, made by the script the real-PBS test
# (tests/openpbs-e2e.sh) runs its copy from.
packaging/pbs/make-install-hooks.sh packaging/pbs/README > "$assets/pbs/install-hooks.sh"
sh -n "$assets/pbs/install-hooks.sh"

gzip -9n "$assets"/man/*

debs=()
for crate in topod topo-lsf spank-topo topo-plugin-core; do
    # topo-pbs (from topo-plugin-core) holds no program: nothing to strip (cargo-deb would try
    # install-hooks.sh).
    strip=()
    [ "$crate" = topo-plugin-core ] && strip=(--no-strip)
    debs+=("$(cargo deb --quiet --no-build "${strip[@]}" ${TOPO_DEB_VERSION:+--deb-version "$TOPO_DEB_VERSION"} --locked -p "$crate" -o "$out")")
done

# What cargo-deb cannot say: a Description with a synopsis of its own (cargo-deb takes the
# crate's one-line description, which is longer than a synopsis may be; both texts are in the
# crate's Cargo.toml) and topo-slurm's Depends on the Slurm it was built for.
metadata=$(mktemp)
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked" "$metadata"' EXIT
cargo metadata --format-version 1 --no-deps --locked > "$metadata"
for deb in "${debs[@]}"; do
    rm -rf "$unpacked/pkg"
    dpkg-deb -R "$deb" "$unpacked/pkg"
    python3 - "$unpacked/pkg/DEBIAN/control" "$metadata" "$slurm_depends" <<'EOT'
import json, sys, textwrap
control, metadata, slurm_depends = sys.argv[1:]
fields = []
for line in open(control).read().splitlines():
    if not line.strip():
        continue
    if line[:1] in (" ", "\t"):
        fields[-1][1].append(line)
    else:
        key, value = line.split(":", 1)
        fields.append((key, [value.strip()]))
name = dict((k, v[0]) for k, v in fields)["Package"]
crate = [p for p in json.load(open(metadata))["packages"]
         if ((p.get("metadata") or {}).get("deb") or {}).get("name") == name][0]
meta = crate["metadata"]
synopsis = meta["topo-deb"]["synopsis"]
assert len(synopsis) <= 80, synopsis
extended = []
for paragraph in meta["deb"]["extended-description"].split("\n\n"):
    if extended:
        extended.append(" .")
    extended += [" " + l for l in textwrap.wrap(" ".join(paragraph.split()), 79)]
out = []
for key, value in fields:
    if key == "Description":
        value = [synopsis] + extended
    if key == "Depends" and name == "topo-slurm":
        value = [value[0] + ", " + slurm_depends]
    out.append("%s: %s" % (key, value[0]))
    out += value[1:]
open(control, "w").write("\n".join(out) + "\n")
EOT
    # md5sums, as dh_md5sums writes them (every file but the conffiles), for dpkg --verify.
    (cd "$unpacked/pkg" && find . -path ./DEBIAN -prune -o -type f -print | sed 's|^\./||' | sort \
        | grep -vxFf <(sed 's|^/||' DEBIAN/conffiles 2>/dev/null || true) | xargs -r md5sum > DEBIAN/md5sums)
    dpkg-deb --root-owner-group -Zxz -b "$unpacked/pkg" "$deb" >/dev/null
done
dpkg-deb -f "${debs[2]}" Depends | grep -qF "slurm-wlm-basic-plugins (>= $slurm_version)"

version=$(cargo metadata --format-version 1 --no-deps --locked | python3 -c 'import json, sys; print([p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "topod"][0])')
version=${TOPO_DEB_VERSION:-$version-}
for name in topod topo-lsf topo-slurm topo-pbs; do
    ls "$out/${name}_${version}"*.deb
done
