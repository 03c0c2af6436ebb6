//! The codec pipeline on the device: the generated kernels of every codec
//! (Hadamard rotations with and without a seeded sign flip, Lloyd–Max
//! levels with rms and l2 norms, sparse outliers, per-channel centering, on
//! the token and the channel axis, for keys and values; the `codec2` and
//! `codec15` presets) against the oracle and `PagedCache`:
//!
//! - decode over an uploaded host cache matches `reference::attend` at odd
//!   lengths 1, 31, 33, 127, 1000, with and without a sliding window, on
//!   GQA, MQA and MHA layouts;
//! - the device's own prefill and appends write exactly the words
//!   `PagedCache` writes (codes, norms, outlier channels and corrections,
//!   sink and window rows, centering means), then decode matches the oracle.
//!
//! Runs on the simulated device everywhere (CI) and on GPU 0 where one is
//! usable; without a GPU the GPU half prints `SKIP ...: <reason>`.

mod codec_util;
mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use codec_util::codec_schemes;
use device_util::{assert_same, devices, write_both};
use kivi_runtime::device::{Device, DeviceBackend, DeviceCache};
use kivi_runtime::{reference, AttnParams, Backend, CacheConfig, PagedCache};
use kivi_spec::{presets, Heads, Scheme, Tensor};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
const TOL: f32 = 1e-4;

/// Every (scheme, layout) pair of the suite: each codec scheme on a GQA,
/// an MQA and an MHA layout (head_dim 64 or 128), the pipeline presets
/// (bound to head_dim 256) on all three.
fn cases() -> Vec<Scheme> {
    let small = [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 128),
        (Heads::Mha(3), 64),
    ];
    let mut out = Vec::new();
    for (i, s) in codec_schemes().into_iter().enumerate() {
        // two layouts per scheme, rotating, so every layout meets every step
        for (h, d) in [small[i % 3], small[(i + 1) % 3]] {
            out.push(s.with_shape(h, d).unwrap());
        }
    }
    for p in presets::pipeline() {
        for h in [Heads::Gqa { q: 4, kv: 2 }, Heads::Mqa(2), Heads::Mha(2)] {
            out.push(p.with_shape(h, 256).unwrap());
        }
    }
    out
}

fn kernels() -> Vec<Generated> {
    cases()
        .iter()
        .flat_map(|s| Kernel::ALL.map(|k| generate(s, k, &default_variant(s, k)).unwrap()))
        .collect()
}

/// Keys with a per-channel offset and a few loud channels, values with an
/// offset: what centering and outliers are for.
fn inputs(rng: &mut Rng, tokens: usize, row: usize, key: bool) -> Vec<f32> {
    device_util::offset_rows(rng, tokens, row, key)
}

fn load_all(dev: &Arc<dyn Device>) {
    // One library for the whole suite on the simulator (compiled in
    // parallel), built by the first test to get here: two tests building
    // the same library at once would share its temporary object names.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let all = kernels();
    dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
}

