//! What the integration tests share: where the real machines live.

use std::path::PathBuf;

/// `shared/topologies`: `$TOPO_SHARED_DIR/topologies`, else `../shared/topologies` beside the
/// repository. Missing is a failure, not a skip: CI always has it.
pub fn topologies() -> PathBuf {
    let dir = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let t = dir.join("topologies");
    assert!(t.join("expected-counts.tsv").is_file(), "shared topologies missing at {}; set TOPO_SHARED_DIR", t.display());
    t
}
