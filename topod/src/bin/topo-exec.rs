//! `topo-exec`: run a command inside a job's cgroup, so that nothing it forks can escape.
//!
//! `topo-exec --job ID [--request R] -- CMD ARGS...` asks the local topod to allocate for the job
//! (when `--request` is given; an existing allocation for the same request is reused), moves
//! itself into the job's cgroup, exports what the job got, and execs the command.
//!
//! As an LSF `JOB_STARTER` (`topo-exec -- %USRCMD`) the job id is `lsf-$LSB_JOBID` (with
//! `[$LSB_JOBINDEX]` in a job array), the request comes from `$TOPO_REQUEST` (which `esub.topo`
//! sets), the tasks are this host's slots in `$LSB_MCPU_HOSTS`, and an
//! `LSB_AFFINITY_HOSTFILE`-compatible file is written for MPI launchers.

use clap::Parser;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use topo_client::Client;
use topo_core::batch;
use topo_core::proto::Op;
use topod::cli::TopoExecArgs;

fn main() -> ExitCode {
    let args = TopoExecArgs::parse();
    match run(args) {
        Ok(never) => match never {},
        Err(message) => {
            eprintln!("topo-exec: {message}");
            ExitCode::from(1)
        }
    }
}

enum Never {}

fn run(args: TopoExecArgs) -> Result<Never, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let job = args
        .job
        .or_else(|| batch::job_id(env))
        .ok_or("no job id: give --job or run under LSF, Slurm or PBS")?;
    let request = args.request.or_else(|| env("TOPO_REQUEST"));
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    let tasks = args
        .tasks
        .or_else(|| env("LSB_MCPU_HOSTS").and_then(|m| batch::lsf_slots_on(&m, &host)))
        .or_else(|| env("LSB_DJOB_NUMPROC").and_then(|v| v.parse().ok()));
    let under_lsf = env("LSB_JOBID").is_some();
    let hostfile = args.hostfile.or_else(|| {
        under_lsf.then(|| {
            PathBuf::from(env("TMPDIR").unwrap_or_else(|| "/tmp".into()))
                .join(format!("topo-affinity.{job}"))
        })
    });
    // A command that cannot run is refused before anything is allocated for it: an allocation
    // made here and never used would stay until somebody released it.
    let program = find_command(&args.command[0], env("PATH").as_deref())?;
    let mut client = Client::connect(&args.socket).map_err(|e| e.to_string())?;
    // An allocation made before the job started (by LSF's host pre-exec, as root) is joined as it
    // is; otherwise the job is allocated here (which needs root or an administrator).
    let jobs = client.list().map_err(|e| e.to_string())?;
    let existing = jobs.into_iter().find(|j| j.allocation.job == job).map(|j| j.allocation);
    let allocated_here = existing.is_none();
    let alloc = match (existing, request) {
        (Some(a), _) => a,
        (None, Some(request)) => client
            .allocate(Op::Allocate(topo_core::proto::AllocateArgs {
                tasks,
                owner_uid: Some(nix::unistd::getuid().as_raw()),
                resize_signal: args
                    .resize_signal
                    .or_else(|| env("TOPO_RESIZE_SIGNAL").and_then(|v| v.parse().ok())),
                // The prime-time pools admit by queue (the batch system's), owner, or name.
                queue: env("LSB_QUEUE")
                    .or_else(|| env("SLURM_JOB_PARTITION"))
                    .or_else(|| env("PBS_QUEUE")),
                pool: env("TOPO_POOL"),
                ..topo_core::proto::AllocateArgs::new(job.clone(), request)
            }))
            .map_err(|e| e.to_string())?,
        (None, None) => {
            return Err(format!("job {job} has no allocation on this host; give --request"))
        }
    };
    client.join_self(&job).map_err(|e| e.to_string())?;
    // GPUs topod chose (the request's gpus=): the job is told which (a batch system that
    // named them has told it already, in its own variables). And the network adapters nearest
    // its GPUs (or CPUs), by interface name.
    let view =
        client.list().map_err(|e| e.to_string())?.into_iter().find(|j| j.allocation.job == job);
    let chosen_gpus: Vec<String> =
        if topo_core::request::parse(&alloc.request).is_ok_and(|r| r.gpus_per_task.is_some()) {
            // A GPU the host no longer has is not the job's to use.
            view.iter()
                .flat_map(|j| j.gpus.iter().filter(|g| !g.gone).map(|g| g.pci_address.clone()))
                .collect()
        } else {
            Vec::new()
        };
    let nics: Vec<String> = view
        .iter()
        .flat_map(|j| &j.nics)
        .map(|n| {
            // A name a list could not carry (a separator, a space, a control character) is
            // replaced by the adapter's PCI address.
            let usable = |name: &&String| {
                !name.is_empty()
                    && !name
                        .chars()
                        .any(|c| c == ',' || c == ';' || c.is_whitespace() || c.is_control())
            };
            n.names.first().filter(usable).unwrap_or(&n.pci_address).clone()
        })
        .collect();
    let cpus = alloc.cpus.to_string();
    let mems = alloc.mems.to_string();
    let mut command = Command::new(&program);
    command
        .arg0(&args.command[0])
        .args(&args.command[1..])
        .env("TOPO_JOB", &job)
        .env("TOPO_CPUS", &cpus)
        .env("TOPO_MEMS", &mems)
        .env("TOPO_NOTIFY_FILE", topo_core::proto::notify_file_for(&args.socket, &job));
    // What the job is told of its GPUs and adapters, most needed first: each only if the new
    // program's arguments and environment still fit what the kernel allows with it (an exec
    // that fails with E2BIG would leave the job allocated and never run).
    let mut lists: Vec<(&str, String)> = Vec::new();
    let mut dropped: Vec<&str> = OWN_LISTS.to_vec();
    if !chosen_gpus.is_empty() {
        match nvidia_uuids(std::path::Path::new("/"), &chosen_gpus) {
            Some(uuids) => {
                // By UUID: CUDA's own numbering depends on its enumeration order and on which
                // devices the job's cgroup lets it open.
                lists.push(("CUDA_VISIBLE_DEVICES", uuids.join(",")));
            }
            None => {
                eprintln!(
                    "topo-exec: job {job}: GPUs {} (TOPO_GPUS); CUDA_VISIBLE_DEVICES not set (and one from the environment removed): not every one is an NVIDIA GPU whose UUID /proc/driver/nvidia/gpus says",
                    chosen_gpus.join(", ")
                );
                // One inherited from the submission (qsub -V, bsub's copied environment)
                // numbers GPUs of another host or job.
                dropped.push("CUDA_VISIBLE_DEVICES");
            }
        }
        lists.push(("TOPO_GPUS", chosen_gpus.join(",")));
    }
    // Each task's GPUs, the nearest its CPUs: "task0,task0;task1" (for a launcher that binds
    // each rank to its own, as Slurm's --gpu-bind=closest does per task).
    let task_gpus: Vec<String> =
        view.iter().flat_map(|j| &j.task_gpus).map(|t| t.join(",")).collect();
    if !task_gpus.is_empty() {
        lists.push(("TOPO_TASK_GPUS", task_gpus.join(";")));
    }
    if !nics.is_empty() {
        lists.push(("TOPO_NICS", nics.join(",")));
    }
    // topo's own lists from an outer job's environment are never this job's: gone, set or not
    // (and so is CUDA_VISIBLE_DEVICES when topod chose the GPUs and it cannot be set).
    let replaced = |name: &std::ffi::OsStr| {
        dropped.iter().chain(lists.iter().map(|(n, _)| n)).any(|own| name == *own)
    };
    for name in dropped.iter().chain(lists.iter().map(|(n, _)| n)) {
        command.env_remove(name);
    }
    let mut budget = ExecBudget::for_this_process(
        std::iter::once(program.as_os_str().len())
            .chain(args.command.iter().map(String::len))
            .chain(
                std::env::vars_os()
                    .filter(|(k, _)| !replaced(k) && command.get_envs().all(|(set, _)| set != k))
                    .map(|(k, v)| k.len() + 1 + v.len()),
            )
            .chain(command.get_envs().filter_map(|(k, v)| Some(k.len() + 1 + v?.len())))
            .chain(hostfile.iter().map(|p| "LSB_AFFINITY_HOSTFILE=".len() + p.as_os_str().len())),
        script_reserve(&program),
    );
    for (name, value) in lists {
        match budget.admit(name, &value) {
            Ok(()) => {
                command.env(name, value);
            }
            Err(why) => eprintln!("topo-exec: job {job}: {name} not set: {why}"),
        }
    }
    if let Some(path) = hostfile {
        let tasks: Vec<String> = alloc.tasks.iter().map(|t| t.to_string()).collect();
        let tasks = if tasks.is_empty() { vec![cpus.clone()] } else { tasks };
        std::fs::write(&path, batch::affinity_hostfile(&host, &tasks))
            .map_err(|e| format!("cannot write the affinity host file {}: {e}", path.display()))?;
        command.env("LSB_AFFINITY_HOSTFILE", &path);
    }
    let err = command.exec();
    // The file is there (checked above): ENOENT now means what its #! line names is not.
    let interpreter = if err.kind() == std::io::ErrorKind::NotFound && program.exists() {
        " (the file is there: the interpreter its #! line names is not)"
    } else {
        ""
    };
    let stays = if allocated_here {
        format!(" (job {job} was allocated for it and stays so until released: topoctl release {job}, or by itself with auto_release)")
    } else {
        String::new()
    };
    Err(format!("cannot run {}: {err}{interpreter}{stays}", shown(&args.command[0])))
}

