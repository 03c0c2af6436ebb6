//! `kivi attend`: fill a paged cache from `.npy` keys and values, one token
//! at a time as a decoder would, and run decode attention for a `.npy` query
//! on the chosen backend.
//!
//! Shapes: `k`, `v` are `[T, Hkv, D]` with `q` `[Hq, D]`, or batched
//! `[B, T, Hkv, D]` with `q` `[B, Hq, D]` (and `--lens` for sequences shorter
//! than `T`). The head layout and head_dim come from the inputs; the output
//! has the query's shape, float32.

use super::schemes::{hash_hex, load_scheme};
use super::show::memory_json;
use crate::args::BackendChoice;
use crate::npy::{self, Array};
use kivi_runtime::device::{DeviceBackend, DeviceKind};
use kivi_runtime::low_rank::LowRankCache;
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, MemoryReport, PagedCache, ReferenceBackend, SeqId};
use kivi_spec::{layout, Heads, Scheme, Shape, Tensor};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The backends `attend` runs on.
const BACKENDS: &[BackendChoice] = &[
    BackendChoice::Reference,
    BackendChoice::Cpu,
    BackendChoice::Sim,
    BackendChoice::Cuda,
];

#[derive(clap::Args)]
pub struct Args {
    /// Scheme text (contains `{`), else a preset name (`kivi schemes`), else a file path (`./NAME` for a file named like a preset)
    #[arg(long)]
    pub scheme: String,
    /// Query, [Hq, D] (or [B, Hq, D] with batched k/v); float32 or float16
    #[arg(long)]
    pub q: PathBuf,
    /// Keys, [T, Hkv, D] or [B, T, Hkv, D]
    #[arg(long)]
    pub k: PathBuf,
    /// Values, the same shape as the keys
    #[arg(long)]
    pub v: PathBuf,
    /// Where to write the attention output (float32, the query's shape)
    #[arg(long)]
    pub out: PathBuf,
    /// Backend to run decode attention on
    #[arg(long, default_value = "cpu", value_parser = crate::args::backend(BACKENDS))]
    pub backend: BackendChoice,
    /// Softmax scale (default: the scheme's, else 1/sqrt(D))
    #[arg(long)]
    pub scale: Option<f32>,
    /// Attend only to the last W tokens (default: the scheme's sliding window)
    #[arg(long, value_parser = crate::args::count)]
    pub window: Option<usize>,
    /// Tokens per cache block (default: the scheme's default block size)
    #[arg(long, value_parser = crate::args::count)]
    pub block_tokens: Option<usize>,
    /// Per-sequence lengths of a batch, comma-separated, e.g. 5,7,1 (default: all T)
    #[arg(long, value_delimiter = ',', value_parser = crate::args::length)]
    pub lens: Option<Vec<usize>>,
    /// Print a one-object JSON summary instead of a line of text
    #[arg(long)]
    pub json: bool,
    /// Also write the cache's dequantized view of K and V to DIR/k.npy and DIR/v.npy
    #[arg(long, value_name = "DIR")]
    pub dump_dequant: Option<PathBuf>,
    /// A calibration file (`kivi calibrate`) whose codebooks a scheme with levels = nuq decodes with, or whose bases a low_rank scheme projects on
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// The layer of the calibration to take the codebooks or bases from
    #[arg(long, default_value_t = 0, requires = "calibration")]
    pub layer: usize,
}

/// The validated problem: the scheme bound to the inputs' shape, and the
/// inputs as flat C-order buffers.
struct Problem {
    scheme: Scheme,
    shape: Shape,
    batched: bool,
    batch: usize,
    /// Tokens per sequence in the k/v arrays (`T`).
    t_max: usize,
    lens: Vec<usize>,
    q: Array,
    k: Array,
    v: Array,
}

fn name(p: &Path) -> String {
    p.display().to_string()
}

