#!/usr/bin/env bash
# The Debian packages, round trip on this host: build them from the workspace
# (packaging/debian/build-debs.sh), lintian, install them with dpkg, read the manual pages, start
# topod from the installed unit (systemctl where systemd is PID 1; elsewhere the installed binary
# run as the unit says: its ExecStart after the package's drop-in, RuntimeDirectory, UMask,
# LimitNOFILE, CapabilityBoundingSet, NoNewPrivileges, and a notify socket for Type=notify), run
# one job through the installed topoctl and topo-exec, stop topod, remove the packages (only the
# conffiles stay) and purge them (nothing stays), and check that no job cgroup is left.
#
# topod runs on this host's real cgroups with a subtree, socket and state directory of its own
# (/run/topo/deb-roundtrip-PID/topod.toml, given with --config added to the unit's ExecStart, as
# a drop-in would), so the other tests' topods are not disturbed. Whatever happens, the packages are purged, topod stopped and its
# cgroups removed. Checks print "  ok: ..." or "  FAIL: ...". Needs root; exit 77 (a visible
# skip) when it cannot run here.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
me=tests/deb-roundtrip.sh
PACKAGES=(topod topo-lsf topo-slurm topo-pbs)
SUBTREE=topo-deb-test
JOB=deb-roundtrip-$$
RUNDIR=/run/topo/deb-roundtrip-$$
FAILED=0

if [ "$(id -u)" -ne 0 ]; then
    echo "$me: SKIPPED: installs packages with dpkg and makes cgroups: needs root"
    exit 77
fi
for p in "${PACKAGES[@]}"; do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -qv "not-installed"; then
        echo "$me: SKIPPED: package $p is already on this host ($(dpkg-query -W -f='${Status}' "$p")); the round trip would remove it"
        exit 77
    fi
done

