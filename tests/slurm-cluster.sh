# A single-host Slurm (Debian's packages) and a topod, started for a test and stopped by pid.
# Sourced by tests/slurm-e2e.sh and tests/slurm-bench.sh; not a test by itself.
#
#   cluster_cannot_run           why this host cannot run a Slurm test (empty: it can)
#   cluster_init                 temp dir, binaries copied where job users can run them
#   cluster_start_munge          munged, unless one already answers
#   cluster_start_topod          topod on real cgroup v1, own socket/state dir/subtree (again
#                                after `cluster_stop topod`: a restart; its log is appended);
#                                TOPOD_EXTRA_CONF: more topod.toml lines
#   cluster_start_slurm MODE [PLUGSTACK_LINE]
#                                MODE: affinity (task/affinity + proctrack/linuxproc) or
#                                cgroup (task/cgroup,task/affinity + proctrack/cgroup, cgroup/v1);
#                                SLURM_EXTRA_CONF: more slurm.conf lines; SLURM_PARTITIONS: the
#                                partition lines (default: one partition, debug); SLURM_NODE_EXTRA:
#                                more of the node's line (Gres=gpu:2); SLURM_GRES_CONF: gres.conf
#   cluster_stop NAME...         the named daemons (slurmd, slurmctld, topod, munged), by pid
#   cluster_stop_slurm           slurmd and slurmctld, by pid
#   cluster_restart_slurmctld    slurmctld stopped and started again (its saved state kept)
#   cluster_stop_all             everything this file started (the callers' EXIT trap)
#
# Only pids recorded here are ever signalled. The cgroup subtree is topo-slurm-test, apart from
# other topod instances on the same machine.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CGROUP_SUBTREE=topo-slurm-test
STARTED_PIDS=()          # "name:pid"

cluster_log() { echo "[$(date +%T)] $*"; }

# Why a Slurm test cannot run on this host (empty when it can): it needs root and cgroup v1's
# cpuset and freezer hierarchies (Slurm 22.05's task/cgroup refuses hybrid v2).
cluster_cannot_run() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "needs root (starts slurmctld, slurmd, munged, topod; makes cgroups)"
    elif [ ! -d /sys/fs/cgroup/cpuset ] || [ ! -d /sys/fs/cgroup/freezer ]; then
        echo "needs cgroup v1 cpuset and freezer hierarchies (Slurm 22.05's task/cgroup refuses hybrid v2)"
    fi
}

# The Debian packages, then the two builds: the plug-in links topod without its default
# features (no daemon code inside Slurm); topod and topoctl are built whole.
cluster_build() {
    "$REPO/tests/install-deps.sh"
    (cd "$REPO" && TOPO_REQUIRE_SLURM=1 cargo build --quiet --release --locked -p spank-topo \
        && cargo build --quiet --release --locked -p topod --bins)
}

