//! The text picture of a host: packages, NUMA nodes, L3 groups, cores and PUs, with who holds
//! what. It fits a 100-column terminal for any machine: each L3 group is one line of cores
//! (16 two-thread cores, 8 four-thread cores; longer groups wrap), and each core is a cell of
//! one character per hardware thread.
//!
//! ```text
//! Package 0
//!   NUMA 0  96 cores, 377 GiB
//!     L3 0   PU 0-7,192-199      AA AA AA AA BB .. .. ..
//! ```
//! `.` free, a letter the job holding it (see the job table), `~` a suspended job's and not
//! lent to anyone now, `-` fenced by an exclusive job, `r` reserved (by configuration, or held by an exclusive cpuset topod did not create), `x`
//! outside the allowed set (another cpuset, offline).

use std::fmt::Write;
use topo_core::cpuset::CpuSet;
use topo_core::ledger::Ledger;
use topo_core::topology::{DeviceClass, Domain, MemoryKind, Topology};

/// Columns for the core cells of one line (the rest of 100 holds the labels).
const CELL_COLUMNS: usize = 72;

/// Cores per line: as many cells of `threads` characters and a space as fit, rounded down to a
/// power of two so that lines of one machine align.
fn cores_per_line(threads: usize) -> usize {
    let fit = (CELL_COLUMNS / (threads + 1)).max(1);
    1 << (usize::BITS - 1 - fit.leading_zeros())
}

/// Letters given to jobs, in order of their first CPU.
const LABELS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwyz0123456789";

/// Marks for CPUs that are not plain free or held.
#[derive(Debug, Clone, Default)]
pub struct Marks {
    /// CPUs reserved by configuration.
    pub reserved: CpuSet,
}

/// A sort key that orders runs of digits by their value: `job2` < `job10`.
fn natural_key(id: &str) -> Vec<(u8, u64, String)> {
    let mut key = Vec::new();
    let mut rest = id;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            let (d, r) = rest.split_at(digits);
            key.push((0, d.parse().unwrap_or(u64::MAX), d.to_string()));
            rest = r;
        } else {
            let text = rest.len() - rest.trim_start_matches(|c: char| !c.is_ascii_digit()).len();
            let (t, r) = rest.split_at(text);
            key.push((1, 0, t.to_string()));
            rest = r;
        }
    }
    key
}

/// `text` without what a terminal would act on rather than show: control characters (escape
/// sequences, line breaks) and the invisible marks that reorder or hide text (bidirectional
/// overrides, zero-width characters). Device names come from sysfs, which drivers and udev
/// rules name, and reach messages and listings: they never drive the administrator's terminal.
pub fn printable(text: &str) -> String {
    text.chars().filter(|&c| !c.is_control() && !is_invisible(c)).collect()
}

