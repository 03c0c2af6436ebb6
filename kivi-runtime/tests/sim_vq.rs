//! Product vector quantization (`vq(...)`) in the generated kernels: the
//! lookup-table decode (`templates/cuda/kivi_vq_decode.cuh`) and the exact
//! nearest-centroid prefill/append (`kivi_vq_extend.cuh`), with the
//! codebooks as a device buffer.
//!
//! - decode over an uploaded host cache matches the oracle
//!   (`cache_view_calibrated` + `decode_attention`) at lengths 1, 31, 33,
//!   127, 1000 on GQA 8:2 and 4:2, MQA and MHA, for vq keys only, vq values
//!   only, both, and one codebook shared by name between them; f16, bf16
//!   and f32 activations (so f16, bf16 and f32 queries); with and without a
//!   sliding window;
//! - every tuner variant of a vq scheme matches the oracle;
//! - a device cache built with the calibration writes, with its own
//!   prefill and append kernels, exactly the words a host cache built with
//!   it writes, and decodes as the oracle does; a named codebook is one
//!   device buffer for every layer and both tensors;
//! - ties (twin centroids) are coded to the lower index on the device;
//! - deleting any barrier of the vq templates that orders something is
//!   caught under a strict simulator schedule;
//! - missing, mismatched or corrupt calibrations are typed errors;
//! - the vq decode, prefill and append sources compile with NVRTC
//!   (skipped, with the reason printed, where NVRTC is absent).
//!
//! Runs on the simulated device (CI) and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::{assert_same, devices};
use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
use kivi_runtime::device::{Device, DeviceCache};
use kivi_runtime::reference::{cache_view_calibrated, decode_attention};
use kivi_runtime::vq::VqFitOptions;
use kivi_runtime::{AttnParams, CacheConfig, PagedCache};
use kivi_spec::{Heads, Scheme, Tensor};
use kivi_templates::{default_variant, generate, variants, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
const TOL: f32 = 1e-4;

/// vq keys and values (per layer, sinks), vq values only with a named
/// codebook behind KIVI-2 keys, vq keys only (chunked flush, f32
/// activations), one codebook shared by name by both tensors (bf16), and
/// vq values behind Lloyd–Max keys (a level table in the same source).
fn schemes() -> Vec<Scheme> {
    [
        "vqkv { key: vq(dim = 4, entries = 16), value: vq(dim = 4, entries = 64), residual: 4, sinks: 2 }",
        "vqv { key: quant(bits = 2, axis = channel, group = 32), \
         value: vq(dim = 8, entries = 256, codebook = shared), residual: 32 }",
        "vqk { key: vq(dim = 2, entries = 4), value: full, residual: 16, flush: chunked, dtype: f32 }",
        "vqs { key: vq(dim = 4, entries = 32, codebook = c), value: vq(dim = 4, entries = 32, codebook = c), \
         residual: 8, dtype: bf16 }",
        "vql { key: quant(bits = 3, axis = token, group = 32, levels = lloyd_max), \
         value: vq(dim = 8, entries = 64), residual: 8 }",
    ]
    .iter()
    .map(|t| kivi_spec::parse_scheme(t).unwrap())
    .collect()
}

/// GQA with two ratios, MQA and MHA, head_dim 32.
fn layouts() -> [Heads; 4] {
    [
        Heads::Gqa { q: 8, kv: 2 },
        Heads::Gqa { q: 4, kv: 2 },
        Heads::Mqa(4),
        Heads::Mha(2),
    ]
}

const D: u32 = 32;

fn cases() -> Vec<Scheme> {
    schemes()
        .iter()
        .flat_map(|s| layouts().into_iter().map(move |h| s.with_shape(h, D).unwrap()))
        .collect()
}

/// Keys with per-channel offsets, standard normal values.
fn kv(rng: &mut Rng, tokens: usize, h: usize, key: bool) -> Vec<f32> {
    let d = D as usize;
    (0..tokens * h * d)
        .map(|i| {
            let c = i % d;
            if key {
                ((c * 7) % 5) as f32 - 2.0 + (0.5 + (c % 3) as f32) * rng.f32()
            } else {
                rng.normal()
            }
        })
        .collect()
}

/// A two-layer calibration for `s`'s shape, fitted on other draws.
fn calibration(s: &Scheme) -> Calibration {
    let shape = s.shape().unwrap();
    let (hq, h) = (shape.q_heads, shape.kv_heads);
    let mut rng = Rng::new(11 + h as u64);
    let samples: Vec<LayerSamples> = (0..2)
        .map(|l| {
            LayerSamples::new(
                l,
                128,
                hq,
                h,
                D as usize,
                kv(&mut rng, 128, h, true),
                kv(&mut rng, 128, h, false),
            )
        })
        .collect();
    let model = ModelId {
        name: "sim-vq".into(),
        layers: 2,
        kv_heads: h as u32,
        head_dim: D,
    };
    let mut cal = Calibration::new(model, "random");
    let opts = VqFitOptions {
        iterations: 6,
        ..Default::default()
    };
    cal.fit_vq(s, &samples, opts).unwrap();
    cal
}

/// The default decode, prefill and append kernels of every case (one
/// simulator library).
fn kernels() -> Vec<Generated> {
    cases()
        .iter()
        .flat_map(|s| Kernel::ALL.map(|k| generate(s, k, &default_variant(s, k)).unwrap()))
        .collect()
}

fn load_all(dev: &Arc<dyn Device>) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let all = kernels();
    dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
}

