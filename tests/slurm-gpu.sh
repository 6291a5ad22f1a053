#!/usr/bin/env bash
# Issue 33, the batch system chose the GPUs, on a real Slurm (Debian's 22.05) with a configured
# gres of two fake GPUs, spank_topo.so and a real topod on real cgroups (v1):
#   - topod reads the machine from a sysfs tree made here: this host's two CPUs as two NUMA
#     nodes, a GPU on each, their device files character devices made here (major 241, local
#     use), linked from the tree's sys/dev/char as the kernel links a GPU's;
#   - gres.conf lists the GPU of node 1 first, so that Slurm's GPU number 0 is not the GPU of
#     CPU 0; which file each number is, is taken from slurmd's own log (DebugFlags=Gres);
#   - srun -c2 --gres=gpu:1 --topology=affinity[core]: of the two cores Slurm gives, topod takes
#     the one beside the job's GPU (best-fit alone takes CPU 0), and topoctl jobs says it is local;
#   - srun -c1 --gres=gpu:1: where Slurm's one core is away from the GPU, the job runs there and
#     topoctl jobs gives the distance; with gpubind=numa the step fails and srun's output says
#     why;
#   - with confine_devices, the job opens its own GPU's device file and not the other's (the
#     plug-in sends Slurm's GPU as its device number, topod denies the other in the job's v1
#     devices cgroup);
#   - a request with gpus=1 fails for a step Slurm gave no GPU (saying to ask Slurm) and runs with
#     --gres=gpu:1;
#   - after the jobs, topod's ledger is empty.
# Needs root and two CPUs; skips without. Usage: tests/slurm-gpu.sh   (also run by tests/run-all.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/slurm-cluster.sh
why=$(cluster_cannot_run)
if [ -z "$why" ] && [ "$(nproc --all)" -lt 2 ]; then why="needs two CPUs"; fi
if [ -n "$why" ]; then
    echo "tests/slurm-gpu.sh: SKIPPED: $why"
    exit 0
fi
cluster_build
cluster_init
trap 'rc=$?; cluster_stop_all; if [ $rc -ne 0 ]; then echo "tests/slurm-gpu.sh: FAILED (logs in $BASE/log)"; else rm -rf "$BASE"; fi; exit $rc' EXIT
cluster_start_munge

failures=0
check() {             # check "what" command...
    local what=$1; shift
    if "$@"; then echo "  ok: $what"; else echo "  FAIL: $what"; failures=$((failures + 1)); fi
}
field() { sed -n "s/^$1=\(.*\)$/\1/p" "$2" | head -1; }

# The machine topod sees (tests/gpu-sysfs.sh): CPU 0 on node 0, CPU 1 on node 1; GPU
# 0000:18:00.0 (char 241:3, $BASE/dev/gpu3) on node 0, 0000:86:00.0 (241:5, gpu5) on node 1.
source tests/gpu-sysfs.sh
SYS=$BASE/sysfs
two_gpu_machine "$SYS" "$BASE/dev"

# confine_devices: each job may open only its own GPU's device file (v1 devices controller).
TOPOD_EXTRA_CONF="topology = \"$SYS\"
confine_devices = true"
cluster_start_topod
"$BASE/bin/topoctl" show --sysfs "$SYS" | sed -n '/GPU\|PCI/p' | sed 's/^/  /'

cat > "$BASE/bin/probe" <<EOT
#!/bin/sh
echo "JOB=\$SLURM_JOB_ID"
echo "GPUS=\${SLURM_JOB_GPUS:-\$SLURM_STEP_GPUS}"
grep Cpus_allowed_list /proc/self/status
echo "TOPO_CPUS=\$TOPO_CPUS"
$BASE/bin/topoctl jobs --socket $SOCK | awk -v j="slurm-\$SLURM_JOB_ID" '\$1 == j { show = 1; next } /^[^ ]/ { show = 0 } show && /GPUs/ { sub(/^ +/, ""); print "LISTED=" \$0 }'
for f in $BASE/dev/gpu3 $BASE/dev/gpu5; do
    # No driver has major 241: a device file the job may open says ENXIO, one it may not EPERM.
    echo "OPEN_\${f##*/}=\$( (exec 3<"\$f") 2>&1 )"
done
sleep "\${PROBE_SLEEP:-0}"
EOT
chmod 755 "$BASE/bin/probe"

# gres.conf lists node 1's GPU first (gpu5), then node 0's (gpu3). Slurm numbers them in the order
# slurmd loads them, which its own log says with DebugFlags=Gres: that is the truth the checks
# below compare topod's choice with.
SLURM_EXTRA_CONF="GresTypes=gpu
DebugFlags=Gres"
SLURM_NODE_EXTRA="Gres=gpu:2"
SLURM_GRES_CONF="Name=gpu File=$BASE/dev/gpu5
Name=gpu File=$BASE/dev/gpu3"
cluster_start_slurm affinity "required $BASE/bin/spank_topo.so socket=$SOCK"
mapfile -t slurm_files < <(sed -n 's/.*GRES: gpu device number [0-9]*(\(.*\)):c [0-9:]* rwm$/\1/p' "$BASE/log/slurmd.log")
echo "  Slurm's GPUs, in its order (slurmd log): ${slurm_files[*]}"
check "slurmd logged its two GPUs" test "${#slurm_files[@]}" -eq 2
near_cpu() { case "$1" in */gpu5) echo 1 ;; */gpu3) echo 0 ;; *) echo none ;; esac; }
address() { case "$1" in */gpu5) echo 0000:86:00.0 ;; */gpu3) echo 0000:18:00.0 ;; *) echo none ;; esac; }

