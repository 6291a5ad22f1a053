//! The canonical text of a [`Request`] (`Display`), and the invariants that make it reparse to
//! the same `Request` ([`Request::validate`]).
//!
//! The canonical form is documented on `impl Display for Request`.

use super::parse::{check_name, CpusetKey, MAX_COUNT, MAX_MEM_MIB};
use super::{CpusetOption, CpusetType, Distribute, MemBind, Request, Scope};
use std::fmt;

impl Scope {
    /// The LSF keyword: `intask`, `injob`, `alljobs`.
    pub fn name(self) -> &'static str {
        match self {
            Scope::InTask => "intask",
            Scope::InJob => "injob",
            Scope::AllJobs => "alljobs",
        }
    }
}

impl CpusetOption {
    /// The LSF keyword, e.g. `CPUSET_CPU_EXCLUSIVE`.
    pub fn name(self) -> &'static str {
        match self {
            CpusetOption::CpuExclusive => "CPUSET_CPU_EXCLUSIVE",
            CpusetOption::MemoryLocal => "CPUSET_MEMORY_LOCAL",
            CpusetOption::MemoryExclusive => "CPUSET_MEMORY_EXCLUSIVE",
            CpusetOption::MemoryKernelAvoid => "CPUSET_MEMORY_KERNEL_AVOID",
            CpusetOption::MemoryMandatory => "CPUSET_MEMORY_MANDATORY",
            CpusetOption::PolicyPage => "CPUSET_POLICY_PAGE",
            CpusetOption::PolicyKill => "CPUSET_POLICY_KILL",
            CpusetOption::EventNotify => "CPUSET_EVENT_NOTIFY",
        }
    }
}

impl CpusetType {
    /// The keyword value, in lower case as LSF's docs write it: `static`, `dynamic`, `none`.
    pub fn name(self) -> &'static str {
        match self {
            CpusetType::Static => "static",
            CpusetType::Dynamic => "dynamic",
            CpusetType::None => "none",
        }
    }
}

impl Request {
    /// Whether any `CPUSET[...]` keyword is set.
    pub fn has_cpuset_keywords(&self) -> bool {
        self.cpuset_type.is_some()
            || self.cpuset_name.is_some()
            || self.cpu_list.is_some()
            || !self.cpuset_options.is_empty()
            || self.max_radius.is_some()
            || self.max_cpu_per_node.is_some()
            || self.resume_option.is_some()
    }

    /// Whether any field of the `affinity[...]` section differs from [`Request::default`].
    pub fn has_affinity_settings(&self) -> bool {
        let d = Request::default();
        self.tasks != d.tasks
            || self.tasks_max != d.tasks_max
            || self.unit != d.unit
            || self.units_per_task != d.units_per_task
            || self.same != d.same
            || self.exclusive != d.exclusive
            || self.cpubind != d.cpubind
            || self.membind != d.membind
            || self.distribute != d.distribute
            || self.mem_mib != d.mem_mib
            || self.gpubind != d.gpubind
            || self.gpus_per_task != d.gpus_per_task
    }

    /// Checks the invariants that every parsed `Request` satisfies, and that a `Request` built
    /// in code must satisfy for its text to parse back to it: counts in `1..=65536` (`MAX_RADIUS`
    /// may be 0), `same=` and `exclusive=` levels not below the unit, a valid `CPUSET_NAME`, a
    /// non-empty `CPU_LIST`, `CPUSET_OPTIONS` sorted without repeats, `mem_mib` in
    /// `1..=2^40`, `gpus_per_task` in `1..=65536` and not with a task range. The error says which field is wrong.
    pub fn validate(&self) -> Result<(), String> {
        let count_ok = |n: u32| (1..=MAX_COUNT).contains(&n);
        if let Some(t) = self.tasks.filter(|&t| !count_ok(t)) {
            return Err(format!("tasks = {t}, outside 1..={MAX_COUNT}"));
        }
        if let Some(max) = self.tasks_max {
            match self.tasks {
                None => return Err(format!("tasks_max = {max} without a least task count")),
                Some(min) if max <= min || max > MAX_COUNT => {
                    return Err(format!("tasks_max = {max}, outside {}..={MAX_COUNT}", min + 1))
                }
                Some(_) => {}
            }
        }
        if !count_ok(self.units_per_task) {
            return Err(format!(
                "units_per_task = {}, outside 1..={MAX_COUNT}",
                self.units_per_task
            ));
        }
        if let Some(same) = self.same.filter(|&l| l < self.unit) {
            return Err(format!("same={same} is smaller than the unit {}", self.unit));
        }
        if let Some(ex) = self.exclusive.filter(|e| e.level < self.unit) {
            return Err(format!(
                "exclusive level {} is smaller than the unit {}",
                ex.level, self.unit
            ));
        }
        if let Distribute::Pack(Some((_, n))) = self.distribute {
            if !count_ok(n) {
                return Err(format!("pack count {n} outside 1..={MAX_COUNT}"));
            }
        }
        if let Some(name) = &self.cpuset_name {
            check_name(name).map_err(|why| format!("CPUSET_NAME {name:?}: {why}"))?;
        }
        if self.cpu_list.as_ref().is_some_and(|l| l.is_empty()) {
            return Err("CPU_LIST is empty".into());
        }
        if self
            .cpu_list
            .as_ref()
            .and_then(|l| l.last())
            .is_some_and(|c| c > crate::cpuset::MAX_CPU_ID)
        {
            return Err("CPU_LIST names a CPU above the largest id accepted".into());
        }
        if !self.cpuset_options.windows(2).all(|w| w[0] < w[1]) {
            return Err("CPUSET_OPTIONS not sorted or repeated".into());
        }
        if let Some(r) = self.max_radius.filter(|&r| r > MAX_COUNT) {
            return Err(format!("MAX_RADIUS = {r} above {MAX_COUNT}"));
        }
        if let Some(n) = self.max_cpu_per_node.filter(|&n| !count_ok(n)) {
            return Err(format!("MAX_CPU_PER_NODE = {n} outside 1..={MAX_COUNT}"));
        }
        if let Some(m) = self.mem_mib.filter(|&m| m == 0 || m > MAX_MEM_MIB) {
            return Err(format!("mem_mib = {m} outside 1..={MAX_MEM_MIB}"));
        }
        if let Some(n) = self.gpus_per_task.filter(|&n| !count_ok(n)) {
            return Err(format!("gpus_per_task = {n}, outside 1..={MAX_COUNT}"));
        }
        if self.gpus_per_task.is_some() && self.tasks_max.is_some() {
            return Err("gpus_per_task with a task range (GPUs do not resize with a job)".into());
        }
        Ok(())
    }

