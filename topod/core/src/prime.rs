//! Prime-time pools (after the SDSC Paragon's prime-time scheduling): CPUs of a host set aside
//! in weekly windows (`Mon-Fri 08:00-18:00`) for the jobs that may use them: jobs of named
//! queues or users, or jobs whose allocate names the pool. Inside a window the pool's CPUs go
//! to those jobs only (they may use the rest of the host too, and are placed in the pool when
//! they fit there); outside, the pool is CPUs like any others. When a window opens, jobs that
//! may not use the pool and run on it stay, or are moved out where they fit (`on_open`).
//!
//! This module is the pure part topod and the simulator share: the window grammar, whether a
//! window is open at a local time, who may use a pool, and what placement must avoid. Local
//! time is the caller's: topod takes the host's time zone, the simulator the trace's.

use crate::cpuset::CpuSet;
use crate::place::Occupancy;
use serde::{Deserialize, Serialize};

/// The days, in the order the grammar and [`LocalTime::weekday`] number them.
pub const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];

/// A weekly window: on these days, from `start` to `end` (minutes after local midnight,
/// `end` up to 1440; a window that crosses midnight is written as two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Which days (index 0 = Monday).
    pub days: [bool; 7],
    /// Start, minutes after midnight.
    pub start: u32,
    /// End (excluded), minutes after midnight.
    pub end: u32,
}

/// A local time of the week.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalTime {
    /// 0 = Monday ... 6 = Sunday.
    pub weekday: u8,
    /// Minutes after local midnight.
    pub minute: u32,
}

impl LocalTime {
    /// The local time at `epoch_s` seconds since the epoch, `utc_offset_s` east of UTC.
    pub fn at(epoch_s: i64, utc_offset_s: i64) -> LocalTime {
        let local = epoch_s + utc_offset_s;
        let days = local.div_euclid(86_400);
        // 1970-01-01 was a Thursday (weekday 3).
        let weekday = (days + 3).rem_euclid(7) as u8;
        LocalTime { weekday, minute: (local.rem_euclid(86_400) / 60) as u32 }
    }
}

/// A window that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("prime-time window {text:?}: {why} (write e.g. \"Mon-Fri 08:00-18:00\", \"Sat,Sun 10:00-16:00\")")]
pub struct WindowError {
    /// The text.
    pub text: String,
    /// What is wrong.
    pub why: String,
}

impl std::str::FromStr for Window {
    type Err = WindowError;

    /// `DAYS HH:MM-HH:MM`, DAYS a comma-separated list of days or day ranges (`Mon-Fri`,
    /// `Sat,Sun`, `Mon-Wed,Fri`), day names in English, any case; `24:00` ends a day.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| WindowError { text: text.to_string(), why: why.to_string() };
        let (days_text, hours) = text
            .trim()
            .split_once(char::is_whitespace)
            .ok_or_else(|| err("expected days, a space, then hours"))?;
        let day = |name: &str| {
            DAYS.iter()
                .position(|d| d.eq_ignore_ascii_case(name.trim()))
                .ok_or_else(|| err(&format!("{name:?} is not a day (Mon Tue Wed Thu Fri Sat Sun)")))
        };
        let mut days = [false; 7];
        for part in days_text.split(',') {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (day(a)?, day(b)?);
                    if b < a {
                        return Err(err(&format!("{part} runs backwards; weeks start on Monday")));
                    }
                    days[a..=b].iter_mut().for_each(|d| *d = true);
                }
                None => days[day(part)?] = true,
            }
        }
        let minute = |hm: &str| -> Result<u32, WindowError> {
            let (h, m) = hm.trim().split_once(':').ok_or_else(|| err("hours are HH:MM"))?;
            let (h, m): (u32, u32) = (
                h.parse().map_err(|_| err(&format!("{h:?} is not an hour")))?,
                m.parse().map_err(|_| err(&format!("{m:?} is not a minute")))?,
            );
            if m >= 60 || h > 24 || (h == 24 && m > 0) {
                return Err(err(&format!("{hm} is not a time of day (00:00 to 24:00)")));
            }
            Ok(h * 60 + m)
        };
        let (a, b) = hours.trim().split_once('-').ok_or_else(|| err("hours are HH:MM-HH:MM"))?;
        let (start, end) = (minute(a)?, minute(b)?);
        if end <= start {
            return Err(err("it must end after it starts (split a window across midnight in two)"));
        }
        Ok(Window { days, start, end })
    }
}

