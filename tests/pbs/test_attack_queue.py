"""Hostile and confused use of what the PBS hook now sends topod (the job's queue and the
prime-time pool its Variable_List names) and of the refusals topod now explains, through the
stand-in `pbs` module and a real topod (see test_topo_hook.py, whose harness this reuses).

Each test checks what a PBS user or administrator must be told.
"""

import unittest

from test_topo_hook import HOST, HookTestCase, mom_job


def cpu_ids(text):
    """The CPUs of a list such as "0-3,8"."""
    cpus = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


class PoolRefusalTest(HookTestCase):
    def restart_with_pool(self, queues=("interactive",), named=False):
        """topod again, with an always-open prime-time pool "day" on its lowest CPU (that jobs
        naming it may use with `named`); returns how many CPUs are left outside the pool."""
        allocatable = cpu_ids(self.topod.call("free_map")["ok"]["allocatable"])
        self.topod.stop()
        # Inline: the harness writes its own keys after ours, which a [[table]] would swallow.
        self.topod.start('prime_pools = [{name = "day", cpus = "%d", windows = ["Mon-Sun 00:00-24:00"], queues = %s, named = %s}]\n'
                         % (allocatable[0], "[%s]" % ", ".join('"%s"' % q for q in queues), "true" if named else "false"))
        return len(allocatable) - 1

    def fill_outside_the_pool(self, outside):
        """A PBS job on every CPU outside the pool (the pool admits queue interactive, not it)."""
        fill = mom_job("1.pbs-server.example", ncpus=outside, topology="affinity[thread*%d]" % outside)
        self.assert_accepted(self.run_event("execjob_begin", job=fill, vnode_list={HOST: {}}))

    def test_a_job_kept_out_by_an_open_pool_is_not_told_the_cpus_are_too_scattered(self):
        self.fill_outside_the_pool(self.restart_with_pool())
        late = mom_job("2.pbs-server.example", ncpus=1, topology="affinity[thread*1]")
        refused = self.run_event("execjob_begin", job=late, vnode_list={HOST: {}})
        # topod's reason reaches the job: the pool, and whom it admits.
        self.assert_rejected(refused, "prime-time pool day", "it admits jobs of queue interactive")
        # The hook's own conclusion must not contradict it: the free CPU is in one piece, the
        # job fits it, only the pool's window keeps it out (and PBS will send it back here
        # while the window is open, as it counts the pool's CPUs).
        self.assertNotIn("too scattered", refused["message"])

    def test_a_job_kept_out_by_a_reservation_is_not_told_the_cpus_are_too_scattered(self):
        allocatable = cpu_ids(self.topod.call("free_map")["ok"]["allocatable"])
        outside = len(allocatable) - 1
        fill = mom_job("1.pbs-server.example", ncpus=outside, topology="affinity[thread*%d]" % outside)
        self.assert_accepted(self.run_event("execjob_begin", job=fill, vnode_list={HOST: {}}))
        # The administrator sets the last free CPU aside for a PBS job that waits for it.
        free = sorted(set(allocatable) - set(cpu_ids(self.topod.call("free_map")["ok"]["held"])))
        reserved = self.topod.call("reserve", job="pbs-9.pbs-server.example", request="affinity[thread*1]",
                                   cpus=str(free[0]), expires_in_s=600)
        self.assertIn("ok", reserved, reserved)
        late = mom_job("2.pbs-server.example", ncpus=1, topology="affinity[thread*1]")
        refused = self.run_event("execjob_begin", job=late, vnode_list={HOST: {}})
        self.assert_rejected(refused, "it would fit without job pbs-9.pbs-server.example's reservation")
        self.assertNotIn("too scattered", refused["message"])

    def test_a_pool_variable_too_long_for_topod_is_named_in_the_rejection(self):
        self.restart_with_pool()
        job = dict(mom_job("3.pbs-server.example", ncpus=1, topology="affinity[thread*1]"),
                   Variable_List={"TOPO_POOL": "x" * 70000})
        refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
        # The job's topology request is 18 bytes: the user must learn that TOPO_POOL is the
        # problem, not "request of 70164 bytes is longer than the limit".
        self.assert_rejected(refused, "TOPO_POOL")

    def test_an_unknown_or_hostile_pool_name_is_refused_naming_it_and_the_hosts_pools(self):
        self.restart_with_pool()
        for pool in ("dya", "../day", "day "):
            job = dict(mom_job("4.pbs-server.example", ncpus=1, topology="affinity[thread*1]"),
                       Variable_List={"TOPO_POOL": pool})
            refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
            self.assert_rejected(refused, "no prime-time pool of that name", "its pools: day")
            self.assertIn(json_quoted(pool), refused["message"])
        # A name topod would refuse is refused by the hook, naming TOPO_POOL.
        for pool, says in (("a\nb\x00c", "control character"), ("x" * 129, "129 bytes long")):
            job = dict(mom_job("4.pbs-server.example", ncpus=1, topology="affinity[thread*1]"),
                       Variable_List={"TOPO_POOL": pool})
            refused = self.run_event("execjob_begin", job=job, vnode_list={HOST: {}})
            self.assert_rejected(refused, "TOPO_POOL (qsub -v)", says)
        self.assertEqual(self.topod.jobs(), [])

    def test_a_hostile_queue_name_reaches_topods_list_as_it_is(self):
        self.restart_with_pool(named=True)
        queue = "workq\u202e\"}{"
        job = dict(mom_job("5.pbs-server.example", ncpus=1, topology="affinity[thread*1]"), queue=queue,
                   Variable_List={"TOPO_POOL": "day"})
        self.assert_accepted(self.run_event("execjob_begin", job=job, vnode_list={HOST: {}}))
        listed = dict((a["job"], a) for a in self.topod.call("list")["ok"])["pbs-5.pbs-server.example"]
        self.assertEqual((listed.get("queue"), listed.get("pool")), (queue, "day"))
        self.assert_accepted(self.run_event("execjob_end", job=job, vnode_list={HOST: {}}))
        self.assertEqual(self.topod.jobs(), [])


def json_quoted(text):
    """How topod's message quotes a name (Rust's {:?}) for the plain names used here."""
    return '"%s"' % text.replace("\\", "\\\\").replace("\n", "\\n").replace("\x00", "\\0")
