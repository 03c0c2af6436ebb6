//! `query: int8(group = G)` (integer-domain decode): the CPU backend on
//! every instruction set it has (AVX-512 VNNI, AVX2 `vpmaddubsw`, portable)
//! and the reference backend on a paged cache, against the oracle
//! (`reference::attend`, which quantizes the raw inputs itself) at odd
//! lengths and on MHA, GQA and MQA.
//!
//! Tolerance: max |got - ref| <= 1e-5 * max |ref| over each output (the
//! integer sums are exact; only f32 addition order differs).

mod common;

use common::isas;

use kivi_runtime::rand::Rng;
use kivi_runtime::reference::{self, KeyCodes};
use kivi_runtime::*;
use kivi_spec::{parse_scheme, Heads, QueryQuant, Scheme};

const LENGTHS: [usize; 5] = [1, 31, 33, 127, 1000];

fn layouts() -> [Heads; 4] {
    [
        Heads::Mha(4),
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 14, kv: 2 },
        Heads::Mqa(4),
    ]
}

/// Schemes that put codes in reach of short sequences (small or no
/// windows), with sinks, f32 scales, a sliding window and two query groups.
fn schemes() -> Vec<Scheme> {
    [
        "r0 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
              query: int8(group = 32) }",
        "k4 { key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 32),
              residual: 16, sinks: 3, query: int8(group = 32) }",
        "f32s { key: quant(bits = 2, axis = channel, group = 32, scale = f32), value: quant(bits = 2, axis = token, group = 16),
                residual: 40, sliding_window: 300, query: int8(group = 64) }",
    ]
    .iter()
    .map(|t| parse_scheme(t).unwrap())
    .collect()
}

/// Keys with per-channel offsets and ranges (what channel-axis groups are
/// for), one channel forty times the others (an outlier the query blocks
/// must confine), a few spiky tokens.
fn tensor(rng: &mut Rng, tokens: usize, hkv: usize, d: usize, key: bool) -> Vec<f32> {
    let mut x = Vec::with_capacity(tokens * hkv * d);
    for t in 0..tokens {
        for _ in 0..hkv {
            for c in 0..d {
                let base = if key { ((c * 7) % 5) as f32 - 2.0 } else { 0.0 };
                let amp = if key && c == 5 {
                    40.0
                } else if key {
                    0.5 + (c % 3) as f32
                } else {
                    1.0
                };
                let spike = if t % 97 == 5 { 3.0 } else { 1.0 };
                x.push(base + amp * spike * rng.f32());
            }
        }
    }
    x
}

fn max_err(want: &[f32], got: &[f32]) -> (f32, f32) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = want.iter().zip(got).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (err, scale)
}

/// One cache with a sequence per length (some appended token by token);
/// the oracle on each sequence's raw inputs against the reference backend
/// and the CPU backend on every instruction set.
fn check(s: &Scheme, heads: Heads, d: u32, lens: &[usize], seed: u64) {
    let s = s.with_shape(heads, d).unwrap();
    let shape = s.shape().unwrap();
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let total: usize = lens.iter().sum();
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(total + 64 * lens.len())).unwrap();
    let mut rng = Rng::new(seed);
    let (mut seqs, mut want) = (Vec::new(), Vec::new());
    let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| 2.0 * rng.f32() - 1.0).collect();
    let attn = AttnParams::of(&s, shape);
    let per = hq * d;
    for (i, &n) in lens.iter().enumerate() {
        let k = tensor(&mut rng, n, hkv, d, true);
        let v = tensor(&mut rng, n, hkv, d, false);
        let id = common::add_filled(&mut cache, &k, &v, hkv * d, i % 2 == 0 || n > 200);
        // The cache stores the codes the oracle derives from the inputs.
        let (a, b) = (KeyCodes::from_cache(&cache, id).unwrap(), KeyCodes::of(&s, &k).unwrap());
        assert!(
            a == b,
            "{} {heads} len {n}: the cache's key codes differ from the oracle's",
            s.name
        );
        want.extend(reference::attend(&s, &q[i * per..(i + 1) * per], &k, &v, attn).unwrap());
        seqs.push(id);
    }
    let refb = ReferenceBackend.decode(&cache, &seqs, &q, attn).unwrap();
    let (err, scale) = max_err(&want, &refb);
    assert!(
        err <= 1e-6 * scale,
        "{} {heads} d{d}: reference backend {err:e} of {scale:e}",
        s.name
    );
    for p in isas() {
        let cpu = CpuBackend::new(p).unwrap();
        let path = cpu.kernel_path(&cache);
        assert!(path.contains("int8"), "{path}");
        let got = cpu.decode(&cache, &seqs, &q, attn).unwrap();
        for (b, &n) in lens.iter().enumerate() {
            let (err, scale) = max_err(&want[b * per..(b + 1) * per], &got[b * per..(b + 1) * per]);
            assert!(
                err <= 1e-5 * scale,
                "{} {heads} d{d} len {n} {} ({path}): max error {err:e} vs max |ref| {scale:e}",
                s.name,
                p.name()
            );
        }
    }
}

#[test]
fn every_isa_every_layout_odd_lengths() {
    for (si, s) in schemes().iter().enumerate() {
        for (i, heads) in layouts().into_iter().enumerate() {
            check(s, heads, 64, &LENGTHS, 100 + 10 * si as u64 + i as u64);
        }
    }
}

#[test]
fn head_dims_128_and_256() {
    let s = &schemes()[0];
    check(s, Heads::Gqa { q: 8, kv: 2 }, 128, &[33, 1000], 7);
    check(&schemes()[1], Heads::Mqa(4), 256, &[127, 1000], 8);
}

