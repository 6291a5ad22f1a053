"""topo's PBS hook (packaging/pbs/topo.py) through whole job lives, against a real topod.

Each event runs the hook in a fresh interpreter with the stand-in `pbs` module (pbs.py here),
as pbs_python does. topod is the real binary (target/debug, or $TOPO_BIN_DIR), with its own
socket, state directory and, on real cgroups, its own subtree "topo-pbs-test-<pid>", so that
nothing collides with other tests on the machine. Real cgroups (v1 cpuset, memory, freezer)
are used when this runs as root on a host that has the v1 cpuset hierarchy; otherwise topod's
in-memory backend on an emulated 2-socket, 2-NUMA-node machine, and the tests that need the
kernel say SKIPPED.

Run: tests/pbs-hooks.sh (builds topod first), or python3 -m unittest discover -s tests/pbs -v
"""

import ast
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HOOK = os.path.join(REPO, "packaging", "pbs", "topo.py")
SCHEMA = os.path.join(REPO, "packaging", "protocol.schema.json")
BIN = os.environ.get("TOPO_BIN_DIR", os.path.join(REPO, "target", "debug"))
SHARED = os.environ.get("TOPO_SHARED_DIR", os.path.join(os.path.dirname(REPO), "shared"))
EMULATED = os.path.join(SHARED, "topologies", "converted-hwloc2.9", "32intel64-2p8co2t+8ve.xml")
# Six GPUs, three in each of two NUMA nodes (node 0: PUs 0-15, node 8: PUs 88-103).
WITH_GPUS = os.path.join(SHARED, "topologies", "converted-hwloc2.9", "nvidiagpunumanodes.xml")
HOST = "node1"
SUBTREE = "topo-pbs-test-%d" % os.getpid()


def cpu_count(cpu_list):
    """How many CPUs a kernel CPU list ("0-1,4") names."""
    count = 0
    for part in filter(None, cpu_list.split(",")):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def read(path):
    """The text of a file, closed again."""
    with open(path) as f:
        return f.read()


def v1_mounts():
    """{controller: mount point} of the cgroup v1 hierarchies topod uses."""
    found = {}
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup":
                for controller in ("cpuset", "memory", "freezer", "cpu"):
                    if controller in fields[3].split(","):
                        found.setdefault(controller, fields[1])
    return found


REAL = os.geteuid() == 0 and "cpuset" in v1_mounts()


def load_hook_module():
    """topo.py as a module (its main() runs only where __name__ is the builtins module's, as
    under PBS)."""
    spec = importlib.util.spec_from_file_location("topo_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def remove_subtree():
    """Kills what is left in our test subtree and removes it, in every v1 hierarchy."""
    for mount in v1_mounts().values():
        root = os.path.join(mount, SUBTREE)
        if not os.path.isdir(root):
            continue
        for entry in os.listdir(root):
            job_dir = os.path.join(root, entry)
            if os.path.isdir(job_dir):
                for pid in read(os.path.join(job_dir, "cgroup.procs")).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.05)
                try:
                    os.rmdir(job_dir)
                except OSError:
                    pass
        try:
            os.rmdir(root)
        except OSError:
            pass


class Topod(object):
    """A topod process of this test, stopped by stop() (by its pid, never by name)."""

    def __init__(self, directory):
        self.directory = directory
        self.socket = os.path.join(directory, "topod.sock")
        self.process = None

    def start(self, extra="", topology=None):
        """Starts topod; `extra`: more lines for its topod.toml; `topology`: a machine of its own
        (then on topod's in-memory backend, real cgroups or not)."""
        config = os.path.join(self.directory, "topod.toml")
        with open(config, "w") as f:
            f.write(extra)
            if topology is not None:
                f.write('cgroup = "fake"\ntopology = "%s"\nadmin_uids = [%d]\n' % (topology, os.getuid()))
            elif REAL:
                f.write('cgroup = "v1"\ncgroup_subtree = "%s"\n' % SUBTREE)
            else:
                # MoM runs hooks as root; an unprivileged test run is topod's administrator.
                f.write('cgroup = "fake"\ntopology = "%s"\nadmin_uids = [%d]\n' % (EMULATED, os.getuid()))
        state = os.path.join(self.directory, "state")
        os.makedirs(state, exist_ok=True)
        self.log = open(os.path.join(self.directory, "topod.log"), "ab")
        command = [os.path.join(BIN, "topod"), "--socket", self.socket, "--state-dir", state, "--config", config]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=self.log)
        deadline = time.time() + 20
        while not self._answers():
            if self.process.poll() is not None or time.time() > deadline:
                raise AssertionError("topod did not start: %s" % read(os.path.join(self.directory, "topod.log")))
            time.sleep(0.02)

    def _answers(self):
        try:
            self.call("version")
            return True
        except OSError:
            return False

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None

    def call(self, op, **fields):
        """One request; the reply object ({"ok": ...} or {"error": ...})."""
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(20)
        try:
            s.connect(self.socket)
            s.sendall((json.dumps(dict(fields, v=1, op=op)) + "\n").encode())
            return json.loads(s.makefile("rb").readline().decode())
        finally:
            s.close()

    def jobs(self):
        return sorted(a["job"] for a in self.call("list")["ok"])


def mom_job(job_id, ncpus=1, mem="262144kb", topology=None, in_select=False, vnode=HOST, ngpus=None):
    """A job as a MoM sees it (observed on OpenPBS: custom resources only in schedselect, unless
    the resource has flag m and was asked job-wide; a host-level consumable one, as ngpus with
    flag nh, in exec_vnode too)."""
    select = "1:ncpus=%d:mem=%s" % (ncpus, mem)
    resources = {"ncpus": ncpus, "mem": mem}
    gpus = "" if ngpus is None else ":ngpus=%d" % ngpus
    select += gpus
    if topology is not None and in_select:
        select += ":topology=%s" % topology
    elif topology is not None:
        resources["topology"] = topology
    return {"id": job_id, "schedselect": select, "exec_vnode": "(%s:ncpus=%d:mem=%s%s)" % (vnode, ncpus, mem, gpus),
            "Resource_List": resources, "euser": "root"}


@unittest.skipUnless(os.path.exists(os.path.join(BIN, "topod")), "topod not built in %s (tests/pbs-hooks.sh builds it)" % BIN)
class HookTestCase(unittest.TestCase):
    """A fresh topod and hook configuration per test."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="topo-pbs-test-")
        self.topod = Topod(self.dir)
        self.topod.start()
        self.addCleanup(self._clean)
        self.config = os.path.join(self.dir, "topo.json")
        self.write_config()
        self.events = 0

    def _clean(self):
        self.topod.stop()
        if REAL:
            remove_subtree()
        shutil.rmtree(self.dir, ignore_errors=True)

    def write_config(self, **overrides):
        config = {"socket": self.topod.socket, "topoctl": os.path.join(BIN, "topoctl"),
                  "topo_exec": os.path.join(BIN, "topo-exec"), "state_dir": os.path.join(self.dir, "hook-state"),
                  "timeout_seconds": 10, "protocol_schema": SCHEMA}
        config.update(overrides)
        with open(self.config, "w") as f:
            json.dump(config, f)

    def event_file(self, name, **fields):
        self.events += 1
        description = dict(fields, event=name, host=HOST, hook_config_filename=self.config)
        path = os.path.join(self.dir, "event-%d.json" % self.events)
        with open(path, "w") as f:
            json.dump(description, f)
        return path, os.path.join(self.dir, "result-%d.json" % self.events)

    def run_event(self, name, **fields):
        """Runs the hook for one event; the result (outcome, message, vnodes, log, ...)."""
        event, result = self.event_file(name, **fields)
        subprocess.check_call([sys.executable, os.path.join(HERE, "run_hook.py"), HOOK, event, result])
        with open(result) as f:
            out = json.load(f)
        self.assertNotEqual(out["outcome"], "exception", "the hook crashed:\n%s" % out["message"])
        return out

    def assert_accepted(self, result):
        self.assertEqual(result["outcome"], "accept", "%s\n%s" % (result["message"], result["log"]))

    def assert_rejected(self, result, *words):
        self.assertEqual(result["outcome"], "reject", result["log"])
        for word in words:
            self.assertIn(word, result["message"])

    def periodic(self, running=(), vnodes=None):
        return self.run_event("exechost_periodic", job_list=list(running), vnode_list=vnodes or {HOST: {}})

    def launch(self, job, script, env=None):
        """Starts the job's program through execjob_launch, as MoM does; returns the process
        and the hook's result once the program runs. `env`: more of the job's environment."""
        env = dict(env or {}, PATH="/usr/bin:/bin", PBS_JOBID=job["id"])
        event, result = self.event_file("execjob_launch", job=dict(job, session_id=0), progname="/bin/sh",
                                        argv=["/bin/sh", "-c", script], env=env, vnode_list={HOST: {}})
        # The job's output goes to a file: a process it leaves behind must not hold the test
        # runner's stdout open.
        with open(os.path.join(self.dir, "job-stdio-%d" % self.events), "wb") as stdio:
            process = subprocess.Popen([sys.executable, os.path.join(HERE, "launcher.py"), HOOK, event, result],
                                       stdin=subprocess.DEVNULL, stdout=stdio, stderr=stdio)
        self.addCleanup(stop_child, process)
        deadline = time.time() + 20
        while not os.path.exists(result):
            if time.time() > deadline or process.poll() is not None:
                raise AssertionError("the launch hook wrote no result (launcher exit status %s)" % process.poll())
            time.sleep(0.02)
        with open(result) as f:
            return process, json.load(f)


def wait_for_lines(path, count, process):
    deadline = time.time() + 20
    while time.time() < deadline:
        if os.path.exists(path):
            lines = read(path).splitlines()
            if len(lines) >= count:
                return lines
        if process.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError("the job did not write %d lines to %s (exit status %s)" % (count, path, process.poll()))


def cpuset_cgroup_of(pid):
    """The cpuset cgroup path of a process (v1), e.g. /topo-pbs-test-1/pbs-1.server."""
    with open("/proc/%d/cgroup" % pid) as f:
        for line in f:
            hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpuset" in controllers.split(","):
                return path
    return None


def stop_child(process):
    """Test clean-up after a failed assertion: a process this test started must not outlive it
    (Popen sends nothing once the child is reaped, so a reused pid is never hit)."""
    if process.poll() is None:
        process.kill()
        process.wait()


def kill_if_still(pid, command):
    """Kills `pid` if it is still the process this test started (its command line is `command`)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            if f.read().split(b"\0")[:len(command)] == [c.encode() for c in command]:
                os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


