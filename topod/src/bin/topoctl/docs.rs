//! `topoctl completions SHELL` and the hidden `topoctl man --out DIR`: both from topoctl's own
//! clap definitions (and, for the pages, topod's and topo-exec's, and topod's configuration
//! type: `topod::man`).

use crate::Failure;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub(crate) enum Docs {
    /// Print a shell completion script for topoctl: bash, zsh, fish, elvish or powershell
    /// (e.g. `topoctl completions bash > /etc/bash_completion.d/topoctl`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (topod.8, topoctl.1 and one per subcommand, topo-exec.1,
    /// topod.toml.5) into a directory.
    #[command(hide = true)]
    Man {
        /// The directory (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

pub(crate) fn run(docs: Docs, mut topoctl: clap::Command) -> Result<(), Failure> {
    match docs {
        Docs::Completions { shell } => {
            clap_complete::generate(shell, &mut topoctl, "topoctl", &mut std::io::stdout());
            Ok(())
        }
        Docs::Man { out } => {
            let written = topod::man::write_all(&out, topoctl).map_err(|e| {
                Failure::runtime(format!("writing the pages in {}: {e}", out.display()))
            })?;
            for path in written {
                println!("{}", path.display());
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_whole_command_line_passes_clap_checks() {
        // Parsing builds only the subcommand used; the pages and completions build them all.
        crate::Cli::command().debug_assert();
    }

    #[test]
    fn completions_name_the_subcommands() {
        for shell in
            [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish]
        {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut crate::Cli::command(), "topoctl", &mut out);
            let text = String::from_utf8(out).unwrap();
            for word in ["alloc", "release", "completions", "socket"] {
                assert!(text.contains(word), "{shell}: no {word}");
            }
        }
    }

    #[test]
    fn pages_for_every_visible_subcommand() {
        let pages = topod::man::pages(crate::Cli::command());
        let files: Vec<&str> = pages.iter().map(|p| p.file.as_str()).collect();
        for file in [
            "topod.8",
            "topo-exec.1",
            "topoctl.1",
            "topoctl-alloc.1",
            "topoctl-bench-daemon.1",
            "topoctl-completions.1",
            "topod.toml.5",
        ] {
            assert!(files.contains(&file), "{file} not in {files:?}");
        }
        assert!(
            !files.iter().any(|f| f.starts_with("topoctl-man") || f.contains("attack")),
            "{files:?}"
        );
    }
}
