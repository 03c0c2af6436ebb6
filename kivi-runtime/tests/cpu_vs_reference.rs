//! The CPU backend against the reference oracle: every preset and a set of
//! rare schemes, odd lengths, four head layouts, unequal batches, several
//! kernel parameters, and both the AVX2 and the scalar inner loops.
//!
//! Tolerance: max |cpu - ref| <= 1e-5 * max |ref| over each output.

mod common;

use common::{block_tensor as tensor, isas};

use kivi_runtime::cpu::Isa;
use kivi_runtime::rand::Rng;
use kivi_runtime::*;
use kivi_spec::{presets, Axis, Codec, Dtype, Flush, Heads, Levels, Quant, ScaleDtype, Scheme};

const LENGTHS: [usize; 6] = [1, 31, 33, 127, 1000, 4099];

fn layouts() -> [Heads; 4] {
    [
        Heads::Mha(4),
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 14, kv: 2 },
        Heads::Mqa(4),
    ]
}

fn params_default() -> Vec<CpuParams> {
    isas().to_vec()
}

/// Fills a cache with sequences of `lens` (some by prefill, some by appends)
/// and compares every backend configuration against the reference, on the
/// whole batch and on single sequences.
fn check(s: &Scheme, heads: Heads, d: u32, lens: &[usize], params: &[CpuParams], seed: u64) {
    let s = s.with_shape(heads, d).unwrap();
    let shape = s.shape().unwrap();
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let total: usize = lens.iter().sum();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(total + 64 * lens.len())).unwrap();
    let mut rng = Rng::new(seed);
    let mut seqs = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let k = tensor(&mut rng, n, hkv, d, true);
        let v = tensor(&mut rng, n, hkv, d, false);
        let id = common::add_filled(&mut cache, &k, &v, hkv * d, i % 2 == 0 || n > 200);
        seqs.push(id);
    }
    let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| 2.0 * rng.f32()).collect();
    let attn = AttnParams::of(&s, shape);
    let want = ReferenceBackend.decode(&cache, &seqs, &q, attn).unwrap();
    for p in params {
        let cpu = CpuBackend::new(*p).unwrap();
        let got = cpu.decode(&cache, &seqs, &q, attn).unwrap();
        let per = hq * d;
        for (b, &n) in lens.iter().enumerate() {
            let w = &want[b * per..(b + 1) * per];
            let g = &got[b * per..(b + 1) * per];
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            let err = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                err <= 1e-5 * scale,
                "{} {heads} d{d} len {n} {} ({}): max error {err:e} vs max |ref| {scale:e}",
                s.name,
                p.name(),
                p.isa(d).name()
            );
        }
        // One sequence alone gives the same numbers as inside the batch.
        let last = lens.len() - 1;
        let alone = cpu.decode(&cache, &seqs[last..], &q[last * per..], attn).unwrap();
        let w = &want[last * per..];
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let err = w.iter().zip(&alone).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(err <= 1e-5 * scale, "{} alone: {err:e}", p.name());
    }
}

#[test]
fn every_preset_every_layout_odd_lengths() {
    for s in presets::all() {
        for (i, heads) in layouts().into_iter().enumerate() {
            check(&s, heads, 64, &LENGTHS, &params_default(), 11 + i as u64);
        }
    }
}

#[test]
fn presets_at_head_dim_128_and_256() {
    for s in [presets::kivi2(), presets::kivi4(), presets::int8(), presets::f16()] {
        check(
            &s,
            Heads::Gqa { q: 8, kv: 2 },
            128,
            &[33, 1000, 4099],
            &params_default(),
            3,
        );
        check(&s, Heads::Mqa(4), 256, &[127, 1000], &params_default(), 4);
    }
}

#[test]
fn kernel_parameters() {
    let mut params = Vec::new();
    for splits in [1, 3, 0] {
        for tile_tokens in [1, 7, 64] {
            for isa in isas() {
                params.push(CpuParams {
                    splits,
                    tile_tokens,
                    ..isa
                });
            }
        }
    }
    params.push(CpuParams {
        threads: 1,
        ..CpuParams::default()
    });
    params.push(CpuParams {
        threads: 3,
        splits: 5,
        ..CpuParams::default()
    });
    for s in [presets::kivi2(), presets::int8(), presets::swapped2(), presets::f16()] {
        check(
            &s,
            Heads::Gqa { q: 8, kv: 2 },
            64,
            &[1, 33, 127, 1000, 4099],
            &params,
            5,
        );
    }
}

