//! Prime-time pools on this host (see `topo_core::prime`): configured in topod.toml
//! (`prime_pools`), enforced at allocate (a job the pool does not admit is placed outside it
//! while a window is open; one it admits is placed inside it when it fits there) and when a
//! window opens (jobs it does not admit on its CPUs stay, or are moved out where they fit, by
//! the pool's `on_open`). The host's local time is the pools' clock.

use super::{Host, HostError};
use serde::Deserialize;
use topo_core::cpuset::CpuSet;
use topo_core::ledger::Allocation;
use topo_core::place::{self, Occupancy};
use topo_core::prime::{Asker, LocalTime, OnOpen, Pool, Window};
use topo_core::request::{self, Request};

/// One `prime_pools` entry of topod.toml.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Its name (an allocate's `pool` names it).
    pub name: String,
    /// Its CPUs, as a list...
    #[serde(default)]
    pub cpus: Option<CpuSet>,
    /// ...or as a shape placed on the empty host (`affinity[core(8,same=numa)]`).
    #[serde(default)]
    pub shape: Option<String>,
    /// Weekly windows in the host's local time (`Mon-Fri 08:00-18:00`).
    pub windows: Vec<String>,
    /// Queues whose jobs may use it.
    #[serde(default)]
    pub queues: Vec<String>,
    /// Users (uids) whose jobs may use it.
    #[serde(default)]
    pub users: Vec<u32>,
    /// Whether a job whose allocate names the pool may use it (`TOPO_POOL`, `topoctl alloc
    /// --pool`): by default only a pool without `queues` and `users` admits that way, since any
    /// user can name a pool, and a pool for some queues or users would be for anyone then.
    #[serde(default)]
    pub named: Option<bool>,
    /// What happens to other jobs on it when a window opens: `stay` or `migrate`.
    #[serde(default)]
    pub on_open: OnOpen,
}