fn load(args: &Args) -> super::Result<Problem> {
    let scheme = load_scheme(&args.scheme)?;
    let q = npy::read(&args.q)?;
    let k = npy::read(&args.k)?;
    let v = npy::read(&args.v)?;
    let (kn, vn, qn) = (name(&args.k), name(&args.v), name(&args.q));
    let (batched, batch, t_max, hkv, d) = match k.shape[..] {
        [t, h, d] => (false, 1, t, h, d),
        [b, t, h, d] => (true, b, t, h, d),
        _ => return Err(format!("{kn}: shape {:?} is neither [T, Hkv, D] nor [B, T, Hkv, D]", k.shape).into()),
    };
    if v.shape != k.shape {
        return Err(format!("{vn}: shape {:?} differs from the keys' {:?} ({kn})", v.shape, k.shape).into());
    }
    let hq = match (batched, &q.shape[..]) {
        (false, [h, qd]) | (true, [_, h, qd]) if *qd == d => *h,
        (false, [_, qd]) | (true, [_, _, qd]) => {
            return Err(format!("{qn}: head_dim {qd} differs from the keys' head_dim {d} ({kn})").into())
        }
        (false, s) => return Err(format!("{qn}: shape {s:?} is not [Hq, D] (the keys are [T, Hkv, D])").into()),
        (true, s) => return Err(format!("{qn}: shape {s:?} is not [B, Hq, D] (the keys are [B, T, Hkv, D])").into()),
    };
    if batched && q.shape[0] != batch {
        return Err(format!("{qn}: {} queries for a batch of {batch} sequences ({kn})", q.shape[0]).into());
    }
    if hq > u32::MAX as usize || hkv > u32::MAX as usize || d > u32::MAX as usize {
        return Err(format!("{kn}: shape {:?} is too large", k.shape).into());
    }
    let heads = Heads::from_counts(hq as u32, hkv as u32);
    let bound = scheme.with_shape(heads, d as u32).map_err(|e| {
        format!(
            "inputs do not fit scheme `{}`: {e} ({qn}: {hq} query heads, {kn}: {hkv} KV heads, head_dim {d})",
            scheme.name
        )
    })?;
    let shape = bound.shape().ok_or("internal: bound scheme without a shape")?;
    let lens = match &args.lens {
        None => vec![t_max; batch],
        Some(_) if !batched => {
            return Err(format!("--lens needs batched inputs ([B, T, Hkv, D]); {kn} is {:?}", k.shape).into())
        }
        Some(l) if l.len() != batch => {
            return Err(format!("--lens has {} lengths for a batch of {batch} sequences", l.len()).into())
        }
        Some(l) => {
            if let Some((i, n)) = l.iter().enumerate().find(|(_, n)| **n > t_max) {
                return Err(
                    format!("--lens: sequence {i} has length {n}, more than the {t_max} tokens in {kn}").into(),
                );
            }
            l.clone()
        }
    };
    if let Some((i, x)) = q.data.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        let (h, c) = ((i / d) % hq, i % d);
        let at = if batched {
            format!("[{}, {h}, {c}]", i / (hq * d))
        } else {
            format!("[{h}, {c}]")
        };
        return Err(format!("{qn}: non-finite value ({x}) at {at}").into());
    }
    Ok(Problem {
        scheme: bound,
        shape,
        batched,
        batch,
        t_max,
        lens,
        q,
        k,
        v,
    })
}

/// The cache `attend` fills: a paged cache, or for a `low_rank` scheme a
/// `LowRankCache` (the paged cache of its coordinates plus the bases of
/// `--layer` from `--calibration`), which projects each row as it is
/// appended and the query once, and reconstructs the output once.
enum Cache {
    // Boxed: both are large (a cache is a kilobyte of bookkeeping).
    Paged(Box<PagedCache>),
    LowRank(Box<LowRankCache>),
}

