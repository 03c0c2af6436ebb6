//! Shared helpers for the runtime's integration tests: the seeded generator
//! (`kivi_runtime::rand`) and a set of schemes covering the language.
#![allow(dead_code)]

use kivi_spec::*;

/// The runtime's one seeded generator (the same xorshift64* stream these
/// tests always used), with the test-data shapes of [`KvData`] on top.
pub use kivi_runtime::rand::Rng;

/// Test-data shapes drawn from [`Rng`].
pub trait KvData {
    /// Activations that look like LLM keys: a few channels with large
    /// magnitude (outliers), the rest small.
    fn kv(&mut self, tokens: usize, heads: usize, d: usize, outliers: bool) -> Vec<f32>;
}

impl KvData for Rng {
    fn kv(&mut self, tokens: usize, heads: usize, d: usize, outliers: bool) -> Vec<f32> {
        let mut v = Vec::with_capacity(tokens * heads * d);
        for _ in 0..tokens {
            for _ in 0..heads {
                for c in 0..d {
                    let scale = if outliers && c % 17 == 3 { 8.0 } else { 1.0 };
                    v.push(self.f32() * scale);
                }
            }
        }
        v
    }
}

pub fn quant(bits: u32, axis: Axis, group: u32) -> Codec {
    Codec::Quant(Quant {
        bits,
        axis,
        group,
        scale: ScaleDtype::F16,
        levels: Levels::Uniform,
    })
}

/// Presets plus non-preset schemes that exercise every feature.
pub fn schemes() -> Vec<Scheme> {
    let mut v = presets::all();
    let k2 = presets::kivi2();
    v.push(Scheme {
        name: "three_bit_sinks".into(),
        key: quant(3, Axis::Channel, 16),
        value: quant(3, Axis::Token, 16),
        residual: 20,
        sinks: 4,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "one_bit_bf16".into(),
        key: quant(1, Axis::Channel, 8),
        value: quant(1, Axis::Token, 8),
        residual: 5,
        dtype: Dtype::Bf16,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "chunked_f32".into(),
        key: quant(4, Axis::Channel, 32),
        value: quant(2, Axis::Token, 16),
        residual: 64,
        flush: Flush::Chunked,
        dtype: Dtype::F32,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "f32_scales_window".into(),
        key: Codec::Quant(Quant {
            bits: 8,
            axis: Axis::Channel,
            group: 8,
            scale: ScaleDtype::F32,
            levels: Levels::Uniform,
        }),
        value: Codec::Quant(Quant {
            bits: 2,
            axis: Axis::Channel,
            group: 16,
            scale: ScaleDtype::F32,
            levels: Levels::Uniform,
        }),
        residual: 3,
        sinks: 2,
        sliding_window: Some(50),
        softmax_scale: Some(0.0625),
        ..k2.clone()
    });
    v.push(Scheme {
        name: "full_key".into(),
        key: Codec::Full,
        value: quant(4, Axis::Token, 16),
        residual: 0,
        sinks: 1,
        ..k2
    });
    v
}

pub fn layouts() -> Vec<(Heads, u32)> {
    vec![
        (Heads::Mha(2), 32),
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Gqa { q: 7, kv: 1 }, 32),
        (Heads::Mqa(4), 64),
    ]
}

/// max |a - b| / max |b|.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let num = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let den = want.iter().map(|b| b.abs()).fold(0f32, f32::max).max(1e-30);
    num / den
}

