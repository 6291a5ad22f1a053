//! The optional read-only TCP listener: the scheduler's plug-in reads each host's free map
//! from it. Off by default. A connection is accepted only from an allowed address, and serves
//! nothing until its first line is the shared key; after that, the read operations of the
//! socket protocol (version, topology, free map, fit, list). Changes are refused.
//!
//! TCP connections never take the Unix socket's places: whatever arrives over the network, with
//! or without the key, takes no place a local user or a job's `topo-exec` needs. Until it has
//! sent its key (within [`KEY_DEADLINE`]) a connection is one of at most [`KEY_WAITING`], the
//! oldest giving way to a new one ([`Unproven`]), so silent connections from however many
//! addresses never keep a key holder out; once keyed, it counts against the listener's own
//! budget ([`TCP_MAX_CONNECTIONS`], [`TCP_MAX_PER_ADDRESS`] per address). Refused addresses are
//! logged once a minute each ([`RefusalLog`]).

use super::conn::{
    AcceptErrors, Admitted, Gate, Holder, Limits, Line, LineReader, RefusalLog, Unproven,
    UnprovenPlace,
};
use super::server::{Peer, Server};
use std::io::Write;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use topo_core::proto::{ErrorCode, Reply};

/// Keyed TCP connections open at once, all addresses together (the scheduler's plug-in opens
/// one per fetch of a host).
pub const TCP_MAX_CONNECTIONS: usize = 64;
/// Keyed TCP connections open at once from one address.
pub const TCP_MAX_PER_ADDRESS: usize = 8;
/// Connections waiting for their key, at most (past it, the oldest gives way).
pub const KEY_WAITING: usize = 64;
/// How long a new TCP connection has, at most, to send its whole key line: half of it before
/// the first byte, half from there to the newline.
pub const KEY_DEADLINE: Duration = Duration::from_secs(2);

/// The TCP listener's own limits for keyed connections: its budget, and the socket's timeouts.
pub fn tcp_limits(socket: Limits) -> Limits {
    Limits {
        max_connections: TCP_MAX_CONNECTIONS,
        max_connections_per_user: TCP_MAX_PER_ADDRESS,
        ..socket
    }
}

/// One allow-list entry: an address, or a network in CIDR form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    net: IpAddr,
    prefix: u8,
}

impl Allow {
    /// Parses `192.0.2.7`, `10.1.0.0/16`, `::1` or `fd00::/8`.
    pub fn parse(text: &str) -> Result<Allow, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let net: IpAddr =
            addr.trim().parse().map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= max)
                .ok_or_else(|| format!("{text:?}: prefix must be 0 to {max}"))?,
            None => max,
        };
        Ok(Allow { net, prefix })
    }

    /// Whether `ip` is inside.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |a: IpAddr| -> (u128, u32) {
            match a {
                IpAddr::V4(v) => (u128::from(u32::from(v)), 32),
                IpAddr::V6(v) => (u128::from(v), 128),
            }
        };
        let ((n, width), (i, iw)) = (bits(self.net), bits(ip.to_canonical()));
        if width != iw {
            return false;
        }
        let shift = width - u32::from(self.prefix);
        if shift >= 128 {
            return true;
        }
        (n >> shift) == (i >> shift)
    }
}

impl<'de> serde::Deserialize<'de> for Allow {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Allow::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// Serves the read-only listener until it fails (see the module documentation).
pub fn serve(listener: TcpListener, server: Arc<Server>, allow: Arc<Vec<Allow>>, key: Arc<String>) {
    let keyed = Gate::new(tcp_limits(server.gate.limits()));
    let waiting = Unproven::new(KEY_WAITING);
    let mut refusals = RefusalLog::new("TCP", "tcp_allow");
    let mut errors = AcceptErrors::new();
    loop {
        let (stream, addr) = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                errors.failed("the TCP listener", &e);
                continue;
            }
        };
        let ip = addr.ip().to_canonical();
        if !allow.iter().any(|a| a.contains(ip)) {
            if let Some(line) = refusals.refused(ip, Instant::now()) {
                tracing::warn!("{line}");
            }
            continue;
        }
        let Some(place) = waiting.enter(&stream) else { continue };
        let (server, key, keyed) = (server.clone(), key.clone(), keyed.clone());
        let spawned = std::thread::Builder::new().name("topod-tcp".into()).spawn(move || {
            if let Err(e) = connection(stream, &server, &key, place, &keyed, ip) {
                tracing::debug!("TCP connection from {ip} ended: {e}");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a thread for a TCP connection: {e}");
        }
    }
}

fn connection(
    mut stream: TcpStream,
    server: &Server,
    key: &str,
    place: UnprovenPlace,
    keyed: &Arc<Gate>,
    ip: IpAddr,
) -> std::io::Result<()> {
    super::server::lower_priority();
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(server.gate.limits().write))?;
    // The key must come first, whole, within its deadline; then the socket's limits apply.
    let limits = server.gate.limits();
    let half = KEY_DEADLINE / 2;
    let key_limits = Limits { idle: limits.idle.min(half), line: limits.line.min(half), ..limits };
    let mut lines = LineReader::new(topo_core::proto::MAX_LINE_BYTES, &key_limits);
    let given = match lines.next(&mut stream) {
        Ok(Line::Complete(line)) => line,
        // Gone, or shut down to make way for a newer connection: nothing to say.
        Ok(Line::Closed) | Err(_) => return Ok(()),
        Ok(_) => Vec::new(),
    };
    let lines = lines.with_limits(&limits);
    let given = String::from_utf8_lossy(&given);
    if !same(given.trim_end_matches('\r').as_bytes(), key.as_bytes()) {
        stream.write_all(
            Reply::error(
                ErrorCode::Forbidden,
                "wrong or missing key: send the shared key as the first line",
            )
            // Before any request: in the oldest version, which every client reads.
            .in_version(topo_core::proto::OLDEST_PROTOCOL_VERSION)
            .to_line()
            .as_bytes(),
        )?;
        return Ok(());
    }
    drop(place);
    let admitted: Admitted = match keyed.admit(Holder::Ip(ip), false) {
        Ok(a) => a,
        Err(why) => {
            super::server::refuse(stream, server, &why);
            return Ok(());
        }
    };
    // No kernel credentials over TCP: the peer is nobody, and nobody may only read.
    super::server::connection(stream, lines, server, &Peer::nobody(), true, admitted)
}

/// Compares in time that does not depend on where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists() {
        let net = Allow::parse("10.1.0.0/16").unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(Allow::parse("127.0.0.1").unwrap().contains("127.0.0.1".parse().unwrap()));
        assert!(Allow::parse("0.0.0.0/0").unwrap().contains("192.0.2.1".parse().unwrap()));
        assert!(Allow::parse("::1").unwrap().contains("::1".parse().unwrap()));
        assert!(Allow::parse("127.0.0.1").unwrap().contains("::ffff:127.0.0.1".parse().unwrap()));
        assert!(Allow::parse("10.0.0.0/33").is_err());
        assert!(Allow::parse("host.example").is_err());
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"abc", b"ab"));
    }
}