class SubmitTest(HookTestCase):
    def topoctl_check_message(self, request):
        """The last line `topoctl check` prints for a bad request: the message a user must see."""
        done = subprocess.run([os.path.join(BIN, "topoctl"), "check", request], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.assertEqual(done.returncode, 2)
        return done.stderr.decode().strip().splitlines()[-1]

    def test_a_bad_request_is_refused_with_topoctls_message(self):
        for bad in ["affinity[cores(2)]", "affinity[core(2,same=numa)*4:membind=nowhere]", "CPUSET[MAX_RADIUS=x]", "affinity[core(2)"]:
            expected = self.topoctl_check_message(bad)
            queued = self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": bad}})
            self.assert_rejected(queued, expected, "topology=" + bad)
            in_select = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "2:ncpus=4:topology=%s+1:ncpus=1" % bad}})
            self.assert_rejected(in_select, expected)
            altered = self.run_event("modifyjob", job={"id": "7.server", "Resource_List": {"topology": bad}}, job_o={"id": "7.server"})
            self.assert_rejected(altered, expected)

    def test_good_requests_and_jobs_without_one_are_accepted(self):
        for good in ["affinity[core(2,same=numa)*4:membind=localonly]", "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]", '"affinity[thread*2]"']:
            self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": good}}))
        self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=2:topology=affinity[core(1):membind=localonly]"}}))
        self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"walltime": "1:00:00"}}))
        # A request that starts with "-" is a request, not an option of topoctl.
        self.assert_rejected(self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": "--help"}}), "refused: at byte 0")

    def test_a_request_for_gpus_needs_gpus_asked_of_pbs(self):
        # PBS counts a host's GPUs (ngpus); topod chooses which. gpus= without ngpus would let
        # topod give GPUs PBS did not count, and PBS give them to another job.
        for request in ["affinity[core(2)*2:gpus=1]", "affinity[thread:gpus=2]"]:
            said = ("topology=" + request + " refused: gpus=", "asks PBS for none", "ngpus=G")
            queued = self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": request}})
            self.assert_rejected(queued, *said)
            in_select = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=4:topology=%s" % request}})
            self.assert_rejected(in_select, *said)
            altered = self.run_event("modifyjob", job={"id": "7.server", "Resource_List": {"topology": request}}, job_o={"id": "7.server"})
            self.assert_rejected(altered, *said)
            # With GPUs asked of PBS, in the request's chunk or job-wide, it goes through.
            self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=4:ngpus=2:topology=%s" % request}}))
            self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": request, "ngpus": 2}}))
            # GPUs asked in another chunk are not this request's.
            other = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=4:topology=%s+1:ncpus=1:ngpus=1" % request}})
            self.assert_rejected(other, *said)
        # A request without gpus= goes through with or without GPUs.
        self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=2:ngpus=1:topology=affinity[core(2)]"}}))
        # A site that turned GPUs off (gpus_resource "") refuses gpus= as before.
        self.write_config(gpus_resource="")
        off = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=4:ngpus=2:topology=affinity[thread:gpus=2]"}})
        self.assert_rejected(off, "gpus_resource is empty", "leave gpus= out")

    def test_gpus_asked_of_pbs_must_be_what_the_request_takes_on_each_host(self):
        # Attack findings: each was accepted at qsub and refused at every start (PBS tries ~20
        # times, then holds the job).
        cases = [
            # 2 tasks x gpus=1 on a host, 1 asked of PBS there.
            ({"select": "1:ncpus=4:ngpus=1", "topology": "affinity[core*2:gpus=1]"},
             ["takes gpus=1 for 2 task(s) on a host, 2 GPU(s)", "chunk 1 of -l select (ncpus=4:ngpus=1)", "ask for ngpus=2"]),
            # A job-wide request applies on every chunk's host; chunk 2 asks for no GPUs.
            ({"select": "1:ncpus=4:ngpus=1+1:ncpus=4", "topology": "affinity[core:gpus=1]"},
             ["chunk 2 of -l select (ncpus=4)", "ngpus=0"]),
            # A count PBS would not give.
            ({"select": "1:ncpus=4:ngpus=-1", "topology": "affinity[core:gpus=1]"}, ["ngpus in -l select '-1'", "0 or more"]),
            ({"ncpus": 4, "ngpus": -3, "topology": "affinity[core:gpus=1]"}, ["-l ngpus '-3'"]),
            # GPUs do not resize: refused by the parser, where it is written.
            ({"select": "1:ncpus=4:ngpus=1", "topology": "affinity[thread*1-2:gpus=1]"}, ["gpus=1 with a task range (*1-2)"]),
            # No gpus=, but GPUs that are no whole number per task: topod could not choose them.
            ({"select": "1:ncpus=4:ngpus=1", "topology": "affinity[core*2]"},
             ["ngpus=1 for 2 task(s), no whole number of GPUs per task", "a multiple of 2"]),
            ({"select": "1:ncpus=4:mpiprocs=2:ngpus=3", "topology": "affinity[core]"}, ["ngpus=3 for 2 task(s)"]),
        ]
        for resources, said in cases:
            self.assert_rejected(self.run_event("queuejob", job={"id": "", "Resource_List": resources}), *said)
        # What each host gets right goes through: per chunk, by mpiprocs, job-wide.
        for resources in [{"select": "1:ncpus=4:ngpus=2", "topology": "affinity[core*2:gpus=1]"},
                          {"select": "2:ncpus=4:ngpus=1", "topology": "affinity[core:gpus=1]"},
                          {"select": "1:ncpus=4:mpiprocs=2:ngpus=2", "topology": "affinity[core:gpus=1]"},
                          {"select": "1:ncpus=4:ngpus=2", "topology": "affinity[core*2]"},
                          {"select": "1:ncpus=4:ngpus=1+1:ncpus=1:topology=affinity[thread]", "topology": None},
                          {"ncpus": 4, "ngpus": 2, "topology": "affinity[core*2:gpus=1]"}]:
            resources = dict((k, v) for k, v in resources.items() if v is not None)
            self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": resources}))
        # qalter of select alone: PBS's job-wide sum of the old select (job_o) is not read.
        old = {"select": "1:ncpus=4:ngpus=2", "ngpus": 2, "ncpus": 4, "topology": "affinity[core:gpus=2]"}
        altered = self.run_event("modifyjob", job={"id": "7.server", "Resource_List": {"select": "1:ncpus=4"}},
                                 job_o={"id": "7.server", "Resource_List": old})
        self.assert_rejected(altered, "asks PBS for none")
        kept = self.run_event("modifyjob", job={"id": "7.server", "Resource_List": {"walltime": "2:00:00"}},
                              job_o={"id": "7.server", "Resource_List": old})
        self.assert_accepted(kept)

    def test_a_server_without_ngpus_or_topology_defined_loses_no_job(self):
        # Reading a resource the server does not define raises AttributeError in PBS (the first
        # real run of the GPU hook crashed every qsub so, before `qmgr create resource ngpus`).
        for missing in (["ngpus"], ["ngpus", "topology"]):
            plain = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=2"}},
                                   undefined_resources=missing)
            self.assert_accepted(plain)
            altered = self.run_event("modifyjob", job={"id": "7.server", "Resource_List": {"walltime": "1:00:00"}},
                                     job_o={"id": "7.server"}, undefined_resources=missing)
            self.assert_accepted(altered)
        # A request without gpus= goes through; gpus= is refused saying what the administrator does.
        self.assert_accepted(self.run_event("queuejob", job={"id": "", "Resource_List": {"topology": "affinity[core(2)]"}},
                                            undefined_resources=["ngpus"]))
        refused = self.run_event("queuejob", job={"id": "", "Resource_List": {"select": "1:ncpus=4:topology=affinity[thread:gpus=1]"}},
                                 undefined_resources=["ngpus"])
        self.assert_rejected(refused, "gpus=1 asks topod to choose", "defines no resource ngpus",
                             'create resource ngpus type=long,flag=nh', "resources_available.ngpus")


