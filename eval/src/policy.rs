//! Per-layer policies, KVTuner-style (`kivi policy`): measure how much each
//! layer suffers under each candidate (key, value) precision on the
//! calibration text, then choose one candidate per layer minimising the
//! summed damage under a byte budget, and write the choice as a model
//! declaration (`kivi_spec::parse_model`) that `kivi eval --models` and
//! `kivi show --model` read.
//!
//! **Damage** of a candidate on a layer: the mean KL(p_f32 ‖ p) of the
//! next-token distribution over teacher-forced decode steps on the
//! calibration text, when *only that layer* is quantized (every other layer
//! f32). KL of the output distribution is the quantity the evaluation scores
//! (and perplexity moves with it), and it carries what a per-layer
//! attention-output error cannot: how much the rest of the network amplifies
//! or absorbs a layer's error (the global layers of Gemma 3 matter more
//! than their output error says). Summing it over layers is the KVTuner
//! assumption (errors of different layers add to first order); the
//! evaluation checks the found policy end to end.
//!
//! **Cost**: one batched decode of `layers x candidates` rows (plus the f32
//! row) for a few dozen steps after one shared prefill, in chunks of rows
//! so memory stays bounded.
//!
//! **Bytes**: a layer's cost is the exact payload ([`Footprint`]) of the
//! tokens it holds at a context of `T` tokens: `T` for a global layer,
//! `min(T, W)` for a sliding one (it evicts what its window no longer sees;
//! block rounding is left out). Windows (sinks, the recent full-precision
//! tokens) are counted, so candidates with different windows compare fairly.
//!
//! **Search**: exact. A dynamic programme over layers keeps the Pareto
//! frontier of (total bytes, total damage) of partial assignments — every
//! assignment not dominated by another of no more bytes and no more damage —
//! so the minimum-damage assignment within the budget is never pruned.

use crate::error::{Error, Result};
use crate::fetch;
use crate::model::{log_softmax_rows, Config, Gemma3, Logits, Weights};
use kivi_spec::layout::Footprint;
use kivi_spec::{Heads, LayerKind, Scheme};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

/// The attention layout a policy is priced on: what [`Config`] says about
/// layers, heads and windows, without the weights (so tests and `kivi show`
/// style callers can build one by hand).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelLayout {
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The sliding layers' window (`None`: every layer is global).
    pub window: Option<usize>,
    pub global_layers: Vec<usize>,
}

impl ModelLayout {
    /// The layout of a loaded model.
    pub fn of(c: &Config) -> ModelLayout {
        ModelLayout {
            layers: c.layers,
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            window: Some(c.sliding_window),
            global_layers: c.global_layers.clone(),
        }
    }

    /// Gemma 3 270M's layout (18 layers, MQA 4:1, head_dim 256, window 512,
    /// global layers 5, 11, 17), for pricing without the model file.
    pub fn gemma3_270m() -> ModelLayout {
        ModelLayout {
            layers: 18,
            q_heads: 4,
            kv_heads: 1,
            head_dim: 256,
            window: Some(512),
            global_layers: vec![5, 11, 17],
        }
    }

    /// Each layer's kind, as [`kivi_spec::ModelDecl::schemes_for`] takes it.
    pub fn kinds(&self) -> Vec<LayerKind> {
        (0..self.layers)
            .map(|l| {
                if self.window.is_none() || self.global_layers.contains(&l) {
                    LayerKind::Global
                } else {
                    LayerKind::Sliding
                }
            })
            .collect()
    }

    /// Tokens layer `layer` holds at a context of `context` tokens.
    pub fn held(&self, layer: usize, context: usize) -> usize {
        match (self.kinds()[layer], self.window) {
            (LayerKind::Sliding, Some(w)) => context.min(w),
            _ => context,
        }
    }

    fn heads(&self) -> Heads {
        Heads::from_counts(self.q_heads as u32, self.kv_heads as u32)
    }
}

