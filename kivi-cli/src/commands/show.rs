//! `kivi show`: a scheme's canonical form, stable hash and exact memory cost
//! — per token per KV head, at a context length, and as a paged cache
//! really allocates it. With `--model`, the same for a whole model declared
//! layer by layer (`kivi_spec::parse_model`): each layer's scheme, window
//! and bytes (sliding layers evicting), the model's total, and the one
//! block pool every layer draws on (`kivi_runtime::pool`): its bytes at the
//! context with and without eviction, and its peak during a chunked
//! prefill (what a pool must hold).

use super::schemes::{hash_hex, load_scheme};
use kivi_runtime::low_rank::LowRankCache;
use kivi_runtime::pool::{BlockPool, PoolReport};
use kivi_runtime::{CacheConfig, MemoryReport, PagedCache};
use kivi_spec::layout::{bits_per_element, bytes_per_token_per_head, codes_per_word, default_block_tokens, Footprint};
use kivi_spec::{Axis, Codec, Heads, Scheme, Tensor};

/// Longest context `show` fills a real cache for (it quantizes every token).
const MAX_CONTEXT: usize = 1 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Scheme text (contains `{`), else a preset name (`kivi schemes`), else a file path (`./NAME` for a file named like a preset)
    #[arg(long, required_unless_present = "model", conflicts_with = "model")]
    pub scheme: Option<String>,
    /// A model declaration instead of a scheme: its text (`model { layers: 18, window: 512, global_layers: [5, 11, 17], default: kivi2, global: kivi4 }`) or a file holding it
    #[arg(long)]
    pub model: Option<String>,
    /// Head layout: gqa:Q:KV, mha:N or mqa:Q (default: the scheme's own, else gqa:32:8)
    #[arg(long, value_parser = parse_heads)]
    pub heads: Option<Heads>,
    /// Head dimension (default: the scheme's own, else 128)
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Context length, in tokens, for the totals and the paged cache (1 to 1m; 4k = 4096)
    #[arg(long, default_value = "4k", value_parser = crate::args::count)]
    pub context: usize,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

/// `gqa:32:8`, `mha:8`, `mqa:4`. Shared by `show`, `codegen` and `tune`;
/// only the syntax is checked here — the counts are validated with the
/// scheme (`Scheme::with_shape`), which gives the one-line message.
pub fn parse_heads(s: &str) -> Result<Heads, String> {
    let parts: Vec<&str> = s.split(':').map(str::trim).collect();
    let num = |p: &str| -> Result<u32, String> {
        p.parse::<u32>()
            .map_err(|_| format!("`{p}` in --heads {s} is not a head count"))
    };
    let h = match parts.as_slice() {
        ["gqa", q, kv] => Heads::Gqa {
            q: num(q)?,
            kv: num(kv)?,
        },
        ["mha", n] => Heads::Mha(num(n)?),
        ["mqa", q] => Heads::Mqa(num(q)?),
        _ => return Err(format!("`{s}` is not a head layout; expected gqa:Q:KV, mha:N or mqa:Q")),
    };
    Ok(h)
}

/// Bytes of one tensor over `tokens` quantized tokens of one KV head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    pub codes: usize,
    /// Scales (uniform) or norms (Lloyd–Max).
    pub scales: usize,
    pub zeros: usize,
    /// Sparse outliers: u16 channel indices and corrections.
    pub outliers: usize,
}

impl Cost {
    pub fn total(&self) -> usize {
        self.codes + self.scales + self.zeros + self.outliers
    }

    /// Bytes per token of each part over `per` tokens, as `--json` reports
    /// them; `outliers` only where the tensor can have them (an MLA part
    /// cannot, and its report has no such field).
    pub fn json(&self, per: usize, outliers: bool) -> serde_json::Value {
        let f = |b: usize| b as f64 / per as f64;
        let mut m = serde_json::json!({
            "codes": f(self.codes),
            "scales": f(self.scales),
            "zeros": f(self.zeros),
            "total": f(self.total()),
        });
        if outliers {
            m["outliers"] = f(self.outliers).into();
        }
        m
    }
}