ok() { echo "  ok: $*"; }
fail() { echo "  FAIL: $*"; FAILED=$((FAILED + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else fail "$what"; fi; }
log() { echo "[$(date +%T)] $*"; }

started=$(date +%s)
BASE=$(mktemp -d /tmp/topo-deb.XXXXXX)
chmod 755 "$BASE"
etc_topo_before=0; [ -e /etc/topo ] && etc_topo_before=1
run_topo_before=0; [ -e /run/topo ] && run_topo_before=1
TOPOD_PID="" NOTIFY_PID="" SYSTEMD_STARTED=0

cgroup_dirs() { ls -d /sys/fs/cgroup/"$SUBTREE"* /sys/fs/cgroup/*/"$SUBTREE"* 2>/dev/null || true; }
cleanup() {
    local rc=$?
    set +e
    if [ "$SYSTEMD_STARTED" = 1 ]; then
        systemctl stop topod.service
        rm -rf /run/systemd/system/topod.service.d/zz-roundtrip.conf
        systemctl daemon-reload
    fi
    if [ -n "$TOPOD_PID" ] && kill -0 "$TOPOD_PID" 2>/dev/null; then
        /usr/bin/topoctl release --socket "$RUNDIR/topod.sock" "$JOB" >/dev/null 2>&1
        kill "$TOPOD_PID"; wait "$TOPOD_PID" 2>/dev/null
    fi
    [ -n "$NOTIFY_PID" ] && kill "$NOTIFY_PID" 2>/dev/null
    # A job cgroup left by a failure: its processes killed, then the cgroups, deepest first.
    local dir
    for dir in $(cgroup_dirs); do
        find "$dir" -name tasks -o -name cgroup.procs | xargs -r cat 2>/dev/null | xargs -r kill -9 2>/dev/null
        find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    local installed=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -qv "not-installed" && installed+=("$p")
    done
    [ "${#installed[@]}" -gt 0 ] && dpkg --purge "${installed[@]}" >/dev/null
    rm -rf "$RUNDIR"
    [ "$run_topo_before" = 0 ] && rm -rf /run/topo
    rm -rf "$BASE"
    exit "$rc"
}
trap cleanup EXIT
# A signal ends the script through exit, so that the clean-up runs.
trap "exit 130" INT
trap "exit 143" TERM

# --- build and lint -------------------------------------------------------------------------------
log "building the packages"
packaging/debian/build-debs.sh "$BASE/debs" > "$BASE/debs.list"
debs=()
for p in "${PACKAGES[@]}"; do
    deb=$(ls "$BASE"/debs/"${p}"_*.deb 2>/dev/null | head -1)
    check "package $p built ($(basename "${deb:-none}"))" test -n "$deb"
    [ -n "$deb" ] && debs+=("$deb")
done
[ "${#debs[@]}" -eq "${#PACKAGES[@]}" ] || { echo "$me: not every package was built" >&2; exit 1; }

log "lintian"
# The verdict without the overridden tags (lintian counts a shown override as a warning), then
# every tag, overridden ones too, for the log.
lintian_rc=0
lintian --fail-on error,warning "${debs[@]}" > "$BASE/lintian.out" 2>&1 || lintian_rc=$?
lintian --display-info --show-overrides "${debs[@]}" 2>&1 | grep -E '^[EWIO]:' | sed 's/^/  lintian: /' || true
check "lintian finds no error or warning (overrides each explained in packaging/debian/lintian/)" test "$lintian_rc" = 0
# An override without its reason: the line before it in the file is not a comment.
check "every lintian override has a comment saying why" \
    awk 'FNR == 1 { prev = "" } /^[a-z]/ && prev !~ /^#/ { bad = 1; print FILENAME ": " $0 } { prev = $0 } END { exit bad }' packaging/debian/lintian/*

slurm_version=$(dpkg-query -W -f='${Version}' libslurm-dev)
check "topo-slurm depends on the Slurm it was built against ($slurm_version)" \
    grep -qF "slurm-wlm-basic-plugins (>= $slurm_version)" <(dpkg-deb -f "$BASE"/debs/topo-slurm_*.deb Depends)
check "topod's /etc/topo/topod.toml is a conffile" \
    grep -qx /etc/topo/topod.toml <(dpkg-deb --ctrl-tarfile "$BASE"/debs/topod_*.deb | tar -xO ./conffiles)

# --- install --------------------------------------------------------------------------------------
log "dpkg -i ${debs[*]##*/}"
# Man pages are wanted even where the image's dpkg configuration leaves them out.
dpkg --path-include='/usr/share/man/*' -i "${debs[@]}" > "$BASE/dpkg-install.log" 2>&1 || { cat "$BASE/dpkg-install.log"; fail "dpkg -i"; exit 1; }
for p in "${PACKAGES[@]}"; do
    check "$p is installed" grep -q "install ok installed" <(dpkg-query -W -f='${Status}' "$p")
    dpkg -L "$p" > "$BASE/files.$p"
done
check "the installed unit is not enabled (the package enables nothing)" \
    bash -c '! ls /etc/systemd/system/*.wants/topod.service /var/lib/systemd/deb-systemd-helper-enabled/*.wants/topod.service >/dev/null 2>&1'
running_installed() {
    local p
    for p in /proc/[0-9]*; do [ "$(readlink "$p/exe" 2>/dev/null)" = /usr/sbin/topod ] && return 0; done
    return 1
}
no_installed_topod() { ! running_installed; }
check "the package started no topod" no_installed_topod
check "/etc/topo/topod.toml is the default file, every key commented out" cmp /etc/topo/topod.toml packaging/topod.toml

check "man -w topod finds topod(8)" grep -qx /usr/share/man/man8/topod.8.gz <(man -w topod 2>&1)
check "man -w topod.toml finds topod.toml(5)" grep -qx /usr/share/man/man5/topod.toml.5.gz <(man -w 5 topod.toml 2>&1)
MANWIDTH=100 man topod > "$BASE/man-topod.txt" 2> "$BASE/man-topod.err" || true
check "man topod renders, with its options and files" \
    bash -c "grep -q 'the per-host daemon' '$BASE/man-topod.txt' && grep -q -- '--config <FILE>' '$BASE/man-topod.txt' && grep -q '/etc/topo/topod.toml' '$BASE/man-topod.txt'"
check "man topod: groff says nothing" test ! -s "$BASE/man-topod.err"
check "man topod.toml lists every key (cgroup_subtree, write_timeout_ms)" \
    bash -c "MANWIDTH=100 man 5 topod.toml 2>/dev/null | grep -q cgroup_subtree && MANWIDTH=100 man 5 topod.toml | grep -q write_timeout_ms"
check "man topoctl-alloc and man topo-exec render" \
    bash -c "man topoctl-alloc 2>/dev/null | grep -q -- '--job' && man topo-exec 2>/dev/null | grep -q TOPO_CPUS"
check "bash completion for topoctl loads and completes subcommands" \
    bash -c 'source /usr/share/bash-completion/completions/topoctl && complete -p topoctl >/dev/null && COMP_WORDS=(topoctl al) COMP_CWORD=1 COMP_LINE="topoctl al" COMP_POINT=10 && _topoctl topoctl al topoctl && printf "%s\n" "${COMPREPLY[@]}" | grep -qx alloc'
check "zsh and fish completions are installed" test -s /usr/share/zsh/vendor-completions/_topoctl -a -s /usr/share/fish/vendor_completions.d/topoctl.fish

# topo-pbs: its install-hooks.sh runs the README's qmgr commands, with the hook and its config
# in the current directory (a stand-in qmgr records what it is asked).
mkdir -p "$BASE/fakebin"
cat > "$BASE/fakebin/qmgr" <<EOT
#!/bin/sh
[ "\$1" = -c ] || exit 2
case "\$2" in
    # A fresh server that answers (as a real one does "list server"): only what was created
    # since exists (install-hooks.sh asks before it creates, and lists the hooks at the end);
    # a list is not recorded.
    "list server") exit 0 ;;
    "list "*) grep -qxF "create \${2#list }" "$BASE/qmgr.created" 2>/dev/null; exit \$? ;;
    "create "*) echo "\$2" >> "$BASE/qmgr.created" ;;
    "import hook "*" topo.py") cmp -s topo.py /usr/share/topo-pbs/topo.py || { echo "qmgr: no topo.py here" >&2; exit 1; } ;;
    "import hook "*" topo.json") cmp -s topo.json /etc/topo/pbs/topo.json || { echo "qmgr: no topo.json here" >&2; exit 1; } ;;