/// Exact payload bytes of `scheme` on layer `layer` at `context` tokens
/// (see the module docs).
pub fn layer_bytes(scheme: &Scheme, layout: &ModelLayout, layer: usize, context: usize) -> Result<u64> {
    let bound = scheme
        .with_shape(layout.heads(), layout.head_dim as u32)
        .map_err(|e| Error::Config(format!("scheme `{}`: {e}", scheme.name)))?;
    Ok(Footprint::for_tokens(&bound, layout.held(layer, context)).total() as u64)
}

/// [`layer_bytes`] summed over the layers: `schemes` holds one scheme per
/// layer, or one for every layer.
pub fn model_bytes(schemes: &[Scheme], layout: &ModelLayout, context: usize) -> Result<u64> {
    if schemes.len() != 1 && schemes.len() != layout.layers {
        return Err(Error::Config(format!(
            "{} schemes for {} layers",
            schemes.len(),
            layout.layers
        )));
    }
    (0..layout.layers)
        .map(|l| layer_bytes(&schemes[l.min(schemes.len() - 1)], layout, l, context))
        .sum()
}

/// Mean over layers of each layer's all-in bits per element
/// ([`kivi_spec::layout::bits_per_element`]: codes and parameters of a
/// quantized token, windows excluded), every layer weighted alike.
pub fn mean_bits_per_element(schemes: &[Scheme], layout: &ModelLayout) -> Result<f64> {
    let mut sum = 0.0;
    for l in 0..layout.layers {
        let s = &schemes[l.min(schemes.len().saturating_sub(1))];
        let bound = s
            .with_shape(layout.heads(), layout.head_dim as u32)
            .map_err(|e| Error::Config(format!("scheme `{}`: {e}", s.name)))?;
        sum += kivi_spec::layout::bits_per_element(&bound);
    }
    Ok(sum / layout.layers as f64)
}

/// A byte budget, as `kivi policy --budget` spells it.
#[derive(Clone, Debug, PartialEq)]
pub enum Budget {
    /// What this scheme on every layer holds (a preset, scheme text or file).
    Scheme(String),
    /// Bytes of K/V per token, all layers together, at the context.
    BytesPerToken(f64),
    /// Bits per cached K/V element, windows included, at the context.
    Bits(f64),
}

impl Budget {
    /// `kivi2` (any scheme), `1500B` (bytes per token, all layers) or
    /// `3bits` (bits per held element).
    pub fn parse(text: &str) -> Result<Budget> {
        let t = text.trim();
        let num = |s: &str| -> Result<f64> {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| Error::Config(format!("budget `{text}`: `{}` is not a positive number", s.trim())))
        };
        if let Some(n) = t.strip_suffix("bits") {
            return Ok(Budget::Bits(num(n)?));
        }
        if let Some(n) = t.strip_suffix('B') {
            if n.trim().chars().next().is_some_and(|c| c.is_ascii_digit() || c == '.') {
                return Ok(Budget::BytesPerToken(num(n)?));
            }
        }
        if t.is_empty() {
            return Err(Error::Config(
                "empty budget; write e.g. `kivi2`, `1500B` or `3bits`".into(),
            ));
        }
        Ok(Budget::Scheme(t.to_string()))
    }

    /// The budget in total bytes at `context` tokens.
    pub fn bytes(&self, layout: &ModelLayout, context: usize) -> Result<u64> {
        match self {
            Budget::Scheme(s) => model_bytes(&[crate::kv::resolve_scheme(s)?], layout, context),
            Budget::BytesPerToken(b) => Ok((b * context as f64).floor() as u64),
            Budget::Bits(bits) => {
                let elems: usize = (0..layout.layers)
                    .map(|l| layout.held(l, context) * 2 * layout.head_dim * layout.kv_heads)
                    .sum();
                Ok((bits * elems as f64 / 8.0).floor() as u64)
            }
        }
    }
}