class JobLifeTest(HookTestCase):
    def test_a_whole_job_life_stays_in_its_cgroup_and_leaves_nothing(self):
        job = mom_job("123.pbs-server.example", ncpus=1, topology="affinity[thread*1]")
        jid = "pbs-123.pbs-server.example"
        begun = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_accepted(begun)
        allocation = self.topod.call("list")["ok"]
        self.assertEqual([a["job"] for a in allocation], [jid])
        cpus = allocation[0]["cpus"]
        self.assertEqual(len(load_hook_module().cpu_set(cpus)), 1)
        job_dir = os.path.join(v1_mounts().get("cpuset", "/nonexistent"), SUBTREE, jid)
        if REAL:
            self.assertEqual(read(os.path.join(job_dir, "cpuset.cpus")).strip(), cpus)
            memory_dir = os.path.join(v1_mounts()["memory"], SUBTREE, jid)
            self.assertEqual(int(read(os.path.join(memory_dir, "memory.limit_in_bytes"))), 262144 * 1024)

        # The job: reports what it got, leaves a process in a session of its own (as a daemon
        # started by a job does), and ends normally when the test says so.
        out, go = os.path.join(self.dir, "job.out"), os.path.join(self.dir, "go")
        script = ("exec > %s; echo $TOPO_CPUS; echo $TOPO_MEMS; echo $TOPO_JOB; grep Cpus_allowed_list /proc/self/status; "
                  "setsid sleep 300 & echo $!; n=0; while [ ! -e %s ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done" % (out, go))
        shell, launched = self.launch(job, script)
        self.assertEqual(launched["outcome"], "accept", launched)
        lines = wait_for_lines(out, 5, shell)
        self.assertEqual(lines[:3], [cpus, allocation[0]["mems"], jid])
        escaped = int(lines[4])
        self.addCleanup(kill_if_still, escaped, ["sleep", "300"])
        attached = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)   # an MPI rank started by pbs_attach
        self.addCleanup(stop_child, attached)
        self.assert_accepted(self.run_event("execjob_attach", job=job, pid=attached.pid, vnode_list={HOST: {}}))
        if REAL:
            self.assertEqual(lines[3].split(":")[1].strip(), cpus, "the job runs on the CPUs topod gave it")
            for pid in (shell.pid, escaped, attached.pid):
                self.assertEqual(cpuset_cgroup_of(pid), "/%s/%s" % (SUBTREE, jid), "process %d" % pid)
        open(go, "w").close()
        self.assertEqual(shell.wait(20), 0, "the job shell ends normally")
        self.assertTrue(alive(escaped), "its daemon outlives the job shell, as it would under PBS")
        if REAL:
            procs = read(os.path.join(job_dir, "cgroup.procs")).split()
            self.assertEqual(sorted(procs), sorted(str(p) for p in (escaped, attached.pid)), "what is left is in the job's cgroup")
        else:
            print("SKIPPED (not root or no v1 cpuset): the kernel-side checks of the job's cgroup", file=sys.stderr)
            for pid in (escaped, attached.pid):   # the in-memory backend kills nothing
                os.kill(pid, signal.SIGKILL)

        self.assert_accepted(self.run_event("execjob_epilogue", job=job, vnode_list={HOST: {}}))
        self.assertEqual(self.topod.jobs(), [])
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        attached.wait(10)
        deadline = time.time() + 10
        while alive(escaped) and time.time() < deadline:
            time.sleep(0.05)
        self.assertFalse(alive(escaped), "release killed what the job left")
        if REAL:
            self.assertFalse(os.path.exists(job_dir), "no cgroup left")
            for mount in v1_mounts().values():
                self.assertEqual([d for d in os.listdir(os.path.join(mount, SUBTREE)) if os.path.isdir(os.path.join(mount, SUBTREE, d))], [], mount)

    def test_every_task_launched_through_tm_joins_too(self):
        """execjob_launch fires again for each task started through TM (pbsdsh), observed on
        OpenPBS: each one's launching process joins the job's cgroup."""
        job = mom_job("64.server", ncpus=1)
        jid = "pbs-64.server"
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        tasks = []
        for n in range(2):
            out = os.path.join(self.dir, "task-%d.out" % n)
            task, launched = self.launch(job, "echo $TOPO_JOB > %s; exec sleep 300" % out)
            self.assertEqual(launched["outcome"], "accept", launched)
            self.assertEqual(wait_for_lines(out, 1, task), [jid])
            tasks.append(task)
        if REAL:
            for task in tasks:
                self.assertEqual(cpuset_cgroup_of(task.pid), "/%s/%s" % (SUBTREE, jid))
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        if REAL:
            for task in tasks:
                self.assertEqual(task.wait(10), -signal.SIGKILL, "release killed the task")

    def test_begin_gives_topod_the_queue_and_the_pool_the_job_names(self):
        # Prime-time pools admit by queue, and a job may name one with qsub -v TOPO_POOL=...
        job = dict(mom_job("124.pbs-server.example", ncpus=1, topology="affinity[thread*1]"),
                   queue="workq", Variable_List={"TOPO_POOL": "day", "PATH": "/bin"})
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        plain = mom_job("125.pbs-server.example", ncpus=1)
        self.assert_accepted(self.run_event("execjob_begin", job=plain, vnode_list={HOST: {}}))
        listed = {a["job"]: a for a in self.topod.call("list")["ok"]}
        named = listed["pbs-124.pbs-server.example"]
        self.assertEqual((named.get("queue"), named.get("pool")), ("workq", "day"))
        unnamed = listed["pbs-125.pbs-server.example"]
        self.assertEqual((unnamed.get("queue"), unnamed.get("pool")), (None, None))
        for j in (job, plain):
            self.assert_accepted(self.run_event("execjob_end", job=j, vnode_list={HOST: {}}))
        self.assertEqual(self.topod.jobs(), [])

    def test_end_alone_or_epilogue_alone_releases(self):
        for only in ("execjob_end", "execjob_epilogue"):
            job = mom_job("55.server", ncpus=1)
            self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
            self.assertEqual(self.topod.jobs(), ["pbs-55.server"])
            self.assert_accepted(self.run_event(only, job=job, vnode_list={HOST: {}}))
            self.assertEqual(self.topod.jobs(), [], only)

    def test_suspension_freezes_the_job_and_resume_waits_for_its_cpus(self):
        """qsig -s suspend then resume, as the MoM runs the hooks: postsuspend freezes through
        topod, preresume thaws, and is rejected (PBS keeps the job suspended) while another
        job runs on the suspended job's CPUs."""
        job = mom_job("57.server", ncpus=2)
        jid = "pbs-57.server"
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        self.assert_accepted(self.run_event("execjob_postsuspend", job=job, vnode_list={HOST: {}}))
        states = dict((a["job"], a["state"]) for a in self.topod.call("list")["ok"])
        self.assertEqual(states[jid], "suspended")
        # Suspended twice (PBS retries): accepted, nothing changes.
        self.assert_accepted(self.run_event("execjob_postsuspend", job=job, vnode_list={HOST: {}}))
        cpus = [a["cpus"] for a in self.topod.call("list")["ok"] if a["job"] == jid][0]
        # Another job placed on exactly those CPUs while the first is suspended.
        other = self.topod.call("allocate", job="other-1", request="CPUSET[CPU_LIST=%s]" % cpus)
        self.assertIn("ok", other, other)
        result = self.run_event("execjob_preresume", job=job, vnode_list={HOST: {}})
        self.assert_rejected(result, "lent to job other-1")
        self.topod.call("release", job="other-1")
        self.assert_accepted(self.run_event("execjob_preresume", job=job, vnode_list={HOST: {}}))
        states = dict((a["job"], a["state"]) for a in self.topod.call("list")["ok"])
        self.assertEqual(states[jid], "running")
        # A job topod does not hold (not placed by topo here): both events pass.
        stranger = mom_job("58.server", ncpus=1)
        self.assert_accepted(self.run_event("execjob_postsuspend", job=stranger, vnode_list={HOST: {}}))
        self.assert_accepted(self.run_event("execjob_preresume", job=stranger, vnode_list={HOST: {}}))
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))

    def test_topo_exec_launch_joins_as_the_job_does(self):
        self.write_config(launch="topo-exec")
        job = mom_job("56.server", ncpus=1)
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        out = os.path.join(self.dir, "job.out")
        shell, launched = self.launch(job, "echo $TOPO_CPUS > %s; grep Cpus_allowed_list /proc/self/status >> %s" % (out, out))
        self.assertEqual(launched["argv"][:6], [os.path.join(BIN, "topo-exec"), "--socket", self.topod.socket, "--job", "pbs-56.server", "--"])
        self.assertEqual(launched["argv"][6:], ["/bin/sh", "-c", launched["argv"][8]])
        self.assertEqual(shell.wait(20), 0)
        lines = read(out).splitlines()
        cpus = self.topod.call("list")["ok"][0]["cpus"]
        self.assertEqual(lines[0], cpus)
        if REAL:
            self.assertEqual(lines[1].split(":")[1].strip(), cpus)
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        self.assertEqual(self.topod.jobs(), [])

    def test_a_request_larger_than_ncpus_or_a_bad_job_id_is_refused_and_holds_nothing(self):
        if REAL:
            too_big = mom_job("57.server", ncpus=1, topology="affinity[thread*2]")
        else:
            too_big = mom_job("57.server", ncpus=2, topology="affinity[core(2)]")
        result = self.run_event("execjob_begin", job=too_big, vnode_list={HOST: {}})
        self.assert_rejected(result, "takes", "asked PBS for ncpus=")
        for bad_id in ["12/../../etc.server", "../x", "7 .server", "x" * 200]:
            result = self.run_event("execjob_begin", job=mom_job(bad_id), vnode_list={HOST: {}})
            self.assert_rejected(result, "cannot name a topod job")
        self.assertEqual(self.topod.jobs(), [])

    def test_a_request_for_gpus_without_gpus_from_pbs_is_refused_at_the_start_too_and_holds_nothing(self):
        # A job queued before the hook was installed, or a default_request that asks for GPUs.
        refused = self.run_event("execjob_begin", job=mom_job("61.server", ncpus=2, topology="affinity[thread:gpus=1]"),
                                 vnode_list={HOST: {}})
        self.assert_rejected(refused, "topology=affinity[thread:gpus=1] takes gpus=1 for 1 task(s)", "asked PBS for ngpus=0")
        self.write_config(default_request="affinity[thread:gpus=1]")
        refused = self.run_event("execjob_begin", job=mom_job("62.server", ncpus=1), vnode_list={HOST: {}})
        self.assert_rejected(refused, "gpus=1", "ngpus=0")
        self.assertEqual(self.topod.jobs(), [])
        # In any case, as the parser reads it, job-wide or in a select chunk (an attack finding:
        # GPUS= was given GPUs at the start).
        for jid, job in [("64.server", mom_job("64.server", ncpus=2, topology="affinity[thread:GPUS=1]")),
                         ("65.server", mom_job("65.server", ncpus=2, topology="AFFINITY[core: Gpus =1]", in_select=True))]:
            refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
            self.assert_rejected(refused, "takes gpus=1", "ngpus=0")
        self.assertEqual(self.topod.jobs(), [])
        # The word alone is no refusal: a request without gpus= starts, also where topoctl
        # cannot run (it is not asked).
        self.write_config(topoctl=os.path.join(self.dir, "no-topoctl"))
        for jid, request in [("63.server", "affinity[thread:gpubind=any]"),
                             ("66.server", "CPUSET[CPUSET_NAME=mygpus] affinity[thread]")]:
            started = mom_job(jid, ncpus=1, topology=request)
            self.assert_accepted(self.run_event("execjob_begin", job=started, vnode_list={HOST: {}}))
            self.topod.call("release", job="pbs-" + jid)

    def test_a_job_starts_on_a_server_without_ngpus_defined(self):
        # The MoM's view of the job, with and without exec_vnode (then Resource_List counts).
        for jid, job in [("67.server", mom_job("67.server", ncpus=2, topology="affinity[thread]")),
                         ("68.server", dict(mom_job("68.server", ncpus=2, topology="affinity[thread]"), exec_vnode=None))]:
            started = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}, undefined_resources=["ngpus"])
            self.assert_accepted(started)
            self.assertIn("pbs-" + jid, self.topod.jobs())
            self.topod.call("release", job="pbs-" + jid)

    def test_topods_gang_rows_never_slice_a_pbs_job(self):
        # PBS would count the frozen time against the job's walltime.
        self.topod.stop()
        self.topod.start("gang_rows = 2\ngang_slice_s = 1\ngang_all_jobs = true\n")
        job = mom_job("60.server", ncpus=1, topology="affinity[thread*1]")
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        got = {a["job"]: a for a in self.topod.call("list")["ok"]}["pbs-60.server"]
        self.assertNotIn("gang_row", got)
        self.topod.call("release", job="pbs-60.server")

    def test_a_malleable_request_starts_shrunk_to_its_ncpus(self):
        job = mom_job("58.server", ncpus=1, topology="affinity[thread*1-2]")
        result = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_accepted(result)
        got = {a["job"]: a for a in self.topod.call("list")["ok"]}["pbs-58.server"]
        self.assertEqual((len(got["tasks"]), got["cpus"]), (1, got["tasks"][0]), got)
        self.assertTrue(any("malleable, 1 task(s) on 1 CPU(s) to fit ncpus=1" in line for _, line in result["log"]),
                        result["log"])
        self.topod.call("release", job="pbs-58.server")
        # Its least does not fit ncpus: refused as any request that takes more, nothing held.
        too_big = mom_job("59.server", ncpus=1, topology="affinity[thread*2-3]")
        self.assert_rejected(self.run_event("execjob_begin", job=too_big, vnode_list={HOST: {}}),
                             "takes", "asked PBS for ncpus=")
        self.assertEqual(self.topod.jobs(), [])

    def test_an_unexpected_error_is_a_sentence_and_the_traceback_goes_to_the_log(self):
        # A value PBS would not give: handled, with the value named.
        job = dict(mom_job("63.server"), exec_vnode="(node1:ncpus=two:mem=1gb)")
        result = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_rejected(result, "cannot read ncpus of node1 'two'")
        # One the hook does not expect at all (an attach with no process id): a sentence.
        result = self.run_event("execjob_attach", job=mom_job("63.server"), pid="not-a-pid")
        self.assert_rejected(result, "topo hook: internal error (ValueError: ", "the traceback is in the PBS log")
        self.assertNotIn("Traceback", result["message"])
        self.assertTrue(any("Traceback" in line for _, line in result["log"]), result["log"])

    def test_without_a_request_a_job_gets_its_ncpus_or_is_left_alone(self):
        self.assert_accepted(self.run_event("execjob_begin", job=mom_job("58.server", ncpus=1), vnode_list={HOST: {}}))
        self.assertEqual(self.topod.call("list")["ok"][0]["request"], "affinity[thread*1]")
        self.assert_accepted(self.run_event("execjob_end", job=mom_job("58.server"), vnode_list={HOST: {}}))
        self.write_config(default_request="")
        job = mom_job("59.server", ncpus=1)
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        self.assertEqual(self.topod.jobs(), [])
        shell, launched = self.launch(job, "true")
        self.assertEqual(launched["outcome"], "accept")
        self.assertEqual(shell.wait(20), 0)


