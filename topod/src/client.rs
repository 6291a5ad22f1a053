//! A client of topod's socket, for `topoctl`, `topo-exec` and tests.

use crate::cgroup::{CgroupError, SelfJoin};
use crate::proto::{self, ErrorBody, Op, Request};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached.
    #[error(
        "cannot reach topod at {path}: {source} (is topod running? is the socket path right?)"
    )]
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

    /// Connects to the socket at `path` (as root, to the administrators' socket beside it when
    /// there is one: see [`proto::admin_socket_for`]); each read or write may take up to
    /// `timeout`.
    pub fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let admin = nix::unistd::geteuid().is_root().then(|| proto::admin_socket_for(path));
        let stream = match admin.and_then(|a| UnixStream::connect(a).ok()) {
            Some(s) => s,
            None => UnixStream::connect(path).map_err(|source| ClientError::Connect {
                path: path.display().to_string(),
                source,
            })?,
        };
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        Ok(Client { reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) })
    }

    /// Connects to topod's read-only TCP listener at `address` (`host:port`) and presents the
    /// shared `key`; connecting, and each read or write, may take up to `timeout`.
    pub fn connect_tcp(address: &str, key: &str, timeout: Duration) -> Result<Client, ClientError> {
        let connect_error =
            |source| ClientError::Connect { path: format!("tcp:{address}"), source };
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
                    return Ok(Client {
                        reader: BufReader::new(Box::new(stream)),
                        writer: Box::new(writer),
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(connect_error(last))
    }

    /// Sends one operation and reads its result as `T` (one of [`proto::reply`], or the types
    /// the reply documentation names): a reply of another shape is an error that says which.
    pub fn call_as<T: serde::de::DeserializeOwned>(&mut self, op: Op) -> Result<T, ClientError> {
        let name = op_name(&op);
        let value = self.call(op)?;
        serde_json::from_value(value).map_err(|e| {
            ClientError::Reply(proto::ProtoError::Invalid(format!("reply to {name}: {e}")))
        })
    }

    /// `version`.
    pub fn version(&mut self) -> Result<proto::reply::Version, ClientError> {
        self.call_as(Op::Version)
    }

    /// `free_map`.
    pub fn free_map(&mut self) -> Result<proto::reply::FreeMap, ClientError> {
        self.call_as(Op::FreeMap)
    }

    /// `topology`.
    pub fn topology(&mut self) -> Result<crate::topology::Topology, ClientError> {
        self.call_as(Op::Topology)
    }

    /// `list`.
    pub fn list(&mut self) -> Result<Vec<crate::ledger::JobView>, ClientError> {
        self.call_as(Op::List)
    }

    /// `allocate` (an [`Op::Allocate`]; see [`Op::allocate`]).
    pub fn allocate(&mut self, op: Op) -> Result<crate::ledger::Allocation, ClientError> {
        self.call_as(op)
    }

    /// `release`.
    pub fn release(&mut self, job: &str) -> Result<proto::reply::Release, ClientError> {
        self.call_as(Op::Release { job: job.to_string() })
    }

    /// Sends one operation and returns the result.
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        self.writer.write_all(Request::new(op).to_line().as_bytes())?;
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if line.is_empty() {
            return Err(ClientError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "topod closed the connection without a reply",
            )));
        }
        let reply = proto::parse_reply(&line)?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(ClientError::Refused(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }
}

/// The operation's name, as `op` spells it on the wire.
fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Version => "version",
        Op::Topology => "topology",
        Op::FreeMap => "free_map",
        Op::Fit { .. } => "fit",
        Op::Allocate { .. } => "allocate",
        Op::Join { .. } => "join",
        Op::SelfJoinFiles { .. } => "self_join_files",
        Op::Release { .. } => "release",
        Op::List => "list",
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

/// A failed [`join_self`]; `E` is the error of the caller's conversation with topod.
#[derive(Debug, thiserror::Error)]
pub enum JoinSelfError<E: std::fmt::Display + std::fmt::Debug> {
    /// topod could not be asked, or refused the join.
    #[error("{0}")]
    Topod(E),
    /// The process began to move itself and a write failed: it may be in some of the job's
    /// hierarchies and not others. topod is not asked to finish (it would recreate a hierarchy
    /// that a release is removing), so the caller should fail.
    #[error(
        "moving itself into the job's cgroup failed part way ({0}); is the job being released?"
    )]
    Moving(CgroupError),
    /// It moved itself in, but topod did not confirm with `join`.
    #[error("moved itself into the job's cgroup, but topod did not confirm: {0}")]
    Confirm(E),
}