/// A host cache of layer 1 holding one sequence per `LENS` entry
/// (prefilled or streamed, alternately), with its inputs.
struct Filled {
    cache: PagedCache,
    ids: Vec<u64>,
    ks: Vec<Vec<f32>>,
    vs: Vec<Vec<f32>>,
}

fn filled(s: &Scheme, cal: &Calibration, seed: u64) -> Filled {
    let h = s.shape().unwrap().kv_heads;
    let row = h * D as usize;
    let mut rng = Rng::new(seed);
    let mut cache = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(4096), cal, 1).unwrap();
    let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (b, &t) in LENS.iter().enumerate() {
        let (k, v) = (kv(&mut rng, t, h, true), kv(&mut rng, t, h, false));
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
    Filled { cache, ids, ks, vs }
}

/// The oracle: attention over the calibrated views of each sequence.
fn oracle(s: &Scheme, cal: &Calibration, ks: &[Vec<f32>], vs: &[Vec<f32>], q: &[f32], attn: AttnParams) -> Vec<f32> {
    let per = q.len() / ks.len();
    ks.iter()
        .zip(vs)
        .enumerate()
        .flat_map(|(b, (k, v))| {
            let kw = cache_view_calibrated(s, Tensor::Key, k, cal, 1).unwrap();
            let vw = cache_view_calibrated(s, Tensor::Value, v, cal, 1).unwrap();
            decode_attention(s, &q[b * per..][..per], &kw, &vw, attn).unwrap()
        })
        .collect()
}