/// The per-tensor split of [`bytes_per_token_per_head`], over the same
/// period of `tokens` tokens (a whole number of every group), straight from
/// the packing rules in `kivi_spec::layout`.
pub fn tensor_cost(s: &Scheme, t: Tensor, head_dim: usize, tokens: usize) -> Cost {
    match s.codec(t) {
        Codec::Full => Cost {
            codes: tokens * head_dim * s.dtype.bytes(),
            ..Cost::default()
        },
        // One packed code per sub-vector; the codebooks are per layer.
        Codec::Vq(v) => Cost {
            codes: tokens * v.subvectors(head_dim).div_ceil(codes_per_word(v.code_bits())) * 4,
            ..Cost::default()
        },
        Codec::Quant(q) => {
            let g = q.group as usize;
            let params = match q.axis {
                Axis::Channel => tokens / g * head_dim,
                Axis::Token => tokens * (head_dim / g),
            };
            let k = s.outliers_of(t);
            Cost {
                codes: tokens * head_dim.div_ceil(codes_per_word(q.bits)) * 4,
                scales: params * q.scale.bytes(),
                zeros: if q.has_zeros() { params * q.scale.bytes() } else { 0 },
                // per token: indices two per word, corrections packed in words
                outliers: tokens * (k.div_ceil(2) + (k * s.dtype.bytes()).div_ceil(4)) * 4,
            }
        }
    }
}

/// Exact bytes per token per KV head of a bound scheme: the total as
/// `(bytes, tokens)` and the key/value split over the same `tokens`.
pub fn per_token(s: &Scheme) -> super::Result<((usize, usize), Cost, Cost)> {
    let d = s.head_dim.ok_or("scheme has no head_dim")? as usize;
    let (bytes, tokens) = bytes_per_token_per_head(s);
    let k = tensor_cost(s, Tensor::Key, d, tokens);
    let v = tensor_cost(s, Tensor::Value, d, tokens);
    if k.total() + v.total() != bytes {
        return Err(format!(
            "internal: the key/value breakdown ({} + {} bytes) disagrees with the layout ({bytes} bytes) over {tokens} tokens",
            k.total(),
            v.total()
        )
        .into());
    }
    Ok(((bytes, tokens), k, v))
}

/// `n / d` printed exactly: an integer when it divides, else a decimal and
/// the fraction.
pub fn exact(n: usize, d: usize) -> String {
    let (whole, rest) = (n / d, n % d);
    if rest == 0 {
        whole.to_string()
    } else {
        format!("{:.4} ({n}/{d})", n as f64 / d as f64)
    }
}

/// Bytes of `tokens` tokens of K and V in f16, all KV heads.
pub fn f16_bytes(tokens: usize, kv_heads: usize, head_dim: usize) -> usize {
    tokens * kv_heads * head_dim * 2 * 2
}

/// Fills a paged cache with `tokens` synthetic tokens and returns what it
/// allocated. Prefill in chunks: the same cache as streaming, bit for bit,
/// without holding the whole context in f32.
pub fn fill_paged(s: &Scheme, tokens: usize) -> super::Result<(MemoryReport, usize)> {
    fill_paged_evicting(s, tokens, None)
}

/// [`fill_paged`] for a layer with a sliding window `window`: the cache
/// evicts what the window no longer sees (`PagedCache::set_eviction_window`).
pub fn fill_paged_evicting(s: &Scheme, tokens: usize, window: Option<usize>) -> super::Result<(MemoryReport, usize)> {
    let shape = s.shape().ok_or("scheme has no shape")?;
    let bt = default_block_tokens(s);
    let config = CacheConfig {
        block_tokens: Some(bt),
        max_blocks: tokens.div_ceil(bt) + 1,
    };
    let mut cache = PagedCache::new(s.clone(), config)?;
    cache.set_eviction_window(window)?;
    let seq = cache.add_sequence();
    let row = shape.kv_heads * shape.head_dim;
    // Deterministic values in [-2, 2): what the cache allocates depends on
    // the shape only, but real values exercise the real write path.
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut next = move || rng.f32() * 2.0;
    let mut done = 0;
    while done < tokens {
        let n = (tokens - done).min(CHUNK);
        let k: Vec<f32> = (0..n * row).map(|_| next()).collect();
        let v: Vec<f32> = (0..n * row).map(|_| next()).collect();
        cache.extend(seq, &k, &v)?;
        done += n;
    }
    Ok((cache.memory(), bt))
}