/// The KIVI family on a grid: keys `kb`-bit per channel (groups of 32),
/// values `vb`-bit per token (groups of 32), for every pair of `bits`, with
/// the given full-precision window and sinks. Named `k{kb}v{vb}` (`_s{n}`
/// with sinks); `k2v2` with R = 128 is kivi2.
pub fn kivi_grid(bits: &[u32], residual: u32, sinks: u32) -> Result<Vec<Scheme>> {
    if bits.is_empty() {
        return Err(Error::Config("no candidate bit widths".into()));
    }
    let mut out = Vec::new();
    for &kb in bits {
        for &vb in bits {
            let name = if sinks > 0 {
                format!("k{kb}v{vb}_s{sinks}")
            } else {
                format!("k{kb}v{vb}")
            };
            let text = format!(
                "{name} {{ key: quant(bits = {kb}, axis = channel, group = 32), \
                 value: quant(bits = {vb}, axis = token, group = 32), residual: {residual}, sinks: {sinks} }}"
            );
            out.push(
                kivi_spec::parse_scheme(&text)
                    .map_err(|e| Error::Config(format!("candidate k{kb}v{vb}: {}", e.message)))?,
            );
        }
    }
    Ok(out)
}

/// What [`search`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The chosen candidate of each layer.
    pub choice: Vec<usize>,
    /// Total bytes and total predicted damage of the choice.
    pub cost: u64,
    pub damage: f64,
}

/// The assignment of one candidate per layer that minimises the summed
/// `damage[layer][candidate]` with summed `cost[layer][candidate]` at most
/// `budget` — exactly (the Pareto dynamic programme of the module docs).
/// Ties go to the cheaper assignment, then to lower candidate indices.
/// Errors: no layers, ragged or empty rows, a non-finite damage, or a
/// budget below the cheapest assignment.
pub fn search(cost: &[Vec<u64>], damage: &[Vec<f64>], budget: u64) -> Result<Plan> {
    if cost.is_empty() || cost.len() != damage.len() {
        return Err(Error::Config(format!(
            "{} cost rows for {} damage rows; need one per layer, at least one",
            cost.len(),
            damage.len()
        )));
    }
    for (l, (c, d)) in cost.iter().zip(damage).enumerate() {
        if c.is_empty() || c.len() != d.len() {
            return Err(Error::Config(format!(
                "layer {l}: {} costs for {} damages; need one per candidate, at least one",
                c.len(),
                d.len()
            )));
        }
        if let Some(x) = d.iter().find(|x| !x.is_finite()) {
            return Err(Error::Config(format!("layer {l}: damage {x} is not finite")));
        }
    }
    let cheapest: u64 = cost.iter().map(|c| *c.iter().min().unwrap_or(&0)).sum();
    if cheapest > budget {
        return Err(Error::Config(format!(
            "the budget ({budget} bytes) is below the cheapest assignment ({cheapest} bytes): \
             raise it or add cheaper candidates"
        )));
    }
    // Frontier entries: (cost, damage, parent entry in the previous
    // frontier, candidate). Sorted by cost, damage strictly decreasing.
    let mut frontiers: Vec<Vec<(u64, f64, usize, usize)>> = Vec::with_capacity(cost.len());
    let mut prev: Vec<(u64, f64, usize, usize)> = vec![(0, 0.0, 0, 0)];
    for (c, d) in cost.iter().zip(damage) {
        let mut next = Vec::with_capacity(prev.len() * c.len());
        for (pi, &(pc, pd, _, _)) in prev.iter().enumerate() {
            for (k, (&ck, &dk)) in c.iter().zip(d).enumerate() {
                let total = pc.saturating_add(ck);
                if total <= budget {
                    next.push((total, pd + dk, pi, k));
                }
            }
        }
        next.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        let mut kept: Vec<(u64, f64, usize, usize)> = Vec::with_capacity(next.len());
        for e in next {
            if kept.last().is_none_or(|k| e.1 < k.1) {
                kept.push(e);
            }
        }
        frontiers.push(std::mem::replace(&mut prev, kept.clone()));
        prev = kept;
    }
    frontiers.push(prev);
    // The last frontier's last entry has the least damage.
    let last = frontiers.last().expect("one frontier per layer and the start");
    let (total, dmg, mut parent, cand) = *last.last().expect("the cheapest assignment fits the budget");
    let mut choice = vec![cand];
    for f in frontiers[1..frontiers.len() - 1].iter().rev() {
        let (_, _, p, k) = f[parent];
        choice.push(k);
        parent = p;
    }
    choice.reverse();
    Ok(Plan {
        choice,
        cost: total,
        damage: dmg,
    })
}

