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
//!
//! [`queue_release`] leaves a release for a topod that cannot be reached
//! ([`ClientError::is_unreachable`]), which topod does when it is back: a batch system's epilog
//! then need not fail (and drain the node) because topod was restarting.

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

    /// Whether topod could not be reached or did not answer: no socket, nobody listening, a
    /// connection cut or timed out. (Not a refusal, nor an answer this client cannot read.)
    pub fn is_unreachable(&self) -> bool {
        matches!(self, ClientError::Connect { .. } | ClientError::Io { .. })
    }
}

/// A stream whose reads the client can bound.
trait ReadWithin: Read + Send {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl ReadWithin for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

impl ReadWithin for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

/// The connection's reading side: each read within the connection's timeout, and within the
/// deadline of the reply being read, when there is one (a read that would pass it waits only
/// until it, and one past it fails as timed out).
struct Bounded {
    stream: Box<dyn ReadWithin>,
    per_read: Duration,
    deadline: Option<std::time::Instant>,
}

impl Bounded {
    fn new(stream: Box<dyn ReadWithin>, per_read: Duration) -> Self {
        Bounded { stream, per_read, deadline: None }
    }
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left.min(self.per_read)))?;
            let read = self.stream.read(buf);
            self.stream.set_read_timeout(Some(self.per_read))?;
            return read;
        }
        self.stream.read(buf)
    }
}

