//! The one parser of the scheme language, shared by `kivi::scheme!` (at
//! compile time) and scheme files (at run time, via [`parse_scheme`]).
//!
//! Grammar (whitespace and a trailing comma are free):
//!
//! ```text
//! scheme   := [pub] NAME '{' field (',' field)* '}'
//! field    := key: codec | value: codec | residual: INT | sinks: INT
//!           | flush: eager|chunked | heads: heads | head_dim: INT
//!           | dtype: f16|bf16|f32 | softmax_scale: NUMBER
//!           | sliding_window: INT|none | nonfinite: reject
//!           | rotation: hadamard(block = INT, apply = tensors [, signs = INT|none])
//!           | outliers: sparse(per_token = INT, apply = tensors)
//!           | center: channel_mean(tokens = INT, apply = tensors)
//!           | rope: post | pre(theta = NUMBER, style = half|interleaved
//!                              [, scaling = none|linear(NUMBER)])
//!           | query: int8(group = INT)
//!           | low_rank: pca(rank = INT, apply = tensors [, residual = INT])
//! codec    := full | quant(bits = INT, axis = channel|token, group = INT
//!                          [, scale = f16|f32] [, levels = uniform|lloyd_max|nuq] [, norm = rms|l2|minmax|minmax_pinned])
//!           | vq(dim = INT, entries = INT [, codebook = NAME])
//! tensors  := [key] | [value] | [key, value]
//! heads    := mha(INT) | gqa(q = INT, kv = INT) | mqa(q = INT)
//!           | mla(q = INT, latent = INT, rope_dim = INT [, rope = codec])
//! ```
//!
//! With `mla` heads the `key` codec stores the latent (which is also the
//! value, so there is no `value` field) and `rope` (default `full`) the
//! decoupled RoPE key; `head_dim` is the latent width (see [`crate::mla`]).
//!
//! A tensor's codec is a small pipeline: center (subtract per-channel
//! means), rotate, take out the sparse outliers, quantize the rest with
//! `quant(...)`, or store it as product-codebook indices with `vq(...)`;
//! `low_rank: pca(...)` stores keys and values as coordinates in a
//! calibrated basis (see [`crate::low_rank`]). Names reserved for what
//! comes next (a top-level `codebook` or `vq`, `normalize`, learned
//! rotations, ...) are recognised and rejected with "not supported yet"
//! rather than ignored.
//!
//! `rope: pre(...)` (KVQuant) declares that the keys given to the cache are
//! taken *before* RoPE; decode rotates each cached key to its absolute
//! position (see [`Rope`]).

use crate::low_rank::LowRank;
use crate::model::*;
use crate::validate::{validate, Field};
use crate::vq::VqName;
use proc_macro2::Span;
use std::collections::HashMap;
use syn::parse::{Parse, ParseStream};
use syn::{braced, parenthesized, Ident, LitInt, Token};

/// One parsed declaration: visibility, name, the validated scheme, and the
/// span of every field (for error reporting by later passes).
pub struct SchemeDecl {
    /// Doc comments (`///`) written above the declaration.
    pub docs: Vec<syn::Attribute>,
    pub vis: syn::Visibility,
    pub ident: Ident,
    pub scheme: Scheme,
    pub spans: HashMap<Field, Span>,
}

/// One or more declarations, as a macro invocation or a file holds them.
pub struct SchemeList(pub Vec<SchemeDecl>);

/// Top-level fields planned but not implemented, with what they will mean.
const FUTURE_FIELDS: &[(&str, &str)] = &[
    ("codebook", "calibrated non-uniform codebooks"),
    (
        "vq",
        "a top-level vq field; vector quantization is a codec: `key: vq(dim = 8, entries = 256)`",
    ),
    ("normalize", "per-channel key normalisation folded into the query"),
];

/// Arguments of `quant(...)` planned but not implemented.
const FUTURE_QUANT_ARGS: &[&str] = &["codebook", "symmetric", "clip", "nuq"];

/// Arguments of `quant(...)` that are top-level fields instead, and where.
const MISPLACED_QUANT_ARGS: &[(&str, &str)] = &[
    ("outliers", "outliers: sparse(per_token = K, apply = [key])"),
    ("rotation", "rotation: hadamard(block = B, apply = [key, value])"),
    ("hadamard", "rotation: hadamard(block = B, apply = [key, value])"),
    ("center", "center: channel_mean(tokens = N, apply = [key])"),
];

const FIELDS: &str = "key, value, residual, sinks, flush, heads, head_dim, dtype, softmax_scale, sliding_window, nonfinite, rotation, outliers, center, rope, query, low_rank";

fn err<T>(span: Span, msg: impl std::fmt::Display) -> syn::Result<T> {
    Err(syn::Error::new(span, msg))
}

/// Refuses a Rust type suffix on a number (`300u8`, `0.5f32`): syn parses
/// the digits and keeps the suffix aside, so without this `300u8` would
/// read as 300 — a scheme's numbers are plain.
fn no_suffix(span: Span, text: String, suffix: &str, digits: &str) -> syn::Result<()> {
    if suffix.is_empty() {
        Ok(())
    } else {
        err(
            span,
            format!("`{text}` has a type suffix `{suffix}`; numbers in a scheme are plain, e.g. `{digits}`"),
        )
    }
}

