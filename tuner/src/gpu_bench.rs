//! The GPU decode benchmark behind `benches/gpu_decode.rs`, on any
//! [`Device`]: a GPU (CUDA events, L2 flushed before every run) or the
//! simulated device, which runs the same code on the CPU at small shapes so
//! that none of it is GPU-only.
//!
//! For each scheme, batch and context it fills a [`DeviceCache`] by chunked
//! prefill **on the device**, checks the decode output of the first and the
//! last sequence against the reference oracle, and only then times it; a
//! row whose output is wrong is an error, never a figure. The variant sweep
//! checks every variant the same way before timing it.

use kivi_runtime::device::{Device, DeviceCache, DeviceKind, Timing};
use kivi_runtime::rand::Rng;
use kivi_runtime::{reference, AttnParams, CacheConfig, Error};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{variants, Kernel, Variant};
use serde::Serialize;

/// Relative error (of the output's largest magnitude) a timed run may have.
pub const TOLERANCE: f32 = 1e-4;

/// What to run.
#[derive(Clone, Debug)]
pub struct GpuBenchOptions {
    pub schemes: Vec<Scheme>,
    pub batches: Vec<usize>,
    pub contexts: Vec<usize>,
    pub warmup: usize,
    pub iters: usize,
    /// Decode variants timed in the sweep per scheme (`None` = all).
    pub sweep_limit: Option<usize>,
    /// Tokens per prefill launch.
    pub chunk: usize,
}

impl GpuBenchOptions {
    /// The GPU benchmark: kivi2 / kivi4 / int8 / f16 at GQA 32:8 d128,
    /// batch 1 and 8, odd contexts from 1k to 32k (`quick`: two contexts).
    pub fn gpu(quick: bool) -> GpuBenchOptions {
        GpuBenchOptions {
            schemes: gqa_schemes(),
            batches: vec![1, 8],
            contexts: if quick {
                vec![1021, 32749]
            } else {
                vec![1021, 2039, 4093, 8191, 16381, 32749]
            },
            warmup: if quick { 3 } else { 10 },
            iters: if quick { 10 } else { 50 },
            sweep_limit: None,
            chunk: 4096,
        }
    }

    /// The same code at shapes the simulator runs in seconds: odd contexts,
    /// two batch sizes, a few sweep variants.
    pub fn sim() -> GpuBenchOptions {
        GpuBenchOptions {
            schemes: vec![presets::kivi2(), presets::int8()]
                .into_iter()
                .map(|s| {
                    s.with_shape(Heads::Gqa { q: 8, kv: 2 }, 64)
                        .expect("presets bind GQA 8:2 d64")
                })
                .collect(),
            batches: vec![1, 3],
            contexts: vec![61, 201],
            warmup: 1,
            iters: 2,
            sweep_limit: Some(3),
            chunk: 100,
        }
    }
}

/// The schemes of the GPU benchmark.
pub fn gqa_schemes() -> Vec<Scheme> {
    [presets::kivi2(), presets::kivi4(), presets::int8(), presets::f16()]
        .into_iter()
        .map(|s| {
            s.with_shape(Heads::Gqa { q: 32, kv: 8 }, 128)
                .expect("presets bind GQA 32:8 d128")
        })
        .collect()
}

#[derive(Clone, Debug, Serialize)]
pub struct TimingRow {
    pub median_ms: f64,
    pub p20_ms: f64,
    pub p80_ms: f64,
    pub samples: usize,
}

impl From<&Timing> for TimingRow {
    fn from(t: &Timing) -> TimingRow {
        TimingRow {
            median_ms: t.median_ms,
            p20_ms: t.p20_ms,
            p80_ms: t.p80_ms,
            samples: t.samples,
        }
    }
}

/// One timed, checked decode.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub scheme: String,
    pub kernel: String,
    pub batch: usize,
    pub context: usize,
    pub kv_bytes: usize,
    pub timing: TimingRow,
    pub gbs: f64,
    pub fraction_of_peak: Option<f64>,
    /// Largest error of the checked sequences, relative to the output's scale.
    pub checked_rel_error: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceRow {
    pub backend: &'static str,
    pub name: String,
    pub arch: String,
    pub sms: i32,
    pub l2_bytes: i32,
    pub driver_version: i32,
    pub peak_gbs: Option<f64>,
    pub describe: String,
}

