//! The cluster core's queue of waiting jobs, indexed for backfilling.
//!
//! Jobs wait in arrival order, each at a position that only grows (positions are renumbered
//! when the queue is compacted, which [`WaitQueue::numbering`] tells). Beside the order the
//! queue keeps, per block of positions and per node of a tree over the blocks, the Pareto
//! frontier of its jobs' (processors needed, longest run): for each need, the shortest run
//! among jobs needing at most that many. A backfill pass asks for the first job at or after a
//! position that could start by its counts alone, i.e. one that needs at most `any` processors
//! (it fits beside the head's reservation, or in another gang row), or at most `reserved`
//! processors and runs at most `within` seconds (it ends before the head is due). The frontier
//! answers that exactly for a whole subtree, so a pass visits only the jobs that could start,
//! plus a path of the tree per job: a queue of many jobs that cannot start costs a pass a few
//! steps, not a step per job (EASY's pass was quadratic in a long queue when every end changed
//! the cluster and restarted it).

use super::{JobKey, Time};

/// Positions per block (a block's frontier is computed by scanning it).
const BLOCK: usize = 32;

/// (processors needed, longest run) of a waiting job.
type Need = (u32, Time);

/// Waiting jobs in arrival order, with the index described in the module documentation.
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    /// Jobs by position; `None` where a job left.
    slots: Vec<Option<(JobKey, Need)>>,
    /// No job waits before this position.
    first: usize,
    /// Jobs waiting.
    live: usize,
    /// Each waiting job's position, by job key (`usize::MAX`: not waiting).
    position: Vec<usize>,
    /// Per node of a complete binary tree over the blocks (node 1 the root, block b at node
    /// `blocks + b`): the frontier, by need ascending and run strictly descending.
    frontier: Vec<Vec<Need>>,
    /// Blocks the tree has room for (a power of two).
    blocks: usize,
    /// How many times positions were renumbered.
    numbering: u64,
    /// The positions the waiting jobs had before the last renumbering, in order (the new
    /// position of each is its index here), to carry a position over ([`Self::carry`]).
    before: Vec<usize>,
    /// Blocks changed since the frontiers were last brought up to date (a pass brings them up
    /// to date when it asks; FCFS never asks, and pays nothing for the index).
    dirty: Vec<usize>,
}

impl WaitQueue {
    /// Jobs waiting.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The first job waiting.
    pub fn front(&self) -> Option<JobKey> {
        self.slots.get(self.first).and_then(|s| s.map(|(job, _)| job))
    }

    /// Removes and returns the first job waiting.
    pub fn pop_front(&mut self) -> Option<JobKey> {
        let job = self.front()?;
        self.remove(job);
        Some(job)
    }

    /// Which numbering positions are in ([`Self::carry`] brings one kept from the numbering
    /// before over).
    pub fn numbering(&self) -> u64 {
        self.numbering
    }

    /// Position `at` of numbering `numbering`, in today's: the same place in the order (every
    /// job before it is still before it). None when positions were renumbered twice since.
    pub fn carry(&self, at: usize, numbering: u64) -> Option<usize> {
        if numbering == self.numbering {
            Some(at)
        } else if numbering + 1 == self.numbering {
            Some(self.before.partition_point(|&old| old < at))
        } else {
            None
        }
    }

    /// One past the last position taken.
    pub fn end(&self) -> usize {
        self.slots.len()
    }

    /// Queues `job`, which needs `need` processors and runs at most `run` seconds.
    pub fn push(&mut self, job: JobKey, need: u32, run: Time) {
        if self.slots.len() == self.blocks * BLOCK {
            // Full: compact, and make room for as many again as wait.
            let blocks = (2 * (self.live + 1)).div_ceil(BLOCK).next_power_of_two();
            self.renumber(blocks);
        }
        let at = self.slots.len();
        self.slots.push(Some((job, (need, run))));
        let key = job as usize;
        if self.position.len() <= key {
            self.position.resize(key + 1, usize::MAX);
        }
        self.position[key] = at;
        self.live += 1;
        self.mark(at / BLOCK);
    }

