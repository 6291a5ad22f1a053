#!/usr/bin/env bash
# The LSF module test: builds schmod_topo.so (and its panic-injection test build), libtopo.so,
# and the C harness that stands in for mbschd, starts real topod processes (fake cgroup backend) on real
# machines from shared/topologies, and runs the harness scenarios, one of them under valgrind.
#
#   h1  AMD EPYC 7451, 2 packages x 24 cores, served over topod's TCP listener (shared key)
#   h2  the same machine on a Unix socket, one package already held by a job
#   h3  2 x 8-core Intel (32 PUs), Unix socket, with defrag = true and migrate_min_run_s = 0 (the
#       blocks scenario gives it a topology reservation, then fragments it)
#   h4  no topod at all (the module is configured fail-closed)
#
# and the scale scenario (its own config): 10,000 hosts over five topods, 500 hung hosts, 400
# jobs, a scheduler restart in the middle, with the release build of the module; its figures
# are printed one per line ("figure ..."), and its thresholds are checked (see below).
#
# Usage: tests/lsf-harness/run.sh        (tests/run-all.sh runs it)
#        HARNESS_ONLY=scale tests/lsf-harness/run.sh   (the scale scenario alone; any scenario's
#                                                      name runs that one alone)
#        HARNESS_MEMORY_DETAIL=1 ...   (where the resident growth is: by mapping, the C library's
#                                       free bytes, and what malloc_trim would give back)
set -euo pipefail
cd "$(dirname "$0")/../.."
shared="${TOPO_SHARED_DIR:-../shared}"
topologies="$shared/topologies/converted-hwloc2.9"

cargo build --quiet --locked -p topod --bin topod --bin topoctl
cargo build --quiet --locked -p topo-lsf --features inject-panic
work=$(mktemp -d /tmp/topo-lsf-harness.XXXXXX)
cp target/debug/libschmod_topo.so "$work/schmod_topo_panic.so"
cargo build --quiet --locked -p topo-lsf -p topo-capi
cp target/debug/libschmod_topo.so "$work/schmod_topo.so"

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cc -std=c11 -Wall -Wextra -Werror -g -O1 -rdynamic -o "$work/harness" tests/lsf-harness/harness.c -ldl
# A 6.x-generation scheduler: only the lsb_* names, and lsb_get_jobinfo's 6.x struct jobInfo.
cc -std=c11 -Wall -Wextra -Werror -g -O1 -rdynamic -DLSB_ONLY -DTOPO_LSF6_JOBINFO -o "$work/harness-lsb" tests/lsf-harness/harness.c -ldl
# The scale scenario's baseline: a module that accepts every host (the cost of the ABI itself).
cc -std=c11 -Wall -Wextra -Werror -O2 -fPIC -shared -o "$work/dummy_module.so" tests/lsf-harness/dummy_module.c
cc -std=c11 -D_DEFAULT_SOURCE -Wall -Wextra -Werror -g -o "$work/capi_test" tests/lsf-harness/capi_test.c -Ltarget/debug -ltopo -Wl,-rpath,"$PWD/target/debug"

topod_bin=target/debug/topod
start_topod() { # name topology [extra topod.toml lines]
    local name=$1 topo=$2
    mkdir -p "$work/$name"
    printf '%s\n' "${@:3}" > "$work/$name/topod.toml"
    RUST_LOG=warn "$topod_bin" --config "$work/$name/topod.toml" --cgroup fake --topology "$topologies/$topo" \
        --socket "$work/$name/topod.sock" --state-dir "$work/$name" 2>"$work/$name/log" &
    pids+=($!)
}
port=$((20000 + RANDOM % 20000))
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/tcp.key"
chmod 600 "$work/tcp.key"   # topod refuses a key every user can read
start_topod h1 AMD-17h-Zen-2xEpyc-7451.xml "tcp_listen = \"127.0.0.1:$port\"" 'tcp_allow = ["127.0.0.1/32"]' "tcp_key_file = \"$work/tcp.key\""
start_topod h2 AMD-17h-Zen-2xEpyc-7451.xml
start_topod h3 32intel64-2p8co2t+8ve.xml 'defrag = true' 'migrate_min_run_s = 0'
# hp: the pools scenario's EPYC, one package a prime-time pool open all week for queue interactive.
start_topod hp AMD-17h-Zen-2xEpyc-7451.xml \
    'prime_pools = [{ name = "day", shape = "affinity[socket]", windows = ["Mon-Sun 00:00-24:00"], queues = ["interactive"] }]'
