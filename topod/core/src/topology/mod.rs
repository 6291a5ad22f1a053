//! The hardware graph of one host, and its readers.
//!
//! The graph is plain data: every level (package, die, NUMA node, L3 group, L2/cluster group,
//! core, PU) is a list of domains, each with the set of OS CPU ids it covers. Levels are *not*
//! assumed to nest: sub-NUMA clustering puts two NUMA nodes under one L3, some platforms report
//! every core as a package, and a NUMA node may have no CPU at all (HBM, GPU memory). Code that
//! needs "the NUMA node of this L3 group" asks by set intersection, never by tree position.
//!
//! The graph describes the whole machine that the reader saw. Which CPUs a job may get is a
//! separate question, answered by [`Topology::allowed_cpus`] (online, inside the reading
//! process's cpuset) minus what configuration reserves; [`Topology::counts`] counts only what
//! is allowed, as hwloc and a scheduler do.
//!
//! Readers: [`sysfs`] (a Linux `/sys` + `/proc` tree under any root directory) and [`hwloc_xml`]
//! (hwloc's XML v2 export, so any machine can be emulated from a file).

pub mod hwloc_xml;
pub mod sysfs;

use crate::cpuset::CpuSet;
use crate::request::Level;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One domain of one level: the CPUs it covers and the OS (or hwloc logical) index when known.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Domain {
    /// OS index (`physical_package_id`, cache id, ...) when the source gives one.
    pub os_index: Option<u32>,
    /// Every CPU of the domain, allowed or not.
    pub cpus: CpuSet,
}

/// What kind of memory a NUMA node holds.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// Ordinary DRAM (the default when nothing says otherwise).
    Dram,
    /// High-bandwidth memory (MCDRAM, HBM), usually a CPU-less node.
    Hbm,
    /// A GPU's memory exposed as a NUMA node (POWER9 + V100, Grace Hopper).
    GpuMemory,
    /// Persistent or far memory (Optane, CXL expanders).
    FarMemory,
}

/// A NUMA node: a memory and the CPUs local to it (possibly none).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    /// The kernel's node id (`nodeN`).
    pub os_index: u32,
    /// CPUs whose local memory this is (the kernel's `cpulist`); empty for CPU-less nodes.
    pub cpus: CpuSet,
    /// CPUs nearest to this memory: `cpus` for ordinary nodes; for CPU-less nodes (HBM, GPU
    /// memory) the CPUs of the package or cluster they hang off (hwloc's cpuset of the node),
    /// else of the nearest CPU nodes by distance. Empty when unknown.
    pub near_cpus: CpuSet,
    /// Memory size in bytes (0 when unknown).
    pub memory_bytes: u64,
    /// What memory it is.
    pub kind: MemoryKind,
}

/// A class of CPU on hybrid processors (P-cores and E-cores), in the order the source gives
/// (hwloc: ascending efficiency).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuKind {
    /// The CPUs of this kind.
    pub cpus: CpuSet,
    /// A label: `IntelAtom`/`IntelCore`, the ARM part number, or `capacity=N`.
    pub name: String,
    /// Relative efficiency rank as the source gives it (higher = faster), if any.
    pub efficiency: Option<i32>,
}

/// The class of an I/O device, as far as placement cares.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceClass {
    /// Display / 3D controller (PCI class 0x03).
    Gpu,
    /// Network or InfiniBand controller (PCI class 0x02, 0x0c06).
    Network,
    /// Processing accelerator (PCI class 0x12, 0x0b40), vector engines, FPGAs.
    Accelerator,
    /// Storage controller (PCI class 0x01).
    Storage,
    /// Anything else.
    Other,
}

