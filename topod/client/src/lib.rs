//! The one client of topod, for every program that talks to it: `topoctl`, `topo-exec`,
//! `libtopo` (the C API), the Slurm SPANK module and the scheduler-side plug-in core.
//!
//! A [`Client`] is one blocking connection, to topod's Unix socket (as root, to the
//! administrators' socket beside it first) or to its read-only TCP listener, with a deadline on
//! every read and write and no threads of its own: the SPANK module runs inside slurmstepd, which
//! forks the job's tasks. Each operation has a typed call ([`Client::allocate`],
//! [`Client::free_map`], ...) that decodes the reply into its [`proto::reply`] type, so a field
//! renamed on one side is an error that names it, not a silent zero.
//!
//! [`Client::join_self`] moves the calling process into its job's cgroup, by itself where that
//! is cheaper and safe ([`SelfJoin`]), else through topod.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;
use topo_core::proto::{self, ErrorBody, ErrorCode, Op, Request};

/// A failed call. Each names the topod it talked to (a socket path, or `tcp:host:port`).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached.
    #[error(
        "cannot reach topod at {peer}: {source} (is topod running? is the socket path right?)"
    )]
    Connect {
        /// The socket, or `tcp:` and the address.
        peer: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection broke or timed out.
    #[error("talking to topod at {peer}: {source}")]
    Io {
        /// The socket, or `tcp:` and the address.
        peer: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The answer is not a valid reply, or not of the shape the operation's reply has.
    #[error("topod at {peer} sent an answer this client does not understand: {what}")]
    Reply {
        /// The socket, or `tcp:` and the address.
        peer: String,
        /// What was wrong.
        what: String,
    },
    /// topod refused or failed.
    #[error("topod: {}", .0.message)]
    Refused(ErrorBody),
}

impl ClientError {
    /// topod's error code, when topod answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Refused(body) => Some(body.code),
            _ => None,
        }
    }
}

/// One connection to topod: its local Unix socket, or its read-only TCP listener.
pub struct Client {
    peer: String,
    reader: BufReader<Box<dyn Read + Send>>,
    writer: Box<dyn Write + Send>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("peer", &self.peer).finish_non_exhaustive()
    }
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
        let peer = path.display().to_string();
        let admin = nix::unistd::geteuid().is_root().then(|| proto::admin_socket_for(path));
        let stream = match admin.and_then(|a| UnixStream::connect(a).ok()) {
            Some(s) => s,
            None => UnixStream::connect(path)
                .map_err(|source| ClientError::Connect { peer: peer.clone(), source })?,
        };
        let io = |source| ClientError::Io { peer: peer.clone(), source };
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
        let writer = stream.try_clone().map_err(io)?;
        Ok(Client { peer, reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) })
    }

    /// Connects to topod's read-only TCP listener at `address` (`host:port`) and presents the
    /// shared `key`; connecting, and each read or write, may take up to `timeout`.
    pub fn connect_tcp(address: &str, key: &str, timeout: Duration) -> Result<Client, ClientError> {
        let peer = format!("tcp:{address}");
        let connect_error = |source| ClientError::Connect { peer: peer.clone(), source };
        let addrs = address.to_socket_addrs().map_err(connect_error)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    let io = |source| ClientError::Io { peer: peer.clone(), source };
                    stream.set_read_timeout(Some(timeout)).map_err(io)?;
                    stream.set_write_timeout(Some(timeout)).map_err(io)?;
                    stream.set_nodelay(true).map_err(io)?;
                    let mut writer = stream.try_clone().map_err(io)?;
                    writer.write_all(format!("{key}\n").as_bytes()).map_err(io)?;
                    return Ok(Client {
                        peer,
                        reader: BufReader::new(Box::new(stream)),
                        writer: Box::new(writer),
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(connect_error(last))
    }

    /// Where this client is connected: the socket path, or `tcp:` and the address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sends one operation and reads its result as `T` (one of [`proto::reply`], or the types
    /// the reply documentation names): a reply of another shape is an error that says which.
    pub fn call_as<T: serde::de::DeserializeOwned>(&mut self, op: Op) -> Result<T, ClientError> {
        let name = op.name();
        let value = self.call(op)?;
        serde_json::from_value(value).map_err(|e| ClientError::Reply {
            peer: self.peer.clone(),
            what: format!("the reply to {name}: {e}"),
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
    pub fn topology(&mut self) -> Result<topo_core::topology::Topology, ClientError> {
        self.call_as(Op::Topology)
    }

    /// `fit`: where `request` would go now (with `tasks` when the request does not say), or
    /// why it would not fit.
    pub fn fit(
        &mut self,
        request: &str,
        tasks: Option<u32>,
    ) -> Result<topo_core::place::Fit, ClientError> {
        self.call_as(Op::Fit(topo_core::proto::FitArgs {
            tasks,
            ..topo_core::proto::FitArgs::new(request.to_string())
        }))
    }

    /// `list`.
    pub fn list(&mut self) -> Result<Vec<topo_core::ledger::JobView>, ClientError> {
        self.call_as(Op::List)
    }

    /// `allocate` (an [`Op::Allocate`]; see [`Op::allocate`]).
    pub fn allocate(&mut self, op: Op) -> Result<topo_core::ledger::Allocation, ClientError> {
        self.call_as(op)
    }

    /// `join`: topod moves process `pid` (all its threads) into `job`'s cgroup.
    pub fn join(&mut self, job: &str, pid: i32) -> Result<proto::reply::Join, ClientError> {
        self.call_as(Op::Join { job: job.to_string(), pid })
    }

    /// `release`.
    pub fn release(&mut self, job: &str) -> Result<proto::reply::Release, ClientError> {
        self.call_as(Op::Release { job: job.to_string() })
    }

    /// Moves the calling process into `job`'s cgroup: see [`join_self`].
    pub fn join_self(&mut self, job: &str) -> Result<Joined, JoinSelfError<ClientError>> {
        join_self(job, |op| self.call(op), |e| matches!(e, ClientError::Refused(_)))
    }

    /// Sends one operation and returns the result, untyped (the typed calls above decode it).
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        let io = |source| ClientError::Io { peer: self.peer.clone(), source };
        self.writer.write_all(Request::new(op).to_line().as_bytes()).map_err(io)?;
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line).map_err(io)?;
        if line.is_empty() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "topod closed the connection without a reply",
            )));
        }
        let reply = proto::parse_reply(&line)
            .map_err(|e| ClientError::Reply { peer: self.peer.clone(), what: e.to_string() })?;
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
    Moving(SelfJoinError),
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
                // An answer of another shape is treated as no files: topod then moves the process.
                let files = serde_json::from_value::<proto::reply::SelfJoinFiles>(reply)
                    .map(|r| r.files)
                    .unwrap_or_default();
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

