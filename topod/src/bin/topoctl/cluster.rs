//! `topoctl simulate --cluster FILE.toml`: a cluster of host groups (each a count of one
//! machine) and partitions (disjoint sets of groups, each taking the trace's jobs of some
//! queues or partitions, under its own policy).
//!
//! ```toml
//! [[group]]
//! name = "epyc"
//! count = 4
//! topology = "AMD-17h-Zen-2xEpyc-7451.xml"   # hwloc XML, sysfs snapshot or flat:P
//!
//! [[partition]]
//! name = "batch"
//! groups = ["epyc"]
//! queues = [1, 2]          # the trace's field 15
//! partitions = [2]         # the trace's field 16
//! default = true           # and every job no partition names
//! policy = "easy"          # else --policy
//! placement = "best-fit"   # else --placement
//! ```
//!
//! Partitions share no host, so each is replayed apart and the figures are summed up as one
//! replay's (`topo_core::sim::merge`). Without `[[partition]]` every group is one partition
//! that takes every job. Paths are relative to the file.

use crate::simulate::{host_topology, MAX_HOSTS, MAX_PROCESSORS};
use crate::Failure;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use topo_core::place::HostModel;
use topo_core::swf::SwfJob;
use topo_core::CpuSet;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(rename = "group", default)]
    groups: Vec<GroupEntry>,
    #[serde(rename = "partition", default)]
    partitions: Vec<PartitionEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupEntry {
    name: String,
    count: usize,
    topology: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PartitionEntry {
    name: String,
    groups: Vec<String>,
    #[serde(default)]
    queues: Vec<i64>,
    #[serde(default)]
    partitions: Vec<i64>,
    #[serde(default)]
    default: bool,
    policy: Option<String>,
    placement: Option<String>,
}

/// Loads a group's machine: `(topology as written, what names the entry in messages)`.
type LoadMachine<'a> = dyn Fn(&str, &str) -> Result<Arc<HostModel>, Failure> + 'a;

/// Hosts of one machine.
#[derive(Debug)]
pub(crate) struct Group {
    pub name: String,
    pub count: usize,
    /// How the file (or `--topology`) named the machine, and its file name for tables.
    pub topology: String,
    pub model: Arc<HostModel>,
    /// Whole cores per host.
    pub cores: u64,
}

impl Group {
    /// A group's machine for tables: its topology file's name, or `flat:P`.
    pub fn machine(&self) -> String {
        Path::new(&self.topology)
            .file_name()
            .map_or_else(|| self.topology.clone(), |n| n.to_string_lossy().into())
    }
}

/// Hosts that run some of the trace's jobs under one policy.
#[derive(Debug)]
pub(crate) struct PartitionSpec {
    pub name: String,
    /// Its hosts: indices into the cluster's hosts ([`Cluster::hosts`]).
    pub hosts: Vec<usize>,
    pub processors: u64,
    queues: Vec<i64>,
    partitions: Vec<i64>,
    default: bool,
    /// Its own policy and host strategy, as `--policy` and `--placement` write one.
    pub policy: Option<String>,
    pub placement: Option<String>,
}

/// A cluster: groups of hosts, split into partitions.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub groups: Vec<Group>,
    pub partitions: Vec<PartitionSpec>,
    /// Whether it came from a file (else `--hosts`/`--topology`, one group).
    pub from_file: bool,
    /// The files it was read from, each with what it is (for a check that no output is one).
    inputs: Vec<(String, PathBuf)>,
}

impl Cluster {
    /// `count` hosts of one machine, one partition that takes every job (`--hosts`,
    /// `--topology`).
    pub fn one_group(topology: &str, model: Arc<HostModel>, count: usize) -> Cluster {
        let cores = whole_cores(&model);
        Cluster {
            groups: vec![Group {
                name: "hosts".into(),
                count,
                topology: topology.to_string(),
                model,
                cores,
            }],
            partitions: vec![PartitionSpec {
                name: "all".into(),
                hosts: (0..count).collect(),
                processors: cores * count as u64,
                queues: Vec::new(),
                partitions: Vec::new(),
                default: true,
                policy: None,
                placement: None,
            }],
            from_file: false,
            inputs: Vec::new(),
        }
    }

