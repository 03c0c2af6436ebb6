//! Per-layer errors of the four axis choices at 2 bits, group 32, on the real
//! K/V/Q of the model (captured from the unquantized forward), with and
//! without a 128-token full-precision window.
//!
//! Everything goes through the oracle: [`kivi_runtime::reference::cache_view`]
//! gives what a cache of the scheme would return for each token, and
//! [`kivi_runtime::reference::decode_attention`] the attention output. The
//! schemes here keep activations in f32 so that the numbers are quantization
//! error alone (scales and zero points are f16, as in the presets).

use crate::error::Result;
use crate::kv::f32_scheme;
use crate::model::{Capture, Config};
use kivi_runtime::reference::{cache_view, decode_attention};
use kivi_runtime::AttnParams;
use kivi_spec::{Axis, Codec, Dtype, Heads, Levels, Quant, ScaleDtype, Scheme, Tensor};
use rayon::prelude::*;

/// Relative errors, each `||x^ - x|| / ||x||` (Frobenius / L2).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Errors {
    /// Keys over the whole cache (window tokens count, exactly 0).
    pub key: f64,
    /// Values over the whole cache.
    pub value: f64,
    /// Pre-softmax scores of each query head over the tokens it attends to,
    /// averaged over heads and query positions.
    pub score: f64,
    /// Attention output of each query head, averaged likewise.
    pub output: f64,
}

/// One axis choice: its results per layer and averaged.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AxisResult {
    /// `K<c|t>-V<c|t>-r<R>`, e.g. `Kc-Vt-r128` (KIVI's choice).
    pub name: String,
    pub key_axis: String,
    pub value_axis: String,
    pub residual: u32,
    /// All-in bits per element ([`kivi_spec::layout::bits_per_element`]).
    pub bits_per_element: f64,
    /// One of the `extra` schemes (the codec study), not an axis combination.
    pub codec: bool,
    pub per_layer: Vec<Errors>,
    pub mean: Errors,
}

/// The whole per-layer study.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerReport {
    pub bits: u32,
    pub group: u32,
    /// Tokens in the cache for the K/V errors.
    pub tokens: usize,
    /// Query positions used for score and output errors.
    pub query_positions: Vec<usize>,
    pub global_layers: Vec<usize>,
    pub results: Vec<AxisResult>,
}

fn axis_name(a: Axis) -> &'static str {
    match a {
        Axis::Channel => "channel",
        Axis::Token => "token",
    }
}

