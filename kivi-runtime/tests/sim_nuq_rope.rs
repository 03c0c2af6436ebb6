//! Calibrated codebooks (`levels = nuq`) on pre-RoPE keys in the generated
//! CUDA decode kernel: the table fitted on pre-RoPE keys is baked in
//! (`generate_calibrated`) and the kernel turns each key to its position
//! (`rope: pre`), both features the decode template had separately. Over
//! a host cache holding sequences of lengths 1, 31, 33, 127, 1000 (odd
//! ones streamed), on GQA, MQA and MHA, both RoPE bases of Gemma 3 and
//! both pair conventions, channel- and token-axis nuq keys, with and
//! without a sliding window, the decode matches the oracle
//! (`cache_view_calibrated` + `decode_attention`, which turns the keys).
//!
//! Runs on the simulated device (CI) and on GPU 0 where one is usable.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::devices;
use kivi_runtime::calib::{Calibration, FitOptions, LayerSamples, ModelId};
use kivi_runtime::device::{Device, DeviceBackend};
use kivi_runtime::reference::{cache_view_calibrated, decode_attention};
use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache};
use kivi_spec::{Heads, RopeStyle, Scheme, Tensor};
use kivi_templates::{default_variant, generate_calibrated, Codebooks, Generated, Kernel};
use sim_util::{rel_error, Rng};
use std::sync::Arc;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];
const TOL: f32 = 1e-4;

/// Channel-axis nuq keys (half pairs, base 10000) and token-axis nuq keys
/// (interleaved pairs, base 1000000, sinks), each on three layouts.
fn cases() -> Vec<Scheme> {
    let texts = [
        "pnuqck { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
         value: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2), residual: 32, \
         rope: pre(theta = 10000, style = half) }",
        "pnuqtk { key: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2), \
         value: quant(bits = 2, axis = token, group = 32), residual: 16, sinks: 2, \
         rope: pre(theta = 1000000, style = interleaved) }",
    ];
    let layouts = [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 64),
        (Heads::Mha(3), 64),
    ];
    let out: Vec<Scheme> = texts
        .iter()
        .flat_map(|t| {
            let s = kivi_spec::parse_scheme(t).unwrap();
            layouts.iter().map(move |(h, d)| s.with_shape(*h, *d).unwrap())
        })
        .collect();
    assert!(out.iter().any(|s| s.rope.unwrap().style == RopeStyle::Interleaved));
    out
}

/// Pre-RoPE keys with per-channel offsets and a few loud channels.
fn inputs(rng: &mut Rng, tokens: usize, row: usize, key: bool) -> Vec<f32> {
    device_util::offset_rows(rng, tokens, row, key)
}

/// A one-layer calibration fitted for `s` on pre-RoPE keys (the post-RoPE
/// keys given are other draws: a table fitted on them would differ).
fn calibration(s: &Scheme) -> Calibration {
    let shape = s.shape().unwrap();
    let (h, d) = (shape.kv_heads, shape.head_dim);
    let mut rng = Rng::new(9 + h as u64);
    let model = ModelId {
        name: "sim-nuq-rope".into(),
        layers: 1,
        kv_heads: h as u32,
        head_dim: d as u32,
    };
    let mut cal = Calibration::new(model, "random");
    let (k, v) = (inputs(&mut rng, 256, h * d, true), inputs(&mut rng, 256, h * d, false));
    let mut x = LayerSamples::new(0, 256, shape.q_heads, h, d, rng.vec(256 * h * d), v);
    x.keys_pre_rope = Some(k);
    cal.fit_codebooks(s, &[x], FitOptions::default()).unwrap();
    cal
}

fn kernels() -> Vec<Generated> {
    cases()
        .iter()
        .map(|s| {
            let cal = calibration(s);
            let cb = Codebooks {
                key: Some(cal.codebook(s, Tensor::Key, 0).unwrap()),
                value: cal.codebook(s, Tensor::Value, 0).ok(),
            };
            let k = Kernel::Decode;
            generate_calibrated(s, k, &default_variant(s, k), Default::default(), &cb).unwrap()
        })
        .collect()
}

fn load_all(dev: &Arc<dyn Device>) {
    let all = kernels();
    dev.load_many(&all.iter().collect::<Vec<_>>()).unwrap();
}

#[test]
fn nuq_pre_rope_decode_matches_reference() {
    for dev in devices("nuq_rope_decode", kernels) {
        load_all(&dev);
        let backend = DeviceBackend::new(dev.clone());
        let (mut worst, mut n) = (0f32, 0);
        for (i, s) in cases().iter().enumerate() {
            let shape = s.shape().unwrap();
            let row = shape.kv_heads * shape.head_dim;
            let cal = calibration(s);
            let mut rng = Rng::new(300 + i as u64);
            let mut cache = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(4096), &cal, 0).unwrap();
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
                let want: Vec<f32> = (0..ids.len())
                    .flat_map(|b| {
                        let kw = cache_view_calibrated(s, Tensor::Key, &ks[b], &cal, 0).unwrap();
                        let vw = cache_view_calibrated(s, Tensor::Value, &vs[b], &cal, 0).unwrap();
                        decode_attention(s, &q[b * per..][..per], &kw, &vw, attn).unwrap()
                    })
                    .collect();
                let got = backend.decode(&cache, &ids, &q, attn).unwrap();
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
            "{}: pre-RoPE nuq decode of {n} scheme/layout/window cases agrees with the oracle (worst relative error {worst:.2e})",
            dev.kind().name()
        ));
    }
}