/// One connection to topod: its local Unix socket, or its read-only TCP listener.
pub struct Client {
    peer: String,
    reader: BufReader<Bounded>,
    writer: Box<dyn Write + Send>,
    /// How long one whole reply may take ([`Client::set_reply_within`]); `None`: only each
    /// read is bounded.
    reply_within: Option<Duration>,
    /// The protocol version to ask in: this build's, until an older topod says it speaks
    /// only an older one (see `topo_core::proto`'s "Versions").
    version: u32,
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
        Ok(Client {
            peer,
            reply_within: None,
            reader: BufReader::new(Bounded::new(Box::new(stream), timeout)),
            writer: Box::new(writer),
            version: proto::PROTOCOL_VERSION,
        })
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
                        reply_within: None,
                        reader: BufReader::new(Bounded::new(Box::new(stream), timeout)),
                        writer: Box::new(writer),
                        version: proto::PROTOCOL_VERSION,
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(connect_error(last))
    }

    /// Bounds each whole reply to `within` (each read stays bounded by the connection's
    /// timeout too): a peer that sends its reply a byte at a time, each within the read
    /// timeout, otherwise holds the caller for as long as it likes (seen: a scheduler's host
    /// left unknown for minutes by a topod that dripped one reply).
    pub fn set_reply_within(&mut self, within: Duration) {
        self.reply_within = Some(within);
    }

    /// Where this client is connected: the socket path, or `tcp:` and the address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The protocol version this connection asks in: this build's, or 1 once an older topod
    /// refused it.
    pub fn protocol_version(&self) -> u32 {
        self.version
    }

    /// Asks in version `v` from the next request on (kept within the versions this build
    /// speaks): for a caller that learned on an earlier connection that this topod is older,
    /// so that each new connection does not ask twice.
    pub fn speak_version(&mut self, v: u32) {
        self.version = v.clamp(proto::OLDEST_PROTOCOL_VERSION, proto::PROTOCOL_VERSION);
    }

    /// Sends one operation and reads its result as `T` (one of [`proto::reply`], or the types
    /// the reply documentation names): a reply of another shape is an error that says which.
    pub fn call_as<T: serde::de::DeserializeOwned>(&mut self, op: Op) -> Result<T, ClientError> {
        /// A reply line with its result read straight into `T`.
        #[derive(serde::Deserialize)]
        struct Typed<T> {
            v: u32,
            #[serde(default = "Option::default")]
            ok: Option<T>,
            #[serde(default)]
            error: Option<serde::de::IgnoredAny>,
        }
        let name = op.name();
        let line = self.exchange(op)?;
        // Straight into `T`, without a JSON tree between (a free map is read from every host at
        // every refresh); any other reply (an error, another version, another shape) goes the
        // general way, which says what it is.
        let text = std::str::from_utf8(line.strip_suffix(b"\n").unwrap_or(&line));
        if let Ok(Typed { v, ok: Some(ok), error: None }) =
            text.map_err(drop).and_then(|t| serde_json::from_str::<Typed<T>>(t).map_err(drop))
        {
            if proto::is_spoken(u64::from(v)) {
                return Ok(ok);
            }
        }
        let value = self.interpret(&line)?;
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

    /// `suspend`: freezes the job; its CPUs may be lent until `resume`.
    pub fn suspend(&mut self, job: &str) -> Result<proto::reply::Suspend, ClientError> {
        self.call_as(Op::Suspend { job: job.to_string() })
    }

    /// `resume`: thaws a suspended job once its CPUs are free again.
    pub fn resume(&mut self, job: &str) -> Result<proto::reply::Resume, ClientError> {
        self.call_as(Op::Resume { job: job.to_string() })
    }

    /// `follow`: tells topod what the batch system has done with the jobs on this host (see
    /// [`proto::BatchView`]); root or an administrator.
    pub fn follow(&mut self, view: proto::BatchView) -> Result<proto::reply::Follow, ClientError> {
        self.call_as(Op::Follow(view))
    }

    /// Moves the calling process into `job`'s cgroup: see [`join_self`].
    pub fn join_self(&mut self, job: &str) -> Result<Joined, JoinSelfError<ClientError>> {
        join_self(job, |op| self.call(op), |e| matches!(e, ClientError::Refused(_)))
    }

    /// A refusal topod sent before it closed the connection, if one is there to read.
    fn refusal_waiting(&mut self) -> Option<ClientError> {
        let mut line = Vec::new();
        (&mut self.reader).take(64 * 1024).read_until(b'\n', &mut line).ok()?;
        proto::parse_reply(&line).ok()?.error.map(ClientError::Refused)
    }

    /// Sends one operation and returns the result, untyped (the typed calls above decode it).
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        let line = self.exchange(op)?;
        self.interpret(&line)
    }

    /// Sends one operation and reads its reply line; asks again in version 1 when an older
    /// topod refuses this build's version (once: the connection then stays at version 1).
    fn exchange(&mut self, op: Op) -> Result<Vec<u8>, ClientError> {
        let line = self.exchange_in(self.version, op.clone())?;
        // Only a version-1 error can be that refusal (topod writes `v` first): every other
        // reply, a free map among them, is not parsed twice.
        if self.version > proto::OLDEST_PROTOCOL_VERSION
            && line.starts_with(br#"{"v":1,"error":"#)
            && proto::parse_reply(&line).is_ok_and(|r| proto::refuses_newer_version(&r))
        {
            self.version = proto::OLDEST_PROTOCOL_VERSION;
            return self.exchange_in(self.version, op);
        }
        Ok(line)
    }

    /// Sends one operation in protocol version `v` and reads its reply line.
    fn exchange_in(&mut self, v: u32, op: Op) -> Result<Vec<u8>, ClientError> {
        if let Err(e) = self.writer.write_all(Request { v, op }.to_line().as_bytes()) {
            // topod refuses a connection it has no room for (too many connections) before
            // reading anything: its reason waits to be read, better than "Broken pipe".
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) {
                if let Some(refused) = self.refusal_waiting() {
                    return Err(refused);
                }
            }
            return Err(ClientError::Io { peer: self.peer.clone(), source: e });
        }
        let io = |source| ClientError::Io { peer: self.peer.clone(), source };
        let mut line = Vec::new();
        // The limit counts the reply, not its newline (as MAX_LINE_BYTES does).
        let limit = proto::MAX_REPLY_BYTES as u64 + 1;
        self.reader.get_mut().deadline = self.reply_within.map(|d| std::time::Instant::now() + d);
        let read = (&mut self.reader).take(limit).read_until(b'\n', &mut line);
        self.reader.get_mut().deadline = None;
        read.map_err(|e| {
            // A read timeout is EAGAIN on a socket: say what it means.
            io(match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no answer within the time limit (topod may be stalled or overloaded)",
                    )
                }
                _ => e,
            })
        })?;
        if line.len() as u64 == limit && line.last() != Some(&b'\n') {
            return Err(ClientError::Reply {
                peer: self.peer.clone(),
                what: format!(
                    "a reply longer than {} MiB (the limit): not read further",
                    proto::MAX_REPLY_BYTES >> 20
                ),
            });
        }
        if line.is_empty() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "topod closed the connection without a reply",
            )));
        }
        Ok(line)
    }

    /// A reply line's result, or the error it carries or is.
    fn interpret(&self, line: &[u8]) -> Result<serde_json::Value, ClientError> {
        let reply = proto::parse_reply(line)
            .map_err(|e| ClientError::Reply { peer: self.peer.clone(), what: e.to_string() })?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(ClientError::Refused(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }
}

/// Why a release could not be queued (see [`queue_release`]).
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// Not a job id topod would accept.
    #[error(transparent)]
    BadJob(#[from] topo_core::JobIdError),
    /// The directory or the file could not be made.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The socket's directory, or the queue in it, is not one root can trust: another user could
    /// take the queue's name, plant requests, or make root write elsewhere through a link.
    #[error("{why}; the release was not queued")]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// What is wrong, and what fixes it.
        why: String,
    },
    /// The directory the socket's directory would be made in does not exist.
    #[error("{parent} does not exist, so topod has never run here (it makes {socket_dir} when it starts); the release was not queued")]
    NeverRan {
        /// The missing directory.
        parent: PathBuf,
        /// The socket's directory.
        socket_dir: PathBuf,
    },
}