/// [`fill_paged`] for a low-rank scheme: a `LowRankCache` (the paged cache
/// of its coordinates plus the bases, counted once). The bases are the
/// first `R` unit vectors: what the cache allocates depends on the shape,
/// not on the basis a calibration would supply.
pub fn fill_low_rank(s: &Scheme, tokens: usize) -> super::Result<(MemoryReport, usize)> {
    let shape = s.shape().ok_or("scheme has no shape")?;
    let coords = s.coordinate_scheme().ok_or("scheme has no low_rank field")?;
    let bt = default_block_tokens(&coords);
    let mut cache = unit_low_rank_cache(s, tokens)?;
    let seq = cache.add_sequence();
    let row = shape.kv_heads * shape.head_dim;
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut done = 0;
    while done < tokens {
        let n = (tokens - done).min(CHUNK);
        let k: Vec<f32> = (0..n * row).map(|_| rng.f32() * 2.0).collect();
        let v: Vec<f32> = (0..n * row).map(|_| rng.f32() * 2.0).collect();
        cache.extend(seq, &k, &v)?;
        done += n;
    }
    Ok((cache.memory(), bt))
}

/// A `LowRankCache` of a bound low-rank scheme for `tokens` tokens, its
/// bases the first `R` unit vectors (what it allocates depends on the
/// shape, not on the basis a calibration would supply).
fn unit_low_rank_cache(s: &Scheme, tokens: usize) -> super::Result<LowRankCache> {
    let shape = s.shape().ok_or("scheme has no shape")?;
    let coords = s.coordinate_scheme().ok_or("scheme has no low_rank field")?;
    let (h, d, r) = (shape.kv_heads, shape.head_dim, coords.head_dim.unwrap_or(0) as usize);
    let unit: Vec<f32> = (0..h * r * d)
        .map(|i| if i % d == (i / d) % r { 1.0 } else { 0.0 })
        .collect();
    let bases = kivi_runtime::low_rank::Bases::new(s, unit.clone(), unit)?;
    let bt = default_block_tokens(&coords);
    let config = CacheConfig {
        block_tokens: Some(bt),
        max_blocks: tokens.div_ceil(bt) + 1,
    };
    Ok(LowRankCache::with_bases(s.clone(), config, bases)?)
}

/// The scheme whose rows a layer's blocks hold: a low-rank scheme's
/// coordinate scheme (`R` wide), else the scheme itself.
fn stored_scheme(s: &Scheme) -> Scheme {
    kivi_templates::kernel_scheme(s).into_owned()
}

/// One layer's cache in [`fill_model_pool`].
enum LayerCache {
    Paged(Box<PagedCache>),
    LowRank(Box<LowRankCache>),
}

/// Prefill chunk of [`fill_model_pool`] (and of [`fill_paged`]).
const CHUNK: usize = 1024;

