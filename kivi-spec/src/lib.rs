//! The kivi scheme model — one grammar, one validator, one canonical form.
//!
//! A *scheme* says how a KV cache is stored: how keys and values are
//! quantized (bits, grouping axis, group size, scale dtype), which tokens stay
//! in full precision (attention sinks, a recent residual window), the head
//! layout and the activation dtype. `kivi::scheme!` parses the same text at
//! compile time that [`parse_scheme`] parses at run time, and both call
//! [`validate`]. [`layout`] turns a scheme into exact byte offsets shared by
//! the paged cache and every kernel.
//!
//! ```
//! let s = kivi_spec::parse_scheme(r#"
//!     pub Kivi2 {
//!         key: quant(bits = 2, axis = channel, group = 32),
//!         value: quant(bits = 2, axis = token, group = 32),
//!         residual: 128,
//!         heads: gqa(q = 32, kv = 8),
//!         head_dim: 128,
//!     }
//! "#).unwrap();
//! assert_eq!(kivi_spec::canonical(&s), kivi_spec::canonical(
//!     &kivi_spec::presets::kivi2().with_shape(kivi_spec::Heads::Gqa { q: 32, kv: 8 }, 128).unwrap()
//! ).replace("kivi2", "Kivi2"));
//! ```

mod canonical;
pub mod layout;
mod load;
pub mod low_rank;
pub mod mla;
mod model;
mod model_decl;
mod parse;
pub mod presets;
pub mod tokens;
mod validate;
pub mod vq;

pub use canonical::{canonical, canonical_body, fnv1a64, scheme_hash};
pub use load::{load_scheme, resolve_scheme, LoadError, ResolvedScheme, SchemeSource};
pub use low_rank::LowRank;
pub use mla::{mla_bytes_per_token, Mla, MlaLayout, MlaParts};
pub use model::*;
pub use model_decl::{parse_model, LayerKind, ModelDecl, SchemeRef};
pub use parse::{parse_decls, parse_scheme, parse_schemes, span_for, ParseError, SchemeDecl, SchemeList};
pub use validate::{validate, Field, Invalid, ALLOWED_BITS, LLOYD_MAX_BITS};
pub use vq::{Vq, VqName};
