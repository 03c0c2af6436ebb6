//! `heads: mla(...)`: grammar, validation, canonical text and hash, and the
//! exact bytes per token of DeepSeek-V2-Lite-shaped MLA caches.

use kivi_spec::*;

const LATENT2: &str = "quant(bits = 2, axis = channel, group = 32)";

fn mla(rope: &str, key: &str) -> Scheme {
    parse_scheme(&format!(
        "M {{ key: {key}, residual: 64, heads: mla(q = 16, latent = 512, rope_dim = 64{rope}) }}"
    ))
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn mla_parses_to_one_latent_codec_and_a_rope_codec() {
    let s = mla("", LATENT2);
    let m = s.mla().unwrap();
    assert_eq!((m.q, m.latent, m.rope_dim, m.rope), (16, 512, 64, Codec::Full));
    // The latent is the value: one codec, and head_dim is the latent width.
    assert_eq!(s.value, s.key);
    assert_eq!(s.head_dim, Some(512));
    let shape = s.shape().unwrap();
    assert_eq!((shape.q_heads, shape.kv_heads, shape.head_dim), (16, 1, 512));
    let r = mla(", rope = quant(bits = 4, axis = token, group = 64)", LATENT2);
    let q = *r.mla().unwrap().rope.quant().unwrap();
    assert_eq!((q.bits, q.axis, q.group), (4, Axis::Token, 64));
    // Default scale: the absorbed key's width.
    assert_eq!(s.effective_softmax_scale(512), 1.0 / 576f32.sqrt());
}

#[test]
fn mla_canonical_text_round_trips_and_hash_tracks_meaning() {
    let variants = [
        mla("", LATENT2),
        mla(", rope = full", LATENT2),
        mla(", rope = quant(bits = 4, axis = token, group = 64)", LATENT2),
        mla(", rope = quant(bits = 4, axis = channel, group = 32)", LATENT2),
        mla("", "quant(bits = 4, axis = token, group = 64)"),
    ];
    for s in &variants {
        let text = canonical(s);
        assert!(
            text.contains("heads: mla(q = 16, latent = 512, rope_dim = 64, rope = "),
            "{text}"
        );
        assert!(!text.contains("value:"), "an mla scheme has no value field:\n{text}");
        let back = parse_scheme(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
        assert_eq!(&back, s);
        assert_eq!(canonical(&back), text);
        assert_eq!(scheme_hash(&back), scheme_hash(s));
    }
    // `rope = full` is the default; everything else changes the hash.
    assert_eq!(scheme_hash(&variants[0]), scheme_hash(&variants[1]));
    for (i, a) in variants.iter().enumerate().skip(1) {
        for b in variants.iter().skip(i + 1) {
            assert_ne!(scheme_hash(a), scheme_hash(b));
        }
    }
    // Argument order and an explicit matching head_dim do not matter.
    let spelled = parse_scheme(&format!(
        "N {{ heads: mla(rope_dim = 64, latent = 512, q = 16), head_dim: 512, residual: 64, key: {LATENT2} }}"
    ))
    .unwrap();
    assert_eq!(scheme_hash(&spelled), scheme_hash(&variants[0]));
    // Against the MQA scheme of the same latent codec: different meaning.
    let mqa = parse_scheme(&format!(
        "N {{ key: {LATENT2}, value: {LATENT2}, residual: 64, heads: mqa(q = 16), head_dim: 512 }}"
    ))
    .unwrap();
    assert_ne!(scheme_hash(&mqa), scheme_hash(&variants[0]));
}

/// Each refusal names the value and points at it (line:column of the
/// offending token).
#[test]
fn mla_errors_point_at_the_offending_token() {
    let cases: &[(&str, &str, &str)] = &[
        // (text, message fragment, token the error points at)
        (
            "S { key: full, value: full, heads: mla(q = 8, latent = 64, rope_dim = 16) }",
            "leave `value` out",
            "full, heads",
        ),
        ("S { key: full, heads: mla(q = 8, rope_dim = 16) }", "missing `latent`", "(q = 8"),
        (
            "S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 16, rope = quant(bits = 5, axis = token, group = 16)) }",
            "mla rope bits = 5",
            "5, axis",
        ),
        (
            "S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 16, rope = quant(bits = 4, axis = token, group = 32)) }",
            "does not divide rope_dim 16",
            "32))",
        ),
        (
            "S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 16, rope = quant(bits = 4, axis = token)) }",
            "mla rope quant(...) is missing `group`",
            "quant(bits = 4",
        ),
        ("S { key: full, heads: mla(q = 8, latent = 2000, rope_dim = 16) }", "latent = 2000", "2000"),
        ("S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 0) }", "rope_dim = 0", "0)"),
        ("S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 16), head_dim: 32 }", "head_dim = 32", "32 }"),
        ("S { key: full, heads: mla(q = 8, latent = 64, rope_dim = 16, kv = 2) }", "unknown mla argument `kv`", "kv ="),
        ("S { key: full, heads: mla(q = 8, q = 8, latent = 64, rope_dim = 16) }", "duplicate mla argument `q`", "q = 8, latent"),
        ("S { key: full, mla: x }", "`heads: mla(", "mla:"),
        (
            "S { key: quant(bits = 2, axis = channel, group = 32), residual: 32, outliers: sparse(per_token = 2, apply = [key]), heads: mla(q = 8, latent = 64, rope_dim = 16) }",
            "not supported with mla heads yet",
            "sparse",
        ),
    ];
    for (text, fragment, at) in cases {
        let e = parse_scheme(text).unwrap_err();
        assert!(e.message.contains(fragment), "{text}\n{}", e.message);
        let col = text.find(at).unwrap_or_else(|| panic!("{at} not in {text}")) + 1;
        assert_eq!((e.line, e.column), (1, col), "{text}\n{}", e.message);
    }
}

#[test]
fn with_shape_binds_an_mla_layout_only_at_its_latent_width() {
    let m = Mla {
        q: 16,
        latent: 512,
        rope_dim: 64,
        rope: Codec::Full,
    };
    let mut base = presets::kivi2();
    base.value = base.key; // the latent has one codec
    let s = base.with_shape(Heads::Mla(m), 512).unwrap();
    assert_eq!(s.mla(), Some(m));
    let e = base.with_shape(Heads::Mla(m), 256).unwrap_err();
    assert_eq!(e.field, Field::HeadDim);
    // kivi2's value codec differs from its key codec: not one latent codec.
    assert_eq!(
        presets::kivi2().with_shape(Heads::Mla(m), 512).unwrap_err().field,
        Field::Codec(Tensor::Value)
    );
}

/// Exact bytes per token on DeepSeek-V2-Lite's cache (latent 512 + RoPE 64),
/// against an f16 cache of both (1152 B) and DeepSeek's FP8 layout (656 B:
/// 512 FP8 + 4 f32 tile scales + 64 bf16).
#[test]
fn mla_bytes_per_token_are_exact() {
    let per = |s: &Scheme| {
        let (b, n) = mla_bytes_per_token(s).unwrap();
        b as f64 / n as f64
    };
    let f16 = parse_scheme("F { key: full, heads: mla(q = 16, latent = 512, rope_dim = 64) }").unwrap();
    assert_eq!(per(&f16), 1152.0);
    // 2-bit latent, channel g32: 128 B codes + 512 channels x (2 + 2) B / 32.
    assert_eq!(per(&mla("", LATENT2)), 128.0 + 64.0 + 128.0);
    // 4-bit rope, token g64: 32 B codes + 4 B.
    assert_eq!(
        per(&mla(", rope = quant(bits = 4, axis = token, group = 64)", LATENT2)),
        192.0 + 36.0
    );
    // 4-bit latent, token g64: 256 B + 8 groups x 4 B.
    assert_eq!(
        per(&mla("", "quant(bits = 4, axis = token, group = 64)")),
        256.0 + 32.0 + 128.0
    );
    // Whole-sequence count: 200 tokens with R = 64 on the channel axis:
    // 128 quantized (4 groups), 72 in the window; the exact rope part.
    let (lat, rope) = mla::mla_bytes_for_tokens(&mla("", LATENT2), 200).unwrap();
    assert_eq!(lat, 128 * 128 + 4 * 512 * 4 + 72 * 512 * 2);
    assert_eq!(rope, 200 * 64 * 2);
    // The block layout holds the same bytes per block.
    let s = mla("", LATENT2);
    let l = MlaLayout::new(&s, s.mla().unwrap(), 64);
    assert_eq!(l.block_words * 4, 64 * 320);
    assert_eq!(mla::mla_block_tokens(&s, s.mla().unwrap()), 64);
}
