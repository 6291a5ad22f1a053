//! Linux sysfs/procfs reader with an injectable root directory.
//!
//! `root` holds `sys/` and `proc/`: `/` for the running host, or an extracted
//! `hwloc-gather-topology` snapshot. What is read, and from where:
//!
//! | what | files |
//! |---|---|
//! | online CPUs | `sys/devices/system/cpu/online` |
//! | cores, packages, dies | `cpuN/topology/{core_cpus,thread_siblings,package_cpus,core_siblings,die_cpus}[_list]`, `physical_package_id`, `die_id` |
//! | L2 and L3 groups | `cpuN/cache/index*/{level,type,shared_cpu_list|shared_cpu_map,id}` |
//! | CPU kinds | `cpuN/cpu_capacity`, `cpuN/cpufreq/cpuinfo_max_freq` (two or more distinct values) |
//! | NUMA nodes | `sys/devices/system/node/nodeN/{cpulist|cpumap,meminfo,distance}` |
//! | GPU memory nodes | `proc/driver/nvidia/gpus/*/numa_status` (`Node: N`); hidden unless asked for, as hwloc does |
//! | PCI devices | `sys/bus/pci/devices/*/{class,vendor,device,numa_node,local_cpulist|local_cpus}`, names under `net/`, `infiniband/`, `drm/` |
//! | allowed CPUs and memory | the process's cpuset cgroup (`proc/self/cpuset` or `proc/self/cgroup`, mounts from `proc/mounts`: cgroup v2 `cpuset.*.effective`, v1 `cpuset.cpus`, the legacy cpuset filesystem's `cpus`), and `Cpus_allowed_list` / `Mems_allowed_list` in `proc/self/status` |
//!
//! Sets are cut to the online CPUs (the kernel lists offline siblings). Optional files may be
//! missing; a file that is there but malformed is an error naming the file.

use super::{CpuKind, Distances, Domain, IoDevice, MemoryKind, NumaNode, Topology, TopologyError};
use crate::cpuset::CpuSet;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Reader choices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Keep NVIDIA GPU memory NUMA nodes (hwloc's `HWLOC_KEEP_NVIDIA_GPU_NUMA_NODES=1`).
    pub keep_gpu_numa_nodes: bool,
}

/// Reads the topology under `root` with the default options.
pub fn read(root: &Path) -> Result<Topology, TopologyError> {
    read_with(root, &ReadOptions::default())
}

/// Reads the topology under `root`.
pub fn read_with(root: &Path, options: &ReadOptions) -> Result<Topology, TopologyError> {
    let fs = Fs { root: root.to_path_buf(), tree: confining_tree(root) };
    let cpu_dir = "sys/devices/system/cpu";
    let online = match fs.optional(&format!("{cpu_dir}/online"))? {
        Some(text) => fs.list(&format!("{cpu_dir}/online"), &text)?,
        None => fs.cpu_dirs(cpu_dir)?,
    };
    if online.is_empty() {
        return Err(TopologyError::Empty {
            source_name: root.display().to_string(),
            what: format!("no online CPU under {cpu_dir}"),
        });
    }
    let mut groups = Groups::default();
    groups.read_ids(&fs, cpu_dir, &online)?;
    let mut kinds: BTreeMap<(Option<u64>, Option<u64>), CpuSet> = BTreeMap::new();
    for cpu in online.iter() {
        let dir = format!("{cpu_dir}/cpu{cpu}");
        groups.read_cpu(&fs, &dir, cpu, &online)?;
        let capacity = fs.number(&format!("{dir}/cpu_capacity"))?;
        let max_freq = fs.number(&format!("{dir}/cpufreq/cpuinfo_max_freq"))?;
        kinds.entry((capacity, max_freq)).or_default().insert(cpu);
    }
    let (numa_nodes, distances) = read_nodes(&fs, &online, options)?;
    let (allowed_cpus, allowed_mems) = allowed(&fs)?;
    let node_ids: CpuSet = numa_nodes.iter().map(|n| n.os_index).collect();
    let topo = Topology {
        source: root.display().to_string(),
        allowed: allowed_cpus.map_or_else(|| online.clone(), |a| a.intersection(&online)),
        allowed_mems: allowed_mems.map_or_else(|| node_ids.clone(), |m| m.intersection(&node_ids)),
        pus: online,
        cores: groups.cores.into_domains(),
        l2_groups: groups.l2.into_domains(),
        l3_groups: groups.l3.into_domains(),
        numa_nodes,
        dies: groups.dies.into_domains(),
        packages: groups.packages.into_domains(),
        cpu_kinds: cpu_kinds(kinds),
        distances,
        devices: read_pci(&fs)?,
    };
    Ok(topo)
}

/// File access under the root, with errors that name the file.
struct Fs {
    root: PathBuf,
    /// [`confining_tree`] of `root`, worked out once.
    tree: Option<PathBuf>,
}

impl Fs {
    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// The file's text, or `None` when it does not exist.
    fn optional(&self, rel: &str) -> Result<Option<String>, TopologyError> {
        self.optional_up_to(rel, MAX_ATTRIBUTE_BYTES)
    }

