//! Linux sysfs/procfs reader with an injectable root directory. (Being written.)

use super::{Topology, TopologyError};
use std::path::Path;

/// Reads the topology under `root` (a directory holding `sys/` and `proc/`; `/` for this host).
pub fn read(root: &Path) -> Result<Topology, TopologyError> {
    Err(TopologyError::Empty { source_name: root.display().to_string(), what: "sysfs reader not written yet".into() })
}
