//! The main job: declare a KV-cache scheme in Rust, fill a paged cache with
//! a realistic decode workload, run decode attention on the CPU backend, and
//! report exactly what the quantized cache saves and what it costs in
//! accuracy and time.
//!
//! ```text
//! cargo run --release --example main_job [-- CONTEXT_TOKENS]
//! ```
//!
//! Steps (one function each, in order):
//! 1. declare KIVI-2 for a GQA 32:8, head_dim 128 model with `kivi::scheme!`;
//!    the macro validates it and generates the CUDA source of its kernels;
//! 2. compile the generated decode kernel with NVRTC for sm_90 (when NVRTC is
//!    present: `scripts/provision-cuda.sh` fetches it; no GPU is needed), and
//!    report its registers and spills;
//! 3. select the decode variant for this shape from the per-machine decision
//!    cache, tuning it now on a miss (`KIVI_TUNE=off|cached|tune`, default
//!    `tune` here; `KIVI_TUNE_BUDGET` seconds, default 8). On a machine
//!    without a GPU the CPU backend's own parameters are what is tuned;
//! 4. make synthetic K/V/Q shaped like a real LLM layer's: keys with a few
//!    large-magnitude outlier channels, values without, queries that focus
//!    on a handful of past tokens;
//! 5. fill a KIVI-2 paged cache and an f16 cache token by token;
//! 6. decode attention with the selected CPU variant, checked against the
//!    reference;
//! 7. report memory (exact bytes from the caches), error against f16 and
//!    against exact f32 attention, and timings.

use kivi::runtime::rand::Rng;
use kivi::runtime::reference;
use kivi::{AttnParams, Backend, CacheConfig, CpuBackend, PagedCache, ReferenceBackend, Scheme, SeqId, Shape};
use std::time::{Duration, Instant};

kivi::scheme! {
    /// KIVI (ICML 2024) at 2 bits: keys per channel, values per token, the
    /// most recent 128 tokens kept in f16.
    pub Kivi2 {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 128,
        heads: gqa(q = 32, kv = 8),
        head_dim: 128,
    }
}

/// Tokens in the cache when no argument is given.
const DEFAULT_CONTEXT: usize = 4096;
/// Timed repetitions of each decode (the median is reported).
const REPEATS: usize = 9;