/// The file `command` names, as `execvp` would find it: a path with a slash as it is, else the
/// first executable file of that name in `path` (the `PATH` variable; `/usr/bin:/bin` when
/// unset; an empty entry, which `execvp` takes for the current directory, is skipped). An error
/// says why it cannot run.
fn find_command(command: &str, path: Option<&str>) -> Result<PathBuf, String> {
    let runnable = |file: &std::path::Path| -> Result<(), String> {
        let meta = std::fs::metadata(file).map_err(|e| e.to_string())?;
        if meta.is_dir() {
            return Err("it is a directory".into());
        }
        nix::unistd::access(file, nix::unistd::AccessFlags::X_OK)
            .map_err(|_| "it is not executable".to_string())
    };
    if command.is_empty() {
        return Err("no command given after --".into());
    }
    if command.contains('/') {
        let file = PathBuf::from(command);
        return runnable(&file)
            .map(|()| file)
            .map_err(|why| format!("cannot run {}: {why}", shown(command)));
    }
    let path = path.unwrap_or("/usr/bin:/bin");
    let mut found_unrunnable = None;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let file = PathBuf::from(dir).join(command);
        match runnable(&file) {
            Ok(()) => return Ok(file),
            Err(why) if file.exists() => found_unrunnable = Some((file, why)),
            Err(_) => {}
        }
    }
    Err(match found_unrunnable {
        Some((file, why)) => {
            format!("cannot run {}: {}: {why}", shown(command), shown(&file.to_string_lossy()))
        }
        None => format!("cannot run {}: no such command in PATH ({})", shown(command), shown(path)),
    })
}

