//! Telling a job its CPUs changed: each job's notify file (`job-notify/JOB` beside the socket:
//! `generation=`, `cpus=`, `mems=`, what libtopo's `topo_resize_wait` reads), rewritten with a
//! new generation at every change, and the `resize_signal` a malleable job chose, sent to its
//! processes that catch it; and the batch system's report of the change, dropped at release.

use super::{Host, HostError};
use crate::cgroup::JobId;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

impl Host {
    /// Where the jobs' notify files go (`job-notify/` beside the socket; see
    /// `topo_core::proto::notify_file_for`), created mode 0755 if missing; `None`: no files.
    pub fn set_notify_dir(&mut self, dir: Option<PathBuf>) -> Result<(), HostError> {
        if let Some(dir) = &dir {
            // Made by a user before topod (the socket's directory let them): never ours to use,
            // fix or chown; what root should do is said without trusting it.
            if let Ok(seen) = std::fs::symlink_metadata(dir) {
                use std::os::unix::fs::MetadataExt;
                let me = nix::unistd::geteuid().as_raw();
                if seen.uid() != 0 && seen.uid() != me {
                    let open =
                        dir.parent().and_then(|p| std::fs::metadata(p).ok()).is_some_and(|p| {
                            p.permissions().mode() & 0o022 != 0 || (p.uid() != 0 && p.uid() != me)
                        });
                    return Err(HostError::Notify(format!(
                        "{} is not topod's: {}",
                        dir.display(),
                        topo_core::pending::remove_foreign(dir, seen.uid(), open)
                    )));
                }
            }
            match std::fs::DirBuilder::new().mode(0o755).create(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(HostError::Notify(format!("creating {}: {e}", dir.display())))
                }
            }
            super::super::records::check_private_dir(dir)
                .map_err(|e| HostError::Notify(e.to_string()))?;
            // topod's own directory (checked above): readable by every job's user whatever
            // umask topod runs with (the systemd unit's UMask=0077 made it 0700).
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(|e| {
                HostError::Notify(format!("making {} readable: {e}", dir.display()))
            })?;
        }
        self.notify_dir = dir;
        Ok(())
    }

    /// Tells `job` its CPUs: rewrites its notify file and, with `signal`, sends its
    /// `resize_signal` (if it chose one) to each of its processes. Failures are logged: the
    /// job's CPUs have changed whatever it hears.
    pub(crate) fn tell(&mut self, job: &str, signal: bool) {
        let Some(alloc) = self.ledger.get(job).cloned() else { return };
        if let Some(dir) = self.notify_dir.clone() {
            // The file's generation never goes back, whatever the record says (a record that
            // could not be written, a restart): a job waits for a generation above the last it saw.
            let (file_gen, file_text) = read_notify(&dir.join(job));
            let Some(hint) = self.hints.get_mut(job) else { return };
            let body = format!("cpus={}\nmems={}\n", alloc.cpus, alloc.mems);
            let mut generation = hint.notify_generation.max(1);
            if file_gen >= generation && !file_text.ends_with(&body) {
                generation = file_gen.saturating_add(1);
            }
            generation = generation.max(file_gen);
            hint.notify_generation = generation;
            let text = format!("generation={generation}\n{body}");
            if text != file_text {
                if let Err(e) = write_world_readable(&dir, job, text.as_bytes()) {
                    tracing::warn!(
                        "job {job}: cannot write its notify file in {}: {e}",
                        dir.display()
                    );
                }
            }
        }
        let Some(hint) = self.hints.get(job) else { return };
        let Some(signal) = hint.ask.resize_signal.filter(|_| signal) else { return };
        let Ok(id) = JobId::parse(job) else { return };
        let Ok(signal) = nix::sys::signal::Signal::try_from(signal) else { return };
        let owner = hint.ask.owner_uid;
        for pid in self.backend.pids(&id).unwrap_or_default() {
            // Only to processes that catch it (a process that does not would die of it, or
            // stop), and, when the job has an owner, that run as the owner: topod keeps
            // CAP_KILL, and must not let an owner's resize reach anyone the owner could not
            // signal (a batch system's root daemon inside the job, say).
            if !wants_signal(pid, signal as i32, owner) {
                continue;
            }
            // A process of the job's cgroup; one that has just exited is no error.
            if let Err(e) = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal) {
                tracing::debug!("job {job}: {signal} to process {pid}: {e}");
            }
        }
    }

    /// Removes `job`'s notify file and drops a report to its batch system not yet sent (its
    /// release: the batch system ended the job, and alters a finished job no more).
    pub(crate) fn forget_notify(&self, job: &str) {
        if let Some(dir) = &self.notify_dir {
            let _ = std::fs::remove_file(dir.join(job));
        }
        if let Some(reporter) = &self.batch_reporter {
            reporter.forget(job);
        }
    }
}

