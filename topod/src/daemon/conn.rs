//! What one connection may cost topod: how many may be open, for how long a line may take to
//! arrive, and how long a reply may wait for a client that does not read.
//!
//! Every connection holds a thread and two descriptors, so a client that opens thousands, or
//! sends one byte every twenty seconds, or never reads its replies, would otherwise take topod
//! from every other client. Connections from root and configured administrators are counted but
//! never refused: an administrator must always be able to reach the host.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The bounds on connections and their lines (configuration keys of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open connections from users who are not administrators, all together.
    pub max_connections: usize,
    /// Open connections from one user (Unix socket) or one address (TCP).
    pub max_connections_per_user: usize,
    /// How long a connection may wait between requests before it is closed.
    pub idle: Duration,
    /// How long a request line may take from its first byte to its newline.
    pub line: Duration,
    /// How long a reply may wait for the client to read it.
    pub write: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 512,
            max_connections_per_user: 64,
            idle: Duration::from_secs(30),
            line: Duration::from_secs(10),
            write: Duration::from_secs(10),
        }
    }
}

/// Who a connection counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A local user, by uid.
    Uid(u32),
    /// A TCP peer, by address.
    Ip(IpAddr),
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Uid(u) => write!(f, "uid {u}"),
            Holder::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Counts open connections and refuses those over the limits.
#[derive(Debug)]
pub struct Gate {
    limits: Limits,
    open: Mutex<GateCounts>,
}

#[derive(Debug, Default)]
struct GateCounts {
    unprivileged: usize,
    by_holder: HashMap<Holder, usize>,
    /// CPU time spent for each holder who is not an administrator, draining at
    /// [`USER_CPU_SHARE`] (a leaky bucket).
    spent: HashMap<Holder, Bucket>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: Duration,
    at: Instant,
}

/// The share of one CPU that topod spends, on average, on one user (or TCP address) who is not
/// an administrator: beyond it, that user's next requests wait (a tenth of a CPU answers
/// hundreds of reads a second, far more than any batch system or person sends).
pub const USER_CPU_SHARE: f64 = 0.1;

/// How much CPU time a user may spend in a burst before waiting.
pub const USER_CPU_BURST: Duration = Duration::from_millis(200);

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub struct Admitted {
    gate: Arc<Gate>,
    holder: Holder,
    privileged: bool,
}

impl Admitted {
    /// Whom the connection counts against.
    pub fn holder(&self) -> Holder {
        self.holder
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.gate.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.by_holder.get_mut(&self.holder) {
            *n -= 1;
            if *n == 0 {
                open.by_holder.remove(&self.holder);
            }
        }
        if !self.privileged {
            open.unprivileged -= 1;
        }
    }
}

impl Gate {
    /// A gate with these limits.
    pub fn new(limits: Limits) -> Arc<Gate> {
        Arc::new(Gate { limits, open: Mutex::new(GateCounts::default()) })
    }

