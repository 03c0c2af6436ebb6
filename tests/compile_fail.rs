//! `kivi::scheme!` rejects bad schemes at `cargo build`, pointing at the
//! offending token. Each class of error has one case in `tests/ui/` with the
//! exact compiler output in its `.stderr` snapshot: the message a user sees
//! is part of the API. `tests/pass/` holds declarations that must compile
//! and run.
//!
//! Regenerate the snapshots after an intended message change with
//! `TRYBUILD=overwrite cargo test -p kivi --test compile_fail`, then read them.

#[test]
fn scheme_macro_diagnostics() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/pass/*.rs");
}
