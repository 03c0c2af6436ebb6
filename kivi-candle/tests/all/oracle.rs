//! kivi-candle against the oracle: the fused path must equal streaming
//! through the reference backend (append one token, decode its query), at
//! odd chunk sizes, GQA and MQA, per-layer schemes and windows; and every
//! bad input is a typed error that leaves the cache as it was.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::{random, rows_of};
use kivi_candle::{Error, KiviKvCache, ModelShape};
use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache, ReferenceBackend};
use kivi_spec::{presets, Heads, Scheme};

fn scheme(text: &str) -> Scheme {
    kivi_spec::resolve_scheme(text, &[]).unwrap().scheme
}

fn f32_scheme() -> Scheme {
    scheme("f32 { dtype: f32, key: full, value: full }")
}

/// The oracle for one layer: the same scheme in a plain paged cache, fed one
/// token at a time, each query decoded by the reference backend.
struct Oracle {
    cache: PagedCache,
    seq: u64,
    attn: AttnParams,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl Oracle {
    fn new(s: &Scheme, hq: usize, hkv: usize, d: usize, window: Option<usize>) -> Oracle {
        let b = s
            .with_shape(Heads::from_counts(hq as u32, hkv as u32), d as u32)
            .unwrap();
        let mut attn = AttnParams::of(&b, b.shape().unwrap());
        attn.window = window;
        let mut cache = PagedCache::new(b, CacheConfig::for_tokens(4096)).unwrap();
        let seq = cache.add_sequence();
        Oracle {
            cache,
            seq,
            attn,
            hq,
            hkv,
            d,
        }
    }

    fn step(&mut self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let (qr, kr) = (self.hq * self.d, self.hkv * self.d);
        let mut out = Vec::new();
        for i in 0..k.len() / kr {
            self.cache
                .append(self.seq, &k[i * kr..(i + 1) * kr], &v[i * kr..(i + 1) * kr])
                .unwrap();
            out.extend(
                ReferenceBackend
                    .decode(&self.cache, &[self.seq], &q[i * qr..(i + 1) * qr], self.attn)
                    .unwrap(),
            );
        }
        out
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Two layers with different schemes and windows, chunks of odd sizes:
/// every output within float noise of the oracle, and the stored K/V
/// identical to the oracle's, bit for bit.
fn check_against_oracle(hq: usize, hkv: usize, d: usize, schemes: &[Scheme], windows: &[Option<usize>]) {
    let mut rng = fastrand::Rng::with_seed(7);
    let shape = ModelShape {
        layers: schemes.len(),
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
    };
    let mut cache = KiviKvCache::per_layer(schemes, shape, 200).unwrap();
    let mut oracles: Vec<Oracle> = schemes
        .iter()
        .zip(windows)
        .map(|(s, w)| Oracle::new(s, hq, hkv, d, *w))
        .collect();
    for (l, w) in windows.iter().enumerate() {
        cache.set_window(l, *w).unwrap();
    }
    let mut total = 0;
    for n in [37, 1, 1, 13, 64, 1, 5, 70, 1] {
        for (l, oracle) in oracles.iter_mut().enumerate() {
            let (q, qh) = random(&mut rng, hq, n, d);
            let (k, kh) = random(&mut rng, hkv, n, d);
            let (v, vh) = random(&mut rng, hkv, n, d);
            let out = cache.attend(l, &q, &k, &v).unwrap();
            assert_eq!(out.dims(), [1, hq, n, d]);
            let want = oracle.step(&qh, &kh, &vh);
            let diff = max_diff(&rows_of(&out), &want);
            assert!(diff < 1e-4, "layer {l}, chunk of {n} at {total}: {diff}");
        }
        total += n;
        assert_eq!(cache.current_seq_len(), total);
    }
    for (l, oracle) in oracles.iter().enumerate() {
        // The dense view `append` returns is the cache's own: compare it
        // with the oracle's dequantized cache through a zero-token append.
        let empty = Tensor::zeros((1, hkv, 0, d), DType::F32, &Device::Cpu).unwrap();
        let (k, v) = cache.append(l, &empty, &empty).unwrap();
        // A windowed layer evicts by default; its evicted rows read as zeros.
        let (sinks, evicted) = (
            cache.scheme(l).unwrap().sinks as usize,
            cache.evicted_tokens(l).unwrap(),
        );
        assert_eq!(cache.evicts(l).unwrap(), windows[l].is_some());
        for (got, t) in [(k, kivi_spec::Tensor::Key), (v, kivi_spec::Tensor::Value)] {
            let mut want = oracle.cache.dequantize(oracle.seq, t).unwrap();
            want[sinks * hkv * d..(sinks + evicted) * hkv * d].fill(0.0);
            assert_eq!(rows_of(&got), want, "layer {l} {t:?}");
        }
    }
}

#[test]
fn gqa_per_layer_schemes_and_windows_match_streaming_through_the_oracle() {
    check_against_oracle(
        4,
        2,
        32,
        &[presets::kivi2_r0(), presets::kivi4(), presets::f16()],
        &[None, Some(20), Some(1)],
    );
}

#[test]
fn mqa_with_sinks_and_a_short_residual_matches_the_oracle() {
    let s = scheme(
        "sinky { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), sinks: 3, residual: 16 }",
    );
    check_against_oracle(4, 1, 64, &[s, f32_scheme()], &[Some(50), None]);
}

#[test]
fn chunking_does_not_change_outputs_or_cache() {
    let shape = ModelShape {
        layers: 1,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 32,
    };
    let mut rng = fastrand::Rng::with_seed(3);
    let (q, _) = random(&mut rng, 2, 90, 32);
    let (k, _) = random(&mut rng, 1, 90, 32);
    let (v, _) = random(&mut rng, 1, 90, 32);
    let run = |cuts: &[usize]| {
        let mut c = KiviKvCache::new(&presets::kivi2_r0(), shape, 90).unwrap();
        let mut outs = Vec::new();
        let mut at = 0;
        for &n in cuts {
            let part = |t: &Tensor| t.narrow(2, at, n).unwrap();
            outs.push(c.attend(0, &part(&q), &part(&k), &part(&v)).unwrap());
            at += n;
        }
        let empty = Tensor::zeros((1, 1, 0, 32), DType::F32, &Device::Cpu).unwrap();
        let (kk, vv) = c.append(0, &empty, &empty).unwrap();
        (Tensor::cat(&outs, 2).unwrap(), rows_of(&kk), rows_of(&vv))
    };
    let (o1, k1, v1) = run(&[90]);
    let (o2, k2, v2) = run(&[31, 1, 33, 25]);
    assert_eq!((k1, v1), (k2, v2), "cache differs between one block and four");
    assert!(max_diff(&rows_of(&o1), &rows_of(&o2)) < 1e-5);
}

#[test]
fn append_with_an_unquantized_scheme_is_candle_nn_concatenation() {
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let mut c = KiviKvCache::new(&f32_scheme(), shape, 64).unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let (k1, _) = random(&mut rng, 2, 5, 16);
    let (v1, _) = random(&mut rng, 2, 5, 16);
    let (k2, _) = random(&mut rng, 2, 3, 16);
    let (v2, _) = random(&mut rng, 2, 3, 16);
    c.append(1, &k1, &v1).unwrap();
    let (k, v) = c.append(1, &k2, &v2).unwrap();
    let cat = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], 2).unwrap();
    assert_eq!(k.dims(), [1, 2, 8, 16]);
    assert_eq!(rows_of(&k), rows_of(&cat(&k1, &k2)));
    assert_eq!(rows_of(&v), rows_of(&cat(&v1, &v2)));
    // Layer 0 saw nothing: the model-wide length is the shortest layer's.
    assert_eq!(
        (c.seq_len(0).unwrap(), c.seq_len(1).unwrap(), c.current_seq_len()),
        (0, 8, 0)
    );
    c.reset();
    assert_eq!((c.seq_len(1).unwrap(), c.f16_bytes()), (0, 0));
    let (k, _) = c.append(1, &k2, &v2).unwrap();
    assert_eq!(rows_of(&k), rows_of(&k2), "a reset cache starts over");
}

#[test]
fn half_precision_inputs_are_taken_and_the_output_follows_q() {
    let shape = ModelShape {
        layers: 1,
        q_heads: 2,
        kv_heads: 2,
        head_dim: 32,
    };
    let mut rng = fastrand::Rng::with_seed(5);
    let (q, _) = random(&mut rng, 2, 4, 32);
    let (k, _) = random(&mut rng, 2, 4, 32);
    let (v, _) = random(&mut rng, 2, 4, 32);
    let mut a = KiviKvCache::new(&presets::f16(), shape, 16).unwrap();
    let mut b = KiviKvCache::new(&presets::f16(), shape, 16).unwrap();
    let want = a.attend(0, &q, &k, &v).unwrap();
    let h = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
    // An f16 scheme rounds inputs to f16 anyway: f16 inputs give the same.
    let got = b.attend(0, &q.to_dtype(DType::BF16).unwrap(), &h(&k), &h(&v)).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    let bf = |t: &Tensor| rows_of(&t.to_dtype(DType::BF16).unwrap());
    // The query was rounded to bf16 first, so compare at bf16 precision.
    assert!(max_diff(&bf(&want), &rows_of(&got)) < 0.05);
    assert_eq!(
        rows_of(&a.append(0, &h(&k), &h(&v)).unwrap().0),
        rows_of(&b.append(0, &k, &v).unwrap().0)
    );
}

#[test]
fn memory_is_the_caches_own_and_f16_bytes_count_tokens() {
    let shape = ModelShape {
        layers: 3,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
    };
    let mut c = KiviKvCache::new(&presets::kivi2(), shape, 1024).unwrap();
    let mut rng = fastrand::Rng::with_seed(1);
    for l in 0..3 {
        let (k, kh) = random(&mut rng, 1, 1000, 64);
        let (v, vh) = random(&mut rng, 1, 1000, 64);
        c.extend(l, &k, &v).unwrap();
        // The same tokens in a bare paged cache: the memory must agree.
        // Layers not filled yet hold an empty sequence, whose sink and
        // window buffers are allocated (and counted) already.
        let b = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 1 }, 64).unwrap();
        let mut p = PagedCache::new(b, CacheConfig::for_tokens(1024)).unwrap();
        let s = p.add_sequence();
        let empty = p.memory().total;
        assert!(empty > 0);
        p.extend(s, &kh, &vh).unwrap();
        assert_eq!(c.memory().total, (l + 1) * p.memory().total + (2 - l) * empty);
    }
    assert_eq!(c.f16_bytes(), 3 * 1000 * 64 * 2 * 2);
    assert!(
        c.memory_bytes() < c.f16_bytes() / 2,
        "2-bit codes past a 128-token window"
    );
}

