//! What a zero point for `levels = nuq` could buy on Gemma 3's pre-RoPE
//! keys, measured offline before anyone changes the grammar
//! (docs/accuracy.md, "Two bits all-in", idea 2 of the 2-bit search).
//!
//! `cargo run --release -p kivi-eval --example key_offsets -- [TEXT]`
//!
//! For every layer it codes the pre-RoPE keys of TEXT (default: the
//! development text, MPL-2.0; tokens 4..768, past 4 sinks) per channel in
//! groups of G tokens at 2 bits in two ways with the same bytes (a scale and
//! a zero per group):
//!
//! - **uniform**: the oracle's own `group_params`/`encode`/`decode`
//!   (levels 0, 1/3, 2/3, 1 of `[lo, hi]`);
//! - **minmax nuq**: `y = (x - z) / s` with `s = hi - lo`, `z = lo`
//!   (rounded to f16 like the oracle's), the nearest of 4 levels in
//!   `[0, 1]` learned per layer by 1-D k-means on the calibration text
//!   (the bundled US Constitution, 1,024 tokens), each value weighted by its
//!   channel's query weight times `s^2`, so the fit minimises the same
//!   error that is reported.
//!
//! The error reported is the one the scores see: per channel, the squared
//! key error times the mean squared query of the channel's RoPE pair (the
//! part of the query weight no position's angle changes), summed, relative
//! to the same sum over the keys themselves. A ratio below 1 is what a
//! zero-pointed table would remove from the keys' share of the loss; it is
//! an estimate for the key codec alone, not a perplexity.

use kivi_eval::model::{Gemma3, Logits, Weights};
use kivi_runtime::quant::{decode, encode, group_params, round_to_scale};
use kivi_spec::{Axis, Levels, Quant, ScaleDtype};

const SINKS: usize = 4;

/// Pre-RoPE keys `[T, D]` (Gemma 3 270M has one KV head) and pair-mean
/// query weights `[D]` of every layer, for the first `n` tokens of `text`.
fn capture(model: &Gemma3, tok: &kivi_eval::tokenizer::Tokenizer, text: &str, n: usize) -> Vec<(Vec<f32>, Vec<f64>)> {
    let mut ids = vec![tok.bos()];
    ids.extend(tok.encode(text, false).into_iter().filter(|&t| t != tok.bos()));
    ids.truncate(n);
    let c = model.config().clone();
    let d = c.head_dim;
    assert_eq!(c.kv_heads, 1, "this experiment reads one KV head");
    let fwd = model.forward(&ids, Logits::None, true).expect("forward");
    fwd.layers
        .into_iter()
        .map(|cap| {
            let t = ids.len();
            let mut w = vec![0f64; d];
            for (i, q) in cap.q.iter().enumerate() {
                w[i % d] += (*q as f64).powi(2);
            }
            // RoPE (rotate-half) turns channel i with channel i + D/2: only
            // the pair's mean is position-free.
            let half = d / 2;
            for i in 0..half {
                let m = (w[i] + w[i + half]) / (2 * t * c.q_heads) as f64;
                w[i] = m;
                w[i + half] = m;
            }
            (cap.k_pre, w)
        })
        .collect()
}

/// Each channel-axis group of `g` tokens past the sinks (whole groups only):
/// `(channel, values)`.
fn groups(k: &[f32], d: usize, g: usize) -> Vec<(usize, Vec<f32>)> {
    let t = k.len() / d;
    let mut out = Vec::new();
    let mut start = SINKS;
    while start + g <= t {
        for c in 0..d {
            out.push((c, (start..start + g).map(|i| k[i * d + c]).collect()));
        }
        start += g;
    }
    out
}

/// `(s, z)` of a minmax group, rounded like the oracle's parameters.
fn minmax(v: &[f32]) -> (f32, f32) {
    let (lo, hi) = kivi_runtime::quant::group_lo_hi(v.iter().copied());
    (
        round_to_scale(hi - lo, ScaleDtype::F16),
        round_to_scale(lo, ScaleDtype::F16),
    )
}

