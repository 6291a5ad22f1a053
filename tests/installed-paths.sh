#!/usr/bin/env bash
# One set of paths everywhere: every absolute path to one of topo's programs or libraries that
# the repository's files name (READMEs, the unit, examples, hooks, scripts) must be where the
# Debian packages install it (the assets in each crate's [package.metadata.deb]), and a build from
# source installs to the same places, so no file may name /usr/local for them.
# Usage: tests/installed-paths.sh     (prints each wrong mention with its file and line)
set -euo pipefail
cd "$(dirname "$0")/.."
git ls-files -z | python3 -c '
import re, sys, tomllib
installed = set()
for manifest in ["topod/Cargo.toml", "plugin/lsf/Cargo.toml", "plugin/slurm/Cargo.toml", "plugin/core/Cargo.toml"]:
    deb = tomllib.load(open(manifest, "rb"))["package"]["metadata"]["deb"]
    for source, dest, _mode in deb["assets"]:
        path = "/" + dest
        if dest.endswith("/"):
            path += source.rsplit("/", 1)[-1]
        # Programs and libraries only (a manual page or a completion has the name of a program).
        if re.search(r"/(s?bin|lib)/", path):
            installed.add(path)
names = ["topod", "topoctl", "topo-exec", "schmod_topo.so", "spank_topo.so", "libtopo.so"]
expected = {n: sorted(p for p in installed if p.rsplit("/", 1)[-1] == n) for n in names}
missing = [n for n, paths in expected.items() if not paths]
if missing:
    sys.exit("tests/installed-paths.sh: the packages install no %s: update this check" % ", ".join(missing))
mention = re.compile(r"(?<![\w.-])(/(?:usr|opt|bin|sbin)(?:/(?!share/|include/)[\w.+-]+)*/(%s))(?![\w.-])" % "|".join(re.escape(n) for n in names))
local_line = re.compile(r"/usr/local/s?bin\b")
program = re.compile(r"\b(topod|topoctl|topo-exec)\b")
wrong = []
for path in sys.stdin.read().split("\0"):
    if not path or path == "tests/installed-paths.sh":
        continue
    try:
        text = open(path, encoding="utf-8").read()
    except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
        continue
    for number, line in enumerate(text.splitlines(), 1):
        for m in mention.finditer(line):
            if m.group(1) not in installed:
                wrong.append("%s:%d: %s (installed: %s)" % (path, number, m.group(1), " or ".join(expected[m.group(2)])))
        if local_line.search(line) and program.search(line):
            wrong.append("%s:%d: names /usr/local for a topo program (installed: /usr/sbin/topod, /usr/bin/topoctl, /usr/bin/topo-exec): %s" % (path, number, line.strip()))
for w in wrong:
    print(w)
if wrong:
    sys.exit("tests/installed-paths.sh: %d mention(s) of a path where no package installs it" % len(wrong))
print("tests/installed-paths.sh: every path to topo'"'"'s programs and libraries is where the packages install them (%d paths)" % len(installed))
'
