//! Model-level declarations: a scheme per layer or per layer kind, with a
//! default — what a multi-layer cache (`kivi_candle::KiviKvCache`) and
//! `kivi show --model` take. The same parser serves run-time text
//! ([`parse_model`]) and, through [`ModelDecl`]'s `Parse` impl, a macro.
//!
//! Grammar (whitespace and a trailing comma are free; schemes are the
//! scheme grammar of `parse.rs`, or a preset's name):
//!
//! ```text
//! model   := [pub] 'model' [NAME] '{' entry (',' entry)* '}'
//! entry   := default: scheme                  the scheme of every layer not named otherwise
//!          | sliding: scheme                  layers with a sliding window
//!          | global: scheme                   layers that attend to everything
//!          | layers[INT (, INT)*]: scheme     these layers (0-based); wins over kinds
//!          | layers: INT                      the model's layer count
//!          | window: INT                      the sliding layers' window
//!          | global_layers: [INT (, INT)*]    which layers are global (the rest slide)
//! scheme  := PRESET | NAME '{' fields '}'
//! ```
//!
//! Precedence: `layers[...]`, then the layer's kind, then `default`. The
//! last three entries describe the model (needed by `kivi show`, which has
//! no model at hand; a caller with a model passes its layer kinds to
//! [`ModelDecl::schemes_for`] instead).
//!
//! ```
//! use kivi_spec::{parse_model, LayerKind};
//! let m = parse_model(
//!     "model gemma3 { layers: 18, window: 512, global_layers: [5, 11, 17],
//!                     default: kivi2, global: kivi4, layers[0]: f16 }",
//! ).unwrap();
//! let kinds = m.kinds().unwrap();
//! assert_eq!(kinds[5], LayerKind::Global);
//! let schemes = m.schemes_for(&kinds).unwrap();
//! let names: Vec<&str> = schemes.iter().map(|s| s.name.as_str()).collect();
//! assert_eq!(&names[..7], ["f16", "kivi2", "kivi2", "kivi2", "kivi2", "kivi4", "kivi2"]);
//! // Errors point at the offending token.
//! let e = parse_model("model m { layers: 4, default: kivi2, layers[7]: kivi4 }").unwrap_err();
//! assert_eq!((e.line, e.column), (1, 45));
//! assert!(e.message.contains("layer 7 does not exist"), "{}", e.message);
//! ```

use crate::model::Scheme;
use crate::parse::{ParseError, SchemeDecl};
use crate::presets;
use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::{braced, bracketed, Ident, LitInt, Token};

/// What a layer attends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// A sliding window: only the last `W` tokens.
    Sliding,
    /// Every token.
    Global,
}

impl LayerKind {
    /// `sliding` or `global`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Sliding => "sliding",
            LayerKind::Global => "global",
        }
    }
}

/// A scheme named in a declaration, with where it was written.
#[derive(Clone, Debug)]
pub struct SchemeRef {
    pub scheme: Scheme,
    pub span: Span,
}

/// A parsed model declaration ([module docs](self)).
#[derive(Clone, Debug)]
pub struct ModelDecl {
    /// The declaration's name (`model` when it has none).
    pub name: String,
    pub name_span: Span,
    /// Whether it was named at all (`kivi::model!` needs a name).
    pub named: bool,
    /// Declared `pub` (what `kivi::model!` gives its struct).
    pub public: bool,
    pub default: Option<SchemeRef>,
    pub sliding: Option<SchemeRef>,
    pub global: Option<SchemeRef>,
    /// `layers[...]` entries in order: each layer with its index's span.
    pub overrides: Vec<(Vec<(usize, Span)>, SchemeRef)>,
    /// `layers: N`.
    pub layers: Option<usize>,
    /// `window: W`.
    pub window: Option<u32>,
    /// `global_layers: [...]`.
    pub global_layers: Option<Vec<usize>>,
}

const ENTRIES: &str = "default, sliding, global, layers[...], layers, window, global_layers";

fn err<T>(span: Span, msg: impl std::fmt::Display) -> syn::Result<T> {
    Err(syn::Error::new(span, msg))
}

fn parse_index(input: ParseStream, what: &str) -> syn::Result<(usize, Span)> {
    let lit: LitInt = input
        .parse()
        .map_err(|e| syn::Error::new(e.span(), format!("expected {what}")))?;
    if !lit.suffix().is_empty() {
        return err(lit.span(), format!("`{lit}`: {what} takes a plain number"));
    }
    let v = lit
        .base10_parse::<usize>()
        .map_err(|_| syn::Error::new(lit.span(), format!("`{lit}` is not {what}")))?;
    Ok((v, lit.span()))
}

