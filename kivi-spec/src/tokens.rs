//! Rust tokens that rebuild a [`Scheme`] value, for code the macro emits.
//! Paths go through the `kivi` facade (`::kivi::spec`), the crate users
//! depend on.

use crate::model::*;
use proc_macro2::TokenStream;
use quote::quote;

fn codec(c: &Codec) -> TokenStream {
    match c {
        Codec::Full => quote!(::kivi::spec::Codec::Full),
        Codec::Vq(v) => {
            let (dim, entries) = (v.dim, v.entries);
            let codebook = opt(v.codebook.map(|n| {
                let n = n.as_str();
                // Checked by the parser, so the name rebuilds.
                quote!(::kivi::spec::VqName::new(#n).expect("a parsed codebook name"))
            }));
            quote!(::kivi::spec::Codec::Vq(::kivi::spec::Vq { dim: #dim, entries: #entries, codebook: #codebook }))
        }
        Codec::Quant(q) => {
            let bits = q.bits;
            let group = q.group;
            let axis = match q.axis {
                Axis::Channel => quote!(::kivi::spec::Axis::Channel),
                Axis::Token => quote!(::kivi::spec::Axis::Token),
            };
            let scale = match q.scale {
                ScaleDtype::F16 => quote!(::kivi::spec::ScaleDtype::F16),
                ScaleDtype::F32 => quote!(::kivi::spec::ScaleDtype::F32),
            };
            let levels = match q.levels {
                Levels::Uniform => quote!(::kivi::spec::Levels::Uniform),
                Levels::LloydMax(Norm::Rms) => quote!(::kivi::spec::Levels::LloydMax(::kivi::spec::Norm::Rms)),
                Levels::LloydMax(Norm::L2) => quote!(::kivi::spec::Levels::LloydMax(::kivi::spec::Norm::L2)),
                Levels::Nuq(Norm::Rms) => quote!(::kivi::spec::Levels::Nuq(::kivi::spec::Norm::Rms)),
                Levels::Nuq(Norm::L2) => quote!(::kivi::spec::Levels::Nuq(::kivi::spec::Norm::L2)),
                Levels::LloydMax(Norm::MinMax) => quote!(::kivi::spec::Levels::LloydMax(::kivi::spec::Norm::MinMax)),
                Levels::Nuq(Norm::MinMax) => quote!(::kivi::spec::Levels::Nuq(::kivi::spec::Norm::MinMax)),
                Levels::LloydMax(Norm::MinMaxPinned) => {
                    quote!(::kivi::spec::Levels::LloydMax(::kivi::spec::Norm::MinMaxPinned))
                }
                Levels::Nuq(Norm::MinMaxPinned) => quote!(::kivi::spec::Levels::Nuq(::kivi::spec::Norm::MinMaxPinned)),
            };
            quote!(::kivi::spec::Codec::Quant(::kivi::spec::Quant {
                bits: #bits, axis: #axis, group: #group, scale: #scale, levels: #levels
            }))
        }
    }
}

fn opt<T: quote::ToTokens>(v: Option<T>) -> TokenStream {
    match v {
        Some(v) => quote!(::core::option::Option::Some(#v)),
        None => quote!(::core::option::Option::None),
    }
}

fn apply(a: &Apply) -> TokenStream {
    let (k, v) = (a.key, a.value);
    quote!(::kivi::spec::Apply { key: #k, value: #v })
}

/// An expression of type `::kivi::spec::Scheme` equal to `s`.
pub fn scheme_expr(s: &Scheme) -> TokenStream {
    let name = &s.name;
    let key = codec(&s.key);
    let value = codec(&s.value);
    let residual = s.residual;
    let sinks = s.sinks;
    let flush = match s.flush {
        Flush::Eager => quote!(::kivi::spec::Flush::Eager),
        Flush::Chunked => quote!(::kivi::spec::Flush::Chunked),
    };
    let heads = opt(s.heads.map(|h| match h {
        Heads::Mha(n) => quote!(::kivi::spec::Heads::Mha(#n)),
        Heads::Gqa { q, kv } => quote!(::kivi::spec::Heads::Gqa { q: #q, kv: #kv }),
        Heads::Mqa(q) => quote!(::kivi::spec::Heads::Mqa(#q)),
        Heads::Mla(m) => {
            let (q, latent, rope_dim, rope) = (m.q, m.latent, m.rope_dim, codec(&m.rope));
            quote!(::kivi::spec::Heads::Mla(::kivi::spec::Mla {
                q: #q, latent: #latent, rope_dim: #rope_dim, rope: #rope
            }))
        }
    }));
    let head_dim = opt(s.head_dim);
    let dtype = match s.dtype {
        Dtype::F16 => quote!(::kivi::spec::Dtype::F16),
        Dtype::Bf16 => quote!(::kivi::spec::Dtype::Bf16),
        Dtype::F32 => quote!(::kivi::spec::Dtype::F32),
    };
    let softmax_scale = opt(s.softmax_scale);
    let sliding_window = opt(s.sliding_window);
    let rotation = opt(s.rotation.map(|r| {
        let (block, a) = (r.block, apply(&r.apply));
        let signs = opt(r.signs);
        quote!(::kivi::spec::Rotation { block: #block, signs: #signs, apply: #a })
    }));
    let outliers = opt(s.outliers.map(|o| {
        let (k, a) = (o.per_token, apply(&o.apply));
        quote!(::kivi::spec::Outliers { per_token: #k, apply: #a })
    }));
    let center = opt(s.center.map(|c| {
        let (n, a) = (c.tokens, apply(&c.apply));
        quote!(::kivi::spec::Center { tokens: #n, apply: #a })
    }));
    let rope = opt(s.rope.map(|r| {
        let (theta, scaling) = (r.theta, r.scaling);
        let style = match r.style {
            RopeStyle::Half => quote!(::kivi::spec::RopeStyle::Half),
            RopeStyle::Interleaved => quote!(::kivi::spec::RopeStyle::Interleaved),
        };
        quote!(::kivi::spec::Rope { theta: #theta, style: #style, scaling: #scaling })
    }));
    let low_rank = opt(s.low_rank.map(|l| {
        let (r, a, n) = (l.rank, apply(&l.apply), l.residual);
        quote!(::kivi::spec::LowRank { rank: #r, apply: #a, residual: #n })
    }));
    let query = opt(s.query.map(|q| {
        let g = q.group;
        quote!(::kivi::spec::QueryQuant { group: #g })
    }));
    quote!(::kivi::spec::Scheme {
        name: ::std::string::String::from(#name),
        key: #key,
        value: #value,
        residual: #residual,
        sinks: #sinks,
        flush: #flush,
        heads: #heads,
        head_dim: #head_dim,
        dtype: #dtype,
        softmax_scale: #softmax_scale,
        sliding_window: #sliding_window,
        nonfinite: ::kivi::spec::NonFinite::Reject,
        rotation: #rotation,
        outliers: #outliers,
        center: #center,
        rope: #rope,
        query: #query,
        low_rank: #low_rank,
    })
}