/// Fills every layer of a model (`schemes[l]`, sliding window
/// `windows[l]`, evicting) with `tokens` synthetic tokens in lockstep, a
/// chunk of [`CHUNK`] tokens through all layers at a time as a model's
/// prefill does, all on one [`BlockPool`]; returns the pool's report (its
/// peak is the most bytes of blocks the model held at once) and each
/// layer's memory. A low-rank layer is a `LowRankCache` (unit bases,
/// [`fill_low_rank`]): its coordinate blocks on the pool, its bases and
/// exact residual rows outside it; it must be a global layer (a
/// `LowRankCache` does not evict).
pub fn fill_model_pool(
    schemes: &[Scheme],
    windows: &[Option<usize>],
    tokens: usize,
) -> super::Result<(PoolReport, Vec<MemoryReport>)> {
    // The budget is unbounded here: this measures what a pool must hold.
    let pool = BlockPool::new(usize::MAX);
    let mut caches = Vec::with_capacity(schemes.len());
    for (l, (s, w)) in schemes.iter().zip(windows).enumerate() {
        if s.low_rank.is_some() {
            if let Some(w) = w {
                return Err(format!(
                    "layer {l}: scheme `{}` has low_rank, and a low-rank cache does not evict yet; \
                     give it a global layer (global_layers: [...]) or a scheme without low_rank for the sliding layers (window {w})",
                    s.name
                )
                .into());
            }
            let mut c = unit_low_rank_cache(s, tokens)?;
            c.set_pool(Some(pool.clone()))?;
            let id = c.add_sequence();
            caches.push((LayerCache::LowRank(Box::new(c)), id));
            continue;
        }
        let bt = default_block_tokens(s);
        let config = CacheConfig {
            block_tokens: Some(bt),
            max_blocks: tokens.div_ceil(bt) + 1,
        };
        let mut c = PagedCache::new(s.clone(), config)?;
        c.set_eviction_window(*w)?;
        c.set_pool(Some(pool.clone()))?;
        let id = c.add_sequence();
        caches.push((LayerCache::Paged(Box::new(c)), id));
    }
    let shape = schemes.first().and_then(Scheme::shape).ok_or("scheme has no shape")?;
    let row = shape.kv_heads * shape.head_dim;
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut done = 0;
    while done < tokens {
        let n = (tokens - done).min(CHUNK);
        let k: Vec<f32> = (0..n * row).map(|_| rng.f32() * 2.0).collect();
        let v: Vec<f32> = (0..n * row).map(|_| rng.f32() * 2.0).collect();
        for (c, id) in &mut caches {
            match c {
                LayerCache::Paged(c) => c.extend(*id, &k, &v)?,
                LayerCache::LowRank(c) => c.extend(*id, &k, &v)?,
            }
        }
        done += n;
    }
    let memory = caches
        .iter()
        .map(|(c, _)| match c {
            LayerCache::Paged(c) => c.memory(),
            LayerCache::LowRank(c) => c.memory(),
        })
        .collect();
    Ok((pool.memory(), memory))
}

/// Bytes of a cache's blocks (what it draws from a block pool; a
/// low-rank scheme's blocks hold its coordinates).
fn block_bytes(s: &Scheme, m: &MemoryReport) -> usize {
    let s = stored_scheme(s);
    let shape = s.shape().expect("bound");
    m.blocks_in_use * kivi_spec::layout::BlockLayout::new(&s, shape, default_block_tokens(&s)).block_bytes()
}

/// A memory report as JSON (shared with `attend`).
pub fn memory_json(m: &MemoryReport) -> serde_json::Value {
    serde_json::json!({
        "codes": m.codes,
        "scales": m.scales,
        "zeros": m.zeros,
        "outliers": m.outliers,
        "means": m.means,
        "codebooks": m.codebooks,
        "bases": m.bases,
        "windows": m.windows,
        "tables": m.tables,
        "blocks_in_use": m.blocks_in_use,
        "total": m.total,
    })
}

/// Binds the shape from the flags, else the scheme's own, else GQA 32:8
/// with head_dim 128 (shared with `codegen`).
pub fn bind_or_default(scheme: &Scheme, heads: Option<Heads>, head_dim: Option<u32>) -> super::Result<Scheme> {
    let heads = heads.or(scheme.heads).unwrap_or(Heads::Gqa { q: 32, kv: 8 });
    let head_dim = head_dim.or(scheme.head_dim).unwrap_or(128);
    Ok(scheme.with_shape(heads, head_dim).map_err(|e| {
        format!(
            "scheme `{}` does not fit heads {heads}, head_dim {head_dim}: {e}",
            scheme.name
        )
    })?)
}

