//! Pre-RoPE keys (`rope: pre(...)`): the cache stores keys before rotary
//! embedding and decode turns each to its absolute position.
//!
//! - The math check that could fail: with exact keys, pre-RoPE attention
//!   equals post-RoPE attention over keys rotated outside the cache by an
//!   independent RoPE (written here from the two conventions' formulas), and
//!   the wrong pair convention does not.
//! - CPU (both strategies: rotate the key, rotate the query) against the
//!   oracle on quantized pre-RoPE keys: both RoPE bases of Gemma 3 (local
//!   10000, global 1000000), both pair conventions, lengths 1, 31, 33, 127,
//!   1000, MHA / GQA / MQA, sinks, residual windows, sliding windows.
//! - Positions come from the cache: a streamed cache with an eviction
//!   window, and many-query blocks, agree with the oracle.
//!
//! Tolerance: max |got - want| <= 1e-5 * max |want| (as cpu_vs_reference).

mod common;
use common::*;
use kivi_runtime::reference::{self, AttnParams};
use kivi_runtime::*;
use kivi_spec::*;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

/// The RoPE strategy is process-wide: tests that set it or assert the path
/// it picks hold this lock (the test harness runs tests on threads).
static STRATEGY: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// Gemma 3's RoPE bases: local (sliding) layers and global layers.
const BASES: [f64; 2] = [10_000.0, 1_000_000.0];
const STYLES: [RopeStyle; 2] = [RopeStyle::Half, RopeStyle::Interleaved];

fn layouts3() -> [(Heads, u32); 3] {
    [
        (Heads::Mha(2), 32),
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 64),
    ]
}

fn with_rope(s: &Scheme, theta: f64, style: RopeStyle) -> Scheme {
    let mut s = s.clone();
    s.rope = Some(Rope {
        theta,
        style,
        scaling: 1.0,
    });
    validate(&s).unwrap();
    s
}

/// RoPE as a model applies it, written independently of `kivi_spec::Rope`:
/// Llama's `rotate_half` (`x * cos + rotate_half(x) * sin`, where
/// `rotate_half(x) = [-x2, x1]`) or GPT-J's interleaved pairs, with
/// `inv_freq_i = 1 / theta^(2i/D)`. `k` is `[T, H, D]`.
fn model_rope(k: &[f32], h: usize, d: usize, theta: f64, style: RopeStyle) -> Vec<f32> {
    let mut out = k.to_vec();
    for (row_i, row) in out.chunks_mut(d).enumerate() {
        let t = row_i / h;
        let x = k[row_i * d..(row_i + 1) * d].to_vec();
        match style {
            RopeStyle::Half => {
                let half = d / 2;
                for c in 0..d {
                    let i = c % half;
                    let ang = t as f64 / theta.powf((2 * i) as f64 / d as f64);
                    let rot = if c < half { -x[c + half] } else { x[c - half] };
                    row[c] = (x[c] as f64 * ang.cos() + rot as f64 * ang.sin()) as f32;
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..d / 2 {
                    let ang = t as f64 / theta.powf((2 * i) as f64 / d as f64);
                    let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
                    row[2 * i] = (a * ang.cos() - b * ang.sin()) as f32;
                    row[2 * i + 1] = (b * ang.cos() + a * ang.sin()) as f32;
                }
            }
        }
    }
    out
}

fn check(got: &[f32], want: &[f32], what: &str) {
    let err = rel_err(got, want);
    assert!(err <= 1e-5, "{what}: rel err {err:e}");
}

fn filled(s: &Scheme, k: &[f32], v: &[f32]) -> (PagedCache, SeqId) {
    let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(k.len() + 64)).unwrap();
    let id = c.add_sequence();
    c.extend(id, k, v).unwrap();
    (c, id)
}