fn parse_u32(input: ParseStream, what: &str) -> syn::Result<(u32, Span)> {
    let lit: LitInt = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), format!("expected an integer for {what}")))?;
    no_suffix(lit.span(), lit.to_string(), lit.suffix(), lit.base10_digits())?;
    let v = lit
        .base10_parse::<u32>()
        .map_err(|_| syn::Error::new(lit.span(), format!("{what} = {lit} is not a valid size")))?;
    Ok((v, lit.span()))
}

fn parse_choice<'a>(input: ParseStream, what: &str, options: &[&'a str]) -> syn::Result<(&'a str, Span)> {
    let id: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), format!("expected {what}: one of {}", options.join(", "))))?;
    let s = id.to_string();
    match options.iter().find(|o| **o == s) {
        Some(o) => Ok((o, id.span())),
        None => err(
            id.span(),
            format!("unknown {what} `{s}`; expected one of {}", options.join(", ")),
        ),
    }
}

fn expect_eq(input: ParseStream, name: &Ident) -> syn::Result<()> {
    input
        .parse::<Token![=]>()
        .map_err(|e| syn::Error::new(e.span(), format!("expected `=` after `{name}`")))
        .map(|_| ())
}

/// Which `levels = ...` a quant named.
#[derive(Clone, Copy, PartialEq)]
enum LevelsKind {
    Uniform,
    LloydMax,
    Nuq,
}

fn parse_codec(input: ParseStream, t: Tensor, spans: &mut HashMap<Field, Span>) -> syn::Result<Codec> {
    let head: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected `full`, `quant(...)` or `vq(...)`"))?;
    spans.insert(Field::Codec(t), head.span());
    match head.to_string().as_str() {
        "full" => return Ok(Codec::Full),
        "quant" => {}
        "vq" => return parse_vq(input, &head, t, spans),
        "nuq" | "codebook" | "lut" => {
            return err(
                head.span(),
                format!("`{head}` codecs are not supported yet; use `quant(...)`, `vq(...)` or `full`"),
            )
        }
        other => {
            return err(
                head.span(),
                format!("unknown codec `{other}`; expected `full`, `quant(...)` or `vq(...)`"),
            )
        }
    }
    let content;
    parenthesized!(content in input);
    let (mut bits, mut axis, mut group, mut scale) = (None, None, None, None);
    // `levels` as named; `norm` with its span for errors.
    let mut lloyd: Option<LevelsKind> = None;
    let mut norm: Option<(Norm, Span)> = None;
    while !content.is_empty() {
        let arg: Ident = content.parse()?;
        let name = arg.to_string();
        let dup = |seen: bool| -> syn::Result<()> {
            if seen {
                err(arg.span(), format!("duplicate quant argument `{name}`"))
            } else {
                Ok(())
            }
        };
        match name.as_str() {
            "bits" => {
                dup(bits.is_some())?;
                expect_eq(&content, &arg)?;
                let (v, sp) = parse_u32(&content, "bits")?;
                spans.insert(Field::Bits(t), sp);
                bits = Some(v);
            }
            "axis" => {
                dup(axis.is_some())?;
                expect_eq(&content, &arg)?;
                let (v, sp) = parse_choice(&content, "axis", &["channel", "token"])?;
                spans.insert(Field::Axis(t), sp);
                axis = Some(if v == "channel" { Axis::Channel } else { Axis::Token });
            }
            "group" => {
                dup(group.is_some())?;
                expect_eq(&content, &arg)?;
                let (v, sp) = parse_u32(&content, "group")?;
                spans.insert(Field::Group(t), sp);
                group = Some(v);
            }
            "scale" => {
                dup(scale.is_some())?;
                expect_eq(&content, &arg)?;
                let (v, sp) = parse_choice(&content, "scale dtype", &["f16", "f32"])?;
                spans.insert(Field::Scale(t), sp);
                scale = Some(if v == "f16" { ScaleDtype::F16 } else { ScaleDtype::F32 });
            }
            "levels" => {
                dup(lloyd.is_some())?;
                expect_eq(&content, &arg)?;
                let id: Ident = content
                    .parse()
                    .map_err(|e| syn::Error::new(e.span(), "expected levels: one of uniform, lloyd_max, nuq"))?;
                let v = id.to_string();
                match v.as_str() {
                    "uniform" => lloyd = Some(LevelsKind::Uniform),
                    "lloyd_max" => lloyd = Some(LevelsKind::LloydMax),
                    // A per-layer codebook from a calibration file
                    // (`kivi calibrate`), applied like lloyd_max.
                    "nuq" => lloyd = Some(LevelsKind::Nuq),
                    "codebook" | "kmeans" | "learned" => {
                        return err(
                            id.span(),
                            format!(
                                "levels = {v} is not supported yet; calibrated codebooks are spelled `levels = nuq`"
                            ),
                        )
                    }
                    _ => {
                        return err(
                            id.span(),
                            format!("unknown levels `{v}`; expected one of uniform, lloyd_max, nuq"),
                        )
                    }
                }
                spans.insert(Field::Levels(t), id.span());
            }
            "norm" => {
                dup(norm.is_some())?;
                expect_eq(&content, &arg)?;
                let (v, sp) = parse_choice(&content, "norm", &["rms", "l2", "minmax", "minmax_pinned"])?;
                spans.insert(Field::Norm(t), sp);
                let n = match v {
                    "rms" => Norm::Rms,
                    "l2" => Norm::L2,
                    "minmax" => Norm::MinMax,
                    _ => Norm::MinMaxPinned,
                };
                norm = Some((n, sp));
            }
            n if FUTURE_QUANT_ARGS.contains(&n) => {
                return err(arg.span(), format!("quant argument `{n}` is not supported yet"));
            }
            n if MISPLACED_QUANT_ARGS.iter().any(|(a, _)| *a == n) => {
                let (_, field) = MISPLACED_QUANT_ARGS.iter().find(|(a, _)| *a == n).expect("checked");
                return err(
                    arg.span(),
                    format!("`{n}` is not a quant argument; it is a field of the scheme: `{field}`"),
                );
            }
            n => {
                return err(
                    arg.span(),
                    format!("unknown quant argument `{n}`; expected bits, axis, group, scale, levels or norm"),
                )
            }
        }
        if !content.is_empty() {
            content.parse::<Token![,]>()?;
        }
    }
    let missing = |what: &str| syn::Error::new(head.span(), format!("{} quant(...) is missing `{what}`", t.name()));
    let levels = match (lloyd, norm) {
        (Some(LevelsKind::LloydMax), n) => Levels::LloydMax(n.map_or(Norm::Rms, |n| n.0)),
        (Some(LevelsKind::Nuq), n) => Levels::Nuq(n.map_or(Norm::Rms, |n| n.0)),
        (_, Some((n, sp))) => {
            return err(
                sp,
                format!(
                    "norm = {} applies to lloyd_max and nuq levels; uniform levels store a scale and a zero point per group",
                    n.name()
                ),
            )
        }
        _ => Levels::Uniform,
    };
    Ok(Codec::Quant(Quant {
        bits: bits.ok_or_else(|| missing("bits"))?,
        axis: axis.ok_or_else(|| missing("axis"))?,
        group: group.ok_or_else(|| missing("group"))?,
        scale: scale.unwrap_or(ScaleDtype::F16),
        levels,
    }))
}

