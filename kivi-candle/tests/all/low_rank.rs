//! A `low_rank` scheme through kivi-candle: each layer stores coordinates
//! in its calibrated bases; the fused path (chunks of odd sizes, GQA) must
//! match the low-rank oracle (`kivi_runtime::low_rank::attend`) on every
//! prefix, the drop-in `append` must return the oracle's reconstructed
//! rows, memory counts the bases once per layer, and a low-rank scheme
//! without a calibration is a typed error.

use candle_core::{Device, Tensor};
use kivi_candle::{KiviKvCache, ModelShape};
use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
use kivi_runtime::low_rank::{self, Bases};
use kivi_runtime::rand::Rng;
use kivi_runtime::AttnParams;
use kivi_spec::{Heads, Tensor as Which};

fn tensor(rows: &[f32], n: usize, heads: usize, d: usize) -> Tensor {
    Tensor::from_vec(rows.to_vec(), (n, heads, d), &Device::Cpu)
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.squeeze(0)
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn low_rank_layers_match_the_oracle() {
    let (layers, hq, h, d, rank) = (2, 4, 2, 32, 16);
    let mut rng = Rng::new(9);
    // Rows near a rank-6 subspace (plus noise), per layer and head.
    let mix: Vec<f32> = (0..d * 6).map(|_| rng.normal()).collect();
    let rows = |rng: &mut Rng, n: usize| -> Vec<f32> {
        (0..n * h)
            .flat_map(|_| {
                let z: Vec<f32> = (0..6).map(|_| rng.normal()).collect();
                (0..d)
                    .map(|c| (0..6).map(|j| mix[c * 6 + j] * z[j]).sum::<f32>() + 0.05 * rng.normal())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let mut cal = Calibration::new(
        ModelId {
            name: "toy".into(),
            layers: layers as u32,
            kv_heads: h as u32,
            head_dim: d as u32,
        },
        "synthetic",
    );
    let samples: Vec<LayerSamples> = (0..layers)
        .map(|l| LayerSamples::new(l, 300, hq, h, d, rows(&mut rng, 300), rows(&mut rng, 300)))
        .collect();
    cal.fit_bases(&samples).unwrap();
    let s = kivi_spec::parse_scheme(&format!(
        "L {{ key: quant(bits = 4, axis = channel, group = 16), value: quant(bits = 4, axis = token, group = 16), \
         residual: 16, dtype: f32, low_rank: pca(rank = {rank}, apply = [key, value]) }}"
    ))
    .unwrap();
    let shape = ModelShape {
        layers,
        q_heads: hq,
        kv_heads: h,
        head_dim: d,
    };
    let e = KiviKvCache::per_layer(&vec![s.clone(); layers], shape, 512)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("calibration"), "{e}");
    // `residual = N` (LowRAM's exact rows) is refused by name, not decoded
    // as if it were 0.
    let with_residual = kivi_spec::parse_scheme(&format!(
        "L {{ key: quant(bits = 4, axis = channel, group = 16), value: quant(bits = 4, axis = token, group = 16), \
         residual: 16, dtype: f32, low_rank: pca(rank = {rank}, apply = [key, value], residual = 4) }}"
    ))
    .unwrap();
    let e = KiviKvCache::per_layer_calibrated(&vec![with_residual; layers], shape, 512, Some(&cal))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("residual = 4"), "{e}");
    let mut cache = KiviKvCache::per_layer_calibrated(&vec![s.clone(); layers], shape, 512, Some(&cal)).unwrap();
    let bound = s
        .with_shape(
            Heads::Gqa {
                q: hq as u32,
                kv: h as u32,
            },
            d as u32,
        )
        .unwrap();
    assert_eq!(cache.scheme(0).unwrap(), &bound);
    let attn = AttnParams::of(&bound, bound.shape().unwrap());
    let total = 1 + 30 + 33 + 63;
    let (k, v) = (rows(&mut rng, total), rows(&mut rng, total));
    let q: Vec<f32> = (0..total * hq * d).map(|_| 0.3 * rng.normal()).collect();
    let (kr, qr) = (h * d, hq * d);
    for layer in 0..layers {
        let b = Bases::for_layer(&bound, &cal, layer).unwrap();
        let mut at = 0;
        for n in [1, 30, 33, 63] {
            let out = cache
                .attend(
                    layer,
                    &tensor(&q[at * qr..(at + n) * qr], n, hq, d),
                    &tensor(&k[at * kr..(at + n) * kr], n, h, d),
                    &tensor(&v[at * kr..(at + n) * kr], n, h, d),
                )
                .unwrap();
            let got = host(&out);
            for i in 0..n {
                let t = at + i + 1;
                let want =
                    low_rank::attend(&bound, &q[(t - 1) * qr..t * qr], &k[..t * kr], &v[..t * kr], attn, &b).unwrap();
                let scale = want.iter().fold(0.1f32, |m, x| m.max(x.abs()));
                let err = want
                    .iter()
                    .zip(&got[i * qr..(i + 1) * qr])
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(err <= 2e-4 * scale, "layer {layer} token {t}: {err} of {scale}");
            }
            at += n;
        }
        // The drop-in path returns the oracle's reconstructed rows.
        let (kk, _) = cache
            .append(layer, &tensor(&k[..0], 0, h, d), &tensor(&v[..0], 0, h, d))
            .unwrap();
        assert_eq!(host(&kk), low_rank::cache_view(&bound, Which::Key, &k, &b).unwrap());
    }
    let m = cache.memory();
    assert_eq!(m.bases, layers * 2 * h * rank * d * 4);
    assert_eq!(cache.layer_memory(0).unwrap().bases, 2 * h * rank * d * 4);
}