fn quant(bits: u32, axis: Axis, group: u32, scale: ScaleDtype) -> Codec {
    Codec::Quant(Quant {
        bits,
        axis,
        group,
        scale,
        levels: Levels::Uniform,
    })
}

/// Schemes off the fast paths (or on their edges).
fn rare() -> Vec<Scheme> {
    let k2 = presets::kivi2();
    let mut out = Vec::new();
    let mut add = |name: &str, f: &dyn Fn(&mut Scheme)| {
        let mut s = k2.clone();
        s.name = name.into();
        f(&mut s);
        out.push(s);
    };
    add("bits3", &|s| {
        s.key = quant(3, Axis::Channel, 32, ScaleDtype::F16);
        s.value = quant(3, Axis::Token, 32, ScaleDtype::F16);
    });
    add("bits1", &|s| {
        s.key = quant(1, Axis::Channel, 16, ScaleDtype::F16);
        s.value = quant(1, Axis::Token, 16, ScaleDtype::F16);
    });
    add("bits8_channel", &|s| {
        s.key = quant(8, Axis::Channel, 32, ScaleDtype::F16);
        s.value = quant(8, Axis::Channel, 16, ScaleDtype::F16);
    });
    add("bits4_token_g8", &|s| {
        s.key = quant(4, Axis::Token, 8, ScaleDtype::F16);
        s.value = quant(4, Axis::Token, 16, ScaleDtype::F16);
    });
    add("token_g4", &|s| {
        s.key = quant(2, Axis::Token, 4, ScaleDtype::F16);
        s.value = quant(2, Axis::Token, 4, ScaleDtype::F16);
    });
    add("bf16", &|s| s.dtype = Dtype::Bf16);
    add("f32", &|s| s.dtype = Dtype::F32);
    add("bf16_full", &|s| {
        s.dtype = Dtype::Bf16;
        s.key = Codec::Full;
        s.value = Codec::Full;
        s.residual = 0;
    });
    add("f32_full_mixed", &|s| {
        s.dtype = Dtype::F32;
        s.value = Codec::Full;
    });
    add("sinks", &|s| s.sinks = 4);
    add("sinks_r0", &|s| {
        s.sinks = 7;
        s.residual = 0;
    });
    add("sliding", &|s| s.sliding_window = Some(300));
    add("sliding_short", &|s| s.sliding_window = Some(17));
    add("chunked", &|s| s.flush = Flush::Chunked);
    add("chunked_sinks", &|s| {
        s.flush = Flush::Chunked;
        s.sinks = 3;
        s.residual = 64;
    });
    add("f32_scales", &|s| {
        s.key = quant(2, Axis::Channel, 32, ScaleDtype::F32);
        s.value = quant(4, Axis::Token, 32, ScaleDtype::F32);
    });
    add("softmax_scale", &|s| s.softmax_scale = Some(1.0 / 16.0));
    out
}

#[test]
fn rare_schemes() {
    for (i, s) in rare().iter().enumerate() {
        for heads in [Heads::Gqa { q: 8, kv: 2 }, Heads::Gqa { q: 14, kv: 2 }, Heads::Mqa(4)] {
            check(s, heads, 64, &LENGTHS, &params_default(), 100 + i as u64);
        }
    }
}