for h in h1 h2 h3 hp; do
    for _ in $(seq 100); do [ -S "$work/$h/topod.sock" ] && break; sleep 0.05; done
done
target/debug/topoctl alloc --socket "$work/hp/topod.sock" --job pre-p --queue normal 'affinity[core(24,same=socket)]' >/dev/null
target/debug/topoctl alloc --socket "$work/h2/topod.sock" --job pre-1 'affinity[core(24,same=socket)]' >/dev/null

cat > "$work/topo-lsf.toml" <<TOML
[lsf]
handler_id = 142
log_file = "$work/schmod_topo.log"
log_level = "debug"

[cache]
address_template = ""
key_file = "$work/tcp.key"
refresh_interval_ms = 300
stale_after_ms = 60000
unreachable = "closed"

[cache.hosts]
h1 = "tcp:127.0.0.1:$port"
h2 = "unix:$work/h2/topod.sock"
h3 = "unix:$work/h3/topod.sock"
h4 = "unix:$work/h4-has-no-topod.sock"
TOML
export TOPO_LSF_CONF="$work/topo-lsf.toml" HARNESS_TOPOCTL="$PWD/target/debug/topoctl" HARNESS_H1_SOCKET="$work/h1/topod.sock" \
    HARNESS_H3_SOCKET="$work/h3/topod.sock"

# HARNESS_ONLY=SCENARIO: that harness scenario alone (its last argument), e.g. reconfig.
run() {
    if [ -n "${HARNESS_ONLY:-}" ] && [ "${*: -1}" != "$HARNESS_ONLY" ]; then return 0; fi
    echo "== $*"; "$@"
}
status=0
# HARNESS_ONLY=scale: the scale scenario alone (for its figures while changing the module).
if [ "${HARNESS_ONLY:-}" != scale ]; then
run "$work/harness" "$work/schmod_topo.so" session || status=1
run "$work/harness" "$work/schmod_topo.so" restart || status=1
run "$work/harness-lsb" "$work/schmod_topo.so" restart || status=1
run "$work/harness" "$work/schmod_topo.so" reinit || status=1
# topo-lsf.toml changed between two sched_init calls (no sched_finalize between): h1 and h3 swap
# topods, h4 gets h2's; then a configuration that does not read.
sed -e "s|^h1 = .*|h1 = \"unix:$work/h3/topod.sock\"|" -e "s|^h3 = .*|h3 = \"tcp:127.0.0.1:$port\"|" \
    -e "s|^h4 = .*|h4 = \"unix:$work/h2/topod.sock\"|" "$work/topo-lsf.toml" > "$work/topo-lsf-2.toml"
printf '[lsf]\nhandler_id = 18\n' > "$work/topo-lsf-bad.toml"
HARNESS_CONF2="$work/topo-lsf-2.toml" HARNESS_CONF_BAD="$work/topo-lsf-bad.toml" HARNESS_CONF_MISSING="$work/no-such.toml" run "$work/harness" "$work/schmod_topo.so" reconfig || status=1
sed 's/^unreachable = "closed"$/unreachable = "open"/' "$work/topo-lsf.toml" > "$work/topo-lsf-open.toml"
TOPO_LSF_CONF="$work/topo-lsf-open.toml" run "$work/harness" "$work/schmod_topo.so" open || status=1
# h1 is hp here, h2-h4 unknown (removed: fail-closed).
sed -e '/^\[cache.hosts\]/,$d' "$work/topo-lsf.toml" > "$work/topo-lsf-pools.toml"
printf '[cache.hosts]\nh1 = "unix:%s"\n' "$work/hp/topod.sock" >> "$work/topo-lsf-pools.toml"
TOPO_LSF_CONF="$work/topo-lsf-pools.toml" HARNESS_H1_SOCKET="$work/hp/topod.sock" run "$work/harness" "$work/schmod_topo.so" pools || status=1
# h1 is h5 here, a topod that the scenario stops and starts again on other hardware at the same
# address (HARNESS_SWAP_H1); h2-h4 unknown (removed: fail-closed).
mkdir -p "$work/h5"
RUST_LOG=warn "$topod_bin" --cgroup fake --topology "$topologies/AMD-17h-Zen-2xEpyc-7451.xml" \
    --socket "$work/h5/topod.sock" --state-dir "$work/h5" 2>>"$work/h5/log" &
