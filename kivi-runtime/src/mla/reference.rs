//! The MLA oracle: docs/semantics.md, "MLA caches", written plainly on
//! whole tensors. Each part's cache view is the ordinary oracle's
//! ([`crate::reference::cache_view`]) on that part's scheme
//! ([`kivi_spec::MlaParts`]), so the quantization semantics are the ones
//! every other scheme is held to; what is new here is only the absorbed
//! attention over the two views.

use crate::error::{Error, Result};
use crate::reference::{cache_view, round_inputs, AttnParams};
use kivi_spec::{Mla, Scheme, Tensor};

/// The MLA layout of a scheme, or a clear error.
pub fn mla_of(s: &Scheme) -> Result<Mla> {
    s.mla().ok_or_else(|| {
        Error::Config(format!(
            "scheme `{}` has no mla heads; the mla oracle serves `heads: mla(...)` schemes",
            s.name
        ))
    })
}

/// The softmax scale and window of an MLA scheme (`softmax_scale`, or
/// `1/sqrt(latent + rope_dim)`; its sliding window).
pub fn attn_params(s: &Scheme) -> Result<AttnParams> {
    let m = mla_of(s)?;
    Ok(AttnParams {
        softmax_scale: s.effective_softmax_scale(m.latent as usize),
        window: s.sliding_window.map(|w| w as usize),
    })
}

/// The cache's view of both parts: `(latent [T, L], rope [T, R])` — the
/// rounded value of sink and window tokens, the dequantized value of
/// quantized ones, each part by its own codec.
pub fn cache_views(s: &Scheme, latent: &[f32], rope: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
    let p = s.mla_parts().ok_or_else(|| mla_of(s).unwrap_err())?;
    let (l, r) = (p.mla.latent as usize, p.mla.rope_dim as usize);
    if !latent.len().is_multiple_of(l) || !rope.len().is_multiple_of(r) || latent.len() / l != rope.len() / r {
        return Err(Error::Shape {
            what: "latent/rope length",
            expected: format!("T x {l} and T x {r} for the same T"),
            got: format!("{} and {}", latent.len(), rope.len()),
        });
    }
    Ok((
        cache_view(&p.latent, Tensor::Key, latent)?,
        cache_view(&p.rope, Tensor::Key, rope)?,
    ))
}

/// Absorbed MLA decode attention of one query over cache views.
///
/// `q` is `[Hq, L + R]`: per head the absorbed latent query `q_latent_h`
/// (the head's `W_UK^T q_nope`) then its RoPE query `q_rope_h`, rounded to
/// the activation dtype first. `latent` is `[T, L]`, `rope` is `[T, R]`.
/// For each head, over the last `W` tokens (all without a window):
///
/// ```text
/// score_t = (q_latent_h . c_t + q_rope_h . k_rope_t) * scale
/// p = softmax(score);  out_h = sum_t p_t c_t
/// ```
///
/// Returns `[Hq, L]` (the up-projection `W_UV` is applied outside).
/// Accumulates in f64, like the other oracle.
pub fn decode_attention(s: &Scheme, q: &[f32], latent: &[f32], rope: &[f32], params: AttnParams) -> Result<Vec<f32>> {
    let m = mla_of(s)?;
    let (hq, l, r) = (m.q as usize, m.latent as usize, m.rope_dim as usize);
    let w = l + r;
    if q.len() != hq * w {
        return Err(Error::Shape {
            what: "query length",
            expected: format!("{} (q_heads x (latent + rope_dim))", hq * w),
            got: q.len().to_string(),
        });
    }
    if !latent.len().is_multiple_of(l) || rope.len() != latent.len() / l * r {
        return Err(Error::Shape {
            what: "latent/rope length",
            expected: format!("T x {l} and T x {r} for the same T"),
            got: format!("{} and {}", latent.len(), rope.len()),
        });
    }
    let q = round_inputs(s, "query", q, hq, w)?;
    let tokens = latent.len() / l;
    let start = params.window.map_or(0, |win| tokens.saturating_sub(win));
    let mut out = vec![0f32; hq * l];
    for h in 0..hq {
        let (ql, qr) = q[h * w..(h + 1) * w].split_at(l);
        let scores: Vec<f64> = (start..tokens)
            .map(|t| {
                let c = &latent[t * l..(t + 1) * l];
                let k = &rope[t * r..(t + 1) * r];
                let dot: f64 = ql.iter().zip(c).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                    + qr.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
                dot * params.softmax_scale as f64
            })
            .collect();
        if scores.is_empty() {
            continue; // an empty cache attends to nothing: the output is zero
        }
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let mut acc = vec![0f64; l];
        for (i, t) in (start..tokens).enumerate() {
            let p = weights[i] / sum;
            for (a, x) in acc.iter_mut().zip(&latent[t * l..(t + 1) * l]) {
                *a += p * *x as f64;
            }
        }
        for (o, a) in out[h * l..(h + 1) * l].iter_mut().zip(acc) {
            *o = a as f32;
        }
    }
    Ok(out)
}

/// The whole MLA oracle for one sequence: fill a cache with `latent`
/// (`[T, L]`) and `rope` (`[T, R]`), attend with `q` (`[Hq, L + R]`).
///
/// ```
/// use kivi_runtime::mla::reference;
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 4, axis = token, group = 32),
///     heads: mla(q = 2, latent = 32, rope_dim = 8) }").unwrap();
/// let (t, c, k) = (3, vec![0.5f32; 3 * 32], vec![0.25f32; 3 * 8]);
/// let q = vec![0.1f32; 2 * 40];
/// let out = reference::attend(&s, &q, &c, &k, reference::attn_params(&s).unwrap()).unwrap();
/// assert_eq!(out.len(), 2 * 32); // latent-wide output per head
/// assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-6)); // equal rows average to themselves
/// # let _ = t;
/// ```
pub fn attend(s: &Scheme, q: &[f32], latent: &[f32], rope: &[f32], params: AttnParams) -> Result<Vec<f32>> {
    let (cv, rv) = cache_views(s, latent, rope)?;
    decode_attention(s, q, &cv, &rv, params)
}