/// The model declaration of a per-layer assignment: the model's layout, the
/// most frequent scheme as `default`, every other scheme on `layers[...]`,
/// schemes inline in canonical form; `comment` lines go on top as `//`
/// comments. [`kivi_spec::parse_model`] reads it back to the same schemes.
pub fn declaration(name: &str, layout: &ModelLayout, schemes: &[Scheme], comment: &str) -> Result<String> {
    if schemes.len() != layout.layers {
        return Err(Error::Config(format!(
            "{} schemes for {} layers",
            schemes.len(),
            layout.layers
        )));
    }
    let ident_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ident_ok || name == "model" {
        return Err(Error::Config(format!(
            "`{name}` cannot name a model declaration (letters, digits and `_`, not starting with a digit)"
        )));
    }
    // Group layers by scheme (canonical text), in order of first use.
    let mut groups: Vec<(String, &Scheme, Vec<usize>)> = Vec::new();
    for (l, s) in schemes.iter().enumerate() {
        let key = kivi_spec::canonical(s);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.2.push(l),
            None => groups.push((key, s, vec![l])),
        }
    }
    let default = (0..groups.len())
        .max_by_key(|&i| (groups[i].2.len(), std::cmp::Reverse(i)))
        .expect("at least one layer");
    let mut o = String::new();
    for line in comment.lines() {
        o += &format!("// {line}\n");
    }
    o += &format!("model {name} {{\n    layers: {},\n", layout.layers);
    if let Some(w) = layout.window {
        let g: Vec<String> = layout.global_layers.iter().map(|l| l.to_string()).collect();
        o += &format!("    window: {w},\n    global_layers: [{}],\n", g.join(", "));
    }
    let inline = |s: &Scheme| -> String {
        let body = kivi_spec::canonical(s);
        body.trim_end().replace('\n', "\n    ")
    };
    o += &format!("    default: {},\n", inline(groups[default].1));
    for (i, (_, s, layers)) in groups.iter().enumerate() {
        if i == default {
            continue;
        }
        let idx: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
        o += &format!("    layers[{}]: {},\n", idx.join(", "), inline(s));
    }
    o += "}\n";
    Ok(o)
}

/// Per-layer schemes of a model declaration for a model of `layout`; the
/// declaration's own layout, when it states one, must be the model's.
pub fn resolve_model(decl: &kivi_spec::ModelDecl, layout: &ModelLayout) -> Result<Vec<Scheme>> {
    let bad = |what: String| Error::Config(format!("model `{}`: {what}", decl.name));
    if let Some(w) = decl.window {
        if layout.window != Some(w as usize) {
            return Err(bad(format!("declares window {w}; the model's is {:?}", layout.window)));
        }
    }
    if let Some(g) = &decl.global_layers {
        let (mut a, mut b) = (g.clone(), layout.global_layers.clone());
        a.sort_unstable();
        b.sort_unstable();
        if a != b {
            return Err(bad(format!(
                "declares global layers {g:?}; the model's are {:?}",
                layout.global_layers
            )));
        }
    }
    decl.schemes_for(&layout.kinds())
        .map_err(|e| bad(format!("{}:{}: {}", e.line, e.column, e.message)))
}

