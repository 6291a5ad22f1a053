#!/usr/bin/env bash
# End-to-end test of spank_topo.so against a real Slurm (Debian's slurmctld/slurmd 22.05), a real
# topod and real cgroups (v1), under TaskPlugin=task/affinity and under task/cgroup:
#   - srun --topology and sbatch --topology jobs run; inside the job, Cpus_allowed_list and the
#     cgroup match topod's ledger (topod's cgroup under task/affinity; Slurm's own cgroup, narrowed,
#     under task/cgroup);
#   - two jobs at once get disjoint CPUs; each job's queue in topod is its partition, confirmed
#     with slurmctld (a prime-time pool admits that partition);
#   - a bad --topology makes sbatch fail with the parse error, and no job appears in the queue;
#   - a step that cannot get its allocation fails with one line (a batch step is named "batch");
#   - topod stopped while a job runs: the job epilog queues the release, the node is not drained,
#     and topod releases the job when it starts again; a job started while topod is down fails
#     with a clear message and does not drain the node either;
#   - topod restarting as a batch job starts: the plug-in waits for it and the job runs on topod's
#     CPUs; topod down longer than the plug-in's timeout: the batch job fails, its output naming
#     topod's socket, and the node is not drained;
#   - after the jobs end, topod's ledger is empty and no job cgroup is left.
# The daemons it starts are stopped by pid at the end, pass or fail. Needs root; skips without.
# Usage: tests/slurm-e2e.sh   (also run by tests/run-all.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/slurm-cluster.sh
why=$(cluster_cannot_run)
if [ -n "$why" ]; then
    echo "tests/slurm-e2e.sh: SKIPPED: $why"
    exit 0
fi
cluster_build
cluster_init
# Logs are kept when something failed, removed when all passed.
trap 'rc=$?; cluster_stop_all; if [ $rc -ne 0 ]; then echo "tests/slurm-e2e.sh: FAILED (logs in $BASE/log)"; else rm -rf "$BASE"; fi; exit $rc' EXIT
cluster_start_munge
# A prime-time pool, always open, that admits the partition debug (every job's here): the
# partition a job's environment names then decides something, so the plug-in confirms it with
# slurmctld (slurm_load_job) before giving it to topod as the queue, and the checks that topod
# was given "debug" cover that question's real path.
TOPOD_EXTRA_CONF='prime_pools = [{ name = "prime", cpus = "0", windows = ["Mon-Sun 00:00-24:00"], queues = ["debug"] }]'
cluster_start_topod
USER_NAME=nobody      # jobs run as an ordinary user
PLUGSTACK="required $BASE/bin/spank_topo.so socket=$SOCK"

failures=0
check() {             # check "what" command...
    local what=$1; shift
    if "$@"; then echo "  ok: $what"; else echo "  FAIL: $what"; failures=$((failures + 1)); fi
}
as_user() { runuser -u "$USER_NAME" -- env SLURM_CONF="$SLURM_CONF" "$@"; }

# The probe every job runs: what the task sees, and topod's ledger as seen from inside the job.
cat > "$BASE/bin/probe" <<EOT
#!/bin/sh
echo "JOB=\$SLURM_JOB_ID"
grep Cpus_allowed_list /proc/self/status
cg=\$(grep -E '^[0-9]+:cpuset:' /proc/self/cgroup | cut -d: -f3)
echo "CPUSET_CGROUP=\$cg"
echo "CPUSET_CGROUP_CPUS=\$(cat /sys/fs/cgroup/cpuset\$cg/cpuset.cpus)"
echo "IN_TOPOD_CGROUP=\$(grep -qx \$\$ /sys/fs/cgroup/cpuset/$CGROUP_SUBTREE/slurm-\$SLURM_JOB_ID/cgroup.procs 2>/dev/null && echo yes || echo no)"
echo "TOPO_JOB=\$TOPO_JOB TOPO_CPUS=\$TOPO_CPUS TOPO_TASK_CPUS=\$TOPO_TASK_CPUS TOPO_MEMS=\$TOPO_MEMS TOPO_CGROUP=\$TOPO_CGROUP"
echo "TOPO_NOTIFY_FILE=\$TOPO_NOTIFY_FILE"
echo "NOTIFIED_CPUS=\$(sed -n 's/^cpus=//p' "\$TOPO_NOTIFY_FILE" 2>/dev/null)"
$BASE/bin/topoctl jobs --socket $SOCK | awk -v j="slurm-\$SLURM_JOB_ID" '\$1 == j { print "LEDGER_CPUS=" \$3; print "LEDGER_MEMS=" \$4 }'
$BASE/bin/topoctl jobs --json --socket $SOCK | python3 -c 'import json, sys; j = [x for x in json.load(sys.stdin) if x["job"] == sys.argv[1]]; print("LEDGER_QUEUE=%s" % (j[0].get("queue", "") if j else ""))' "slurm-\$SLURM_JOB_ID"
sleep "\${PROBE_SLEEP:-0}"
EOT
chmod 755 "$BASE/bin/probe"

