//! The Unix-socket server: one JSON request per line, one reply per line.
//!
//! Who the peer is comes only from the kernel: `SO_PEERCRED` for its uid and gid, and a pidfd
//! for the process that connected (`SO_PEERPIDFD`, or `pidfd_open` of the peer's pid on kernels
//! before 6.5), so that a pid number recycled after the peer exits is never taken for the peer.
//! Reads (version, topology, free map, fit, list) are open to everyone; allocate and release need
//! root or a configured administrator uid or gid; join needs an administrator, or the job's owner
//! moving the very process that connected (how `topo-exec` started as the job's user gets in);
//! self_join_files (the files a root process writes to move itself in, then confirmed by its own
//! join) needs an administrator or the job's owner. No join ever moves a process or thread of
//! topod's own.
//!
//! What one client can cost is bounded (see [`super::conn`]): connections per user and in
//! total, the time a line may take, the time a reply may wait; requests are parsed before the
//! host lock is taken, reads work on a snapshot, and a release waits for the job's processes to
//! die without the lock.

use super::conn::{thread_cpu_time, AcceptErrors, Admitted, Gate, Holder, Line, LineReader, Timed};
use super::host::{self, Host, HostError, Snapshot};
use super::process::{ProcessError, ProcessHandle};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard};
use topo_core::proto::{self, ErrorCode, Op, Reply};
use topo_core::topology::Topology;

/// Who may change state.
#[derive(Debug, Clone, Default)]
pub struct Admins {
    /// Administrator uids (root always is one).
    pub uids: Vec<u32>,
    /// Administrator gids.
    pub gids: Vec<u32>,
}

impl Admins {
    /// Whether `peer` may change state.
    pub fn allows(&self, peer: &Peer) -> bool {
        peer.uid == 0 || self.uids.contains(&peer.uid) || self.gids.contains(&peer.gid)
    }
}

/// The peer of a connection, as the kernel reports it.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Process id at connect time.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// The process that connected, held by a pidfd (none over TCP, or where the kernel could
    /// not name it: then the peer may only read and do what an administrator may).
    pub process: Option<Arc<ProcessHandle>>,
}

impl Peer {
    /// A TCP peer: no kernel credentials, so nobody, who may only read.
    pub fn nobody() -> Peer {
        Peer { pid: 0, uid: u32::MAX, gid: u32::MAX, process: None }
    }

    /// The peer of a Unix socket connection: its credentials only (no pidfd yet; see
    /// [`Peer::name_process`]).
    pub fn of(stream: &UnixStream) -> std::io::Result<Peer> {
        let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
            .map_err(std::io::Error::from)?;
        Ok(Peer { pid: cred.pid(), uid: cred.uid(), gid: cred.gid(), process: None })
    }

    /// Names the process that connected by a pidfd (done once a connection is admitted, so a
    /// flood of refused connections costs no pidfd each).
    pub fn name_process(&mut self, stream: &UnixStream) {
        let (pid, uid) = (self.pid, self.uid);
        let process = match ProcessHandle::of_peer(stream, pid) {
            Ok(Some(h)) => Some(h),
            // Before Linux 6.5: open a pidfd of the pid now, and keep it only if that process is
            // still the peer's user (the pid cannot have been reused by another user's process
            // and still pass). The window between connect and this accept is not closed there.
            Ok(None) => {
                ProcessHandle::open(pid).ok().filter(|h| h.status().is_ok_and(|s| s.uids[1] == uid))
            }
            Err(_) => None,
        };
        self.process = process.map(Arc::new);
    }
}

/// What every connection shares.
pub struct Server {
    /// The host state, behind the one lock.
    host: Mutex<Host>,
    /// What reads need, published after every change: reads (free map, fit, list) take no lock,
    /// so no reader waits behind a change and no change waits behind a reader (a user's thread
    /// runs at a lower priority and could otherwise hold the lock while it waits for a CPU).
    published: arc_swap::ArcSwap<Snapshot>,
    /// The hardware graph (it never changes while topod runs), readable without the lock.
    pub topology: Arc<Topology>,
    /// The topology as sent to clients, made once.
    topology_json: serde_json::Value,
    /// Who may change state.
    pub admins: Admins,
    /// The connection limits.
    pub gate: Arc<Gate>,
    backend_kind: &'static str,
    /// What topod counts for its metrics (shared with the host).
    pub metrics: Arc<super::metrics::Metrics>,
    /// Releases, suspensions and resumptions under way (their waits take no lock): a stop waits
    /// for them, so that no job is left frozen halfway through (see [`Server::drain`]).
    in_flight: std::sync::atomic::AtomicUsize,
    /// Set by a stop: no release, suspension or resumption starts after it.
    stopping: std::sync::atomic::AtomicBool,
    /// Held while the host's queued freezes and thaws run without its lock (gang switches,
    /// resumes after preemption; see [`Server::settle`]), and by a release, suspension or
    /// resumption as it begins, which so never finds a job halfway through one.
    settling: Mutex<()>,
}

/// One release, suspension or resumption under way, counted while it lives.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(count: &'a std::sync::atomic::AtomicUsize) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The host, locked; when it was changed through this guard, the snapshot readers see is
/// replaced as the guard goes.
pub struct HostGuard<'a> {
    host: MutexGuard<'a, Host>,
    published: &'a arc_swap::ArcSwap<Snapshot>,
    changed: bool,
}

impl std::ops::Deref for HostGuard<'_> {
    type Target = Host;
    fn deref(&self) -> &Host {
        &self.host
    }
}

impl std::ops::DerefMut for HostGuard<'_> {
    fn deref_mut(&mut self) -> &mut Host {
        self.changed = true;
        &mut self.host
    }
}

impl Drop for HostGuard<'_> {
    fn drop(&mut self) {
        if self.changed {
            self.published.store(Arc::new(self.host.snapshot()));
        }
    }
}

impl Server {
    /// A server for `host`.
    pub fn new(mut host: Host, admins: Admins, gate: Arc<Gate>) -> Arc<Server> {
        // Freezes and thaws that follow a change wait on the kernel: not under the lock.
        host.defer_kernel_waits();
        let topology = host.topology().clone();
        let topology_json = serde_json::to_value(&*topology).unwrap_or_default();
        let backend_kind = host.backend_kind();
        let published = arc_swap::ArcSwap::from_pointee(host.snapshot());
        let metrics = host.metrics();
        Arc::new(Server {
            metrics,
            host: Mutex::new(host),
            published,
            topology,
            topology_json,
            admins,
            gate,
            backend_kind,
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            stopping: std::sync::atomic::AtomicBool::new(false),
            settling: Mutex::new(()),
        })
    }

    /// Runs the freezes and thaws the host queued (gang switches and the thaws onto the CPUs
    /// they freed, resumes after preemption) without its lock, after a change that may have
    /// queued some. Waits while another thread runs them (as a change once waited for the lock),
    /// so that all are done when it returns; reads never wait.
    pub fn settle(&self) {
        // Only when some are queued: a change that queued none does not wait for another's
        // (which that one's thread runs).
        if !self.lock_quiet().has_queued_kernel_work() {
            return;
        }
        self.settle_all();
    }