class GpuTest(HookTestCase):
    """Issue 33 under PBS: PBS counts a host's GPUs (ngpus), topod chooses which, beside the
    job's CPUs, on a machine of six GPUs in two NUMA nodes."""

    def setUp(self):
        HookTestCase.setUp(self)
        self.topod.stop()
        self.topod.start(topology=WITH_GPUS)
        self.write_config(default_request="affinity[thread]")

    def allocation(self, jid):
        return {a["job"]: a for a in self.topod.call("list")["ok"]}.get("pbs-" + jid)

    def test_vnode_per_numa_node_gives_each_vnode_its_nodes_gpus_and_a_job_there_gets_them(self):
        gpus_by_node = {}
        for d in self.topod.call("topology")["ok"]["devices"]:
            if d.get("class") == "gpu":
                gpus_by_node.setdefault(d["numa_node"], set()).add(d["pci_address"])
        self.write_config(default_request="affinity[thread]", vnode_per_numa_node=True)
        started = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ncpus": 32, "ngpus": 6}}})
        self.assert_accepted(started)
        vnodes = started["vnode_list"]
        per_vnode = dict((name, vnodes[name]["resources_available"].get("ngpus")) for name in vnodes)
        self.assertEqual(per_vnode, dict([(HOST, 0)] + [("%s[%d]" % (HOST, n), len(g)) for n, g in gpus_by_node.items()]))
        self.assertTrue(any("ngpus per vnode: " in line for _, line in started["log"]), started["log"])
        # PBS gives a chunk ncpus and ngpus of the second NUMA node's vnode (node 8 on this
        # POWER machine): its GPUs and CPUs are that node's.
        second = max(gpus_by_node)
        job = mom_job("75.server", ncpus=2, ngpus=2, topology="affinity[thread*2:gpus=1]", vnode="%s[%d]" % (HOST, second))
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={"%s[%d]" % (HOST, second): {}}))
        held = self.allocation("75.server")
        self.assertEqual(len(held["gpus"]), 2, held)
        self.assertEqual(set(g["pci_address"] for g in held["gpus"]) - gpus_by_node[second], set(), held)
        node = [n for n in self.topod.call("topology")["ok"]["numa_nodes"] if n["os_index"] == second][0]
        hook = load_hook_module()
        self.assertTrue(hook.cpu_set(held["cpus"]) <= hook.cpu_set(node["cpus"]), held)
        # A chunk PBS spread over two NUMA vnodes (its CPU on the first, a GPU on each) keeps its
        # CPU where PBS counted it, and takes a GPU in each node as PBS counted them (both
        # beside its CPU would leave PBS counting one free on the first node that topod gave).
        first = min(gpus_by_node)
        split = mom_job("76.server", ncpus=1, ngpus=2, topology="affinity[thread:gpus=2]")
        split["exec_vnode"] = "(%s[%d]:ncpus=1:ngpus=1+%s[%d]:ngpus=1)" % (HOST, first, HOST, second)
        self.assert_accepted(self.run_event("execjob_begin", job=split, vnode_list={HOST: {}}))
        node = [n for n in self.topod.call("topology")["ok"]["numa_nodes"] if n["os_index"] == first][0]
        held = self.allocation("76.server")
        self.assertTrue(hook.cpu_set(held["cpus"]) <= hook.cpu_set(node["cpus"]))
        self.assertEqual(sorted(g["numa_node"] for g in held["gpus"]), [first, second], held)
        # The second node's last GPU is 76's now; a job PBS gives it there goes back to the
        # queue, naming the node.
        late = mom_job("78.server", ncpus=1, ngpus=1, topology="affinity[thread:gpus=1]")
        late["exec_vnode"] = "(%s[%d]:ncpus=1:ngpus=1)" % (HOST, second)
        refused = self.run_event("execjob_begin", job=late, vnode_list={HOST: {}})
        self.assert_rejected(refused, "needs 1 GPU(s) but only 0 are free in NUMA node %d" % second, "goes back to the queue")
        self.assertIsNone(self.allocation("78.server"))
        # The MoM restarts while GPU jobs run (75 and 76 hold 4 of the 6): the same counts as on
        # the idle host, the held GPUs counted in their nodes.
        again = self.run_event("exechost_startup", vnode_list={HOST: {}})
        per_vnode = dict((name, again["vnode_list"][name]["resources_available"].get("ngpus")) for name in again["vnode_list"])
        self.assertEqual(per_vnode, dict([(HOST, 0)] + [("%s[%d]" % (HOST, n), len(g)) for n, g in gpus_by_node.items()]))
        # A job outside PBS holding a GPU: PBS would count it as its own to give, so none is
        # set, and the log says why.
        outside = [g for g in gpus_by_node[first] if g not in set(x["pci_address"] for a in self.topod.call("list")["ok"] for x in a.get("gpus") or [])][0]
        self.assertIn("ok", self.topod.call("allocate", job="other-9", request="affinity[thread]", gpus=[outside]))
        again = self.run_event("exechost_startup", vnode_list={HOST: {}})
        self.assertEqual([n for n in again["vnode_list"] if "ngpus" in again["vnode_list"][n]["resources_available"]], [])
        self.assertTrue(any("ngpus per NUMA vnode not published: GPU(s) are held outside PBS now (%s)" % outside in line
                            for _, line in again["log"]), again["log"])
        self.topod.call("release", job="other-9")
        # Without gpus_resource, or one vnode per host, the GPUs' count is the administrator's.
        self.write_config(default_request="affinity[thread]", vnode_per_numa_node=True, gpus_resource="")
        plain = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ngpus": 6}}})
        self.assertEqual(plain["vnode_list"][HOST]["resources_available"].get("ngpus"), 6)
        self.assertNotIn("ngpus", plain["vnode_list"]["%s[%d]" % (HOST, second)]["resources_available"])
        self.write_config(default_request="affinity[thread]")
        plain = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ngpus": 6}}})
        self.assertEqual(plain["vnode_list"][HOST]["resources_available"].get("ngpus"), 6)

    def test_a_chunk_spread_over_two_numa_vnodes_keeps_its_cpus_where_pbs_counted_them(self):
        self.write_config(default_request="affinity[thread]", vnode_per_numa_node=True)
        numa = dict((n["os_index"], n["cpus"]) for n in self.topod.call("topology")["ok"]["numa_nodes"])
        first, second = min(numa), max(numa)
        hook = load_hook_module()
        # A job outside PBS on the second node: best fit would put a one-CPU job beside it.
        cpus = hook.cpu_list(sorted(hook.cpu_set(numa[second]))[:4])
        self.assertIn("ok", self.topod.call("allocate", job="other-1", request="affinity[thread*4]", cpus=cpus))
        # PBS gives the chunk its CPU on the first node's vnode and memory on the second's.
        job = mom_job("77.server", ncpus=1, topology="affinity[thread]")
        job["exec_vnode"] = "(%s[%d]:ncpus=1:mem=1kb+%s[%d]:mem=262143kb)" % (HOST, first, HOST, second)
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        got = hook.cpu_set(self.allocation("77.server")["cpus"])
        self.assertTrue(got <= hook.cpu_set(numa[first]), "CPUs %s, not on the vnode PBS gave them from" % sorted(got))

    def test_gpus_without_a_numa_vnode_leave_the_count_to_the_administrator(self):
        # All CPUs of NUMA node 8 reserved: its GPUs lie in no vnode PBS can give CPUs of, so
        # per-vnode counts would send jobs there that topod refuses: none is set, and the log
        # says why and what to do.
        self.topod.stop()
        self.topod.start(extra='reserved_cpus = "88-103"\n', topology=WITH_GPUS)
        self.write_config(default_request="affinity[thread]", vnode_per_numa_node=True)
        started = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ngpus": 3}}})
        self.assert_accepted(started)
        self.assertEqual(started["vnode_list"][HOST]["resources_available"]["ngpus"], 3)
        self.assertEqual([n for n in started["vnode_list"] if n != HOST
                          and "ngpus" in started["vnode_list"][n]["resources_available"]], [])
        self.assertTrue(any("3 GPU(s) have no NUMA node with CPUs PBS jobs may use" in line and "set them with qmgr" in line
                            for _, line in started["log"]), started["log"])

    def test_topod_chooses_as_many_gpus_as_pbs_counted_beside_the_jobs_cpus(self):
        gpus_by_node = {}
        for d in self.topod.call("topology")["ok"]["devices"]:
            if d.get("class") == "gpu":
                gpus_by_node.setdefault(d["numa_node"], set()).add(d["pci_address"])
        self.assertEqual(sorted(len(g) for g in gpus_by_node.values()), [3, 3], gpus_by_node)
        # No gpus= in the request: PBS's ngpus=2 for its one task becomes gpus=2.
        result = self.run_event("execjob_begin", job=mom_job("70.server", ncpus=4, ngpus=2, topology="affinity[core]"),
                                vnode_list={HOST: {}})
        self.assert_accepted(result)
        self.assertTrue(any("ngpus=2 on %s: topod chooses the GPUs" % HOST in line and "affinity[core:gpus=2]" in line
                            for _, line in result["log"]), result["log"])
        first = self.allocation("70.server")
        given = {g["pci_address"] for g in first["gpus"]}
        self.assertEqual(len(given), 2, first)
        self.assertTrue(any(given <= g for g in gpus_by_node.values()), "%s: not in one NUMA node" % given)
        self.assertTrue(all(g["distance"] == 10 for g in first["gpus"]), first)
        # gpus= said, as many as PBS counted (2 tasks x 1): also chosen by topod, none of the first's.
        result = self.run_event("execjob_begin", job=mom_job("71.server", ncpus=2, ngpus=2, topology="affinity[thread*2:gpus=1]"),
                                vnode_list={HOST: {}})
        self.assert_accepted(result)
        second = self.allocation("71.server")
        self.assertEqual(len(second["gpus"]), 2, second)
        self.assertFalse(given & {g["pci_address"] for g in second["gpus"]}, "one GPU given to two jobs")
        self.assertEqual(len(second["task_gpus"]), 2, second)
        # Launched in join mode, the job is told its GPUs: TOPO_GPUS and each task's (no NVIDIA
        # driver here, so no CUDA_VISIBLE_DEVICES).
        out = os.path.join(self.dir, "gpus.out")
        shell, launched = self.launch(mom_job("71.server", ncpus=2, ngpus=2, topology="affinity[thread*2:gpus=1]"),
                                      'echo "$TOPO_GPUS;$TOPO_TASK_GPUS;${CUDA_VISIBLE_DEVICES-unset}" > %s' % out)
        self.assertEqual(launched["outcome"], "accept", launched)
        self.assertEqual(shell.wait(20), 0)
        told, per_task_a, per_task_b, cuda = read(out).strip().split(";")
        self.assertEqual(sorted(told.split(",")), sorted(g["pci_address"] for g in second["gpus"]))
        self.assertEqual([per_task_a, per_task_b], [",".join(t) for t in second["task_gpus"]])
        self.assertEqual(cuda, "unset")
        # gpus= that is not what PBS counted: refused with both numbers, nothing held.
        refused = self.run_event("execjob_begin", job=mom_job("72.server", ncpus=2, ngpus=1, topology="affinity[thread*2:gpus=1]"),
                                 vnode_list={HOST: {}})
        self.assert_rejected(refused, "gpus=1 for 2 task(s) on %s, 2 GPU(s)" % HOST, "ngpus=1 there", "ask for ngpus=2")
        self.assertIsNone(self.allocation("72.server"))
        # More than are free: the job goes back to the queue with topod's reason, nothing held.
        refused = self.run_event("execjob_begin", job=mom_job("73.server", ncpus=4, ngpus=3, topology="affinity[core]"),
                                 vnode_list={HOST: {}})
        self.assert_rejected(refused, "needs 3 GPU(s) but only 2 are free", "PBS counted ngpus=3", "resources_available.ngpus", "goes back to the queue")
        self.assertIsNone(self.allocation("73.server"))
        for jid in ("70.server", "71.server"):
            self.topod.call("release", job="pbs-" + jid)

    def test_the_default_request_takes_its_gpus_as_fewer_larger_tasks(self):
        # default_request: one task per ncpus; 1 GPU for 2 tasks is no gpus=n. Run unconfined, the
        # job could use GPUs topod then gave another job (an attack finding): it is given as one
        # task of both CPUs with gpus=1 instead, and another job gets none of its GPU.
        result = self.run_event("execjob_begin", job=mom_job("74.server", ncpus=2, ngpus=1), vnode_list={HOST: {}})
        self.assert_accepted(result)
        self.assertTrue(any("ngpus=1 on %s for 2 task(s) of default_request" % HOST in line
                            and "as 1 task(s): affinity[thread(2):gpus=1]" in line for _, line in result["log"]), result["log"])
        first = self.allocation("74.server")
        self.assertEqual(len(first["gpus"]), 1, first)
        self.assertEqual(len(first["tasks"]), 1, first)
        self.assertEqual(cpu_count(first["cpus"]), 2, first)
        # ncpus=4, ngpus=2: two tasks of two CPUs, a GPU each.
        result = self.run_event("execjob_begin", job=mom_job("77.server", ncpus=4, ngpus=2), vnode_list={HOST: {}})
        self.assert_accepted(result)
        second = self.allocation("77.server")
        self.assertEqual((len(second["gpus"]), len(second["tasks"]), len(second["task_gpus"])), (2, 2, 2), second)
        taken = {g["pci_address"] for g in first["gpus"]} | {g["pci_address"] for g in second["gpus"]}
        self.assertEqual(len(taken), 3, "one GPU given to two jobs: %s %s" % (first["gpus"], second["gpus"]))
        # The other 3 GPUs are all another job gets.
        refused = self.run_event("execjob_begin", job=mom_job("78.server", ncpus=4, ngpus=4, topology="affinity[core]"),
                                 vnode_list={HOST: {}})
        self.assert_rejected(refused, "needs 4 GPU(s) but only 3 are free")

    def test_a_default_request_with_options_takes_its_gpus_too(self):
        # Options with parentheses of their own (an attack finding: not regrouped, the job ran
        # with its GPUs unconfined and the log said to add :gpus=n).
        self.write_config(default_request="affinity[thread(1,exclusive=(thread,injob)):distribute=pack(numa=1)]")
        result = self.run_event("execjob_begin", job=mom_job("80.server", ncpus=2, ngpus=1), vnode_list={HOST: {}})
        self.assert_accepted(result)
        self.assertTrue(any("as 1 task(s): affinity[thread(2,exclusive=(thread,injob)):distribute=pack(numa=1):gpus=1]" in line
                            for _, line in result["log"]), result["log"])
        self.assertEqual(len(self.allocation("80.server")["gpus"]), 1)
        # ncpus=0 with a default_request: not confined, and the log says why (it said there was
        # no default_request).
        result = self.run_event("execjob_begin", job=mom_job("81.server", ncpus=0, ngpus=1), vnode_list={HOST: {}})
        self.assert_accepted(result)
        self.assertTrue(any("default_request applies only where the job has CPUs (ncpus=0 here)" in line
                            for _, line in result["log"]), result["log"])

    def test_chunks_pbs_packed_on_one_host_are_told_why_a_count_does_not_fit(self):
        # Each chunk asks what *2 x gpus=1 takes; packed on one host, their GPUs add up.
        job = {"id": "82.server", "schedselect": "1:ncpus=2:ngpus=2+1:ncpus=2:ngpus=2",
               "exec_vnode": "(%s:ncpus=2:ngpus=2)+(%s:ncpus=2:ngpus=2)" % (HOST, HOST),
               "Resource_List": {"ncpus": 4, "topology": "affinity[thread*2:gpus=1]"}, "euser": "root"}
        refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_rejected(refused, "PBS placed 2 chunks here that ask ngpus=4 in all", "place=scatter", "leave *count out")
        self.assertIsNone(self.allocation("82.server"))

    def test_gpus_no_whole_number_per_task_of_a_users_request_start_without_gpus_saying_why(self):
        # qsub refuses these where it sees them; a job queued before the hook still starts.
        for jid, request in [("74.server", "affinity[thread*2]"), ("75.server", "CPUSET[MAX_RADIUS=1]"),
                             ("76.server", "affinity[thread*1-2]")]:
            result = self.run_event("execjob_begin", job=mom_job(jid, ncpus=2, ngpus=1, topology=request), vnode_list={HOST: {}})
            self.assert_accepted(result)
            self.assertTrue(any("topod does not choose or confine the job's GPUs" in line for _, line in result["log"]), result["log"])
            self.assertEqual(self.allocation(jid).get("gpus", []), [])
        self.assertEqual(sorted(self.topod.jobs()), ["pbs-74.server", "pbs-75.server", "pbs-76.server"])

    def test_a_cuda_visible_devices_the_job_inherited_is_never_its_own(self):
        # qsub -V copies the submitter's CUDA_VISIBLE_DEVICES, and an outer job's TOPO_GPUS: they
        # name GPUs the job was not given (an attack finding: join mode left them).
        job = mom_job("79.server", ncpus=2, ngpus=1, topology="affinity[thread]")
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        out = os.path.join(self.dir, "env.out")
        shell, launched = self.launch(job, 'echo "${CUDA_VISIBLE_DEVICES-unset};${TOPO_TASK_GPUS-unset};$TOPO_GPUS" > %s' % out,
                                      env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5", "TOPO_TASK_GPUS": "0000:99:00.0;x"})
        self.assertEqual(launched["outcome"], "accept", launched)
        self.assertEqual(shell.wait(20), 0)
        cuda, tasks, told = read(out).strip().split(";")
        self.assertEqual((cuda, tasks), ("unset", "unset"))
        self.assertEqual(told, self.allocation("79.server")["gpus"][0]["pci_address"])


class HostTest(HookTestCase):
    def test_periodic_sets_the_comment_of_a_job_topod_found_mis_sized(self):
        """topod's sampler flags a job with no process running idle (its CPUs all unused) once
        its settling time (0 here) and three samples have passed; the periodic hook writes the
        reason into the job's comment, once."""
        self.topod.stop()
        self.topod.start(extra="missized_settle_s = 0\nmetrics_interval_s = 1\n")
        job = mom_job("80.server")
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        deadline = time.time() + 20
        while True:
            flags = [a.get("missized") for a in self.topod.call("list")["ok"] if a["job"] == "pbs-80.server"]
            if flags and flags[0]:
                break
            self.assertLess(time.time(), deadline, "topod did not flag the idle job")
            time.sleep(0.25)
        first = self.periodic(running=["80.server"])
        self.assert_accepted(first)
        comment = first["job_list"]["80.server"]["comment"]
        self.assertTrue(comment.startswith("topo: mis-sized (idle): idle: 0.0 threads runnable"), comment)
        self.assertTrue(any("80.server;topo hook: topo: mis-sized" in line for _, line in first["log"]), first["log"])
        # Already said: not again.
        again = self.run_event("exechost_periodic", job_list={"80.server": {"comment": comment}}, vnode_list={HOST: {}})
        self.assertFalse(any("mis-sized" in line for _, line in again["log"]), again["log"])

    def test_periodic_releases_orphans_after_two_runs_and_only_pbs_jobs(self):
        running, orphan = mom_job("60.server"), mom_job("61.server")
        for job in (running, orphan):
            self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        first = self.periodic(running=["60.server"])
        self.assert_accepted(first)
        self.assertEqual(self.topod.jobs(), ["pbs-60.server", "pbs-61.server"], "not after one run: its begin may race")
        second = self.periodic(running=["60.server"])
        self.assert_accepted(second)
        self.assertEqual(self.topod.jobs(), ["pbs-60.server"])
        self.assertTrue(any("released orphan pbs-61.server" in line for _, line in second["log"]), second["log"])
        free_map = self.topod.call("free_map")["ok"]
        free = free_map["free"]
        published = second["vnode_list"][HOST]["resources_available"]
        # ncpus: every allocatable CPU, since the only job topod holds is one PBS runs here.
        self.assertEqual(published, {"topo_free_numa": free["free_numa_nodes"], "topo_free_l3": free["free_l3_groups"],
                                     "topo_free_cores": free["free_cores"], "ncpus": len(load_hook_module().cpu_set(free_map["allocatable"]))})
        self.assertEqual(second["vnode_list"][HOST]["state"], 0, "online")
        # Jobs of other batch systems or of topoctl on the same topod are never touched.
        other = self.topod.call("allocate", job="lsf-4711", request="affinity[thread]")
        self.assertIn("ok", other, other)
        self.periodic(running=["60.server"])
        self.periodic(running=["60.server"])
        self.assertEqual(self.topod.jobs(), ["lsf-4711", "pbs-60.server"])

    def test_cpus_held_outside_pbs_are_taken_off_ncpus_and_a_begin_that_cannot_fit_is_not_retried(self):
        """PBS counts ncpus; topod may hold CPUs PBS does not know about (another batch
        system's job, topoctl, an orphan). The periodic hook publishes what PBS may really use;
        a begin that finds fewer free CPUs than PBS counted publishes it at once and sends the
        job back to wait, rather than letting PBS retry it until it is held."""
        free_map = self.topod.call("free_map")["ok"]
        allocatable = load_hook_module().cpu_set(free_map["allocatable"])
        total = len(allocatable)
        other = self.topod.call("allocate", job="other-1", request="affinity[thread*%d]" % (total - 1))
        self.assertIn("ok", other, other)
        periodic = self.periodic()
        vnode = periodic["vnode_list"][HOST]
        self.assertEqual(vnode["resources_available"]["ncpus"], 1)
        self.assertEqual(vnode["comment"], "topo: %d of %d CPUs held outside PBS (other-1)" % (total - 1, total))
        self.assertTrue(any("ncpus for PBS: %s 1 of %d" % (HOST, total) in line for _, line in periodic["log"]), periodic["log"])
        # A begin that PBS sent before it knew: refused, sent back, and PBS told the truth.
        begun = self.run_event("execjob_begin", job=mom_job("70.server", ncpus=2), vnode_list={HOST: {}})
        self.assert_rejected(begun, "does not fit", "waits in the queue")
        self.assertTrue(begun["rerun"])
        self.assertEqual(begun["vnode_list"][HOST]["resources_available"]["ncpus"], 1)
        self.assertEqual(self.topod.jobs(), ["other-1"])
        # Free again: ncpus back and the comment gone.
        self.topod.call("release", job="other-1")
        freed = self.periodic()["vnode_list"][HOST]
        self.assertEqual(freed["resources_available"]["ncpus"], total)
        self.assertIsNone(freed["comment"])

    def test_a_request_with_ncpus_0_is_refused_and_holds_nothing(self):
        job = mom_job("80.server", ncpus=0, topology="affinity[thread*2]")
        begun = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_rejected(begun, "ncpus=0")
        self.assertEqual(self.topod.jobs(), [])

    def test_an_administrators_comment_is_left_alone(self):
        total = len(load_hook_module().cpu_set(self.topod.call("free_map")["ok"]["allocatable"]))
        self.assertIn("ok", self.topod.call("allocate", job="other-2", request="affinity[thread*%d]" % (total - 1)))
        admin = {HOST: {"comment": "admin: bad DIMM, do not use"}}
        held = self.periodic(vnodes=admin)["vnode_list"][HOST]
        self.assertEqual(held["comment"], "admin: bad DIMM, do not use")
        self.assertEqual(held["resources_available"]["ncpus"], 1)
        self.topod.call("release", job="other-2")
        freed = self.periodic(vnodes=admin)["vnode_list"][HOST]
        self.assertEqual(freed["comment"], "admin: bad DIMM, do not use")
        self.assertEqual(freed["resources_available"]["ncpus"], total)

    def test_another_topo_reason_on_the_vnode_is_not_taken_for_the_held_cpus_comment(self):
        """The site test's CI run found it: the hook had written its "CPUs held outside PBS"
        comment; the vnode was then offlined with another "topo: ..." reason (by hand here,
        as an earlier hook run or an administrator would), and the next run cleared that
        reason as its own, leaving the vnode offline with no word why (and the package's
        removal, which brings back vnodes with a "topo: " comment, could not find it)."""
        total = len(load_hook_module().cpu_set(self.topod.call("free_map")["ok"]["allocatable"]))
        self.assertIn("ok", self.topod.call("allocate", job="other-4", request="affinity[thread*%d]" % (total - 1)))
        held = self.periodic()["vnode_list"][HOST]
        self.assertIn("CPUs held outside PBS", held["comment"])
        self.topod.call("release", job="other-4")
        reason = {HOST: {"comment": "topo: cannot reach topod (test)"}}
        freed = self.periodic(vnodes=reason)["vnode_list"][HOST]
        self.assertEqual(freed["comment"], "topo: cannot reach topod (test)")
        self.assertEqual(freed["resources_available"]["ncpus"], total)
        # Its own comment still goes when the CPUs come back.
        self.assertIn("ok", self.topod.call("allocate", job="other-5", request="affinity[thread*%d]" % (total - 1)))
        self.assertIn("CPUs held outside PBS", self.periodic()["vnode_list"][HOST]["comment"])
        self.topod.call("release", job="other-5")
        self.assertIsNone(self.periodic()["vnode_list"][HOST]["comment"])

    def test_damaged_state_files_and_a_state_dir_that_is_a_file_are_messages(self):
        state = os.path.join(self.dir, "hook-state")
        os.makedirs(state, exist_ok=True)
        for name, text in (("ncpus.json", '{"%s": 5}' % HOST), ("orphans.json", '{"pbs-200.server": "x"}')):
            with open(os.path.join(state, name), "w") as f:
                f.write(text)
        self.assert_accepted(self.periodic())
        self.assert_accepted(self.periodic())
        shutil.rmtree(state)
        with open(state, "w") as f:
            f.write("not a directory")
        total = len(load_hook_module().cpu_set(self.topod.call("free_map")["ok"]["allocatable"]))
        self.assertIn("ok", self.topod.call("allocate", job="other-3", request="affinity[thread*%d]" % total))
        begun = self.run_event("execjob_begin", job=mom_job("81.server", ncpus=1), vnode_list={HOST: {}})
        self.assert_rejected(begun, "does not fit")
        self.assertTrue(begun["rerun"], "sent back to the queue even when the state cannot be written")
        self.assertTrue(any("state file" in line for _, line in begun["log"]), begun["log"])

    @unittest.skipIf(REAL, "emulated 2-NUMA machine only with the fake backend")
    def test_startup_publishes_one_vnode_per_numa_node_and_begin_stays_inside(self):
        self.write_config(vnode_per_numa_node=True)
        started = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ncpus": 32}}})
        self.assert_accepted(started)
        vnodes = started["vnode_list"]
        self.assertEqual(sorted(vnodes), [HOST, HOST + "[0]", HOST + "[1]"])
        self.assertEqual(vnodes[HOST]["resources_available"]["ncpus"], 0)
        for name in (HOST + "[0]", HOST + "[1]"):
            self.assertEqual(vnodes[name]["resources_available"]["ncpus"], 16)
            self.assertEqual(vnodes[name]["resources_available"]["topo_free_numa"], 1)
            self.assertEqual(vnodes[name]["resources_available"]["topo_free_cores"], 8)
        self.assertEqual(vnodes[HOST]["resources_available"]["topo_free_cores"], 16)
        # PBS puts the job on vnode node1[1]: topod places it inside NUMA node 1.
        job = mom_job("62.server", ncpus=4, topology="affinity[core(2)]", in_select=True, vnode=HOST + "[1]")
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST + "[1]": {}}))
        topology = self.topod.call("topology")["ok"]
        node1 = [n for n in topology["numa_nodes"] if n["os_index"] == 1][0]
        hook = load_hook_module()
        got = hook.cpu_set(self.topod.call("list")["ok"][0]["cpus"])
        self.assertEqual(len(got), 4)
        self.assertTrue(got <= hook.cpu_set(node1["cpus"]), got)

    def test_topod_down_gives_clear_messages_offlines_and_requeues_then_comes_back(self):
        job = mom_job("70.server", ncpus=1)
        self.topod.stop()
        begun = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        self.assert_rejected(begun, "cannot reach topod at %s" % self.topod.socket, "is topod running", "goes back to the queue")
        self.assertTrue(begun["rerun"], "the job is requeued, not lost")
        self.assertEqual(begun["vnode_list"][HOST]["state"], 1, "offline")
        self.assertIn("topo: cannot reach topod", begun["vnode_list"][HOST]["comment"])
        self.assertNotIn("Traceback", begun["message"])
        launched = self.run_event("execjob_launch", job=job, progname="/bin/sh", argv=[], env={}, vnode_list={HOST: {}})
        self.assert_rejected(launched, "cannot reach topod")
        self.assertTrue(launched["rerun"])
        self.assert_rejected(self.run_event("execjob_attach", job=job, pid=os.getpid(), vnode_list={HOST: {}}), "cannot reach topod")
        ended = self.run_event("execjob_end", job=job, vnode_list={HOST: {}})
        self.assert_accepted(ended)
        self.assertTrue(any("cannot reach topod" in line for _, line in ended["log"]), ended["log"])
        down = self.periodic()
        self.assertEqual(down["vnode_list"][HOST]["state"], 1)
        self.assertIn("cannot reach topod", down["vnode_list"][HOST]["comment"])
        startup = self.run_event("exechost_startup", vnode_list={HOST: {}})
        self.assert_accepted(startup)
        self.assertEqual(startup["vnode_list"][HOST]["state"], 1)
        self.topod.start()
        back = self.periodic(vnodes={HOST: {"state": 1, "comment": down["vnode_list"][HOST]["comment"]}})
        self.assertEqual((back["vnode_list"][HOST]["state"], back["vnode_list"][HOST]["comment"]), (0, None), "back online")
        again = self.periodic(vnodes={HOST: {"state": 1, "comment": "an admin's reason"}})
        self.assertEqual(again["vnode_list"][HOST]["state"], 1, "a vnode the hook did not offline stays offline")

    def test_per_numa_vnodes_startup_could_not_make_are_made_by_periodic_once_no_job_runs(self):
        self.write_config(vnode_per_numa_node=True)
        self.topod.stop()
        started = self.run_event("exechost_startup", vnode_list={HOST: {"resources_available": {"ncpus": 32}}})
        self.assert_accepted(started)
        self.assertEqual(sorted(started["vnode_list"]), [HOST])
        self.assertEqual(started["vnode_list"][HOST]["state"], 1)
        offlined = {HOST: {"state": 1, "comment": started["vnode_list"][HOST]["comment"]}}
        # A machine with two NUMA nodes, on topod's in-memory backend (also as root).
        self.topod.start(topology=EMULATED)
        # A PBS job runs on the host's own vnode: its CPUs are counted there, so no vnode yet.
        job = mom_job("72.server", ncpus=1)
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        busy = self.periodic(running=["72.server"], vnodes=dict(offlined))
        self.assertEqual(sorted(busy["vnode_list"]), [HOST])
        self.assertTrue(any("are made once no PBS job runs" in line for _, line in busy["log"]), busy["log"])
        self.assertEqual(busy["vnode_list"][HOST]["state"], 0, "the host's own vnode is back online meanwhile")
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        idle = self.periodic(vnodes={HOST: {}})
        vnodes = idle["vnode_list"]
        self.assertEqual(sorted(vnodes), [HOST, HOST + "[0]", HOST + "[1]"])
        self.assertEqual(vnodes[HOST]["resources_available"]["ncpus"], 0)
        for name in (HOST + "[0]", HOST + "[1]"):
            self.assertEqual(vnodes[name]["resources_available"]["ncpus"], 16)
            self.assertEqual(vnodes[name]["resources_available"]["topo_free_numa"], 1)
        # Made once: the next run only refreshes them.
        made = {name: {} for name in vnodes}
        again = self.periodic(vnodes=made)
        self.assertFalse(any("making vnodes" in line for _, line in again["log"]), again["log"])
        self.assertEqual(sorted(again["vnode_list"]), sorted(vnodes))

    def test_a_job_whose_end_could_not_reach_topod_is_released_by_periodic(self):
        job = mom_job("71.server")
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        self.write_config(socket=os.path.join(self.dir, "no-topod-here.sock"))
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        self.assertEqual(self.periodic()["vnode_list"][HOST]["state"], 1)
        self.write_config()
        self.assertEqual(self.topod.jobs(), ["pbs-71.server"])
        self.assertEqual(self.periodic()["vnode_list"][HOST]["state"], 0)
        self.periodic()
        self.assertEqual(self.topod.jobs(), [])


