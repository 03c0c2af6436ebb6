//! `kivi calibrate`: learn a scheme's calibrated parts (the `nuq` codebooks)
//! from Gemma 3 270M's own K/V on a calibration text, and write them to a
//! calibration file ([`kivi_runtime::calib`]).
//!
//! Protocol: the text is cut into chunks of `chunk` tokens (each starting
//! with `<bos>`, as a fresh sequence); every chunk goes through the plain
//! forward once with every layer's q/k/v captured; keys before RoPE are
//! recovered from the captured keys by the inverse rotation. Per layer the
//! calibration gets the channel RMS of keys (before and after RoPE) and
//! values, and a codebook for every `levels = nuq` tensor and product
//! codebooks for every `vq(...)` tensor of every scheme asked for. The default text, the US Constitution, is disjoint from the
//! evaluation texts (the Declaration of Independence bundled for
//! `kivi eval`, the GPL v3 of docs/accuracy.md).

use crate::error::{Error, Result};
use crate::fetch;
use crate::model::{Config, Gemma3, Logits, Weights};
use kivi_runtime::calib::{Calibration, FitOptions, FitReport, LayerSamples, ModelId, Stage};
use kivi_spec::{Scheme, Tensor};
use std::path::{Path, PathBuf};

/// The calibration text used when none is given: the Constitution of the
/// United States (public domain; `eval/data/README.md` says where the copy
/// comes from).
pub const CALIBRATION_TEXT: &str = include_str!("../data/us-constitution.txt");

/// How reports name [`CALIBRATION_TEXT`].
pub const CALIBRATION_TEXT_NAME: &str = "the US Constitution (bundled)";

/// What to calibrate.
#[derive(Clone, Debug)]
pub struct CalibConfig {
    /// A GGUF file; `None` fetches (or reuses) the cached Gemma 3 270M.
    pub model: Option<PathBuf>,
    /// A text file; `None` uses [`CALIBRATION_TEXT`].
    pub text: Option<PathBuf>,
    /// Tokens of the text to use (at most; fewer if the text is shorter).
    pub tokens: usize,
    /// Tokens per forward pass (one sequence each).
    pub chunk: usize,
    /// Schemes whose `nuq` tensors get codebooks (none: statistics only).
    pub schemes: Vec<Scheme>,
    pub fit: FitOptions,
    pub weights: Weights,
}

impl Default for CalibConfig {
    fn default() -> Self {
        CalibConfig {
            model: None,
            text: None,
            tokens: 4096,
            chunk: 1024,
            schemes: Vec::new(),
            fit: FitOptions::default(),
            weights: Weights::F32,
        }
    }
}

/// Where a calibration run is, for a progress bar.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// A line of news (model loaded, text read).
    Note(String),
    /// `done` of `total` forward passes finished.
    Forward { done: usize, total: usize },
    /// `done` of `total` codebooks fitted.
    Fit { done: usize, total: usize },
}

/// The keys before RoPE, from keys after it (`[T, Hkv, D]`, positions
/// `0..T`): candle's rotation (`x1 cos - x2 sin`, `x2 cos + x1 sin` on the
/// two halves of each head) undone with the same angles, `pos * base^(-2i/D)`
/// in f32 as the model's tables compute them.
pub fn unrope(k: &[f32], kv_heads: usize, head_dim: usize, base: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let mut out = k.to_vec();
    for (row_i, row) in out.chunks_exact_mut(head_dim).enumerate() {
        let pos = (row_i / kv_heads) as f32;
        for (i, f) in inv.iter().enumerate() {
            let a = pos * f;
            let (c, s) = (a.cos(), a.sin());
            let (y1, y2) = (row[i], row[i + half]);
            row[i] = y1 * c + y2 * s;
            row[i + half] = y2 * c - y1 * s;
        }
    }
    out
}

fn rope_base(c: &Config, layer: usize) -> f32 {
    if c.global_layers.contains(&layer) {
        c.rope_global
    } else {
        c.rope_local
    }
}

