//! Low-rank keys and values (`low_rank: pca(...)`) on the device: the
//! generated kernels of the coordinate scheme (`kivi_templates::kernel_scheme`)
//! behind `DeviceLowRankCache`, which projects rows and queries and
//! reconstructs outputs with the host's `low_rank` code.
//!
//! - decode over an uploaded host `LowRankCache` matches the low-rank
//!   oracle (`low_rank::attend`) at lengths 1, 31, 33, 127, 1000 on MHA,
//!   GQA 8:2 and 6:3, and MQA, for two coordinate codecs (uniform channel /
//!   token keys and values in f32; Lloyd–Max token keys with channel values
//!   and sinks in f16), with and without a sliding window — and the scalar
//!   reference backend over the same coordinates (same query rounding) to
//!   1e-4 in both dtypes;
//! - the device's own prefill and appends (`DeviceLowRankCache::extend`)
//!   write exactly the coordinate words a host `LowRankCache` writes, and
//!   its decode matches the oracle afterwards;
//! - a device cache of a low-rank scheme without its bases, with a missing
//!   layer, another model's calibration or bases of another rank is a typed
//!   error; bad lengths and non-finite inputs are refused with nothing changed;
//! - the templates generate the coordinate scheme's kernels for a low-rank
//!   scheme and refuse the many-query block kernel by name; NVRTC compiles
//!   them for sm_90 (where provisioned);
//! - with `KIVI_FULL_SWEEP=1` (scripts/full-sweep.sh), every decode variant
//!   of one case against the oracle.
//!
//! Runs on the simulated device (CI) and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::{assert_same, devices};
use kivi_runtime::calib::{CalibError, Calibration, LayerSamples, ModelId};
use kivi_runtime::device::{Device, DeviceBackend, DeviceCache, DeviceLowRankCache};
use kivi_runtime::low_rank::{self, Bases, LowRankCache};
use kivi_runtime::{AttnParams, CacheConfig, Error, ReferenceBackend};
use kivi_spec::{Heads, Scheme};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
const D: usize = 64;
/// Rank of the synthetic data's subspace (the schemes keep 32 and 24).
const R0: usize = 12;

/// Two coordinate codecs: uniform 2-bit keys per channel and values per
/// token in f32 (rank 32), and 3-bit Lloyd–Max keys per token with 4-bit
/// values per channel and two sinks in f16 (rank 24).
fn schemes() -> Vec<Scheme> {
    [
        "lrq2 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 16), \
         residual: 32, dtype: f32, low_rank: pca(rank = 32, apply = [key, value]) }",
        "lrlm { key: quant(bits = 3, axis = token, group = 8, levels = lloyd_max), \
         value: quant(bits = 4, axis = channel, group = 16), residual: 16, sinks: 2, \
         low_rank: pca(rank = 24, apply = [key, value]) }",
    ]
    .iter()
    .map(|t| kivi_spec::parse_scheme(t).unwrap())
    .collect()
}

/// Both schemes on MHA 3, GQA 8:2 and 6:3 (two ratios) and MQA 4.
fn cases() -> Vec<Scheme> {
    let layouts = [
        Heads::Mha(3),
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 6, kv: 3 },
        Heads::Mqa(4),
    ];
    schemes()
        .iter()
        .flat_map(|s| layouts.iter().map(move |h| s.with_shape(*h, D as u32).unwrap()))
        .collect()
}

/// A fixed mixing per KV head and tensor (`[D x R0]`), from the shape.
struct Mix {
    key: Vec<Vec<f32>>,
    value: Vec<Vec<f32>>,
}

fn mix(h: usize) -> Mix {
    let mut rng = Rng::new(31 + h as u64);
    let mut one = || (0..h).map(|_| (0..D * R0).map(|_| rng.normal()).collect()).collect();
    Mix {
        key: one(),
        value: one(),
    }
}