class NotInstalledTest(HookTestCase):
    """A host whose topo has been removed (topod's socket and its protocol schema both gone)
    while the server still hands its MoM the hook: jobs without a request run, the others are
    refused with the reason; a topod that is merely down is still handled as down."""

    def remove_topo(self):
        self.topod.stop()
        self.write_config(socket=os.path.join(self.dir, "gone", "topod.sock"),
                          protocol_schema=os.path.join(self.dir, "gone", "protocol.schema.json"))

    def test_a_job_without_a_request_runs_without_topo_and_one_with_a_request_is_refused(self):
        self.remove_topo()
        plain = mom_job("90.server", ncpus=1)
        begun = self.run_event("execjob_begin", job=plain, vnode_list={HOST: {}})
        self.assert_accepted(begun)
        said = [line for _, line in begun["log"] if "not installed" in line]
        self.assertEqual(len(said), 1, begun["log"])
        self.assertIn("topo is not installed on this host (no topod socket at %s" % os.path.join(self.dir, "gone", "topod.sock"), said[0])
        self.assertIn("job runs without topo's placement", said[0])
        self.assertFalse(begun["rerun"])
        self.assertEqual(begun["vnode_list"][HOST]["state"], 0, "not offlined")
        shell, launched = self.launch(plain, "true")
        self.assert_accepted(launched)
        self.assertNotIn("TOPO_JOB", launched["env"])
        self.assertEqual(shell.wait(20), 0)
        self.assert_accepted(self.run_event("execjob_attach", job=plain, pid=os.getpid(), vnode_list={HOST: {}}))
        for name in ("execjob_epilogue", "execjob_end"):
            ended = self.run_event(name, job=plain, vnode_list={HOST: {}})
            self.assert_accepted(ended)
            self.assertFalse([line for level, line in ended["log"] if level == 1], ended["log"])
        for job in (mom_job("91.server", topology="affinity[core(1)]"),
                    mom_job("92.server", topology="affinity[core(1)]", in_select=True)):
            refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
            self.assert_rejected(refused, "topo is not installed on %s" % HOST, "topology=affinity[core(1)]",
                                 "only topo can place")
            self.assertNotIn("cannot reach topod", refused["message"])

    def test_a_topod_that_is_only_down_still_holds_jobs_back(self):
        self.topod.stop()
        self.write_config(socket=os.path.join(self.dir, "gone", "topod.sock"))   # the schema is there
        begun = self.run_event("execjob_begin", job=mom_job("93.server", ncpus=1), vnode_list={HOST: {}})
        self.assert_rejected(begun, "cannot reach topod")
        self.assertTrue(begun["rerun"])

    def test_periodic_brings_back_the_vnodes_this_hook_offlined_and_leaves_an_admins(self):
        self.topod.stop()
        down = self.periodic()
        self.assertEqual(down["vnode_list"][HOST]["state"], 1)
        self.remove_topo()
        back = self.periodic(vnodes={HOST: {"state": 1, "comment": down["vnode_list"][HOST]["comment"]}})
        self.assertEqual((back["vnode_list"][HOST]["state"], back["vnode_list"][HOST]["comment"]), (0, None))
        self.assertTrue(any("back online, without topo" in line for _, line in back["log"]), back["log"])
        # The marker gone with a purged state_dir: the hook's comment is enough.
        shutil.rmtree(os.path.join(self.dir, "hook-state"), ignore_errors=True)
        again = self.periodic(vnodes={HOST: {"state": 1, "comment": "topo: cannot reach topod at /x"}})
        self.assertEqual(again["vnode_list"][HOST]["state"], 0)
        admin = self.periodic(vnodes={HOST: {"state": 1, "comment": "disk replaced, do not use"}})
        self.assertEqual((admin["vnode_list"][HOST]["state"], admin["vnode_list"][HOST]["comment"]), (1, "disk replaced, do not use"))
        started = self.run_event("exechost_startup", vnode_list={HOST: {}})
        self.assert_accepted(started)
        self.assertFalse([line for level, line in started["log"] if level == 1], started["log"])


