//! The per-host daemon: configuration, host state, socket server, and a client.
//!
//! topod runs with no configuration file; `/etc/topo/topod.toml` (or `--config`) may set any of
//! the [`Config`] fields. Command-line options override the file.

pub mod batch_report;
pub mod conn;
pub mod host;
pub mod metrics;
pub mod pending;
pub mod process;
pub mod records;
pub mod server;
pub mod tcp;

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use topo_core::cpuset::CpuSet;

/// The default socket path.
pub use topo_core::proto::DEFAULT_SOCKET;
/// The default state directory (the hint file lives there): a tmpfs, as the hints describe
/// live job cgroups, which never outlive a boot, and are rewritten on every allocate and release.
pub const DEFAULT_STATE_DIR: &str = "/run/topo";

/// topod's configuration file (TOML). Every field is optional.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Unix socket path.
    pub socket: Option<PathBuf>,
    /// State directory.
    pub state_dir: Option<PathBuf>,
    /// Which cgroup backend (`auto` by default).
    pub cgroup: Option<CgroupKind>,
    /// Our subtree's name under each cgroup hierarchy.
    pub cgroup_subtree: Option<String>,
    /// An hwloc XML file, or a directory with a sysfs snapshot, to use instead of this host's
    /// /sys (emulation).
    pub topology: Option<PathBuf>,
    /// CPUs no job may get, in list format (`0-1`).
    pub reserved_cpus: Option<CpuSet>,
    /// Placement strategy (best-fit by default).
    pub strategy: Option<topo_core::place::Strategy>,
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
    pub tcp_allow: Vec<tcp::Allow>,
    /// A file holding the shared key a TCP client must send first (one line, within 2 s);
    /// readable by its owner only. Of the TCP connections waiting for their key, the oldest
    /// gives way past 64; keyed ones are 64 at most, 8 per address. None takes the socket's
    /// places: nothing that arrives over the network keeps a local user out.
    pub tcp_key_file: Option<PathBuf>,
    /// Open connections on the socket allowed from users who are not administrators, all
    /// together; default 512. Administrators are never refused.
    pub max_connections: Option<usize>,
    /// Open connections on the socket allowed from one user; default 64.
    pub max_connections_per_user: Option<usize>,
    /// Milliseconds a connection may wait between requests before topod closes it (30000).
    pub idle_timeout_ms: Option<u64>,
    /// Milliseconds a request line may take from its first byte to its newline (10000).
    pub line_timeout_ms: Option<u64>,
    /// Milliseconds a reply may wait for a client that does not read it (10000).
    pub write_timeout_ms: Option<u64>,
    /// Gang time slicing: rows, 2 to 64 (how many gang jobs may share a CPU, taking turns by
    /// slices); off unless set.
    pub gang_rows: Option<u32>,
    /// Gang slice length in seconds, 1 to 86400 (30). Slice k starts at k times this since the
    /// epoch, so hosts whose clocks agree switch together.
    pub gang_slice_s: Option<u64>,
    /// Every job is gang-scheduled unless it is prime; otherwise only jobs whose allocate asks.
    #[serde(default)]
    pub gang_all_jobs: bool,
    /// Queues whose jobs are prime: they run through every slice and share no CPU.
    #[serde(default)]
    pub gang_prime_queues: Vec<String>,
    /// An allocate that does not fit and asks to preempt may suspend running jobs that said
    /// they may be suspended, chosen to free the tightest domain, lowest expansion factor
    /// first; they resume when their CPUs are free.
    #[serde(default)]
    pub preempt: bool,
    /// Seconds a job runs after its start, or its resume after preemption, before it may be
    /// suspended (300).
    pub preempt_min_run_s: Option<u64>,
    /// Suspensions by preemption per job at most (2); other suspensions do not count.
    pub preempt_max_suspensions: Option<u32>,
    /// The expansion factor ((wait + estimate) / estimate) from which a job may preempt (2.0).
    pub preempt_min_xf: Option<f64>,
    /// Address for the metrics listener (`"127.0.0.1:9879"`): the Prometheus text format over
    /// HTTP, for any GET; off when unset. Prometheus sends no key, so `metrics_allow` is its
    /// only gate, and it serves nothing but the scrape (another address gets 403). Of the
    /// connections waiting for their request, the oldest gives way past 64; 64 replies at once
    /// at most, 16 to one address.
    pub metrics_listen: Option<String>,
    /// Addresses or networks (as `tcp_allow`) allowed to scrape; loopback only when empty.
    #[serde(default)]
    pub metrics_allow: Vec<tcp::Allow>,
    /// A file topod writes the same scrape to every `metrics_interval_s`, atomically (a
    /// temporary file beside it, then a rename), for node_exporter's textfile collector; off
    /// when unset.
    pub metrics_textfile: Option<PathBuf>,
    /// Seconds between two samples of the running jobs (CPU time, threads runnable, pressure),
    /// 1 to 3600 (15). The sampler runs when `metrics_listen`, `metrics_textfile` or
    /// `missized_settle_s` is set.
    pub metrics_interval_s: Option<u64>,
    /// Seconds a job runs before the sampler may find it mis-sized (300); its figures are
    /// averaged from then on.
    pub missized_settle_s: Option<u64>,
    /// A job is busy (mis-sized) when its threads runnable average more than this many times
    /// its CPUs (1.25); 1 or more.
    pub missized_busy_ratio: Option<f64>,
    /// A job is idle (mis-sized) when its CPU time per second and its threads runnable both
    /// stay below this share of its CPUs (0.5); above 0, at most 1.
    pub missized_idle_fraction: Option<f64>,
    /// Prime-time pools: CPUs set aside in weekly windows of the host's local time for the jobs
    /// of some queues or users, or whose allocate names the pool. Each pool: `name`, its CPUs as
    /// `cpus` (a list) or `shape` (a request placed on the empty host), `windows`
    /// (`"Mon-Fri 08:00-18:00"`), `queues`, `users` (uids), `named` (jobs that name it are
    /// admitted; by default only when it lists no queues and no users), and `on_open`: `stay`
    /// (jobs it does not admit that run on it when a window opens run on) or `migrate` (they
    /// are moved out where they fit).
    #[serde(default)]
    pub prime_pools: Vec<host::PoolConfig>,
    /// Malleable jobs (requests `*min-max`) share the CPUs rigid jobs leave equally within
    /// their ranges, rebalanced at every allocate and release; an arrival that does not fit
    /// shrinks them toward their least first. Not with `preempt` or `gang_rows`.
    #[serde(default)]
    pub equipartition: bool,
    /// Defragmenting migration: an allocate that does not fit although enough CPUs are free
    /// moves running jobs, each within its own request, the fewest moves first.
    #[serde(default)]
    pub defrag: bool,
    /// A job is not moved before it has run this many seconds (default 60).
    pub migrate_min_run_s: Option<u64>,
    /// Nor again within this many seconds of its last move or resize (default 300).
    pub migrate_gap_s: Option<u64>,
    /// When topod gives a running Slurm or PBS job other CPUs (a resize, a move), it says so in
    /// the job's Slurm `AdminComment` or PBS `comment` (`scontrol`, `qalter`; see
    /// [`batch_report`]); on by default.
    pub tell_batch_system: Option<bool>,
    /// Jobs moved to make room for one allocate, at most (default 8).
    pub defrag_max_moves: Option<usize>,
    /// Each job is also a group of the CPU scheduler (v1: its directory in the `cpu`
    /// hierarchy; v2: the `cpu` controller enabled for job cgroups), so that a job's many
    /// threads weigh as one against topod's and other jobs'; on by default.
    pub cpu_groups: Option<bool>,
    /// Each job may open only the device files of its own GPUs (those the batch system gave
    /// it, `gpus`): every other GPU's and accelerator's are denied in its cgroup (v1: the
    /// `devices` controller; v2: a BPF device program on the job's cgroup, see
    /// `cgroup::devices_bpf`; topod then keeps CAP_SYS_ADMIN, which the kernel asks for to set a
    /// device rule). Off by default.
    #[serde(default)]
    pub confine_devices: bool,
}

