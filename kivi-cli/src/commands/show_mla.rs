//! `kivi show` for a scheme with `heads: mla(...)`: bytes per token of the
//! latent and RoPE parts (exact), against an f16 cache of both and
//! DeepSeek's FP8 layout, and what a paged [`MlaCache`] really holds at a
//! context length.

use super::schemes::hash_hex;
use super::show::{exact, tensor_cost, Args};
use kivi_runtime::mla::{MlaCache, MlaConfig, MlaMemory};
use kivi_spec::mla::{mla_block_tokens, mla_bytes_for_tokens};
use kivi_spec::{mla_bytes_per_token, Scheme, Tensor};

/// DeepSeek-V3's FP8 MLA cache per token: the latent in FP8 with one f32
/// scale per 128 channels, the RoPE key in bf16 (656 bytes at 512 + 64).
pub fn deepseek_fp8_bytes(latent: usize, rope_dim: usize) -> usize {
    latent + 4 * latent.div_ceil(128) + 2 * rope_dim
}

/// Fills an [`MlaCache`] with `tokens` synthetic tokens (in chunks, the
/// same cache as streaming) and returns what it holds.
pub fn fill_mla(s: &Scheme, tokens: usize) -> super::Result<(MlaMemory, usize)> {
    let m = s.mla().ok_or("scheme has no mla heads")?;
    let bt = mla_block_tokens(s, m);
    let mut cache = MlaCache::new(
        s.clone(),
        MlaConfig {
            block_tokens: Some(bt),
            max_blocks: tokens.div_ceil(bt) + 1,
        },
    )?;
    let id = cache.add_sequence();
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15);
    let (l, r) = (m.latent as usize, m.rope_dim as usize);
    let mut done = 0;
    while done < tokens {
        let n = (tokens - done).min(1024);
        let c: Vec<f32> = (0..n * l).map(|_| rng.f32() * 2.0).collect();
        let k: Vec<f32> = (0..n * r).map(|_| rng.f32() * 2.0).collect();
        cache.extend(id, &c, &k)?;
        done += n;
    }
    Ok((cache.sequence_memory(id)?, bt))
}

pub fn run(bound: &Scheme, args: &Args) -> super::Result {
    let p = bound.mla_parts().ok_or("scheme has no mla heads")?;
    let (l, r) = (p.mla.latent as usize, p.mla.rope_dim as usize);
    let (bytes, per) = mla_bytes_per_token(bound).ok_or("scheme has no mla heads")?;
    let lat = tensor_cost(&p.latent, Tensor::Key, l, per);
    let rope = tensor_cost(&p.rope, Tensor::Key, r, per);
    if lat.total() + rope.total() != bytes {
        return Err(format!(
            "internal: the latent/rope breakdown ({} + {}) disagrees with the layout ({bytes}) over {per} tokens",
            lat.total(),
            rope.total()
        )
        .into());
    }
    let f16_tok = (l + r) * 2;
    let fp8_tok = deepseek_fp8_bytes(l, r);
    let ctx = args.context;
    let (payload_l, payload_r) = mla_bytes_for_tokens(bound, ctx).ok_or("scheme has no mla heads")?;
    let (mem, bt) = fill_mla(bound, ctx)?;
    if (mem.latent, mem.rope) != (payload_l, payload_r) {
        return Err("internal: the cache's bytes disagree with the layout's count".into());
    }
    let f16_ctx = ctx * f16_tok;
    if args.json {
        let out = serde_json::json!({
            "name": bound.name,
            "canonical": kivi_spec::canonical(bound),
            "hash": hash_hex(bound),
            "mla": {"q_heads": p.mla.q, "latent": l, "rope_dim": r},
            "bytes_per_token": {
                "bytes": bytes,
                "tokens": per,
                "per_token": bytes as f64 / per as f64,
                "latent": lat.json(per, false),
                "rope": rope.json(per, false),
                "f16": f16_tok,
                "deepseek_fp8": fp8_tok,
                "ratio_f16": (f16_tok * per) as f64 / bytes as f64,
                "ratio_fp8": (fp8_tok * per) as f64 / bytes as f64,
            },
            "context": ctx,
            "f16_bytes": f16_ctx,
            "paged_cache": {
                "block_tokens": bt,
                "latent": mem.latent,
                "rope": mem.rope,
                "windows": mem.windows,
                "blocks_in_use": mem.blocks_in_use,
                "block_bytes": mem.block_bytes,
                "tables": mem.tables,
                "total": mem.total,
                "ratio": f16_ctx as f64 / mem.total as f64,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print!("{}", kivi_spec::canonical(bound));
    println!();
    println!("hash      {}", hash_hex(bound));
    println!();
    println!(
        "mla: {} query heads share one {l}-channel latent and one {r}-channel RoPE key per token",
        p.mla.q
    );
    println!("bytes per quantized token (exact, codes + scales/norms + zeros):");
    for (name, c) in [("latent", &lat), ("rope", &rope)] {
        println!(
            "  {name:6}  {:>8} = codes {} + scales {} + zeros {}",
            exact(c.total(), per),
            exact(c.codes, per),
            exact(c.scales, per),
            exact(c.zeros, per)
        );
    }
    println!(
        "  total   {:>8}   (f16 latent + rope: {f16_tok}, {:.2}x; DeepSeek FP8 layout: {fp8_tok}, {:.2}x)",
        exact(bytes, per),
        (f16_tok * per) as f64 / bytes as f64,
        (fp8_tok * per) as f64 / bytes as f64
    );
    println!();
    println!("at {ctx} tokens (f16 latent + rope: {f16_ctx} bytes):");
    println!(
        "  paged cache  {:>12} bytes = blocks {} ({} of {bt} tokens) + windows {} + tables {}   (latent {} + rope {} stored; compression {:.2}x)",
        mem.total,
        mem.block_bytes,
        mem.blocks_in_use,
        mem.windows,
        mem.tables,
        mem.latent,
        mem.rope,
        f16_ctx as f64 / mem.total as f64
    );
    Ok(())
}
