//! kivi runtime: the reference oracle, the paged quantized KV cache and the
//! backends that run decode attention over it.
//!
//! - [`reference`](mod@reference) — DESIGN.md §3, plainly; the oracle for everything else.
//! - [`quant`] — the quantization math (one copy on the host).
//! - [`cache`] — the paged cache with exact memory accounting.
//! - [`calib`] — calibration files (learned `nuq` codebooks) and fitting
//!   them from K/V samples.
//! - [`cpu`] — fused dequantize + decode attention on the CPU.
//! - [`backend`] — the interface every backend implements: decode (one
//!   query per sequence) and [`Backend::attend_block`] (a causal block of
//!   new queries: chunked prefill, speculative verification).
//! - [`device`] — the device layer: the GPU path's host code, run on a GPU
//!   ([`cuda`]) or on the simulated device ([`sim`]) alike.
//! - [`mla`] — multi-head latent attention caches: oracle, paged cache, CPU decode.
//! - [`rand`] — the one seeded generator for test and benchmark inputs.

pub mod backend;
pub mod cache;
pub mod calib;
pub mod cpu;
pub mod cuda;
pub mod device;
mod error;
pub mod low_rank;
pub mod mla;
pub mod pool;
pub mod quant;
pub mod rand;
pub mod reference;
pub mod sim;
pub mod vq;

pub use backend::{Backend, DecodePartial, NewTokens, ReferenceBackend};
pub use cache::{CacheConfig, MemoryReport, PagedCache, RawRows, SeqId, SeqView};
pub use cpu::{CpuBackend, CpuParams};
pub use error::{Error, Result};
pub use reference::AttnParams;