    /// The limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Admits a connection of `holder`, or says why not. `privileged` (root, an administrator)
    /// is always admitted.
    pub fn admit(self: &Arc<Gate>, holder: Holder, privileged: bool) -> Result<Admitted, String> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mine = open.by_holder.get(&holder).copied().unwrap_or(0);
        if !privileged {
            if mine >= self.limits.max_connections_per_user {
                return Err(format!(
                    "too many connections: {holder} has {mine} open, the limit is {} (max_connections_per_user); close some and try again",
                    self.limits.max_connections_per_user
                ));
            }
            if open.unprivileged >= self.limits.max_connections {
                return Err(format!("too many connections: topod has {} open, the limit is {} (max_connections); try again shortly", open.unprivileged, self.limits.max_connections));
            }
            open.unprivileged += 1;
        }
        *open.by_holder.entry(holder).or_insert(0) += 1;
        Ok(Admitted { gate: self.clone(), holder, privileged })
    }

    /// Records that serving `holder` took `cpu` of CPU time.
    pub fn charge(&self, holder: Holder, cpu: Duration) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let b = open.spent.entry(holder).or_insert(Bucket { level: Duration::ZERO, at: now });
        b.level = drained(*b, now) + cpu;
        b.at = now;
        // Forget holders whose buckets have drained, so the map stays the size of the active.
        if open.spent.len() > 1024 {
            open.spent.retain(|_, b| !drained(*b, now).is_zero());
        }
    }

    /// How long `holder`'s next request must wait so that its CPU time stays within
    /// [`USER_CPU_SHARE`] after a burst of [`USER_CPU_BURST`].
    pub fn wait_for(&self, holder: Holder) -> Duration {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let Some(b) = open.spent.get(&holder) else { return Duration::ZERO };
        let level = drained(*b, Instant::now());
        level.saturating_sub(USER_CPU_BURST).div_f64(USER_CPU_SHARE)
    }

    /// Open connections of `holder`.
    pub fn open_of(&self, holder: Holder) -> usize {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_holder
            .get(&holder)
            .copied()
            .unwrap_or(0)
    }
}

/// A bucket's level once it has drained at [`USER_CPU_SHARE`] until `now`.
fn drained(b: Bucket, now: Instant) -> Duration {
    b.level.saturating_sub(now.saturating_duration_since(b.at).mul_f64(USER_CPU_SHARE))
}

/// The CPU time the calling thread has used.
pub fn thread_cpu_time() -> Duration {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map(Duration::from).unwrap_or_default()
}

/// A stream whose read timeout can be set per read (Unix and TCP alike).
pub trait Timed: Read + Write {
    /// As `set_read_timeout` of the std streams.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// As `set_write_timeout` of the std streams.
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Timed for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, t)
    }
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

/// What reading a line gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A whole line, newline removed.
    Complete(Vec<u8>),
    /// More than `max` bytes without a newline; the connection cannot be trusted to be in step.
    TooLong(usize),
    /// The client closed the connection (anything it sent without a newline is dropped).
    Closed,
    /// Nothing came for the idle time, or a started line did not finish in time.
    TimedOut {
        /// Whether a line had begun.
        partial: bool,
    },
}

/// Reads request lines with two deadlines: the idle time before a line starts, and the line time
/// from its first byte to its newline (so a byte every few seconds cannot hold a connection).
pub struct LineReader {
    pending: Vec<u8>,
    max: usize,
    idle: Duration,
    line: Duration,
}

impl LineReader {
    /// Lines of at most `max` bytes.
    pub fn new(max: usize, limits: &Limits) -> Self {
        LineReader { pending: Vec::new(), max, idle: limits.idle, line: limits.line }
    }

    /// The same reader (and what it has read ahead) under other timeouts: the TCP listener's
    /// key line has a shorter deadline than the requests after it.
    pub fn with_limits(self, limits: &Limits) -> Self {
        LineReader { idle: limits.idle, line: limits.line, ..self }
    }

