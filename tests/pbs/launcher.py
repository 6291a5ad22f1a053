"""The process that becomes a job's program, as PBS MoM starts one: usage
launcher.py HOOK.py EVENT.json RESULT.json.

It runs the execjob_launch hook as its child (so the hook's os.getppid() is this process, as
observed on a real OpenPBS: the launch hook's parent is the process that will exec the job),
waits for it, and if the event was accepted execs event.progname with event.argv (an empty
argv means [progname]) and event.env as the whole environment, as MoM does.
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
    os.execve(result["progname"], argv, result["env"])


if __name__ == "__main__":
    main()