/// `vq(dim = M, entries = E [, codebook = NAME])` after its head (see
/// [`crate::vq`]); the numbers are checked by the validator.
fn parse_vq(input: ParseStream, head: &Ident, t: Tensor, spans: &mut HashMap<Field, Span>) -> syn::Result<Codec> {
    let content;
    parenthesized!(content in input);
    let (mut dim, mut entries, mut codebook) = (None, None, None);
    while !content.is_empty() {
        let arg: Ident = content.parse()?;
        let name = arg.to_string();
        let seen = match name.as_str() {
            "dim" => dim.is_some(),
            "entries" => entries.is_some(),
            "codebook" => codebook.is_some(),
            _ => {
                return err(
                    arg.span(),
                    format!("unknown vq argument `{name}`; expected dim, entries or codebook"),
                )
            }
        };
        if seen {
            return err(arg.span(), format!("duplicate vq argument `{name}`"));
        }
        expect_eq(&content, &arg)?;
        match name.as_str() {
            "dim" => {
                let (v, sp) = parse_u32(&content, "dim")?;
                spans.insert(Field::VqDim(t), sp);
                dim = Some(v);
            }
            "entries" => {
                let (v, sp) = parse_u32(&content, "entries")?;
                spans.insert(Field::VqEntries(t), sp);
                entries = Some(v);
            }
            _ => {
                // Any identifier, keywords included (`loop` is a good name
                // for LoopVQ's shared codebook).
                let id: Ident = syn::ext::IdentExt::parse_any(&content)
                    .map_err(|e| syn::Error::new(e.span(), "expected a codebook name (an identifier)"))?;
                let text = id.to_string();
                let n = VqName::new(&text).ok_or_else(|| {
                    syn::Error::new(
                        id.span(),
                        format!(
                            "codebook name `{text}` must be an ASCII identifier of at most {} bytes",
                            crate::vq::MAX_VQ_NAME
                        ),
                    )
                })?;
                spans.insert(Field::VqCodebook(t), id.span());
                codebook = Some(n);
            }
        }
        if !content.is_empty() {
            content.parse::<Token![,]>()?;
        }
    }
    let missing = |what: &str| syn::Error::new(head.span(), format!("{} vq(...) is missing `{what}`", t.name()));
    Ok(Codec::Vq(crate::vq::Vq {
        dim: dim.ok_or_else(|| missing("dim"))?,
        entries: entries.ok_or_else(|| missing("entries"))?,
        codebook,
    }))
}

/// `[key]`, `[value]` or `[key, value]` (either order, each at most once).
fn parse_apply(input: ParseStream, field: Field, spans: &mut HashMap<Field, Span>) -> syn::Result<Apply> {
    let content;
    let bracket = syn::bracketed!(content in input);
    spans.insert(field, bracket.span.join());
    let mut a = Apply {
        key: false,
        value: false,
    };
    while !content.is_empty() {
        let (v, sp) = parse_choice(&content, "tensor", &["key", "value"])?;
        let slot = if v == "key" { &mut a.key } else { &mut a.value };
        if *slot {
            return err(sp, format!("`{v}` is listed twice in apply"));
        }
        *slot = true;
        if !content.is_empty() {
            content.parse::<Token![,]>()?;
        }
    }
    if !(a.key || a.value) {
        return err(
            bracket.span.join(),
            "apply lists no tensor; expected [key], [value] or [key, value]",
        );
    }
    Ok(a)
}