field() { sed -n "s/^$1=\(.*\)$/\1/p" "$2" | head -1; }
ids() {               # "0-2,5" -> "0 1 2 5"
    local out=() part a b
    IFS=, read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        a=${part%-*}; b=${part#*-}
        for ((i = a; i <= b; i++)); do out+=("$i"); done
    done
    echo "${out[*]}"
}
subset() {            # subset LIST_A LIST_B: every id of A is in B
    local x
    for x in $(ids "$1"); do [[ " $(ids "$2") " == *" $x "* ]] || return 1; done
}
disjoint() { local x; for x in $(ids "$1"); do [[ " $(ids "$2") " == *" $x "* ]] && return 1; done; return 0; }

# What a job saw must match topod's ledger, and its cgroup the mode's rule.
check_job_output() {
    local out=$1 mode=$2 job allowed ledger cg cgcpus
    job=$(field JOB "$out"); allowed=$(sed -n 's/^Cpus_allowed_list:\s*//p' "$out")
    ledger=$(field LEDGER_CPUS "$out"); cg=$(field CPUSET_CGROUP "$out"); cgcpus=$(field CPUSET_CGROUP_CPUS "$out")
    echo "  job $job: Cpus_allowed_list=$allowed ledger=$ledger cpuset cgroup=$cg ($cgcpus); $(grep ^TOPO_JOB "$out")"
    check "job $job is in topod's ledger as slurm-$job" test -n "$ledger"
    check "job $job: Cpus_allowed_list ($allowed) = topod's CPUs ($ledger)" test -n "$allowed" -a "$allowed" = "$ledger"
    check "job $job: TOPO_CPUS exported" grep -q "TOPO_JOB=slurm-$job TOPO_CPUS=$ledger " "$out"
    check "job $job: TOPO_NOTIFY_FILE names topod's notify file, which says its CPUs" \
        test "$(field TOPO_NOTIFY_FILE "$out"):$(field NOTIFIED_CPUS "$out")" = "$(dirname "$SOCK")/job-notify/slurm-$job:$ledger"
    check "job $job: topod was given its partition, as slurmctld's record says, as its queue ($(field LEDGER_QUEUE "$out"))" test "$(field LEDGER_QUEUE "$out")" = debug
    if [ "$mode" = affinity ]; then
        check "job $job: task is in topod's cgroup /$CGROUP_SUBTREE/slurm-$job" test "$cg" = "/$CGROUP_SUBTREE/slurm-$job"
        check "job $job: that cgroup's cpuset.cpus = ledger" test -n "$cgcpus" -a "$cgcpus" = "$ledger"
    else
        check "job $job: task stays in Slurm's own job cgroup ($cg)" bash -c "[[ '$cg' == */job_$job/* ]]"
        check "job $job: not moved into topod's cgroup" grep -q "IN_TOPOD_CGROUP=no" "$out"
        check "job $job: topod's CPUs lie inside Slurm's cgroup ($cgcpus)" subset "$ledger" "$cgcpus"
    fi
}

check_not_drained() {  # the node is up (its epilogs succeeded)
    local state
    state=$(scontrol show node "$NODE" | grep -o 'State=[^ ]*' | head -1)
    check "the node is not drained ($state; sinfo: $(sinfo -h -n "$NODE" -o %T))" bash -c "[[ '$state' != *DRAIN* && '$state' != *DOWN* ]]"
    if [[ $state == *DRAIN* || $state == *DOWN* ]]; then
        scontrol show node "$NODE" | grep -o 'Reason=.*' | sed 's/^/  /'
        scontrol update NodeName="$NODE" State=RESUME    # so that the next checks can run
    fi
}

wait_gone() {         # wait until no job of ours is in the queue
    for _ in $(seq 150); do [ -z "$(squeue -h 2>/dev/null)" ] && return 0; sleep 0.2; done
    squeue; return 1
}

check_clean() {
    local left=""
    for _ in $(seq 100); do
        left=$("$BASE/bin/topoctl" jobs --socket "$SOCK")
        [ "$left" = "no jobs" ] && break
        sleep 0.2
    done
    check "topod's ledger is empty after the jobs ($left)" test "$left" = "no jobs"
    local dirs
    dirs=$(find /sys/fs/cgroup/{cpuset,memory,freezer,cpu}/$CGROUP_SUBTREE -mindepth 1 -type d 2>/dev/null || true)
    check "no job cgroup left under $CGROUP_SUBTREE ($dirs)" test -z "$dirs"
}

for mode in affinity cgroup; do
    echo "== TaskPlugin mode: $mode"
    cp packaging/slurm/job_submit.lua "$BASE/etc/job_submit.lua"
    SLURM_EXTRA_CONF="JobSubmitPlugins=lua" cluster_start_slurm "$mode" "$PLUGSTACK"
    "$BASE/bin/topoctl" slurm-features --socket "$SOCK" --node "$NODE" --once | sed 's/^/  /'
    check "node features published" bash -c "scontrol show node $NODE | grep -q 'ActiveFeatures=topo_cpus_1,topo_cpus_2,topo_numa_1,topo_numa_2,topo_free_1,topo_free_2'"

    echo "-- srun --topology"
    as_user srun --topology='affinity[core]' -n1 "$BASE/bin/probe" > "$BASE/out/srun-$mode.out" 2> "$BASE/out/srun-$mode.err" \
        || { cat "$BASE/out/srun-$mode.err"; tail -20 "$BASE/log/slurmd.log"; }
    check_job_output "$BASE/out/srun-$mode.out" "$mode"
    if [ "$mode" = affinity ] && grep -q '^cgroup .*cpuset' /proc/mounts; then
        # As root, single-threaded, on v1 cgroups, the task moves itself in (no global migration lock).
        check "the task moved itself into topod's cgroup (slurmd log)" grep -q 'joined slurm-[0-9]* in [0-9.]* ms: moved itself in$' "$BASE/log/slurmd.log"
    fi

    echo "-- srun -c2 --topology=affinity[core]: topod picks one of the two cores Slurm gave"
    as_user srun -c2 -n1 --topology='affinity[core]' "$BASE/bin/probe" > "$BASE/out/narrow-$mode.out" 2>&1 || cat "$BASE/out/narrow-$mode.out"
    check_job_output "$BASE/out/narrow-$mode.out" "$mode"
    check "one CPU of the two ($(field LEDGER_CPUS "$BASE/out/narrow-$mode.out"))" test "$(ids "$(field LEDGER_CPUS "$BASE/out/narrow-$mode.out")" | wc -w)" -eq 1

    echo "-- srun -n2 --topology=affinity[core]: one core per task"
    as_user srun -n2 --topology='affinity[core]' -o "$BASE/out/tasks-$mode-%t.out" "$BASE/bin/probe" || cat "$BASE/out/tasks-$mode-"*.out
    t0=$(sed -n 's/^Cpus_allowed_list:\s*//p' "$BASE/out/tasks-$mode-0.out"); t1=$(sed -n 's/^Cpus_allowed_list:\s*//p' "$BASE/out/tasks-$mode-1.out")
    echo "  task 0: $t0 ($(grep -o 'TOPO_TASK_CPUS=[^ ]*' "$BASE/out/tasks-$mode-0.out")), task 1: $t1 ($(grep -o 'TOPO_TASK_CPUS=[^ ]*' "$BASE/out/tasks-$mode-1.out")), job: $(field LEDGER_CPUS "$BASE/out/tasks-$mode-0.out")"
    check "each task bound to its own CPUs from topod" grep -q "TOPO_TASK_CPUS=$t0 " "$BASE/out/tasks-$mode-0.out"
    check "task 1 likewise" grep -q "TOPO_TASK_CPUS=$t1 " "$BASE/out/tasks-$mode-1.out"
    check "the two tasks' CPUs are disjoint ($t0 / $t1)" disjoint "$t0" "$t1"
    check "both inside the job's CPUs" subset "$t0,$t1" "$(field LEDGER_CPUS "$BASE/out/tasks-$mode-0.out")"

    echo "-- sbatch --topology"
    jid=$(as_user sbatch --parsable --topology='affinity[core(1)*1]' -n1 -o "$BASE/out/sbatch-$mode-%j.out" "$BASE/bin/probe")
    wait_gone
    check "sbatch job $jid completed" bash -c "scontrol show job $jid 2>/dev/null | grep -q 'JobState=COMPLETED' || grep -q '^JOB=$jid' $BASE/out/sbatch-$mode-$jid.out"
    check_job_output "$BASE/out/sbatch-$mode-$jid.out" "$mode"

    echo "-- srun inside an sbatch --topology job shares the job's allocation"
    jid=$(as_user sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/step-$mode-%j.out" --wrap "srun -n1 $BASE/bin/probe")
    wait_gone
    check_job_output "$BASE/out/step-$mode-$jid.out" "$mode"
    check "features from job_submit.lua ($(scontrol show job "$jid" | grep -o 'Features=[^ ]*'))" bash -c "scontrol show job $jid | grep -q 'Features=topo_cpus_1 '"

    echo "-- two jobs at once"
    a=$(as_user env PROBE_SLEEP=4 sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/two-$mode-%j.out" "$BASE/bin/probe")
    b=$(as_user env PROBE_SLEEP=4 sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/two-$mode-%j.out" "$BASE/bin/probe")
    for _ in $(seq 100); do [ "$(squeue -h -t R | wc -l)" -eq 2 ] && break; sleep 0.1; done
    sleep 1
    ledger=$("$BASE/bin/topoctl" jobs --socket "$SOCK")
    echo "$ledger" | sed 's/^/  ledger: /'
    ca=$(echo "$ledger" | awk -v j="slurm-$a" '$1 == j { print $3 }'); cb=$(echo "$ledger" | awk -v j="slurm-$b" '$1 == j { print $3 }')
    check "both jobs in the ledger at once ($ca / $cb)" test -n "$ca" -a -n "$cb"
    check "their CPUs are disjoint" disjoint "$ca" "$cb"
    "$BASE/bin/topoctl" slurm-features --socket "$SOCK" --node "$NODE" --once | sed 's/^/  /'
    check "the node's free-now features went with them" bash -c "scontrol show node $NODE | grep 'ActiveFeatures=' | grep -vq topo_free_"
    wait_gone
    check_job_output "$BASE/out/two-$mode-$a.out" "$mode"
    check_job_output "$BASE/out/two-$mode-$b.out" "$mode"

    echo "-- a bad --topology"
    before=$(squeue -h | wc -l)
    set +e
    as_user sbatch --topology='affinity[cores(2)]' --wrap true > "$BASE/out/bad-$mode.out" 2> "$BASE/out/bad-$mode.err"
    rc=$?
    set -e
    sed 's/^/  sbatch says: /' "$BASE/out/bad-$mode.err"
    check "sbatch refused it (exit $rc)" test "$rc" -ne 0
    check "the message carries the parse error" grep -q "topology=affinity\[cores(2)\]: .*cores" "$BASE/out/bad-$mode.err"
    check "no job was queued" test "$(squeue -h | wc -l)" -eq "$before" -a -z "$(grep -o 'Submitted batch job' "$BASE/out/bad-$mode.out")"

    echo "-- a request that does not fit in the cores Slurm gave fails the step, with topod's reason"
    set +e
    as_user srun -n1 --topology='affinity[core(2)]' true > "$BASE/out/nofit-$mode.out" 2> "$BASE/out/nofit-$mode.err"
    rc=$?
    set -e
    sed 's/^/  srun says: /' "$BASE/out/nofit-$mode.err"
    check "srun failed (exit $rc)" test "$rc" -ne 0
    check "the user is told why" grep -q "topo: job [0-9]* step 0: cores 0 (CPUs 0): topod: job slurm-[0-9]* does not fit" "$BASE/out/nofit-$mode.err"
    nofit=$(sed -n 's/.*topo: job \([0-9]*\) step 0: .*/\1/p' "$BASE/out/nofit-$mode.err" | head -1)
    check "one line for the failed step in slurmd's log ($(grep -c "topo: job ${nofit:-x} step 0: .*does not fit" "$BASE/log/slurmd.log"))" \
        test "$(grep -c "topo: job ${nofit:-x} step 0: .*does not fit" "$BASE/log/slurmd.log")" -eq 1

    echo "-- a batch step that does not fit is named 'batch', and the node stays up"
    wait_gone
    jid=$(as_user sbatch --parsable --topology='affinity[core(2)]' -n1 -o "$BASE/out/nofit-batch-$mode-%j.out" --wrap true)
    wait_gone
    sed 's/^/  job output: /' "$BASE/out/nofit-batch-$mode-$jid.out"
    check "the batch job's output says why, naming the batch step" grep -q "topo: job $jid step batch: cores 0 (CPUs 0): topod: job slurm-$jid does not fit" "$BASE/out/nofit-batch-$mode-$jid.out"
    check "no step number 4294967291 in slurmd's log" bash -c "! grep -q 'step 4294967291' '$BASE/log/slurmd.log'"
    check_not_drained

    echo "-- topod stops while a job runs: the epilog queues the release, the node is not drained"
    jid=$(as_user env PROBE_SLEEP=3 sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/down-$mode-%j.out" "$BASE/bin/probe")
    for _ in $(seq 100); do "$BASE/bin/topoctl" jobs --socket "$SOCK" | grep -q "^slurm-$jid " && break; sleep 0.1; done
    check "job $jid holds CPUs in topod" bash -c "'$BASE/bin/topoctl' jobs --socket '$SOCK' | grep -q '^slurm-$jid '"
    cluster_stop topod
    wait_gone
    check_not_drained
    pending="$(dirname "$SOCK")/release-pending/slurm-$jid"
    check "the release is queued in $pending" test -f "$pending"
    sed 's/^/  queued: /' "$pending" 2>/dev/null || true
    grep "topo: job $jid: topod unreachable" "$BASE/log/slurmd.log" | sed 's/^/  slurmd log: /'
    check "slurmd's log says so" grep -q "topo: job $jid: topod unreachable; release of slurm-$jid queued in $(dirname "$SOCK")/release-pending" "$BASE/log/slurmd.log"
    check "job $jid's cgroup is still there while topod is down" test -d "/sys/fs/cgroup/cpuset/$CGROUP_SUBTREE/slurm-$jid"
    cluster_start_topod
    for _ in $(seq 50); do [ ! -e "$pending" ] && break; sleep 0.1; done
    check "topod released it at start: not in its ledger" bash -c "! '$BASE/bin/topoctl' jobs --socket '$SOCK' | grep -q '^slurm-$jid '"
    check "its cgroup is gone" test ! -d "/sys/fs/cgroup/cpuset/$CGROUP_SUBTREE/slurm-$jid"
    check "the queued request is gone" test ! -e "$pending"
    grep "released slurm-$jid" "$BASE/log/topod.log" | sed 's/^/  topod log: /'
    check "topod's log says it released it" grep -q "released slurm-$jid, which ended while topod was unreachable" "$BASE/log/topod.log"

    echo "-- a job started while topod is down fails clearly, and the node is not drained"
    cluster_stop topod
    set +e
    as_user srun -n1 --topology='affinity[core]' true > "$BASE/out/down-start-$mode.out" 2> "$BASE/out/down-start-$mode.err"
    rc=$?
    set -e
    sed 's/^/  srun says: /' "$BASE/out/down-start-$mode.err"
    check "srun failed (exit $rc)" test "$rc" -ne 0
    check "the user is told topod cannot be reached" grep -q "topo: job [0-9]* step 0: waited [0-9.]* s, and still cannot reach topod at $SOCK" "$BASE/out/down-start-$mode.err"
    wait_gone
    check_not_drained
    cluster_start_topod
    for _ in $(seq 50); do [ -z "$(ls -A "$(dirname "$SOCK")/release-pending" 2>/dev/null)" ] && break; sleep 0.1; done
    check "the queued release of a job topod never had is done and gone" test -z "$(ls -A "$(dirname "$SOCK")/release-pending" 2>/dev/null)"

    echo "-- topod restarts as a batch job starts: the plug-in waits for it (within its timeout, 10 s), and the job runs"
    wait_gone
    cluster_stop topod
    jid=$(as_user sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/restart-$mode-%j.out" "$BASE/bin/probe")
    for _ in $(seq 50); do [ "$(squeue -h -j "$jid" -o %T 2>/dev/null)" = RUNNING ] && break; sleep 0.1; done
    state=$(squeue -h -j "$jid" -o %T 2>/dev/null)
    sleep 2
    cluster_start_topod
    check "job $jid was started by Slurm while topod was down ($state)" test "$state" = RUNNING
    wait_gone
    sed 's/^/  job output: /' "$BASE/out/restart-$mode-$jid.out" || true
    check "job $jid completed with exit 0 ($(scontrol show job "$jid" | grep -o 'JobState=[^ ]*\|ExitCode=[^ ]*' | xargs))" \
        bash -c "scontrol show job $jid | grep -q 'JobState=COMPLETED ' && scontrol show job $jid | grep -Eq '(^| )ExitCode=0:0( |\$)'"
    check_job_output "$BASE/out/restart-$mode-$jid.out" "$mode"
    # The plug-in logs how long the allocation took, topod's wait included.
    gave=$(grep "topo: job $jid step batch: Slurm cores .* topod gave " "$BASE/log/slurmd.log" | head -1 || true)
    echo "  slurmd log: ${gave#*topo: }"
    waited=$(echo "$gave" | sed -n 's/.* in \([0-9]*\)\.[0-9]* ms$/\1/p')
    check "slurmd's log shows the plug-in waited for topod (${waited:-?} ms)" test "${waited:-0}" -ge 1000
    check "  ... and says so as it starts waiting" grep -q "topo: job $jid step batch: cannot reach topod at $SOCK: .*; waiting up to 10 s for topod (a restart?)" "$BASE/log/slurmd.log"
    check "and the allocation was not refused or failed" bash -c "! grep -q 'topo: job $jid step batch: waited .* still cannot reach topod' '$BASE/log/slurmd.log'"
    check_not_drained

    echo "-- topod down longer than the plug-in's timeout: the batch job fails, naming topod's socket; the node is not drained"
    wait_gone
    cluster_stop topod
    jid=$(as_user sbatch --parsable --topology='affinity[core]' -n1 -o "$BASE/out/gone-$mode-%j.out" "$BASE/bin/probe")
    wait_gone
    sed 's/^/  job output: /' "$BASE/out/gone-$mode-$jid.out" || true
    grep "topo: job $jid " "$BASE/log/slurmd.log" | sed 's/^/  slurmd log: /' || true
    check "job $jid failed ($(scontrol show job "$jid" | grep -o 'JobState=[^ ]*\|ExitCode=[^ ]*' | xargs))" \
        bash -c "scontrol show job $jid | grep -q 'JobState=FAILED ' && ! scontrol show job $jid | grep -Eq '(^| )ExitCode=0:0( |\$)'"
    check "its output says topod cannot be reached at $SOCK" grep -q "topo: job $jid step batch: waited [0-9.]* s, and still cannot reach topod at $SOCK: .*is topod running" "$BASE/out/gone-$mode-$jid.out"
    check "slurmd's log says so" grep -q "topo: job $jid step batch: waited [0-9.]* s, and still cannot reach topod at $SOCK" "$BASE/log/slurmd.log"
    check "its probe never ran" bash -c "! grep -q '^JOB=' '$BASE/out/gone-$mode-$jid.out'"
    check_not_drained
    cluster_start_topod
    for _ in $(seq 50); do [ -z "$(ls -A "$(dirname "$SOCK")/release-pending" 2>/dev/null)" ] && break; sleep 0.1; done
    check "its queued release is done and gone" test -z "$(ls -A "$(dirname "$SOCK")/release-pending" 2>/dev/null)"

    echo "-- a request no host can hold is refused by job_submit.lua's constraint"
    wait_gone
    set +e
    as_user sbatch --topology='affinity[core*4]' --wrap true > "$BASE/out/big-$mode.out" 2> "$BASE/out/big-$mode.err"
    rc=$?
    set -e
    sed 's/^/  sbatch says: /' "$BASE/out/big-$mode.err"
    check "sbatch refused it (exit $rc)" test "$rc" -ne 0 -a -z "$(squeue -h)"

    echo "-- after the jobs"
    wait_gone
    check_clean
    cluster_stop_slurm
done

if [ "$failures" -ne 0 ]; then
    echo "tests/slurm-e2e.sh: $failures check(s) failed"
    exit 1
fi
echo "tests/slurm-e2e.sh: all checks passed"