    /// [`Server::settle`], and waits for those under way in another thread too: all are done
    /// when it returns.
    fn settle_all(&self) {
        if !self.lock_quiet().kernel_work_pending() {
            return;
        }
        let _settling = self.settling.lock().unwrap_or_else(|e| e.into_inner());
        self.run_kernel_work();
    }

    /// Runs the queued freezes and thaws to the end, `settling` held: the freezes, then the
    /// thaws onto the CPUs they freed.
    fn run_kernel_work(&self) {
        // Freezes, thaws after them, and the thaws' own follow-ups: a few rounds at most.
        for _ in 0..8 {
            let work = self.lock().take_kernel_work();
            if work.is_empty() {
                return;
            }
            let _counted = InFlight::new(&self.in_flight);
            let outcomes: Vec<_> = work.iter().map(host::KernelWork::run).collect();
            let freed = work.iter().any(host::KernelWork::frees_cpus);
            let mut host = self.lock();
            for (work, outcome) in work.into_iter().zip(outcomes) {
                host.finish_kernel_work(work, outcome);
            }
            if freed {
                host.gang_thaws();
            }
            if host.take_gang_recheck() {
                // A switch met one of these jobs halfway: made again now that they are done.
                let now = host.now();
                host.gang_switch(now);
            }
        }
    }

    /// Runs `begin` under the host lock once no freeze or thaw of the host's is queued or
    /// under way (it runs them first), holding off new ones until it returns: a release,
    /// suspension or resumption so never meets a job a gang switch is freezing.
    fn begin_settled<T>(
        &self,
        begin: impl FnOnce(&mut Host) -> Result<T, HostError>,
    ) -> Result<T, HostError> {
        let _settling = self.settling.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            self.run_kernel_work();
            let mut host = self.lock();
            if !host.kernel_work_pending() {
                return begin(&mut host);
            }
        }
    }

    /// The host, locked, for a look that changes nothing (the snapshot is not made again).
    fn lock_quiet(&self) -> MutexGuard<'_, Host> {
        self.host.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a release, suspension or resumption of `job` as under way, or refuses it once a
    /// stop has begun (a retryable refusal: the batch system's epilog queues a release).
    fn start_change(&self, job: &str) -> Result<InFlight<'_>, HostError> {
        let counted = InFlight::new(&self.in_flight);
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(HostError::Changing {
                job: job.to_string(),
                what: "not changed: topod is stopping (systemd starts it again)",
            });
        }
        Ok(counted)
    }

    /// How many releases, suspensions and resumptions are under way.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// For a stop: waits (up to `limit`) until no release, suspension or resumption is under
    /// way, then takes the host lock, so that no change is cut in half, and returns it held
    /// (the caller exits with it). Returns how many were still under way when `limit` ran out.
    pub fn drain(&self, limit: std::time::Duration) -> (HostGuard<'_>, usize) {
        // Counted first, refused after: one that counted itself before this either sees the
        // flag and gives up or is waited for (both SeqCst).
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        let deadline = std::time::Instant::now() + limit;
        while self.in_flight() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let host = self.lock();
        (host, self.in_flight())
    }

    /// The host, locked, for a change.
    pub fn lock(&self) -> HostGuard<'_> {
        HostGuard {
            host: self.host.lock().unwrap_or_else(|e| e.into_inner()),
            published: &self.published,
            changed: false,
        }
    }

    /// Whether the host lock can be taken within `timeout` (the watchdog's check that no change
    /// is stuck holding it).
    pub fn lock_is_free_within(&self, timeout: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        loop {
            match self.host.try_lock() {
                Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => return true,
                Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < timeout => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        }
    }

    /// What reads need, as of the last change; takes no lock.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.published.load_full()
    }

    /// Releases `job` (the protocol's `release`): returns how many processes were killed.
    pub fn release(&self, job: &str) -> Result<usize, HostError> {
        let _counted = self.start_change(job)?;
        let ticket = self.begin_settled(|host| host.begin_release(job))?;
        self.finish_release(ticket)
    }

    /// Suspends `job` (the protocol's `suspend`); waiting for the kernel to report it frozen
    /// takes no lock.
    pub fn suspend(&self, job: &str, by: Option<u32>) -> Result<proto::reply::Suspend, HostError> {
        let _counted = self.start_change(job)?;
        let ticket = self.begin_settled(|host| host.begin_suspend(job, by))?;
        let outcome = ticket.run();
        let done = self.lock().finish_suspend(ticket, outcome);
        self.settle();
        done
    }

    /// Freezes again the suspended jobs someone thawed (topod's periodic tick); the waiting takes
    /// no lock.
    pub fn refreeze_suspended(&self) {
        let Ok(_counted) = self.start_change("(suspended jobs)") else { return };
        let tickets = match self.begin_settled(|host| Ok(host.begin_refreeze())) {
            Ok(tickets) => tickets,
            Err(_) => return,
        };
        for ticket in tickets {
            let outcome = ticket.run();
            self.lock().finish_refreeze(ticket, outcome);
        }
    }

    /// Resumes `job` (the protocol's `resume`); its CPUs are taken back before it thaws.
    pub fn resume(&self, job: &str, by: Option<u32>) -> Result<proto::reply::Resume, HostError> {
        let _counted = self.start_change(job)?;
        let ticket = self.begin_settled(|host| host.begin_resume(job, by))?;
        let outcome = ticket.run();
        let done = self.lock().finish_resume(ticket, outcome);
        self.settle();
        done
    }

    /// Killing the job's processes and waiting for them to go takes no lock: the job shows as
    /// "releasing" meanwhile, and its CPUs stay held until its cgroup is gone.
    fn finish_release(&self, ticket: host::ReleaseTicket) -> Result<usize, HostError> {
        let _counted = InFlight::new(&self.in_flight);
        let outcome = ticket.run();
        let done = self.lock().finish_release(ticket, outcome);
        self.settle();
        done
    }
}

impl super::pending::Releaser for Server {
    /// A release queued while topod could not be reached: the same release, unless the job was
    /// allocated after it was asked (checked under the same lock that starts the release).
    fn release_queued(
        &self,
        job: &crate::cgroup::JobId,
        asked_at: std::time::SystemTime,
    ) -> Result<super::pending::Queued, HostError> {
        let ticket = self.begin_settled(|host| {
            if let Some(at) = host.allocated_after(job.as_str(), asked_at) {
                return Ok(Err(super::pending::Queued::AllocatedSince(at)));
            }
            host.begin_release(job.as_str()).map(Ok)
        })?;
        let ticket = match ticket {
            Ok(ticket) => ticket,
            Err(allocated_since) => return Ok(allocated_since),
        };
        let killed = self.finish_release(ticket)?;
        Ok(super::pending::Queued::Released { killed })
    }
}

/// Which socket a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The public socket (mode 0666): everyone may connect.
    Public,
    /// The administrators' socket (mode 0600, [`proto::admin_socket_for`]): its own listen queue
    /// and accept thread, so no user's flood of connections delays root and the batch system.
    Admins,
}