echo $! > "$work/h5/pid"
cat > "$work/h5/swap.sh" <<SWAP
#!/bin/sh
pid=\$(cat "$work/h5/pid"); kill "\$pid"
for _ in \$(seq 200); do kill -0 "\$pid" 2>/dev/null || break; sleep 0.05; done
kill -9 "\$pid" 2>/dev/null
rm -rf "$work/h5/state" "$work/h5/topod.sock"; mkdir "$work/h5/state"
RUST_LOG=warn "$topod_bin" --cgroup fake --topology "$topologies/32intel64-2p8co2t+8ve.xml" \\
    --socket "$work/h5/topod.sock" --state-dir "$work/h5/state" 2>>"$work/h5/log" </dev/null >/dev/null &
echo \$! > "$work/h5/pid"
for _ in \$(seq 200); do [ -S "$work/h5/topod.sock" ] && exit 0; sleep 0.05; done
exit 1
SWAP
for _ in $(seq 100); do [ -S "$work/h5/topod.sock" ] && break; sleep 0.05; done
sed -e '/^\[cache.hosts\]/,$d' "$work/topo-lsf.toml" > "$work/topo-lsf-h5.toml"
printf '[cache.hosts]\nh1 = "unix:%s"\n' "$work/h5/topod.sock" >> "$work/topo-lsf-h5.toml"
TOPO_LSF_CONF="$work/topo-lsf-h5.toml" HARNESS_SWAP_H1="sh $work/h5/swap.sh" run "$work/harness" "$work/schmod_topo.so" rehardware || status=1
kill "$(cat "$work/h5/pid")" 2>/dev/null || true
run "$work/harness" "$work/schmod_topo.so" refuse || status=1
# A request longer than a handler key, made in one scheduler process and replayed in a new one
# (the key is kept in key_dir, by default beside the log file).
HARNESS_KEY_FILE="$work/longkey" run "$work/harness" "$work/schmod_topo.so" longkey-save || status=1
HARNESS_KEY_FILE="$work/longkey" HARNESS_LOG="$work/schmod_topo.log" run "$work/harness" "$work/schmod_topo.so" longkey-replay || status=1
TOPO_LSF_PANIC_IN=matchFn run "$work/harness" "$work/schmod_topo_panic.so" panic || status=1
# The whole session again under memcheck: no error, nothing definitely lost. (Job 101 is held
# by h1's topod by now; the session's expectations hold either way.)
HARNESS_REFRESH_MS=2000 run valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite "$work/harness" "$work/schmod_topo.so" session || status=1
# topod's topology reservations and defrag on h3 (after the runs that expect h3 idle; it leaves
# h3 idle again).
run "$work/harness" "$work/schmod_topo.so" blocks || status=1
# A long mixed run, each job allocated on its topod after the module kept its host: none refused
# (h4 is hp here, the prime-time pool).
sed -e "s|^h4 = .*|h4 = \"unix:$work/hp/topod.sock\"|" "$work/topo-lsf.toml" > "$work/topo-lsf-agree.toml"
TOPO_LSF_CONF="$work/topo-lsf-agree.toml" HARNESS_H2_SOCKET="$work/h2/topod.sock" HARNESS_H4_SOCKET="$work/hp/topod.sock" \
    run "$work/harness" "$work/schmod_topo.so" agree || status=1
# The same with a scheduler restart halfway, fail-closed and fail-open.
TOPO_LSF_CONF="$work/topo-lsf-agree.toml" HARNESS_H2_SOCKET="$work/h2/topod.sock" HARNESS_H4_SOCKET="$work/hp/topod.sock" \
    HARNESS_AGREE_RESTART=1 run "$work/harness" "$work/schmod_topo.so" agree || status=1
sed 's/^unreachable = "closed"$/unreachable = "open"/' "$work/topo-lsf-agree.toml" > "$work/topo-lsf-agree-open.toml"
TOPO_LSF_CONF="$work/topo-lsf-agree-open.toml" HARNESS_H2_SOCKET="$work/h2/topod.sock" HARNESS_H4_SOCKET="$work/hp/topod.sock" \
    HARNESS_AGREE_RESTART=1 HARNESS_AGREE_OPEN=1 run "$work/harness" "$work/schmod_topo.so" agree || status=1