fn err_of<T>(r: kivi_candle::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_the_cache_alone() {
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
    };
    let mut c = KiviKvCache::new(&presets::kivi2(), shape, 40).unwrap();
    let t = |h: usize, n: usize| Tensor::ones((1, h, n, 32), DType::F32, &Device::Cpu).unwrap();
    c.attend(0, &t(4, 30), &t(2, 30), &t(2, 30)).unwrap();
    let before = c.memory();

    let e = err_of(c.attend(0, &t(4, 11), &t(2, 11), &t(2, 11)));
    assert!(
        matches!(
            e,
            Error::CacheFull {
                layer: 0,
                len: 30,
                adding: 11,
                max: 40
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("sized for 40"), "{e}");
    // Heads of the wrong count, for the query and for the keys.
    let e = err_of(c.attend(0, &t(2, 1), &t(2, 1), &t(2, 1)));
    assert!(matches!(e, Error::Shape { what: "query", .. }), "{e}");
    assert!(e.to_string().contains("[1, 4, seq, 32]"), "{e}");
    let e = err_of(c.attend(0, &t(4, 1), &t(4, 1), &t(4, 1)));
    assert!(matches!(e, Error::Shape { what: "keys", .. }), "{e}");
    // Rank 3, batch 2, mismatched k/v, queries for another token count.
    let r3 = Tensor::ones((2, 1, 32), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(err_of(c.extend(0, &r3, &r3)), Error::Shape { .. }));
    let b2 = Tensor::ones((2, 2, 1, 32), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(err_of(c.extend(0, &b2, &b2)), Error::Shape { .. }));
    let e = err_of(c.extend(0, &t(2, 1), &t(2, 2)));
    assert!(
        matches!(
            e,
            Error::Shape {
                what: "keys and values",
                ..
            }
        ),
        "{e}"
    );
    let e = err_of(c.attend(0, &t(4, 2), &t(2, 1), &t(2, 1)));
    assert!(matches!(e, Error::Shape { what: "queries", .. }), "{e}");
    // Integer dtype.
    let u = Tensor::ones((1, 2, 1, 32), DType::U32, &Device::Cpu).unwrap();
    let e = err_of(c.extend(0, &u, &u));
    assert!(matches!(e, Error::DType { got: DType::U32, .. }), "{e}");
    // Non-finite input: refused by the scheme's policy.
    let nan = (t(2, 1) * f64::NAN).unwrap();
    let e = err_of(c.attend(1, &t(4, 1), &nan, &t(2, 1)));
    assert!(matches!(e, Error::Cache { layer: 1, .. }), "{e}");
    // No such layer, no zero window.
    assert!(matches!(err_of(c.seq_len(2)), Error::NoLayer { layer: 2, layers: 2 }));
    assert!(matches!(err_of(c.set_window(0, Some(0))), Error::Config(_)));
    assert!(matches!(err_of(c.set_softmax_scale(f32::NAN)), Error::Config(_)));

    assert_eq!(c.memory(), before, "a failed call changed the cache");
    assert_eq!((c.seq_len(0).unwrap(), c.seq_len(1).unwrap()), (30, 0));
    // The error travels through candle's own error type.
    let ce: candle_core::Error = err_of(c.seq_len(9)).into();
    assert!(ce.to_string().contains("layer 9 does not exist"), "{ce}");
}

#[test]
fn schemes_must_fit_the_model_head_layout() {
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
    };
    let declared = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let e = err_of(KiviKvCache::new(&declared, shape, 16));
    assert!(matches!(e, Error::HeadLayout(_)), "{e}");
    let declared = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 1 }, 128).unwrap();
    assert!(matches!(
        err_of(KiviKvCache::new(&declared, shape, 16)),
        Error::HeadLayout(_)
    ));
    // The same layout declared is fine.
    let declared = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 1 }, 64).unwrap();
    KiviKvCache::new(&declared, shape, 16).unwrap();
    let odd = ModelShape { kv_heads: 3, ..shape };
    assert!(matches!(
        err_of(KiviKvCache::new(&presets::kivi2(), odd, 16)),
        Error::HeadLayout(_)
    ));
    // A head_dim the scheme's groups do not divide.
    let narrow = ModelShape { head_dim: 48, ..shape };
    assert!(matches!(
        err_of(KiviKvCache::new(&presets::kivi2(), narrow, 16)),
        Error::Cache { layer: 0, .. }
    ));
    assert!(matches!(
        err_of(KiviKvCache::per_layer(&[presets::kivi2()], shape, 16)),
        Error::Config(_)
    ));
    assert!(matches!(
        err_of(KiviKvCache::new(&presets::kivi2(), shape, 0)),
        Error::Config(_)
    ));
}