impl Window {
    /// Whether the window is open at `t`.
    pub fn open_at(&self, t: LocalTime) -> bool {
        self.days[usize::from(t.weekday % 7)] && (self.start..self.end).contains(&t.minute)
    }
}

/// What to do, when a window opens, with jobs on the pool that may not use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnOpen {
    /// They run on where they are; no new such job is placed there.
    #[default]
    Stay,
    /// They are moved out of the pool where they fit (otherwise they stay).
    Migrate,
}

/// One pool, as topod uses it (its CPUs chosen).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    /// Its name (what an allocate's `pool` names).
    pub name: String,
    /// Its CPUs.
    pub cpus: CpuSet,
    /// When it is reserved.
    pub windows: Vec<Window>,
    /// Queues whose jobs may use it.
    pub queues: Vec<String>,
    /// Users (uids) whose jobs may use it.
    pub users: Vec<u32>,
    /// Jobs whose allocate names it may use it (the request flag): any job, then, since a
    /// user sets the name (`TOPO_POOL`).
    pub named: bool,
    /// What happens to other jobs on it when a window opens.
    pub on_open: OnOpen,
}

/// Who a job is, for the pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Asker<'a> {
    /// Its batch queue.
    pub queue: Option<&'a str>,
    /// Its owner's uid.
    pub owner: Option<u32>,
    /// The pool its allocate names.
    pub pool: Option<&'a str>,
}

impl Pool {
    /// Whether the pool is reserved at `t`.
    pub fn open_at(&self, t: LocalTime) -> bool {
        self.windows.iter().any(|w| w.open_at(t))
    }

    /// Whom the pool admits, for a message: "jobs of queues a, b, users 1001, and jobs that
    /// name it".
    pub fn admission(&self) -> String {
        let mut parts = Vec::new();
        if !self.queues.is_empty() {
            parts.push(format!("jobs of queue {}", self.queues.join(", ")));
        }
        if !self.users.is_empty() {
            let users: Vec<String> = self.users.iter().map(u32::to_string).collect();
            parts.push(format!("jobs of uid {}", users.join(", ")));
        }
        if self.named {
            parts.push(format!("jobs that name it (pool {:?})", self.name));
        }
        parts.join(", ")
    }

    /// Whether `who` may use the pool.
    pub fn admits(&self, who: Asker<'_>) -> bool {
        (self.named && who.pool == Some(self.name.as_str()))
            || who.queue.is_some_and(|q| self.queues.iter().any(|p| p == q))
            || who.owner.is_some_and(|u| self.users.contains(&u))
    }
}