/// Moves the calling process into `job`'s cgroup, through `call` (one operation to topod;
/// `refused` tells a refusal by topod from a broken conversation).
///
/// As root, a single-threaded process on a host with v1 cgroups moves itself, which skips the
/// kernel's global migration lock (see [`SelfJoin`]), and then sends `join`, which topod answers
/// by checking that it is in (a read) and counting the job as started (auto-release). In every
/// other case topod moves it with `join`: not root, several threads, cgroup v2 (no files), a
/// topod that does not know `self_join_files` (it refuses the operation), file names that fail
/// the checks. A conversation that broke (a timeout, say) is an error, never a fallback: the next
/// reply on it might answer the earlier question.
pub fn join_self<E: std::fmt::Display + std::fmt::Debug>(
    job: &str,
    mut call: impl FnMut(Op) -> Result<serde_json::Value, E>,
    refused: impl Fn(&E) -> bool,
) -> Result<Joined, JoinSelfError<E>> {
    let join = Op::Join { job: job.to_string(), pid: std::process::id() as i32 };
    let why = if !nix::unistd::geteuid().is_root() {
        "not root".to_string()
    } else {
        match call(Op::SelfJoinFiles { job: job.to_string() }) {
            Err(e) if refused(&e) => format!("topod gave no files: {e}"),
            Err(e) => return Err(JoinSelfError::Topod(e)),
            Ok(reply) => {
                let files: Vec<PathBuf> = reply["files"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.as_str())
                    .map(Into::into)
                    .collect();
                if files.is_empty() {
                    "this host's cgroups offer no self-join".to_string()
                } else {
                    match SelfJoin::prepare(job, &files) {
                        Err(e) => e.to_string(),
                        Ok(ready) => {
                            ready.move_in().map_err(JoinSelfError::Moving)?;
                            call(join).map_err(JoinSelfError::Confirm)?;
                            return Ok(Joined::Itself);
                        }
                    }
                }
            }
        }
    };
    call(join).map_err(JoinSelfError::Topod)?;
    Ok(Joined::ByTopod { why })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs join_self against a scripted topod; returns the result and the operations sent.
    fn run(
        answer: impl Fn(&Op) -> Result<serde_json::Value, String>,
    ) -> (Result<Joined, JoinSelfError<String>>, Vec<&'static str>) {
        let mut sent = Vec::new();
        let result = join_self(
            "42",
            |op| {
                sent.push(match op {
                    Op::SelfJoinFiles { .. } => "self_join_files",
                    Op::Join { .. } => "join",
                    _ => "other",
                });
                answer(&op)
            },
            |e: &String| e.starts_with("refused"),
        );
        (result, sent)
    }

    #[test]
    fn join_self_falls_back_to_topod_only_when_that_is_safe() {
        let root = nix::unistd::geteuid().is_root();
        let asked_first = |ops: &[&str]| {
            if root {
                ops.first() == Some(&"self_join_files")
            } else {
                ops.first() == Some(&"join")
            }
        };
        // An older topod refuses the operation: topod moves the process.
        let (r, sent) = run(|op| match op {
            Op::SelfJoinFiles { .. } => Err("refused: unknown operation".into()),
            _ => Ok(serde_json::json!({})),
        });
        assert!(matches!(r, Ok(Joined::ByTopod { .. })), "{r:?}");
        assert!(asked_first(&sent) && sent.last() == Some(&"join"), "{sent:?}");
        // No files (cgroup v2), or files that fail the checks: topod moves it.
        for files in [
            serde_json::json!([]),
            serde_json::json!(["/etc/passwd"]),
            serde_json::json!(["/tmp/42/tasks"]),
        ] {
            let (r, sent) = run(|op| match op {
                Op::SelfJoinFiles { .. } => Ok(serde_json::json!({ "job": "42", "files": files })),
                _ => Ok(serde_json::json!({})),
            });
            assert!(matches!(r, Ok(Joined::ByTopod { .. })), "{r:?}");
            assert_eq!(sent.last(), Some(&"join"));
        }
        // A broken conversation is an error, not a fallback on the same connection.
        if root {
            let (r, sent) = run(|_| Err("timed out".into()));
            assert!(matches!(r, Err(JoinSelfError::Topod(ref e)) if e == "timed out"), "{r:?}");
            assert_eq!(sent, ["self_join_files"]);
        }
        // topod's refusal of the join itself is the error.
        let (r, _) = run(|op| match op {
            Op::Join { .. } => Err("refused: job 42 is not allocated".into()),
            _ => Err("refused: unknown operation".into()),
        });
        assert!(r.unwrap_err().to_string().contains("not allocated"));
    }
}