/// A name the user gave, as an error shows it: no control characters or invisible marks (a
/// command name must not drive the terminal the error is printed on).
fn shown(text: &str) -> String {
    topod::picture::printable(text)
}

/// What a new program's arguments and environment may still take, as the kernel counts them
/// (execve(2), "Limits on size of arguments and environment"; fs/exec.c, `bprm_stack_limits`):
/// all the strings, each with its NUL, and a pointer for each, within a quarter of the stack
/// limit (at most 3/4 of 8 MiB, at least `ARG_MAX`); and each string within 32 pages
/// (`MAX_ARG_STRLEN`). Past either the exec fails with E2BIG.
struct ExecBudget {
    /// Bytes left for more strings and their pointers.
    left: usize,
    /// The whole allowance, for messages.
    limit: usize,
    /// The most one string may take.
    one_string: usize,
}

impl ExecBudget {
    /// The budget under this process's stack limit (`ulimit -s`), with the strings of
    /// `lengths` (file name, arguments, environment; without their NULs) and `reserve` more
    /// bytes already taken.
    fn for_this_process(lengths: impl Iterator<Item = usize>, reserve: usize) -> Self {
        use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
        let stack = getrlimit(Resource::RLIMIT_STACK)
            .ok()
            .map(|(soft, _)| soft)
            .filter(|&soft| soft != RLIM_INFINITY);
        let mut budget = Self::new(stack, page_size(), lengths);
        budget.left = budget.left.saturating_sub(reserve);
        budget
    }

    fn new(stack_limit: Option<u64>, page: usize, lengths: impl Iterator<Item = usize>) -> Self {
        let quarter =
            stack_limit.map_or(usize::MAX, |s| usize::try_from(s / 4).unwrap_or(usize::MAX));
        let limit = quarter.clamp(ARG_MAX, (8 << 20) / 4 * 3);
        let mut budget = Self { left: limit, limit, one_string: 32 * page };
        // Each string with its NUL and its pointer; one pointer more for the list's end.
        let taken: usize = lengths.map(|n| n + 1 + POINTER).sum::<usize>() + POINTER;
        budget.left = budget.left.saturating_sub(taken);
        budget
    }

