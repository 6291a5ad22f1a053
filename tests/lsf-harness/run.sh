#!/usr/bin/env bash
# The LSF module test: builds schmod_topo.so (and its panic-injection test build), libtopo.so,
# and the C harness that stands in for mbschd, starts real topod processes (fake cgroup backend) on real
# machines from shared/topologies, and runs the harness scenarios, one of them under valgrind.
#
#   h1  AMD EPYC 7451, 2 packages x 24 cores, served over topod's TCP listener (shared key)
#   h2  the same machine on a Unix socket, one package already held by a job
#   h3  2 x 8-core Intel (32 PUs), Unix socket
#   h4  no topod at all (the module is configured fail-closed)
#
# Usage: tests/lsf-harness/run.sh        (tests/run-all.sh runs it)
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
cc -std=c11 -D_DEFAULT_SOURCE -Wall -Wextra -Werror -g -o "$work/capi_test" tests/lsf-harness/capi_test.c -Ltarget/debug -ltopo -Wl,-rpath,"$PWD/target/debug"

start_topod() { # name topology [extra topod.toml lines]
    local name=$1 topo=$2
    mkdir -p "$work/$name"
    printf '%s\n' "${@:3}" > "$work/$name/topod.toml"
    RUST_LOG=warn target/debug/topod --config "$work/$name/topod.toml" --cgroup fake --topology "$topologies/$topo" \
        --socket "$work/$name/topod.sock" --state-dir "$work/$name" 2>"$work/$name/log" &
    pids+=($!)
}
port=$((20000 + RANDOM % 20000))
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/tcp.key"
chmod 600 "$work/tcp.key"   # topod refuses a key every user can read
start_topod h1 AMD-17h-Zen-2xEpyc-7451.xml "tcp_listen = \"127.0.0.1:$port\"" 'tcp_allow = ["127.0.0.1/32"]' "tcp_key_file = \"$work/tcp.key\""
start_topod h2 AMD-17h-Zen-2xEpyc-7451.xml
start_topod h3 32intel64-2p8co2t+8ve.xml
for h in h1 h2 h3; do
    for _ in $(seq 100); do [ -S "$work/$h/topod.sock" ] && break; sleep 0.05; done
done
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
export TOPO_LSF_CONF="$work/topo-lsf.toml" HARNESS_TOPOCTL="$PWD/target/debug/topoctl" HARNESS_H1_SOCKET="$work/h1/topod.sock"

run() { echo "== $*"; "$@"; }
status=0
run "$work/harness" "$work/schmod_topo.so" session || status=1
run "$work/harness" "$work/schmod_topo.so" restart || status=1
run "$work/harness-lsb" "$work/schmod_topo.so" restart || status=1
run "$work/harness" "$work/schmod_topo.so" reinit || status=1
TOPO_LSF_PANIC_IN=matchFn run "$work/harness" "$work/schmod_topo_panic.so" panic || status=1
# The whole session again under memcheck: no error, nothing definitely lost. (Job 101 is held
# by h1's topod by now; the session's expectations hold either way.)
HARNESS_REFRESH_MS=2000 run valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite "$work/harness" "$work/schmod_topo.so" session || status=1
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
if [ "$status" -ne 0 ]; then
    echo "--- module log (last 60 lines)"; tail -n 60 "$work/schmod_topo.log"
    for h in h1 h2 h3; do echo "--- topod $h"; tail -n 20 "$work/$h/log"; done
    echo "tests/lsf-harness/run.sh: FAILED"
    exit 1
fi
echo "tests/lsf-harness/run.sh: all LSF module scenarios passed"