    /// The next line from `stream`.
    pub fn next(&mut self, stream: &mut impl Timed) -> io::Result<Line> {
        let mut started = (!self.pending.is_empty()).then(Instant::now);
        let idle_from = Instant::now();
        let mut chunk = [0u8; 8192];
        loop {
            if let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.pending.drain(..=i).collect();
                line.pop();
                if line.len() > self.max {
                    return Ok(Line::TooLong(line.len()));
                }
                return Ok(Line::Complete(line));
            }
            if self.pending.len() > self.max {
                return Ok(Line::TooLong(self.pending.len()));
            }
            let deadline = match started {
                Some(t) => t + self.line,
                None => idle_from + self.idle,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Line::TimedOut { partial: started.is_some() });
            }
            stream.set_read_timeout(Some(left))?;
            match stream.read(&mut chunk) {
                Ok(0) => return Ok(Line::Closed),
                Ok(n) => {
                    started.get_or_insert_with(Instant::now);
                    self.pending.extend_from_slice(&chunk[..n]);
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    return Ok(Line::TimedOut { partial: started.is_some() });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Refusals of one address said in the log at most once a minute, with how many there were:
/// a client that is not allowed costs one line a minute, however fast it reconnects. At most
/// 4,096 addresses are remembered (looked over at most once a second when full).
#[derive(Debug)]
pub struct RefusalLog {
    /// What listener (`metrics`, `TCP`).
    what: &'static str,
    /// The allow-list's key (`metrics_allow`).
    list: &'static str,
    by_address: HashMap<IpAddr, (Instant, u64)>,
    pruned_at: Option<Instant>,
}

impl RefusalLog {
    /// The log of refusals by `what`'s `list`.
    pub fn new(what: &'static str, list: &'static str) -> RefusalLog {
        RefusalLog { what, list, by_address: HashMap::new(), pruned_at: None }
    }

    /// Counts a refusal of `ip` at `now`; returns the line to log, if one is due: the first
    /// refusal of an address, then one a minute with the number since the last line.
    pub fn refused(&mut self, ip: IpAddr, now: Instant) -> Option<String> {
        const EVERY: Duration = Duration::from_secs(60);
        const MOST: usize = 4096;
        if self.by_address.len() >= MOST
            && self.pruned_at.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            // Addresses not seen for a minute are forgotten.
            self.by_address.retain(|_, (at, _)| now.duration_since(*at) < EVERY);
            self.pruned_at = Some(now);
        }
        let full = self.by_address.len() >= MOST;
        let (what, list) = (self.what, self.list);
        match self.by_address.get_mut(&ip) {
            Some((at, count)) if now.duration_since(*at) < EVERY => {
                *count += 1;
                None
            }
            Some((at, count)) => {
                let line = format!(
                    "{what} connections from {ip} refused: not in {list} ({} since the last line)",
                    *count + 1
                );
                *at = now;
                *count = 0;
                Some(line)
            }
            None if full => None,
            None => {
                self.by_address.insert(ip, (now, 0));
                Some(format!("{what} connection from {ip} refused: not in {list} (said once a minute per address)"))
            }
        }
    }
}

/// Network connections that have not proved themselves yet (sent their key, or their request
/// head), oldest first, at most `limit`. A new one past the limit takes the place of the oldest,
/// which is shut down: a flood of silent connections, from however many addresses, then never
/// keeps out a client that speaks at once (a key holder, Prometheus), and costs at most `limit`
/// threads, each for at most its deadline.
#[derive(Debug)]
pub struct Unproven {
    limit: usize,
    waiting: Mutex<(u64, std::collections::VecDeque<(u64, TcpStream)>)>,
}

/// A connection's place among the [`Unproven`]; dropping it (once it has proved itself, or
/// ended) gives the place back.
#[derive(Debug)]
pub struct UnprovenPlace {
    of: Arc<Unproven>,
    id: u64,
}

impl Unproven {
    /// At most `limit` waiting at once.
    pub fn new(limit: usize) -> Arc<Unproven> {
        Arc::new(Unproven { limit: limit.max(1), waiting: Mutex::default() })
    }

    /// Takes a place for `stream`, shutting the oldest waiting connection down when all are
    /// taken. `None` when `stream` cannot be kept (no descriptor for its copy).
    pub fn enter(self: &Arc<Self>, stream: &TcpStream) -> Option<UnprovenPlace> {
        let copy = stream.try_clone().ok()?;
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while w.1.len() >= self.limit {
            if let Some((_, oldest)) = w.1.pop_front() {
                let _ = oldest.shutdown(std::net::Shutdown::Both);
            }
        }
        w.0 += 1;
        let id = w.0;
        w.1.push_back((id, copy));
        Some(UnprovenPlace { of: self.clone(), id })
    }

    /// How many wait now.
    pub fn len(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for UnprovenPlace {
    fn drop(&mut self) {
        let mut w = self.of.waiting.lock().unwrap_or_else(|e| e.into_inner());
        w.1.retain(|(id, _)| *id != self.id);
    }
}

/// Logs a failed `accept(2)` at most once every ten seconds (with how many were not logged), and
/// pauses after one that says topod is out of descriptors or memory, so the accept loop waits for
/// a connection to close instead of spinning on the same error.
pub struct AcceptErrors {
    last_logged: Option<Instant>,
    unlogged: u64,
    /// What failed: accepting, or starting a connection's thread.
    doing: &'static str,
}

impl Default for AcceptErrors {
    fn default() -> Self {
        Self::new()
    }
}

impl AcceptErrors {
    /// No errors yet.
    pub fn new() -> Self {
        AcceptErrors { last_logged: None, unlogged: 0, doing: "accepting" }
    }

    /// No failures yet to start a thread for a connection (logged as accept failures are).
    pub fn thread_failures() -> Self {
        AcceptErrors { doing: "starting a thread for", ..Self::new() }
    }

    /// Handles one failed accept on `what` (a listener's name).
    pub fn failed(&mut self, what: &str, e: &io::Error) {
        let now = Instant::now();
        if self.last_logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
            if self.unlogged > 0 {
                tracing::warn!("{} a connection on {what} failed: {e} ({} more failures since the last message)", self.doing, self.unlogged);
            } else {
                tracing::warn!("{} a connection on {what} failed: {e}", self.doing);
            }
            self.last_logged = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        let out_of_resources = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
        );
        std::thread::sleep(if out_of_resources {
            Duration::from_millis(50)
        } else {
            Duration::from_millis(1)
        });
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit (connections cost
/// two each); returns the new soft limit.
pub fn raise_fd_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    // Where they are equal (the unit's LimitNOFILE), no system call: the unit's filter has none.
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(io::Error::from)?;
    }
    Ok(hard.max(soft))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_connections: 3,
            max_connections_per_user: 2,
            idle: Duration::from_millis(300),
            line: Duration::from_millis(200),
            write: Duration::from_millis(200),
        }
    }

    #[test]
    fn the_gate_counts_per_holder_and_in_total_and_never_refuses_an_administrator() {
        let gate = Gate::new(limits());
        let a1 = gate.admit(Holder::Uid(1000), false).unwrap();
        let _a2 = gate.admit(Holder::Uid(1000), false).unwrap();
        let e = gate.admit(Holder::Uid(1000), false).unwrap_err();
        assert!(e.contains("uid 1000 has 2 open") && e.contains("max_connections_per_user"), "{e}");
        let _b = gate.admit(Holder::Uid(1001), false).unwrap();
        let e = gate.admit(Holder::Uid(1002), false).unwrap_err();
        assert!(e.contains("max_connections"), "{e}");
        let roots: Vec<_> = (0..10).map(|_| gate.admit(Holder::Uid(0), true).unwrap()).collect();
        assert_eq!(gate.open_of(Holder::Uid(0)), 10);
        drop(a1);
        assert_eq!(gate.open_of(Holder::Uid(1000)), 1);
        gate.admit(Holder::Uid(1002), false).unwrap();
        drop(roots);
        assert_eq!(gate.open_of(Holder::Uid(0)), 0);
    }

    #[test]
    fn a_user_who_spends_more_than_a_share_of_a_cpu_waits() {
        let gate = Gate::new(limits());
        let user = Holder::Uid(1000);
        assert_eq!(gate.wait_for(user), Duration::ZERO);
        gate.charge(user, Duration::from_millis(150));
        assert_eq!(gate.wait_for(user), Duration::ZERO, "within the burst");
        gate.charge(user, Duration::from_millis(150));
        let wait = gate.wait_for(user);
        // 300 ms spent, 200 ms of burst: the other 100 ms drain at a tenth of a CPU.
        assert!(wait > Duration::from_millis(900) && wait <= Duration::from_secs(1), "{wait:?}");
        assert_eq!(gate.wait_for(Holder::Uid(1001)), Duration::ZERO, "others are not charged");
        let t = thread_cpu_time();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1 && thread_cpu_time() > t);
    }

    #[test]
    fn a_line_must_arrive_whole_in_time() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let mut r = LineReader::new(16, &limits());
        b.write_all(b"{\"v\":1}\nsecond\n").unwrap();
        assert_eq!(r.next(&mut a).unwrap(), Line::Complete(b"{\"v\":1}".to_vec()));
        assert_eq!(r.next(&mut a).unwrap(), Line::Complete(b"second".to_vec()));
        // Nothing at all: the idle limit.
        let t = Instant::now();
        assert_eq!(r.next(&mut a).unwrap(), Line::TimedOut { partial: false });
        assert!(t.elapsed() >= Duration::from_millis(290));
        // A line begun and left unfinished on a real socket times out as a partial line (that a
        // dribble does not keep it open is `a_dribbled_line_is_cut_off_at_the_line_limit`).
        let writer = std::thread::spawn(move || {
            for _ in 0..10 {
                if b.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            b
        });
        assert_eq!(r.next(&mut a).unwrap(), Line::TimedOut { partial: true });
        let mut b = writer.join().unwrap();
        let mut r = LineReader::new(16, &limits());
        b.write_all(&[b'y'; 40]).unwrap();
        assert!(matches!(r.next(&mut a).unwrap(), Line::TooLong(n) if n > 16));
        drop(b);
        let mut r = LineReader::new(16, &limits());
        assert_eq!(r.next(&mut a).unwrap(), Line::Closed);
    }

    /// A client that sends one byte of a line per `gap`, `bytes` in all, then closes; it never
    /// waits longer than the read timeout the reader set (then it reports a timeout, as a socket
    /// would). What it was asked is kept.
    struct Dribble {
        gap: Duration,
        bytes: usize,
        given: usize,
        timeout: std::cell::Cell<Option<Duration>>,
        timeouts: std::cell::RefCell<Vec<Duration>>,
    }

    impl Read for Dribble {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.given == self.bytes {
                return Ok(0);
            }
            let timeout = self.timeout.get().expect("the reader sets a read timeout");
            if timeout <= self.gap {
                std::thread::sleep(timeout);
                return Err(io::ErrorKind::WouldBlock.into());
            }
            std::thread::sleep(self.gap);
            buf[0] = b'x';
            self.given += 1;
            Ok(1)
        }
    }

