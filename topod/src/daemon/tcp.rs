//! The optional read-only TCP listener: the scheduler's plug-in reads each host's free map
//! from it. Off by default. A connection is accepted only from an allowed address, and serves
//! nothing until its first line is the shared key; after that, the read operations of the
//! socket protocol (version, topology, free map, fit, list). Changes are refused.

use super::host::Host;
use super::server::{self, Admins, Peer};
use crate::proto::{self, ErrorCode, Op, Reply};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

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
        let net: IpAddr = addr.trim().parse().map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(|| format!("{text:?}: prefix must be 0 to {max}"))?,
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

/// Serves the read-only listener until it fails.
pub fn serve(listener: TcpListener, host: Arc<Mutex<Host>>, allow: Arc<Vec<Allow>>, key: Arc<String>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let ip = match stream.peer_addr() {
            Ok(a) => a.ip(),
            Err(_) => continue,
        };
        if !allow.iter().any(|a| a.contains(ip)) {
            tracing::warn!("TCP connection from {ip} refused: not in tcp_allow");
            continue;
        }
        let (host, key) = (host.clone(), key.clone());
        std::thread::spawn(move || {
            if let Err(e) = connection(stream, &host, &key) {
                tracing::debug!("TCP connection from {ip} ended: {e}");
            }
        });
    }
}

fn connection(stream: TcpStream, host: &Mutex<Host>, key: &str) -> std::io::Result<()> {
    stream.set_read_timeout(Some(server::IDLE_TIMEOUT))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut first = Vec::new();
    (&mut reader).take(4096).read_until(b'\n', &mut first)?;
    let given = String::from_utf8_lossy(&first);
    if !same(given.trim_end_matches(['\n', '\r']).as_bytes(), key.as_bytes()) {
        writer.write_all(Reply::error(ErrorCode::Forbidden, "wrong or missing key: send the shared key as the first line").to_line().as_bytes())?;
        return Ok(());
    }
    // No kernel credentials over TCP: the peer is nobody, and nobody may only read.
    let nobody = Peer { pid: 0, uid: u32::MAX, gid: u32::MAX };
    loop {
        let mut line = Vec::new();
        let n = (&mut reader).take(proto::MAX_LINE_BYTES as u64 + 2).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        let reply = match proto::parse_request(&line) {
            Ok(req) if matches!(req.op, Op::Allocate { .. } | Op::Join { .. } | Op::SelfJoinFiles { .. } | Op::Release { .. }) => {
                Reply::error(ErrorCode::Forbidden, "the TCP listener is read-only; change state through the local socket")
            }
            Ok(req) => server::handle(host, &Admins::default(), &nobody, req.op),
            Err(e) => Reply::error(ErrorCode::BadRequest, e.to_string()),
        };
        writer.write_all(reply.to_line().as_bytes())?;
    }
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