#[test]
fn vq_decode_matches_the_oracle() {
    for dev in devices("vq_decode", kernels) {
        load_all(&dev);
        let (mut worst, mut n) = (0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let cal = calibration(s);
            let f = filled(s, &cal, 100 + i as u64);
            let dc = DeviceCache::upload(dev.clone(), &f.cache, &f.ids).unwrap();
            let q = Rng::new(200 + i as u64).vec(LENS.len() * shape.q_heads * shape.head_dim);
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let want = oracle(s, &cal, &f.ks, &f.vs, &q, attn);
                let got = dc.decode(&q, attn, None).unwrap();
                let e = rel_error(&got, &want);
                assert!(
                    e <= TOL,
                    "{} {:?} window {window:?}: relative error {e}",
                    s.name,
                    s.heads.unwrap()
                );
                worst = worst.max(e);
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: vq decode of {n} scheme/layout/window cases agrees with the oracle (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}

/// Every tuner variant of vq schemes against the oracle: in CI two cases
/// (both tensors vq on GQA 8:2; vq values behind KIVI-2 keys on MQA);
/// under `KIVI_FULL_SWEEP=1` (scripts/full-sweep.sh) every case.
#[test]
fn every_vq_variant_matches_the_oracle() {
    let picks: Vec<Scheme> = if std::env::var_os("KIVI_FULL_SWEEP").is_some() {
        cases()
    } else {
        vec![
            schemes()[0].with_shape(Heads::Gqa { q: 8, kv: 2 }, D).unwrap(),
            schemes()[1].with_shape(Heads::Mqa(4), D).unwrap(),
        ]
    };
    for dev in devices("vq_variants", || {
        picks
            .iter()
            .flat_map(|s| {
                variants(s, Kernel::Decode)
                    .into_iter()
                    .map(move |v| generate(s, Kernel::Decode, &v).unwrap())
            })
            .collect()
    }) {
        for (i, s) in picks.iter().enumerate() {
            let vs = variants(s, Kernel::Decode);
            assert!(vs.len() >= 8, "{}: only {} variants", s.name, vs.len());
            assert!(!variants(s, Kernel::Prefill).is_empty() && !variants(s, Kernel::Append).is_empty());
            let cal = calibration(s);
            let f = filled(s, &cal, 300 + i as u64);
            let shape = s.shape().unwrap();
            let dc = DeviceCache::upload(dev.clone(), &f.cache, &f.ids).unwrap();
            let q = Rng::new(400 + i as u64).vec(LENS.len() * shape.q_heads * shape.head_dim);
            let attn = AttnParams::of(s, shape);
            let want = oracle(s, &cal, &f.ks, &f.vs, &q, attn);
            let modules = dc.decode_modules(&vs).unwrap();
            for (v, m) in vs.iter().zip(&modules) {
                let got = dc.decode_on(m, &q, attn).unwrap();
                let e = rel_error(&got, &want);
                assert!(e <= TOL, "{} {}: relative error {e}", s.name, v.name());
            }
            sim_util::report(&format!(
                "{}: {} decode variants of {} agree with the oracle",
                dev.kind().name(),
                vs.len(),
                s.name
            ));
        }
    }
}

/// The device cache's own writes (the prefill and append kernels of
/// `kivi_vq_extend.cuh`: a prefill, then appends of one token and of
/// several, on the default and on a 64-thread variant) equal a host
/// cache's word for word — every code the oracle's nearest centroid — and
/// decode as the oracle does; a named codebook is one buffer for both
/// tensors and every layer of a device.
#[test]
fn vq_writes_match_paged_cache_bit_for_bit() {
    for dev in devices("vq_writes", kernels) {
        load_all(&dev);
        for (i, s) in cases().iter().enumerate().filter(|(i, _)| i % 3 == 0) {
            let shape = s.shape().unwrap();
            let (h, hq) = (shape.kv_heads, shape.q_heads);
            let row = h * D as usize;
            let cal = calibration(s);
            let cfg = CacheConfig::for_tokens(4096);
            let mut dc = DeviceCache::with_calibration(dev.clone(), s, 2, 2048, cfg, &cal, 1).unwrap();
            let mut host = PagedCache::with_calibration(s.clone(), cfg, &cal, 1).unwrap();
            let ids = [host.add_sequence(), host.add_sequence()];
            let mut rng = Rng::new(500 + i as u64);
            let (mut ks, mut vs) = (vec![Vec::new(), Vec::new()], vec![Vec::new(), Vec::new()]);
            // prefill 33 and 127 tokens, then 40 appends of one token each
            // (sequence 1 skips every third), then a step of 5 and 0.
            let mut steps: Vec<[usize; 2]> = vec![[33, 127]];
            steps.extend((0..40).map(|j| [1, usize::from(j % 3 != 0)]));
            steps.push([5, 0]);
            for (j, counts) in steps.iter().enumerate() {
                let mut k = Vec::new();
                let mut v = Vec::new();
                for b in 0..2 {
                    let (kb, vb) = (kv(&mut rng, counts[b], h, true), kv(&mut rng, counts[b], h, false));
                    if counts[b] > 0 {
                        host.extend(ids[b], &kb, &vb).unwrap();
                    }
                    k.extend_from_slice(&kb);
                    v.extend_from_slice(&vb);
                    ks[b].extend(kb);
                    vs[b].extend(vb);
                }
                let variant = if i % 2 == 1 {
                    Some(kivi_templates::Variant::parse("t64.tile32.s8.h1.w1.u1").unwrap())
                } else {
                    None
                };
                dc.extend_with(counts, &k, &v, variant).unwrap();
                if j == 0 || j + 1 == steps.len() || j % 13 == 0 {
                    assert_same(s, &host, &ids, &dc, &format!("after step {j}"));
                }
            }
            assert_eq!(dc.lens(), &[ks[0].len() / row, ks[1].len() / row]);
            let q = Rng::new(600 + i as u64).vec(2 * hq * D as usize);
            let attn = AttnParams::of(s, shape);
            let want = oracle(s, &cal, &ks, &vs, &q, attn);
            let e = rel_error(&dc.decode(&q, attn, None).unwrap(), &want);
            assert!(e <= TOL, "{} {:?}: relative error {e}", s.name, s.heads.unwrap());
            // A write the host refuses (a non-finite key) changes nothing.
            let mut bad = kv(&mut rng, 1, h, true);
            bad[3] = f32::NAN;
            let both: Vec<f32> = bad.iter().chain(&bad).copied().collect();
            let before = dc.download_pool().unwrap();
            assert!(dc.extend(&[1, 1], &both, &both).is_err());
            assert_eq!(dc.download_pool().unwrap(), before);
            assert_eq!(dc.lens(), &[ks[0].len() / row, ks[1].len() / row]);
        }
        // One named codebook, one buffer: both tensors of one cache and the
        // caches of two layers.
        let s = &cases()[12]; // vqs on GQA 8:2
        assert_eq!(s.name, "vqs");
        let cal = calibration(s);
        let cfg = CacheConfig::for_tokens(256);
        let a = DeviceCache::with_calibration(dev.clone(), s, 1, 64, cfg, &cal, 0).unwrap();
        let b = DeviceCache::with_calibration(dev.clone(), s, 1, 64, cfg, &cal, 1).unwrap();
        assert!(Arc::ptr_eq(a.book_buffer(Tensor::Key), a.book_buffer(Tensor::Value)));
        assert!(Arc::ptr_eq(a.book_buffer(Tensor::Key), b.book_buffer(Tensor::Value)));
        // Per-layer codebooks are per cache.
        let s = &cases()[0];
        let cal = calibration(s);
        let a = DeviceCache::with_calibration(dev.clone(), s, 1, 64, cfg, &cal, 0).unwrap();
        let b = DeviceCache::with_calibration(dev.clone(), s, 1, 64, cfg, &cal, 1).unwrap();
        assert!(!Arc::ptr_eq(a.book_buffer(Tensor::Key), b.book_buffer(Tensor::Key)));
        assert_ne!(a.vq_book(Tensor::Key), b.vq_book(Tensor::Key));
    }
}

#[test]
fn vq_device_cache_needs_a_matching_calibration() {
    let dev: Arc<dyn Device> = kivi_runtime::device::SimDevice::shared();
    let s = &cases()[0];
    let cfg = CacheConfig::for_tokens(256);
    // No calibration: a typed error naming the vq codec.
    let e = DeviceCache::new(dev.clone(), s, 1, 64, cfg).err().unwrap();
    assert!(matches!(e, kivi_runtime::Error::Calibration(_)), "{e:?}");
    assert!(e.to_string().contains("vq(...)"), "{e}");
    let cal = calibration(s);
    // A layer the calibration does not have.
    let e = DeviceCache::with_calibration(dev.clone(), s, 1, 64, cfg, &cal, 2)
        .err()
        .unwrap();
    assert!(e.to_string().contains("layer 2"), "{e}");
    // Another model shape (head_dim 64).
    let other = schemes()[0].with_shape(s.heads.unwrap(), 64).unwrap();
    let e = DeviceCache::with_calibration(dev.clone(), &other, 1, 64, cfg, &cal, 0)
        .err()
        .unwrap();
    assert!(matches!(e, kivi_runtime::Error::Calibration(_)), "{e:?}");
    // Codebooks fitted for other entries: the missing fit is named.
    let s2 = kivi_spec::parse_scheme(
        "vqkv { key: vq(dim = 4, entries = 32), value: vq(dim = 4, entries = 64), residual: 4, sinks: 2 }",
    )
    .unwrap()
    .with_shape(s.heads.unwrap(), D)
    .unwrap();
    let e = DeviceCache::with_calibration(dev.clone(), &s2, 1, 64, cfg, &cal, 0)
        .err()
        .unwrap();
    assert!(e.to_string().contains("vq dim=4 entries=32"), "{e}");
    // A corrupt calibration file is refused on load, before any cache.
    let mut bytes = cal.to_bytes();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    assert!(Calibration::from_bytes(&bytes).is_err());
    // The many-query block kernel is refused by name.
    let e = kivi_templates::generate_block(s, Default::default()).unwrap_err();
    assert!(e.to_string().contains("vq"), "{e}");
}

/// The vq decode, prefill and append sources compile for sm_90 with NVRTC.
#[test]
fn vq_kernels_compile_with_nvrtc() {
    let Some(c) = device_util::nvrtc_or_skip("vq_kernels_compile_with_nvrtc") else {
        return;
    };
    let opts = kivi_runtime::cuda::NvrtcOptions::for_arch(kivi_runtime::cuda::Arch::parse("sm_90").unwrap());
    let mut gens = kernels();
    // and the largest codebooks a head_dim 128 scheme uses (8 x 256 entries)
    let big = kivi_spec::parse_scheme(
        "vq1 { key: vq(dim = 8, entries = 256), value: vq(dim = 8, entries = 256), residual: 32 }",
    )
    .unwrap()
    .with_shape(Heads::Gqa { q: 32, kv: 8 }, 128)
    .unwrap();
    for v in variants(&big, Kernel::Decode) {
        gens.push(generate(&big, Kernel::Decode, &v).unwrap());
    }
    for k in [Kernel::Prefill, Kernel::Append] {
        gens.push(generate(&big, k, &default_variant(&big, k)).unwrap());
    }
    for g in &gens {
        let a = c
            .compile(&g.name, &g.source, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", g.name));
        for e in &g.entry_points {
            assert!(a.artifact.ptx.contains(&format!(".entry {e}(")), "{}: {e}", g.name);
        }
        // ptxas's report (when its log has one): the lookup tables fit the
        // static shared memory, and the lanes' accumulators fit registers.
        for r in a.resources().iter().filter(|r| r.function.contains("kivi_decode")) {
            assert!(r.shared <= 48 * 1024, "{}: {r:?}", g.name);
            assert!(r.spill_stores <= 4, "{}: {r:?}", g.name);
            if g.name.starts_with("vq1") {
                println!(
                    "  {}: {} registers, {} B shared, {} B spilled",
                    g.name, r.registers, r.shared, r.spill_stores
                );
            }
        }
    }
    println!(
        "vq_kernels_compile_with_nvrtc: {} sources compiled for sm_90",
        gens.len()
    );
}

/// The barriers of template `file` in `src`: byte ranges of each
/// `__syncthreads()` / `__syncwarp()` call in that file's part of the
/// generated source (comments skipped), in source order.
fn barriers_in(src: &str, file: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut inside, mut offset) = (false, 0);
    for line in src.split_inclusive('\n') {
        if let Some(f) = line.trim().strip_prefix("// ===== ") {
            inside = f.starts_with(file);
        } else if inside {
            let code = line.split("//").next().unwrap_or("");
            for call in ["__syncthreads()", "__syncwarp()"] {
                if let Some(i) = code.find(call) {
                    out.push(offset + i..offset + i + call.len());
                }
            }
        }
        offset += line.len();
    }
    out.sort_by_key(|r| r.start);
    out
}

/// Proof that the simulator would catch a missing barrier in the vq
/// kernel: each `__syncthreads()` / `__syncwarp()` of
/// `kivi_vq_decode.cuh` is deleted in turn (replaced by `(void)0`), and
/// every mutant must give a wrong answer or a sim error under at least one
/// strict schedule (sim_barriers.rs does the same for the other
/// templates), while the intact kernel passes under all of them. Cases:
/// both tensors vq, vq keys with `full` values, vq values behind KIVI-2
/// keys; one split and several tiles (so the end-of-tile barrier orders
/// something), 64 threads.
#[test]
fn deleting_any_vq_decode_barrier_is_caught() {
    use kivi_runtime::sim::{compile, Schedule, SimBackend, SimOptions};
    use kivi_runtime::Backend;
    if kivi_runtime::sim::find_compiler().is_err() {
        println!("SKIP deleting_any_vq_decode_barrier_is_caught: no C++ compiler for the simulator");
        return;
    }
    let picks: Vec<Scheme> = [0, 1, 2]
        .iter()
        .map(|&i| schemes()[i].with_shape(Heads::Gqa { q: 8, kv: 2 }, D).unwrap())
        .collect();
    let v = kivi_templates::Variant::parse("t64.tile32.s1.h2.w1.u1").unwrap();
    let mut jobs = Vec::new();
    for s in &picks {
        let g = generate(s, Kernel::Decode, &v).unwrap();
        let muts: Vec<Generated> = barriers_in(&g.source, "kivi_vq_decode.cuh")
            .into_iter()
            .enumerate()
            .map(|(n, at)| {
                let mut m = g.clone();
                m.source.replace_range(at, "(void)0");
                m.name = format!("{} without vq barrier #{}", g.name, n + 1);
                m.hash = kivi_spec::fnv1a64(m.source.as_bytes());
                m
            })
            .collect();
        assert!(muts.len() >= 6, "{}: {} barriers", s.name, muts.len());
        jobs.push((s.clone(), g, muts));
    }
    let all: Vec<&Generated> = jobs
        .iter()
        .flat_map(|(_, g, ms)| std::iter::once(g).chain(ms.iter()))
        .collect();
    let lib = compile(&all).unwrap();
    let lens = [1usize, 31, 33, 127, 301];
    let mut caught = 0;
    for (i, (s, g, muts)) in jobs.iter().enumerate() {
        let cal = calibration(s);
        let h = s.shape().unwrap().kv_heads;
        let row = h * D as usize;
        let mut rng = Rng::new(700 + i as u64);
        let mut cache = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(2048), &cal, 1).unwrap();
        let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for &t in &lens {
            let (k, v) = (kv(&mut rng, t, h, true), kv(&mut rng, t, h, false));
            let id = cache.add_sequence();
            cache.extend(id, &k[..t * row], &v[..t * row]).unwrap();
            ks.push(k);
            vs.push(v);
            ids.push(id);
        }
        let q = rng.vec(lens.len() * s.shape().unwrap().q_heads * D as usize);
        let attn = AttnParams::of(s, s.shape().unwrap());
        let want = oracle(s, &cal, &ks, &vs, &q, attn);
        let run = |g: &Generated| -> Vec<String> {
            Schedule::STRICT
                .iter()
                .filter_map(|&sch| {
                    SimOptions::with_schedule(sch)
                        .scope(|| -> Result<(), String> {
                            let sim = SimBackend::with_library(s, g.clone(), lib.clone()).map_err(|e| e.to_string())?;
                            let got = sim.decode(&cache, &ids, &q, attn).map_err(|e| e.to_string())?;
                            let e = rel_error(&got, &want);
                            if e <= TOL {
                                Ok(())
                            } else {
                                Err(format!("relative error {e:.2e}"))
                            }
                        })
                        .err()
                        .map(|e| format!("{sch}: {}", e.lines().next().unwrap_or("")))
                })
                .collect()
        };
        let intact = run(g);
        assert!(intact.is_empty(), "{} fails with every barrier: {intact:?}", g.name);
        for (n, m) in muts.iter().enumerate() {
            // #1 (the __syncwarp of vq_teams_to_warp) exists only for vq
            // values, #2 (after the shared query) only for vq keys: in the
            // other schemes they sit in code that is never instantiated,
            // and deleting them must change nothing.
            let dead = (n == 0 && s.value.vq().is_none()) || (n == 1 && s.key.vq().is_none());
            // #3 (after s_m/s_l are set) orders the lookup table's writes
            // before the scores read it; without vq keys it orders nothing,
            // for kivi_decode.cuh's reason (sim_barriers.rs, REDUNDANT #2):
            // s_m/s_l are first read in the softmax, after the scores'
            // barrier (or, with no tile, by the thread that set them after
            // the barrier before the cross-warp sum).
            let redundant = n == 2 && s.key.vq().is_none();
            let fails = run(m);
            if dead || redundant {
                assert!(fails.is_empty(), "{}: orders nothing here, yet: {fails:?}", m.name);
                continue;
            }
            assert!(
                !fails.is_empty(),
                "{}: no strict schedule notices the deletion (a race the simulator misses, or a redundant barrier)",
                m.name
            );
            caught += 1;
        }
    }
    sim_util::report(&format!(
        "sim: vq decode barrier deletions: {} sources, {caught} mutants, each caught",
        jobs.len()
    ));
}

/// Ties: codebooks in which every centroid has a twin at a higher index
/// (the twin always at the same distance) make every code a tie; the
/// device's prefill and appends must pick the lower index, as the oracle
/// does, word for word with a host cache.
#[test]
fn device_coding_breaks_ties_to_the_lowest_index() {
    use kivi_runtime::calib::{Entry, Kind, Stage};
    for dev in devices("vq_ties", kernels) {
        load_all(&dev);
        let s = &cases()[0]; // vqkv on GQA 8:2: both tensors vq
        let mut cal = calibration(s);
        for (t, book) in [Tensor::Key, Tensor::Value].map(|t| (t, kivi_runtime::vq::book(&cal, s, t, 1).unwrap())) {
            // centroid 2c + 1 := centroid 2c, for every sub-vector
            let mut data = book.data.clone();
            for j in 0..book.subvectors {
                for c in (0..book.entries).step_by(2) {
                    let src = book.centroid(j, c).to_vec();
                    data[(j * book.entries + c + 1) * book.dim..][..book.dim].copy_from_slice(&src);
                }
            }
            cal.insert(Entry {
                layer: 1,
                tensor: t,
                stage: Stage::PostRope,
                kind: Kind::VqCodebook,
                fit: kivi_runtime::vq::fit_key(s, t).unwrap(),
                shape: vec![book.subvectors as u32, book.entries as u32, book.dim as u32],
                data,
            })
            .unwrap();
        }
        let h = s.shape().unwrap().kv_heads;
        let cfg = CacheConfig::for_tokens(1024);
        let mut dc = DeviceCache::with_calibration(dev.clone(), s, 1, 512, cfg, &cal, 1).unwrap();
        let mut host = PagedCache::with_calibration(s.clone(), cfg, &cal, 1).unwrap();
        let id = [host.add_sequence()];
        let mut rng = Rng::new(900);
        for n in [40usize, 1, 1, 7] {
            let (k, v) = (kv(&mut rng, n, h, true), kv(&mut rng, n, h, false));
            host.extend(id[0], &k, &v).unwrap();
            dc.extend(&[n], &k, &v).unwrap();
            assert_same(s, &host, &id, &dc, &format!("after {n} more tokens"));
        }
        // Every stored code is even: the lower of each pair of twins.
        let l = host.layout();
        let pool = host.pool();
        let view = host.view(id[0]).unwrap();
        for t in [Tensor::Key, Tensor::Value] {
            let bits = s.codec(t).vq().unwrap().code_bits();
            let tl = l.tensor(t);
            for p in 0..view.quantized(t) {
                let blk = view.table()[p / l.block_tokens] as usize;
                for hh in 0..h {
                    let part = blk * l.block_words + l.tensor_offset(hh, t);
                    let words = &pool[part + (p % l.block_tokens) * tl.words_per_token..][..tl.words_per_token];
                    for w in words {
                        for i in 0..32 / bits {
                            assert_eq!((w >> (i * bits)) & 1, 0, "an odd code at token {p}");
                        }
                    }
                }
            }
        }
    }
}

/// The same proof for `kivi_vq_extend.cuh`'s one barrier (every ring row
/// is read before any is overwritten): without it, an append that codes
/// the oldest window token while the new token takes its ring slot reads
/// the new row under some strict schedule, and the stored codes differ
/// from a host cache's.
#[test]
fn deleting_the_vq_extend_barrier_is_caught() {
    use kivi_runtime::sim::{Schedule, SimOptions};
    if kivi_runtime::sim::find_compiler().is_err() {
        println!("SKIP deleting_the_vq_extend_barrier_is_caught: no C++ compiler for the simulator");
        return;
    }
    let dev: Arc<dyn Device> = kivi_runtime::device::SimDevice::shared();
    let s = &cases()[0]; // vqkv on GQA 8:2, residual 4, sinks 2
    let cal = calibration(s);
    let gen = |k: Kernel| generate(s, k, &default_variant(s, k)).unwrap();
    let (prefill, append) = (gen(Kernel::Prefill), gen(Kernel::Append));
    let sites = barriers_in(&append.source, "kivi_vq_extend.cuh");
    assert_eq!(sites.len(), 1, "{sites:?}");
    let mut mutant = append.clone();
    mutant.source.replace_range(sites[0].clone(), "(void)0");
    mutant.name = format!("{} without the vq extend barrier", append.name);
    mutant.hash = kivi_spec::fnv1a64(mutant.source.as_bytes());
    let mods = dev.load_many(&[&prefill, &append, &mutant]).unwrap();
    let h = s.shape().unwrap().kv_heads;
    // A prefill of 40 tokens, then 12 appends through `append`: does every
    // stored word match a host cache's?
    let run = |append: &kivi_runtime::device::Module| -> Result<(), String> {
        let cfg = CacheConfig::for_tokens(256);
        let mut dc = DeviceCache::with_calibration(dev.clone(), s, 1, 128, cfg, &cal, 1).map_err(|e| e.to_string())?;
        let mut host = PagedCache::with_calibration(s.clone(), cfg, &cal, 1).unwrap();
        let id = host.add_sequence();
        let mut rng = Rng::new(31);
        for (step, n) in std::iter::once(40usize).chain(std::iter::repeat_n(1, 12)).enumerate() {
            let (k, v) = (kv(&mut rng, n, h, true), kv(&mut rng, n, h, false));
            host.extend(id, &k, &v).unwrap();
            let m = if n > 1 { &mods[0] } else { append };
            dc.extend_on(m, &[n], &k, &v).map_err(|e| e.to_string())?;
            if dc.download_pool().map_err(|e| e.to_string())? != host.pool() {
                return Err(format!("pool words differ after step {step}"));
            }
        }
        Ok(())
    };
    let outcome = |m: &kivi_runtime::device::Module| -> Vec<String> {
        Schedule::STRICT
            .iter()
            .filter_map(|&sch| {
                SimOptions::with_schedule(sch)
                    .scope(|| run(m))
                    .err()
                    .map(|e| format!("{sch}: {}", e.lines().next().unwrap_or("")))
            })
            .collect()
    };
    let intact = outcome(&mods[1]);
    assert!(intact.is_empty(), "the intact append kernel fails: {intact:?}");
    let caught = outcome(&mods[2]);
    assert!(
        !caught.is_empty(),
        "deleting the vq extend barrier changed nothing under any strict schedule"
    );
    sim_util::report(&format!("sim: vq extend barrier deletion caught ({})", caught[0]));
}