/// With `full` f32 keys nothing is lost, so storing keys before RoPE and
/// turning them in the kernel must give post-RoPE attention over the same
/// keys; the other pair convention must not.
#[test]
fn exact_pre_rope_equals_post_rope_attention() {
    let mut rng = Rng::new(13);
    let exact = Scheme {
        name: "exact".into(),
        key: Codec::Full,
        value: Codec::Full,
        dtype: Dtype::F32,
        ..presets::f16()
    };
    let mut wrong_differs = 0;
    for (li, (heads, d)) in layouts3().into_iter().enumerate() {
        let post = exact.with_shape(heads, d).unwrap();
        let shape = post.shape().unwrap();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        for theta in BASES {
            for style in STYLES {
                let pre = with_rope(&post, theta, style);
                let other = with_rope(&post, theta, STYLES[(style == RopeStyle::Half) as usize]);
                for &t in &LENS {
                    let k = rng.kv(t, hkv, d, true);
                    let v = rng.kv(t, hkv, d, false);
                    let q: Vec<f32> = rng.kv(1, hq, d, false).iter().map(|x| x * 2.0).collect();
                    let attn = AttnParams::of(&post, shape);
                    let what = format!("layout {li} theta {theta} {} T={t}", style.name());
                    let want = reference::attend(&post, &q, &model_rope(&k, hkv, d, theta, style), &v, attn).unwrap();
                    check(
                        &reference::attend(&pre, &q, &k, &v, attn).unwrap(),
                        &want,
                        &format!("oracle {what}"),
                    );
                    let (c, id) = filled(&pre, &k, &v);
                    let cpu = CpuBackend::default().decode(&c, &[id], &q, attn).unwrap();
                    check(&cpu, &want, &format!("cpu {what}"));
                    let wrong = reference::attend(&other, &q, &k, &v, attn).unwrap();
                    if t > 1 && rel_err(&wrong, &want) > 1e-3 {
                        wrong_differs += 1;
                    }
                }
            }
        }
    }
    // Every case with more than one token tells the conventions apart.
    assert_eq!(wrong_differs, 3 * 2 * 2 * 4, "the pair convention must matter");
}

/// Quantized pre-RoPE keys: the CPU backend (both strategies, AVX and
/// scalar, one split and several) equals the oracle's decode over the same
/// cache, and the paged cache equals the oracle's one-shot view.
#[test]
fn cpu_matches_the_oracle_on_quantized_pre_rope_keys() {
    let mut rng = Rng::new(0x13_01);
    let kivi2 = Scheme {
        residual: 32,
        sinks: 4,
        ..presets::kivi2()
    };
    let kivi4_window = Scheme {
        name: "kivi4_window".into(),
        sliding_window: Some(100),
        ..presets::kivi4()
    };
    let lloyd = parse_scheme(
        "lloyd { key: quant(bits = 3, axis = channel, group = 16, levels = lloyd_max), value: quant(bits = 2, axis = token, group = 32), residual: 7 }",
    )
    .unwrap();
    let int8 = presets::int8();
    let bases = [kivi2, kivi4_window, lloyd, int8];
    let _lock = STRATEGY.lock().unwrap_or_else(|e| e.into_inner());
    let backends = [
        CpuBackend::default(),
        CpuBackend::new(CpuParams {
            splits: 3,
            tile_tokens: 16,
            scalar: true,
            ..CpuParams::default()
        })
        .unwrap(),
    ];
    let mut case = 0usize;
    for theta in BASES {
        for style in STYLES {
            for (heads, d) in layouts3() {
                for &t in &LENS {
                    case += 1;
                    let base = &bases[case % bases.len()];
                    let s = with_rope(&base.with_shape(heads, d).unwrap(), theta, style);
                    let shape = s.shape().unwrap();
                    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
                    let k = rng.kv(t, hkv, d, true);
                    let v = rng.kv(t, hkv, d, false);
                    let q = rng.kv(1, hq, d, false);
                    let attn = AttnParams::of(&s, shape);
                    let what = format!("{} theta {theta} {} {heads} T={t}", s.name, style.name());
                    let want = reference::attend(&s, &q, &k, &v, attn).unwrap();
                    let (c, id) = filled(&s, &k, &v);
                    check(
                        &ReferenceBackend.decode(&c, &[id], &q, attn).unwrap(),
                        &want,
                        &format!("paged {what}"),
                    );
                    for (bi, b) in backends.iter().enumerate() {
                        assert!(b.kernel_path(&c).ends_with("+rope"), "{}", b.kernel_path(&c));
                        for rotate_query in [false, true] {
                            kivi_runtime::cpu::set_rope_strategy(rotate_query);
                            let got = b.decode(&c, &[id], &q, attn).unwrap();
                            check(&got, &want, &format!("cpu {bi} query={rotate_query} {what}"));
                        }
                        kivi_runtime::cpu::set_rope_strategy(false);
                    }
                }
            }
        }
    }
}

