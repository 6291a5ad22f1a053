//! The manual pages: topod(8), topoctl(1) with a page per subcommand (topoctl-alloc(1), ...),
//! topo-exec(1) and topod.toml(5).
//!
//! The command pages are rendered by `clap_mangen` from the very clap definitions the binaries
//! parse ([`crate::cli`], topoctl's `Cli`). The configuration page is made from the [`Config`]
//! type itself: its keys are the fields serde reads (taken from the type at run time), each
//! described by the field's own doc comment (read from the source of `daemon/mod.rs`, compiled
//! in), with its line in the default file `packaging/topod.toml`. A test fails when a key has
//! no doc comment, no line in the default file, or no entry in the page.
//!
//! `topoctl man --out DIR` writes them; the Debian package installs them.

use crate::cli::{TopoExecArgs, TopodArgs, DEFAULT_CONFIG};
use crate::daemon::{Config, DEFAULT_SOCKET, DEFAULT_STATE_DIR};
use clap::CommandFactory;
use std::io;
use std::path::{Path, PathBuf};

/// The source of the configuration type, for its fields' doc comments.
const CONFIG_SOURCE: &str = include_str!("daemon/mod.rs");
/// The default configuration file, every key commented out with its default or an example.
pub const DEFAULT_FILE: &str = include_str!("../../packaging/topod.toml");

/// One manual page: its file name (`topod.8`) and its roff text.
#[derive(Debug)]
pub struct Page {
    /// File name, `NAME.SECTION`.
    pub file: String,
    /// The page, roff.
    pub text: String,
}

/// Every page, given topoctl's command (which lives in topoctl's binary).
pub fn pages(topoctl: clap::Command) -> Vec<Page> {
    let mut pages = Vec::new();
    let topod = TopodArgs::command().long_about(TOPOD_DESCRIPTION);
    pages.push(command_page(topod, "8", &[("FILES", TOPOD_FILES)], TOPOD_SEE_ALSO));
    let exec = TopoExecArgs::command().long_about(TOPO_EXEC_DESCRIPTION);
    pages.push(command_page(exec, "1", &[("ENVIRONMENT", TOPO_EXEC_ENVIRONMENT)], EXEC_SEE_ALSO));
    let mut topoctl = topoctl.disable_help_subcommand(true);
    topoctl.build();
    topoctl_pages(&topoctl, &mut pages);
    pages.push(Page { file: "topod.toml.5".into(), text: config_page() });
    pages
}

/// Writes every page into `dir` (created if missing); returns the files written.
pub fn write_all(dir: &Path, topoctl: clap::Command) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for page in pages(topoctl) {
        let path = dir.join(&page.file);
        std::fs::write(&path, page.text)?;
        written.push(path);
    }
    Ok(written)
}

const TOPOD_DESCRIPTION: &str = "topod owns this host's hardware graph and the ledger of which job holds which CPUs and memory nodes. For each job the batch system starts here (through topo-exec, the Slurm plug-in, the PBS hook or topoctl) it picks the CPUs, creates the job's cpuset cgroup under its own subtree, moves the job's processes into it, and removes it when the job is released.

It needs no configuration file: /etc/topo/topod.toml, when it exists, may set any key of topod.toml(5), and the options below override the file. A restart or a crash loses nothing: at start the ledger is rebuilt from the job cgroups that exist. Stopping topod leaves every job running.

Run by systemd (the unit topod.service, Type=notify with a watchdog); the Debian package installs the unit but neither enables nor starts it. Clients reach topod on a Unix socket that everyone may connect to; what each may do is decided from the peer's kernel credentials: root and the administrators of topod.toml(5) allocate and release, a job's owner suspends and resumes it, everyone may look.";