/// A PCI device with its locality.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoDevice {
    /// `domain:bus:device.function`, e.g. `0000:3b:00.0`.
    pub pci_address: String,
    /// What it is.
    pub class: DeviceClass,
    /// The PCI class code (24 bits, `0x030200`).
    pub class_code: u32,
    /// PCI vendor id, when known.
    pub vendor_id: Option<u16>,
    /// PCI device id, when known.
    pub device_id: Option<u16>,
    /// Names the OS gives it (`eth0`, `mlx5_0`, `cuda0`, ...).
    pub names: Vec<String>,
    /// The NUMA node it hangs off, when known.
    pub numa_node: Option<u32>,
    /// CPUs local to it (empty when unknown).
    pub local_cpus: CpuSet,
    /// The PCI bridges above it, from the root port down (`domain:bus:device.function` each;
    /// empty when not known, as for a sysfs snapshot that kept no links): devices whose lists
    /// share a bridge below the root port sit behind one PCIe switch
    /// ([`IoDevice::switch`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upstream: Vec<String>,
    /// An SR-IOV virtual function (sysfs `physfn`): a slice of its physical function, made for
    /// virtual machines and containers, not an adapter of its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub virtual_function: bool,
    /// The GPU fabric it is part of, when its driver or hwloc says: `nvlink:ADDRESS` for an
    /// NVLink island (GPUs joined by NVLink, directly or through NVSwitches; named by the
    /// lowest PCI address in it), `xgmi:HIVE` for an AMD xGMI hive (sysfs
    /// `xgmi_hive_info/xgmi_hive_id`). GPUs of one fabric exchange data over its links, not
    /// through PCIe ([`IoDevice::fabric_name`] says it for a person).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<String>,
}

impl IoDevice {
    /// The PCIe switch it sits behind, by the address of the switch's upstream port (the
    /// bridge right below the root port), or `None` when it hangs off a root port directly
    /// or its bridges are not known. Devices with the same switch exchange data through it
    /// without crossing the root complex (peer-to-peer DMA, GPUDirect).
    pub fn switch(&self) -> Option<&str> {
        self.upstream.get(1).map(String::as_str)
    }

    /// How many of the bridges above `self` are also above `other` (from the root port
    /// down): 0 for devices on different root ports, 2 or more for devices behind one
    /// switch.
    pub fn shared_bridges(&self, other: &IoDevice) -> usize {
        self.upstream.iter().zip(&other.upstream).take_while(|(a, b)| a == b).count()
    }

    /// Its [`IoDevice::fabric`] for a person: `NVLink island 0002:01:00.0`, `xGMI hive 42`.
    pub fn fabric_name(&self) -> Option<String> {
        fabric_name(self.fabric.as_deref()?)
    }
}

/// Clears the fabric of every device that is not a GPU or accelerator, and of a GPU whose
/// fabric no other GPU shares: a fabric joins GPUs to each other, and one GPU alone is joined
/// to nothing (both readers apply it).
pub(crate) fn keep_shared_gpu_fabrics(devices: &mut [IoDevice]) {
    let is_gpu = |d: &IoDevice| matches!(d.class, DeviceClass::Gpu | DeviceClass::Accelerator);
    for d in devices.iter_mut().filter(|d| !is_gpu(d)) {
        d.fabric = None;
    }
    let shared: std::collections::HashMap<String, usize> =
        devices.iter().filter_map(|d| d.fabric.clone()).fold(Default::default(), |mut m, f| {
            *m.entry(f).or_default() += 1;
            m
        });
    for d in devices.iter_mut() {
        if d.fabric.as_ref().is_some_and(|f| shared[f] < 2) {
            d.fabric = None;
        }
    }
}

/// A fabric id ([`IoDevice::fabric`]) for a person.
pub fn fabric_name(fabric: &str) -> Option<String> {
    match fabric.split_once(':') {
        Some(("nvlink", first)) => Some(format!("NVLink island {first}")),
        Some(("xgmi", hive)) => Some(format!("xGMI hive {hive}")),
        _ => None,
    }
}

/// The NUMA distance matrix (SLIT), square, in the order of `nodes`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Distances {
    /// NUMA node OS indexes, in row order.
    pub nodes: Vec<u32>,
    /// Row-major `nodes.len()²` values; 10 means local by the ACPI convention.
    pub values: Vec<u32>,
}

