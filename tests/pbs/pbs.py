"""A stand-in for PBS's `pbs` hook module, for running topo's hook without a PBS installation.

It keeps to the documented hook interface (PBS Professional Hooks Guide; OpenPBS
src/include/hook.h for the event bits; observations on a real OpenPBS in
shared/reference/pbs-hooks-observed.md) and to how pbs_python runs a hook:

- each event runs the hook in a fresh interpreter (tests/pbs/run_hook.py), the script executed
  in globals without a `__name__` of their own, so `__name__` is 'builtins' (observed);
- pbs.event() is the one event of that run: type, hook_name, job (id, Resource_List,
  schedselect, exec_vnode, euser, session_id, queue, Variable_List, rerun()), job_o (modifyjob), pid (attach),
  progname / argv / env (launch; env is dict-like and a missing key raises KeyError),
  vnode_list (MoM events), job_list (exechost_periodic);
- event.accept() and event.reject(msg) end the hook by raising SystemExit; a hook that ends
  without either is accepted; an exception is "hook encountered an exception, request rejected";
- Resource_List[name] is None for a resource the job does not have, and raises AttributeError
  for one the server does not define (the event's "undefined_resources");
- pbs.logmsg, pbs.logjobmsg, pbs.get_local_nodename, pbs.hook_config_filename, pbs.size,
  pbs.vnode, the ND_* vnode states and the LOG_* / EVENT_* log levels.

The event comes from a JSON file ($PBS_STANDIN_EVENT); what the hook did (accept or reject and
the message, the launch command and environment, vnode changes, rerun, log lines) is written
to $PBS_STANDIN_RESULT by the runner.
"""

import json
import os

# Event types: the bits of src/include/hook.h.
QUEUEJOB = 0x01
MODIFYJOB = 0x02
RESVSUB = 0x04
MOVEJOB = 0x08
RUNJOB = 0x10
EXECJOB_BEGIN = 0x40
EXECJOB_PROLOGUE = 0x80
EXECJOB_EPILOGUE = 0x100
EXECJOB_END = 0x200
EXECJOB_PRETERM = 0x400
EXECJOB_LAUNCH = 0x800
EXECHOST_PERIODIC = 0x1000
EXECHOST_STARTUP = 0x2000
EXECJOB_ATTACH = 0x4000
# As the real pbs module of OpenPBS 23.06 has them (printed from /opt/pbs's _pbs_v1).
EXECJOB_POSTSUSPEND = 0x80000
EXECJOB_PRERESUME = 0x100000

EVENT_NAMES = {
    "queuejob": QUEUEJOB, "modifyjob": MODIFYJOB, "runjob": RUNJOB, "execjob_begin": EXECJOB_BEGIN,
    "execjob_prologue": EXECJOB_PROLOGUE, "execjob_epilogue": EXECJOB_EPILOGUE, "execjob_end": EXECJOB_END,
    "execjob_launch": EXECJOB_LAUNCH, "exechost_periodic": EXECHOST_PERIODIC,
    "exechost_startup": EXECHOST_STARTUP, "execjob_attach": EXECJOB_ATTACH,
    "execjob_postsuspend": EXECJOB_POSTSUSPEND, "execjob_preresume": EXECJOB_PRERESUME,
}

# Vnode states (bit values as in PBS: free is no bit set).
ND_FREE = 0
ND_OFFLINE = 1

# Log levels.
LOG_DEBUG = 0x0004
LOG_WARNING = 0x0003
LOG_ERROR = 0x0002
EVENT_ERROR = 0x0001
EVENT_SYSTEM = 0x0002
EVENT_DEBUG = 0x0080

# Set by the runner from the event file: None when no configuration file was imported.
hook_config_filename = None

_log = []
_event = None


class size(object):
    """pbs.size: a size with its unit, printed as given ("100mb")."""

    def __init__(self, text):
        self.text = str(text)

    def __str__(self):
        return self.text

    def __repr__(self):
        return "pbs.size(%r)" % self.text


# Resources the PBS server of this event does not define (the event file's
# "undefined_resources"): reading one raises AttributeError, as the real pbs_resource does.
_undefined_resources = set()