    /// [`Fs::optional`] for a file that may hold up to `limit` bytes.
    fn optional_up_to(&self, rel: &str, limit: u64) -> Result<Option<String>, TopologyError> {
        let path = self.path(rel);
        match read_attribute(self.tree.as_deref(), &path, limit) {
            // Some sysfs files (and snapshots of them) end in NUL padding.
            Ok(bytes) => Ok(Some(
                String::from_utf8_lossy(&bytes).trim_end_matches(['\0', '\n', ' ']).to_string(),
            )),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                Ok(None)
            }
            // Reading some sysfs attributes is refused to non-root users (EACCES) or fails for
            // devices that are gone (ENODEV, EINVAL); treat those as absent too.
            Err(e) if matches!(e.raw_os_error(), Some(13) | Some(19) | Some(22) | Some(1)) => {
                Ok(None)
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                Err(TopologyError::Format { path: path.display().to_string(), what: e.to_string() })
            }
            Err(source) => Err(TopologyError::Io { path, source }),
        }
    }

    fn bad(&self, rel: &str, what: String) -> TopologyError {
        TopologyError::Format { path: self.path(rel).display().to_string(), what }
    }

    fn list(&self, rel: &str, text: &str) -> Result<CpuSet, TopologyError> {
        CpuSet::parse_list(text).map_err(|e| self.bad(rel, e.to_string()))
    }

    fn mask(&self, rel: &str, text: &str) -> Result<CpuSet, TopologyError> {
        CpuSet::parse_mask(text).map_err(|e| self.bad(rel, e.to_string()))
    }

    /// A set from `<base>_list` (list format) or `<base>` (mask format), whichever exists.
    fn set(&self, base: &str) -> Result<Option<CpuSet>, TopologyError> {
        let list = format!("{base}_list");
        if let Some(text) = self.optional(&list)? {
            return self.list(&list, &text).map(Some);
        }
        match self.optional(base)? {
            Some(text) => self.mask(base, &text).map(Some),
            None => Ok(None),
        }
    }

    fn number(&self, rel: &str) -> Result<Option<u64>, TopologyError> {
        match self.optional(rel)? {
            None => Ok(None),
            Some(text) => {
                let t = text.trim();
                t.parse::<i64>()
                    .map(|v| u64::try_from(v).ok())
                    .map_err(|_| self.bad(rel, format!("{t:?} is not a number")))
            }
        }
    }

    /// The PCI bridges above the device `rel` (`sys/bus/pci/devices/<addr>`, a link into
    /// `sys/devices/pci<domain>:<bus>/<root port>/.../<addr>`), root port first: the link's
    /// components that are PCI addresses, less the device itself. Empty when it is no link
    /// (a snapshot that copied the directory) or names no bridge.
    fn pci_upstream(&self, rel: &str, addr: &str) -> Vec<String> {
        let Ok(target) = std::fs::read_link(self.path(rel)) else { return Vec::new() };
        let parts: Vec<String> = target
            .components()
            .filter_map(|c| c.as_os_str().to_str())
            .filter(|c| is_pci_address(c))
            .map(str::to_string)
            .collect();
        match parts.split_last() {
            Some((last, above)) if last == addr => above.to_vec(),
            _ => Vec::new(),
        }
    }

    /// Whether `rel` exists (a link counts, whatever it points to).
    fn exists(&self, rel: &str) -> bool {
        std::fs::symlink_metadata(self.path(rel)).is_ok()
    }

    fn entries(&self, rel: &str) -> Vec<String> {
        std::fs::read_dir(self.path(rel))
            .map(|it| it.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }

    /// `cpuN` directories, when `online` is missing.
    fn cpu_dirs(&self, rel: &str) -> Result<CpuSet, TopologyError> {
        Ok(self
            .entries(rel)
            .iter()
            .filter_map(|n| n.strip_prefix("cpu")?.parse::<u32>().ok())
            .filter(|&n| n <= crate::cpuset::MAX_CPU_ID)
            .collect())
    }
}

/// Distinct CPU sets of one level, with the OS index the kernel gives each.
#[derive(Default)]
struct Level(BTreeMap<CpuSet, Option<u32>>);

impl Level {
    fn add(&mut self, set: CpuSet, id: Option<u64>) {
        if !set.is_empty() {
            let id = id.and_then(|i| u32::try_from(i).ok());
            self.0.entry(set).or_insert(id);
        }
    }

    fn into_domains(self) -> Vec<Domain> {
        let mut v: Vec<Domain> =
            self.0.into_iter().map(|(cpus, os_index)| Domain { os_index, cpus }).collect();
        v.sort_by_key(|d| d.cpus.first());
        v
    }
}

/// (package id, die id, core id) of one CPU.
type CpuIds = (Option<u64>, Option<u64>, Option<u64>);

#[derive(Default)]
struct Groups {
    /// Per CPU: its ids, where the kernel gives them.
    ids: BTreeMap<u32, CpuIds>,
    cores: Level,
    packages: Level,
    dies: Level,
    l2: Level,
    l3: Level,
}

impl Groups {
    fn read_ids(&mut self, fs: &Fs, cpu_dir: &str, online: &CpuSet) -> Result<(), TopologyError> {
        for cpu in online.iter() {
            let topo = format!("{cpu_dir}/cpu{cpu}/topology");
            let ids = (
                fs.number(&format!("{topo}/physical_package_id"))?,
                fs.number(&format!("{topo}/die_id"))?,
                fs.number(&format!("{topo}/core_id"))?,
            );
            self.ids.insert(cpu, ids);
        }
        Ok(())
    }

    fn read_cpu(
        &mut self,
        fs: &Fs,
        dir: &str,
        cpu: u32,
        online: &CpuSet,
    ) -> Result<(), TopologyError> {
        let me: CpuSet = std::iter::once(cpu).collect();
        let topo = format!("{dir}/topology");
        let core = match fs.set(&format!("{topo}/core_cpus"))? {
            Some(s) => Some(s),
            None => fs.set(&format!("{topo}/thread_siblings"))?,
        };
        // A core is the thread siblings that also share (package, die, core_id): AMD Bulldozer
        // lists the two cores of a compute module as thread siblings, with different core ids.
        let mine = self.ids.get(&cpu).copied();
        let core: CpuSet = core
            .unwrap_or_else(|| me.clone())
            .intersection(online)
            .iter()
            .filter(|c| mine.is_none_or(|m| m.2.is_none() || self.ids.get(c).copied() == Some(m)))
            .collect();
        // core_id is only unique inside a package, so cores keep no OS index.
        self.cores.add(core, None);
        let package = match fs.set(&format!("{topo}/package_cpus"))? {
            Some(s) => Some(s),
            None => fs.set(&format!("{topo}/core_siblings"))?,
        };
        self.packages.add(
            package.unwrap_or_else(|| me.clone()).intersection(online),
            fs.number(&format!("{topo}/physical_package_id"))?,
        );
        if let Some(die) = fs.set(&format!("{topo}/die_cpus"))? {
            self.dies.add(die.intersection(online), fs.number(&format!("{topo}/die_id"))?);
        }
        for index in
            fs.entries(&format!("{dir}/cache")).into_iter().filter(|e| e.starts_with("index"))
        {
            let cache = format!("{dir}/cache/{index}");
            let level = fs.number(&format!("{cache}/level"))?;
            let kind = fs.optional(&format!("{cache}/type"))?.unwrap_or_default();
            if kind.trim() == "Instruction" {
                continue;
            }
            let shared = match fs.optional(&format!("{cache}/shared_cpu_list"))? {
                Some(t) => fs.list(&format!("{cache}/shared_cpu_list"), &t)?,
                None => match fs.optional(&format!("{cache}/shared_cpu_map"))? {
                    Some(t) => fs.mask(&format!("{cache}/shared_cpu_map"), &t)?,
                    None => continue,
                },
            };
            let id = fs.number(&format!("{cache}/id"))?;
            match level {
                Some(2) => self.l2.add(shared.intersection(online), id),
                Some(3) => self.l3.add(shared.intersection(online), id),
                _ => {}
            }
        }
        Ok(())
    }
}