/// Rows `[n, h, D]` near a rank-`R0` subspace per head, plus a mean offset
/// (keys have one, as real keys do) and a little isotropic noise.
fn rows(rng: &mut Rng, mix: &[Vec<f32>], n: usize, key: bool) -> Vec<f32> {
    let h = mix.len();
    let mut out = vec![0f32; n * h * D];
    for t in 0..n {
        for (head, m) in mix.iter().enumerate() {
            let z: Vec<f32> = (0..R0).map(|_| rng.normal()).collect();
            for c in 0..D {
                let mut x = 0.1 * rng.normal() + if key { 0.5 } else { 0.0 };
                for (j, zj) in z.iter().enumerate() {
                    x += 0.3 * m[c * R0 + j] * zj;
                }
                out[(t * h + head) * D + c] = x;
            }
        }
    }
    out
}

/// A two-layer calibration for `s`'s shape with bases fitted on samples
/// of the same distribution as the test inputs (each layer its own draw).
fn calibration(s: &Scheme) -> Calibration {
    let shape = s.shape().unwrap();
    let h = shape.kv_heads;
    let m = mix(h);
    let mut rng = Rng::new(7 + h as u64);
    let model = ModelId {
        name: "sim-low-rank".into(),
        layers: 2,
        kv_heads: h as u32,
        head_dim: D as u32,
    };
    let mut cal = Calibration::new(model, "synthetic");
    let samples: Vec<LayerSamples> = (0..2)
        .map(|l| {
            let n = 300;
            let (k, v) = (rows(&mut rng, &m.key, n, true), rows(&mut rng, &m.value, n, false));
            LayerSamples::new(l, n, shape.q_heads, h, D, k, v)
        })
        .collect();
    cal.fit_bases(&samples).unwrap();
    cal
}

/// Prefill, append and decode of every case (the coordinate scheme's
/// kernels, generated from the low-rank scheme).
fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for s in cases() {
        for k in Kernel::ALL {
            out.push(generate(&s, k, &default_variant(&s, k)).unwrap());
        }
    }
    out
}

fn load_all(dev: &Arc<dyn Device>) {
    // One simulator library for the suite, built by the first test here.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let all = kernels();
    dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
}

/// A host low-rank cache of layer 0 holding one sequence per `LENS` entry
/// (prefilled, or streamed one token per call, alternately), with its inputs.
struct Filled {
    cache: LowRankCache,
    ids: Vec<u64>,
    ks: Vec<Vec<f32>>,
    vs: Vec<Vec<f32>>,
}

fn filled(s: &Scheme, cal: &Calibration, seed: u64) -> Filled {
    let h = s.shape().unwrap().kv_heads;
    let m = mix(h);
    let row = h * D;
    let mut rng = Rng::new(seed);
    let mut cache = LowRankCache::with_calibration(s.clone(), CacheConfig::for_tokens(4096), cal, 0).unwrap();
    let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (b, &t) in LENS.iter().enumerate() {
        let (k, v) = (rows(&mut rng, &m.key, t, true), rows(&mut rng, &m.value, t, false));
        let id = cache.add_sequence();
        if b % 2 == 1 {
            for p in 0..t {
                cache.extend(id, &k[p * row..][..row], &v[p * row..][..row]).unwrap();
            }
        } else {
            cache.extend(id, &k, &v).unwrap();
        }
        ks.push(k);
        vs.push(v);
        ids.push(id);
    }
    Filled { cache, ids, ks, vs }
}

/// The low-rank oracle for a batch, one query per sequence.
fn oracle(s: &Scheme, b: &Bases, ks: &[Vec<f32>], vs: &[Vec<f32>], q: &[f32], attn: AttnParams) -> Vec<f32> {
    let per = q.len() / ks.len();
    (0..ks.len())
        .flat_map(|i| low_rank::attend(s, &q[i * per..][..per], &ks[i], &vs[i], attn, b).unwrap())
        .collect()
}

