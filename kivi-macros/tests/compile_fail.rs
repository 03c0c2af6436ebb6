//! `kivi::scheme!` rejects bad schemes at `cargo build`, pointing at the
//! offending token. Each class of error has one case in `tests/ui/` with the
//! exact compiler output in its `.stderr` snapshot: the message a user sees
//! is part of the API. `tests/pass/` holds declarations that must compile
//! and run.
//!
//! Regenerate the snapshots after an intended message change with
//! `TRYBUILD=overwrite cargo test -p kivi-macros --test compile_fail`, then
//! read them.
//!
//! It lives in kivi-macros, not in the `kivi` crate whose macro it checks,
//! because trybuild builds its cases in a project of its own (under
//! `target/tests/trybuild`) with every dev-dependency of the crate it runs
//! in: in `kivi` that meant candle, the tokenizer and the model stack (about
//! 220 s of a cold CI run for ~90 one-line cases); here it is `kivi` itself
//! and trybuild.

#[test]
fn scheme_macro_diagnostics() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/pass/*.rs");
}