#[test]
fn head_dims_off_the_simd_width() {
    // head_dim 36: not a multiple of 8, so even the default takes the
    // scalar loops; groups of 4 and 12 channels, 12 tokens.
    let mut s = presets::kivi2();
    s.key = quant(2, Axis::Channel, 12, ScaleDtype::F16);
    s.value = quant(4, Axis::Token, 12, ScaleDtype::F16);
    s.residual = 5;
    assert_eq!(CpuParams::default().isa(36), Isa::Scalar);
    // head_dim 40: AVX2 at most (AVX-512 reads 16 channels at a time).
    assert_ne!(CpuParams::default().isa(40), Isa::Avx512);
    let mut w = presets::kivi4();
    w.key = quant(4, Axis::Channel, 8, ScaleDtype::F16);
    w.value = quant(4, Axis::Token, 8, ScaleDtype::F16);
    w.residual = 16;
    for heads in [Heads::Gqa { q: 8, kv: 2 }, Heads::Mqa(3)] {
        check(&w, heads, 40, &LENGTHS, &params_default(), 10);
    }
    for heads in layouts() {
        check(&s, heads, 36, &LENGTHS, &params_default(), 7);
    }
    let mut t = presets::int8();
    t.key = quant(8, Axis::Token, 4, ScaleDtype::F16);
    t.value = quant(8, Axis::Token, 12, ScaleDtype::F16);
    check(&t, Heads::Gqa { q: 8, kv: 2 }, 36, &LENGTHS, &params_default(), 8);
    check(
        &presets::f16(),
        Heads::Gqa { q: 6, kv: 2 },
        20,
        &LENGTHS,
        &params_default(),
        9,
    );
}

#[test]
fn instruction_sets_are_selected_as_documented() {
    let d = CpuParams::default();
    assert_eq!(CpuParams { scalar: true, ..d }.isa(128), Isa::Scalar);
    assert_ne!(CpuParams { avx512: false, ..d }.isa(128), Isa::Avx512);
    // Report what this machine exercised, so a log shows which paths ran.
    eprintln!(
        "isa at head_dim 128: default {:?}, avx512 off {:?}",
        d.isa(128),
        CpuParams { avx512: false, ..d }.isa(128)
    );
}

#[test]
fn empty_and_single_token_sequences() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let shape = s.shape().unwrap();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(64)).unwrap();
    let empty = cache.add_sequence();
    let one = cache.add_sequence();
    let row: Vec<f32> = (0..128).map(|i| i as f32 / 100.0).collect();
    cache.append(one, &row, &row).unwrap();
    let q = vec![0.3f32; 2 * 8 * 64];
    let attn = AttnParams::of(&s, shape);
    let want = ReferenceBackend.decode(&cache, &[empty, one], &q, attn).unwrap();
    for p in params_default() {
        let got = CpuBackend::new(p)
            .unwrap()
            .decode(&cache, &[empty, one], &q, attn)
            .unwrap();
        assert!(got[..8 * 64].iter().all(|x| *x == 0.0));
        let err = want.iter().zip(&got).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(err <= 1e-6, "{err}");
    }
}

#[test]
fn bad_parameters_and_inputs_are_errors() {
    assert!(CpuBackend::new(CpuParams {
        tile_tokens: 0,
        ..CpuParams::default()
    })
    .is_err());
    let s = presets::kivi2().with_shape(Heads::Mha(2), 32).unwrap();
    let shape = s.shape().unwrap();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(64)).unwrap();
    let id = cache.add_sequence();
    let attn = AttnParams::of(&s, shape);
    let cpu = CpuBackend::default();
    assert!(cpu.decode(&cache, &[id], &[0.0; 3], attn).is_err());
    assert!(cpu.decode(&cache, &[id + 9], &[0.0; 64], attn).is_err());
    let mut q = vec![0.0f32; 64];
    q[5] = f32::NAN;
    assert!(cpu.decode(&cache, &[id], &q, attn).is_err());
    let public_field = CpuBackend {
        params: CpuParams {
            tile_tokens: 100_000,
            ..CpuParams::default()
        },
    };
    assert!(public_field.decode(&cache, &[id], &[0.0; 64], attn).is_err());
}