/// `Some(AVX-512 F + DQ are there)` where AVX2 + FMA + F16C are (what the
/// CPU backend's ISA choice asks for), else `None`.
fn x86_features() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        return Some(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq"));
    }
    None
}

/// The vector path (`<isa>-vec+rope`: channel-axis uniform 1/2/4-bit keys,
/// the key turned, `D % 16 == 0`) on AVX-512 and AVX2, one split and
/// several of small tiles: the path name is asserted (so a plan that
/// silently fell back to the row reader fails), and its decode equals the
/// oracle at every length, layout, base and pair convention, 1, 2 and 4
/// bits, f16 and f32 parameters, key groups of 32 and 48, with sinks
/// and full-precision windows inside the tiles.
#[test]
fn vector_path_matches_the_oracle_on_avx512_and_avx2() {
    let Some(has512) = x86_features() else {
        eprintln!("no AVX2: the vector path is not planned here");
        return;
    };
    let mut rng = Rng::new(0x13_03);
    let kivi2 = Scheme {
        residual: 32,
        sinks: 4,
        ..presets::kivi2()
    };
    let kivi4 = presets::kivi4();
    // 1-bit keys with f32 parameters (read one by one, the f16 run not
    // taken, the values not on the fused path), and key groups of 48
    // tokens (runs cut at group ends that are not tile ends).
    let one_bit = parse_scheme(
        "onebit { key: quant(bits = 1, axis = channel, group = 32, scale = f32), value: quant(bits = 4, axis = token, group = 32), residual: 16 }",
    )
    .unwrap();
    let g48 = parse_scheme(
        "g48 { key: quant(bits = 4, axis = channel, group = 48), value: quant(bits = 2, axis = token, group = 16), residual: 48, sinks: 1 }",
    )
    .unwrap();
    let bases = [kivi2, kivi4, one_bit, g48];
    let mk = |avx512: bool, splits: usize, tile_tokens: usize| {
        CpuBackend::new(CpuParams {
            splits,
            tile_tokens,
            avx512,
            ..CpuParams::default()
        })
        .unwrap()
    };
    let backends = [
        (
            mk(true, 0, 64),
            if has512 { "avx512-vec+rope" } else { "avx2-vec+rope" },
        ),
        (
            mk(true, 3, 16),
            if has512 { "avx512-vec+rope" } else { "avx2-vec+rope" },
        ),
        (mk(false, 0, 64), "avx2-vec+rope"),
        (mk(false, 3, 16), "avx2-vec+rope"),
    ];
    let _lock = STRATEGY.lock().unwrap_or_else(|e| e.into_inner());
    kivi_runtime::cpu::set_rope_strategy(false);
    let mut case = 0usize;
    for theta in BASES {
        for style in STYLES {
            for (heads, d) in layouts3() {
                for &t in &LENS {
                    case += 1;
                    let base = &bases[case % bases.len()];
                    let s = with_rope(&base.with_shape(heads, d).unwrap(), theta, style);
                    let shape = s.shape().unwrap();
                    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
                    let k = rng.kv(t, hkv, d, true);
                    let v = rng.kv(t, hkv, d, false);
                    let q = rng.kv(1, hq, d, false);
                    let attn = AttnParams::of(&s, shape);
                    let want = reference::attend(&s, &q, &k, &v, attn).unwrap();
                    let (c, id) = filled(&s, &k, &v);
                    for (bi, (b, path)) in backends.iter().enumerate() {
                        assert_eq!(b.kernel_path(&c), *path, "backend {bi}");
                        let got = b.decode(&c, &[id], &q, attn).unwrap();
                        let what = format!("{} theta {theta} {} {heads} T={t} {path} {bi}", s.name, style.name());
                        check(&got, &want, &what);
                    }
                }
            }
        }
    }
}