/// Eviction changes no output: a windowed layer that evicts (the default)
/// and one that keeps every token give the same bits at every chunk, and
/// the evicting one holds fewer blocks, exactly accounted.
#[test]
fn eviction_changes_no_output_and_bounds_memory() {
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
    };
    let mut rng = fastrand::Rng::with_seed(21);
    let mut on = KiviKvCache::new(&presets::kivi2(), shape, 1200).unwrap();
    let mut off = KiviKvCache::new(&presets::kivi2(), shape, 1200).unwrap();
    for c in [&mut on, &mut off] {
        c.set_window(0, Some(100)).unwrap();
    }
    off.set_eviction(0, false).unwrap();
    assert_eq!(
        (on.evicts(0).unwrap(), off.evicts(0).unwrap(), on.evicts(1).unwrap()),
        (true, false, false)
    );
    let mut total = 0;
    for n in [1, 31, 33, 127, 300, 1, 1, 505] {
        let (q, _) = random(&mut rng, 4, n, 64);
        let (k, _) = random(&mut rng, 1, n, 64);
        let (v, _) = random(&mut rng, 1, n, 64);
        for l in 0..2 {
            let a = on.attend(l, &q, &k, &v).unwrap();
            let b = off.attend(l, &q, &k, &v).unwrap();
            let bits = |t: &Tensor| rows_of(t).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "layer {l}, chunk of {n} at {total}");
        }
        total += n;
    }
    assert_eq!(on.current_seq_len(), 999);
    let (m_on, m_off) = (on.layer_memory(0).unwrap(), off.layer_memory(0).unwrap());
    assert!(m_on.blocks_in_use * 4 < m_off.blocks_in_use, "{m_on:?} {m_off:?}");
    assert_eq!(on.layer_memory(1).unwrap(), off.layer_memory(1).unwrap());
    assert_eq!(on.memory().total, m_on.total + on.layer_memory(1).unwrap().total);
    // Widening the window past what was evicted is refused, not served.
    on.set_window(0, None).unwrap();
    let (q, _) = random(&mut rng, 4, 1, 64);
    let (k, _) = random(&mut rng, 1, 1, 64);
    assert!(matches!(on.attend(0, &q, &k, &k), Err(Error::Cache { layer: 0, .. })));
}
