"""The process that becomes a job's program, as PBS MoM starts one: usage
launcher.py HOOK.py EVENT.json RESULT.json.

It runs the execjob_launch hook as its child (so the hook's os.getppid() is this process, as
observed on a real OpenPBS: the launch hook's parent is the process that will exec the job),
waits for it, and if the event was accepted execs event.progname with event.argv (an empty
argv means [progname]) and event.env as the whole environment, as MoM does: each value cut at
its first comma not escaped with a backslash (a comma after two backslashes is a cut: the
backslash is the one escaped), and a backslash that escapes the character after it dropped
(OpenPBS src/lib/Libattr/attr_func.c, strtok_quoted and prune_esc_backslash; quotes, which
strtok_quoted also reads, are not in any value the hook sets). Observed on the OpenPBS built
from ../shared/pbs: a hook's TOPO_GPUS=A,B reached the job as A; OpenPBS's pbs_cgroups hook
escapes its CUDA_VISIBLE_DEVICES so.
"""

import json
import os
import subprocess
import sys


def main():
    hook, event_file, result_file = sys.argv[1:4]
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_hook.py")
    subprocess.check_call([sys.executable, runner, hook, event_file, result_file])
    with open(result_file) as f:
        result = json.load(f)
    if result["outcome"] != "accept":
        sys.exit(3)
    argv = result["argv"] or [result["progname"]]
    env = dict((name, as_passed(value)) for name, value in result["env"].items())
    os.execve(result["progname"], argv, env)


def as_passed(value):
    """An event.env value as the job gets it (see above)."""
    cut = len(value)
    for i, c in enumerate(value):
        if c == "," and (i < 1 or value[i - 1] != "\\" or (i >= 2 and value[i - 2] == "\\")):
            cut = i
            break
    token, out, i = value[:cut], [], 0
    while i < len(token):
        if token[i] == "\\":
            i += 1
        if i < len(token):
            out.append(token[i])
        i += 1
    return "".join(out)


if __name__ == "__main__":
    main()