    /// Takes `job` out of the queue (it started, or was cancelled); nothing if it is not in it.
    pub fn remove(&mut self, job: JobKey) {
        let Some(at) = self.position.get(job as usize).copied().filter(|&p| p != usize::MAX) else {
            return;
        };
        self.position[job as usize] = usize::MAX;
        self.slots[at] = None;
        self.live -= 1;
        while self.first < self.slots.len() && self.slots[self.first].is_none() {
            self.first += 1;
        }
        self.mark(at / BLOCK);
    }

    /// Notes that block `b` changed (the list stays within twice the blocks: FCFS, which
    /// never asks, would otherwise grow it with every change).
    fn mark(&mut self, b: usize) {
        if self.dirty.len() >= 2 * self.blocks.max(8) {
            self.dirty.sort_unstable();
            self.dirty.dedup();
        }
        self.dirty.push(b);
    }

    /// The first job waiting at or after position `from`, with its position.
    pub fn next_from(&self, from: usize) -> Option<(usize, JobKey)> {
        let from = from.max(self.first);
        self.slots.get(from..)?.iter().enumerate().find_map(|(k, s)| s.map(|(j, _)| (from + k, j)))
    }

    /// Every job waiting, in order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = JobKey> + '_ {
        self.slots[self.first.min(self.slots.len())..].iter().filter_map(|s| s.map(|(j, _)| j))
    }

    /// The first job at or after position `from` that needs at most `any` processors, or at
    /// most `reserved` and runs at most `within` seconds; with its position.
    pub fn first_candidate(
        &mut self,
        from: usize,
        any: u64,
        reserved: u64,
        within: Time,
    ) -> Option<(usize, JobKey)> {
        let fits = |&(need, run): &Need| {
            u64::from(need) <= any || (u64::from(need) <= reserved && run <= within)
        };
        let from = from.max(self.first);
        if from >= self.slots.len() {
            return None;
        }
        self.bring_up_to_date();
        // The rest of the block `from` is in, then whole blocks found through the tree.
        let in_block = |b: usize, start: usize| {
            let end = ((b + 1) * BLOCK).min(self.slots.len());
            (start..end).find_map(|p| match self.slots[p] {
                Some((job, need)) if fits(&need) => Some((p, job)),
                _ => None,
            })
        };
        let b = from / BLOCK;
        if let Some(found) = in_block(b, from) {
            return Some(found);
        }
        let holds = |node: usize| frontier_holds(&self.frontier[node], any, reserved, within);
        let next = self.first_block_from(b + 1, &holds)?;
        in_block(next, next * BLOCK)
    }

    /// The first block at or after `from` whose frontier `holds` a fitting job.
    fn first_block_from(&self, from: usize, holds: &dyn Fn(usize) -> bool) -> Option<usize> {
        self.find(1, 0, self.blocks, from, holds)
    }

    /// [`Self::first_block_from`] within `node`, which covers blocks `lo..hi`: the frontier is
    /// exact, so a node wholly at or after `from` that holds one leads down to it.
    fn find(
        &self,
        node: usize,
        lo: usize,
        hi: usize,
        from: usize,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        if hi <= from || !holds(node) {
            return None;
        }
        if node >= self.blocks {
            return Some(lo);
        }
        let mid = (lo + hi) / 2;
        self.find(2 * node, lo, mid, from, holds)
            .or_else(|| self.find(2 * node + 1, mid, hi, from, holds))
    }

    /// Recomputes the frontiers of the blocks changed since the last call, and of their
    /// ancestors, each once.
    fn bring_up_to_date(&mut self) {
        if self.dirty.is_empty() {
            return;
        }
        let mut nodes = std::mem::take(&mut self.dirty);
        nodes.sort_unstable();
        nodes.dedup();
        for &b in &nodes {
            self.block_frontier(b);
        }
        for node in &mut nodes {
            *node += self.blocks;
        }
        while nodes.first().is_some_and(|&n| n > 1) {
            for node in &mut nodes {
                *node /= 2;
            }
            nodes.dedup();
            for &node in &nodes {
                let mut merged = std::mem::take(&mut self.frontier[node]);
                merge(&self.frontier[2 * node], &self.frontier[2 * node + 1], &mut merged);
                self.frontier[node] = merged;
            }
        }
        // (The buffer, emptied, for the next changes.)
        nodes.clear();
        self.dirty = nodes;
    }

    /// Computes block `b`'s frontier from its jobs.
    fn block_frontier(&mut self, b: usize) {
        let start = b * BLOCK;
        let end = ((b + 1) * BLOCK).min(self.slots.len());
        let mut needs: Vec<Need> = self.slots[start..end].iter().flatten().map(|s| s.1).collect();
        needs.sort_unstable();
        pareto(&needs, &mut self.frontier[self.blocks + b]);
    }

    /// Moves every waiting job to the front, in order, in a tree of `blocks` blocks.
    fn renumber(&mut self, blocks: usize) {
        let kept: Vec<(JobKey, Need)> = self.slots.iter().flatten().copied().collect();
        self.before.clear();
        self.before.extend((0..self.slots.len()).filter(|&p| self.slots[p].is_some()));
        self.blocks = blocks.max(1);
        self.slots = Vec::with_capacity(self.blocks * BLOCK);
        self.frontier = vec![Vec::new(); 2 * self.blocks];
        for (at, &(job, need)) in kept.iter().enumerate() {
            self.slots.push(Some((job, need)));
            self.position[job as usize] = at;
        }
        self.first = 0;
        self.numbering += 1;
        self.dirty.clear();
        // Blocks first, then each inner node from its children.
        for b in 0..self.slots.len().div_ceil(BLOCK) {
            self.block_frontier(b);
        }
        for node in (1..self.blocks).rev() {
            let mut merged = Vec::new();
            merge(&self.frontier[2 * node], &self.frontier[2 * node + 1], &mut merged);
            self.frontier[node] = merged;
        }
    }
}

