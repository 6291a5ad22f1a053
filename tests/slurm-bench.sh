#!/usr/bin/env bash
# Step launch cost of spank_topo.so: `srun /bin/true` with and without the plug-in, on the same
# Slurm in the same run, alternating, on a single-host Slurm started for the purpose (root).
#
#   steps: inside one allocation (salloc), each srun is one job step: plain `srun /bin/true` with
#          an empty plugstack.conf, against `srun --topology=affinity[core] /bin/true` with the
#          plug-in loaded (slurmstepd asks topod for the job's allocation and joins the task).
#   jobs:  each srun makes a new job (allocation, step, epilog): without the plug-in, and with it
#          and --topology (allocation, join, and release in the job epilog).
# Prints the median and 90th percentile of each, and the median overhead per step and per job.
#
# Usage: tests/slurm-bench.sh [STEPS] [JOBS]   (defaults 60 and 20)
#   TASK_MODE=affinity|cgroup (Slurm task set-up, default affinity), TOPO_MODE=auto|join|narrow
#   (the plug-in's mode= argument, default auto)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-60}
JOBS=${2:-20}
TASK_MODE=${TASK_MODE:-affinity}
if [ "$(id -u)" -ne 0 ]; then
    echo "tests/slurm-bench.sh: needs root (starts slurmctld, slurmd, munged, topod)" >&2
    exit 1
fi
source tests/slurm-cluster.sh
cluster_build
cluster_init
trap 'rc=$?; cluster_stop_all; exit $rc' EXIT
cluster_start_munge
cluster_start_topod
WITH="required $BASE/bin/spank_topo.so socket=$SOCK mode=${TOPO_MODE:-auto}"
cluster_start_slurm "$TASK_MODE" "$WITH"
as_user() { runuser -u nobody -- env SLURM_CONF="$SLURM_CONF" "$@"; }

# The alternating loop, run by the job user inside one allocation. plugstack.conf is read
# afresh by every srun and slurmstepd, so switching the file switches the plug-in.
cat > "$BASE/bin/steps" <<EOT
#!/bin/bash
set -e
for i in \$(seq $STEPS); do
    : > $BASE/etc/plugstack.conf
    t0=\$(date +%s%N); srun -n1 /bin/true; t1=\$(date +%s%N)
    echo "without \$(( (t1 - t0) / 1000 ))"
    echo "$WITH" > $BASE/etc/plugstack.conf
    t0=\$(date +%s%N); srun -n1 --topology='affinity[core]' /bin/true; t1=\$(date +%s%N)
    echo "with \$(( (t1 - t0) / 1000 ))"
done
EOT
chmod 755 "$BASE/bin/steps"
chmod 666 "$BASE/etc/plugstack.conf"    # the loop switches it as the job user
echo "$WITH" > "$BASE/etc/plugstack.conf"

echo "== $STEPS steps each way inside one allocation (TaskPlugin mode $TASK_MODE)"
as_user salloc -n1 --topology='affinity[core]' "$BASE/bin/steps" > "$BASE/out/steps.tsv" 2> "$BASE/out/steps.err" || { cat "$BASE/out/steps.err"; exit 1; }

idle() {    # no job in the queue and topod's ledger empty (the epilog has released)
    for _ in $(seq 200); do
        [ -z "$(squeue -h)" ] && [ "$("$BASE/bin/topoctl" jobs --socket "$SOCK")" = "no jobs" ] && return 0
        sleep 0.05
    done
    echo "not idle: $(squeue -h) / $("$BASE/bin/topoctl" jobs --socket "$SOCK")" >&2; return 1
}
echo "== $JOBS jobs each way, one srun each"
: > "$BASE/out/jobs.tsv"
for i in $(seq "$JOBS"); do
    idle; : > "$BASE/etc/plugstack.conf"
    t0=$(date +%s%N); as_user srun -n1 /bin/true; t1=$(date +%s%N)
    echo "without $(( (t1 - t0) / 1000 ))" >> "$BASE/out/jobs.tsv"
    idle; echo "$WITH" > "$BASE/etc/plugstack.conf"
    t0=$(date +%s%N); as_user srun -n1 --topology='affinity[core]' /bin/true; t1=$(date +%s%N)
    echo "with $(( (t1 - t0) / 1000 ))" >> "$BASE/out/jobs.tsv"
done
idle

stat() {    # stat FILE VARIANT -> "median p90" in ms
    awk -v v="$2" '$1 == v { print $2 }' "$1" | sort -n | awk '{ a[NR] = $1 } END {
        m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
        p = a[int(NR * 0.9 + 0.999)]
        printf "%.1f %.1f", m / 1000, p / 1000 }'
}
report() {
    local file=$1 what=$2 n wo_m wo_p w_m w_p
    n=$(grep -c '^with ' "$file")
    read -r wo_m wo_p <<< "$(stat "$file" without)"
    read -r w_m w_p <<< "$(stat "$file" with)"
    printf '%-6s n=%-3s without plug-in: median %6.1f ms (p90 %6.1f)   with --topology: median %6.1f ms (p90 %6.1f)   overhead per %s: %+.1f ms (median)\n' \
        "$what" "$n" "$wo_m" "$wo_p" "$w_m" "$w_p" "$what" "$(awk -v a="$w_m" -v b="$wo_m" 'BEGIN { print a - b }')"
}
echo
echo "machine: $(nproc) CPUs, $(slurmd -V), $(uname -r); TaskPlugin mode $TASK_MODE, plug-in mode=${TOPO_MODE:-auto}; raw timings in $BASE/out/*.tsv"
report "$BASE/out/steps.tsv" step
report "$BASE/out/jobs.tsv" job
# Inside that overhead, the plug-in's own calls to topod, as it logs them in slurmd's log.
med() { sort -n | awk '{ a[NR] = $1 } END { if (NR) printf "%.1f ms (n=%d)", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2, NR; else printf "none" }'; }
echo "plug-in's calls to topod (slurmd log): allocate (topology + allocate) median $(sed -n 's/.*topod gave .* in \([0-9.]*\) ms$/\1/p' "$BASE/log/slurmd.log" | med);" \
     "join median $(sed -n 's/.*: joined .* in \([0-9.]*\) ms: .*$/\1/p' "$BASE/log/slurmd.log" | med)" \
     "($(grep -c ': moved itself in$' "$BASE/log/slurmd.log" || true) tasks moved themselves in, $(grep -c ': topod moved it in' "$BASE/log/slurmd.log" || true) were moved by topod)"
echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) (the machine's other users share its $(nproc) CPUs)"
