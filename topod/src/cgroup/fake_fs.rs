//! A cgroup file system emulated in a temporary directory, for unit tests of the real v1 and v2
//! backends: directories and files are real, and each operation keeps the kernel rules the
//! backends depend on (from `shared/reference/cgroups.md` and the kernel's
//! `Documentation/admin-guide/cgroup-v1/cpusets.rst` and `cgroup-v2.rst`):
//!
//! - `mkdir` populates a cgroup's control files; a new v1 cpuset has no CPUs or memory nodes,
//!   a new v2 cgroup's `cpuset.cpus.effective` is its parent's (inherited until written), and a
//!   v2 cgroup's `cgroup.controllers` is what its parent's `cgroup.subtree_control` enables;
//! - a process written to a v1 cpuset without CPUs or memory nodes is refused with ENOSPC;
//!   CPUs outside the parent's, or overlapping an exclusive sibling's, with EINVAL;
//! - `rmdir` of a cgroup with processes or child cgroups fails with EBUSY;
//! - v2: no processes in a (non-root) cgroup that enables controllers for its children (EBUSY),
//!   a controller enabled only where the parent offers it (ENOENT), `cgroup.events` says
//!   `populated 1` while the subtree holds a process, `cgroup.kill` kills the subtree.
//!
//! Processes are pids listed in `cgroup.procs`: [`FakeCgroupFs::start_process`] puts one in each
//! hierarchy's root, a kill removes it everywhere, unless it was made
//! [`FakeCgroupFs::unkillable`].

use super::fs::CgroupFs;
use std::collections::BTreeSet;
use std::io::{Error, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;
use topo_core::cpuset::CpuSet;

/// Which kernel to emulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `cpuset`, `freezer` and `memory` hierarchies.
    V1,
    /// One unified hierarchy.
    V2,
}

/// The emulated cgroup file system; see the module documentation.
#[derive(Debug)]
pub(crate) struct FakeCgroupFs {
    dir: tempfile::TempDir,
    layout: Layout,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    unkillable: BTreeSet<i32>,
    own_cgroups: Option<String>,
    affinity: std::collections::BTreeMap<i32, topo_core::cpuset::CpuSet>,
}

fn errno(e: nix::errno::Errno) -> Error {
    Error::from_raw_os_error(e as i32)
}

/// The v1 hierarchies the fake mounts.
const V1_HIERARCHIES: [&str; 4] = ["cpuset", "freezer", "memory", "cpu"];

impl FakeCgroupFs {
    /// v1: `cpuset`, `freezer`, `memory` and `cpu` mounted, the root cpuset holding `cpus` and `mems`.
    pub fn v1(cpus: &str, mems: &str) -> Self {
        let fs = Self::empty(Layout::V1);
        for h in V1_HIERARCHIES {
            std::fs::create_dir(fs.root(h)).unwrap();
            fs.populate(&fs.root(h)).unwrap();
        }
        let cpuset = fs.root("cpuset");
        for (file, value) in [
            ("cpuset.cpus", cpus),
            ("cpuset.effective_cpus", cpus),
            ("cpuset.mems", mems),
            ("cpuset.effective_mems", mems),
            ("cpuset.cpu_exclusive", "1"),
        ] {
            std::fs::write(cpuset.join(file), value).unwrap();
        }
        fs
    }

    /// v2: the unified hierarchy, its root offering `cpuset`, `cpu` and `memory` over `cpus`, `mems`.
    pub fn v2(cpus: &str, mems: &str) -> Self {
        let fs = Self::empty(Layout::V2);
        let root = fs.root("unified");
        std::fs::create_dir(&root).unwrap();
        fs.populate(&root).unwrap();
        for (file, value) in [
            ("cgroup.controllers", "cpuset cpu memory"),
            ("cpuset.cpus.effective", cpus),
            ("cpuset.mems.effective", mems),
        ] {
            std::fs::write(root.join(file), value).unwrap();
        }
        fs
    }

