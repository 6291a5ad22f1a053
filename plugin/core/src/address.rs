//! Where a host's topod answers.

use std::fmt;
use std::path::PathBuf;

/// A topod endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// The read-only TCP listener, `host:port`.
    Tcp(String),
    /// A Unix socket (the local host, or tests).
    Unix(PathBuf),
}

/// An address that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad topod address {text:?}: {why} (expected \"tcp:HOST:PORT\" or \"unix:/path/to/topod.sock\")")]
pub struct AddressError {
    /// What was given.
    pub text: String,
    /// What is wrong.
    pub why: &'static str,
}

impl Address {
    /// Parses `tcp:HOST:PORT` or `unix:/PATH`.
    pub fn parse(text: &str) -> Result<Address, AddressError> {
        let bad = |why| AddressError { text: text.to_string(), why };
        if let Some(path) = text.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(bad("a Unix socket path must be absolute"));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        let Some(hostport) = text.strip_prefix("tcp:") else {
            return Err(bad("unknown scheme"));
        };
        let Some((host, port)) = hostport.rsplit_once(':') else {
            return Err(bad("no port"));
        };
        if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("empty host name or one with spaces"));
        }
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(bad("the port is not a number from 1 to 65535"));
        }
        Ok(Address::Tcp(hostport.to_string()))
    }

    /// The address of `host` from a template such as `tcp:{host}:7979`.
    pub fn from_template(template: &str, host: &str) -> Result<Address, AddressError> {
        Address::parse(&template.replace("{host}", host))
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp(a) => write!(f, "tcp:{a}"),
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert_eq!(Address::parse("tcp:node01:7979").unwrap(), Address::Tcp("node01:7979".into()));
        assert_eq!(Address::parse("tcp:[::1]:7979").unwrap(), Address::Tcp("[::1]:7979".into()));
        assert_eq!(
            Address::parse("unix:/run/topo/topod.sock").unwrap(),
            Address::Unix(topo_core::proto::DEFAULT_SOCKET.into())
        );
        for bad in [
            "node01:7979",
            "tcp:node01",
            "tcp::7979",
            "tcp:node01:0",
            "tcp:node01:99999",
            "unix:relative.sock",
            "tcp:a b:1",
        ] {
            let e = Address::parse(bad).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
        assert_eq!(
            Address::from_template("tcp:{host}:7979", "n7").unwrap().to_string(),
            "tcp:n7:7979"
        );
    }
}
