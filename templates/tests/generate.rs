//! The generator: names, hashes, the variant space, errors, and the sources
//! `kivi::scheme!` embeds at compile time.

use kivi_spec::{parse_scheme, presets, Heads};
use kivi_templates::*;

kivi::scheme! {
    pub Kivi2Llama {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        heads: gqa(q = 32, kv = 8),
        head_dim: 128,
    }
    Unbound {
        key: quant(bits = 4, axis = channel, group = 32),
        value: full,
    }
}

fn kivi2() -> kivi_spec::Scheme {
    presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap()
}

#[test]
fn kivi2_gqa_has_at_least_24_decode_variants_all_generated() {
    let s = kivi2();
    let vs = variants(&s, Kernel::Decode);
    assert!(vs.len() >= 24, "{}", vs.len());
    assert_eq!(vs[0], default_variant(&s, Kernel::Decode));
    let mut hashes = std::collections::HashSet::new();
    for v in &vs {
        let g = generate(&s, Kernel::Decode, v).unwrap();
        assert_eq!(g.hash, kivi_spec::fnv1a64(g.source.as_bytes()));
        assert!(g.name.ends_with(&v.name()), "{}", g.name);
        assert!(g.source.contains(&format!("// variant {}", v.name())));
        assert!(hashes.insert(g.hash), "two variants with one source");
        assert_eq!(Variant::parse(&v.name()).unwrap(), *v);
    }
    let g = generate(&s, Kernel::Decode, &vs[0]).unwrap();
    assert_eq!(
        g.name,
        format!("kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128/decode/{}", vs[0].name())
    );
    // Deterministic: the same inputs give the same bytes.
    assert_eq!(generate(&s, Kernel::Decode, &vs[0]).unwrap(), g);
}

#[test]
fn launch_shape_follows_the_variant() {
    let s = kivi2();
    let v = Variant::parse("t64.tile32.s8.h2.w1.u1").unwrap();
    let g = generate(&s, Kernel::Decode, &v).unwrap();
    let d = g.launch.entry("kivi_decode").unwrap();
    assert_eq!(d.block, [64, 1, 1]);
    assert_eq!(d.grid(3, 1000), [8, 8 * 4 / 2, 3]);
    assert_eq!(d.params.len(), 15);
    let c = g.launch.entry("kivi_combine").unwrap();
    assert_eq!(c.grid(3, 1000), [32, 1, 3]);
    assert_eq!(g.launch.part_acc_len(3), 3 * 32 * 8 * 128);
    let a = generate(&s, Kernel::Append, &default_variant(&s, Kernel::Append)).unwrap();
    assert_eq!(a.entry_points, ["kivi_append"]);
    assert_eq!(a.launch.entries[0].grid(5, 0), [8, 2, 5]);
}

#[test]
fn every_preset_every_kernel_at_three_layouts_generates() {
    let mut n = 0;
    for (h, d) in [
        (Heads::Gqa { q: 32, kv: 8 }, 128),
        (Heads::Mqa(4), 256),
        (Heads::Mha(8), 64),
    ] {
        for p in presets::all() {
            let s = p.with_shape(h, d).unwrap();
            for k in Kernel::ALL {
                let vs = variants(&s, k);
                assert!(!vs.is_empty(), "{} {k}", s.name);
                for v in vs {
                    generate(&s, k, &v).unwrap();
                    n += 1;
                }
            }
        }
    }
    assert!(n > 300, "{n}");
}