/// `--context` within what `kivi show` fills a cache for.
fn check_context(context: usize) -> super::Result {
    if context > MAX_CONTEXT {
        return Err(format!("--context {context} is out of range; expected 1 to {MAX_CONTEXT}").into());
    }
    Ok(())
}

pub fn run(args: Args) -> super::Result {
    if let Some(model) = &args.model {
        return run_model(model, &args);
    }
    let scheme = load_scheme(
        args.scheme
            .as_deref()
            .ok_or("name a scheme with --scheme NAME or a model with --model TEXT")?,
    )?;
    let bound = bind_or_default(&scheme, args.heads, args.head_dim)?;
    check_context(args.context)?;
    if bound.mla().is_some() {
        return super::show_mla::run(&bound, &args);
    }
    let (heads, head_dim) = (
        bound.heads.ok_or("scheme has no heads")?,
        bound.head_dim.ok_or("no head_dim")?,
    );
    let shape = bound.shape().ok_or("scheme has no shape")?;
    // A low-rank scheme stores its coordinate scheme's rows (R wide): its
    // per-token bytes and footprint are that scheme's; f16 is of full rows.
    let stored = kivi_templates::kernel_scheme(&bound).into_owned();
    let ((bytes, per), k, v) = per_token(&stored)?;
    let f16_tok = 2 * shape.head_dim * 2;
    // The footprint counts a low-rank scheme's coordinate rows and its
    // kept exact rows (`residual = N`).
    let foot = Footprint::for_tokens(&bound, args.context);
    let f16_ctx = f16_bytes(args.context, shape.kv_heads, shape.head_dim);
    let (mem, block_tokens) = if bound.low_rank.is_some() {
        fill_low_rank(&bound, args.context)?
    } else {
        fill_paged(&bound, args.context)?
    };
    let ratio = |b: usize| f16_ctx as f64 / b as f64;

    if args.json {
        let mut out = serde_json::json!({
            "name": bound.name,
            "canonical": kivi_spec::canonical(&bound),
            "hash": hash_hex(&bound),
            "scheme_hash": hash_hex(&scheme),
            "shape": {"q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
            "bytes_per_token_per_head": {
                "bytes": bytes,
                "tokens": per,
                "per_token": bytes as f64 / per as f64,
                "key": k.json(per, true),
                "value": v.json(per, true),
                "f16": f16_tok,
                "ratio": (f16_tok * per) as f64 / bytes as f64,
            },
            "bits_per_element": bits_per_element(&bound),
            "context": args.context,
            "f16_bytes": f16_ctx,
            "footprint": {
                "codes": foot.codes,
                "scales": foot.scales,
                "zeros": foot.zeros,
                "outliers": foot.outliers,
                "means": foot.means,
                "windows": foot.windows,
                "total": foot.total(),
                "ratio": ratio(foot.total()),
            },
            "paged_cache": {
                "block_tokens": block_tokens,
                "memory": memory_json(&mem),
                "ratio": ratio(mem.total),
            },
        });
        if let Some(l) = bound.low_rank {
            out["low_rank"] = serde_json::json!({
                "rank": l.rank,
                "coordinates": kivi_spec::canonical(&stored),
                "bases_bytes": mem.bases,
            });
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    print!("{}", kivi_spec::canonical(&bound));
    println!();
    println!(
        "hash      {} (of the scheme bound to {heads}, head_dim {head_dim})",
        hash_hex(&bound)
    );
    if bound != scheme {
        println!("          {} (as declared, without a shape)", hash_hex(&scheme));
    }
    if let Some(l) = bound.low_rank {
        println!(
            "low_rank  {} coordinates per token per KV head (of head_dim {head_dim}), stored as `{}` stores an R-wide head; \
             bases {} bytes per layer (2 x {} KV heads x {} x {head_dim} in {}), counted once in the paged cache",
            l.rank,
            stored.name,
            mem.bases,
            shape.kv_heads,
            l.rank,
            bound.dtype.name()
        );
    }
    println!();
    println!("bytes per quantized token per KV head (exact, codes + scales/norms + zeros + outliers):");
    for (name, c) in [("key", &k), ("value", &v)] {
        println!(
            "  {name:5}  {:>8} = codes {} + scales {} + zeros {} + outliers {}",
            exact(c.total(), per),
            exact(c.codes, per),
            exact(c.scales, per),
            exact(c.zeros, per),
            exact(c.outliers, per)
        );
    }
    println!(
        "  total  {:>8}   (f16: {f16_tok}; compression {:.2}x; all-in {:.4} bits per element)",
        exact(bytes, per),
        (f16_tok * per) as f64 / bytes as f64,
        bits_per_element(&bound)
    );
    println!();
    println!(
        "at {} tokens, kv_heads = {} (f16 K+V: {f16_ctx} bytes):",
        args.context, shape.kv_heads
    );
    println!(
        "  payload      {:>12} bytes = codes {} + scales {} + zeros {} + outliers {} + means {} + windows {}   (compression {:.2}x)",
        foot.total(),
        foot.codes,
        foot.scales,
        foot.zeros,
        foot.outliers,
        foot.means,
        foot.windows,
        ratio(foot.total())
    );
    println!(
        "  paged cache  {:>12} bytes = codes {} + scales {} + zeros {} + outliers {} + means {} + codebooks {}{} + windows {} + tables {}   (compression {:.2}x; {} blocks of {block_tokens} tokens)",
        mem.total,
        mem.codes,
        mem.scales,
        mem.zeros,
        mem.outliers,
        mem.means,
        mem.codebooks,
        if mem.bases > 0 {
            format!(" + bases {}", mem.bases)
        } else {
            String::new()
        },
        mem.windows,
        mem.tables,
        ratio(mem.total),
        mem.blocks_in_use
    );
    Ok(())
}

/// One layer of a model report.
struct LayerRow {
    kind: kivi_spec::LayerKind,
    window: Option<usize>,
    scheme: Scheme,
    /// With eviction (sliding layers), and without.
    memory: MemoryReport,
    kept: MemoryReport,
}

/// `kivi show --model`: every layer's scheme and exact bytes at the
/// context, sliding layers with and without eviction, and the totals.
fn run_model(arg: &str, args: &Args) -> super::Result {
    let (text, origin) = if arg.contains('{') {
        (arg.to_string(), "model text".to_string())
    } else {
        let text = std::fs::read_to_string(arg).map_err(|e| format!("cannot read model file `{arg}`: {e}"))?;
        (text, arg.to_string())
    };
    let decl = kivi_spec::parse_model(&text).map_err(|e| format!("{origin}:{e}"))?;
    let (kinds, windows) = decl.kinds().zip(decl.windows()).ok_or(
        "the model declares no layer count: add `layers: N` (and `window: W`, `global_layers: [...]` for sliding layers)",
    )?;
    let schemes = decl.schemes_for(&kinds).map_err(|e| format!("{origin}:{e}"))?;
    check_context(args.context)?;
    let mut bound = Vec::with_capacity(schemes.len());
    for (l, scheme) in schemes.iter().enumerate() {
        bound.push(bind_or_default(scheme, args.heads, args.head_dim).map_err(|e| format!("layer {l}: {e}"))?);
    }
    let shape = bound[0].shape().ok_or("scheme has no shape")?;
    if let Some((l, s)) = bound.iter().enumerate().find(|(_, s)| s.shape() != Some(shape)) {
        return Err(format!("layer {l}: scheme `{}` has another head layout than layer 0", s.name).into());
    }
    let windows: Vec<Option<usize>> = windows.iter().map(|w| w.map(|w| w as usize)).collect();
    // Every layer on one pool, filled in lockstep: each layer's bytes with
    // eviction, and the pool's.
    let (pool, evicting) = fill_model_pool(&bound, &windows, args.context)?;
    // Without eviction, layers of one scheme hold the same bytes: fill each once.
    let mut seen: Vec<(String, MemoryReport)> = Vec::new();
    let mut rows = Vec::with_capacity(schemes.len());
    for (((scheme, kind), window), memory) in bound.into_iter().zip(&kinds).zip(&windows).zip(evicting) {
        let key = kivi_spec::canonical(&scheme);
        let kept = match (window, seen.iter().find(|(k, _)| *k == key)) {
            (None, _) => memory,
            (Some(_), Some((_, m))) => *m,
            (Some(_), None) => {
                let m = fill_paged(&scheme, args.context)?.0;
                seen.push((key, m));
                m
            }
        };
        rows.push(LayerRow {
            kind: *kind,
            window: *window,
            scheme,
            memory,
            kept,
        });
    }
    // The pool holds blocks only; sinks, windows, tables, means and a
    // low-rank layer's bases and exact rows are per cache, outside it.
    let pool_kept: usize = rows.iter().map(|r| block_bytes(&r.scheme, &r.kept)).sum();
    let outside: usize = rows
        .iter()
        .map(|r| r.memory.total - block_bytes(&r.scheme, &r.memory))
        .sum();
    let total: usize = rows.iter().map(|r| r.memory.total).sum();
    let kept: usize = rows.iter().map(|r| r.kept.total).sum();
    let f16_all = rows.len() * f16_bytes(args.context, shape.kv_heads, shape.head_dim);
    if args.json {
        let layers: Vec<serde_json::Value> = rows
            .iter()
            .enumerate()
            .map(|(l, r)| {
                serde_json::json!({
                    "layer": l,
                    "kind": r.kind.name(),
                    "window": r.window,
                    "scheme": r.scheme.name,
                    "hash": hash_hex(&r.scheme),
                    "memory": memory_json(&r.memory),
                    "without_eviction": r.kept.total,
                })
            })
            .collect();
        let out = serde_json::json!({
            "name": decl.name,
            "shape": {"q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
            "context": args.context,
            "layers": layers,
            "total": total,
            "without_eviction": kept,
            "pool": {
                "blocks": pool.used,
                "peak": pool.peak,
                "prefill_chunk": CHUNK,
                "without_eviction": pool_kept,
                "outside_pool": outside,
            },
            "f16_bytes": f16_all,
            "ratio": f16_all as f64 / total as f64,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "model {}: {} layers, {}, head_dim {}, at {} tokens (exact bytes of each layer's paged cache; sliding layers evict)",
        decl.name,
        rows.len(),
        rows[0].scheme.heads.map_or("?".into(), |h| h.to_string()),
        shape.head_dim,
        args.context
    );
    println!(
        "  {:>5}  {:<7}  {:>7}  {:<10}  {:>16}  {:>18}",
        "layer", "kind", "window", "scheme", "bytes", "without eviction"
    );
    for (l, r) in rows.iter().enumerate() {
        println!(
            "  {l:>5}  {:<7}  {:>7}  {:<10}  {:>16}  {:>18}",
            r.kind.name(),
            r.window.map_or("-".into(), |w| w.to_string()),
            r.scheme.name,
            r.memory.total,
            r.kept.total
        );
    }
    println!(
        "  total  {total} bytes ({:.2} MiB; without eviction {kept}, {:.1}%); f16 K+V of every layer {f16_all} (compression {:.2}x)",
        total as f64 / (1 << 20) as f64,
        100.0 * total as f64 / kept as f64,
        f16_all as f64 / total as f64
    );
    println!(
        "  pool   one block pool for all {} layers: {} bytes of blocks ({:.2} MiB; without eviction {pool_kept}, {:.2} MiB); \
         peak {} bytes ({:.2} MiB) during a prefill in chunks of {CHUNK}; {outside} bytes of sinks, windows, tables and means{} outside it",
        rows.len(),
        pool.used,
        mib(pool.used),
        mib(pool_kept),
        pool.peak,
        mib(pool.peak),
        if rows.iter().any(|r| r.scheme.low_rank.is_some()) {
            " (and the low-rank layers' bases and exact rows)"
        } else {
            ""
        },
    );
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kivi_spec::presets;

    #[test]
    fn kivi2_costs_96_bytes_split_48_48() {
        let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
        let ((bytes, per), k, v) = per_token(&s).unwrap();
        assert_eq!(bytes, 96 * per);
        assert_eq!((k.total(), v.total()), (48 * per, 48 * per));
        assert_eq!((k.codes, k.scales, k.zeros), (32 * per, 8 * per, 8 * per));
        assert_eq!((v.codes, v.scales, v.zeros), (32 * per, 8 * per, 8 * per));
    }

    #[test]
    fn breakdown_agrees_with_layout_for_every_preset_and_shape() {
        for p in presets::all() {
            for (h, d) in [
                (Heads::Mha(2), 64),
                (Heads::Mqa(4), 96),
                (Heads::Gqa { q: 8, kv: 2 }, 256),
            ] {
                let s = p.with_shape(h, d).unwrap();
                per_token(&s).unwrap();
            }
        }
        // 3-bit codes do not divide 32: 10 per word, a 96-channel row is 10 words.
        let s = kivi_spec::parse_scheme(
            "B { key: quant(bits = 3, axis = channel, group = 48), value: quant(bits = 3, axis = token, group = 32, scale = f32), head_dim: 96 }",
        )
        .unwrap()
        .with_shape(Heads::Mha(1), 96)
        .unwrap();
        let ((_, per), k, v) = per_token(&s).unwrap();
        assert_eq!(k.codes, per * 40);
        assert_eq!(v.scales, per * 3 * 4);
        assert_eq!(exact(k.scales, per), "4");
        // The codec pipeline: norms without zeros, outliers per token.
        let s = kivi_spec::parse_scheme(
            "C { key: quant(bits = 3, axis = token, group = 256, levels = lloyd_max), value: quant(bits = 2, axis = token, group = 64),
                 outliers: sparse(per_token = 3, apply = [key]), rotation: hadamard(block = 256, apply = [key]) }",
        )
        .unwrap()
        .with_shape(Heads::Mqa(4), 256)
        .unwrap();
        let ((bytes, per), k, v) = per_token(&s).unwrap();
        assert_eq!(
            (k.codes, k.scales, k.zeros, k.outliers),
            (104 * per, 2 * per, 0, 16 * per)
        );
        assert_eq!(v.total(), (64 + 16) * per);
        assert_eq!(bytes, (122 + 80) * per);
    }

    #[test]
    fn heads_parse() {
        assert_eq!(parse_heads("gqa:32:8"), Ok(Heads::Gqa { q: 32, kv: 8 }));
        assert_eq!(parse_heads("mha:8"), Ok(Heads::Mha(8)));
        assert_eq!(parse_heads("mqa:4"), Ok(Heads::Mqa(4)));
        assert!(parse_heads("gqa:32").is_err());
        assert!(parse_heads("gqa:x:8").is_err());
    }

    #[test]
    fn paged_cache_allocation_matches_footprint_plus_overheads() {
        let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 64).unwrap();
        let (m, bt) = fill_paged(&s, 1000).unwrap();
        let f = Footprint::for_tokens(&s, 1000);
        // Blocks round up, windows are allocated at capacity: never less.
        assert!(m.codes >= f.codes && m.windows >= f.windows);
        let qk = kivi_spec::layout::regions(&s, Tensor::Key, 1000).quantized; // 864
        let qv = kivi_spec::layout::regions(&s, Tensor::Value, 1000).quantized; // 872
        assert_eq!(m.blocks_in_use, qk.max(qv).div_ceil(bt));
        // 2 heads x (key + value) x 64 tokens x 4 words x 4 bytes per block
        assert_eq!(m.codes, m.blocks_in_use * 2 * 2 * bt * 4 * 4);
        assert_eq!(m.total, m.codes + m.scales + m.zeros + m.windows + m.tables);
    }
}