/// [`printable`], keeping line breaks (a message of several lines).
pub fn printable_lines(text: &str) -> String {
    text.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

fn is_invisible(c: char) -> bool {
    // Unicode's format and separator characters that move, hide or break text: the bidi
    // marks and overrides, zero-width ones, word joiner, soft hyphen, line and paragraph
    // separators.
    matches!(
        c,
        '\u{00ad}'
            | '\u{061c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{2069}'
            | '\u{feff}'
    )
}

/// The widest line of a picture, in columns (one terminal of 100 shows it unwrapped).
const PICTURE_COLUMNS: usize = 100;

/// Draws `topo` with the jobs of `ledger`.
pub fn render(topo: &Topology, ledger: &Ledger, marks: &Marks) -> String {
    let mut out = String::new();
    let c = topo.counts();
    let _ = writeln!(
        out,
        "{}\n{} packages, {} NUMA nodes, {} L3 groups, {} cores, {} of {} PUs allowed",
        topo.short_name(),
        c.packages,
        c.numa_nodes,
        c.l3_groups,
        c.cores,
        c.pus,
        topo.pus.len()
    );
    // Letters follow the jobs' ids in their natural order (job2 before job10), so that A is the
    // first job a person reads in the table below.
    let mut jobs: Vec<_> = ledger.jobs().collect();
    jobs.sort_by_key(|a| natural_key(&a.job));
    let label_of = |cpu: u32| -> Option<char> {
        jobs.iter().position(|a| a.cpus.contains(cpu)).map(|i| LABELS[i % LABELS.len()] as char)
    };
    let fenced = &ledger.occupancy().fenced;
    let mut suspended: Vec<_> = ledger.suspended_jobs().collect();
    suspended.sort_by_key(|a| natural_key(&a.job));
    let suspended_cpus = CpuSet::union_all(suspended.iter().map(|a| &a.cpus));
    let cell = |cpu: u32| -> char {
        if !topo.allowed.contains(cpu) {
            'x'
        } else if marks.reserved.contains(cpu) {
            'r'
        } else if let Some(l) = label_of(cpu) {
            l
        } else if fenced.contains(cpu) {
            '-'
        } else if suspended_cpus.contains(cpu) {
            '~'
        } else {
            '.'
        }
    };
    let mut packages = if topo.packages.is_empty() {
        vec![Domain { os_index: Some(0), cpus: topo.pus.clone() }]
    } else {
        topo.packages.clone()
    };
    packages.sort_by_key(|p| (p.os_index, p.cpus.first()));
    for (pi, pkg) in packages.iter().enumerate() {
        let _ = writeln!(out, "Package {}", pkg.os_index.unwrap_or(pi as u32));
        let numas: Vec<(String, CpuSet)> = {
            let v: Vec<(String, CpuSet)> = topo
                .numa_nodes
                .iter()
                .filter(|n| n.cpus.intersects(&pkg.cpus))
                .map(|n| {
                    let part = if n.cpus.is_subset(&pkg.cpus) { "" } else { " (part)" };
                    (
                        format!("NUMA {}{part}  {}", n.os_index, human_bytes(n.memory_bytes)),
                        n.cpus.intersection(&pkg.cpus),
                    )
                })
                .collect();
            let covered = v.iter().fold(CpuSet::new(), |a, (_, s)| a.union(s));
            let mut v = v;
            let rest = pkg.cpus.difference(&covered);
            if !rest.is_empty() {
                v.push(("no local memory node".to_string(), rest));
            }
            v
        };
        let mut memory_only: Vec<_> = topo
            .numa_nodes
            .iter()
            .filter(|n| n.cpus.is_empty() && n.near_cpus.intersects(&pkg.cpus))
            .collect();
        memory_only.sort_by_key(|n| (n.near_cpus.first(), n.os_index));
        for n in memory_only {
            let kind = match n.kind {
                MemoryKind::Hbm => "high-bandwidth memory",
                MemoryKind::GpuMemory => "GPU memory",
                MemoryKind::FarMemory => "far memory",
                MemoryKind::Dram => "memory",
            };
            let _ = writeln!(
                out,
                "  NUMA {}  {} {}, no CPUs (near PU {})",
                n.os_index,
                human_bytes(n.memory_bytes),
                kind,
                short_list(&n.near_cpus, 30)
            );
        }
        for (label, ncpus) in numas {
            let _ = writeln!(out, "  {label}");
            let groups: Vec<CpuSet> = {
                let mut g: Vec<CpuSet> = topo
                    .l3_groups
                    .iter()
                    .map(|l| l.cpus.intersection(&ncpus))
                    .filter(|s| !s.is_empty())
                    .collect();
                let covered = g.iter().fold(CpuSet::new(), |a, s| a.union(s));
                let rest = ncpus.difference(&covered);
                if !rest.is_empty() {
                    g.push(rest);
                }
                g
            };
            for (gi, gcpus) in groups.iter().enumerate() {
                let l3_name = topo
                    .l3_groups
                    .iter()
                    .position(|l| l.cpus.is_superset_of(gcpus))
                    .map_or_else(|| "     ".to_string(), |i| format!("L3 {i:<2}"));
                let _ = gi;
                let cores: Vec<CpuSet> = cores_in(topo, gcpus);
                let threads = cores.iter().map(|c| c.len()).max().unwrap_or(1);
                for (li, line) in cores.chunks(cores_per_line(threads)).enumerate() {
                    let span = line.iter().fold(CpuSet::new(), |a, s| a.union(s));
                    let head = if li == 0 { l3_name.clone() } else { "     ".to_string() };
                    let cells: Vec<String> =
                        line.iter().map(|core| core.iter().map(cell).collect()).collect();
                    let _ = writeln!(
                        out,
                        "    {head} {:<18} {}",
                        format!("PU {}", short_list(&span, 15)),
                        cells.join(" ")
                    );
                }
            }
        }
    }
    if !jobs.is_empty() {
        let _ = writeln!(out, "\nJobs");
        for (i, a) in jobs.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {}  {:<16} {:>4} {:<3}  PU {}  mem {}",
                LABELS[i % LABELS.len()] as char,
                a.job,
                a.cpus.len(),
                if a.cpus.len() == 1 { "PU" } else { "PUs" },
                a.cpus,
                if a.mems.is_empty() { "-".to_string() } else { a.mems.to_string() }
            );
        }
    }
    if !suspended.is_empty() {
        let _ = writeln!(out, "\nSuspended (frozen; their CPUs may be lent)");
        for a in &suspended {
            let lent = a.cpus.intersection(&ledger.occupancy().held);
            let _ = writeln!(
                out,
                "  ~  {:<16} {:>4} {:<3}  PU {}{}",
                a.job,
                a.cpus.len(),
                if a.cpus.len() == 1 { "PU" } else { "PUs" },
                a.cpus,
                if lent.is_empty() { String::new() } else { format!(", PU {lent} lent now") }
            );
        }
    }
    let mut frozen: Vec<_> = ledger.gang_frozen_jobs().collect();
    frozen.sort_by_key(|a| natural_key(&a.job));
    if !frozen.is_empty() {
        let _ = writeln!(
            out,
            "\nGang jobs frozen until their row's slice (the map shows who runs now)"
        );
        for a in &frozen {
            let _ = writeln!(
                out,
                "     {:<16} {:>4} {:<3}  PU {}  row {}",
                a.job,
                a.cpus.len(),
                if a.cpus.len() == 1 { "PU" } else { "PUs" },
                a.cpus,
                a.gang_row.map_or_else(|| "-".to_string(), |r| r.to_string())
            );
        }
    }
    let foreign = topo.pus.difference(&topo.allowed);
    if !foreign.is_empty() || !marks.reserved.is_empty() || !fenced.is_empty() {
        let _ = writeln!(out);
        if !foreign.is_empty() {
            let _ = writeln!(
                out,
                "  x  PU {} outside the allowed cpuset (another cpuset, or offline)",
                foreign
            );
        }
        if !marks.reserved.is_empty() {
            let _ = writeln!(
                out,
                "  r  PU {} reserved (configuration, or another exclusive cpuset)",
                marks.reserved
            );
        }
        if !fenced.is_empty() {
            let _ = writeln!(out, "  -  PU {} kept free by an exclusive job", fenced);
        }
    }
    let devices: Vec<_> = topo.devices.iter().filter(|d| d.class != DeviceClass::Other).collect();
    if !devices.is_empty() {
        let _ = writeln!(out, "\nDevices");
        for d in devices {
            let names = if d.names.is_empty() {
                String::new()
            } else {
                format!(" ({})", printable(&d.names.join(", ")))
            };
            let mut near = match d.numa_node {
                Some(n) => format!("NUMA {n}"),
                None => "NUMA ?".to_string(),
            };
            // The kernel lists the local CPUs of most devices; a snapshot may not.
            if !d.local_cpus.is_empty() {
                near += &format!(", PU {}", short_list(&d.local_cpus, 40));
            }
            // Devices behind one PCIe switch talk through it, not through the root complex;
            // GPUs joined by NVLink or xGMI talk over those links.
            let links: Vec<String> = d
                .switch()
                .map(|s| format!("PCIe switch {}", printable(s)))
                .into_iter()
                .chain(d.fabric_name().map(|f| printable(&f)))
                .collect();
            let line = format!(
                "  {:<12} {:<12}{}  near {near}",
                format!("{:?}", d.class).to_lowercase(),
                printable(&d.pci_address),
                names,
            );
            let whole = links.iter().fold(line.clone(), |l, link| l + ", " + link);
            // The picture keeps to 100 columns: what does not fit goes on the next line.
            if links.is_empty() || whole.chars().count() <= PICTURE_COLUMNS {
                let _ = writeln!(out, "{whole}");
            } else {
                let _ = writeln!(out, "{line}");
                let _ = writeln!(out, "{:15}{}", "", links.join(", "));
            }
        }
    }
    out
}

