//! Tuning and the decision cache.
//!
//! - [`tune`] — the backend-independent tuning loop and its methodology
//!   ([`tune::Target`], [`tune::Workload`]): reuse, prune, verify, time,
//!   eliminate, choose.
//! - [`cpu`] — the CPU backend as a tuning target ([`CpuTarget`]).
//! - [`cuda`] — CUDA: the tuning target on a GPU, and the static ranking
//!   of variants (NVRTC + ptxas resources + occupancy) where there is none.
//! - [`decisions`] — the persistent decision cache (atomic, lock + merge,
//!   corrupt/stale/foreign files reported and ignored, bundles).
//! - [`fingerprint`] — device and toolchain identity.
//! - [`bucket`] — shape buckets.
//! - [`select`] — run-time selection: [`select_or_tune`], `KIVI_TUNE`.
//! - [`plot`] — SVG chart of time per variant per context length.

pub mod bucket;
pub mod cpu;
pub mod cuda;
pub mod decisions;
pub mod fingerprint;
pub mod plot;
pub mod progress;
pub mod select;
pub mod tune;

pub use bucket::Bucket;
pub use cpu::CpuTarget;
pub use decisions::{DecisionFile, Entry, Status, Store};
pub use fingerprint::{Fingerprint, Toolchain};
pub use select::{
    select_cpu, select_cuda, select_or_tune, select_with, BackendKind, Mode, SelectOptions, Selection, Source,
};