/// One layer's worth of decode inputs: `k`, `v` are `[T, Hkv, D]`, `q` is `[Hq, D]`.
struct Workload {
    tokens: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

fn context_from_args() -> Result<usize, String> {
    match std::env::args().nth(1) {
        None => Ok(DEFAULT_CONTEXT),
        Some(a) => match a.parse::<usize>() {
            Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
            _ => Err(format!(
                "CONTEXT_TOKENS must be an integer from 1 to 1048576, got `{a}`"
            )),
        },
    }
}

/// Synthetic data with the statistics that make KV quantization hard or
/// easy in real models: a few key channels carry large, mostly fixed-sign
/// values (the reason KIVI quantizes keys per channel), keys drift smoothly
/// with position (as rotary embeddings make them), values are unremarkable,
/// and each query head looks for a few specific past tokens.
fn synthetic_workload(shape: Shape, tokens: usize, seed: u64) -> Workload {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let mut rng = Rng::new(seed);
    // Per KV head and channel: offset, spread and a rotation frequency.
    let mut bias = vec![0f32; hkv * d];
    let mut spread = vec![1f32; hkv * d];
    let mut freq = vec![0f32; hkv * d];
    for h in 0..hkv {
        for c in 0..d {
            freq[h * d + c] = 10000f32.powf(-((c / 2 * 2) as f32) / d as f32);
            spread[h * d + c] = 0.5 + 0.5 * rng.open01();
        }
        // 4 outlier channels per head: magnitudes 8..20 with a fixed sign,
        // varying over tokens no more than other channels do. Per-channel
        // groups absorb them; per-token groups stretch to cover them.
        for _ in 0..4 {
            let c = (rng.open01() * d as f32) as usize % d;
            let sign = if rng.open01() < 0.5 { -1.0 } else { 1.0 };
            bias[h * d + c] = sign * (8.0 + 12.0 * rng.open01());
        }
    }
    let mut k = vec![0f32; tokens * hkv * d];
    let mut v = vec![0f32; tokens * hkv * d];
    for t in 0..tokens {
        for h in 0..hkv {
            for c in 0..d {
                let i = h * d + c;
                let rot = (t as f32 * freq[i]).sin();
                k[(t * hkv + h) * d + c] = bias[i] + spread[i] * (0.7 * rng.normal() + 0.7 * rot);
                v[(t * hkv + h) * d + c] = rng.normal();
            }
        }
    }
    // Each query head looks for 3 past tokens of its KV head (plus noise), so
    // the softmax is peaked, as in real decode steps; like real heads it
    // favours recent tokens: two of the three are among the last 128.
    let group = hq / hkv;
    let mut q = vec![0f32; hq * d];
    for head in 0..hq {
        let kvh = head / group;
        for pick in 0..3 {
            let span = if pick < 2 { tokens.min(128) } else { tokens };
            let t = tokens - 1 - (rng.open01() * span as f32) as usize % span;
            for c in 0..d {
                let centred = k[(t * hkv + kvh) * d + c] - bias[kvh * d + c];
                q[head * d + c] += 1.5 * centred;
            }
        }
        for c in 0..d {
            q[head * d + c] += 0.3 * rng.normal();
        }
    }
    Workload { tokens, k, v, q }
}

/// A cache for `scheme` holding the workload, appended one token at a time
/// as a decoder does. Returns the cache, its sequence and the fill time.
fn fill_cache(scheme: &Scheme, w: &Workload) -> kivi::Result<(PagedCache, SeqId, Duration)> {
    let shape = scheme.shape().expect("a bound scheme");
    let row = shape.kv_heads * shape.head_dim;
    let mut cache = PagedCache::new(scheme.clone(), CacheConfig::for_tokens(w.tokens))?;
    let seq = cache.add_sequence();
    let start = Instant::now();
    for t in 0..w.tokens {
        cache.append(seq, &w.k[t * row..(t + 1) * row], &w.v[t * row..(t + 1) * row])?;
    }
    Ok((cache, seq, start.elapsed()))
}

/// Runs `decode` `REPEATS` times; returns the last output and the median time.
fn timed_decode(
    backend: &dyn Backend,
    cache: &PagedCache,
    seq: SeqId,
    q: &[f32],
    attn: AttnParams,
) -> kivi::Result<(Vec<f32>, Duration)> {
    let mut times = Vec::with_capacity(REPEATS);
    let mut out = Vec::new();
    for _ in 0..REPEATS {
        let start = Instant::now();
        out = backend.decode(cache, &[seq], q, attn)?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok((out, times[REPEATS / 2]))
}

/// Exact attention: f32 inputs, no rounding, no quantization (the oracle
/// with a full-precision f32 scheme).
fn exact_attention(shape: Shape, w: &Workload, attn: AttnParams) -> kivi::Result<Vec<f32>> {
    let exact = Scheme {
        name: "exact_f32".into(),
        dtype: kivi::Dtype::F32,
        ..kivi::presets::f16()
    }
    .with_shape(
        kivi::Heads::from_counts(shape.q_heads as u32, shape.kv_heads as u32),
        shape.head_dim as u32,
    )?;
    reference::decode_attention(&exact, &w.q, &w.k, &w.v, attn)
}

/// `||a - b|| / ||b||` and `max |a - b|`.
fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let e = (*x as f64 - *y as f64).abs();
        num += e * e;
        den += (*y as f64) * (*y as f64);
        max = max.max(e);
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Step 1's second half: the kernels `kivi::scheme!` generated at compile time.
fn show_generated() {
    println!(
        "generated at compile time by kivi::scheme! ({} kernels):",
        Kivi2::KERNELS.len()
    );
    for (name, source) in Kivi2::KERNELS {
        println!(
            "  {name}  ({} lines, source hash {:016x})",
            source.lines().count(),
            kivi::spec::fnv1a64(source.as_bytes())
        );
    }
}

/// Step 2: NVRTC compiles the generated decode kernel for sm_90 (through the
/// artifact cache). Without NVRTC this says why and the job goes on.
fn compile_decode() {
    use kivi::runtime::cuda::{Arch, Compiler, NvrtcOptions, Origin};
    let Some((name, source)) = Kivi2::KERNELS.iter().find(|(n, _)| n.contains("/decode/")) else {
        println!("compile: no decode kernel was generated");
        return;
    };
    let compiler = match Compiler::new() {
        Ok(c) => c,
        Err(e) => {
            println!("compile: skipped, {e} (scripts/provision-cuda.sh provides NVRTC)");
            return;
        }
    };
    match compiler.compile(name, source, &NvrtcOptions::for_arch(Arch(90))) {
        Ok(c) => {
            let how = match &c.origin {
                Origin::Compiled { seconds } => format!("compiled in {seconds:.2} s"),
                Origin::Cached => "from the artifact cache".to_string(),
                Origin::Recompiled { seconds, reason } => format!("recompiled in {seconds:.2} s ({reason})"),
            };
            println!("compile: NVRTC {} -> sm_90, {how}", compiler.version());
            for r in c.resources() {
                println!(
                    "  {}: {} registers, {} B spilled, {} B shared",
                    r.function, r.registers, r.spill_stores, r.shared
                );
            }
        }
        Err(e) => println!("compile: failed: {e}"),
    }
}

/// Step 3: the decode variant for this shape bucket, from the decision cache
/// or tuned now.
fn select_backend(scheme: &Scheme, tokens: usize) -> Result<CpuBackend, String> {
    let mut opts = kivi_tuner::SelectOptions::from_env()?;
    if std::env::var_os("KIVI_TUNE").is_none() {
        opts.mode = kivi_tuner::Mode::Tune;
    }
    if std::env::var_os("KIVI_TUNE_BUDGET").is_none() {
        opts.budget_s = 8.0;
    }
    let shape = scheme.shape().ok_or("a bound scheme")?;
    let bucket = kivi_tuner::Bucket::of(1, tokens, shape.group_size());
    let start = Instant::now();
    let (backend, sel) = kivi_tuner::select_cpu(scheme, bucket, &opts)?;
    for w in &sel.warnings {
        println!("  warning: {w}");
    }
    println!(
        "select: {} for {bucket} ({:?}, {:.1} s): {}",
        sel.variant,
        sel.source,
        start.elapsed().as_secs_f64(),
        sel.reason
    );
    Ok(backend)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // 1. The scheme, declared and validated at compile time.
    let scheme = Kivi2::spec();
    let shape = scheme.shape().ok_or("Kivi2 declares its shape")?;
    let tokens = context_from_args()?;
    println!(
        "kivi main job: {} with {} x head_dim {}, {tokens} tokens of context",
        scheme.name,
        scheme.heads.map(|h| h.to_string()).unwrap_or_default(),
        shape.head_dim
    );
    println!("scheme hash {:016x}\n{}", Kivi2::HASH, Kivi2::CANONICAL);
    show_generated();

    // 2. NVRTC (no GPU needed).
    compile_decode();

    // 3. Tune on a miss, then select.
    let selected = select_backend(&scheme, tokens)?;

    // 4. A realistic decode workload.
    let w = synthetic_workload(shape, tokens, 0x6b69_7669);

    // 5. The KIVI-2 cache and the f16 baseline, filled the same way.
    let f16 = kivi::presets::f16().with_shape(scheme.heads.ok_or("heads")?, shape.head_dim as u32)?;
    let (kv2, seq2, fill2) = fill_cache(&scheme, &w)?;
    let (kvf, seqf, fillf) = fill_cache(&f16, &w)?;

    // 6. Decode attention with the selected variant; the oracle checks it.
    let attn = AttnParams::of(&scheme, shape);
    let cpu = CpuBackend::default();
    let (out2, t2) = timed_decode(&selected, &kv2, seq2, &w.q, attn)?;
    let (_, t2_default) = timed_decode(&cpu, &kv2, seq2, &w.q, attn)?;
    let (outf, tf) = timed_decode(&cpu, &kvf, seqf, &w.q, attn)?;
    let (oracle2, tref) = timed_decode(&ReferenceBackend, &kv2, seq2, &w.q, attn)?;
    let (cpu_vs_oracle, _) = errors(&out2, &oracle2);
    if cpu_vs_oracle > 1e-4 {
        return Err(format!("the CPU backend disagrees with the reference: relative error {cpu_vs_oracle:.3e}").into());
    }
    let exact = exact_attention(shape, &w, attn)?;

    // 7. The report.
    let (m2, mf) = (kv2.memory(), kvf.memory());
    let (bytes, per) = kivi::spec::layout::bytes_per_token_per_head(&scheme);
    println!("memory (exact bytes held by each paged cache):");
    for (name, m) in [(scheme.name.as_str(), &m2), ("f16", &mf)] {
        println!(
            "  {name:6} {:>11} = codes {} + scales {} + zeros {} + windows {} + tables {}",
            m.total, m.codes, m.scales, m.zeros, m.windows, m.tables
        );
    }
    println!(
        "  saved  {:>11} bytes ({:.1}% less, {:.2}x smaller); a quantized token costs {} bytes per KV head instead of {}",
        mf.total as i64 - m2.total as i64,
        100.0 * (1.0 - m2.total as f64 / mf.total as f64),
        mf.total as f64 / m2.total as f64,
        bytes as f64 / per as f64,
        4 * shape.head_dim
    );
    let (e2, max2) = errors(&out2, &exact);
    let (ef, maxf) = errors(&outf, &exact);
    let (e2f, max2f) = errors(&out2, &outf);
    println!(
        "decode attention error (relative L2, max abs), {} query heads:",
        shape.q_heads
    );
    println!("  {:6} vs exact f32: {e2:.3e}  {max2:.3e}", scheme.name);
    println!("  f16    vs exact f32: {ef:.3e}  {maxf:.3e}");
    println!("  {:6} vs f16 cache: {e2f:.3e}  {max2f:.3e}", scheme.name);
    println!("  cpu backend vs reference on the same cache: {cpu_vs_oracle:.1e}");
    println!("time (decode: median of {REPEATS}):");
    println!(
        "  fill, one token at a time: {} {:.1} ms, f16 {:.1} ms",
        scheme.name,
        ms(fill2),
        ms(fillf)
    );
    println!(
        "  decode, cpu backend:       {} {:.3} ms selected ({}), {:.3} ms default; f16 {:.3} ms (reference backend {:.1} ms)",
        scheme.name,
        ms(t2),
        selected.params.name(),
        ms(t2_default),
        ms(tf),
        ms(tref)
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("main_job: error: {e}");
        std::process::exit(1);
    }
}
