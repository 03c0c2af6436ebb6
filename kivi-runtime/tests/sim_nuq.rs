//! Calibrated codebooks (`levels = nuq`) in the generated kernels: the
//! calibration's table for (layer, tensor) is baked into the decode,
//! prefill and append sources (`kivi_templates::generate_calibrated`), and
//! the device cache takes the calibration as `PagedCache` does.
//!
//! - decode over an uploaded host cache matches the oracle
//!   (`cache_view_calibrated` + `decode_attention`) at lengths 1, 31, 33,
//!   127, 1000 on GQA, MQA and MHA, for channel- and token-axis `nuq` keys
//!   and values (rms and l2 norms), with and without a sliding window;
//! - the device's own prefill and appends write exactly the words a host
//!   cache built with the same calibration writes;
//! - another layer's table changes the source hash, the kernel name and
//!   the output (which then matches that layer's oracle, not the first's);
//! - the many-query block kernel with the tables matches the oracle;
//! - a `nuq` device cache without a matching calibration is a typed error.
//!
//! Runs on the simulated device (CI) and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::{devices, write_both};
use kivi_runtime::calib::{CalibError, Calibration, FitOptions, LayerSamples, ModelId};
use kivi_runtime::device::{Device, DeviceBackend, DeviceCache};
use kivi_runtime::reference::{block_attention_views, cache_view_calibrated, decode_attention, round_inputs};
use kivi_runtime::{AttnParams, Backend, CacheConfig, Error, NewTokens, PagedCache};
use kivi_spec::{Heads, Scheme, Tensor};
use kivi_templates::{default_variant, generate_block_calibrated, generate_calibrated, Codebooks, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
const TOL: f32 = 1e-4;

/// Channel-axis `nuq` keys with token-axis `nuq` values (l2 norm), and the
/// other way round (with sinks): each axis of each tensor, both norms.
fn schemes() -> Vec<Scheme> {
    [
        "nuqck { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
         value: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2), residual: 32 }",
        "nuqtk { key: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2), \
         value: quant(bits = 2, axis = channel, group = 16, levels = nuq), residual: 32, sinks: 2 }",
    ]
    .iter()
    .map(|t| kivi_spec::parse_scheme(t).unwrap())
    .collect()
}

/// Both schemes on GQA 8:2, MQA 4:1 and MHA 3 (head_dim 64).
fn cases() -> Vec<Scheme> {
    let layouts = [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 64),
        (Heads::Mha(3), 64),
    ];
    schemes()
        .iter()
        .flat_map(|s| layouts.iter().map(move |(h, d)| s.with_shape(*h, *d).unwrap()))
        .collect()
}

/// Keys with a per-channel offset and a few loud channels, values with an
/// offset; layer 1's are cubed (heavy tails), so its codebooks differ.
fn inputs(rng: &mut Rng, tokens: usize, row: usize, key: bool, layer: usize) -> Vec<f32> {
    let x = rng.vec(tokens * row);
    let x = if layer == 1 {
        x.iter().map(|x| 2.0 * x * x * x).collect()
    } else {
        x
    };
    device_util::with_offsets(x, row, key)
}

/// A two-layer calibration fitted for `s` (its shape) on samples drawn as
/// [`inputs`] draws each layer's.
fn calibration(s: &Scheme) -> Calibration {
    let shape = s.shape().unwrap();
    let (h, d) = (shape.kv_heads, shape.head_dim);
    let mut rng = Rng::new(7 + h as u64);
    let model = ModelId {
        name: "sim-nuq".into(),
        layers: 2,
        kv_heads: h as u32,
        head_dim: d as u32,
    };
    let mut cal = Calibration::new(model, "random");
    let samples: Vec<LayerSamples> = (0..2)
        .map(|l| {
            let (k, v) = (
                inputs(&mut rng, 256, h * d, true, l),
                inputs(&mut rng, 256, h * d, false, l),
            );
            LayerSamples::new(l, 256, shape.q_heads, h, d, k, v)
        })
        .collect();
    cal.fit_codebooks(s, &samples, FitOptions::default()).unwrap();
    cal
}

fn codebooks(s: &Scheme, cal: &Calibration, layer: usize) -> Codebooks {
    Codebooks {
        key: Some(cal.codebook(s, Tensor::Key, layer).unwrap()),
        value: Some(cal.codebook(s, Tensor::Value, layer).unwrap()),
    }
}