/// `open(2)` of a directory with `flags` (and `O_DIRECTORY | O_CLOEXEC`), relative to `at`.
#[allow(unsafe_code)]
fn open_dir_at(
    at: Option<&std::fs::File>,
    path: &Path,
    flags: nix::fcntl::OFlag,
) -> nix::Result<std::fs::File> {
    use nix::fcntl::OFlag;
    use std::os::fd::{AsRawFd, FromRawFd};
    let fd = nix::fcntl::openat(
        at.map(|f| f.as_raw_fd()),
        path,
        flags | OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    // SAFETY: openat just returned this descriptor, which nothing else owns or closes.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Opens topod's socket directory `dir` for a writer running as `me`, and checks it as the
/// place of the queue: a directory, not a link, of root's (or `me`'s), that neither its group nor
/// others can write ([`topo_core::pending::socket_dir_problem`]). Made (mode 0755) when missing,
/// only inside a parent that is root's (or `me`'s) and that others cannot write without the
/// sticky bit (which keeps them from replacing what root made there); nothing above it is made.
fn open_socket_dir(dir: &Path, me: u32) -> Result<std::fs::File, QueueError> {
    use nix::fcntl::OFlag;
    use std::os::unix::fs::MetadataExt;
    let unsafe_dir = |path: &Path, why: String| QueueError::Unsafe { path: path.into(), why };
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |e: nix::Error| QueueError::Io { action, path, source: e.into() }
    };
    let (parent, name) = match (dir.parent(), dir.file_name()) {
        (Some(p), Some(n)) => (if p.as_os_str().is_empty() { Path::new(".") } else { p }, n),
        // `/` or `.`: nothing above it to check, nothing to make.
        _ => (dir, std::ffi::OsStr::new(".")),
    };
    let parent_dir = match open_dir_at(None, parent, OFlag::empty()) {
        Ok(d) => d,
        Err(nix::errno::Errno::ENOENT) => {
            return Err(QueueError::NeverRan { parent: parent.into(), socket_dir: dir.into() })
        }
        Err(e) => return Err(io("opening", parent)(e)),
    };
    let meta = parent_dir.metadata().map_err(|source| QueueError::Io {
        action: "inspecting",
        path: parent.into(),
        source,
    })?;
    if meta.uid() != 0 && meta.uid() != me {
        return Err(unsafe_dir(
            parent,
            format!(
                "{} belongs to uid {}, who could replace topod's socket directory {} in it: {}",
                parent.display(),
                meta.uid(),
                dir.display(),
                topo_core::pending::MOVE_SOCKET
            ),
        ));
    }
    if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
        return Err(unsafe_dir(
            parent,
            format!(
                "{} is writable by others without the sticky bit (mode {:o}), so anyone could replace topod's socket directory {} in it: {}",
                parent.display(),
                meta.mode() & 0o7777,
                dir.display(),
                topo_core::pending::MOVE_SOCKET
            ),
        ));
    }
    let open = || open_dir_at(Some(&parent_dir), Path::new(name), OFlag::O_NOFOLLOW);
    let opened = match open() {
        Err(nix::errno::Errno::ENOENT) => {
            // topod makes it when it starts; the first epilog may come first.
            use std::os::fd::AsRawFd;
            let mode = nix::sys::stat::Mode::from_bits_truncate(0o755);
            match nix::sys::stat::mkdirat(Some(parent_dir.as_raw_fd()), name, mode) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => open(),
                Err(e) => return Err(io("creating", dir)(e)),
            }
        }
        other => other,
    };
    let socket_dir = match opened {
        Ok(d) => d,
        // O_NOFOLLOW | O_DIRECTORY on a link: ELOOP, or ENOTDIR when the link names a directory.
        Err(e @ (nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR)) => {
            let seen = std::fs::symlink_metadata(dir).map_err(|source| QueueError::Io {
                action: "inspecting",
                path: dir.into(),
                source,
            })?;
            if !seen.file_type().is_symlink() {
                let why = format!("topod's socket directory {} is not a directory", dir.display());
                return Err(unsafe_dir(dir, why));
            }
            let why = topo_core::pending::socket_dir_problem(dir, true, seen.uid(), 0, me);
            return Err(unsafe_dir(dir, why.unwrap_or_else(|| e.to_string())));
        }
        Err(e) => return Err(io("opening", dir)(e)),
    };
    let meta = socket_dir.metadata().map_err(|source| QueueError::Io {
        action: "inspecting",
        path: dir.into(),
        source,
    })?;
    if let Some(mut why) =
        topo_core::pending::socket_dir_problem(dir, false, meta.uid(), meta.mode(), me)
    {
        // What another user made there in the queue's place is theirs to lose, never ours to
        // take over.
        let queue = topo_core::pending::pending_dir_for(&dir.join("topod.sock"));
        if let Ok(theirs) = std::fs::symlink_metadata(&queue) {
            if theirs.uid() != 0 && theirs.uid() != me {
                why = format!(
                    "{why}; {}",
                    topo_core::pending::remove_foreign(&queue, theirs.uid(), false)
                );
            }
        }
        return Err(unsafe_dir(dir, why));
    }
    Ok(socket_dir)
}

