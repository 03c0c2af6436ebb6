//! `vq(dim = M, entries = E [, codebook = NAME])`: parsing, canonical text
//! and hash, exact accounting, and spanned refusals of bad numbers and of
//! combinations the codec does not implement.

use kivi_spec::layout::{bits_per_element, bytes_per_token_per_head, regions, BlockLayout};
use kivi_spec::{canonical, parse_scheme, scheme_hash, Codec, Heads, Tensor, Vq};

const KIVI2_KEY: &str = "key: quant(bits = 2, axis = channel, group = 32)";

fn scheme(body: &str) -> kivi_spec::Scheme {
    parse_scheme(&format!("S {{ {body} }}")).unwrap_or_else(|e| panic!("{body}: {e}"))
}

/// The error of `text`, checking that it points at the first occurrence
/// of `at` and that its message holds every needle.
fn refused_at(text: &str, at: &str, needles: &[&str]) {
    let e = parse_scheme(text).expect_err(text);
    for n in needles {
        assert!(e.message.contains(n), "{text}\n  message: {}\n  lacks {n:?}", e.message);
    }
    let col = text.find(at).unwrap_or_else(|| panic!("{at:?} not in {text}")) + 1;
    assert_eq!((e.line, e.column), (1, col), "{text}: {}", e.message);
}

#[test]
fn vq_parses_with_and_without_a_codebook_name() {
    let s = scheme("key: vq(dim = 8, entries = 256), value: vq(entries = 16, dim = 4, codebook = loop), residual: 32");
    assert_eq!(
        s.key,
        Codec::Vq(Vq {
            dim: 8,
            entries: 256,
            codebook: None
        })
    );
    let Codec::Vq(v) = s.value else {
        panic!("value is {:?}", s.value)
    };
    assert_eq!((v.dim, v.entries, v.codebook.unwrap().as_str()), (4, 16, "loop"));
    assert!(s.has_vq());
}

#[test]
fn canonical_text_round_trips_and_every_field_changes_the_hash() {
    let base = "key: vq(dim = 8, entries = 256), value: quant(bits = 2, axis = token, group = 32), residual: 32";
    let s = scheme(base);
    let text = canonical(&s);
    assert!(text.contains("key: vq(dim = 8, entries = 256),"), "{text}");
    assert_eq!(parse_scheme(&text).unwrap(), s);
    let named = scheme(&base.replace("256)", "256, codebook = shared)"));
    assert!(canonical(&named).contains("vq(dim = 8, entries = 256, codebook = shared)"));
    assert_eq!(parse_scheme(&canonical(&named)).unwrap(), named);
    let h = scheme_hash(&s);
    for other in [
        base.replace("dim = 8", "dim = 4"),
        base.replace("256", "16"),
        base.replace("256)", "256, codebook = a)"),
    ] {
        assert_ne!(scheme_hash(&scheme(&other)), h, "{other}");
    }
    let (a, b) = (
        scheme(&base.replace("256)", "256, codebook = a)")),
        scheme(&base.replace("256)", "256, codebook = b)")),
    );
    assert_ne!(scheme_hash(&a), scheme_hash(&b));
    // Argument order and the scheme's name do not matter.
    let mut r = scheme(&base.replace("dim = 8, entries = 256", "entries = 256, dim = 8"));
    r.name = "other".into();
    assert_eq!(scheme_hash(&r), h);
}

#[test]
fn bits_per_element_is_log2_entries_over_dim_plus_nothing_per_token() {
    for (dim, entries, bits) in [
        (8, 256, 1.0),
        (4, 256, 2.0),
        (16, 65536, 1.0),
        (8, 16, 0.5),
        (2, 4, 1.0),
    ] {
        let s = scheme(&format!(
            "key: vq(dim = {dim}, entries = {entries}), value: vq(dim = {dim}, entries = {entries}), residual: 16"
        ))
        .with_shape(Heads::Mqa(4), 256)
        .unwrap();
        assert_eq!(bits_per_element(&s), bits, "dim {dim} entries {entries}");
    }
    // Mixed with 2-bit channel-axis keys (3 bits all-in per key element
    // with its f16 scale and zero per 32 tokens): (3 + 1) / 2.
    let s = scheme(&format!("{KIVI2_KEY}, value: vq(dim = 8, entries = 256), residual: 32"))
        .with_shape(Heads::Mqa(4), 256)
        .unwrap();
    assert_eq!(bits_per_element(&s), 2.0);
    let (bytes, per) = bytes_per_token_per_head(&s);
    assert_eq!(bytes * 2 / per, (256 * 3 / 8 + 256 / 8) * 2);
    // Codes that do not fill a word: 12-bit codes, two per word.
    let s = scheme("key: vq(dim = 8, entries = 4096), value: full, residual: 16")
        .with_shape(Heads::Mha(1), 64)
        .unwrap();
    let l = BlockLayout::new(&s, s.shape().unwrap(), 64);
    assert_eq!(l.key.words_per_token, 4); // 8 codes, 2 per word
    assert_eq!(l.key.params_per_block, 0);
}

