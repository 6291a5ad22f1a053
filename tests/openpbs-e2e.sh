#!/usr/bin/env bash
# topo's PBS hook (packaging/pbs/topo.py) inside a real OpenPBS: server, scheduler, comm and MoM
# on this host (built from the shared source snapshot by tests/openpbs-build.sh), the hook
# installed with exactly the qmgr commands of packaging/pbs/README, a real topod on real cgroup
# v1 cpusets, and real jobs submitted by an ordinary user.
#
# Checks, each printed as "  ok: ..." or "  FAIL: ...":
#   a malleable request (*1-2) with ncpus=1 starts, shrunk to one CPU, and its comment says so;
#   a bad request is refused at qsub with topoctl's message (and a split one says to quote it);
#   a job's CPUs and cgroup are the ones topod's ledger holds for it; two jobs at once are
#   disjoint; a double-forked daemon is killed at job end; qdel releases; an array job and a
#   multi-chunk job; the periodic hook releases an orphan; topod killed with SIGKILL and
#   restarted keeps a running job; a job that does not fit at the MoM because topod holds CPUs
#   PBS does not know about is not held: it waits with a comment and runs by itself once they
#   are free; GPUs PBS counts (ngpus=1 each, two jobs at once, on a two-GPU machine given to
#   topod as a sysfs tree) are chosen by topod, one each, beside each job's CPU, and each job
#   opens its own GPU's device file and not the other's.
#   With one vnode per NUMA node: each vnode publishes its own node's GPUs (10c); with topod
#   down at the MoM's start, exechost_periodic makes those vnodes once topod answers (10d).
#
# Every daemon it starts is stopped at the end, pass or fail; /etc/hosts and /etc/pbs.conf are
# restored. Needs root; exit 77 (a visible skip) when it cannot run here.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
me=tests/openpbs-e2e.sh
export TOPO_SHARED_DIR="${TOPO_SHARED_DIR:-$REPO/../shared}"

if [ "$(id -u)" -ne 0 ]; then
    echo "$me: SKIPPED: a real PBS needs root"
    exit 77
fi
rc=0
tests/openpbs-build.sh || rc=$?
if [ "$rc" -eq 77 ]; then
    echo "$me: SKIPPED: OpenPBS could not be built here (see above)"
    exit 77
elif [ "$rc" -ne 0 ]; then
    exit "$rc"
fi
cargo build --quiet --release --locked -p topod --bins

export PBS_EXEC=/opt/pbs
export PATH="$PBS_EXEC/bin:$PBS_EXEC/sbin:$PATH"
PBS_HOME=/var/spool/pbs
NODE=$(hostname -s)
SUBTREE=topo-pbs-test
JOB_USER=topopbs
FAILED=0
STARTED_TOPOD=""

BASE=$(mktemp -d /tmp/topo-openpbs.XXXXXX)
chmod 755 "$BASE"
mkdir -p "$BASE"/{bin,topod,out,hook-state}
chmod 1777 "$BASE/out"

