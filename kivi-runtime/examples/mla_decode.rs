//! MLA decode on the CPU, DeepSeek-V2-Lite shape (16 heads, latent 512,
//! RoPE 64), synthetic latents with heavy channels: per scheme, the exact
//! bytes the cache holds, the decode time (median of repeated runs, side by
//! side with the exact f16 cache), and the output error against exact f32
//! attention (the oracle on the unquantized rows).
//!
//! `cargo run --release -p kivi-runtime --example mla_decode [context...]`

use kivi_runtime::cpu::mla as cpu_mla;
use kivi_runtime::mla::{reference, MlaCache, MlaConfig};
use kivi_runtime::rand::Rng;
use kivi_spec::parse_scheme;
use std::time::Instant;

const HEADS: usize = 16;
const LATENT: usize = 512;
const ROPE: usize = 64;

fn data(rng: &mut Rng, tokens: usize) -> (Vec<f32>, Vec<f32>) {
    let mut scale: Vec<f32> = (0..LATENT).map(|_| 0.5 + rng.unit() as f32).collect();
    for _ in 0..8 {
        scale[rng.below(LATENT)] *= 10.0 + 40.0 * rng.unit() as f32;
    }
    let mean: Vec<f32> = (0..LATENT).map(|_| 0.3 * rng.normal()).collect();
    let latent = (0..tokens * LATENT)
        .map(|i| scale[i % LATENT] * (mean[i % LATENT] + rng.normal()))
        .collect();
    let mut rs: Vec<f32> = (0..ROPE).map(|_| 0.5 + rng.unit() as f32).collect();
    rs[3] *= 20.0;
    let rope = (0..tokens * ROPE).map(|i| rs[i % ROPE] * rng.normal()).collect();
    (latent, rope)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let contexts: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let contexts = if contexts.is_empty() {
        vec![4096, 32768]
    } else {
        contexts
    };
    let schemes = [
        ("f16", "full", "full"),
        ("4-bit latent", "quant(bits = 4, axis = channel, group = 32)", "full"),
        ("2-bit latent", "quant(bits = 2, axis = channel, group = 32)", "full"),
        (
            "2-bit + 4-bit rope",
            "quant(bits = 2, axis = channel, group = 32)",
            "quant(bits = 4, axis = token, group = 32)",
        ),
    ];
    println!(
        "MLA decode, 16 heads, latent 512 + rope 64, {} rayon threads",
        rayon::current_num_threads()
    );
    for &t in &contexts {
        let mut rng = Rng::new(t as u64);
        let (c, k) = data(&mut rng, t);
        let q: Vec<f32> = (0..HEADS * (LATENT + ROPE))
            .map(|i| if i % 576 < 512 { 0.15 } else { 0.3 } * rng.normal())
            .collect();
        let exact_s = parse_scheme(
            "E { key: full, heads: mla(q = 16, latent = 512, rope_dim = 64), dtype: f32, softmax_scale: 0.07216878 }",
        )
        .unwrap();
        let p = reference::attn_params(&exact_s).unwrap();
        let exact = reference::attend(&exact_s, &q, &c, &k, p).unwrap();
        println!("\ncontext {t} tokens");
        println!(
            "  {:20} {:>12} {:>9} {:>10} {:>8} {:>12}",
            "scheme", "bytes", "vs f16", "decode ms", "vs f16", "rel err"
        );
        let mut f16 = (0usize, 0f64);
        for (name, key, rope) in schemes {
            let s = parse_scheme(&format!(
                "S {{ key: {key}, residual: {r}, heads: mla(q = 16, latent = 512, rope_dim = 64, rope = {rope}), softmax_scale: 0.07216878 }}",
                r = if key == "full" { 0 } else { 64 }
            ))
            .unwrap();
            let bt = kivi_spec::mla::mla_block_tokens(&s, s.mla().unwrap());
            let mut cache = MlaCache::new(
                s.clone(),
                MlaConfig {
                    block_tokens: None,
                    max_blocks: t / bt + 2,
                },
            )
            .unwrap();
            let id = cache.add_sequence();
            cache.extend(id, &c, &k).unwrap();
            let bytes = cache.memory().total;
            let _ = cpu_mla::decode(&cache, &[id], &q, p).unwrap(); // warm up
            let runs = if t > 16384 { 5 } else { 15 };
            let mut ms = Vec::new();
            let mut out = Vec::new();
            for _ in 0..runs {
                let s0 = Instant::now();
                out = cpu_mla::decode(&cache, &[id], &q, p).unwrap();
                ms.push(s0.elapsed().as_secs_f64() * 1e3);
            }
            let ms = median(ms);
            if name == "f16" {
                f16 = (bytes, ms);
            }
            let num = out.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let den = exact.iter().map(|b| b.abs()).fold(0f32, f32::max);
            println!(
                "  {name:20} {bytes:>12} {:>8.2}x {ms:>10.2} {:>7.2}x {:>12.2e}",
                f16.0 as f64 / bytes as f64,
                ms / f16.1,
                num / den
            );
        }
    }
}
