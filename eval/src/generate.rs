//! Text generation on a kivi cache: the prompt prefilled in chunks straight
//! into the (quantized) cache, then one token at a time, greedy or sampled
//! (temperature, top-p, seeded). `kivi generate` is a thin shell around
//! [`generate`].

use crate::error::{Error, Result};
use crate::model::{Gemma3, Logits};
use kivi_candle::KiviKvCache;
use std::time::Instant;

/// How the next token is picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus sampling: draw from the smallest set of most likely tokens
    /// whose probability reaches `top_p` (1 keeps every token).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Prompt tokens per prefill call (the cache takes each chunk at once).
    pub prefill_chunk: usize,
    pub sampling: Sampling,
    /// Token ids that end generation (not emitted).
    pub stop: Vec<u32>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// A stop token came.
    StopToken,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The cache (or the model's positions) is full.
    ContextFull,
}

/// The outcome and its timings.
#[derive(Clone, Debug)]
pub struct Generated {
    /// Generated tokens, stop token excluded.
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub stop: Stop,
    /// Seconds spent prefilling the prompt (its last chunk yields the first
    /// token's logits).
    pub prefill_secs: f64,
    /// Decode steps (one token through the model each) and their seconds.
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// Bytes the cache holds at the end (exact, from the cache) and what an
    /// f16 cache of the same tokens would hold.
    pub kv_bytes: usize,
    pub f16_bytes: usize,
}

/// Checks a sampling setting.
pub fn check_sampling(s: &Sampling) -> Result<()> {
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return Err(Error::Config(format!(
            "temperature {} must be 0 or more",
            s.temperature
        )));
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return Err(Error::Config(format!("top-p {} must be in (0, 1]", s.top_p)));
    }
    Ok(())
}

/// Generates after `prompt` (token ids, BOS included) on `cache`, which must
/// be empty or hold the sequence so far. `on_token` sees each generated
/// token as soon as it is picked (for streaming); an error from it stops
/// generation.
pub fn generate(
    model: &Gemma3,
    cache: &mut KiviKvCache,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generated> {
    check_sampling(&cfg.sampling)?;
    if prompt.is_empty() {
        return Err(Error::Config("the prompt has no tokens".into()));
    }
    if cfg.prefill_chunk == 0 {
        return Err(Error::Config("the prefill chunk must be at least 1 token".into()));
    }
    let room = cache.max_tokens().min(model.config().max_positions);
    if cache.current_seq_len() + prompt.len() > room {
        return Err(Error::Config(format!(
            "the prompt has {} tokens, the cache room for {} (after {} already there); raise the context size",
            prompt.len(),
            room,
            cache.current_seq_len()
        )));
    }
    let mut rng = fastrand::Rng::with_seed(cfg.sampling.seed);
    let t = Instant::now();
    let mut logits = None;
    for chunk in prompt.chunks(cfg.prefill_chunk) {
        logits = model.forward_cached(chunk, cache, Logits::Last)?;
    }
    let prefill_secs = t.elapsed().as_secs_f64();
    let mut tokens = Vec::new();
    let mut decode_steps = 0;
    let t = Instant::now();
    let stop = loop {
        let row: Vec<f32> = match &logits {
            Some(l) => l.get(0)?.to_vec1()?,
            None => return Err(Error::Config("the model returned no logits".into())),
        };
        let next = pick(&row, &cfg.sampling, &mut rng);
        if cfg.stop.contains(&next) {
            break Stop::StopToken;
        }
        tokens.push(next);
        on_token(next)?;
        if tokens.len() >= cfg.max_tokens {
            break Stop::MaxTokens;
        }
        if cache.current_seq_len() + 1 > room {
            break Stop::ContextFull;
        }
        logits = model.forward_cached(&[next], cache, Logits::Last)?;
        decode_steps += 1;
    };
    Ok(Generated {
        tokens,
        prompt_tokens: prompt.len(),
        stop,
        prefill_secs,
        decode_steps,
        decode_secs: t.elapsed().as_secs_f64(),
        kv_bytes: cache.memory_bytes(),
        f16_bytes: cache.f16_bytes(),
    })
}

/// The next token from one row of logits.
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut fastrand::Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            // First of equal maxima, as an argmax over the row would give.
            .fold(0, |b, (i, &x)| if x > logits[b] { i } else { b }) as u32
    };
    if s.temperature == 0.0 || logits.is_empty() {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, (((x - max) / s.temperature) as f64).exp()))
        .collect();
    let total: f64 = p.iter().map(|x| x.1).sum();
    if !(total.is_finite() && total > 0.0) {
        return argmax();
    }
    // Most likely first (ties by id, so a seed always gives the same draw),
    // then keep the nucleus.
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut n = 0;
    for (_, w) in &p {
        kept += w;
        n += 1;
        if kept >= s.top_p as f64 * total {
            break;
        }
    }
    let mut r = rng.f64() * kept;
    for (id, w) in &p[..n] {
        if r < *w {
            return *id;
        }
        r -= w;
    }
    p[n - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_top_p_keeps_the_nucleus() {
        let mut rng = fastrand::Rng::with_seed(1);
        let logits = [0.0, 3.0, 3.0, 1.0];
        assert_eq!(pick(&logits, &Sampling::default(), &mut rng), 1);
        // A tiny top-p keeps only the most likely token (the first of a tie).
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.01,
            seed: 0,
        };
        for _ in 0..50 {
            assert_eq!(pick(&logits, &s, &mut rng), 1);
        }
        // Full nucleus at temperature 1: every token turns up, in about
        // its share (token 0 has e^0 / (1 + 2e^3 + e) = 2.3%).
        let s = Sampling { top_p: 1.0, ..s };
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[pick(&logits, &s, &mut rng) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 0), "{seen:?}");
        assert!((seen[1] as f64 / seen[2] as f64 - 1.0).abs() < 0.15, "{seen:?}");
        assert!(seen[0] < 200, "{seen:?}");
    }

    #[test]
    fn a_seed_repeats_its_draws() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = Sampling {
            temperature: 0.8,
            top_p: 0.9,
            seed: 42,
        };
        let draw = || {
            let mut rng = fastrand::Rng::with_seed(s.seed);
            (0..20).map(|_| pick(&logits, &s, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
        assert!(check_sampling(&Sampling { top_p: 0.0, ..s }).is_err());
        assert!(check_sampling(&Sampling { temperature: -1.0, ..s }).is_err());
    }
}