/// The fused tile (AVX-512 or AVX2) takes the integer scores: `vpdpbusd`
/// where the CPU has VNNI, `vpmaddubsw` on AVX2; the portable loops else.
#[test]
fn path_names() {
    let s = schemes()[0].with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let cache = PagedCache::new(s, CacheConfig::for_tokens(64)).unwrap();
    let name = |p: CpuParams| CpuBackend::new(p).unwrap().kernel_path(&cache);
    let [dflt, avx2, scalar] = isas();
    assert_eq!(name(scalar), "scalar+int8");
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        assert_eq!(name(avx2), "avx2-fused+maddubs-int8");
    }
    if std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512dq") {
        assert_eq!(name(dflt), "avx512-fused+vnni-int8");
    }
}

/// The field changes the numbers (it is not ignored), by much less than
/// the 2-bit keys themselves do (against exact f32 attention), and blocks
/// of 32 channels keep the 40x outlier channel from costing the others
/// their precision, as one scale per head does not.
#[test]
fn small_next_to_the_key_codes_and_not_zero() {
    let s = schemes()[0].with_shape(Heads::Gqa { q: 8, kv: 2 }, 128).unwrap();
    let mut f32q = s.clone();
    f32q.query = None;
    let exact = kivi_spec::Scheme {
        key: kivi_spec::Codec::Full,
        value: kivi_spec::Codec::Full,
        ..f32q.clone()
    };
    let mut rng = Rng::new(3);
    let (hq, hkv, d, n) = (8, 2, 128, 1000);
    let k = tensor(&mut rng, n, hkv, d, true);
    let v = tensor(&mut rng, n, hkv, d, false);
    let q: Vec<f32> = (0..hq * d).map(|_| 2.0 * rng.f32() - 1.0).collect();
    let attn = AttnParams::of(&s, s.shape().unwrap());
    let run = |s: &Scheme| reference::attend(s, &q, &k, &v, attn).unwrap();
    let (a, b, x) = (run(&s), run(&f32q), run(&exact));
    let (int8, _) = max_err(&b, &a);
    let (codes, _) = max_err(&x, &b);
    assert!(
        int8 > 0.0 && int8 <= 0.25 * codes,
        "int8 query {int8:e}, 2-bit keys {codes:e}"
    );
    let mut wide = s.clone();
    wide.query = Some(QueryQuant { group: 128 });
    let (per_head, _) = max_err(&b, &run(&wide));
    assert!(
        per_head > int8,
        "one scale per head {per_head:e} <= per 32 channels {int8:e}"
    );
}

/// Many-query attention (chunked prefill, what `kivi eval` runs) by its
/// streaming definition: both backends against the oracle's
/// `block_attention_streaming`, two sequences, blocks that cross a key
/// group, a sliding window.
#[test]
fn attend_block_is_streaming_decode() {
    let s = schemes()[2].with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let (hq, hkv, d) = (8, 2, 64);
    let attn = AttnParams::of(&s, s.shape().unwrap());
    let mut rng = Rng::new(5);
    let lens = [(70usize, 37usize), (0, 33)];
    let mut want = Vec::new();
    let mut inputs = Vec::new();
    for &(past, n) in &lens {
        let k = tensor(&mut rng, past + n, hkv, d, true);
        let v = tensor(&mut rng, past + n, hkv, d, false);
        let q: Vec<f32> = (0..n * hq * d).map(|_| 2.0 * rng.f32() - 1.0).collect();
        want.extend(reference::block_attention_streaming(&s, past, &q, &k, &v, attn).unwrap());
        inputs.push((past, q, k, v));
    }
    let backends: [&dyn Backend; 3] = [
        &ReferenceBackend,
        &CpuBackend::default(),
        &CpuBackend::new(CpuParams {
            scalar: true,
            ..CpuParams::default()
        })
        .unwrap(),
    ];
    for b in backends {
        let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
        let mut blocks = Vec::new();
        for (past, q, k, v) in &inputs {
            let id = cache.add_sequence();
            let row = hkv * d;
            cache.extend(id, &k[..past * row], &v[..past * row]).unwrap();
            blocks.push((id, q, &k[past * row..], &v[past * row..]));
        }
        let nt: Vec<NewTokens> = blocks
            .iter()
            .map(|(seq, q, k, v)| NewTokens { seq: *seq, q, k, v })
            .collect();
        let got = b.attend_block(&mut cache, &nt, attn).unwrap();
        let (err, scale) = max_err(&want, &got);
        assert!(err <= 1e-5 * scale, "{}: {err:e} of {scale:e}", b.name());
        // A bad block leaves every sequence as it was.
        let lens_before: Vec<usize> = blocks.iter().map(|b| cache.len(b.0).unwrap()).collect();
        let bad_q = vec![f32::NAN; hq * d];
        let bad = [
            NewTokens {
                seq: blocks[0].0,
                q: &blocks[0].1[..hq * d],
                k: &blocks[0].2[..hkv * d],
                v: &blocks[0].3[..hkv * d],
            },
            NewTokens {
                seq: blocks[1].0,
                q: &bad_q,
                k: &blocks[1].2[..hkv * d],
                v: &blocks[1].3[..hkv * d],
            },
        ];
        assert!(b.attend_block(&mut cache, &bad, attn).is_err());
        let lens_after: Vec<usize> = blocks.iter().map(|b| cache.len(b.0).unwrap()).collect();
        assert_eq!(lens_before, lens_after, "{}", b.name());
    }
}
