//! hwloc XML v2 import, so that any machine can be emulated from a file.
//!
//! The format (hwloc's `hwloc2.dtd`, written by `lstopo --of xml`): a `<topology version="2.0">`
//! holding nested `<object type=...>` elements, each with `os_index` and its `cpuset`/`nodeset`
//! as hwloc bitmaps; NUMA nodes are memory children of the object they hang off; PCI devices and
//! their OS devices (`eth0`, `mlx5_0`, `cuda0`) are I/O children; `<distances2>` carries the NUMA
//! distance matrix and `<cpukind>` the CPU kinds of hybrid processors.
//!
//! What is kept: packages, dies, NUMA nodes, L3 and L2 caches, cores, PUs, CPU kinds, NUMA
//! distances (the `NUMALatency` matrix), PCI devices with their locality (the cpuset and
//! nodeset of their nearest non-I/O ancestor), and the GPUs' NVLink islands (the
//! `NVLinkBandwidth` matrix hwloc reads from NVML). The allowed CPUs and memory nodes come from the
//! root's `allowed_cpuset` / `allowed_nodeset` (present in exports made with `--disallowed`),
//! else from its `cpuset` / `nodeset`.
//!
//! XML v3 (hwloc 3.0) is refused with a message saying so.

use super::{
    CpuKind, DeviceClass, Distances, Domain, IoDevice, MemoryKind, NumaNode, Topology,
    TopologyError,
};
use crate::cpuset::CpuSet;
use std::path::Path;

/// Where an "infinite" hwloc bitmap (`0xf...f`) is cut.
const BITMAP_LIMIT: u32 = 8192;

/// Reads an hwloc XML v2 file.
pub fn read_file(path: &Path) -> Result<Topology, TopologyError> {
    let xml = std::fs::read_to_string(path)
        .map_err(|source| TopologyError::Io { path: path.to_path_buf(), source })?;
    parse(&path.display().to_string(), &xml)
}

/// Reads an hwloc XML v2 document; `source` names it in errors and in the result.
pub fn parse(source: &str, xml: &str) -> Result<Topology, TopologyError> {
    // hwloc writes `<!DOCTYPE topology SYSTEM "hwloc2.dtd">`; roxmltree never fetches external
    // DTDs and bounds entity expansion, so allowing the declaration is safe.
    let options =
        roxmltree::ParsingOptions { allow_dtd: true, ..roxmltree::ParsingOptions::default() };
    let doc = roxmltree::Document::parse_with_options(xml, options).map_err(|e| {
        TopologyError::Format {
            path: source.to_string(),
            what: format!("not well-formed XML: {e}"),
        }
    })?;
    let root = doc.root_element();
    let at =
        |node: roxmltree::Node| format!("{source}:{}", doc.text_pos_at(node.range().start).row);
    if root.tag_name().name() != "topology" {
        return Err(TopologyError::Format {
            path: at(root),
            what: format!(
                "the root element is <{}>, not <topology>: not an hwloc XML file",
                root.tag_name().name()
            ),
        });
    }
    let version = root.attribute("version").unwrap_or("1.0");
    if !version.starts_with("2.") {
        return Err(TopologyError::Format {
            path: at(root),
            what: format!("hwloc XML version {version} is not supported; export it with hwloc 2.x (lstopo --of xml)"),
        });
    }
    let machine =
        root.children().find(|n| n.has_tag_name("object")).ok_or_else(|| TopologyError::Empty {
            source_name: source.to_string(),
            what: "no <object> in <topology>".into(),
        })?;
    let mut reader = Reader {
        at: &at,
        topo: empty(source),
        os_devices: std::collections::HashMap::new(),
        nvlink_islands: Vec::new(),
    };
    reader.object(machine, None)?;
    reader.machine(machine)?;
    for node in root.children().filter(|n| n.is_element()) {
        match node.tag_name().name() {
            "distances2" | "distances2hetero"
                if node.attribute("name") == Some("NVLinkBandwidth") =>
            {
                reader.nvlinks(node)?
            }
            "distances2" => reader.distances(node)?,
            "cpukind" => reader.cpu_kind(node)?,
            _ => {}
        }
    }
    let islands = std::mem::take(&mut reader.nvlink_islands);
    let mut topo = reader.topo;
    name_nvlink_islands(&mut topo.devices, &islands);
    super::keep_shared_gpu_fabrics(&mut topo.devices);
    // Devices whose ancestor had no nodeset: the one NUMA node with CPUs covering their CPUs.
    for dev in topo.devices.iter_mut().filter(|d| d.numa_node.is_none() && !d.local_cpus.is_empty())
    {
        let near: Vec<u32> = topo
            .numa_nodes
            .iter()
            .filter(|n| n.cpus.intersects(&dev.local_cpus))
            .map(|n| n.os_index)
            .collect();
        if near.len() == 1 {
            dev.numa_node = Some(near[0]);
        }
    }
    if topo.cpu_kinds.len() < 2 {
        topo.cpu_kinds.clear();
    }
    if topo.pus.is_empty() {
        return Err(TopologyError::Empty {
            source_name: source.to_string(),
            what: "no PU objects: not a CPU topology".into(),
        });
    }
    Ok(topo)
}

