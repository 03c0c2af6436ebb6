//! Low-rank keys and values (`low_rank: pca(...)`): the basis fit, the
//! calibration entries and their errors, the oracle, and `LowRankCache` on
//! the CPU and reference backends against the oracle at odd lengths on
//! MHA, GQA and MQA.

use kivi_runtime::calib::{CalibError, Calibration, Entry, Kind, LayerSamples, ModelId, Stage};
use kivi_runtime::low_rank::{self, symmetric_eigen, Bases, LowRankCache};
use kivi_runtime::rand::Rng;
use kivi_runtime::{reference, AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache, ReferenceBackend};
use kivi_spec::{parse_scheme, Heads, Scheme, Tensor};

/// Rows `[n, h, d]` near a rank-`r0` subspace per head (a fixed mixing per
/// head and a little isotropic noise), with a mean offset like real keys.
fn low_rank_rows(rng: &mut Rng, mix: &[Vec<f32>], n: usize, h: usize, d: usize, r0: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * h * d];
    for t in 0..n {
        for head in 0..h {
            let z: Vec<f32> = (0..r0).map(|_| rng.normal()).collect();
            for c in 0..d {
                let mut x = 0.05 * rng.normal() + 0.5;
                for (j, zj) in z.iter().enumerate() {
                    x += mix[head][c * r0 + j] * zj;
                }
                out[(t * h + head) * d + c] = x;
            }
        }
    }
    out
}

fn mixing(rng: &mut Rng, h: usize, d: usize, r0: usize) -> Vec<Vec<f32>> {
    (0..h).map(|_| (0..d * r0).map(|_| rng.normal()).collect()).collect()
}

fn model(layers: u32, h: usize, d: usize) -> ModelId {
    ModelId {
        name: "toy".into(),
        layers,
        kv_heads: h as u32,
        head_dim: d as u32,
    }
}

/// A calibration with bases for `layers` layers fitted on rank-`r0` data.
fn calibrated(
    rng: &mut Rng,
    layers: usize,
    hq: usize,
    h: usize,
    d: usize,
    r0: usize,
) -> (Calibration, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (mk, mv) = (mixing(rng, h, d, r0), mixing(rng, h, d, r0));
    let mut cal = Calibration::new(model(layers as u32, h, d), "synthetic");
    let samples: Vec<LayerSamples> = (0..layers)
        .map(|l| {
            let n = 400;
            let (k, v) = (
                low_rank_rows(rng, &mk, n, h, d, r0),
                low_rank_rows(rng, &mv, n, h, d, r0),
            );
            LayerSamples::new(l, n, hq, h, d, k, v)
        })
        .collect();
    let reports = cal.fit_bases(&samples).unwrap();
    // Rank-r0 data plus a mean and noise: 16 vectors keep nearly all of it.
    for r in &reports {
        let e16 = r.energy.iter().find(|(k, _)| *k == 16).unwrap().1;
        assert!(e16 > 0.99, "{r:?}");
    }
    (cal, mk, mv)
}

#[test]
fn jacobi_eigenvectors_diagonalise_a_random_symmetric_matrix() {
    let mut rng = Rng::new(5);
    let n = 24;
    let mut a = vec![0f64; n * n];
    for i in 0..n {
        for j in i..n {
            let x = rng.normal() as f64;
            a[i * n + j] = x;
            a[j * n + i] = x;
        }
    }
    let (vals, vecs) = symmetric_eigen(a.clone(), n);
    assert!(vals.windows(2).all(|w| w[0] >= w[1]));
    for k in 0..n {
        let v = &vecs[k * n..][..n];
        for i in 0..n {
            let av: f64 = (0..n).map(|j| a[i * n + j] * v[j]).sum();
            assert!((av - vals[k] * v[i]).abs() < 1e-9, "A v != l v at {k},{i}");
        }
        for m in 0..n {
            let dot: f64 = (0..n).map(|j| v[j] * vecs[m * n + j]).sum();
            assert!((dot - if m == k { 1.0 } else { 0.0 }).abs() < 1e-9);
        }
        // Sign convention: the largest component is positive.
        let big = v.iter().fold(0f64, |m, x| if x.abs() > m.abs() { *x } else { m });
        assert!(big > 0.0);
    }
    // Deterministic: the same input gives the same bits.
    assert_eq!(symmetric_eigen(a.clone(), n), (vals, vecs));
}

fn scheme(text_codecs: &str, rank: usize, heads: Heads, d: usize) -> Scheme {
    parse_scheme(&format!(
        "L {{ {text_codecs}, low_rank: pca(rank = {rank}, apply = [key, value]) }}"
    ))
    .unwrap()
    .with_shape(heads, d as u32)
    .unwrap()
}

