//! Takes `plugin_version`, the `spank_item` numbers and the special step ids from the installed
//! Slurm headers.
//!
//! Slurm refuses a SPANK plug-in whose major.minor differs from its own, so the version must be
//! the one of the Slurm that will load the module: `SLURM_VERSION_NUMBER` from
//! `slurm/slurm_version.h` (directory: `$SLURM_INCLUDE_DIR`, default `/usr/include`; Debian's
//! `libslurm-dev`). The `spank_item` enum is read from `slurm/spank.h` so that the item numbers
//! follow the header too, and the step ids of the batch script, the extern step and the
//! interactive step (`SLURM_BATCH_SCRIPT`, ... in `slurm/slurm.h`; they changed in 20.11) go to
//! `slurm_steps.rs`, which the pure code includes (its tests build without Slurm).
//!
//! Without the headers the crate still builds (so `cargo build --workspace` works anywhere),
//! with a warning and `plugin_version = 0`: Slurm then refuses to load the module ("Incompatible
//! Slurm plugin version"), never runs it with a wrong ABI. Set `TOPO_REQUIRE_SLURM=1` to make
//! missing headers a build error instead (the Slurm tests do).

use std::path::PathBuf;

/// The items the plug-in reads, and their numbers in Slurm 22.05 (used only without headers).
const ITEMS: &[(&str, u32)] = &[
    ("S_JOB_UID", 0),
    ("S_JOB_ID", 2),
    ("S_JOB_STEPID", 3),
    ("S_JOB_LOCAL_TASK_COUNT", 6),
    ("S_TASK_ID", 11),
    ("S_JOB_ALLOC_CORES", 25),
    ("S_JOB_ALLOC_MEM", 26),
    ("S_STEP_ALLOC_CORES", 27),
];

/// The special step ids the plug-in names, and their values in Slurm 22.05 (used only without
/// headers).
const STEPS: &[(&str, u32)] = &[
    ("SLURM_PENDING_STEP", 0xffff_fffd),
    ("SLURM_EXTERN_CONT", 0xffff_fffc),
    ("SLURM_BATCH_SCRIPT", 0xffff_fffb),
    ("SLURM_INTERACTIVE_STEP", 0xffff_fffa),
];

