#!/usr/bin/env bash
# topo's PBS hook (packaging/pbs/topo.py) through whole job lives against a real topod, with a
# stand-in for PBS's `pbs` module (tests/pbs/pbs.py): real cgroups as root on a host with the
# v1 cpuset hierarchy, topod's in-memory backend otherwise. Needs only python3 (stdlib).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --locked -p topod --bins
TOPO_BIN_DIR="$PWD/target/debug" python3 -m unittest discover -s tests/pbs -v