/// The whole report (what `--out` writes as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    pub device: DeviceRow,
    pub clock: &'static str,
    pub warmup: usize,
    pub iters: usize,
    pub decode: Vec<DecodeRow>,
    pub variant_sweep: Vec<DecodeRow>,
}

/// The inputs of the sequences whose output is checked.
struct Kept {
    /// (sequence index, keys, values)
    seqs: Vec<(usize, Vec<f32>, Vec<f32>)>,
}

/// Fills `dc` with `ctx` tokens per sequence by chunked prefill on the
/// device, keeping the inputs of the first and the last sequence.
fn fill(dc: &mut DeviceCache, s: &Scheme, batch: usize, ctx: usize, chunk: usize, seed: u64) -> Result<Kept, Error> {
    let shape = s.shape().expect("bound");
    let row = shape.kv_heads * shape.head_dim;
    let mut rng = Rng::new(seed);
    let checked: Vec<usize> = if batch > 1 { vec![0, batch - 1] } else { vec![0] };
    let mut kept = Kept {
        seqs: checked.iter().map(|&b| (b, Vec::new(), Vec::new())).collect(),
    };
    let mut done = 0;
    while done < ctx {
        let n = chunk.max(1).min(ctx - done);
        let mut k = vec![0f32; batch * n * row];
        let mut v = vec![0f32; batch * n * row];
        rng.fill(&mut k);
        rng.fill(&mut v);
        for (b, kk, vv) in &mut kept.seqs {
            kk.extend_from_slice(&k[*b * n * row..(*b + 1) * n * row]);
            vv.extend_from_slice(&v[*b * n * row..(*b + 1) * n * row]);
        }
        dc.extend(&vec![n; batch], &k, &v)?;
        done += n;
    }
    Ok(kept)
}

/// The reference output of every kept sequence.
fn references(s: &Scheme, kept: &Kept, q: &[f32], attn: AttnParams) -> Result<Vec<(usize, Vec<f32>)>, Error> {
    let shape = s.shape().expect("bound");
    let per = shape.q_heads * shape.head_dim;
    kept.seqs
        .iter()
        .map(|(b, k, v)| Ok((*b, reference::attend(s, &q[b * per..(b + 1) * per], k, v, attn)?)))
        .collect()
}

/// Largest relative error of the checked sequences; an error above
/// [`TOLERANCE`] (or a non-finite output) fails the row.
fn check(what: &str, got: &[f32], want: &[(usize, Vec<f32>)]) -> Result<f32, Error> {
    let mut worst = 0f32;
    for (b, w) in want {
        let g = &got[b * w.len()..(b + 1) * w.len()];
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
        // a NaN anywhere is a failure (f32::max would skip it)
        let e = if g.iter().all(|x| x.is_finite()) {
            g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        } else {
            f32::INFINITY
        };
        if e > TOLERANCE {
            return Err(Error::Config(format!(
                "{what}: sequence {b}: relative error {e:.3e} against the reference (tolerance {TOLERANCE:.0e}); not timed"
            )));
        }
        worst = worst.max(e);
    }
    Ok(worst)
}

/// One checked, timed decode of `variant`.
#[allow(clippy::too_many_arguments)]
fn measure(
    dc: &DeviceCache,
    s: &Scheme,
    variant: Option<Variant>,
    q: &[f32],
    attn: AttnParams,
    want: &[(usize, Vec<f32>)],
    warmup: usize,
    iters: usize,
    peak: Option<f64>,
) -> Result<DecodeRow, Error> {
    let module = dc.decode_module(variant)?;
    let mut run = dc.prepare_decode(&module, q, attn)?;
    run.launch()?;
    let got = run.output()?;
    let (batch, ctx) = (dc.batch(), dc.lens()[0]);
    let err = check(
        &format!("{} batch {batch} context {ctx}", module.generated.name),
        &got,
        want,
    )?;
    let t = run.time(warmup, iters)?;
    let bytes = dc.decode_bytes();
    let gbs = bytes as f64 / (t.median_ms * 1e-3) / 1e9;
    Ok(DecodeRow {
        scheme: s.name.clone(),
        kernel: module.generated.name.clone(),
        batch,
        context: ctx,
        kv_bytes: bytes,
        timing: TimingRow::from(&t),
        gbs,
        fraction_of_peak: peak.map(|p| gbs / p),
        checked_rel_error: err,
    })
}

