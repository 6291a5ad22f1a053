//! The per-host daemon: configuration, host state, socket server, and a client.
//!
//! topod runs with no configuration file; `/etc/topo/topod.toml` (or `--config`) may set any of
//! the [`Config`] fields. Command-line options override the file.

pub mod host;
pub mod server;
pub mod tcp;

use crate::cpuset::CpuSet;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The default socket path.
pub const DEFAULT_SOCKET: &str = "/run/topo/topod.sock";
/// The default state directory (the hint file lives there): a tmpfs, as the hints describe
/// live job cgroups, which never outlive a boot, and are rewritten on every allocate and release.
pub const DEFAULT_STATE_DIR: &str = "/run/topo";

/// topod's configuration file (TOML). Every field is optional.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Unix socket path.
    pub socket: Option<PathBuf>,
    /// State directory.
    pub state_dir: Option<PathBuf>,
    /// `auto`, `v1`, `v2` or `fake`.
    pub cgroup: Option<String>,
    /// Our subtree's name under each cgroup hierarchy.
    pub cgroup_subtree: Option<String>,
    /// An hwloc XML file to use instead of this host's /sys (emulation).
    pub topology: Option<PathBuf>,
    /// CPUs no job may get, in list format (`0-1`).
    pub reserved_cpus: Option<String>,
    /// Placement strategy (best-fit by default).
    pub strategy: Option<String>,
    /// Uids that may allocate and release besides root.
    #[serde(default)]
    pub admin_uids: Vec<u32>,
    /// Gids whose members may allocate and release.
    #[serde(default)]
    pub admin_gids: Vec<u32>,
    /// Release a job by itself once its cgroup has had processes and has none left
    /// (for batch systems that do not call release; off by default).
    #[serde(default)]
    pub auto_release: bool,
    /// Address for the read-only TCP listener (`"0.0.0.0:7979"`) that serves the free map to the
    /// scheduler's plug-in; off when unset. Needs `tcp_key_file`.
    pub tcp_listen: Option<String>,
    /// Addresses or networks (`"10.1.0.0/16"`, `"192.0.2.7"`) allowed to connect over TCP.
    #[serde(default)]
    pub tcp_allow: Vec<String>,
    /// A file holding the shared key a TCP client must send first (one line).
    pub tcp_key_file: Option<PathBuf>,
}

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Unreadable.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, or an unknown key, or a wrong type.
    #[error("{path}: {what}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What and where, as the TOML parser says it.
        what: String,
    },
}

impl Config {
    /// Reads a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
        Config::parse(path, &text)
    }

    /// Parses configuration text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Invalid { path: path.to_path_buf(), what: e.to_string() })?;
        if let Some(r) = &config.reserved_cpus {
            CpuSet::parse_list(r).map_err(|e| ConfigError::Invalid { path: path.to_path_buf(), what: format!("reserved_cpus: {e}") })?;
        }
        if let Some(c) = &config.cgroup {
            if !["auto", "v1", "v2", "fake"].contains(&c.as_str()) {
                return Err(ConfigError::Invalid { path: path.to_path_buf(), what: format!("cgroup = {c:?}; expected auto, v1, v2 or fake") });
            }
        }
        if config.tcp_listen.is_some() && config.tcp_key_file.is_none() {
            return Err(ConfigError::Invalid { path: path.to_path_buf(), what: "tcp_listen needs tcp_key_file".into() });
        }
        for entry in &config.tcp_allow {
            tcp::Allow::parse(entry).map_err(|what| ConfigError::Invalid { path: path.to_path_buf(), what: format!("tcp_allow: {what}") })?;
        }
        if let Some(s) = &config.strategy {
            s.parse::<crate::place::Strategy>().map_err(|e| ConfigError::Invalid { path: path.to_path_buf(), what: format!("strategy: {e}") })?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_say_what_and_where() {
        let p = Path::new("topod.toml");
        assert_eq!(Config::parse(p, "").unwrap(), Config::default());
        let c = Config::parse(p, "reserved_cpus = \"0-1\"\nadmin_uids = [1000]\ncgroup = \"v1\"\n").unwrap();
        assert_eq!(c.admin_uids, [1000]);
        let e = Config::parse(p, "socket = 3").unwrap_err().to_string();
        assert!(e.contains("topod.toml") && e.contains("socket"), "{e}");
        let e = Config::parse(p, "sockett = \"/x\"").unwrap_err().to_string();
        assert!(e.contains("unknown field") && e.contains("sockett"), "{e}");
        let e = Config::parse(p, "reserved_cpus = \"0-x\"").unwrap_err().to_string();
        assert!(e.contains("reserved_cpus"), "{e}");
        let e = Config::parse(p, "cgroup = \"v3\"").unwrap_err().to_string();
        assert!(e.contains("expected auto, v1, v2 or fake"), "{e}");
        let e = Config::parse(p, "tcp_listen = \"0.0.0.0:7979\"").unwrap_err().to_string();
        assert!(e.contains("tcp_key_file"), "{e}");
        let e = Config::parse(p, "tcp_allow = [\"10.0.0.0/33\"]").unwrap_err().to_string();
        assert!(e.contains("10.0.0.0/33"), "{e}");
        let e = Config::parse(p, "strategy = \"fast\"").unwrap_err().to_string();
        assert!(e.contains("best-fit"), "{e}");
    }
}