const TOPOD_FILES: &str = ".TP\n/etc/topo/topod.toml\nThe configuration, topod.toml(5).\n.TP\n/run/topo/topod.sock, /run/topo/topod-admin.sock\nThe sockets (the second, mode 0600, for root's clients).\n.TP\n/run/topo/jobs/\nOne record per job (its request, tasks and owner).\n.TP\n/sys/fs/cgroup/cpuset/topo/ (v1), /sys/fs/cgroup/topo.slice/ (v2)\ntopod's cgroup subtree, one cgroup per job (cgroup_subtree in topod.toml(5)).\n";
const TOPOD_SEE_ALSO: &str = "topoctl(1), topo-exec(1), topod.toml(5), systemd.unit(5)";

const TOPO_EXEC_DESCRIPTION: &str = "topo-exec asks the local topod to allocate for the job (when a request is given; an existing allocation for the same job is joined as it is), moves itself into the job's cgroup, exports what the job got, and execs the command. Everything the command forks stays in the job's cgroup.

As an LSF JOB_STARTER (topo-exec -- %USRCMD) the job id is lsf-$LSB_JOBID, the request comes from $TOPO_REQUEST (which esub.topo sets), the tasks are this host's slots in $LSB_MCPU_HOSTS, and an LSB_AFFINITY_HOSTFILE-compatible file is written for MPI launchers.";
const TOPO_EXEC_ENVIRONMENT: &str = ".TP\nTOPO_JOB, TOPO_CPUS, TOPO_MEMS\nSet for the command: its job id, and the CPUs and memory nodes it was given (list format).\n.TP\nLSB_AFFINITY_HOSTFILE\nSet for the command when a host file is written (--hostfile, or under LSF).\n.TP\nLSB_JOBID, LSB_JOBINDEX, SLURM_JOB_ID, PBS_JOBID, TOPO_REQUEST, LSB_MCPU_HOSTS, LSB_DJOB_NUMPROC\nRead for the defaults of --job, --request and --tasks.\n";
const EXEC_SEE_ALSO: &str = "topod(8), topoctl(1)";

/// A command's page from clap, with extra sections (roff bodies) and SEE ALSO.
fn command_page(cmd: clap::Command, section: &str, extra: &[(&str, &str)], see_also: &str) -> Page {
    let man = clap_mangen::Man::new(cmd).section(section).manual("topo");
    let file = man.get_filename();
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    man.render(&mut out).expect("rendering into memory");
    let mut text = String::from_utf8(out).expect("clap_mangen writes UTF-8");
    for (title, body) in extra {
        text.push_str(&format!(".SH {title}\n{body}"));
    }
    text.push_str(&format!(".SH \"SEE ALSO\"\n{}\n", escape(see_also)));
    Page { file, text }
}

/// topoctl's page and one per subcommand, recursively (`topoctl-bench-daemon.1`); hidden ones
/// are left out.
fn topoctl_pages(cmd: &clap::Command, pages: &mut Vec<Page>) {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        topoctl_pages(sub, pages);
    }
    let see_also = if cmd.get_name() == "topoctl" {
        let mut names: Vec<String> = cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| format!("topoctl-{}(1)", s.get_name()))
            .collect();
        names.extend(["topod(8)", "topo-exec(1)", "topod.toml(5)"].map(String::from));
        names.join(", ")
    } else {
        "topoctl(1), topod(8)".to_string()
    };
    pages.push(command_page(cmd.clone(), "1", &[], &see_also));
}

/// One key of topod.toml: a field of [`Config`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigKey {
    /// The key (the field's name).
    pub name: String,
    /// The field's doc comment, joined into one paragraph.
    pub doc: String,
    /// Its lines in the default file, uncommented (`socket = "/run/topo/topod.sock"`).
    pub default_lines: Vec<String>,
}

