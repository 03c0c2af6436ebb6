//! The evaluation: perplexity, KL divergence and top-1 agreement of each
//! scheme's cache against the f32 cache, on a real text, teacher-forced.
//!
//! Protocol: the first `prefix` tokens go through the plain forward once and
//! their K/V are written into every scheme's cache (`extend`: the prefix is
//! quantized like any other tokens). Then every scheme decodes the rest of the
//! text one token at a time, in lockstep (one batch, one row per scheme), each
//! reading its own quantized cache; at every step its next-token distribution
//! is compared with the f32 row's. Only decode steps are scored: the prefix
//! logits never read a quantized cache.

use crate::error::{Error, Result};
use crate::fetch;
use crate::kv::resolve_scheme;
use crate::layers::{self, LayerReport};
use crate::model::{log_softmax_rows, Config, Gemma3, Logits, Weights};
use kivi_spec::{Codec, Heads, Levels, Scheme, Tensor};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The schemes of the accuracy table, in its order.
pub const DEFAULT_SCHEMES: [&str; 8] = ["f32", "f16", "int8", "kivi4", "kivi2", "kivi2_r0", "swapped2", "tok4"];

/// The text used when none is given: the US Declaration of Independence
/// (public domain), bundled so that the evaluation runs on any machine
/// (`eval/data/README.md` says where the copy comes from). The numbers in
/// docs/accuracy.md were measured on the GNU GPL v3 instead
/// (`--text /usr/share/common-licenses/GPL-3` on Debian).
pub const DEFAULT_TEXT: &str = include_str!("../data/us-declaration.txt");

/// How reports name [`DEFAULT_TEXT`].
pub const DEFAULT_TEXT_NAME: &str = "the US Declaration of Independence (bundled)";

/// What to evaluate.
#[derive(Clone, Debug)]
pub struct EvalConfig {
    /// A GGUF file; `None` fetches (or reuses) the cached Gemma 3 270M.
    pub model: Option<PathBuf>,
    /// A text file; `None` uses the bundled [`DEFAULT_TEXT`].
    pub text: Option<PathBuf>,
    /// Tokens (BOS included) prefilled before decoding starts.
    pub prefix: usize,
    /// Tokens of the text used in all (BOS included).
    pub tokens: usize,
    /// Schemes (see [`resolve_scheme`]); `f32` is always run as the baseline.
    pub schemes: Vec<String>,
    /// Model declarations (`kivi_spec::parse_model`), each run as one row
    /// with its own scheme on every layer, after the schemes.
    pub models: Vec<kivi_spec::ModelDecl>,
    /// Run the per-layer axis study.
    pub layers: bool,
    /// Query positions per layer in the axis study.
    pub layer_queries: usize,
    /// How the model's matmul weights are held.
    pub weights: Weights,
    /// Extra schemes for the per-layer study (the codec study).
    pub study: Vec<Scheme>,
    /// Run the teacher-forced decode (perplexity, KL); `false` runs only the
    /// plain forward and the per-layer study (to choose parameters on a
    /// calibration text quickly).
    pub decode: bool,
    /// A calibration file (`kivi calibrate`) for schemes with
    /// `levels = nuq`; its hash is reported with the results.
    pub calibration: Option<PathBuf>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            model: None,
            text: None,
            prefix: 256,
            tokens: 768,
            schemes: DEFAULT_SCHEMES.iter().map(|s| s.to_string()).collect(),
            models: Vec::new(),
            layers: true,
            layer_queries: 8,
            weights: Weights::F32,
            study: Vec::new(),
            decode: true,
            calibration: None,
        }
    }
}

