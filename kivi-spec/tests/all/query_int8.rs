//! `query: int8(group = G)`: parsed with spans, canonical and hashed,
//! validated against the keys it applies to.

use kivi_spec::{canonical, parse_scheme, presets, scheme_hash, Field, Heads, QueryQuant};

const KIVI2_Q8: &str = "K {
    key: quant(bits = 2, axis = channel, group = 32),
    value: quant(bits = 2, axis = token, group = 32),
    residual: 128,
    query: int8(group = 32),
}";

#[test]
fn parses_round_trips_and_changes_the_hash() {
    let s = parse_scheme(KIVI2_Q8).unwrap();
    assert_eq!(s.query, Some(QueryQuant { group: 32 }));
    let text = canonical(&s);
    assert!(text.contains("query: int8(group = 32),"), "{text}");
    assert_eq!(parse_scheme(&text).unwrap(), s);
    let mut plain = presets::kivi2();
    plain.name = "K".into();
    // A scheme without the field keeps its text and hash.
    assert!(!canonical(&plain).contains("query"));
    assert_ne!(scheme_hash(&plain), scheme_hash(&s));
    let mut other = s.clone();
    other.query = Some(QueryQuant { group: 64 });
    assert_ne!(scheme_hash(&other), scheme_hash(&s));
}

fn err(text: &str) -> (String, usize, usize) {
    let e = parse_scheme(text).unwrap_err();
    (e.message, e.line, e.column)
}

#[test]
fn errors_point_at_the_query_tokens() {
    // Unknown kind: at the kind.
    let (m, l, c) =
        err("K { key: quant(bits = 2, axis = channel, group = 32), value: full,\n query: int4(group = 32) }");
    assert!(m.contains("not supported yet"), "{m}");
    assert_eq!((l, c), (2, 9));
    let (m, ..) = err("K { key: quant(bits = 2, axis = channel, group = 32), value: full, query: q8(group = 32) }");
    assert!(m.contains("unknown query quantization `q8`"), "{m}");
    // A group that is not whole code words: at the number.
    let (m, l, c) =
        err("K { key: quant(bits = 2, axis = channel, group = 32), value: full,\n query: int8(group = 24) }");
    assert!(m.contains("multiple of 16"), "{m}");
    assert_eq!((l, c), (2, 22));
    let (m, ..) = err("K { key: quant(bits = 2, axis = channel, group = 32), value: full, query: int8(size = 32) }");
    assert!(m.contains("unknown int8 argument `size`"), "{m}");
    let (m, ..) = err("K { key: quant(bits = 2, axis = channel, group = 32), value: full, query: int8() }");
    assert!(m.contains("missing `group`"), "{m}");
}

#[test]
fn only_channel_axis_uniform_keys_of_2_or_4_bits() {
    for key in [
        "full",
        "quant(bits = 2, axis = token, group = 32)",
        "quant(bits = 8, axis = channel, group = 32)",
        "quant(bits = 3, axis = channel, group = 32)",
        "quant(bits = 2, axis = channel, group = 32, levels = lloyd_max)",
    ] {
        let text = format!("K {{ key: {key}, value: full, query: int8(group = 32) }}");
        let (m, l, c) = err(&text);
        assert!(m.contains("channel-axis uniform keys of 2 or 4 bits"), "{key}: {m}");
        let col = text.find("int8").unwrap() + 1;
        assert_eq!((l, c), (1, col), "{key}");
    }
    let (m, ..) = err(
        "K { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
             residual: 32, center: channel_mean(tokens = 16, apply = [key]), query: int8(group = 32) }",
    );
    assert!(m.contains("does not combine"), "{m}");
    for p in [presets::kivi2(), presets::kivi4()] {
        let mut s = p.clone();
        s.query = Some(QueryQuant { group: 32 });
        assert!(kivi_spec::validate(&s).is_ok());
        // The group must divide head_dim once a shape is bound.
        assert!(s.with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).is_ok());
        s.query = Some(QueryQuant { group: 48 });
        let e = s.with_shape(Heads::Mha(2), 64).unwrap_err();
        assert_eq!(e.field, Field::QueryGroup);
        assert!(e.message.contains("does not divide head_dim 64"), "{}", e.message);
    }
}
