#!/bin/sh
# Writes install-hooks.sh (the topo-pbs package's /usr/share/topo-pbs/install-hooks.sh) to
# stdout: the qmgr commands of packaging/pbs/README's "Installation with qmgr" and "Removal with
# qmgr" blocks (taken by qmgr-commands.sh), each wrapped so that a second install succeeds and
# a removal goes on past what it cannot delete. packaging/debian/build-debs.sh and
# tests/openpbs-e2e.sh both make it here, so the package's script is the one the test runs.
# Usage: packaging/pbs/make-install-hooks.sh [README] > install-hooks.sh
set -e
here=$(dirname "$0")
readme=${1:-$here/README}
install=$("$here/qmgr-commands.sh" "$readme")
remove=$("$here/qmgr-commands.sh" --remove "$readme")
if [ "$(echo "$install" | grep -c '^qmgr -c ')" -lt 10 ] || [ "$(echo "$remove" | grep -c '^qmgr -c ')" -lt 4 ]; then
    echo "$0: $readme: the \"Installation with qmgr\" or \"Removal with qmgr\" block was not found" >&2
    exit 1
fi
cat <<'EOT'
#!/bin/sh
# topo-pbs: installs topo's PBS hooks (topo_submit on the server, topo on every MoM) and the
# resources they use, with qmgr; or removes them. Run it as root on the PBS server host, after
# editing /etc/topo/pbs/topo.json. The commands are the "Installation with qmgr" and "Removal
# with qmgr" blocks of /usr/share/doc/topo-pbs/README, taken from it when the package was built.
#
# Install (again): a resource that exists with the same type and flags is kept (with others,
# they are set, which PBS refuses while jobs use it); a hook that exists is configured and its
# script and configuration imported again (an upgrade of topo.py or a changed topo.json).
# --remove: deletes the hooks, then the resources; what cannot be deleted (a resource jobs still
# use) is said, the rest is done, and the exit status is then 1.
#
# Usage: /usr/share/topo-pbs/install-hooks.sh [--remove]
#   TOPO_PBS_CONFIG=FILE  another topo.json (default /etc/topo/pbs/topo.json)
#   TOPO_PBS_HOOK=FILE    another topo.py (default /usr/share/topo-pbs/topo.py)
set -ef   # -f: the commands are split into words, never expanded as file names
me=$(basename "$0")
config=${TOPO_PBS_CONFIG:-/etc/topo/pbs/topo.json}
hook=${TOPO_PBS_HOOK:-/usr/share/topo-pbs/topo.py}
case "${1:-}" in
    "") action=install ;;
    --remove) action=remove ;;
    *) echo "usage: $me [--remove]" >&2; exit 2 ;;
esac
if ! command -v qmgr >/dev/null 2>&1; then
    echo "$me: qmgr not found: run this on the PBS server host with PBS's bin directory in PATH" >&2
    exit 1
