//! `KiviKvCache::attend` through kivi's device layer: on the simulated
//! device (the generated CUDA compiled as C++ on the CPU) in CI, on GPU 0
//! when one is usable (else a printed skip). Outputs against the oracle
//! (`reference::block_attention`) and against the CPU backend for prefill
//! chunks and decode steps at odd lengths (1, 31, 33, 127) on MHA, GQA and
//! MQA with kivi2, kivi4 and f16, a sliding window that evicts; the stored
//! cache identical to the CPU path's, bit for bit; bad input refused with
//! the cache unchanged.
//!
//! Tolerance: max |device - oracle| <= 1e-5 * max |oracle| over each
//! query's output row, as kivi-runtime/tests/device_block.rs (the kernels
//! accumulate in f32 in another order).
//!
//! Cost: the layouts are those of device_block.rs's suite, so the simulator
//! finds their kernels in its on-disk cache (`target/kivi-sim`) when that
//! suite ran first, and compiles each once otherwise.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::{random, rows_of};
use kivi_candle::{AttentionBackend, Error, KiviKvCache, ModelShape};
use kivi_runtime::{reference, AttnParams};
use kivi_spec::{presets, Scheme};

const TOL: f32 = 1e-5;
/// Prefill chunks and decode steps: every length of the brief, a flush of
/// the residual window inside a chunk (kivi's residual is 128 tokens).
const CHUNKS: [usize; 7] = [31, 1, 33, 1, 127, 1, 1];

/// Max |want - got| over one row, and max |want| (NaN in `got` is infinite).
fn row_error(want: &[f32], got: &[f32]) -> (f32, f32) {
    assert_eq!(want.len(), got.len());
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

fn assert_rows_close(want: &[f32], got: &[f32], per: usize, what: &str) {
    for (i, (w, g)) in want.chunks(per).zip(got.chunks(per)).enumerate() {
        let (err, scale) = row_error(w, g);
        assert!(
            err <= TOL * scale,
            "{what}, query {i}: error {err:e} vs max |ref| {scale:e}"
        );
    }
}

/// The presets and layouts of the suite (those of device_block.rs).
fn cases() -> Vec<(Scheme, ModelShape)> {
    let layouts = [(3, 3, 64), (8, 2, 64), (4, 1, 256)];
    let mut out = Vec::new();
    for p in [presets::kivi2(), presets::kivi4(), presets::f16()] {
        for (q, kv, d) in layouts {
            let shape = ModelShape {
                layers: 2,
                q_heads: q,
                kv_heads: kv,
                head_dim: d,
            };
            out.push((p.clone(), shape));
        }
    }
    out
}

/// Runs CHUNKS through two layers (layer 1 with an evicting sliding window
/// of 40 tokens) on `backend` and on the CPU: every output row within
/// tolerance of the oracle, the device's also of the CPU's, and both caches
/// identical (dense K/V bit for bit, memory, lengths).
fn check(backend: &AttentionBackend, scheme: &Scheme, shape: ModelShape, seed: u64) {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let new = || {
        let mut c = KiviKvCache::new(scheme, shape, 512).unwrap();
        c.set_window(1, Some(40)).unwrap();
        c
    };
    let mut dev = new().with_backend(backend.clone());
    let mut cpu = new();
    assert_eq!(cpu.backend().name(), "cpu");
    let bound = dev.scheme(0).unwrap().clone();
    let attn = |l: usize| AttnParams {
        window: dev.window(l).unwrap(),
        ..AttnParams::of(&bound, bound.shape().unwrap())
    };
    let attn = [attn(0), attn(1)];
    let mut rng = fastrand::Rng::with_seed(seed);
    // Every key and value so far, per layer, for the oracle.
    let mut hist: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); 2];
    let mut past = 0;
    for n in CHUNKS {
        for (l, (ks, vs)) in hist.iter_mut().enumerate() {
            let (q, qh) = random(&mut rng, hq, n, d);
            let (k, kh) = random(&mut rng, hkv, n, d);
            let (v, vh) = random(&mut rng, hkv, n, d);
            ks.extend(&kh);
            vs.extend(&vh);
            let got = dev.attend(l, &q, &k, &v).unwrap();
            assert_eq!(got.dims(), [1, hq, n, d]);
            let got = rows_of(&got);
            let on_cpu = rows_of(&cpu.attend(l, &q, &k, &v).unwrap());
            let want = reference::block_attention(&bound, past, &qh, ks, vs, attn[l]).unwrap();
            let what = format!(
                "{} {hq}/{hkv}x{d} on {} layer {l}, chunk of {n} after {past}",
                scheme.name,
                backend.name()
            );
            assert_rows_close(&want, &got, hq * d, &what);
            assert_rows_close(&on_cpu, &got, hq * d, &format!("{what} (against the CPU path)"));
        }
        past += n;
        assert_eq!(dev.current_seq_len(), past);
    }
    assert_eq!(dev.memory(), cpu.memory());
    assert!(dev.evicted_tokens(1).unwrap() > 0, "the window should have evicted");
    let empty = Tensor::zeros((1, hkv, 0, d), DType::F32, &Device::Cpu).unwrap();
    for l in 0..2 {
        let (dk, dv) = dev.append(l, &empty, &empty).unwrap();
        let (ck, cv) = cpu.append(l, &empty, &empty).unwrap();
        assert_eq!(rows_of(&dk), rows_of(&ck), "layer {l} keys");
        assert_eq!(rows_of(&dv), rows_of(&cv), "layer {l} values");
    }
}

