//! The plug-ins' cache settings (a `[cache]` table in each plug-in's TOML file).

use crate::address::{Address, AddressError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// What to do with a host whose topology state is unknown: its topod did not answer, or its
/// state went stale. (A host whose topod has not been asked yet, in the first refresh after a
/// start, is offered to no job either way: [`crate::cache::HostStatus::asked`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Unreachable {
    /// Keep the host, ranked after every host whose state is known (the job may then start on
    /// a host topod could not vouch for; topod still places it when it starts).
    #[default]
    Open,
    /// Remove the host from the candidates, with a reason.
    Closed,
}

/// The `[cache]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Hosts and their topod addresses (`"tcp:HOST:PORT"` or `"unix:/path"`).
    pub hosts: BTreeMap<String, String>,
    /// Address of any other host the scheduler asks about, `{host}` standing for its name; an
    /// empty string means only the listed hosts are known.
    pub address_template: String,
    /// The DNS domain host names are completed with, without a leading dot (`""`: none). Every
    /// host is known by its configured name, its short name, and its short name with this
    /// domain, so `n1` and `n1.<domain>` find the same host whichever of them is configured or
    /// offered by the batch system. Without a domain, a name with any domain also finds the
    /// host configured by its short name.
    pub domain: String,
    /// File holding the shared key of topod's TCP listener (`tcp_key_file` in topod.toml).
    pub key_file: Option<PathBuf>,
    /// How often every host is fetched again, in milliseconds.
    pub refresh_interval_ms: u64,
    /// Connect, read and write time-out per host, in milliseconds; one whole reply may take
    /// four times this (a topod dripping its reply would otherwise hold its host's fetch).
    pub timeout_ms: u64,
    /// A host not refreshed for this long counts as unknown, in milliseconds. A failing host is
    /// tried again after 1, 2, 4, then 8 intervals, never later than half of this.
    pub stale_after_ms: u64,
    /// Hosts fetched at once.
    pub workers: usize,
    /// How many nice levels below the scheduler's own thread the refresher and its fetch
    /// threads run (0 to 19), so that a refresh of thousands of hosts does not take the CPU
    /// from the scheduler's callbacks.
    pub refresh_nice: u32,
    /// Policy for hosts whose state is unknown.
    pub unreachable: Unreachable,
    /// A tentative reservation the host never confirms is dropped after this many seconds.
    pub reservation_ttl_s: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            hosts: BTreeMap::new(),
            address_template: "tcp:{host}:7979".into(),
            domain: String::new(),
            key_file: None,
            refresh_interval_ms: 5_000,
            timeout_ms: 1_000,
            stale_after_ms: 30_000,
            workers: 16,
            refresh_nice: 10,
            unreachable: Unreachable::Open,
            reservation_ttl_s: 300,
        }
    }
}

/// A setting that does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A host's address.
    #[error("[cache] hosts.{host}: {source}")]
    Address {
        /// The host.
        host: String,
        /// Why.
        #[source]
        source: AddressError,
    },
    /// The template.
    #[error("[cache] address_template: {0}")]
    Template(#[source] AddressError),
    /// A number out of range.
    #[error("[cache] {key} = {value}: {why}")]
    Range {
        /// The key.
        key: &'static str,
        /// Its value.
        value: u64,
        /// Why.
        why: &'static str,
    },
    /// The domain.
    #[error("[cache] domain = {0:?}: not a DNS domain (letters, digits, '-' and '.')")]
    Domain(String),
    /// The key file.
    #[error("[cache] key_file {path}: {source}")]
    KeyFile {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl CacheConfig {
    /// Checks every value and returns the hosts with parsed addresses.
    pub fn validate(&self) -> Result<Vec<(String, Address)>, ConfigError> {
        let range = |key, value: u64, ok: bool, why| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::Range { key, value, why })
            }
        };
        range(
            "timeout_ms",
            self.timeout_ms,
            (1..=60_000).contains(&self.timeout_ms),
            "must be 1 to 60000",
        )?;
        range(
            "refresh_interval_ms",
            self.refresh_interval_ms,
            self.refresh_interval_ms >= 100,
            "must be at least 100",
        )?;
        range(
            "stale_after_ms",
            self.stale_after_ms,
            self.stale_after_ms > self.refresh_interval_ms,
            "must be longer than refresh_interval_ms",
        )?;
        range(
            "workers",
            self.workers as u64,
            (1..=256).contains(&self.workers),
            "must be 1 to 256",
        )?;
        range(
            "refresh_nice",
            u64::from(self.refresh_nice),
            self.refresh_nice <= 19,
            "must be 0 to 19",
        )?;
        let domain = self.domain.trim_start_matches('.');
        if domain.chars().any(|c| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'))
            || domain.contains("..")
            || domain.ends_with('.')
        {
            return Err(ConfigError::Domain(self.domain.clone()));
        }
        if !self.address_template.is_empty() {
            Address::from_template(&self.address_template, "host")
                .map_err(ConfigError::Template)?;
        }
        self.hosts
            .iter()
            .map(|(host, text)| {
                Address::parse(text)
                    .map(|a| (host.clone(), a))
                    .map_err(|source| ConfigError::Address { host: host.clone(), source })
            })
            .collect()
    }

    /// The shared key, when a key file is configured.
    pub fn read_key(&self) -> Result<Option<String>, ConfigError> {
        let Some(path) = &self.key_file else { return Ok(None) };
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::KeyFile { path: path.display().to_string(), source })?;
        Ok(Some(text.trim().to_string()))
    }

    /// The per-host time-out.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The refresh interval.
    pub fn refresh_interval(&self) -> Duration {
        Duration::from_millis(self.refresh_interval_ms)
    }

    /// How old an entry may be.
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        assert!(CacheConfig::default().validate().unwrap().is_empty());
        let c: CacheConfig = toml::from_str("timeout_ms = 0").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("timeout_ms = 0"));
        let c: CacheConfig = toml::from_str("[hosts]\nn1 = \"n1:7979\"").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("hosts.n1"));
        assert!(toml::from_str::<CacheConfig>("timeout = 5")
            .unwrap_err()
            .to_string()
            .contains("unknown field"));
        let c: CacheConfig =
            toml::from_str("unreachable = \"closed\"\n[hosts]\nn1 = \"tcp:n1:7979\"").unwrap();
        assert_eq!(c.unreachable, Unreachable::Closed);
        assert_eq!(c.validate().unwrap(), vec![("n1".to_string(), Address::Tcp("n1:7979".into()))]);
        let c: CacheConfig = toml::from_str("domain = \"cluster.example\"").unwrap();
        assert_eq!(c.domain, "cluster.example");
        assert!(c.validate().is_ok());
        let c: CacheConfig = toml::from_str("domain = \"a b\"").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("domain"));
        let c: CacheConfig = toml::from_str("refresh_nice = 20").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("refresh_nice = 20"));
        let c: CacheConfig = toml::from_str("refresh_nice = 0").unwrap();
        assert!(c.validate().is_ok());
    }
}