/// The model's identity: its file name and SHA-256 (the known one for the
/// fetched, verified file; computed for any other).
fn model_name(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let name = path
        .file_name()
        .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    if fetch::verify(path).is_ok() {
        return Ok(format!("{name} sha256:{}", fetch::MODEL_SHA256));
    }
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{name} sha256:{hex}"))
}

/// Runs the calibration; returns the calibration and one report per
/// fitted codebook.
pub fn run(cfg: &CalibConfig, progress: &mut dyn FnMut(Step)) -> Result<(Calibration, Vec<FitReport>)> {
    if cfg.chunk < 2 || cfg.tokens < 2 {
        return Err(Error::Config(format!(
            "chunk {} and tokens {} must be at least 2",
            cfg.chunk, cfg.tokens
        )));
    }
    let (text, text_name) = match &cfg.text {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?,
            p.display().to_string(),
        ),
        None => (CALIBRATION_TEXT.to_string(), CALIBRATION_TEXT_NAME.to_string()),
    };
    let path = match &cfg.model {
        Some(p) => p.clone(),
        None => fetch::ensure_model(&fetch::models_dir(), &mut |l| progress(Step::Note(l.to_string())))?,
    };
    let (model, tok) = Gemma3::load(&path, cfg.chunk + 1, cfg.weights)?;
    let c = model.config().clone();
    // Chunks of `chunk` tokens, each a fresh sequence opening with <bos>.
    let mut ids = tok.encode(&text, false);
    if ids.first() == Some(&tok.bos()) {
        ids.remove(0);
    }
    ids.truncate(cfg.tokens);
    let chunks: Vec<Vec<u32>> = ids
        .chunks(cfg.chunk - 1)
        .filter(|ch| ch.len() >= 16)
        .map(|ch| std::iter::once(tok.bos()).chain(ch.iter().copied()).collect())
        .collect();
    if chunks.is_empty() {
        return Err(Error::Config(format!("{text_name} has too few tokens to calibrate on")));
    }
    let used: usize = chunks.iter().map(|c| c.len()).sum();
    progress(Step::Note(format!(
        "model {} loaded; {text_name}: {} tokens, using {used} in {} chunks",
        path.display(),
        ids.len(),
        chunks.len()
    )));
    let mut samples: Vec<LayerSamples> = Vec::new();
    for (i, ch) in chunks.iter().enumerate() {
        let fwd = model.forward(ch, Logits::None, true)?;
        for (layer, cap) in fwd.layers.into_iter().enumerate() {
            let mut s = LayerSamples::new(layer, ch.len(), c.q_heads, c.kv_heads, c.head_dim, cap.k, cap.v);
            s.keys_pre_rope = Some(unrope(&s.keys, c.kv_heads, c.head_dim, rope_base(&c, layer)));
            // Queries only weight the fit; without weighting they would
            // double the memory a run holds.
            s.queries = cfg.fit.weighted.then_some(cap.q);
            samples.push(s);
        }
        progress(Step::Forward {
            done: i + 1,
            total: chunks.len(),
        });
    }
    let model_id = ModelId {
        name: model_name(&path)?,
        layers: c.layers as u32,
        kv_heads: c.kv_heads as u32,
        head_dim: c.head_dim as u32,
    };
    let mut cal = Calibration::new(
        model_id,
        format!(
            "{text_name}: {used} tokens in {} chunks of at most {}; k-means {} iterations{}",
            chunks.len(),
            cfg.chunk,
            cfg.fit.iterations,
            if cfg.fit.weighted {
                ", keys weighted by mean q^2 per channel"
            } else {
                ""
            }
        ),
    );
    cal.add_channel_rms(&samples).map_err(kivi_runtime::Error::from)?;
    // Low-rank bases (low_rank: pca(...)) for every layer: keys after and
    // before RoPE, values; a scheme of any rank takes a prefix.
    progress(Step::Note(
        "fitting low-rank bases (PCA of K/V per layer and KV head)".into(),
    ));
    for layer in 0..c.layers {
        // One layer at a time, so that each line reports progress.
        let mine: Vec<LayerSamples> = samples.iter().filter(|x| x.layer == layer).cloned().collect();
        let bases = cal.fit_bases(&mine).map_err(kivi_runtime::Error::from)?;
        let mut line = format!("basis {}/{}: layer {layer:2} energy kept at rank", layer + 1, c.layers);
        for r in kivi_runtime::low_rank::REPORT_RANKS
            .into_iter()
            .filter(|&r| r <= c.head_dim)
        {
            line += &format!(" {r}:");
            for (t, st, tag) in [
                (Tensor::Key, Stage::PostRope, "k"),
                (Tensor::Key, Stage::PreRope, "kpre"),
                (Tensor::Value, Stage::PostRope, "v"),
            ] {
                // Mean over KV heads.
                let e: Vec<f64> = bases
                    .iter()
                    .filter(|b| b.tensor == t && b.stage == st)
                    .filter_map(|b| b.energy.iter().find(|(k, _)| *k == r).map(|x| x.1))
                    .collect();
                if !e.is_empty() {
                    line += &format!(" {tag} {:.3}", e.iter().sum::<f64>() / e.len() as f64);
                }
            }
        }
        progress(Step::Note(line));
    }
    let total = cfg.schemes.len() * c.layers;
    let mut reports = Vec::new();
    for (i, s) in cfg.schemes.iter().enumerate() {
        // One layer at a time, so the bar moves.
        for layer in 0..c.layers {
            let mine: Vec<LayerSamples> = samples.iter().filter(|x| x.layer == layer).cloned().collect();
            reports.extend(
                cal.fit_codebooks(s, &mine, cfg.fit)
                    .map_err(kivi_runtime::Error::from)?,
            );
            progress(Step::Fit {
                done: i * c.layers + layer + 1,
                total,
            });
        }
        // Product codebooks (`vq(...)`): all layers at once, since a named
        // codebook pools every layer that shares it.
        if s.has_vq() {
            let fits = cal
                .fit_vq(
                    s,
                    &samples,
                    kivi_runtime::vq::VqFitOptions {
                        keep_existing: true,
                        ..Default::default()
                    },
                )
                .map_err(kivi_runtime::Error::from)?;
            for r in fits {
                progress(Step::Note(format!(
                    "{}: vq layer {} {} ({}): {} rows, relative mse {:.4}",
                    s.name,
                    r.layer,
                    r.tensor.name(),
                    r.fit,
                    r.rows,
                    r.mse / r.mean_square.max(f64::MIN_POSITIVE)
                )));
            }
        }
    }
    Ok((cal, reports))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `unrope` inverts the model's RoPE: rotate rows with candle's own
    /// kernel, undo them, compare.
    #[test]
    fn unrope_inverts_candles_rope() {
        use candle_core::{Device, Tensor};
        let (t, h, d, base) = (37usize, 2usize, 16usize, 10_000f32);
        let half = d / 2;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in 0..t {
            for i in 0..half {
                let a = p as f32 * (1.0 / base.powf((2 * i) as f32 / d as f32));
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let dev = Device::Cpu;
        let mut rng = kivi_runtime::rand::Rng::new(4);
        let x = rng.vec(t * h * d);
        // [T, H, D] -> [1, H, T, D] for candle, and back.
        let xt = Tensor::from_slice(&x, (t, h, d), &dev)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let cos = Tensor::from_vec(cos, (t, half), &dev).unwrap();
        let sin = Tensor::from_vec(sin, (t, half), &dev).unwrap();
        let y = candle_nn::rotary_emb::rope(&xt.contiguous().unwrap(), &cos, &sin).unwrap();
        let y: Vec<f32> = y
            .squeeze(0)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3),
            "rope changed nothing"
        );
        let back = unrope(&y, h, d, base);
        let err = back.iter().zip(&x).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 1e-5, "max error {err}");
    }
}
