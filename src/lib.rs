//! # kivi — quantized KV caches for LLM inference
//!
//! Declare a KV-cache scheme in Rust with [`scheme!`]; it is parsed and
//! validated while `cargo build` runs, and a mistake is a compile error that
//! points at the offending token. At run time the scheme drives a paged
//! quantized cache ([`PagedCache`]) with exact memory accounting, a scalar
//! reference oracle ([`runtime::reference`]) and fast backends
//! ([`CpuBackend`], and the generated-CUDA ones).
//!
//! ```
//! kivi::scheme! {
//!     // KIVI-2 for a Llama-style model: 2-bit keys per channel, 2-bit values
//!     // per token, the last 128 tokens kept in f16.
//!     pub Kivi2 {
//!         key: quant(bits = 2, axis = channel, group = 32),
//!         value: quant(bits = 2, axis = token, group = 32),
//!         residual: 128,
//!         heads: gqa(q = 32, kv = 8),
//!         head_dim: 128,
//!     }
//! }
//!
//! use kivi::{AttnParams, Backend, CacheConfig, CpuBackend, PagedCache};
//!
//! let scheme = Kivi2::spec();
//! assert_eq!(scheme.residual, 128);
//! // The hash depends on what the scheme means, not on how it was written.
//! assert_eq!(Kivi2::HASH, kivi::scheme_hash(&scheme));
//! // 2-bit keys and values at head_dim 128: 96 bytes per token per KV head
//! // (48 for keys, 48 for values, codes and f16 parameters), against 512 in f16.
//! let (bytes, tokens) = kivi::spec::layout::bytes_per_token_per_head(&scheme);
//! assert_eq!(bytes / tokens, 96);
//!
//! let shape = scheme.shape().unwrap();
//! let mut cache = PagedCache::new(scheme.clone(), CacheConfig::for_tokens(512)).unwrap();
//! let seq = cache.add_sequence();
//! let row = vec![0.25f32; shape.kv_heads * shape.head_dim];
//! for _ in 0..200 {
//!     cache.append(seq, &row, &row).unwrap();
//! }
//! let q = vec![0.5f32; shape.q_heads * shape.head_dim];
//! let out = CpuBackend::default()
//!     .decode(&cache, &[seq], &q, AttnParams::of(&scheme, shape))
//!     .unwrap();
//! assert_eq!(out.len(), shape.q_heads * shape.head_dim);
//! ```
//!
//! # The scheme language
//!
//! `kivi::scheme!` and [`parse_scheme`] (scheme files, the `kivi` CLI) accept
//! the same text and give the same error messages. A declaration is
//! `[pub] Name { field: value, ... }`; fields may come in any order, each at
//! most once:
//!
//! | field | value | default |
//! |---|---|---|
//! | `key`, `value` | `full` or `quant(bits = 1\|2\|3\|4\|8, axis = channel\|token, group = G [, scale = f16\|f32])` | required |
//! | `residual` | recent tokens kept unquantized, `R` | `0` |
//! | `sinks` | first tokens kept unquantized, `S` | `0` |
//! | `flush` | `eager` (DESIGN.md §3) or `chunked` (KIVI's original) | `eager` |
//! | `heads` | `mha(N)`, `gqa(q = N, kv = M)`, `mqa(q = N)` | bound at use |
//! | `head_dim` | `D` | bound at use |
//! | `dtype` | activation dtype `f16`, `bf16`, `f32` | `f16` |
//! | `softmax_scale` | a positive number | `1/sqrt(D)` |
//! | `sliding_window` | `W` or `none` | `none` |
//! | `nonfinite` | `reject` | `reject` |
//!
//! A scheme *argument* (a CLI flag, a config value) goes through
//! [`load_scheme`]: scheme text if it contains `{`, else a preset name, else
//! a file path (`./kivi2` loads a file named like a preset).
//!
//! Each declaration becomes a unit struct with `spec()`, `CANONICAL` (the
//! canonical text, see [`canonical`]) and `HASH` ([`scheme_hash`]).
//!
//! A scheme that breaks a rule does not compile:
//!
//! ```compile_fail
//! kivi::scheme! {
//!     Bad {
//!         key: quant(bits = 5, axis = channel, group = 32), // 5 bits: not supported
//!         value: full,
//!     }
//! }
//! ```

/// A scheme per layer: [`model!`] declares a model's layers (a scheme by
/// layer index, by kind — `sliding`, `global` — and a default) in the
/// grammar of [`spec::parse_model`], checked at `cargo build`:
///
/// ```
/// kivi::model! {
///     pub model Gemma3 {
///         layers: 18, window: 512, global_layers: [5, 11, 17],
///         default: kivi2,
///         global: kivi4,
///     }
/// }
/// let d = Gemma3::decl();
/// let schemes = d.schemes_for(&d.kinds().unwrap()).unwrap();
/// assert_eq!((schemes[4].name.as_str(), schemes[5].name.as_str()), ("kivi2", "kivi4"));
/// ```
pub use kivi_macros::model;
pub use kivi_macros::scheme;
/// The runtime: reference oracle, paged cache, backends.
pub use kivi_runtime as runtime;
/// The scheme model, parser, validator, canonical form and memory layout.
pub use kivi_spec as spec;
/// CUDA templates and the code generator.
pub use kivi_templates as templates;

pub use kivi_runtime::{
    AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, Error, MemoryReport, PagedCache, ReferenceBackend, Result,
    SeqId,
};
pub use kivi_spec::{
    canonical, load_scheme, parse_scheme, parse_schemes, presets, scheme_hash, Axis, Codec, Dtype, Flush, Heads,
    ParseError, Quant, ScaleDtype, Scheme, Shape, Tensor,
};

/// The README's Rust examples run as doc tests, so they cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
