//! Releases queued for topod while it could not be reached: where they are kept, what one says,
//! and the time stamps they carry.
//!
//! A job's end is announced by its batch system (Slurm's job epilog). When topod cannot be
//! reached at that moment (stopped, restarting, not answering in time), the epilog does not fail,
//! which would drain the node for a job topod may not even hold: it leaves a request, one file
//! per job, in [`pending_dir_for`] the socket (`/run/topo/release-pending/slurm-42`), and topod
//! releases the job when it starts and every few seconds while it runs. The directory is on the
//! same tmpfs as the socket, which is right: after a reboot there is no cgroup left to release.
//!
//! This module is the pure part, shared by the writer (`topo_client::queue_release`) and topod
//! (`topod::daemon::pending`): no I/O.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The directory's name, beside topod's socket.
pub const PENDING_DIR_NAME: &str = "release-pending";

/// The longest request file topod reads (a request is about a hundred bytes).
pub const MAX_REQUEST_BYTES: usize = 4096;

/// Where releases for the topod listening on `socket` are queued: `release-pending` in the
/// socket's directory (`/run/topo/topod.sock` -> `/run/topo/release-pending`). A client knows
/// the socket, and topod knows it too, so both find the same directory without configuration.
pub fn pending_dir_for(socket: &Path) -> PathBuf {
    socket.parent().unwrap_or(Path::new("")).join(PENDING_DIR_NAME)
}

/// What to do about a socket directory that others can write, in every message about it.
pub const MOVE_SOCKET: &str = "move the socket to a directory only root can write, e.g. /run/topo";

/// What is wrong with topod's socket directory `dir` as the place of the queue, for a writer or a
/// topod running as `me`: `None` when it is a directory (not a link) of root's (or `me`'s) that
/// neither its group nor others can write. Whoever can write it can take the queue's name first
/// (a directory of their own, a link, a FIFO), so that no release can be queued, or plant
/// entries in it; a sticky bit does not stop either. `uid` and `mode` are its owner and
/// permission bits, `is_link` whether it is a symbolic link, as `lstat` sees it.
pub fn socket_dir_problem(
    dir: &Path,
    is_link: bool,
    uid: u32,
    mode: u32,
    me: u32,
) -> Option<String> {
    let dir = dir.display();
    if is_link {
        return Some(format!(
            "topod's socket directory {dir} is a symbolic link (made by uid {uid}): {MOVE_SOCKET}"
        ));
    }
    if uid != 0 && uid != me {
        return Some(format!("topod's socket directory {dir} belongs to uid {uid}: {MOVE_SOCKET}"));
    }
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 { "others" } else { "its group" };
        return Some(format!(
            "topod's socket directory {dir} is writable by {who} (mode {:o}): {MOVE_SOCKET}",
            mode & 0o7777
        ));
    }
    None
}

/// What to do about `path`, which uid `uid` made (not root, not the one asking): remove it. Never
/// `chown` or `chmod` it: either would follow a link onto what it names, or adopt a directory with
/// whatever its maker put inside. `socket_dir_open` says whether the socket's directory is
/// writable by others (how it got there), which is the fix to make too.
pub fn remove_foreign(path: &Path, uid: u32, socket_dir_open: bool) -> String {
    let path = path.display();
    if socket_dir_open {
        format!("remove {path}, which uid {uid} created, and {MOVE_SOCKET}")
    } else {
        format!("remove {path}, which uid {uid} created")
    }
}

/// What one queued release says besides the job (which is the file's name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedRelease {
    /// When it was asked, in UTC (`2025-06-01T12:00:00.123Z`).
    pub asked_at: String,
    /// Who asked (`the Slurm job epilog (pid 4242)`).
    pub asked_by: String,
}

impl QueuedRelease {
    /// A request made at `at` by `by`.
    pub fn new(at: SystemTime, by: &str) -> QueuedRelease {
        QueuedRelease { asked_at: format_utc(at), asked_by: by.to_string() }
    }

    /// The file's contents: one JSON object and a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec(self).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    /// Reads a request file's contents; `None` when they are not a request (an empty file an
    /// administrator made with `touch` is not, and is still a request: its time is the file's).
    pub fn parse(bytes: &[u8]) -> Option<(QueuedRelease, SystemTime)> {
        let request: QueuedRelease = serde_json::from_slice(bytes).ok()?;
        let at = parse_utc(&request.asked_at)?;
        Some((request, at))
    }
}