fn empty(source: &str) -> Topology {
    Topology {
        source: source.to_string(),
        pus: CpuSet::new(),
        allowed: CpuSet::new(),
        allowed_mems: CpuSet::new(),
        cores: Vec::new(),
        l2_groups: Vec::new(),
        l3_groups: Vec::new(),
        numa_nodes: Vec::new(),
        dies: Vec::new(),
        packages: Vec::new(),
        cpu_kinds: Vec::new(),
        distances: None,
        devices: Vec::new(),
    }
}

struct Reader<'a> {
    at: &'a dyn Fn(roxmltree::Node) -> String,
    topo: Topology,
    /// The PCI device (index in `topo.devices`) of each PCI and OS device, by its
    /// `gp_index` (unique across a file's objects): what the NVLink matrix names.
    os_devices: std::collections::HashMap<String, usize>,
    /// The GPUs (indices in `topo.devices`) each NVLink matrix joins, island by island; a
    /// file may hold several matrices, whose islands are merged at the end.
    nvlink_islands: Vec<Vec<usize>>,
}

impl Reader<'_> {
    fn bad(&self, node: roxmltree::Node, what: String) -> TopologyError {
        TopologyError::Format { path: (self.at)(node), what }
    }

    fn bitmap(&self, node: roxmltree::Node, attr: &str) -> Result<Option<CpuSet>, TopologyError> {
        match node.attribute(attr) {
            None => Ok(None),
            Some(text) => CpuSet::parse_hwloc(text, BITMAP_LIMIT)
                .map(Some)
                .map_err(|e| self.bad(node, format!("attribute {attr}: {e}"))),
        }
    }

    fn number<T: std::str::FromStr>(
        &self,
        node: roxmltree::Node,
        attr: &str,
    ) -> Result<Option<T>, TopologyError> {
        match node.attribute(attr) {
            None => Ok(None),
            Some(text) => {
                text.trim().parse().map(Some).map_err(|_| {
                    self.bad(node, format!("attribute {attr}={text:?} is not a number"))
                })
            }
        }
    }

    fn domain(&self, node: roxmltree::Node) -> Result<Domain, TopologyError> {
        let cpus = self
            .bitmap(node, "cpuset")?
            .ok_or_else(|| self.bad(node, format!("{} object without a cpuset", type_of(node))))?;
        Ok(Domain { os_index: self.number(node, "os_index")?, cpus })
    }

    /// Reads `node` and its subtree; `pci` is the nearest PCI device above, for OS devices.
    fn object(&mut self, node: roxmltree::Node, pci: Option<usize>) -> Result<(), TopologyError> {
        let mut pci = pci;
        match type_of(node) {
            "Package" => {
                let d = self.domain(node)?;
                self.topo.packages.push(d);
            }
            "Die" => {
                let d = self.domain(node)?;
                self.topo.dies.push(d);
            }
            "L3Cache" => {
                let d = self.domain(node)?;
                self.topo.l3_groups.push(d);
            }
            "L2Cache" => {
                let d = self.domain(node)?;
                self.topo.l2_groups.push(d);
            }
            "Core" => {
                let d = self.domain(node)?;
                self.topo.cores.push(d);
            }
            "PU" => {
                let id: u32 = self
                    .number(node, "os_index")?
                    .ok_or_else(|| self.bad(node, "PU object without os_index".into()))?;
                if id > crate::cpuset::MAX_CPU_ID {
                    return Err(self.bad(
                        node,
                        format!("PU os_index {id} is above the largest CPU id accepted"),
                    ));
                }
                self.topo.pus.insert(id);
            }
            "NUMANode" => {
                let os_index: u32 = self
                    .number(node, "os_index")?
                    .ok_or_else(|| self.bad(node, "NUMANode object without os_index".into()))?;
                // hwloc gives a memory object the cpuset of the object it hangs off; for the
                // kernel, HBM and GPU memory nodes have no CPUs of their own.
                let near_cpus = self.bitmap(node, "cpuset")?.unwrap_or_default();
                let kind = match node.attribute("subtype") {
                    Some("GPUMemory") => MemoryKind::GpuMemory,
                    Some("MCDRAM") | Some("HBM") => MemoryKind::Hbm,
                    Some("NVM") | Some("SPM") | Some("CXL-DRAM") => MemoryKind::FarMemory,
                    _ => MemoryKind::Dram,
                };
                let cpus = if kind == MemoryKind::Dram { near_cpus.clone() } else { CpuSet::new() };
                let memory_bytes = self.number(node, "local_memory")?.unwrap_or(0);
                self.topo.numa_nodes.push(NumaNode {
                    os_index,
                    cpus,
                    near_cpus,
                    memory_bytes,
                    kind,
                });
            }
            "PCIDev" => {
                let i = self.pci_device(node)?;
                if let Some(gp) = node.attribute("gp_index") {
                    self.os_devices.insert(gp.to_string(), i);
                }
                pci = Some(i);
            }
            "OSDev" => {
                if let (Some(i), Some(gp)) = (pci, node.attribute("gp_index")) {
                    self.os_devices.insert(gp.to_string(), i);
                }
                if let (Some(i), Some(name)) = (pci, node.attribute("name")) {
                    if let Some(dev) = self.topo.devices.get_mut(i) {
                        dev.names.push(name.to_string());
                        if node.attribute("osdev_type") == Some("5")
                            && dev.class == DeviceClass::Other
                        {
                            dev.class = DeviceClass::Accelerator;
                        }
                    }
                }
            }
            _ => {}
        }
        for child in node.children().filter(|n| n.has_tag_name("object")) {
            self.object(child, pci)?;
        }
        Ok(())
    }

    fn pci_device(&mut self, node: roxmltree::Node) -> Result<usize, TopologyError> {
        let address = node.attribute("pci_busid").unwrap_or_default().to_string();
        // hwloc writes domain:bus:device.function; anything else would reach listings and
        // names (an NVLink island is named by an address).
        if !super::sysfs::is_pci_address(&address) {
            let shown: String = address.chars().take(40).collect();
            return Err(self.bad(
                node,
                format!("PCIDev with pci_busid {shown:?}, which is not a PCI address (domain:bus:device.function, such as 0000:3b:00.0)"),
            ));
        }
        // pci_type="0200 [14e4:1639] [0014:007c] 20": class/subclass, [vendor:device], ...
        let pci_type = node.attribute("pci_type").unwrap_or("");
        let mut fields = pci_type.split_whitespace();
        let class16 = fields.next().and_then(|c| u32::from_str_radix(c, 16).ok()).unwrap_or(0);
        let ids = fields.next().unwrap_or("").trim_matches(|c| c == '[' || c == ']');
        let (vendor_id, device_id) = match ids.split_once(':') {
            Some((v, d)) => (u16::from_str_radix(v, 16).ok(), u16::from_str_radix(d, 16).ok()),
            None => (None, None),
        };
        let (local_cpus, numa_node) = self.locality(node)?;
        // The bridges above it, nearest first as ancestors come; the host bridge has no
        // address of its own.
        let mut upstream: Vec<String> = node
            .ancestors()
            .skip(1)
            .filter(|n| n.has_tag_name("object") && type_of(*n) == "Bridge")
            .filter_map(|n| n.attribute("pci_busid"))
            .map(str::to_string)
            .collect();
        upstream.reverse();
        self.topo.devices.push(IoDevice {
            upstream,
            pci_address: address,
            class: super::classify_pci(class16 << 8),
            class_code: class16 << 8,
            vendor_id,
            device_id,
            names: Vec::new(),
            numa_node,
            local_cpus,
            virtual_function: false,
            fabric: None,
        });
        Ok(self.topo.devices.len() - 1)
    }

    /// The cpuset and single NUMA node of the nearest ancestor that is not an I/O object.
    fn locality(&self, node: roxmltree::Node) -> Result<(CpuSet, Option<u32>), TopologyError> {
        for anc in node.ancestors().skip(1).filter(|n| n.has_tag_name("object")) {
            if matches!(type_of(anc), "Bridge" | "PCIDev" | "OSDev" | "Misc") {
                continue;
            }
            let cpus = self.bitmap(anc, "cpuset")?.unwrap_or_default();
            let nodes = self.bitmap(anc, "nodeset")?.unwrap_or_default();
            let numa = if nodes.len() == 1 { nodes.first() } else { None };
            return Ok((cpus, numa));
        }
        Ok((CpuSet::new(), None))
    }

    fn machine(&mut self, machine: roxmltree::Node) -> Result<(), TopologyError> {
        let cpuset = self.bitmap(machine, "cpuset")?.unwrap_or_else(|| self.topo.pus.clone());
        let allowed = self.bitmap(machine, "allowed_cpuset")?.unwrap_or(cpuset);
        self.topo.allowed = allowed.intersection(&self.topo.pus);
        let nodes: CpuSet = self.topo.numa_nodes.iter().map(|n| n.os_index).collect();
        let nodeset = self.bitmap(machine, "nodeset")?.unwrap_or_else(|| nodes.clone());
        let allowed_mems = self.bitmap(machine, "allowed_nodeset")?.unwrap_or(nodeset);
        self.topo.allowed_mems = allowed_mems.intersection(&nodes);
        Ok(())
    }

    fn distances(&mut self, node: roxmltree::Node) -> Result<(), TopologyError> {
        if node.attribute("type") != Some("NUMANode") || node.attribute("indexing") != Some("os") {
            return Ok(());
        }
        // Several matrices may exist (latency, bandwidth); the SLIT is the latency one.
        if self.topo.distances.is_some() && node.attribute("name") != Some("NUMALatency") {
            return Ok(());
        }
        let (indexes, values) = self.matrix(node, "distances2")?;
        let nodes = indexes
            .iter()
            .map(|word| {
                let v: u64 = word.parse().map_err(|_| {
                    self.bad(node, format!("distances2 index {word:?} is not a number"))
                })?;
                Ok(u32::try_from(v).unwrap_or(u32::MAX))
            })
            .collect::<Result<Vec<u32>, TopologyError>>()?;
        let values = values.into_iter().map(|v| u32::try_from(v).unwrap_or(u32::MAX)).collect();
        self.topo.distances = Some(Distances { nodes, values });
        Ok(())
    }

    /// A `<distances2>` or `<distances2hetero>` matrix (`what` names it in errors): its
    /// `nbobjs` index words and its row-major values, checked to be that many and square.
    fn matrix(
        &self,
        node: roxmltree::Node,
        what: &str,
    ) -> Result<(Vec<String>, Vec<u64>), TopologyError> {
        let n: usize = self
            .number(node, "nbobjs")?
            .ok_or_else(|| self.bad(node, format!("{what} without nbobjs")))?;
        if n > 4096 {
            return Err(
                self.bad(node, format!("{what} with {n} objects is larger than any machine"))
            );
        }
        let mut indexes = Vec::new();
        let mut values = Vec::new();
        for child in node.children().filter(|c| c.is_element()) {
            let words = child.text().unwrap_or("").split_whitespace();
            match child.tag_name().name() {
                "indexes" => indexes.extend(words.map(str::to_string)),
                "u64values" => {
                    for word in words {
                        values.push(word.parse().map_err(|_| TopologyError::Format {
                            path: (self.at)(child),
                            what: format!("{word:?} is not a number"),
                        })?);
                    }
                }
                _ => {}
            }
        }
        if indexes.len() != n || values.len() != n * n {
            return Err(self.bad(
                node,
                format!(
                    "{what} of {n} objects has {} indexes and {} values",
                    indexes.len(),
                    values.len()
                ),
            ));
        }
        Ok((indexes, values))
    }

    /// hwloc's `NVLinkBandwidth` matrix (from NVML: the bandwidth of the NVLinks between
    /// GPUs, NVSwitches and, on POWER, packages; hwloc's "Distances" documentation): the GPUs
    /// joined by links, directly or through NVSwitches, are one island
    /// ([`IoDevice::fabric`]). A link to a package does not join GPUs: their data would cross
    /// the processor.
    fn nvlinks(&mut self, node: roxmltree::Node) -> Result<(), TopologyError> {
        let (indexes, values) = self.matrix(node, "NVLinkBandwidth")?;
        let n = indexes.len();
        // A homogeneous matrix names OS devices by gp_index; a heterogeneous one "Type:gp".
        let homogeneous_type = node.attribute("type");
        let objects: Vec<(String, String)> = indexes
            .iter()
            .map(|w| match (homogeneous_type, w.split_once(':')) {
                (_, Some((kind, gp))) => (kind.to_string(), gp.to_string()),
                (Some(kind), None) => (kind.to_string(), w.clone()),
                (None, None) => (String::new(), w.clone()),
            })
            .collect();
        // The GPU each object is, if it is one (an OS or PCI device of a GPU or accelerator).
        let gpu_of = |i: usize| {
            let (kind, gp) = &objects[i];
            let dev = matches!(kind.as_str(), "OSDev" | "PCIDev")
                .then(|| self.os_devices.get(gp).copied())
                .flatten()?;
            let class = self.topo.devices[dev].class;
            matches!(class, DeviceClass::Gpu | DeviceClass::Accelerator).then_some(dev)
        };
        // Islands by union-find over the objects a GPU's data may cross between GPUs: the GPUs
        // and switches (NVSwitch, a Misc object), not a package (its data would cross the
        // processor) nor another device (a NIC).
        let joins = |i: usize| match objects[i].0.as_str() {
            "Package" => false,
            "OSDev" | "PCIDev" => gpu_of(i).is_some(),
            _ => true,
        };
        let mut parent: Vec<usize> = (0..n).collect();
        for a in 0..n {
            for b in 0..n {
                if a != b && values[a * n + b] > 0 && joins(a) && joins(b) {
                    let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
                    parent[ra] = rb;
                }
            }
        }
        let mut islands: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for i in 0..n {
            if let Some(dev) = gpu_of(i) {
                let r = root(&mut parent, i);
                islands.entry(r).or_default().push(dev);
            }
        }
        self.nvlink_islands.extend(islands.into_values().filter(|v| v.len() >= 2));
        Ok(())
    }

    fn cpu_kind(&mut self, node: roxmltree::Node) -> Result<(), TopologyError> {
        let cpus = self
            .bitmap(node, "cpuset")?
            .ok_or_else(|| self.bad(node, "cpukind without a cpuset".into()))?;
        let efficiency: Option<i32> = match self.number(node, "forced_efficiency")? {
            Some(e) => Some(e),
            None => self.number(node, "efficiency")?,
        };
        let info = |key: &str| {
            node.children()
                .filter(|c| c.has_tag_name("info"))
                .find(|c| c.attribute("name") == Some(key))
                .and_then(|c| c.attribute("value"))
        };
        let name = info("CoreType")
            .map(str::to_string)
            .or_else(|| info("LinuxCapacity").map(|c| format!("capacity={c}")))
            .unwrap_or_else(|| format!("kind{}", self.topo.cpu_kinds.len()));
        self.topo.cpu_kinds.push(CpuKind { cpus, name, efficiency });
        Ok(())
    }
}

