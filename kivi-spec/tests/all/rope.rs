//! `rope: pre(...)`: the grammar, its canonical text and hash, and its
//! refusals (each at the token that caused it).

use kivi_spec::{canonical, parse_scheme, scheme_hash, Rope, RopeStyle};

const KEYS: &str = "key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32)";

fn with(rope: &str) -> String {
    format!("S {{ {KEYS}, residual: 32, head_dim: 64, {rope} }}")
}

#[test]
fn parses_both_styles_bases_and_scaling() {
    let s = parse_scheme(&with("rope: pre(theta = 1_000_000, style = half)")).unwrap();
    assert_eq!(
        s.rope,
        Some(Rope {
            theta: 1e6,
            style: RopeStyle::Half,
            scaling: 1.0
        })
    );
    let s = parse_scheme(&with(
        "rope: pre(style = interleaved, theta = 10000.0, scaling = linear(8))",
    ))
    .unwrap();
    assert_eq!(
        s.rope,
        Some(Rope {
            theta: 1e4,
            style: RopeStyle::Interleaved,
            scaling: 8.0
        })
    );
    // `post` is the default spelled out: keys stored as given.
    let post = parse_scheme(&with("rope: post")).unwrap();
    let plain = parse_scheme(&format!("S {{ {KEYS}, residual: 32, head_dim: 64 }}")).unwrap();
    assert_eq!(post, plain);
}

#[test]
fn canonical_text_round_trips_and_the_hash_sees_every_argument() {
    let texts = [
        "rope: pre(theta = 10000, style = half)",
        "rope: pre(theta = 1000000, style = half)",
        "rope: pre(theta = 10000, style = interleaved)",
        "rope: pre(theta = 10000, style = half, scaling = linear(8))",
        "rope: pre(theta = 10000, style = half, scaling = linear(0.5))",
    ];
    let plain = parse_scheme(&format!("S {{ {KEYS}, residual: 32, head_dim: 64 }}")).unwrap();
    let mut hashes = vec![scheme_hash(&plain)];
    for t in texts {
        let s = parse_scheme(&with(t)).unwrap();
        let c = canonical(&s);
        assert!(c.contains("    rope: pre(theta = "), "{c}");
        assert_eq!(parse_scheme(&c).unwrap(), s, "{c}");
        assert_eq!(canonical(&parse_scheme(&c).unwrap()), c);
        hashes.push(scheme_hash(&s));
    }
    let n = hashes.len();
    hashes.sort();
    hashes.dedup();
    assert_eq!(hashes.len(), n, "every rope argument changes the hash");
    // `scaling = none` is the default and prints as such.
    let s = parse_scheme(&with("rope: pre(theta = 10000, style = half, scaling = none)")).unwrap();
    assert!(canonical(&s).contains("rope: pre(theta = 10000.0, style = half, scaling = none),"));
    // Without `rope` the canonical text has no rope line (old hashes hold).
    assert!(!canonical(&plain).contains("rope"));
}

