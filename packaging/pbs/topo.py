# topo site hook for OpenPBS / PBS Professional: topology-aware CPU placement and job cgroups
# through the local topod. Installation and configuration: packaging/pbs/README.
"""topo's PBS hook.

The model: PBS decides *which hosts* (and how many CPUs, how much memory on each) a job gets;
topod, one daemon per execution host, decides *which CPUs* on that host, creates the job's
cgroup (v1, v2 or hybrid: topod does the cgroup work, this hook never touches /sys/fs/cgroup)
and tears it down. This hook carries PBS's decisions to topod at each point of a job's life:

  queuejob, modifyjob  (server)  check the job's topology request with topoctl, the placement
                                 core's own parser; refuse a bad one with topoctl's message
  execjob_begin        (MoM)     allocate: the CPU count and memory PBS gave the job on this
                                 host, the topology request, and the GPUs PBS counted there
                                 (ngpus): topod chooses which, and makes the job's cgroup
  execjob_launch       (MoM)     put the process that will exec the job into the cgroup (or
                                 prepend topo-exec), export TOPO_CPUS / TOPO_MEMS / TOPO_JOB
                                 and the job's GPUs (TOPO_GPUS, CUDA_VISIBLE_DEVICES)
  execjob_attach       (MoM)     put event.pid (pbs_attach, tm_attach) into the cgroup
  execjob_epilogue/end (MoM)     release: topod kills what is left and removes the cgroup;
                                 each of the two is enough on its own
  exechost_startup     (MoM)     publish free whole NUMA nodes, L3 groups and cores as vnode
                                 resources, optionally one vnode per NUMA node
  exechost_periodic    (MoM)     release allocations of jobs this MoM no longer runs, publish
                                 again, offline the vnodes while topod or a clean-up fails and
                                 bring back online the vnodes this hook offlined once it works;
                                 a job topod found mis-sized gets the reason as its comment

PBS job ids become topod job ids by a prefix: "123.server" is "pbs-123.server". topod accepts
only letters, digits and ._-:@+[] in job ids, so a job id can never name a path outside the
job's cgroup; this hook refuses any other id with a message before asking topod.

Every handler catches its own errors: a failure is a rejection (or, where rejecting means
nothing, a log line and an offlined vnode) with a sentence that says what failed, never a
bare traceback. event.accept() and event.reject() end the hook by raising SystemExit, which is
therefore never caught here.

Only the Python 3 standard library, and nothing newer than Python 3.5 (no f-strings), because
PBS runs hooks in its own embedded interpreter.
"""

import json
import math
import os
import pwd
import re
import socket
import subprocess
import time
import traceback

import pbs

HOOK = "topo hook"


def log_info(message):
    """A line in the MoM's log for something that went as it should (not an error)."""
    pbs.logmsg(pbs.EVENT_SYSTEM, "%s: %s" % (HOOK, message))

# topod job ids for PBS jobs: this prefix and the PBS job id.
JOB_PREFIX = "pbs-"

# What topod accepts in a job id (topod::cgroup::JobId); the prefix makes the first character
# a letter, and the whole id must fit in 128 bytes.
JOB_ID_CHARS = re.compile(r"^[A-Za-z0-9._:@+\[\]-]+$")
JOB_ID_MAX_BYTES = 128

# Every key topo.json may set, with its default. Unknown keys are refused.
DEFAULTS = {
    "socket": "/run/topo/topod.sock",   # topod's Unix socket on the execution hosts
    "topoctl": "/usr/bin/topoctl",   # for queuejob/modifyjob, and a start whose request has gpus=
    "topo_exec": "/usr/bin/topo-exec",   # only with "launch": "topo-exec"
    "timeout_seconds": 20,              # per topod or topoctl call; keep below the hook's alarm
    "resource": "topology",             # the job's request: -l topology=... or in a select chunk
    "default_request": "affinity[thread]",   # jobs without a request: one PU per ncpus; "" = not confined
    "enforce_ncpus": True,              # refuse a request that takes more CPUs here than ncpus
    "launch": "join",                   # "join" the launching process, or prepend "topo-exec"
    "publish": True,                    # publish free-topology resources on the vnodes
    "publish_ncpus": True,              # set the vnodes' ncpus to the CPUs PBS may really use
    "resource_prefix": "topo_",         # topo_free_numa, topo_free_l3, topo_free_cores
    "vnode_per_numa_node": False,       # exechost_startup makes host[0], host[1], ...
    "orphan_after_runs": 2,             # periodic runs a job must be missing before release
    "state_dir": "/var/lib/topo/pbs-hook",   # orphan candidates, the "we offlined it" marker
    "protocol_schema": "/usr/share/topo/protocol.schema.json",   # topod's replies are read against it
    "gpus_resource": "ngpus",           # PBS's count of a host's GPUs; topod chooses which; "" = refuse gpus=
}

# Published per vnode: resource suffix -> the free-map field topod computes for the host.
PUBLISHED = (("free_numa", "free_numa_nodes"), ("free_l3", "free_l3_groups"), ("free_cores", "free_cores"))


class HookError(Exception):
    """A failure with a message for the person who reads it (user at qsub, admin in logs)."""


class TopodUnreachable(HookError):
    """topod does not answer: not running, wrong socket path, or too slow."""


class DoesNotFitHere(HookError):
    """topod has not the CPUs free that PBS counted for the job on this host."""


class TopodRefused(HookError):
    """topod answered with an error; `code` is its error code (proto.rs ErrorCode)."""

    def __init__(self, code, message):
        HookError.__init__(self, "topod: %s" % message)
        self.code = code
        self.reason = message


# ---------------------------------------------------------------------------------------------
# Configuration


def load_config(path):
    """topo.json (imported with qmgr, found through pbs.hook_config_filename) over DEFAULTS.

    No file means the defaults. A key this hook does not know, or a value of the wrong type, is
    an error naming the file and the key: a misspelt key silently ignored is a site running
    with settings it did not choose."""
    config = dict(DEFAULTS)
    if not path:
        return config
    try:
        with open(path) as f:
            given = json.load(f)
    except (OSError, ValueError) as e:
        raise HookError("cannot read the hook configuration %s: %s" % (path, e))
    if not isinstance(given, dict):
        raise HookError("hook configuration %s: expected a JSON object" % path)
    for key, value in given.items():
        if key not in DEFAULTS:
            raise HookError("hook configuration %s: unknown key %r; known keys: %s"
                            % (path, key, ", ".join(sorted(DEFAULTS))))
        if not isinstance(value, type(DEFAULTS[key])) or isinstance(value, bool) != isinstance(DEFAULTS[key], bool):
            raise HookError("hook configuration %s: %r must be %s, not %r"
                            % (path, key, type(DEFAULTS[key]).__name__, value))
        config[key] = value
    if config["launch"] not in ("join", "topo-exec"):
        raise HookError("hook configuration %s: \"launch\" must be \"join\" or \"topo-exec\", not %r"
                        % (path, config["launch"]))
    return config


# ---------------------------------------------------------------------------------------------
# PBS values: job ids, select chunks, exec_vnode, sizes, CPU lists


def topod_job_id(pbs_job_id):
    """The topod job id of a PBS job: "123.server" -> "pbs-123.server" (arrays: "12[3].server")."""
    jid = JOB_PREFIX + str(pbs_job_id)
    if not pbs_job_id or not JOB_ID_CHARS.match(jid) or len(jid.encode()) > JOB_ID_MAX_BYTES:
        raise HookError(
            "PBS job id %r cannot name a topod job: only letters, digits and ._-:@+[] are accepted, "
            "at most %d characters" % (str(pbs_job_id)[:60], JOB_ID_MAX_BYTES - len(JOB_PREFIX))
        )
    return jid


def pbs_job_id(topod_id):
    """The PBS job id of a topod job id this hook made, or None for anyone else's job."""
    return topod_id[len(JOB_PREFIX):] if topod_id.startswith(JOB_PREFIX) else None