fn cores_in(topo: &Topology, cpus: &CpuSet) -> Vec<CpuSet> {
    let mut cores: Vec<CpuSet> =
        topo.cores.iter().map(|c| c.cpus.intersection(cpus)).filter(|s| !s.is_empty()).collect();
    let covered = cores.iter().fold(CpuSet::new(), |a, s| a.union(s));
    for cpu in cpus.difference(&covered).iter() {
        cores.push(std::iter::once(cpu).collect());
    }
    cores.sort_by_key(|c| c.first());
    cores
}

/// The list form, cut with `...` when longer than `max` characters.
fn short_list(set: &CpuSet, max: usize) -> String {
    let s = set.to_string();
    if s.len() <= max {
        return s;
    }
    let cut = s[..max.saturating_sub(3)].rfind(',').unwrap_or(max.saturating_sub(3));
    format!("{}...", &s[..cut])
}

fn human_bytes(b: u64) -> String {
    if b == 0 {
        return "memory size unknown".to_string();
    }
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    if b >= GIB {
        format!("{} GiB", b / GIB)
    } else {
        format!("{} MiB", b / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use topo_core::place::{place, HostModel, Strategy};
    use topo_core::request::Request;

    #[test]
    fn messages_keep_their_lines_but_lose_what_would_drive_a_terminal() {
        let said =
            "no PCI device \"card9\"; there are:\n0000:88:00.0 (\u{1b}]0;PWNED\u{7}ib0\u{202e})";
        assert_eq!(
            printable_lines(said),
            "no PCI device \"card9\"; there are:\n0000:88:00.0 (]0;PWNEDib0)"
        );
        assert_eq!(printable("a\u{061c}b\u{2060}c\u{00ad}d\u{2028}e\u{2069}f"), "abcdef");
    }
    use topo_core::topology::SyntheticShape;

    #[test]
    fn the_picture_shows_jobs_and_fits_100_columns() {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 1,
            l3_per_numa: 12,
            cores_per_l3: 8,
            threads_per_core: 2,
        });
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let mut ledger = Ledger::new();
        for (i, n) in [8u32, 3, 40].into_iter().enumerate() {
            let p =
                place(&model, ledger.occupancy(), &Request::threads(n), Strategy::BestFit).unwrap();
            ledger.allocate(&format!("job{i}"), &p, "").unwrap();
        }
        let pic = render(&topo, &ledger, &Marks::default());
        assert!(pic.lines().all(|l| l.chars().count() <= 100), "{pic}");
        assert!(pic.contains("AA AA AA AA"), "job A holds 4 whole cores:\n{pic}");
        assert!(pic.contains("  C  job2"), "{pic}");
        assert_eq!(pic.lines().filter(|l| l.trim_start().starts_with("L3")).count(), 24);
    }
}