impl Config {
    /// The sampler's period and the mis-sized rules, when anything needs the sampler.
    pub fn sampling(&self) -> Option<(Duration, metrics::SizeRules)> {
        let on = self.metrics_listen.is_some()
            || self.metrics_textfile.is_some()
            || self.missized_settle_s.is_some();
        let d = metrics::SizeRules::default();
        on.then(|| {
            (
                Duration::from_secs(self.metrics_interval_s.unwrap_or(15)),
                metrics::SizeRules {
                    settle: self.missized_settle_s.map_or(d.settle, Duration::from_secs),
                    busy_ratio: self.missized_busy_ratio.unwrap_or(d.busy_ratio),
                    idle_fraction: self.missized_idle_fraction.unwrap_or(d.idle_fraction),
                },
            )
        })
    }
}

impl Config {
    /// Preemption's rules, when `preempt` turns it on.
    pub fn preempt(&self) -> Option<topo_core::policy::Preempt> {
        let d = topo_core::policy::Preempt::default();
        self.preempt.then(|| topo_core::policy::Preempt {
            min_run: self.preempt_min_run_s.map_or(d.min_run, |s| s as i64),
            max_suspensions: self.preempt_max_suspensions.unwrap_or(d.max_suspensions),
            min_xf: self.preempt_min_xf.unwrap_or(d.min_xf),
        })
    }