/// A streamed cache with an eviction window (positions past the freed
/// blocks stay absolute), and many-query blocks after a prefix; kivi2 keys,
/// and the same with two key outliers per token (stored before RoPE,
/// streamed appends and block writes alike).
#[test]
fn positions_come_from_the_cache_streamed_evicted_and_in_blocks() {
    let mut rng = Rng::new(0x13_02);
    let win = Scheme {
        name: "win".into(),
        sinks: 3,
        residual: 16,
        sliding_window: Some(48),
        ..presets::kivi2()
    };
    let win_o = Scheme {
        name: "win_o".into(),
        outliers: Some(Outliers {
            per_token: 2,
            apply: Apply {
                key: true,
                value: false,
            },
        }),
        ..win.clone()
    };
    for (base, (theta, style)) in [&win, &win_o].into_iter().flat_map(|b| {
        [
            (b, (10_000.0, RopeStyle::Half)),
            (b, (1_000_000.0, RopeStyle::Interleaved)),
        ]
    }) {
        for (heads, d) in layouts3() {
            let s = with_rope(&base.with_shape(heads, d).unwrap(), theta, style);
            let shape = s.shape().unwrap();
            let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
            let attn = AttnParams::of(&s, shape);
            let total = 300;
            let k = rng.kv(total, hkv, d, true);
            let v = rng.kv(total, hkv, d, false);
            let mut c = PagedCache::new(
                s.clone(),
                CacheConfig {
                    block_tokens: Some(32),
                    ..CacheConfig::for_tokens(total + 64)
                },
            )
            .unwrap();
            c.set_eviction_window(Some(64)).unwrap();
            let id = c.add_sequence();
            let row = hkv * d;
            for t in 1..=total {
                c.append(id, &k[(t - 1) * row..t * row], &v[(t - 1) * row..t * row])
                    .unwrap();
                if [1, 31, 33, 127, 200, 300].contains(&t) {
                    let q = rng.kv(1, hq, d, false);
                    let want = reference::attend(&s, &q, &k[..t * row], &v[..t * row], attn).unwrap();
                    let what = format!("{heads} {} T={t}", style.name());
                    check(
                        &CpuBackend::default().decode(&c, &[id], &q, attn).unwrap(),
                        &want,
                        &what,
                    );
                    check(&ReferenceBackend.decode(&c, &[id], &q, attn).unwrap(), &want, &what);
                }
            }
            assert!(c.evicted_tokens(id).unwrap() > 0, "the window evicted blocks");
            // Many-query blocks: prefix 0 and 127, blocks of 33 and 1.
            for (past, n) in [(0usize, 33usize), (127, 33), (127, 1)] {
                let q = rng.kv(n, hq, d, false);
                let want =
                    reference::block_attention(&s, past, &q, &k[..(past + n) * row], &v[..(past + n) * row], attn)
                        .unwrap();
                let backends: [&dyn Backend; 2] = [&ReferenceBackend, &CpuBackend::default()];
                for b in backends {
                    let (mut c, id) = filled(&s, &k[..past * row], &v[..past * row]);
                    let blk = NewTokens {
                        seq: id,
                        q: &q,
                        k: &k[past * row..(past + n) * row],
                        v: &v[past * row..(past + n) * row],
                    };
                    let got = b.attend_block(&mut c, &[blk], attn).unwrap();
                    check(&got, &want, &format!("{} block {past}+{n} {heads}", b.name()));
                }
            }
        }
    }
}