/// What `kivi policy` measures.
#[derive(Clone, Debug)]
pub struct SensitivityConfig {
    /// A GGUF file; `None` fetches (or reuses) the cached Gemma 3 270M.
    pub model: Option<PathBuf>,
    /// A text file; `None` uses the bundled calibration text
    /// ([`crate::calibrate::CALIBRATION_TEXT`]).
    pub text: Option<PathBuf>,
    /// Tokens prefilled (and quantized) before the scored decode steps.
    pub prefix: usize,
    /// Teacher-forced decode steps scored.
    pub steps: usize,
    /// Candidate schemes.
    pub candidates: Vec<Scheme>,
    /// Rows decoded together (the f32 row is added to each chunk).
    pub chunk: usize,
    pub weights: Weights,
}

/// Measured per-layer damages ([module docs](self)).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Sensitivity {
    pub model_file: String,
    pub layout: ModelLayout,
    pub text: String,
    pub prefix: usize,
    pub steps: usize,
    /// Candidate names and their canonical scheme text.
    pub names: Vec<String>,
    pub schemes: Vec<String>,
    /// `damage[layer][candidate]`: mean KL(p_f32 ‖ p) in nats per scored
    /// step with only that layer on that candidate.
    pub damage: Vec<Vec<f64>>,
    pub seconds: f64,
}

impl Sensitivity {
    /// The candidate schemes, parsed back.
    pub fn candidate_schemes(&self) -> Result<Vec<Scheme>> {
        self.schemes
            .iter()
            .map(|t| kivi_spec::parse_scheme(t).map_err(|e| Error::Config(format!("sensitivity file: {}", e.message))))
            .collect()
    }
}

