//! Where the requests behind hashed handler keys outlive the scheduler process.
//!
//! A request whose canonical form is longer than [`crate::extsched::KEY_MAX`] is keyed by a hash
//! (`topo#h#<32 hex digits>`). LSF keeps that key with the job; a new mbschd (a restart, a
//! `badmin reconfig`) replays running jobs' allocations with it (`NOTIFY_STARTUP`) before it
//! has seen their requests, and the module must then say what each job holds. So each long
//! request is written once, as its canonical text, to a file named by its hash in
//! `[lsf] key_dir`, and read back when a key is not in memory.
//!
//! The directory is the module's own: created mode 0700, refused when another user owns it or
//! others may write to it, and a file is read only when it is a regular file the module's user
//! owns. A key names a file only when its hash is exactly 32 hex digits, so no key from the
//! scheduler becomes a path elsewhere. Files not written or read for [`KEEP_DAYS`] are removed
//! at `sched_init`.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where long requests are kept (a trait: the directory, or memory in unit tests).
pub trait KeyStore: Send + Sync {
    /// Keeps `canonical` under `hash` (32 hex digits); a failure is logged, not fatal.
    fn save(&self, hash: &str, canonical: &str);
    /// The canonical request kept under `hash`, if any.
    fn load(&self, hash: &str) -> Option<String>;
}

/// Days a key file is kept after it was last written or read.
pub const KEEP_DAYS: u64 = 366;

/// The largest key file read back (a canonical request is at most about 64 KiB).
const FILE_MAX: u64 = 1 << 20;

/// Whether `hash` may name a key file: exactly 32 lower-case hex digits.
pub fn is_hash(hash: &str) -> bool {
    hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The key files in a directory of the module's own.
#[derive(Debug)]
pub struct DirKeyStore {
    dir: PathBuf,
}

impl DirKeyStore {
    /// Opens `dir` (creating it, mode 0700), checks that it is the module's own, and removes
    /// key files not used for [`KEEP_DAYS`]. The error says what is wrong with the directory.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let say = |what: String| format!("[lsf] key_dir {}: {what}", dir.display());
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(say(format!("cannot create it: {e}"))),
        }
        let meta = std::fs::symlink_metadata(dir).map_err(|e| say(e.to_string()))?;
        let me = euid();
        if !meta.is_dir() {
            return Err(say("not a directory".into()));
        }
        if meta.uid() != me {
            return Err(say(format!(
                "owned by uid {}, not by the scheduler's uid {me}: another user could choose the requests replayed jobs are given",
                meta.uid()
            )));
        }
        if meta.permissions().mode() & 0o022 != 0 {
            return Err(say(format!(
                "mode {:o}: others may write to it (chmod go-w)",
                meta.permissions().mode() & 0o777
            )));
        }
        let store = DirKeyStore { dir: dir.to_path_buf() };
        store.prune();
        Ok(store)
    }

    /// Removes key files not written or read for [`KEEP_DAYS`], and stray temporary files.
    fn prune(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        let keep = std::time::Duration::from_secs(KEEP_DAYS * 86_400);
        let mut removed = 0usize;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Ok(meta) = entry.metadata() else { continue };
            let age = meta.modified().ok().and_then(|t| t.elapsed().ok()).unwrap_or_default();
            let stale_tmp = name.ends_with(".tmp") && age > std::time::Duration::from_secs(3600);
            if ((is_hash(name) && age > keep) || stale_tmp)
                && std::fs::remove_file(entry.path()).is_ok()
            {
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(removed, dir = %self.dir.display(), "key files unused for {KEEP_DAYS} days removed");
        }
    }

    fn path(&self, hash: &str) -> Option<PathBuf> {
        is_hash(hash).then(|| self.dir.join(hash))
    }
}

impl KeyStore for DirKeyStore {
    fn save(&self, hash: &str, canonical: &str) {
        let Some(path) = self.path(hash) else { return };
        if path.exists() {
            // Written before (by this process or another): used again, so kept longer.
            touch(&path);
            return;
        }
        let tmp = self.dir.join(format!("{hash}.{}.tmp", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(o_nofollow())
            .open(&tmp)
            .and_then(|mut f| f.write_all(canonical.as_bytes()).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(file = %path.display(), "cannot keep a long request for after a restart: {e}");
        }
    }

    fn load(&self, hash: &str) -> Option<String> {
        let path = self.path(hash)?;
        let mut file =
            std::fs::OpenOptions::new().read(true).custom_flags(o_nofollow()).open(&path).ok()?;
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.uid() != euid() || meta.len() > FILE_MAX {
            tracing::warn!(file = %path.display(), "a key file that is not the module's own regular file: ignored");
            return None;
        }
        let mut text = String::new();
        file.read_to_string(&mut text).ok()?;
        touch(&path);
        Some(text)
    }
}

/// Marks a key file used now (its age is what [`DirKeyStore::prune`] goes by).
fn touch(path: &Path) {
    if let Ok(f) = std::fs::OpenOptions::new().append(true).custom_flags(o_nofollow()).open(path) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

fn o_nofollow() -> i32 {
    libc::O_NOFOLLOW
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Long requests in memory (unit tests: a "new process" keeps the store and forgets the rest).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct MemKeyStore(pub std::sync::Mutex<std::collections::HashMap<String, String>>);

#[cfg(test)]
impl KeyStore for MemKeyStore {
    fn save(&self, hash: &str, canonical: &str) {
        self.0.lock().unwrap().insert(hash.to_string(), canonical.to_string());
    }
    fn load(&self, hash: &str) -> Option<String> {
        self.0.lock().unwrap().get(hash).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_is_written_once_read_back_and_only_when_it_is_the_modules_own() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        let store = DirKeyStore::open(&keys).unwrap();
        let mode = std::fs::metadata(&keys).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let hash = "0123456789abcdef0123456789abcdef";
        assert_eq!(store.load(hash), None);
        store.save(hash, "CPUSET[CPU_LIST=1,3,5]");
        assert_eq!(store.load(hash).as_deref(), Some("CPUSET[CPU_LIST=1,3,5]"));
        // A key from the scheduler names no other path.
        for bad in ["../../etc/passwd", "0123456789ABCDEF0123456789ABCDEF", "abc", ""] {
            store.save(bad, "x");
            assert_eq!(store.load(bad), None, "{bad:?}");
        }
        assert_eq!(std::fs::read_dir(&keys).unwrap().count(), 1);
        // A symbolic link put in its place is not followed.
        let other = "fedcba9876543210fedcba9876543210";
        std::os::unix::fs::symlink(keys.join(hash), keys.join(other)).unwrap();
        assert_eq!(store.load(other), None);
        // Others may write to the directory: refused, saying why.
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = DirKeyStore::open(&keys).unwrap_err();
        assert!(e.contains("others may write to it"), "{e}");
        // A file where the directory should be.
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(DirKeyStore::open(&file).unwrap_err().contains("not a directory"));
    }
}