/// The root of `i` in a union-find forest, halving the path on the way.
fn root(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

/// Names each NVLink island (`islands`: GPU device indices, as the file's matrices join them;
/// islands sharing a GPU are one) `nvlink:` and its lowest PCI address, on its GPUs.
fn name_nvlink_islands(devices: &mut [IoDevice], islands: &[Vec<usize>]) {
    let mut parent: Vec<usize> = (0..devices.len()).collect();
    for island in islands {
        for pair in island.windows(2) {
            let (a, b) = (root(&mut parent, pair[0]), root(&mut parent, pair[1]));
            parent[a] = b;
        }
    }
    let linked: std::collections::BTreeSet<usize> = islands.iter().flatten().copied().collect();
    let mut members: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for &d in &linked {
        let r = root(&mut parent, d);
        members.entry(r).or_default().push(d);
    }
    for devs in members.values() {
        let Some(first) = devs.iter().map(|&d| devices[d].pci_address.clone()).min() else {
            continue;
        };
        for &d in devs {
            devices[d].fabric = Some(format!("nvlink:{first}"));
        }
    }
}

fn type_of<'a>(node: roxmltree::Node<'a, '_>) -> &'a str {
    node.attribute("type").unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<topology version="2.0">
  <object type="Machine" os_index="0" cpuset="0x0000000f" allowed_cpuset="0x00000007" nodeset="0x00000003" allowed_nodeset="0x00000003">
    <object type="Package" os_index="0" cpuset="0x0000000f">
      <object type="NUMANode" os_index="0" cpuset="0x0000000f" local_memory="1073741824"/>
      <object type="L3Cache" os_index="0" cpuset="0x0000000f">
        <object type="Core" os_index="0" cpuset="0x00000003">
          <object type="PU" os_index="0" cpuset="0x00000001"/>
          <object type="PU" os_index="1" cpuset="0x00000002"/>
        </object>
        <object type="Core" os_index="1" cpuset="0x0000000c">
          <object type="PU" os_index="2" cpuset="0x00000004"/>
          <object type="PU" os_index="3" cpuset="0x00000008"/>
        </object>
      </object>
      <object type="Bridge" os_index="0">
        <object type="PCIDev" pci_busid="0000:3b:00.0" pci_type="0302 [10de:20b0] [10de:1450] a1">
          <object type="OSDev" name="cuda0" osdev_type="5"/>
        </object>
      </object>
    </object>
    <object type="NUMANode" os_index="1" cpuset="0x0000000f" subtype="MCDRAM" local_memory="17179869184"/>
  </object>
  <distances2 type="NUMANode" nbobjs="2" kind="5" name="NUMALatency" indexing="os">
    <indexes length="4">0 1 </indexes>
    <u64values length="12">10 31 31 10 </u64values>
  </distances2>
</topology>"#;

    /// Three GPUs (gp_index 10, 11, 12) and a matrix `matrix` after them.
    fn three_gpus(matrix: &str) -> String {
        format!(
            r#"<?xml version="1.0" encoding="UTF-8"?>
<topology version="2.0">
  <object type="Machine" os_index="0" cpuset="0x00000003" nodeset="0x00000001">
    <object type="Package" os_index="0" gp_index="2" cpuset="0x00000003">
      <object type="NUMANode" os_index="0" cpuset="0x00000003" local_memory="1073741824"/>
      <object type="Core" os_index="0" cpuset="0x00000003">
        <object type="PU" os_index="0" cpuset="0x00000001"/>
        <object type="PU" os_index="1" cpuset="0x00000002"/>
      </object>
      <object type="Bridge" os_index="0">
        <object type="PCIDev" gp_index="5" pci_busid="0000:3b:00.0" pci_type="0302 [10de:20b0] [10de:1450] a1">
          <object type="OSDev" gp_index="10" name="nvml0" osdev_type="1"/>
        </object>
        <object type="PCIDev" gp_index="6" pci_busid="0000:3c:00.0" pci_type="0302 [10de:20b0] [10de:1450] a1">
          <object type="OSDev" gp_index="11" name="nvml1" osdev_type="1"/>
        </object>
        <object type="PCIDev" gp_index="7" pci_busid="0000:3d:00.0" pci_type="0302 [10de:20b0] [10de:1450] a1">
          <object type="OSDev" gp_index="12" name="nvml2" osdev_type="1"/>
        </object>
      </object>
    </object>
  </object>
  {matrix}
</topology>"#
        )
    }

    #[test]
    fn islands_join_gpus_only_merge_across_matrices_and_addresses_are_checked() {
        // Found by attacking the first version. A NIC linked to a GPU joins nothing (and the
        // GPU alone is in no island); GPU 11 is made a NIC here by its class.
        let nic = three_gpus(
            r#"<distances2 type="OSDev" nbobjs="2" kind="25" name="NVLinkBandwidth" indexing="gp">
    <indexes length="9">10 11 </indexes>
    <u64values length="30">1000 40 40 1000 </u64values>
  </distances2>"#,
        )
        .replacen(
            "0302 [10de:20b0] [10de:1450] a1\">\n          <object type=\"OSDev\" gp_index=\"11\"",
            "0200 [15b3:1017] [15b3:0007] 00\">\n          <object type=\"OSDev\" gp_index=\"11\"",
            1,
        );
        let t = parse("nic", &nic).unwrap();
        assert_eq!(t.devices[1].class, DeviceClass::Network, "{:?}", t.devices);
        assert!(t.devices.iter().all(|d| d.fabric.is_none()), "{:?}", t.devices);
        // Two matrices: 10-11 in one, 11-12 in the other: one island of three.
        let two = three_gpus(
            r#"<distances2 type="OSDev" nbobjs="2" kind="25" name="NVLinkBandwidth" indexing="gp">
    <indexes length="9">10 11 </indexes>
    <u64values length="30">1000 40 40 1000 </u64values>
  </distances2>
  <distances2 type="OSDev" nbobjs="2" kind="25" name="NVLinkBandwidth" indexing="gp">
    <indexes length="9">11 12 </indexes>
    <u64values length="30">1000 40 40 1000 </u64values>
  </distances2>"#,
        );
        let t = parse("two", &two).unwrap();
        let fabrics: Vec<Option<&str>> = t.devices.iter().map(|d| d.fabric.as_deref()).collect();
        assert_eq!(fabrics, [Some("nvlink:0000:3b:00.0"); 3]);
        // A pci_busid that is no PCI address is refused, saying which.
        let spoofed = three_gpus("").replacen("0000:3c:00.0", "0000:3c:00.0&#13;&#9;job evil", 1);
        let e = parse("spoofed", &spoofed).unwrap_err().to_string();
        assert!(e.contains("which is not a PCI address") && e.contains("job evil"), "{e}");
    }

    #[test]
    fn gpus_joined_through_an_nvswitch_are_one_island_and_a_package_joins_none() {
        // GPUs 10 and 11 link to the switch (Misc 20); GPU 12 only to the package.
        let hetero = three_gpus(
            r#"<distances2hetero nbobjs="5" kind="25" name="NVLinkBandwidth">
    <indexes length="40">OSDev:10 OSDev:11 OSDev:12 Misc:20 Package:2 </indexes>
    <u64values length="99">1000 0 0 300 0  0 1000 0 300 0  0 0 1000 0 50  300 300 0 1000 0  0 0 50 0 1000 </u64values>
  </distances2hetero>"#,
        );
        let t = parse("three", &hetero).unwrap();
        let fabrics: Vec<Option<&str>> = t.devices.iter().map(|d| d.fabric.as_deref()).collect();
        assert_eq!(fabrics, [Some("nvlink:0000:3b:00.0"), Some("nvlink:0000:3b:00.0"), None]);
        // A homogeneous matrix of OS devices by gp_index: 11 and 12 linked directly.
        let homogeneous = three_gpus(
            r#"<distances2 type="OSDev" nbobjs="3" kind="25" name="NVLinkBandwidth" indexing="gp">
    <indexes length="9">10 11 12 </indexes>
    <u64values length="30">1000 0 0 0 1000 40 0 40 1000 </u64values>
  </distances2>"#,
        );
        let t = parse("three", &homogeneous).unwrap();
        let fabrics: Vec<Option<&str>> = t.devices.iter().map(|d| d.fabric.as_deref()).collect();
        assert_eq!(fabrics, [None, Some("nvlink:0000:3c:00.0"), Some("nvlink:0000:3c:00.0")]);
        // A matrix whose size does not match its indexes is an error that says so.
        let short = three_gpus(
            r#"<distances2 type="OSDev" nbobjs="3" kind="25" name="NVLinkBandwidth" indexing="gp">
    <indexes length="9">10 11 12 </indexes>
    <u64values length="30">1000 0 0 0 1000 40 </u64values>
  </distances2>"#,
        );
        let e = parse("three", &short).unwrap_err().to_string();
        assert!(e.contains("NVLinkBandwidth of 3 objects has 3 indexes and 6 values"), "{e}");
    }

    #[test]
    fn reads_a_small_machine() {
        let t = parse("small", SMALL).unwrap();
        assert_eq!(t.pus.to_string(), "0-3");
        assert_eq!(t.allowed.to_string(), "0-2");
        let c = t.counts();
        assert_eq!((c.packages, c.numa_nodes, c.l3_groups, c.cores, c.pus), (1, 2, 1, 2, 3));
        assert_eq!(t.numa_nodes[1].kind, MemoryKind::Hbm);
        assert!(t.numa_nodes[1].cpus.is_empty(), "HBM has no CPUs of its own");
        assert_eq!(t.numa_nodes[1].near_cpus.to_string(), "0-3");
        // A localonly job gets the HBM next to its CPUs as well as its DRAM.
        let model = crate::place::HostModel::new(&t, &CpuSet::new()).unwrap();
        let req = crate::request::Request {
            membind: crate::request::MemBind::LocalOnly,
            ..crate::request::Request::threads(1)
        };
        let p =
            crate::place::place(&model, &Default::default(), &req, crate::place::Strategy::BestFit)
                .unwrap();
        assert_eq!(p.mems.to_string(), "0-1");
        assert_eq!(t.numa_distance(0, 1), 31);
        let gpu = &t.devices[0];
        assert_eq!(
            (gpu.class, gpu.vendor_id, gpu.numa_node),
            (DeviceClass::Gpu, Some(0x10de), Some(0))
        );
        assert_eq!(gpu.names, ["cuda0"]);
        assert_eq!(gpu.local_cpus.to_string(), "0-3");
    }

    #[test]
    fn bad_input_says_what_and_where() {
        let e = parse("f.xml", "<topology version=\"2.0\"><object type=\"Machine\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("f.xml") && e.contains("not well-formed"), "{e}");
        let e = parse("f.xml", "<topology version=\"3.0\"/>").unwrap_err().to_string();
        assert!(e.contains("version 3.0") && e.contains("hwloc 2.x"), "{e}");
        let e = parse("f.xml", "<html/>").unwrap_err().to_string();
        assert!(e.contains("not an hwloc XML file"), "{e}");
        let garbled = SMALL.replace("cpuset=\"0x00000003\"", "cpuset=\"0xnothex\"");
        let e = parse("f.xml", &garbled).unwrap_err().to_string();
        assert!(e.contains("f.xml:7") && e.contains("cpuset"), "{e}");
        let e = parse("f.xml", &SMALL.replace("os_index=\"2\"", "os_index=\"two\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("os_index") && e.contains("\"two\""), "{e}");
        let e = parse("f.xml", &SMALL.replace("10 31 31 10", "10 31 31")).unwrap_err().to_string();
        assert!(e.contains("3 values"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]
        #[test]
        fn never_panics_on_mutated_xml(cut in 0usize..1500, pos in 0usize..1500, byte in 0u8..128) {
            let mut bytes = SMALL.as_bytes().to_vec();
            let p = pos % bytes.len();
            bytes[p] = byte;
            bytes.truncate(cut.max(1).min(bytes.len()));
            let text = String::from_utf8_lossy(&bytes);
            let _ = parse("fuzz", &text);
        }
    }
}