/// `[INT, INT, ...]`, at least one.
fn parse_list(input: ParseStream, what: &str) -> syn::Result<Vec<(usize, Span)>> {
    let inner;
    bracketed!(inner in input);
    let mut v = Vec::new();
    while !inner.is_empty() {
        v.push(parse_index(&inner, what)?);
        if !inner.is_empty() {
            inner.parse::<Token![,]>()?;
        }
    }
    if v.is_empty() {
        return Err(inner.error(format!("expected at least one {what}")));
    }
    Ok(v)
}

/// A preset's name or an inline scheme `NAME { ... }`.
fn parse_scheme_ref(input: ParseStream) -> syn::Result<SchemeRef> {
    if input.peek(Ident) && input.peek2(syn::token::Brace) {
        let span = input.span();
        let decl: SchemeDecl = input.parse()?;
        return Ok(SchemeRef {
            scheme: decl.scheme,
            span,
        });
    }
    let name: Ident = input.parse().map_err(|e| {
        syn::Error::new(
            e.span(),
            "expected a scheme: a preset's name or `name { key: ..., value: ... }`",
        )
    })?;
    let text = name.to_string();
    match presets::by_name(&text) {
        Some(scheme) => Ok(SchemeRef {
            scheme,
            span: name.span(),
        }),
        None => {
            let names: Vec<String> = presets::listed().into_iter().map(|s| s.name).collect();
            err(
                name.span(),
                format!(
                    "`{text}` is not a preset ({}); write an inline scheme `{text} {{ key: ..., value: ... }}`",
                    names.join(", ")
                ),
            )
        }
    }
}

impl Parse for ModelDecl {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let public = input.peek(Token![pub]);
        if public {
            input.parse::<Token![pub]>()?;
        }
        let kw: Ident = input
            .parse()
            .map_err(|e| syn::Error::new(e.span(), "expected `model`, e.g. `model { default: kivi2 }`"))?;
        if kw != "model" {
            return err(kw.span(), format!("expected `model`, found `{kw}`"));
        }
        let named = input.peek(Ident);
        let (name, name_span) = if named {
            let n: Ident = input.parse()?;
            (n.to_string(), n.span())
        } else {
            ("model".to_string(), kw.span())
        };
        let body;
        braced!(body in input);
        let mut m = ModelDecl {
            name,
            name_span,
            named,
            public,
            default: None,
            sliding: None,
            global: None,
            overrides: Vec::new(),
            layers: None,
            window: None,
            global_layers: None,
        };
        let mut global_spans = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        while !body.is_empty() {
            let key: Ident = body.parse()?;
            let k = key.to_string();
            let listed = k == "layers" && body.peek(syn::token::Bracket);
            let indices = if listed {
                Some(parse_list(&body, "a layer index")?)
            } else {
                None
            };
            if !listed {
                if seen.contains(&k) {
                    return err(key.span(), format!("duplicate entry `{k}`"));
                }
                seen.push(k.clone());
            }
            body.parse::<Token![:]>()
                .map_err(|e| syn::Error::new(e.span(), format!("expected `:` after `{k}`")))?;
            match (k.as_str(), indices) {
                ("layers", Some(idx)) => {
                    for (l, sp) in &idx {
                        if m.overrides.iter().any(|(o, _)| o.iter().any(|(x, _)| x == l)) {
                            return err(*sp, format!("layer {l} is named twice"));
                        }
                    }
                    let s = parse_scheme_ref(&body)?;
                    m.overrides.push((idx, s));
                }
                ("default", None) => m.default = Some(parse_scheme_ref(&body)?),
                ("sliding", None) => m.sliding = Some(parse_scheme_ref(&body)?),
                ("global", None) => m.global = Some(parse_scheme_ref(&body)?),
                ("layers", None) => {
                    let (n, sp) = parse_index(&body, "a layer count")?;
                    if n == 0 {
                        return err(sp, "a model has at least one layer");
                    }
                    m.layers = Some(n);
                }
                ("window", None) => {
                    let (w, sp) = parse_index(&body, "a window in tokens")?;
                    let w = u32::try_from(w).ok().filter(|w| *w > 0).ok_or_else(|| {
                        syn::Error::new(sp, format!("window {w} is out of range; expected 1 to {}", u32::MAX))
                    })?;
                    m.window = Some(w);
                }
                ("global_layers", None) => {
                    let v = parse_list(&body, "a layer index")?;
                    for (i, (l, sp)) in v.iter().enumerate() {
                        if v[..i].iter().any(|(x, _)| x == l) {
                            return err(*sp, format!("layer {l} is listed twice"));
                        }
                    }
                    global_spans = v.iter().map(|(_, s)| *s).collect();
                    m.global_layers = Some(v.into_iter().map(|(l, _)| l).collect());
                }
                (other, _) => {
                    return err(
                        key.span(),
                        format!("unknown entry `{other}`; expected one of {ENTRIES}"),
                    );
                }
            }
            if !body.is_empty() {
                body.parse::<Token![,]>()
                    .map_err(|e| syn::Error::new(e.span(), "expected `,` between entries"))?;
            }
        }
        if m.default.is_none() && m.sliding.is_none() && m.global.is_none() && m.overrides.is_empty() {
            return err(m.name_span, "the model names no scheme; add `default: <scheme>`");
        }
        if let Some(n) = m.layers {
            let listed = m.overrides.iter().flat_map(|(v, _)| v.iter().copied());
            let globals = m
                .global_layers
                .iter()
                .flatten()
                .copied()
                .zip(global_spans.iter().copied());
            if let Some((l, sp)) = listed.chain(globals).find(|(l, _)| *l >= n) {
                return err(
                    sp,
                    format!("layer {l} does not exist: the model has {n} layers (0 to {})", n - 1),
                );
            }
        } else if m.global_layers.is_some() {
            return err(
                global_spans[0],
                "`global_layers` needs the layer count: add `layers: N`",
            );
        }
        Ok(m)
    }
}