/// The fused path on both widths, AVX-512 and AVX2 (channel-axis 2/4-bit or
/// token-axis 2/4/8-bit keys, token-axis values): code widths, key and value
/// groups, head dims that take the gather (d64 at 2 bits) and the transpose
/// (the rest) layouts, GQA groups of 4 and 8 heads, MQA, tiles that are and
/// are not multiples of 16, split starts off the tile grid, sinks. Each case
/// must take the fused path of each width the CPU has (asserted; AVX2
/// declines 2-bit values in groups under 32, whose lanes would straddle
/// groups), and agree with the reference anyway.
#[test]
fn fused_path_shapes() {
    let cpu_has_it = std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq");
    let has_avx2 = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c");
    if !cpu_has_it {
        eprintln!("fused_path_shapes: no AVX-512 here; checking the generic loops on the same cases");
    }
    let quant = |bits, axis, group| {
        Codec::Quant(Quant {
            bits,
            axis,
            group,
            scale: ScaleDtype::F16,
            levels: Levels::Uniform,
        })
    };
    let mut cases = 0;
    let mut avx2_cases = 0;
    let key_value_cases = [
        (2, Axis::Channel, 32, 2, 32),
        (4, Axis::Channel, 32, 4, 32),
        (2, Axis::Channel, 64, 4, 16),
        (4, Axis::Channel, 16, 8, 64),
        (2, Axis::Channel, 128, 8, 128),
        // Token-axis keys (int8-like): groups of whole words.
        (8, Axis::Token, 32, 8, 32),
        (4, Axis::Token, 16, 4, 64),
        (2, Axis::Token, 64, 2, 16),
    ];
    for (kbits, kaxis, kgroup, vbits, vgroup) in key_value_cases {
        for (heads, d) in [
            (Heads::Gqa { q: 8, kv: 2 }, 128u32),
            (Heads::Gqa { q: 16, kv: 2 }, 64),
            (Heads::Mqa(4), 256),
            (Heads::Gqa { q: 8, kv: 2 }, 64),
        ] {
            let mut s = presets::kivi2();
            s.name = format!("k{kbits}{kaxis:?}{kgroup}_v{vbits}g{vgroup}");
            s.key = quant(kbits, kaxis, kgroup);
            s.value = quant(vbits, Axis::Token, vgroup);
            if kbits == 4 && vbits == 8 {
                s.sinks = 4;
            }
            if !d.is_multiple_of(vgroup) {
                continue;
            }
            // AVX-512 at four tiles, AVX2 at three (the 48-token tile with
            // three splits starts splits off the tile grid).
            let params: Vec<CpuParams> = [
                (16, true),
                (32, true),
                (48, true),
                (64, true),
                (16, false),
                (48, false),
                (64, false),
            ]
            .iter()
            .map(|&(tile_tokens, avx512)| CpuParams {
                tile_tokens,
                splits: if tile_tokens == 48 { 3 } else { 0 },
                avx512,
                ..CpuParams::default()
            })
            .collect();
            let bound = s.with_shape(heads, d).unwrap();
            let cache = PagedCache::new(bound, CacheConfig::for_tokens(64)).unwrap();
            for p in &params {
                let path = CpuBackend::new(*p).unwrap().kernel_path(&cache);
                if !p.avx512 && has_avx2 {
                    let fits = vbits != 2 || vgroup >= 32;
                    let want = if p.tile_tokens.is_multiple_of(16) && fits {
                        "avx2-fused"
                    } else {
                        "avx2"
                    };
                    assert_eq!(path, want, "{} {heads} d{d} tile {} (AVX2)", s.name, p.tile_tokens);
                    avx2_cases += usize::from(want == "avx2-fused");
                } else if cpu_has_it {
                    let want = if p.tile_tokens.is_multiple_of(16) {
                        "avx512-fused"
                    } else {
                        "avx512"
                    };
                    assert_eq!(path, want, "{} {heads} d{d} tile {}", s.name, p.tile_tokens);
                }
            }
            check(&s, heads, d, &[1, 31, 33, 127, 1000, 2077], &params, 900 + cases);
            cases += 1;
        }
    }
    assert!(cases >= 25, "{cases} cases");
    assert!(!has_avx2 || avx2_cases >= 60, "{avx2_cases} AVX2 fused cases");
}