    /// Defragmenting migration's settings, when `defrag` is on.
    pub fn defrag(&self) -> Option<host::Defrag> {
        let d = topo_core::defrag::DefragLimits::default();
        let limits = topo_core::defrag::DefragLimits {
            max_moves: self.defrag_max_moves.unwrap_or(d.max_moves),
            ..d
        };
        self.defrag.then(|| host::Defrag {
            min_run: self.migrate_min_run_s.unwrap_or(60) as i64,
            gap: self.migrate_gap_s.unwrap_or(300) as i64,
            limits,
        })
    }

    /// The host's gang configuration, when `gang_rows` turns slicing on.
    pub fn gang(&self) -> Option<host::GangConfig> {
        Some(host::GangConfig {
            gang: topo_core::policy::Gang {
                slice: self.gang_slice_s.unwrap_or(30) as i64,
                rows: self.gang_rows?,
            },
            all_jobs: self.gang_all_jobs,
            prime_queues: self.gang_prime_queues.clone(),
        })
    }
}

impl Config {
    /// The connection limits this configuration sets.
    pub fn limits(&self) -> conn::Limits {
        let d = conn::Limits::default();
        conn::Limits {
            max_connections: self.max_connections.unwrap_or(d.max_connections),
            max_connections_per_user: self
                .max_connections_per_user
                .unwrap_or(d.max_connections_per_user),
            idle: self.idle_timeout_ms.map_or(d.idle, Duration::from_millis),
            line: self.line_timeout_ms.map_or(d.line, Duration::from_millis),
            write: self.write_timeout_ms.map_or(d.write, Duration::from_millis),
        }
    }
}

/// Checks a `cgroup_subtree` value: one or more names separated by `/`, each made only of
/// letters, digits and `._-:@+` and not `.` or `..`, so that it stays under the cgroup mounts.
pub fn check_subtree(subtree: &str) -> Result<(), String> {
    if subtree.is_empty() || subtree.len() > 255 {
        return Err(format!("cgroup_subtree {subtree:?} must be 1 to 255 bytes"));
    }
    for part in subtree.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(format!("cgroup_subtree {subtree:?}: {part:?} is not a directory name (no leading or trailing '/', no '.', '..' or '//')"));
        }
        if let Some(c) =
            part.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-:@+".contains(*c)))
        {
            return Err(format!("cgroup_subtree {subtree:?}: character {c:?} is not allowed (letters, digits and ._-:@+ only)"));
        }
    }
    Ok(())
}

/// The cgroup backends: `auto` (v2 where its cpuset controller is offered, else v1), `v1`,
/// `v2`, or `fake` (in memory; jobs are not confined).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupKind {
    /// v2 where its cpuset controller is offered, else v1.
    #[default]
    Auto,
    /// The v1 hierarchies.
    V1,
    /// The unified hierarchy.
    V2,
    /// In memory: for trying topod without root.
    Fake,
}

