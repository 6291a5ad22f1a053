"""Runs a PBS hook script once, as pbs_python does: usage run_hook.py HOOK.py EVENT.json RESULT.json.

The stand-in `pbs` module (this directory) reads the event; the script runs in globals of its
own with no `__name__` entry, as PBS runs hook code (observed on a real OpenPBS: a top-level
`__name__` then resolves to the builtins module's name, 'builtins'); SystemExit from
accept()/reject() ends it; any other exception is what PBS logs as "hook encountered an exception, request rejected" and is reported as the
outcome "exception" with its traceback, so that a test can tell a handled failure from a crash.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pbs  # noqa: E402  (the stand-in, from this directory)


def main():
    hook, event_file, result_file = sys.argv[1:4]
    os.environ["PBS_STANDIN_EVENT"] = event_file
    with open(event_file) as f:
        description = json.load(f)
    pbs.hook_config_filename = description.get("hook_config_filename")
    pbs._undefined_resources = set(description.get("undefined_resources", ()))
    os.environ["PBS_STANDIN_HOST"] = description.get("host", "node1")
    exception = None
    try:
        with open(hook) as f:
            code = compile(f.read(), hook, "exec")
        # No __name__ of the hook's own: exec adds __builtins__, so the name the script sees
        # is the builtins module's, as under pbs_python.
        exec(code, {})
    except SystemExit:
        pass
    except BaseException:
        exception = traceback.format_exc()
    # Written whole, then renamed: the launcher's test reads it while the job runs.
    with open(result_file + ".tmp", "w") as f:
        json.dump(pbs._result(exception), f)
    os.rename(result_file + ".tmp", result_file)


if __name__ == "__main__":
    main()