/// The 2-bit g32 scheme for one axis choice (f32 activations).
pub fn axis_scheme(key: Axis, value: Axis, residual: u32, bits: u32, group: u32) -> Scheme {
    let q = |axis| {
        Codec::Quant(Quant {
            bits,
            axis,
            group,
            scale: ScaleDtype::F16,
            levels: Levels::Uniform,
        })
    };
    let mut s = kivi_spec::presets::kivi2();
    let short = |a: Axis| if a == Axis::Channel { 'c' } else { 't' };
    s.name = format!("K{}-V{}-r{residual}", short(key), short(value));
    s.key = q(key);
    s.value = q(value);
    s.residual = residual;
    s.dtype = Dtype::F32;
    s
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    if den == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

/// Runs the study on captured layers. `query_positions` must be below the
/// captured length. `extra` schemes (any codec; activations are set to f32
/// here) are studied after the eight axis combinations — the codec study
/// of docs/accuracy.md, also how the codec presets' parameters were chosen
/// on a calibration text.
pub fn analyze(caps: &[Capture], cfg: &Config, query_positions: &[usize], extra: &[Scheme]) -> Result<LayerReport> {
    let (bits, group) = (2, 32);
    let heads = Heads::from_counts(cfg.q_heads as u32, cfg.kv_heads as u32);
    let d = cfg.head_dim;
    let (hq, hkv) = (cfg.q_heads, cfg.kv_heads);
    let mut combos = Vec::new();
    for residual in [128, 0] {
        for (k, v) in [
            (Axis::Channel, Axis::Token),
            (Axis::Token, Axis::Channel),
            (Axis::Channel, Axis::Channel),
            (Axis::Token, Axis::Token),
        ] {
            combos.push(axis_scheme(k, v, residual, bits, group).with_shape(heads, d as u32)?);
        }
    }
    // All-in bits of each scheme as declared (its own activation dtype sizes
    // the outlier corrections), though the study runs it with f32 activations.
    let mut all_in: Vec<f64> = combos.iter().map(kivi_spec::layout::bits_per_element).collect();
    for e in extra {
        all_in.push(kivi_spec::layout::bits_per_element(&e.with_shape(heads, d as u32)?));
        let mut e = e.clone();
        e.dtype = Dtype::F32;
        combos.push(e.with_shape(heads, d as u32)?);
    }
    let base = f32_scheme().with_shape(heads, d as u32)?;
    let tokens = caps.first().map_or(0, |c| c.k.len() / (hkv * d));
    let tasks: Vec<(usize, usize)> = (0..combos.len())
        .flat_map(|c| (0..caps.len()).map(move |l| (c, l)))
        .collect();
    let errs: Vec<Errors> = tasks
        .par_iter()
        .map(|&(ci, li)| -> Result<Errors> {
            let s = &combos[ci];
            let cap = &caps[li];
            let kview = cache_view(s, Tensor::Key, &cap.k)?;
            let vview = cache_view(s, Tensor::Value, &cap.v)?;
            let mut e = Errors {
                key: rel(&kview, &cap.k),
                value: rel(&vview, &cap.v),
                ..Errors::default()
            };
            let params = AttnParams {
                softmax_scale: cfg.softmax_scale,
                window: cfg.window(li),
            };
            let mut n = 0usize;
            for &t in query_positions {
                let len = (t + 1) * hkv * d;
                let (k, v) = (&cap.k[..len], &cap.v[..len]);
                // The cache as it stood when token t was decoded.
                let kq = cache_view(s, Tensor::Key, k)?;
                let vq = cache_view(s, Tensor::Value, v)?;
                let q = &cap.q[t * hq * d..(t + 1) * hq * d];
                let exact = decode_attention(&base, q, k, v, params)?;
                let approx = decode_attention(s, q, &kq, &vq, params)?;
                let start = params.window.map_or(0, |w| (t + 1).saturating_sub(w));
                for h in 0..hq {
                    let kh = h / (hq / hkv);
                    let qh = &q[h * d..(h + 1) * d];
                    let score = |kk: &[f32], j: usize| -> f32 {
                        let row = &kk[(j * hkv + kh) * d..][..d];
                        qh.iter().zip(row).map(|(a, b)| a * b).sum::<f32>() * params.softmax_scale
                    };
                    let se: Vec<f32> = (start..=t).map(|j| score(k, j)).collect();
                    let sq: Vec<f32> = (start..=t).map(|j| score(&kq, j)).collect();
                    e.score += rel(&sq, &se);
                    e.output += rel(&approx[h * d..(h + 1) * d], &exact[h * d..(h + 1) * d]);
                    n += 1;
                }
            }
            if n > 0 {
                e.score /= n as f64;
                e.output /= n as f64;
            }
            Ok(e)
        })
        .collect::<Result<_>>()?;
    let results = combos
        .iter()
        .enumerate()
        .map(|(ci, s)| {
            let per_layer: Vec<Errors> = errs[ci * caps.len()..(ci + 1) * caps.len()].to_vec();
            let n = per_layer.len().max(1) as f64;
            let mean = Errors {
                key: per_layer.iter().map(|e| e.key).sum::<f64>() / n,
                value: per_layer.iter().map(|e| e.value).sum::<f64>() / n,
                score: per_layer.iter().map(|e| e.score).sum::<f64>() / n,
                output: per_layer.iter().map(|e| e.output).sum::<f64>() / n,
            };
            let axis = |c: &Codec| c.quant().map_or("full", |q| axis_name(q.axis)).to_string();
            AxisResult {
                name: s.name.clone(),
                key_axis: axis(&s.key),
                value_axis: axis(&s.value),
                residual: s.residual,
                bits_per_element: all_in[ci],
                codec: ci >= 8,
                per_layer,
                mean,
            }
        })
        .collect();
    Ok(LayerReport {
        bits,
        group,
        tokens,
        query_positions: query_positions.to_vec(),
        global_layers: cfg.global_layers.clone(),
        results,
    })
}