    /// `one_group`, with the topology file it was read from.
    pub fn with_input(mut self, what: &str, path: &Path) -> Cluster {
        self.inputs.push((what.to_string(), path.to_path_buf()));
        self
    }

    /// The files it was read from: the cluster file and its topology files.
    pub fn input_files(&self) -> &[(String, PathBuf)] {
        &self.inputs
    }

    /// Reads and checks a cluster file; every message names the file and the entry.
    pub fn load(path: &Path) -> Result<Cluster, Failure> {
        let shown = path.display();
        if path == Path::new("-") {
            return Err(Failure::input(
                "--cluster -: a cluster file is read from a file, not standard input",
            ));
        }
        let cannot =
            |e: std::io::Error| Failure::input(format!("--cluster {shown}: cannot read it: {e}"));
        let meta = std::fs::metadata(path).map_err(cannot)?;
        if !meta.is_file() {
            return Err(Failure::input(format!(
                "--cluster {shown}: not a regular file (a folder, a device or a pipe)"
            )));
        }
        if meta.len() > MAX_CLUSTER_BYTES {
            return Err(Failure::input(format!(
                "--cluster {shown}: {} KiB is more than a cluster file needs ({} KiB at most): check that it is one",
                meta.len() >> 10,
                MAX_CLUSTER_BYTES >> 10
            )));
        }
        let text = std::fs::read_to_string(path).map_err(cannot)?;
        let file: ClusterFile = toml::from_str(&text)
            .map_err(|e| Failure::input(format!("--cluster {shown}: {}", toml_error(&text, &e))))?;
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut cluster = Cluster::build(file, &shown.to_string(), &|spec, what| {
            let (resolved, what) = if spec.starts_with("flat:") || Path::new(spec).is_absolute() {
                (spec.to_string(), what.to_string())
            } else {
                // Relative to the file: messages say where that led.
                let joined = folder.join(spec).display().to_string();
                let what = format!("{what} ({joined})");
                (joined, what)
            };
            let topo = host_topology(&resolved, &what)?;
            HostModel::new(&topo, &CpuSet::new())
                .map(Arc::new)
                .map_err(|e| Failure::input(format!("{what}: {e}")))
        })?;
        cluster.inputs.push(("the cluster file".into(), path.to_path_buf()));
        for g in &cluster.groups {
            if !g.topology.starts_with("flat:") {
                let what = format!("group {:?}'s topology", g.name);
                cluster.inputs.push((what, folder.join(&g.topology)));
            }
        }
        Ok(cluster)
    }