#[test]
fn vq_tokens_leave_the_window_one_at_a_time() {
    let s = scheme("key: vq(dim = 8, entries = 256), value: full, residual: 32, sinks: 4");
    let r = regions(&s, Tensor::Key, 100);
    assert_eq!((r.sinks, r.quantized, r.window), (4, 64, 32));
    let r = regions(&s, Tensor::Key, 20);
    assert_eq!((r.sinks, r.quantized, r.window), (4, 0, 16));
}

#[test]
fn bad_numbers_are_spanned_errors() {
    let t = "S { key: vq(dim = 6, entries = 256), value: full, head_dim: 64 }";
    refused_at(t, "6,", &["dim = 6", "does not divide head_dim 64"]);
    let t = "S { key: vq(dim = 0, entries = 256), value: full }";
    refused_at(t, "0,", &["dim = 0"]);
    for e in ["100", "1", "0", "131072"] {
        let t = format!("S {{ key: full, value: vq(dim = 8, entries = {e}) }}");
        refused_at(&t, &format!("{e})"), &[&format!("entries = {e}"), "power of two"]);
    }
    let t = "S { key: vq(dim = 8), value: full }";
    refused_at(t, "vq", &["missing `entries`"]);
    let t = "S { key: vq(dim = 8, entries = 256, bits = 2), value: full }";
    refused_at(t, "bits", &["unknown vq argument `bits`"]);
    let t = "S { key: vq(dim = 8, dim = 4, entries = 256), value: full }";
    refused_at(t, "dim = 4", &["duplicate vq argument `dim`"]);
    let t = "S { key: vq(dim = 8, entries = 256, codebook = 3), value: full }";
    refused_at(t, "3)", &["codebook name"]);
    let long = "x".repeat(40);
    let t = format!("S {{ key: vq(dim = 8, entries = 256, codebook = {long}), value: full }}");
    refused_at(&t, &long, &["at most 31 bytes"]);
    // With a shape bound later, the check still runs.
    let s = scheme("key: vq(dim = 24, entries = 256), value: full");
    assert!(s.with_shape(Heads::Mha(2), 64).is_err());
    assert!(s.with_shape(Heads::Mha(2), 48).is_ok());
}

#[test]
fn unimplemented_combinations_are_refused_by_name() {
    let v = "value: vq(dim = 8, entries = 256)";
    let t = format!("S {{ {KIVI2_KEY}, {v}, residual: 32, rotation: hadamard(block = 64, apply = [key, value]) }}");
    refused_at(&t, "[key, value]", &["rotation", "vq value"]);
    let t = format!("S {{ {KIVI2_KEY}, {v}, residual: 32, outliers: sparse(per_token = 2, apply = [value]) }}");
    refused_at(&t, "[value]", &["outliers", "vq value"]);
    let t = format!("S {{ {KIVI2_KEY}, {v}, residual: 32, center: channel_mean(tokens = 16, apply = [value]) }}");
    refused_at(&t, "[value]", &["centering", "vq value"]);
    let t =
        "S { key: vq(dim = 8, entries = 256), value: full, residual: 32, rope: pre(theta = 10000.0, style = half) }";
    refused_at(t, "pre", &["vq keys", "rope: pre"]);
    let t = "S { key: vq(dim = 8, entries = 256), heads: mla(q = 16, latent = 512, rope_dim = 64) }";
    refused_at(t, "vq", &["mla"]);
    let t = "S { key: vq(dim = 8, entries = 256), value: full, residual: 32, query: int8(group = 32) }";
    refused_at(t, "int8", &["query: int8"]);
    // One name, one shape.
    let t = "S { key: vq(dim = 8, entries = 256, codebook = c), value: vq(dim = 4, entries = 256, codebook = c) }";
    refused_at(t, "c) }", &["codebook `c`", "one shape"]);
    // The same name and shape on both tensors is fine; so are windows
    // with only vq tensors.
    scheme("key: vq(dim = 8, entries = 256, codebook = c), value: vq(dim = 8, entries = 256, codebook = c), residual: 32, sinks: 4");
}

#[test]
fn a_top_level_vq_field_points_at_the_codec() {
    let e = parse_scheme("S { key: full, value: full, vq: x }").unwrap_err();
    assert!(e.message.contains("key: vq(dim = 8"), "{}", e.message);
}
