//! The Unix-socket server: one JSON request per line, one reply per line.
//!
//! Who the peer is comes only from the kernel (`SO_PEERCRED`). Reads (version, topology, free
//! map, fit, list) are open to everyone; allocate and release need root or a configured
//! administrator uid or gid; join needs an administrator, or the job's owner moving its own
//! process (the peer's pid), which is how `topo-exec` started as the job's user gets in;
//! self_join_files (the files a root process writes to move itself in, then confirmed by its
//! own join) needs an administrator or the job's owner.

use super::host::{Host, HostError};
use crate::proto::{self, ErrorCode, Op, Reply};
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Who may change state.
#[derive(Debug, Clone, Default)]
pub struct Admins {
    /// Administrator uids (root always is one).
    pub uids: Vec<u32>,
    /// Administrator gids.
    pub gids: Vec<u32>,
}

/// The peer of a connection, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

impl Admins {
    fn allows(&self, peer: &Peer) -> bool {
        peer.uid == 0 || self.uids.contains(&peer.uid) || self.gids.contains(&peer.gid)
    }
}

/// How long a connection may stay silent before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves connections until the listener fails.
pub fn serve(listener: UnixListener, host: Arc<Mutex<Host>>, admins: Arc<Admins>) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                let (host, admins) = (host.clone(), admins.clone());
                std::thread::spawn(move || {
                    if let Err(e) = connection(stream, &host, &admins) {
                        tracing::debug!("connection ended: {e}");
                    }
                });
            }
            Err(e) => tracing::warn!("accept failed: {e}"),
        }
    }
}

fn peer_of(stream: &UnixStream) -> std::io::Result<Peer> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).map_err(std::io::Error::from)?;
    Ok(Peer { pid: cred.pid(), uid: cred.uid(), gid: cred.gid() })
}

fn connection(stream: UnixStream, host: &Mutex<Host>, admins: &Admins) -> std::io::Result<()> {
    let peer = peer_of(&stream)?;
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_write_timeout(Some(IDLE_TIMEOUT))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = Vec::new();
        // One byte more than the limit tells a line that is too long from one that is not.
        let n = (&mut reader).take(proto::MAX_LINE_BYTES as u64 + 2).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        let too_long = !line.ends_with(b"\n") && line.len() > proto::MAX_LINE_BYTES;
        let reply = if too_long {
            Reply::error(ErrorCode::BadRequest, proto::ProtoError::TooLong(line.len()).to_string())
        } else {
            match proto::parse_request(&line) {
                Ok(req) => handle(host, admins, &peer, req.op),
                Err(e) => Reply::error(ErrorCode::BadRequest, e.to_string()),
            }
        };
        writer.write_all(reply.to_line().as_bytes())?;
        if too_long {
            // The rest of that line cannot be trusted to be a request: close.
            return Ok(());
        }
    }
}

/// Answers one request from `peer`.
pub fn handle(host: &Mutex<Host>, admins: &Admins, peer: &Peer, op: Op) -> Reply {
    let mut host = host.lock().unwrap_or_else(|e| e.into_inner());
    let forbidden = |what: &str| {
        Reply::error(ErrorCode::Forbidden, format!("{what} needs root or a configured administrator; you are uid {} gid {}", peer.uid, peer.gid))
    };
    match op {
        Op::Version => Reply::ok(json!({
            "topod": env!("CARGO_PKG_VERSION"),
            "protocol": proto::PROTOCOL_VERSION,
            "cgroup": host.backend_kind(),
            "pid": std::process::id(),
        })),
        Op::Topology => Reply::ok(serde_json::to_value(host.topology()).unwrap_or_default()),
        Op::FreeMap => {
            let l = host.ledger();
            Reply::ok(json!({
                "generation": l.generation(),
                "allocatable": host.allocatable(),
                "held": l.occupancy().held,
                "fenced": l.occupancy().fenced,
                "jobs": l.len(),
                "job_ids": l.jobs().map(|a| a.job.as_str()).collect::<Vec<_>>(),
                "free": host.host_metrics(),
            }))
        }
        Op::Fit { request, tasks } => match host.fit(&request, tasks) {
            Ok(fit) => Reply::ok(serde_json::to_value(fit).unwrap_or_default()),
            Err(e) => error_reply(&e),
        },
        Op::List => Reply::ok(serde_json::to_value(host.ledger().jobs().collect::<Vec<_>>()).unwrap_or_default()),
        Op::Allocate { job, request, tasks, cpus, mem_limit_bytes, owner_uid, join_pid } => {
            if !admins.allows(peer) {
                return forbidden("allocate");
            }
            let existed = host.ledger().get(&job).is_some();
            let alloc = match host.allocate(&job, &request, tasks, cpus.as_deref(), mem_limit_bytes, owner_uid) {
                Ok(a) => a,
                Err(e) => return error_reply(&e),
            };
            if let Some(pid) = join_pid {
                // An administrator may move any process in, as with `join`. All or nothing: an
                // allocation this request made is undone when the process cannot be moved in;
                // one that was there before stays.
                if let Err(e) = host.join(&job, pid) {
                    let mut reply = error_reply(&e);
                    let outcome = if existed {
                        format!("job {job} keeps its allocation (CPUs {})", alloc.cpus)
                    } else {
                        match host.release(&job) {
                            Ok(_) => format!("job {job} was not allocated"),
                            Err(undo) => format!("job {job} is allocated (CPUs {}) and could not be undone: {undo}", alloc.cpus),
                        }
                    };
                    if let Some(err) = reply.error.as_mut() {
                        err.message = format!("{outcome}: process {pid} could not be moved in: {}", err.message);
                    }
                    return reply;
                }
            }
            Reply::ok(serde_json::to_value(alloc).unwrap_or_default())
        }
        Op::Join { job, pid } => {
            let own = pid == peer.pid && host.owner_of(&job) == Some(peer.uid);
            if !admins.allows(peer) && !own {
                return forbidden("moving a process other than your own into a job you do not own");
            }
            match host.join(&job, pid) {
                Ok(()) => Reply::ok(json!({ "job": job, "pid": pid })),
                Err(e) => error_reply(&e),
            }
        }
        Op::SelfJoinFiles { job } => {
            if !admins.allows(peer) && host.owner_of(&job) != Some(peer.uid) {
                return forbidden("moving yourself into a job you do not own");
            }
            match host.self_join_files(&job) {
                Ok(files) => Reply::ok(json!({ "job": job, "files": files })),
                Err(e) => error_reply(&e),
            }
        }
        Op::Release { job } => {
            if !admins.allows(peer) {
                return forbidden("release");
            }
            match host.release(&job) {
                Ok(killed) => Reply::ok(json!({ "job": job, "killed": killed })),
                Err(e) => error_reply(&e),
            }
        }
    }
}

fn error_reply(e: &HostError) -> Reply {
    let code = match e {
        HostError::BadJob(_) | HostError::AlreadyAllocated { .. } | HostError::BadPid(_) => ErrorCode::BadRequest,
        HostError::BadRequest(_) => ErrorCode::BadTopologyRequest,
        HostError::DoesNotFit { .. } => ErrorCode::DoesNotFit,
        HostError::UnknownJob(_) => ErrorCode::UnknownJob,
        HostError::Survivors { .. } | HostError::Cgroup(_) | HostError::Ledger(_) => ErrorCode::Internal,
    };
    Reply::error(code, e.to_string())
}