/// The keys of topod.toml in the order serde reads them, from the [`Config`] type.
pub fn config_key_names() -> &'static [&'static str] {
    struct Grab(Option<&'static [&'static str]>);
    impl<'de> serde::Deserializer<'de> for &mut Grab {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = Some(fields);
            Err(serde::de::Error::custom("only the field names were wanted"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }
    let mut grab = Grab(None);
    let _ = <Config as serde::Deserialize>::deserialize(&mut grab);
    grab.0.unwrap_or(&[])
}

/// The fields of `pub struct Config` in the source with their doc comments, in source order.
fn config_docs() -> Vec<(String, String)> {
    let mut fields = Vec::new();
    let Some(start) = CONFIG_SOURCE.find("\npub struct Config {\n") else { return fields };
    let mut doc: Vec<&str> = Vec::new();
    for line in CONFIG_SOURCE[start..].lines().skip(2) {
        let line = line.trim();
        if line == "}" {
            break;
        }
        if let Some(text) = line.strip_prefix("///") {
            doc.push(text.trim());
        } else if let Some(rest) = line.strip_prefix("pub ") {
            if let Some((name, _)) = rest.split_once(':') {
                fields.push((name.trim().to_string(), doc.join(" ")));
            }
            doc.clear();
        }
    }
    fields
}

/// The keys of topod.toml: the fields serde reads, each with its doc comment and its lines in
/// the default file (empty when the source or the file says nothing; the tests refuse that).
pub fn config_keys() -> Vec<ConfigKey> {
    let docs = config_docs();
    config_key_names()
        .iter()
        .map(|name| ConfigKey {
            name: name.to_string(),
            doc: docs.iter().find(|(n, _)| n == name).map(|(_, d)| d.clone()).unwrap_or_default(),
            default_lines: DEFAULT_FILE
                .lines()
                .filter_map(|l| l.strip_prefix("# "))
                .filter(|l| l.split_once(" = ").is_some_and(|(k, _)| k == *name))
                .map(str::to_string)
                .collect(),
        })
        .collect()
}

/// topod.toml(5).
pub fn config_page() -> String {
    let mut t = String::new();
    t.push_str(".TH topod.toml 5 \"\" \"topod ");
    t.push_str(env!("CARGO_PKG_VERSION"));
    t.push_str(
        "\" topo\n.SH NAME\ntopod.toml \\- configuration of topod, the topo per-host daemon\n",
    );
    t.push_str(".SH SYNOPSIS\n");
    t.push_str(&escape(DEFAULT_CONFIG));
    t.push_str("\n.SH DESCRIPTION\n");
    t.push_str(&escape(&format!(
        "topod(8) runs with no configuration file. When {DEFAULT_CONFIG} exists (or a file is given with --config) it is read at start; it is TOML, and every key is optional. topod refuses unknown keys, wrong types and bad values with the file, line and key in its message, and does not start. Options on topod's command line override the file. A change takes effect when topod is restarted; restarting topod keeps every job."
    )));
    t.push_str("\n.PP\n");
    t.push_str(&escape(&format!(
        "Without the file topod listens on {DEFAULT_SOCKET}, keeps its job records under {DEFAULT_STATE_DIR}, picks the cgroup backend by itself, and lets only root allocate and release."
    )));
    t.push_str("\n.SH KEYS\n");
    for key in config_keys() {
        t.push_str(".TP\n.B ");
        t.push_str(&escape(&key.name));
        t.push('\n');
        t.push_str(&escape(&key.doc));
        t.push('\n');
        if !key.default_lines.is_empty() {
            t.push_str(".RS\n.PP\nIn the default file:\n.nf\n");
            for line in &key.default_lines {
                t.push_str(&escape(line));
                t.push('\n');
            }
            t.push_str(".fi\n.RE\n");
        }
    }
    t.push_str(".SH EXAMPLE\nThe file the package installs, each key commented out with its default or an example:\n.PP\n.nf\n.RS 4\n");
    for line in DEFAULT_FILE.lines() {
        t.push_str(&escape(line));
        t.push('\n');
    }
    t.push_str(".RE\n.fi\n.SH FILES\n.TP\n");
    t.push_str(&escape(DEFAULT_CONFIG));
    t.push_str("\nRead by topod at start when it exists.\n.SH \"SEE ALSO\"\ntopod(8), topoctl(1), topo\\-exec(1)\n");
    t
}

/// Text for roff: backslashes doubled, hyphens as `\-`, a line that would start with a control
/// character protected.
fn escape(text: &str) -> String {
    let body = text.replace('\\', "\\e").replace('-', "\\-");
    body.lines()
        .map(
            |l| {
                if l.starts_with('.') || l.starts_with('\'') {
                    format!("\\&{l}")
                } else {
                    l.into()
                }
            },
        )
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topoctl_like() -> clap::Command {
        clap::Command::new("topoctl")
            .version("1")
            .about("t")
            .subcommand(clap::Command::new("alloc").about("Allocate"))
            .subcommand(clap::Command::new("man").hide(true))
    }

    #[test]
    fn every_config_key_is_documented_in_the_page() {
        let names = config_key_names();
        assert!(names.len() >= 18 && names.contains(&"socket"), "{names:?}");
        let docs = config_docs();
        let doc_names: Vec<&str> = docs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(doc_names, names, "the source's fields and serde's keys differ");
        let page = config_page();
        for key in config_keys() {
            assert!(
                !key.doc.is_empty(),
                "topod.toml key {} has no doc comment in Config",
                key.name
            );
            assert!(
                !key.default_lines.is_empty(),
                "topod.toml key {} has no `# {} = ...` line in packaging/topod.toml",
                key.name,
                key.name
            );
            let entry = format!(".TP\n.B {}\n{}\n", escape(&key.name), escape(&key.doc));
            assert!(page.contains(&entry), "no entry for {} in topod.toml(5)", key.name);
        }
    }

    #[test]
    fn the_default_file_lines_are_valid_settings() {
        // Every commented-out line, uncommented, is a value topod accepts (tcp_listen with a key).
        for key in config_keys() {
            for line in &key.default_lines {
                let text = if key.name == "tcp_listen" {
                    format!("{line}\ntcp_key_file = \"/k\"")
                } else {
                    line.clone()
                };
                Config::parse(Path::new("topod.toml"), &text)
                    .unwrap_or_else(|e| panic!("packaging/topod.toml: {line}: {e}"));
            }
        }
    }

    #[test]
    fn command_pages_come_from_the_clap_definitions() {
        let pages = pages(topoctl_like());
        let files: Vec<&str> = pages.iter().map(|p| p.file.as_str()).collect();
        assert_eq!(
            files,
            ["topod.8", "topo-exec.1", "topoctl-alloc.1", "topoctl.1", "topod.toml.5"],
            "hidden subcommands have no page"
        );
        let topod = &pages[0].text;
        for arg in TopodArgs::command().get_arguments() {
            if let Some(long) = arg.get_long() {
                assert!(topod.contains(&format!("\\-\\-{}", long.replace('-', "\\-"))), "--{long}");
            }
        }
        assert!(topod.contains(".TH topod 8") && topod.contains(".SH FILES"), "{topod}");
        let exec = &pages[1].text;
        assert!(exec.contains("\\-\\-request") && exec.contains("TOPO_CPUS"), "{exec}");
        let main = &pages[3].text;
        assert!(main.contains("topoctl\\-alloc(1)") && !main.contains("topoctl\\-man"), "{main}");
    }

    #[test]
    fn the_package_installs_the_default_file_where_topod_reads_it() {
        // topod's Debian package (topod/Cargo.toml) puts packaging/topod.toml at DEFAULT_CONFIG.
        let manifest = include_str!("../Cargo.toml");
        let asset = format!("[\"../packaging/topod.toml\", \"{}\", \"644\"]", &DEFAULT_CONFIG[1..]);
        assert!(manifest.contains(&asset), "topod/Cargo.toml has no asset {asset}");
    }

    #[test]
    fn roff_escapes() {
        assert_eq!(escape(".x\n'y\na-b\\c"), "\\&.x\n\\&'y\na\\-b\\ec");
    }
}