log() { echo "[$(date +%T)] $*"; }
ok() { echo "  ok: $*"; }
fail() { echo "  FAIL: $*"; FAILED=$((FAILED + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else fail "$what"; fi; }

# --- the host: name to a non-loopback address, the job user -------------------------------------
cp /etc/hosts "$BASE/hosts.before"
cp /etc/pbs.conf "$BASE/pbs.conf.before" 2>/dev/null || true
restore_host() {
    cat "$BASE/hosts.before" > /etc/hosts
    [ -f "$BASE/pbs.conf.before" ] && cp "$BASE/pbs.conf.before" /etc/pbs.conf
}
# From here on /etc/hosts is put back whatever happens (the full clean-up replaces this trap).
trap restore_host EXIT
trap "exit 130" INT
trap "exit 143" TERM
addr=$(ip -4 -o addr show scope global | awk '{ split($4, a, "/"); print a[1]; exit }')
if [ -z "$addr" ]; then
    echo "$me: SKIPPED: PBS needs a non-loopback address for $NODE and this host has none"
    exit 77
fi
# PBS refuses to start while its host name resolves only to 127.0.0.1 (shared/pbs/README).
grep -v -E "[[:space:]]$NODE([[:space:]]|\$)" "$BASE/hosts.before" > "$BASE/hosts.new"
echo "$addr $NODE" >> "$BASE/hosts.new"
cat "$BASE/hosts.new" > /etc/hosts
id "$JOB_USER" >/dev/null 2>&1 || useradd -m -s /bin/bash "$JOB_USER"

# --- topod: real cgroup v1 cpusets, its own subtree, socket and state -----------------------------
install -m 0755 target/release/topod target/release/topoctl target/release/topo-exec "$BASE/bin/"
install -m 0644 packaging/protocol.schema.json "$BASE/protocol.schema.json"
SOCK="$BASE/topod/topod.sock"
cat > "$BASE/topod/topod.toml" <<EOT
socket = "$SOCK"
state_dir = "$BASE/topod"
cgroup = "v1"
cgroup_subtree = "$SUBTREE"
EOT
start_topod() {
    # Under setsid: pbs_attach-style session kills at job end must not reach it.
    setsid "$BASE/bin/topod" --config "$BASE/topod/topod.toml" >> "$BASE/topod.log" 2>&1 < /dev/null &
    STARTED_TOPOD=$!
    for _ in $(seq 100); do
        "$BASE/bin/topoctl" status --socket "$SOCK" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    tail -20 "$BASE/topod.log"; echo "$me: topod did not start" >&2; return 1
}
stop_topod() {
    local signal=${1:-TERM}
    [ -n "$STARTED_TOPOD" ] || return 0
    kill "-$signal" "$STARTED_TOPOD" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$STARTED_TOPOD" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$STARTED_TOPOD" 2>/dev/null || true
    wait "$STARTED_TOPOD" 2>/dev/null || true
    STARTED_TOPOD=""
}
topoctl() { "$BASE/bin/topoctl" "$@" --socket "$SOCK"; }
# "job cpus" lines of topod's ledger.
ledger() { topoctl jobs --json | python3 -c '
import json, sys
for j in json.load(sys.stdin):
    print(j["job"], j["cpus"])'; }

# --- PBS ---------------------------------------------------------------------------------------
pbs_stop() { /etc/init.d/pbs stop > "$BASE/pbs-stop.log" 2>&1 || true; }
cleanup() {
    local status=$?
    set +e
    # The hooks go with the run (while the MoM is up to confirm), so that a PBS on this machine
    # is left without them and the next run starts clean.
    declare -F delete_hooks >/dev/null && delete_hooks
    # Section 10b's sched_config, and its ngpus (the database outlives the run).
    if [ -f "$BASE/sched_config.orig" ]; then
        cp "$BASE/sched_config.orig" "$PBS_HOME/sched_priv/sched_config"
        qmgr -c "unset node $NODE resources_available.ngpus" >/dev/null 2>&1
        qmgr -c "delete node $NODE[0]" >/dev/null 2>&1
        qmgr -c "delete node $NODE[1]" >/dev/null 2>&1
        qmgr -c "delete resource ngpus" >/dev/null 2>&1
    fi
    pbs_stop
    stop_topod
    for c in cpuset memory freezer cpu; do
        d=/sys/fs/cgroup/$c/$SUBTREE
        [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    restore_host
    if [ "$FAILED" -eq 0 ] && [ "$status" -eq 0 ]; then rm -rf "$BASE"; else echo "$me: logs kept in $BASE and $PBS_HOME/*_logs"; fi
}
trap cleanup EXIT
# A signal ends the script through exit, so that the clean-up runs (an EXIT trap alone does not
# run when bash is killed by a signal it does not trap).
trap "exit 130" INT
trap "exit 143" TERM

sed -i 's/^PBS_START_MOM=.*/PBS_START_MOM=1/' /etc/pbs.conf
grep -q '^PBS_START_MOM=' /etc/pbs.conf || echo 'PBS_START_MOM=1' >> /etc/pbs.conf
# The post-install registered a systemd unit that the init script defers to; without systemd as
# PID 1 the init script must start the daemons itself.
if [ ! -d /run/systemd/system ]; then
    rm -f /etc/systemd/system/pbs.service /lib/systemd/system/pbs.service /usr/lib/systemd/system/pbs.service
fi
# Local delivery of job output, and jobs that start promptly.
grep -q '^\$usecp' "$PBS_HOME/mom_priv/config" 2>/dev/null || echo '$usecp *:/ /' >> "$PBS_HOME/mom_priv/config"
# An earlier run's hook, still cached at the MoM, would run its exechost_startup against that
# run's topod before the server tells the MoM it is gone.
rm -f "$PBS_HOME"/mom_priv/hooks/topo.* "$PBS_HOME"/mom_priv/hooks/topo_submit.*
start_topod
log "starting PBS"
/etc/init.d/pbs start > "$BASE/pbs-start.log" 2>&1 || { cat "$BASE/pbs-start.log"; exit 1; }
for _ in $(seq 100); do qstat -B >/dev/null 2>&1 && break; sleep 0.3; done
# What an earlier run left in PBS's database (it outlives the daemons): its jobs, their history,
# the hooks and resources the README's commands create. The MoM must be connected first: a
# deleted MoM hook stays "pending delete" (and its name taken) until the MoM has removed its
# copy, which the server logs as "successfully deleted hook file topo.HK".
for _ in $(seq 100); do pbsnodes "$NODE" 2>/dev/null | grep -q "pcpus" && break; sleep 0.3; done
qdel -W force -x $(qselect -x 2>/dev/null) >/dev/null 2>&1 || true
qmgr -c "set server job_history_enable = false" >/dev/null 2>&1 || true
delete_hooks() {
    local server_log acks
    server_log=$PBS_HOME/server_logs/$(date +%Y%m%d)
    acks=$(grep -c 'successfully deleted hook file topo.HK' "$server_log" 2>/dev/null || true)
    qmgr -c "delete hook topo_submit" >/dev/null 2>&1 || true
    # The server's stray periodic task for the hook cancelled first (packaging/pbs/README, Notes).
    qmgr -c "set hook topo event += periodic" >/dev/null 2>&1 || true
    qmgr -c "set hook topo event -= periodic" >/dev/null 2>&1 && sleep 5
    qmgr -c "delete hook topo" >/dev/null 2>&1 || return 0
    for _ in $(seq 300); do
        [ "$(grep -c 'successfully deleted hook file topo.HK' "$server_log" 2>/dev/null || true)" -gt "$acks" ] && return 0
        sleep 0.2
    done
    echo "$me: the MoM did not confirm the deletion of the topo hook" >&2
    return 1
}
delete_hooks
qmgr -c "unset node $NODE resources_available.ngpus" >/dev/null 2>&1 || true
for r in topology topo_free_numa topo_free_l3 topo_free_cores ngpus; do qmgr -c "delete resource $r" >/dev/null 2>&1 || true; done
# The node as PBS itself sees it: no ncpus, offline state or comment set by an earlier hook.
qmgr -c "unset node $NODE resources_available.ncpus" >/dev/null 2>&1 || true
qmgr -c "unset node $NODE comment" >/dev/null 2>&1 || true
pbsnodes -r "$NODE" >/dev/null 2>&1 || true
qmgr -c "set server scheduler_iteration = 600"
qmgr -c "set server flatuid = true" >/dev/null
qmgr -c "set server job_history_enable = true"
for _ in $(seq 100); do
    pbsnodes -a 2>/dev/null | grep -q "state = free" && break
    pbsnodes -r "$NODE" >/dev/null 2>&1 || true
    sleep 0.3
done
pbsnodes -a | grep -q "state = free" || { pbsnodes -a; echo "$me: the MoM did not come up" >&2; exit 1; }
log "PBS up: $(qstat --version 2>&1 | head -1), node $NODE ($addr)"

# --- the hook, with exactly the README's qmgr commands --------------------------------------------
cat > "$BASE/topo.json" <<EOT
{
  "socket": "$SOCK",
  "topoctl": "$BASE/bin/topoctl",
  "topo_exec": "$BASE/bin/topo-exec",
  "state_dir": "$BASE/hook-state",
  "protocol_schema": "$BASE/protocol.schema.json"
}
EOT
cp packaging/pbs/topo.py "$BASE/topo.py"
# The README's blocks, as the topo-pbs package's install-hooks.sh runs them (made by the same
# script, packaging/pbs/make-install-hooks.sh), with this run's topo.py and topo.json. Twice: a
# second installation (an upgrade, a changed topo.json) must succeed over the first.
packaging/pbs/make-install-hooks.sh packaging/pbs/README > "$BASE/install-hooks.sh"
install_hooks() { TOPO_PBS_HOOK=$BASE/topo.py TOPO_PBS_CONFIG=$BASE/topo.json sh "$BASE/install-hooks.sh" "$@"; }
rc=0; install_hooks > "$BASE/install-1.log" 2>&1 || rc=$?
check "install-hooks.sh installs both hooks (exit status $rc)" sh -c "[ $rc = 0 ] && qmgr -c 'list hook topo' | grep -q 'enabled = true' && qmgr -c 'list hook topo_submit' | grep -q 'enabled = true'"
rc=0; install_hooks > "$BASE/install-2.log" 2>&1 || rc=$?
check "install-hooks.sh run a second time succeeds (exit status $rc)" test "$rc" = 0
check "  ... keeps the resources and imports the hooks again" sh -c "grep -q 'resource topology exists (type=string,flag=m): kept' '$BASE/install-2.log' && grep -q 'hook topo exists: configured and imported again' '$BASE/install-2.log'"
[ "$FAILED" -eq 0 ] || { cat "$BASE"/install-*.log; exit 1; }
# "freq" is lowered so that the periodic checks take seconds, not minutes; and the server's stray
# "periodic" task for it cancelled as the README says (Notes and troubleshooting).
set_freq() {
    qmgr -c "set hook topo freq = $1"
    qmgr -c "set hook topo event += periodic"
    qmgr -c "set hook topo event -= periodic"
}
set_freq 3
qmgr -c "set hook pbs_cgroups enabled = false" 2>/dev/null || true
for _ in $(seq 100); do [ -f "$PBS_HOME/mom_priv/hooks/topo.PY" ] && break; sleep 0.2; done
sleep 2
# The MoM keeps the period it had (the README's 60 s) until its next periodic run: wait for two
# runs, after which they come every 3 s.
periodic_log=$PBS_HOME/mom_logs/$(date +%Y%m%d)
periodic_runs() { grep -c 'topo hook: on_periodic done' "$periodic_log" 2>/dev/null || true; }
runs=$(periodic_runs)
for _ in $(seq 450); do [ "$(periodic_runs)" -ge $((runs + 2)) ] && break; sleep 0.2; done

# Jobs are submitted from a directory their user may write (PBS copies the job's output there).
as_user() { (cd "$BASE/out" && runuser -u "$JOB_USER" -- "$@"); }
job_state() { qstat -xf "$1" 2>/dev/null | awk -F' = ' '/ job_state = /{ print $2 }'; }
job_attr() { qstat -xf "$1" 2>/dev/null | awk -v k="    $2" -F' = ' '$1 == k { print $2 }'; }
wait_state() { # JOB STATE SECONDS
    local t
    for t in $(seq $(( $3 * 5 ))); do [ "$(job_state "$1")" = "$2" ] && return 0; sleep 0.2; done
    return 1
}
wait_file() { for _ in $(seq $(( $2 * 5 ))); do [ -s "$1" ] && return 0; sleep 0.2; done; return 1; }
topod_id() { echo "pbs-$1"; }
cgroup_cpus() { cat "/sys/fs/cgroup/cpuset/$SUBTREE/$1/cpuset.cpus" 2>/dev/null; }
OUT=$BASE/out

mom_log=$PBS_HOME/mom_logs/$(date +%Y%m%d)
mom_log_lines=$(cat "$mom_log" 2>/dev/null | wc -l)

# --- 1. bad requests at qsub ---------------------------------------------------------------------
said=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[cores(2)]' -- /bin/true 2>&1) && fail "a bad request was accepted: $said" || true
expected=$("$BASE/bin/topoctl" check 'affinity[cores(2)]' 2>&1 | tail -1 || true)
check "a bad request is refused at qsub with topoctl's message" grep -qF "$expected" <<<"$said"
long=$(python3 -c 'print("CPUSET[CPU_LIST=" + ",".join(str(i) for i in range(3000)) + ",x]")')
# Quoted as the README says, so that PBS passes all 10 KB to the hook.
said=$(as_user qsub -l select=1:ncpus=1 -l topology="\"$long\"" -- /bin/true 2>&1) && fail "a 10 KB bad request was accepted" || true
check "a 10 KB bad request is quoted around its error only ($(wc -c <<<"$said") bytes)" test "$(wc -c <<<"$said")" -lt 1500
check "  ... and its reason is there" grep -q 'at byte' <<<"$said"
said=$(as_user qsub -l select=1:ncpus=1 -l topology=affinity[core\(1,same=numa\)] -- /bin/true 2>&1) && fail "a request split at its comma was accepted: $said" || true
check "a request PBS split at a comma says to quote it" grep -qi 'quote' <<<"$said"
said=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[thread*2]' -- /bin/true 2>&1) && fail "a request larger than the job's ncpus was accepted: $said" || true
check "a request needing more CPUs than the job's ncpus is refused at qsub, saying what to ask ($said)" \
    grep -qF 'topology=affinity[thread*2] needs at least 2 CPUs but the job asks ncpus=1: ask -l select=1:ncpus=2' <<<"$said"
said=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[thread:gpus=1]' -- /bin/true 2>&1) && fail "a request for GPUs was accepted: $said" || true
check "a request for GPUs (gpus=, which topod chooses) on a server without ngpus is refused at qsub, saying what the administrator does ($said)" \
    grep -qF "topology=affinity[thread:gpus=1] refused: gpus=1 asks topod to choose the job's GPUs, but the PBS server defines no resource ngpus" <<<"$said"
said=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[thread]' -h -- /bin/true 2>&1) || true
check "  ... and a job without gpus= is queued as before ($said)" grep -q '^[0-9]' <<<"$said"
qdel "$said" >/dev/null 2>&1 || true

# --- 2. one job: its CPUs and cgroup are topod's ----------------------------------------------
cat > "$BASE/job.sh" <<'EOT'
#!/bin/sh
out=$1
grep Cpus_allowed_list /proc/self/status | awk '{ print $2 }' > "$out.cpus.tmp"
grep ':cpuset:' /proc/self/cgroup > "$out.cgroup"
echo "$TOPO_JOB $TOPO_CPUS" > "$out.env"
echo "$TOPO_NOTIFY_FILE" > "$out.notify"
mv "$out.cpus.tmp" "$out.cpus"
# A double-forked daemon that outlives the job shell unless its cgroup is torn down.
setsid sh -c 'sleep 1000 & echo $! > '"$out"'.daemon' < /dev/null > /dev/null 2>&1 &
while [ ! -e "$out.stop" ]; do sleep 0.2; done
EOT
chmod 755 "$BASE/job.sh"
submit() { # NAME QSUB-ARGS...: the job id
    local name=$1; shift
    as_user qsub -N "$name" "$@" -- "$BASE/job.sh" "$OUT/$name"
}
j1=$(submit one -l select=1:ncpus=1 -l topology='affinity[thread*1]')
wait_file "$OUT/one.cpus" 30 || fail "job one did not start: $(job_attr "$j1" comment)"
l1=$(ledger | awk -v j="$(topod_id "$j1")" '$1 == j { print $2 }')
check "job one runs on the CPUs topod's ledger holds for it (${l1:-none})" test -n "$l1" -a "$(cat "$OUT/one.cpus")" = "$l1"
check "job one's processes are in its cgroup" grep -q "/$SUBTREE/$(topod_id "$j1")\$" "$OUT/one.cgroup"
check "job one's environment names its allocation" test "$(cat "$OUT/one.env")" = "$(topod_id "$j1") $l1"
queue_of() { topoctl jobs --json | python3 -c '
import json, sys
print(" ".join(j.get("queue", "-") for j in json.load(sys.stdin) if j["job"] == sys.argv[1]))' "$1"; }
check "topod was given job one's queue ($(queue_of "$(topod_id "$j1")"))" test "$(queue_of "$(topod_id "$j1")")" = workq
check "job one's environment names its notify file ($(cat "$OUT/one.notify"))" \
    test "$(cat "$OUT/one.notify")" = "$BASE/topod/job-notify/$(topod_id "$j1")"

# --- 3. a second job at once: disjoint ---------------------------------------------------------
j2=$(submit two -l select=1:ncpus=1)
wait_file "$OUT/two.cpus" 30 || fail "job two did not start: $(job_attr "$j2" comment)"
check "two jobs at once hold disjoint CPUs ($(cat "$OUT/one.cpus") and $(cat "$OUT/two.cpus" 2>/dev/null))" \
    test "$(cat "$OUT/one.cpus")" != "$(cat "$OUT/two.cpus" 2>/dev/null)"

# --- 3b. qsig -s suspend / resume: PBS's signals, then topod's freezer -----------------------------
freezer_state() { cat "/sys/fs/cgroup/freezer/$SUBTREE/$1/freezer.state" 2>/dev/null; }
job_in_ledger_state() { topoctl jobs --json | python3 -c '
import json, sys
print(" ".join(j["state"] for j in json.load(sys.stdin) if j["job"] == sys.argv[1]))' "$1"; }
qsig -s suspend "$j2"
for _ in $(seq 50); do [ "$(freezer_state "$(topod_id "$j2")")" = FROZEN ] && break; sleep 0.2; done
check "qsig -s suspend: the postsuspend hook freezes the job's cgroup ($(freezer_state "$(topod_id "$j2")"))" \
    test "$(freezer_state "$(topod_id "$j2")")" = FROZEN
check "  ... and topod shows it suspended, its CPU free to lend" test "$(job_in_ledger_state "$(topod_id "$j2")")" = suspended
qsig -s resume "$j2"
for _ in $(seq 50); do [ "$(freezer_state "$(topod_id "$j2")")" = THAWED ] && break; sleep 0.2; done
check "qsig -s resume: the preresume hook thaws it ($(freezer_state "$(topod_id "$j2")"), PBS state $(job_state "$j2"))" \
    test "$(freezer_state "$(topod_id "$j2")")" = THAWED -a "$(job_state "$j2")" = R
check "  ... and topod shows it running on its CPU again" test "$(job_in_ledger_state "$(topod_id "$j2")")" = running

# --- 4. job end: the double-forked daemon dies, nothing is left ---------------------------------
wait_file "$OUT/one.daemon" 10 || true
daemon=$(cat "$OUT/one.daemon" 2>/dev/null || echo 0)
touch "$OUT/one.stop"
wait_state "$j1" F 30 || fail "job one did not finish"
for _ in $(seq 50); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.2; done
check "job one's double-forked daemon (pid $daemon) was killed at job end" test "$daemon" -gt 0 -a ! -d "/proc/$daemon"
check "job one's allocation and cgroup are gone" test -z "$(ledger | grep "$(topod_id "$j1")")" -a ! -d "/sys/fs/cgroup/cpuset/$SUBTREE/$(topod_id "$j1")"

# --- 5. qdel ------------------------------------------------------------------------------------
qdel "$j2"
wait_state "$j2" F 30 || fail "job two did not end after qdel"
for _ in $(seq 50); do ledger | grep -q "$(topod_id "$j2")" || break; sleep 0.2; done
check "qdel releases the job's allocation" test -z "$(ledger | grep "$(topod_id "$j2")")"

# --- 5b. a malleable request with ncpus of its least starts, shrunk to what PBS gave ------------
jmal=$(submit mal -l select=1:ncpus=1 -l topology='affinity[thread*1-2]')
wait_file "$OUT/mal.cpus" 30 || fail "the malleable job did not start: $(job_attr "$jmal" comment)"
lmal=$(ledger | awk -v j="$(topod_id "$jmal")" '$1 == j { print $2 }')
check "a *1-2 job with ncpus=1 runs on one CPU, the one topod holds (${lmal:-none}, ran on $(cat "$OUT/mal.cpus" 2>/dev/null))" \
    test -n "$lmal" -a "$(cat "$OUT/mal.cpus" 2>/dev/null)" = "$lmal" -a "${lmal//[0-9]/}" = ""
check "  ... on its first run (run_count $(job_attr "$jmal" run_count))" test "$(job_attr "$jmal" run_count)" = 1
# PBS cannot change a running job's ncpus: topod says in the job's comment what it runs on
# (qalter -W comment as root, a manager on the server's host), 10 s after the change, once PBS's
# scheduler has written its own "Job run at". JSON: qstat -f folds long lines.
comment_of() { qstat -xf -F json "$1" 2>/dev/null | python3 -c '
import json, sys
print(next(iter(json.load(sys.stdin)["Jobs"].values())).get("comment", ""))'; }
says_resized() { comment_of "$1" | grep -q "^topo on $(hostname -s): resized at .* UTC: runs on 1 CPU ($2)\$"; }
# topod runs qalter as root within its systemd unit's capabilities only: PBS's default
# authentication (resvport: pbs_iff binds a reserved port) needs CAP_NET_BIND_SERVICE there.
unit_caps=$(sed -n 's/^CapabilityBoundingSet=//p' packaging/systemd/topod.service | tr 'A-Z ' 'a-z,' | sed 's/cap_/+/g')
probe_rc=0
probe=$(setpriv --bounding-set "-all,$unit_caps" --inh-caps -all --no-new-privs qalter -W "comment=topo: probe" "$jmal" 2>&1) || probe_rc=$?
check "  ... qalter -W comment works within the unit's capabilities ($unit_caps) and NoNewPrivileges (exit $probe_rc${probe:+: $probe})" \
    test "$probe_rc" = 0
for _ in $(seq 300); do says_resized "$jmal" "$lmal" && break; sleep 0.2; done
check "  ... and PBS shows the shrink in the job's comment ($(comment_of "$jmal"))" says_resized "$jmal" "$lmal"
touch "$OUT/mal.stop"
wait_state "$jmal" F 30 || fail "the malleable job did not finish"

# --- 6. an array job and a multi-chunk job -------------------------------------------------------
ja=$(as_user qsub -N arr -J 1-2 -l select=1:ncpus=1 -- /bin/sh -c "grep Cpus_allowed_list /proc/self/status > $OUT/arr.\$PBS_ARRAY_INDEX; cat /proc/self/cgroup | grep :cpuset: >> $OUT/arr.\$PBS_ARRAY_INDEX")
wait_state "$ja" F 60 || fail "the array job did not finish"
check "both subjobs of the array job ran in their own cgroups" \
    sh -c "grep -q 'pbs-.*\[1\]' $OUT/arr.1 && grep -q 'pbs-.*\[2\]' $OUT/arr.2"
jm=$(submit multi -l select=2:ncpus=1:mpiprocs=1)
wait_file "$OUT/multi.cpus" 30 || fail "the multi-chunk job did not start: $(job_attr "$jm" comment)"
lm=$(ledger | awk -v j="$(topod_id "$jm")" '$1 == j { print $2 }')
check "a two-chunk job on one host holds both chunks' CPUs (${lm:-none}, ran on $(cat "$OUT/multi.cpus" 2>/dev/null))" \
    test -n "$lm" -a "$(cat "$OUT/multi.cpus" 2>/dev/null)" = "$lm" -a "$(python3 -c "import sys; sys.path.insert(0,'packaging/pbs')
print(len([c for p in '$lm'.split(',') for c in (range(int(p.split('-')[0]), int(p.split('-')[-1])+1))]))")" = 2

# --- 7. topod killed with SIGKILL and restarted: the running job keeps its CPUs ----------------
stop_topod KILL
start_topod
check "after topod's SIGKILL and restart the multi-chunk job still holds $lm" \
    test "$(ledger | awk -v j="$(topod_id "$jm")" '$1 == j { print $2 }')" = "$lm"
touch "$OUT/multi.stop"
wait_state "$jm" F 30 || fail "the multi-chunk job did not finish"
for _ in $(seq 50); do ledger | grep -q "$(topod_id "$jm")" || break; sleep 0.2; done
check "  ... and is released at its end" test -z "$(ledger | grep "$(topod_id "$jm")")"

# --- 8. the periodic hook releases an orphan ------------------------------------------------------
topoctl alloc --job "pbs-999999.$NODE" 'affinity[thread*1]' >/dev/null
for _ in $(seq 75); do ledger | grep -q "pbs-999999" || break; sleep 0.2; done
check "the periodic hook releases a PBS job topod holds and the MoM does not run" test -z "$(ledger | grep pbs-999999)"

# --- 9. CPUs held outside PBS: the job waits visibly and runs by itself --------------------------
# The scheduler starts a waiting job at its next cycle: a job event, or every scheduler_iteration
# seconds (600 by default; 5 here, so that the test takes seconds).
qmgr -c "set server scheduler_iteration = 5"
# a) the periodic hook has published that one CPU is held outside PBS before the job comes.
topoctl alloc --job other-1 'affinity[thread*1]' >/dev/null
for _ in $(seq 50); do pbsnodes "$NODE" | grep -q 'comment = topo: .*(other-1)' && break; sleep 0.2; done
check "the periodic hook publishes ncpus = 1 while topod holds one CPU outside PBS" \
    grep -q 'resources_available.ncpus = 1' <(pbsnodes "$NODE")
check "  ... and the vnode's comment says by whom" grep -q 'comment = topo: 1 of 2 CPUs held outside PBS (other-1)' <(pbsnodes "$NODE")
jw=$(submit wait -l select=1:ncpus=2)
sleep 8
run_count=$(job_attr "$jw" run_count)
check "a 2-CPU job waits with PBS's comment ($(job_state "$jw"): $(job_attr "$jw" comment))" \
    sh -c "[ '$(job_state "$jw")' = Q ] && qstat -xf $jw | grep -q 'comment = .*Insufficient amount of resource: ncpus'"
check "  ... and was never sent to the MoM (run_count ${run_count:-0})" test "${run_count:-0}" = 0
topoctl release other-1 >/dev/null
if wait_file "$OUT/wait.cpus" 30; then
    ok "  ... and runs by itself once the CPU is free"
else
    fail "the waiting job did not start after the CPU was freed: $(job_attr "$jw" comment)"
fi
# The periodic hook clears the comment at its next run, which may come after the job's start
# (the free CPU was published first, and the job started on it).
for _ in $(seq 75); do pbsnodes "$NODE" | grep -q 'comment = topo:' || break; sleep 0.2; done
check "  ... and the vnode's comment is gone ($(pbsnodes "$NODE" | grep 'comment =' || echo none left))" \
    sh -c "! pbsnodes $NODE | grep -q 'comment = topo:'"
touch "$OUT/wait.stop"
wait_state "$jw" F 30 || fail "the waiting job did not finish"
# b) the MoM refuses the job because topod holds a CPU that PBS has not been told about yet: the
#    periodic hook runs every 60 s (the README's freq) and the CPU is taken right after one of
#    its runs, so that execjob_begin finds it first. Not held after 21 tries: sent back once.
set_freq 60
sleep 4
runs=$(grep -c 'on_periodic done' "$mom_log")
for _ in $(seq 400); do [ "$(grep -c 'on_periodic done' "$mom_log")" -gt "$runs" ] && break; sleep 0.2; done
topoctl alloc --job other-2 'affinity[thread*1]' >/dev/null
jr=$(submit race -l select=1:ncpus=2)
for _ in $(seq 50); do [ -n "$(job_attr "$jr" run_count)" ] && break; sleep 0.2; done
sleep 5
# The MoM's vnode update and the server's requeue race: the scheduler may send the job once more
# before it sees the new ncpus. Without the hook's update PBS tries 21 times and holds the job.
tries=$(job_attr "$jr" run_count)
check "a job the MoM could not place waits in the queue after ${tries:-0} tries ($(job_state "$jr"): $(job_attr "$jr" comment))" \
    sh -c "[ '$(job_state "$jr")' = Q ] && [ '${tries:-0}' -ge 1 ] && [ '${tries:-0}' -le 3 ]"
check "  ... is not held" test "$(job_attr "$jr" Hold_Types)" = n
check "  ... and the refusal told PBS the real ncpus" grep -q 'resources_available.ncpus = 1' <(pbsnodes "$NODE")
topoctl release other-2 >/dev/null
if wait_file "$OUT/race.cpus" 90; then
    ok "  ... and it runs by itself once the CPU is free (at the periodic hook's next run)"
else
    fail "the refused job did not start after the CPU was freed: $(job_attr "$jr" comment)"
fi
touch "$OUT/race.stop"
wait_state "$jr" F 30 || fail "the refused job did not finish"

# --- 10. the hook's log lines: successes are not errors --------------------------------------------
tail -n +"$((mom_log_lines + 1))" "$mom_log" > "$BASE/mom.log"
check "'released orphan' is logged at info, not as an error" grep -q ';0002;.*released orphan' "$BASE/mom.log"
check "no success is logged as an error" sh -c "! grep ';0001;.*topo hook.*\(released orphan\|back online\)' '$BASE/mom.log'"

# --- 10b. GPUs: PBS counts them (ngpus), topod chooses which, beside the job's CPU --------------------
# topod restarted on the two-GPU machine of tests/gpu-sysfs.sh (this host's two CPUs as two NUMA
# nodes, GPU 0000:18:00.0 beside CPU 0, 0000:86:00.0 beside CPU 1) with confine_devices; ngpus
# made as packaging/pbs/README ("GPUs") says, with the node's count and the scheduler's resources.
source tests/gpu-sysfs.sh
if ! grep -q ' cgroup [^ ]*devices' /proc/mounts; then
    log "10b skipped: no cgroup v1 devices hierarchy here for confine_devices"
else
    two_gpu_machine "$BASE/gpu-sysfs" "$BASE/dev"
    chmod 755 "$BASE/dev"
    cp "$BASE/topod/topod.toml" "$BASE/topod/topod.toml.cpus"
    printf 'topology = "%s"\nconfine_devices = true\n' "$BASE/gpu-sysfs" >> "$BASE/topod/topod.toml"
    stop_topod; start_topod
    cp "$PBS_HOME/sched_priv/sched_config" "$BASE/sched_config.orig"
    sed -i 's/^resources: "\(.*\)"$/resources: "\1, ngpus"/' "$PBS_HOME/sched_priv/sched_config"
    qmgr -c "create resource ngpus type=long,flag=nh"
    qmgr -c "set node $NODE resources_available.ngpus = 2"
    pkill -HUP -x pbs_sched || true
    sleep 2
    cat > "$BASE/gpu-job.sh" <<EOT
#!/bin/sh
out=\$1
grep Cpus_allowed_list /proc/self/status | awk '{ print \$2 }' > "\$out.cpus.tmp"
echo "\$TOPO_GPUS" > "\$out.gpus"
echo "\${CUDA_VISIBLE_DEVICES-unset}" > "\$out.cuda"
for f in $BASE/dev/gpu3 $BASE/dev/gpu5; do
    echo "\${f##*/} \$( (exec 3<"\$f") 2>&1 | sed 's/.*: //')" >> "\$out.opens"
done
mv "\$out.cpus.tmp" "\$out.cpus"
while [ ! -e "\$out.stop" ]; do sleep 0.2; done
EOT
    chmod 755 "$BASE/gpu-job.sh"
    # Job one brings a CUDA_VISIBLE_DEVICES from its submission (qsub -v, as -V would): it names
    # GPUs that are not its own, and the hook removes it (no NVIDIA driver here to name its own).
    gpu_job() { as_user qsub -N "$1" -l select=1:ncpus=1:ngpus=1 -l topology="$2" ${3:+-v "$3"} -- "$BASE/gpu-job.sh" "$OUT/$1"; }
    said=$(as_user qsub -l select=1:ncpus=1:ngpus=1 -l topology='affinity[thread:gpus=1]' -h -- /bin/true 2>&1) || true
    check "gpus= with GPUs asked of PBS is accepted at qsub ($said)" grep -q '^[0-9]' <<<"$said"
    qdel "$said" >/dev/null 2>&1 || true
    said=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[thread:gpus=1]' -- /bin/true 2>&1) && fail "gpus= without GPUs asked of PBS was accepted: $said" || true
    check "gpus= without GPUs asked of PBS is refused at qsub, saying to ask for them ($said)" \
        grep -qF 'topology=affinity[thread:gpus=1] refused: gpus=1 asks topod to choose 1 GPU(s) per task, but the job asks PBS for none' <<<"$said"
    g1=$(gpu_job gpu1 'affinity[thread]' CUDA_VISIBLE_DEVICES=7)
    g2=$(gpu_job gpu2 'affinity[thread:gpus=1]')
    wait_file "$OUT/gpu1.cpus" 30 || fail "GPU job one did not start: $(job_attr "$g1" comment)"
    wait_file "$OUT/gpu2.cpus" 30 || fail "GPU job two did not start: $(job_attr "$g2" comment)"
    near_cpu() { case "$1" in 0000:18:00.0) echo 0 ;; 0000:86:00.0) echo 1 ;; *) echo none ;; esac; }
    own_file() { case "$1" in 0000:18:00.0) echo gpu3 ;; 0000:86:00.0) echo gpu5 ;; *) echo none ;; esac; }
    for n in 1 2; do
        gpu=$(cat "$OUT/gpu$n.gpus" 2>/dev/null); cpus=$(cat "$OUT/gpu$n.cpus" 2>/dev/null)
        check "GPU job $n (ngpus=1) was given a GPU by topod (TOPO_GPUS=${gpu:-none}) and runs beside it (CPU ${cpus:-none})" \
            test -n "$gpu" -a "$cpus" = "$(near_cpu "$gpu")"
        mine=$(own_file "$gpu")
        check "  ... it opens its own GPU's device file and not the other's ($(tr '\n' ';' < "$OUT/gpu$n.opens" 2>/dev/null))" \
            sh -c "grep -qx '$mine No such device or address' '$OUT/gpu$n.opens' && [ \$(grep -c 'Operation not permitted' '$OUT/gpu$n.opens') = 1 ]"
    done
    check "a CUDA_VISIBLE_DEVICES job one brought from qsub is not in its environment ($(cat "$OUT/gpu1.cuda" 2>/dev/null))" \
        grep -qx unset "$OUT/gpu1.cuda"
    check "the two jobs hold different GPUs ($(cat "$OUT/gpu1.gpus" "$OUT/gpu2.gpus" 2>/dev/null | tr '\n' ' '))" \
        sh -c "[ -s '$OUT/gpu1.gpus' ] && ! cmp -s '$OUT/gpu1.gpus' '$OUT/gpu2.gpus'"
    listed=$(topoctl jobs | grep -c 'local to' || true)
    check "topoctl jobs says each job's GPU is local ($listed of 2)" test "$listed" = 2
    touch "$OUT/gpu1.stop" "$OUT/gpu2.stop"
    wait_state "$g1" F 30 || true; wait_state "$g2" F 30 || true
    left=$(ledger)
    check "  ... and both are released at their end (held: ${left:-nothing})" test -z "$left"

    # --- 10c. one vnode per NUMA node: each publishes its own NUMA node's GPUs ----------------
    # With vnode_per_numa_node, exechost_startup (run at the MoM's start) makes $NODE[0] and
    # $NODE[1], one CPU each, and gives each the ngpus of its NUMA node's GPU (the host's own
    # vnode keeps none): PBS gives a chunk CPUs and a GPU of one NUMA node, and topod chooses
    # that GPU, beside that CPU.
    restart_mom() {
        pkill -x pbs_mom || true
        for _ in $(seq 100); do pgrep -x pbs_mom >/dev/null || break; sleep 0.2; done
        "$PBS_EXEC/sbin/pbs_mom" || fail "pbs_mom did not start again"
    }
    set_numa_vnodes() { # true|false
        python3 - "$BASE/topo.json" "$1" <<'EOP'
import json, sys
path, on = sys.argv[1], sys.argv[2] == "true"
config = json.load(open(path))
config["vnode_per_numa_node"] = on
json.dump(config, open(path, "w"), indent=2)
EOP
        qmgr -c "import hook topo application/x-config default $BASE/topo.json" >/dev/null
        sleep 2
        restart_mom
    }
    vnode_ngpus() { pbsnodes -v "$1" 2>/dev/null | awk -F' = ' '/resources_available.ngpus/ { print $2 }'; }
    # The count 10b set by hand would stand over the hook's.
    qmgr -c "unset node $NODE resources_available.ngpus"
    set_numa_vnodes true
    for _ in $(seq 150); do
        [ "$(vnode_ngpus "$NODE[1]")" = 1 ] && pbsnodes -v "$NODE[1]" 2>/dev/null | grep -q "state = free" && break
        sleep 0.2
    done
    check "exechost_startup made a vnode per NUMA node, each with its node's GPU (ngpus: $NODE $(vnode_ngpus "$NODE"), [0] $(vnode_ngpus "$NODE[0]"), [1] $(vnode_ngpus "$NODE[1]"))" \
        test "$(vnode_ngpus "$NODE")/$(vnode_ngpus "$NODE[0]")/$(vnode_ngpus "$NODE[1]")" = "0/1/1"
    v1=$(gpu_job vgpu1 'affinity[thread]')
    v2=$(gpu_job vgpu2 'affinity[thread]')
    wait_file "$OUT/vgpu1.cpus" 30 || fail "per-NUMA GPU job one did not start: $(job_attr "$v1" comment)"
    wait_file "$OUT/vgpu2.cpus" 30 || fail "per-NUMA GPU job two did not start: $(job_attr "$v2" comment)"
    for n in 1 2; do
        jid=$([ $n = 1 ] && echo "$v1" || echo "$v2")
        where=$(job_attr "$jid" exec_vnode)
        index=$(sed -n 's/^([^+]*\[\([0-9]*\)\]:[^+]*)$/\1/p' <<<"$where")
        gpu=$(cat "$OUT/vgpu$n.gpus" 2>/dev/null); cpus=$(cat "$OUT/vgpu$n.cpus" 2>/dev/null)
        check "per-NUMA GPU job $n got its CPU and GPU from one vnode ($where), CPU ${cpus:-none} of that node and the GPU beside it (${gpu:-none})" \
            sh -c "[ -n '$index' ] && [ '$cpus' = '$index' ] && [ '$(near_cpu "$gpu")' = '$index' ]"
    done
    touch "$OUT/vgpu1.stop" "$OUT/vgpu2.stop"
    wait_state "$v1" F 30 || true; wait_state "$v2" F 30 || true
    # A chunk no one vnode holds (one CPU and both GPUs): PBS splits it over both vnodes of the
    # host, its CPU on one and a GPU counted on each. The hook sends those counts
    # (gpus_by_numa), and topod takes one GPU in each node, as PBS counted them.
    v4=$(as_user qsub -N vgpu4 -l select=1:ncpus=1:ngpus=2 -l topology='affinity[thread]' -- "$BASE/gpu-job.sh" "$OUT/vgpu4")
    wait_file "$OUT/vgpu4.cpus" 30 || fail "the split GPU job did not start: $(job_attr "$v4" comment)"
    where=$(job_attr "$v4" exec_vnode)
    gpus=$(cat "$OUT/vgpu4.gpus" 2>/dev/null)
    counted=$(grep -c "job pbs-${v4%%.*}.*as the batch system counted them (1 in node 0, 1 in node 1" "$BASE/topod.log" || true)
    check "a chunk PBS split over both NUMA vnodes ($where) got a GPU in each node (${gpus:-none}), as PBS counted them (topod's log: $counted line)" \
        bash -c "[ \$(grep -o 'ngpus=1' <<<'$where' | wc -l) = 2 ] && [ '$counted' = 1 ] && [ \"\$(tr , '\n' <<<'$gpus' | sort | tr '\n' ' ')\" = '0000:18:00.0 0000:86:00.0 ' ]"
    # The MoM restarts while that job holds both GPUs: exechost_startup publishes the same
    # counts (the held GPUs counted in their nodes), and the job runs on. A site restarts a MoM
    # under running jobs with SIGINT and pbs_mom -p (SIGTERM kills its jobs: OpenPBS
    # src/resmom/linux/mom_func.c, stop_me; -p preserves them: src/resmom/mom_main.c).
    before=$(grep -c "ngpus per vnode: " "$mom_log" || true)
    pkill -INT -x pbs_mom || true
    for _ in $(seq 100); do pgrep -x pbs_mom >/dev/null || break; sleep 0.2; done
    "$PBS_EXEC/sbin/pbs_mom" -p || fail "pbs_mom -p did not start again"
    for _ in $(seq 150); do [ "$(grep -c "ngpus per vnode: " "$mom_log" || true)" -gt "$before" ] && break; sleep 0.2; done
    for _ in $(seq 50); do pbsnodes -v "$NODE[1]" 2>/dev/null | grep -q "state = free" && break; sleep 0.2; done
    said=$(grep "ngpus per vnode: " "$mom_log" | tail -1 | sed 's/.*ngpus per vnode: //')
    check "a MoM restarted under that GPU job publishes the same GPU counts ($said; server: [0] $(vnode_ngpus "$NODE[0]"), [1] $(vnode_ngpus "$NODE[1]")) and the job runs on ($(job_state "$v4"))" \
        sh -c "[ '$(grep -c "ngpus per vnode: " "$mom_log" || true)' -gt '$before' ] && [ '$(vnode_ngpus "$NODE[0]")/$(vnode_ngpus "$NODE[1]")' = 1/1 ] && [ '$(job_state "$v4")' = R ]"
    touch "$OUT/vgpu4.stop"
    wait_state "$v4" F 30 || true
    # --- 10d. topod not up when the MoM starts: exechost_periodic makes the per-NUMA vnodes ------
    # exechost_startup cannot reach topod, so it offlines the host's vnode and makes none; once
    # topod answers and no job runs, exechost_periodic makes $NODE[0] and $NODE[1] (the server
    # creates vnodes a MoM's hook reports) and brings the host back.
    qmgr -c "delete node $NODE[0]" >/dev/null 2>&1 || true
    qmgr -c "delete node $NODE[1]" >/dev/null 2>&1 || true
    stop_topod
    restart_mom
    for _ in $(seq 150); do pbsnodes -v "$NODE" 2>/dev/null | grep -q "state = offline" && break; sleep 0.2; done
    check "with topod down, exechost_startup offlined $NODE and made no per-NUMA vnode ($(pbsnodes -v "$NODE" 2>/dev/null | awk -F' = ' '/comment/ { print $2 }'))" \
        sh -c "pbsnodes -v '$NODE' | grep -q 'state = offline' && ! pbsnodes -v '$NODE[0]' >/dev/null 2>&1"
    start_topod
    for _ in $(seq 300); do
        pbsnodes -v "$NODE[1]" 2>/dev/null | grep -q "state = free" && pbsnodes -v "$NODE" 2>/dev/null | grep -q "state = free" && break
        sleep 0.2
    done
    vnode_ncpus() { pbsnodes -v "$1" 2>/dev/null | awk -F' = ' '/resources_available.ncpus/ { print $2 }'; }
    check "exechost_periodic made the per-NUMA vnodes once topod answered (ncpus: $NODE $(vnode_ncpus "$NODE"), [0] $(vnode_ncpus "$NODE[0]"), [1] $(vnode_ncpus "$NODE[1]"); ngpus [0] $(vnode_ngpus "$NODE[0]"), [1] $(vnode_ngpus "$NODE[1]")), all free" \
        sh -c "[ '$(vnode_ncpus "$NODE")/$(vnode_ncpus "$NODE[0]")/$(vnode_ncpus "$NODE[1]")' = 0/1/1 ] && [ '$(vnode_ngpus "$NODE[0]")/$(vnode_ngpus "$NODE[1]")' = 1/1 ] && pbsnodes -v '$NODE' | grep -q 'state = free' && pbsnodes -v '$NODE[0]' | grep -q 'state = free'"
    v3=$(gpu_job vgpu3 'affinity[thread]')
    wait_file "$OUT/vgpu3.cpus" 30 || fail "a GPU job on the vnodes periodic made did not start: $(job_attr "$v3" comment)"
    where=$(job_attr "$v3" exec_vnode)
    index=$(sed -n 's/^([^+]*\[\([0-9]*\)\]:[^+]*)$/\1/p' <<<"$where")
    cpus=$(cat "$OUT/vgpu3.cpus" 2>/dev/null)
    check "a job on a vnode periodic made ($where) runs on that NUMA node's CPU (${cpus:-none})" \
        sh -c "[ -n '$index' ] && [ '$cpus' = '$index' ]"
    touch "$OUT/vgpu3.stop"
    wait_state "$v3" F 30 || true
    # Back to one vnode: the per-NUMA vnodes go (the server keeps vnodes a MoM once reported).
    set_numa_vnodes false
    qmgr -c "delete node $NODE[0]" >/dev/null 2>&1 || true
    qmgr -c "delete node $NODE[1]" >/dev/null 2>&1 || true
    for _ in $(seq 150); do pbsnodes "$NODE" 2>/dev/null | grep -q "state = free" && break; sleep 0.2; done
    cp "$BASE/topod/topod.toml.cpus" "$BASE/topod/topod.toml"
    stop_topod; start_topod
fi

# --- 11. what the hooks cost a job's start -----------------------------------------------------------
# qsub to the first instruction of the job, one job at a time, with the topo hooks enabled and
# disabled (the same PBS, the same minute). Figures, not a pass/fail check: they are printed.
set_freq 60
bench_jobs=${TOPO_PBS_BENCH_JOBS:-15}
median_ms() { sort -n | awk '{ v[NR] = $1 } END { if (NR) printf "%.0f", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
median1() { sort -n | awk '{ v[NR] = $1 } END { if (NR) printf "%.1f", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
bench() { # LABEL: one line a job, the milliseconds from qsub to its start
    local label=$1 i t0 jid
    for i in $(seq "$bench_jobs"); do
        t0=$(date +%s.%N)
        jid=$(as_user qsub -l select=1:ncpus=1 -l topology="affinity[thread]" -- /bin/sh -c "date +%s.%N > $OUT/bench.$label.$i")
        wait_file "$OUT/bench.$label.$i" 30 || { echo "bench job $jid did not start" >&2; continue; }
        awk -v a="$t0" -v b="$(cat "$OUT/bench.$label.$i")" 'BEGIN { printf "%.1f\n", (b - a) * 1000 }'
        wait_state "$jid" F 30 || true
    done
}
server_log=$PBS_HOME/server_logs/$(date +%Y%m%d)
mom_from=$(wc -l < "$mom_log"); server_from=$(wc -l < "$server_log")
with=$(bench with | median_ms)
# topo's own share: the time each hook event spent in topo.py (its "done in" debug lines),
# median per event over the jobs above.
own_ms() { # LOG FROM HANDLER
    tail -n +"$(($2 + 1))" "$1" | sed -n "s/.*topo hook: $3 done in \([0-9.]*\) ms.*/\1/p" | median1
}
own="submit $(own_ms "$server_log" "$server_from" on_submit) ms, begin $(own_ms "$mom_log" "$mom_from" on_begin) ms, launch $(own_ms "$mom_log" "$mom_from" on_launch) ms, end $(own_ms "$mom_log" "$mom_from" on_end) ms"
for h in topo topo_submit; do qmgr -c "set hook $h enabled = false"; done
sleep 2
without=$(bench without | median_ms)
for h in topo topo_submit; do qmgr -c "set hook $h enabled = true"; done
echo "$me: qsub to job start, median of $bench_jobs jobs: ${with:-?} ms with the topo hooks, ${without:-?} ms without"
echo "$me: time spent in topo.py per event (median): $own"
check "every benchmark job started" test -n "$with" -a -n "$without"

# --- 11b. topo removed from the host while the hooks stay: fail open --------------------------------
# topod's protocol schema gone first, then topod with its socket: what a removed topod package
# leaves. A plain job runs without topo; a job asking for a topology is refused with the reason.
mv "$BASE/protocol.schema.json" "$BASE/protocol.schema.json.away"
stop_topod
rm -f "$SOCK" "${SOCK%.sock}-admin.sock"
mom_from=$(wc -l < "$mom_log")
jopen=$(as_user qsub -l select=1:ncpus=1 -- /bin/sh -c "grep Cpus_allowed_list /proc/self/status > $OUT/open.cpus")
wait_state "$jopen" F 60 || true
check "without topo on the host a job without a request runs (exit status $(job_attr "$jopen" Exit_status), run_count $(job_attr "$jopen" run_count))" \
    sh -c "[ '$(job_attr "$jopen" Exit_status)' = 0 ] && [ '$(job_attr "$jopen" run_count)' = 1 ] && [ -s $OUT/open.cpus ]"
check "  ... and the MoM logs it once" test "$(tail -n +"$((mom_from + 1))" "$mom_log" | grep -c "$jopen.*topo is not installed on this host (.*): job runs without topo's placement")" = 1
# With job_run_wait = execjob_hook the scheduler waits for execjob_begin and writes its refusal
# into the job's comment (packaging/pbs/README, Notes); PBS's default (runjob_hook) does not.
qmgr -c "set sched job_run_wait = execjob_hook"
jneeds=$(as_user qsub -l select=1:ncpus=1 -l topology='affinity[thread*1]' -- /bin/true)
for _ in $(seq 100); do [ "$(job_attr "$jneeds" run_count)" -ge 1 ] 2>/dev/null && break; sleep 0.2; done
sleep 1
check "  ... a job asking for a topology is refused with the reason (run_count $(job_attr "$jneeds" run_count))" \
    sh -c "tail -n +$((mom_from + 1)) '$mom_log' | grep -q '$jneeds.*topo is not installed on $NODE (.*): the job asks for topology=affinity\[thread\*1\], which only topo can place'"
for _ in $(seq 300); do [ "$(job_state "$jneeds")" = H ] && break; sleep 0.2; done
held_comment=$(job_attr "$jneeds" comment)
check "  ... and once PBS holds it ($(job_state "$jneeds") after $(job_attr "$jneeds" run_count) tries), with job_run_wait = execjob_hook its comment says why ($held_comment)" \
    sh -c "[ '$(job_state "$jneeds")' = H ] && grep -q 'Not Running: PBS Error: topo hook: topo is not installed on' <<EOT
$held_comment
EOT"
qmgr -c "set sched job_run_wait = runjob_hook"
qdel "$jneeds" >/dev/null 2>&1 || true
wait_state "$jneeds" F 30 || true
mv "$BASE/protocol.schema.json.away" "$BASE/protocol.schema.json"
start_topod

# --- 12. install-hooks.sh --remove, and topo-pbs's prerm ---------------------------------------------
# The prerm on upgrade leaves the hooks alone.
prerm() { TOPO_PBS_INSTALL_HOOKS=$BASE/install-hooks.sh PATH=$PATH sh packaging/pbs/debian/prerm "$@"; }
rc=0; prerm upgrade 0.1.1-1 > "$BASE/prerm-upgrade.log" 2>&1 || rc=$?
check "topo-pbs's prerm on upgrade leaves the hooks installed (exit status $rc)" \
    sh -c "[ $rc = 0 ] && qmgr -c 'list hook topo' >/dev/null 2>&1 && qmgr -c 'list hook topo_submit' >/dev/null 2>&1"
# A job that still has a topology request (a held one here, and the ended ones in the job history)
# keeps PBS from deleting the resource: said, the rest removed, exit status 1; once the jobs are
# gone a second removal finishes.
# On removal it runs install-hooks.sh --remove and never fails, even when that does not finish.
jheld=$(as_user qsub -h -l select=1:ncpus=1 -l topology='affinity[thread*1]' -- /bin/true)
rc=0; prerm remove > "$BASE/remove-1.log" 2>&1 || rc=$?
check "topo-pbs's prerm on removal ends with exit status 0 ($rc) although --remove could not delete everything" \
    sh -c "[ $rc = 0 ] && grep -q 'install-hooks.sh --remove ended with exit status 1' '$BASE/remove-1.log'"
check "  ... --remove says what it could not delete and why" grep -q 'could not delete resource topology: .*Resource busy on job' "$BASE/remove-1.log"
check "  ... and removed both hooks all the same" sh -c "! qmgr -c 'list hook' | grep -E '^Hook topo(_submit)?\$'"
qdel -x -W force $(qselect -x) >/dev/null 2>&1 || true
for _ in $(seq 50); do [ -z "$(qselect -x)" ] && break; sleep 0.2; done
rc=0; install_hooks --remove > "$BASE/remove-2.log" 2>&1 || rc=$?
check "--remove again once the job is gone: exit status 0 ($rc)" test "$rc" = 0
for r in topology topo_free_numa topo_free_l3 topo_free_cores; do
    check "  ... resource $r is gone" sh -c "! qmgr -c 'list resource $r' >/dev/null 2>&1"
done
check "  ... no hook is left pending in the MoM" sh -c "for _ in \$(seq 100); do ls $PBS_HOME/mom_priv/hooks/ | grep -q '^topo' || exit 0; sleep 0.2; done; exit 1"
jplain=$(as_user qsub -l select=1:ncpus=1 -- /bin/sh -c "grep Cpus_allowed_list /proc/self/status > $OUT/plain.cpus")
wait_state "$jplain" F 60 || true
check "a plain job runs after the removal (exit status $(job_attr "$jplain" Exit_status))" \
    sh -c "[ '$(job_attr "$jplain" Exit_status)' = 0 ] && [ -s $OUT/plain.cpus ]"
check "  ... without asking topod" test -z "$(ledger | grep "$(topod_id "$jplain")")"

echo "$me: $FAILED failed"
[ "$FAILED" -eq 0 ]
