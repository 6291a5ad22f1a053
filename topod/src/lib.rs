//! topo: topology-aware job placement for the batch systems HPC sites already run.
//!
//! This crate holds the placement core that every part of topo shares, and the per-host daemon
//! built on it:
//!
//! - [`topology`]: the hardware graph of a host, read from Linux sysfs or an hwloc XML file;
//! - [`request`]: the request language (LSF `CPUSET[...]` and `affinity[...]`, which is also the
//!   syntax of Slurm's `--topology=` and PBS's `-l topology=`), normalized into one [`request::Request`];
//! - [`place`]: placement strategies and their metrics, pure functions of (graph, ledger, request);
//! - [`ledger`]: who holds which CPUs and memory nodes on one host, with its invariants;
//! - [`proto`]: the versioned line protocol between topod and its clients;
//! - [`cgroup`]: job cgroups (v1, v2, and an in-memory fake), the one OS boundary of topod;
//! - `daemon` (feature `daemon`): topod's configuration, host state and socket server, and
//!   [`client`], what talks to it.
//!
//! Placement, the ledger, the request language and the protocol are pure. The file system is
//! touched only by the topology readers (which take their root directory or file as an argument,
//! so that tests run on snapshots of real machines), the cgroup backends behind their trait, and
//! the daemon.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod batch;
pub mod bench;
pub mod cgroup;
pub mod client;
pub mod cpuset;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod ledger;
pub mod picture;
pub mod place;
pub mod proto;
pub mod request;
pub mod topology;

pub use cpuset::CpuSet;