/// Against the oracle: f32 activations differ by roundings only; in f16
/// the projected query is rounded to f16 as any query is (the oracle dots
/// the unprojected one), ~1e-3 of a score (`low_rank` module docs).
fn oracle_tol(s: &Scheme) -> f32 {
    if s.dtype == kivi_spec::Dtype::F32 {
        2e-4
    } else {
        1e-2
    }
}

/// Against the scalar reference backend over the same coordinates (same
/// projected, rounded query): the decode kernels' own tolerance.
const TOL: f32 = 1e-4;

#[test]
fn low_rank_decode_matches_the_oracle() {
    for dev in devices("low_rank_decode", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let (mut worst, mut worst_ref, mut n) = (0f32, 0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let cal = calibration(s);
            let f = filled(s, &cal, 100 + i as u64);
            let q: Vec<f32> = Rng::new(200 + i as u64)
                .vec(LENS.len() * shape.q_heads * D)
                .iter()
                .map(|x| 2.0 * x)
                .collect();
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let want = oracle(s, f.cache.bases(), &f.ks, &f.vs, &q, attn);
                let got = f.cache.decode(&backend, &f.ids, &q, attn).unwrap();
                let e = rel_error(&got, &want);
                let what = format!("{} {:?} window {window:?}", s.name, s.heads.unwrap());
                assert!(e <= oracle_tol(s), "{what}: relative error {e} against the oracle");
                let scalar = f.cache.decode(&ReferenceBackend, &f.ids, &q, attn).unwrap();
                let er = rel_error(&got, &scalar);
                assert!(er <= TOL, "{what}: relative error {er} against the reference backend");
                // The same through a device low-rank cache uploaded from the host one.
                let dc = DeviceLowRankCache::upload(dev.clone(), &f.cache, &f.ids).unwrap();
                assert_eq!(dc.identity(), f.cache.identity());
                assert_eq!(dc.decode(&q, attn, None).unwrap(), got);
                worst = worst.max(e);
                worst_ref = worst_ref.max(er);
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: low-rank decode of {n} scheme/layout/window cases agrees with the oracle \
             (worst relative error {worst:.2e}; {worst_ref:.2e} against the reference backend)",
            dev.kind().name()
        ));
    }
}

#[test]
fn device_writes_match_the_host_low_rank_cache() {
    for dev in devices("low_rank_extend", kernels) {
        load_all(&dev);
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let h = shape.kv_heads;
            let row = h * D;
            let m = mix(h);
            let cal = calibration(s);
            let cfg = CacheConfig::for_tokens(8192);
            let mut host = LowRankCache::with_calibration(s.clone(), cfg, &cal, 0).unwrap();
            let mut dc = DeviceLowRankCache::with_calibration(dev.clone(), s, LENS.len(), 1100, cfg, &cal, 0).unwrap();
            assert_eq!(dc.identity(), host.identity());
            assert_eq!(dc.calibration_hash(), Some(cal.hash()));
            let ids: Vec<u64> = LENS.iter().map(|_| host.add_sequence()).collect();
            let mut rng = Rng::new(500 + i as u64);
            let mut ks: Vec<Vec<f32>> = LENS.iter().map(|&t| rows(&mut rng, &m.key, t, true)).collect();
            let mut vs: Vec<Vec<f32>> = LENS.iter().map(|&t| rows(&mut rng, &m.value, t, false)).collect();
            for (b, &id) in ids.iter().enumerate() {
                host.extend(id, &ks[b], &vs[b]).unwrap();
            }
            dc.extend(&LENS, &ks.concat(), &vs.concat()).unwrap();
            let coords = s.coordinate_scheme().unwrap();
            assert_same(&coords, host.coordinates(), &ids, dc.coordinates(), "after prefill");
            // 33 appends: every sequence crosses a flush on the way
            for step in 0..33 {
                let k = rows(&mut rng, &m.key, ids.len(), true);
                let v = rows(&mut rng, &m.value, ids.len(), false);
                for (b, &id) in ids.iter().enumerate() {
                    host.extend(id, &k[b * row..][..row], &v[b * row..][..row]).unwrap();
                    ks[b].extend(&k[b * row..][..row]);
                    vs[b].extend(&v[b * row..][..row]);
                }
                dc.extend(&vec![1; ids.len()], &k, &v).unwrap();
                if step % 16 == 0 || step == 32 {
                    assert_same(
                        &coords,
                        host.coordinates(),
                        &ids,
                        dc.coordinates(),
                        &format!("after append step {step}"),
                    );
                }
            }
            let attn = AttnParams::of(s, shape);
            let q = rng.vec(ids.len() * shape.q_heads * D);
            let got = dc.decode(&q, attn, None).unwrap();
            let want = oracle(s, dc.bases(), &ks, &vs, &q, attn);
            let e = rel_error(&got, &want);
            assert!(
                e <= oracle_tol(s),
                "{} {:?}: decode after device writes, relative error {e}",
                s.name,
                s.heads.unwrap()
            );
            n += 1;
        }
        sim_util::report(&format!(
            "{}: low-rank prefill + 33 appends bit-identical to LowRankCache for {n} scheme/layout pairs",
            dev.kind().name()
        ));
    }
}

