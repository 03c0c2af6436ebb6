//! Multi-head latent attention (MLA) caches: `heads: mla(...)` schemes
//! (see [`kivi_spec::mla`] and docs/semantics.md, "MLA caches").
//!
//! - [`reference`] — the oracle: each part's cache view, then absorbed
//!   attention (`q_latent . c + q_rope . k_rope`, output `sum p c`).
//! - [`cache`] — [`MlaCache`], the paged cache of both parts with exact
//!   accounting.
//! - [`crate::cpu::mla`] — decode on the CPU over an [`MlaCache`].
//! - [`device`] — the generated CUDA decode kernel on a GPU or the simulator.
//!
//! An MLA scheme is not a [`crate::PagedCache`] scheme: its two parts have
//! different widths and codecs, and its latent is read as key and value
//! from one stored copy. The paged cache and the generic oracle refuse it
//! with [`NOT_PAGED`].

pub mod cache;
pub mod device;
pub mod reference;

pub use cache::{MlaCache, MlaConfig, MlaMemory, Part};

/// Why a `heads: mla(...)` scheme is refused by the generic cache and oracle.
pub const NOT_PAGED: &str =
    "mla heads store one latent and one RoPE key per token; use kivi_runtime::mla (MlaCache, mla::reference)";
