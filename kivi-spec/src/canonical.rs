//! Canonical text and stable hash of a scheme.
//!
//! The canonical form spells every field, defaults included, in one fixed
//! order, with head layouts normalized (`gqa(q = 8, kv = 8)` prints as
//! `mha(8)`). It parses back to the same scheme.
//!
//! The hash is FNV-1a (64-bit) of the canonical *body*: everything between
//! the braces. So it changes when anything that changes stored bits or
//! results changes — codecs, bits, axes, groups, scale dtypes, windows, flush
//! policy, heads, head_dim, dtype, softmax scale, sliding window, non-finite
//! policy — and does **not** change with the scheme's name, its visibility,
//! field order, spacing, or how the same head layout was spelled.
//!
//! The codec pipeline (`levels`/`norm` of a quant, `rotation`, `outliers`,
//! `center`), `rope: pre(...)`, the integer-domain query (`query`) and `low_rank` are
//! printed only where they differ from KIVI's plain uniform codes,
//! so that every scheme written before it existed keeps its text and its
//! hash (tuning decisions are keyed by the hash); when present, every one of
//! their arguments is spelled out and hashed.

use crate::model::*;
use std::fmt::Write;

pub(crate) fn codec_text(c: &Codec) -> String {
    match c {
        Codec::Full => "full".into(),
        Codec::Vq(v) => format!(
            "vq(dim = {}, entries = {}{})",
            v.dim,
            v.entries,
            v.codebook.map_or(String::new(), |n| format!(", codebook = {n}"))
        ),
        Codec::Quant(q) => format!(
            "quant(bits = {}, axis = {}, group = {}, scale = {}{})",
            q.bits,
            match q.axis {
                Axis::Channel => "channel",
                Axis::Token => "token",
            },
            q.group,
            q.scale.name(),
            match q.levels {
                Levels::Uniform => String::new(),
                Levels::LloydMax(n) => format!(", levels = lloyd_max, norm = {}", n.name()),
                Levels::Nuq(n) => format!(", levels = nuq, norm = {}", n.name()),
            }
        ),
    }
}

/// The body (fields only) of the canonical form, one field per line.
pub fn canonical_body(s: &Scheme) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "    key: {},", codec_text(&s.key));
    // An mla scheme's latent is its value: it has no `value` field.
    if s.mla().is_none() {
        let _ = writeln!(o, "    value: {},", codec_text(&s.value));
    }
    let _ = writeln!(o, "    residual: {},", s.residual);
    let _ = writeln!(o, "    sinks: {},", s.sinks);
    let _ = writeln!(
        o,
        "    flush: {},",
        match s.flush {
            Flush::Eager => "eager",
            Flush::Chunked => "chunked",
        }
    );
    if let Some(h) = s.heads {
        let _ = writeln!(o, "    heads: {h},");
    }
    if let Some(d) = s.head_dim {
        let _ = writeln!(o, "    head_dim: {d},");
    }
    let _ = writeln!(o, "    dtype: {},", s.dtype.name());
    if let Some(sc) = s.softmax_scale {
        // `{:?}` prints the shortest text that parses back to the same f32.
        let mut t = format!("{sc:?}");
        if !t.contains(['.', 'e']) {
            t.push_str(".0");
        }
        let _ = writeln!(o, "    softmax_scale: {t},");
    }
    match s.sliding_window {
        Some(w) => {
            let _ = writeln!(o, "    sliding_window: {w},");
        }
        None => {
            let _ = writeln!(o, "    sliding_window: none,");
        }
    }
    let _ = writeln!(o, "    nonfinite: reject,");
    if let Some(r) = &s.rotation {
        let signs = r.signs.map_or("none".to_string(), |x| x.to_string());
        let _ = writeln!(
            o,
            "    rotation: hadamard(block = {}, apply = {}, signs = {signs}),",
            r.block,
            r.apply.text()
        );
    }
    if let Some(x) = &s.outliers {
        let _ = writeln!(
            o,
            "    outliers: sparse(per_token = {}, apply = {}),",
            x.per_token,
            x.apply.text()
        );
    }
    if let Some(c) = &s.center {
        let _ = writeln!(
            o,
            "    center: channel_mean(tokens = {}, apply = {}),",
            c.tokens,
            c.apply.text()
        );
    }
    if let Some(r) = &s.rope {
        let scaling = if r.scaling == 1.0 {
            "none".to_string()
        } else {
            format!("linear({})", float_text(r.scaling))
        };
        let _ = writeln!(
            o,
            "    rope: pre(theta = {}, style = {}, scaling = {scaling}),",
            float_text(r.theta),
            r.style.name()
        );
    }
    if let Some(q) = &s.query {
        let _ = writeln!(o, "    query: int8(group = {}),", q.group);
    }
    if let Some(l) = &s.low_rank {
        let _ = writeln!(o, "    low_rank: {},", l.text());
    }
    o
}

/// The shortest text that parses back to the same f64, always with a `.`
/// or an exponent (`10000.0`, `1000000.0`, `1e20`).
fn float_text(x: f64) -> String {
    let mut t = format!("{x:?}");
    if !t.contains(['.', 'e']) {
        t.push_str(".0");
    }
    t
}

/// The full canonical text, `NAME { ... }`, parseable by [`crate::parse_scheme`].
///
/// ```
/// let s = kivi_spec::presets::kivi2();
/// let text = kivi_spec::canonical(&s);
/// assert_eq!(kivi_spec::parse_scheme(&text).unwrap(), s);
/// ```
pub fn canonical(s: &Scheme) -> String {
    format!("{} {{\n{}}}\n", s.name, canonical_body(s))
}

/// 64-bit FNV-1a; small, dependency-free and stable across platforms and
/// releases (unlike `std`'s `DefaultHasher`).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The stable hash of a scheme's meaning (see the module docs).
///
/// ```
/// let a = kivi_spec::presets::kivi2();
/// let mut b = a.clone();
/// b.name = "renamed".into();
/// assert_eq!(kivi_spec::scheme_hash(&a), kivi_spec::scheme_hash(&b));
/// b.residual = 64;
/// assert_ne!(kivi_spec::scheme_hash(&a), kivi_spec::scheme_hash(&b));
/// ```
pub fn scheme_hash(s: &Scheme) -> u64 {
    fnv1a64(canonical_body(s).as_bytes())
}