/// Schemes that use the codec pipeline (rotation, Lloyd–Max levels, norms,
/// outliers, centering), alone and together, on both axes. Head dims in
/// `layouts()` are 32 and 64: rotation blocks here divide both.
pub fn codec_schemes() -> Vec<Scheme> {
    let texts = [
        // Lloyd–Max alone, token and channel axis, both norms.
        "lloyd_tok { key: quant(bits = 3, axis = token, group = 16, levels = lloyd_max),
                     value: quant(bits = 2, axis = token, group = 32, levels = lloyd_max, norm = l2), residual: 5 }",
        "lloyd_chan { key: quant(bits = 2, axis = channel, group = 8, levels = lloyd_max, norm = l2),
                      value: quant(bits = 4, axis = token, group = 8, levels = lloyd_max), residual: 3, sinks: 2 }",
        // Rotation with and without signs, uniform codes.
        "rot_uniform { key: quant(bits = 2, axis = channel, group = 16), value: quant(bits = 2, axis = token, group = 16),
                       rotation: hadamard(block = 32, apply = [key, value]), residual: 7 }",
        "rot_signs_bf16 { key: quant(bits = 4, axis = token, group = 32, levels = lloyd_max),
                          value: quant(bits = 1, axis = token, group = 32, levels = lloyd_max),
                          rotation: hadamard(block = 16, apply = [key], signs = 5), dtype: bf16 }",
        // Outliers alone, then everything at once.
        "outliers_only { key: quant(bits = 2, axis = channel, group = 8), value: quant(bits = 2, axis = token, group = 16),
                         outliers: sparse(per_token = 3, apply = [key, value]), residual: 4 }",
        "everything { key: quant(bits = 3, axis = token, group = 32, levels = lloyd_max, norm = l2),
                      value: quant(bits = 2, axis = token, group = 16, levels = lloyd_max),
                      rotation: hadamard(block = 32, apply = [key, value], signs = 9),
                      outliers: sparse(per_token = 2, apply = [key]),
                      center: channel_mean(tokens = 6, apply = [key, value]), residual: 4, sinks: 2 }",
        // Centering with chunked flush and f32 activations and scales.
        "center_chunked_f32 { key: quant(bits = 2, axis = channel, group = 4, scale = f32),
                              value: full, center: channel_mean(tokens = 8, apply = [key]),
                              rotation: hadamard(block = 8, apply = [key]), residual: 8, flush: chunked, dtype: f32 }",
    ];
    texts
        .iter()
        .map(|t| parse_scheme(t).unwrap_or_else(|e| panic!("{t}: {e}")))
        .collect()
}

// The block-attention suites (many_query.rs on the CPU, device_block.rs
// on the device) draw the same data and stress the same schemes.

/// Keys with per-channel offsets and scales and a few spiky tokens (what
/// makes the quantized and full-precision views differ), noise for values.
pub fn block_tensor(rng: &mut Rng, tokens: usize, hkv: usize, d: usize, key: bool) -> Vec<f32> {
    let mut x = Vec::with_capacity(tokens * hkv * d);
    for t in 0..tokens {
        for _ in 0..hkv {
            for c in 0..d {
                let base = if key { ((c * 7) % 5) as f32 - 2.0 } else { 0.0 };
                let amp = if key { 0.5 + (c % 3) as f32 } else { 1.0 };
                let spike = if t % 97 == 5 { 3.0 } else { 1.0 };
                x.push(base + amp * spike * rng.f32());
            }
        }
    }
    x
}

/// One sequence's raw data: `past` tokens already cached, then a block of
/// `n` with their queries.
pub struct Case {
    pub past: usize,
    pub n: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub q: Vec<f32>,
}

pub fn cases(s: &Scheme, shapes: &[(usize, usize)], seed: u64) -> Vec<Case> {
    let shape = s.shape().unwrap();
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let mut rng = Rng::new(seed);
    shapes
        .iter()
        .map(|&(past, n)| Case {
            past,
            n,
            k: block_tensor(&mut rng, past + n, hkv, d, true),
            v: block_tensor(&mut rng, past + n, hkv, d, false),
            q: rng.vec(n * hq * d).iter().map(|x| 2.0 * x).collect(),
        })
        .collect()
}

/// A cache holding each case's first `past` tokens, one sequence each.
pub fn filled(s: &Scheme, cases: &[Case], spare: usize) -> (kivi_runtime::PagedCache, Vec<kivi_runtime::SeqId>) {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    let total: usize = cases.iter().map(|c| c.past + c.n).sum();
    let mut cache =
        kivi_runtime::PagedCache::new(s.clone(), kivi_runtime::CacheConfig::for_tokens(total + spare)).unwrap();
    let seqs = cases
        .iter()
        .map(|c| {
            let id = cache.add_sequence();
            cache.extend(id, &c.k[..c.past * row], &c.v[..c.past * row]).unwrap();
            id
        })
        .collect();
    (cache, seqs)
}

pub fn blocks<'a>(s: &Scheme, cases: &'a [Case], seqs: &[kivi_runtime::SeqId]) -> Vec<kivi_runtime::NewTokens<'a>> {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    cases
        .iter()
        .zip(seqs)
        .map(|(c, &seq)| kivi_runtime::NewTokens {
            seq,
            q: &c.q,
            k: &c.k[c.past * row..],
            v: &c.v[c.past * row..],
        })
        .collect()
}

