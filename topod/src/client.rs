//! A client of topod's socket, for `topoctl`, `topo-exec` and tests.

use crate::proto::{self, ErrorBody, Op, Request};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached.
    #[error("cannot reach topod at {path}: {source} (is topod running? is the socket path right?)")]
    Connect {
        /// The socket.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection broke or timed out.
    #[error("talking to topod: {0}")]
    Io(#[from] std::io::Error),
    /// The reply is not a valid reply.
    #[error("topod sent an invalid reply: {0}")]
    Reply(#[from] proto::ProtoError),
    /// topod refused or failed.
    #[error("topod: {}", .0.message)]
    Refused(ErrorBody),
}

/// One connection to topod: its local Unix socket, or its read-only TCP listener.
pub struct Client {
    reader: BufReader<Box<dyn Read + Send>>,
    writer: Box<dyn Write + Send>,
}

impl Client {
    /// Connects to the socket at `path`; a reply may take up to a minute (a release waits for
    /// the job's processes to die).
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        Self::connect_with_timeout(path, Duration::from_secs(60))
    }

    /// Connects to the socket at `path`; each read or write may take up to `timeout`.
    pub fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect { path: path.display().to_string(), source })?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        Ok(Client { reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) })
    }

    /// Connects to topod's read-only TCP listener at `address` (`host:port`) and presents the
    /// shared `key`; connecting, and each read or write, may take up to `timeout`.
    pub fn connect_tcp(address: &str, key: &str, timeout: Duration) -> Result<Client, ClientError> {
        let connect_error = |source| ClientError::Connect { path: format!("tcp:{address}"), source };
        let addrs = address.to_socket_addrs().map_err(connect_error)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    stream.set_read_timeout(Some(timeout))?;
                    stream.set_write_timeout(Some(timeout))?;
                    stream.set_nodelay(true)?;
                    let mut writer = stream.try_clone()?;
                    writer.write_all(format!("{key}\n").as_bytes())?;
                    return Ok(Client { reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) });
                }
                Err(e) => last = e,
            }
        }
        Err(connect_error(last))
    }

    /// Sends one operation and returns the result.
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        self.writer.write_all(Request::new(op).to_line().as_bytes())?;
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if line.is_empty() {
            return Err(ClientError::Io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "topod closed the connection without a reply")));
        }
        let reply = proto::parse_reply(&line)?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(ClientError::Refused(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }
}

/// How [`join_self`] moved the calling process into its job's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Joined {
    /// It wrote `0` to the job's v1 `tasks` files itself (root, single-threaded, v1 host).
    Itself,
    /// topod moved it (`join`); `why` says why it did not move itself.
    ByTopod {
        /// Why the cheaper path was not taken.
        why: String,
    },
}

/// Moves the calling process into `job`'s cgroup, through `call` (one operation to topod).
///
/// As root, a single-threaded process on a host with v1 cgroups moves itself, which skips the
/// kernel's global migration lock (see [`crate::cgroup::self_join`]). Either way it then sends
/// `join`: topod confirms a process that is already in (a cheap read) and so counts the job as
/// started (auto-release), and moves one that is not, or only partly, in. Errors are those of
/// that `join`.
pub fn join_self<E: std::fmt::Display>(job: &str, mut call: impl FnMut(Op) -> Result<serde_json::Value, E>) -> Result<Joined, E> {
    let why = if !nix::unistd::geteuid().is_root() {
        "not root".to_string()
    } else {
        match call(Op::SelfJoinFiles { job: job.to_string() }) {
            Err(e) => format!("topod gave no files: {e}"),
            Ok(reply) => {
                let files: Vec<std::path::PathBuf> = reply["files"].as_array().into_iter().flatten().filter_map(|f| f.as_str()).map(Into::into).collect();
                if files.is_empty() {
                    "this host's cgroups offer no self-join".to_string()
                } else {
                    match crate::cgroup::self_join(&files) {
                        Ok(()) => {
                            call(Op::Join { job: job.to_string(), pid: std::process::id() as i32 })?;
                            return Ok(Joined::Itself);
                        }
                        Err(e) => e.to_string(),
                    }
                }
            }
        }
    };
    call(Op::Join { job: job.to_string(), pid: std::process::id() as i32 })?;
    Ok(Joined::ByTopod { why })
}