/// The calling process, ready to move itself into a job's cgroup by writing `0` to each of the
/// v1 `tasks` files topod names in its reply to `self_join_files`.
///
/// Why: writing a pid to `cgroup.procs` takes the kernel's global threadgroup lock for writing,
/// which waits for an RCU grace period when no migration happened just before (milliseconds
/// each time on a quiet host). A thread moving only itself (`0` written to v1 `tasks`) skips that
/// lock on current kernels (`cgroup_procs_write_start`; on this project's test VM, kernel 6.18:
/// 0.3 ms against 6.3 ms, `tests/cgroup-join-bench.py`).
///
/// The caller is root and the file names come from topod, so they are checked before anything is
/// written: each must be a file named `tasks` in a directory named after the job, on a cgroup v1
/// file system, opened without following links, creating or truncating anything. v1 `tasks`
/// moves one thread, so a process with more than one thread is refused: the others would stay
/// behind. Nothing is written unless every check passes.
#[derive(Debug)]
pub struct SelfJoin {
    files: Vec<(PathBuf, std::fs::File)>,
}

/// Why a process did not, or did not wholly, move itself.
#[derive(Debug, thiserror::Error)]
pub enum SelfJoinError {
    /// A check failed; nothing was written.
    #[error("{0}")]
    Refused(String),
    /// A file could not be opened, read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done (`opening`, `reading`, `writing 0 to`).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl SelfJoin {
    /// Checks the process and opens every file; writes nothing.
    pub fn prepare(job: &str, files: &[PathBuf]) -> Result<SelfJoin, SelfJoinError> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut opened = Vec::with_capacity(files.len());
        for file in files {
            let named_right = file.file_name().is_some_and(|n| n == "tasks")
                && file.parent().and_then(|d| d.file_name()).is_some_and(|n| n == job);
            if !named_right {
                return Err(SelfJoinError::Refused(format!(
                    "{} is not a tasks file of job {job}'s cgroup",
                    file.display()
                )));
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(file)
                .map_err(|source| SelfJoinError::Io {
                    action: "opening",
                    path: file.clone(),
                    source,
                })?;
            let on_cgroup_v1 = nix::sys::statfs::fstatfs(&f)
                .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP_SUPER_MAGIC);
            if !on_cgroup_v1 {
                return Err(SelfJoinError::Refused(format!(
                    "{} is not on a cgroup v1 file system",
                    file.display()
                )));
            }
            opened.push((file.clone(), f));
        }
        let status = std::path::Path::new("/proc/self/status");
        let text = std::fs::read_to_string(status).map_err(|source| SelfJoinError::Io {
            action: "reading",
            path: status.into(),
            source,
        })?;
        let threads = text.lines().find_map(|l| l.strip_prefix("Threads:")).map(str::trim);
        if threads != Some("1") {
            return Err(SelfJoinError::Refused(format!(
                "this process has {} threads; only a single-threaded process can move itself through v1 tasks files",
                threads.unwrap_or("an unknown number of")
            )));
        }
        Ok(SelfJoin { files: opened })
    }

    /// Writes `0` to each file in order. An error here may leave the process moved in some
    /// hierarchies and not others.
    pub fn move_in(self) -> Result<(), SelfJoinError> {
        use std::io::Write;
        for (path, mut f) in self.files {
            f.write_all(b"0").map_err(|source| SelfJoinError::Io {
                action: "writing 0 to",
                path,
                source,
            })?;
        }
        Ok(())
    }
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