/// Checks one batched `attend_block` output `got` against each case's
/// oracle rows `want[i]`: every query's row within `tol * max |want|`
/// (a NaN fails), each sequence `past + n` tokens long after the call, and
/// no rows beyond the batch's.
#[allow(clippy::too_many_arguments)]
pub fn assert_block_rows(
    s: &Scheme,
    attn: kivi_runtime::AttnParams,
    backend: &str,
    cache: &kivi_runtime::PagedCache,
    seqs: &[kivi_runtime::SeqId],
    cases: &[Case],
    want: &[Vec<f32>],
    got: &[f32],
    tol: f32,
) {
    let shape = s.shape().unwrap();
    let per = shape.q_heads * shape.head_dim;
    let mut at = 0;
    for ((c, &seq), want) in cases.iter().zip(seqs).zip(want) {
        assert_eq!(cache.len(seq).unwrap(), c.past + c.n);
        for i in 0..c.n {
            let (err, scale) = row_error(&want[i * per..(i + 1) * per], &got[(at + i) * per..(at + i + 1) * per]);
            assert!(
                err <= tol * scale,
                "{} {:?} window {:?} on {backend}: past {} block {} query {i}: error {err:e} vs max |ref| {scale:e}",
                s.name,
                shape,
                attn.window,
                c.past,
                c.n
            );
        }
        at += c.n;
    }
    assert_eq!(got.len(), at * per);
}

/// Max |got - want| over one row (infinite where `got` holds a NaN, which
/// `f32::max` would otherwise pass over), and max |want|.
pub fn row_error(want: &[f32], got: &[f32]) -> (f32, f32) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = want.iter().zip(got).fold(0f32, |m, (x, y)| {
        if y.is_nan() {
            f32::INFINITY
        } else {
            m.max((x - y).abs())
        }
    });
    (err, scale)
}

/// Schemes that stress the windows: sinks, a residual window that flushes
/// inside most blocks, KIVI's chunked flush, a sliding window smaller than
/// the largest block, f32 activations, bf16 and 1-bit codes, a full key.
pub fn window_schemes() -> Vec<Scheme> {
    let k2 = presets::kivi2();
    vec![
        Scheme {
            name: "sinks_r20".into(),
            key: quant(3, Axis::Channel, 16),
            value: quant(3, Axis::Token, 16),
            residual: 20,
            sinks: 4,
            ..k2.clone()
        },
        Scheme {
            name: "bf16_r5_window40".into(),
            key: quant(1, Axis::Channel, 8),
            value: quant(1, Axis::Token, 8),
            residual: 5,
            sinks: 3,
            dtype: Dtype::Bf16,
            sliding_window: Some(40),
            ..k2.clone()
        },
        Scheme {
            name: "chunked_f32".into(),
            key: quant(4, Axis::Channel, 32),
            value: quant(2, Axis::Token, 16),
            residual: 64,
            flush: Flush::Chunked,
            dtype: Dtype::F32,
            ..k2.clone()
        },
        Scheme {
            name: "chan_values_window50".into(),
            key: quant(8, Axis::Channel, 8),
            value: quant(2, Axis::Channel, 16),
            residual: 3,
            sinks: 2,
            sliding_window: Some(50),
            softmax_scale: Some(0.0625),
            ..k2.clone()
        },
        Scheme {
            name: "full_key".into(),
            key: Codec::Full,
            value: quant(4, Axis::Token, 16),
            residual: 0,
            sinks: 1,
            ..k2
        },
    ]
}

/// Adds a sequence holding `k` and `v` (`row` floats a token) to `cache`:
/// by one `extend` when `prefill`, else one `append` a token, so that the
/// decode suites read caches written both ways.
pub fn add_filled(
    cache: &mut kivi_runtime::PagedCache,
    k: &[f32],
    v: &[f32],
    row: usize,
    prefill: bool,
) -> kivi_runtime::SeqId {
    let id = cache.add_sequence();
    if prefill {
        cache.extend(id, k, v).unwrap();
    } else {
        for t in 0..k.len() / row {
            cache
                .append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                .unwrap();
        }
    }
    id
}

/// The three instruction sets of the CPU backend: the default (AVX-512
/// where the CPU has it), AVX2, scalar.
pub fn isas() -> [kivi_runtime::CpuParams; 3] {
    use kivi_runtime::CpuParams;
    let d = CpuParams::default();
    [d, CpuParams { avx512: false, ..d }, CpuParams { scalar: true, ..d }]
}
