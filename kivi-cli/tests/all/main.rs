//! kivi-cli's integration tests: the `kivi` binary end to end.
//!
//! One test binary for the crate (one link instead of 10): each former
//! `tests/NAME.rs` is the module `NAME` here, so
//! `cargo test -p kivi-cli --test all NAME::` runs what `--test NAME` did.

mod cli;
mod cli_bench_low_rank;
mod cli_bench_vq;
mod cli_convention;
mod cli_low_rank;
mod cli_tune;
mod fuzz_npy;
mod generate;
mod policy;
mod show_mla;