fn cpu_kinds(kinds: BTreeMap<(Option<u64>, Option<u64>), CpuSet>) -> Vec<CpuKind> {
    if kinds.len() < 2 {
        return Vec::new();
    }
    // Ascending capacity/frequency = ascending efficiency rank, as hwloc orders kinds.
    kinds
        .into_iter()
        .enumerate()
        .map(|(rank, ((capacity, freq), cpus))| {
            let name = match (capacity, freq) {
                (Some(c), _) => format!("capacity={c}"),
                (None, Some(f)) => format!("max_freq={}MHz", f / 1000),
                (None, None) => "unknown".to_string(),
            };
            CpuKind { cpus, name, efficiency: i32::try_from(rank).ok() }
        })
        .collect()
}

fn read_nodes(
    fs: &Fs,
    online: &CpuSet,
    options: &ReadOptions,
) -> Result<(Vec<NumaNode>, Option<Distances>), TopologyError> {
    let node_dir = "sys/devices/system/node";
    let mut ids: Vec<u32> =
        fs.entries(node_dir).iter().filter_map(|n| n.strip_prefix("node")?.parse().ok()).collect();
    ids.sort_unstable();
    let gpu_nodes = nvidia_gpu_nodes(fs)?;
    let mut nodes = Vec::new();
    let mut rows: Vec<(u32, Vec<u32>)> = Vec::new();
    for &id in &ids {
        let dir = format!("{node_dir}/node{id}");
        let cpus = match fs.optional(&format!("{dir}/cpulist"))? {
            Some(t) => fs.list(&format!("{dir}/cpulist"), &t)?,
            None => match fs.optional(&format!("{dir}/cpumap"))? {
                Some(t) => fs.mask(&format!("{dir}/cpumap"), &t)?,
                None => CpuSet::new(),
            },
        }
        .intersection(online);
        let memory_bytes = match fs.optional(&format!("{dir}/meminfo"))? {
            Some(t) => mem_total(&t).ok_or_else(|| {
                fs.bad(&format!("{dir}/meminfo"), "no readable MemTotal line".into())
            })?,
            None => 0,
        };
        if let Some(t) = fs.optional(&format!("{dir}/distance"))? {
            let row: Result<Vec<u32>, _> = t.split_whitespace().map(str::parse::<u32>).collect();
            let row = row.map_err(|_| {
                fs.bad(
                    &format!("{dir}/distance"),
                    format!("{:?} is not a list of numbers", t.trim()),
                )
            })?;
            rows.push((id, row));
        }
        let kind = if gpu_nodes.contains(id) { MemoryKind::GpuMemory } else { MemoryKind::Dram };
        nodes.push(NumaNode { os_index: id, near_cpus: cpus.clone(), cpus, memory_bytes, kind });
    }
    let possible = match fs.optional(&format!("{node_dir}/possible"))? {
        Some(t) => fs.list(&format!("{node_dir}/possible"), &t)?.iter().collect(),
        None => Vec::new(),
    };
    let distances = build_distances(fs, node_dir, &ids, &possible, rows)?;
    // CPU-less nodes: near the CPUs of the nodes closest to them.
    if let Some(d) = &distances {
        let with_cpus: Vec<(u32, CpuSet)> = nodes
            .iter()
            .filter(|n| !n.cpus.is_empty())
            .map(|n| (n.os_index, n.cpus.clone()))
            .collect();
        for n in nodes.iter_mut().filter(|n| n.cpus.is_empty()) {
            let best = with_cpus.iter().filter_map(|(o, _)| d.between(n.os_index, *o)).min();
            if let Some(best) = best {
                n.near_cpus = CpuSet::union_all(
                    with_cpus
                        .iter()
                        .filter(|(o, _)| d.between(n.os_index, *o) == Some(best))
                        .map(|(_, c)| c),
                );
            }
        }
    }
    if !options.keep_gpu_numa_nodes {
        nodes.retain(|n| n.kind != MemoryKind::GpuMemory);
    }
    Ok((nodes, distances))
}

/// The SLIT from the `distance` rows. A row has one entry per node present, or, when a node is
/// offline, one per possible node (seen on kernels that keep offline nodes in the table).
fn build_distances(
    fs: &Fs,
    node_dir: &str,
    ids: &[u32],
    possible: &[u32],
    rows: Vec<(u32, Vec<u32>)>,
) -> Result<Option<Distances>, TopologyError> {
    if rows.is_empty() || rows.len() != ids.len() {
        return Ok(None);
    }
    let width = rows[0].1.len();
    let columns: &[u32] = if width == ids.len() {
        ids
    } else if width == possible.len() {
        possible
    } else {
        return Err(fs.bad(
            &format!("{node_dir}/node{}/distance", rows[0].0),
            format!("{width} distances for {} NUMA nodes ({} possible)", ids.len(), possible.len()),
        ));
    };
    // Square matrix over `columns`; rows of absent nodes are unknown (20 off the diagonal).
    let n = columns.len();
    let mut values: Vec<u32> = (0..n * n).map(|k| if k / n == k % n { 10 } else { 20 }).collect();
    for (id, row) in rows {
        if row.len() != n {
            return Err(fs.bad(
                &format!("{node_dir}/node{id}/distance"),
                format!("{} distances where the other nodes have {n}", row.len()),
            ));
        }
        let Some(i) = columns.iter().position(|&c| c == id) else { continue };
        for (j, v) in row.into_iter().enumerate() {
            values[i * n + j] = v;
            // The SLIT is symmetric: fill the column of a node whose own row is missing.
            if !ids.contains(&columns[j]) {
                values[j * n + i] = values[i * n + j];
            }
        }
    }
    Ok(Some(Distances { nodes: columns.to_vec(), values }))
}