esac
printf 'qmgr -c "%s"\n' "\$2" >> "$BASE/qmgr.log"
EOT
chmod 755 "$BASE/fakebin/qmgr"
PATH="$BASE/fakebin:$PATH" /usr/share/topo-pbs/install-hooks.sh > "$BASE/install-hooks.out" 2>&1 || cat "$BASE/install-hooks.out"
packaging/pbs/qmgr-commands.sh | sed 's/"; qmgr -c "/"\nqmgr -c "/g' | grep -v '^qmgr -c "list ' > "$BASE/qmgr.expected"
check "topo-pbs's install-hooks.sh runs packaging/pbs/README's $(wc -l < "$BASE/qmgr.expected") qmgr commands, in order, with topo.py and topo.json at hand" \
    cmp "$BASE/qmgr.expected" "$BASE/qmgr.log"
check "topo-pbs's topo.json names the installed topoctl, topo-exec and protocol schema" python3 -c '
import json, os, sys
c = json.load(open("/etc/topo/pbs/topo.json"))
want = {"topoctl": "/usr/bin/topoctl", "topo_exec": "/usr/bin/topo-exec", "protocol_schema": "/usr/share/topo/protocol.schema.json"}
bad = [(k, c.get(k)) for k, v in want.items() if c.get(k) != v or not os.path.isfile(v)]
sys.exit("topo.json: %s" % bad if bad else 0)'

check "topo-slurm's spank_topo.so exports the SPANK entry points" \
    bash -c "nm -D --defined-only /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_topo.so | grep -qw plugin_version && nm -D --defined-only /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_topo.so | grep -qw slurm_spank_init"
check "topo-lsf's schmod_topo.so and libtopo.so are in /usr/lib/topo with topo.h" \
    test -f /usr/lib/topo/schmod_topo.so -a -f /usr/lib/topo/libtopo.so -a -f /usr/include/topo/topo.h