    /// Checks `file` (from `shown`), loading each group's machine with `load(spec, what)`,
    /// `what` naming the entry for messages.
    fn build(file: ClusterFile, shown: &str, load: &LoadMachine<'_>) -> Result<Cluster, Failure> {
        let bad = |why: String| Failure::input(format!("--cluster {shown}: {why}"));
        if file.groups.is_empty() {
            return Err(bad(
                "no [[group]]: give at least one, with name, count and topology (an hwloc XML file, a sysfs snapshot or flat:P)".into(),
            ));
        }
        let mut groups: Vec<Group> = Vec::new();
        let mut first_host = Vec::new();
        let mut hosts = 0usize;
        let mut processors = 0u64;
        for (k, g) in file.groups.into_iter().enumerate() {
            let entry = format!("group {} ({:?})", k + 1, g.name);
            check_name(&g.name).map_err(|why| bad(format!("{entry}: name {why}")))?;
            if groups.iter().any(|o| o.name == g.name) {
                return Err(bad(format!("{entry}: another group has this name")));
            }
            if g.count == 0 || g.count > MAX_HOSTS {
                return Err(bad(format!("{entry}: count = {}: 1 to {MAX_HOSTS} hosts", g.count)));
            }
            if g.topology.trim().is_empty() {
                return Err(bad(format!(
                    "{entry}: topology is empty: give an hwloc XML file, a sysfs snapshot directory or flat:P"
                )));
            }
            let what = format!("--cluster {shown}: {entry}: topology = {:?}", g.topology);
            let model = load(&g.topology, &what)?;
            let cores = whole_cores(&model);
            first_host.push(hosts);
            hosts += g.count;
            processors = processors.saturating_add(cores.saturating_mul(g.count as u64));
            if hosts > MAX_HOSTS {
                return Err(bad(format!(
                    "{hosts} hosts up to {entry}; at most {MAX_HOSTS} are simulated"
                )));
            }
            if processors > MAX_PROCESSORS {
                return Err(bad(format!(
                    "{processors} processors up to {entry}; at most {MAX_PROCESSORS} are simulated"
                )));
            }
            groups.push(Group { name: g.name, count: g.count, topology: g.topology, model, cores });
        }
        let mut entries = file.partitions;
        if entries.is_empty() {
            entries.push(PartitionEntry {
                name: "all".into(),
                groups: groups.iter().map(|g| g.name.clone()).collect(),
                queues: Vec::new(),
                partitions: Vec::new(),
                default: true,
                policy: None,
                placement: None,
            });
        }
        let mut partitions: Vec<PartitionSpec> = Vec::new();
        let mut owner: Vec<Option<usize>> = vec![None; groups.len()];
        for (k, p) in entries.into_iter().enumerate() {
            let entry = format!("partition {} ({:?})", k + 1, p.name);
            check_name(&p.name).map_err(|why| bad(format!("{entry}: name {why}")))?;
            if partitions.iter().any(|o| o.name == p.name) {
                return Err(bad(format!("{entry}: another partition has this name")));
            }
            if p.groups.is_empty() {
                return Err(bad(format!("{entry}: groups = []: name the groups of hosts it has")));
            }
            if p.queues.is_empty() && p.partitions.is_empty() && !p.default {
                return Err(bad(format!(
                    "{entry}: it takes no job: give queues = [...] (the trace's field 15), partitions = [...] (field 16), or default = true"
                )));
            }
            let mut hosts = Vec::new();
            let mut processors = 0;
            for name in &p.groups {
                let Some(g) = groups.iter().position(|g| &g.name == name) else {
                    let known: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
                    return Err(bad(format!(
                        "{entry}: groups: no group is named {name:?} (the groups are {})",
                        known.join(", ")
                    )));
                };
                if owner[g] == Some(k) {
                    return Err(bad(format!("{entry}: groups: {name:?} is listed twice")));
                }
                if let Some(other) = owner[g] {
                    return Err(bad(format!(
                        "{entry}: group {name:?} is already in partition {:?}: partitions share no hosts here (each is replayed on its own hosts)",
                        partitions.get(other).map_or(&p.name, |o| &o.name)
                    )));
                }
                owner[g] = Some(k);
                hosts.extend(first_host[g]..first_host[g] + groups[g].count);
                processors += groups[g].cores * groups[g].count as u64;
            }
            for (field, numbers, theirs) in [
                (
                    "queues",
                    &p.queues,
                    (|o: &PartitionSpec| &o.queues) as fn(&PartitionSpec) -> &Vec<i64>,
                ),
                ("partitions", &p.partitions, |o: &PartitionSpec| &o.partitions),
            ] {
                for (i, n) in numbers.iter().enumerate() {
                    if numbers[..i].contains(n) {
                        return Err(bad(format!("{entry}: {field}: {n} is listed twice")));
                    }
                    if let Some(other) = partitions.iter().find(|o| theirs(o).contains(n)) {
                        return Err(bad(format!(
                            "{entry}: {field}: {n} is already partition {:?}'s: a job goes to one partition",
                            other.name
                        )));
                    }
                }
            }
            if p.default {
                if let Some(other) = partitions.iter().find(|o| o.default) {
                    return Err(bad(format!(
                        "{entry}: default = true, but partition {:?} is already the default",
                        other.name
                    )));
                }
            }
            partitions.push(PartitionSpec {
                name: p.name,
                hosts,
                processors,
                queues: p.queues,
                partitions: p.partitions,
                default: p.default,
                policy: p.policy,
                placement: p.placement,
            });
        }
        for (g, owned) in groups.iter().zip(&owner) {
            if owned.is_none() {
                eprintln!(
                    "topoctl: warning: --cluster {shown}: group {:?} is in no partition; its {} host(s) run no job",
                    g.name, g.count
                );
            }
        }
        Ok(Cluster { groups, partitions, from_file: true, inputs: Vec::new() })
    }

