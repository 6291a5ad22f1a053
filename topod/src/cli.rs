//! The command lines of `topod` and `topo-exec`, in the library so that one generator (`topoctl
//! man`, see [`crate::man`]) makes their manual pages from the same definitions the binaries
//! parse.

use std::path::PathBuf;

/// The configuration file topod reads when `--config` is not given and the file exists.
pub const DEFAULT_CONFIG: &str = "/etc/topo/topod.toml";

/// `topod`'s command line.
#[cfg(feature = "daemon")]
#[derive(Debug, clap::Parser)]
#[command(name = "topod", version, about = "Topology-aware job placement: the per-host daemon")]
pub struct TopodArgs {
    /// Configuration file (TOML); default: /etc/topo/topod.toml when it exists.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Socket to listen on [default: /run/topo/topod.sock].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Directory for the job hint file [default: /run/topo].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// cgroup backend: auto, v1, v2 or fake (in memory, for demos and tests) [default: auto].
    #[arg(long, value_name = "KIND")]
    pub cgroup: Option<crate::daemon::CgroupKind>,
    /// Emulate the machine of this hwloc XML file, or of this directory's sysfs snapshot
    /// (`sys/`, `proc/`), instead of reading /sys.
    #[arg(long, value_name = "FILE|DIR")]
    pub topology: Option<PathBuf>,
    /// Create topod's cgroup subtree in each hierarchy (with the host's CPUs and memory nodes)
    /// and exit: the systemd unit's `ExecStartPre=+`, which runs with root's full privileges,
    /// because the daemon keeps only CAP_KILL, CAP_SYS_NICE and CAP_NET_BIND_SERVICE and cgroup
    /// v1's hierarchy roots are writable only with CAP_DAC_OVERRIDE.
    #[arg(long, conflicts_with = "remove_cgroups")]
    pub prepare_cgroups: bool,
    /// Remove topod's empty cgroup subtree from each hierarchy and exit (the Debian package's
    /// removal, after topod has stopped). A job cgroup still there is left with its processes,
    /// and named; refused while a topod answers on the socket.
    #[arg(long)]
    pub remove_cgroups: bool,
    /// Check the configuration (and the topology file, prime pools and TCP key it names) as a
    /// start would, say what is wrong, and exit: 0 when topod would start with it. The Debian
    /// package runs it before restarting topod on an upgrade.
    #[arg(long, conflicts_with_all = ["prepare_cgroups", "remove_cgroups"])]
    pub check_config: bool,
}

/// `topo-exec`'s command line.
#[derive(Debug, clap::Parser)]
#[command(name = "topo-exec", version, about = "Run a command inside a job's cpuset/cgroup")]
pub struct TopoExecArgs {
    /// The job id [default: lsf-$LSB_JOBID (lsf-$LSB_JOBID[$LSB_JOBINDEX] in an array), $SLURM_JOB_ID or $PBS_JOBID].
    #[arg(long)]
    pub job: Option<String>,
    /// The topology request; without it the job must already be allocated [default: $TOPO_REQUEST].
    #[arg(long)]
    pub request: Option<String>,
    /// Tasks when the request does not say [default: this host's slots in $LSB_MCPU_HOSTS, else $LSB_DJOB_NUMPROC, else 1].
    #[arg(long)]
    pub tasks: Option<u32>,
    /// Write the job's CPUs per task here, one `host cpu_list` line per task, and point
    /// $LSB_AFFINITY_HOSTFILE at it [default under LSF: $TMPDIR/topo-affinity.JOB, else none].
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// A malleable job (request `*min-max`): the signal number topod sends to the job's
    /// processes after it resizes the job, e.g. 10 (SIGUSR1) [default: $TOPO_RESIZE_SIGNAL, else
    /// none]. Either way the job finds its CPUs in the file $TOPO_NOTIFY_FILE names.
    #[arg(long, value_name = "SIGNAL")]
    pub resize_signal: Option<i32>,
    /// topod's socket. When topo-exec allocates the job, it also gives topod the job's queue
    /// ($LSB_QUEUE, $SLURM_JOB_PARTITION or $PBS_QUEUE) and $TOPO_POOL, which prime-time pools
    /// admit jobs by.
    #[arg(long, default_value = topo_core::proto::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}