fi
say() { echo "$me: $*"; }
# The value of ATTRIBUTE in `qmgr -c "list TYPE NAME"` (empty when NAME does not exist).
listed() { # TYPE NAME ATTRIBUTE
    qmgr -c "list $1 $2" 2>/dev/null | awk -v k="$3" -F' = ' '{ sub(/^[ \t]+/, "", $1) } $1 == k { print $2; exit }'
}
# Whether TYPE NAME exists. A failed "list" means "not there" only while the server answers:
# a server gone meanwhile stops the script, saying that nothing after this point was checked.
exists() {
    qmgr -c "list $1 $2" >/dev/null 2>&1 && return 0
    qmgr -c "list server" >/dev/null 2>&1 && return 1
    say "the PBS server stopped answering (qmgr -c \"list server\" fails) while checking $1 $2: stopped here; what is installed from here on was not checked. Run this again (--remove to remove) once the server answers" >&2
    exit 2
}
# One command of the installation block; "create" of what exists becomes a check or an update.
install_step() {
    command=$1
    set -- $1
    case "$1 $2" in
        "create resource")
            name=$3; wanted_type=""; wanted_flag=""
            for pair in $(echo "${4:-}" | tr ',' ' '); do
                case "$pair" in
                    type=*) wanted_type=${pair#type=} ;;
                    flag=*) wanted_flag=${pair#flag=} ;;
                esac
            done
            if ! exists resource "$name"; then
                qmgr -c "create resource $name ${4:-}"
                say "resource $name created (${4:-})"
            elif [ "$(listed resource "$name" type)" = "$wanted_type" ] && [ "$(listed resource "$name" flag)" = "$wanted_flag" ]; then
                say "resource $name exists (type=$wanted_type,flag=$wanted_flag): kept"
            elif ! out=$(qmgr -c "set resource $name ${4:-}" 2>&1); then
                say "resource $name exists as type=$(listed resource "$name" type),flag=$(listed resource "$name" flag) and cannot be changed to ${4:-}: $out" >&2
                say "delete the jobs that use it, or run $me --remove first, then install again" >&2
                exit 1
            else
                say "resource $name changed to ${4:-}"
            fi
            ;;
        "create hook")
            if exists hook "$3"; then
                say "hook $3 exists: configured and imported again"
            else
                qmgr -c "create hook $3"
                say "hook $3 created"
            fi
            ;;
        *)
            qmgr -c "$command"
            ;;
    esac
}
failed=""
deleted_resources=""
changed_hook=0
# One command of the removal block: what does not exist is said, what PBS refuses is said and
# the removal goes on.
remove_step() {
    command=$1
    set -- $1
    kind=$2; name=$3
    if ! exists "$kind" "$name"; then
        if [ "$1" = delete ]; then say "$kind $name: not there"; fi
        return 0
    fi
    if [ "$1" != delete ]; then
        # A step before the deletion (the hook's stray server task cancelled): said if it fails.
        out=$(qmgr -c "$command" 2>&1) || say "$command: $out" >&2
        changed_hook=1
        return 0
    fi
    if [ "$kind" = hook ] && [ "$changed_hook" = 1 ]; then
        # The server sends a changed hook to the MoMs asynchronously; deleted right after the
        # change, the change arrived after the deletion and left topo.HK at the MoM (observed).
        say "waiting 5 s for the MoMs to receive the hook's change before deleting it"
        sleep 5
        changed_hook=0
    fi
    if out=$(qmgr -c "$command" 2>&1); then
        say "$kind $name deleted"
        if [ "$kind" = resource ]; then deleted_resources="$deleted_resources $name"; fi
    else
        out=$(echo "$out" | tr '\n' ' ')
        case "$out" in
            *busy*) why="jobs still have it: queued, running, or ended and kept in the job history (qstat -x); delete it once they are gone" ;;
            *) why="" ;;
        esac
        say "could not delete $kind $name: $out${why:+($why)}" >&2
        failed="$failed $kind:$name"
    fi
}
# A deleted MoM hook stays "pending delete" until every MoM has removed its copy ("list hook"
# no longer shows it); until then a MoM's periodic run may publish topo_free_* again, which PBS
# answers by re-creating them. So the resources are checked again at the end.
resources_back() {
    back=""
    for r in $deleted_resources; do
        exists resource "$r" && back="$back $r"
    done
    echo $back
}
if [ "$action" = install ]; then
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    # qmgr imports topo.py and topo.json from the current directory.
    cp "$hook" "$dir/topo.py"
    cp "$config" "$dir/topo.json"
    cd "$dir"
EOT
echo "$install" | sed 's/^qmgr -c /    install_step /'
cat <<'EOT'
    say "installed (hook $hook, configuration $config)"
    exit 0
fi
EOT
echo "$remove" | sed 's/^qmgr -c /remove_step /'
cat <<'EOT'
# A MoM that had not yet dropped the hook may have published a topo_free_* again.
sleep 5
for r in $(resources_back); do
    say "resource $r came back (a MoM's periodic hook published it before the MoM dropped the hook): deleting it again"
    remove_step "delete resource $r"