impl Cache {
    fn add_sequence(&mut self) -> SeqId {
        match self {
            Cache::Paged(c) => c.add_sequence(),
            Cache::LowRank(c) => c.add_sequence(),
        }
    }
    fn append(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> kivi_runtime::Result<()> {
        match self {
            Cache::Paged(c) => c.append(id, k, v),
            Cache::LowRank(c) => c.extend(id, k, v),
        }
    }
    fn decode(&self, b: &dyn Backend, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> kivi_runtime::Result<Vec<f32>> {
        match self {
            Cache::Paged(c) => b.decode(c, seqs, q, attn),
            Cache::LowRank(c) => c.decode(b, seqs, q, attn),
        }
    }
    fn dequantize(&self, id: SeqId, t: Tensor) -> kivi_runtime::Result<Vec<f32>> {
        match self {
            Cache::Paged(c) => c.dequantize(id, t),
            Cache::LowRank(c) => c.dequantize(id, t),
        }
    }
    fn memory(&self) -> MemoryReport {
        match self {
            Cache::Paged(c) => c.memory(),
            Cache::LowRank(c) => c.memory(),
        }
    }
}

pub fn run(args: Args) -> super::Result {
    // An mla scheme takes latent and RoPE rows instead of keys and values.
    // (Resolved quietly here: `load` says the same on stderr once.)
    if let Ok(s) = kivi_spec::load_scheme(&args.scheme) {
        if s.mla().is_some() {
            return super::attend_mla::run(&args, s);
        }
    }
    let p = load(&args)?;
    let Shape {
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
    } = p.shape;

    let mut attn = AttnParams::of(&p.scheme, p.shape);
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

    // The pool holds every sequence's blocks; one spare covers rounding.
    // (A low-rank scheme's blocks hold its coordinate scheme's rows.)
    let bt = args
        .block_tokens
        .unwrap_or_else(|| layout::default_block_tokens(&kivi_templates::kernel_scheme(&p.scheme)));
    let max_blocks = if bt == 0 {
        1
    } else {
        p.lens.iter().map(|l| l.div_ceil(bt)).sum::<usize>() + 1
    };
    let config = CacheConfig {
        block_tokens: Some(bt),
        max_blocks,
    };
    let mut cache = match &args.calibration {
        Some(path) => {
            let cal = kivi_runtime::calib::Calibration::load(path)
                .map_err(|e| format!("--calibration {}: {e}", path.display()))?;
            if p.scheme.low_rank.is_some() {
                Cache::LowRank(Box::new(LowRankCache::with_calibration(
                    p.scheme.clone(),
                    config,
                    &cal,
                    args.layer,
                )?))
            } else {
                Cache::Paged(Box::new(PagedCache::with_calibration(
                    p.scheme.clone(),
                    config,
                    &cal,
                    args.layer,
                )?))
            }
        }
        None if p.scheme.low_rank.is_some() => {
            return Err(format!(
                "scheme `{}` has low_rank, whose bases come from a calibration: pass --calibration FILE (made by `kivi calibrate`) and --layer N",
                p.scheme.name
            )
            .into())
        }
        None => Cache::Paged(Box::new(PagedCache::new(p.scheme.clone(), config)?)),
    };

    // Append in order, one token at a time, as a decoder fills its cache.
    let row = hkv * d;
    let fill = Instant::now();
    let mut seqs = Vec::with_capacity(p.batch);
    for (b, &len) in p.lens.iter().enumerate() {
        let id = cache.add_sequence();
        let base = b * p.t_max * row;
        for t in 0..len {
            let at = base + t * row;
            cache
                .append(id, &p.k.data[at..at + row], &p.v.data[at..at + row])
                .map_err(|e| {
                    if p.batched {
                        format!("sequence {b}: {e}")
                    } else {
                        e.to_string()
                    }
                })?;
        }
        seqs.push(id);
    }
    let fill_ms = fill.elapsed().as_secs_f64() * 1e3;

    let backend: Box<dyn Backend> = match args.backend {
        BackendChoice::Reference => Box::new(ReferenceBackend),
        BackendChoice::Cpu => Box::new(CpuBackend::default()),
        BackendChoice::Sim => Box::new(DeviceBackend::open(DeviceKind::Sim)?),
        // `auto` is not offered here (BACKENDS): a run names what it measures.
        BackendChoice::Cuda | BackendChoice::Auto => Box::new(
            DeviceBackend::open(DeviceKind::Cuda)
                .map_err(|e| format!("{e} (`--backend sim` runs the same generated kernels on the CPU)"))?,
        ),
    };
    let start = Instant::now();
    let out = cache.decode(backend.as_ref(), &seqs, &p.q.data, attn)?;
    let time_ms = start.elapsed().as_secs_f64() * 1e3;
    npy::write(&args.out, &p.q.shape, &out)?;

    if let Some(dir) = &args.dump_dequant {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {}", dir.display(), npy::io_reason(&e)))?;
        for (t, file) in [(Tensor::Key, "k.npy"), (Tensor::Value, "v.npy")] {
            // Batched: [B, T, Hkv, D], zero past each sequence's length.
            let mut all = vec![0f32; p.batch * p.t_max * row];
            for (b, &id) in seqs.iter().enumerate() {
                let x = cache.dequantize(id, t)?;
                all[b * p.t_max * row..][..x.len()].copy_from_slice(&x);
            }
            npy::write(&dir.join(file), &p.k.shape, &all)?;
        }
    }

    let mem = cache.memory();
    let tokens: usize = p.lens.iter().sum();
    let f16_bytes = tokens * hkv * d * 2 * 2;
    let ratio = if mem.total == 0 {
        0.0
    } else {
        f16_bytes as f64 / mem.total as f64
    };
    if args.json {
        let o = serde_json::json!({
            "scheme": p.scheme.name,
            "hash": hash_hex(&p.scheme),
            "backend": backend.name(),
            "heads": p.scheme.heads.map(|h| h.to_string()),
            "q_heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "batch": p.batch,
            "lens": p.lens,
            "tokens": tokens,
            "block_tokens": bt,
            "bytes": memory_json(&mem),
            "f16_bytes": f16_bytes,
            "ratio": ratio,
            "softmax_scale": attn.softmax_scale,
            "window": attn.window,
            "fill_ms": fill_ms,
            "time_ms": time_ms,
            "out": args.out.display().to_string(),
        });
        println!("{o}");
    } else {
        println!(
            "{} {} {}: {tokens} tokens, {} x {d}, cache {} bytes (f16 {f16_bytes}, compression {ratio:.2}x), decode {time_ms:.3} ms -> {}",
            p.scheme.name,
            hash_hex(&p.scheme),
            backend.name(),
            p.scheme.heads.map(|h| h.to_string()).unwrap_or_default(),
            mem.total,
            args.out.display()
        );
    }
    Ok(())
}
