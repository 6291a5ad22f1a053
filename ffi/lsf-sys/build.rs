//! Generates the LSF bindings with bindgen.
//!
//! The header is `ffi/include/lssched.h` (topo's own, written from the documented interface),
//! or `$LSF_INCLUDE_DIR/lssched.h` when that variable is set (a site's SDK, e.g.
//! `$LSF_TOP/10.1/include/lsf`). The build prints which one it used, and the crate exports it as
//! `HEADER_USED` so that the module logs it at start.
//!
//! Functions are generated as a table loaded at run time (bindgen's dynamic loading): the
//! scheduler exports them from its own executable, LSF 6.x under the `lsb_*` names and 9/10
//! under `extsched_*`, and a module linked with immediate binding must not name a symbol the
//! running scheduler lacks.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LSF_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=TOPO_LSF6_JOBINFO");
    let ours =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
            .join("../include");
    let (dir, origin) = match env::var_os("LSF_INCLUDE_DIR") {
        Some(d) => (PathBuf::from(d), "the site's SDK (LSF_INCLUDE_DIR)"),
        None => (ours, "topo's own"),
    };
    let header = dir.join("lssched.h");
    if !header.is_file() {
        panic!("topo-lsf-sys: {} does not exist; LSF_INCLUDE_DIR must name the directory that holds lssched.h", header.display());
    }
    println!("cargo:rerun-if-changed={}", header.display());
    println!(
        "cargo:warning=topo-lsf-sys: LSF bindings from {} header {}",
        origin,
        header.display()
    );
    let mut builder = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", dir.display()))
        .allowlist_function("(lsb|extsched)_.*")
        .allowlist_type("candHost|hostSlot|candHostGroup|jobInfo|hostResources|resources|phase|restype|ctype|RsrcReqHandler.*|_RsrcReqHandlerType|extsched_.*")
        .allowlist_var("NOTIFY_.*|SCH_FM_EVE_.*|SCH_MOD_DECISION_.*|PEND_CUSTOM_REASON_.*")
        .dynamic_library_name("LsfApi")
        .dynamic_link_require_all(false)
        .derive_default(true)
        .layout_tests(true);
    if env::var_os("TOPO_LSF6_JOBINFO").is_some() {
        builder = builder.clang_arg("-DTOPO_LSF6_JOBINFO");
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| panic!("topo-lsf-sys: bindgen failed on {}: {e}", header.display()));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("lssched.rs")).expect("writing the bindings");
    println!("cargo:rustc-env=TOPO_LSF_HEADER_USED={} ({})", header.display(), origin);
}
