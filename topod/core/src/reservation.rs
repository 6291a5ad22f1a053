//! Topology reservations ("blocking", after the SDSC Paragon scheduler): a block of a host's
//! CPUs set aside, until it expires, for one named job that is waiting. Other jobs are placed
//! outside the block; jobs already running inside it run on, so the block drains as they end;
//! the named job, when it is allocated, is placed inside the block if it fits there (and may use
//! the rest of the host besides), and the reservation is then spent.
//!
//! This module is the pure part that topod and the simulator share: where a block goes
//! ([`choose_block`]), and what a placement must avoid because of the blocks of others
//! ([`blocked_for`]). Times are seconds since the epoch.

use crate::cpuset::CpuSet;
use crate::place::{self, HostModel, Occupancy, PlaceError, Placement, Strategy};
use crate::request::Request;
use serde::{Deserialize, Serialize};

/// One reservation on one host.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// The waiting job it is for.
    pub job: String,
    /// The block.
    pub cpus: CpuSet,
    /// The request the block was chosen for (canonical).
    pub request: String,
    /// When it was made.
    pub made_at: i64,
    /// When it lapses if the job has not been allocated.
    pub expires_at: i64,
    /// The GPUs held with the block for a request that asks topod for GPUs (`gpus=`; PCI
    /// addresses): no other job is given them while it holds, and the block lies beside them.
    /// None for a request without `gpus=` (and in a record of a topod older than this field).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
}

impl Reservation {
    /// Whether it still holds at `now`.
    pub fn live(&self, now: i64) -> bool {
        now < self.expires_at
    }
}

/// What `job`'s placement must avoid because of the live reservations of other jobs: their
/// blocks, as fenced CPUs, added to `occupancy`.
pub fn blocked_for<'a>(
    occupancy: &Occupancy,
    reservations: impl IntoIterator<Item = &'a Reservation>,
    job: &str,
    now: i64,
) -> Occupancy {
    let mut occ = occupancy.clone();
    for r in reservations {
        if r.job != job && r.live(now) {
            occ.fenced.union_with(&r.cpus);
        }
    }
    occ
}

/// Where a block for `request` goes, and which of its CPUs are busy now.
///
/// First among the CPUs free now (`occupancy`, other blocks left out): a block that is free at
/// once. Failing that, anywhere outside the other blocks, running jobs ignored: the block then
/// drains as the jobs inside it end, which is what blocking is for (the Paragon reserved nodes
/// for a large waiting job so that small ones stopped filling them). Either way by `strategy`,
/// as a job would be placed.
pub fn choose_block(
    model: &HostModel,
    occupancy: &Occupancy,
    others: &[&Reservation],
    request: &Request,
    strategy: Strategy,
    now: i64,
) -> Result<(Placement, CpuSet), PlaceError> {
    let now_free = blocked_for(occupancy, others.iter().copied(), "", now);
    if let Ok(p) = place::place(model, &now_free, request, strategy) {
        return Ok((p, CpuSet::new()));
    }
    let only_blocks = blocked_for(&Occupancy::default(), others.iter().copied(), "", now);
    let p = place::place(model, &only_blocks, request, strategy)?;
    let mut busy = p.cpus.intersection(&occupancy.held);
    busy.union_with(&p.cpus.intersection(&occupancy.fenced));
    Ok((p, busy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{SyntheticShape, Topology};

    fn model() -> HostModel {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 4,
            threads_per_core: 1,
        });
        HostModel::new(&topo, &CpuSet::new()).unwrap()
    }

    fn set(s: &str) -> CpuSet {
        CpuSet::parse_list(s).unwrap()
    }

    #[test]
    fn a_block_is_free_now_if_it_can_be_else_it_drains_and_others_keep_out() {
        let m = model();
        let numa: Request = "affinity[numa]".parse().unwrap();
        let busy = Occupancy { held: set("0,5"), fenced: CpuSet::new() };
        // Both nodes have a job: the block drains, and says which CPUs are busy.
        let (p, b) = choose_block(&m, &busy, &[], &numa, Strategy::BestFit, 0).unwrap();
        assert_eq!(p.cpus.len(), 4);
        assert_eq!(b.len(), 1, "{} busy in {}", b, p.cpus);
        // A node free now is taken at once.
        let one = Occupancy { held: set("0"), fenced: CpuSet::new() };
        let (p, b) = choose_block(&m, &one, &[], &numa, Strategy::BestFit, 0).unwrap();
        assert_eq!((p.cpus, b), (set("4-7"), CpuSet::new()));
        // Another job's live block is avoided; an expired one is not.
        let other = Reservation {
            job: "big".into(),
            cpus: set("4-7"),
            request: String::new(),
            made_at: 0,
            expires_at: 100,
            gpus: Vec::new(),
        };
        let (p, b) = choose_block(&m, &one, &[&other], &numa, Strategy::BestFit, 50).unwrap();
        assert_eq!((p.cpus, b), (set("0-3"), set("0")));
        let (p, _) = choose_block(&m, &one, &[&other], &numa, Strategy::BestFit, 100).unwrap();
        assert_eq!(p.cpus, set("4-7"));
        // Two blocks cover the host: a third cannot be had.
        let mine = Reservation { job: "m".into(), cpus: set("0-3"), ..other.clone() };
        assert!(choose_block(&m, &one, &[&other, &mine], &numa, Strategy::BestFit, 50).is_err());
        // What a placement of another job must avoid, and of the named job.
        let occ = blocked_for(&one, [&other], "small", 50);
        assert_eq!(occ.fenced, set("4-7"));
        assert_eq!(blocked_for(&one, [&other], "big", 50).fenced, CpuSet::new());
    }
}