#[test]
fn codec_decode_matches_reference() {
    for dev in devices("codec_decode", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let mut worst = 0f32;
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let mut rng = Rng::new(100 + i as u64);
            let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(4096)).unwrap();
            let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
            for (b, &t) in LENS.iter().enumerate() {
                let (k, v) = (inputs(&mut rng, t, row, true), inputs(&mut rng, t, row, false));
                let id = cache.add_sequence();
                if b % 2 == 1 {
                    for p in 0..t {
                        cache.append(id, &k[p * row..][..row], &v[p * row..][..row]).unwrap();
                    }
                } else {
                    cache.extend(id, &k, &v).unwrap();
                }
                ks.push(k);
                vs.push(v);
                ids.push(id);
            }
            let q = rng.vec(LENS.len() * shape.q_heads * shape.head_dim);
            let per = shape.q_heads * shape.head_dim;
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let mut want = Vec::new();
                for b in 0..LENS.len() {
                    want.extend(reference::attend(s, &q[b * per..][..per], &ks[b], &vs[b], attn).unwrap());
                }
                let got = backend.decode(&cache, &ids, &q, attn).unwrap();
                let e = rel_error(&got, &want);
                assert!(
                    e <= TOL,
                    "{} {:?} d{} window {window:?}: relative error {e}",
                    s.name,
                    s.heads.unwrap(),
                    shape.head_dim
                );
                worst = worst.max(e);
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: decode of {n} codec scheme/layout/window cases agrees with the reference (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}

#[test]
fn codec_writes_match_paged_cache_bit_for_bit() {
    for dev in devices("codec_extend", kernels) {
        load_all(&dev);
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let cfg = CacheConfig::for_tokens(8192);
            let mut host = PagedCache::new(s.clone(), cfg).unwrap();
            let mut dc = DeviceCache::new(dev.clone(), s, LENS.len(), 1100, cfg).unwrap();
            let mut rng = Rng::new(500 + i as u64);
            // appends: every sequence crosses a flush (and the 1-token one
            // reaches its centering tokens) on the way
            let (ids, ks, vs) = write_both(s, &mut host, &mut dc, &LENS, &mut rng, 40, 13, |r, t, key| {
                inputs(r, t, row, key)
            });
            let attn = AttnParams::of(s, shape);
            let q = rng.vec(ids.len() * shape.q_heads * shape.head_dim);
            let got = dc.decode(&q, attn, None).unwrap();
            let per = shape.q_heads * shape.head_dim;
            let mut want = Vec::new();
            for b in 0..ids.len() {
                want.extend(reference::attend(s, &q[b * per..][..per], &ks[b], &vs[b], attn).unwrap());
            }
            let e = rel_error(&got, &want);
            assert!(e <= TOL, "{}: decode after device writes, relative error {e}", s.name);
            n += 1;
        }
        sim_util::report(&format!(
            "{}: prefill + 40 appends bit-identical to PagedCache for {n} codec scheme/layout pairs",
            dev.kind().name()
        ));
    }
}

/// Every decode variant of `codec2` and `codec15` at MQA 4:1 d256 against
/// the oracle. A sweep of ~50 sources: `scripts/full-sweep.sh` runs it
/// (`KIVI_FULL_SWEEP=1`); elsewhere it prints a skip.
#[test]
fn every_decode_variant_of_the_pipeline_presets() {
    if std::env::var_os("KIVI_FULL_SWEEP").is_none() {
        println!("SKIP every_decode_variant_of_the_pipeline_presets: set KIVI_FULL_SWEEP=1 (scripts/full-sweep.sh)");
        return;
    }
    for dev in devices("codec_variants", Vec::new) {
        let mut n = 0;
        for (i, p) in presets::pipeline().iter().enumerate() {
            let s = p.with_shape(Heads::Mqa(4), 256).unwrap();
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let mut rng = Rng::new(900 + i as u64);
            let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(4096)).unwrap();
            let lens = [1usize, 127, 301];
            let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
            for &t in &lens {
                let (k, v) = (inputs(&mut rng, t, row, true), inputs(&mut rng, t, row, false));
                let id = cache.add_sequence();
                cache.extend(id, &k, &v).unwrap();
                ks.push(k);
                vs.push(v);
                ids.push(id);
            }
            let q = rng.vec(lens.len() * shape.q_heads * shape.head_dim);
            let per = shape.q_heads * shape.head_dim;
            let attn = AttnParams::of(&s, shape);
            let mut want = Vec::new();
            for b in 0..lens.len() {
                want.extend(reference::attend(&s, &q[b * per..][..per], &ks[b], &vs[b], attn).unwrap());
            }
            let vars = kivi_templates::variants(&s, Kernel::Decode);
            let gens: Vec<Generated> = vars.iter().map(|v| generate(&s, Kernel::Decode, v).unwrap()).collect();
            dev.load_many(&gens.iter().collect::<Vec<_>>()).unwrap();
            for v in vars {
                let got = DeviceBackend::new(dev.clone())
                    .with_variant(Some(v))
                    .decode(&cache, &ids, &q, attn)
                    .unwrap();
                let e = rel_error(&got, &want);
                assert!(e <= TOL, "{} {}: relative error {e}", s.name, v.name());
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: {n} decode variants of codec2 and codec15 (MQA 4:1 d256) agree with the reference",
            dev.kind().name()
        ));
    }
}