fn cache_for(dev: &std::sync::Arc<dyn Device>, s: &Scheme, batch: usize, ctx: usize) -> Result<DeviceCache, Error> {
    let bt = kivi_spec::layout::default_block_tokens(s);
    let cfg = CacheConfig {
        block_tokens: None,
        max_blocks: batch * (ctx.div_ceil(bt) + 1),
    };
    DeviceCache::new(dev.clone(), s, batch, ctx, cfg)
}

/// Runs the benchmark on `dev`, printing a line per row as it goes.
pub fn run(dev: std::sync::Arc<dyn Device>, o: &GpuBenchOptions) -> Result<GpuReport, Error> {
    let info = dev.info().clone();
    let peak = match dev.kind() {
        DeviceKind::Cuda => info.peak_bandwidth_gbs(),
        DeviceKind::Sim => None, // a simulated device has no bandwidth to compare with
    };
    println!("gpu_decode on {}", dev.describe());
    let mut decode = Vec::new();
    for s in &o.schemes {
        let shape = s.shape().ok_or_else(|| Error::Unbound(s.name.clone()))?;
        let attn = AttnParams::of(s, shape);
        for &batch in &o.batches {
            for &ctx in &o.contexts {
                let mut dc = cache_for(&dev, s, batch, ctx)?;
                let kept = fill(&mut dc, s, batch, ctx, o.chunk, 17 + ctx as u64)?;
                let mut q = vec![0f32; batch * shape.q_heads * shape.head_dim];
                Rng::new(99).fill(&mut q);
                let want = references(s, &kept, &q, attn)?;
                let r = measure(&dc, s, None, &q, attn, &want, o.warmup, o.iters, peak)?;
                println!(
                    "  {:8} b{batch} ctx {ctx:5}: {:9.4} ms (p20 {:.4}, p80 {:.4})  {:7.2} MB  {:7.1} GB/s{}  checked {:.1e}",
                    s.name,
                    r.timing.median_ms,
                    r.timing.p20_ms,
                    r.timing.p80_ms,
                    r.kv_bytes as f64 / 1e6,
                    r.gbs,
                    r.fraction_of_peak.map_or(String::new(), |f| format!("  {:.0}% of peak", 100.0 * f)),
                    r.checked_rel_error
                );
                decode.push(r);
            }
        }
    }
    // Every decode variant (or the first few) at the largest shape.
    let mut sweep = Vec::new();
    let batch = *o.batches.iter().max().unwrap_or(&1);
    let ctx = *o.contexts.iter().max().unwrap_or(&1);
    for s in &o.schemes {
        let shape = s.shape().ok_or_else(|| Error::Unbound(s.name.clone()))?;
        let attn = AttnParams::of(s, shape);
        let mut dc = cache_for(&dev, s, batch, ctx)?;
        let kept = fill(&mut dc, s, batch, ctx, o.chunk, 5)?;
        let mut q = vec![0f32; batch * shape.q_heads * shape.head_dim];
        Rng::new(7).fill(&mut q);
        let want = references(s, &kept, &q, attn)?;
        let mut vs = variants(s, Kernel::Decode);
        if let Some(n) = o.sweep_limit {
            vs.truncate(n);
        }
        dc.decode_modules(&vs)?; // one load (one library on the simulator)
        let mut best: Option<(f64, String)> = None;
        for v in vs {
            let r = measure(&dc, s, Some(v), &q, attn, &want, o.warmup.min(5), o.iters.min(20), peak)?;
            if !matches!(&best, Some((b, _)) if *b <= r.timing.median_ms) {
                best = Some((r.timing.median_ms, v.name()));
            }
            sweep.push(r);
        }
        if let Some((ms, name)) = best {
            println!(
                "  sweep {:8} b{batch} ctx {ctx}: best {name} {ms:.4} ms ({:.1} GB/s)",
                s.name,
                dc.decode_bytes() as f64 / (ms * 1e-3) / 1e9
            );
        }
    }
    Ok(GpuReport {
        device: DeviceRow {
            backend: dev.kind().name(),
            name: info.name.clone(),
            arch: info.arch.name(),
            sms: info.sms,
            l2_bytes: info.l2_bytes,
            driver_version: info.driver_version,
            peak_gbs: peak,
            describe: dev.describe(),
        },
        clock: match dev.kind() {
            DeviceKind::Cuda => "cuda events on the stream, L2 flushed before every run",
            DeviceKind::Sim => "host clock around simulated launches (not a GPU timing)",
        },
        warmup: o.warmup,
        iters: o.iters,
        decode,
        variant_sweep: sweep,
    })
}