    /// Takes `name=value` from the budget, or says why it does not fit.
    fn admit(&mut self, name: &str, value: &str) -> Result<(), String> {
        let bytes = name.len() + 1 + value.len() + 1;
        if bytes > self.one_string {
            return Err(format!(
                "it would take {bytes} bytes, more than one environment variable may hold ({}); set, the command could not have started",
                self.one_string
            ));
        }
        if bytes + POINTER > self.left {
            return Err(format!(
                "its {bytes} bytes would take the command's arguments and environment past the {} bytes a new program may have (a quarter of the stack limit, ulimit -s); set, the command could not have started",
                self.limit
            ));
        }
        self.left -= bytes + POINTER;
        Ok(())
    }
}

/// What the kernel may add to the arguments of `program` when it is a script: its `#!` line's
/// interpreter with its one argument (within a buffer of 256 bytes, `BINPRM_BUF_SIZE`) and the
/// script's path again, each with its pointer (fs/binfmt_script.c).
fn script_reserve(program: &std::path::Path) -> usize {
    256 + 1 + POINTER + program.as_os_str().len() + 1 + POINTER
}

/// The variables only topo-exec sets: one inherited from an outer job is never this job's.
const OWN_LISTS: [&str; 3] = ["TOPO_GPUS", "TOPO_TASK_GPUS", "TOPO_NICS"];

/// The least the kernel allows a new program's arguments and environment whatever the stack
/// limit (`ARG_MAX` in the kernel's include/uapi/linux/limits.h: bytes, not pages).
const ARG_MAX: usize = 131_072;

/// The size of a pointer in the new program's argument and environment lists.
const POINTER: usize = std::mem::size_of::<usize>();