impl std::str::FromStr for CgroupKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CgroupKind::Auto),
            "v1" => Ok(CgroupKind::V1),
            "v2" => Ok(CgroupKind::V2),
            "fake" => Ok(CgroupKind::Fake),
            other => Err(format!("{other:?}: expected auto, v1, v2 or fake")),
        }
    }
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
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
        Config::parse(path, &text)
    }

    /// Parses configuration text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Invalid { path: path.to_path_buf(), what: e.to_string() })?;
        if config.tcp_listen.is_some() && config.tcp_key_file.is_none() {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                what: "tcp_listen needs tcp_key_file".into(),
            });
        }
        if let Some(subtree) = &config.cgroup_subtree {
            check_subtree(subtree)
                .map_err(|what| ConfigError::Invalid { path: path.to_path_buf(), what })?;
        }
        if config.max_connections == Some(0) || config.max_connections_per_user == Some(0) {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                what: "max_connections and max_connections_per_user must be at least 1".into(),
            });
        }
        let bad_gang = if config.gang_rows.is_some_and(|r| !(2..=64).contains(&r)) {
            Some("gang_rows must be 2 to 64 (leave it out to turn slicing off)")
        } else if config.gang_slice_s.is_some_and(|s| !(1..=86_400).contains(&s)) {
            Some("gang_slice_s must be 1 to 86400 (seconds)")
        } else {
            None
        };
        let bad_gang =
            bad_gang.or(if config.preempt_min_xf.is_some_and(|x| !(x.is_finite() && x >= 1.0)) {
                Some("preempt_min_xf must be 1 or more (an expansion factor)")
            } else if config.preempt_min_run_s.is_some_and(|s| s > 31_536_000) {
                Some("preempt_min_run_s must be at most 31536000 (a year)")
            } else {
                None
            });
        let conflict = topo_core::policy::rules_conflict(
            config.preempt,
            config.gang_rows.is_some(),
            config.equipartition,
        )
        .map(|why| {
            format!("equipartition does not go with preempt or gang_rows: {why}; turn one off")
        });
        let bad_gang = bad_gang.map(str::to_string).or(conflict).or(
            if config.metrics_interval_s.is_some_and(|s| !(1..=3600).contains(&s)) {
                Some("metrics_interval_s must be 1 to 3600 (seconds)")
            } else if config.missized_settle_s.is_some_and(|s| s > 31_536_000) {
                Some("missized_settle_s must be at most 31536000 (a year)")
            } else if config.missized_busy_ratio.is_some_and(|x| !(x.is_finite() && x >= 1.0)) {
                Some("missized_busy_ratio must be 1 or more (times the CPUs given)")
            } else if config.missized_idle_fraction.is_some_and(|x| !(x > 0.0 && x <= 1.0)) {
                Some("missized_idle_fraction must be above 0 and at most 1 (a share of the CPUs given)")
            } else {
                None
            }
            .map(str::to_string),
        );
        if let Some(what) = bad_gang {
            return Err(ConfigError::Invalid { path: path.to_path_buf(), what });
        }
        for (key, ms) in [
            ("idle_timeout_ms", config.idle_timeout_ms),
            ("line_timeout_ms", config.line_timeout_ms),
            ("write_timeout_ms", config.write_timeout_ms),
        ] {
            if ms.is_some_and(|ms| !(10..=3_600_000).contains(&ms)) {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    what: format!("{key} must be 10 to 3600000 (milliseconds)"),
                });
            }
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
        let c = Config::parse(p, "reserved_cpus = \"0-1\"\nadmin_uids = [1000]\ncgroup = \"v1\"\n")
            .unwrap();
        assert_eq!(c.admin_uids, [1000]);
        let e = Config::parse(p, "socket = 3").unwrap_err().to_string();
        assert!(e.contains("topod.toml") && e.contains("socket"), "{e}");
        let e = Config::parse(p, "sockett = \"/x\"").unwrap_err().to_string();
        assert!(e.contains("unknown field") && e.contains("sockett"), "{e}");
        let e = Config::parse(p, "reserved_cpus = \"0-x\"").unwrap_err().to_string();
        assert!(e.contains("reserved_cpus"), "{e}");
        let e = Config::parse(p, "cgroup = \"v3\"").unwrap_err().to_string();
        assert!(
            e.contains("expected one of `auto`, `v1`, `v2`, `fake`") && e.contains("line 1"),
            "{e}"
        );
        let e = Config::parse(p, "tcp_listen = \"0.0.0.0:7979\"").unwrap_err().to_string();
        assert!(e.contains("tcp_key_file"), "{e}");
        let e = Config::parse(p, "tcp_allow = [\"10.0.0.0/33\"]").unwrap_err().to_string();
        assert!(e.contains("10.0.0.0/33"), "{e}");
        let e = Config::parse(p, "strategy = \"fast\"").unwrap_err().to_string();
        assert!(e.contains("best-fit"), "{e}");
        for bad in ["../../../../tmp/x", "/abs", "a//b", "a/./b", "a/..", "", "x y", "a/"] {
            let e = Config::parse(p, &format!("cgroup_subtree = {bad:?}")).unwrap_err().to_string();
            assert!(e.contains("cgroup_subtree"), "{bad}: {e}");
        }
        assert_eq!(
            Config::parse(p, "cgroup_subtree = \"batch/topo\"").unwrap().cgroup_subtree.as_deref(),
            Some("batch/topo")
        );
        let e = Config::parse(p, "max_connections_per_user = 0").unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        assert_eq!(Config::parse(p, "max_connections = 9").unwrap().limits().max_connections, 9);
        assert_eq!(Config::parse(p, "").unwrap().sampling(), None);
        let (every, rules) = Config::parse(p, "metrics_textfile = \"/x.prom\"\nmetrics_interval_s = 2\nmissized_idle_fraction = 0.6\n")
            .unwrap()
            .sampling()
            .unwrap();
        assert_eq!(
            (every, rules.idle_fraction, rules.busy_ratio),
            (Duration::from_secs(2), 0.6, 1.25)
        );
        for bad in [
            "metrics_interval_s = 0",
            "missized_busy_ratio = 0.5",
            "missized_idle_fraction = 0.0",
            "metrics_allow = [\"1.2.3.4/40\"]",
        ] {
            let e = Config::parse(p, bad).unwrap_err().to_string();
            assert!(
                e.contains(bad.split(' ').next().unwrap()) || e.contains("1.2.3.4/40"),
                "{bad}: {e}"
            );
        }
    }
}