impl Distances {
    /// Distance from node `a` to node `b` (OS indexes), if both are in the matrix.
    pub fn between(&self, a: u32, b: u32) -> Option<u32> {
        let i = self.nodes.iter().position(|&n| n == a)?;
        let j = self.nodes.iter().position(|&n| n == b)?;
        self.values.get(i * self.nodes.len() + j).copied()
    }
}

/// The hardware graph of one host.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Where the graph came from (a path, or `/` for the running host).
    pub source: String,
    /// Every PU (hardware thread) the reader saw online, by OS id.
    pub pus: CpuSet,
    /// CPUs that are online and inside the reading process's cpuset (cgroup or affinity).
    pub allowed: CpuSet,
    /// NUMA node ids that the reading process's cpuset allows (`cpuset.mems`).
    pub allowed_mems: CpuSet,
    /// Physical cores.
    pub cores: Vec<Domain>,
    /// L2 cache / cluster groups (cores sharing an L2, e.g. Atom clusters, Bulldozer modules).
    pub l2_groups: Vec<Domain>,
    /// L3 cache groups (CCX/CCD on AMD, the LLC on Intel).
    pub l3_groups: Vec<Domain>,
    /// NUMA nodes, CPU-less ones included.
    pub numa_nodes: Vec<NumaNode>,
    /// Dies (several per package on multi-chip modules), when the source reports them.
    pub dies: Vec<Domain>,
    /// Packages (sockets). On some platforms each core reports as its own package.
    pub packages: Vec<Domain>,
    /// CPU kinds on hybrid processors; empty when all CPUs are alike.
    pub cpu_kinds: Vec<CpuKind>,
    /// NUMA distances, when the source has them.
    pub distances: Option<Distances>,
    /// PCI devices that matter for placement (GPUs, NICs, accelerators).
    pub devices: Vec<IoDevice>,
}

/// The five numbers that hwloc's `hwloc-calc -N` reports, over allowed resources only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Packages with at least one allowed PU.
    pub packages: usize,
    /// NUMA nodes that are allowed (`allowed_mems`) and near an allowed PU (as hwloc counts
    /// them: a node whose CPUs were all taken away is not counted).
    pub numa_nodes: usize,
    /// L3 groups with at least one allowed PU.
    pub l3_groups: usize,
    /// Cores with at least one allowed PU.
    pub cores: usize,
    /// Allowed PUs.
    pub pus: usize,
}

/// Why a topology could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file's content is not what the format says.
    #[error("{path}: {what}")]
    Format {
        /// The file (and for XML, the line).
        path: String,
        /// What is wrong, in words.
        what: String,
    },
    /// The source has no CPU at all, or nothing usable.
    #[error("{source_name}: {what}")]
    Empty {
        /// The source.
        source_name: String,
        /// What is missing.
        what: String,
    },
}

impl Topology {
    /// A fingerprint of this topology as topod serves it (FNV-1a over its JSON): the free map
    /// carries it, so that a scheduler's plug-in that cached the topology of a host notices a
    /// topod that came back on other hardware, or read it again differently, and fetches it
    /// again. Equal only for equal topologies of one build; compared, never decoded.
    pub fn fingerprint(&self) -> u64 {
        let json = serde_json::to_vec(self).unwrap_or_default();
        fnv1a(&json)
    }

    /// CPUs a job may be given before configuration reservations: online and allowed.
    pub fn allowed_cpus(&self) -> &CpuSet {
        &self.allowed
    }

    /// The counts of allowed resources, comparable with `hwloc-calc -N`.
    pub fn counts(&self) -> Counts {
        let touching =
            |doms: &[Domain]| doms.iter().filter(|d| d.cpus.intersects(&self.allowed)).count();
        Counts {
            packages: touching(&self.packages),
            numa_nodes: self
                .numa_nodes
                .iter()
                .filter(|n| {
                    self.allowed_mems.contains(n.os_index)
                        && (n.cpus.intersects(&self.allowed)
                            || n.near_cpus.intersects(&self.allowed))
                })
                .count(),
            l3_groups: touching(&self.l3_groups),
            cores: touching(&self.cores),
            pus: self.allowed.len(),
        }
    }