# --- topod from the installed unit ------------------------------------------------------------------
# Under /run/topo, not /tmp: the unit gives topod a private /tmp and a read-only file system but
# for /run/topo and the cgroup tree (PrivateTmp, ProtectSystem=strict, ReadWritePaths).
mkdir -p -m 0755 /run/topo
mkdir -p -m 0700 "$RUNDIR" "$RUNDIR/state"
cat > "$RUNDIR/topod.toml" <<EOT
socket = "$RUNDIR/topod.sock"
state_dir = "$RUNDIR/state"
cgroup_subtree = "$SUBTREE"
EOT
SOCK=$RUNDIR/topod.sock
UNIT=/usr/lib/systemd/system/topod.service
# A key's value as systemd reads it: the unit, then its drop-ins in order; an empty assignment
# resets a list (ExecStart=).
unit_value() {
    local key=$1 value="" line f
    for f in "$UNIT" $(ls "$UNIT".d/*.conf 2>/dev/null | sort); do
        while IFS= read -r line; do
            case "$line" in "$key="*) value=${line#"$key="} ;; esac
        done < "$f"
    done
    echo "$value"
}
exec_start=$(unit_value ExecStart)
check "the installed unit runs the installed topod (ExecStart=$exec_start)" test "$exec_start" = /usr/sbin/topod
if [ -d /run/systemd/system ] && [ "$(ps -p 1 -o comm=)" = systemd ]; then
    log "systemd runs here: systemctl start topod (a runtime drop-in adds --config)"
    mkdir -p /run/systemd/system/topod.service.d
    printf '[Service]\nExecStartPre=\nExecStartPre=+%s --prepare-cgroups --config %s\nExecStart=\nExecStart=%s --config %s\n' \
        "$exec_start" "$RUNDIR/topod.toml" "$exec_start" "$RUNDIR/topod.toml" \
        > /run/systemd/system/topod.service.d/zz-roundtrip.conf
    systemctl daemon-reload
    SYSTEMD_STARTED=1
    systemctl start topod.service
    check "systemctl start topod: active" systemctl is-active --quiet topod.service
    TOPOD_PID=$(systemctl show -p MainPID --value topod.service)
else
    log "systemd is not PID 1 here: the installed binary with the unit's settings"
    runtime_dir=$(unit_value RuntimeDirectory)
    umask_value=$(unit_value UMask)
    nofile=$(unit_value LimitNOFILE)
    bounding=$(unit_value CapabilityBoundingSet | tr 'A-Z' 'a-z' | sed 's/cap_/+/g; s/ /,/g')
    no_new_privs=()
    [ "$(unit_value NoNewPrivileges)" = yes ] && no_new_privs=(--no-new-privs)
    [ "$(unit_value Type)" = notify ] || fail "the unit is Type=notify"
    [ -n "$runtime_dir" ] && mkdir -p -m 0755 "/run/$runtime_dir"
    # The unit's ExecStartPre=+ makes the subtree with root's full privileges (systemd's "+"):
    # the daemon keeps only CAP_KILL, CAP_SYS_NICE and CAP_NET_BIND_SERVICE, and a cgroup v1 hierarchy root of mode
    # 0555 (this host's cpuset is $(stat -c %a /sys/fs/cgroup/cpuset 2>/dev/null)) is writable
    # only with CAP_DAC_OVERRIDE.
    exec_start_pre=$(unit_value ExecStartPre)
    check "the unit prepares the cgroup subtree with full privileges (ExecStartPre=$exec_start_pre)" \
        test "$exec_start_pre" = "+/usr/sbin/topod --prepare-cgroups"
    ${exec_start_pre#+} --config "$RUNDIR/topod.toml" >> "$BASE/topod.log" 2>&1 \
        || fail "ExecStartPre failed: $(tail -1 "$BASE/topod.log")"
    # Type=notify: a datagram socket that topod must say READY=1 on.
    python3 - "$BASE/notify.sock" "$BASE/notify.out" <<'EOT' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(30)
with open(sys.argv[2], "w") as out:
    try:
        while True:
            msg = s.recv(4096).decode()
            out.write(msg + "\n"); out.flush()
            if "READY=1" in msg.split("\n"):
                break
    except socket.timeout:
        pass
EOT
    NOTIFY_PID=$!
    for _ in $(seq 50); do [ -S "$BASE/notify.sock" ] && break; sleep 0.1; done
    (
        umask "${umask_value:-0022}"
        # As high as the unit says, or as this container's hard limit allows.
        if [ -n "$nofile" ]; then ulimit -n "$nofile" 2>/dev/null || ulimit -n "$(ulimit -Hn)"; fi
        export NOTIFY_SOCKET=$BASE/notify.sock
        exec setpriv --bounding-set="-all${bounding:+,$bounding}" "${no_new_privs[@]}" \
            $exec_start --config "$RUNDIR/topod.toml"
    ) >> "$BASE/topod.log" 2>&1 < /dev/null &
    TOPOD_PID=$!
    wait "$NOTIFY_PID" || true
    NOTIFY_PID=""
    check "topod told its notify socket READY=1 (Type=notify)" grep -qx READY=1 "$BASE/notify.out"
    check "topod kept only the unit's capabilities ($(unit_value CapabilityBoundingSet))" \
        grep -qi "capabilities.*: cap_kill cap_net_bind_service cap_sys_nice$" "$BASE/topod.log"
fi
for _ in $(seq 100); do /usr/bin/topoctl status --socket "$SOCK" >/dev/null 2>&1 && break; sleep 0.1; done
check "the installed topoctl reaches the installed topod" bash -c "/usr/bin/topoctl status --socket '$SOCK' >/dev/null"
grep -h "" "$BASE/topod.log" 2>/dev/null | sed 's/^/  topod log: /' | head -20

# --- one job through it ----------------------------------------------------------------------------
log "topoctl run --request 'affinity[core]' --job $JOB"
cat > "$BASE/job.sh" <<EOT
#!/bin/sh
cat /proc/self/cgroup > "$BASE/job.cgroup"
grep Cpus_allowed_list /proc/self/status | awk '{ print \$2 }' > "$BASE/job.cpus"
/usr/bin/topoctl jobs --socket "$SOCK" > "$BASE/job.ledger"
ls -d /sys/fs/cgroup/*/$SUBTREE/$JOB > "$BASE/job.dirs" 2>/dev/null
echo "\${TOPO_JOB:-}" > "$BASE/job.env"
EOT
chmod 755 "$BASE/job.sh"
run_rc=0
/usr/bin/topoctl run --socket "$SOCK" --request 'affinity[core]' --job "$JOB" -- "$BASE/job.sh" > "$BASE/run.out" 2>&1 || run_rc=$?
cat "$BASE/run.out" | sed 's/^/  topoctl run: /'
check "topoctl run exits 0" test "$run_rc" = 0
ledger_cpus=$(awk -v j="$JOB" '$1 == j { print $3 }' "$BASE/job.ledger" 2>/dev/null)
check "the job was in topod's ledger while it ran (CPUs ${ledger_cpus:-none})" test -n "$ledger_cpus"
check "the job ran on topod's CPUs (Cpus_allowed_list $(cat "$BASE/job.cpus" 2>/dev/null))" test "$(cat "$BASE/job.cpus" 2>/dev/null)" = "$ledger_cpus"
check "the job ran in topod's cgroup /$SUBTREE/$JOB" grep -q ":/$SUBTREE/$JOB\$" "$BASE/job.cgroup"
check "topo-exec set TOPO_JOB=$JOB" grep -qx "$JOB" "$BASE/job.env"
check "the job's cgroups existed while it ran ($(wc -l < "$BASE/job.dirs" 2>/dev/null || echo 0))" test -s "$BASE/job.dirs"
check "released: topod's ledger is empty" grep -qx "no jobs" <(/usr/bin/topoctl jobs --socket "$SOCK")
left=$(find $(cgroup_dirs) -mindepth 1 -type d 2>/dev/null | tr '\n' ' ')
check "released: no job cgroup left under $SUBTREE (${left:-none})" test -z "$left"

# --- stop, remove, purge ----------------------------------------------------------------------------
log "stopping topod"
if [ "$SYSTEMD_STARTED" = 1 ]; then
    systemctl stop topod.service
    rm -f /run/systemd/system/topod.service.d/zz-roundtrip.conf
    systemctl daemon-reload
    SYSTEMD_STARTED=0
else
    kill "$TOPOD_PID"
    for _ in $(seq 100); do kill -0 "$TOPOD_PID" 2>/dev/null || break; sleep 0.1; done
    wait "$TOPOD_PID" 2>/dev/null || true
fi
check "topod stopped" bash -c "! kill -0 $TOPOD_PID 2>/dev/null"
TOPOD_PID=""
# topod leaves its (empty) subtree when it stops; it is the test's to remove.
rmdir_failed=""
for dir in $(cgroup_dirs); do rmdir "$dir" 2>/dev/null || rmdir_failed+="$dir "; done
check "topod's subtree held no cgroup and was removed (${rmdir_failed:-all removed})" test -z "$rmdir_failed"

log "dpkg -r ${PACKAGES[*]}"
dpkg -r "${PACKAGES[@]}" > "$BASE/dpkg-remove.log" 2>&1 || { cat "$BASE/dpkg-remove.log"; fail "dpkg -r"; }
for p in "${PACKAGES[@]}"; do
    conffiles=$(dpkg-deb --ctrl-tarfile "$BASE"/debs/"${p}"_*.deb | tar -xO ./conffiles 2>/dev/null || true)
    # Every file of the package but its conffiles is gone; the conffiles stay.
    stray=""
    while IFS= read -r f; do
        [ -d "$f" ] && continue
        grep -qxF "$f" <<<"$conffiles" && continue
        [ -e "$f" ] && stray+="$f "
    done < "$BASE/files.$p"
    check "removed $p: no file of it left but its conffiles (${stray:-none left})" test -z "$stray"
    if [ -n "$conffiles" ]; then
        check "removed $p: its conffiles stay ($(echo $conffiles))" bash -c "for f in $(echo $conffiles); do test -f \$f || exit 1; done"
        listed=$(dpkg -L "$p" 2>/dev/null | while IFS= read -r f; do [ -d "$f" ] || echo "$f"; done | sort | tr '\n' ' ')
        check "removed $p: dpkg -L lists only its conffiles ($listed)" test "$listed" = "$(echo "$conffiles" | sort | tr '\n' ' ')"
    else
        check "removed $p: dpkg knows nothing more of it" bash -c "! dpkg -L $p >/dev/null 2>&1"
    fi
done

log "dpkg --purge ${PACKAGES[*]}"
dpkg --purge "${PACKAGES[@]}" > "$BASE/dpkg-purge.log" 2>&1 || { cat "$BASE/dpkg-purge.log"; fail "dpkg --purge"; }
for p in "${PACKAGES[@]}"; do
    stray=""
    while IFS= read -r f; do
        [ -d "$f" ] && continue
        [ -e "$f" ] && stray+="$f "
    done < "$BASE/files.$p"
    check "purged $p: not a file of it left (${stray:-none})" test -z "$stray"
    check "purged $p: dpkg -L knows nothing of it" bash -c "! dpkg -L $p >/dev/null 2>&1"
done
# Directories only the packages made (dpkg removes them once empty).
for dir in /usr/share/topo /usr/share/topo-pbs /usr/lib/topo /usr/include/topo /usr/share/doc/topod /usr/lib/systemd/system/topod.service.d; do
    check "purged: $dir is gone" test ! -e "$dir"
done
[ "$etc_topo_before" = 0 ] && check "purged: /etc/topo is gone" test ! -e /etc/topo
check "purged: systemd's package state forgets topod.service" \
    bash -c '! ls /var/lib/systemd/deb-systemd-helper-enabled/*topod* /var/lib/systemd/deb-systemd-helper-masked/*topod* >/dev/null 2>&1'
check "no topod cgroup of the round trip left ($(cgroup_dirs | tr '\n' ' '))" test -z "$(cgroup_dirs)"

echo "$me: took $(( $(date +%s) - started )) s"
if [ "$FAILED" -gt 0 ]; then
    echo "$me: $FAILED check(s) failed"
    exit 1
fi
echo "$me: all checks passed"