#[test]
fn errors_are_clear_and_never_panic() {
    let unbound = presets::kivi2();
    let e = generate(&unbound, Kernel::Decode, &default_variant(&unbound, Kernel::Decode)).unwrap_err();
    assert!(e.to_string().contains("no head layout"), "{e}");
    assert!(variants(&unbound, Kernel::Decode).is_empty());
    let s = kivi2();
    let bad = Variant::parse("t100.tile32.s8.h4.w4.u1").unwrap();
    let e = generate(&s, Kernel::Decode, &bad).unwrap_err();
    assert!(e.to_string().contains("100 threads"), "{e}");
    let e = generate(&s, Kernel::Decode, &Variant::parse("t128.tile32.s8.h3.w4.u1").unwrap()).unwrap_err();
    assert!(e.to_string().contains("does not divide the GQA group of 4"), "{e}");
    // 3-bit codes at head_dim 64: 7 words per row, not a multiple of a 4-word load
    let b3 = parse_scheme("b3 { key: quant(bits = 3, axis = channel, group = 32), value: full, residual: 32 }")
        .unwrap()
        .with_shape(Heads::Mha(2), 64)
        .unwrap();
    let e = generate(&b3, Kernel::Decode, &Variant::parse("t128.tile32.s8.h1.w4.u1").unwrap()).unwrap_err();
    assert!(e.to_string().contains("7 words"), "{e}");
    assert!(variants(&b3, Kernel::Decode).iter().all(|v| v.load_width == 1));
    for bad in [
        "",
        "t128",
        "t128.tile32.s8.h4.w4.u1.x2",
        "t128.t64.s8.h4.w4.u1",
        "tx.tile32.s8.h4.w4.u1",
    ] {
        assert!(Variant::parse(bad).is_err(), "{bad}");
    }
    assert!(Kernel::parse("decoder")
        .unwrap_err()
        .to_string()
        .contains("unknown kernel"));
    let e = generate_with(
        &s,
        Kernel::Decode,
        &default_variant(&s, Kernel::Decode),
        GenOptions { block_tokens: Some(48) },
    );
    assert!(e.unwrap_err().to_string().contains("not a multiple"));
}

#[test]
fn macro_embeds_the_generated_sources() {
    let s = Kivi2Llama::spec();
    let names: Vec<&str> = Kivi2Llama::KERNELS.iter().map(|(n, _)| *n).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for (k, (name, src)) in [Kernel::Prefill, Kernel::Append, Kernel::Decode]
        .iter()
        .zip(Kivi2Llama::KERNELS)
    {
        let g = generate(&s, *k, &default_variant(&s, *k)).unwrap();
        assert_eq!(*name, g.name.replace("kivi2", "Kivi2Llama"));
        assert_eq!(*src, g.source);
    }
    assert!(Unbound::KERNELS.is_empty());
}

#[test]
fn templates_keep_to_what_the_sim_shim_implements() {
    // No atomics, inline PTX, dynamic shared memory or warp votes: the sim
    // backend could not run them (and would fail to compile, loudly).
    for (file, text) in TEMPLATES {
        for banned in [
            "atomic",
            "asm(",
            "asm volatile",
            "extern __shared__",
            "__ballot",
            "__any_sync",
            "__all_sync",
        ] {
            assert!(!text.contains(banned), "{file} uses {banned}");
        }
    }
}

/// The codec pipeline: only pipeline schemes' sources paste the
/// `kivi_codec_*` templates; the Lloyd–Max table is the one the oracle
/// uses (`kivi_spec::lloyd_max_levels`), written as exact f32 literals;
/// every step is spelled in the kernel name; the variant space is not
/// empty for the pipeline presets and codec mixes on GQA, MQA and MHA.
#[test]
fn pipeline_sources_carry_their_steps_and_tables() {
    let plain = kivi2();
    for k in Kernel::ALL {
        let g = generate(&plain, k, &default_variant(&plain, k)).unwrap();
        assert!(!g.source.contains("===== kivi_codec_"), "{}", g.name);
        assert!(!g.source.contains("__constant__"), "{}", g.name);
    }
    for h in [Heads::Gqa { q: 8, kv: 2 }, Heads::Mqa(4), Heads::Mha(2)] {
        let s = presets::codec2().with_shape(h, 256).unwrap();
        let d = generate(&s, Kernel::Decode, &default_variant(&s, Kernel::Decode)).unwrap();
        assert!(
            d.name
                .starts_with("codec2-k.t.g256.b3.lml2.h256.o4.m128-v.t.g256.b2.lml2.h256-r128-s4/"),
            "{}",
            d.name
        );
        assert!(d.source.contains("===== kivi_codec_decode.cuh") && !d.source.contains("===== kivi_codec_extend.cuh"));
        // the 3-bit key table, the 2-bit value table, each value exactly
        for (tensor, bits) in [("KeyCfg", 3), ("ValueCfg", 2)] {
            let levels = kivi_spec::lloyd_max_levels(bits).unwrap();
            let decl = format!("static __constant__ float {tensor}_levels[{}] = {{", levels.len());
            let at = d.source.find(&decl).unwrap_or_else(|| panic!("{decl}"));
            let body = &d.source[at + decl.len()..];
            let body = &body[..body.find('}').unwrap()];
            let parsed: Vec<f32> = body
                .split(',')
                .map(|x| x.trim().trim_end_matches('f').parse().unwrap())
                .collect();
            assert_eq!(parsed, levels, "{tensor}");
        }
        let p = generate(&s, Kernel::Prefill, &default_variant(&s, Kernel::Prefill)).unwrap();
        assert!(p.source.contains("===== kivi_codec_extend.cuh") && !p.source.contains("===== kivi_codec_decode.cuh"));
        for k in Kernel::ALL {
            assert!(!kivi_templates::variants(&s, k).is_empty(), "{} {k}", s.name);
        }
        assert!(kivi_templates::extend_work_floats(&s, Default::default()).unwrap() > 0);
    }
    assert_eq!(
        kivi_templates::extend_work_floats(&plain, Default::default()).unwrap(),
        0
    );
    // a sign seed is in the name (the kernels derive the signs from it)
    let signed = kivi_spec::parse_scheme(
        "S { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
            rotation: hadamard(block = 64, apply = [value], signs = 9), residual: 32, heads: mha(2), head_dim: 64 }",
    )
    .unwrap();
    let g = generate(&signed, Kernel::Decode, &default_variant(&signed, Kernel::Decode)).unwrap();
    assert!(g.name.starts_with("S-k.c.g32.b2-v.t.g32.b2.h64x9-r32/"), "{}", g.name);
    assert!(g.source.contains("SEED = 9;"));
}