    /// Every host, group by group in the file's order.
    pub fn hosts(&self) -> Vec<Arc<HostModel>> {
        self.groups.iter().flat_map(|g| std::iter::repeat_n(&g.model, g.count).cloned()).collect()
    }

    pub fn host_count(&self) -> usize {
        self.groups.iter().map(|g| g.count).sum()
    }

    pub fn processors(&self) -> u64 {
        self.groups.iter().map(|g| g.cores * g.count as u64).sum()
    }

    /// The partition a trace line's job goes to: the first whose queues name its queue (field
    /// 15) or whose partitions name its partition (field 16), else the default one.
    pub fn partition_of(&self, job: &SwfJob) -> Option<usize> {
        self.partitions
            .iter()
            .position(|p| p.queues.contains(&job.queue) || p.partitions.contains(&job.partition))
            .or_else(|| self.partitions.iter().position(|p| p.default))
    }

    /// One line for tables and titles: `4 × AMD-17h-Zen-2xEpyc-7451.xml (48 cores) + ...`.
    pub fn describe(&self) -> String {
        self.groups
            .iter()
            .map(|g| {
                let machine = g.machine();
                if self.from_file {
                    format!("{} {} × {machine} ({} cores)", g.name, g.count, g.cores)
                } else {
                    format!("{} × {machine}", g.count)
                }
            })
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// A TOML error as "line L, column C: what" (the parser's own text quotes the whole line,
/// however long).
fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let Some(span) = error.span() else { return error.message().to_string() };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("line {line}, column {column}: {}", error.message().trim().replace('\n', "; "))
}

/// The largest cluster file read (a file of thousands of groups is a few hundred KiB).
const MAX_CLUSTER_BYTES: u64 = 4 << 20;

/// Why a group's or a partition's name cannot be one, if it cannot: names are printed in
/// tables, messages and SVG titles, so they are one printable line.
fn check_name(name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err("is empty".into());
    }
    if name.chars().any(char::is_control) {
        return Err(
            "has a control character (a line end, a tab, an escape): names are one printable line"
                .into(),
        );
    }
    if name.chars().count() > 64 {
        return Err("is longer than 64 characters".into());
    }
    Ok(())
}