/// Serves connections until the listener fails.
pub fn serve(listener: UnixListener, server: Arc<Server>, kind: Listener) {
    let mut errors = AcceptErrors::new();
    let mut spawn_failures = AcceptErrors::thread_failures();
    if kind == Listener::Public {
        // A flood of users' connections costs this thread; root's come through the
        // administrators' socket, whose thread keeps its priority.
        lower_priority();
    }
    let what = match kind {
        Listener::Public => "the socket",
        Listener::Admins => "the administrators' socket",
    };
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                errors.failed(what, &e);
                continue;
            }
        };
        let mut peer = match Peer::of(&stream) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!("connection without credentials: {e}");
                continue;
            }
        };
        let privileged = server.admins.allows(&peer);
        if kind == Listener::Admins && !privileged {
            refuse(
                stream,
                &server,
                "this socket is for root and topod's administrators; use the public one",
            );
            continue;
        }
        let admitted = match server.gate.admit(Holder::Uid(peer.uid), privileged) {
            Ok(a) => a,
            Err(why) => {
                refuse(stream, &server, &why);
                continue;
            }
        };
        peer.name_process(&stream);
        // Handed to the connection's thread; taken back here if no thread can be started.
        let work = Arc::new(std::sync::Mutex::new(Some((stream, peer, admitted))));
        let handed = work.clone();
        let for_thread = server.clone();
        let spawned = std::thread::Builder::new().name("topod-conn".into()).spawn(move || {
            let taken = handed.lock().unwrap_or_else(|e| e.into_inner()).take();
            let Some((stream, peer, admitted)) = taken else { return };
            if !privileged {
                lower_priority();
            } else if kind == Listener::Public {
                // Root or an administrator on the public socket (an administrator who is not
                // root cannot open the admins' one, mode 0600): back up from the listener's
                // nice 10 to topod's own.
                let _ = super::process::set_this_thread_nice(super::process::DAEMON_NICE);
            }
            let lines = LineReader::new(proto::MAX_LINE_BYTES, &for_thread.gate.limits());
            if let Err(e) = connection(stream, lines, &for_thread, &peer, false, admitted) {
                tracing::debug!("connection ended: {e}");
            }
        });
        let Err(e) = spawned else { continue };
        let left = work.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((stream, peer, admitted)) = left else { continue };
        if kind == Listener::Admins {
            // Out of threads (a job holding every process id of the host, say): root and the
            // batch system are still answered, one connection at a time on this thread.
            spawn_failures.failed(
                &format!("{what} (its connections are served one at a time meanwhile)"),
                &e,
            );
            let lines = LineReader::new(proto::MAX_LINE_BYTES, &server.gate.limits());
            if let Err(e) = connection(stream, lines, &server, &peer, false, admitted) {
                tracing::debug!("connection ended: {e}");
            }
        } else {
            spawn_failures.failed(what, &e);
            refuse(
                stream,
                &server,
                "topod cannot start a thread for this connection now (the host is out of processes or memory); try again",
            );
        }
    }
}

/// How far below root's the threads serving other users run (nice): on a host whose CPUs are
/// all busy, a user looping expensive reads takes CPU from topod's work for root and the batch
/// system only in this proportion (about a tenth of a contended CPU), without starving.
const UNPRIVILEGED_NICE: i32 = 10;

/// Lowers the calling connection thread to [`UNPRIVILEGED_NICE`]; logged once if the system
/// does not allow it.
pub(crate) fn lower_priority() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Err(e) = super::process::set_this_thread_nice(UNPRIVILEGED_NICE) {
        WARNED.call_once(|| {
            tracing::warn!("cannot lower the priority of threads serving other users: {e}")
        });
    }
}

/// Answers a connection that is over a limit with one error line (never waiting on the client)
/// and closes it.
pub(crate) fn refuse(mut stream: impl Timed, server: &Server, why: &str) {
    let _ = stream.set_write_timeout(Some(
        std::time::Duration::from_millis(100).min(server.gate.limits().write),
    ));
    // Before any request: in the oldest version, which every client reads.
    let refusal = Reply::error(ErrorCode::Busy, why).in_version(proto::OLDEST_PROTOCOL_VERSION);
    let _ = stream.write_all(refusal.to_line().as_bytes());
}

/// Serves one connection: a request line, a reply line, until the client closes, falls silent,
/// or sends a line too long or too slow. `read_only` refuses every change (the TCP listener).
pub(crate) fn connection(
    mut stream: impl Timed,
    mut lines: LineReader,
    server: &Server,
    peer: &Peer,
    read_only: bool,
    admitted: Admitted,
) -> std::io::Result<()> {
    let limits = server.gate.limits();
    stream.set_write_timeout(Some(limits.write))?;
    // Work for a user who is not an administrator is charged to that user (or TCP address), and
    // one who has spent more than a share of a CPU waits before the next request.
    let charged = (!server.admins.allows(peer)).then_some(admitted.holder());
    loop {
        // The wait comes before the line is read: reading 64 KiB is work too.
        let cpu_before = charged.map(|holder| {
            let wait = server.gate.wait_for(holder);
            if !wait.is_zero() {
                std::thread::sleep(wait);
            }
            thread_cpu_time()
        });
        // A release, suspension or resumption counts as under way until its reply is written:
        // a stop waits for it (Server::drain), so its caller is answered, not cut off (seen
        // on the cgroup v2 guest: the release was done, the reply never sent).
        let mut answering = None;
        // Each reply in its request's protocol version; a line that is no request, in the
        // oldest (every client reads it).
        let mut version = proto::OLDEST_PROTOCOL_VERSION;
        let (reply, close) = match lines.next(&mut stream)? {
            Line::Closed => return Ok(()),
            Line::TimedOut { partial: false } => return Ok(()),
            Line::TimedOut { partial: true } => (
                Reply::error(
                    ErrorCode::BadRequest,
                    format!(
                        "the request line did not arrive whole within {} s; closing",
                        limits.line.as_secs_f64()
                    ),
                ),
                true,
            ),
            // The rest of that line cannot be trusted to be a request: close.
            Line::TooLong(n) => (
                Reply::error(ErrorCode::BadRequest, proto::ProtoError::TooLong(n).to_string()),
                true,
            ),
            Line::Complete(line) => match proto::parse_request(&line) {
                Ok(req) if read_only && req.op.changes_state() => {
                    version = req.v;
                    (
                        Reply::error(
                            ErrorCode::Forbidden,
                            "the TCP listener is read-only; change state through the local socket",
                        ),
                        false,
                    )
                }
                Ok(req) => {
                    version = req.v;
                    if matches!(req.op, Op::Release { .. } | Op::Suspend { .. } | Op::Resume { .. })
                    {
                        answering = Some(InFlight::new(&server.in_flight));
                    }
                    let (op, started) = (req.op.name(), std::time::Instant::now());
                    let reply = handle(server, peer, req.op);
                    let refused = reply.error.as_ref().map(|e| {
                        serde_json::to_value(e.code)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_default()
                    });
                    server.metrics.request(op, started.elapsed().as_secs_f64(), refused);
                    (reply, false)
                }
                Err(e) => (Reply::error(ErrorCode::BadRequest, e.to_string()), false),
            },
        };
        stream.write_all(reply.in_version(version).to_line().as_bytes())?;
        drop(answering);
        if let (Some(holder), Some(before)) = (charged, cpu_before) {
            server.gate.charge(holder, thread_cpu_time().saturating_sub(before));
        }
        if close {
            return Ok(());
        }
    }
}