/// Key outliers on pre-RoPE keys (KVQuant's dense-and-sparse keys): each
/// correction lives in the pre-RoPE domain and is added before the row is
/// turned. The paged cache (reference backend) and the CPU backend (both
/// strategies, vector ISA and scalar, one split and several) equal the
/// oracle at lengths 1, 31, 33, 127, 1000 on MHA / GQA / MQA, both bases
/// and both pair conventions; channel-axis keys (the group-wise decode in
/// `cpu/rope.rs`) and token-axis keys (the row reader), uniform and
/// Lloyd–Max levels, with value outliers too. The keys carry spikes of
/// 40x in a few channels, and at 1000 tokens the outliers change the
/// oracle's answer, so a kernel that dropped the corrections would fail.
#[test]
fn key_outliers_on_pre_rope_keys_match_the_oracle() {
    let mut rng = Rng::new(0x13_0c);
    let bases = [
        "ko_c { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
                outliers: sparse(per_token = 2, apply = [key]), residual: 32, sinks: 4 }",
        "ko_t { key: quant(bits = 2, axis = token, group = 32), value: quant(bits = 2, axis = token, group = 32),
                outliers: sparse(per_token = 1, apply = [key, value]), residual: 7 }",
        "ko_lm { key: quant(bits = 3, axis = channel, group = 16, levels = lloyd_max),
                 value: quant(bits = 2, axis = channel, group = 16), outliers: sparse(per_token = 3, apply = [key]),
                 residual: 0, sinks: 1 }",
    ]
    .map(|t| parse_scheme(t).unwrap());
    let _lock = STRATEGY.lock().unwrap_or_else(|e| e.into_inner());
    let backends = [
        CpuBackend::default(),
        CpuBackend::new(CpuParams {
            splits: 3,
            tile_tokens: 16,
            scalar: true,
            ..CpuParams::default()
        })
        .unwrap(),
    ];
    let (mut case, mut mattered) = (0usize, 0usize);
    for theta in BASES {
        for style in STYLES {
            for (heads, d) in layouts3() {
                for &t in &LENS {
                    case += 1;
                    let base = &bases[case % bases.len()];
                    let s = with_rope(&base.with_shape(heads, d).unwrap(), theta, style);
                    let shape = s.shape().unwrap();
                    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
                    let mut k = rng.kv(t, hkv, d, true);
                    for row in k.chunks_exact_mut(d) {
                        let c = (rng.f32().abs() * d as f32) as usize % d;
                        row[c] *= 40.0;
                    }
                    let v = rng.kv(t, hkv, d, false);
                    let q = rng.kv(1, hq, d, false);
                    let attn = AttnParams::of(&s, shape);
                    let what = format!("{} theta {theta} {} {heads} T={t}", s.name, style.name());
                    let want = reference::attend(&s, &q, &k, &v, attn).unwrap();
                    if t == 1000 {
                        let plain = Scheme {
                            outliers: None,
                            ..s.clone()
                        };
                        let without = reference::attend(&plain, &q, &k, &v, attn).unwrap();
                        assert!(rel_err(&without, &want) > 1e-3, "{what}: outliers changed nothing");
                        mattered += 1;
                    }
                    let (c, id) = filled(&s, &k, &v);
                    check(
                        &ReferenceBackend.decode(&c, &[id], &q, attn).unwrap(),
                        &want,
                        &format!("paged {what}"),
                    );
                    for (bi, b) in backends.iter().enumerate() {
                        let path = b.kernel_path(&c);
                        assert!(path.ends_with("+rope") && !path.ends_with("vec+rope"), "{path}");
                        for rotate_query in [false, true] {
                            kivi_runtime::cpu::set_rope_strategy(rotate_query);
                            let got = b.decode(&c, &[id], &q, attn).unwrap();
                            check(&got, &want, &format!("cpu {bi} query={rotate_query} {what}"));
                        }
                        kivi_runtime::cpu::set_rope_strategy(false);
                    }
                }
            }
        }
    }
    assert_eq!(mattered, 2 * 2 * 3);
}

