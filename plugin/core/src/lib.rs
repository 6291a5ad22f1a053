//! What every topo batch-system plug-in shares on the scheduler side.
//!
//! A cluster scheduler (LSF's mbschd, a Slurm or PBS scheduler hook) must decide, for thousands
//! of hosts and within its own scheduling cycle, which hosts can hold a job's topology request
//! and which fits best. Asking each host's topod while deciding would put a network round trip
//! per host on the scheduler's thread (the 2001 design), so instead:
//!
//! - [`cache::HostCache`] holds, per host, the hardware model (shared between hosts with the
//!   same topology) and its free map: held and fenced CPUs, the jobs it holds, its topology
//!   reservations (blocks of CPUs set aside for one waiting job each) and whether it moves
//!   running jobs to make room (`defrag`). It is pure data; nothing in it does I/O.
//! - [`fetch::Refresher`] fills the cache in the background from each host's topod (its
//!   read-only TCP listener, or a local socket), in parallel with timeouts, through the
//!   [`fetch::HostSource`] trait (a real and a fake implementation). Each host is fetched on
//!   its own schedule and its result applied as it arrives, so a host goes stale only when its
//!   own topod stops answering, and a hung topod costs its own time-out and nothing else. The
//!   scheduler reads an immutable snapshot of the cache ([`cache::CacheCell`]) and never waits
//!   for the refresher.
//! - [`reserve::Reservations`] holds the tentative placements the scheduler has decided but the
//!   hosts have not reported yet, so that two jobs dispatched in one session never count the same
//!   CPUs; they go when the host's free map shows the job, when the scheduler deallocates, or
//!   after a time-out.
//! - [`eval`] answers fit-and-score for a host with the placement core's own best-fit
//!   placement on (cache state + reservations), for a job or a group of peer jobs
//!   ([`eval::Claimant`]: other jobs' blocks are in the way, its own are tried first), ranks
//!   the hosts in bands (its own block first, then fits as it is, then fits only in a block of
//!   a group of peers' shape, then fits only after topod's moves, then in a pool, then
//!   unknown), and applies the [`config::Unreachable`] policy to hosts whose state
//!   is unknown or stale.
//!
//! The plug-ins themselves (`plugin/lsf`, `plugin/slurm`, `packaging/pbs`) only translate
//! between their batch system's calls and these types.

pub mod address;
pub mod cache;
pub mod config;
pub mod eval;
pub mod fetch;
pub mod reserve;

pub use address::Address;
pub use cache::HostCache;
pub use config::{CacheConfig, Unreachable};
pub use eval::{evaluate, Claimant, NoFit, Verdict};
pub use reserve::Reservations;

#[cfg(test)]
mod tests;
