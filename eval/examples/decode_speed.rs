//! Decode speed of Gemma 3 270M on kivi caches at a long context, schemes
//! side by side in one run:
//! `cargo run --release -p kivi-eval --example decode_speed -- [context] [steps] [schemes,...] [threads]`
//! (defaults 4096, 32, `f16,kivi2`, 2).
//!
//! The context is the bundled text repeated, run once through the plain
//! forward; its captured K/V fill every scheme's cache (the same tokens for
//! all). The same is done at a 64-token context. Then every cache decodes
//! `steps` tokens (greedy) through kivi-candle's fused attention, all of
//! them (both contexts, every scheme) taking turns every token so that
//! machine noise hits them alike: the long-minus-short difference is what
//! the long context costs, nearly all of it attention over the cache.

use kivi_eval::model::{Gemma3, Logits, Weights};
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> kivi_eval::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| -> kivi_eval::Result<usize> {
        a.get(i).map_or(Ok(d), |s| {
            s.parse()
                .map_err(|_| kivi_eval::Error::Config(format!("not a number: {s}")))
        })
    };
    let (context, steps) = (num(0, 4096)?, num(1, 32)?);
    let names: Vec<String> = a
        .get(2)
        .map_or("f16,kivi2", String::as_str)
        .split(',')
        .map(String::from)
        .collect();
    kivi_eval::set_threads(num(3, 2)?)?;
    let schemes = names
        .iter()
        .map(|n| kivi_eval::kv::resolve_scheme(n))
        .collect::<kivi_eval::Result<Vec<_>>>()?;
    let path = kivi_eval::fetch::ensure_model(&kivi_eval::fetch::models_dir(), &mut |l| eprintln!("{l}"))?;
    let (model, tok) = Gemma3::load(&path, context + steps + 1, Weights::F32)?;
    let text = tok.encode(kivi_eval::metrics::DEFAULT_TEXT, false);
    let ids: Vec<u32> = text
        .iter()
        .chain(text[1..].iter().cycle())
        .copied()
        .take(context)
        .collect();

    // Every (context, scheme) cache is filled first; then they take turns
    // every token, short and long contexts alike, so that machine noise
    // (these machines are shared) hits every row the same and the
    // long-minus-short difference is the cost of attending over the context.
    let mut runs = Vec::new();
    for ctx in [64, context] {
        let t = Instant::now();
        let fwd = model.forward(&ids[..ctx], Logits::Last, true)?;
        eprintln!("plain forward over {ctx} tokens: {:.1} s", t.elapsed().as_secs_f64());
        let first = argmax(&row(fwd.logits.clone())?);
        for (s, scheme) in schemes.iter().enumerate() {
            let mut c = model.new_cache(std::slice::from_ref(scheme), ctx + steps + 1)?;
            model.fill_cache(&mut c, &fwd)?;
            runs.push((ctx, s, c, first, 0f64));
        }
    }
    for _ in 0..steps {
        for (_, _, c, next, secs) in runs.iter_mut() {
            let t = Instant::now();
            let l = model.forward_cached(&[*next], c, Logits::Last)?;
            *secs += t.elapsed().as_secs_f64();
            *next = argmax(&row(l)?);
        }
    }
    let rows: Vec<_> = runs
        .iter()
        .map(|(ctx, s, c, _, secs)| {
            (
                *ctx,
                names[*s].clone(),
                secs / steps as f64,
                c.memory_bytes(),
                c.f16_bytes(),
            )
        })
        .collect();
    println!("| context | scheme | ms/token | tokens/s | KV bytes | f16 bytes |");
    println!("|---|---|---|---|---|---|");
    for (ctx, name, s, kv, f16) in &rows {
        println!("| {ctx} | {name} | {:.1} | {:.1} | {kv} | {f16} |", s * 1e3, 1.0 / s);
    }
    for (i, name) in names.iter().enumerate() {
        let short = rows[i].2;
        let long = rows[names.len() + i].2;
        println!(
            "{name}: the {context}-token context adds {:.1} ms/token over 64 tokens",
            (long - short) * 1e3
        );
    }
    Ok(())
}

/// The first row of a `[rows, vocab]` logits tensor.
fn row(logits: Option<candle_core::Tensor>) -> kivi_eval::Result<Vec<f32>> {
    match logits {
        Some(l) => Ok(l.get(0)?.to_vec1()?),
        None => Err(kivi_eval::Error::Config("no logits".into())),
    }
}

fn argmax(r: &[f32]) -> u32 {
    r.iter().enumerate().fold(0, |b, (i, &x)| if x > r[b] { i } else { b }) as u32
}
