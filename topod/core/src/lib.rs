//! topo's pure core: everything about topology-aware placement that needs no operating system.
//!
//! - [`topology`]: the hardware graph of a host (plain data), and its readers, Linux sysfs and
//!   hwloc XML, which take their root directory or file as an argument, so that tests run on
//!   snapshots of real machines;
//! - [`request`]: the request language (LSF `CPUSET[...]` and `affinity[...]`, which is also the
//!   syntax of Slurm's `--topology=` and PBS's `-l topology=`), normalized into one
//!   [`request::Request`], with errors that carry byte spans;
//! - [`place`]: placement strategies and their metrics, pure functions of (graph, occupancy,
//!   request);
//! - [`ledger`]: who holds which CPUs and memory nodes on one host, with its invariants;
//! - [`cpuset`]: CPU sets and the kernel's list format;
//! - [`jobid`] and [`batch`]: what a job is called, on the wire, as a cgroup name, and as each
//!   batch system names it;
//! - [`proto`]: the wire protocol between topod and its clients, requests *and* replies, typed
//!   and versioned, and the default socket paths;
//! - [`pending`]: releases queued for topod while it could not be reached (where, what one
//!   says, its time stamp);
//! - [`bench`](mod@bench): the synthetic job streams the placement benchmarks replay;
//! - [`policy`]: the policy core, `(state, events) -> actions`, which topod and the simulator
//!   both run; [`sim`]: the simulator that replays a workload through it; [`swf`]: the
//!   Standard Workload Format the workloads come in.
//!
//! Nothing here opens a socket, starts a thread or touches a cgroup: the daemon (`topod`), the
//! client (`topo-client`) and the batch-system plug-ins all build on this crate, and the plug-ins
//! load into other people's daemons.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod batch;
#[cfg(feature = "sim")]
pub mod bench;
pub mod cpuset;
pub mod defrag;
pub mod gpus;
pub mod jobid;
pub mod ledger;
pub mod malleable;
pub mod pending;
pub mod place;
pub mod policy;
pub mod prime;
pub mod proto;
pub mod request;
pub mod reservation;
#[cfg(feature = "sim")]
pub mod sim;
#[cfg(feature = "sim")]
pub mod swf;
pub mod topology;

pub use cpuset::CpuSet;
pub use jobid::{JobId, JobIdError};