#[test]
fn missing_or_mismatched_bases_are_typed_errors() {
    if kivi_runtime::sim::find_compiler().is_err() {
        eprintln!("skipped: no C++ compiler for the simulator");
        return;
    }
    let dev = kivi_runtime::device::SimDevice::shared();
    let s = &cases()[1]; // lrq2, GQA 8:2
    let cfg = CacheConfig::for_tokens(256);
    // A plain device cache would store rows and run R-wide kernels on them.
    let e = DeviceCache::new(dev.clone(), s, 1, 256, cfg).err().unwrap();
    assert!(
        matches!(&e, Error::Config(m) if m.contains("DeviceLowRankCache")),
        "{e}"
    );
    let cal = calibration(s);
    // No basis for layer 5: named.
    let e = DeviceLowRankCache::with_calibration(dev.clone(), s, 1, 256, cfg, &cal, 5)
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Calibration(c) if matches!(**c, CalibError::Missing { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("layer 5"), "{e}");
    // Fitted for another model shape (3 KV heads, not 2).
    let other = calibration(&cases()[2]);
    let e = DeviceLowRankCache::with_calibration(dev.clone(), s, 1, 256, cfg, &other, 0)
        .err()
        .unwrap();
    assert!(matches!(&e, Error::Calibration(_)), "{e}");
    // Bases of another rank (the other scheme's 24) for this rank-32 scheme.
    let s24 = &cases()[5]; // lrlm, GQA 8:2
    let b24 = Bases::for_layer(s24, &cal, 0).unwrap();
    let e = DeviceLowRankCache::with_bases(dev.clone(), s, 1, 256, cfg, b24)
        .err()
        .unwrap();
    assert!(matches!(&e, Error::Config(m) if m.contains("rank 24")), "{e}");
    // Bad inputs: typed errors, nothing changed.
    let mut dc = DeviceLowRankCache::with_calibration(dev.clone(), s, 2, 256, cfg, &cal, 1).unwrap();
    let row = 2 * D;
    let x = Rng::new(9).vec(3 * row);
    assert!(matches!(
        dc.extend(&[2, 1], &x[..2 * row], &x[..2 * row]),
        Err(Error::Shape { .. })
    ));
    let mut bad = x.clone();
    bad[row + 5] = f32::NAN;
    let e = dc.extend(&[2, 1], &bad, &x).unwrap_err();
    assert!(
        e.to_string().contains("not finite") || e.to_string().contains("channel 5"),
        "{e}"
    );
    assert_eq!(dc.lens(), &[0, 0]);
    dc.extend(&[2, 1], &x, &x).unwrap();
    assert_eq!(dc.lens(), &[2, 1]);
    let attn = AttnParams::of(s, s.shape().unwrap());
    assert!(matches!(
        dc.decode(&vec![0.1; 2 * 8 * D - 1], attn, None),
        Err(Error::Shape { .. })
    ));
    assert_eq!(dc.decode(&vec![0.1; 2 * 8 * D], attn, None).unwrap().len(), 2 * 8 * D);
}

/// The templates serve a low-rank scheme with its coordinate scheme's
/// kernels (the same source, head_dim R) and refuse the block kernel.
#[test]
fn templates_generate_the_coordinate_kernels() {
    for s in cases() {
        let c = s.coordinate_scheme().unwrap();
        for k in Kernel::ALL {
            let v = default_variant(&s, k);
            assert_eq!(v, default_variant(&c, k));
            let g = generate(&s, k, &v).unwrap();
            assert_eq!(g.source, generate(&c, k, &v).unwrap().source);
            assert_eq!(g.launch.head_dim as usize, c.head_dim.unwrap() as usize);
            assert!(g.name.starts_with(&kivi_templates::scheme_tag(&s)));
        }
        assert_eq!(
            kivi_templates::variants(&s, Kernel::Decode),
            kivi_templates::variants(&c, Kernel::Decode)
        );
        let e = kivi_templates::generate_block(&s, Default::default()).unwrap_err();
        assert!(
            matches!(
                e,
                kivi_templates::GenError::Unsupported {
                    field: kivi_spec::Field::LowRank,
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// Every decode variant of one case's coordinate kernels (lrq2 on GQA
/// 8:2) against the oracle, with `KIVI_FULL_SWEEP=1`
/// (scripts/full-sweep.sh); CI runs the default variants above.
#[test]
fn every_decode_variant_matches_the_oracle() {
    if std::env::var_os("KIVI_FULL_SWEEP").is_none() {
        println!("SKIP every_decode_variant_matches_the_oracle: KIVI_FULL_SWEEP=1 runs it");
        return;
    }
    let s = &cases()[1];
    let variants = kivi_templates::variants(s, Kernel::Decode);
    let gens: Vec<Generated> = variants
        .iter()
        .map(|v| generate(s, Kernel::Decode, v).unwrap())
        .collect();
    for dev in devices("low_rank_variants", || gens.clone()) {
        dev.load_many(&gens.iter().collect::<Vec<_>>()).unwrap();
        let shape = s.shape().unwrap();
        let cal = calibration(s);
        let f = filled(s, &cal, 900);
        let dc = DeviceLowRankCache::upload(dev.clone(), &f.cache, &f.ids).unwrap();
        let q = Rng::new(901).vec(LENS.len() * shape.q_heads * D);
        let attn = AttnParams::of(s, shape);
        let want = oracle(s, f.cache.bases(), &f.ks, &f.vs, &q, attn);
        for v in &variants {
            let e = rel_error(&dc.decode(&q, attn, Some(*v)).unwrap(), &want);
            assert!(e <= oracle_tol(s), "{}: relative error {e}", v.name());
        }
        sim_util::report(&format!(
            "{}: {} low-rank decode variants agree with the oracle",
            dev.kind().name(),
            variants.len()
        ));
    }
}

/// The coordinate kernels of both schemes (R = 32 and the odd width 24)
/// compile with NVRTC for sm_90 where NVRTC is provisioned; skipped with a
/// line otherwise.
#[test]
fn nvrtc_compiles_the_low_rank_kernels() {
    use kivi_runtime::cuda::{Arch, NvrtcOptions};
    let Some(compiler) = device_util::nvrtc_or_skip("nvrtc_compiles_the_low_rank_kernels") else {
        return;
    };
    let opts = NvrtcOptions::for_arch(Arch::parse("sm_90").unwrap());
    for s in [&cases()[1], &cases()[5]] {
        for k in Kernel::ALL {
            let g = generate(s, k, &default_variant(s, k)).unwrap();
            let c = compiler
                .compile(&g.name, &g.source, &opts)
                .unwrap_or_else(|e| panic!("{}: {e}", g.name));
            assert!(!c.artifact.ptx.is_empty(), "{}: no PTX", g.name);
        }
    }
}
