#!/usr/bin/env bash
# Builds tests/malleable/malleable.c against libtopo.so, as tests/lsf-harness/run.sh builds its
# C programs: the library from the directory that holds it (-L and an rpath, so the program runs
# without LD_LIBRARY_PATH). Prints the program's path.
#
# Usage: tests/malleable/build.sh OUT_DIR [LIB_DIR]
#   LIB_DIR: where libtopo.so is (default: target/debug, after `cargo build -p topo-capi`).
# ffi/capi/tests/malleable.rs runs it with the libtopo.so its own `cargo test` has just built.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build.sh OUT_DIR [LIB_DIR]}"
lib="$(cd "${2:-$here/../../target/debug}" && pwd)"
[ -f "$lib/libtopo.so" ] || { echo "tests/malleable/build.sh: no libtopo.so in $lib (cargo build -p topo-capi)" >&2; exit 1; }
mkdir -p "$out"
cc -std=c11 -Wall -Wextra -Werror -g -O1 -pthread -o "$out/malleable" "$here/malleable.c" \
    -L"$lib" -ltopo -Wl,-rpath,"$lib"
echo "$out/malleable"