/// The codec pipeline (rotation, Lloyd–Max levels, norms, outliers,
/// centering, sinks) on every instruction set, at odd lengths, MHA / GQA
/// 4:1 / GQA 7:1 / MQA and head_dim 64, 128, 256: token-axis codec tensors
/// on the fused codec loops, the rotated channel-axis keys of `chan_rot` on
/// the generic row reader. The KIVI fused path declines these schemes and
/// `kernel_path` says so.
#[test]
fn codec_pipelines_odd_lengths_and_layouts() {
    let texts = [
        "kv_lloyd { key: quant(bits = 3, axis = token, group = 64, levels = lloyd_max, norm = l2),
                    value: quant(bits = 2, axis = token, group = 64, levels = lloyd_max),
                    rotation: hadamard(block = 64, apply = [key, value], signs = 3),
                    outliers: sparse(per_token = 2, apply = [key]),
                    center: channel_mean(tokens = 16, apply = [key]), residual: 16, sinks: 3 }",
        "chan_rot { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
                    rotation: hadamard(block = 32, apply = [key]), outliers: sparse(per_token = 1, apply = [value]), residual: 32 }",
    ];
    for (i, text) in texts.iter().enumerate() {
        let s = kivi_spec::parse_scheme(text).unwrap();
        for (j, heads) in layouts().into_iter().enumerate() {
            check(
                &s,
                heads,
                64,
                &[1, 31, 33, 127, 1000],
                &params_default(),
                40 + (i * 4 + j) as u64,
            );
        }
        for d in [128, 256] {
            check(
                &s,
                Heads::Gqa { q: 8, kv: 2 },
                d,
                &[33, 1000],
                &params_default(),
                50 + i as u64,
            );
        }
        let bound = s.with_shape(Heads::Mqa(4), 256).unwrap();
        let cache = PagedCache::new(bound, CacheConfig::for_tokens(64)).unwrap();
        for p in isas() {
            let path = CpuBackend::new(p).unwrap().kernel_path(&cache);
            assert!(path.ends_with("+codec"), "{path}");
        }
    }
}

/// The codec presets were chosen at Gemma 3's head_dim 256 (their 256-wide
/// groups and Hadamard blocks bind to multiples of 256 only).
#[test]
fn codec_presets_at_the_gemma_shape() {
    for s in kivi_spec::presets::pipeline() {
        check(&s, Heads::Mqa(4), 256, &[1, 127, 1000], &params_default(), 60);
        check(&s, Heads::Gqa { q: 8, kv: 2 }, 256, &[33, 1000], &params_default(), 61);
    }
}

/// The fused codec loops (`cpu/codec.rs`: table lookup of 1- to 4-bit
/// codes, norms folded into scores and weights, sparse outliers, uniform
/// codes with zero points) against the oracle: the two codec presets with
/// and without a sliding window, and kin that exercise every code width,
/// both norms, uniform levels, f32 scales, bf16 and f32 activations,
/// groups narrower than a token, and GQA groups of 1, 4 and 7 heads (whole
/// and partial blocks of four heads), at odd lengths, on every instruction
/// set. `kernel_path` must name the fused codec loops for each.
#[test]
fn codec_fused_path_variants() {
    let avx512 = std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq");
    let mut schemes: Vec<(Scheme, u32)> = Vec::new();
    for mut s in presets::pipeline() {
        schemes.push((s.clone(), 256));
        s.name = format!("{}_sliding", s.name);
        s.sliding_window = Some(300);
        schemes.push((s, 256));
    }
    let texts = [
        "lm4_rms { key: quant(bits = 4, axis = token, group = 16, levels = lloyd_max, norm = rms),
                   value: quant(bits = 1, axis = token, group = 32, levels = lloyd_max, norm = l2, scale = f32),
                   rotation: hadamard(block = 64, apply = [key, value], signs = 5),
                   outliers: sparse(per_token = 3, apply = [key, value]), residual: 16, sinks: 2 }",
        "uni_rot { key: quant(bits = 3, axis = token, group = 32), value: quant(bits = 4, axis = token, group = 64),
                   rotation: hadamard(block = 32, apply = [key, value]),
                   outliers: sparse(per_token = 1, apply = [key, value]),
                   center: channel_mean(tokens = 8, apply = [key, value]), residual: 32, sinks: 1 }",
        "lm3_bf16 { key: quant(bits = 3, axis = token, group = 64, levels = lloyd_max, norm = l2),
                    value: quant(bits = 2, axis = token, group = 16, levels = lloyd_max, norm = rms),
                    rotation: hadamard(block = 64, apply = [value]), residual: 8, dtype: bf16, sliding_window: 200 }",
        "lm2_f32 { key: quant(bits = 2, axis = token, group = 64, levels = lloyd_max, norm = l2),
                   value: quant(bits = 3, axis = token, group = 64, levels = lloyd_max, norm = l2),
                   outliers: sparse(per_token = 2, apply = [value]), residual: 16, sinks: 4, dtype: f32 }",
    ];
    for t in texts {
        schemes.push((kivi_spec::parse_scheme(t).unwrap(), 64));
    }
    for (i, (s, d)) in schemes.iter().enumerate() {
        let layouts = [Heads::Mqa(4), Heads::Mha(4), Heads::Gqa { q: 14, kv: 2 }];
        for (j, heads) in layouts.into_iter().enumerate() {
            let bound = s.with_shape(heads, *d).unwrap();
            let cache = PagedCache::new(bound, CacheConfig::for_tokens(64)).unwrap();
            for p in isas() {
                let path = CpuBackend::new(p).unwrap().kernel_path(&cache);
                let want = match p.isa(*d as usize) {
                    Isa::Avx512 => "avx512-fused+codec",
                    Isa::Avx2 => "avx2-table+codec",
                    Isa::Scalar => "scalar-table+codec",
                };
                assert_eq!(path, want, "{} {heads}", s.name);
            }
            check(
                s,
                heads,
                *d,
                &[1, 31, 33, 127, 1000],
                &params_default(),
                700 + (i * 3 + j) as u64,
            );
        }
        if avx512 {
            assert_eq!(CpuParams::default().isa(*d as usize), Isa::Avx512);
        }
    }
}

