//! Rust tokens that rebuild a [`Scheme`] value, for code the macro emits.
//! Paths go through the `kivi` facade (`::kivi::spec`), the crate users
//! depend on.

use crate::model::*;
use proc_macro2::TokenStream;
use quote::quote;

fn codec(c: &Codec) -> TokenStream {
    match c {
        Codec::Full => quote!(::kivi::spec::Codec::Full),
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
            quote!(::kivi::spec::Codec::Quant(::kivi::spec::Quant {
                bits: #bits, axis: #axis, group: #group, scale: #scale
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
    }));
    let head_dim = opt(s.head_dim);
    let dtype = match s.dtype {
        Dtype::F16 => quote!(::kivi::spec::Dtype::F16),
        Dtype::Bf16 => quote!(::kivi::spec::Dtype::Bf16),
        Dtype::F32 => quote!(::kivi::spec::Dtype::F32),
    };
    let softmax_scale = opt(s.softmax_scale);
    let sliding_window = opt(s.sliding_window);
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
    })
}