/// `Node 0 MemTotal:  129839104 kB` → bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.contains("MemTotal:"))?;
    let kb: u64 = line.split("MemTotal:").nth(1)?.split_whitespace().next()?.parse().ok()?;
    kb.checked_mul(1024)
}

/// NUMA nodes that are NVIDIA GPU memory, from the driver's `numa_status` files.
fn nvidia_gpu_nodes(fs: &Fs) -> Result<CpuSet, TopologyError> {
    let dir = "proc/driver/nvidia/gpus";
    let mut out = CpuSet::new();
    for gpu in fs.entries(dir) {
        let file = format!("{dir}/{gpu}/numa_status");
        if let Some(text) = fs.optional(&file)? {
            let node = text.lines().find_map(|l| l.trim().strip_prefix("Node:")).map(str::trim);
            if let Some(node) = node {
                let id: i64 = node
                    .parse()
                    .map_err(|_| fs.bad(&file, format!("Node: {node:?} is not a number")))?;
                if let Ok(id) = u32::try_from(id) {
                    out.insert(id.min(crate::cpuset::MAX_CPU_ID));
                }
            }
        }
    }
    Ok(out)
}

/// The process's allowed CPUs and memory nodes: its cpuset cgroup, then `proc/self/status`.
fn allowed(fs: &Fs) -> Result<(Option<CpuSet>, Option<CpuSet>), TopologyError> {
    let (mut cpus, mut mems) = cgroup_cpuset(fs)?;
    if let Some(status) = fs.optional("proc/self/status")? {
        for line in status.lines() {
            let field = |name: &str| line.strip_prefix(name).map(str::trim);
            if let Some(v) = field("Cpus_allowed_list:") {
                let s = fs.list("proc/self/status", v)?;
                cpus = Some(cpus.map_or_else(|| s.clone(), |c| c.intersection(&s)));
            } else if let Some(v) = field("Mems_allowed_list:") {
                let s = fs.list("proc/self/status", v)?;
                mems = Some(mems.map_or_else(|| s.clone(), |m| m.intersection(&s)));
            }
        }
    }
    Ok((cpus, mems))
}

/// A mounted cpuset hierarchy: where, and how its files are named.
struct CpusetMount {
    mount_point: String,
    /// File names for (cpus, mems), most specific first.
    cpus: &'static [&'static str],
    mems: &'static [&'static str],
    v2: bool,
}

fn cpuset_mounts(mounts: &str) -> Vec<CpusetMount> {
    let mut out = Vec::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let (point, fstype, opts) = (f[1], f[2], f[3]);
        match fstype {
            "cgroup2" => out.push(CpusetMount {
                mount_point: point.to_string(),
                cpus: &["cpuset.cpus.effective", "cpuset.cpus"],
                mems: &["cpuset.mems.effective", "cpuset.mems"],
                v2: true,
            }),
            // v1: the configured `cpuset.cpus`, as hwloc reads it (`effective_cpus` differs only
            // under `cpuset_v2_mode` after hot-unplug).
            "cgroup" if opts.split(',').any(|o| o == "cpuset") => out.push(CpusetMount {
                mount_point: point.to_string(),
                cpus: &["cpuset.cpus"],
                mems: &["cpuset.mems"],
                v2: false,
            }),
            "cpuset" => out.push(CpusetMount {
                mount_point: point.to_string(),
                cpus: &["cpus"],
                mems: &["mems"],
                v2: false,
            }),
            _ => {}
        }
    }
    out
}

/// The cpus/mems of the process's cpuset cgroup, if one can be found.
fn cgroup_cpuset(fs: &Fs) -> Result<(Option<CpuSet>, Option<CpuSet>), TopologyError> {
    let Some(mounts) = fs.optional_up_to("proc/mounts", MAX_MOUNTS_BYTES)? else {
        return Ok((None, None));
    };
    let cgroup_file = fs.optional("proc/self/cgroup")?.unwrap_or_default();
    let v1_path = cgroup_file.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "cpuset").then(|| path.to_string())
    });
    let v2_path = cgroup_file.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string));
    let cpuset_path = fs.optional("proc/self/cpuset")?.map(|p| p.trim().to_string());
    for mount in cpuset_mounts(&mounts) {
        let path = if mount.v2 {
            v2_path.clone().or_else(|| cpuset_path.clone())
        } else {
            v1_path.clone().or_else(|| cpuset_path.clone())
        };
        let Some(path) = path else { continue };
        if path.split('/').any(|c| c == "..") {
            continue;
        }
        // Walk up from the process's cgroup until a level says something.
        let mut rel = path.trim_end_matches('/').to_string();
        loop {
            let dir = format!(
                "{}/{}",
                mount.mount_point.trim_end_matches('/'),
                rel.trim_start_matches('/')
            );
            let cpus = first_set(fs, &dir, mount.cpus)?;
            let mems = first_set(fs, &dir, mount.mems)?;
            if cpus.as_ref().is_some_and(|c| !c.is_empty()) {
                return Ok((cpus, mems.filter(|m| !m.is_empty())));
            }
            match rel.rfind('/') {
                Some(i) if !rel.is_empty() => rel.truncate(i),
                _ => break,
            }
        }
    }
    Ok((None, None))
}

fn first_set(fs: &Fs, dir: &str, names: &[&str]) -> Result<Option<CpuSet>, TopologyError> {
    for name in names {
        let rel = format!("{dir}/{name}");
        if let Some(text) = fs.optional(&rel)? {
            if !text.trim().is_empty() {
                return fs.list(&rel, &text).map(Some);
            }
        }
    }
    Ok(None)
}

/// NVIDIA's driver's character device major (`/dev/nvidia0` is 195:0), whose devices have no
/// `sys/dev/char` entry.
const NVIDIA_MAJOR: u32 = 195;