#[test]
fn simulated_device_matches_the_oracle_and_the_cpu_path() {
    let sim = AttentionBackend::simulated();
    assert_eq!((sim.name(), sim.is_gpu()), ("sim", false));
    for (i, (s, shape)) in cases().iter().enumerate() {
        check(&sim, s, *shape, 40 + i as u64);
    }
}

fn err_of<T>(r: kivi_candle::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

/// Errors on the device path: caught before the device (shape, room) and
/// from the device backend itself (non-finite input); each leaves the cache
/// as it was, and the next call still agrees with the CPU path.
#[test]
fn bad_input_on_the_simulated_device_leaves_the_cache_unchanged() {
    let shape = ModelShape {
        layers: 1,
        q_heads: 8,
        kv_heads: 2,
        head_dim: 64,
    };
    let mut dev = KiviKvCache::new(&presets::kivi2(), shape, 64)
        .unwrap()
        .with_backend(AttentionBackend::simulated());
    let mut cpu = KiviKvCache::new(&presets::kivi2(), shape, 64).unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    let mut step = |dev: &mut KiviKvCache, cpu: &mut KiviKvCache, n: usize| {
        let (q, _) = random(&mut rng, 8, n, 64);
        let (k, _) = random(&mut rng, 2, n, 64);
        let (v, _) = random(&mut rng, 2, n, 64);
        let got = rows_of(&dev.attend(0, &q, &k, &v).unwrap());
        let want = rows_of(&cpu.attend(0, &q, &k, &v).unwrap());
        assert_rows_close(&want, &got, 8 * 64, &format!("chunk of {n}"));
    };
    step(&mut dev, &mut cpu, 33);
    let before = dev.memory();
    let t = |h: usize, n: usize| Tensor::ones((1, h, n, 64), DType::F32, &Device::Cpu).unwrap();

    let nan = (t(2, 3) * f64::NAN).unwrap();
    let e = err_of(dev.attend(0, &t(8, 3), &t(2, 3), &nan));
    assert!(matches!(e, Error::Cache { layer: 0, .. }), "{e}");
    let e = err_of(dev.attend(0, &t(8, 32), &t(2, 32), &t(2, 32)));
    assert!(
        matches!(
            e,
            Error::CacheFull {
                len: 33,
                adding: 32,
                ..
            }
        ),
        "{e}"
    );
    let e = err_of(dev.attend(0, &t(4, 1), &t(2, 1), &t(2, 1)));
    assert!(matches!(e, Error::Shape { what: "query", .. }), "{e}");

    assert_eq!(dev.memory(), before, "a failed call changed the cache");
    assert_eq!(dev.seq_len(0).unwrap(), 33);
    step(&mut dev, &mut cpu, 1);
    step(&mut dev, &mut cpu, 7);
}

/// The backend can change between calls in the middle of a sequence: the
/// cache is the host's either way, so CPU → sim → CPU agrees with the CPU
/// all along, and the stored cache is the same bit for bit.
#[test]
fn switching_backends_mid_sequence_changes_nothing() {
    let shape = ModelShape {
        layers: 1,
        q_heads: 8,
        kv_heads: 2,
        head_dim: 64,
    };
    let mut mixed = KiviKvCache::new(&presets::kivi4(), shape, 256).unwrap();
    let mut cpu = KiviKvCache::new(&presets::kivi4(), shape, 256).unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    for (i, n) in [31, 1, 127, 33, 1].into_iter().enumerate() {
        mixed.set_backend(if i % 2 == 1 {
            AttentionBackend::simulated()
        } else {
            AttentionBackend::Cpu
        });
        let (q, _) = random(&mut rng, 8, n, 64);
        let (k, _) = random(&mut rng, 2, n, 64);
        let (v, _) = random(&mut rng, 2, n, 64);
        let got = rows_of(&mixed.attend(0, &q, &k, &v).unwrap());
        let want = rows_of(&cpu.attend(0, &q, &k, &v).unwrap());
        let on = mixed.backend().name();
        assert_rows_close(&want, &got, 8 * 64, &format!("chunk {i} of {n} on {on}"));
    }
    let empty = Tensor::zeros((1, 2, 0, 64), DType::F32, &Device::Cpu).unwrap();
    let (mk, mv) = mixed.append(0, &empty, &empty).unwrap();
    let (ck, cv) = cpu.append(0, &empty, &empty).unwrap();
    assert_eq!((rows_of(&mk), rows_of(&mv)), (rows_of(&ck), rows_of(&cv)));
}

/// GPU 0 when usable; else the typed error, printed as the reason for the
/// skip (`KIVI_REQUIRE_GPU` set: a missing GPU fails, as in
/// kivi-runtime's device tests).
#[test]
fn cuda_device_matches_the_oracle_or_skips() {
    let gpu = match AttentionBackend::cuda(0) {
        Ok(b) => b,
        Err(e) => {
            assert!(matches!(e, Error::Unavailable { backend: "cuda", .. }), "{e}");
            if std::env::var_os("KIVI_REQUIRE_GPU").is_some() {
                panic!("KIVI_REQUIRE_GPU is set but the GPU is unavailable: {e}");
            }
            println!("SKIP cuda_device_matches_the_oracle_or_skips: {e}");
            return;
        }
    };
    println!("cuda_device_matches_the_oracle_or_skips: on {gpu:?}");
    assert_eq!((gpu.name(), gpu.is_gpu()), ("cuda", true));
    for (i, (s, shape)) in cases().iter().enumerate() {
        check(&gpu, s, *shape, 40 + i as u64);
    }
}

/// A model holding the cache can move to another thread whichever backend
/// it attends on (a serving loop's worker).
#[test]
fn the_cache_and_its_backends_are_send() {
    fn send<T: Send>() {}
    send::<KiviKvCache>();
    send::<AttentionBackend>();
}