    /// NUMA nodes that hold at least one allowed CPU.
    pub fn numa_nodes_with_cpus(&self) -> impl Iterator<Item = &NumaNode> {
        self.numa_nodes.iter().filter(|n| n.cpus.intersects(&self.allowed))
    }

    /// The NUMA distance between two nodes (OS ids): the SLIT value, else 10 for the same node
    /// and 20 for two different ones (the ACPI defaults the kernel also assumes).
    pub fn numa_distance(&self, a: u32, b: u32) -> u32 {
        self.distances.as_ref().and_then(|d| d.between(a, b)).unwrap_or(if a == b {
            10
        } else {
            20
        })
    }

    /// The PCI device `name` names: its PCI address (`0000:3b:00.0`, any case; `3b:00.0` for
    /// domain 0, as `lspci` prints it) or a name the OS gives it (`card1`, `mlx5_0`).
    pub fn device(&self, name: &str) -> Option<&IoDevice> {
        let name = name.trim();
        let full =
            if name.matches(':').count() == 1 { format!("0000:{name}") } else { name.into() };
        self.devices.iter().find(|d| {
            d.pci_address.eq_ignore_ascii_case(&full) || d.names.iter().any(|n| n == name)
        })
    }

    /// The CPUs near `device` at `level`: those of the NUMA node it hangs off (`Level::Numa`;
    /// for a node without CPUs, those nearest it) or of the packages that node is in
    /// (`Level::Socket`). Where its NUMA node is not known
    /// (`numa_node` -1, as on many cloud VMs) its `local_cpulist` stands for it, widened to the
    /// NUMA nodes or packages it touches. `None` when neither is known. Other levels are
    /// treated as `Numa`.
    pub fn cpus_near(&self, device: &IoDevice, level: Level) -> Option<CpuSet> {
        // A CPU-less node (HBM, a GPU's own memory) stands for the CPUs nearest it.
        let node_cpus = device
            .numa_node
            .and_then(|n| self.numa_nodes.iter().find(|node| node.os_index == n))
            .map(
                |node| {
                    if node.cpus.is_empty() {
                        node.near_cpus.clone()
                    } else {
                        node.cpus.clone()
                    }
                },
            )
            .map(|cpus| cpus.intersection(&self.pus))
            .filter(|cpus| !cpus.is_empty());
        let local = node_cpus.or_else(|| {
            (!device.local_cpus.is_empty()).then(|| {
                let mut wide = CpuSet::new();
                for node in self.numa_nodes.iter().filter(|n| n.cpus.intersects(&device.local_cpus))
                {
                    wide.union_with(&node.cpus);
                }
                if wide.is_empty() {
                    device.local_cpus.clone()
                } else {
                    wide
                }
            })
        })?;
        if level != Level::Socket {
            return Some(local);
        }
        let mut wide = CpuSet::new();
        for package in self.packages.iter().filter(|p| p.cpus.intersects(&local)) {
            wide.union_with(&package.cpus);
        }
        Some(if wide.is_empty() { local } else { wide })
    }

    /// How far `device` is from `cpus`: the largest NUMA distance (SLIT, 10 = local) between
    /// the node it hangs off and the nodes those CPUs are in; `None` when its node is not known
    /// (or not one of this host's) or `cpus` is in none.
    pub fn device_distance(&self, device: &IoDevice, cpus: &CpuSet) -> Option<u32> {
        let from = device.numa_node.filter(|n| self.numa_nodes.iter().any(|m| m.os_index == *n))?;
        self.numa_nodes
            .iter()
            .filter(|n| n.cpus.intersects(cpus))
            .map(|n| self.numa_distance(from, n.os_index))
            .max()
    }

    /// A short name for display: the file stem of the source.
    pub fn short_name(&self) -> &str {
        if self.source == "/" {
            return "this host";
        }
        let s = self.source.trim_end_matches('/');
        let base = s.rsplit('/').next().unwrap_or(s);
        base.strip_suffix(".xml").or_else(|| base.strip_suffix(".tar.bz2")).unwrap_or(base)
    }
}