    fn fmt_cpuset(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CPUSET[")?;
        let mut first = true;
        for key in CpusetKey::ALL {
            let value = match key {
                CpusetKey::CpusetType => self.cpuset_type.map(|t| t.name().to_string()),
                CpusetKey::CpusetName => self.cpuset_name.clone(),
                CpusetKey::CpuList => self.cpu_list.as_ref().map(ToString::to_string),
                CpusetKey::CpusetOptions => (!self.cpuset_options.is_empty()).then(|| {
                    self.cpuset_options.iter().map(|o| o.name()).collect::<Vec<_>>().join(" ")
                }),
                CpusetKey::MaxRadius => self.max_radius.map(|n| n.to_string()),
                CpusetKey::MaxCpuPerNode => self.max_cpu_per_node.map(|n| n.to_string()),
                CpusetKey::ResumeOption => self.resume_option.map(|_| "ORIG_CPUS".to_string()),
            };
            if let Some(value) = value {
                if !first {
                    f.write_str(";")?;
                }
                first = false;
                write!(f, "{}={value}", key.name())?;
            }
        }
        f.write_str("]")
    }

    fn fmt_affinity(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "affinity[{}", self.unit)?;
        if self.units_per_task != 1 || self.same.is_some() || self.exclusive.is_some() {
            write!(f, "({}", self.units_per_task)?;
            if let Some(same) = self.same {
                write!(f, ",same={same}")?;
            }
            if let Some(ex) = self.exclusive {
                write!(f, ",exclusive=({},{})", ex.level, ex.scope.name())?;
            }
            f.write_str(")")?;
        }
        if let Some(tasks) = self.tasks {
            write!(f, "*{tasks}")?;
            if let Some(max) = self.tasks_max {
                write!(f, "-{max}")?;
            }
        }
        if let Some(level) = self.cpubind {
            write!(f, ":cpubind={level}")?;
        }
        if self.membind == MemBind::LocalOnly {
            f.write_str(":membind=localonly")?;
        }
        match self.distribute {
            Distribute::Any => {}
            Distribute::Balance => f.write_str(":distribute=balance")?,
            Distribute::Pack(None) => f.write_str(":distribute=pack")?,
            Distribute::Pack(Some((level, n))) => write!(f, ":distribute=pack({level}={n})")?,
        }
        if let Some(mib) = self.mem_mib {
            write!(f, ":mem={}", format_size(mib))?;
        }
        if let Some(bind) = self.gpubind {
            write!(f, ":gpubind={}", bind.name())?;
        }
        if let Some(n) = self.gpus_per_task {
            write!(f, ":gpus={n}")?;
        }
        f.write_str("]")
    }
}

/// `mib` with the largest binary unit that is exact: `4G`, `1536M`, `2T`.
fn format_size(mib: u64) -> String {
    if mib != 0 && mib % (1 << 20) == 0 {
        format!("{}T", mib >> 20)
    } else if mib != 0 && mib % (1 << 10) == 0 {
        format!("{}G", mib >> 10)
    } else {
        format!("{mib}M")
    }
}

/// The canonical text: for every `Request` that passes [`Request::validate`],
/// `parse(&r.to_string()) == Ok(r)`.
///
/// Canonical form:
/// - `CPUSET[...]` first, only when some `CPUSET` keyword is set; keywords in the order
///   `CPUSET_TYPE, CPUSET_NAME, CPU_LIST, CPUSET_OPTIONS, MAX_RADIUS, MAX_CPU_PER_NODE,
///   RESUME_OPTION`, separated by `;`, no trailing `;`; `CPUSET_TYPE` in lower case, CPU lists
///   without spaces (`1,5,7-12`), options in upper case separated by one space, in
///   [`CpusetOption`]'s order;
/// - then, separated by one space, `affinity[...]` when some affinity field differs from the
///   default or when no `CPUSET` keyword is set (so that the text is never empty): lower case,
///   canonical level names (`thread`, not `cpu`), `unit` alone when there is one unit per task
///   and no unit option, else `unit(n[,same=..][,exclusive=(level,scope)])` (the scope always
///   written), then `*tasks`, then `:cpubind=`, `:membind=localonly`, `:distribute=` and
///   `:mem=`, `:gpubind=` and `:gpus=`, in that order, each only when not the default.
impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cpuset = self.has_cpuset_keywords();
        if cpuset {
            self.fmt_cpuset(f)?;
        }
        if self.has_affinity_settings() || !cpuset {
            if cpuset {
                f.write_str(" ")?;
            }
            self.fmt_affinity(f)?;
        }
        Ok(())
    }
}