/// `norm = minmax` and `minmax_pinned` (a nuq table with a zero point per
/// group) generate with their table: the key's configuration says
/// `MINMAX` (so the templates store and add the zero point), the kernel
/// name tells the two norms and `rms` apart, and without a table they are
/// refused as every nuq scheme is — by the levels, not the norm.
#[test]
fn minmax_nuq_generates_with_its_table() {
    let text = "m { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax), \
                value: quant(bits = 2, axis = token, group = 32), residual: 32, \
                rope: pre(theta = 10000, style = half) }";
    let cb = Codebooks {
        key: Some(vec![0.0, 0.3, 0.7, 1.0]),
        value: None,
    };
    let mut names = Vec::new();
    for (norm, tag) in [("minmax", ".nuqmm-"), ("minmax_pinned", ".nuqmmp-"), ("rms", ".nuq-")] {
        let s = parse_scheme(&text.replace("norm = minmax", &format!("norm = {norm}")))
            .unwrap()
            .with_shape(Heads::Mqa(4), 128)
            .unwrap();
        let e = check_supported(&s).unwrap_err();
        assert!(
            matches!(
                e,
                GenError::Unsupported {
                    field: kivi_spec::Field::Levels(kivi_spec::Tensor::Key),
                    ..
                }
            ),
            "{e}"
        );
        for k in Kernel::ALL {
            let g = generate_calibrated(&s, k, &default_variant(&s, k), Default::default(), &cb).unwrap();
            assert!(g.name.contains(tag), "{}", g.name);
            let key_cfg = &g.source[g.source.find("struct KeyCfg").unwrap()..];
            let key_cfg = &key_cfg[..key_cfg.find("};").unwrap()];
            assert_eq!(key_cfg.contains("MINMAX = true;"), norm != "rms", "{norm} {k}");
            assert!(!g.source.contains("struct ValueCfg {\n  static constexpr bool MINMAX"));
            names.push(g.name);
        }
    }
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 9, "three norms, three kernels: nine names");
}

/// Key outliers on pre-RoPE keys generate (the decode template turns each
/// correction with the query); the many-query block kernel still refuses
/// pre-RoPE keys by name.
#[test]
fn pre_rope_key_outliers_generate() {
    let bind = |t: &str| parse_scheme(t).unwrap().with_shape(Heads::Mqa(4), 128).unwrap();
    let ko = "k { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), \
              outliers: sparse(per_token = 2, apply = [key]), residual: 32, rope: pre(theta = 10000, style = half) }";
    let s = bind(ko);
    check_supported(&s).unwrap();
    for k in Kernel::ALL {
        generate(&s, k, &default_variant(&s, k)).unwrap();
    }
    let e = kivi_templates::generate_block(&s, Default::default()).unwrap_err();
    assert!(
        matches!(
            e,
            GenError::Unsupported {
                field: kivi_spec::Field::Rope,
                ..
            }
        ),
        "{e}"
    );
}