/// Shape of a regular machine, for tests and examples: `packages × numa_per_package ×
/// l3_per_numa × cores_per_l3 × threads_per_core`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticShape {
    /// Packages.
    pub packages: u32,
    /// NUMA nodes per package.
    pub numa_per_package: u32,
    /// L3 groups per NUMA node.
    pub l3_per_numa: u32,
    /// Cores per L3 group.
    pub cores_per_l3: u32,
    /// Hardware threads per core.
    pub threads_per_core: u32,
}

impl Topology {
    /// A plain host of `cores` processors: one package, one NUMA node, one L3 group, no SMT
    /// (what `topoctl simulate --topology flat:P` replays on). Named `flat:P`.
    pub fn flat(cores: u32) -> Topology {
        let mut topo = Topology::synthetic(SyntheticShape {
            packages: 1,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: cores,
            threads_per_core: 1,
        });
        topo.source = format!("flat:{cores}");
        topo
    }

    /// A regular machine numbered as Linux numbers x86 machines: first thread of every core
    /// first, SMT siblings `cores` apart. NUMA distance 10 local, 12 inside a package, 32 across.
    pub fn synthetic(shape: SyntheticShape) -> Topology {
        let SyntheticShape {
            packages,
            numa_per_package,
            l3_per_numa,
            cores_per_l3,
            threads_per_core,
        } = shape;
        let cores_total = packages * numa_per_package * l3_per_numa * cores_per_l3;
        let cpus_of_core = |core: u32| -> CpuSet {
            (0..threads_per_core).map(|t| core + t * cores_total).collect()
        };
        let span = |first_core: u32, n: u32| -> CpuSet {
            (first_core..first_core + n).fold(CpuSet::new(), |acc, c| acc.union(&cpus_of_core(c)))
        };
        let dom = |i: u32, cpus: CpuSet| Domain { os_index: Some(i), cpus };
        let per_l3 = cores_per_l3;
        let per_numa = per_l3 * l3_per_numa;
        let per_pkg = per_numa * numa_per_package;
        let numa_count = packages * numa_per_package;
        let mut values = Vec::new();
        for a in 0..numa_count {
            for b in 0..numa_count {
                values.push(if a == b {
                    10
                } else if a / numa_per_package == b / numa_per_package {
                    12
                } else {
                    32
                });
            }
        }
        let pus = CpuSet::first_n(cores_total * threads_per_core);
        Topology {
            source: format!("synthetic-{packages}p{numa_per_package}n{l3_per_numa}l{cores_per_l3}c{threads_per_core}t"),
            allowed: pus.clone(),
            allowed_mems: CpuSet::first_n(numa_count),
            pus,
            cores: (0..cores_total).map(|c| dom(c, cpus_of_core(c))).collect(),
            l2_groups: Vec::new(),
            l3_groups: (0..cores_total / per_l3).map(|i| dom(i, span(i * per_l3, per_l3))).collect(),
            numa_nodes: (0..numa_count)
                .map(|i| {
                    let cpus = span(i * per_numa, per_numa);
                    NumaNode { os_index: i, near_cpus: cpus.clone(), cpus, memory_bytes: 64 << 30, kind: MemoryKind::Dram }
                })
                .collect(),
            dies: Vec::new(),
            packages: (0..packages).map(|i| dom(i, span(i * per_pkg, per_pkg))).collect(),
            cpu_kinds: Vec::new(),
            distances: Some(Distances { nodes: (0..numa_count).collect(), values }),
            devices: Vec::new(),
        }
    }
}

/// What a PCI class code (24 bits: class, subclass, programming interface) means for placement.
pub fn classify_pci(class_code: u32) -> DeviceClass {
    let class = class_code >> 16;
    let subclass = (class_code >> 8) & 0xff;
    match (class, subclass) {
        (0x03, _) => DeviceClass::Gpu,
        (0x02, _) | (0x0c, 0x06) => DeviceClass::Network,
        (0x12, _) | (0x0b, 0x40) => DeviceClass::Accelerator,
        (0x01, _) => DeviceClass::Storage,
        _ => DeviceClass::Other,
    }
}