/// Makes the pools of `configs` for the host `model`: lists checked, shapes placed one after
/// the other on the empty host; pools may not overlap.
pub fn make_pools(model: &place::HostModel, configs: &[PoolConfig]) -> Result<Vec<Pool>, String> {
    let mut taken = Occupancy::default();
    let mut pools = Vec::new();
    for c in configs {
        let what = format!("prime pool {:?}", c.name);
        if c.name.is_empty() || pools.iter().any(|p: &Pool| p.name == c.name) {
            return Err(format!("{what}: pools need distinct, non-empty names"));
        }
        // Names an allocate could not send would make a pool no job can reach.
        topo_core::proto::check_name("name", &c.name).map_err(|e| format!("{what}: {e}"))?;
        for q in &c.queues {
            topo_core::proto::check_name("a queue", q).map_err(|e| format!("{what}: {e}"))?;
        }
        let cpus = match (&c.cpus, &c.shape) {
            (Some(list), None) if list.is_empty() => {
                return Err(format!("{what}: cpus is empty; give a CPU list such as \"0-7\""));
            }
            (Some(list), None) => {
                let missing = list.difference(&model.allocatable);
                if !missing.is_empty() {
                    return Err(format!(
                        "{what}: cpus {list} must be CPUs jobs may have here ({} are not)",
                        missing
                    ));
                }
                if list.intersects(&taken.held) {
                    return Err(format!(
                        "{what}: CPUs {} are in another pool",
                        list.intersection(&taken.held)
                    ));
                }
                list.clone()
            }
            (None, Some(shape)) => {
                let req: Request =
                    request::parse(shape).map_err(|e| format!("{what}: shape: {e}"))?;
                let req = Request { tasks: req.tasks.or(Some(1)), ..req };
                place::place(model, &taken, &req, place::Strategy::BestFit)
                    .map_err(|e| format!("{what}: shape {shape} {e}"))?
                    .cpus
            }
            _ => {
                return Err(format!(
                "{what}: give its CPUs as cpus = \"LIST\" or shape = \"REQUEST\", one of the two"
            ))
            }
        };
        if c.windows.is_empty() {
            return Err(format!("{what}: no windows (windows = [\"Mon-Fri 08:00-18:00\"])"));
        }
        let windows = c
            .windows
            .iter()
            .map(|w| w.parse::<Window>().map_err(|e| format!("{what}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let named = c.named.unwrap_or(c.queues.is_empty() && c.users.is_empty());
        if !named && c.queues.is_empty() && c.users.is_empty() {
            return Err(format!(
                "{what}: admits no job: give queues, users, or named = true (jobs that name it)"
            ));
        }
        taken.held.union_with(&cpus);
        pools.push(Pool {
            name: c.name.clone(),
            cpus,
            windows,
            queues: c.queues.clone(),
            users: c.users.clone(),
            named,
            on_open: c.on_open,
        });
    }
    Ok(pools)
}

/// The host's prime-time pools and what they need to be looked at: the host's offset from UTC
/// at a time (the local time zone; a test's own in tests), and which pools were in a window at
/// the last look (a window that opens since is what moves jobs, [`Host::pool_windows`]).
pub(crate) struct PrimePools {
    list: Vec<Pool>,
    utc_offset: std::sync::Arc<dyn Fn(i64) -> i64 + Send + Sync>,
    open_at_last_look: Vec<bool>,
}

impl Default for PrimePools {
    fn default() -> Self {
        PrimePools {
            list: Vec::new(),
            utc_offset: std::sync::Arc::new(|_| 0),
            open_at_last_look: Vec::new(),
        }
    }
}

impl PrimePools {
    /// No pool: most hosts, and then nothing need look at the time zone.
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The pools.
    pub(crate) fn list(&self) -> &[Pool] {
        &self.list
    }

    /// The host's local time at `now` (seconds since the epoch).
    fn local_time(&self, now: i64) -> LocalTime {
        LocalTime::at(now, (self.utc_offset)(now))
    }

    /// Whether each pool is in a window at `now`.
    pub(crate) fn open_at(&self, now: i64) -> Vec<bool> {
        let t = self.local_time(now);
        self.list.iter().map(|p| p.open_at(t)).collect()
    }

    /// The pools whose window opened since the last look, by index; `now` is the new last look.
    fn opened_since_last_look(&mut self, now: i64) -> Vec<usize> {
        let now_open = self.open_at(now);
        let opened = (0..self.list.len())
            .filter(|&i| now_open[i] && !self.open_at_last_look.get(i).copied().unwrap_or(false))
            .collect();
        self.open_at_last_look = now_open;
        opened
    }

    /// `occupancy` with the pools open at `now` that `who` may not use fenced, and the CPUs of
    /// those it may.
    pub(crate) fn fence(
        &self,
        occupancy: &Occupancy,
        who: Asker<'_>,
        now: i64,
    ) -> (Occupancy, CpuSet) {
        if self.list.is_empty() {
            return (occupancy.clone(), CpuSet::new());
        }
        topo_core::prime::pools_for(occupancy, &self.list, who, self.local_time(now))
    }
}

impl Host {
    /// Sets the prime-time pools; `utc_offset` gives the host's offset east of UTC, in seconds,
    /// at a time (the local time zone; a test's own in tests).
    pub fn set_pools(
        &mut self,
        pools: Vec<Pool>,
        utc_offset: std::sync::Arc<dyn Fn(i64) -> i64 + Send + Sync>,
    ) {
        let now = self.now_s();
        self.pools = PrimePools { list: pools, utc_offset, open_at_last_look: Vec::new() };
        self.pools.open_at_last_look = self.pools.open_at(now);
    }

    /// The pools and whether each is in a window now.
    pub fn pools(&self) -> Vec<(Pool, bool)> {
        self.pools.list.iter().cloned().zip(self.open_pools()).collect()
    }

    pub(crate) fn open_pools(&self) -> Vec<bool> {
        self.pools.open_at(self.now_s())
    }

    /// The pools as `free_map` shows them (nothing looked up on a host without pools).
    pub(crate) fn pool_status(&self) -> Vec<topo_core::proto::reply::PoolStatus> {
        if self.pools.is_empty() {
            return Vec::new();
        }
        self.pools
            .list
            .iter()
            .zip(self.open_pools())
            .map(|(p, open)| topo_core::proto::reply::PoolStatus {
                name: p.name.clone(),
                cpus: p.cpus.clone(),
                open,
                queues: p.queues.clone(),
                users: p.users.clone(),
                named: p.named,
            })
            .collect()
    }

    /// Who `job` is for the pools, from its record.
    pub(crate) fn asker_of(&self, job: &str) -> (Option<String>, Option<u32>, Option<String>) {
        self.hints
            .get(job)
            .map(|h| (h.ask.queue.clone(), h.ask.owner_uid, h.ask.pool.clone()))
            .unwrap_or_default()
    }

    /// `occupancy` with the open pools `who` may not use fenced, and the CPUs of those it may.
    pub(crate) fn with_pools(&self, occupancy: &Occupancy, who: Asker<'_>) -> (Occupancy, CpuSet) {
        // Most hosts have no pool: no look at the clock on every placement then.
        if self.pools.is_empty() {
            return (occupancy.clone(), CpuSet::new());
        }
        self.pools.fence(occupancy, who, self.now_s())
    }

    /// Checks the windows (topod's tick): for each pool whose window has just opened, the jobs
    /// on it that it does not admit stay or, with `on_open = "migrate"`, are moved out where they
    /// fit. Returns the jobs moved.
    pub fn pool_windows(&mut self) -> Vec<String> {
        let now = self.now_s();
        let mut moved = Vec::new();
        for i in self.pools.opened_since_last_look(now) {
            let pool = self.pools.list[i].clone();
            tracing::info!(event = "pool_open", pool = %pool.name, "prime pool {}: window open, CPUs {} reserved for its jobs", pool.name, pool.cpus);
            if pool.on_open != OnOpen::Migrate {
                continue;
            }
            let on_it: Vec<Allocation> = self
                .ledger
                .jobs()
                .filter(|a| a.cpus.intersects(&pool.cpus) && a.gang_row.is_none())
                .filter(|a| {
                    let (q, o, p) = self.asker_of(&a.job);
                    !pool.admits(Asker { queue: q.as_deref(), owner: o, pool: p.as_deref() })
                })
                .cloned()
                .collect();
            for a in on_it {
                match self.move_out(&a, &pool) {
                    Ok(true) => moved.push(a.job.clone()),
                    Ok(false) => tracing::info!(
                        "job {}: stays on prime pool {} (no room outside it)",
                        a.job,
                        pool.name
                    ),
                    Err(e) => tracing::warn!(
                        "job {}: could not be moved out of prime pool {}: {e}",
                        a.job,
                        pool.name
                    ),
                }
            }
        }
        moved
    }

    /// Moves `a` off `pool`'s CPUs, placing its request again outside the pool (and the other
    /// open pools it may not use); `false` when there is no room.
    fn move_out(&mut self, a: &Allocation, pool: &Pool) -> Result<bool, HostError> {
        let Ok(req) = request::parse(&a.request) else { return Ok(false) };
        let req = Request { tasks: Some(a.tasks.len().max(1) as u32), tasks_max: None, ..req };
        let mut occ = self.placement_occupancy(&a.job, None);
        occ.held.difference_with(&a.cpus);
        occ.fenced.difference_with(&a.fenced);
        occ.fenced.union_with(&pool.cpus);
        let Ok(p) = place::place(&self.model, &occ, &req, self.strategy) else { return Ok(false) };
        let moved = Allocation {
            cpus: p.cpus,
            tasks: p.tasks,
            mems: p.mems,
            fenced: p.fenced,
            ..a.clone()
        };
        self.apply_moves(vec![moved], "moved out of a prime pool")?;
        Ok(true)
    }
}
