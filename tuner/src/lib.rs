//! Tuning and the decision cache.
//!
//! Run-time selection is one call. The decision cache lives in
//! `$KIVI_CACHE_DIR`, else `$XDG_CACHE_HOME/kivi`, else `~/.cache/kivi`;
//! `KIVI_TUNE=off|cached|tune` says what a miss does (default `cached`: the
//! documented heuristic default, no benchmarking in the serving path);
//! `KIVI_TUNE_BUDGET` bounds a tune-on-miss in seconds.
//!
//! ```no_run
//! use kivi_runtime::Backend;
//! use kivi_tuner::{select_cpu, Bucket, SelectOptions};
//! let scheme = kivi_spec::presets::kivi2().with_shape(kivi_spec::Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
//! // The bucket of the real inputs: batch, longest context, GQA ratio.
//! let bucket = Bucket::of(4, 3000, 4);
//! let (backend, sel) = select_cpu(&scheme, bucket, &SelectOptions::from_env().unwrap()).unwrap();
//! for w in &sel.warnings {
//!     eprintln!("warning: {w}"); // e.g. a corrupt decision file, ignored
//! }
//! println!("{} via {} ({:?}: {})", bucket, sel.variant, sel.source, sel.reason);
//! // backend.decode(&cache, &seqs, &q, attn) ...
//! # let _ = backend.name();
//! ```
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
//! - [`select`] — run-time selection: [`select_or_tune`], [`select_cpu`],
//!   [`select_cuda`], `KIVI_TUNE`.
//! - [`low_rank`] — low-rank schemes: the coordinate scheme's target,
//!   keyed by the calibration the bases came from.
//! - [`progress`] — the hand-drawn progress bar of `kivi tune`.
//! - [`gpu_bench`] — the GPU decode benchmark (`benches/gpu_decode.rs`) on
//!   any device, the simulated one included.
//!
//! The `kivi` program that drives all this is the `kivi-cli` crate.

pub mod bucket;
pub mod cpu;
pub mod cuda;
pub mod decisions;
pub mod fingerprint;
pub mod gpu_bench;
pub mod low_rank;
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