/// Decode, prefill and append of every case at layer 0, and the decode of
/// the first case at layer 1.
fn kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for (i, s) in cases().iter().enumerate() {
        let cal = calibration(s);
        for layer in [0, 1] {
            if layer == 1 && i > 0 {
                continue;
            }
            let cb = codebooks(s, &cal, layer);
            if layer == 0 {
                out.push(generate_block_calibrated(s, Default::default(), &cb).unwrap());
            }
            for k in Kernel::ALL {
                if layer == 1 && k != Kernel::Decode {
                    continue;
                }
                out.push(generate_calibrated(s, k, &default_variant(s, k), Default::default(), &cb).unwrap());
            }
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

/// The oracle: attention over the calibrated cache views of one sequence.
fn oracle(s: &Scheme, cal: &Calibration, layer: usize, q: &[f32], k: &[f32], v: &[f32], attn: AttnParams) -> Vec<f32> {
    let kv = cache_view_calibrated(s, Tensor::Key, k, cal, layer).unwrap();
    let vv = cache_view_calibrated(s, Tensor::Value, v, cal, layer).unwrap();
    decode_attention(s, q, &kv, &vv, attn).unwrap()
}

/// A host cache of layer `layer` holding one sequence per `LENS` entry
/// (prefilled or streamed, alternately), with its inputs.
struct Filled {
    cache: PagedCache,
    ids: Vec<u64>,
    ks: Vec<Vec<f32>>,
    vs: Vec<Vec<f32>>,
}

fn filled(s: &Scheme, cal: &Calibration, layer: usize, seed: u64) -> Filled {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    let mut rng = Rng::new(seed);
    let mut cache = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(4096), cal, layer).unwrap();
    let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (b, &t) in LENS.iter().enumerate() {
        let (k, v) = (inputs(&mut rng, t, row, true, 0), inputs(&mut rng, t, row, false, 0));
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

fn oracle_batch(s: &Scheme, cal: &Calibration, layer: usize, f: &Filled, q: &[f32], attn: AttnParams) -> Vec<f32> {
    let per = q.len() / f.ids.len();
    (0..f.ids.len())
        .flat_map(|b| oracle(s, cal, layer, &q[b * per..][..per], &f.ks[b], &f.vs[b], attn))
        .collect()
}

#[test]
fn nuq_decode_matches_reference() {
    for dev in devices("nuq_decode", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let (mut worst, mut n) = (0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let cal = calibration(s);
            let f = filled(s, &cal, 0, 100 + i as u64);
            let q = Rng::new(200 + i as u64).vec(LENS.len() * shape.q_heads * shape.head_dim);
            for window in [None, Some(40)] {
                let attn = AttnParams {
                    window,
                    ..AttnParams::of(s, shape)
                };
                let want = oracle_batch(s, &cal, 0, &f, &q, attn);
                let got = backend.decode(&f.cache, &f.ids, &q, attn).unwrap();
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
            "{}: nuq decode of {n} scheme/layout/window cases agrees with the oracle (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}

#[test]
fn nuq_writes_match_paged_cache_bit_for_bit() {
    for dev in devices("nuq_extend", kernels) {
        load_all(&dev);
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let cal = calibration(s);
            let cfg = CacheConfig::for_tokens(8192);
            let mut host = PagedCache::with_calibration(s.clone(), cfg, &cal, 0).unwrap();
            let mut dc = DeviceCache::with_calibration(dev.clone(), s, LENS.len(), 1100, cfg, &cal, 0).unwrap();
            assert_eq!(dc.identity(), host.identity());
            let mut rng = Rng::new(500 + i as u64);
            // 33 appends: every sequence crosses a flush on the way
            let (ids, ks, vs) = write_both(s, &mut host, &mut dc, &LENS, &mut rng, 33, 16, |r, t, key| {
                inputs(r, t, row, key, 0)
            });
            let attn = AttnParams::of(s, shape);
            let q = rng.vec(ids.len() * shape.q_heads * shape.head_dim);
            let got = dc.decode(&q, attn, None).unwrap();
            let per = shape.q_heads * shape.head_dim;
            let want: Vec<f32> = (0..ids.len())
                .flat_map(|b| oracle(s, &cal, 0, &q[b * per..][..per], &ks[b], &vs[b], attn))
                .collect();
            let e = rel_error(&got, &want);
            assert!(e <= TOL, "{}: decode after device writes, relative error {e}", s.name);
            n += 1;
        }
        sim_util::report(&format!(
            "{}: nuq prefill + 33 appends bit-identical to PagedCache for {n} scheme/layout pairs",
            dev.kind().name()
        ));
    }
}

/// The check that could fail: layer 1's table must give another source
/// (hash and name) and another answer — its own oracle's, not layer 0's.
#[test]
fn another_table_changes_the_source_and_the_output() {
    for dev in devices("nuq_tables", kernels) {
        load_all(&dev);
        let s = &cases()[0];
        let shape = s.shape().unwrap();
        let cal = calibration(s);
        let (cb0, cb1) = (codebooks(s, &cal, 0), codebooks(s, &cal, 1));
        assert_ne!(cb0, cb1, "the two layers' samples should fit different codebooks");
        let v = default_variant(s, Kernel::Decode);
        let g0 = generate_calibrated(s, Kernel::Decode, &v, Default::default(), &cb0).unwrap();
        let g1 = generate_calibrated(s, Kernel::Decode, &v, Default::default(), &cb1).unwrap();
        assert_ne!(g0.hash, g1.hash);
        assert_ne!(g0.name, g1.name);
        assert_eq!(g0.launch, g1.launch, "the table changes no launch shape or argument");
        let attn = AttnParams::of(s, shape);
        let q = Rng::new(300).vec(LENS.len() * shape.q_heads * shape.head_dim);
        let backend = DeviceBackend::new(dev.clone());
        let mut got = Vec::new();
        let mut want = Vec::new();
        for layer in [0, 1] {
            // the same inputs, the two layers' tables
            let f = filled(s, &cal, layer, 400);
            got.push(backend.decode(&f.cache, &f.ids, &q, attn).unwrap());
            want.push(oracle_batch(s, &cal, layer, &f, &q, attn));
        }
        for layer in 0..2 {
            let e = rel_error(&got[layer], &want[layer]);
            assert!(e <= TOL, "layer {layer}: relative error {e} against its own oracle");
        }
        let apart = rel_error(&want[1], &want[0]);
        assert!(
            apart > 100.0 * TOL,
            "the two tables give nearly the same attention ({apart:.2e})"
        );
        let e = rel_error(&got[1], &want[0]);
        assert!(e > 10.0 * TOL, "layer 1's decode matches layer 0's oracle ({e:.2e})");
    }
}

#[test]
fn nuq_device_cache_needs_a_matching_calibration() {
    let dev = kivi_runtime::device::SimDevice::shared();
    let s = &cases()[1];
    let cfg = CacheConfig::for_tokens(256);
    match DeviceCache::new(dev.clone(), s, 1, 256, cfg) {
        Err(Error::Calibration(e)) => assert!(matches!(*e, CalibError::Needed { .. }), "{e}"),
        Err(e) => panic!("expected a calibration error, got {e}"),
        Ok(_) => panic!("a nuq device cache was built without its codebooks"),
    }
    let cal = calibration(s);
    let e = DeviceCache::with_calibration(dev.clone(), s, 1, 256, cfg, &cal, 5)
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Calibration(c) if matches!(**c, CalibError::Missing { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("layer 5"), "{e}");
    // fitted for another shape (MHA 3 has 3 KV heads, MQA 1)
    let other = calibration(&cases()[2]);
    let e = DeviceCache::with_calibration(dev.clone(), s, 1, 256, cfg, &other, 0)
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Calibration(c) if matches!(**c, CalibError::ModelMismatch { .. })),
        "{e}"
    );
    let dc = DeviceCache::with_calibration(dev.clone(), s, 1, 256, cfg, &cal, 1).unwrap();
    assert_eq!(dc.calibration_hash(), Some(cal.hash()));
    assert_eq!(dc.codebooks(), &codebooks(s, &cal, 1));
    // the generator refuses a table that does not fit, by type
    let mut bad = codebooks(s, &cal, 0);
    bad.value.as_mut().unwrap().pop();
    let e = generate_calibrated(
        s,
        Kernel::Decode,
        &default_variant(s, Kernel::Decode),
        Default::default(),
        &bad,
    )
    .unwrap_err();
    assert!(
        matches!(e, kivi_templates::GenError::Codebook { tensor: "value", .. }),
        "{e}"
    );
    // without its tables the many-query kernel is refused by name too
    let e = kivi_templates::generate_block(s, Default::default()).unwrap_err();
    assert!(
        matches!(
            e,
            kivi_templates::GenError::Unsupported {
                field: kivi_spec::Field::Levels(_),
                ..
            }
        ),
        "{e}"
    );
}

/// The many-query block kernel with the tables baked in: a block of new
/// tokens per sequence appended to caches of 1 to 1000 tokens, against
/// the oracle's `block_attention_views` over the calibrated views.
#[test]
fn nuq_block_matches_reference() {
    for dev in devices("nuq_block", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let (mut worst, mut n) = (0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let (h, d) = (shape.kv_heads, shape.head_dim);
            let cal = calibration(s);
            let mut f = filled(s, &cal, 0, 600 + i as u64);
            let mut rng = Rng::new(700 + i as u64);
            let news = [3usize, 1, 40, 7, 33];
            let nk: Vec<Vec<f32>> = news.iter().map(|&m| inputs(&mut rng, m, h * d, true, 0)).collect();
            let nv: Vec<Vec<f32>> = news.iter().map(|&m| inputs(&mut rng, m, h * d, false, 0)).collect();
            let nq: Vec<Vec<f32>> = news.iter().map(|&m| rng.vec(m * shape.q_heads * d)).collect();
            let blocks: Vec<NewTokens> = (0..news.len())
                .map(|b| NewTokens {
                    seq: f.ids[b],
                    q: &nq[b],
                    k: &nk[b],
                    v: &nv[b],
                })
                .collect();
            let attn = AttnParams::of(s, shape);
            let got = backend.attend_block(&mut f.cache, &blocks, attn).unwrap();
            let mut want = Vec::new();
            for b in 0..news.len() {
                let k = [&f.ks[b][..], &nk[b][..]].concat();
                let v = [&f.vs[b][..], &nv[b][..]].concat();
                let kf = cache_view_calibrated(s, Tensor::Key, &k, &cal, 0).unwrap();
                let vf = cache_view_calibrated(s, Tensor::Value, &v, &cal, 0).unwrap();
                let kr = round_inputs(s, "key", &k, h, d).unwrap();
                let vr = round_inputs(s, "value", &v, h, d).unwrap();
                want.extend(block_attention_views(s, LENS[b], &nq[b], [&kf, &vf], [&kr, &vr], attn).unwrap());
            }
            let e = rel_error(&got, &want);
            assert!(e <= TOL, "{} {:?}: block relative error {e}", s.name, s.heads.unwrap());
            worst = worst.max(e);
            n += 1;
        }
        sim_util::report(&format!(
            "{}: nuq many-query blocks of {n} scheme/layout cases agree with the oracle (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}

/// The generated nuq kernels compile with NVRTC for sm_90 where NVRTC is
/// provisioned; skipped with a line otherwise.
#[test]
fn nvrtc_compiles_the_nuq_kernels() {
    use kivi_runtime::cuda::{Arch, NvrtcOptions};
    let Some(compiler) = device_util::nvrtc_or_skip("nvrtc_compiles_the_nuq_kernels") else {
        return;
    };
    let opts = NvrtcOptions::for_arch(Arch::parse("sm_90").unwrap());
    // one case of each scheme: every axis of both tensors
    for s in [&cases()[0], &cases()[4]] {
        let cb = codebooks(s, &calibration(s), 0);
        let mut gens: Vec<Generated> = Kernel::ALL
            .iter()
            .map(|&k| generate_calibrated(s, k, &default_variant(s, k), Default::default(), &cb).unwrap())
            .collect();
        gens.push(generate_block_calibrated(s, Default::default(), &cb).unwrap());
        for g in gens {
            let c = compiler
                .compile(&g.name, &g.source, &opts)
                .unwrap_or_else(|e| panic!("{}: {e}", g.name));
            assert!(!c.artifact.ptx.is_empty(), "{}: no PTX", g.name);
        }
    }
}