class PureFunctionsTest(unittest.TestCase):
    """The hook's reading of PBS values, without topod."""

    @classmethod
    def setUpClass(cls):
        cls.hook = load_hook_module()

    def test_select_chunks_keep_requests_with_colons_and_quotes(self):
        chunks = self.hook.select_chunks('2:ncpus=4:mpiprocs=2:topology=affinity[core(2):membind=localonly]+1:ncpus=1:topology="affinity[thread]"')
        self.assertEqual(len(chunks), 3)
        self.assertEqual(chunks[0], {"ncpus": "4", "mpiprocs": "2", "topology": "affinity[core(2):membind=localonly]"})
        self.assertEqual(chunks[2]["topology"], "affinity[thread]")
        self.assertEqual(self.hook.select_chunks(None), [])

    def test_share_on_host_counts_only_this_hosts_chunks(self):
        class Job(object):
            exec_vnode = "(node1[0]:ncpus=4:mem=1048576kb+node1[1]:ncpus=4)+(node2:ncpus=8:mem=2gb)+(node1:ncpus=2:mem=1gb)"
            schedselect = "1:ncpus=8:mpiprocs=4:topology=affinity[core(1)]+1:ncpus=8+1:ncpus=2"
        share = self.hook.share_on_host(Job(), "node1", "topology")
        self.assertEqual((share.ncpus, share.mem_bytes, share.mpiprocs, share.numa_nodes), (10, 2 << 30, 5, {0, 1}))
        self.assertEqual(share.requests, ["affinity[core(1)]"])
        other = self.hook.share_on_host(Job(), "node2", "topology")
        self.assertEqual((other.ncpus, other.mem_bytes, other.mpiprocs, other.numa_nodes), (8, 2 << 30, 1, set()))
        self.assertEqual(self.hook.share_on_host(Job(), "node10", "topology").ncpus, 0, "node1 is not a prefix match")

    def test_gpus_per_numa_node_counts_held_gpus_where_free_ones_would_be(self):
        # A GPU in a CPU-less node (HBM) or of unknown node with a local_cpulist: topod's free
        # map places it by the CPUs near it, held or free alike (from the second attack: held
        # ones were counted by their listed numa_node, 2 here, and nothing was published).
        topology = {"numa_nodes": [{"os_index": 0, "cpus": "0-1"}, {"os_index": 1, "cpus": "2-3"},
                                   {"os_index": 2, "cpus": ""}]}
        free_map = {"allocatable": "0-3", "gpus": [{"numa": "2-3"}],
                    "held_gpus": [{"job": "pbs-1.x", "pci_address": "0000:18:00.0", "site": {"numa": "0-1"}}]}
        listed = [{"job": "pbs-1.x", "gpus": [{"pci_address": "0000:18:00.0", "numa_node": 2}]}]
        self.assertEqual(self.hook.gpus_per_numa_node(topology, free_map, listed), ({0: 1, 1: 1}, None))
        # Two jobs sharing one GPU count it once; a job outside PBS holding one: none published.
        shared = dict(free_map, held_gpus=free_map["held_gpus"] * 2)
        self.assertEqual(self.hook.gpus_per_numa_node(topology, shared, listed), ({0: 1, 1: 1}, None))
        outside = dict(free_map, held_gpus=[dict(free_map["held_gpus"][0], job="other-1")])
        counts, why = self.hook.gpus_per_numa_node(topology, outside, listed)
        self.assertIsNone(counts)
        self.assertIn("held outside PBS now (0000:18:00.0)", why)
        # A topod older than held_gpus: GPUs held, their place not said.
        older = {"allocatable": "0-3", "gpus": [{"numa": "2-3"}]}
        counts, why = self.hook.gpus_per_numa_node(topology, older, listed)
        self.assertIsNone(counts)
        self.assertIn("does not say where", why)

    def test_values_the_launch_hook_sets_keep_their_commas(self):
        # The MoM cuts an event.env value at an unescaped comma (see env_value).
        self.assertEqual(self.hook.env_value("0,2-3"), "0\\,2-3")
        self.assertEqual(self.hook.env_value("0000:18:00.0,0000:86:00.0;0000:87:00.0"),
                         "0000:18:00.0\\,0000:86:00.0;0000:87:00.0")
        self.assertEqual(self.hook.env_value("0-7"), "0-7")
        # Through the MoM (the launcher's reading of OpenPBS's strtok_quoted and
        # prune_esc_backslash), every value the hook sets arrives whole, backslashes too.
        import launcher
        self.assertEqual(launcher.as_passed("a,b"), "a")
        self.assertEqual(launcher.as_passed("a\\\\,b"), "a\\")
        for value in ("0,2-3", "0000:18:00.0,0000:86:00.0;0000:87:00.0", "/srv\\topo,1/job-notify/pbs-1.x", "\\"):
            self.assertEqual(launcher.as_passed(self.hook.env_value(value)), value)

    def test_a_topod_older_than_gpus_by_numa_is_asked_again_without_it(self):
        hook = self.hook
        calls = []

        class OldTopod(object):
            """Answers as a topod before gpus_by_numa did (proto.rs's wording for an unknown field)."""
            def call(self, op, **fields):
                calls.append(dict(fields))
                if "gpus_by_numa" in fields:
                    raise hook.TopodRefused("bad_request", 'unknown field "gpus_by_numa" for operation allocate; '
                                                           "accepted fields: job, request, tasks, cpus, gpus")
                return {"job": fields["job"], "cpus": "0"}

        class Job(object):
            id = "80.server"
            euser = "root"
        share = hook.Share()
        share.gpus_by_numa = {1: 1}
        got = hook.allocate(OldTopod(), None, Job(), "pbs-80.server", share, "affinity[core:gpus=1]", 1)
        self.assertEqual(got["cpus"], "0")
        self.assertEqual([c.get("gpus_by_numa") for c in calls], [[{"numa": 1, "count": 1}], None])
        # Any other refusal is the job's, not retried.
        del calls[:]

        class Refusing(OldTopod):
            def call(self, op, **fields):
                calls.append(dict(fields))
                raise hook.TopodRefused("bad_argument", "gpus_by_numa: this host has no NUMA node 1 (its nodes: 0)")
        os.environ.setdefault("PBS_STANDIN_HOST", HOST)
        with self.assertRaises(hook.HookError) as refused:
            hook.allocate(Refusing(), None, Job(), "pbs-80.server", share, "affinity[core:gpus=1]", 1)
        self.assertIn("no NUMA node 1", str(refused.exception))
        self.assertEqual(len(calls), 1)

    def test_share_on_host_sums_this_hosts_gpus(self):
        class Job(object):
            exec_vnode = "(node1[0]:ncpus=4:ngpus=1+node1[1]:ncpus=4:ngpus=2)+(node2:ncpus=8:ngpus=4)"
            schedselect = "1:ncpus=8:ngpus=3+1:ncpus=8:ngpus=4"
        self.assertEqual(self.hook.share_on_host(Job(), "node1", "topology", "ngpus").ngpus, 3)
        self.assertEqual(self.hook.share_on_host(Job(), "node2", "topology", "ngpus").ngpus, 4)
        self.assertEqual(self.hook.share_on_host(Job(), "node1", "topology").ngpus, 0, "not counted without gpus_resource")
        # Where PBS counted them: per NUMA vnode, sent to topod as gpus_by_numa for a request
        # that asks for GPUs; none when some are on the host's own vnode.
        one = self.hook.share_on_host(Job(), "node1", "topology", "ngpus")
        self.assertEqual((one.gpus_by_numa, one.gpus_off_numa), ({0: 1, 1: 2}, 0))
        self.assertEqual(self.hook.gpu_counts_by_numa(one, "affinity[core*3:gpus=1]"),
                         [{"numa": 0, "count": 1}, {"numa": 1, "count": 2}])
        self.assertEqual(self.hook.gpu_counts_by_numa(one, "affinity[core]"), [])
        two = self.hook.share_on_host(Job(), "node2", "topology", "ngpus")
        self.assertEqual((two.gpus_by_numa, two.gpus_off_numa), ({}, 4))
        self.assertEqual(self.hook.gpu_counts_by_numa(two, "affinity[core:gpus=4]"), [])

    def test_a_job_is_told_its_gpus_and_cuda_its_uuids_only_when_the_driver_says_every_one(self):
        nvidia = tempfile.mkdtemp(prefix="topo-pbs-nvidia-")
        self.addCleanup(shutil.rmtree, nvidia, True)
        a, b = "GPU-1d2c3b4a-0000-1111-2222-333344445555", "GPU-9e8f7a6b-aaaa-bbbb-cccc-ddddeeeeffff"
        for address, uuid in [("0000:18:00.0", a), ("0000:86:00.0", b)]:
            os.makedirs(os.path.join(nvidia, address))
            with open(os.path.join(nvidia, address, "information"), "w") as f:
                f.write("Model: \t A100\nGPU UUID: \t %s\nDevice Minor: 0\n" % uuid)
        both = {"gpus": [{"pci_address": "0000:18:00.0"}, {"pci_address": "0000:86:00.0"}],
                "task_gpus": [["0000:18:00.0"], ["0000:86:00.0"]]}
        self.assertEqual(self.hook.gpu_variables(both, nvidia),
                         [("TOPO_GPUS", "0000:18:00.0,0000:86:00.0"), ("TOPO_TASK_GPUS", "0000:18:00.0;0000:86:00.0"),
                          ("CUDA_VISIBLE_DEVICES", a + "," + b)])
        one_unknown = {"gpus": [{"pci_address": "0000:18:00.0"}, {"pci_address": "0000:3b:00.0"}]}
        self.assertEqual(self.hook.gpu_variables(one_unknown, nvidia), [("TOPO_GPUS", "0000:18:00.0,0000:3b:00.0")])
        self.assertEqual(self.hook.gpu_variables({"gpus": []}, nvidia), [])
        # An address that is no PCI address (a hostile or broken reply) is no path, and reaches
        # no variable (attack findings: "..", ".", a trailing newline, a task list with ';' or
        # '='); a GPU the host no longer has is not the job's; each GPU once.
        for bad in ("../../etc", "..", ".", "0000:18:00.0\n", "0000:18:00.0,0000:86:00.0", ""):
            self.assertEqual(self.hook.gpu_variables({"gpus": [{"pci_address": bad}]}, nvidia), [], repr(bad))
        self.assertEqual(self.hook.gpu_variables({"gpus": [{"pci_address": "0000:18:00.0", "gone": True}]}, nvidia), [])
        odd = {"gpus": [{"pci_address": "0000:18:00.0"}, {"pci_address": "0000:18:00.0"}, {"pci_address": ".."}],
               "task_gpus": [["0000:18:00.0;LD_PRELOAD=/tmp/x.so"], ["a\nb", ".."]]}
        self.assertEqual(self.hook.gpu_variables(odd, nvidia), [("TOPO_GPUS", "0000:18:00.0"), ("CUDA_VISIBLE_DEVICES", a)])
        # A UUID line that is no UUID: no CUDA_VISIBLE_DEVICES at all.
        with open(os.path.join(nvidia, "0000:86:00.0", "information"), "w") as f:
            f.write("GPU UUID: GPU-aaaaaaaa;rm -rf /\n")
        self.assertEqual(self.hook.gpu_variables({"gpus": [{"pci_address": "0000:86:00.0"}]}, nvidia),
                         [("TOPO_GPUS", "0000:86:00.0")])

    def test_pbs_usable_cpus(self):
        usable = self.hook.pbs_usable_cpus
        free_map = {"allocatable": "0-7"}
        jobs = [{"job": "pbs-1.s", "cpus": "0-1", "fenced": ""},           # PBS job, ncpus 2
                {"job": "pbs-2.s", "cpus": "2", "fenced": "3"},            # PBS job fencing a sibling, ncpus 1
                {"job": "lsf-9", "cpus": "4-5", "fenced": ""},             # not PBS's
                {"job": "pbs-3.s", "cpus": "6", "fenced": ""}]             # an orphan: PBS no longer runs it
        running = {"pbs-1.s": {"h": 2}, "pbs-2.s": {"h": 1}}
        self.assertEqual(usable(free_map, jobs, running), 8 - 2 - 1 - 1)
        self.assertEqual(usable(free_map, jobs, dict(running, **{"pbs-2.s": None})), 8 - 2 - 1)
        self.assertEqual(usable(free_map, jobs, running, within={4, 5, 6, 7}, vnode="h[1]"), 1)
        # Per NUMA vnode: the fence counts on the vnode that holds it.
        per_numa = {"pbs-1.s": {"h[0]": 2}, "pbs-2.s": {"h[0]": 1}}
        self.assertEqual(usable(free_map, jobs, per_numa, within={0, 1, 2, 3}, vnode="h[0]"), 4 - 1)
        self.assertEqual(usable(free_map, [], {}), 8)
        # A job PBS gave ncpus=0 that holds CPUs anyway: all of them count against PBS.
        self.assertEqual(usable(free_map, jobs[:1], {"pbs-1.s": {"h": 0}}), 6)

    def test_hostile_values_are_messages_not_crashes(self):
        hook = self.hook
        for bad in ("abc", "1.5", "0x10", "=1"):
            job = types.SimpleNamespace(exec_vnode="(n:ncpus=%s)" % bad, schedselect="1:ncpus=1", Resource_List={})
            with self.assertRaises(hook.HookError) as e:
                hook.share_on_host(job, "n", "topology")
            self.assertIn("ncpus", str(e.exception))
        self.assertFalse(hook.cut_at_comma("affinity[core(1,same=numa)"), "it still has its comma: not cut there")
        self.assertTrue(hook.cut_at_comma("affinity[core(1"))

    def test_sizes_cpu_lists_and_job_ids(self):
        h = self.hook
        self.assertEqual([h.size_in_bytes(s) for s in ["100mb", "102400kb", "2GB", "10w", "512"]], [100 << 20, 100 << 20, 2 << 30, 80, 512])
        self.assertRaises(h.HookError, h.size_in_bytes, "lots")
        self.assertEqual(h.cpu_set("0-3,8,10-11"), {0, 1, 2, 3, 8, 10, 11})
        self.assertEqual(h.cpu_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8")
        self.assertEqual(h.topod_job_id("123[4].server.example"), "pbs-123[4].server.example")
        self.assertEqual(h.pbs_job_id("pbs-1.s"), "1.s")
        self.assertIsNone(h.pbs_job_id("lsf-1"))
        for bad in ["", "1/2.server", "1 .s", "\x00", "x" * 125]:
            self.assertRaises(h.HookError, h.topod_job_id, bad)

    def test_a_release_topod_refuses_offlines_the_vnode_with_the_reason(self):
        """A release that fails (processes that will not die: topod keeps the cgroup) cannot be
        caused on demand on a test machine; this drives on_periodic with a topod double that
        answers as topod does in that case (daemon/host.rs HostError::Survivors)."""
        hook = self.hook
        refusal = "job pbs-9.s: 1 process(es) would not die ([4242]); its cgroup and CPUs are kept"

        class RefusingTopod(object):
            def __init__(self, config):
                pass

            def call(self, op, **fields):
                if op == "list":
                    return [{"job": "pbs-9.s"}]
                if op == "release":
                    raise hook.TopodRefused("internal", refusal)
                raise AssertionError(op)

        class Event(object):
            job_list = {}
            vnode_list = {"node1": hook.pbs.vnode("node1")}

        state = tempfile.mkdtemp(prefix="topo-pbs-test-")
        self.addCleanup(shutil.rmtree, state, True)
        config = dict(hook.DEFAULTS, state_dir=state, orphan_after_runs=1, publish=False, publish_ncpus=False)
        os.environ["PBS_STANDIN_HOST"] = "node1"
        real_topod, hook.Topod = hook.Topod, RefusingTopod
        try:
            hook.on_periodic(Event(), config)
        finally:
            hook.Topod = real_topod
        vnode = Event.vnode_list["node1"]
        self.assertEqual(vnode.state, hook.pbs.ND_OFFLINE)
        self.assertEqual(vnode.comment, "topo: cannot release pbs-9.s: topod: " + refusal)

    def test_replies_are_read_against_topods_protocol_schema(self):
        """The hook checks every reply against packaging/protocol.schema.json (generated from
        topod's types): a field renamed or missing, or of the wrong type, names itself."""
        schema = self.hook.ProtocolSchema(SCHEMA)
        allocation = {"job": "pbs-1.s", "cpus": "0-3", "tasks": ["0-1", "2-3"], "mems": "0",
                      "fenced": "", "request": "affinity[core(2)*2]"}
        schema.check_ok("allocate", allocation)
        schema.check_ok("list", [dict(allocation, state="running", owner_uid=1000)])
        schema.check_ok("release", {"job": "pbs-1.s", "killed": 0})

        def refused(op, value):
            with self.assertRaises(self.hook.HookError) as caught:
                schema.check_ok(op, value)
            return str(caught.exception)

        renamed = dict(allocation)
        renamed["cpu_list"] = renamed.pop("cpus")
        self.assertIn("ok has no 'cpus'", refused("allocate", renamed))
        self.assertIn("ok.cpus is '0-3,x'", refused("allocate", dict(allocation, cpus="0-3,x")))
        self.assertIn("ok[0].state is 'sleeping'", refused("list", [dict(allocation, state="sleeping")]))
        self.assertIn("ok.killed is '0', not of type integer", refused("release", {"job": "j", "killed": "0"}))
        self.assertIn("no reply for the operation 'launch'", refused("launch", {}))
        reply = {"v": 1, "error": {"code": "no_such_code", "message": "x"}}
        self.assertIsNotNone(schema.problem(reply, {"$ref": "#/$defs/Reply"}, "the reply"))

    def test_an_endless_reply_is_refused_at_the_limit(self):
        """A broken or hostile peer on topod's socket that never ends its reply: the hook,
        running inside PBS's daemons, stops reading at the limit with a message."""
        import threading
        directory = tempfile.mkdtemp(prefix="topo-pbs-test-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "topod.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        sent = []

        def peer():
            conn, _ = listener.accept()
            conn.recv(4096)
            chunk, total = b"x" * 65536, 0
            try:
                while True:
                    conn.sendall(chunk)
                    total += len(chunk)
            except OSError:
                sent.append(total)
            conn.close()

        thread = threading.Thread(target=peer)
        thread.start()
        topod = self.hook.Topod({"socket": path, "timeout_seconds": 10, "protocol_schema": SCHEMA})
        with self.assertRaises(self.hook.HookError) as caught:
            topod.call("version")
        topod.close()
        thread.join(10)
        listener.close()
        self.assertIn("longer than 16 MiB", str(caught.exception))
        self.assertLess(sent[0], self.hook.MAX_REPLY_BYTES + 8 * 1024 * 1024)

    def test_a_schema_the_hook_cannot_check_is_refused(self):
        directory = tempfile.mkdtemp(prefix="topo-pbs-test-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "schema.json")
        with open(path, "w") as f:
            json.dump({"$defs": {"ok.version": {"type": "object", "dependentRequired": {"a": ["b"]}}}}, f)
        with self.assertRaises(self.hook.HookError) as caught:
            self.hook.ProtocolSchema(path)
        self.assertIn("uses dependentRequired, which this hook cannot check", str(caught.exception))
        with self.assertRaises(self.hook.HookError) as caught:
            self.hook.ProtocolSchema(os.path.join(directory, "missing.json"))
        self.assertIn("copy packaging/protocol.schema.json there", str(caught.exception))

    def test_the_hook_keeps_to_python_3_5(self):
        """PBS embeds its own Python; old releases have 3.5/3.6: no f-strings, no walrus, no
        subprocess.run(capture_output=, text=)."""
        with open(HOOK) as f:
            tree = ast.parse(f.read())
        newer = [n for n in ast.walk(tree) if type(n).__name__ in ("JoinedStr", "NamedExpr")]
        newer += [k for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg in ("capture_output", "text")]
        self.assertEqual(newer, [], "features newer than Python 3.5 at lines %s" % [getattr(n, "lineno", "?") for n in newer])


if __name__ == "__main__":
    unittest.main()