/// `full` tensors (the `f16` preset, and bf16/f32 variants) on the dense
/// loops (`dense.rs`): odd lengths, MHA / GQA 4:1 / GQA 7:1 / MQA, head_dim
/// 64, 128 and 256, with a sliding window, on every instruction
/// set. `kernel_path` must name the dense loops on AVX-512 and AVX2.
#[test]
fn dense_full_path_odd_lengths_and_layouts() {
    let mut cases = 0u64;
    let mut variants = Vec::new();
    for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
        let mut s = presets::f16();
        s.dtype = dtype;
        s.name = format!("full_{dtype:?}");
        variants.push(s.clone());
        if dtype == Dtype::F16 {
            // Sinks and the residual window are rejected for schemes that
            // quantize nothing; a sliding window is not.
            for win in [300, 17] {
                let mut w = s.clone();
                w.name = format!("full_sliding{win}");
                w.sliding_window = Some(win);
                variants.push(w);
            }
        }
    }
    let heads_dims = [
        (Heads::Mha(4), 64u32),
        (Heads::Gqa { q: 8, kv: 2 }, 128),
        (Heads::Gqa { q: 14, kv: 2 }, 64),
        (Heads::Mqa(4), 256),
    ];
    for s in &variants {
        for (heads, d) in heads_dims {
            let bound = s.with_shape(heads, d).unwrap();
            let group = bound.shape().unwrap().group_size();
            let cache = PagedCache::new(bound, CacheConfig::for_tokens(64)).unwrap();
            let mut params = isas().to_vec();
            // A tile that is not a multiple of the rows per pass, and a
            // short one (the fused f16 tile at its smallest).
            params.push(CpuParams {
                tile_tokens: 37,
                splits: 3,
                ..CpuParams::default()
            });
            params.push(CpuParams {
                tile_tokens: 16,
                splits: 2,
                ..CpuParams::default()
            });
            // f16 rows with groups of four heads run whole tiles fused
            // (`dense::tile`); the rest of their tokens, and other groups
            // and dtypes, the dense loops.
            let fused = s.dtype == Dtype::F16 && group.is_multiple_of(4);
            for p in &params {
                let path = CpuBackend::new(*p).unwrap().kernel_path(&cache);
                let want = match (p.isa(d as usize), fused) {
                    (Isa::Avx512, true) => "avx512-dense-fused",
                    (Isa::Avx2, true) => "avx2-dense-fused",
                    (Isa::Avx512, false) => "avx512-dense",
                    (Isa::Avx2, false) => "avx2-dense",
                    (Isa::Scalar, _) => "scalar",
                };
                assert_eq!(path, want, "{} {heads} d{d} {}", s.name, p.name());
            }
            check(s, heads, d, &[1, 31, 33, 127, 1000], &params, 1200 + cases);
            cases += 1;
        }
    }
    assert_eq!(cases, 20);
}
