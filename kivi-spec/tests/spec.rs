use kivi_spec::*;

#[test]
fn canonical_form_round_trips_for_every_preset_and_shape() {
    for s in presets::all() {
        for (h, d) in [
            (Heads::Gqa { q: 32, kv: 8 }, 128),
            (Heads::Mqa(4), 256),
            (Heads::Mha(8), 64),
        ] {
            for s in [s.clone(), s.with_shape(h, d).unwrap()] {
                let text = canonical(&s);
                let back = parse_scheme(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
                assert_eq!(back, s);
                assert_eq!(canonical(&back), text);
                assert_eq!(scheme_hash(&back), scheme_hash(&s));
            }
        }
    }
}

#[test]
fn hash_is_stable_and_tracks_meaning() {
    // Pinned: the hash is a persistent cache key; changing it invalidates
    // every user's tuning decisions, so it must only change on purpose.
    assert_eq!(format!("{:016x}", scheme_hash(&presets::kivi2())), PINNED_KIVI2);
    let base = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    let h = scheme_hash(&base);
    let spelled = parse_scheme(
        "other {
            value: quant(group = 32, bits = 2, axis = token),
            residual: 128, key: quant(bits = 2, axis = channel, group = 32, scale = f16),
            head_dim: 128, heads: gqa(q = 32, kv = 8), dtype: f16, sliding_window: none,
        }",
    )
    .unwrap();
    assert_eq!(scheme_hash(&spelled), h, "order, defaults and name do not matter");
    let mha_a = base.with_shape(Heads::Gqa { q: 8, kv: 8 }, 128);
    assert!(mha_a.is_err(), "declared heads must agree");
    let x = presets::kivi2();
    assert_eq!(
        scheme_hash(&x.with_shape(Heads::Gqa { q: 8, kv: 8 }, 64).unwrap()),
        scheme_hash(&x.with_shape(Heads::Mha(8), 64).unwrap()),
        "the same layout spelled two ways"
    );
    let mut changed = Vec::new();
    let mut m = base.clone();
    m.residual = 64;
    changed.push(m);
    let mut m = base.clone();
    m.sinks = 4;
    changed.push(m);
    let mut m = base.clone();
    m.dtype = Dtype::Bf16;
    changed.push(m);
    let mut m = base.clone();
    m.softmax_scale = Some(0.0625);
    changed.push(m);
    let mut m = base.clone();
    m.sliding_window = Some(512);
    changed.push(m);
    let mut m = base.clone();
    m.flush = Flush::Chunked;
    changed.push(m);
    let mut m = base.clone();
    if let Codec::Quant(q) = &mut m.key {
        q.scale = ScaleDtype::F32;
    }
    changed.push(m);
    let mut m = base.clone();
    m.value = Codec::Full;
    changed.push(m);
    for c in changed {
        assert_ne!(scheme_hash(&c), h, "{}", canonical(&c));
    }
}

const PINNED_KIVI2: &str = "b95c4ff8db810dd4";

#[test]
fn runtime_errors_carry_line_and_column() {
    let cases: &[(&str, (usize, usize), &str)] = &[
        (
            "A {\n  key: full,\n  value: full,\n  colour: 3 }",
            (4, 3),
            "unknown field `colour`",
        ),
        (
            "A {\n  key: full,\n  key: full,\n  value: full }",
            (3, 3),
            "duplicate field `key`",
        ),
        (
            "A { key: quant(bits = 5, axis = token, group = 32), value: full }",
            (1, 23),
            "bits = 5 is not supported",
        ),
        (
            "A { key: quant(bits = 2, axis = diagonal, group = 32), value: full }",
            (1, 33),
            "unknown axis `diagonal`",
        ),
        ("A { key: full, value: full,\n rope: yes }", (2, 2), "not supported yet"),
        (
            "A { key: full, value: quant(bits = 2, axis = token, group = 48), head_dim: 128 }",
            (1, 61),
            "does not divide head_dim 128",
        ),
        (
            "A { key: full, value: full, heads: gqa(q = 6, kv = 4) }",
            (1, 52),
            "not a multiple of 4 kv heads",
        ),
        ("A { key: full, value: full, residual: 16 }", (1, 39), "have no effect"),
        ("A { value: full }", (1, 1), "missing field `key`"),
        (
            "A { key: quant(bits = 2, axis = token), value: full }",
            (1, 10),
            "missing `group`",
        ),
        (
            "A { key: quant(bits = 2, axis = token, group = 0), value: full }",
            (1, 48),
            "must be between 1 and 4096",
        ),
        (
            "A { key: quant(bits = 2, axis = token, group = 4, codebook = 3), value: full }",
            (1, 51),
            "not supported yet",
        ),
        (
            "A { key: full, value: full, head_dim: 0 }",
            (1, 39),
            "head_dim = 0 is out of range",
        ),
        ("A { key: full, value: full ", (1, 3), "not valid scheme syntax"),
    ];
    for (text, (line, col), msg) in cases {
        let e = parse_scheme(text).unwrap_err();
        assert!(e.message.contains(msg), "{text}: {e}");
        assert_eq!((e.line, e.column), (*line, *col), "{text}: {e}");
    }
}