const Q4: &str =
    "key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 16), residual: 32";

#[test]
fn bases_round_trip_and_missing_or_mismatched_ones_are_errors() {
    let mut rng = Rng::new(1);
    let (cal, _, _) = calibrated(&mut rng, 2, 2, 2, 32, 4);
    let back = Calibration::from_bytes(&cal.to_bytes()).unwrap();
    assert_eq!(back, cal);
    // Keys after and before RoPE? these samples have no pre-RoPE keys: post only.
    assert!(cal
        .get(0, Tensor::Key, Stage::PreRope, Kind::Basis, low_rank::FIT)
        .is_none());
    let s = scheme(Q4, 16, Heads::Mha(2), 32);
    Bases::for_layer(&s, &cal, 1).unwrap();
    let e = Bases::for_layer(&s, &cal, 2).unwrap_err().to_string();
    assert!(e.contains("layer 2 key"), "{e}");
    // A calibration without the value basis of layer 0 names it.
    let mut partial = Calibration::new(cal.model.clone(), "partial");
    for e in cal
        .entries()
        .iter()
        .filter(|e| !(e.layer == 0 && e.tensor == Tensor::Value))
    {
        partial.insert(e.clone()).unwrap();
    }
    let e = Bases::for_layer(&s, &partial, 0).unwrap_err().to_string();
    assert!(e.contains("layer 0 value") && e.contains("no basis"), "{e}");
    // Another model shape: a mismatch, not a wrong basis.
    let other = scheme(Q4, 16, Heads::Mha(4), 32);
    let e = Bases::for_layer(&other, &cal, 0).unwrap_err().to_string();
    assert!(e.contains("kv heads"), "{e}");
    // Malformed entries are refused on insert (and so on load).
    let mut bad = Calibration::new(model(1, 1, 4), "bad");
    let entry = |shape: Vec<u32>, data: Vec<f32>| Entry {
        layer: 0,
        tensor: Tensor::Key,
        stage: Stage::PostRope,
        kind: Kind::Basis,
        fit: low_rank::FIT.into(),
        shape,
        data,
    };
    assert!(matches!(
        bad.insert(entry(vec![1, 4, 3], vec![0.5; 12])),
        Err(CalibError::Malformed(_))
    ));
    let e = bad.insert(entry(vec![1, 4, 4], vec![0.5; 16]));
    assert!(e.is_ok(), "rows of 0.5 x 4 have unit length");
    let e = bad.insert(entry(vec![1, 4, 4], vec![0.4; 16])).unwrap_err().to_string();
    assert!(e.contains("unit length"), "{e}");
    // Rows of unit length that are not orthogonal: the cache refuses them.
    let s1 = scheme("key: full, value: full", 2, Heads::Mha(1), 4);
    let e = Bases::for_layer(&s1, &bad, 0).unwrap_err().to_string();
    assert!(e.contains("layer 0 value"), "{e}");
    let e = Bases::new(&s1, vec![0.5; 8], vec![0.5; 8]).unwrap_err().to_string();
    assert!(e.contains("not orthonormal"), "{e}");
}

#[test]
fn plain_caches_and_the_plain_oracle_refuse_low_rank_schemes() {
    let s = scheme(Q4, 16, Heads::Mha(2), 32);
    let e = PagedCache::new(s.clone(), CacheConfig::for_tokens(64))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("LowRankCache"), "{e}");
    let e = reference::cache_view(&s, Tensor::Key, &[0.0; 64])
        .unwrap_err()
        .to_string();
    assert!(e.contains("low_rank"), "{e}");
}