fn nearest(y: f32, levels: &[f32]) -> f32 {
    *levels
        .iter()
        .min_by(|a, b| (y - **a).abs().total_cmp(&(y - **b).abs()))
        .expect("levels")
}

/// 1-D weighted k-means (Lloyd) of the normalised values, 4 levels, from
/// the uniform levels.
fn fit(samples: &[(f32, f64)]) -> Vec<f32> {
    let mut l = vec![0.0f32, 1.0 / 3.0, 2.0 / 3.0, 1.0];
    for _ in 0..100 {
        let mut sum = [0f64; 4];
        let mut wt = [0f64; 4];
        for &(y, w) in samples {
            let j = l
                .iter()
                .enumerate()
                .min_by(|a, b| (y - a.1).abs().total_cmp(&(y - b.1).abs()))
                .expect("levels")
                .0;
            sum[j] += w * y as f64;
            wt[j] += w;
        }
        let next: Vec<f32> = (0..4)
            .map(|j| if wt[j] > 0.0 { (sum[j] / wt[j]) as f32 } else { l[j] })
            .collect();
        if next == l {
            break;
        }
        l = next;
    }
    l.sort_by(f32::total_cmp);
    l
}

fn main() {
    let text_path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/usr/share/common-licenses/MPL-2.0".into());
    let text = std::fs::read_to_string(&text_path).expect("read the text");
    let path =
        kivi_eval::fetch::ensure_model(&kivi_eval::fetch::models_dir(), &mut |l| eprintln!("{l}")).expect("model");
    let (model, tok) = Gemma3::load(&path, 1025, Weights::F32).expect("load");
    let d = model.config().head_dim;
    let calib = capture(&model, &tok, kivi_eval::calibrate::CALIBRATION_TEXT, 1024);
    let eval = capture(&model, &tok, &text, 768);
    println!(
        "pre-RoPE keys, 2 bits per channel group; query-weighted key error relative to the keys' own weighted energy"
    );
    println!("calibration: US Constitution (1024 tokens); measured on {text_path} (tokens {SINKS}..768)\n");
    for g in [64usize, 48, 128] {
        let q = Quant {
            bits: 2,
            axis: Axis::Channel,
            group: g as u32,
            scale: ScaleDtype::F16,
            levels: Levels::Uniform,
        };
        println!("G = {g}\n\n| layer | uniform | minmax nuq | ratio | table |\n|---:|---:|---:|---:|---|");
        let (mut su, mut sn) = (0f64, 0f64);
        for (layer, ((ck, cw), (ek, ew))) in calib.iter().zip(&eval).enumerate() {
            // Fit on the calibration text: weight = query weight x s^2.
            let mut samples = Vec::new();
            for (c, v) in groups(ck, d, g) {
                let (s, z) = minmax(&v);
                if s > 0.0 {
                    samples.extend(v.iter().map(|x| ((x - z) / s, cw[c] * (s as f64).powi(2))));
                }
            }
            let table = fit(&samples);
            // Measure on the other text.
            let (mut eu, mut en, mut energy) = (0f64, 0f64, 0f64);
            for (c, v) in groups(ek, d, g) {
                let (p, _, _) = group_params(v.iter().copied(), &q);
                let (s, z) = minmax(&v);
                for x in &v {
                    let xu = decode(encode(*x, p, 3), p);
                    let xn = if s > 0.0 {
                        z + s * nearest((x - z) / s, &table)
                    } else {
                        z
                    };
                    eu += ew[c] * ((x - xu) as f64).powi(2);
                    en += ew[c] * ((x - xn) as f64).powi(2);
                    energy += ew[c] * (*x as f64).powi(2);
                }
            }
            let (ru, rn) = (eu / energy, en / energy);
            su += ru;
            sn += rn;
            println!(
                "| {layer} | {ru:.5} | {rn:.5} | {:.3} | {:.3} {:.3} {:.3} {:.3} |",
                rn / ru,
                table[0],
                table[1],
                table[2],
                table[3]
            );
        }
        let n = eval.len() as f64;
        println!("| mean | {:.5} | {:.5} | {:.3} | |\n", su / n, sn / n, sn / su);
    }
}
