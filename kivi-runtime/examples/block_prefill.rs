//! Chunked prefill with attention on the CPU: tokens/s of a 512-token
//! prompt appended in chunks to a cache that already holds `past` tokens,
//! every new query attending to the cache and the chunk so far
//! (`Backend::attend_block`), kivi2 against f16 — and, for scale, the same
//! tokens streamed one `append` + `decode` at a time.
//!
//! `cargo run --release -p kivi-runtime --example block_prefill [threads]`

use kivi_runtime::*;
use kivi_spec::{presets, Heads, Scheme};
use std::time::Instant;

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1 << 24) as f32 - 0.5)
        .collect()
}

/// Seconds to prefill `prompt` tokens in chunks of `chunk` after `past`.
fn run(s: &Scheme, cpu: &CpuBackend, past: usize, prompt: usize, chunk: usize) -> f64 {
    let shape = s.shape().unwrap();
    let (per, row) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let attn = AttnParams::of(s, shape);
    let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(past + prompt)).unwrap();
    let seq = cache.add_sequence();
    let (k0, v0) = (data(past * row, 1), data(past * row, 2));
    cache.extend(seq, &k0, &v0).unwrap();
    let (k, v, q) = (data(prompt * row, 3), data(prompt * row, 4), data(prompt * per, 5));
    let t = Instant::now();
    for a in (0..prompt).step_by(chunk) {
        let z = (a + chunk).min(prompt);
        let blk = NewTokens {
            seq,
            q: &q[a * per..z * per],
            k: &k[a * row..z * row],
            v: &v[a * row..z * row],
        };
        std::hint::black_box(cpu.attend_block(&mut cache, &[blk], attn).unwrap());
    }
    t.elapsed().as_secs_f64()
}

fn main() {
    let threads = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(0);
    let cpu = CpuBackend::new(CpuParams {
        threads,
        ..CpuParams::default()
    })
    .unwrap();
    let prompt = 512;
    println!("512-token prefill with attention, tokens/s (CPU, threads {threads}; 0 = all)");
    println!(
        "{:<8} {:<14} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "scheme", "heads", "past", "chunk 512", "chunk 128", "chunk 16", "chunk 1"
    );
    for (heads, d) in [(Heads::Mqa(4), 256), (Heads::Gqa { q: 32, kv: 8 }, 128)] {
        for past in [0, 4096, 16384] {
            for s in [presets::kivi2(), presets::f16()] {
                let s = s.with_shape(heads, d).unwrap();
                let rate = |chunk| prompt as f64 / run(&s, &cpu, past, prompt, chunk);
                println!(
                    "{:<8} {:<14} {:>6} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
                    s.name,
                    format!("{heads} d{d}"),
                    past,
                    rate(512),
                    rate(128),
                    rate(16),
                    rate(1)
                );
            }
        }
    }
}