/// How long a preempting allocate waits for the suspensions and resumptions under way (a victim
/// being changed is spared) before it takes the refusal: the freezer's default time limit.
const CHANGE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Answers one request from `peer`.
pub fn handle(server: &Server, peer: &Peer, op: Op) -> Reply {
    // A change may queue freezes and thaws (a gang job that runs now, a job preemption
    // suspended that may resume): run before the answer, without the host lock.
    let settles = matches!(
        op,
        Op::Allocate(_) | Op::Resize { .. } | Op::Follow(_) | Op::Reserve(_) | Op::Unreserve { .. }
    );
    let reply = handle_op(server, peer, op);
    if settles {
        server.settle();
    }
    reply
}

/// [`handle`], before the kernel's queued waits.
fn handle_op(server: &Server, peer: &Peer, op: Op) -> Reply {
    let admin = server.admins.allows(peer);
    let forbidden = |what: &str| {
        Reply::error(
            ErrorCode::Forbidden,
            format!(
                "{what} needs root or a configured administrator; you are uid {} gid {}",
                peer.uid, peer.gid
            ),
        )
    };
    match op {
        Op::Version => ok(proto::reply::Version {
            topod: env!("CARGO_PKG_VERSION").to_string(),
            protocol: proto::PROTOCOL_VERSION,
            cgroup: server.backend_kind.to_string(),
            pid: std::process::id(),
        }),
        Op::Topology => Reply::ok(server.topology_json.clone()),
        Op::FreeMap => ok(server.snapshot().free_map()),
        Op::Fit(proto::FitArgs { request, tasks, cpus, gpus }) => {
            // A device file is looked up as root: not for anyone to probe paths with.
            if !admin && gpus.iter().any(|g| g.starts_with('/')) {
                return forbidden("naming GPUs by device file");
            }
            let prepared = match host::prepare(&server.topology, &request, tasks, cpus.as_deref())
                .and_then(|p| {
                    let gpus = host::device_files_to_pci(&server.topology, &gpus)?;
                    p.with_gpus(&server.topology, &gpus)
                }) {
                Ok(p) => p,
                Err(e) => return error_reply(&e),
            };
            let snap = server.snapshot();
            match snap.fit(&prepared) {
                Ok(fit) => Reply::ok(serde_json::to_value(fit).unwrap_or_default()),
                Err(e) => error_reply(&e),
            }
        }
        Op::List => {
            let snap = server.snapshot();
            Reply::ok(serde_json::to_value(&snap.jobs).unwrap_or_default())
        }
        Op::Allocate(args) => {
            if !admin {
                return forbidden("allocate");
            }
            // What the job asks, read and checked once (`Prepared::from_allocate`).
            let prepared = match host::Prepared::from_allocate(&server.topology, &args) {
                Ok(p) => p,
                Err(e) => return error_reply(&e),
            };
            let proto::AllocateArgs { job, mem_limit_bytes, join_pid, preempt, batch, .. } = args;
            let owner_uid = prepared.ask.owner_uid;
            // An administrator may move any process in, as with `join`, but never topod's own.
            let target = match join_pid.map(|pid| join_target(pid, peer, true)).transpose() {
                Ok(t) => t,
                Err(reply) => return reply,
            };
            let mut host = server.lock();
            // Whether the job held CPUs before the allocate that answers, under the same hold of
            // the lock as that allocate and the join: a retry of this request on another
            // connection may allocate the job while this one waits without the lock, and a
            // failed join must not then release (and kill) what that one started.
            let mut existed;
            // What the batch system did to the other jobs here first: a job it suspended
            // lends this one its CPUs.
            // A preempting allocate's victims freeze without the lock, then the same allocate
            // places it; one refused while freezes or thaws are under way, or while a job is
            // being suspended or resumed (a victim being changed is spared), asks again once
            // they are done. A few rounds of preemption at most: each waits for the kernel, and
            // another request may take what it freed; the wait for suspensions and resumptions
            // is bounded by the freezer's own time limit.
            let mut rounds = 0;
            let waiting_since = std::time::Instant::now();
            let allocated = loop {
                existed = host.ledger().get(&job).is_some();
                let allocated = host.allocate_following(
                    batch.as_ref(),
                    &job,
                    &prepared,
                    mem_limit_bytes,
                    owner_uid,
                );
                let refused = matches!(allocated, Err(HostError::DoesNotFit { .. })) && preempt;
                let under_way = matches!(allocated, Err(HostError::PreemptionUnderWay(_)));
                if (under_way || refused && host.kernel_work_pending()) && rounds < 4 {
                    rounds += 1;
                    drop(host);
                    server.settle_all();
                    host = server.lock();
                    continue;
                }
                if refused && host.changes_under_way() && waiting_since.elapsed() < CHANGE_WAIT_MAX
                {
                    // Asked again once they are done, not at every look (a placement each time).
                    loop {
                        drop(host);
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        host = server.lock();
                        if !host.changes_under_way() || waiting_since.elapsed() >= CHANGE_WAIT_MAX {
                            break;
                        }
                    }
                    continue;
                }
                // Refused before it came to place the job: its victims run again.
                host.abandon_preemption(&job);
                break allocated;
            };
            let allocated = match allocated {
                Err(HostError::PreemptionUnderWay(_)) => Err(HostError::Changing {
                    job: job.clone(),
                    what: "not started: each time its preemption had freed CPUs, other requests (for this job or others) changed the host first",
                }),
                other => other,
            };
            let alloc = match allocated {
                Ok(a) => a,
                Err(e) => return error_reply(&e),
            };
            if let Some(target) = target {
                // All or nothing: an allocation this request made is undone when the process
                // cannot be moved in; one that was there before stays.
                let pid = target.pid();
                if let Err(e) = host.join(&job, pid) {
                    let mut reply = error_reply(&e);
                    let outcome = if existed {
                        format!("job {job} keeps its allocation (CPUs {})", alloc.cpus)
                    } else {
                        match host.release(&job) {
                            Ok(_) => format!("job {job} was not allocated"),
                            Err(undo) => format!(
                                "job {job} is allocated (CPUs {}) and could not be undone: {undo}",
                                alloc.cpus
                            ),
                        }
                    };
                    if let Some(err) = reply.error.as_mut() {
                        err.message = format!(
                            "{outcome}: process {pid} could not be moved in: {}",
                            err.message
                        );
                    }
                    return reply;
                }
                moved_check(&target, &job);
            }
            Reply::ok(serde_json::to_value(alloc).unwrap_or_default())
        }
        Op::Join { job, pid } => {
            let target = match join_target(pid, peer, admin) {
                Ok(t) => t,
                Err(reply) => return reply,
            };
            let mut host = server.lock();
            if !admin && host.owner_of(&job) != Some(peer.uid) {
                return Reply::error(ErrorCode::Forbidden, format!("job {job} is not yours (uid {}): only its owner or an administrator may move processes into it", peer.uid));
            }
            // Checked again under the lock, just before the write, through the same pidfd: the
            // process may have exec'd a set-uid program while this request waited for the lock.
            if !admin {
                if let Err(reply) = runs_as(&target, peer.uid) {
                    return reply;
                }
            }
            match host.join(&job, pid) {
                Ok(()) => {
                    moved_check(&target, &job);
                    ok(proto::reply::Join { job, pid })
                }
                Err(e) => error_reply(&e),
            }
        }
        Op::SelfJoinFiles { job } => {
            let mut host = server.lock();
            if !admin && host.owner_of(&job) != Some(peer.uid) {
                return forbidden("moving yourself into a job you do not own");
            }
            match host.self_join_files(&job) {
                Ok(files) => ok(proto::reply::SelfJoinFiles { job, files }),
                Err(e) => error_reply(&e),
            }
        }
        Op::Release { job } => {
            if !admin {
                return forbidden("release");
            }
            match server.release(&job) {
                Ok(killed) => ok(proto::reply::Release { job, killed }),
                Err(e) => error_reply(&e),
            }
        }
        Op::Suspend { job } => {
            // As bstop: root, an administrator, or the job's owner (LSF runs a queue's
            // JOB_CONTROLS actions as the job's user). A job topod does not hold is said so
            // first, so that an LSF action can fall back to signals.
            let (owner, by_policy) = {
                if let Err(e) = crate::cgroup::JobId::parse(&job) {
                    return error_reply(&HostError::BadJob(e));
                }
                let host = server.lock();
                if host.ledger().get(&job).is_none() {
                    return error_reply(&HostError::UnknownJob(job));
                }
                (host.owner_of(&job), host.suspended_by_policy(&job))
            };
            if !admin && owner != Some(peer.uid) {
                return forbidden("suspending a job that is not yours");
            }
            if !admin && by_policy {
                // Taken over, the suspension would be the owner's to resume (attack, issue 29).
                return Reply::error(
                    ErrorCode::Forbidden,
                    format!("job {job} is suspended already, by the batch system or for another job; that suspension is not yours to take over (you are uid {})", peer.uid),
                );
            }
            match server.suspend(&job, (!admin).then_some(peer.uid)) {
                Ok(reply) => ok(reply),
                Err(e) => error_reply(&e),
            }
        }
        Op::Resume { job } => {
            let (owner, suspender, suspended) = {
                if let Err(e) = crate::cgroup::JobId::parse(&job) {
                    return error_reply(&HostError::BadJob(e));
                }
                let host = server.lock();
                if host.ledger().get(&job).is_none() {
                    return error_reply(&HostError::UnknownJob(job));
                }
                (host.owner_of(&job), host.suspended_by(&job), host.ledger().is_suspended(&job))
            };
            if !admin && owner != Some(peer.uid) {
                return forbidden("resuming a job that is not yours");
            }
            if !admin && suspended && host_suspended_by_other(suspender, peer.uid) {
                let why = server.lock().not_the_owners_to_resume(&job, peer.uid);
                return Reply::error(ErrorCode::Forbidden, why);
            }
            if !admin {
                if let Some((pid, uid)) = server.lock().foreign_process(&job, peer.uid) {
                    return error_reply(&HostError::ForeignProcess { job, pid, uid });
                }
            }
            match server.resume(&job, (!admin).then_some(peer.uid)) {
                Ok(reply) => ok(reply),
                Err(e) => error_reply(&e),
            }
        }
        Op::Resize { job, tasks } => {
            if let Err(e) = crate::cgroup::JobId::parse(&job) {
                return error_reply(&HostError::BadJob(e));
            }
            let mut host = server.lock();
            if !admin {
                // Its owner may give CPUs back, never take more: growing is the batch
                // system's decision.
                let Some(alloc) = host.ledger().get(&job) else {
                    return error_reply(&HostError::UnknownJob(job));
                };
                if host.owner_of(&job) != Some(peer.uid) {
                    return forbidden("resizing a job that is not yours");
                }
                if tasks as usize > alloc.tasks.len() {
                    return forbidden("growing a job");
                }
            }
            match host.resize(&job, tasks) {
                Ok(alloc) => Reply::ok(serde_json::to_value(alloc).unwrap_or_default()),
                Err(e) => error_reply(&e),
            }
        }
        Op::Reserve(proto::ReserveArgs { job, request, tasks, cpus, expires_in_s }) => {
            if !admin {
                return forbidden("reserve");
            }
            let prepared = match host::prepare(&server.topology, &request, tasks, cpus.as_deref()) {
                Ok(p) => p,
                Err(e) => return error_reply(&e),
            };
            let mut host = server.lock();
            match host.reserve(&job, &prepared, expires_in_s) {
                Ok((reservation, busy)) => {
                    let held = host.held_gpus();
                    drop(host);
                    let busy_gpus =
                        reservation.gpus.iter().filter(|g| held.contains(*g)).cloned().collect();
                    ok(proto::reply::Reserve { reservation, busy, busy_gpus })
                }
                Err(e) => error_reply(&e),
            }
        }
        Op::Follow(view) => {
            // The batch system's word: only root or an administrator may speak for it (a user
            // who could mark jobs suspended could take their CPUs).
            if !admin {
                return forbidden("follow");
            }
            match server.lock().follow_batch(&view) {
                Ok(done) => ok(done),
                Err(e) => error_reply(&e),
            }
        }
        Op::Unreserve { job } => {
            if !admin {
                return forbidden("unreserve");
            }
            match server.lock().unreserve(&job) {
                Ok(r) => Reply::ok(serde_json::to_value(r).unwrap_or_default()),
                Err(e) => error_reply(&e),
            }
        }
    }
}