/// Whether a frontier has a job needing at most `any`, or at most `reserved` and running at
/// most `within`.
fn frontier_holds(frontier: &[Need], any: u64, reserved: u64, within: Time) -> bool {
    match frontier.first() {
        None => false,
        Some(&(least, _)) if u64::from(least) <= any => true,
        Some(_) => {
            // The shortest run among those needing at most `reserved`: the last such point.
            let k = frontier.partition_point(|&(need, _)| u64::from(need) <= reserved);
            k > 0 && frontier[k - 1].1 <= within
        }
    }
}

/// The frontier of `sorted` (by need, then run): the points whose run is below every run of
/// a smaller need.
fn pareto(sorted: &[Need], out: &mut Vec<Need>) {
    out.clear();
    for &(need, run) in sorted {
        if out.last().is_none_or(|&(_, shortest)| run < shortest) {
            out.push((need, run));
        }
    }
}

/// The frontier of two frontiers.
fn merge(a: &[Need], b: &[Need], out: &mut Vec<Need>) {
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        let take_a = j == b.len() || (i < a.len() && a[i] <= b[j]);
        let point = if take_a {
            i += 1;
            a[i - 1]
        } else {
            j += 1;
            b[j - 1]
        };
        if out.last().is_none_or(|&(_, shortest)| point.1 < shortest) {
            out.push(point);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The first fitting job by a plain scan, for comparison.
    fn scan(q: &WaitQueue, from: usize, any: u64, reserved: u64, within: Time) -> Option<usize> {
        (from.max(q.first)..q.slots.len()).find(|&p| {
            q.slots[p].is_some_and(|(_, (need, run))| {
                u64::from(need) <= any || (u64::from(need) <= reserved && run <= within)
            })
        })
    }

    #[test]
    fn the_queue_keeps_arrival_order_through_removals_and_compaction() {
        let mut q = WaitQueue::default();
        for job in 0..100 {
            q.push(job, 1 + job % 7, Time::from(job));
        }
        for job in (0..100).filter(|j| j % 3 != 0) {
            q.remove(job);
        }
        assert_eq!(q.front(), Some(0));
        assert_eq!(q.pop_front(), Some(0));
        let numbering = q.numbering();
        // A place kept from before a compaction is carried over: job 99 was at 99, and the
        // jobs before it are the 32 multiples of 3 from 3 to 96.
        let mut copy = WaitQueue::default();
        std::mem::swap(&mut copy, &mut q);
        let mut job = 100;
        while copy.numbering() == numbering {
            copy.push(job, 1, 1);
            job += 1;
        }
        assert_eq!(copy.carry(99, numbering), Some(32));
        assert_eq!(copy.next_from(32).map(|(_, job)| job), Some(99));
        std::mem::swap(&mut copy, &mut q);
        // (Back to the queue before those pushes.)
        let mut q = WaitQueue::default();
        for job in (3..100).step_by(3) {
            q.push(job, 1 + job % 7, Time::from(job));
        }
        let numbering = q.numbering();
        for job in 100..300 {
            q.push(job, 2, 5);
        }
        assert!(q.numbering() > numbering, "compacted");
        assert!(q.numbering() >= 2);
        assert_eq!(q.carry(5, q.numbering() - 2), None, "renumbered twice since");
        let order: Vec<JobKey> = q.iter().collect();
        let expected: Vec<JobKey> = (3..100).step_by(3).chain(100..300).collect();
        assert_eq!(order, expected);
        assert_eq!(q.len(), expected.len());
        q.remove(7); // not waiting: nothing
        assert_eq!(q.len(), expected.len());
    }

    #[test]
    fn a_long_queue_of_jobs_that_cannot_start_is_passed_in_a_few_steps() {
        let mut q = WaitQueue::default();
        for job in 0..100_000 {
            // Jobs that need 2 processors, or 1 for a long time.
            q.push(job, 1 + job % 2, 1_000_000);
        }
        q.push(100_000, 1, 10);
        // One free processor, none beside the head, 100 s to its reservation.
        assert_eq!(q.first_candidate(0, 0, 1, 100), Some((100_000, 100_000)));
        assert_eq!(q.first_candidate(0, 1, 1, 100), Some((0, 0)), "one fits beside");
        assert_eq!(q.first_candidate(1, 1, 1, 100), Some((2, 2)));
        assert_eq!(q.first_candidate(0, 0, 0, 100), None);
    }

    proptest! {
        #[test]
        fn the_first_candidate_is_the_first_a_scan_finds(
            jobs in proptest::collection::vec((1u32..40, 1i64..1000, any::<bool>()), 1..400),
            queries in proptest::collection::vec((0usize..450, 0u64..45, 0u64..45, 0i64..1100), 1..40),
        ) {
            // Pushes with removals between them (of a job half as far in), so that blocks,
            // compaction and the tree are updated in every order.
            let mut q = WaitQueue::default();
            for (k, &(need, run, leaves)) in jobs.iter().enumerate() {
                q.push(k as JobKey, need, run);
                if leaves {
                    q.remove((k / 2) as JobKey);
                }
                // Some questions between the changes too (the frontiers are brought up to date
                // when asked).
                if k % 7 == 0 {
                    let (from, any, reserved, within) = queries[k % queries.len()];
                    let found = q.first_candidate(from, any, reserved, within).map(|(p, _)| p);
                    prop_assert_eq!(found, scan(&q, from, any, reserved, within));
                }
            }
            for &(from, any, reserved, within) in &queries {
                let found = q.first_candidate(from, any, reserved, within).map(|(p, _)| p);
                prop_assert_eq!(found, scan(&q, from, any, reserved, within));
            }
        }
    }
}