# esub.topo at bsub time: a good request goes to the job's environment, a bad one is refused
# with topoctl's message, another module's string is left alone.
esub() { # extsched-string -> exit status; output in $work/esub.*
    printf 'LSB_SUB_EXTSCHED_PARAM="%s"\n' "$1" > "$work/esub.parm"
    : > "$work/esub.env"
    LSB_SUB_PARM_FILE="$work/esub.parm" LSB_SUB_MODIFY_ENVFILE="$work/esub.env" LSB_SUB_ABORT_VALUE=97 \
        TOPOCTL=target/debug/topoctl sh packaging/lsf/esub.topo 2>"$work/esub.err"
}
echo "== esub.topo"
if esub 'affinity[core(2)*4]' && grep -qx 'TOPO_REQUEST="affinity\[core(2)\*4\]"' "$work/esub.env"; then
    echo "  ok    a good request is passed on as TOPO_REQUEST"
else echo "  FAIL  good request: $(cat "$work/esub.env" "$work/esub.err")"; status=1; fi
rc=0; esub 'affinity[core(2,same=numaa)]' || rc=$?
if [ "$rc" -eq 97 ] && grep -q 'numaa' "$work/esub.err" && [ ! -s "$work/esub.env" ]; then
    echo "  ok    a bad request is refused with the parser's message: $(tail -n1 "$work/esub.err")"
else echo "  FAIL  bad request: rc $rc, $(cat "$work/esub.err")"; status=1; fi
if esub 'filer[vol1]' && [ ! -s "$work/esub.env" ]; then
    echo "  ok    another module's -extsched string is left alone"
else echo "  FAIL  other module's string"; status=1; fi

# The C API (libtopo.so), against h3's topod, also under memcheck.
CAPI_SOCKET="$work/h3/topod.sock" run "$work/capi_test" || status=1
CAPI_SOCKET="$work/h3/topod.sock" run valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite "$work/capi_test" || status=1

fi

# Scale, with the release builds (the figures are the module's, not a debug build's):
# 10,000 LSF hosts n00001..n10000 over five topods (three on the 2 x 24-core AMD EPYC, two on the
# 32-PU Intel) and 500 hung hosts whose topod address accepts connections and never answers.
# Hosts are configured by short name with the [cache] domain; the harness offers every third
# one with the domain. Every host sharing a topod reports that topod's state, and the module
# keeps its reservations per LSF host, not per topod: two jobs on n00001 and n00006 (both on
# t0) are each reserved on their own host and may have the same CPU numbers; that is as it
# should be for the scheduler (they are different hosts to it), and nothing here starts a job
# on a topod, so no topod ever reports one (which would show its CPUs held on every host that
# shares the topod). The check "no job on a replayed job's CPUs" is therefore per LSF host.
if [ -n "${HARNESS_ONLY:-}" ] && [ "$HARNESS_ONLY" != scale ]; then
    [ "$status" -eq 0 ] && { echo "tests/lsf-harness/run.sh: $HARNESS_ONLY passed"; exit 0; }
    echo "--- module log (last 60 lines)"; tail -n 60 "$work/schmod_topo.log"
    echo "tests/lsf-harness/run.sh: $HARNESS_ONLY FAILED"; exit 1