#[test]
fn validation_rules_without_the_parser() {
    let mut s = presets::kivi2();
    assert!(validate(&s).is_ok());
    s.residual = 100;
    s.flush = Flush::Chunked;
    assert_eq!(validate(&s).unwrap_err().field, Field::Residual);
    let mut s = presets::kivi2();
    s.softmax_scale = Some(f32::NAN);
    assert_eq!(validate(&s).unwrap_err().field, Field::SoftmaxScale);
    let mut s = presets::kivi2();
    s.sliding_window = Some(0);
    assert_eq!(validate(&s).unwrap_err().field, Field::SlidingWindow);
    let s = presets::kivi2();
    assert!(s.with_shape(Heads::Gqa { q: 32, kv: 0 }, 128).is_err());
    assert!(s.with_shape(Heads::Mha(4), 2048).is_err());
}

#[test]
fn footprint_and_windows_follow_design() {
    let s = presets::kivi2().with_shape(Heads::Mha(1), 128).unwrap();
    // keys: window holds R..R+G-1 tokens once R exist
    for t in [0usize, 1, 127, 128, 159, 160, 161, 1000] {
        let r = layout::regions(&s, Tensor::Key, t);
        assert_eq!(r.sinks + r.quantized + r.window, t);
        assert_eq!(r.quantized % 32, 0);
        if t >= 128 {
            assert!((128..160).contains(&r.window), "t={t} window={}", r.window);
        }
        let v = layout::regions(&s, Tensor::Value, t);
        assert_eq!(v.window, t.min(128));
    }
    let mut c = s.clone();
    c.flush = Flush::Chunked;
    for t in [0usize, 127, 128, 129, 300] {
        assert_eq!(layout::regions(&c, Tensor::Key, t).window, t % 128);
        assert_eq!(layout::regions(&c, Tensor::Value, t).window, t % 128);
    }
    let f16 = presets::f16().with_shape(Heads::Mha(1), 128).unwrap();
    assert_eq!(layout::bytes_per_token_per_head(&f16), (512, 1));
    // 3-bit: 10 codes per word, 13 words per 128-channel row
    assert_eq!(layout::codes_per_word(3), 10);
    let t3 = layout::TensorLayout::new(
        Codec::Quant(Quant {
            bits: 3,
            axis: Axis::Token,
            group: 32,
            scale: ScaleDtype::F16,
        }),
        Dtype::F16,
        128,
        64,
    );
    assert_eq!(t3.words_per_token, 13);
}

#[test]
fn doc_comments_are_allowed_and_other_attributes_are_not() {
    let s = parse_scheme("/// KIVI at 2 bits.\n/// Second line.\npub A { key: full, value: full }").unwrap();
    assert_eq!(s.name, "A");
    let e = parse_scheme("#[derive(Debug)]\npub A { key: full, value: full }").unwrap_err();
    assert!(e.message.contains("only doc comments"), "{e}");
    assert_eq!((e.line, e.column), (1, 1));
}

/// Found by the scheme fuzzer: two channel-axis groups whose lcm is more
/// than a block can hold (64 and 3493 -> 223,552 tokens) were accepted, and
/// then no cache could be made for the scheme.
#[test]
fn channel_groups_that_no_block_can_hold_are_refused() {
    let text =
        "A1 { key: quant(bits = 4, axis = channel, group = 64), value: quant(bits = 4, axis = channel, group = 3493) }";
    let e = kivi_spec::parse_scheme(text).unwrap_err();
    assert!(
        e.message
            .contains("a block must hold a multiple of both (223552 tokens)"),
        "{e}"
    );
    assert_eq!((e.line, e.column), (1, 103), "{e}"); // at `3493`
                                                     // Groups where one divides the other are fine at any size.
    kivi_spec::parse_scheme(
        "A2 { key: quant(bits = 4, axis = channel, group = 4096), value: quant(bits = 4, axis = channel, group = 64) }",
    )
    .unwrap();
}