def split_top_level(text, separator):
    """Splits on `separator` outside brackets, parentheses and quotes: a topology request inside
    a select chunk ("topology=affinity[core(2):membind=localonly]") keeps its own ':'."""
    parts, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[(":
            depth += 1
        elif c in "])":
            depth = max(0, depth - 1)
        elif c == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def unquote(value):
    """A select value without the double or single quotes PBS lets a user put around it."""
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def resources_of(words):
    """["ncpus=2", "mem=1gb"] -> {"ncpus": "2", "mem": "1gb"}."""
    found = {}
    for word in words:
        if "=" in word:
            key, value = word.split("=", 1)
            found[key.strip()] = unquote(value)
    return found


def select_chunks(schedselect):
    """job.schedselect ("2:ncpus=4:mpiprocs=4+1:ncpus=1") as one dict per chunk, counts expanded,
    in the order PBS lists the chunks in exec_vnode."""
    chunks = []
    for chunk in split_top_level(str(schedselect or ""), "+"):
        words = split_top_level(chunk, ":")
        count = 1
        if words and words[0].strip().isdigit():
            count = int(words.pop(0))
        if any(w.strip() for w in words):
            chunks.extend([resources_of(words)] * count)
    return chunks


def exec_vnode_groups(exec_vnode):
    """job.exec_vnode ("(a:ncpus=2:mem=1048576kb)+(b:ncpus=2+c:ncpus=2)") as one list per chunk
    of (vnode name, resources) pairs: a chunk may be spread over several vnodes of one host."""
    groups = []
    for group in split_top_level(str(exec_vnode or ""), "+"):
        group = group.strip()
        if group.startswith("(") and group.endswith(")"):
            group = group[1:-1]
        parts = []
        for piece in group.split("+"):
            words = piece.split(":")
            if words[0].strip():
                parts.append((words[0].strip(), resources_of(words[1:])))
        if parts:
            groups.append(parts)
    return groups


def whole(value, what):
    """A PBS count ("2", 2) as an int; a value PBS would not give (abc, 1.5) is an error that
    names it, never a ValueError."""
    try:
        return int(str(value).strip())
    except ValueError:
        raise HookError("cannot read %s %r: expected a whole number" % (what, str(value)[:40]))


SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
SIZE = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(b|w)?\s*$", re.IGNORECASE)


def size_in_bytes(value):
    """A PBS size ("100mb", "102400kb", "2gb", "10w", or pbs.size) in bytes; units are powers of
    1024, a word is 8 bytes, a bare number is bytes."""
    if value is None:
        return None
    found = SIZE.match(str(value))
    if not found:
        raise HookError("cannot read the memory size %r (a PBS size: a number with b, kb, mb, gb, tb, pb or w)" % str(value))
    number, scale, unit = found.groups()
    word = 8 if (unit or "b").lower() == "w" else 1
    return int(number) * SIZE_UNITS[scale.lower()] * word


def cpu_set(text):
    """A CPU list ("0-3,8,10-11") as a set of ints."""
    cpus = set()
    for part in str(text or "").split(","):
        part = part.strip()
        if "-" in part:
            first, last = part.split("-", 1)
            cpus.update(range(int(first), int(last) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def cpu_list(cpus):
    """A set of ints as a CPU list, ranges joined: {0,1,2,5} -> "0-2,5"."""
    ranges, run = [], []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            ranges.append(run)
        run = [cpu]
    if run:
        ranges.append(run)
    return ",".join(str(r[0]) if len(r) == 1 else "%d-%d" % (r[0], r[-1]) for r in ranges)


# ---------------------------------------------------------------------------------------------
# What the job asked for, and what PBS gave it on this host


def is_local_vnode(name, host):
    """This MoM's vnodes: the natural one (the host's name) and the per-NUMA ones host[N]."""
    return name == host or re.match(r"^%s\[\d+\]$" % re.escape(host), name) is not None


def numa_index_of_vnode(name, host):
    """N for a per-NUMA vnode host[N], else None."""
    found = re.match(r"^%s\[(\d+)\]$" % re.escape(host), name)
    return int(found.group(1)) if found else None


class Share(object):
    """What PBS gave one job on this host: summed over the job's chunks placed here."""

    def __init__(self):
        self.ncpus = 0
        self.known = False        # whether PBS said how many CPUs (exec_vnode or Resource_List)
        self.per_vnode = {}       # vnode -> ncpus PBS gave the job there
        self.mem_bytes = None
        self.mpiprocs = 0
        self.numa_nodes = set()   # per-NUMA vnodes host[N] with ncpus here; empty: the whole host
        self.requests = []        # topology requests of the chunks here
        self.ngpus = 0            # GPUs PBS counted for the job here (gpus_resource)
        self.gpus_by_numa = {}    # NUMA node N -> GPUs PBS counted on vnode host[N]
        self.gpus_off_numa = 0    # GPUs PBS counted on the host's own vnode
        self.chunks = 0           # select chunks PBS placed here

    def add(self, vnode, resources, host, gpus_resource=""):
        ncpus = whole(resources.get("ncpus", 0) or 0, "ncpus of %s" % vnode)
        index = numa_index_of_vnode(vnode, host)
        if gpus_resource:
            ngpus = whole(resources.get(gpus_resource, 0) or 0, "%s of %s" % (gpus_resource, vnode))
            self.ngpus += ngpus
            # Where PBS counted them: topod takes them in the same NUMA nodes (gpus_by_numa),
            # also where PBS split a chunk (its CPUs on one vnode, a GPU on another).
            if ngpus and index is not None:
                self.gpus_by_numa[index] = self.gpus_by_numa.get(index, 0) + ngpus
            elif ngpus:
                self.gpus_off_numa += ngpus
        self.ncpus += ncpus
        self.known = True
        self.per_vnode[vnode] = self.per_vnode.get(vnode, 0) + ncpus
        if resources.get("mem"):
            self.mem_bytes = (self.mem_bytes or 0) + size_in_bytes(resources["mem"])
        # Only where PBS gave it CPUs: a chunk PBS spread over two NUMA vnodes (its CPUs on
        # one, GPUs or memory on the other) keeps its CPUs where PBS counted them.
        if index is not None and ncpus > 0:
            self.numa_nodes.add(index)


def share_on_host(job, host, resource, gpus_resource=""):
    """Sums the job's exec_vnode chunks on this host's vnodes (exec_vnode has one parenthesised
    group per select chunk, in select order, so the chunk's other resources come from
    schedselect). Without exec_vnode (never seen at a MoM) the job-wide Resource_List counts.
    With `gpus_resource`, the GPUs PBS counted for the job here are summed too."""
    share = Share()
    groups = exec_vnode_groups(getattr(job, "exec_vnode", None))
    chunks = select_chunks(getattr(job, "schedselect", None))
    for i, group in enumerate(groups):
        here = [(vnode, res) for vnode, res in group if is_local_vnode(vnode, host)]
        if not here:
            continue
        chunk = chunks[i] if i < len(chunks) else {}
        share.chunks += 1
        for vnode, res in here:
            share.add(vnode, res, host, gpus_resource)
        chunk_ncpus = sum(whole(res.get("ncpus", 0) or 0, "ncpus") for _, res in group)
        share.mpiprocs += whole(chunk.get("mpiprocs", 1 if chunk_ncpus > 0 else 0), "mpiprocs")
        if chunk.get(resource):
            share.requests.append(chunk[resource])
    if not groups:
        share.known = resource_of(job.Resource_List, "ncpus") is not None
        share.ncpus = whole(resource_of(job.Resource_List, "ncpus") or 0, "ncpus")
        share.per_vnode = {host: share.ncpus}
        share.mem_bytes = size_in_bytes(resource_of(job.Resource_List, "mem"))
        share.mpiprocs = whole(resource_of(job.Resource_List, "mpiprocs") or 1, "mpiprocs")
        if gpus_resource:
            share.ngpus = whole(resource_of(job.Resource_List, gpus_resource) or 0, gpus_resource)
    return share


def resource_of(resources, name):
    """resources[name] of a Resource_List or resources_available, or None when it is unset or the
    PBS server defines no such resource (pbs_resource then raises AttributeError: "'pbs_resource'
    object has no attribute 'ngpus'", observed on OpenPBS 23.06 before `qmgr create resource`)."""
    try:
        return resources[name]
    except (AttributeError, KeyError):
        return None


def resource_defined(resources, name):
    """Whether the PBS server defines the resource `name` (set or not)."""
    try:
        resources[name]
    except (AttributeError, KeyError):
        return False
    return True


def job_wide_request(job, resource):
    """-l topology=REQ, visible at the MoM when the resource has flag m."""
    value = resource_of(job.Resource_List, resource)
    return unquote(str(value)) if value is not None and str(value).strip() else None


def request_for(job, share, config):
    """(request, tasks) for topod, or (None, None) when the job is not to be confined.

    A job-wide -l topology= wins over select chunks; chunks placed here that ask for different
    requests cannot be one topod allocation and are refused. A request without "*count" gets
    PBS's task count here: the chunks' mpiprocs (PBS's default, 1 per chunk with CPUs). A job
    without a request gets default_request with one task per ncpus here, or is left alone."""
    resource = config["resource"]
    request = job_wide_request(job, resource)
    if request is None and share.requests:
        distinct = sorted(set(share.requests))
        if len(distinct) > 1:
            raise HookError(
                "the job's chunks on this host ask for different %s requests (%s); "
                "topod places one request per job and host" % (resource, ", ".join(distinct))
            )
        request = distinct[0]
    if request is not None:
        return request, max(share.mpiprocs, 1)
    if config["default_request"] and share.ncpus > 0:
        return config["default_request"], share.ncpus
    return None, None


# ---------------------------------------------------------------------------------------------
# topod's protocol schema


# The JSON Schema keywords ProtocolSchema checks; the others it may meet are annotations.
SCHEMA_CHECKED = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "type", "minimum", "maximum",
                  "pattern", "properties", "required", "additionalProperties", "items")
SCHEMA_ANNOTATIONS = ("$schema", "$defs", "title", "description", "default", "format", "protocol_version")

JSON_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class ProtocolSchema(object):
    """topod's protocol as a JSON Schema (packaging/protocol.schema.json, which `topoctl
    protocol-schema` generates from topod's own types). Every reply is read against it before
    this hook uses it, so a reply of another shape (a renamed or missing field, a topod of
    another version) is an error that names the field, never a KeyError or a silent default.

    Only the keywords the generated schema uses are implemented (SCHEMA_CHECKED); a schema with
    any other keyword is refused when it is read, rather than half checked."""

    def __init__(self, path):
        self.path = path
        try:
            with open(path) as f:
                document = json.load(f)
        except (OSError, ValueError) as e:
            raise HookError("cannot read topod's protocol schema %s: %s (copy packaging/protocol.schema.json "
                            "there, or set \"protocol_schema\" in the hook configuration)" % (path, e))
        self.defs = document.get("$defs") if isinstance(document, dict) else None
        if not isinstance(self.defs, dict):
            raise HookError("topod's protocol schema %s has no $defs" % path)
        unknown = sorted(self._keywords(document) - set(SCHEMA_CHECKED) - set(SCHEMA_ANNOTATIONS))
        if unknown:
            raise HookError("topod's protocol schema %s uses %s, which this hook cannot check"
                            % (path, ", ".join(unknown)))

    def _keywords(self, schema, found=None):
        """Every keyword used in `schema` and the schemas inside it (not inside values such as
        "const" or "default", which are data)."""
        found = set() if found is None else found
        if not isinstance(schema, dict):
            return found
        for key, value in schema.items():
            found.add(key)
            if key in ("properties", "$defs") and isinstance(value, dict):
                for sub in value.values():
                    self._keywords(sub, found)
            elif key in ("items", "additionalProperties"):
                self._keywords(value, found)
            elif key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
                for sub in value:
                    self._keywords(sub, found)
        return found

    def check_ok(self, op, value):
        """Raises HookError unless `value` is a valid "ok" value of a reply to `op`."""
        schema = self.defs.get("ok." + op)
        if schema is None:
            raise HookError("topod's protocol schema %s has no reply for the operation %r" % (self.path, op))
        problem = self.problem(value, schema, "ok")
        if problem:
            raise HookError("topod's reply to %s does not match its protocol (%s): %s" % (op, self.path, problem))

    def problem(self, value, schema, where):
        """What is wrong with `value` at `where` against `schema`, or None."""
        if schema is True or schema == {}:
            return None
        if schema is False:
            return "%s: nothing is allowed here" % where
        if "$ref" in schema:
            name = schema["$ref"].split("/")[-1]
            if name not in self.defs:
                return "%s: the schema refers to an unknown %s" % (where, schema["$ref"])
            found = self.problem(value, self.defs[name], where)
            if found:
                return found
        for key in ("anyOf", "oneOf"):
            if key in schema:
                problems = [self.problem(value, sub, where) for sub in schema[key]]
                matches = problems.count(None)
                if matches == 0:
                    return " or ".join(p for p in problems if p)
                if key == "oneOf" and matches > 1:
                    return "%s: %r matches more than one of the forms allowed here" % (where, value)
        for sub in schema.get("allOf", ()):
            found = self.problem(value, sub, where)
            if found:
                return found
        if "const" in schema and value != schema["const"]:
            return "%s is %r, not %r" % (where, value, schema["const"])
        if "enum" in schema and value not in schema["enum"]:
            return "%s is %r, not one of %s" % (where, value, ", ".join(repr(e) for e in schema["enum"]))
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(JSON_TYPES[t](value) for t in types if t in JSON_TYPES):
                return "%s is %r, not of type %s" % (where, value, " or ".join(types))
        if JSON_TYPES["number"](value):
            if "minimum" in schema and value < schema["minimum"]:
                return "%s is %r, below %r" % (where, value, schema["minimum"])
            if "maximum" in schema and value > schema["maximum"]:
                return "%s is %r, above %r" % (where, value, schema["maximum"])
        if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            return "%s is %r, which does not have the form %s" % (where, value, schema["pattern"])
        if isinstance(value, dict):
            for key in schema.get("required", ()):
                if key not in value:
                    return "%s has no %r" % (where, key)
            properties = schema.get("properties", {})
            for key in sorted(value):
                inner = "%s.%s" % (where, key)
                if key in properties:
                    found = self.problem(value[key], properties[key], inner)
                elif "additionalProperties" in schema:
                    found = self.problem(value[key], schema["additionalProperties"], inner)
                else:
                    found = None
                if found:
                    return found
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                found = self.problem(item, schema["items"], "%s[%d]" % (where, i))
                if found:
                    return found
        return None


# ---------------------------------------------------------------------------------------------
# topod and topoctl


class Topod(object):
    """A connection to the local topod: one JSON request per line, one reply per line
    (topod/core/src/proto.rs, protocol version 1). Connects on the first call."""

    def __init__(self, config):
        self.path = config["socket"]
        self.timeout = config["timeout_seconds"]
        self.schema_path = config["protocol_schema"]
        self.schema = None
        self.sock = None
        self.buffer = bytearray()

    def _reachable_path(self):
        """The hooks run as root: topod's administrators' socket beside the public one
        (topod.sock -> topod-admin.sock), which users' connections cannot crowd out; the public
        one where there is none (an older topod)."""
        base, ext = os.path.splitext(self.path)
        admin = base + "-admin" + ext
        if os.geteuid() == 0 and os.path.exists(admin):
            return admin
        return self.path

    def call(self, op, **fields):
        """The "ok" value of the reply, checked against topod's protocol schema; TopodRefused
        for an "error" reply, TopodUnreachable when topod cannot be reached or does not answer
        in time, HookError for a reply that is not what the protocol says."""
        if self.schema is None:
            self.schema = ProtocolSchema(self.schema_path)
        request = dict(fields, v=1, op=op)
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(self._reachable_path())
            self.sock.sendall((json.dumps(request) + "\n").encode())
            line = self._read_line()
        except (OSError, socket.timeout) as e:
            self.close()
            raise TopodUnreachable("cannot reach topod at %s: %s (is topod running on this host?)" % (self.path, e))
        try:
            reply = json.loads(line.decode())
        except ValueError:
            raise HookError("topod at %s sent a reply that is not JSON: %r" % (self.path, line[:200]))
        problem = self.schema.problem(reply, {"$ref": "#/$defs/Reply"}, "the reply")
        if problem:
            raise HookError("topod at %s sent a reply that does not match its protocol (%s): %s"
                            % (self.path, self.schema_path, problem))
        if reply.get("error"):
            raise TopodRefused(reply["error"]["code"], reply["error"]["message"])
        ok = reply.get("ok")
        self.schema.check_ok(op, ok)
        return ok

    def _read_line(self):
        searched = 0
        while True:
            end = self.buffer.find(b"\n", searched)
            if end >= 0:
                break
            searched = len(self.buffer)
            if searched > MAX_REPLY_BYTES:
                # A broken or hostile peer: the hook runs inside PBS's daemons and must not
                # grow without bound (topod's own replies are well under a MiB).
                self.close()
                raise HookError("topod at %s sent a reply longer than %d MiB without ending it; not read further"
                                % (self.path, MAX_REPLY_BYTES >> 20))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("topod closed the connection without answering")
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return line

    def close(self):
        if self.sock is not None:
            self.sock.close()
        self.sock, self.buffer = None, bytearray()


# The longest reply read from topod (topo_core::proto::MAX_REPLY_BYTES).
MAX_REPLY_BYTES = 16 * 1024 * 1024

# The longest queue or pool name topod takes (topo_core::proto::MAX_NAME_BYTES).
MAX_NAME_BYTES = 128

# What topod adds to a refusal when only other jobs' reservations or open prime-time pools keep
# the job out (topod/src/daemon/host.rs, held_back_by).
HELD_BACK = "; it would fit without "

# How much of a request a message quotes; topoctl's message names the fragment and its byte.
REQUEST_SHOWN = 60


def shortened(request):
    """The request as a message quotes it: whole when short, else its start and '...' (a
    10 KB request would fill qsub's error output, about 3 KB, before the reason)."""
    return request if len(request) <= REQUEST_SHOWN else request[:REQUEST_SHOWN] + "..."


def cut_at_comma(request):
    """Whether a request may have been cut where PBS splits an unquoted -l value at a comma: no
    comma left in it, and a '[' or '(' left open (PBS keeps the rest as other resources and the
    hook never sees it). A typo looks the same, so the message says "if"."""
    return "," not in request and (request.count("[") > request.count("]") or request.count("(") > request.count(")"))


def check_request(request, config):
    """`topoctl check --json`'s answer for `request` ({"canonical": ..., "request": {...}}): the
    placement core's own parser, so that qsub refuses exactly what topod would. A bad request
    raises HookError with topoctl's one-line message (the last line `topoctl check` prints)."""
    command = [config["topoctl"], "check", "--json", "--", request]
    cannot = "cannot check the %s request: " % config["resource"]
    if "\0" in request:
        raise HookError("%s=%s refused: it contains a NUL character" % (config["resource"], shortened(request.replace("\0", "\\0"))))
    try:
        request.encode("utf-8")
    except UnicodeError:
        raise HookError("%s refused: it is not valid UTF-8 text" % config["resource"])
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=config["timeout_seconds"])
    except OSError as e:
        raise HookError(cannot + "cannot run %s: %s (install topoctl on this host: it comes in the topod package; or set \"topoctl\" in topo.json)"
                        % (config["topoctl"], e))
    except subprocess.TimeoutExpired:
        raise HookError(cannot + "%s took longer than %s s" % (config["topoctl"], config["timeout_seconds"]))
    try:
        answer = json.loads(done.stdout.decode("utf-8", "replace"))
    except ValueError:
        answer = {}
    if done.returncode == 0 and "canonical" in answer:
        return answer
    if done.returncode == 2 and isinstance(answer.get("error"), dict):
        message = "%s=%s refused: %s" % (config["resource"], shortened(request), answer["error"]["message"])
        if cut_at_comma(request):
            message += ("; if the request has a comma, PBS cut it there (it splits -l values at "
                        "commas): quote it, -l '%s=\"...\"'" % config["resource"])
        raise HookError(message)
    said = done.stderr.decode("utf-8", "replace").strip()[:300]
    raise HookError(cannot + "%s exited with status %s: %s" % (config["topoctl"], done.returncode, said))


# What every request that asks for GPUs has (the parser reads keywords in any case).
MAY_ASK_FOR_GPUS = re.compile(r"gpus\s*=", re.IGNORECASE)


# check_gpus_at_submit's asked_gpus when the server has no gpus_resource at all.
NOT_DEFINED = object()


def gpus_per_task(answer):
    """The `gpus=n` of a checked request (GPUs per task that topod chooses), or None."""
    parsed = answer.get("request") if isinstance(answer, dict) else None
    per_task = parsed.get("gpus_per_task") if isinstance(parsed, dict) else None
    return per_task if isinstance(per_task, int) and not isinstance(per_task, bool) and per_task > 0 else None


def check_gpus_at_submit(request, answer, asked, config):
    """qsub, qalter: GPUs asked of PBS (gpus_resource, ngpus), which counts each host's GPUs, must
    be what the request gives topod to choose on the host, or execjob_begin would refuse the job
    on every host and PBS would try it ~20 times before holding it. `asked`: a (where, ngpus,
    tasks) per chunk the request applies to (the job-wide count without -l select), from
    gpus_asked_at_submit; NOT_DEFINED where the server has no such resource; None where the
    hook counts no GPUs. A request saying `gpus=n` needs n x its tasks in each; one without it
    needs a whole number of GPUs per task where it asks for any (else topod could neither
    choose nor confine them). Without gpus_resource the hook passes no GPUs and gpus= is refused."""
    per_task = gpus_per_task(answer)
    resource = config["resource"]
    name = config["gpus_resource"]
    if per_task and not name:
        raise HookError(
            "%s=%s refused: gpus=%s asks topod to choose the job's GPUs, but this site's hook counts "
            "no GPUs (topo.json gpus_resource is empty): ask PBS for GPUs and leave gpus= out of "
            "the %s request" % (resource, shortened(request), per_task, resource))
    if per_task and asked is NOT_DEFINED:
        raise HookError(
            "%s=%s refused: gpus=%s asks topod to choose the job's GPUs, but the PBS server defines "
            "no resource %s to count them: the administrator creates it (qmgr -c \"create resource "
            "%s type=long,flag=nh\") and sets resources_available.%s of each GPU host"
            % (resource, shortened(request), per_task, name, name, name))
    if asked is None or asked is NOT_DEFINED:
        return
    if per_task and not any(ngpus for _, ngpus, _ in asked):
        raise HookError(
            "%s=%s refused: gpus=%s asks topod to choose %s GPU(s) per task, but the job asks PBS "
            "for none: PBS counts each host's GPUs, so ask for them too (-l select=1:ncpus=N:%s=G, "
            "G = %s x the tasks on the host)"
            % (resource, shortened(request), per_task, per_task, name, per_task))
    for where, ngpus, tasks in asked:
        if per_task and ngpus != per_task * tasks:
            raise HookError(
                "%s=%s refused: it takes gpus=%d for %d task(s) on a host, %d GPU(s), but %s asks "
                "PBS for %s=%d: ask for %s=%d there, or change gpus="
                % (resource, shortened(request), per_task, tasks, per_task * tasks, where, name,
                   ngpus, name, per_task * tasks))
        if not per_task and ngpus % tasks:
            raise HookError(
                "%s=%s refused: %s asks PBS for %s=%d for %d task(s), no whole number of GPUs per "
                "task, so topod could neither choose nor confine them: ask for a multiple of %d, "
                "or fewer tasks with more CPUs each (e.g. one task: affinity[core(N)])"
                % (resource, shortened(request), where, name, ngpus, tasks, tasks))


def gpu_count(value, what):
    """A GPU count PBS would give: a whole number, 0 or more."""
    n = whole(value, what)
    if n < 0:
        raise HookError("cannot read %s %r: expected a whole number of GPUs, 0 or more" % (what, str(value)[:40]))
    return n


def gpus_asked_at_submit(event, chunks, request_chunks, answer, name):
    """For check_gpus_at_submit: (where, ngpus, tasks) for each chunk the request applies to, or
    for the job-wide count when the job has no -l select (then PBS makes one chunk of it; with
    select, a job-wide count is only PBS's sum and is not read: qalter of select alone leaves
    the old sum in job_o). Tasks on a host: the request's *count, else the chunk's mpiprocs
    (PBS's default, 1), as at execjob_begin. NOT_DEFINED where the server has no `name`."""
    if not resource_defined(event.job.Resource_List, name):
        return NOT_DEFINED
    parsed = answer.get("request") if isinstance(answer, dict) else None
    count = parsed.get("tasks") if isinstance(parsed, dict) else None
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
    if chunks:
        asked = []
        for chunk, _ in request_chunks:
            value = chunk.get(name)
            ngpus = 0 if value in (None, "") else gpu_count(value, "%s in -l select" % name)
            tasks = count or max(1, whole(chunk.get("mpiprocs") or 1, "mpiprocs in -l select"))
            number = next(i + 1 for i, (c, _) in enumerate(chunks) if c is chunk)
            asked.append(("chunk %d of -l select (%s)" % (number, chunk_text(chunk, ("ncpus", "mpiprocs", name))), ngpus, tasks))
        return asked
    value = submitted(event, name)
    ngpus = 0 if value in (None, "") else gpu_count(value, "-l %s" % name)
    tasks = count or max(1, whole(submitted(event, "mpiprocs") or 1, "-l mpiprocs"))
    return [("the job (-l %s)" % name, ngpus, tasks)]


def chunk_text(chunk, names):
    """A chunk's resources `names` as -l select writes them, for a message."""
    return ":".join("%s=%s" % (k, shortened(str(chunk[k]))) for k in names if k in chunk) or "no resources"


def request_with_gpus(job, request, tasks, share, config, default=False):
    """(request, tasks) to send topod for a job PBS counted `share.ngpus` GPUs for on this host:
    topod chooses which of the host's GPUs (beside the job's CPUs), confines the job to them
    where it confines devices, and tells the job (TOPO_GPUS, CUDA_VISIBLE_DEVICES). A request
    saying gpus=n must take exactly that many (n x its tasks here); one without gpus= gets
    gpus=ngpus/tasks when that is a whole number. The site's default_request (`default`: one
    task per ncpus, the hook's choice) is otherwise given as fewer, larger tasks, the same CPUs
    in all (ncpus=8, ngpus=1: affinity[thread(8)] for one task with gpus=1); any other request
    runs with no GPUs chosen, as before, with a job message saying why (qsub refuses that case
    where it can see it). A request that may not ask for GPUs is returned as it is, unparsed."""
    resource = config["resource"]
    if not config["gpus_resource"]:
        if MAY_ASK_FOR_GPUS.search(request):
            check_gpus_at_submit(request, check_request(request, config), None, config)
        return request, tasks
    if share.ngpus <= 0 and not MAY_ASK_FOR_GPUS.search(request):
        return request, tasks
    answer = check_request(request, config)
    parsed = answer.get("request") or {}
    here = parsed.get("tasks") or tasks or 1
    per_task = gpus_per_task(answer)
    host = pbs.get_local_nodename()
    name = config["gpus_resource"]
    if per_task:
        if per_task * here != share.ngpus:
            if parsed.get("tasks") and share.chunks > 1:
                # Chunks PBS put together here (place=free or pack): their GPUs add up, but
                # *count is the tasks of the whole host.
                raise HookError(
                    "%s=%s takes gpus=%d for %d task(s) on %s, but PBS placed %d chunks here that ask "
                    "%s=%d in all: the request's *%d is the tasks of a host, not of a chunk; ask "
                    "-l place=scatter, or leave *count out (the tasks are then the chunks' mpiprocs)"
                    % (resource, shortened(request), per_task, here, host, share.chunks, name,
                       share.ngpus, here))
            raise HookError(
                "%s=%s takes gpus=%d for %d task(s) on %s, %d GPU(s), but the job asked PBS for "
                "%s=%d there: ask for %s=%d there, or change gpus="
                % (resource, shortened(request), per_task, here, host, per_task * here,
                   name, share.ngpus, name, per_task * here))
        return request, tasks
    if share.ngpus <= 0:
        return request, tasks
    canonical = answer.get("canonical") or ""
    why_not = None
    if parsed.get("tasks_max"):
        why_not = "a malleable request (*min-max) takes no GPUs"
    elif not (canonical.endswith("]") and canonical.rfind("[") == canonical.rfind("affinity[") + len("affinity")):
        why_not = "the request has no affinity[...] part to add gpus= to"
    elif share.ngpus % here:
        regrouped = default and not parsed.get("tasks") and fewer_tasks(canonical, parsed, here, share.ngpus)
        if regrouped:
            larger, groups = regrouped
            try:
                checked = check_request(larger, config)
            except HookError:
                checked = None
            if checked is not None:
                chosen = "%s:gpus=%d]" % ((checked.get("canonical") or larger)[:-1], share.ngpus // groups)
                pbs.logjobmsg(job.id, "%s: %s=%d on %s for %d task(s) of default_request %s: topod chooses "
                              "the GPUs, beside the job's CPUs, as %d task(s): %s"
                              % (HOOK, name, share.ngpus, host, here, shortened(request), groups, chosen))
                return chosen, groups
        why_not = "%s=%d is no whole number of GPUs for each of its %d task(s)" % (name, share.ngpus, here)
    if why_not:
        pbs.logjobmsg(job.id, "%s: %s=%d on %s: topod does not choose or confine the job's GPUs: %s; "
                      "add :gpus=n (GPUs per task) to the %s request"
                      % (HOOK, name, share.ngpus, host, why_not, resource))
        return request, tasks
    chosen = "%s:gpus=%d]" % (canonical[:-1], share.ngpus // here)
    pbs.logjobmsg(job.id, "%s: %s=%d on %s: topod chooses the GPUs, beside the job's CPUs: %s"
                  % (HOOK, name, share.ngpus, host, chosen))
    return chosen, tasks


# The processor unit of a canonical affinity[...] and its count per task, with its options (one
# level of parentheses inside them): "affinity[core(2,exclusive=(core,injob)):membind=localonly]".
AFFINITY_UNIT = re.compile(r"\A(.*affinity\[)([A-Za-z]+)(?:\((\d+)((?:,(?:[^()]|\([^()]*\))*)?)\))?((?::[^\[\]]*)?\])\Z")


def fewer_tasks(canonical, parsed, tasks, ngpus):
    """(request, groups): `tasks` tasks of a request without *count made gcd(tasks, ngpus) tasks,
    each with the CPUs of tasks/groups of them, so that the GPUs are a whole number per task; None
    where the request cannot be written so."""
    found = AFFINITY_UNIT.match(canonical)
    units = parsed.get("units_per_task") or 1
    if not found or not isinstance(units, int):
        return None
    groups = math.gcd(tasks, ngpus)
    head, unit, _, options, tail = found.groups()
    return "%s%s(%d%s)%s" % (head, unit, units * (tasks // groups), options or "", tail), groups


# ---------------------------------------------------------------------------------------------
# Vnodes: offline/online with a reason, published resources


def local_vnodes(event, host):
    """The names in event.vnode_list that are this MoM's."""
    return [name for name in list(event.vnode_list.keys()) if is_local_vnode(name, host)]


def marker_path(config):
    return os.path.join(config["state_dir"], "offline")


def offline_vnodes(event, host, config, reason):
    """Offlines this MoM's vnodes with `reason` as their comment, and remembers (a marker file)
    that this hook did it, so that only this hook's offlining is undone when things work again."""
    comment = ("topo: " + reason)[:250]
    if not local_vnodes(event, host):
        event.vnode_list[host] = pbs.vnode(host)
    for name in local_vnodes(event, host):
        event.vnode_list[name].state = pbs.ND_OFFLINE
        event.vnode_list[name].comment = comment
    pbs.logmsg(pbs.EVENT_ERROR, "%s: vnodes of %s offlined: %s" % (HOOK, host, comment))
    try:
        ensure_dir(config["state_dir"])
        with open(marker_path(config), "w") as f:
            f.write(comment + "\n")
    except OSError as e:
        pbs.logmsg(pbs.EVENT_ERROR, "%s: cannot write %s (%s): the vnodes will not be put back online by the hook"
                   % (HOOK, marker_path(config), e))


def online_vnodes_if_we_offlined(event, host, config):
    """Brings this MoM's vnodes back online, comment cleared, if this hook offlined them."""
    if not os.path.exists(marker_path(config)):
        return
    for name in local_vnodes(event, host):
        event.vnode_list[name].state = pbs.ND_FREE
        event.vnode_list[name].comment = None
    os.remove(marker_path(config))
    log_info("topod answers and clean-up worked: vnodes of %s back online" % host)


def ensure_dir(path):
    if not os.path.isdir(path):
        os.makedirs(path, 0o700)


def free_counts(topology, free_map, numa_index=None):
    """Free whole NUMA nodes, L3 groups and cores, on the host or inside one NUMA node: a domain
    counts when its allocatable CPUs are all free (topod's own rule, place::HostMetrics)."""
    allocatable = cpu_set(free_map["allocatable"])
    free = allocatable - cpu_set(free_map["held"]) - cpu_set(free_map["fenced"])
    within = allocatable
    if numa_index is not None:
        node = [n for n in topology["numa_nodes"] if n.get("os_index") == numa_index]
        within = cpu_set(node[0]["cpus"]) & allocatable if node else set()

    def whole(domains):
        count = 0
        for domain in domains:
            cpus = cpu_set(domain["cpus"]) & allocatable
            if cpus and cpus <= within and cpus <= free:
                count += 1
        return count

    return {
        "free_numa_nodes": whole(topology["numa_nodes"]),
        "free_l3_groups": whole(topology["l3_groups"]),
        "free_cores": whole(topology["cores"]),
    }


def numa_nodes_with_cpus(topology, free_map):
    """[(os_index, allocatable CPUs, memory bytes)] of the NUMA nodes that have allocatable CPUs."""
    allocatable = cpu_set(free_map["allocatable"])
    nodes = []
    for node in topology["numa_nodes"]:
        cpus = cpu_set(node["cpus"]) & allocatable
        if cpus and node.get("os_index") is not None:
            nodes.append((node["os_index"], cpus, node.get("memory_bytes") or 0))
    return nodes


def cpus_of(allocation):
    """The CPUs an allocation keeps from other jobs: those it holds and those it fences."""
    return cpu_set(allocation.get("cpus")) | cpu_set(allocation.get("fenced"))


def pbs_usable_cpus(free_map, allocations, running, within=None, vnode=None):
    """How many CPUs PBS may count on this host (or, for the vnode `vnode`, inside the CPU set
    `within`): topod's allocatable CPUs (online, inside topod's cpuset, not reserved by its
    configuration), less those held or fenced by allocations that are not PBS jobs this MoM
    runs (orphans not yet released, jobs of topoctl or of another batch system), less what a
    running PBS job keeps beyond the ncpus PBS gave it there (an exclusive request's fence).

    `running` maps the topod id of each PBS job running here to {vnode: ncpus PBS gave it
    there}, or to None where that is not known (its fence is then not counted). PBS's own count
    of the ncpus its running jobs use does the rest, so PBS's free ncpus equal topod's."""
    allocatable = cpu_set(free_map["allocatable"])
    if within is not None:
        allocatable &= within
    foreign = set()
    excess = 0
    for allocation in allocations:
        cpus = cpus_of(allocation) & allocatable
        jid = allocation.get("job")
        if jid not in running:
            foreign |= cpus
        elif running[jid] is not None:
            given = running[jid].get(vnode, 0) if within is not None else sum(running[jid].values())
            excess += max(0, len(cpus) - given)
    return max(0, len(allocatable - foreign) - excess)


def held_outside_pbs(topod, config):
    """The jobs topod holds CPUs for that are not PBS jobs running here (as far as an event
    without a job list can tell), sorted."""
    allocations = topod.call("list") or []
    running = running_from_topod(allocations, config)
    return sorted(a["job"] for a in allocations if a["job"] not in running and cpus_of(a))


def running_from_topod(allocations, config):
    """The PBS jobs topod holds, as running here, except those the periodic hook already found
    missing from the MoM (orphan candidates): for events that have no job list."""
    candidates = read_orphan_counts(config)
    return dict((a["job"], None) for a in allocations
                if pbs_job_id(a["job"]) is not None and a["job"] not in candidates)


# What this hook's own vnode comment says (see publish_ncpus), how it knows the comment as its own.
HELD_OUTSIDE = "CPUs held outside PBS"


def publish_ncpus(event, host, topology, free_map, allocations, running, config, lower_only=False):
    """Sets resources_available.ncpus of this MoM's vnodes to what PBS may really use (see
    pbs_usable_cpus), per NUMA node with vnode_per_numa_node; with `lower_only` never above what
    this hook last published there. While some CPUs are kept from PBS, the vnode's comment says
    by whom (pbsnodes shows it; the job waiting for them shows PBS's own "Insufficient amount of
    resource: ncpus"); the comment goes when they are back. A comment this hook did not write
    (an administrator's, or "topo: ..." while this hook has offlined the vnode) is left alone,
    as far as the MoM's view of the vnode shows it."""
    vnodes = event.vnode_list
    allocatable = cpu_set(free_map["allocatable"])
    wanted = []   # (vnode, ncpus PBS may use, allocatable CPUs there)
    if config["vnode_per_numa_node"]:
        for index, cpus, _ in numa_nodes_with_cpus(topology, free_map):
            name = "%s[%d]" % (host, index)
            if name in vnodes:
                wanted.append((name, pbs_usable_cpus(free_map, allocations, running, cpus, name), len(cpus)))
    else:
        wanted.append((host, pbs_usable_cpus(free_map, allocations, running), len(allocatable)))
    keepers = sorted(set(a["job"] for a in allocations if a["job"] not in running and cpus_of(a)))
    offlined_by_us = os.path.exists(marker_path(config))
    before = read_published(config)
    published = dict(before)
    for name, ncpus, total in wanted:
        last = before.get(name)
        if lower_only and last is not None:
            ncpus = min(ncpus, last["ncpus"])
        if name not in vnodes:
            vnodes[name] = pbs.vnode(name)
        vnode = vnodes[name]
        vnode.resources_available["ncpus"] = ncpus
        current = getattr(vnode, "comment", None)
        # Ours: this hook wrote the comment there is, the one about CPUs held outside PBS (not
        # another "topo: ..." reason, which the vnode keeps until what set it clears it).
        ours = bool(last and last.get("comment")) and (not current or HELD_OUTSIDE in current)
        may_comment = not offlined_by_us and (not current or ours)
        comment = False
        if ncpus < total and may_comment:
            shown = ", ".join(keepers[:5]) + (" and %d more" % (len(keepers) - 5) if len(keepers) > 5 else "")
            vnode.comment = ("topo: %d of %d %s (%s)"
                             % (total - ncpus, total, HELD_OUTSIDE, shown or "fenced beyond their ncpus"))[:250]
            comment = True
        elif ncpus >= total and ours and may_comment:
            vnode.comment = None
        elif ours and not may_comment:
            comment = True   # still ours to clear once this hook may write it again
        published[name] = {"ncpus": ncpus, "allocatable": total, "comment": comment}
    if before != published:
        log_info("ncpus for PBS: %s" % ", ".join(
            "%s %d of %d" % (name, v["ncpus"], v["allocatable"]) for name, v in sorted(published.items())
            if any(name == w[0] for w in wanted)))
        write_published(config, published)


def gpus_per_numa_node(topology, free_map, allocations):
    """({NUMA node os_index: how many GPUs topod may give jobs there}, None), counted from
    free_map's GPUs, free, reserved and held alike (each by its NUMA node's CPUs, topod's own
    rule of which devices are jobs' GPUs and where they sit, not one written again here), so
    that a MoM restarted under GPU jobs publishes the same counts as one started on an idle
    host; or (None, why) when such counts would not be what topod gives: a GPU has no NUMA node
    with CPUs PBS jobs may use (not known, as on cloud VMs, or all its CPUs reserved or
    offline), where PBS would have to give it with CPUs of another vnode; a job outside PBS
    holds GPUs; or GPUs are held and topod (older than held_gpus) does not say where. ({},
    None) on a host without GPUs."""
    held = free_map.get("held_gpus") or []
    outside = sorted(set(g.get("pci_address") or "?" for g in held if not str(g.get("job")).startswith(JOB_PREFIX)))
    if outside:
        # Not PBS's to count: it would send jobs there that topod refuses.
        return None, "GPU(s) are held outside PBS now (%s)" % ", ".join(outside[:4])
    if not held:
        listed = sorted(set(g.get("pci_address") or "?" for a in allocations for g in a.get("gpus") or []
                            if isinstance(g, dict) and not g.get("gone")))
        if listed:
            return None, ("GPU(s) are held now (%s) and this topod does not say where (it is older than "
                          "the hook: upgrade it)" % ", ".join(listed[:4]))
    with_vnode = {}
    for index, cpus, _ in numa_nodes_with_cpus(topology, free_map):
        for node in topology.get("numa_nodes") or []:
            if node.get("os_index") == index:
                with_vnode[frozenset(cpu_set(node["cpus"]))] = index
    counts = {}
    stray = []
    seen = set()
    sites = [("a free GPU", None, site) for site in free_map.get("gpus") or []]
    sites += [("a GPU reserved for %s" % g.get("job"), None, g.get("site") or {}) for g in free_map.get("reserved_gpus") or []]
    sites += [("%s (held by %s)" % (g.get("pci_address"), g.get("job")), g.get("pci_address"), g.get("site") or {})
              for g in held]
    for name, address, site in sites:
        if address is not None:
            if address in seen:
                continue   # one GPU two jobs share (a batch system's word) counts once
            seen.add(address)
        index = with_vnode.get(frozenset(cpu_set(site.get("numa")))) if site.get("numa") else None
        if index is None:
            stray.append(name)
        else:
            counts[index] = counts.get(index, 0) + 1
    if stray:
        return None, ("%d GPU(s) have no NUMA node with CPUs PBS jobs may use here (not known, or "
                      "all its CPUs reserved or offline): %s" % (len(stray), ", ".join(stray[:4])))
    return counts, None


def publish_gpus_per_numa_node(event, host, topology, free_map, allocations, config):
    """With vnode_per_numa_node (exechost_startup): each vnode host[N] gets as many of the GPUs
    resource (gpus_resource, "ngpus") as NUMA node N has GPUs for jobs, and the host's own vnode
    none, so that PBS gives a chunk the GPUs of the vnode whose CPUs it gives, and topod chooses
    them there, beside the job's CPUs. Only where every GPU lies in a NUMA node with such a
    vnode, and none is held outside PBS (GPUs PBS jobs hold count in their nodes, so that a MoM
    restarted under GPU jobs sets the same counts); otherwise nothing is set, and the log says
    why and what to do. Nothing on a host
    without GPUs (an administrator's count stays), nor where the server does not define the
    resource."""
    counts, why_not = gpus_per_numa_node(topology, free_map, allocations)
    resource = config["gpus_resource"]
    if why_not:
        log_info("%s per NUMA vnode not published: %s; none set by this hook (set them with qmgr, "
                 "or restart the MoM once no GPU is held)" % (resource, why_not))
        return
    if not counts:
        return
    vnodes = event.vnode_list
    published = []   # (vnode, count)
    try:
        for index, _, _ in numa_nodes_with_cpus(topology, free_map):
            name = "%s[%d]" % (host, index)
            if name in vnodes:
                vnodes[name].resources_available[resource] = counts.get(index, 0)
                published.append((name, counts.get(index, 0)))
        if host not in vnodes:
            vnodes[host] = pbs.vnode(host)
        vnodes[host].resources_available[resource] = 0
        published.append((host, 0))
    except Exception as e:  # the server does not define it: PBS raises on the attribute
        log_info("%s per NUMA vnode not published (%s: %s): the server defines no resource %s "
                 "(qmgr -c \"create resource %s type=long,flag=nh\")" % (resource, type(e).__name__, e, resource, resource))
        return
    log_info("%s per vnode: %s (a count set with qmgr on a vnode stands over these)"
             % (resource, ", ".join("%s=%d" % p for p in published)))


def published_path(config):
    return os.path.join(config["state_dir"], "ncpus.json")


def read_state(path):
    """One of the hook's state files as a dict; {} when it is missing, unreadable or not a JSON
    object (the hook then starts that state afresh)."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_published(config):
    """{vnode: {"ncpus", "allocatable", "comment"}} as last published by this hook; entries of
    another shape (an older hook's file, a damaged one) are ignored."""
    good = {}
    for name, value in read_state(published_path(config)).items():
        if (isinstance(value, dict) and isinstance(value.get("ncpus"), int)
                and isinstance(value.get("allocatable"), int)):
            good[name] = {"ncpus": value["ncpus"], "allocatable": value["allocatable"],
                          "comment": value.get("comment") is True}
    return good


def write_published(config, published):
    write_state(config, published_path(config), published)


def write_state(config, path, value):
    """Writes one of the hook's state files whole (temporary file, rename); a failure is a
    HookError that names the file."""
    try:
        ensure_dir(config["state_dir"])
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            json.dump(value, f)
        os.rename(temporary, path)
    except OSError as e:
        raise HookError("cannot write the hook's state file %s: %s (\"state_dir\" in the hook "
                        "configuration must be a directory root can write)" % (path, e))


# publish()'s make_numa_vnodes for exechost_periodic: only those exechost_startup could not
# make (see numa_vnodes_to_make).
IF_MISSING = object()


def publish(event, host, topod, config, make_numa_vnodes, running=None, lower_only=False):
    """Sets topo_free_numa / topo_free_l3 / topo_free_cores on this MoM's vnodes (with
    "publish") and their ncpus (with "publish_ncpus"). With vnode_per_numa_node, each NUMA node
    is a vnode host[N] with its ncpus, mem and counts, and the natural vnode keeps no CPUs (as
    the stock cgroups hook does); `make_numa_vnodes` creates them (exechost_startup), IF_MISSING
    only when exechost_startup could not (exechost_periodic), otherwise only the ones PBS already
    lists are refreshed. `running`: see pbs_usable_cpus (None: every
    PBS job topod holds that is not an orphan candidate).

    A job that waited for CPUs topod held starts at the scheduler's next cycle once they are
    published free: at the next job submission or end, or scheduler_iteration seconds later.
    A MoM hook cannot start a cycle: pbs.server().scheduler_restart_cycle() only restarts one
    under way, and one asked for while the scheduler is idle stopped all scheduling on OpenPBS
    23.06 until pbs_sched was restarted (seen here), so this hook never asks."""
    topology = topod.call("topology")
    free_map = topod.call("free_map")
    if make_numa_vnodes is IF_MISSING:
        make_numa_vnodes = numa_vnodes_to_make(event, host, topology, free_map, config)
    prefix = config["resource_prefix"] if config["publish"] else None
    vnodes = event.vnode_list
    if config["vnode_per_numa_node"]:
        for index, cpus, memory in numa_nodes_with_cpus(topology, free_map):
            name = "%s[%d]" % (host, index)
            if name not in vnodes:
                if not make_numa_vnodes:
                    continue
                vnodes[name] = pbs.vnode(name)
            if make_numa_vnodes:
                vnodes[name].resources_available["ncpus"] = len(cpus)
                if memory:
                    vnodes[name].resources_available["mem"] = pbs.size("%dkb" % (memory // 1024))
            counts = free_counts(topology, free_map, index)
            for suffix, field in PUBLISHED if prefix is not None else ():
                vnodes[name].resources_available[prefix + suffix] = counts[field]
        if make_numa_vnodes and host in vnodes:
            vnodes[host].resources_available["ncpus"] = 0
        if make_numa_vnodes and config["gpus_resource"]:
            publish_gpus_per_numa_node(event, host, topology, free_map, topod.call("list") or [], config)
    if config["publish_ncpus"]:
        allocations = topod.call("list") or []
        if running is None:
            running = running_from_topod(allocations, config)
        publish_ncpus(event, host, topology, free_map, allocations, running, config, lower_only)
    if prefix is None:
        return
    if host not in vnodes:
        vnodes[host] = pbs.vnode(host)
    for suffix, field in PUBLISHED:
        vnodes[host].resources_available[prefix + suffix] = free_map["free"][field]


# ---------------------------------------------------------------------------------------------
# Event handlers


def on_submit(event, config):
    """queuejob, modifyjob: every topology request of the job (job-wide, and in select chunks)
    must parse, and with enforce_ncpus must not need more CPUs than the job asks PBS for where
    it is to run (qalter: the job as it will be); qsub/qalter print the rejection message as it is."""
    resource = config["resource"]
    requests = []   # (request, the select chunks it applies to; None: job-wide)
    value = submitted(event, resource)
    wide = unquote(str(value)) if value is not None and str(value).strip() else None
    if wide is not None:
        requests.append((wide, None))
    select = submitted(event, "select")
    chunks = list(chunk_counts(select))
    for chunk, count in chunks:
        if chunk.get(resource) and chunk[resource] not in [r for r, _ in requests]:
            requests.append((chunk[resource], [(c, n) for c, n in chunks if c.get(resource) == chunk[resource]]))
    gpus = config["gpus_resource"]
    for request, applies_to in requests:
        answer = check_request(request, config)
        request_chunks = applies_to if applies_to is not None else chunks
        asked = gpus_asked_at_submit(event, chunks, request_chunks, answer, gpus) if gpus else None
        check_gpus_at_submit(request, answer, asked, config)
        if config["enforce_ncpus"]:
            check_ncpus(request, answer, applies_to if applies_to is not None else chunks,
                        submitted(event, "ncpus") if not chunks else None, config)


def submitted(event, name):
    """A resource of the job as it is to be (modifyjob: the change if there is one, else the job
    as it was), or None."""
    value = resource_of(event.job.Resource_List, name)
    if value is None and getattr(event, "job_o", None) is not None:
        value = resource_of(event.job_o.Resource_List, name)
    return value


def chunk_counts(select):
    """-l select's chunks as (resources, count) pairs: "2:ncpus=4+1:ncpus=1" ->
    [({"ncpus": "4"}, 2), ({"ncpus": "1"}, 1)]."""
    for chunk in split_top_level(str(select or ""), "+"):
        words = split_top_level(chunk, ":")
        count = 1
        if words and words[0].strip().isdigit():
            count = int(words.pop(0))
        if any(w.strip() for w in words):
            yield resources_of(words), count


def least_cpus(answer):
    """The fewest CPUs a checked request takes on a host: its tasks (the least of a malleable
    request; 1 without a count, whose count is the chunks' mpiprocs) times the units per task,
    a unit being at least one CPU (a core is one CPU per hardware thread, more with SMT)."""
    parsed = answer.get("request") if isinstance(answer, dict) else None
    if not isinstance(parsed, dict):
        return None
    tasks, units = parsed.get("tasks") or 1, parsed.get("units_per_task") or 1
    if not isinstance(tasks, int) or not isinstance(units, int):
        return None
    return tasks * units


def check_ncpus(request, answer, chunks, job_ncpus, config):
    """Refuses at qsub a request that needs more CPUs than the job asks for: execjob_begin would
    refuse it on every host, and PBS would try it ~20 times before holding it. The most CPUs
    the job can have on one host is the ncpus of all the chunks the request applies to (or -l
    ncpus without select); a chunk without ncpus, or no ncpus at all (PBS's defaults come after
    this hook), is not judged."""
    need = least_cpus(answer)
    if need is None:
        return
    if chunks:
        if any(chunk.get("ncpus") is None for chunk, _ in chunks):
            return
        have = sum(whole(chunk["ncpus"], "ncpus in -l select") * count for chunk, count in chunks)
        asked = "+".join("%s%s" % ("%d:" % count if count > 1 else "", "ncpus=%s" % chunk["ncpus"]) for chunk, count in chunks)
    elif job_ncpus is not None:
        have = whole(job_ncpus, "-l ncpus")
        asked = "ncpus=%d" % have
    else:
        return
    if need > have:
        raise HookError("%s=%s needs at least %d CPUs but the job asks %s: ask -l select=1:ncpus=%d "
                        "or a smaller request" % (config["resource"], shortened(request), need, asked, need))


def on_begin(event, config):
    """execjob_begin: allocate on this host. topod down: the job goes back to the queue
    (job.rerun() and a rejection) and this host's vnodes are offlined with the reason, so that
    the scheduler stops sending jobs here until exechost_periodic finds topod again."""
    job, host = event.job, pbs.get_local_nodename()
    jid = topod_job_id(job.id)
    share = share_on_host(job, host, config["resource"], config["gpus_resource"])
    request, tasks = request_for(job, share, config)
    if request is None:
        if config["default_request"]:
            why = "default_request applies only where the job has CPUs (ncpus=0 here)"
        else:
            why = "no default_request"
        pbs.logjobmsg(job.id, "%s: no %s request and %s: not confined" % (HOOK, config["resource"], why))
        return
    if config["enforce_ncpus"] and share.known and share.ncpus == 0:
        # PBS would count none of the CPUs the request takes here.
        raise HookError("%s=%s takes CPUs on %s but the job asked PBS for ncpus=0 there; ask for "
                        "the ncpus the request takes" % (config["resource"], shortened(request), host))
    # GPUs PBS counted here: topod chooses which. Only a request that may say gpus= (in any
    # case, as the parser reads it), or a job with GPUs here, is parsed again: no process for
    # every job's start (topoctl comes with topod, which topo-pbs needs).
    request, tasks = request_with_gpus(job, request, tasks, share, config,
                                       default=request == config["default_request"] and tasks == share.ncpus
                                       and job_wide_request(job, config["resource"]) is None and not share.requests)
    topod = Topod(config)
    try:
        allocation = allocate(topod, event, job, jid, share, request, tasks)
    except TopodUnreachable as e:
        offline_vnodes(event, host, config, "%s; jobs cannot start here" % e)
        job.rerun()
        raise HookError("%s; job %s goes back to the queue" % (e, job.id))
    except DoesNotFitHere as e:
        job.rerun()
        if HELD_BACK in str(e):
            # topod named the reservation or open prime-time pool that keeps the job out: the
            # CPUs are free and in one piece, PBS just cannot see those.
            raise HookError("%s; job %s goes back to the queue" % (e, job.id))
        if share.ngpus and " GPU(s)" in str(e):
            # PBS counted GPUs free here that topod does not have free: its ngpus is not the
            # number of GPUs topod sees (or GPUs are held outside PBS).
            if config["vnode_per_numa_node"]:
                advice = ("resources_available.%s of the vnodes %s[N] is set by this hook at the MoM's start "
                          "from topod's GPUs (unset any count set with qmgr on %s or its vnodes, and restart "
                          "the MoM when no GPU is held)" % (config["gpus_resource"], host, host))
            else:
                advice = ("make resources_available.%s of %s the number of GPUs `topoctl show` lists there"
                          % (config["gpus_resource"], host))
            raise HookError("%s; PBS counted %s=%d for job %s here: %s; the job goes back to the queue"
                            % (e, config["gpus_resource"], share.ngpus, job.id, advice))
        outside = held_outside_pbs(topod, config)
        if not outside:
            # Enough CPUs by PBS's count and topod's, but not in the shape the request asks
            # for: PBS cannot see shapes, so it may send the job here again.
            raise HookError("%s; the free CPUs on %s are too scattered for the request's shape"
                            % (e, host))
        # PBS counted CPUs that topod holds for something PBS does not know about. Tell PBS
        # what it may really use here (never more than was last published: this event does not
        # know the ncpus of the running jobs), so that its scheduler keeps the job queued with
        # its own "Insufficient amount of resource: ncpus" comment instead of sending it back
        # until it is held.
        if config["publish_ncpus"]:
            try:
                publish(event, host, topod, config, False, lower_only=True)
            except HookError as failed:
                pbs.logmsg(pbs.EVENT_ERROR, "%s: cannot publish ncpus on %s: %s" % (HOOK, host, failed))
        raise HookError("%s; topod holds CPUs for %s, which PBS does not count: job %s waits in "
                        "the queue until they are free" % (e, ", ".join(outside[:5]), job.id))
    got = cpu_set(allocation["cpus"])
    if config["enforce_ncpus"] and share.ncpus and len(got) > share.ncpus:
        # A malleable request (*min-max) starts with the most tasks that fit the host: it is
        # shrunk to what PBS gave it here, when its least fits.
        shrunk = fit_malleable(topod, jid, allocation, share.ncpus)
        if shrunk is not None:
            allocation, got = shrunk, cpu_set(shrunk["cpus"])
            pbs.logjobmsg(job.id, "%s: %s: malleable, %d task(s) on %d CPU(s) to fit ncpus=%d on %s"
                          % (HOOK, jid, len(shrunk["tasks"]), len(got), share.ncpus, host))
    if config["enforce_ncpus"] and share.ncpus and len(got) > share.ncpus:
        release(topod, jid)
        raise HookError(
            "%s=%s takes %d CPUs on %s but the job asked PBS for ncpus=%d there; ask for more "
            "ncpus or a smaller request" % (config["resource"], request, len(got), host, share.ncpus)
        )
    pbs.logjobmsg(job.id, "%s: %s on %s: CPUs %s, memory nodes %s (%s)"
                  % (HOOK, jid, host, allocation["cpus"], allocation["mems"], allocation["request"]))


MALLEABLE = re.compile(r"\*\d+-\d+")


def fit_malleable(topod, jid, allocation, ncpus):
    """A malleable job's allocation shrunk (topod's resize, which keeps its first tasks) to the
    most tasks whose CPUs add up to at most `ncpus`; None when the request is not malleable or
    its least does not fit (topod refuses a size below it)."""
    if not MALLEABLE.search(allocation.get("request", "")):
        return None
    total, fit = 0, 0
    for task in allocation.get("tasks", []):
        total += len(cpu_set(task))
        if total > ncpus:
            break
        fit += 1
    if fit < 1 or fit >= len(allocation.get("tasks", [])):
        return None
    try:
        return topod.call("resize", job=jid, tasks=fit)
    except TopodRefused:
        return None


def allocate(topod, event, job, jid, share, request, tasks):
    """topod's allocate with what PBS gave the job here: a per-NUMA-vnode job stays inside the
    CPUs of its NUMA nodes; the owner may then join its own processes (topo-exec)."""
    fields = {"job": jid, "request": request, "tasks": tasks}
    if share.numa_nodes:
        topology, free_map = topod.call("topology"), topod.call("free_map")
        cpus = set()
        for index, node_cpus, _ in numa_nodes_with_cpus(topology, free_map):
            if index in share.numa_nodes:
                cpus |= node_cpus
        fields["cpus"] = cpu_list(cpus)
    if share.mem_bytes:
        fields["mem_limit_bytes"] = share.mem_bytes
    gpus_by_numa = gpu_counts_by_numa(share, request)
    if gpus_by_numa:
        fields["gpus_by_numa"] = gpus_by_numa
    uid = owner_uid(job)
    if uid is not None:
        fields["owner_uid"] = uid
    # Prime-time pools and gang_prime_queues admit by queue; a job may name a pool with
    # qsub -v TOPO_POOL=NAME.
    queue = queue_name(job)
    if queue:
        fields["queue"] = queue
    pool = job_variable(job, "TOPO_POOL")
    if pool:
        problem = name_problem(pool)
        if problem:
            raise HookError("job %s: TOPO_POOL (qsub -v) %s; it names a prime-time pool of this host's topod"
                            % (job.id, problem))
        fields["pool"] = pool
    # Never sliced by topod's gang rows: PBS would not know the time the job spent frozen and
    # would end it at its walltime. PBS's own preemption (suspend) is followed instead, through
    # execjob_postsuspend and execjob_preresume.
    fields["gang"] = False
    try:
        try:
            return topod.call("allocate", **fields)
        except TopodRefused as e:
            if "gpus_by_numa" not in fields or 'unknown field "gpus_by_numa"' not in e.reason:
                raise
            # A topod older than this hook: it chooses the GPUs where it finds best (PBS's count
            # of free GPUs per vnode may then drift from topod's).
            pbs.logjobmsg(job.id, "%s: topod takes no gpus_by_numa (older than this hook): it "
                          "chooses the job's GPUs in any NUMA node; upgrade topod" % HOOK)
            del fields["gpus_by_numa"]
            return topod.call("allocate", **fields)
    except TopodRefused as e:
        if e.code == "does_not_fit":
            raise DoesNotFitHere("%s on %s" % (e, pbs.get_local_nodename()))
        raise HookError("cannot place job %s on %s: %s" % (job.id, pbs.get_local_nodename(), e))


def gpu_counts_by_numa(share, request):
    """allocate's gpus_by_numa ([{"numa": N, "count": k}]): the GPUs PBS counted for the job on
    each per-NUMA vnode host[N] here, for a request that asks topod for GPUs (gpus=, which
    request_with_gpus made add up to share.ngpus); [] when PBS counted some on the host's own
    vnode (their node is not PBS's to say) or the request asks for none."""
    if not share.gpus_by_numa or share.gpus_off_numa or not MAY_ASK_FOR_GPUS.search(request or ""):
        return []
    return [{"numa": index, "count": count} for index, count in sorted(share.gpus_by_numa.items())]


def owner_uid(job):
    """The uid of job.euser on this host, or None (then only root may join processes)."""
    try:
        return pwd.getpwnam(str(job.euser)).pw_uid
    except (KeyError, TypeError):
        return None


def name_problem(name):
    """What is wrong with a queue or pool name topod would refuse (topo_core::proto::check_name:
    at most MAX_NAME_BYTES bytes, no control characters), or None."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        return "is %d bytes long; at most %d bytes" % (size, MAX_NAME_BYTES)
    for at, c in enumerate(name):
        if ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0:
            return "%r has a control character at character %d" % (shortened(name), at)
    return None


def queue_name(job):
    """The name of the job's queue, or None (job.queue is a pbs.queue, or its name)."""
    queue = getattr(job, "queue", None)
    if queue is None:
        return None
    name = getattr(queue, "name", None) or str(queue)
    return name or None


def job_variable(job, name):
    """A variable of the job's environment as qsub -v / -V gave it (Variable_List), or None."""
    variables = getattr(job, "Variable_List", None)
    if variables is None:
        return None
    try:
        value = variables[name]
    except (KeyError, TypeError):
        return None
    return str(value) if value else None


def find_allocation(topod, jid):
    """The job's allocation from topod's list, or None."""
    for allocation in topod.call("list") or []:
        if allocation.get("job") == jid:
            return allocation
    return None


def expects_allocation(job, config):
    """Whether execjob_begin allocated for this job (the same rule as on_begin)."""
    host = pbs.get_local_nodename()
    request, _ = request_for(job, share_on_host(job, host, config["resource"]), config)
    return request is not None


def on_launch(event, config):
    """execjob_launch: the hook's parent is the process that will exec the job's program (the
    job shell or a TM task); "join" moves it into the cgroup, so that everything the job forks
    starts inside. "topo-exec" instead rewrites the command so that topo-exec, as the job's
    user, joins itself and execs the program. Either way the job's environment says what it got."""
    job = event.job
    jid = topod_job_id(job.id)
    topod = Topod(config)
    allocation = on_topod_down_rerun(job, lambda: find_allocation(topod, jid))
    if allocation is None:
        if expects_allocation(job, config):
            raise HookError("job %s has no allocation on %s (did execjob_begin run with the topo hook?); "
                            "it is not started outside a cgroup" % (job.id, pbs.get_local_nodename()))
        return
    if config["launch"] == "join":
        on_topod_down_rerun(job, lambda: topod.call("join", job=jid, pid=os.getppid()))
    else:
        prepend_topo_exec(event, jid, config)
    event.env["TOPO_JOB"] = env_value(jid)
    event.env["TOPO_CPUS"] = env_value(allocation["cpus"])
    event.env["TOPO_MEMS"] = env_value(allocation["mems"])
    if config["launch"] == "join":
        # topo-exec tells the job its GPUs itself. Lists the job inherited (qsub -V, an outer
        # job) name GPUs it was not given: topo's own are removed when not set here, and so is
        # CUDA_VISIBLE_DEVICES of a job given GPUs (as topo-exec does).
        told = gpu_variables(allocation)
        for name, value in told:
            event.env[name] = env_value(value)
        stale = set(JOB_GPU_LISTS if told else TOPO_GPU_LISTS) - set(n for n, _ in told)
        for name in sorted(stale):
            if name in event.env:
                del event.env[name]
    # Where topod tells a malleable job its CPUs after a resize (libtopo's topo_resize_wait).
    event.env["TOPO_NOTIFY_FILE"] = env_value(os.path.join(os.path.dirname(config["socket"]), "job-notify", jid))


def env_value(value):
    """`value` as execjob_launch's event.env must hold it: the MoM cuts a value at its first
    comma unless the comma is escaped with a backslash, and drops a backslash that escapes the
    character after it (OpenPBS src/lib/Libattr/attr_func.c, strtok_quoted and
    prune_esc_backslash). Observed on the OpenPBS built from ../shared/pbs: a two-GPU job was
    told TOPO_GPUS=0000:18:00.0 (its first GPU only) until this; OpenPBS's own pbs_cgroups hook
    joins CUDA_VISIBLE_DEVICES with "\\," (setup_job_devices_env). A CPU list ("0,2-3")
    needs it as much as a list of GPUs. A backslash right before a comma cannot be passed (the
    MoM reads "\\\\\\," as a backslash and a cut); none of the values set here has one."""
    return str(value).replace("\\", "\\\\").replace(",", "\\,")


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
# What a job is told of its GPUs (gpu_variables); one inherited is never this job's.
TOPO_GPU_LISTS = ("TOPO_GPUS", "TOPO_TASK_GPUS")
JOB_GPU_LISTS = TOPO_GPU_LISTS + ("CUDA_VISIBLE_DEVICES",)
# A PCI address as sysfs names a function (domain:bus:device.function), and an NVIDIA UUID as
# the driver's information file gives it; \Z, not $, so that no newline passes.
PCI_ADDRESS = re.compile(r"\A[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\Z")
NVIDIA_UUID = re.compile(r"\AGPU-[0-9a-fA-F-]{8,64}\Z")


def gpu_variables(allocation, nvidia=NVIDIA_GPUS):
    """What a job is told of its GPUs, as topo-exec tells it: TOPO_GPUS (PCI addresses), with
    several tasks TOPO_TASK_GPUS (tasks by ';', a task's GPUs by ','), and CUDA_VISIBLE_DEVICES by
    UUID when every GPU is an NVIDIA GPU whose driver says its UUID (CUDA's own numbering depends
    on its enumeration order and on which devices the cgroup lets it open). A job without GPUs is
    told nothing of them (the empty list PBS's pbs_cgroups sets is not set either). Only what
    reads as a PCI address (or a UUID) is passed on, each once; a GPU topod lists as gone is not
    the job's to use."""
    addresses = []
    for gpu in allocation.get("gpus") or []:
        address = gpu.get("pci_address") if isinstance(gpu, dict) else None
        if isinstance(address, str) and PCI_ADDRESS.match(address) and not gpu.get("gone") \
                and address not in addresses:
            addresses.append(address)
    if not addresses:
        return []
    found = [("TOPO_GPUS", ",".join(addresses))]
    tasks = [[a for a in t if a in addresses] if isinstance(t, list) else [] for t in allocation.get("task_gpus") or []]
    if len(tasks) > 1 and all(tasks):
        found.append(("TOPO_TASK_GPUS", ";".join(",".join(t) for t in tasks)))
    uuids = []
    for address in addresses:
        try:
            with open(os.path.join(nvidia, address, "information")) as f:
                text = f.read(65536)
        except (OSError, UnicodeError):
            return found
        uuid = [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("GPU UUID:")]
        if not uuid or not NVIDIA_UUID.match(uuid[0]):
            return found
        uuids.append(uuid[0])
    found.append(("CUDA_VISIBLE_DEVICES", ",".join(uuids)))
    return found


def on_topod_down_rerun(job, call):
    """Runs `call`; when topod cannot be reached, marks the job to be requeued before the
    rejection, so that it is not lost and does not run outside its cgroup."""
    try:
        return call()
    except TopodUnreachable as e:
        job.rerun()
        raise HookError("%s; job %s goes back to the queue" % (e, job.id))


def prepend_topo_exec(event, jid, config):
    """progname/argv become topo-exec --socket S --job J -- PROGRAM ARGS. PBS gives the job
    shell an empty argv (the script comes on stdin), so argv[0] is then the program itself."""
    program = str(event.progname)
    argv = [str(a) for a in (event.argv or [])]
    event.progname = config["topo_exec"]
    event.argv = [config["topo_exec"], "--socket", config["socket"], "--job", jid, "--", program] + argv[1:]


def on_attach(event, config):
    """execjob_attach: event.pid (a process pbs_attach or tm_attach adds to the job) joins."""
    job = event.job
    jid = topod_job_id(job.id)
    topod = Topod(config)
    try:
        topod.call("join", job=jid, pid=int(event.pid))
    except TopodRefused as e:
        if e.code == "unknown_job" and not expects_allocation(job, config):
            return
        raise HookError("cannot put process %s of job %s into its cgroup: %s" % (event.pid, job.id, e))


def on_end(event, config):
    """execjob_epilogue and execjob_end: release. Both do it, so either one is enough; the
    second finds nothing to release. If topod cannot be reached, exechost_periodic releases
    the job later (it is then an orphan: held by topod, not run by this MoM)."""
    jid = topod_job_id(event.job.id)
    try:
        killed = release(Topod(config), jid)
    except TopodUnreachable as e:
        raise HookError("%s; exechost_periodic releases %s once topod answers" % (e, jid))
    if killed is not None:
        pbs.logjobmsg(event.job.id, "%s: %s released (%d leftover process(es) killed)" % (HOOK, jid, killed))


def release(topod, jid):
    """topod's release; None when the job held nothing here (already released, never placed)."""
    try:
        return topod.call("release", job=jid).get("killed", 0)
    except TopodRefused as e:
        if e.code == "unknown_job":
            return None
        raise HookError("cannot release %s: %s" % (jid, e))


def on_postsuspend(event, config):
    """execjob_postsuspend: PBS has stopped the job's processes with SIGSTOP (qsig -s suspend,
    or preemption by suspension); topod now freezes the whole cgroup, which also stops what
    forked around the signals and what a SIGCONT from inside would wake, and may lend the job's
    CPUs until it resumes. PBS's suspension stands whatever happens here."""
    jid = topod_job_id(event.job.id)
    try:
        topod = Topod(config)
        reply = topod.call("suspend", job=jid)
        log_info("job %s frozen by topod (CPUs %s may be lent until it resumes)" % (event.job.id, reply.get("cpus")))
    except TopodRefused as e:
        if e.code == "unknown_job" or "is suspended" in e.reason:
            return
        raise HookError("cannot freeze %s: %s" % (jid, e))


def on_preresume(event, config):
    """execjob_preresume: before PBS sends SIGCONT, topod thaws the job once no other job runs
    on its CPUs. While one does, the event is rejected and PBS keeps the job suspended."""
    jid = topod_job_id(event.job.id)
    try:
        Topod(config).call("resume", job=jid)
    except TopodRefused as e:
        if e.code == "unknown_job" or "is running" in e.reason:
            return
        raise HookError("cannot resume %s: %s" % (jid, e))


def on_startup(event, config):
    """exechost_startup: publish (and create the per-NUMA vnodes). If topod is not up yet the
    vnodes are offlined with the reason; exechost_periodic brings them back."""
    host = pbs.get_local_nodename()
    if not config["publish"] and not config["publish_ncpus"] and not config["vnode_per_numa_node"]:
        return
    try:
        publish(event, host, Topod(config), config, True)
    except TopodUnreachable as e:
        offline_vnodes(event, host, config, "%s; jobs cannot start here" % e)


def on_periodic(event, config):
    """exechost_periodic: release orphans, publish, then offline (something failed) or bring
    back online (all worked, and this hook had offlined the vnodes)."""
    host = pbs.get_local_nodename()
    topod = Topod(config)
    try:
        failures = release_orphans(event, topod, config)
        comment_missized(event, topod)
        if config["publish"] or config["publish_ncpus"]:
            running = running_jobs(event, host, config)
            # A PBS job topod holds that this run's job list lacks for the first time is most
            # likely starting (its execjob_begin raced with this hook), not an orphan: PBS
            # counts its ncpus already. From its second miss on it counts as held outside PBS,
            # until it is released.
            for jid, misses in read_orphan_counts(config).items():
                if misses <= 1:
                    running.setdefault(jid, None)
            publish(event, host, topod, config, IF_MISSING, running)
        elif config["vnode_per_numa_node"]:
            publish(event, host, topod, config, IF_MISSING)
    except TopodUnreachable as e:
        offline_vnodes(event, host, config, "%s; jobs cannot start here" % e)
        return
    if failures:
        offline_vnodes(event, host, config, "; ".join(failures))
    else:
        online_vnodes_if_we_offlined(event, host, config)


def numa_vnodes_to_make(event, host, topology, free_map, config):
    """Whether this exechost_periodic run makes the per-NUMA vnodes exechost_startup could not
    (topod was not up when the MoM started): with vnode_per_numa_node, when a NUMA node with CPUs
    has no vnode HOST[N] yet and no PBS job runs on this MoM. While one does, its ncpus are
    counted on the vnodes it was given (the host's own): taking them away there would let PBS
    give the same CPUs again through the new vnodes, so the vnodes wait for the host to be idle
    (logged at each run)."""
    if not config["vnode_per_numa_node"]:
        return False
    missing = ["%s[%d]" % (host, index) for index, _, _ in numa_nodes_with_cpus(topology, free_map)
               if "%s[%d]" % (host, index) not in event.vnode_list]
    if not missing:
        return False
    if len(event.job_list):
        log_info("vnode_per_numa_node: vnodes %s are not made yet (exechost_startup could not reach "
                 "topod); they are made once no PBS job runs on %s" % (", ".join(missing), host))
        return False
    log_info("vnode_per_numa_node: making vnodes %s, which exechost_startup could not (topod was "
             "not reachable then)" % ", ".join(missing))
    return True


def comment_missized(event, topod):
    """Says of each job of this MoM that topod found mis-sized (its sampler: more threads
    runnable than CPUs, or most CPUs idle) topod's one-line reason, once: in the job's MoM log
    lines (tracejob JOBID shows them) and in its comment at the MoM. A job whose comment says it
    already is left alone. The comment never reaches the server on Linux (OpenPBS sends a MoM's
    job comment to the server only in its Windows build, src/resmom/mom_updates_bundle.c; see the
    README's "Notes and troubleshooting"), so qstat -f does not show it; the MoM's view of the
    job keeps it, which is what "once" is judged by."""
    for allocation in topod.call("list") or []:
        flag = allocation.get("missized")
        pbs_id = pbs_job_id(allocation.get("job", ""))
        if not flag or pbs_id is None or pbs_id not in event.job_list:
            continue
        comment = ("topo: mis-sized (%s): %s" % (flag.get("kind"), flag.get("reason")))[:250]
        job = event.job_list[pbs_id]
        if getattr(job, "comment", None) == comment:
            continue
        job.comment = comment
        pbs.logjobmsg(pbs_id, "%s: %s" % (HOOK, comment))


def running_jobs(event, host, config):
    """{topod job id: {vnode: ncpus PBS gave it there}} of the jobs this MoM runs (job_list);
    None for a job whose counts PBS did not show. A job whose values cannot be read counts as
    running with unknown counts (it is PBS's, whatever its numbers)."""
    running = {}
    for pbs_id, job in event.job_list.items():
        try:
            jid = topod_job_id(pbs_id)
        except HookError:
            continue
        try:
            share = share_on_host(job, host, config["resource"])
            running[jid] = dict(share.per_vnode) if share.known else None
        except HookError as e:
            pbs.logmsg(pbs.EVENT_DEBUG, "%s: job %s: %s" % (HOOK, pbs_id, e))
            running[jid] = None
    return running


def release_orphans(event, topod, config):
    """Releases the PBS jobs topod holds that this MoM does not run (event.job_list), once they
    have been missing for orphan_after_runs periodic runs in a row: a job whose execjob_begin
    races with this hook is not yet in the list it was given. Returns the failures."""
    running = set(str(j) for j in event.job_list.keys())
    held = [a["job"] for a in topod.call("list") or [] if pbs_job_id(a["job"]) is not None]
    missing = [jid for jid in held if pbs_job_id(jid) not in running]
    counts = read_orphan_counts(config)
    counts = dict((jid, counts.get(jid, 0) + 1) for jid in missing)
    failures = []
    for jid in missing:
        if counts[jid] < config["orphan_after_runs"]:
            continue
        try:
            killed = release(topod, jid)
            del counts[jid]
            log_info("released orphan %s (no such job on this MoM; %s process(es) killed)" % (jid, killed or 0))
        except TopodUnreachable:
            raise
        except HookError as e:
            failures.append(str(e))
    write_orphan_counts(config, counts)
    return failures


def orphans_path(config):
    return os.path.join(config["state_dir"], "orphans.json")


def read_orphan_counts(config):
    """{topod job id: periodic runs it has been missing}; entries of another shape are ignored."""
    counts = read_state(orphans_path(config))
    return dict((k, v) for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool))


def write_orphan_counts(config, counts):
    write_state(config, orphans_path(config), counts)


# ---------------------------------------------------------------------------------------------
# A host whose topo has been removed


def not_installed(config):
    """Why topo counts as removed from this host, or None: topod's socket (and its
    administrators' socket) and topod's protocol schema are all missing. A topod that is merely
    down leaves the schema (a file of the topod package) in place, and is handled as down."""
    base, ext = os.path.splitext(config["socket"])
    paths = [config["socket"], base + "-admin" + ext, config["protocol_schema"]]
    if any(os.path.exists(p) for p in paths):
        return None
    return "no topod socket at %s and no protocol schema at %s" % (config["socket"], config["protocol_schema"])


def explicit_request(job, config):
    """The topology request the job itself asked for on this host (job-wide, or in a chunk placed
    here), or None: default_request does not count."""
    wide = job_wide_request(job, config["resource"])
    if wide is not None:
        return wide
    share = share_on_host(job, pbs.get_local_nodename(), config["resource"])
    return share.requests[0] if share.requests else None


def on_not_installed(event, config, reason):
    """A MoM event on a host whose topo has been removed while the hooks were still installed
    (the server hands every MoM the hook): fail open. A job without a topology request runs
    without topo's placement (one log line at execjob_begin); one that asks for a topology is
    refused, since nothing here can place it. exechost_* bring back online the vnodes this hook
    had offlined (its comments start with "topo: "; the marker may have gone with state_dir)."""
    host = pbs.get_local_nodename()
    if event.type in (pbs.EXECHOST_STARTUP, pbs.EXECHOST_PERIODIC):
        back = []
        for name in local_vnodes(event, host):
            vnode = event.vnode_list[name]
            comment = getattr(vnode, "comment", None) or ""
            if os.path.exists(marker_path(config)) or comment.startswith("topo: "):
                vnode.state = pbs.ND_FREE
                vnode.comment = None
                back.append(name)
        try:
            os.remove(marker_path(config))
        except OSError:
            pass
        if back:
            log_info("topo is not installed on this host (%s): vnodes %s back online, without topo" % (reason, ", ".join(back)))
        return
    job = getattr(event, "job", None)
    if job is None:
        return
    request = explicit_request(job, config)
    if request is not None:
        if event.type in (pbs.EXECJOB_BEGIN, pbs.EXECJOB_LAUNCH, pbs.EXECJOB_ATTACH):
            raise HookError("topo is not installed on %s (%s): the job asks for %s=%s, which only topo "
                            "can place; submit it without -l %s, or to hosts that run topod"
                            % (host, reason, config["resource"], shortened(request), config["resource"]))
        return
    if event.type == pbs.EXECJOB_BEGIN:
        pbs.logjobmsg(job.id, "%s: topo is not installed on this host (%s): job runs without topo's placement"
                      % (HOOK, reason))


# ---------------------------------------------------------------------------------------------
# Dispatch


def handlers():
    """Event type -> (handler, whether a failure rejects the event). Where rejecting means
    nothing (end, startup, periodic) a failure is logged and the vnodes speak for it."""
    return {
        pbs.QUEUEJOB: (on_submit, True),
        pbs.MODIFYJOB: (on_submit, True),
        pbs.EXECJOB_BEGIN: (on_begin, True),
        pbs.EXECJOB_LAUNCH: (on_launch, True),
        pbs.EXECJOB_ATTACH: (on_attach, True),
        pbs.EXECJOB_EPILOGUE: (on_end, False),
        pbs.EXECJOB_END: (on_end, False),
        pbs.EXECHOST_STARTUP: (on_startup, False),
        pbs.EXECHOST_PERIODIC: (on_periodic, False),
        pbs.EXECJOB_POSTSUSPEND: (on_postsuspend, False),
        pbs.EXECJOB_PRERESUME: (on_preresume, True),
    }


def mom_events():
    """The event types that run at a MoM (where topod is asked), as far as this PBS has them."""
    names = ("EXECJOB_BEGIN", "EXECJOB_LAUNCH", "EXECJOB_ATTACH", "EXECJOB_EPILOGUE", "EXECJOB_END",
             "EXECHOST_STARTUP", "EXECHOST_PERIODIC", "EXECJOB_POSTSUSPEND", "EXECJOB_PRERESUME")
    return set(getattr(pbs, n) for n in names if hasattr(pbs, n))


def main():
    event = pbs.event()
    handler, rejects = handlers().get(event.type, (None, False))
    if handler is None:
        event.accept()
    started = time.time()
    try:
        config = load_config(pbs.hook_config_filename)
        reason = not_installed(config) if event.type in mom_events() else None
        if reason is not None:
            handler = on_not_installed
            on_not_installed(event, config, reason)
        else:
            handler(event, config)
    except HookError as e:
        fail(event, rejects, str(e))
    except Exception as e:   # a bug here: say so in words, the traceback goes to the log
        pbs.logmsg(pbs.EVENT_ERROR, "%s: %s" % (HOOK, traceback.format_exc()))
        fail(event, rejects, "internal error (%s: %s); the traceback is in the PBS log" % (type(e).__name__, e))
    pbs.logmsg(pbs.EVENT_DEBUG, "%s: %s done in %.1f ms" % (HOOK, handler.__name__, (time.time() - started) * 1000))
    event.accept()


def fail(event, rejects, message):
    """Logs `message` and, for events where that means something, rejects with it."""
    job = getattr(event, "job", None)
    where = " (job %s)" % job.id if job is not None and getattr(job, "id", None) else ""
    pbs.logmsg(pbs.EVENT_ERROR, "%s%s: %s" % (HOOK, where, message))
    if rejects:
        event.reject("%s: %s" % (HOOK, message))


# PBS runs hook code in globals that have no __name__ of their own, so the name seen here is
# the builtins module's: 'builtins' under Python 3 (observed on OpenPBS 23.06 with Python 3.11),
# '__builtin__' under Python 2 PBS versions; OpenPBS's own pbs_cgroups hook tests both. The tests
# import this file under another name to reach the functions above without running it.
if __name__ in ("builtins", "__builtin__"):
    main()
