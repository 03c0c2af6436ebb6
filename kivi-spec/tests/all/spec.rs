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
        (
            "A { key: full, value: full,\n low_rank: yes }",
            (2, 12),
            "unknown low-rank basis `yes`",
        ),
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
            levels: Levels::Uniform,
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
    // At `3493`.
    assert_eq!((e.line, e.column), (1, 103), "{e}");
    // Groups where one divides the other are fine at any size.
    kivi_spec::parse_scheme(
        "A2 { key: quant(bits = 4, axis = channel, group = 4096), value: quant(bits = 4, axis = channel, group = 64) }",
    )
    .unwrap();
}

/// A scheme using every part of the codec pipeline.
const PIPELINE: &str = "Codecs {
    key: quant(bits = 3, axis = token, group = 128, levels = lloyd_max, norm = l2),
    value: quant(bits = 2, axis = token, group = 64, levels = lloyd_max),
    rotation: hadamard(block = 64, apply = [value, key], signs = 7),
    outliers: sparse(per_token = 2, apply = [key]),
    center: channel_mean(tokens = 16, apply = [key]),
    residual: 32,
    sinks: 4,
}";

#[test]
fn pipeline_grammar_parses_prints_and_hashes_every_field() {
    let s = parse_scheme(PIPELINE).unwrap();
    assert_eq!(
        s.key.quant().unwrap().levels,
        Levels::LloydMax(Norm::L2),
        "norm = l2 as written"
    );
    assert_eq!(
        s.value.quant().unwrap().levels,
        Levels::LloydMax(Norm::Rms),
        "rms is the default norm"
    );
    let r = s.rotation.unwrap();
    assert_eq!(
        (r.block, r.signs, r.apply),
        (64, Some(7), Apply { key: true, value: true })
    );
    assert_eq!(s.outliers_of(Tensor::Key), 2);
    assert_eq!(s.outliers_of(Tensor::Value), 0);
    assert_eq!(s.center_of(Tensor::Key), Some(16));
    assert!(s.has_pipeline(Tensor::Key) && s.has_pipeline(Tensor::Value));
    assert!(!presets::kivi2().has_pipeline(Tensor::Key));
    for s in [s.clone(), s.with_shape(Heads::Mqa(4), 256).unwrap()] {
        let text = canonical(&s);
        let back = parse_scheme(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
        assert_eq!(back, s);
        assert_eq!(canonical(&back), text);
    }
    // Every new field changes the hash.
    let h = scheme_hash(&s);
    let mut variants = Vec::new();
    let mut m = s.clone();
    m.rotation.as_mut().unwrap().block = 32;
    variants.push(m);
    let mut m = s.clone();
    m.rotation.as_mut().unwrap().signs = None;
    variants.push(m);
    let mut m = s.clone();
    m.rotation.as_mut().unwrap().apply.value = false;
    variants.push(m);
    let mut m = s.clone();
    m.rotation = None;
    variants.push(m);
    let mut m = s.clone();
    m.outliers.as_mut().unwrap().per_token = 3;
    variants.push(m);
    let mut m = s.clone();
    m.outliers.as_mut().unwrap().apply.value = true;
    variants.push(m);
    let mut m = s.clone();
    m.center.as_mut().unwrap().tokens = 8;
    variants.push(m);
    let mut m = s.clone();
    m.center = None;
    variants.push(m);
    let mut m = s.clone();
    m.key = Codec::Quant(Quant {
        levels: Levels::LloydMax(Norm::Rms),
        ..*s.key.quant().unwrap()
    });
    variants.push(m);
    let mut m = s.clone();
    m.key = Codec::Quant(Quant {
        levels: Levels::Uniform,
        ..*s.key.quant().unwrap()
    });
    variants.push(m);
    for v in &variants {
        validate(v).unwrap();
        assert_ne!(scheme_hash(v), h, "{}", canonical(v));
    }
    // Schemes without a pipeline print (and hash) as before.
    assert!(!canonical(&presets::kivi2()).contains("levels"));
}

#[test]
fn lloyd_max_tables_are_fixed_points() {
    // Max (1960): the levels are the centroids of their cells and the cell
    // edges the midpoints of the levels. Recompute by Lloyd iteration on the
    // exact unit Gaussian (density and CDF from erf) and compare.
    fn erf(x: f64) -> f64 {
        // Abramowitz-Stegun 7.1.26 is too coarse; integrate instead.
        let n = 20_000;
        let h = x / n as f64;
        let f = |t: f64| (-t * t).exp();
        let mut s = f(0.0) + f(x);
        for i in 1..n {
            s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
    }
    let pdf = |x: f64| (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let cdf = |x: f64| 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
    for bits in LLOYD_MAX_BITS {
        let n = 1usize << bits;
        let mut l: Vec<f64> = (0..n).map(|i| -2.0 + 4.0 * (i as f64 + 0.5) / n as f64).collect();
        for _ in 0..300 {
            let edges: Vec<f64> = (0..=n)
                .map(|i| match i {
                    0 => -12.0,
                    i if i == n => 12.0,
                    i => (l[i - 1] + l[i]) / 2.0,
                })
                .collect();
            l = (0..n)
                .map(|i| (pdf(edges[i]) - pdf(edges[i + 1])) / (cdf(edges[i + 1]) - cdf(edges[i])))
                .collect();
        }
        let table = lloyd_max_levels(bits).unwrap();
        assert_eq!(table.len(), n);
        for (a, b) in table.iter().zip(&l) {
            assert!((*a as f64 - b).abs() < 1e-5, "{bits} bits: table {a}, Lloyd {b}");
        }
    }
    assert!(lloyd_max_levels(8).is_none());
}

#[test]
fn pipeline_memory_is_exact() {
    let s = parse_scheme(PIPELINE).unwrap().with_shape(Heads::Mqa(4), 256).unwrap();
    // key: 3-bit codes (26 words = 104 B), 2 l2 norms (4 B), 2 outliers
    // (1 index word + 1 f16 pair word = 8 B); value: 2-bit (64 B), 4 norms (8 B).
    let (bytes, per) = layout::bytes_per_token_per_head(&s);
    assert_eq!(bytes as f64 / per as f64, 104.0 + 4.0 + 8.0 + 64.0 + 8.0);
    let f = layout::Footprint::for_tokens(&s, 100);
    let rk = layout::regions(&s, Tensor::Key, 100);
    assert_eq!(f.outliers, rk.quantized * 8);
    assert_eq!(f.zeros, 0, "Lloyd–Max groups store no zero point");
    assert_eq!(f.means, 256 * 2, "one f16 mean per key channel");
    let bits = layout::bits_per_element(&s);
    assert!((bits - 188.0 * 8.0 / 512.0).abs() < 1e-12);
    let l = layout::BlockLayout::new(&s, s.shape().unwrap(), 64);
    assert_eq!(l.key.zero_words, 0);
    assert_eq!(l.key.outliers, 2);
    assert_eq!(l.key.words, 64 * 26 + 64 * 2 / 2 + 64 + 64);
}

#[test]
fn pipeline_rules() {
    let ok = parse_scheme(PIPELINE).unwrap();
    let bad = |f: &dyn Fn(&mut Scheme)| {
        let mut s = ok.clone();
        f(&mut s);
        validate(&s).unwrap_err()
    };
    assert_eq!(
        bad(&|s| s.rotation.as_mut().unwrap().block = 48).field,
        Field::RotationBlock
    );
    assert_eq!(
        bad(&|s| {
            s.rotation.as_mut().unwrap().block = 256;
            s.head_dim = Some(128);
        })
        .field,
        Field::RotationBlock
    );
    assert_eq!(bad(&|s| s.value = Codec::Full).field, Field::RotationApply);
    assert_eq!(
        bad(&|s| s.outliers.as_mut().unwrap().per_token = 0).field,
        Field::OutliersPerToken
    );
    assert_eq!(
        bad(&|s| s.center.as_mut().unwrap().tokens = 37).field,
        Field::CenterTokens
    );
    assert_eq!(
        bad(&|s| s.key = Codec::Quant(Quant {
            bits: 8,
            ..*s.key.quant().unwrap()
        }))
        .field,
        Field::Bits(Tensor::Key)
    );
}

#[test]
fn study_candidates_parse_and_fit_their_class() {
    // eval/schemes/study.kivi: the codec study of docs/accuracy.md.
    let all = parse_schemes(include_str!("../../../eval/schemes/study.kivi")).unwrap();
    assert!(all.len() >= 15);
    for s in &all {
        let b = layout::bits_per_element(&s.with_shape(Heads::Mqa(4), 256).unwrap());
        println!("{:24} {b:.4}", s.name);
        assert!(b <= 3.0 || s.name.starts_with("k2muHo4"), "{} has {b} bits", s.name);
    }
}

/// eval/schemes/acc2.kivi (docs/accuracy.md, "Two bits all-in"): every
/// candidate is at most 2.0 bits per element all-in at Gemma 3's shape, and
/// the bits the doc's tables print are the layout's (vq codes pack
/// `floor(32 / b)` to a word, one outlier costs two slots' words), so a
/// change to either shows up here rather than as a wrong table.
#[test]
fn two_bit_candidates_fit_the_budget_and_match_the_doc() {
    let all = parse_schemes(include_str!("../../../eval/schemes/acc2.kivi")).unwrap();
    let diag = parse_schemes(include_str!("../../../eval/schemes/acc2-diag.kivi")).unwrap();
    assert_eq!((all.len(), diag.len()), (15, 3));
    let bits = |s: &Scheme| layout::bits_per_element(&s.with_shape(Heads::Mqa(4), 256).unwrap());
    for s in &all {
        assert!(bits(s) <= 2.0, "{} has {} bits", s.name, bits(s));
        assert_eq!(s.sinks, 4, "{}: the doc's runs used 4 sinks throughout", s.name);
    }
    let doc = [
        ("pre_k64_u", 1.90625),
        ("pk128_v4x64", 1.9375),
        ("pk256_v4x64", 1.875),
        ("pk64_v8x256", 1.75),
        ("vk4x256_v4x64", 1.8125),
        ("pk48_v1nuq_o2", 1.9896),
        ("pk96_v4x64", 1.9792),
        ("pk40_v1nuq", 1.9312),
        ("pk36_v1nuq", 1.9757),
        ("pk32_v8x256", 2.0),
        ("pk64mm_v1nuq_o2", 1.90625),
        ("pk48mm_v1nuq_o2", 1.9896),
        ("pk128mm_v1nuq_o2", 1.78125),
    ];
    for (name, want) in doc {
        let s = all.iter().find(|s| s.name == name).unwrap();
        assert!(
            (bits(s) - want).abs() < 1e-4,
            "{name}: {} bits, the doc says {want}",
            bits(s)
        );
    }
    // A 2c40 key with one value outlier would be over budget (why the
    // scheme file skips it).
    let o1 = parse_scheme(
        "o1 { key: quant(bits = 2, axis = channel, group = 40), \
         value: quant(bits = 1, axis = token, group = 256, levels = nuq, norm = l2), \
         rotation: hadamard(block = 256, apply = [value]), outliers: sparse(per_token = 1, apply = [value]), \
         residual: 128, sinks: 4, rope: pre(theta = 10000, style = half) }",
    )
    .unwrap();
    assert!((bits(&o1) - 2.05625).abs() < 1e-9, "{}", bits(&o1));
    for s in &diag {
        assert!(s.name.starts_with("diag_") && bits(s) > 8.0, "{}", s.name);
    }
}

/// `norm = minmax` (a nuq table over [0, 1] with a zero point): parsed,
/// printed back, priced like uniform levels (a scale and a zero per
/// group), and refused by name wherever a kernel would not add the zero.
#[test]
fn minmax_nuq_parses_prices_and_refuses_where_unsupported() {
    let text = "M { key: quant(bits = 2, axis = channel, group = 64, levels = nuq, norm = minmax), \
                value: quant(bits = 2, axis = token, group = 32), rope: pre(theta = 10000, style = half) }";
    let s = parse_scheme(text).unwrap();
    let q = *s.key.quant().unwrap();
    assert_eq!(q.levels, Levels::Nuq(Norm::MinMax));
    assert!(q.has_zeros());
    let b = s.with_shape(Heads::Mqa(4), 256).unwrap();
    assert_eq!(parse_scheme(&canonical(&b)).unwrap(), b);
    assert!(canonical(&b).contains("levels = nuq, norm = minmax"));
    let uniform = parse_scheme(&text.replace(", levels = nuq, norm = minmax", ""))
        .unwrap()
        .with_shape(Heads::Mqa(4), 256)
        .unwrap();
    assert_eq!(
        layout::bytes_per_token_per_head(&b),
        layout::bytes_per_token_per_head(&uniform)
    );
    assert_ne!(scheme_hash(&b), scheme_hash(&uniform));
    for (bad, why) in [
        (
            text.replace("levels = nuq, norm = minmax", "levels = lloyd_max, norm = minmax"),
            "needs levels = nuq",
        ),
        (
            text.replace(", rope: pre(theta = 10000, style = half)", ""),
            "rope: pre",
        ),
        (
            text.replace("axis = channel, group = 64", "axis = token, group = 64"),
            "channel-axis keys",
        ),
        (
            "M { key: quant(bits = 2, axis = channel, group = 64), \
             value: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax), \
             rope: pre(theta = 10000, style = half) }"
                .to_string(),
            "channel-axis keys",
        ),
    ] {
        let e = parse_scheme(&bad).unwrap_err().to_string();
        assert!(e.contains(why) && e.contains("minmax"), "{bad}: {e}");
    }
    assert!(parse_scheme(&text.replace("norm = minmax", "norm = maxmin")).is_err());
}

/// eval/schemes/acc3.kivi (docs/accuracy.md, round 5): every candidate is
/// at most 2.0 bits per element all-in at Gemma 3's shape, with the bits
/// its comment and the doc give (key outliers cost 8 bytes per token and
/// head whatever else the outliers field applies to).
#[test]
fn round5_candidates_fit_the_budget_and_match_the_doc() {
    let all = parse_schemes(include_str!("../../../eval/schemes/acc3.kivi")).unwrap();
    let bits = |s: &Scheme| layout::bits_per_element(&s.with_shape(Heads::Mqa(4), 256).unwrap());
    let doc = [
        ("pre_k64_u", 1.90625),
        ("pk48_v1nuq_o2", 1.9896),
        ("pk64mp_v1nuq_o2", 1.90625),
        ("pk48mp_v1nuq_o2", 1.9896),
        ("pk128mp_v1nuq_o2", 1.78125),
        ("pk128_o2kv", 1.90625),
        ("pk80_o2kv", 1.98125),
        ("pk64_o2k_v1nuq", 1.90625),
        ("pk128mp_o2kv", 1.90625),
        ("pk80mp_o2kv", 1.98125),
    ];
    assert_eq!(all.len(), doc.len());
    for (name, want) in doc {
        let s = all.iter().find(|s| s.name == name).unwrap();
        assert!(bits(s) <= 2.0, "{name} has {} bits", bits(s));
        assert_eq!((s.sinks, s.residual), (4, 128), "{name}");
        assert!(
            (bits(s) - want).abs() < 1e-4,
            "{name}: {} bits, the doc says {want}",
            bits(s)
        );
    }
}

/// `norm = minmax_pinned` (a minmax table with its ends fixed at 0 and 1):
/// its own meaning (hash, canonical text, tokens) while the stored bytes
/// and the existing spellings stay what they were; refused at 1 bit and
/// wherever `minmax` is.
#[test]
fn minmax_pinned_is_its_own_scheme_and_leaves_minmax_unchanged() {
    let text = "M { key: quant(bits = 2, axis = channel, group = 64, levels = nuq, norm = minmax_pinned), \
                value: quant(bits = 2, axis = token, group = 32), rope: pre(theta = 10000, style = half) }";
    let s = parse_scheme(text).unwrap();
    let q = *s.key.quant().unwrap();
    assert_eq!(q.levels, Levels::Nuq(Norm::MinMaxPinned));
    assert!(q.has_zeros() && Norm::MinMaxPinned.has_zero() && !Norm::L2.has_zero());
    let b = s.with_shape(Heads::Mqa(4), 256).unwrap();
    assert_eq!(parse_scheme(&canonical(&b)).unwrap(), b);
    assert!(canonical(&b).contains("levels = nuq, norm = minmax_pinned"));
    let free = parse_scheme(&text.replace("minmax_pinned", "minmax"))
        .unwrap()
        .with_shape(Heads::Mqa(4), 256)
        .unwrap();
    assert_eq!(
        layout::bytes_per_token_per_head(&b),
        layout::bytes_per_token_per_head(&free)
    );
    assert_ne!(scheme_hash(&b), scheme_hash(&free));
    // The existing spelling prints and hashes as before this option: the
    // canonical text has no new field, and the hash is the one this scheme
    // had when `minmax` was the only zero-pointed norm (pinned).
    assert!(
        canonical(&free).contains("levels = nuq, norm = minmax),"),
        "{}",
        canonical(&free)
    );
    assert_eq!(format!("{:016x}", scheme_hash(&free)), "e9013da6d544a3cd");
    for (bad, why) in [
        (
            text.replace("bits = 2, axis = channel", "bits = 1, axis = channel"),
            "at 1 bit",
        ),
        (
            text.replace(", rope: pre(theta = 10000, style = half)", ""),
            "rope: pre",
        ),
        (
            text.replace(
                "levels = nuq, norm = minmax_pinned",
                "levels = lloyd_max, norm = minmax_pinned",
            ),
            "needs levels = nuq",
        ),
    ] {
        let e = parse_scheme(&bad).unwrap_err().to_string();
        assert!(e.contains(why) && e.contains("minmax_pinned"), "{bad}: {e}");
    }
}

#[test]
fn codec_presets_fit_their_classes_and_round_trip() {
    for p in presets::pipeline() {
        assert!(presets::by_name(&p.name).is_some());
        assert!(p.has_pipeline(Tensor::Key) || p.has_pipeline(Tensor::Value));
        let b = p.with_shape(Heads::Mqa(4), 256).unwrap();
        let text = canonical(&b);
        assert_eq!(parse_scheme(&text).unwrap(), b);
        let bits = layout::bits_per_element(&b);
        let kivi2 = layout::bytes_per_token_per_head(&presets::kivi2().with_shape(Heads::Mqa(4), 256).unwrap());
        let (bytes, per) = layout::bytes_per_token_per_head(&b);
        match p.name.as_str() {
            // the 2-bit class: at most kivi2's bytes per token per head
            "codec2" => assert!(bytes * kivi2.1 <= kivi2.0 * per && bits <= 3.0, "{bits}"),
            // the 1.5-bit class: at most 2.0 bits per element all-in
            "codec15" => assert!(bits <= 2.0, "{bits}"),
            n => panic!("unexpected pipeline preset {n}"),
        }
    }
    assert_eq!(
        presets::listed().len(),
        presets::all().len() + presets::pipeline().len()
    );
}

/// `levels = nuq` (calibrated codebooks): parsed with its norm, printed
/// back, hashed apart from its Lloyd–Max twin, held to the same widths, and
/// other codebook spellings refused at their token.
#[test]
fn nuq_levels_parse_print_hash_and_refuse() {
    let text = "N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
                value: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2) }";
    let s = parse_scheme(text).unwrap();
    assert_eq!(s.key.quant().unwrap().levels, Levels::Nuq(Norm::Rms));
    assert_eq!(s.value.quant().unwrap().levels, Levels::Nuq(Norm::L2));
    let c = canonical(&s);
    assert!(
        c.contains("levels = nuq, norm = rms") && c.contains("levels = nuq, norm = l2"),
        "{c}"
    );
    assert_eq!(canonical(&parse_scheme(&c).unwrap()), c);
    let twin = parse_scheme(&text.replace("nuq", "lloyd_max")).unwrap();
    assert_ne!(scheme_hash(&s), scheme_hash(&twin));
    assert!(s.has_pipeline(Tensor::Key));
    let e = parse_scheme(&text.replace("bits = 2", "bits = 8")).unwrap_err();
    assert!(e.message.contains("no nuq table"), "{}", e.message);
    let e = parse_scheme(&text.replacen("levels = nuq", "levels = kmeans", 1)).unwrap_err();
    assert!(e.message.contains("spelled `levels = nuq`"), "{}", e.message);
    assert_eq!(e.column, text.find("nuq").unwrap() + 1, "the error points at `kmeans`");
}