# A fresh directory for one cluster's files; installs the built binaries there.
cluster_init() {
    BASE=$(mktemp -d /tmp/topo-slurm.XXXXXX)
    chmod 755 "$BASE"
    mkdir -p "$BASE"/{etc,state,spool,log,run,bin,topod,out}
    chmod 1777 "$BASE/log" "$BASE/out"
    install -m 0755 "$REPO/target/release/topoctl" "$REPO/target/release/topod" "$BASE/bin/"
    install -m 0755 "$REPO/target/release/libspank_topo.so" "$BASE/bin/spank_topo.so"
    SOCK="$BASE/topod/topod.sock"
    export SLURM_CONF="$BASE/etc/slurm.conf"
    NODE=$(hostname -s)
    # Slurm cgroup directories that were here before this test (an administrator's): kept.
    SLURM_CGROUPS_BEFORE=""
    local d
    for d in /sys/fs/cgroup/*/"slurm_$NODE"; do
        if [ -d "$d" ]; then SLURM_CGROUPS_BEFORE+="$d "; fi
    done
}

cluster_start_munge() {
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
    fi
    if munge -n </dev/null >/dev/null 2>&1; then
        cluster_log "munged already running; using it"
        return
    fi
    # munged runs as munge and writes its pid file itself: in its own run directory.
    local pidfile=/run/munge/topo-test-munged.pid
    rm -f "$pidfile"
    runuser -u munge -- /usr/sbin/munged --pid-file="$pidfile"
    for _ in $(seq 50); do [ -s "$pidfile" ] && break; sleep 0.1; done
    STARTED_PIDS+=("munged:$(cat "$pidfile")")
    munge -n | unmunge >/dev/null
}

cluster_start_topod() {
    cat > "$BASE/topod/topod.toml" <<EOT
socket = "$SOCK"
state_dir = "$BASE/topod"
cgroup = "v1"
cgroup_subtree = "$CGROUP_SUBTREE"
${TOPOD_EXTRA_CONF:-}
EOT
    "$BASE/bin/topod" --config "$BASE/topod/topod.toml" >> "$BASE/log/topod.log" 2>&1 &
    STARTED_PIDS+=("topod:$!")
    for _ in $(seq 100); do [ -S "$SOCK" ] && "$BASE/bin/topoctl" status --socket "$SOCK" >/dev/null 2>&1 && return; sleep 0.1; done
    cat "$BASE/log/topod.log"; echo "topod did not start" >&2; return 1
}

cluster_start_slurm() {
    local mode=$1 plugstack=${2:-}
    local task proc
    case "$mode" in
        affinity) task=task/affinity; proc=proctrack/linuxproc ;;
        cgroup) task=task/cgroup,task/affinity; proc=proctrack/cgroup ;;
        *) echo "unknown mode $mode" >&2; return 1 ;;
    esac
    # The node as slurmd sees it, so that Slurm's abstract core numbers match the hardware.
    local hw
    hw=$(slurmd -C | head -1 | grep -o 'CPUs=.* ThreadsPerCore=[0-9]*')
    cat > "$SLURM_CONF" <<EOT
ClusterName=topotest
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=verbose
ProctrackType=$proc
TaskPlugin=$task
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=100
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
PlugStackConfig=$BASE/etc/plugstack.conf
${SLURM_EXTRA_CONF:-}
NodeName=$NODE NodeAddr=127.0.0.1 $hw RealMemory=1000 ${SLURM_NODE_EXTRA:-} State=UNKNOWN
${SLURM_PARTITIONS:-PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP}
EOT
    cat > "$BASE/etc/cgroup.conf" <<'EOT'
CgroupPlugin=cgroup/v1
ConstrainCores=yes
ConstrainRAMSpace=yes
EOT
    printf '%s\n' "$plugstack" > "$BASE/etc/plugstack.conf"
    if [ -n "${SLURM_GRES_CONF:-}" ]; then
        printf '%s\n' "$SLURM_GRES_CONF" > "$BASE/etc/gres.conf"
    fi
    slurmctld -D -i > "$BASE/log/slurmctld.out" 2>&1 &
    CTLD_PID=$!; STARTED_PIDS+=("slurmctld:$CTLD_PID")
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
    slurmd -D > "$BASE/log/slurmd.out" 2>&1 &
    SLURMD_PID=$!; STARTED_PIDS+=("slurmd:$SLURMD_PID")
    for _ in $(seq 150); do sinfo -h -t idle -o %N 2>/dev/null | grep -q . && break; sleep 0.2; done
    sinfo -h -t idle -o %N | grep -q . || { tail -20 "$BASE/log/slurmd.log" "$BASE/log/slurmctld.log"; echo "the node did not become idle" >&2; return 1; }
    cluster_log "Slurm up ($mode): slurmctld $CTLD_PID, slurmd $SLURMD_PID; node: $hw"
}

# Stops the named daemons among those started (by pid), waiting for each.
cluster_stop() {
    local keep=() entry name pid
    for entry in "${STARTED_PIDS[@]}"; do
        name=${entry%%:*}; pid=${entry##*:}
        if [[ " $* " == *" $name "* ]]; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null || true
        else
            keep+=("$entry")
        fi
    done
    STARTED_PIDS=("${keep[@]}")
}

cluster_stop_slurm() { cluster_stop slurmd slurmctld; }

# slurmctld alone, stopped and started again with the same configuration (its state kept).
cluster_restart_slurmctld() {
    cluster_stop slurmctld
    slurmctld -D > "$BASE/log/slurmctld.out" 2>&1 &
    CTLD_PID=$!; STARTED_PIDS+=("slurmctld:$CTLD_PID")
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && return 0; sleep 0.2; done
    tail -20 "$BASE/log/slurmctld.log"; echo "slurmctld did not come back" >&2; return 1
}

cluster_stop_all() {
    cluster_stop slurmd slurmctld topod munged
    # topod removes job cgroups on release; the subtree itself is ours to remove once empty.
    for c in cpuset memory freezer cpu devices; do
        [ -d "/sys/fs/cgroup/$c/$CGROUP_SUBTREE" ] && rmdir "/sys/fs/cgroup/$c/$CGROUP_SUBTREE" 2>/dev/null || true
    done
    # Slurm's task/cgroup makes slurm_<node> in every v1 hierarchy and leaves it when slurmd
    # stops: remove the ones this test's Slurm made (deepest first; a directory that still
    # holds a process stays).
    local dir
    for dir in /sys/fs/cgroup/*/"slurm_${NODE:-}"; do
        [ -n "${NODE:-}" ] && [ -d "$dir" ] || continue
        [[ " ${SLURM_CGROUPS_BEFORE:-} " == *" $dir "* ]] && continue
        find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
}