fi
cargo build --quiet --locked --release -p topo-lsf
cargo build --quiet --locked --release -p topod --bin topod
# HARNESS_SCALE_MODULE: another build of the module to measure instead (e.g. an earlier
# commit's, for figures side by side).
cp "${HARNESS_SCALE_MODULE:-target/release/libschmod_topo.so}" "$work/schmod_topo_release.so"
topod_bin=target/release/topod
scale_hosts=${HARNESS_SCALE_HOSTS:-10000} scale_hung=${HARNESS_SCALE_HUNG:-500}
scale_topo=(AMD-17h-Zen-2xEpyc-7451.xml AMD-17h-Zen-2xEpyc-7451.xml AMD-17h-Zen-2xEpyc-7451.xml 32intel64-2p8co2t+8ve.xml 32intel64-2p8co2t+8ve.xml)
for t in 0 1 2 3 4; do start_topod "t$t" "${scale_topo[$t]}"; done
python3 - "$work/hung.sock" <<'PY' &
# Accepts every connection, reads what comes, never answers; closes when the client does.
import selectors, socket, sys
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1024)
sel = selectors.DefaultSelector(); sel.register(s, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is s:
            c, _ = s.accept(); sel.register(c, selectors.EVENT_READ)
        else:
            c = key.fileobj
            try: data = c.recv(65536)
            except OSError: data = b""
            if not data: sel.unregister(c); c.close()
PY
pids+=($!)
for t in t0 t1 t2 t3 t4; do
    for _ in $(seq 100); do [ -S "$work/$t/topod.sock" ] && break; sleep 0.05; done
done
for _ in $(seq 100); do [ -S "$work/hung.sock" ] && break; sleep 0.05; done
{
    cat <<TOML
[lsf]
handler_id = 142
log_file = "$work/scale.log"
log_level = "info"

[cache]
address_template = ""
domain = "cluster.example"
refresh_interval_ms = 10000
timeout_ms = 500
workers = 16
stale_after_ms = 120000
unreachable = "closed"
reservation_ttl_s = 600

[cache.hosts]
TOML
    awk -v n="$scale_hosts" -v h="$scale_hung" -v w="$work" 'BEGIN {
        for (i = 1; i <= n; i++) printf "n%05d = \"unix:%s/t%d/topod.sock\"\n", i, w, (i - 1) % 5
        for (i = 1; i <= h; i++) printf "hung%03d = \"unix:%s/hung.sock\"\n", i, w }'
} > "$work/scale.toml"
# The issue's thresholds are enforced: match+sort and end to end per job p50 <= 1 ms, match+sort
# p99 <= 5 ms, the first match of each shape <= 20 ms, at most 2 KB kept per pending requirement,
# on this 2-core machine. The ratio to the dummy module (1.3x asked) prints but is not enforced:
# this harness's own work per job is 22 us (the candidate list of 10,500), so 1.3x would leave
# the module 0.7 ns per candidate; topo's is 12.4-12.9x (end to end p50 0.27-0.28 ms, three runs,
# November 2026, quiet machine: match+sort p50 0.25-0.26 ms, p99 1.5-3.6 ms, first matches under
# 2.5 ms). They are wall-clock figures: while another job kept the CPUs busy (a QEMU guest taking
# 1.4 of the 2 CPUs) p99 reached 4.6-6.1 ms and one run failed, though matchFn's own CPU time
# stayed under 0.7 ms at p99 (its "figure" line); run the suite on a machine nothing else loads.
# HARNESS_SCALE_ENFORCE= (empty) prints them as "figures ok/FAIL" lines that fail nothing, for a
# machine shared with other load. Correctness (replays, no CPU given twice, every host
# refreshed, every job placed, host names read once per sched_init) always counts.
# HARNESS_SCALE_CALLGRIND=FILE: the scenario under valgrind's callgrind, counting only the
# instructions inside matchFn (repeatable whatever else the machine does, unlike its wall-clock
# figures), written to FILE for callgrind_annotate; with fewer hosts and jobs, e.g.
#   HARNESS_ONLY=scale HARNESS_SCALE_CALLGRIND=/tmp/match.cg HARNESS_SCALE_HOSTS=3000 \
#   HARNESS_SCALE_HUNG=0 HARNESS_SCALE_JOBS=100 HARNESS_SCALE_PENDING=200 HARNESS_SCALE_ENFORCE= \
#   tests/lsf-harness/run.sh        (about 3 minutes; "I refs" is the count)
under=()
if [ -n "${HARNESS_SCALE_CALLGRIND:-}" ]; then
    under=(valgrind --tool=callgrind "--callgrind-out-file=$HARNESS_SCALE_CALLGRIND" '--toggle-collect=*match_fn*')
fi
TOPO_LSF_CONF="$work/scale.toml" HARNESS_LOG="$work/scale.log" HARNESS_SCALE_HOSTS=$scale_hosts HARNESS_SCALE_HUNG=$scale_hung \
    HARNESS_SCALE_ENFORCE="${HARNESS_SCALE_ENFORCE-p50,p99,first,pending}" HARNESS_DUMMY_MODULE="$work/dummy_module.so" \
    run "${under[@]}" "$work/harness" "$work/schmod_topo_release.so" scale || status=1

if [ "$status" -ne 0 ]; then
    [ -f "$work/scale.log" ] && { echo "--- scale module log (warnings, last 20)"; grep -v " INFO " "$work/scale.log" | tail -n 20; }
    echo "--- module log (last 60 lines)"; tail -n 60 "$work/schmod_topo.log"
    for h in h1 h2 h3; do echo "--- topod $h"; tail -n 20 "$work/$h/log"; done
    echo "tests/lsf-harness/run.sh: FAILED"
    exit 1
fi
echo "tests/lsf-harness/run.sh: all LSF module scenarios passed"