/// One scheme's row of the table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SchemeResult {
    pub name: String,
    /// The scheme bound to the model's shape, canonical text.
    pub canonical: String,
    /// Key and value codec, short (`2c32`: 2-bit per-channel groups of 32).
    pub key: String,
    pub value: String,
    /// Residual window (full-precision recent tokens): the largest over
    /// the layers (a model declaration's layers may differ; see
    /// `residual_min`).
    pub residual: u32,
    /// The smallest residual window over the layers (= `residual` for a
    /// plain scheme).
    pub residual_min: u32,
    /// Attention sinks: the largest over the layers.
    pub sinks: u32,
    /// The fewest attention sinks over the layers.
    pub sinks_min: u32,
    /// Bytes per quantized token per KV head, K + V: codes, parameters and
    /// sparse outliers.
    pub bytes_per_token_per_head: f64,
    /// All-in bits per element: the same over the 2 x head_dim elements
    /// ([`kivi_spec::layout::bits_per_element`]; kivi2 is 3.0).
    pub bits_per_element: f64,
    /// Exact bytes the caches of all layers held at the end of the run.
    pub cache_bytes: usize,
    /// The scheme of each layer (a model declaration's row; one name
    /// repeated for a plain scheme).
    pub layer_schemes: Vec<String>,
    /// K/V payload per token, all layers summed, at the run's context
    /// (`tokens`), sliding layers holding only their window
    /// ([`crate::policy::model_bytes`] over `tokens`): the honest budget.
    pub kv_bytes_per_token: f64,
    /// The same at 32k tokens (sliding layers hold 512 of them).
    pub kv_bytes_per_token_32k: f64,
    pub perplexity: f64,
    pub mean_nll: f64,
    /// Mean KL(p_f32 || p_scheme) per decoded token, nats.
    pub kl_mean: f64,
    pub kl_max: f64,
    /// Fraction of decode steps whose argmax equals the f32 cache's.
    pub top1_agreement: f64,
    /// Fraction of decode steps whose argmax is the text's next token.
    pub top1_accuracy: f64,
}

/// The plain forward vs the cached f32 decode, same weights, same tokens.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReferenceCheck {
    /// Position whose logits were compared.
    pub position: usize,
    pub max_abs_logit_diff: f64,
    /// Spread of the reference logits there (max - min), for scale.
    pub logit_range: f64,
    pub same_argmax: bool,
}

/// Wall time of each phase, seconds.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Timings {
    pub fetch_and_load: f64,
    pub prefill: f64,
    pub decode: f64,
    pub reference_forward: f64,
    pub layer_study: f64,
    pub total: f64,
}

/// Everything `kivi eval` prints.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub model_file: String,
    pub model: Config,
    pub text: String,
    pub text_tokens: usize,
    pub prefix: usize,
    pub tokens: usize,
    /// Decode steps scored per scheme.
    pub scored_tokens: usize,
    pub threads: usize,
    pub weights: Weights,
    pub schemes: Vec<SchemeResult>,
    pub reference_check: ReferenceCheck,
    pub layers: Option<LayerReport>,
    pub seconds: Timings,
}

/// A tensor's codec, short: `2c32` (2-bit per-channel groups of 32), then
/// the pipeline: `·lm` Lloyd–Max (`·lm2` with the l2 norm), `·H256`
/// Hadamard blocks (`s` with signs), `·o2` outliers per token, `·μ32`
/// centering on the first 32 tokens; `vq8x256` a product quantizer of
/// 8-channel sub-vectors and 256 centroids (`·NAME` when shared).
pub fn codec_short(s: &Scheme, t: Tensor) -> String {
    // A low-rank tensor: `pcaR·` before how its coordinates are stored.
    let pca = s.rank_of(t).map_or(String::new(), |r| format!("pca{r}·"));
    let q = match s.codec(t) {
        Codec::Full => return format!("{pca}{}", s.dtype.name()),
        Codec::Vq(v) => {
            let mut o = format!("{pca}vq{}x{}", v.dim, v.entries);
            if let Some(n) = v.codebook {
                o += &format!("·{n}");
            }
            return o;
        }
        Codec::Quant(q) => q,
    };
    let mut o = format!(
        "{pca}{}{}{}",
        q.bits,
        if q.axis == kivi_spec::Axis::Channel { 'c' } else { 't' },
        q.group
    );
    match q.levels {
        Levels::Uniform => {}
        Levels::LloydMax(kivi_spec::Norm::Rms) => o += "·lm",
        Levels::LloydMax(kivi_spec::Norm::L2) => o += "·lm2",
        Levels::Nuq(kivi_spec::Norm::Rms) => o += "·nuq",
        Levels::Nuq(kivi_spec::Norm::L2) => o += "·nuq2",
        // A table over [0, 1] with a zero point (norm = minmax).
        Levels::LloydMax(kivi_spec::Norm::MinMax) | Levels::Nuq(kivi_spec::Norm::MinMax) => o += "·nuqz",
        // The same with the table's ends pinned at 0 and 1.
        Levels::LloydMax(kivi_spec::Norm::MinMaxPinned) | Levels::Nuq(kivi_spec::Norm::MinMaxPinned) => o += "·nuqp",
    }
    if let Some(r) = s.rotation_of(t) {
        o += &format!("·H{}{}", r.block, if r.signs.is_some() { "s" } else { "" });
    }
    if s.outliers_of(t) > 0 {
        o += &format!("·o{}", s.outliers_of(t));
    }
    if let Some(n) = s.center_of(t) {
        o += &format!("·μ{n}");
    }
    o
}

