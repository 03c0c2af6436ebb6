//! kivi-candle's integration tests: the candle cache against the oracle,
//! the pool, low-rank caches, the simulated device.
//!
//! One test binary for the crate (one link instead of 5): each former
//! `tests/NAME.rs` is the module `NAME` here, so
//! `cargo test -p kivi-candle --test all NAME::` runs what `--test NAME` did.

mod common;
mod device;
mod gemma_memory;
mod low_rank;
mod oracle;
mod pool;