/// Whether process `pid` catches `signal` (its `SigCgt` mask in /proc) and, when `owner` is
/// given, runs as that uid (real and effective).
fn wants_signal(pid: i32, signal: i32, owner: Option<u32>) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim).unwrap_or_default()
    };
    let caught = u64::from_str_radix(field("SigCgt:"), 16)
        .is_ok_and(|mask| (1..=64).contains(&signal) && mask & (1u64 << (signal - 1)) != 0);
    let uids: Vec<u32> = field("Uid:").split_whitespace().filter_map(|u| u.parse().ok()).collect();
    let as_owner = match owner {
        Some(o) => uids.len() >= 2 && uids[0] == o && uids[1] == o,
        None => true,
    };
    caught && as_owner
}

/// The generation and the whole text of a notify file (0 and empty when there is none).
fn read_notify(path: &Path) -> (u64, String) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let generation = text
        .lines()
        .find_map(|l| l.strip_prefix("generation="))
        .and_then(|g| g.trim().parse().ok())
        .unwrap_or(0);
    (generation, text)
}

/// Removes the notify files of jobs not in `keep` (left by jobs released while topod was down,
/// or by an earlier boot's topod on a persistent directory), and stray temporary files.
pub(crate) fn sweep_notify_dir(dir: &Path, keep: &std::collections::BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // Only what topod writes there: notify files and their temporary files.
        let ours = name.starts_with('.') && name.ends_with(".tmp")
            || std::fs::read_to_string(e.path()).is_ok_and(|t| t.starts_with("generation="));
        if !keep.contains(&name) && ours && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes `dir/name` (mode 0644) through a temporary file and a rename, so that a reader sees
/// the old content or the new, whole. `name` is a job id: one path component, never `.`.
fn write_world_readable(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let create = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&tmp)
    };
    let mut f = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(&tmp)?;
            create()
        }
        other => other,
    }?;
    // 0644 whatever the umask: the job's user reads it.
    f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::wants_signal;

    #[test]
    fn the_resize_signal_is_for_processes_that_catch_it_and_run_as_the_owner() {
        struct Kill(std::process::Child);
        impl Drop for Kill {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let me = nix::unistd::getuid().as_raw();
        let deaf = Kill(std::process::Command::new("sleep").arg("30").spawn().unwrap());
        let mut hearing = Kill(
            std::process::Command::new("sh")
                .args(["-c", "trap 'echo usr1' USR1; echo trapped; while :; do sleep 1; done"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let pid = |k: &Kill| k.0.id() as i32;
        // The shell says so once its trap is installed (however long it takes to start).
        let mut said = String::new();
        let out = hearing.0.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut said).unwrap();
        assert_eq!(said, "trapped\n");
        assert!(wants_signal(pid(&hearing), 10, None));
        assert!(wants_signal(pid(&hearing), 10, Some(me)));
        assert!(!wants_signal(pid(&hearing), 10, Some(me + 1)), "not the owner's");
        assert!(!wants_signal(pid(&hearing), 12, None), "SIGUSR2 is not caught");
        assert!(!wants_signal(pid(&deaf), 10, None), "sleep would die of it");
        assert!(!wants_signal(i32::MAX, 10, None), "no such process");
    }
}
