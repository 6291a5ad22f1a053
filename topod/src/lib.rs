//! topod, topo's per-host daemon, and the tools beside it (`topoctl`, `topo-exec`).
//!
//! The placement core itself is the pure crate `topo_core` (hardware graph, request language,
//! placement, ledger, protocol); the client of topod's socket is `topo_client`. This crate adds
//! what crosses the operating system:
//!
//! - [`cgroup`]: job cgroups (v1, v2, and an in-memory fake), the one OS boundary of topod;
//! - `daemon` (feature `daemon`): topod's configuration, host state, job records, peer
//!   authentication and socket server;
//! - [`picture`]: the text picture of a host and who holds what, for `topoctl`;
//! - `cli` (feature `cli`): the command lines of `topod` and `topo-exec`, and `man` (features
//!   `cli` and `daemon`): the manual pages made from them, topoctl's and the configuration type.
//!
//! The binaries are `topod` (the daemon), `topoctl` (the administrator's and user's view,
//! what-if placement and benchmarks) and `topo-exec` (runs a command inside a job's cgroup).

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cgroup;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(all(feature = "cli", feature = "daemon"))]
pub mod man;
pub mod picture;
