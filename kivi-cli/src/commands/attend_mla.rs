//! `kivi attend` for a scheme with `heads: mla(...)`: `--k` holds the
//! latent rows `[T, L]`, `--v` the RoPE key rows `[T, R]`, `--q` the
//! absorbed queries `[Hq, L + R]` (per head: latent query, then RoPE
//! query); the output is `[Hq, L]`. The cache is filled one token at a time
//! and decoded on the chosen backend (the sim and cuda backends run the
//! generated MLA kernel). `--dump-dequant` writes the cache's latent and
//! RoPE rows as `k.npy` and `v.npy`.

use super::attend::Args;
use super::schemes::hash_hex;
use crate::args::BackendChoice;
use crate::npy;
use kivi_runtime::device::{self, DeviceKind};
use kivi_runtime::mla::device::MlaDeviceDecode;
use kivi_runtime::mla::{reference, MlaCache, MlaConfig, Part};
use kivi_spec::Scheme;
use std::time::Instant;

/// Rows of a `[T, W]` or `[T, 1, W]` array: `(T, data)`.
fn rows(a: &npy::Array, width: usize, what: &str, path: &std::path::Path) -> super::Result<usize> {
    match a.shape[..] {
        [t, w] | [t, 1, w] if w == width => Ok(t),
        _ => Err(format!(
            "{}: shape {:?} is not [T, {width}] ({what} rows of scheme's mla heads)",
            path.display(),
            a.shape
        )
        .into()),
    }
}

pub fn run(args: &Args, scheme: Scheme) -> super::Result {
    let m = scheme.mla().ok_or("scheme has no mla heads")?;
    let (hq, l, r) = (m.q as usize, m.latent as usize, m.rope_dim as usize);
    if args.lens.is_some() || args.block_tokens.is_some() {
        return Err("--lens and --block-tokens are not supported with mla heads; pass one sequence".into());
    }
    let q = npy::read(&args.q)?;
    let c = npy::read(&args.k)?;
    let k = npy::read(&args.v)?;
    let t = rows(&c, l, "latent", &args.k)?;
    if rows(&k, r, "rope", &args.v)? != t {
        return Err(format!("{}: {} rope rows for {t} latent rows", args.v.display(), k.shape[0]).into());
    }
    if q.shape[..] != [hq, l + r] {
        return Err(format!(
            "{}: shape {:?} is not [{hq}, {}] (q heads x (latent + rope_dim))",
            args.q.display(),
            q.shape,
            l + r
        )
        .into());
    }
    let mut attn = reference::attn_params(&scheme)?;
    if let Some(s) = args.scale {
        if !(s.is_finite() && s > 0.0) {
            return Err(format!("--scale {s} must be a finite positive number").into());
        }
        attn.softmax_scale = s;
    }
    if let Some(w) = args.window {
        if w == 0 {
            return Err("--window 0 would attend to nothing; expected at least 1".into());
        }
        attn.window = Some(w);
    }
    let bt = kivi_spec::mla::mla_block_tokens(&scheme, m);
    let mut cache = MlaCache::new(
        scheme.clone(),
        MlaConfig {
            block_tokens: Some(bt),
            max_blocks: t / bt + 1,
        },
    )?;
    let id = cache.add_sequence();
    for i in 0..t {
        cache.append(id, &c.data[i * l..(i + 1) * l], &k.data[i * r..(i + 1) * r])?;
    }
    let start = Instant::now();
    let (out, backend) = match args.backend {
        BackendChoice::Reference => (
            reference::attend(&scheme, &q.data, &c.data, &k.data, attn)?,
            "reference",
        ),
        BackendChoice::Cpu | BackendChoice::Auto => {
            (kivi_runtime::cpu::mla::decode(&cache, &[id], &q.data, attn)?, "cpu")
        }
        BackendChoice::Sim | BackendChoice::Cuda => {
            let kind = if args.backend == BackendChoice::Sim {
                DeviceKind::Sim
            } else {
                DeviceKind::Cuda
            };
            let dev = MlaDeviceDecode::new(device::open(kind)?, &scheme, None)?;
            (dev.decode(&cache, &[id], &q.data, attn)?, kind.name())
        }
    };
    let ms = start.elapsed().as_secs_f64() * 1e3;
    npy::write(&args.out, &[hq, l], &out)?;
    if let Some(dir) = &args.dump_dequant {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {}", dir.display(), npy::io_reason(&e)))?;
        npy::write(&dir.join("k.npy"), &[t, l], &cache.dequantize(id, Part::Latent)?)?;
        npy::write(&dir.join("v.npy"), &[t, r], &cache.dequantize(id, Part::Rope)?)?;
    }
    let mem = cache.memory();
    if args.json {
        let out = serde_json::json!({
            "scheme": scheme.name,
            "hash": hash_hex(&scheme),
            "backend": backend,
            "tokens": t,
            "q_heads": hq,
            "latent": l,
            "rope_dim": r,
            "softmax_scale": attn.softmax_scale,
            "window": attn.window,
            "ms": ms,
            "memory": {"latent": mem.latent, "rope": mem.rope, "windows": mem.windows,
                       "block_bytes": mem.block_bytes, "tables": mem.tables, "total": mem.total},
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{backend}: {t} tokens, mla q {hq} latent {l} rope {r}, cache {} bytes, decode {ms:.3} ms -> {}",
            mem.total,
            args.out.display()
        );
    }
    Ok(())
}
