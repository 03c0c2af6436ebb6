//! `kivi::scheme!`: declare KV-cache schemes in Rust, validated at build time.
//! The grammar, validator and messages live in `kivi-spec`; this crate only
//! maps them onto compiler diagnostics and emits code.

use proc_macro::TokenStream;
use quote::quote;

/// Declares one or more schemes. Each becomes a unit struct with a
/// `spec()` constructor, its canonical text and its stable hash.
///
/// See the `kivi` crate docs for the grammar and an example.
#[proc_macro]
pub fn scheme(input: TokenStream) -> TokenStream {
    let list = syn::parse_macro_input!(input as kivi_spec::SchemeList);
    let mut out = proc_macro2::TokenStream::new();
    for decl in list.0 {
        let vis = &decl.vis;
        let docs = &decl.docs;
        let ident = &decl.ident;
        let expr = kivi_spec::tokens::scheme_expr(&decl.scheme);
        let canonical = kivi_spec::canonical(&decl.scheme);
        let hash = kivi_spec::scheme_hash(&decl.scheme);
        let doc = format!("KV-cache scheme `{ident}`.\n\n```text\n{canonical}```");
        // The default variant of each kernel, generated now (a scheme the
        // templates cannot instantiate fails the build here).
        let kernels = match kivi_templates::default_kernels(&decl.scheme) {
            Ok(k) => k,
            Err((msg, field)) => {
                // Point at the part of the scheme the templates cannot do.
                let span = field
                    .and_then(|f| kivi_spec::span_for(&decl.spans, f))
                    .unwrap_or_else(|| ident.span());
                out.extend(syn::Error::new(span, msg).to_compile_error());
                continue;
            }
        };
        let (kernel_names, kernel_sources): (Vec<String>, Vec<String>) = kernels.into_iter().unzip();
        out.extend(quote! {
            #(#docs)*
            #[doc = #doc]
            #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
            #vis struct #ident;
            impl #ident {
                /// The canonical text of this scheme.
                pub const CANONICAL: &'static str = #canonical;
                /// Stable hash of the scheme's meaning (see `kivi::spec::scheme_hash`).
                pub const HASH: u64 = #hash;
                /// CUDA source of the default variant of every kernel, as
                /// `(name, source)`, generated at compile time (empty when
                /// the scheme declares no heads or head_dim, or mla heads).
                pub const KERNELS: &'static [(&'static str, &'static str)] = &[#((#kernel_names, #kernel_sources)),*];
                /// The validated scheme model.
                pub fn spec() -> ::kivi::spec::Scheme {
                    #expr
                }
            }
        });
    }
    out.into()
}

/// Declares a model: a scheme per layer or per layer kind with a default
/// (the grammar of `kivi::spec::parse_model`, parsed by the same code).
/// Becomes a unit struct with the declaration's text and a `decl()`
/// constructor; every error is a compile error at the offending token.
///
/// See the `kivi` crate docs for an example.
#[proc_macro]
pub fn model(input: TokenStream) -> TokenStream {
    let text = input.to_string();
    let decl = syn::parse_macro_input!(input as kivi_spec::ModelDecl);
    if !decl.named {
        return syn::Error::new(decl.name_span, "`kivi::model!` needs a name: `model Gemma3 { ... }`")
            .to_compile_error()
            .into();
    }
    let ident = syn::Ident::new(&decl.name, decl.name_span);
    let vis = if decl.public { quote!(pub) } else { quote!() };
    let doc = format!("KV-cache model declaration `{}`.\n\n```text\n{text}\n```", decl.name);
    quote! {
        #[doc = #doc]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        #vis struct #ident;
        impl #ident {
            /// The declaration's text, as `kivi::spec::parse_model` reads it.
            pub const TEXT: &'static str = #text;
            /// The parsed declaration (validated when the macro expanded).
            pub fn decl() -> ::kivi::spec::ModelDecl {
                ::kivi::spec::parse_model(Self::TEXT).expect("validated when kivi::model! expanded")
            }
        }
    }
    .into()
}
