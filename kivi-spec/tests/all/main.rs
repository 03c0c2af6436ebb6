//! kivi-spec's integration tests: the scheme language, its canonical form
//! and hash, model declarations.
//!
//! One test binary for the crate (one link instead of 8): each former
//! `tests/NAME.rs` is the module `NAME` here, so
//! `cargo test -p kivi-spec --test all NAME::` runs what `--test NAME` did.

mod combinations;
mod low_rank;
mod mla;
mod model_decl;
mod query_int8;
mod rope;
mod spec;
mod vq;