/// What a placement for `who` at `t` must avoid because of `pools` (their CPUs, fenced), and
/// the CPUs of the open pools it may use (to try first).
pub fn pools_for(
    occupancy: &Occupancy,
    pools: &[Pool],
    who: Asker<'_>,
    t: LocalTime,
) -> (Occupancy, CpuSet) {
    let mut occ = occupancy.clone();
    let mut mine = CpuSet::new();
    for p in pools.iter().filter(|p| p.open_at(t)) {
        if p.admits(who) {
            mine.union_with(&p.cpus);
        } else {
            occ.fenced.union_with(&p.cpus);
        }
    }
    (occ, mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> Window {
        s.parse().unwrap()
    }

    #[test]
    fn windows_read_and_open_on_their_days_and_hours() {
        let day = w("Mon-Fri 08:00-18:00");
        assert_eq!(day.days, [true, true, true, true, true, false, false]);
        assert_eq!((day.start, day.end), (480, 1080));
        let t = |weekday, h: u32, m: u32| LocalTime { weekday, minute: h * 60 + m };
        assert!(day.open_at(t(0, 8, 0)) && day.open_at(t(4, 17, 59)));
        assert!(
            !day.open_at(t(4, 18, 0)) && !day.open_at(t(5, 12, 0)) && !day.open_at(t(2, 7, 59))
        );
        assert_eq!(w("sat,SUN 00:00-24:00").days, [false, false, false, false, false, true, true]);
        assert_eq!(w("Mon-Wed,Fri 9:30-12:00").days, [true, true, true, false, true, false, false]);
        for (bad, says) in [
            ("Mon-Fri", "days, a space"),
            ("Mo 08:00-18:00", "not a day"),
            ("Fri-Mon 08:00-18:00", "backwards"),
            ("Mon 18:00-08:00", "end after it starts"),
            ("Mon 08:00-24:01", "not a time of day"),
            ("Mon 08:60-09:00", "not a time of day"),
            ("Mon 8-9", "HH:MM"),
            ("Mon xx:00-09:00", "not an hour"),
        ] {
            let e = bad.parse::<Window>().unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("Mon-Fri 08:00-18:00"), "{bad}: {e}");
        }
    }

    #[test]
    fn local_time_counts_weekdays_from_a_thursday_and_takes_the_offset() {
        assert_eq!(LocalTime::at(0, 0), LocalTime { weekday: 3, minute: 0 });
        // 2026-11-25 (a Wednesday) 06:00 UTC is 07:00 in Central Europe.
        let t = 1_795_564_800 + 6 * 3600; // date -ud 2026-11-25 +%s, plus 6 h
        assert_eq!(LocalTime::at(t, 3600), LocalTime { weekday: 2, minute: 420 });
        assert_eq!(LocalTime::at(t, -7 * 3600).weekday, 1, "still Tuesday in California");
    }

    #[test]
    fn an_open_pool_is_only_for_those_it_admits() {
        let pool = Pool {
            name: "day".into(),
            cpus: CpuSet::parse_list("0-3").unwrap(),
            windows: vec![w("Mon-Fri 08:00-18:00")],
            queues: vec!["interactive".into()],
            users: vec![1000],
            named: true,
            on_open: OnOpen::Stay,
        };
        let monday_noon = LocalTime { weekday: 0, minute: 720 };
        let night = LocalTime { weekday: 0, minute: 60 };
        let occ = Occupancy::default();
        let batch = Asker { queue: Some("batch"), owner: Some(2000), pool: None };
        let (o, mine) = pools_for(&occ, std::slice::from_ref(&pool), batch, monday_noon);
        assert_eq!((o.fenced.to_string(), mine.len()), ("0-3".into(), 0));
        let (o, _) = pools_for(&occ, std::slice::from_ref(&pool), batch, night);
        assert!(o.fenced.is_empty(), "outside its windows a pool is open to all");
        for who in [
            Asker { queue: Some("interactive"), ..batch },
            Asker { owner: Some(1000), ..batch },
            Asker { pool: Some("day"), ..batch },
        ] {
            let (o, mine) = pools_for(&occ, std::slice::from_ref(&pool), who, monday_noon);
            assert!(o.fenced.is_empty() && mine == pool.cpus, "{who:?}");
        }
        assert!(!pool.admits(Asker { pool: Some("night"), ..batch }));
        // Without the request flag, naming it is not enough: only its queues and users.
        let listed_only = Pool { named: false, ..pool.clone() };
        assert!(!listed_only.admits(Asker { pool: Some("day"), ..batch }));
        assert!(listed_only.admits(Asker { queue: Some("interactive"), ..batch }));
        assert!(!listed_only.admission().contains("name it"), "{}", listed_only.admission());
    }
}
