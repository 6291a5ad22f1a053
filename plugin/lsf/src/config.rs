//! The module's configuration file and its log.

use serde::Deserialize;
use std::path::{Path, PathBuf};
use topo_plugin_core::CacheConfig;

/// The whole file: `[lsf]` for the module, `[cache]` for the host-state cache.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModuleConfig {
    /// The module's own settings.
    pub lsf: LsfConfig,
    /// Where host states come from and how old they may be.
    pub cache: CacheConfig,
}

/// The `[lsf]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LsfConfig {
    /// The resource-requirement handler id (100-199; must differ from other modules').
    pub handler_id: i32,
    /// The first of the four custom pending reasons topo uses (20001-24997): +0 bad request,
    /// +1 does not fit this host, +2 host state unknown (fail-closed), +3 host changed since the
    /// match.
    pub reason_base: i32,
    /// The log file.
    pub log_file: PathBuf,
    /// The log level: error, warn, info, debug or trace. At debug the module logs every
    /// `-extsched` element it receives, so that a site can see which element holds the job's
    /// string.
    pub log_level: String,
    /// Where requests longer than a handler key may be are kept for a new scheduler process
    /// (its replays of running jobs name them by a hash): a directory of the scheduler user's
    /// own, mode 0700. Default: `schmod_topo.keys` beside the log file; if that cannot be
    /// used, the module warns and keeps them in memory only.
    pub key_dir: Option<PathBuf>,
}

impl Default for LsfConfig {
    fn default() -> Self {
        let dir = std::env::var_os("LSF_LOGDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp"));
        Self {
            handler_id: 142,
            reason_base: 20001,
            log_file: dir.join("schmod_topo.log"),
            log_level: "info".into(),
            key_dir: None,
        }
    }
}

/// Where the file is: `$TOPO_LSF_CONF`, else `$LSF_ENVDIR/topo-lsf.toml`, else
/// `/etc/topo/topo-lsf.toml`. A missing file means the defaults.
pub fn path() -> PathBuf {
    if let Some(p) = std::env::var_os("TOPO_LSF_CONF") {
        return PathBuf::from(p);
    }
    std::env::var_os("LSF_ENVDIR")
        .map(|d| PathBuf::from(d).join("topo-lsf.toml"))
        .unwrap_or_else(|| PathBuf::from("/etc/topo/topo-lsf.toml"))
}

/// Reads and checks the file at `path`.
pub fn load(path: &Path) -> Result<ModuleConfig, String> {
    let config: ModuleConfig = match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => ModuleConfig::default(),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if !(100..=199).contains(&config.lsf.handler_id) {
        return Err(format!(
            "{}: [lsf] handler_id = {}: must be 100 to 199",
            path.display(),
            config.lsf.handler_id
        ));
    }
    if !(20001..=24997).contains(&config.lsf.reason_base) {
        return Err(format!(
            "{}: [lsf] reason_base = {}: must be 20001 to 24997 (topo uses four reasons from it)",
            path.display(),
            config.lsf.reason_base
        ));
    }
    if !["error", "warn", "info", "debug", "trace"].contains(&config.lsf.log_level.as_str()) {
        return Err(format!(
            "{}: [lsf] log_level = {:?}: must be error, warn, info, debug or trace",
            path.display(),
            config.lsf.log_level
        ));
    }
    config.cache.validate().map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(config)
}

/// Sends the module's `tracing` events to the log file (appending). The scheduler is not a
/// Rust program, so nothing else installs a subscriber.
pub fn start_log(config: &LsfConfig) -> Result<(), String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&config.log_file)
        .map_err(|e| format!("log file {}: {e}", config.log_file.display()))?;
    let filter = tracing_subscriber::EnvFilter::new(format!(
        "schmod_topo={0},topo_plugin_core={0}",
        config.log_level
    ));
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_env_filter(filter)
        .finish();
    // A second sched_init (reconfiguration) keeps the first subscriber.
    let _ = tracing::subscriber::set_global_default(subscriber);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        let dir = tempfile_dir();
        let p = dir.join("topo-lsf.toml");
        for (text, expect) in [
            ("[lsf]\nhandler_id = 18", "handler_id = 18"),
            ("[lsf]\nreason_base = 100", "reason_base = 100"),
            ("[lsf]\nlog_level = \"loud\"", "log_level"),
            ("[lsf]\nhandlerid = 120", "unknown field"),
            ("[cache]\ntimeout_ms = 0", "timeout_ms"),
        ] {
            std::fs::write(&p, text).unwrap();
            let e = load(&p).unwrap_err();
            assert!(e.contains(expect) && e.contains("topo-lsf.toml"), "{e}");
        }
        assert_eq!(load(&dir.join("absent.toml")).unwrap().lsf.handler_id, 142);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_packaged_example_loads() {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../packaging/lsf/topo-lsf.toml");
        let c = load(&p).unwrap();
        assert_eq!(
            (c.lsf.handler_id, c.lsf.reason_base, c.cache.refresh_interval_ms),
            (142, 20001, 5000)
        );
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("topo-lsf-config-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