/// Full rank with `full` coordinates loses nothing but roundings: the
/// oracle equals the plain one within f32 noise. Rank 8 of rank-4 data
/// with full coordinates: also close (the noise is all it drops).
#[test]
fn full_rank_and_exact_subspaces_reconstruct() {
    let mut rng = Rng::new(2);
    let (h, d) = (2, 32);
    let (cal, mk, mv) = calibrated(&mut rng, 1, 4, h, d, 4);
    let full = "key: full, value: full";
    let plain = parse_scheme(&format!("P {{ {full}, dtype: f32 }}"))
        .unwrap()
        .with_shape(Heads::Gqa { q: 4, kv: 2 }, 32)
        .unwrap();
    let n = 50;
    let (k, v) = (
        low_rank_rows(&mut rng, &mk, n, h, d, 4),
        low_rank_rows(&mut rng, &mv, n, h, d, 4),
    );
    let q: Vec<f32> = (0..4 * d).map(|_| rng.normal()).collect();
    let attn = AttnParams::of(&plain, plain.shape().unwrap());
    let want = reference::attend(&plain, &q, &k, &v, attn).unwrap();
    for (rank, tol) in [(32, 1e-4), (8, 0.05)] {
        let mut s = scheme(full, rank, Heads::Gqa { q: 4, kv: 2 }, d);
        s.dtype = kivi_spec::Dtype::F32;
        let b = Bases::for_layer(&s, &cal, 0).unwrap();
        let got = low_rank::attend(&s, &q, &k, &v, attn, &b).unwrap();
        let err = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(err <= tol * scale, "rank {rank}: {err} of {scale}");
    }
    // Rank 2 of rank-4 data drops real signal: visibly worse.
    let mut s = scheme(full, 2, Heads::Gqa { q: 4, kv: 2 }, d);
    s.dtype = kivi_spec::Dtype::F32;
    let b = Bases::for_layer(&s, &cal, 0).unwrap();
    let kv = low_rank::cache_view(&s, Tensor::Key, &k, &b).unwrap();
    let err = k.iter().zip(&kv).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / k.iter().map(|a| a * a).sum::<f32>();
    assert!(err > 0.05, "rank 2 of rank-4 keys should lose energy: {err}");
}

/// `LowRankCache` on the CPU backend (every ISA) and the reference backend
/// against the oracle, at lengths 1, 31, 33, 127 and 1000 on MHA, GQA and
/// MQA, f32 and f16 activations; appends one by one and in one call store
/// the same coordinates; memory counts the bases once.
#[test]
fn cache_decode_matches_the_oracle() {
    let mut rng = Rng::new(3);
    let d = 64;
    let p0 = CpuParams::default();
    let backends: Vec<(String, Box<dyn Backend>)> = vec![
        ("reference".into(), Box::new(ReferenceBackend)),
        ("cpu".into(), Box::new(CpuBackend::new(p0).unwrap())),
        (
            "cpu-avx2".into(),
            Box::new(CpuBackend::new(CpuParams { avx512: false, ..p0 }).unwrap()),
        ),
        (
            "cpu-scalar".into(),
            Box::new(CpuBackend::new(CpuParams { scalar: true, ..p0 }).unwrap()),
        ),
    ];
    for (hq, h) in [(4, 4), (8, 2), (4, 1)] {
        let heads = Heads::from_counts(hq as u32, h as u32);
        let (cal, mk, mv) = calibrated(&mut rng, 1, hq, h, d, 6);
        for (codecs, rank, dtype) in [
            (Q4, 32, "f32"),
            (Q4, 16, "f16"),
            (
                "key: quant(bits = 2, axis = token, group = 16, levels = lloyd_max), value: full, residual: 16",
                48,
                "f16",
            ),
        ] {
            let s = scheme(&format!("{codecs}, dtype: {dtype}"), rank, heads, d);
            let lens = [1usize, 31, 33, 127, 1000];
            let mut cache = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(2400), &cal, 0).unwrap();
            let mut one = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(2400), &cal, 0).unwrap();
            let b = cache.bases().clone();
            let (mut seqs, mut views) = (Vec::new(), Vec::new());
            for &n in &lens {
                let (k, v) = (
                    low_rank_rows(&mut rng, &mk, n, h, d, 6),
                    low_rank_rows(&mut rng, &mv, n, h, d, 6),
                );
                let id = cache.add_sequence();
                cache.extend(id, &k, &v).unwrap();
                if n <= 127 {
                    let id1 = one.add_sequence();
                    for t in 0..n {
                        let r = h * d;
                        one.extend(id1, &k[t * r..(t + 1) * r], &v[t * r..(t + 1) * r]).unwrap();
                    }
                    for t in [Tensor::Key, Tensor::Value] {
                        assert_eq!(one.dequantize(id1, t).unwrap(), cache.dequantize(id, t).unwrap());
                    }
                }
                let (kw, vw) = (
                    low_rank::cache_view(&s, Tensor::Key, &k, &b).unwrap(),
                    low_rank::cache_view(&s, Tensor::Value, &v, &b).unwrap(),
                );
                // The cache stores what the oracle computes (same projection,
                // same coordinate codec), reconstructed the same way.
                assert_eq!(cache.dequantize(id, Tensor::Key).unwrap(), kw, "keys {n}");
                assert_eq!(cache.dequantize(id, Tensor::Value).unwrap(), vw, "values {n}");
                seqs.push(id);
                views.push((k, v));
            }
            let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| 0.3 * rng.normal()).collect();
            let attn = AttnParams::of(&s, s.shape().unwrap());
            let per = hq * d;
            let want: Vec<f32> = views
                .iter()
                .enumerate()
                .flat_map(|(i, (k, v))| low_rank::attend(&s, &q[i * per..(i + 1) * per], k, v, attn, &b).unwrap())
                .collect();
            // f32: only roundings of k^ / q' differ; f16: the projected query
            // is rounded to f16 by the backend (module docs), ~1e-3 of a score.
            let tol = if dtype == "f32" { 2e-4 } else { 1e-2 };
            for (name, be) in &backends {
                let got = cache.decode(be.as_ref(), &seqs, &q, attn).unwrap();
                for (i, n) in lens.iter().enumerate() {
                    let (w, g) = (&want[i * per..(i + 1) * per], &got[i * per..(i + 1) * per]);
                    let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(0.1);
                    let err = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        err <= tol * scale,
                        "{heads} {codecs} {dtype} R{rank} len {n} {name}: {err:e} vs {scale:e}"
                    );
                }
            }
            // Memory: the coordinate cache plus both bases once, in the dtype.
            let m = cache.memory();
            let inner = cache.coordinates().memory();
            let elem = if dtype == "f32" { 4 } else { 2 };
            assert_eq!(m.bases, 2 * h * rank * d * elem);
            assert_eq!(m.total, inner.total + m.bases);
            assert_eq!(cache.coordinates().shape().head_dim, rank);
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let mut rng = Rng::new(4);
    let (cal, _, _) = calibrated(&mut rng, 1, 2, 1, 32, 4);
    let s = scheme(Q4, 16, Heads::Mqa(2), 32);
    let mut c = LowRankCache::with_calibration(s, CacheConfig::for_tokens(64), &cal, 0).unwrap();
    let id = c.add_sequence();
    assert!(c.extend(id, &[0.0; 31], &[0.0; 31]).is_err());
    let mut k = vec![0.5f32; 32];
    k[3] = f32::NAN;
    let e = c.extend(id, &k, &[0.5; 32]).unwrap_err().to_string();
    assert!(e.contains("channel 3"), "{e}");
    assert_eq!(c.len(id).unwrap(), 0);
    c.extend(id, &[0.5; 32], &[0.5; 32]).unwrap();
    let attn = AttnParams {
        softmax_scale: 0.1,
        window: None,
    };
    assert!(c.decode(&ReferenceBackend, &[id], &[0.0; 63], attn).is_err());
    assert_eq!(c.decode(&ReferenceBackend, &[id], &[0.0; 64], attn).unwrap().len(), 64);
}

