#!/bin/sh
# Prints the qmgr commands of README's "Installation with qmgr" block, one per line, exactly as
# they stand there. tests/openpbs-e2e.sh runs them in a real OpenPBS, and the topo-pbs Debian
# package's install-hooks.sh is made of them (packaging/debian/build-debs.sh): one source, so the
# two cannot drift. Usage: packaging/pbs/qmgr-commands.sh [README]
readme=${1:-$(dirname "$0")/README}
sed -n '/^Installation with qmgr/,/^The same topo.py serves/p' "$readme" | grep -E '^  qmgr -c ' | sed 's/^  //'
