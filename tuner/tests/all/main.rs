//! kivi-tuner's integration tests: tuning logic on a fake backend, the
//! decision cache, the CPU and CUDA targets.
//!
//! One test binary for the crate (one link instead of 7): each former
//! `tests/NAME.rs` is the module `NAME` here, so
//! `cargo test -p kivi-tuner --test all NAME::` runs what `--test NAME` did.

mod calibrated_tune;
mod common;
mod cpu_tune;
mod decision_cache;
mod device_tune;
mod fuzz_decisions;
mod tune_logic;
mod vq_tune;