#[test]
fn refusals_point_at_the_offending_token() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "rope: pre(theta = 0.5, style = half)",
            "0.5",
            "rope theta = 0.5 must be a number above 1",
        ),
        (
            "rope: pre(theta = 1, style = half)",
            "1,",
            "rope theta = 1 must be a number above 1",
        ),
        (
            "rope: pre(theta = 10000, style = diagonal)",
            "diagonal",
            "unknown rope style `diagonal`; expected one of half, interleaved",
        ),
        (
            "rope: pre(theta = 10000)",
            "(",
            "pre(...) is missing `style (half or interleaved)`",
        ),
        ("rope: pre(style = half)", "(", "pre(...) is missing `theta`"),
        (
            "rope: pre(theta = 10000, style = half, scaling = linear(0))",
            "0)",
            "rope scaling factor = 0 must be above 0",
        ),
        (
            "rope: pre(theta = 10000, style = half, scaling = yarn)",
            "yarn",
            "rope scaling `yarn` is not supported yet",
        ),
        (
            "rope: pre(theta = 10000, style = half, dim = 32)",
            "dim",
            "unknown rope argument `dim`; expected theta, style or scaling",
        ),
        (
            "rope: pre(theta = 10000, style = half, style = half)",
            "style = half)",
            "duplicate rope argument `style`",
        ),
        (
            "rope: pre(theta = 10000f32, style = half)",
            "10000f32",
            "has a type suffix",
        ),
        ("rope: sideways", "sideways", "unknown rope `sideways`"),
        (
            "pre_rope: pre(theta = 10000, style = half)",
            "pre_rope",
            "write `rope: pre(theta = B, style = half)`",
        ),
    ];
    for (field, at, msg) in cases {
        let text = with(field);
        let e = parse_scheme(&text).unwrap_err();
        assert!(e.message.contains(msg), "{field}: {}", e.message);
        let col = text.find(field).unwrap() + field.rfind(at).unwrap() + 1;
        assert_eq!((e.line, e.column), (1, col), "{field}: {}", e.message);
    }
}

#[test]
fn refuses_odd_heads_and_key_transforms() {
    let e = parse_scheme("S { key: full, value: quant(bits = 2, axis = channel, group = 32), head_dim: 63, rope: pre(theta = 10000, style = half) }").unwrap_err();
    assert!(e.message.contains("head_dim 63 is odd"), "{}", e.message);
    for extra in [
        "rotation: hadamard(block = 32, apply = [key])",
        "center: channel_mean(tokens = 32, apply = [key])",
    ] {
        let e = parse_scheme(&with(&format!("{extra}, rope: pre(theta = 10000, style = half)"))).unwrap_err();
        assert!(
            e.message.contains("with rope: pre(...) is not supported yet"),
            "{extra}: {}",
            e.message
        );
        let e2 = parse_scheme(&with(&format!(
            "{}, rope: pre(theta = 10000, style = half)",
            extra.replace("[key]", "[value]")
        )));
        assert!(e2.is_ok(), "{extra} on values: {e2:?}");
    }
}

/// Key outliers alone live in the pre-RoPE domain (no transform to undo per
/// token): accepted, on keys and on both tensors, and hashed apart from the
/// same scheme without them; with a key rotation they are still refused
/// (by the rotation).
#[test]
fn accepts_key_outliers_on_pre_rope_keys() {
    let rope = "rope: pre(theta = 10000, style = half)";
    let base = parse_scheme(&with(rope)).unwrap();
    for apply in ["[key]", "[key, value]"] {
        let s = parse_scheme(&with(&format!(
            "outliers: sparse(per_token = 2, apply = {apply}), {rope}"
        )))
        .unwrap();
        assert_eq!(s.outliers_of(kivi_spec::Tensor::Key), 2, "{apply}");
        assert_ne!(kivi_spec::scheme_hash(&s), kivi_spec::scheme_hash(&base));
        assert_eq!(parse_scheme(&kivi_spec::canonical(&s)).unwrap(), s);
    }
    let e = parse_scheme(&with(&format!(
        "outliers: sparse(per_token = 2, apply = [key]), rotation: hadamard(block = 32, apply = [key]), {rope}"
    )))
    .unwrap_err();
    assert!(
        e.message.contains("a key rotation with rope: pre(...)"),
        "{}",
        e.message
    );
}

#[test]
fn angles_follow_the_definition() {
    let r = Rope {
        theta: 10000.0,
        style: RopeStyle::Half,
        scaling: 4.0,
    };
    // (p / F) * B^(-2i/D)
    assert!((r.angle(8, 8, 64) - 2.0 * 10000f64.powf(-0.25)).abs() < 1e-15);
    let mut x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
    let norm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>();
    let n0 = norm(&x);
    r.rotate(&mut x, 12345);
    assert!((norm(&x) - n0).abs() < 1e-3, "a rotation keeps the norm");
}