/// The page size (32 of them is `MAX_ARG_STRLEN`).
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions; it returns -1 for a name it does not know.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// The UUIDs of the NVIDIA GPUs at PCI `addresses` (`GPU UUID:` in the driver's
/// `proc/driver/nvidia/gpus/ADDRESS/information` under `root`), what `CUDA_VISIBLE_DEVICES`
/// takes; `None` unless every one has one.
fn nvidia_uuids(root: &std::path::Path, addresses: &[String]) -> Option<Vec<String>> {
    addresses
        .iter()
        .map(|address| {
            let info = std::fs::read_to_string(
                root.join("proc/driver/nvidia/gpus").join(address).join("information"),
            )
            .ok()?;
            let uuid = info.lines().find_map(|l| l.strip_prefix("GPU UUID:"))?.trim();
            (uuid.starts_with("GPU-") && !uuid.contains(',')).then(|| uuid.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_command_is_found_as_execvp_would_or_refused_saying_why() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, other) = (dir.path().join("bin"), dir.path().join("other"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(other.join("dir")).unwrap();
        let file = |path: &std::path::Path, mode: u32| {
            std::fs::write(path, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        file(&bin.join("job"), 0o755);
        file(&other.join("plain"), 0o644);
        let path = format!("{}::{}", other.display(), bin.display());
        let found = super::find_command("job", Some(&path)).unwrap();
        assert_eq!(found, bin.join("job"));
        let e = super::find_command("nope", Some(&path)).unwrap_err();
        assert!(e.contains("nope: no such command in PATH"), "{e}");
        let e = super::find_command("dir", Some(&path)).unwrap_err();
        assert!(e.contains("it is a directory"), "{e}");
        let absolute = other.join("missing");
        let e = super::find_command(absolute.to_str().unwrap(), None).unwrap_err();
        assert!(e.contains("No such file"), "{e}");
        if !nix::unistd::geteuid().is_root() {
            let e = super::find_command("plain", Some(&path)).unwrap_err();
            assert!(e.contains("not executable"), "{e}");
        }
        let e = super::find_command(other.join("plain").to_str().unwrap(), None);
        // Root may read it but not run it either: no execute bit at all.
        assert!(e.unwrap_err().contains("not executable"));
        assert_eq!(super::find_command("sh", None).unwrap().file_name().unwrap(), "sh");
    }

    #[test]
    fn a_list_too_long_for_one_environment_string_is_left_out_not_the_job() {
        let page = super::page_size();
        let name = "TOPO_NICS";
        let most = 32 * page - name.len() - 2;
        let fresh = || super::ExecBudget::new(None, page, std::iter::empty());
        assert_eq!(fresh().admit(name, &"x".repeat(most)), Ok(()));
        let e = fresh().admit(name, &"x".repeat(most + 1)).unwrap_err();
        assert!(e.contains(&format!("{} bytes", 32 * page + 1)), "{e}");
        assert!(e.contains("could not have started"), "{e}");
        // What the kernel says of the longest that passes and the shortest that does not.
        let run = |length: usize| {
            std::process::Command::new("/bin/true").env(name, "x".repeat(length)).status()
        };
        assert!(run(most).unwrap().success());
        assert_eq!(run(most + 1).unwrap_err().raw_os_error(), Some(libc::E2BIG));
    }

    /// `command` runs under a stack limit of `stack` bytes (`ulimit -s`), set in the child.
    fn under_stack_limit(command: &mut std::process::Command, stack: u64) {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe, all the child does before exec.
        unsafe {
            command.pre_exec(move || {
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_STACK,
                    stack,
                    stack,
                )
                .map_err(std::io::Error::from)
            });
        }
    }

    #[test]
    fn the_lists_are_left_out_when_the_whole_environment_would_not_fit() {
        // A stack limit of 512 KiB leaves a new program 128 KiB of arguments and environment.
        let stack = 512 * 1024;
        let page = super::page_size();
        let program = "/bin/true";
        let taken = || [program.len(), program.len(), "A=".len() + 90_000].into_iter();
        let mut budget = super::ExecBudget::new(Some(stack), page, taken());
        // The largest B the budget admits beside A, found by halving.
        let (mut fits, mut fails) = (0, 200_000);
        while fails - fits > 1 {
            let mid = (fits + fails) / 2;
            let mut trial = super::ExecBudget::new(Some(stack), page, taken());
            if trial.admit("B", &"x".repeat(mid)).is_ok() {
                fits = mid;
            } else {
                fails = mid;
            }
        }
        assert!(fits > 0 && fits < 128 * 1024 - 90_000, "{fits}");
        let e = budget.admit("B", &"x".repeat(fails)).unwrap_err();
        assert!(e.contains("a quarter of the stack limit"), "{e}");
        // The kernel agrees: what the budget admits runs, and a page more does not.
        let run = |b: usize| {
            let mut command = std::process::Command::new(program);
            command.env_clear().env("A", "a".repeat(90_000)).env("B", "b".repeat(b));
            under_stack_limit(&mut command, stack);
            command.status()
        };
        assert!(run(fits).unwrap().success());
        assert_eq!(run(fits + page).unwrap_err().raw_os_error(), Some(libc::E2BIG));
    }

    #[test]
    fn a_script_found_by_a_short_name_at_a_long_path_still_starts() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        // The kernel gives a #! script its interpreter and its whole path as arguments: the
        // budget keeps room for them, so what it admits runs even so.
        let stack = 512 * 1024;
        let page = super::page_size();
        let dir = tempfile::tempdir().unwrap();
        let long = dir.path().join("d".repeat(200));
        std::fs::create_dir(&long).unwrap();
        let script = long.join("j");
        std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = script.as_os_str().len();
        let budget = || {
            let mut b =
                super::ExecBudget::new(Some(stack), page, [file, 1, 2 + 90_000].into_iter());
            b.left -= super::script_reserve(&script);
            b
        };
        let (mut fits, mut fails) = (0, 200_000);
        while fails - fits > 1 {
            let mid = (fits + fails) / 2;
            if budget().admit("B", &"x".repeat(mid)).is_ok() {
                fits = mid;
            } else {
                fails = mid;
            }
        }
        let mut command = std::process::Command::new(&script);
        command.arg0("j").env_clear().env("A", "a".repeat(90_000)).env("B", "b".repeat(fits));
        under_stack_limit(&mut command, stack);
        assert!(command.status().unwrap().success(), "B of {fits} bytes");
    }

    #[test]
    fn cuda_is_told_the_gpus_by_uuid_or_not_at_all() {
        let root = tempfile::tempdir().unwrap();
        let info = |address: &str, text: &str| {
            let dir = root.path().join("proc/driver/nvidia/gpus").join(address);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("information"), text).unwrap();
        };
        info(
            "0000:18:00.0",
            "Model: A100\nGPU UUID: \t GPU-1b2c3d4e-0000-1111-2222-333344445555\n",
        );
        info("0000:19:00.0", "Model: A100\nDevice Minor: 1\n");
        let addresses = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            super::nvidia_uuids(root.path(), &addresses(&["0000:18:00.0"])).unwrap(),
            ["GPU-1b2c3d4e-0000-1111-2222-333344445555"]
        );
        assert_eq!(
            super::nvidia_uuids(root.path(), &addresses(&["0000:18:00.0", "0000:19:00.0"])),
            None
        );
        assert_eq!(super::nvidia_uuids(root.path(), &addresses(&["0000:86:00.0"])), None);
    }
}