/// An outlier correction the activation dtype cannot hold (a rotated f16
/// row whose largest entry is ~3.4e5; f32 scales, so no scale overflows and
/// the host's range rule lets the values through) is refused by the device
/// append (status 3) as by `PagedCache::extend`, and undone: every buffer
/// as before, and later appends still match the host cache.
#[test]
fn an_outlier_correction_the_dtype_cannot_hold_is_refused_and_undone() {
    let s = kivi_spec::parse_scheme(
        "Loud { key: quant(bits = 2, axis = token, group = 32, scale = f32), \
         value: quant(bits = 2, axis = token, group = 32), \
         rotation: hadamard(block = 32, apply = [key]), outliers: sparse(per_token = 1, apply = [key]), \
         residual: 0 }",
    )
    .unwrap()
    .with_shape(Heads::Mha(2), 32)
    .unwrap();
    let row = 2 * 32;
    let gens = || {
        Kernel::ALL
            .iter()
            .map(|&k| generate(&s, k, &default_variant(&s, k)).unwrap())
            .collect::<Vec<_>>()
    };
    for dev in devices("codec_undo", gens) {
        let cfg = CacheConfig::for_tokens(1024);
        let mut host = PagedCache::new(s.clone(), cfg).unwrap();
        let id = host.add_sequence();
        let mut dc = DeviceCache::new(dev.clone(), &s, 1, 200, cfg).unwrap();
        let mut rng = Rng::new(77);
        let (k, v) = (inputs(&mut rng, 20, row, true), inputs(&mut rng, 20, row, false));
        host.extend(id, &k, &v).unwrap();
        dc.extend(&[20], &k, &v).unwrap();
        assert_same(&s, &host, &[id], &dc, "before the loud token");
        let snapshot = |dc: &DeviceCache| {
            let mut all = vec![dc
                .download_pool()
                .unwrap()
                .iter()
                .map(|w| *w as f32)
                .collect::<Vec<_>>()];
            for t in [Tensor::Key, Tensor::Value] {
                all.push(dc.download_rows(t, true).unwrap());
                all.push(dc.download_rows(t, false).unwrap());
                all.push(dc.download_means(t).unwrap());
            }
            all
        };
        let before = snapshot(&dc);
        // head 1 of the key: every channel 60000, rotated into one entry of
        // ~3.4e5 (quantized at once: no window)
        let mut loud = inputs(&mut rng, 1, row, true);
        for x in &mut loud[32..] {
            *x = 60000.0;
        }
        let quiet = inputs(&mut rng, 1, row, false);
        let he = host.append(id, &loud, &quiet).unwrap_err();
        assert!(
            he.to_string().contains("outlier") || he.to_string().contains("correction"),
            "{he}"
        );
        let de = dc.extend(&[1], &loud, &quiet).unwrap_err();
        assert!(de.to_string().contains("outlier correction"), "{de}");
        assert_eq!(dc.lens(), &[20]);
        assert!(snapshot(&dc) == before, "a refused append changed the device cache");
        for _ in 0..5 {
            let (k, v) = (inputs(&mut rng, 1, row, true), inputs(&mut rng, 1, row, false));
            host.append(id, &k, &v).unwrap();
            dc.extend(&[1], &k, &v).unwrap();
        }
        assert_same(&s, &host, &[id], &dc, "after the refused append and 5 more");
    }
}