/// Runs the evaluation; `log` gets progress lines.
pub fn run(cfg: &EvalConfig, log: &mut dyn FnMut(&str)) -> Result<Report> {
    let t0 = Instant::now();
    if cfg.prefix == 0 || cfg.prefix + 2 > cfg.tokens {
        return Err(Error::Config(format!(
            "prefix {} must be at least 1 and at least 2 below tokens {}",
            cfg.prefix, cfg.tokens
        )));
    }
    let mut names: Vec<String> = vec!["f32".into()];
    for n in &cfg.schemes {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    let schemes = names.iter().map(|n| resolve_scheme(n)).collect::<Result<Vec<_>>>()?;
    for m in &cfg.models {
        if names.contains(&m.name) {
            return Err(Error::Config(format!(
                "model `{}` has the name of another row; rename it",
                m.name
            )));
        }
        names.push(m.name.clone());
    }
    let (text, text_name) = match &cfg.text {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?,
            p.display().to_string(),
        ),
        None => (DEFAULT_TEXT.to_string(), DEFAULT_TEXT_NAME.to_string()),
    };

    let path = match &cfg.model {
        Some(p) => p.clone(),
        None => fetch::ensure_model(&fetch::models_dir(), log)?,
    };
    let (model, tok) = Gemma3::load(&path, cfg.tokens + 1, cfg.weights)?;
    let calibration = match &cfg.calibration {
        Some(p) => {
            let c = kivi_runtime::calib::Calibration::load(p).map_err(kivi_runtime::Error::from)?;
            log(&format!(
                "calibration {} (hash {:016x}) for {}: {}",
                p.display(),
                c.hash(),
                c.model,
                c.source
            ));
            Some(c)
        }
        None => None,
    };
    let mc = model.config().clone();
    let layout = crate::policy::ModelLayout::of(&mc);
    // One row per scheme (the same on every layer), then one per model
    // declaration (a scheme per layer).
    let mut rows: Vec<Vec<Scheme>> = schemes.iter().map(|s| vec![s.clone()]).collect();
    for m in &cfg.models {
        rows.push(crate::policy::resolve_model(m, &layout)?);
    }
    let all_ids = tok.encode(&text, false);
    if all_ids.len() < cfg.tokens {
        return Err(Error::Config(format!(
            "{} has {} tokens, fewer than the {} asked for",
            text_name,
            all_ids.len(),
            cfg.tokens
        )));
    }
    let ids = &all_ids[..cfg.tokens];
    let mut times = Timings {
        fetch_and_load: t0.elapsed().as_secs_f64(),
        ..Timings::default()
    };
    log(&format!(
        "model {} loaded; text {} tokens, using {} ({} prefilled, {} decoded) x {} schemes",
        path.display(),
        all_ids.len(),
        cfg.tokens,
        cfg.prefix,
        cfg.tokens - 1 - cfg.prefix,
        rows.len()
    ));

    let steps = cfg.tokens - 1 - cfg.prefix;
    let n = if cfg.decode { rows.len() } else { 0 };
    // Prefill once, unquantized; every cache gets the same K/V.
    let t = Instant::now();
    let pre = model.forward(&ids[..if cfg.decode { cfg.prefix } else { 1 }], Logits::None, true)?;
    let mut caches = rows[..n]
        .iter()
        .map(|s| model.new_cache_calibrated(s, cfg.tokens, calibration.as_ref()))
        .collect::<Result<Vec<_>>>()?;
    for c in caches.iter_mut() {
        model.fill_cache(c, &pre)?;
    }
    drop(pre);
    times.prefill = t.elapsed().as_secs_f64();

    // Decode in lockstep; row 0 is the f32 baseline.
    let t = Instant::now();
    let mut nll = vec![0f64; n];
    let mut kl = vec![0f64; n];
    let mut kl_max = vec![0f64; n];
    let mut agree = vec![0usize; n];
    let mut correct = vec![0usize; n];
    let mut last_f32: Vec<f32> = Vec::new();
    for (k, pos) in (cfg.prefix..cfg.tokens - 1).enumerate().filter(|_| cfg.decode) {
        let toks = vec![ids[pos]; n];
        let mut refs: Vec<&mut kivi_candle::KiviKvCache> = caches.iter_mut().collect();
        let logits = model.step(&toks, &mut refs)?;
        if pos == cfg.tokens - 2 {
            last_f32 = logits.get(0)?.to_vec1()?;
        }
        let lsm = log_softmax_rows(&logits)?;
        let target = ids[pos + 1] as usize;
        let argmax = |r: &[f64]| r.iter().enumerate().fold(0, |b, (i, x)| if *x > r[b] { i } else { b });
        let base = &lsm[0];
        let base_top = argmax(base);
        let stats: Vec<(f64, f64, bool, bool)> = lsm
            .par_iter()
            .map(|r| {
                let d: f64 = base.iter().zip(r).map(|(p, q)| p.exp() * (p - q)).sum();
                let top = argmax(r);
                (-r[target], d.max(0.0), top == base_top, top == target)
            })
            .collect();
        for (s, (l, d, a, c)) in stats.into_iter().enumerate() {
            nll[s] += l;
            kl[s] += d;
            kl_max[s] = kl_max[s].max(d);
            agree[s] += a as usize;
            correct[s] += c as usize;
        }
        if (k + 1) % 64 == 0 || k + 1 == steps {
            log(&format!(
                "decoded {}/{steps} tokens ({:.1} s); running ppl f32 {:.3}",
                k + 1,
                t.elapsed().as_secs_f64(),
                (nll[0] / (k + 1) as f64).exp()
            ));
        }
    }
    times.decode = t.elapsed().as_secs_f64();

    // The plain forward over the same tokens: a check of the cached path,
    // and the captured K/V/Q for the per-layer study.
    let t = Instant::now();
    let full = model.forward(&ids[..cfg.tokens - 1], Logits::Last, cfg.layers)?;
    let ref_last: Vec<f32> = full
        .logits
        .as_ref()
        .ok_or_else(|| Error::Config("no logits".into()))?
        .get(0)?
        .to_vec1()?;
    if !cfg.decode {
        last_f32 = ref_last.clone();
    }
    let max_abs = ref_last
        .iter()
        .zip(&last_f32)
        .map(|(a, b)| (*a as f64 - *b as f64).abs())
        .fold(0f64, f64::max);
    let (lo, hi) = ref_last
        .iter()
        .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    let am = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, x)| if *x > r[b] { i } else { b });
    let reference_check = ReferenceCheck {
        position: cfg.tokens - 2,
        max_abs_logit_diff: max_abs,
        logit_range: (hi - lo) as f64,
        same_argmax: am(&ref_last) == am(&last_f32),
    };
    times.reference_forward = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let layer_report = if cfg.layers {
        let q = cfg.layer_queries.max(1);
        let last = cfg.tokens - 2;
        // Evenly spaced over the decoded range, ending at the last token.
        let positions: Vec<usize> = (0..q).map(|i| cfg.prefix + (last - cfg.prefix) * (i + 1) / q).collect();
        log(&format!("per-layer study at query positions {positions:?}"));
        Some(layers::analyze(&full.layers, &mc, &positions, &cfg.study)?)
    } else {
        None
    };
    times.layer_study = t.elapsed().as_secs_f64();

    let heads = Heads::from_counts(mc.q_heads as u32, mc.kv_heads as u32);
    let results = rows[..n]
        .iter()
        .enumerate()
        .map(|(s, per_layer)| -> Result<SchemeResult> {
            let bound = per_layer
                .iter()
                .map(|sc| sc.with_shape(heads, mc.head_dim as u32))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let uniform = bound
                .iter()
                .all(|b| kivi_spec::canonical(b) == kivi_spec::canonical(&bound[0]));
            let mean = |f: &dyn Fn(&Scheme) -> f64| bound.iter().map(f).sum::<f64>() / bound.len() as f64;
            let same = |f: &dyn Fn(&Scheme) -> String| {
                let v = f(&bound[0]);
                if bound.iter().all(|b| f(b) == v) {
                    v
                } else {
                    "per layer".to_string()
                }
            };
            let per_token = |ctx: usize| -> Result<f64> {
                Ok(crate::policy::model_bytes(per_layer, &layout, ctx)? as f64 / ctx as f64)
            };
            Ok(SchemeResult {
                // A scheme row keeps its scheme's own name (a file's or
                // text's), a model row the declaration's.
                name: schemes.get(s).map_or_else(|| names[s].clone(), |sc| sc.name.clone()),
                canonical: if uniform {
                    kivi_spec::canonical(&bound[0])
                } else {
                    crate::policy::declaration(&names[s], &layout, &bound, "")?
                },
                key: same(&|b| codec_short(b, Tensor::Key)),
                value: same(&|b| codec_short(b, Tensor::Value)),
                residual: bound.iter().map(|b| b.residual).max().unwrap_or(0),
                residual_min: bound.iter().map(|b| b.residual).min().unwrap_or(0),
                sinks: bound.iter().map(|b| b.sinks).max().unwrap_or(0),
                sinks_min: bound.iter().map(|b| b.sinks).min().unwrap_or(0),
                bytes_per_token_per_head: mean(&|b| {
                    let (x, per) = kivi_spec::layout::bytes_per_token_per_head(b);
                    x as f64 / per as f64
                }),
                bits_per_element: mean(&|b| kivi_spec::layout::bits_per_element(b)),
                cache_bytes: caches[s].memory_bytes(),
                layer_schemes: (0..mc.layers)
                    .map(|l| bound[l.min(bound.len() - 1)].name.clone())
                    .collect(),
                kv_bytes_per_token: per_token(cfg.tokens)?,
                kv_bytes_per_token_32k: per_token(32 * 1024)?,
                perplexity: (nll[s] / steps as f64).exp(),
                mean_nll: nll[s] / steps as f64,
                kl_mean: kl[s] / steps as f64,
                kl_max: kl_max[s],
                top1_agreement: agree[s] as f64 / steps as f64,
                top1_accuracy: correct[s] as f64 / steps as f64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    times.total = t0.elapsed().as_secs_f64();
    Ok(Report {
        model_file: path.display().to_string(),
        model: mc,
        text: text_name,
        text_tokens: all_ids.len(),
        prefix: cfg.prefix,
        tokens: cfg.tokens,
        scored_tokens: steps,
        threads: rayon::current_num_threads(),
        weights: cfg.weights,
        schemes: results,
        reference_check,
        layers: layer_report,
        seconds: times,
    })
}

impl Report {
    /// The report as Markdown tables (what docs/accuracy.md shows).
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let file = Path::new(&self.model_file)
            .file_name()
            .map_or(self.model_file.clone(), |f| f.to_string_lossy().into_owned());
        s += &format!(
            "Model `{file}` ({} layers, {} query heads, {} KV head(s), head_dim {}); text `{}` ({} tokens), \
             first {} tokens: {} prefilled, {} decoded and scored; {} threads.\n\n",
            self.model.layers,
            self.model.q_heads,
            self.model.kv_heads,
            self.model.head_dim,
            self.text,
            self.text_tokens,
            self.tokens,
            self.prefix,
            self.scored_tokens,
            self.threads
        );
        s += "| scheme | K | V | R | S | bytes/token/head | all-in bits/elem | cache (all layers) | perplexity | Δ ppl vs f32 | mean KL (nats) | max KL | top-1 agree | top-1 acc |\n";
        s += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
        let base = self.schemes.first().map_or(f64::NAN, |r| r.perplexity);
        for r in &self.schemes {
            // A model row's layers may differ: print the range.
            let range = |lo: u32, hi: u32| {
                if lo == hi {
                    hi.to_string()
                } else {
                    format!("{lo}–{hi}")
                }
            };
            s += &format!(
                "| {} | {} | {} | {} | {} | {:.1} | {:.3} | {:.2} MiB | {:.4} | {:+.4} ({:+.1}%) | {:.5} | {:.4} | {:.2}% | {:.2}% |\n",
                r.name,
                r.key,
                r.value,
                range(r.residual_min, r.residual),
                range(r.sinks_min, r.sinks),
                r.bytes_per_token_per_head,
                r.bits_per_element,
                r.cache_bytes as f64 / (1 << 20) as f64,
                r.perplexity,
                r.perplexity - base,
                100.0 * (r.perplexity / base - 1.0),
                r.kl_mean,
                r.kl_max,
                100.0 * r.top1_agreement,
                100.0 * r.top1_accuracy
            );
        }
        s += &format!(
            "\nK/V bytes per token, all layers summed (exact payload at the context, windows included; \
             sliding layers hold only their last {} tokens), and all-in bits per element averaged over layers \
             (every layer alike, windows excluded):\n\n",
            self.model.sliding_window
        );
        s += &format!(
            "| scheme | layers | mean all-in bits/elem | K/V bytes/token at {} tokens | vs f16 | at 32k tokens | vs f16 |\n\
             |---|---|---|---|---|---|---|\n",
            self.tokens
        );
        let f16_at = |ctx: usize| -> f64 {
            let held: usize = (0..self.model.layers)
                .map(|l| self.model.window(l).map_or(ctx, |w| ctx.min(w)))
                .sum();
            (held * 2 * self.model.head_dim * self.model.kv_heads * 2) as f64 / ctx as f64
        };
        for r in &self.schemes {
            let mut counts: Vec<(&str, usize)> = Vec::new();
            for n in &r.layer_schemes {
                match counts.iter_mut().find(|c| c.0 == n) {
                    Some(c) => c.1 += 1,
                    None => counts.push((n, 1)),
                }
            }
            let layers: Vec<String> = counts.iter().map(|(n, c)| format!("{n} x{c}")).collect();
            s += &format!(
                "| {} | {} | {:.3} | {:.1} | {:.2}x | {:.1} | {:.2}x |\n",
                r.name,
                layers.join(", "),
                r.bits_per_element,
                r.kv_bytes_per_token,
                f16_at(self.tokens) / r.kv_bytes_per_token,
                r.kv_bytes_per_token_32k,
                f16_at(32 * 1024) / r.kv_bytes_per_token_32k
            );
        }
        let rc = &self.reference_check;
        s += &format!(
            "\nReference check (plain full-sequence forward vs cached f32 decode, position {}): max |Δ logit| = {:.2e} \
             (logit range {:.1}), same argmax: {}.\n",
            rc.position, rc.max_abs_logit_diff, rc.logit_range, rc.same_argmax
        );
        if let Some(l) = &self.layers {
            s += &format!(
                "\nPer-layer study: {}-bit, group {}, {} tokens of real K/V, queries at positions {:?}; \
                 relative errors (‖x̂ − x‖ / ‖x‖), mean over layers:\n\n",
                l.bits, l.group, l.tokens, l.query_positions
            );
            s += "| K axis / V axis, window | key | value | scores | attention output |\n|---|---|---|---|---|\n";
            for r in l.results.iter().filter(|r| !r.codec) {
                s += &format!(
                    "| {} ({} / {}, R = {}) | {:.4} | {:.4} | {:.4} | {:.4} |\n",
                    r.name, r.key_axis, r.value_axis, r.residual, r.mean.key, r.mean.value, r.mean.score, r.mean.output
                );
            }
            let codecs: Vec<_> = l.results.iter().filter(|r| r.codec).collect();
            if !codecs.is_empty() {
                s += "\nCodec study (same data and queries, f32 activations): relative errors, mean over layers, \
                      and the attention-output error averaged over the global layers:\n\n";
                s +=
                    "| scheme | all-in bits/elem | key | value | scores | attention output | output, global layers |\n";
                s += "|---|---|---|---|---|---|---|\n";
                for r in &codecs {
                    let g: Vec<f64> = l
                        .global_layers
                        .iter()
                        .filter_map(|&i| r.per_layer.get(i))
                        .map(|e| e.output)
                        .collect();
                    s += &format!(
                        "| {} | {:.3} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |\n",
                        r.name,
                        r.bits_per_element,
                        r.mean.key,
                        r.mean.value,
                        r.mean.score,
                        r.mean.output,
                        g.iter().sum::<f64>() / g.len().max(1) as f64
                    );
                }
            }
            for (title, rows) in [
                (
                    "Attention-output error per layer (g = global layer):",
                    l.results.iter().filter(|r| !r.codec).collect::<Vec<_>>(),
                ),
                ("Codec study, attention-output error per layer:", codecs.clone()),
            ] {
                if rows.is_empty() {
                    continue;
                }
                s += &format!("\n{title}\n\n| layer |");
                for r in &rows {
                    s += &format!(" {} |", r.name);
                }
                s += "\n|---|";
                for _ in &rows {
                    s += "---|";
                }
                s += "\n";
                for layer in 0..rows[0].per_layer.len() {
                    let g = if l.global_layers.contains(&layer) { " g" } else { "" };
                    s += &format!("| {layer}{g} |");
                    for r in &rows {
                        s += &format!(" {:.4} |", r.per_layer[layer].output);
                    }
                    s += "\n";
                }
            }
        }
        let t = &self.seconds;
        s += &format!(
            "\nWall time: {:.1} s (load {:.1}, prefill {:.1}, decode {:.1}, reference forward {:.1}, layer study {:.1}).\n",
            t.total, t.fetch_and_load, t.prefill, t.decode, t.reference_forward, t.layer_study
        );
        s
    }
}