class pbs_resource(dict):
    """Resource_List / resources_available: a resource the job does not have is None, not a
    KeyError; one the server does not define raises AttributeError (observed on OpenPBS 23.06:
    "'pbs_resource' object has no attribute 'ngpus'" before `qmgr create resource ngpus`)."""

    def __getitem__(self, key):
        if key in _undefined_resources:
            raise AttributeError("'pbs_resource' object has no attribute '%s'" % key)
        return dict.get(self, key)


class pbs_env(dict):
    """event.env in execjob_launch: a plain dict (a missing key raises KeyError)."""


class job(object):
    """pbs.job as a MoM or the server shows it."""

    def __init__(self, fields):
        resources = dict(fields.get("Resource_List", {}))
        if "mem" in resources:
            resources["mem"] = size(resources["mem"])
        self.Resource_List = pbs_resource(resources)
        self.id = fields.get("id", "")
        self.schedselect = fields.get("schedselect")
        self.exec_vnode = fields.get("exec_vnode")
        self.euser = fields.get("euser")
        self.queue = queue(fields["queue"]) if fields.get("queue") else None
        self.Variable_List = dict(fields.get("Variable_List", {}))
        self.session_id = fields.get("session_id")
        self.comment = fields.get("comment")
        self.rerun_requested = False

    def rerun(self):
        self.rerun_requested = True


class queue(object):
    """pbs.queue: its name (str() gives it too)."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


class vnode(object):
    """pbs.vnode: name, state, comment, resources_available."""

    def __init__(self, name, fields=None):
        fields = fields or {}
        self.name = name
        self.state = fields.get("state", ND_FREE)
        self.comment = fields.get("comment")
        self.resources_available = pbs_resource(fields.get("resources_available", {}))


class event(object):
    """pbs.event(): the event of this hook run (a singleton, as in PBS)."""

    def __new__(cls):
        global _event
        if _event is None:
            _event = object.__new__(cls)
            _event._load(os.environ["PBS_STANDIN_EVENT"])
        return _event

    def _load(self, path):
        with open(path) as f:
            d = json.load(f)
        self.type = EVENT_NAMES[d["event"]]
        self.hook_name = d.get("hook_name", "topo")
        self.requestor = d.get("requestor", "PBS_Server")
        self.job = job(d["job"]) if "job" in d else None
        self.job_o = job(d["job_o"]) if "job_o" in d else None
        self.pid = d.get("pid")
        self.progname = d.get("progname")
        self.argv = d.get("argv")
        self.env = pbs_env(d.get("env", {}))
        self.vnode_list = dict((n, vnode(n, v)) for n, v in d.get("vnode_list", {}).items())
        # exechost_periodic's jobs: a list of ids, or ids with their fields.
        jobs = d.get("job_list", [])
        jobs = jobs if isinstance(jobs, dict) else dict((j, {}) for j in jobs)
        self.job_list = dict((j, job(dict(fields, id=j))) for j, fields in jobs.items())
        self.outcome, self.message = None, ""

    def accept(self):
        self.outcome = "accept"
        raise SystemExit(0)

    def reject(self, msg=""):
        self.outcome, self.message = "reject", str(msg)
        raise SystemExit(0)


def logmsg(level, msg):
    _log.append([level, str(msg)])


def logjobmsg(jobid, msg):
    _log.append([LOG_DEBUG, "%s;%s" % (jobid, msg)])


def get_local_nodename():
    return os.environ["PBS_STANDIN_HOST"]


def _result(exception=None):
    """What the hook did, for the test."""
    e = _event
    out = {"outcome": "exception" if exception else (e.outcome if e and e.outcome else "accept"),
           "message": exception or (e.message if e else ""), "log": _log}
    if e is not None:
        out["progname"], out["argv"], out["env"] = e.progname, e.argv, dict(e.env)
        out["rerun"] = bool(e.job and e.job.rerun_requested)
        out["job_list"] = dict((j, {"comment": x.comment}) for j, x in e.job_list.items())
        out["vnode_list"] = dict(
            (n, {"state": v.state, "comment": v.comment, "resources_available": dict((k, str(x) if isinstance(x, size) else x) for k, x in v.resources_available.items())})
            for n, v in e.vnode_list.items())
    return out