fn main() {
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=TOPO_REQUIRE_SLURM");
    let include =
        PathBuf::from(std::env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".into()));
    let version_h = include.join("slurm/slurm_version.h");
    let spank_h = include.join("slurm/spank.h");
    let slurm_h = include.join("slurm/slurm.h");
    println!("cargo:rerun-if-changed={}", version_h.display());
    println!("cargo:rerun-if-changed={}", spank_h.display());
    println!("cargo:rerun-if-changed={}", slurm_h.display());
    let required = std::env::var("TOPO_REQUIRE_SLURM").map(|v| v == "1").unwrap_or(false);

    let found = std::fs::read_to_string(&version_h)
        .ok()
        .zip(std::fs::read_to_string(&spank_h).ok())
        .zip(std::fs::read_to_string(&slurm_h).ok());
    let (version, items, steps) = match found {
        Some(((version_text, spank_text), slurm_text)) => {
            let version = parse_version(&version_text)
                .unwrap_or_else(|| panic!("{}: no `#define SLURM_VERSION_NUMBER 0x......` line", version_h.display()));
            let items = ITEMS
                .iter()
                .map(|(name, _)| {
                    let n = enum_ordinal(&spank_text, "spank_item", name)
                        .unwrap_or_else(|| panic!("{}: enum spank_item has no {name}", spank_h.display()));
                    (*name, n)
                })
                .collect::<Vec<_>>();
            let steps = STEPS
                .iter()
                .map(|(name, _)| {
                    let n = define_u32(&slurm_text, name)
                        .unwrap_or_else(|| panic!("{}: no `#define {name} (0x...)` line", slurm_h.display()));
                    (*name, n)
                })
                .collect::<Vec<_>>();
            (version, items, steps)
        }
        None if required => panic!(
            "TOPO_REQUIRE_SLURM=1 but {}, {} or {} is missing: install libslurm-dev or set SLURM_INCLUDE_DIR",
            version_h.display(),
            spank_h.display(),
            slurm_h.display()
        ),
        None => {
            println!(
                "cargo:warning=spank-topo: no Slurm headers at {} (install libslurm-dev or set SLURM_INCLUDE_DIR); \
                 building spank_topo.so with plugin_version 0, which Slurm refuses to load",
                include.join("slurm").display()
            );
            (0, ITEMS.to_vec(), STEPS.to_vec())
        }
    };
    let mut out = format!(
        "/// `SLURM_VERSION_NUMBER` of the Slurm headers this module was built against (0: none found).\n\
         pub const SLURM_VERSION_NUMBER: u32 = {version:#08x};\n"
    );
    for (name, n) in items {
        out.push_str(&format!("/// `{name}` in this Slurm's `enum spank_item`.\npub const {name}: libc::c_int = {n};\n"));
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dest = out_dir.join("slurm_abi.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("cannot write {}: {e}", dest.display()));
    let mut out = String::new();
    for (name, n) in steps {
        out.push_str(&format!(
            "/// `{name}` in this Slurm's `slurm.h`.\npub const {name}: u32 = {n:#010x};\n"
        ));
    }
    let dest = out_dir.join("slurm_steps.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("cannot write {}: {e}", dest.display()));

    // The job-state query (slurm_load_job) reads Slurm's job record, whose layout only the
    // installed slurm.h knows: compiled from C against it. Without headers the module asks
    // slurmctld nothing (and Slurm refuses to load it anyway, see above).
    println!("cargo:rustc-check-cfg=cfg(slurm_api)");
    println!("cargo:rerun-if-changed=src/slurm_jobs.c");
    if version != 0 {
        cc::Build::new()
            .file("src/slurm_jobs.c")
            .include(&include)
            .warnings(true)
            .compile("topo_slurm_jobs");
        println!("cargo:rustc-cfg=slurm_api");
    }
}

/// `0xfffffffb` from `#define SLURM_BATCH_SCRIPT (0xfffffffb)` (with or without parentheses).
fn define_u32(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define")?.trim_start().strip_prefix(name)?;
        if !rest.starts_with(char::is_whitespace) {
            return None;
        }
        let value = rest.trim().trim_start_matches('(').split(')').next()?.trim();
        let hex = value.strip_prefix("0x").or_else(|| value.strip_prefix("0X"))?;
        u32::from_str_radix(hex, 16).ok()
    })
}

/// `0x160508` from `#define SLURM_VERSION_NUMBER 0x160508`.
fn parse_version(text: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let rest = line
            .trim()
            .strip_prefix("#define")?
            .trim_start()
            .strip_prefix("SLURM_VERSION_NUMBER")?;
        let hex = rest.trim().strip_prefix("0x")?;
        u32::from_str_radix(hex.trim(), 16).ok()
    })
}

/// The position of `name` in `enum <enum_name> { ... }` (plain enumerators, no `= value`).
fn enum_ordinal(text: &str, enum_name: &str, name: &str) -> Option<u32> {
    let start = text.find(&format!("enum {enum_name} {{"))?;
    let body = &text[start..];
    let body = &body[body.find('{')? + 1..body.find("};")?];
    // Drop comments, then split on commas.
    let mut clean = String::new();
    let mut rest = body;
    while let Some(i) = rest.find("/*") {
        clean.push_str(&rest[..i]);
        rest = &rest[i + rest[i..].find("*/")? + 2..];
    }
    clean.push_str(rest);
    let mut n = 0u32;
    for entry in clean.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (ident, value) = match entry.split_once('=') {
            Some((i, v)) => (i.trim(), Some(v.trim())),
            None => (entry, None),
        };
        if let Some(v) = value {
            n = v.parse().ok()?;
        }
        if ident == name {
            return Some(n);
        }
        n += 1;
    }
    None
}
