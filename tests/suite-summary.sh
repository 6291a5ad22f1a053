#!/usr/bin/env bash
# Counts what tests/run-all.sh ran, from its output ($1), the skips the Rust tests recorded
# ($2, one "binary::test: reason" a line), its duration in seconds ($3) and its exit code ($4);
# prints the reasons for skips, the failing checks by name, then one closing line:
# "tests/run-all.sh: N passed, N failed, N skipped". A suite that stopped on a failing step
# that reported no test counts it as one.
#
# Sources: libtest's "test result:" lines (the cargo tests here and the same binaries in the
# cgroup v2 guest, whose skips print "SKIPPED: ..." uncaptured), the LSF harness ("  ok    " /
# "  FAIL  "), the PBS hook tests (unittest's "Ran N tests" and "skipped=K"), the Slurm and
# OpenPBS end-to-end tests ("  ok: " / "  FAIL: "). A test that returned early because it could not run
# here is counted as skipped, not passed.
set -uo pipefail
log=$1 skips=$2 seconds=${3:-0} rc=${4:-0}

# sum RE FIELD [WHERE]: the FIELD-th word of every match of RE, added up; WHERE is "loaded"
# for the lines tests/under-load.sh printed (tests run a second time, under load), "unloaded"
# (the default) for the rest, or "all".
sum() {
    awk -v re="$1" -v field="$2" -v where="${3:-unloaded}" '
        /^tests\/under-load\.sh: [0-9]+ spinning/ { loaded = 1; next }
        /^tests\/under-load\.sh: done/ { loaded = 0; next }
        { if ((where == "all" || (where == "loaded") == loaded) && match($0, re)) { split(substr($0, RSTART, RLENGTH), w, " "); n += w[field] } }
        END { print n + 0 }' "$log"
}
rust_passed=$(sum '[0-9]+ passed; [0-9]+ failed' 1)
# A test that fails only under load fails the suite as any other.
rust_failed=$(sum '[0-9]+ passed; [0-9]+ failed' 3 all)
rerun_passed=$(sum '[0-9]+ passed; [0-9]+ failed' 1 loaded)
# A test skipped again in its rerun under load is one skip.
host_skips=$(sort -u "$skips" 2>/dev/null | grep -c . || true)
guest_skips=$(grep -v '^tests/' "$log" | grep -c 'SKIPPED: ' || true)
lsf_ok=$(grep -c '^  ok    ' "$log" || true)
lsf_fail=$(grep -c '^  FAIL  ' "$log" || true)
pbs_ran=$(sum 'Ran [0-9]+ tests?' 2)
pbs_skipped=$(grep -Eo 'skipped=[0-9]+' "$log" | awk -F= '{ n += $2 } END { print n + 0 }')
pbs_failed=$(grep -Eo 'FAILED \((failures|errors)=[0-9]+' "$log" | awk -F= '{ n += $2 } END { print n + 0 }')
slurm_ok=$(grep -c '^  ok: ' "$log" || true)
slurm_fail=$(grep -c '^  FAIL: ' "$log" || true)
shell_skips=$(grep -Ec '^tests/[a-z0-9-]+\.sh: SKIPPED' "$log" || true)

skipped=$((host_skips + guest_skips + pbs_skipped + shell_skips))
failed=$((rust_failed + lsf_fail + pbs_failed + slurm_fail))
passed=$((rust_passed - host_skips - guest_skips + lsf_ok + pbs_ran - pbs_skipped - pbs_failed + slurm_ok))

if [ "$skipped" -gt 0 ]; then
    echo "tests/run-all.sh: skipped, and why:"
    { sort -u "$skips" 2>/dev/null | sed 's/^/  /'
      grep -v '^tests/' "$log" | grep -o 'SKIPPED: .*' | sed 's/^SKIPPED: /  (cgroup v2 guest) /'
      grep -E '^tests/[a-z0-9-]+\.sh: SKIPPED' "$log" | sed 's/^/  /'
      [ "$pbs_skipped" -gt 0 ] && echo "  $pbs_skipped PBS hook test(s): see unittest's output above"
    } | sort | uniq -c | sed 's/^ *\([0-9]*\) /  \1x/'
fi
# The failures by name, near the end of the output: a CI log shows its head and its tail, and a
# failing check in the middle of a long stage (the site lifecycle's container boot) was cut out.
if [ "$failed" -gt 0 ]; then
    echo "tests/run-all.sh: failed, and where (the first 40):"
    grep -E '^  FAIL(:| ) |^test .* \.\.\. FAILED$|^(FAIL|ERROR): test' "$log" | awk '!seen[$0]++' | head -n 40 | sed 's/^ */  /'
fi
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
    echo "tests/run-all.sh: a step failed (exit $rc) without a failing test to count; its last lines are above"
    failed=1
fi
echo "tests/run-all.sh: took $((seconds / 60)) min $((seconds % 60)) s"
echo "tests/run-all.sh: $passed passed, $failed failed, $skipped skipped (and $rerun_passed passed again under load)"