/// Queues the release of `job` for the topod listening on `socket`, which cannot be reached
/// now: writes `<socket's directory>/release-pending/<job>` (see [`topo_core::pending`]), which
/// topod acts on when it starts and every few seconds while it runs. `asked_by` says who asks
/// (topod logs it). Returns the file.
///
/// Run as root (the batch system's epilog). The socket's directory must be root's (or the
/// caller's) and writable by no one else, not a link; it is made (mode 0755) when missing, if its
/// parent is safe, and nothing above it is made ([`QueueError::NeverRan`]). The queue directory
/// in it is made mode 0700 if missing, and must belong to the caller and be writable by no one
/// else, as topod checks too. Every step is relative to the directory opened and checked before
/// it: no link planted on the way is followed. The file is written beside, under a temporary
/// name (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600), and renamed into place, so topod never
/// reads half a request.
pub fn queue_release(socket: &Path, job: &str, asked_by: &str) -> Result<PathBuf, QueueError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let id = topo_core::JobId::parse(job)?;
    let dir = topo_core::pending::pending_dir_for(socket);
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| QueueError::Io { action, path, source }
    };
    let me = nix::unistd::geteuid().as_raw();
    let socket_dir = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = open_socket_dir(socket_dir, me)?;
    let name = Path::new(topo_core::pending::PENDING_DIR_NAME);
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o700);
    match nix::sys::stat::mkdirat(Some(parent.as_raw_fd()), name, mode) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => return Err(io("creating", &dir)(e.into())),
    }
    let unsafe_dir = |why: String| QueueError::Unsafe { path: dir.clone(), why };
    let handle = match open_dir_at(Some(&parent), name, nix::fcntl::OFlag::O_NOFOLLOW) {
        Ok(h) => h,
        // O_NOFOLLOW | O_DIRECTORY on a link: ELOOP, or ENOTDIR when the link names a directory.
        Err(nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR) => {
            let seen = std::fs::symlink_metadata(&dir).map_err(io("inspecting", &dir))?;
            let what =
                if seen.file_type().is_symlink() { "a symbolic link" } else { "not a directory" };
            return Err(unsafe_dir(if seen.uid() != 0 && seen.uid() != me {
                format!(
                    "{} is {what}; {}",
                    dir.display(),
                    topo_core::pending::remove_foreign(&dir, seen.uid(), false)
                )
            } else {
                format!(
                    "{} is {what}; remove it (the next release queued makes it again)",
                    dir.display()
                )
            }));
        }
        Err(e) => return Err(io("opening", &dir)(e.into())),
    };
    let meta = handle.metadata().map_err(io("inspecting", &dir))?;
    if meta.uid() != me {
        return Err(unsafe_dir(format!(
            "{} is owned by uid {}; {}",
            dir.display(),
            meta.uid(),
            topo_core::pending::remove_foreign(&dir, meta.uid(), false)
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "{} is writable by others (mode {:o}); chmod 700 {0}",
            dir.display(),
            meta.mode() & 0o7777
        )));
    }
    if meta.mode() & 0o300 != 0o300 {
        // topod keeps no CAP_DAC_OVERRIDE: it would refuse a queue it could not remove from.
        return Err(unsafe_dir(format!(
            "{} is not writable by its owner (mode {:o}), so topod could not remove a request once done; chmod 700 {0}",
            dir.display(),
            meta.mode() & 0o7777
        )));
    }
    let fd = handle.as_raw_fd();
    let tmp = format!(".{id}.{}.tmp", std::process::id());
    let tmp_path = dir.join(&tmp);
    let create = || {
        nix::fcntl::openat(
            Some(fd),
            tmp.as_str(),
            nix::fcntl::OFlag::O_WRONLY
                | nix::fcntl::OFlag::O_CREAT
                | nix::fcntl::OFlag::O_EXCL
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
    };
    // A temporary file of this name is left from a process with this pid that died: ours.
    let raw = match create() {
        Err(nix::errno::Errno::EEXIST) => {
            nix::unistd::unlinkat(Some(fd), tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir)
                .map_err(|e| io("removing", &tmp_path)(e.into()))?;
            create()
        }
        other => other,
    }
    .map_err(|e| io("creating", &tmp_path)(e.into()))?;
    // SAFETY: openat just returned this descriptor, which nothing else owns or closes.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let request = topo_core::pending::QueuedRelease::new(std::time::SystemTime::now(), asked_by);
    let written = file.write_all(&request.to_bytes());
    drop(file);
    let path = dir.join(id.as_str());
    let renamed = written.map_err(io("writing", &tmp_path)).and_then(|()| {
        nix::fcntl::renameat(Some(fd), tmp.as_str(), Some(fd), id.as_str())
            .map_err(|e| io("renaming into place", &path)(e.into()))
    });
    if renamed.is_err() {
        let _ =
            nix::unistd::unlinkat(Some(fd), tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
    renamed.map(|()| path)
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

/// Each device file by its number, `char:MAJOR:MINOR`, as topod takes a GPU (`allocate`'s
/// `gpus`): a client stats the file in its own view of `/dev`, which under topod.service's
/// PrivateDevices= is not topod's (there `/dev/nvidia0` does not exist). A file that is missing
/// or no character device is refused naming it.
pub fn device_numbers(files: &[String]) -> Result<Vec<String>, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    files
        .iter()
        .map(|file| {
            let meta = std::fs::metadata(file).map_err(|e| format!("{file}: {e}"))?;
            if !meta.file_type().is_char_device() {
                return Err(format!("{file}: not a character device"));
            }
            // glibc's gnu_dev_major and gnu_dev_minor (sys/sysmacros.h), written out.
            let rdev = meta.rdev();
            let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0fff);
            let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0x00ff);
            Ok(format!("char:{major}:{minor}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A fresh directory for one test (removed when dropped); topo-client has no dev-dependencies.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("topo-client-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn an_endless_reply_is_refused_at_the_limit_not_read_for_ever() {
        let scratch = Scratch::new("endless");
        let socket = scratch.0.join("topod.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        // A broken peer: reads the request, then sends bytes without a newline until the
        // client hangs up.
        let peer = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = [0u8; 256];
            let _ = conn.read(&mut request);
            let chunk = vec![b'x'; 64 * 1024];
            let mut sent = 0usize;
            while conn.write_all(&chunk).is_ok() {
                sent += chunk.len();
            }
            sent
        });
        let mut client = Client::connect(&socket).unwrap();
        match client.call(Op::Version) {
            Err(ClientError::Reply { what, .. }) => assert!(what.contains("16 MiB"), "{what}"),
            other => panic!("expected a refused reply, got {other:?}"),
        }
        drop(client);
        let sent = peer.join().unwrap();
        assert!(sent <= proto::MAX_REPLY_BYTES + 8 * 1024 * 1024, "the client read {sent} bytes");
    }

    /// A peer that drips its reply a byte at a time, each byte well within the read timeout,
    /// held a scheduler's refresher for minutes (attack on the LSF module): with a bound on the
    /// whole reply, the call fails as timed out long before the reply is through.
    #[test]
    fn a_reply_dripped_a_byte_at_a_time_fails_at_its_deadline() {
        let scratch = Scratch::new("drip");
        let socket = scratch.0.join("topod.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let reply = proto::Reply::ok(serde_json::json!({ "padding": "x".repeat(400) })).to_line();
        let peer = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = [0u8; 256];
            let _ = conn.read(&mut request);
            // 400 bytes at one per 50 ms: 20 s for the whole reply.
            for byte in reply.as_bytes() {
                if conn.write_all(std::slice::from_ref(byte)).is_err() {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            true
        });
        let mut client = Client::connect_with_timeout(&socket, Duration::from_secs(5)).unwrap();
        client.set_reply_within(Duration::from_millis(300));
        match client.call(Op::Version) {
            Err(ClientError::Io { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{source}")
            }
            other => panic!("expected a timed-out reply, got {other:?}"),
        }
        drop(client);
        assert!(!peer.join().unwrap(), "the client hung up before the reply was through");
    }

    /// topod refuses a connection it has no room for before reading the request: the client
    /// that writes into the closed connection says topod's reason, not "Broken pipe".
    #[test]
    fn a_connection_refused_before_its_request_says_topods_reason() {
        let scratch = Scratch::new("busy");
        let socket = scratch.0.join("topod.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut client = Client::connect(&socket).unwrap();
        let (mut conn, _) = listener.accept().unwrap();
        let refusal =
            proto::Reply::error(proto::ErrorCode::Busy, "too many connections from uid 1000 (64)");
        conn.write_all(refusal.to_line().as_bytes()).unwrap();
        drop(conn);
        match client.call(Op::Version) {
            Err(ClientError::Refused(e)) => {
                assert!(e.message.contains("too many connections from uid 1000"), "{e:?}")
            }
            other => panic!("expected topod's refusal, got {other:?}"),
        }
    }

    /// `call_as` reads a result straight into its type; an error, another protocol version or a
    /// result of another shape is told as the general path tells it.
    #[test]
    fn a_typed_call_reads_its_result_and_tells_every_other_reply() {
        let scratch = Scratch::new("typed");
        let socket = scratch.0.join("topod.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let replies = [
            format!(
                r#"{{"v":{},"ok":{{"topod":"9.9","protocol":{0},"cgroup":"fake","pid":7}}}}"#,
                proto::PROTOCOL_VERSION
            ),
            proto::Reply::error(proto::ErrorCode::Forbidden, "not yours")
                .to_line()
                .trim_end()
                .to_string(),
            format!(r#"{{"v":{},"ok":{{"topod":"9.9"}}}}"#, proto::PROTOCOL_VERSION + 1),
            format!(r#"{{"v":{},"ok":{{"topod":7}}}}"#, proto::PROTOCOL_VERSION),
        ];
        let peer = std::thread::spawn(move || {
            for reply in replies {
                let (conn, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut request = String::new();
                reader.read_line(&mut request).unwrap();
                (&conn).write_all(format!("{reply}\n").as_bytes()).unwrap();
            }
        });
        let ask = || Client::connect(&socket).unwrap().version();
        let v = ask().unwrap();
        assert_eq!((v.topod.as_str(), v.pid), ("9.9", 7));
        assert!(matches!(ask(), Err(ClientError::Refused(e)) if e.message == "not yours"));
        match ask() {
            Err(ClientError::Reply { what, .. }) => assert!(what.contains("version"), "{what}"),
            other => panic!("{other:?}"),
        }
        match ask() {
            Err(ClientError::Reply { what, .. }) => {
                assert!(what.starts_with("the reply to version: "), "{what}")
            }
            other => panic!("{other:?}"),
        }
        peer.join().unwrap();
    }

    /// Against a topod that speaks only version 1 (before this build), the client asks again
    /// in version 1 and stays there on that connection; a version 1 reply is read as well.
    #[test]
    fn a_topod_of_version_1_is_asked_again_in_version_1() {
        let scratch = Scratch::new("old");
        let socket = scratch.0.join("topod.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let peer = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut asked = Vec::new();
            for _ in 0..3 {
                let mut request = String::new();
                reader.read_line(&mut request).unwrap();
                let v = serde_json::from_str::<serde_json::Value>(&request).unwrap()["v"].clone();
                // What a version 1 topod says to anything else, word for word.
                let reply = if v == 1 {
                    r#"{"v":1,"ok":{"topod":"0.1","protocol":1,"cgroup":"fake","pid":7}}"#.into()
                } else {
                    format!(
                        r#"{{"v":1,"error":{{"code":"bad_request","message":"protocol version {v} is not supported; this topod speaks version 1"}}}}"#
                    )
                };
                (&conn).write_all(format!("{reply}\n").as_bytes()).unwrap();
                asked.push(v);
            }
            asked
        });
        let mut client = Client::connect(&socket).unwrap();
        assert_eq!(client.version().unwrap().topod, "0.1");
        assert_eq!(client.version().unwrap().pid, 7);
        let asked = peer.join().unwrap();
        assert_eq!(asked, [proto::PROTOCOL_VERSION, 1, 1], "asked again once, then in version 1");
    }

    #[test]
    fn a_queued_release_is_one_whole_private_file_beside_the_socket() {
        let scratch = Scratch::new("queue");
        let socket = scratch.0.join("run/topod.sock");
        let before = std::time::SystemTime::now();
        let file = queue_release(&socket, "slurm-42", "the test (pid 1)").unwrap();
        let after = std::time::SystemTime::now();
        let dir = scratch.0.join("run/release-pending");
        assert_eq!(file, dir.join("slurm-42"));
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777, 0o700);
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777, 0o600);
        let (request, at) =
            topo_core::pending::QueuedRelease::parse(&std::fs::read(&file).unwrap())
                .expect("a request topod can read");
        assert_eq!(request.asked_by, "the test (pid 1)");
        // The time of the call (written to the millisecond, cut, not rounded).
        let ms = Duration::from_millis(1);
        assert!(before - ms < at && at <= after, "{at:?} not within {before:?} ..= {after:?}");
        // Again: replaced, and no temporary file is left.
        queue_release(&socket, "slurm-42", "again").unwrap();
        queue_release(&socket, "slurm-43", "another").unwrap();
        assert_eq!(names(&dir), ["slurm-42", "slurm-43"]);
        let again = std::fs::read(&file).unwrap();
        assert_eq!(topo_core::pending::QueuedRelease::parse(&again).unwrap().0.asked_by, "again");
        // A job id topod would refuse names no file.
        for bad in ["../x", "a/b", ".hidden", ""] {
            assert!(
                matches!(queue_release(&socket, bad, "x"), Err(QueueError::BadJob(_))),
                "{bad}"
            );
        }
        assert_eq!(names(&dir), ["slurm-42", "slurm-43"]);
    }

    #[test]
    fn a_directory_others_could_write_or_a_planted_link_is_not_used() {
        let scratch = Scratch::new("unsafe");
        let socket = scratch.0.join("topod.sock");
        let dir = scratch.0.join("release-pending");
        let elsewhere = scratch.0.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        // The directory is a link: nothing is written through it.
        std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
        let e = queue_release(&socket, "slurm-1", "x").unwrap_err().to_string();
        assert!(e.contains("is a symbolic link; remove it"), "{e}");
        assert!(names(&elsewhere).is_empty());
        std::fs::remove_file(&dir).unwrap();
        // Writable by others.
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = queue_release(&socket, "slurm-1", "x").unwrap_err().to_string();
        assert!(e.contains("writable by others (mode 777)") && e.contains("chmod 700"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A link planted at the request's own name is replaced, never written through.
        let victim = scratch.0.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("slurm-1")).unwrap();
        queue_release(&socket, "slurm-1", "x").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(dir.join("slurm-1")).unwrap().is_file());
        // Another user's directory (only root can make one to try).
        if nix::unistd::geteuid().is_root() {
            nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            let e = queue_release(&socket, "slurm-2", "x").unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534") && e.contains("remove"), "{e}");
            assert!(!e.contains("chown") && !e.contains("chmod"), "{e}");
            assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 65534);
        }
    }

    #[test]
    fn no_link_above_the_queue_is_followed_and_no_parent_is_made() {
        let scratch = Scratch::new("above");
        // A directory anyone may write, with the sticky bit (like /tmp), and a link in it where
        // topod's socket directory would be.
        let shared = scratch.0.join("c4");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let target = scratch.0.join("c4-target");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, shared.join("topo")).unwrap();
        let e = queue_release(&shared.join("topo/topod.sock"), "slurm-5", "x").unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains(&format!(
                "topod's socket directory {}/topo is a symbolic link",
                shared.display()
            )),
            "{e}"
        );
        assert!(e.contains("move the socket to a directory only root can write"), "{e}");
        assert!(names(&target).is_empty(), "nothing made through the link");
        // Missing directories above the socket's are not made.
        let socket = scratch.0.join("a/b/topo/topod.sock");
        let e = queue_release(&socket, "slurm-5", "x").unwrap_err().to_string();
        assert!(e.contains("does not exist, so topod has never run here"), "{e}");
        assert!(!scratch.0.join("a").exists());
        // The socket's own directory is made, inside a parent that is safe (sticky is enough).
        let file = queue_release(&shared.join("mine/topod.sock"), "slurm-5", "x").unwrap();
        assert_eq!(file, shared.join("mine/release-pending/slurm-5"));
        assert_eq!(std::fs::metadata(shared.join("mine")).unwrap().mode() & 0o7777, 0o755);
        // Not inside a parent others may write without the sticky bit.
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = queue_release(&shared.join("other/topod.sock"), "slurm-5", "x").unwrap_err();
        assert!(
            e.to_string().contains("writable by others without the sticky bit (mode 777)"),
            "{e}"
        );
        assert!(!shared.join("other").exists());
    }

    #[test]
    fn a_socket_directory_others_can_write_is_named_as_the_cause() {
        let scratch = Scratch::new("sticky");
        let socket_dir = scratch.0.join("topo");
        std::fs::create_dir(&socket_dir).unwrap();
        std::fs::set_permissions(&socket_dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let socket = socket_dir.join("topod.sock");
        let e = queue_release(&socket, "slurm-1", "x").unwrap_err().to_string();
        assert_eq!(
            e,
            format!("topod's socket directory {} is writable by others (mode 1777): move the socket to a directory only root can write, e.g. /run/topo; the release was not queued", socket_dir.display())
        );
        assert!(!socket_dir.join("release-pending").exists(), "nothing made there");
        // A user took the queue's name first: remove it, never chown or chmod it.
        if nix::unistd::geteuid().is_root() {
            let theirs = socket_dir.join("release-pending");
            std::fs::create_dir(&theirs).unwrap();
            nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            let e = queue_release(&socket, "slurm-1", "x").unwrap_err().to_string();
            assert!(e.contains("writable by others (mode 1777)"), "{e}");
            assert!(
                e.contains(&format!("remove {}, which uid 65534 created", theirs.display())),
                "{e}"
            );
            assert!(!e.contains("chown") && !e.contains("chmod"), "{e}");
        }
    }

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

    #[test]
    fn device_files_go_to_topod_by_number() {
        let files = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // /dev/null is 1:3 on every Linux (Documentation/admin-guide/devices.txt).
        assert_eq!(super::device_numbers(&files(&["/dev/null"])).unwrap(), ["char:1:3"]);
        let e = super::device_numbers(&files(&["/proc/self/status"])).unwrap_err();
        assert_eq!(e, "/proc/self/status: not a character device");
        let e = super::device_numbers(&files(&["/dev/no-such-gpu"])).unwrap_err();
        assert!(e.starts_with("/dev/no-such-gpu: No such file"), "{e}");
    }
}