/// Measures [`Sensitivity`]: `log` gets progress lines, `progress(done,
/// total)` is called after every decode step of every chunk.
pub fn measure(
    cfg: &SensitivityConfig,
    log: &mut dyn FnMut(&str),
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Sensitivity> {
    let t0 = Instant::now();
    if cfg.candidates.is_empty() {
        return Err(Error::Config("no candidates to measure".into()));
    }
    if cfg.prefix == 0 || cfg.steps == 0 || cfg.chunk == 0 {
        return Err(Error::Config("prefix, steps and chunk must each be at least 1".into()));
    }
    for (i, s) in cfg.candidates.iter().enumerate() {
        if cfg.candidates[..i].iter().any(|o| o.name == s.name) {
            return Err(Error::Config(format!("two candidates are named `{}`", s.name)));
        }
        let nuq = [kivi_spec::Tensor::Key, kivi_spec::Tensor::Value].iter().any(|&t| {
            s.codec(t)
                .quant()
                .is_some_and(|q| matches!(q.levels, kivi_spec::Levels::Nuq(_)))
        });
        if nuq {
            return Err(Error::Config(format!(
                "candidate `{}` has nuq levels; `kivi policy` takes no calibration file",
                s.name
            )));
        }
    }
    let (text, text_name) = match &cfg.text {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?,
            p.display().to_string(),
        ),
        None => (
            crate::calibrate::CALIBRATION_TEXT.to_string(),
            crate::calibrate::CALIBRATION_TEXT_NAME.to_string(),
        ),
    };
    let path = match &cfg.model {
        Some(p) => p.clone(),
        None => fetch::ensure_model(&fetch::models_dir(), log)?,
    };
    let total_tokens = cfg.prefix + cfg.steps + 1;
    let (model, tok) = Gemma3::load(&path, total_tokens, cfg.weights)?;
    let layout = ModelLayout::of(model.config());
    for s in &cfg.candidates {
        s.with_shape(layout.heads(), layout.head_dim as u32)
            .map_err(|e| Error::Config(format!("candidate `{}` does not fit the model: {e}", s.name)))?;
    }
    let ids = tok.encode(&text, false);
    if ids.len() < total_tokens {
        return Err(Error::Config(format!(
            "{text_name} has {} tokens, fewer than prefix + steps + 1 = {total_tokens}",
            ids.len()
        )));
    }
    let ids = &ids[..total_tokens];
    let f32s = crate::kv::f32_scheme();
    // Row r >= 1 of the grid: layer (r-1) / C on candidate (r-1) % C.
    let nc = cfg.candidates.len();
    let configs: Vec<(usize, usize)> = (0..layout.layers).flat_map(|l| (0..nc).map(move |c| (l, c))).collect();
    log(&format!(
        "{} layers x {nc} candidates = {} configurations; prefix {} tokens, {} scored steps, chunks of {}",
        layout.layers,
        configs.len(),
        cfg.prefix,
        cfg.steps,
        cfg.chunk
    ));
    let pre = model.forward(&ids[..cfg.prefix], Logits::None, true)?;
    let mut damage = vec![vec![0f64; nc]; layout.layers];
    let chunks: Vec<&[(usize, usize)]> = configs.chunks(cfg.chunk).collect();
    let total = chunks.len() * cfg.steps;
    let mut done = 0;
    for chunk in chunks {
        // Row 0 of every chunk is the f32 baseline.
        let mut caches = Vec::with_capacity(chunk.len() + 1);
        caches.push(model.new_cache(std::slice::from_ref(&f32s), total_tokens)?);
        for &(l, c) in chunk {
            let mut per = vec![f32s.clone(); layout.layers];
            per[l] = cfg.candidates[c].clone();
            caches.push(model.new_cache(&per, total_tokens)?);
        }
        for c in caches.iter_mut() {
            model.fill_cache(c, &pre)?;
        }
        let mut kl = vec![0f64; chunk.len()];
        for &token in &ids[cfg.prefix..cfg.prefix + cfg.steps] {
            let toks = vec![token; caches.len()];
            let mut refs: Vec<&mut kivi_candle::KiviKvCache> = caches.iter_mut().collect();
            let logits = model.step(&toks, &mut refs)?;
            let lsm = log_softmax_rows(&logits)?;
            let base = &lsm[0];
            let d: Vec<f64> = lsm[1..]
                .par_iter()
                .map(|r| base.iter().zip(r).map(|(p, q)| p.exp() * (p - q)).sum::<f64>().max(0.0))
                .collect();
            for (k, x) in kl.iter_mut().zip(d) {
                *k += x;
            }
            done += 1;
            progress(done, total);
        }
        for (&(l, c), k) in chunk.iter().zip(kl) {
            damage[l][c] = k / cfg.steps as f64;
        }
    }
    Ok(Sensitivity {
        model_file: path.display().to_string(),
        layout,
        text: text_name,
        prefix: cfg.prefix,
        steps: cfg.steps,
        names: cfg.candidates.iter().map(|s| s.name.clone()).collect(),
        schemes: cfg.candidates.iter().map(kivi_spec::canonical).collect(),
        damage,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// A found policy: the per-layer schemes and how they were priced.
#[derive(Clone, Debug)]
pub struct Policy {
    pub schemes: Vec<Scheme>,
    pub plan: Plan,
    /// The budget in total bytes at `context` tokens.
    pub budget: u64,
    pub context: usize,
}

/// Prices every candidate on every layer at `context` tokens and searches
/// the measured damages under `budget`.
pub fn find(sens: &Sensitivity, budget: &Budget, context: usize) -> Result<Policy> {
    if context == 0 {
        return Err(Error::Config("the context must be at least 1 token".into()));
    }
    let cands = sens.candidate_schemes()?;
    if sens.damage.len() != sens.layout.layers || sens.damage.iter().any(|d| d.len() != cands.len()) {
        return Err(Error::Config(
            "sensitivity file: the damage table does not match its layers and candidates".into(),
        ));
    }
    let cost = (0..sens.layout.layers)
        .map(|l| {
            cands
                .iter()
                .map(|s| layer_bytes(s, &sens.layout, l, context))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let b = budget.bytes(&sens.layout, context)?;
    let plan = search(&cost, &sens.damage, b)?;
    Ok(Policy {
        schemes: plan.choice.iter().map(|&c| cands[c].clone()).collect(),
        plan,
        budget: b,
        context,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(cost: &[Vec<u64>], damage: &[Vec<f64>], budget: u64) -> Option<f64> {
        let n = cost.len();
        let mut idx = vec![0usize; n];
        let mut best: Option<f64> = None;
        loop {
            let c: u64 = (0..n).map(|l| cost[l][idx[l]]).sum();
            let d: f64 = (0..n).map(|l| damage[l][idx[l]]).sum();
            if c <= budget && best.is_none_or(|b| d < b) {
                best = Some(d);
            }
            let mut l = 0;
            loop {
                if l == n {
                    return best;
                }
                idx[l] += 1;
                if idx[l] < cost[l].len() {
                    break;
                }
                idx[l] = 0;
                l += 1;
            }
        }
    }

    #[test]
    fn search_is_optimal_and_within_budget_on_random_small_cases() {
        let mut rng = fastrand::Rng::with_seed(13);
        for case in 0..400 {
            let layers = rng.usize(1..=5);
            let cands = rng.usize(1..=4);
            // Small integer costs make ties and equal totals common.
            let cost: Vec<Vec<u64>> = (0..layers)
                .map(|_| (0..cands).map(|_| rng.u64(1..=6)).collect())
                .collect();
            let damage: Vec<Vec<f64>> = (0..layers)
                .map(|_| (0..cands).map(|_| (rng.u32(0..=8) as f64) / 4.0).collect())
                .collect();
            let min: u64 = cost.iter().map(|c| *c.iter().min().unwrap()).sum();
            let max: u64 = cost.iter().map(|c| *c.iter().max().unwrap()).sum();
            let budget = rng.u64(min.saturating_sub(2)..=max + 1);
            let want = brute(&cost, &damage, budget);
            match search(&cost, &damage, budget) {
                Ok(p) => {
                    let c: u64 = p.choice.iter().enumerate().map(|(l, &k)| cost[l][k]).sum();
                    let d: f64 = p.choice.iter().enumerate().map(|(l, &k)| damage[l][k]).sum();
                    assert!(c <= budget, "case {case}: cost {c} over budget {budget}");
                    assert_eq!(c, p.cost, "case {case}");
                    assert!((d - p.damage).abs() < 1e-9, "case {case}");
                    assert_eq!(Some(d), want, "case {case}: not optimal");
                }
                Err(e) => {
                    assert!(want.is_none(), "case {case}: refused a feasible budget: {e}");
                    assert!(e.to_string().contains("below the cheapest assignment"), "{e}");
                }
            }
        }
    }

    #[test]
    fn search_spends_where_damage_falls_most() {
        // Layer 1 gains far more from the expensive candidate.
        let cost = vec![vec![1, 3], vec![1, 3], vec![1, 3]];
        let damage = vec![vec![1.0, 0.9], vec![5.0, 0.1], vec![1.0, 0.8]];
        let p = search(&cost, &damage, 5).unwrap();
        assert_eq!(p.choice, vec![0, 1, 0]);
        assert_eq!(p.cost, 5);
    }

    #[test]
    fn search_refuses_bad_input() {
        let e = search(&[vec![4, 8]], &[vec![1.0, 0.5]], 3).unwrap_err().to_string();
        assert!(
            e.contains("3 bytes") && e.contains("cheapest assignment (4 bytes)"),
            "{e}"
        );
        assert!(search(&[], &[], 3).is_err());
        assert!(search(&[vec![1]], &[vec![f64::NAN]], 3).is_err());
        assert!(search(&[vec![1, 2]], &[vec![1.0]], 3).is_err());
    }

    #[test]
    fn kivi2_budget_prices_windows_and_eviction() {
        let g = ModelLayout::gemma3_270m();
        let k2 = kivi_spec::presets::kivi2();
        // A global layer at 768 tokens: 640 quantized x 192 B + 128 x 1024 B window.
        assert_eq!(layer_bytes(&k2, &g, 5, 768).unwrap(), 640 * 192 + 128 * 1024);
        // A sliding layer holds only its 512 tokens.
        assert_eq!(layer_bytes(&k2, &g, 0, 768).unwrap(), 384 * 192 + 128 * 1024);
        let b = Budget::parse("kivi2").unwrap().bytes(&g, 768).unwrap();
        assert_eq!(b, 15 * (384 * 192 + 128 * 1024) + 3 * (640 * 192 + 128 * 1024));
        assert_eq!(Budget::parse("1500B").unwrap(), Budget::BytesPerToken(1500.0));
        assert_eq!(Budget::parse(" 3bits").unwrap(), Budget::Bits(3.0));
        assert!(Budget::parse("-1bits").is_err());
        assert!(Budget::parse("kivi9").unwrap().bytes(&g, 768).is_err());
        // k2v2 of the grid costs what kivi2 costs.
        let grid = kivi_grid(&[1, 2, 3, 4], 128, 0).unwrap();
        assert_eq!(grid.len(), 16);
        let k2v2 = grid.iter().find(|s| s.name == "k2v2").unwrap();
        assert_eq!(model_bytes(std::slice::from_ref(k2v2), &g, 768).unwrap(), b);
        assert!(kivi_grid(&[9], 128, 0).is_err());
        assert!(kivi_grid(&[], 128, 0).is_err());
    }

    #[test]
    fn written_declaration_parses_back_to_the_same_schemes() {
        let g = ModelLayout::gemma3_270m();
        let grid = kivi_grid(&[1, 2, 3, 4], 128, 4).unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..20 {
            let schemes: Vec<Scheme> = (0..g.layers).map(|_| grid[rng.usize(..grid.len())].clone()).collect();
            let text = declaration("found", &g, &schemes, "a comment\nover two lines").unwrap();
            let decl = kivi_spec::parse_model(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(decl.name, "found");
            assert_eq!(decl.kinds().unwrap(), g.kinds());
            assert_eq!(resolve_model(&decl, &g).unwrap(), schemes, "{text}");
        }
        assert!(declaration("2x", &g, &vec![grid[0].clone(); g.layers], "").is_err());
        assert!(declaration("ok", &g, &grid[..3], "").is_err());
        // A declaration for another layout is refused.
        let decl =
            kivi_spec::parse_model("model m { layers: 18, window: 256, global_layers: [5], default: kivi2 }").unwrap();
        assert!(resolve_model(&decl, &g).unwrap_err().to_string().contains("window 256"));
    }

    #[test]
    fn find_prices_candidates_and_searches() {
        let g = ModelLayout::gemma3_270m();
        let grid = kivi_grid(&[2, 4], 128, 0).unwrap();
        // Global layers hurt 10x more: they get the 4-bit keys/values
        // first once the budget allows.
        let damage: Vec<Vec<f64>> = (0..g.layers)
            .map(|l| {
                let w = if g.global_layers.contains(&l) { 10.0 } else { 1.0 };
                grid.iter()
                    .map(|s| w * (s.name.contains("k2") as u8 as f64 + s.name.contains("v2") as u8 as f64))
                    .collect()
            })
            .collect();
        let sens = Sensitivity {
            model_file: "x".into(),
            layout: g.clone(),
            text: "t".into(),
            prefix: 1,
            steps: 1,
            names: grid.iter().map(|s| s.name.clone()).collect(),
            schemes: grid.iter().map(kivi_spec::canonical).collect(),
            damage,
            seconds: 0.0,
        };
        let p = find(&sens, &Budget::Scheme("kivi2".into()), 768).unwrap();
        assert!(p.plan.cost <= p.budget);
        assert!(
            p.schemes.iter().all(|s| s.name == "k2v2"),
            "kivi2's own budget buys nothing else"
        );
        let p = find(&sens, &Budget::BytesPerToken(p.budget as f64 / 768.0 + 400.0), 768).unwrap();
        for l in &g.global_layers {
            assert_ne!(p.schemes[*l].name, "k2v2", "layer {l}");
        }
        let e = find(&sens, &Budget::Bits(0.5), 768).unwrap_err().to_string();
        assert!(e.contains("below the cheapest"), "{e}");
    }
}
