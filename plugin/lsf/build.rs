//! Links `schmod_topo.so` with `-z nodelete`: the scheduler may `dlclose` the module and open it
//! again in the same process (`sched_finalize`, then `sched_init`). The module keeps state that
//! jobs already in the scheduler refer to (the requests behind hashed handler keys), and Rust
//! code must not be unmapped while a thread it started may still run, so the library stays
//! mapped for the life of the process, as if `RTLD_NODELETE` had been given.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
