//! The plug-in's arguments from its plugstack.conf line.
//!
//! ```text
//! required /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_topo.so socket=/run/topo/topod.sock mode=auto timeout=10
//! ```
//!
//! - `socket=PATH`: topod's socket (default `/run/topo/topod.sock`, topod's default).
//! - `mode=auto|join|narrow`: how a task is confined. `join` moves it into the cgroup topod made
//!   for the job (right with `TaskPlugin=task/affinity` and `ProctrackType=proctrack/linuxproc`,
//!   where Slurm makes no cgroup); `narrow` leaves it in Slurm's own cgroups and only narrows its
//!   CPU affinity to what topod chose, which Slurm's cgroup already contains (right with
//!   `task/cgroup` or `proctrack/cgroup`); `auto` (default) picks `narrow` when the task is
//!   already inside a Slurm job cgroup (`/job_<id>` in `/proc/self/cgroup`), else `join`.
//! - `timeout=SECONDS`: the longest wait for one answer from topod (default 10).
//! - `gres_conf=PATH`: Slurm's `gres.conf`, which says the device file of each GPU Slurm
//!   numbers (default: `gres.conf` beside `$SLURM_CONF`, else `/etc/slurm/gres.conf`; see
//!   [`crate::gres`]).

use std::path::PathBuf;
use std::time::Duration;

/// How a task is confined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `narrow` inside Slurm's cgroups when there are any, else `join`.
    Auto,
    /// Move the task into topod's cgroup for the job.
    Join,
    /// Stay in Slurm's cgroups; narrow the CPU affinity only.
    Narrow,
}

/// The parsed arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    /// topod's socket.
    pub socket: PathBuf,
    /// How tasks are confined.
    pub mode: Mode,
    /// Longest wait for one reply.
    pub timeout: Duration,
    /// Slurm's gres.conf, when given.
    pub gres_conf: Option<PathBuf>,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            socket: PathBuf::from(topo_core::proto::DEFAULT_SOCKET),
            mode: Mode::Auto,
            timeout: Duration::from_secs(10),
            gres_conf: None,
        }
    }
}

/// A plugstack.conf argument the plug-in does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plugstack.conf argument {position} {text:?}: {reason} (accepted: socket=PATH, mode=auto|join|narrow, timeout=SECONDS, gres_conf=PATH)")]
pub struct ArgsError {
    /// 1-based position after the plug-in path.
    pub position: usize,
    /// The argument.
    pub text: String,
    /// What is wrong.
    pub reason: String,
}

impl Args {
    /// Where Slurm's gres.conf is: `gres_conf=`, else beside `slurm_conf` (`$SLURM_CONF`), else
    /// `/etc/slurm/gres.conf`.
    pub fn gres_conf_path(&self, slurm_conf: Option<&str>) -> PathBuf {
        if let Some(path) = &self.gres_conf {
            return path.clone();
        }
        match slurm_conf.map(std::path::Path::new).and_then(std::path::Path::parent) {
            Some(dir) if !dir.as_os_str().is_empty() => dir.join("gres.conf"),
            _ => PathBuf::from("/etc/slurm/gres.conf"),
        }
    }

    /// Parses the words after the plug-in path.
    pub fn parse<'a>(words: impl IntoIterator<Item = &'a str>) -> Result<Args, ArgsError> {
        let mut args = Args::default();
        for (i, word) in words.into_iter().enumerate() {
            let refuse = |reason: &str| ArgsError {
                position: i + 1,
                text: word.to_string(),
                reason: reason.to_string(),
            };
            let (key, value) = word.split_once('=').ok_or_else(|| refuse("expected key=value"))?;
            match key {
                "socket" if value.starts_with('/') => args.socket = PathBuf::from(value),
                "socket" => return Err(refuse("the socket must be an absolute path")),
                "mode" => {
                    args.mode = match value {
                        "auto" => Mode::Auto,
                        "join" => Mode::Join,
                        "narrow" => Mode::Narrow,
                        _ => return Err(refuse("mode is auto, join or narrow")),
                    }
                }
                "timeout" => match value.parse::<u64>() {
                    Ok(s) if (1..=300).contains(&s) => args.timeout = Duration::from_secs(s),
                    _ => return Err(refuse("timeout is a whole number of seconds from 1 to 300")),
                },
                "gres_conf" if value.starts_with('/') => {
                    args.gres_conf = Some(PathBuf::from(value))
                }
                "gres_conf" => return Err(refuse("gres_conf must be an absolute path")),
                _ => return Err(refuse("unknown argument")),
            }
        }
        Ok(args)
    }
}

/// Whether `/proc/self/cgroup` text shows the process inside Slurm job `job_id`'s cgroups
/// (task/cgroup or proctrack/cgroup: `.../job_<id>/step_<step>` on v1 and v2).
pub fn inside_slurm_job_cgroup(proc_self_cgroup: &str, job_id: u32) -> bool {
    let needle = format!("/job_{job_id}");
    proc_self_cgroup.lines().filter_map(|l| l.splitn(3, ':').nth(2)).any(|path| {
        path.match_indices(&needle)
            .any(|(i, m)| matches!(path[i + m.len()..].chars().next(), None | Some('/')))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments() {
        assert_eq!(Args::parse([]).unwrap(), Args::default());
        let a = Args::parse(["socket=/tmp/t/topod.sock", "mode=narrow", "timeout=3"]).unwrap();
        assert_eq!(
            (a.socket.to_str().unwrap(), a.mode, a.timeout.as_secs()),
            ("/tmp/t/topod.sock", Mode::Narrow, 3)
        );
        for (bad, says) in [
            ("sock=/x", "unknown argument"),
            ("socket=rel", "absolute"),
            ("mode=fight", "auto, join or narrow"),
            ("timeout=0", "1 to 300"),
            ("gres_conf=gres.conf", "absolute"),
            ("verbose", "key=value"),
        ] {
            let e = Args::parse(["mode=auto", bad]).unwrap_err();
            assert_eq!(e.position, 2);
            assert!(e.to_string().contains(says) && e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn slurm_job_cgroups_are_recognized() {
        let v1 = "12:freezer:/slurm_vm/uid_0/job_15/step_0\n4:cpuset:/slurm_vm/uid_0/job_15/step_0\n1:name=systemd:/\n";
        assert!(inside_slurm_job_cgroup(v1, 15));
        assert!(!inside_slurm_job_cgroup(v1, 1), "job_15 is not job_1");
        let v2 = "0::/system.slice/slurmstepd.scope/job_7/step_batch/user/task_0\n";
        assert!(inside_slurm_job_cgroup(v2, 7));
        let ours = "4:cpuset:/topo/slurm-7\n3:memory:/topo/slurm-7\n0::/\n";
        assert!(!inside_slurm_job_cgroup(ours, 7));
    }
}