/// `residual = N` (LowRAM's exact residual): the N worst-reconstructed
/// tokens of each head read their exact rows — in the oracle, in the
/// cache (streamed and prefilled alike), in decode on every backend and
/// in the memory report; planted off-subspace tokens are the ones kept,
/// and keeping them brings attention back near the unprojected answer.
#[test]
fn exact_residual_keeps_the_worst_reconstructed_tokens() {
    // The grammar: canonical text, the default, the range.
    let s = parse_scheme(
        "R { key: full, value: full, low_rank: pca(rank = 8, apply = [key, value], residual = 3), heads: mha(1), head_dim: 32 }",
    )
    .unwrap();
    assert_eq!(s.low_rank.unwrap().residual, 3);
    assert!(kivi_spec::canonical(&s).contains("pca(rank = 8, apply = [key, value], residual = 3)"));
    assert_eq!(kivi_spec::parse_scheme(&kivi_spec::canonical(&s)).unwrap(), s);
    let s0 = scheme("key: full, value: full", 8, Heads::Mha(1), 32);
    assert_eq!(s0.low_rank.unwrap().residual, 0);
    assert!(!kivi_spec::canonical(&s0).contains("residual ="));
    let e =
        parse_scheme("R { key: full, value: full, low_rank: pca(rank = 8, apply = [key, value], residual = 5000) }")
            .unwrap_err()
            .to_string();
    assert!(e.contains("residual = 5000"), "{e}");

    let mut rng = Rng::new(8);
    let d = 32;
    let n_keep = 3;
    for (hq, h) in [(4, 4), (8, 2), (4, 1)] {
        let heads = Heads::from_counts(hq as u32, h as u32);
        let (cal, mk, mv) = calibrated(&mut rng, 1, hq, h, d, 4);
        let lr = |codecs: &str, n: usize| {
            parse_scheme(&format!(
                "R {{ {codecs}, low_rank: pca(rank = 16, apply = [key, value], residual = {n}) }}"
            ))
            .unwrap()
            .with_shape(heads, d as u32)
            .unwrap()
        };
        let s = lr(Q4, n_keep);
        let mut cache = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(2400), &cal, 0).unwrap();
        let mut one = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(2400), &cal, 0).unwrap();
        let b = cache.bases().clone();
        let row = h * d;
        let (mut seqs, mut data) = (Vec::new(), Vec::new());
        for &n in &[1usize, 31, 33, 127, 1000] {
            let mut k = low_rank_rows(&mut rng, &mk, n, h, d, 4);
            let mut v = low_rank_rows(&mut rng, &mv, n, h, d, 4);
            // Tokens far off the subspace in head 0: the ones to keep.
            let planted: Vec<usize> = [5usize, 17, n.saturating_sub(2)]
                .iter()
                .map(|&p| p.min(n - 1))
                .collect();
            for &p in &planted {
                for c in 0..d {
                    k[p * row + c] += 4.0 * rng.normal();
                    v[p * row + c] += 4.0 * rng.normal();
                }
            }
            let id = cache.add_sequence();
            cache.extend(id, &k, &v).unwrap();
            for (t, x) in [(Tensor::Key, &k), (Tensor::Value, &v)] {
                let view = low_rank::cache_view(&s, t, x, &b).unwrap();
                assert_eq!(
                    cache.dequantize(id, t).unwrap(),
                    view,
                    "{heads} {n} {t:?}: cache vs oracle"
                );
                let xr = reference::round_inputs(&s, t.name(), x, h, d).unwrap();
                for &p in &planted {
                    assert_eq!(
                        &view[p * row..][..d],
                        &xr[p * row..][..d],
                        "{heads} {n}: planted token {p} kept"
                    );
                }
                // At most N exact rows per head: the rest are reconstructions.
                let exact = (0..n).filter(|&p| view[p * row..][..d] == xr[p * row..][..d]).count();
                assert!(exact <= n_keep.min(n), "{heads} {n}: {exact} exact rows in head 0");
            }
            if n <= 127 {
                // Streamed one token per call: the same kept set, bit for bit.
                let id1 = one.add_sequence();
                for t in 0..n {
                    one.extend(id1, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                        .unwrap();
                }
                for t in [Tensor::Key, Tensor::Value] {
                    assert_eq!(one.dequantize(id1, t).unwrap(), cache.dequantize(id, t).unwrap());
                }
            }
            seqs.push(id);
            data.push((k, v));
        }
        let q: Vec<f32> = (0..seqs.len() * hq * d).map(|_| 0.3 * rng.normal()).collect();
        let attn = AttnParams::of(&s, s.shape().unwrap());
        let per = hq * d;
        let want: Vec<f32> = data
            .iter()
            .enumerate()
            .flat_map(|(i, (k, v))| low_rank::attend(&s, &q[i * per..(i + 1) * per], k, v, attn, &b).unwrap())
            .collect();
        // Decode on the fast path (kept tokens merged in exactly): the
        // oracle to f32 roundings; `exact_residual_fast_path_*` below covers
        // more shapes and backends.
        for be in [
            Box::new(ReferenceBackend) as Box<dyn Backend>,
            Box::new(CpuBackend::new(CpuParams::default()).unwrap()),
        ] {
            let got = cache.decode(be.as_ref(), &seqs, &q, attn).unwrap();
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= 1e-2 * scale, "{heads} {}: {err:e} vs {scale:e}", be.name());
        }
        // Memory: N rows (D values f16 + a position) per head and tensor per sequence.
        let rows: usize = [1usize, 31, 33, 127, 1000].iter().map(|&n| n.min(n_keep) * 2 * h).sum();
        let m = cache.memory();
        assert_eq!(m.outliers, rows * (d * 2 + 4));
        assert_eq!(cache.coordinates().memory().outliers, 0);
        assert_eq!(m.total, cache.coordinates().memory().total + m.bases + m.outliers);
        // Keeping the planted tokens brings attention near the unprojected
        // answer (full coordinates: only the projection loses anything).
        let (k, v) = &data[3];
        let full = |n: usize| lr("key: full, value: full", n);
        let plain = parse_scheme("P { key: full, value: full }")
            .unwrap()
            .with_shape(heads, d as u32)
            .unwrap();
        let qq = &q[3 * per..4 * per];
        let exact = reference::attend(&plain, qq, k, v, attn).unwrap();
        let err = |n: usize| {
            let got =
                low_rank::attend(&full(n), qq, k, v, attn, &Bases::for_layer(&full(n), &cal, 0).unwrap()).unwrap();
            exact.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        };
        let (without, with) = (err(0), err(n_keep));
        assert!(
            with < 0.5 * without,
            "{heads}: residual error {with} vs {without} without"
        );
    }
    // The device has no residual path yet: a typed refusal.
    let mut s = scheme(Q4, 16, Heads::Mha(1), 32);
    s.low_rank.as_mut().unwrap().residual = 2;
    let unit: Vec<f32> = (0..16 * 32).map(|i| if i % 32 == i / 32 { 1.0 } else { 0.0 }).collect();
    let b = Bases::new(&s, unit.clone(), unit).unwrap();
    let e = kivi_runtime::device::DeviceLowRankCache::with_bases(
        kivi_runtime::device::SimDevice::shared(),
        &s,
        1,
        64,
        CacheConfig::for_tokens(64),
        b,
    )
    .err()
    .unwrap();
    assert!(
        matches!(&e, kivi_runtime::Error::Config(m) if m.contains("residual = 2")),
        "{e}"
    );
}