/// `t` in UTC as `YYYY-MM-DDTHH:MM:SS.mmmZ` (times before 1970 are shown as 1970).
pub fn format_utc(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// `t` in UTC to the nanosecond (`2025-06-01T12:00:00.123456789Z`), which [`parse_utc`] reads
/// back as exactly `t`: for times compared with each other after a restart.
pub fn format_utc_nanos(t: SystemTime) -> String {
    let millis = format_utc(t);
    let nanos = t.duration_since(UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    format!("{}{nanos:09}Z", &millis[..millis.len() - 4])
}

/// Reads what [`format_utc`] writes, with or without the fraction of a second (1 to 9 digits).
pub fn parse_utc(text: &str) -> Option<SystemTime> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date_parts = date.splitn(3, '-');
    let y: i64 = number(date_parts.next()?, 4)?;
    let m: u32 = number(date_parts.next()?, 2)?;
    let d: u32 = number(date_parts.next()?, 2)?;
    let (hms, fraction) = match time.split_once('.') {
        Some((hms, f)) if (1..=9).contains(&f.len()) && f.bytes().all(|b| b.is_ascii_digit()) => {
            (hms, f)
        }
        Some(_) => return None,
        None => (time, ""),
    };
    let mut time_parts = hms.splitn(3, ':');
    let hh: u64 = number(time_parts.next()?, 2)?;
    let mm: u64 = number(time_parts.next()?, 2)?;
    let ss: u64 = number(time_parts.next()?, 2)?;
    if y < 1970 || !(1..=12).contains(&m) || d < 1 || d > days_in_month(y, m) {
        return None;
    }
    if hh > 23 || mm > 59 || ss > 59 {
        return None;
    }
    let days = u64::try_from(days_from_civil(y, m, d)).ok()?;
    let nanos = if fraction.is_empty() {
        0
    } else {
        fraction.parse::<u32>().ok()? * 10u32.pow(9 - fraction.len() as u32)
    };
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// `text` as a number of exactly `digits` ASCII digits.
fn number<T: std::str::FromStr>(text: &str, digits: usize) -> Option<T> {
    (text.len() == digits && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse().ok())?
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a date in the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day counted from 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_is_beside_the_socket() {
        assert_eq!(
            pending_dir_for(Path::new("/run/topo/topod.sock")),
            PathBuf::from("/run/topo/release-pending")
        );
        assert_eq!(
            pending_dir_for(Path::new(crate::proto::DEFAULT_SOCKET)),
            PathBuf::from("/run/topo/release-pending")
        );
        assert_eq!(pending_dir_for(Path::new("topod.sock")), PathBuf::from("release-pending"));
    }

    #[test]
    fn a_socket_directory_others_can_write_is_named_with_the_fix() {
        let d = Path::new("/tmp/topo");
        assert_eq!(socket_dir_problem(d, false, 0, 0o755, 0), None);
        assert_eq!(socket_dir_problem(d, false, 1000, 0o700, 1000), None);
        let e = socket_dir_problem(d, false, 0, 0o1777, 0).unwrap();
        assert_eq!(
            e,
            "topod's socket directory /tmp/topo is writable by others (mode 1777): move the socket to a directory only root can write, e.g. /run/topo"
        );
        assert!(socket_dir_problem(d, false, 0, 0o775, 0).unwrap().contains("by its group"));
        assert!(socket_dir_problem(d, false, 65534, 0o755, 0).unwrap().contains("uid 65534"));
        assert!(socket_dir_problem(d, true, 65534, 0o777, 0).unwrap().contains("symbolic link"));
        let r = remove_foreign(Path::new("/tmp/topo/release-pending"), 65534, true);
        assert!(
            r.starts_with("remove /tmp/topo/release-pending, which uid 65534 created, and move")
        );
        assert!(!r.contains("chown") && !r.contains("chmod"), "{r}");
    }

    #[test]
    fn times_read_back_as_themselves() {
        let at = |secs: u64, millis: u32| UNIX_EPOCH + Duration::new(secs, millis * 1_000_000);
        assert_eq!(format_utc(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_utc(at(951_782_400, 5)), "2000-02-29T00:00:00.005Z");
        assert_eq!(format_utc(at(1_748_779_200, 123)), "2025-06-01T12:00:00.123Z");
        assert_eq!(format_utc(at(4_102_444_799, 999)), "2099-12-31T23:59:59.999Z");
        for secs in (0..5_000_000_000u64).step_by(86_399 * 7 + 13) {
            let t = at(secs, (secs % 1000) as u32);
            assert_eq!(parse_utc(&format_utc(t)), Some(t), "{}", format_utc(t));
        }
        assert_eq!(parse_utc("2025-06-01T12:00:00Z"), Some(at(1_748_779_200, 0)));
        assert_eq!(parse_utc("2025-06-01T12:00:00.5Z"), Some(at(1_748_779_200, 500)));
        let precise = UNIX_EPOCH + Duration::new(1_748_779_200, 123_456_789);
        assert_eq!(format_utc_nanos(precise), "2025-06-01T12:00:00.123456789Z");
        assert_eq!(parse_utc(&format_utc_nanos(precise)), Some(precise));
        for bad in [
            "",
            "2025-06-01T12:00:00",
            "2025-06-01 12:00:00Z",
            "2025-02-29T00:00:00Z",
            "2025-13-01T00:00:00Z",
            "2025-06-01T24:00:00Z",
            "2025-06-01T12:00:00.Z",
            "2025-06-01T12:00:00.1234567890Z",
            "1969-12-31T23:59:59Z",
            "+025-06-01T12:00:00Z",
            "2025-6-01T12:00:00Z",
        ] {
            assert_eq!(parse_utc(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_request_reads_back_and_anything_else_is_not_one() {
        let t = UNIX_EPOCH + Duration::from_millis(1_748_779_200_123);
        let r = QueuedRelease::new(t, "the Slurm job epilog (pid 7)");
        let bytes = r.to_bytes();
        assert!(bytes.ends_with(b"}\n"));
        assert_eq!(QueuedRelease::parse(&bytes), Some((r, t)));
        assert_eq!(QueuedRelease::parse(b""), None);
        assert_eq!(QueuedRelease::parse(b"{\"asked_at\":\"yesterday\",\"asked_by\":\"x\"}"), None);
        assert_eq!(QueuedRelease::parse(b"\xff\xfe"), None);
    }
}