/// The vector path's sub-tiles (the query turned once per 16 rows, each key
/// row by the fixed `R(0..16)`): tiles that are not whole sub-tiles (8, 24,
/// 40) and whole ones (64), one split and several, on AVX-512 and AVX2, at
/// positions far past the step tables (a 20000-token sequence, whose tiles
/// carry their first angles across many chains), with the values of the
/// issue-12 schemes (1-bit Lloyd–Max on Hadamard-rotated values with two
/// outliers per token, `codec.rs`) and with KIVI values (the fused half).
/// The path name is asserted, and every output equals the oracle.
#[test]
fn vector_sub_tiles_match_the_oracle_at_odd_tiles_and_long_positions() {
    let Some(has512) = x86_features() else {
        eprintln!("no AVX2: the vector path is not planned here");
        return;
    };
    let mut rng = Rng::new(0x13_05);
    let codec_values = parse_scheme(
        "pk { key: quant(bits = 2, axis = channel, group = 128), value: quant(bits = 1, axis = token, group = 64, levels = lloyd_max, norm = l2), rotation: hadamard(block = 64, apply = [value]), outliers: sparse(per_token = 2, apply = [value]), residual: 128, sinks: 4 }",
    )
    .unwrap();
    let table_keys = parse_scheme(
        "tk { key: quant(bits = 2, axis = channel, group = 32, levels = lloyd_max), value: quant(bits = 2, axis = token, group = 32), residual: 32, sinks: 4 }",
    )
    .unwrap();
    let _lock = STRATEGY.lock().unwrap_or_else(|e| e.into_inner());
    kivi_runtime::cpu::set_rope_strategy(false);
    let mut case = 0usize;
    for base in [&codec_values, &table_keys] {
        for (heads, d) in [(Heads::Mqa(4), 64u32), (Heads::Gqa { q: 8, kv: 2 }, 64)] {
            for (t, style) in [
                (20_000usize, RopeStyle::Half),
                (1000, RopeStyle::Interleaved),
                (33, RopeStyle::Half),
            ] {
                case += 1;
                let theta = BASES[case % 2];
                let s = with_rope(&base.with_shape(heads, d).unwrap(), theta, style);
                let shape = s.shape().unwrap();
                let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
                let k = rng.kv(t, hkv, d, true);
                let v = rng.kv(t, hkv, d, false);
                let q = rng.kv(1, hq, d, false);
                let attn = AttnParams::of(&s, shape);
                let want = reference::attend(&s, &q, &k, &v, attn).unwrap();
                let (c, id) = filled(&s, &k, &v);
                for avx512 in [true, false] {
                    for (splits, tile_tokens) in [(0, 64), (3, 8), (2, 24), (5, 40)] {
                        let b = CpuBackend::new(CpuParams {
                            splits,
                            tile_tokens,
                            avx512,
                            ..CpuParams::default()
                        })
                        .unwrap();
                        let path = if avx512 && has512 {
                            "avx512-vec+rope"
                        } else {
                            "avx2-vec+rope"
                        };
                        assert_eq!(b.kernel_path(&c), path);
                        let got = b.decode(&c, &[id], &q, attn).unwrap();
                        let what = format!(
                            "{} theta {theta} {} {heads} T={t} {path} splits {splits} tile {tile_tokens}",
                            s.name,
                            style.name()
                        );
                        check(&got, &want, &what);
                    }
                }
            }
        }
    }
}