/// The `name = value` arguments of a transform or an extra, each parsed by
/// `arg` (which returns `false` for a name it does not know).
fn parse_args(
    input: ParseStream,
    what: &str,
    expected: &str,
    mut arg: impl FnMut(&Ident, ParseStream) -> syn::Result<bool>,
) -> syn::Result<Span> {
    let content;
    let paren = parenthesized!(content in input);
    let mut seen: Vec<String> = Vec::new();
    while !content.is_empty() {
        let name: Ident = content.parse()?;
        let n = name.to_string();
        if seen.contains(&n) {
            return err(name.span(), format!("duplicate {what} argument `{n}`"));
        }
        expect_eq(&content, &name)?;
        if !arg(&name, &content)? {
            return err(
                name.span(),
                format!("unknown {what} argument `{n}`; expected {expected}"),
            );
        }
        seen.push(n);
        if !content.is_empty() {
            content.parse::<Token![,]>()?;
        }
    }
    Ok(paren.span.join())
}

fn parse_rotation(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<Rotation> {
    let kind: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected a rotation: hadamard(block = B, apply = [...])"))?;
    spans.insert(Field::Rotation, kind.span());
    match kind.to_string().as_str() {
        "hadamard" => {}
        k @ ("learned" | "random" | "orthogonal" | "spin" | "permute") => {
            return err(
                kind.span(),
                format!("`{k}` rotations are not supported yet (planned: calibrated rotations); use hadamard(...)"),
            )
        }
        k => {
            return err(
                kind.span(),
                format!("unknown rotation `{k}`; expected hadamard(block = B, apply = [...])"),
            )
        }
    }
    let (mut block, mut apply, mut signs) = (None, None, None);
    let close = parse_args(input, "hadamard", "block, apply or signs", |name, c| {
        match name.to_string().as_str() {
            "block" => {
                let (v, sp) = parse_u32(c, "block")?;
                spans.insert(Field::RotationBlock, sp);
                block = Some(v);
            }
            "apply" => apply = Some(parse_apply(c, Field::RotationApply, spans)?),
            "signs" => {
                if c.peek(Ident) {
                    parse_choice(c, "signs", &["none"])?;
                    signs = Some(None);
                } else {
                    signs = Some(Some(parse_u32(c, "signs")?.0));
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let missing = |what: &str| syn::Error::new(close, format!("hadamard(...) is missing `{what}`"));
    Ok(Rotation {
        block: block.ok_or_else(|| missing("block"))?,
        apply: apply.ok_or_else(|| missing("apply"))?,
        signs: signs.flatten(),
    })
}

fn parse_outliers(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<Outliers> {
    let kind: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected sparse(per_token = K, apply = [...])"))?;
    spans.insert(Field::Outliers, kind.span());
    if kind != "sparse" {
        return err(
            kind.span(),
            format!("unknown outlier storage `{kind}`; expected sparse(per_token = K, apply = [...])"),
        );
    }
    let (mut per_token, mut apply) = (None, None);
    let close = parse_args(input, "sparse", "per_token or apply", |name, c| {
        match name.to_string().as_str() {
            "per_token" => {
                let (v, sp) = parse_u32(c, "per_token")?;
                spans.insert(Field::OutliersPerToken, sp);
                per_token = Some(v);
            }
            "apply" => apply = Some(parse_apply(c, Field::OutliersApply, spans)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let missing = |what: &str| syn::Error::new(close, format!("sparse(...) is missing `{what}`"));
    Ok(Outliers {
        per_token: per_token.ok_or_else(|| missing("per_token"))?,
        apply: apply.ok_or_else(|| missing("apply"))?,
    })
}

fn parse_center(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<Center> {
    let kind: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected channel_mean(tokens = N, apply = [...])"))?;
    spans.insert(Field::Center, kind.span());
    if kind != "channel_mean" {
        return err(
            kind.span(),
            format!("unknown centering `{kind}`; expected channel_mean(tokens = N, apply = [...])"),
        );
    }
    let (mut tokens, mut apply) = (None, None);
    let close = parse_args(input, "channel_mean", "tokens or apply", |name, c| {
        match name.to_string().as_str() {
            "tokens" => {
                let (v, sp) = parse_u32(c, "tokens")?;
                spans.insert(Field::CenterTokens, sp);
                tokens = Some(v);
            }
            "apply" => apply = Some(parse_apply(c, Field::CenterApply, spans)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let missing = |what: &str| syn::Error::new(close, format!("channel_mean(...) is missing `{what}`"));
    Ok(Center {
        tokens: tokens.ok_or_else(|| missing("tokens"))?,
        apply: apply.ok_or_else(|| missing("apply"))?,
    })
}

/// `pca(rank = R, apply = [...])` of `low_rank:` (see [`crate::low_rank`]).
fn parse_low_rank(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<LowRank> {
    let kind: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected pca(rank = R, apply = [key, value])"))?;
    spans.insert(Field::LowRank, kind.span());
    if kind != "pca" {
        return err(
            kind.span(),
            format!("unknown low-rank basis `{kind}`; expected pca(rank = R, apply = [key, value])"),
        );
    }
    let (mut rank, mut apply, mut residual) = (None, None, 0);
    let close = parse_args(input, "pca", "rank, apply or residual", |name, c| {
        match name.to_string().as_str() {
            "rank" => {
                let (v, sp) = parse_u32(c, "rank")?;
                spans.insert(Field::LowRankRank, sp);
                rank = Some(v);
            }
            "residual" => residual = parse_u32(c, "residual")?.0,
            "apply" => apply = Some(parse_apply(c, Field::LowRankApply, spans)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let missing = |what: &str| syn::Error::new(close, format!("pca(...) is missing `{what}`"));
    Ok(LowRank {
        rank: rank.ok_or_else(|| missing("rank"))?,
        apply: apply.ok_or_else(|| missing("apply"))?,
        residual,
    })
}

/// A positive number as f64 (`10000`, `1_000_000`, `1e6`, `8.0`).
fn parse_f64(input: ParseStream, what: &str) -> syn::Result<(f64, Span)> {
    let lit: syn::Lit = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), format!("expected a number for {what}")))?;
    let v = match &lit {
        syn::Lit::Int(i) => {
            no_suffix(i.span(), i.to_string(), i.suffix(), i.base10_digits())?;
            i.base10_parse::<f64>()?
        }
        syn::Lit::Float(f) => {
            no_suffix(f.span(), f.to_string(), f.suffix(), f.base10_digits())?;
            f.base10_parse::<f64>()?
        }
        _ => return err(lit.span(), format!("expected a number for {what}")),
    };
    Ok((v, lit.span()))
}

/// `post` (the default: keys are stored as given) or
/// `pre(theta = B, style = half|interleaved [, scaling = none|linear(F)])`.
fn parse_rope(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<Option<Rope>> {
    let kind: Ident = input.parse().map_err(|e| {
        syn::Error::new(
            e.span(),
            "expected `post` or pre(theta = B, style = half|interleaved [, scaling = linear(F)])",
        )
    })?;
    spans.insert(Field::Rope, kind.span());
    match kind.to_string().as_str() {
        "post" => return Ok(None),
        "pre" => {}
        k => {
            return err(
                kind.span(),
                format!("unknown rope `{k}`; expected `post` or pre(theta = B, style = half|interleaved)"),
            )
        }
    }
    let (mut theta, mut style, mut scaling) = (None, None, None);
    let close = parse_args(input, "rope", "theta, style or scaling", |name, c| {
        match name.to_string().as_str() {
            "theta" | "base" => {
                let (v, sp) = parse_f64(c, "theta")?;
                spans.insert(Field::RopeTheta, sp);
                theta = Some(v);
            }
            "style" => {
                let (v, sp) = parse_choice(c, "rope style", &["half", "interleaved"])?;
                spans.insert(Field::RopeStyle, sp);
                style = Some(if v == "half" {
                    RopeStyle::Half
                } else {
                    RopeStyle::Interleaved
                });
            }
            "scaling" => {
                let id: Ident = c
                    .parse()
                    .map_err(|e| syn::Error::new(e.span(), "expected scaling: none or linear(F)"))?;
                spans.insert(Field::RopeScaling, id.span());
                match id.to_string().as_str() {
                    "none" => scaling = Some(1.0),
                    "linear" => {
                        let inner;
                        parenthesized!(inner in c);
                        let (v, sp) = parse_f64(&inner, "the linear scaling factor")?;
                        spans.insert(Field::RopeScaling, sp);
                        if !inner.is_empty() {
                            return err(inner.span(), "linear(...) takes one factor, e.g. linear(8)");
                        }
                        scaling = Some(v);
                    }
                    k @ ("yarn" | "dynamic" | "ntk" | "llama3" | "longrope" | "su") => {
                        return err(
                            id.span(),
                            format!("rope scaling `{k}` is not supported yet; use none or linear(F)"),
                        )
                    }
                    k => {
                        return err(
                            id.span(),
                            format!("unknown rope scaling `{k}`; expected none or linear(F)"),
                        )
                    }
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let missing = |what: &str| syn::Error::new(close, format!("pre(...) is missing `{what}`"));
    Ok(Some(Rope {
        theta: theta.ok_or_else(|| missing("theta"))?,
        style: style.ok_or_else(|| missing("style (half or interleaved)"))?,
        scaling: scaling.unwrap_or(1.0),
    }))
}

/// `int8(group = G)`: the integer-domain decode of [`QueryQuant`].
fn parse_query(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<QueryQuant> {
    let kind: Ident = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected a query quantization: int8(group = G)"))?;
    spans.insert(Field::Query, kind.span());
    match kind.to_string().as_str() {
        "int8" => {}
        k @ ("int4" | "fp8" | "int16" | "f16" | "bf16") => {
            return err(
                kind.span(),
                format!("`{k}` query quantization is not supported yet; use int8(group = G)"),
            )
        }
        k => {
            return err(
                kind.span(),
                format!("unknown query quantization `{k}`; expected int8(group = G)"),
            )
        }
    }
    let mut group = None;
    let close = parse_args(input, "int8", "group", |name, c| {
        if name != "group" {
            return Ok(false);
        }
        let (v, sp) = parse_u32(c, "group")?;
        spans.insert(Field::QueryGroup, sp);
        group = Some(v);
        Ok(true)
    })?;
    Ok(QueryQuant {
        group: group.ok_or_else(|| syn::Error::new(close, "int8(...) is missing `group`"))?,
    })
}

fn parse_named_u32(
    content: ParseStream,
    expect: &str,
    field: Field,
    spans: &mut HashMap<Field, Span>,
) -> syn::Result<u32> {
    let id: Ident = content.parse()?;
    if id != expect {
        return err(id.span(), format!("expected `{expect} = ...`, found `{id}`"));
    }
    expect_eq(content, &id)?;
    let (v, sp) = parse_u32(content, expect)?;
    spans.insert(field, sp);
    Ok(v)
}

fn parse_heads(input: ParseStream, spans: &mut HashMap<Field, Span>) -> syn::Result<Heads> {
    let kind: Ident = input.parse()?;
    spans.insert(Field::Heads, kind.span());
    let content;
    let k = kind.to_string();
    match k.as_str() {
        "mha" => {
            parenthesized!(content in input);
            let (n, sp) = parse_u32(&content, "mha heads")?;
            spans.insert(Field::QHeads, sp);
            spans.insert(Field::KvHeads, sp);
            Ok(Heads::Mha(n))
        }
        "gqa" => {
            parenthesized!(content in input);
            let q = parse_named_u32(&content, "q", Field::QHeads, spans)?;
            content.parse::<Token![,]>()?;
            let kv = parse_named_u32(&content, "kv", Field::KvHeads, spans)?;
            if !content.is_empty() {
                content.parse::<Token![,]>()?;
            }
            Ok(Heads::Gqa { q, kv })
        }
        "mqa" => {
            parenthesized!(content in input);
            let q = parse_named_u32(&content, "q", Field::QHeads, spans)?;
            spans.insert(Field::KvHeads, kind.span());
            if !content.is_empty() {
                content.parse::<Token![,]>()?;
            }
            Ok(Heads::Mqa(q))
        }
        "mla" => parse_mla(input, kind.span(), spans).map(Heads::Mla),
        other => err(
            kind.span(),
            format!("unknown head layout `{other}`; expected mha(N), gqa(q = N, kv = M), mqa(q = N) or mla(q = N, latent = L, rope_dim = R)"),
        ),
    }
}

/// `mla(q = N, latent = L, rope_dim = R [, rope = codec])`, arguments in
/// any order; `rope` defaults to `full`.
fn parse_mla(input: ParseStream, kind: Span, spans: &mut HashMap<Field, Span>) -> syn::Result<crate::mla::Mla> {
    let (mut q, mut latent, mut rope_dim, mut rope) = (None, None, None, None);
    let close = parse_args(input, "mla", "q, latent, rope_dim or rope", |name, c| {
        match name.to_string().as_str() {
            "q" => {
                let (v, sp) = parse_u32(c, "q")?;
                spans.insert(Field::QHeads, sp);
                q = Some(v);
            }
            "latent" => {
                let (v, sp) = parse_u32(c, "latent")?;
                spans.insert(Field::MlaLatent, sp);
                latent = Some(v);
            }
            "rope_dim" => {
                let (v, sp) = parse_u32(c, "rope_dim")?;
                spans.insert(Field::MlaRopeDim, sp);
                rope_dim = Some(v);
            }
            "rope" => {
                // The codec parser records key spans: parse into a scratch
                // map and move them to the rope fields.
                let mut own = HashMap::new();
                let codec = parse_codec(c, Tensor::Key, &mut own).map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        e.to_string().replacen("key quant(...)", "mla rope quant(...)", 1),
                    )
                })?;
                for (from, to) in [
                    (Field::Codec(Tensor::Key), Field::MlaRope),
                    (Field::Bits(Tensor::Key), Field::MlaRopeBits),
                    (Field::Group(Tensor::Key), Field::MlaRopeGroup),
                ] {
                    if let Some(sp) = own.get(&from) {
                        spans.insert(to, *sp);
                    }
                }
                rope = Some(codec);
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    spans.insert(Field::KvHeads, kind);
    let missing = |what: &str| syn::Error::new(close, format!("mla(...) is missing `{what}`"));
    Ok(crate::mla::Mla {
        q: q.ok_or_else(|| missing("q"))?,
        latent: latent.ok_or_else(|| missing("latent"))?,
        rope_dim: rope_dim.ok_or_else(|| missing("rope_dim"))?,
        rope: rope.unwrap_or(Codec::Full),
    })
}

fn parse_number(input: ParseStream) -> syn::Result<(f32, Span)> {
    let lit: syn::Lit = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), "expected a positive number"))?;
    match &lit {
        syn::Lit::Int(i) => no_suffix(i.span(), i.to_string(), i.suffix(), i.base10_digits())?,
        syn::Lit::Float(f) => no_suffix(f.span(), f.to_string(), f.suffix(), f.base10_digits())?,
        _ => {}
    }
    let v = match &lit {
        syn::Lit::Float(f) => f.base10_parse::<f32>()?,
        syn::Lit::Int(i) => i.base10_parse::<f32>()?,
        _ => return err(lit.span(), "expected a positive number"),
    };
    Ok((v, lit.span()))
}

impl Parse for SchemeDecl {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let docs = input.call(syn::Attribute::parse_outer)?;
        if let Some(a) = docs.iter().find(|a| !a.path().is_ident("doc")) {
            return Err(syn::Error::new_spanned(
                a,
                "only doc comments may precede a scheme; attributes are not supported",
            ));
        }
        let vis: syn::Visibility = input.parse()?;
        let ident: Ident = input
            .parse()
            .map_err(|e| syn::Error::new(e.span(), "expected a scheme name, e.g. `pub Kivi2 { ... }`"))?;
        let body;
        braced!(body in input);
        let mut spans = HashMap::new();
        spans.insert(Field::Name, ident.span());
        let mut seen: HashMap<String, Span> = HashMap::new();
        let mut key = None;
        let mut value = None;
        let mut residual = 0;
        let mut sinks = 0;
        let mut flush = Flush::Eager;
        let mut heads = None;
        let mut head_dim = None;
        let mut dtype = Dtype::F16;
        let mut softmax_scale = None;
        let mut sliding_window = None;
        let mut nonfinite = NonFinite::Reject;
        let (mut rotation, mut outliers, mut center) = (None, None, None);
        let mut rope = None;
        let mut query = None;
        let mut low_rank = None;
        while !body.is_empty() {
            let field: Ident = body.parse()?;
            let name = field.to_string();
            if seen.contains_key(&name) {
                return err(field.span(), format!("duplicate field `{name}`"));
            }
            if name == "mla" || name == "latent" {
                return err(
                    field.span(),
                    format!("`{name}` is not a field; an mla cache is a head layout: `heads: mla(q = N, latent = L, rope_dim = R)`"),
                );
            }
            if let Some((_, what)) = FUTURE_FIELDS.iter().find(|(n, _)| *n == name) {
                return err(
                    field.span(),
                    format!("field `{name}` is not supported yet (planned: {what})"),
                );
            }
            body.parse::<Token![:]>()
                .map_err(|e| syn::Error::new(e.span(), format!("expected `:` after `{name}`")))?;
            match name.as_str() {
                "key" => key = Some(parse_codec(&body, Tensor::Key, &mut spans)?),
                "value" => value = Some(parse_codec(&body, Tensor::Value, &mut spans)?),
                "residual" => {
                    let (v, sp) = parse_u32(&body, "residual")?;
                    spans.insert(Field::Residual, sp);
                    residual = v;
                }
                "sinks" => {
                    let (v, sp) = parse_u32(&body, "sinks")?;
                    spans.insert(Field::Sinks, sp);
                    sinks = v;
                }
                "flush" => {
                    let (v, sp) = parse_choice(&body, "flush policy", &["eager", "chunked"])?;
                    spans.insert(Field::Flush, sp);
                    flush = if v == "eager" { Flush::Eager } else { Flush::Chunked };
                }
                "heads" => heads = Some(parse_heads(&body, &mut spans)?),
                "head_dim" => {
                    let (v, sp) = parse_u32(&body, "head_dim")?;
                    spans.insert(Field::HeadDim, sp);
                    head_dim = Some(v);
                }
                "dtype" => {
                    let (v, sp) = parse_choice(&body, "dtype", &["f16", "bf16", "f32"])?;
                    spans.insert(Field::Dtype, sp);
                    dtype = match v {
                        "f16" => Dtype::F16,
                        "bf16" => Dtype::Bf16,
                        _ => Dtype::F32,
                    };
                }
                "softmax_scale" => {
                    let (v, sp) = parse_number(&body)?;
                    spans.insert(Field::SoftmaxScale, sp);
                    softmax_scale = Some(v);
                }
                "sliding_window" => {
                    if body.peek(Ident) {
                        let (_, sp) = parse_choice(&body, "sliding window", &["none"])?;
                        spans.insert(Field::SlidingWindow, sp);
                    } else {
                        let (v, sp) = parse_u32(&body, "sliding_window")?;
                        spans.insert(Field::SlidingWindow, sp);
                        sliding_window = Some(v);
                    }
                }
                "nonfinite" => {
                    let (_, sp) = parse_choice(&body, "non-finite policy", &["reject"])?;
                    spans.insert(Field::NonFinite, sp);
                    nonfinite = NonFinite::Reject;
                }
                "rotation" => rotation = Some(parse_rotation(&body, &mut spans)?),
                "outliers" => outliers = Some(parse_outliers(&body, &mut spans)?),
                "center" => center = Some(parse_center(&body, &mut spans)?),
                "rope" => rope = parse_rope(&body, &mut spans)?,
                "pre_rope" | "rotary" => {
                    return err(
                        field.span(),
                        format!("`{name}` is not a field; write `rope: pre(theta = B, style = half)`"),
                    )
                }
                "query" => query = Some(parse_query(&body, &mut spans)?),
                "low_rank" => low_rank = Some(parse_low_rank(&body, &mut spans)?),
                "hadamard" => {
                    return err(
                        field.span(),
                        "`hadamard` is a kind of rotation; write `rotation: hadamard(block = B, apply = [key, value])`",
                    )
                }
                other => {
                    return err(
                        field.span(),
                        format!("unknown field `{other}`; expected one of {FIELDS}"),
                    );
                }
            }
            seen.insert(name, field.span());
            if !body.is_empty() {
                body.parse::<Token![,]>()
                    .map_err(|e| syn::Error::new(e.span(), "expected `,` between fields"))?;
            }
        }
        // An mla cache stores one latent, read as key and value: its codec
        // is `key`, and its head_dim is the latent width.
        if let Some(Heads::Mla(m)) = heads {
            if value.is_some() {
                let span = spans.get(&Field::Codec(Tensor::Value)).copied().unwrap_or(ident.span());
                return err(
                    span,
                    "an mla cache stores one latent per token, read by the scores and the output alike; its codec is `key` (leave `value` out)",
                );
            }
            value = key;
            head_dim = head_dim.or(Some(m.latent));
        }
        let scheme = Scheme {
            name: ident.to_string(),
            key: key.ok_or_else(|| syn::Error::new(ident.span(), "scheme is missing field `key`"))?,
            value: value.ok_or_else(|| syn::Error::new(ident.span(), "scheme is missing field `value`"))?,
            residual,
            sinks,
            flush,
            heads,
            head_dim,
            dtype,
            softmax_scale,
            sliding_window,
            nonfinite,
            rotation,
            outliers,
            center,
            rope,
            query,
            low_rank,
        };
        if let Err(e) = validate(&scheme) {
            let span = span_for(&spans, e.field).unwrap_or_else(|| ident.span());
            return Err(syn::Error::new(span, e.message));
        }
        Ok(SchemeDecl {
            docs,
            vis,
            ident,
            scheme,
            spans,
        })
    }
}

/// The span that best points at `field`, falling back to its parent.
pub fn span_for(spans: &HashMap<Field, Span>, field: Field) -> Option<Span> {
    let parent = match field {
        Field::Bits(t)
        | Field::Axis(t)
        | Field::Group(t)
        | Field::Scale(t)
        | Field::Levels(t)
        | Field::Norm(t)
        | Field::VqDim(t)
        | Field::VqEntries(t)
        | Field::VqCodebook(t) => Some(Field::Codec(t)),
        Field::RotationBlock | Field::RotationApply => Some(Field::Rotation),
        Field::OutliersPerToken | Field::OutliersApply => Some(Field::Outliers),
        Field::CenterTokens | Field::CenterApply => Some(Field::Center),
        Field::RopeTheta | Field::RopeStyle | Field::RopeScaling => Some(Field::Rope),
        Field::QHeads | Field::KvHeads | Field::MlaLatent | Field::MlaRopeDim | Field::MlaRope => Some(Field::Heads),
        Field::MlaRopeBits | Field::MlaRopeGroup => Some(Field::MlaRope),
        Field::QueryGroup => Some(Field::Query),
        Field::LowRankRank | Field::LowRankApply => Some(Field::LowRank),
        _ => None,
    };
    spans
        .get(&field)
        .or_else(|| parent.and_then(|p| spans.get(&p)))
        .or_else(|| spans.get(&Field::Name))
        .copied()
}

impl Parse for SchemeList {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut v = Vec::new();
        while !input.is_empty() {
            v.push(input.parse()?);
        }
        if v.is_empty() {
            return Err(input.error("expected at least one scheme declaration"));
        }
        Ok(SchemeList(v))
    }
}

/// A scheme text that failed to parse or validate, with its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub message: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.column, self.message)
    }
}

impl std::error::Error for ParseError {}

fn to_parse_error(e: syn::Error) -> ParseError {
    ParseError::at(e.span(), e.to_string())
}

impl ParseError {
    /// An error at `span` of a text parsed at run time (line and column of
    /// its start).
    pub fn at(span: Span, message: impl Into<String>) -> ParseError {
        let start = span.start();
        ParseError {
            message: message.into(),
            line: start.line.max(1),
            column: start.column + 1,
        }
    }
}

/// Parses every declaration in `text`, with names, visibility and the span
/// of every field (what the macro sees), for checks that run after parsing.
pub fn parse_decls(text: &str) -> Result<Vec<SchemeDecl>, ParseError> {
    let tokens: proc_macro2::TokenStream = text.parse().map_err(|e: proc_macro2::LexError| {
        ParseError::at(
            e.span(),
            "the text is not valid scheme syntax (unbalanced brackets or a stray character)",
        )
    })?;
    syn::parse2::<SchemeList>(tokens).map(|l| l.0).map_err(to_parse_error)
}

/// Parses every scheme in `text` (the same grammar as `kivi::scheme!`).
///
/// ```
/// let s = kivi_spec::parse_schemes("pub A { key: full, value: full } B { key: full, value: full }").unwrap();
/// assert_eq!(s.len(), 2);
/// ```
pub fn parse_schemes(text: &str) -> Result<Vec<Scheme>, ParseError> {
    Ok(parse_decls(text)?.into_iter().map(|d| d.scheme).collect())
}

/// Parses a text that holds exactly one scheme.
///
/// ```
/// let s = kivi_spec::parse_scheme(
///     "Kivi2 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 128 }",
/// ).unwrap();
/// assert_eq!(s.residual, 128);
/// let e = kivi_spec::parse_scheme("X {\n  key: full,\n  value: quant(bits = 5, axis = token, group = 32) }").unwrap_err();
/// assert_eq!((e.line, e.column), (3, 23));
/// ```
pub fn parse_scheme(text: &str) -> Result<Scheme, ParseError> {
    let mut all = parse_schemes(text)?;
    if all.len() != 1 {
        return Err(ParseError {
            message: format!("expected one scheme, found {}", all.len()),
            line: 1,
            column: 1,
        });
    }
    Ok(all.remove(0))
}