done
# What the hook left on the vnodes goes back to PBS: a vnode its last periodic run offlined
# (topod out of reach, a clean-up failed; its comment starts "topo: ") would stay offline with no
# hook left to bring it back, and the ncpus it published (the CPUs topod held outside PBS taken
# off, the comment says so) would stay lowered. Such a natural vnode gets its MoM's CPU count
# (pcpus) back. Other vnodes with fewer ncpus than pcpus are named, not changed (the hook also
# leaves out topod's own reserved CPUs, without a comment; an administrator may have set them);
# hosts with one vnode per NUMA node (vnode_per_numa_node) are named, to be set by hand.
publishes_ncpus=yes
grep -Eq '"publish_ncpus"[[:space:]]*:[[:space:]]*false' "$config" 2>/dev/null && publishes_ncpus=no
pbsnodes -av 2>/dev/null | awk '
    /^[^ \t]/ { name = $1; names[name] = 1 }
    /^[ \t]+pcpus = / { pcpus[name] = $3 }
    /^[ \t]+resources_available.ncpus = / { ncpus[name] = $3 }
    /^[ \t]+comment = topo: / { ours[name] = 1 }
    END { for (n in names) print n, (n in pcpus ? pcpus[n] : "-"), (n in ncpus ? ncpus[n] : "-"), (n in ours ? "ours" : "-") }' |
while read -r vnode pcpus ncpus comment; do
    if [ "$comment" = ours ]; then
        pbsnodes -r "$vnode" >/dev/null 2>&1 && qmgr -c "unset node $vnode comment" >/dev/null 2>&1 \
            && say "vnode $vnode, which topo's hook had offlined, is online again" \
            || say "vnode $vnode is still offline with topo's comment: run pbsnodes -r $vnode" >&2
    fi
    case $vnode in *"["*) continue ;; esac
    if [ "$publishes_ncpus" = yes ] && [ "$pcpus" != - ] && [ "$ncpus" != "$pcpus" ]; then
        if pbsnodes -av 2>/dev/null | grep -q "^$vnode\["; then
            say "vnode $vnode has one vnode per NUMA node, made by topo's hook: set their ncpus (and $vnode's) by hand" >&2
        elif [ "$comment" != ours ]; then
            say "vnode $vnode has ncpus $ncpus of its $pcpus CPUs (pcpus): if topo's hook set that (topod's reserved CPUs left out), give them back with: qmgr -c \"set node $vnode resources_available.ncpus = $pcpus\""
        elif qmgr -c "set node $vnode resources_available.ncpus = $pcpus" >/dev/null 2>&1; then
            say "vnode $vnode: ncpus $pcpus again (topo's hook had published $ncpus)"
        fi
    fi
done
# Resources gone from PBS but still named in the scheduler's configuration make it log errors.
sched_config=$(. /etc/pbs.conf 2>/dev/null; echo "${PBS_HOME:-/var/spool/pbs}/sched_priv/sched_config")
if [ -f "$sched_config" ] && grep -q '^resources:.*topo_free_' "$sched_config"; then
    say "$sched_config still lists topo_free_* in \"resources:\": take them out and send pbs_sched a HUP" >&2
fi
if [ -n "$failed" ]; then
    say "not removed:$failed" >&2
    # Said as commands: when this runs from the package's prerm, this script is gone afterwards.
    case "$failed" in
        *resource:*)
            history=$(qmgr -c "list server job_history_duration" 2>/dev/null | awk -F' = ' '/job_history_duration/ { print $2 }')
            say "jobs queued or running (their CPUs stay held by topod on their hosts until 'topoctl release pbs-<job id>' there, as topo's hooks are gone), or ended and kept in PBS's job history (job_history_duration: ${history:-336:00:00, the default}) still have it; once no job in qstat -x has it, delete what is left as root on this host with:" >&2 ;;
        *) say "delete what is left as root on this host with:" >&2 ;;
    esac
    for item in $failed; do
        say "  qmgr -c \"delete ${item%%:*} ${item#*:}\"" >&2
    done
    exit 1
fi
say "removed"
EOT
