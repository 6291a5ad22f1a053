#!/bin/sh
# Prints the qmgr commands of README's "Installation with qmgr" block (or, with --remove, of its
# "Removal with qmgr" block), one per line, exactly as they stand there. tests/openpbs-e2e.sh
# runs them in a real OpenPBS, and the topo-pbs Debian package's install-hooks.sh is made of
# them (packaging/pbs/make-install-hooks.sh): one source, so the two cannot drift.
# Usage: packaging/pbs/qmgr-commands.sh [--remove] [README]
set -e
if [ "${1:-}" = --remove ]; then
    shift
    first='^Removal with qmgr'
    last='^After the hooks are gone'
else
    first='^Installation with qmgr'
    last='^The same topo.py serves'
fi
readme=${1:-$(dirname "$0")/README}
sed -n "/$first/,/$last/p" "$readme" | grep -E '^  qmgr -c ' | sed 's/^  //'