    impl Write for Dribble {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Timed for Dribble {
        fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
            self.timeout.set(t);
            self.timeouts.borrow_mut().extend(t);
            Ok(())
        }
        fn set_write_timeout(&self, _: Option<Duration>) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_dribbled_line_is_cut_off_at_the_line_limit() {
        // One byte per 50 ms against a 200 ms line limit: the line's deadline runs from its
        // first byte, so the reader takes at most 200 / 50 + 1 = 5 bytes before it gives up. A
        // deadline that each byte pushed back would take all 40 and then see the close. A slow
        // machine only makes each byte later, so fewer are taken.
        let mut d = Dribble {
            gap: Duration::from_millis(50),
            bytes: 40,
            given: 0,
            timeout: std::cell::Cell::new(None),
            timeouts: std::cell::RefCell::new(Vec::new()),
        };
        let mut r = LineReader::new(1024, &limits());
        assert_eq!(r.next(&mut d).unwrap(), Line::TimedOut { partial: true });
        assert!((1..=5).contains(&d.given), "{} bytes taken of a dribbled line", d.given);
        // Each read of the line waits only for what is left of the one deadline.
        let line = &d.timeouts.borrow()[1..];
        assert!(line.windows(2).all(|w| w[1] < w[0]), "read timeouts {line:?}");
        assert!(line.iter().all(|&t| t <= limits().line), "read timeouts {line:?}");
    }
}