echo "-- srun -c2 --gres=gpu:1 --topology=affinity[core]: the core beside the job's GPU"
srun -c2 -n1 --gres=gpu:1 --topology='affinity[core]' "$BASE/bin/probe" > "$BASE/out/near.out" 2>&1 || cat "$BASE/out/near.out"
sed 's/^/  /' "$BASE/out/near.out"
gpu=$(field GPUS "$BASE/out/near.out")
file=${slurm_files[${gpu:-9}]:-none}
want=$(near_cpu "$file")
check "Slurm gave the job one GPU ($gpu: $file)" test "$want" != none
check "of Slurm's two cores topod gave CPU $want, the one beside $file ($(address "$file"))" test "$(field TOPO_CPUS "$BASE/out/near.out")" = "$want"
check "the task runs there" grep -q "Cpus_allowed_list:\s*$want\$" "$BASE/out/near.out"
check "topoctl jobs lists the GPU as local" grep -q "^LISTED=GPUs $(address "$file") (card[35], NUMA node $want, local to every CPU)" "$BASE/out/near.out"
other=$BASE/dev/gpu3; [ "$file" = "$other" ] && other=$BASE/dev/gpu5
check "the job opens its own GPU's device file ($file)" grep -q "^OPEN_${file##*/}=.*No such device or address" "$BASE/out/near.out"
check "the job may not open the other GPU's ($other): confine_devices" grep -q "^OPEN_${other##*/}=.*Operation not permitted" "$BASE/out/near.out"
check "the plug-in logged which device file Slurm's GPU $gpu is, and its number" grep -q "Slurm's GPUs $gpu are $file (char:241:[0-9]*)\$" "$BASE/log/slurmd.log"

echo "-- srun -c1 --gres=gpu:1: Slurm's one core is away from the GPU; topod says how far"
srun -c1 -n1 --gres=gpu:1 --topology='affinity[core]' "$BASE/bin/probe" > "$BASE/out/far.out" 2>&1 || cat "$BASE/out/far.out"
sed 's/^/  /' "$BASE/out/far.out"
file=${slurm_files[$(field GPUS "$BASE/out/far.out")]:-none}
cpu=$(field TOPO_CPUS "$BASE/out/far.out")
if [ "$cpu" = "$(near_cpu "$file")" ]; then
    # Slurm 22.05 gives the lowest free core and GPU (observed: core 0 with GPU 0, gpu5, node 1's),
    # so this branch is not expected; the refusal is then covered by topod's own tests only.
    echo "  NOTE: Slurm put the job's one core beside its GPU; the gpubind=numa refusal is not checked here"
    check "the listing says local ($cpu beside $file)" grep -q "local to every CPU" "$BASE/out/far.out"
else
    check "the job ran on Slurm's core $cpu, and the listing says how far $file is" grep -q "^LISTED=GPUs $(address "$file") (card[35], NUMA node $(near_cpu "$file"), distance 21 to the farthest CPU" "$BASE/out/far.out"
    echo "-- the same with gpubind=numa: refused, saying why"
    if srun -c1 -n1 --gres=gpu:1 --topology='affinity[core:gpubind=numa]' "$BASE/bin/probe" > "$BASE/out/bound.out" 2>&1; then
        check "a job that gpubind=numa cannot place does not run" false
    fi
    sed 's/^/  /' "$BASE/out/bound.out"
    check "srun's output says gpubind=numa and the CPUs near the GPU" grep -q "gpubind=numa: the CPUs near GPUs $(address "$file") ($(near_cpu "$file")) are none of those the job may use ($cpu)" "$BASE/out/bound.out"
fi

echo "-- gpus=1 in the request: Slurm must have given the GPUs (it accounts them)"
if srun -c1 -n1 --topology='affinity[core:gpus=1]' "$BASE/bin/probe" > "$BASE/out/nogres.out" 2>&1; then
    check "a gpus= step Slurm gave no GPU does not run" false
fi
sed 's/^/  /' "$BASE/out/nogres.out"
check "srun's output says to ask Slurm for the GPUs" grep -q "Slurm gave this step no GPUs: ask Slurm for them" "$BASE/out/nogres.out"
srun -c1 -n1 --gres=gpu:1 --topology='affinity[core:gpus=1]' "$BASE/bin/probe" > "$BASE/out/withgres.out" 2>&1 || true
check "with --gres=gpu:1 the same request runs on Slurm's GPU" grep -q "^LISTED=GPUs " "$BASE/out/withgres.out"

left=""
for _ in $(seq 100); do
    left=$("$BASE/bin/topoctl" jobs --socket "$SOCK")
    [ "$left" = "no jobs" ] && break
    sleep 0.2
done
check "topod's ledger is empty after the jobs ($left)" test "$left" = "no jobs"

if [ "$failures" -ne 0 ]; then
    echo "tests/slurm-gpu.sh: $failures check(s) failed"
    tail -n 30 "$BASE/log/slurmd.log" "$BASE/log/topod.log"
    exit 1
fi
echo "tests/slurm-gpu.sh: all checks passed"