/// Whether a suspension was not the peer's own (an owner resumes only what it suspended).
fn host_suspended_by_other(suspender: Option<u32>, uid: u32) -> bool {
    suspender != Some(uid)
}

/// The process a join would move, named by a pidfd and checked: a process (not a thread), not
/// topod's own, and, for a peer that is not an administrator, the very process that connected,
/// still running as the peer's user.
fn join_target(pid: i32, peer: &Peer, admin: bool) -> Result<ProcessHandle, Reply> {
    let refused = |e: ProcessError| {
        Reply::error(ErrorCode::BadRequest, format!("cannot move process {pid}: {e}"))
    };
    let target = ProcessHandle::open(pid).map_err(refused)?;
    // pidfd_open refuses a thread that is not its process's leader, so of topod's own ids only
    // its process id is left to refuse here.
    if pid == std::process::id() as i32 {
        return Err(Reply::error(
            ErrorCode::BadRequest,
            format!("pid {pid} is topod itself; topod never moves its own processes or threads into a job"),
        ));
    }
    if admin {
        return Ok(target);
    }
    let forbidden = |why: String| Err(Reply::error(ErrorCode::Forbidden, why));
    let Some(own) = &peer.process else {
        return forbidden("topod could not identify the process that opened this connection, so it moves none for a user who is not an administrator".into());
    };
    if pid != peer.pid {
        return forbidden(format!(
            "you may move only your own process (pid {}) into your job, not pid {pid}",
            peer.pid
        ));
    }
    if !own.alive() {
        return forbidden(format!("the process that opened this connection (pid {}) has exited; a connection cannot move another process in its place", peer.pid));
    }
    runs_as(&target, peer.uid)?;
    Ok(target)
}