/// The PCI function behind the character device `major:minor` (a GPU's `/dev/dri/card1` or
/// `renderD128`, an accelerator's or NIC's device file), under `root` (`/` for this host):
/// the last PCI address on the path `sys/dev/char/MAJOR:MINOR` links to, as the kernel links
/// every device it registers; for NVIDIA's `/dev/nvidiaN` (major 195), which the kernel does
/// not list, the GPU whose `proc/driver/nvidia/gpus/ADDRESS/information` says `Device Minor:
/// N`. `None` when neither says.
pub fn pci_function_of_char_device(root: &Path, major: u32, minor: u32) -> Option<String> {
    let link = root.join(format!("sys/dev/char/{major}:{minor}"));
    if let Ok(target) = std::fs::read_link(&link) {
        let last = target
            .components()
            .rev()
            .filter_map(|c| c.as_os_str().to_str())
            .find(|c| is_pci_address(c));
        if let Some(address) = last {
            return Some(address.to_string());
        }
    }
    if major != NVIDIA_MAJOR {
        return None;
    }
    let gpus = std::fs::read_dir(root.join("proc/driver/nvidia/gpus")).ok()?;
    let tree = confining_tree(root);
    gpus.filter_map(Result::ok).find_map(|entry| {
        let address = entry.file_name().to_str()?.to_string();
        let information = entry.path().join("information");
        let info = read_attribute(tree.as_deref(), &information, MAX_ATTRIBUTE_BYTES).ok()?;
        let info = String::from_utf8_lossy(&info);
        let says = info.lines().find_map(|l| l.strip_prefix("Device Minor:"))?;
        (says.trim().parse::<u32>().ok()? == minor && is_pci_address(&address)).then_some(address)
    })
}

/// The most of an attribute file that is read: the kernel's sysfs text attributes fill at most
/// a page (`sysfs_emit`), and a NUMA node's `distance` row or NVIDIA's `information` stays
/// within a few KiB even on thousands of CPUs or nodes; this still stops a copied tree's huge
/// file.
const MAX_ATTRIBUTE_BYTES: u64 = 16 << 20;

/// The most of `/proc/mounts` that is read: about 150 bytes a mount (more with long overlay
/// options), and a host leaking mounts can have hundreds of thousands; topod must still start.
const MAX_MOUNTS_BYTES: u64 = 1 << 30;

/// The directory a copied tree's files must stay in: `root` resolved, or `None` for this host's
/// own `/` (however it is spelled) or a root that does not exist (then nothing under it does).
fn confining_tree(root: &Path) -> Option<PathBuf> {
    root.canonicalize().ok().filter(|tree| tree != Path::new("/"))
}

/// A sysfs or procfs attribute's bytes, of `path` (inside `tree`, when one is given: see
/// [`confining_tree`]). Only a regular file is read:
/// sysfs holds nothing else, and a FIFO in a copied tree would block the read (and discovery)
/// until something wrote to it, while opening a device node can act on the device. So the path
/// is first opened with `O_PATH` (which opens nothing for I/O and has no side effect on any
/// kind of file), the type is checked on that very file (not on the path again, which a writer
/// of the tree could swap in between), and then that file is opened for reading through
/// `/proc/self/fd`, non-blocking: a regular file that waits for data (`/proc/kmsg`, a tracing
/// pipe) is an error, not a hang. In a copied tree, a file outside the tree (behind a
/// symlink to the live `/proc/kmsg`, say) is refused before it is opened for reading: where the
/// `O_PATH` handle is, not where the path leads, is what is checked. Anything but
/// a file or directory, a file with nothing to read now, or a file over `limit` bytes, is
/// `InvalidInput`.
fn read_attribute(tree: Option<&Path>, path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    let only_files = |file: &std::fs::File| -> std::io::Result<()> {
        let kind = file.metadata()?.file_type();
        if kind.is_file() || kind.is_dir() {
            Ok(())
        } else {
            Err(invalid(
                "is a FIFO, socket or device, not an attribute file (sysfs holds only files)"
                    .into(),
            ))
        }
    };
    let handle = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(path)?;
    if let Some(tree) = tree {
        // Where the file opened is: its own path, from /proc/self/fd (what was opened, not
        // where the path leads now, which a writer of the tree could change in between);
        // without procfs, the path resolved again.
        let real = match std::fs::read_link(format!("/proc/self/fd/{}", handle.as_raw_fd())) {
            Ok(real) => real,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.canonicalize()?,
            Err(e) => return Err(e),
        };
        if !real.starts_with(tree) {
            return Err(invalid(format!(
                "leads outside the tree {} (to {}): a copied tree's files are its own",
                tree.display(),
                real.display()
            )));
        }
    }
    only_files(&handle)?;
    let open =
        |p: &Path| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(p);
    // The same file, now for reading: /proc/self/fd/N opens what N is, wherever the path now
    // leads. Without procfs (a bare chroot) the path is opened again (non-blocking: a FIFO
    // swapped in opens at once) and what it opened is checked again.
    let file = match open(Path::new(&format!("/proc/self/fd/{}", handle.as_raw_fd()))) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let file = open(path)?;
            only_files(&file)?;
            file
        }
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    // A sysfs file's size says 4096 whatever it holds, so the length is what is read.
    match file.take(limit + 1).read_to_end(&mut bytes) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            return Err(invalid(
                "would wait for data to read (as /proc/kmsg does), which no attribute file does"
                    .into(),
            ))
        }
        Err(e) => return Err(e),
    }
    if bytes.len() as u64 > limit {
        return Err(invalid(format!(
            "holds more than {limit} bytes, more than this file can on a real host"
        )));
    }
    Ok(bytes)
}

