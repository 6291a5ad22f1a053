//! `topoctl bench`: the benchmarks an administrator reruns on a host, apart from the commands
//! that show and change it. Each measures one figure the README gives (placement quality and
//! speed, topod's answer times with and without hostile load, freezes, gang switches, resizes,
//! migration), from the same code topod and the policy core run.

pub(crate) mod daemon;
pub(crate) mod freeze;
pub(crate) mod gang;
pub(crate) mod hostile;
pub(crate) mod migrate;
pub(crate) mod placement;
pub(crate) mod resize;