    fn empty(layout: Layout) -> Self {
        let dir = tempfile::tempdir().unwrap();
        FakeCgroupFs { dir, layout, state: Mutex::default() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A hierarchy's mount point: `cpuset`, `freezer`, `memory` (v1) or `unified` (v2).
    pub fn root(&self, hierarchy: &str) -> PathBuf {
        self.dir.path().join(hierarchy)
    }

    /// `/proc/mounts` text for the emulated hierarchies.
    pub fn mounts(&self) -> String {
        let mut text = String::from("proc /proc proc rw,nosuid 0 0\n");
        match self.layout {
            Layout::V1 => {
                for h in V1_HIERARCHIES {
                    text +=
                        &format!("cgroup {} cgroup rw,nosuid,{h} 0 0\n", self.root(h).display());
                }
            }
            Layout::V2 => {
                text +=
                    &format!("cgroup2 {} cgroup2 rw,nosuid 0 0\n", self.root("unified").display());
            }
        }
        text
    }

    /// A new process `pid`, in the root cgroup of every hierarchy.
    pub fn start_process(&self, pid: i32) {
        let roots: Vec<PathBuf> = match self.layout {
            Layout::V1 => V1_HIERARCHIES.iter().map(|h| self.root(h)).collect(),
            Layout::V2 => vec![self.root("unified")],
        };
        for root in roots {
            self.add_pid(&root, pid).unwrap();
        }
    }

    /// `pid` survives SIGKILL (a process in uninterruptible sleep, say).
    pub fn unkillable(&self, pid: i32) {
        self.state().unkillable.insert(pid);
    }

    /// The CPU affinity the backend last gave thread `tid`, if any.
    pub fn affinity(&self, tid: i32) -> Option<topo_core::cpuset::CpuSet> {
        self.state().affinity.get(&tid).cloned()
    }

    /// What `/proc/self/cgroup` reads.
    pub fn set_own_cgroups(&self, text: &str) {
        self.state().own_cgroups = Some(text.to_string());
    }

    /// The hierarchy `path` is in (its first component under the temporary directory).
    fn hierarchy(&self, path: &Path) -> Option<String> {
        let rel = path.strip_prefix(self.dir.path()).ok()?;
        rel.components().next().map(|c| c.as_os_str().to_string_lossy().into_owned())
    }

    fn is_root(&self, dir: &Path) -> bool {
        dir.parent() == Some(self.dir.path())
    }

    fn text(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }

    fn set(path: &Path) -> CpuSet {
        CpuSet::parse_list(&Self::text(path)).unwrap_or_default()
    }

    /// The control files a new cgroup gets.
    fn populate(&self, dir: &Path) -> std::io::Result<()> {
        let parent = dir.parent().unwrap_or(dir);
        let mut files: Vec<(&str, String)> = vec![("cgroup.procs", String::new())];
        match self.hierarchy(dir).as_deref() {
            Some("cpuset") => files.extend([
                ("tasks", String::new()),
                ("cpuset.cpus", String::new()),
                ("cpuset.mems", String::new()),
                ("cpuset.effective_cpus", String::new()),
                ("cpuset.effective_mems", String::new()),
                ("cpuset.cpu_exclusive", "0".to_string()),
            ]),
            Some("freezer") => {
                files.extend([("tasks", String::new()), ("freezer.state", "THAWED\n".into())])
            }
            Some("cpu") => {
                files.extend([("tasks", String::new()), ("cpu.shares", "1024\n".into())])
            }
            Some("memory") => files.extend([
                ("tasks", String::new()),
                ("memory.limit_in_bytes", "9223372036854771712\n".into()),
            ]),
            _ => {
                let offered = Self::text(&parent.join("cgroup.subtree_control"));
                files.extend([
                    ("cgroup.controllers", String::new()),
                    ("cgroup.subtree_control", String::new()),
                    ("cgroup.freeze", "0\n".into()),
                    ("cgroup.kill", String::new()),
                    ("cgroup.events", String::new()),
                ]);
                for controller in offered.split_whitespace() {
                    files.extend(Self::controller_files(parent, controller));
                }
            }
        }
        for (name, value) in files {
            std::fs::write(dir.join(name), value)?;
        }
        Ok(())
    }

    /// The files a v2 controller adds to a child of `parent` once it is enabled there.
    fn controller_files(parent: &Path, controller: &str) -> Vec<(&'static str, String)> {
        match controller {
            "cpuset" => vec![
                ("cpuset.cpus", String::new()),
                ("cpuset.mems", String::new()),
                // Inherited: a new v2 cpuset runs on its parent's CPUs until written.
                ("cpuset.cpus.effective", Self::text(&parent.join("cpuset.cpus.effective"))),
                ("cpuset.mems.effective", Self::text(&parent.join("cpuset.mems.effective"))),
                ("cpuset.cpus.partition", "member\n".into()),
            ],
            "memory" => vec![("memory.max", "max\n".into())],
            "cpu" => vec![("cpu.weight", "100\n".into())],
            _ => Vec::new(),
        }
    }

    /// A v2 cgroup's `cgroup.controllers`: what its parent enables (the root's are fixed).
    fn controllers(&self, dir: &Path) -> String {
        match dir.parent() {
            Some(parent) if !self.is_root(dir) => {
                Self::text(&parent.join("cgroup.subtree_control"))
            }
            _ => Self::text(&dir.join("cgroup.controllers")),
        }
    }

    /// Every cgroup directory of `path`'s hierarchy, `path`'s subtree only when `within`.
    fn cgroups(&self, top: &Path) -> Vec<PathBuf> {
        let mut out = vec![top.to_path_buf()];
        let mut i = 0;
        while i < out.len() {
            if let Ok(entries) = std::fs::read_dir(&out[i]) {
                out.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
            }
            i += 1;
        }
        out
    }

    fn pids_of(dir: &Path) -> Vec<i32> {
        Self::text(&dir.join("cgroup.procs"))
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect()
    }

    fn write_pids(dir: &Path, pids: &[i32]) -> std::io::Result<()> {
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        std::fs::write(dir.join("cgroup.procs"), &text)?;
        if dir.join("tasks").exists() {
            std::fs::write(dir.join("tasks"), &text)?;
        }
        Ok(())
    }

    /// Moves `pid` into `dir`, out of every other cgroup of the hierarchy.
    fn add_pid(&self, dir: &Path, pid: i32) -> std::io::Result<()> {
        let hierarchy = self.hierarchy(dir).unwrap_or_default();
        for cgroup in self.cgroups(&self.root(&hierarchy)) {
            let mut pids = Self::pids_of(&cgroup);
            if cgroup == dir {
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            } else {
                pids.retain(|&p| p != pid);
            }
            Self::write_pids(&cgroup, &pids)?;
        }
        Ok(())
    }

    fn alive(&self, pid: i32) -> bool {
        ["cpuset", "unified"]
            .iter()
            .flat_map(|h| self.cgroups(&self.root(h)))
            .any(|c| Self::pids_of(&c).contains(&pid))
    }

    fn kill_pid(&self, pid: i32) -> bool {
        let alive = self.alive(pid);
        if !alive || self.state().unkillable.contains(&pid) {
            return alive;
        }
        for h in ["cpuset", "freezer", "memory", "cpu", "unified"] {
            for cgroup in self.cgroups(&self.root(h)) {
                let mut pids = Self::pids_of(&cgroup);
                pids.retain(|&p| p != pid);
                let _ = Self::write_pids(&cgroup, &pids);
            }
        }
        true
    }

    fn write_file(&self, path: &Path, data: &str) -> std::io::Result<()> {
        use nix::errno::Errno::{EBUSY, EINVAL, ENOENT, ENOSPC};
        let dir = path.parent().unwrap_or(path);
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let v1_cpuset = self.hierarchy(dir).as_deref() == Some("cpuset");
        let list = || CpuSet::parse_list(data).map_err(|_| errno(EINVAL));
        match name.as_str() {
            "cpuset.cpus" | "cpuset.mems" if v1_cpuset => {
                let value = list()?;
                let parent = dir.parent().unwrap_or(dir);
                if !value.is_subset(&Self::set(&parent.join(&name))) {
                    return Err(errno(EINVAL));
                }
                if name == "cpuset.cpus" {
                    for sibling in self.cgroups(parent).into_iter().skip(1) {
                        let exclusive =
                            Self::text(&sibling.join("cpuset.cpu_exclusive")).trim() == "1";
                        if sibling.parent() == Some(parent)
                            && sibling != dir
                            && exclusive
                            && !Self::set(&sibling.join("cpuset.cpus"))
                                .intersection(&value)
                                .is_empty()
                        {
                            return Err(errno(EINVAL));
                        }
                    }
                }
                let effective = if name == "cpuset.cpus" {
                    "cpuset.effective_cpus"
                } else {
                    "cpuset.effective_mems"
                };
                std::fs::write(path, value.to_string())?;
                std::fs::write(dir.join(effective), value.to_string())
            }
            "cpuset.cpus" | "cpuset.mems" => {
                let value = list()?;
                let parent = dir.parent().unwrap_or(dir);
                let effective = format!("{name}.effective");
                let inherited = Self::set(&parent.join(&effective));
                let now = if value.is_empty() {
                    inherited.clone()
                } else {
                    value.intersection(&inherited)
                };
                std::fs::write(path, value.to_string())?;
                std::fs::write(dir.join(effective), now.to_string())
            }
            "cgroup.procs" | "tasks" => {
                let pid: i32 = data.trim().parse().map_err(|_| errno(EINVAL))?;
                let pid = if pid == 0 { std::process::id() as i32 } else { pid };
                if v1_cpuset
                    && (Self::set(&dir.join("cpuset.cpus")).is_empty()
                        || Self::set(&dir.join("cpuset.mems")).is_empty())
                {
                    return Err(errno(ENOSPC));
                }
                if self.layout == Layout::V2
                    && !self.is_root(dir)
                    && !Self::text(&dir.join("cgroup.subtree_control")).trim().is_empty()
                {
                    return Err(errno(EBUSY));
                }
                if !self.alive(pid) {
                    return Err(Error::from_raw_os_error(nix::errno::Errno::ESRCH as i32));
                }
                self.add_pid(dir, pid)
            }
            "cgroup.kill" => {
                if data.trim() != "1" {
                    return Err(errno(EINVAL));
                }
                for cgroup in self.cgroups(dir) {
                    for pid in Self::pids_of(&cgroup) {
                        self.kill_pid(pid);
                    }
                }
                Ok(())
            }
            "cgroup.subtree_control" => {
                let mut enabled: BTreeSet<String> =
                    Self::text(path).split_whitespace().map(String::from).collect();
                let offered = self.controllers(dir);
                if !self.is_root(dir) && !Self::pids_of(dir).is_empty() {
                    return Err(errno(EBUSY));
                }
                for word in data.split_whitespace() {
                    let (on, controller) = word.split_at(1);
                    if !offered.split_whitespace().any(|c| c == controller) {
                        return Err(errno(ENOENT));
                    }
                    match on {
                        "+" => enabled.insert(controller.to_string()),
                        "-" => enabled.remove(controller),
                        _ => return Err(errno(EINVAL)),
                    };
                }
                // Children gain the files of what is now enabled for them.
                for child in
                    self.cgroups(dir).into_iter().skip(1).filter(|c| c.parent() == Some(dir))
                {
                    for controller in &enabled {
                        for (name, value) in Self::controller_files(dir, controller) {
                            if !child.join(name).exists() {
                                std::fs::write(child.join(name), value)?;
                            }
                        }
                    }
                }
                std::fs::write(path, enabled.into_iter().collect::<Vec<_>>().join(" "))
            }
            "freezer.state" if !matches!(data.trim(), "FROZEN" | "THAWED") => Err(errno(EINVAL)),
            "cgroup.freeze" if !matches!(data.trim(), "0" | "1") => Err(errno(EINVAL)),
            _ => std::fs::write(path, data),
        }
    }
}

impl CgroupFs for FakeCgroupFs {
    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
        if path.file_name().is_some_and(|n| n == "cgroup.controllers") && path.exists() {
            return Ok(self.controllers(path.parent().unwrap_or(path)).into());
        }
        if path.file_name().is_some_and(|n| n == "cgroup.events") && path.exists() {
            let dir = path.parent().unwrap_or(path);
            let populated = self.cgroups(dir).iter().any(|c| !Self::pids_of(c).is_empty());
            let frozen = Self::text(&dir.join("cgroup.freeze")).trim() == "1";
            return Ok(format!("populated {}\nfrozen {}\n", populated as u8, frozen as u8).into());
        }
        std::fs::read(path)
    }

    fn write(&self, path: &Path, data: &[u8]) -> std::io::Result<()> {
        if !path.is_file() {
            return Err(Error::from(ErrorKind::NotFound));
        }
        let text = std::str::from_utf8(data).map_err(|_| errno(nix::errno::Errno::EINVAL))?;
        self.write_file(path, text)
    }

    fn create_dir(&self, path: &Path) -> std::io::Result<()> {
        std::fs::create_dir(path)?;
        self.populate(path)
    }

    fn create_dir_all(&self, path: &Path) -> std::io::Result<()> {
        if path.is_dir() {
            return Ok(());
        }
        if let Some(parent) = path.parent() {
            self.create_dir_all(parent)?;
        }
        self.create_dir(path)
    }

    fn remove_dir(&self, path: &Path) -> std::io::Result<()> {
        if !path.is_dir() {
            return Err(Error::from(ErrorKind::NotFound));
        }
        if self.cgroups(path).len() > 1 || !Self::pids_of(path).is_empty() {
            return Err(errno(nix::errno::Errno::EBUSY));
        }
        std::fs::remove_dir_all(path)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn subdirs(&self, path: &Path) -> std::io::Result<Vec<PathBuf>> {
        Ok(std::fs::read_dir(path)?.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
    }

    fn kill(&self, pid: i32) -> bool {
        self.kill_pid(pid)
    }

    fn threads(&self, pid: i32) -> Option<Vec<i32>> {
        self.alive(pid).then(|| vec![pid])
    }

    fn own_cgroups(&self) -> Option<String> {
        self.state().own_cgroups.clone()
    }

    fn set_affinity(&self, tid: i32, cpus: &topo_core::cpuset::CpuSet) -> bool {
        if !self.alive(tid) {
            return false;
        }
        self.state().affinity.insert(tid, cpus.clone());
        true
    }

    fn watch(
        &self,
        path: &Path,
        timeout: Duration,
        done: &mut dyn FnMut(&str) -> bool,
    ) -> std::io::Result<bool> {
        // The emulation changes state at once; a short poll loop stands in for the notification.
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if done(&String::from_utf8_lossy(&self.read(path)?)) {
                return Ok(true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