impl ModelDecl {
    /// The kind of every layer, when the declaration says how many layers
    /// there are: those in `global_layers` global, the rest sliding if a
    /// `window` is declared, else global.
    pub fn kinds(&self) -> Option<Vec<LayerKind>> {
        let n = self.layers?;
        let globals = self.global_layers.clone().unwrap_or_default();
        Some(
            (0..n)
                .map(|l| {
                    if globals.contains(&l) || self.window.is_none() {
                        LayerKind::Global
                    } else {
                        LayerKind::Sliding
                    }
                })
                .collect(),
        )
    }

    /// The sliding window of every layer from [`Self::kinds`] and `window`.
    pub fn windows(&self) -> Option<Vec<Option<u32>>> {
        Some(
            self.kinds()?
                .into_iter()
                .map(|k| match k {
                    LayerKind::Sliding => self.window,
                    LayerKind::Global => None,
                })
                .collect(),
        )
    }

    /// The scheme of each layer of a model whose layers are `kinds`:
    /// `layers[...]`, else the kind's entry, else `default`. A layer index
    /// past the model or a layer left without a scheme is an error at the
    /// declaration's own position.
    pub fn schemes_for(&self, kinds: &[LayerKind]) -> Result<Vec<Scheme>, ParseError> {
        let n = kinds.len();
        if let Some(decl) = self.layers.filter(|d| *d != n) {
            return Err(ParseError::at(
                self.name_span,
                format!("`{}` declares {decl} layers; the model has {n}", self.name),
            ));
        }
        for (idx, _) in &self.overrides {
            if let Some((l, sp)) = idx.iter().find(|(l, _)| *l >= n) {
                return Err(ParseError::at(
                    *sp,
                    format!("layer {l} does not exist: the model has {n} layers"),
                ));
            }
        }
        kinds
            .iter()
            .enumerate()
            .map(|(l, kind)| {
                let by_index = self
                    .overrides
                    .iter()
                    .find(|(idx, _)| idx.iter().any(|(x, _)| *x == l))
                    .map(|(_, s)| s);
                let by_kind = match kind {
                    LayerKind::Sliding => self.sliding.as_ref(),
                    LayerKind::Global => self.global.as_ref(),
                };
                by_index
                    .or(by_kind)
                    .or(self.default.as_ref())
                    .map(|s| s.scheme.clone())
                    .ok_or_else(|| {
                        ParseError::at(
                            self.name_span,
                            format!(
                                "layer {l} ({}) has no scheme: add `default: <scheme>` or `{}: <scheme>`",
                                kind.name(),
                                kind.name()
                            ),
                        )
                    })
            })
            .collect()
    }
}

/// Parses a model declaration ([module docs](self)).
pub fn parse_model(text: &str) -> Result<ModelDecl, ParseError> {
    let tokens: proc_macro2::TokenStream = text.parse().map_err(|e: proc_macro2::LexError| {
        ParseError::at(
            e.span(),
            "the text is not valid model syntax (unbalanced brackets or a stray character)",
        )
    })?;
    syn::parse2::<ModelDecl>(tokens).map_err(|e| ParseError::at(e.span(), e.to_string()))
}