/// The process `target` names is alive and runs as `uid` (real and effective); else the refusal.
fn runs_as(target: &ProcessHandle, uid: u32) -> Result<(), Reply> {
    let pid = target.pid();
    let status = target.status().map_err(|e| {
        Reply::error(ErrorCode::BadRequest, format!("cannot move process {pid}: {e}"))
    })?;
    if status.uids[0] != uid || status.uids[1] != uid {
        return Err(Reply::error(
            ErrorCode::Forbidden,
            format!(
                "process {pid} does not run as uid {uid} (real uid {}, effective uid {})",
                status.uids[0], status.uids[1]
            ),
        ));
    }
    Ok(())
}

/// After a move: a target that exited meanwhile may have let its pid number go to another
/// process before the kernel's write; say so where an administrator will see it.
fn moved_check(target: &ProcessHandle, job: &str) {
    if !target.alive() {
        tracing::warn!("job {job}: process {} exited while it was being moved in; if its pid was reused at once, another process may be in the job", target.pid());
    }
}

/// A success carrying `value`.
fn ok(value: impl serde::Serialize) -> Reply {
    Reply::ok(serde_json::to_value(value).unwrap_or_default())
}

/// The reply for a refused or failed host operation.
pub fn error_reply(e: &HostError) -> Reply {
    let code = match e {
        HostError::ForeignProcess { .. }
        | HostError::HoldsForPreempted { .. }
        | HostError::WaitedFor { .. } => ErrorCode::Forbidden,
        HostError::BadJob(_)
        | HostError::AlreadyAllocated { .. }
        | HostError::BadPid(_)
        | HostError::Releasing(_)
        | HostError::Changing { .. }
        | HostError::Ledger(topo_core::ledger::LedgerError::WrongState { .. }) => {
            ErrorCode::BadRequest
        }
        HostError::Lent { .. } => ErrorCode::DoesNotFit,
        HostError::Suspended(_) => ErrorCode::BadRequest,
        HostError::NoGang(_) | HostError::GangRow { .. } => ErrorCode::BadRequest,
        HostError::NotMalleable { .. }
        | HostError::OutOfRange { .. }
        | HostError::TasksUnknown { .. } => ErrorCode::BadRequest,
        HostError::Notify(_) | HostError::PreemptionUnderWay(_) => ErrorCode::Internal,
        HostError::NoReservation(_) => ErrorCode::UnknownJob,
        HostError::BadArgument(_)
        | HostError::Ledger(topo_core::ledger::LedgerError::Moving(..)) => ErrorCode::BadRequest,
        HostError::BadRequest(_) | HostError::Unparsable(_) => ErrorCode::BadTopologyRequest,
        HostError::DoesNotFit { .. } => ErrorCode::DoesNotFit,
        HostError::UnknownJob(_) => ErrorCode::UnknownJob,
        HostError::Survivors { .. }
        | HostError::Cgroup(_)
        | HostError::Ledger(_)
        | HostError::Records(_) => ErrorCode::Internal,
    };
    let reply = Reply::error(code, e.to_string());
    match e {
        // Version 2 points at the offending text of the request string.
        HostError::Unparsable(parse) => reply.at(proto::ErrorAt {
            field: "request".into(),
            start: parse.span.start,
            end: parse.span.end,
        }),
        _ => reply,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_fit_is_answered_while_the_host_lock_is_held() {
        // What a 64 KiB fit costs must never be paid under the host lock, where it would stall
        // every allocate and release (3.6 s per fit once): a fit reads the published snapshot,
        // and a request it refuses is refused before that. So both are answered while a change
        // holds the lock (here the test, for as long as it waits). A fit that took the lock
        // would not answer until the wait below gave up.
        let server = super::super::metrics::tests::fake_server();
        let held = server.lock();
        let huge = format!("CPUSET[CPU_LIST={}]", vec!["0-65535"; 64 * 1024 / 8 - 10].join(","));
        let (tx, rx) = std::sync::mpsc::channel();
        let asker = {
            let server = server.clone();
            std::thread::spawn(move || {
                for request in [huge, "affinity[core*2]".to_string()] {
                    let op = Op::Fit(proto::FitArgs::new(request));
                    let _ = tx.send(handle(&server, &Peer::nobody(), op));
                }
            })
        };
        let wait = std::time::Duration::from_secs(60);
        let refused = rx.recv_timeout(wait).expect("a refused fit waited for the host lock");
        let e = refused.error.expect("refused").message;
        assert!(e.contains("CPUs 4-65535, which this host does not have"), "{e}");
        let fit = rx.recv_timeout(wait).expect("a fit waited for the host lock");
        assert!(fit.ok.is_some(), "{:?}", fit.error);
        drop(held);
        asker.join().unwrap();
    }

    /// A kernel whose freezes wait until the test opens the gate (a freezer that takes its
    /// time: a busy job, a slow machine), saying when one has begun.
    struct SlowFreezer {
        kernel: Arc<crate::cgroup::fake::Fake>,
        began: Mutex<std::sync::mpsc::Sender<String>>,
        gate: Gate,
    }

    impl SlowFreezer {
        fn wait(&self) {
            let mut open = self.gate.open.lock().unwrap();
            while !*open {
                open = self.gate.opened.wait(open).unwrap();
            }
        }
    }

    impl crate::cgroup::CgroupBackend for SlowFreezer {
        fn kind(&self) -> &'static str {
            "fake"
        }
        fn create(
            &self,
            j: &crate::cgroup::JobId,
            s: &crate::cgroup::CgroupSpec,
        ) -> Result<crate::cgroup::Effective, crate::cgroup::CgroupError> {
            self.kernel.create(j, s)
        }
        fn join(&self, j: &crate::cgroup::JobId, p: i32) -> Result<(), crate::cgroup::CgroupError> {
            self.kernel.join(j, p)
        }
        fn pids(&self, j: &crate::cgroup::JobId) -> Result<Vec<i32>, crate::cgroup::CgroupError> {
            self.kernel.pids(j)
        }
        fn release(
            &self,
            j: &crate::cgroup::JobId,
            t: std::time::Duration,
        ) -> Result<crate::cgroup::ReleaseReport, crate::cgroup::CgroupError> {
            self.kernel.release(j, t)
        }
        fn list(
            &self,
        ) -> Result<Vec<(crate::cgroup::JobId, crate::cgroup::Effective)>, crate::cgroup::CgroupError>
        {
            self.kernel.list()
        }
        fn freeze(
            &self,
            j: &crate::cgroup::JobId,
            t: std::time::Duration,
        ) -> Result<(), crate::cgroup::CgroupError> {
            let _ = self.began.lock().unwrap().send(j.to_string());
            self.wait();
            self.kernel.freeze(j, t)
        }
        fn thaw(
            &self,
            j: &crate::cgroup::JobId,
            t: std::time::Duration,
        ) -> Result<(), crate::cgroup::CgroupError> {
            if self.gate.thaws_too.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = self.began.lock().unwrap().send(format!("thaw {j}"));
                self.wait();
            }
            self.kernel.thaw(j, t)
        }
        fn is_frozen(&self, j: &crate::cgroup::JobId) -> Result<bool, crate::cgroup::CgroupError> {
            self.kernel.is_frozen(j)
        }
    }

    /// Where a [`SlowFreezer`]'s freezes (and, when asked, thaws) wait until the test opens it.
    #[derive(Default)]
    struct GateState {
        open: Mutex<bool>,
        opened: std::sync::Condvar,
        thaws_too: std::sync::atomic::AtomicBool,
    }
    type Gate = Arc<GateState>;

    /// A 4-core host on a [`SlowFreezer`] kernel (its gate open), that kernel, and the
    /// freezes' starts.
    fn slow_host() -> (Host, Arc<crate::cgroup::fake::Fake>, std::sync::mpsc::Receiver<String>, Gate)
    {
        use topo_core::topology::{SyntheticShape, Topology};
        let topo = Topology::synthetic(SyntheticShape {
            packages: 1,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 4,
            threads_per_core: 1,
        });
        let kernel = Arc::new(crate::cgroup::fake::Fake::new(
            topo.allowed.clone(),
            topo.allowed_mems.clone(),
        ));
        let (began_tx, began) = std::sync::mpsc::channel();
        let gate = Arc::new(GateState { open: Mutex::new(true), ..Default::default() });
        let backend =
            SlowFreezer { kernel: kernel.clone(), began: Mutex::new(began_tx), gate: gate.clone() };
        let host = Host::new(
            topo,
            topo_core::cpuset::CpuSet::new(),
            Box::new(backend),
            None,
            topo_core::place::Strategy::BestFit,
        )
        .unwrap();
        (host, kernel, began, gate)
    }

    fn open(gate: &GateState, open: bool) {
        *gate.open.lock().unwrap() = open;
        gate.opened.notify_all();
    }

    #[test]
    fn a_gang_switch_freezes_without_the_host_lock_and_no_cpu_runs_two_jobs_meanwhile() {
        use crate::cgroup::CgroupBackend;
        let (mut host, kernel, began, gate) = slow_host();
        let topo = host.topology().clone();
        let seconds = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let clock = seconds.clone();
        host.set_clock(Arc::new(move || {
            std::time::UNIX_EPOCH
                + std::time::Duration::from_secs(clock.load(std::sync::atomic::Ordering::SeqCst))
        }));
        host.set_gang(Some(host::GangConfig {
            gang: topo_core::policy::Gang { slice: 30, rows: 2 },
            all_jobs: false,
            prime_queues: Vec::new(),
        }));
        for (job, row) in [("a", 0), ("b", 1)] {
            let mut prepared = host::prepare(&topo, "affinity[core*4]", None, None).unwrap();
            prepared.gang =
                host::GangAsk { gang: Some(true), row: Some(row), ..Default::default() };
            host.allocate_prepared(job, &prepared, None, None).unwrap();
        }
        let frozen = |job: &str| kernel.is_frozen(&crate::cgroup::JobId::parse(job).unwrap());
        assert_eq!((frozen("a").unwrap(), frozen("b").unwrap()), (false, true), "row 0's slice");
        let server = Server::new(
            host,
            Default::default(),
            super::super::conn::Gate::new(Default::default()),
        );
        // Row 1's slice: a is frozen, slowly. (Not the freezes that created a and b frozen.)
        while began.try_recv().is_ok() {}
        open(&gate, false);
        seconds.store(30, std::sync::atomic::Ordering::SeqCst);
        let switcher = {
            let server = server.clone();
            std::thread::spawn(move || {
                let now = server.lock().now();
                server.lock().gang_switch(now);
                server.settle();
            })
        };
        assert_eq!(began.recv().unwrap(), "a");
        // The freeze waits on the kernel: the host lock is free, b is not thawed onto a's CPUs
        // (a still runs), and a release of a waits for the freeze instead of being refused.
        {
            let host = server.host.try_lock().expect("the host lock was held during a freeze");
            assert!(!host.ledger().is_gang_frozen("a") && host.ledger().is_gang_frozen("b"));
            host.ledger().check().unwrap();
        }
        assert!(frozen("b").unwrap(), "b thawed while a may still run on its CPUs");
        let releaser = {
            let server = server.clone();
            std::thread::spawn(move || server.release("a"))
        };
        open(&gate, true);
        switcher.join().unwrap();
        assert_eq!(releaser.join().unwrap().unwrap(), 0, "the release of a, after its freeze");
        // The freeze done, b runs in its slice; a is gone.
        assert!(!frozen("b").unwrap());
        let host = server.lock();
        assert!(host.ledger().get("a").is_none() && !host.ledger().is_gang_frozen("b"));
        host.ledger().check().unwrap();
        assert!(!host.kernel_work_pending());
    }

    /// A server on a [`SlowFreezer`] host with preemption on and job v, preemptible, on all 4
    /// cores; the kernel, the freezes' starts, the gate, and the time (seconds since the epoch).
    fn preemption_server(
        max_suspensions: u32,
    ) -> (Arc<Server>, Arc<crate::cgroup::fake::Fake>, std::sync::mpsc::Receiver<String>, Gate, i64)
    {
        let (mut host, kernel, began, gate) = slow_host();
        let topo = host.topology().clone();
        host.set_preempt(Some(topo_core::policy::Preempt {
            min_run: 0,
            max_suspensions,
            ..topo_core::policy::Preempt::default()
        }));
        let now = host.now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        let mut victim = host::prepare(&topo, "affinity[core*4]", None, None).unwrap();
        host::PreemptAsk::apply(
            host::PreemptAsk {
                preemptible: true,
                submitted_at: Some(now),
                estimate_s: Some(36_000),
                ..Default::default()
            },
            &mut victim,
        );
        host.allocate_prepared("v", &victim, None, None).unwrap();
        let server = Server::new(
            host,
            Default::default(),
            super::super::conn::Gate::new(Default::default()),
        );
        while began.try_recv().is_ok() {}
        (server, kernel, began, gate, now)
    }

    /// An allocate of 2 cores that may preempt, by a job that has waited 3 of its 1-hour
    /// estimates (expansion factor 4).
    fn preempting(job: &str, now: i64) -> Op {
        let mut args = proto::AllocateArgs::new(job.to_string(), "affinity[core*2]".to_string());
        args.preempt = true;
        args.submitted_at = Some(now - 3 * 3600);
        args.estimate_s = Some(3600);
        Op::Allocate(args)
    }

    fn root() -> Peer {
        Peer { pid: 0, uid: 0, gid: 0, process: None }
    }

    #[test]
    fn a_preemptor_waits_for_its_victims_freeze_without_the_host_lock() {
        use crate::cgroup::CgroupBackend;
        let (server, kernel, began, gate, now) = preemption_server(2);
        let (root, ask) = (root(), |job: &str| preempting(job, now));
        open(&gate, false);
        let asker = {
            let (server, root, op) = (server.clone(), root.clone(), ask("p"));
            std::thread::spawn(move || handle(&server, &root, op))
        };
        assert_eq!(began.recv().unwrap(), "v");
        {
            let host = server.host.try_lock().expect("the host lock was held during a freeze");
            // v runs on its CPUs until the kernel says it is frozen: p is not placed yet.
            assert!(host.ledger().get("p").is_none() && !host.ledger().is_suspended("v"));
            host.ledger().check().unwrap();
        }
        // The same job asked again meanwhile (a second connection) is told to wait, and
        // preempts nothing more.
        let again = handle(&server, &root, ask("p"));
        let e = again.error.expect("refused").message;
        assert!(e.contains("being started"), "{e}");
        open(&gate, true);
        let reply = asker.join().unwrap();
        assert!(reply.ok.is_some(), "{:?}", reply.error);
        let host = server.lock();
        assert!(host.ledger().is_suspended("v") && host.ledger().get("p").is_some());
        assert!(kernel.is_frozen(&crate::cgroup::JobId::parse("v").unwrap()).unwrap());
        host.ledger().check().unwrap();
        assert!(!host.kernel_work_pending());
    }

    #[test]
    fn a_preemptor_refused_while_its_victim_is_being_resumed_asks_again_once_it_is() {
        use crate::cgroup::CgroupBackend;
        // Found by an attack: p2 asked to preempt while v, preempted by p1 (just released), was
        // being thawed; v counted as "being changed" and p2 was refused, a state the lock never
        // showed before. It now waits for the thaw and preempts v again.
        let (server, kernel, began, gate, now) = preemption_server(10);
        let (root, ask) = (root(), |job: &str| preempting(job, now));
        let reply = handle(&server, &root, ask("p1"));
        assert!(reply.ok.is_some(), "{:?}", reply.error);
        while began.try_recv().is_ok() {}
        // p1 ends; v's resume is slow.
        gate.thaws_too.store(true, std::sync::atomic::Ordering::SeqCst);
        open(&gate, false);
        let releaser = {
            let server = server.clone();
            std::thread::spawn(move || server.release("p1"))
        };
        assert_eq!(began.recv().unwrap(), "thaw v");
        let opener = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                // Long enough for p2's first try to meet v being thawed (if it comes later, it
                // finds v running and preempts it at once: it passes either way).
                std::thread::sleep(std::time::Duration::from_millis(200));
                open(&gate, true);
            })
        };
        let reply = handle(&server, &root, ask("p2"));
        assert!(reply.ok.is_some(), "p2: {:?}", reply.error);
        releaser.join().unwrap().unwrap();
        opener.join().unwrap();
        let host = server.lock();
        assert!(host.ledger().is_suspended("v") && host.ledger().get("p2").is_some());
        assert!(kernel.is_frozen(&crate::cgroup::JobId::parse("v").unwrap()).unwrap());
        host.ledger().check().unwrap();
    }

    #[test]
    fn a_preemptor_that_meets_its_victim_being_suspended_by_root_waits_for_that() {
        // Found by the second attack: root suspends v while p2 asks to preempt it; v, being
        // suspended, was spared ("being changed") and p2 refused, though v's suspension lends p2
        // its CPUs a moment later.
        let (server, _kernel, began, gate, now) = preemption_server(2);
        open(&gate, false);
        let suspender = {
            let server = server.clone();
            std::thread::spawn(move || server.suspend("v", None))
        };
        assert_eq!(began.recv().unwrap(), "v");
        let opener = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                // Long enough for p2's first try to meet v being suspended (if it comes later,
                // it borrows v's CPUs at once: it passes either way).
                std::thread::sleep(std::time::Duration::from_millis(200));
                open(&gate, true);
            })
        };
        let reply = handle(&server, &root(), preempting("p2", now));
        assert!(reply.ok.is_some(), "p2: {:?}", reply.error);
        suspender.join().unwrap().unwrap();
        opener.join().unwrap();
        let host = server.lock();
        assert!(host.ledger().is_suspended("v") && host.ledger().get("p2").is_some());
        host.ledger().check().unwrap();
    }

    #[test]
    fn a_join_checks_the_processs_uid_through_its_pidfd_each_time() {
        // The check a join makes before the host lock and again under it, just before the
        // write: a process that changed uid meanwhile (a set-uid exec) is refused the second time.
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: starting a process as another uid needs root");
            return;
        }
        use std::os::unix::process::CommandExt;
        let mut other = std::process::Command::new("sleep").arg("30").uid(65534).spawn().unwrap();
        let handle = ProcessHandle::open(other.id() as i32).unwrap();
        assert!(runs_as(&handle, 65534).is_ok());
        let err = runs_as(&handle, 0).unwrap_err().error.unwrap();
        assert_eq!(err.code, ErrorCode::Forbidden);
        assert!(
            err.message.contains("does not run as uid 0 (real uid 65534, effective uid 65534)"),
            "{}",
            err.message
        );
        other.kill().unwrap();
        other.wait().unwrap();
        let err = runs_as(&handle, 65534).unwrap_err().error.unwrap();
        assert_eq!(err.code, ErrorCode::BadRequest, "{}", err.message);
    }

    #[test]
    fn a_reused_peer_pid_is_not_the_peer() {
        // The peer connected and exited; its pid number now names another live process (here a
        // sleep of the same user, standing in for whatever got the number after a wrap-around).
        let mut opener = std::process::Command::new("true").spawn().unwrap();
        let opener_fd = ProcessHandle::open(opener.id() as i32).unwrap();
        opener.wait().unwrap();
        let mut reused = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let reused_pid = reused.id() as i32;
        let peer = Peer { pid: reused_pid, uid: me(), gid: 0, process: Some(Arc::new(opener_fd)) };
        let reply = join_target(reused_pid, &peer, false).unwrap_err();
        let err = reply.error.unwrap();
        assert_eq!(err.code, ErrorCode::Forbidden);
        assert!(
            err.message.contains("has exited")
                && err.message.contains("cannot move another process"),
            "{}",
            err.message
        );
        // The live peer itself is fine; a process that is not the peer is not.
        let live = Peer {
            pid: reused_pid,
            uid: me(),
            gid: 0,
            process: Some(Arc::new(ProcessHandle::open(reused_pid).unwrap())),
        };
        assert!(join_target(reused_pid, &live, false).is_ok());
        let not_peer =
            join_target(std::process::id() as i32, &live, false).unwrap_err().error.unwrap();
        assert!(not_peer.message.contains("topod itself"), "{}", not_peer.message);
        let other = Peer { pid: 1, ..live.clone() };
        let e = join_target(reused_pid, &other, false).unwrap_err().error.unwrap();
        assert!(e.message.contains("only your own process (pid 1)"), "{}", e.message);
        // No pidfd for the peer: only an administrator moves processes.
        let unnamed = Peer { process: None, ..live.clone() };
        assert!(join_target(reused_pid, &unnamed, false)
            .unwrap_err()
            .error
            .unwrap()
            .message
            .contains("could not identify"));
        assert!(join_target(reused_pid, &unnamed, true).is_ok());
        reused.kill().unwrap();
        reused.wait().unwrap();
    }
}