/// Relative error, max-abs over one sequence's output.
fn rel_err(want: &[f32], got: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
    want.iter().zip(got).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// `residual = N` on the fast path (`Backend::decode_partial` with the kept
/// tokens left out, the kept tokens scored on the host, the two softmax
/// states merged): `LowRankCache::decode` on the reference backend's host
/// partials and on the CPU backend (default, AVX2, scalar, and fixed splits
/// with small tiles, so cuts fall inside and on the edges of splits)
/// against the oracle at lengths 1, 31, 33, 127 and 1000 on MHA, GQA and
/// MQA, f32 and f16, with N = 1, 5 and 2000 (more than any sequence: every
/// token exact), with a sliding window, and with a query that puts most of
/// its softmax weight on one kept token (where subtracting the token's
/// reconstructed share from a finished output would cancel).
#[test]
fn exact_residual_fast_path_matches_the_oracle() {
    let mut rng = Rng::new(12);
    let d = 32;
    let p0 = CpuParams::default();
    let backends: Vec<(&str, Box<dyn Backend>)> = vec![
        ("reference", Box::new(ReferenceBackend)),
        ("cpu", Box::new(CpuBackend::new(p0).unwrap())),
        (
            "cpu-avx2",
            Box::new(CpuBackend::new(CpuParams { avx512: false, ..p0 }).unwrap()),
        ),
        (
            "cpu-scalar",
            Box::new(CpuBackend::new(CpuParams { scalar: true, ..p0 }).unwrap()),
        ),
        (
            "cpu-s3t16",
            Box::new(
                CpuBackend::new(CpuParams {
                    splits: 3,
                    tile_tokens: 16,
                    ..p0
                })
                .unwrap(),
            ),
        ),
    ];
    let lens = [1usize, 31, 33, 127, 1000];
    for (hq, h) in [(4, 4), (8, 2), (4, 1)] {
        let heads = Heads::from_counts(hq as u32, h as u32);
        let (cal, mk, mv) = calibrated(&mut rng, 1, hq, h, d, 4);
        let row = h * d;
        // Every sequence: rows near the subspace, three planted far off it
        // in KV head 0 (keys at 5 and near the end, values at 17) and one in
        // the last head (keys and values at 3).
        let data: Vec<(Vec<f32>, Vec<f32>)> = lens
            .iter()
            .map(|&n| {
                let mut k = low_rank_rows(&mut rng, &mk, n, h, d, 4);
                let mut v = low_rank_rows(&mut rng, &mv, n, h, d, 4);
                // The key at 5 the farthest, so that even N = 1 keeps it.
                for (x, p, head, a) in [
                    (0, 5, 0, 6.0),
                    (0, n.saturating_sub(2), 0, 3.0),
                    (1, 17, 0, 3.0),
                    (0, 3, h - 1, 3.0),
                    (1, 3, h - 1, 3.0),
                ] {
                    let p = p.min(n - 1);
                    let x = if x == 0 { &mut k } else { &mut v };
                    for c in 0..d {
                        x[p * row + head * d + c] += a * rng.normal();
                    }
                }
                (k, v)
            })
            .collect();
        for (dtype, n_keep, window) in [
            ("f32", 1, None),
            ("f32", 5, None),
            ("f32", 2000, None),
            ("f16", 5, None),
            ("f32", 5, Some(20)),
        ] {
            let s = parse_scheme(&format!(
                "R {{ {Q4}, dtype: {dtype}, low_rank: pca(rank = 16, apply = [key, value], residual = {n_keep}) }}"
            ))
            .unwrap()
            .with_shape(heads, d as u32)
            .unwrap();
            let mut cache = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(2400), &cal, 0).unwrap();
            let b = cache.bases().clone();
            let seqs: Vec<_> = data
                .iter()
                .map(|(k, v)| {
                    let id = cache.add_sequence();
                    cache.extend(id, k, v).unwrap();
                    id
                })
                .collect();
            let mut attn = AttnParams::of(&s, s.shape().unwrap());
            attn.window = window;
            let per = hq * d;
            // Two queries: random, and one that puts most of query head 0's
            // weight on the planted key at position 5 (kept: it is the
            // worst-reconstructed key of head 0 in every sequence longer
            // than 5).
            let mut queries = vec![(0..seqs.len() * per).map(|_| 0.3 * rng.normal()).collect::<Vec<f32>>()];
            let mut dom = queries[0].clone();
            for (i, (k, _)) in data.iter().enumerate() {
                let p = 5.min(lens[i] - 1);
                for c in 0..d {
                    dom[i * per + c] = 2.0 * k[p * row + c];
                }
            }
            queries.push(dom);
            for (qi, q) in queries.iter().enumerate() {
                let want: Vec<Vec<f32>> = data
                    .iter()
                    .enumerate()
                    .map(|(i, (k, v))| low_rank::attend(&s, &q[i * per..(i + 1) * per], k, v, attn, &b).unwrap())
                    .collect();
                if qi == 1 && window.is_none() {
                    // The planted key does hold most of query head 0's weight
                    // (in the oracle's own view of the cache), for n > 5.
                    let (k, _) = &data[4];
                    let kw = low_rank::cache_view(&s, Tensor::Key, k, &b).unwrap();
                    let scores: Vec<f64> = (0..lens[4])
                        .map(|t| {
                            (0..d)
                                .map(|c| q[4 * per + c] as f64 * kw[t * row + c] as f64)
                                .sum::<f64>()
                                * attn.softmax_scale as f64
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    let w5 = (scores[5] - m).exp() / z;
                    assert!(w5 > 0.9, "{heads} N{n_keep}: weight of the kept token {w5}");
                    let kr = reference::round_inputs(&s, "key", &k[5 * row..][..d], 1, d).unwrap();
                    assert_eq!(&kw[5 * row..][..d], &kr[..], "{heads} N{n_keep}: key 5 is kept");
                }
                // f32: roundings of the projected query and of f32 sums; f16:
                // the backend rounds the projected query to f16 (module docs).
                let tol = if dtype == "f32" { 1e-5 } else { 2e-3 };
                for (name, be) in &backends {
                    let got = cache.decode(be.as_ref(), &seqs, q, attn).unwrap();
                    for (i, n) in lens.iter().enumerate() {
                        let e = rel_err(&want[i], &got[i * per..(i + 1) * per]);
                        assert!(
                            e <= tol,
                            "{heads} {dtype} N{n_keep} window {window:?} query {qi} len {n} {name}: {e:e}"
                        );
                    }
                }
            }
        }
    }
}

/// `Backend::decode_partial` on the CPU backend against the default host
/// partials (the reference backend's), with skipped positions at the ends,
/// inside and across splits, repeated and out of range; with nothing
/// skipped, normalising it gives `decode`. Bad skip lists are typed errors.
#[test]
fn cpu_partial_decode_matches_the_host_partials() {
    let mut rng = Rng::new(13);
    let d = 32;
    for (hq, h) in [(4, 4), (8, 2), (4, 1)] {
        let s = parse_scheme(&format!("P {{ {Q4}, dtype: f32 }}"))
            .unwrap()
            .with_shape(Heads::from_counts(hq as u32, h as u32), d as u32)
            .unwrap();
        let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(2400)).unwrap();
        let lens = [1usize, 31, 33, 127, 1000];
        let seqs: Vec<_> = lens
            .iter()
            .map(|&n| {
                let k: Vec<f32> = (0..n * h * d).map(|_| rng.normal()).collect();
                let v: Vec<f32> = (0..n * h * d).map(|_| rng.normal()).collect();
                let id = cache.add_sequence();
                cache.extend(id, &k, &v).unwrap();
                id
            })
            .collect();
        let q: Vec<f32> = (0..seqs.len() * hq * d).map(|_| 0.5 * rng.normal()).collect();
        let attn = AttnParams::of(&s, s.shape().unwrap());
        let skip: Vec<Vec<Vec<usize>>> = lens
            .iter()
            .map(|&n| {
                (0..h)
                    .map(|head| vec![0, n - 1, head + 1, n / 2, n / 2, n / 3 + head, 5000])
                    .collect()
            })
            .collect();
        let host = ReferenceBackend.decode_partial(&cache, &seqs, &q, attn, &skip).unwrap();
        for p in [
            CpuParams::default(),
            CpuParams {
                splits: 3,
                tile_tokens: 16,
                ..CpuParams::default()
            },
            CpuParams {
                scalar: true,
                ..CpuParams::default()
            },
        ] {
            let cpu = CpuBackend::new(p).unwrap();
            let got = cpu.decode_partial(&cache, &seqs, &q, attn, &skip).unwrap();
            for i in 0..seqs.len() * hq {
                let (m, l) = (host.max[i], host.sum[i]);
                if m == f32::NEG_INFINITY {
                    // A one-token sequence with its only token skipped.
                    assert_eq!((got.max[i], got.sum[i]), (m, 0.0), "{} {i}", p.name());
                    assert!(got.acc[i * d..][..d].iter().all(|&x| x == 0.0));
                    continue;
                }
                // Compare normalised by each side's own max.
                let (gm, gl) = (got.max[i], got.sum[i]);
                assert!(
                    (gm - m).abs() <= 1e-5 * m.abs().max(1.0),
                    "{} {i}: max {gm} vs {m}",
                    p.name()
                );
                let w = (gm - m).exp();
                assert!((gl * w - l).abs() <= 1e-5 * l, "{} {i}: sum {gl} vs {l}", p.name());
                let want: Vec<f32> = host.acc[i * d..][..d].iter().map(|a| a / l).collect();
                let have: Vec<f32> = got.acc[i * d..][..d].iter().map(|a| a * w / l).collect();
                assert!(rel_err(&want, &have) <= 1e-5, "{} {i}", p.name());
            }
            // Nothing skipped: the decode, exactly as `decode` computes it.
            let none = vec![vec![Vec::new(); h]; seqs.len()];
            let all = cpu.decode_partial(&cache, &seqs, &q, attn, &none).unwrap();
            let out = cpu.decode(&cache, &seqs, &q, attn).unwrap();
            for i in 0..seqs.len() * hq {
                for c in 0..d {
                    assert_eq!(all.acc[i * d + c] / all.sum[i], out[i * d + c]);
                }
            }
        }
        let e = CpuBackend::default()
            .decode_partial(&cache, &seqs, &q, attn, &skip[..1])
            .unwrap_err();
        assert!(matches!(e, kivi_runtime::Error::Shape { .. }), "{e}");
        let e = ReferenceBackend
            .decode_partial(&cache, &seqs, &q, attn, &vec![vec![Vec::new(); h + 1]; seqs.len()])
            .unwrap_err();
        assert!(matches!(e, kivi_runtime::Error::Shape { .. }), "{e}");
    }
}

/// `Footprint::for_tokens` prices a low-rank scheme as its cache stores it:
/// R-wide coordinate rows (its coordinate scheme's footprint), plus with
/// `residual = N` the kept exact rows under `outliers`, byte for byte what
/// `LowRankCache::memory` counts for them.
#[test]
fn footprint_counts_coordinates_and_kept_rows() {
    use kivi_spec::layout::Footprint;
    let mut rng = Rng::new(21);
    let (hq, h, d) = (8, 2, 32);
    let heads = Heads::from_counts(hq, h as u32);
    let (cal, mk, mv) = calibrated(&mut rng, 1, hq as usize, h, d, 4);
    for n_keep in [0usize, 3, 40] {
        let s = parse_scheme(&format!(
            "R {{ {Q4}, low_rank: pca(rank = 16, apply = [key, value], residual = {n_keep}) }}"
        ))
        .unwrap()
        .with_shape(heads, d as u32)
        .unwrap();
        let coords = s.coordinate_scheme().unwrap();
        let mut plain = s.clone();
        plain.low_rank = None;
        for tokens in [1usize, 2, 31, 200] {
            let f = Footprint::for_tokens(&s, tokens);
            let fc = Footprint::for_tokens(&coords, tokens);
            assert_eq!(
                (f.codes, f.scales, f.windows),
                (fc.codes, fc.scales, fc.windows),
                "{n_keep} {tokens}"
            );
            let kept = 2 * h * tokens.min(n_keep) * (d * s.dtype.bytes() + 4);
            assert_eq!(f.outliers, fc.outliers + kept, "{n_keep} {tokens}");
            // R = 16 of D = 32: the coordinates are half the rows' bytes.
            let fp = Footprint::for_tokens(&plain, tokens);
            assert_eq!(2 * f.windows, fp.windows, "{tokens}");
            let mut cache = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(256), &cal, 0).unwrap();
            let id = cache.add_sequence();
            let k = low_rank_rows(&mut rng, &mk, tokens, h, d, 4);
            let v = low_rank_rows(&mut rng, &mv, tokens, h, d, 4);
            cache.extend(id, &k, &v).unwrap();
            assert_eq!(cache.memory().outliers, f.outliers, "{n_keep} {tokens}: kept rows");
        }
    }
}
