#!/usr/bin/env bash
# The figures of issue 29's network findings, on the topod built in target/debug (or $TOPOD):
#  1. keyless TCP connections (512, from 8 loopback addresses) against a local user's
#     `topoctl status` on the socket (needs root: the user is nobody);
#  2. a scrape's latency while silent connections (8, or TOPO_FLOOD_SILENT) hold the metrics
#     listener;
#  3. the log lines of 10 s of connections refused by metrics_allow.
# Not part of the suite (it measures, it does not judge); prints one line per figure.
# Usage: sudo tests/network-flood-figures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TOPOD=${TOPOD:-target/debug/topod}
TOPOCTL=${TOPOCTL:-$(dirname "$TOPOD")/topoctl}
machine=topod/data/dell-r740-2x-xeon-gold-6230-snc2.xml
dir=$(mktemp -d /tmp/topo-flood.XXXXXX)
chmod 755 "$dir"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$dir"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
tcp=$(free_port); metrics=$(free_port); refused=$(free_port)
printf '0123456789abcdef-flood-key\n' > "$dir/key"; chmod 600 "$dir/key"
cat > "$dir/a.toml" <<EOF
tcp_listen = "127.0.0.1:$tcp"
tcp_allow = ["127.0.0.0/8"]
tcp_key_file = "$dir/key"
metrics_listen = "127.0.0.1:$metrics"
EOF
printf 'metrics_listen = "127.0.0.1:%s"\nmetrics_allow = ["192.0.2.7"]\n' "$refused" > "$dir/b.toml"
mkdir -p "$dir/a" "$dir/b"
chmod 755 "$dir/a"
"$TOPOD" --cgroup fake --topology "$machine" --socket "$dir/a/topod.sock" --state-dir "$dir/a" --config "$dir/a.toml" 2> "$dir/a.log" & pids+=($!)
"$TOPOD" --cgroup fake --topology "$machine" --socket "$dir/b/topod.sock" --state-dir "$dir/b" --config "$dir/b.toml" 2> "$dir/b.log" & pids+=($!)
for _ in $(seq 100); do [ -S "$dir/a/topod.sock" ] && [ -S "$dir/b/topod.sock" ] && break; sleep 0.1; done

python3 - "$tcp" "$metrics" "$refused" "$dir/a/topod.sock" "$TOPOCTL" <<'EOF'
import os, socket, subprocess, sys, time
tcp, metrics, refused = (int(x) for x in sys.argv[1:4])
SILENT = int(os.environ.get("TOPO_FLOOD_SILENT", "8"))
sock, topoctl = sys.argv[4], sys.argv[5]

def status_as_nobody():
    def drop():
        os.setgid(65534); os.setuid(65534)
    r = subprocess.run([topoctl, "status", "--socket", sock], capture_output=True, text=True,
                       preexec_fn=drop if os.geteuid() == 0 else None)
    return r.returncode == 0, (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]

held = []
for i in range(512):
    s = socket.socket()
    try:
        s.bind(("127.0.0.%d" % (1 + i % 8), 0)); s.connect(("127.0.0.1", tcp)); held.append(s)
    except OSError:
        s.close()
time.sleep(0.5)
ok, said = status_as_nobody()
k = socket.socket(); k.bind(("127.0.0.20", 0)); k.connect(("127.0.0.1", tcp))
k.sendall(b"0123456789abcdef-flood-key\n{\"v\":1,\"op\":\"version\"}\n")
k.settimeout(30)
answer = k.makefile().readline()
print("1. %d keyless TCP connections made; a local user's topoctl status: %s%s; a key holder: %s" % (
    len(held), "served" if ok else "REFUSED", "" if ok else " (" + said[0] + ")",
    "served" if '"ok"' in answer else "REFUSED (" + answer.strip()[:120] + ")"))
for s in held:
    s.close()

silent = [socket.create_connection(("127.0.0.1", metrics)) for _ in range(SILENT)]
times = []
for _ in range(5):
    t = time.monotonic()
    s = socket.create_connection(("127.0.0.1", metrics)); s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    times.append((time.monotonic() - t) * 1000)
print("2. a scrape with %d silent connections open from its own address: %s ms (%s)" % (SILENT,
    ", ".join("%.1f" % x for x in times), data.split(b"\r\n")[0].decode()))
for s in silent:
    s.close()

n, end, first = 0, time.monotonic() + 10, b""
while time.monotonic() < end:
    try:
        s = socket.create_connection(("127.0.0.1", refused)); d = s.recv(200); s.close(); n += 1
        first = first or d.split(b"\r\n")[0]
    except OSError:
        pass
print("3. %d connections refused in 10 s, answered %r;" % (n, first.decode() or "(nothing)"), end=" ")
EOF
sleep 0.5
echo "$(grep -c 'refused' "$dir/b.log" || true) log line(s) about them"
