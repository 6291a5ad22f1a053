#!/usr/bin/env bash
# Runs a command while every CPU of this machine is kept busy (one spinning shell per CPU, at
# the command's own priority), and returns its exit status: a test that still depends on how
# fast the machine is fails here, not on a busy CI machine. The load goes with the command,
# pass or fail.
# Usage: tests/under-load.sh COMMAND [ARG...]
set -uo pipefail
spinners=()
stop() { kill "${spinners[@]}" 2>/dev/null; wait "${spinners[@]}" 2>/dev/null; }
trap stop EXIT
for _ in $(seq "$(nproc)"); do
    sh -c 'while :; do :; done' &
    spinners+=($!)
done
echo "tests/under-load.sh: ${#spinners[@]} spinning shell(s) beside: $*"
"$@"
rc=$?
# The summary counts the tests between these two lines apart: they ran once already, unloaded.
echo "tests/under-load.sh: done (exit $rc)"
exit $rc