/// Whole cores of a host: the processors a trace's job counts.
pub(crate) fn whole_cores(model: &HostModel) -> u64 {
    model.cores.iter().filter(|c| c.is_subset(&model.allocatable)).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use topo_core::topology::Topology;

    fn cluster(text: &str) -> Result<Cluster, String> {
        let file: ClusterFile = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        Cluster::build(file, "c.toml", &|spec, what| {
            let cores: u32 = spec
                .strip_prefix("flat:")
                .and_then(|c| c.parse().ok())
                .ok_or_else(|| Failure::input(format!("{what}: no such file")))?;
            Ok(Arc::new(HostModel::new(&Topology::flat(cores), &CpuSet::new()).unwrap()))
        })
        .map_err(|e| e.to_string())
    }

    /// A trace line of queue `queue` and partition `partition`.
    fn line(queue: i64, partition: i64) -> SwfJob {
        let text = format!("1 0 -1 10 1 -1 -1 1 10 -1 1 -1 -1 -1 {queue} {partition} -1 -1\n");
        topo_core::swf::parse(&text).unwrap().jobs[0].clone()
    }

    const MIXED: &str = r#"
        [[group]]
        name = "thin"
        count = 3
        topology = "flat:4"
        [[group]]
        name = "fat"
        count = 2
        topology = "flat:16"
        [[group]]
        name = "spare"
        count = 1
        topology = "flat:1"
        [[partition]]
        name = "batch"
        groups = ["thin"]
        queues = [1, 2]
        default = true
        [[partition]]
        name = "large"
        groups = ["fat"]
        partitions = [7]
        policy = "fcfs"
    "#;

    #[test]
    fn groups_become_hosts_in_order_and_partitions_own_theirs() {
        let c = cluster(MIXED).unwrap();
        assert_eq!(c.host_count(), 6);
        assert_eq!(c.processors(), 3 * 4 + 2 * 16 + 1);
        assert_eq!(c.partitions[0].hosts, vec![0, 1, 2]);
        assert_eq!(c.partitions[1].hosts, vec![3, 4]);
        assert_eq!((c.partitions[0].processors, c.partitions[1].processors), (12, 32));
        let cores: Vec<usize> = c.hosts().iter().map(|h| h.cores.len()).collect();
        assert_eq!(cores, vec![4, 4, 4, 16, 16, 1]);
        assert_eq!(c.partitions[1].policy.as_deref(), Some("fcfs"));
    }

    #[test]
    fn a_job_goes_by_queue_or_partition_else_to_the_default() {
        let c = cluster(MIXED).unwrap();
        let job = |queue: i64, partition: i64| line(queue, partition);
        assert_eq!(c.partition_of(&job(2, 7)), Some(0), "the first that names it");
        assert_eq!(c.partition_of(&job(5, 7)), Some(1));
        assert_eq!(c.partition_of(&job(5, 1)), Some(0), "the default");
        let no_default = MIXED.replace("default = true", "");
        assert_eq!(cluster(&no_default).unwrap().partition_of(&job(5, 1)), None);
    }

    #[test]
    fn without_partitions_every_group_takes_every_job() {
        let c = cluster(&MIXED[..MIXED.find("[[partition]]").unwrap()]).unwrap();
        assert_eq!(c.partitions.len(), 1);
        assert_eq!(c.partitions[0].hosts, (0..6).collect::<Vec<_>>());
        assert_eq!(c.partition_of(&line(9, 3)), Some(0));
    }

    #[test]
    fn mistakes_are_named_with_their_entry() {
        let cases = [
            (
                MIXED.replace("name = \"fat\"", "name = \"thin\""),
                "group 2 (\"thin\"): another group has this name",
            ),
            (MIXED.replace("count = 2", "count = 0"), "group 2 (\"fat\"): count = 0"),
            (
                MIXED.replace("flat:16", "nowhere.xml"),
                "c.toml: group 2 (\"fat\"): topology = \"nowhere.xml\": no such file",
            ),
            (MIXED.replace("flat:16", ""), "group 2 (\"fat\"): topology is empty"),
            (
                MIXED.replace("name = \"fat\"", "name = \"f\\u001b[31mat\""),
                "group 2 (\"f\\u{1b}[31mat\"): name has a control character",
            ),
            (
                MIXED.replace("groups = [\"fat\"]", "groups = [\"fat\", \"fat\"]"),
                "partition 2 (\"large\"): groups: \"fat\" is listed twice",
            ),
            (
                MIXED.replace("groups = [\"fat\"]", "groups = [\"thin\"]"),
                "partition 2 (\"large\"): group \"thin\" is already in partition \"batch\"",
            ),
            (
                MIXED.replace("groups = [\"fat\"]", "groups = [\"gpu\"]"),
                "no group is named \"gpu\" (the groups are thin, fat, spare)",
            ),
            (
                MIXED.replace("partitions = [7]", "queues = [2]"),
                "partition 2 (\"large\"): queues: 2 is already partition \"batch\"'s",
            ),
            (
                MIXED.replace("partitions = [7]", "partitions = [7, 7]"),
                "partitions: 7 is listed twice",
            ),
            (
                MIXED.replace("partitions = [7]", "default = true"),
                "partition \"batch\" is already the default",
            ),
            (MIXED.replace("partitions = [7]", ""), "partition 2 (\"large\"): it takes no job"),
            (MIXED.replace("count = 3", "count = 3\ncolour = 1"), "unknown field `colour`"),
            ("".to_string(), "no [[group]]"),
        ];
        for (text, expected) in cases {
            let error = cluster(&text).unwrap_err();
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
    }
}