/// FNV-1a, 64 bits: a hash that is the same in every build and process (unlike std's
/// `DefaultHasher`, which makes no such promise).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod device_tests {
    use super::*;

    fn gpu(address: &str, name: &str, numa_node: Option<u32>, local_cpus: &str) -> IoDevice {
        IoDevice {
            pci_address: address.into(),
            class: DeviceClass::Gpu,
            class_code: 0x030200,
            vendor_id: Some(0x10de),
            device_id: None,
            names: vec![name.into()],
            numa_node,
            local_cpus: CpuSet::parse_list(local_cpus).unwrap(),
            upstream: Vec::new(),
            virtual_function: false,
            fabric: None,
        }
    }

    /// Two packages of two NUMA nodes of 4 one-thread cores: nodes 0-3 hold CPUs 0-3, 4-7,
    /// 8-11, 12-15.
    fn host() -> Topology {
        let mut t = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 2,
            l3_per_numa: 1,
            cores_per_l3: 4,
            threads_per_core: 1,
        });
        t.devices = vec![
            gpu("0000:3b:00.0", "card0", Some(1), "4-7"),
            gpu("0000:af:00.0", "card1", None, "9"),
            gpu("0000:d8:00.0", "card2", None, ""),
        ];
        t
    }

    #[test]
    fn devices_are_found_by_address_short_address_and_os_name() {
        let t = host();
        assert_eq!(t.device("0000:3b:00.0").unwrap().names, ["card0"]);
        assert_eq!(t.device("3B:00.0").unwrap().names, ["card0"]);
        assert_eq!(t.device("card1").unwrap().pci_address, "0000:af:00.0");
        assert!(t.device("card9").is_none());
        assert!(t.device("0000:3b:00.1").is_none());
    }

    #[test]
    fn the_cpus_near_a_device_are_its_nodes_or_packages_and_unknown_stays_unknown() {
        let t = host();
        let near = |name: &str, level| t.cpus_near(t.device(name).unwrap(), level);
        let set = |s: &str| Some(CpuSet::parse_list(s).unwrap());
        assert_eq!(near("card0", Level::Numa), set("4-7"));
        assert_eq!(near("card0", Level::Socket), set("0-7"));
        // numa_node -1: its local CPUs stand for it, widened to their node and package.
        assert_eq!(near("card1", Level::Numa), set("8-11"));
        assert_eq!(near("card1", Level::Socket), set("8-15"));
        // Neither known: not node 0.
        assert_eq!(near("card2", Level::Numa), None);
        let card0 = t.device("card0").unwrap();
        assert_eq!(t.device_distance(card0, &CpuSet::parse_list("4-5").unwrap()), Some(10));
        assert_eq!(t.device_distance(card0, &CpuSet::parse_list("0,5").unwrap()), Some(12));
        assert_eq!(t.device_distance(card0, &CpuSet::parse_list("5,12").unwrap()), Some(32));
        assert_eq!(t.device_distance(t.device("card1").unwrap(), &CpuSet::first_n(2)), None);
        // A node that is not the host's has no distance; a CPU-less node's nearest CPUs stand
        // for it.
        let mut stray = t.devices[0].clone();
        stray.numa_node = Some(9);
        assert_eq!(t.device_distance(&stray, &CpuSet::first_n(2)), None);
        let mut t = t;
        t.numa_nodes.push(NumaNode {
            os_index: 4,
            cpus: CpuSet::new(),
            near_cpus: CpuSet::parse_list("12-15").unwrap(),
            memory_bytes: 1 << 30,
            kind: MemoryKind::Hbm,
        });
        let mut on_hbm = t.devices[0].clone();
        on_hbm.numa_node = Some(4);
        assert_eq!(t.cpus_near(&on_hbm, Level::Numa), Some(CpuSet::parse_list("12-15").unwrap()));
    }
}