/// Every character device of this host (under `root`) that is on a PCI function, as
/// `(major, minor, PCI address)`, sorted: each `sys/dev/char/MAJOR:MINOR` whose link passes
/// through a PCI function (a GPU's `card1` and `renderD128`, an accelerator's device files), and
/// NVIDIA's `/dev/nvidiaN` (195:N) from `proc/driver/nvidia/gpus/ADDRESS/information`. The
/// reverse of [`pci_function_of_char_device`]; what a job may not open when it may use only
/// its own GPUs.
pub fn char_devices_on_pci(root: &Path) -> Vec<(u32, u32, String)> {
    let number = |text: &str| -> Option<(u32, u32)> {
        let (major, minor) = text.split_once(':')?;
        Some((major.parse().ok()?, minor.parse().ok()?)).filter(|&(a, i)| is_device_number(a, i))
    };
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("sys/dev/char")) {
        for entry in entries.filter_map(Result::ok) {
            let Some((major, minor)) = entry.file_name().to_str().and_then(number) else {
                continue;
            };
            if let Some(address) = pci_function_of_char_device(root, major, minor) {
                out.push((major, minor, address));
            }
        }
    }
    if let Ok(gpus) = std::fs::read_dir(root.join("proc/driver/nvidia/gpus")) {
        let tree = confining_tree(root);
        for entry in gpus.filter_map(Result::ok) {
            let Some(address) = entry.file_name().to_str().map(str::to_string) else { continue };
            let Ok(info) = read_attribute(
                tree.as_deref(),
                &entry.path().join("information"),
                MAX_ATTRIBUTE_BYTES,
            ) else {
                continue;
            };
            let info = String::from_utf8_lossy(&info);
            let minor = info
                .lines()
                .find_map(|l| l.strip_prefix("Device Minor:"))
                .and_then(|m| m.trim().parse::<u32>().ok());
            let minor = minor.filter(|&m| is_device_number(NVIDIA_MAJOR, m));
            if let (Some(minor), true) = (minor, is_pci_address(&address)) {
                out.push((NVIDIA_MAJOR, minor, address));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The PCI function `address` under `root` as it is now (its class and vendor; no locality):
/// what a function that appeared after the topology was read is (a hot-plugged GPU, SR-IOV
/// functions made later), so that device rules can deny it too. `None` where it is not there or
/// its class cannot be read.
pub fn pci_function_now(root: &Path, address: &str) -> Option<IoDevice> {
    if !is_pci_address(address) {
        return None;
    }
    let tree = confining_tree(root);
    let dev = root.join("sys/bus/pci/devices").join(address);
    let hex = |name: &str| -> Option<u32> {
        let text = read_attribute(tree.as_deref(), &dev.join(name), 64).ok()?;
        let text = String::from_utf8_lossy(&text);
        u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
    };
    let class_code = hex("class")?;
    Some(IoDevice {
        pci_address: address.to_string(),
        class: super::classify_pci(class_code),
        class_code,
        vendor_id: hex("vendor").and_then(|v| u16::try_from(v).ok()),
        device_id: hex("device").and_then(|v| u16::try_from(v).ok()),
        names: Vec::new(),
        numa_node: None,
        local_cpus: CpuSet::new(),
        upstream: Vec::new(),
        virtual_function: false,
        fabric: None,
    })
}

/// Whether `major:minor` can be a Linux device number: 12 bits of major, 20 of minor
/// (include/linux/kdev_t.h, MINORBITS). A larger one written into a device rule would not name
/// one device (the kernel reads `~0` as `*`).
pub fn is_device_number(major: u32, minor: u32) -> bool {
    major < (1 << 12) && minor < (1 << 20)
}

/// Whether `s` reads as a PCI address, `dddd:bb:dd.f` in hexadecimal.
pub(crate) fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && hex(11..12)
}

fn read_pci(fs: &Fs) -> Result<Vec<IoDevice>, TopologyError> {
    let dir = "sys/bus/pci/devices";
    let mut addresses = fs.entries(dir);
    addresses.sort();
    let mut out = Vec::new();
    for addr in addresses {
        let dev = format!("{dir}/{addr}");
        let Some(class_text) = fs.optional(&format!("{dev}/class"))? else { continue };
        let hex = |t: &str| u32::from_str_radix(t.trim().trim_start_matches("0x"), 16).ok();
        // One device's odd file is no reason to run without the host: such a device is left
        // out (a class) or its locality taken as unknown (its local CPUs).
        let Some(class_code) = hex(&class_text) else { continue };
        let class = super::classify_pci(class_code);
        if class == super::DeviceClass::Other {
            continue;
        }
        let id16 = |name: &str| -> Result<Option<u16>, TopologyError> {
            Ok(fs
                .optional(&format!("{dev}/{name}"))?
                .and_then(|t| hex(&t))
                .and_then(|v| u16::try_from(v).ok()))
        };
        let numa_node = fs
            .optional(&format!("{dev}/numa_node"))?
            .and_then(|t| t.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        let local_cpus = match fs.optional(&format!("{dev}/local_cpulist"))? {
            Some(t) => fs.list(&format!("{dev}/local_cpulist"), &t).unwrap_or_default(),
            None => match fs.optional(&format!("{dev}/local_cpus"))? {
                Some(t) => fs.mask(&format!("{dev}/local_cpus"), &t).unwrap_or_default(),
                None => CpuSet::new(),
            },
        };
        let mut names = Vec::new();
        for sub in ["net", "infiniband", "drm"] {
            let mut n = fs.entries(&format!("{dev}/{sub}"));
            n.sort();
            names.extend(n);
        }
        // amdgpu puts the hive of a GPU joined to others by xGMI links in
        // `xgmi_hive_info/xgmi_hive_id` (the kernel's amdgpu_xgmi.c); 0 or absent: none. A
        // hint only: one that cannot be read (a directory, a loop) is none, not an error.
        let fabric = fs
            .optional(&format!("{dev}/xgmi_hive_info/xgmi_hive_id"))
            .ok()
            .flatten()
            .map(|t| t.trim().to_string())
            .filter(|id| {
                !id.is_empty()
                    && id.len() <= 32
                    && id.chars().all(|c| c.is_ascii_alphanumeric())
                    && !id.chars().all(|c| c == '0')
            })
            .map(|id| format!("xgmi:{id}"));
        out.push(IoDevice {
            fabric,
            upstream: fs.pci_upstream(&dev, &addr),
            pci_address: addr.clone(),
            class,
            class_code,
            vendor_id: id16("vendor")?,
            device_id: id16("device")?,
            names,
            numa_node,
            local_cpus,
            virtual_function: fs.exists(&format!("{dev}/physfn")),
        });
    }
    super::keep_shared_gpu_fabrics(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// Two cores of two threads, one NUMA node, a cgroup v2 cpuset allowing three CPUs.
    fn tiny(root: &Path) {
        write(root, "sys/devices/system/cpu/online", "0-3\n");
        for cpu in 0..4 {
            let core = if cpu % 2 == 0 { "0,2" } else { "1,3" };
            let d = format!("sys/devices/system/cpu/cpu{cpu}");
            write(root, &format!("{d}/topology/thread_siblings_list"), core);
            write(root, &format!("{d}/topology/core_siblings_list"), "0-3");
            write(root, &format!("{d}/topology/physical_package_id"), "0");
            write(root, &format!("{d}/cache/index3/level"), "3");
            write(root, &format!("{d}/cache/index3/type"), "Unified");
            write(root, &format!("{d}/cache/index3/shared_cpu_map"), "0000000f");
        }
        write(root, "sys/devices/system/node/node0/cpulist", "0-3");
        write(root, "sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:  1024 kB\n");
        write(root, "sys/devices/system/node/node0/distance", "10\n");
        write(root, "proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
        write(root, "proc/self/cgroup", "0::/job/1\n");
        write(root, "sys/fs/cgroup/job/1/cpuset.cpus.effective", "0-2\n");
        write(root, "sys/fs/cgroup/job/1/cpuset.mems.effective", "0\n");
    }

    #[test]
    fn reads_a_tiny_machine() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        let t = read(dir.path()).unwrap();
        assert_eq!(t.cores.len(), 2);
        assert_eq!(t.cores[0].cpus.to_string(), "0,2");
        assert_eq!(t.allowed.to_string(), "0-2");
        assert_eq!(t.numa_nodes[0].memory_bytes, 1024 * 1024);
        let c = t.counts();
        assert_eq!((c.packages, c.numa_nodes, c.l3_groups, c.cores, c.pus), (1, 1, 1, 2, 3));
    }

    /// A PCI function at `path` under `sys/devices` (its last component the address), linked
    /// from `sys/bus/pci/devices` as the kernel does, of class `class`.
    fn pci_function(root: &Path, path: &str, class: &str) {
        let addr = path.rsplit('/').next().unwrap();
        write(root, &format!("sys/devices/{path}/class"), class);
        write(root, &format!("sys/devices/{path}/numa_node"), "-1");
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        std::os::unix::fs::symlink(
            format!("../../../devices/{path}"),
            root.join(format!("sys/bus/pci/devices/{addr}")),
        )
        .unwrap();
    }

    #[test]
    fn pci_devices_know_the_bridges_above_them_and_an_unknown_node() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        // A root port, a switch (upstream port 01:00.0, two downstream ports), two GPUs
        // behind it; a NIC straight on another root port.
        let switch = "pci0000:00/0000:00:01.0/0000:01:00.0";
        pci_function(dir.path(), "pci0000:00/0000:00:01.0", "0x060400");
        pci_function(dir.path(), switch, "0x060400");
        pci_function(dir.path(), &format!("{switch}/0000:02:08.0"), "0x060400");
        pci_function(dir.path(), &format!("{switch}/0000:02:10.0"), "0x060400");
        pci_function(dir.path(), &format!("{switch}/0000:02:08.0/0000:03:00.0"), "0x030200");
        pci_function(dir.path(), &format!("{switch}/0000:02:10.0/0000:04:00.0"), "0x030200");
        pci_function(dir.path(), "pci0000:00/0000:00:02.0/0000:05:00.0", "0x020000");
        // A snapshot that copied a device's directory instead of its link.
        write(dir.path(), "sys/bus/pci/devices/0000:06:00.0/class", "0x030000");
        // One device's odd files do not stop the host from being read (an attack finding: topod
        // would not start): an unreadable class leaves it out, unreadable local CPUs unknown.
        write(dir.path(), "sys/bus/pci/devices/0000:06:00.0/local_cpulist", "zz");
        write(dir.path(), "sys/bus/pci/devices/0000:07:00.0/class", "0xzz");
        // amdgpu's xGMI hive: the GPU behind the switch and one on its own root port share
        // hive 42; a hive id of 0 is none, and a garbled one is left out.
        pci_function(dir.path(), "pci0000:00/0000:00:03.0/0000:08:00.0", "0x038000");
        let hive = |path: &str, id: &str| {
            write(dir.path(), &format!("sys/devices/{path}/xgmi_hive_info/xgmi_hive_id"), id)
        };
        hive(&format!("{switch}/0000:02:08.0/0000:03:00.0"), "42\n");
        hive("pci0000:00/0000:00:03.0/0000:08:00.0", "42");
        hive(&format!("{switch}/0000:02:10.0/0000:04:00.0"), "00");
        hive("pci0000:00/0000:00:02.0/0000:05:00.0", "../../x");
        // Found by attacking the first version: an unreadable hive id (here a directory) is
        // no hive, not a host that cannot be read; a hive of one GPU joins nothing.
        pci_function(dir.path(), "pci0000:00/0000:00:04.0/0000:09:00.0", "0x030200");
        pci_function(dir.path(), "pci0000:00/0000:00:05.0/0000:0a:00.0", "0x030200");
        std::fs::create_dir_all(dir.path().join(
            "sys/devices/pci0000:00/0000:00:04.0/0000:09:00.0/xgmi_hive_info/xgmi_hive_id/x",
        ))
        .unwrap();
        hive("pci0000:00/0000:00:05.0/0000:0a:00.0", "77");
        let t = read(dir.path()).unwrap();
        let dev = |a: &str| t.devices.iter().find(|d| d.pci_address == a).unwrap();
        let (gpu0, gpu1, nic) = (dev("0000:03:00.0"), dev("0000:04:00.0"), dev("0000:05:00.0"));
        assert_eq!(gpu0.fabric.as_deref(), Some("xgmi:42"));
        assert_eq!(dev("0000:08:00.0").fabric, gpu0.fabric);
        assert_eq!(gpu0.fabric_name().as_deref(), Some("xGMI hive 42"));
        assert_eq!((gpu1.fabric.as_deref(), nic.fabric.as_deref()), (None, None));
        assert_eq!(
            (dev("0000:09:00.0").fabric.as_deref(), dev("0000:0a:00.0").fabric.as_deref()),
            (None, None)
        );
        assert_eq!(gpu0.upstream, ["0000:00:01.0", "0000:01:00.0", "0000:02:08.0"]);
        assert_eq!((gpu0.switch(), gpu1.switch()), (Some("0000:01:00.0"), Some("0000:01:00.0")));
        assert_eq!(gpu0.shared_bridges(gpu1), 2);
        assert_eq!(nic.upstream, ["0000:00:02.0"]);
        assert_eq!((nic.switch(), nic.shared_bridges(gpu0)), (None, 0));
        assert!(dev("0000:06:00.0").upstream.is_empty());
        assert!(dev("0000:06:00.0").local_cpus.is_empty());
        assert!(t.devices.iter().all(|d| d.pci_address != "0000:07:00.0"));
        // numa_node -1 (a cloud VM, a one-node machine) is not known, not node 0.
        assert!(t.devices.iter().all(|d| d.numa_node.is_none()), "{:?}", t.devices);
        for (text, is) in [
            ("0000:03:00.0", true),
            ("abcd:ef:1f.7", true),
            ("pci0000:00", false),
            ("0000:03:00", false),
            ("0000:03:0g.0", false),
            ("0000-03:00.0", false),
        ] {
            assert_eq!(is_pci_address(text), is, "{text}");
        }
    }

    #[test]
    fn a_character_device_leads_to_its_pci_function_by_sysfs_or_nvidias_proc_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let gpu = "pci0000:80/0000:80:01.0/0000:86:00.0";
        std::fs::create_dir_all(root.join(format!("sys/devices/{gpu}/drm/card1"))).unwrap();
        std::fs::create_dir_all(root.join("sys/dev/char")).unwrap();
        std::os::unix::fs::symlink(
            format!("../../devices/{gpu}/drm/card1"),
            root.join("sys/dev/char/226:1"),
        )
        .unwrap();
        std::os::unix::fs::symlink("../../devices/virtual/tty/tty0", root.join("sys/dev/char/4:0"))
            .unwrap();
        write(
            root,
            "proc/driver/nvidia/gpus/0000:3b:00.0/information",
            "Model: X\nDevice Minor: 2\n",
        );
        write(root, "proc/driver/nvidia/gpus/0000:5e:00.0/information", "Device Minor: 0\n");
        let of = |major, minor| pci_function_of_char_device(root, major, minor);
        assert_eq!(of(226, 1).as_deref(), Some("0000:86:00.0"));
        assert_eq!(of(195, 2).as_deref(), Some("0000:3b:00.0"));
        assert_eq!(of(195, 0).as_deref(), Some("0000:5e:00.0"));
        assert_eq!(of(195, 1), None, "no GPU with that minor");
        assert_eq!(of(4, 0), None, "a device on no PCI function");
        assert_eq!(of(226, 9), None, "no such device");
    }

    #[test]
    fn malformed_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        write(dir.path(), "sys/devices/system/node/node0/cpulist", "0-x");
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("node0/cpulist") && e.contains("\"x\""), "{e}");
        tiny(dir.path());
        write(dir.path(), "sys/devices/system/cpu/online", "");
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no online CPU"), "{e}");
        tiny(dir.path());
        write(dir.path(), "sys/devices/system/node/node0/distance", "10 20\n");
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("2 distances for 1 NUMA nodes"), "{e}");
        tiny(dir.path());
        write(dir.path(), "sys/devices/system/node/possible", "0-1");
        write(dir.path(), "sys/devices/system/node/node0/distance", "10 21\n");
        let t = read(dir.path()).unwrap();
        assert_eq!(t.numa_distance(0, 1), 21, "a row over the possible nodes");
    }

    /// A tiny tree whose `cpu/online` file is gone, for a test to put something else there.
    fn tiny_without_online() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        let online = dir.path().join("sys/devices/system/cpu/online");
        std::fs::remove_file(&online).unwrap();
        (dir, online)
    }

    #[test]
    fn a_fifo_in_a_copied_tree_is_named_and_never_read() {
        // Opening a FIFO blocks until something writes to it: read() would hang here.
        let (dir, online) = tiny_without_online();
        let made = std::process::Command::new("mkfifo").arg(&online).status().unwrap();
        assert!(made.success());
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("cpu/online") && e.contains("FIFO"), "{e}");
        // NVIDIA's proc file is read for device numbers the same way.
        let info = dir.path().join("proc/driver/nvidia/gpus/0000:3b:00.0/information");
        std::fs::create_dir_all(info.parent().unwrap()).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(&info).status().unwrap().success());
        assert_eq!(char_devices_on_pci(dir.path()), Vec::new());
        assert_eq!(pci_function_of_char_device(dir.path(), NVIDIA_MAJOR, 0), None);
    }

    #[test]
    fn a_link_out_of_a_copied_tree_is_named_and_never_opened() {
        // A link to the live /proc/kmsg would block, and as root take the kernel's messages
        // away from syslog: refused before it is opened for reading.
        let (dir, online) = tiny_without_online();
        std::os::unix::fs::symlink("/proc/kmsg", &online).unwrap();
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("cpu/online") && e.contains("leads outside the tree"), "{e}");
        assert!(e.contains("/proc/kmsg"), "{e}");
        // A link that stays inside the tree is followed, as sysfs's own links are.
        std::fs::remove_file(&online).unwrap();
        std::fs::write(dir.path().join("sys/devices/system/cpu/online.real"), "0-3\n").unwrap();
        std::os::unix::fs::symlink("online.real", &online).unwrap();
        read(dir.path()).unwrap();
    }

    #[test]
    fn an_attribute_file_over_16_mib_is_named_not_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        // A valid list, padded past the limit: read whole, it would parse.
        let mut online = "0".to_string();
        online.push_str(&" ".repeat(MAX_ATTRIBUTE_BYTES as usize));
        write(dir.path(), "sys/devices/system/cpu/online", &online);
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("cpu/online") && e.contains("more than 16777216 bytes"), "{e}");
        write(dir.path(), "sys/devices/system/cpu/online", &online[..MAX_ATTRIBUTE_BYTES as usize]);
        read(dir.path()).unwrap();
    }

    #[test]
    fn a_host_leaking_mounts_still_reads_its_cpuset() {
        // Past the attribute limit: 17 MiB of leaked mounts before the cgroup2 line.
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        let leaked = "tmpfs /run/leak tmpfs rw,nosuid,nodev,relatime 0 0\n";
        let mut mounts = leaked.repeat((MAX_ATTRIBUTE_BYTES as usize + (1 << 20)) / leaked.len());
        mounts.push_str("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
        write(dir.path(), "proc/mounts", &mounts);
        assert_eq!(read(dir.path()).unwrap().allowed.to_string(), "0-2");
    }

    #[test]
    fn an_empty_root_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no online CPU"), "{e}");
    }
}
