//! The decode-attention benchmark suite behind `kivi bench`.
//!
//! For every (layout, context, batch) point it fills one paged cache per
//! scheme with the same random K/V, then times `CpuBackend::decode` with
//! the schemes interleaved rep by rep, so that a drift in the machine's speed
//! (it is shared) hits every scheme alike and the ratios stay honest. Next to
//! the times it reports what bounds them: the KV bytes a decode must read
//! (exact, from the layout), the FLOPs of the attention, and the machine's
//! streaming-read bandwidth measured in the same run. Peers (numpy, torch,
//! jax) run the same shapes from a Python venv ([`peers`]).

pub mod peers;
pub mod writes;

use kivi_runtime::low_rank::LowRankCache;
use kivi_runtime::rand::Rng;
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache, ReferenceBackend, SeqId};
use kivi_spec::layout::Footprint;
use kivi_spec::{Heads, Scheme};
use serde::Serialize;
use std::time::Instant;

/// A head layout to benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub name: &'static str,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

/// GQA 32:8, head_dim 128 (Llama-3-8B-like).
pub const GQA: Layout = Layout {
    name: "gqa32:8/d128",
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
};

/// MQA 4:1, head_dim 256 (Gemma-3-270M-like).
pub const MQA: Layout = Layout {
    name: "mqa4:1/d256",
    q_heads: 4,
    kv_heads: 1,
    head_dim: 256,
};

impl Layout {
    /// `gqa` or `mqa`.
    pub fn by_name(name: &str) -> Option<Layout> {
        match name {
            "gqa" => Some(GQA),
            "mqa" => Some(MQA),
            _ => None,
        }
    }
    fn heads(&self) -> Heads {
        Heads::from_counts(self.q_heads, self.kv_heads)
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    pub layouts: Vec<Layout>,
    pub contexts: Vec<usize>,
    pub batches: Vec<usize>,
    /// Preset names; `f16` is the baseline the ratios refer to.
    pub schemes: Vec<String>,
    /// Timed repetitions per point (after one warm-up each).
    pub reps: usize,
    pub params: CpuParams,
    /// Evict the caches before each timed decode (KV cold, as in serving).
    pub cold: bool,
    /// Prefill/append throughput and memory at `prefill_tokens`.
    pub prefill: bool,
    pub prefill_tokens: usize,
    /// A calibration and the layer whose codebooks calibrated schemes
    /// (`levels = nuq`, `vq(...)`) decode with (`--calibration`,
    /// `--layer`); every cache is built with it.
    pub calibration: Option<(kivi_runtime::calib::Calibration, usize)>,
}

/// Median, 20th/80th percentile and minimum of a set of times, in ms.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Stats {
    pub median_ms: f64,
    pub p20_ms: f64,
    pub p80_ms: f64,
    pub min_ms: f64,
    pub reps: usize,
}

impl Stats {
    /// Order statistics of `ms` (which must not be empty).
    pub fn of(ms: &[f64]) -> Stats {
        let mut t = ms.to_vec();
        t.sort_by(f64::total_cmp);
        let n = t.len();
        let q = |p: f64| t[((p * (n - 1) as f64).round() as usize).min(n - 1)];
        Stats {
            median_ms: q(0.5),
            p20_ms: q(0.2),
            p80_ms: q(0.8),
            min_ms: t[0],
            reps: n,
        }
    }
}

/// One timed decode point.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub layout: &'static str,
    pub context: usize,
    pub batch: usize,
    pub scheme: String,
    #[serde(flatten)]
    pub stats: Stats,
    /// KV payload one decode reads (codes, parameters, windows), all sequences.
    pub kv_bytes: usize,
    /// `kv_bytes / median`.
    pub gb_per_s: f64,
    /// Attention FLOPs (2 per multiply-add, scores and values) / median.
    pub gflop_per_s: f64,
    /// CPU time of the process (all threads) per decode, median, ms. On a
    /// shared machine this counts the work done, not the time waited for a core.
    pub cpu_ms: f64,
    /// f16 median / this median (higher is faster).
    pub speedup_vs_f16: Option<f64>,
    /// f16 `cpu_ms` / this `cpu_ms`.
    pub cpu_speedup_vs_f16: Option<f64>,
    /// numpy f32 peer median / this median.
    pub speedup_vs_numpy: Option<f64>,
    /// Median time if the read ran at the measured stream bandwidth.
    pub byte_floor_ms: f64,
    /// Median time if every thread issued the decode step at the measured
    /// per-core rate: (multiply-adds / 16) / (decode FMA rate x threads).
    pub compute_floor_ms: Option<f64>,
    /// The CPU kernel's inner loops for this scheme (`avx512-fused`, `avx512`,
    /// ...; `<path>+low_rank` for a low-rank scheme: the time is then the
    /// whole step, query projection + coordinate decode + reconstruction).
    pub path: String,
    /// Error of the first sequence's output against the reference oracle,
    /// relative to the output's scale, checked before anything is timed (a
    /// row above the tuner's tolerance is an error, not a figure).
    pub checked_rel_error: f32,
}

/// Prefill and append throughput of one scheme, and its memory.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillRow {
    pub layout: &'static str,
    pub scheme: String,
    pub tokens: usize,
    /// `PagedCache::extend` of `tokens` tokens, one call.
    pub extend_tokens_per_s: f64,
    /// `PagedCache::append`, one token per call.
    pub append_tokens_per_s: f64,
    /// `cache.memory().total` holding `tokens` tokens.
    pub memory_bytes: usize,
    pub memory_vs_f16: Option<f64>,
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub command: String,
    pub machine: Machine,
    pub params: String,
    /// KV evicted from the CPU caches before each timed decode.
    pub cold: bool,
    pub decode: Vec<DecodeRow>,
    pub peers: peers::PeerReport,
    pub prefill: Vec<PrefillRow>,
    pub notes: Vec<String>,
}

/// The machine as the run saw it.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub threads: usize,
    pub isa: &'static str,
    /// Sum of a 1 GiB buffer over 2 threads, best of 3, GB/s (1e9 bytes).
    pub read_gb_per_s: f64,
    /// Per-core compute ceiling (AVX-512 machines; see
    /// `kivi_runtime::cpu::compute_ceiling`), in billions per second: FMA
    /// peak, FMAs inside the decode step (AND + convert + 4 FMAs per 16
    /// codes), and VNNI dot-product instructions.
    pub fma_g_per_s: Option<f64>,
    pub decode_fma_g_per_s: Option<f64>,
    pub dpbusd_g_per_s: Option<f64>,
    /// `/proc/loadavg` at the start and the end of the run: on a shared
    /// machine, the other work that ran alongside.
    pub load_start: String,
    pub load_end: String,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Bytes of the last-level cache (sysfs), or 32 MiB when unknown.
pub fn last_level_cache() -> usize {
    let mut best = 0;
    for i in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
        if let Ok(s) = std::fs::read_to_string(p) {
            let s = s.trim();
            let (num, mul) = match s.strip_suffix('K') {
                Some(n) => (n, 1 << 10),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s, 1),
                },
            };
            best = best.max(num.parse::<usize>().unwrap_or(0) * mul);
        }
    }
    if best == 0 {
        32 << 20
    } else {
        best
    }
}

/// Reads a buffer twice the last-level cache so that the next decode finds
/// its KV in DRAM, as a decode step does after the other layers ran.
struct Evictor(Vec<u64>);

impl Evictor {
    fn new() -> Evictor {
        let bytes = (2 * last_level_cache()).clamp(64 << 20, 1 << 30);
        Evictor((0..(bytes / 8) as u64).collect())
    }
    fn run(&self) {
        let half = self.0.len().div_ceil(2);
        let s: u64 = std::thread::scope(|sc| {
            let hs: Vec<_> = self.0.chunks(half).map(|c| sc.spawn(move || sum_words(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(s);
    }
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|x| x.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Streaming-read bandwidth: a 1 GiB buffer summed by 2 threads, best of 3.
pub fn read_bandwidth(bytes: usize) -> f64 {
    let words = bytes / 8;
    // Distinct, non-zero contents so that no page is shared or elided.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(words.div_ceil(2).max(1))
                .map(|c| s.spawn(move || sum_words(c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn sum_words(c: &[u64]) -> u64 {
    // Four independent sums: the loop is load-bound, not add-latency-bound.
    let mut a = [0u64; 4];
    let mut it = c.chunks_exact(4);
    for w in &mut it {
        for j in 0..4 {
            a[j] = a[j].wrapping_add(w[j]);
        }
    }
    it.remainder()
        .iter()
        .fold(a.iter().fold(0, |x, y| x.wrapping_add(*y)), |x, y| x.wrapping_add(*y))
}

/// CPU time of all threads of this process, ns (`/proc/self/task/*/schedstat`);
/// 0 where that is not available.
pub fn process_cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()))
        .sum()
}

/// Key/value rows `[tokens, kv_heads, head_dim]`: keys with per-channel
/// offsets (as real keys have), values plain noise.
fn kv_data(tokens: usize, l: Layout, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (h, d) = (l.kv_heads as usize, l.head_dim as usize);
    let mut r = Rng::new(seed);
    let mut k = Vec::with_capacity(tokens * h * d);
    let mut v = Vec::with_capacity(tokens * h * d);
    for _ in 0..tokens * h {
        for c in 0..d {
            k.push(((c * 7) % 5) as f32 * 0.5 - 1.0 + r.f32());
            v.push(r.f32());
        }
    }
    (k, v)
}

/// Ablations of the codec presets, by name, to measure what each pipeline
/// feature costs at decode (`--schemes f16,kivi2,codec2,codec2_norot,...`):
/// `codec2` without its rotation (`_norot`), outliers (`_noout`) or
/// centering (`_nocenter`), or with uniform min/max codes instead of
/// Lloyd–Max levels (`_uniform`, which adds a zero point per group); the
/// same for `codec15`'s values where they apply.
pub fn codec_ablations() -> Vec<Scheme> {
    let codec2 = |name: &str, levels: &str, rotation: &str, outliers: &str, center: &str| {
        format!(
            "{name} {{
                key: quant(bits = 3, axis = token, group = 256{levels}),
                value: quant(bits = 2, axis = token, group = 256{levels}),
                {rotation}{outliers}{center}residual: 128, sinks: 4 }}"
        )
    };
    let (lm, rot, out, cen) = (
        ", levels = lloyd_max, norm = l2",
        "rotation: hadamard(block = 256, apply = [key, value]), ",
        "outliers: sparse(per_token = 4, apply = [key]), ",
        "center: channel_mean(tokens = 128, apply = [key]), ",
    );
    let codec15 = |name: &str, levels: &str, rotation: &str, outliers: &str| {
        format!(
            "{name} {{
                key: quant(bits = 2, axis = channel, group = 64),
                value: quant(bits = 1, axis = token, group = 256{levels}),
                {rotation}{outliers}residual: 128, sinks: 4 }}"
        )
    };
    let (rot15, out15) = (
        "rotation: hadamard(block = 256, apply = [value]), ",
        "outliers: sparse(per_token = 2, apply = [value]), ",
    );
    [
        codec2("codec2_norot", lm, "", out, cen),
        codec2("codec2_noout", lm, rot, "", cen),
        codec2("codec2_nocenter", lm, rot, out, ""),
        codec2("codec2_uniform", "", rot, out, cen),
        codec15("codec15_norot", lm, "", out15),
        codec15("codec15_noout", lm, rot15, ""),
    ]
    .iter()
    .map(|t| kivi_spec::parse_scheme(t).expect("the codec ablations parse"))
    .collect()
}

fn bind(name: &str, l: Layout) -> Result<Scheme, String> {
    let s = kivi_spec::resolve_scheme(name, &codec_ablations())
        .map_err(|e| e.to_string())?
        .scheme;
    s.with_shape(l.heads(), l.head_dim)
        .map_err(|e| format!("scheme `{name}` does not fit {}: {e}", l.name))
}

/// The cache a bench row fills and times: [`BenchCache::LowRank`] for a
/// `low_rank` scheme, else [`paged_cache`].
fn new_cache(bench: &Config, s: &Scheme, l: Layout, cfg: CacheConfig) -> Result<BenchCache, String> {
    if s.low_rank.is_some() {
        return low_rank_cache(bench, s, l, cfg).map(|c| BenchCache::LowRank(Box::new(c)));
    }
    paged_cache(bench.calibration.as_ref(), s, l, cfg).map(|c| BenchCache::Paged(Box::new(c)))
}

/// The cache one bench row times: a paged cache, or for a `low_rank`
/// scheme a `LowRankCache`, whose decode is the whole low-rank step (the
/// query projected, the coordinates decoded by the CPU backend, the output
/// reconstructed; with `residual = N` the kept tokens merged in).
enum BenchCache {
    // Boxed: both are large.
    Paged(Box<PagedCache>),
    LowRank(Box<LowRankCache>),
}

impl BenchCache {
    fn add_sequence(&mut self) -> SeqId {
        match self {
            BenchCache::Paged(c) => c.add_sequence(),
            BenchCache::LowRank(c) => c.add_sequence(),
        }
    }
    fn extend(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> kivi_runtime::Result<()> {
        match self {
            BenchCache::Paged(c) => c.extend(id, k, v),
            BenchCache::LowRank(c) => c.extend(id, k, v),
        }
    }
    fn append(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> kivi_runtime::Result<()> {
        match self {
            BenchCache::Paged(c) => c.append(id, k, v),
            BenchCache::LowRank(c) => c.extend(id, k, v),
        }
    }
    fn decode(&self, b: &dyn Backend, ids: &[SeqId], q: &[f32], attn: AttnParams) -> kivi_runtime::Result<Vec<f32>> {
        match self {
            BenchCache::Paged(c) => b.decode(c, ids, q, attn),
            BenchCache::LowRank(c) => c.decode(b, ids, q, attn),
        }
    }
    fn memory(&self) -> usize {
        match self {
            BenchCache::Paged(c) => c.memory().total,
            BenchCache::LowRank(c) => c.memory().total,
        }
    }
    /// The CPU kernel's path; the coordinate cache's, `+low_rank`.
    fn kernel_path(&self, cpu: &CpuBackend) -> String {
        match self {
            BenchCache::Paged(c) => cpu.kernel_path(c).to_string(),
            BenchCache::LowRank(c) => format!("{}+low_rank", cpu.kernel_path(c.coordinates())),
        }
    }
    /// Bytes one decode of `context` tokens per sequence reads: the layout's
    /// payload (a low-rank cache's coordinates and kept exact rows, plus
    /// its bases once).
    fn decode_bytes(&self, s: &Scheme, context: usize, batch: usize) -> usize {
        let payload = Footprint::for_tokens(s, context).total() * batch;
        match self {
            BenchCache::Paged(_) => payload,
            BenchCache::LowRank(c) => payload + c.bases().bytes(),
        }
    }
}

/// An empty calibration for the bench's synthetic model and one layer of
/// samples to fit it on: another draw of the benchmark's own K/V (1024
/// tokens, seed 0xca1), as [`paged_cache`] and [`low_rank_cache`] fit
/// their codebooks and bases when no `--calibration` is given.
fn synthetic_samples(l: Layout) -> (kivi_runtime::calib::Calibration, kivi_runtime::calib::LayerSamples) {
    use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
    let tokens = 1024;
    let (k, v) = kv_data(tokens, l, 0xca1);
    let (h, d) = (l.kv_heads as usize, l.head_dim as usize);
    let x = LayerSamples::new(0, tokens, l.q_heads as usize, h, d, k, v);
    let model = ModelId {
        name: "kivi bench synthetic K/V".into(),
        layers: 1,
        kv_heads: h as u32,
        head_dim: d as u32,
    };
    (Calibration::new(model, "kv_data(1024 tokens, seed 0xca1)"), x)
}

/// A `LowRankCache` for a `low_rank` scheme: with `--calibration`, the
/// bases of `--layer` from that file; otherwise bases fitted on another
/// draw of the benchmark's own K/V, as [`paged_cache`] fits codebooks:
/// decode speed depends on the rank, not on the basis.
fn low_rank_cache(bench: &Config, s: &Scheme, l: Layout, cfg: CacheConfig) -> Result<LowRankCache, String> {
    let err = |e: kivi_runtime::Error| format!("{}: {e}", s.name);
    if let Some((cal, layer)) = &bench.calibration {
        return LowRankCache::with_calibration(s.clone(), cfg, cal, *layer).map_err(err);
    }
    let (mut cal, x) = synthetic_samples(l);
    cal.fit_bases(std::slice::from_ref(&x))
        .map_err(|e| format!("{}: {e}", s.name))?;
    LowRankCache::with_calibration(s.clone(), cfg, &cal, 0).map_err(err)
}

/// A paged cache for `s`: with `--calibration`, that file's codebooks;
/// otherwise a `levels = nuq` or `vq(...)` scheme gets codebooks fitted on
/// another draw of the benchmark's own K/V (layer 0; keys before RoPE are
/// the same draw, so a pre-RoPE scheme fits too): decode speed depends on
/// the table's width, not on its values, and the bench needs no model.
fn paged_cache(
    calibration: Option<&(kivi_runtime::calib::Calibration, usize)>,
    s: &Scheme,
    l: Layout,
    cfg: CacheConfig,
) -> Result<PagedCache, String> {
    use kivi_runtime::calib::{fit_key, FitOptions};
    use kivi_runtime::vq::VqFitOptions;
    use kivi_spec::Tensor;
    if let Some((cal, layer)) = calibration {
        return PagedCache::with_calibration(s.clone(), cfg, cal, *layer).map_err(|e| format!("{}: {e}", s.name));
    }
    let nuq = fit_key(s, Tensor::Key).is_some() || fit_key(s, Tensor::Value).is_some();
    let vq = [Tensor::Key, Tensor::Value].iter().any(|&t| s.codec(t).vq().is_some());
    if !nuq && !vq {
        return PagedCache::new(s.clone(), cfg).map_err(|e| format!("{}: {e}", s.name));
    }
    let (mut cal, mut x) = synthetic_samples(l);
    x.keys_pre_rope = Some(x.keys.clone());
    if nuq {
        cal.fit_codebooks(s, std::slice::from_ref(&x), FitOptions::default())
            .map_err(|e| format!("{}: {e}", s.name))?;
    }
    if vq {
        // Few iterations on few points: the decode kernel's speed depends
        // on the codebooks' shape, not on how well they fit, and a full fit
        // of 256-entry books takes seconds per scheme on two cores.
        let opts = VqFitOptions {
            iterations: 4,
            max_points: 2048,
            ..VqFitOptions::default()
        };
        cal.fit_vq(s, &[x], opts).map_err(|e| format!("{}: {e}", s.name))?;
    }
    PagedCache::with_calibration(s.clone(), cfg, &cal, 0).map_err(|e| format!("{}: {e}", s.name))
}

/// 4 FLOPs per (query head, channel, token): a multiply-add for the score
/// and one for the value sum.
pub fn attention_flops(l: Layout, context: usize, batch: usize) -> f64 {
    4.0 * l.q_heads as f64 * l.head_dim as f64 * context as f64 * batch as f64
}

/// Times every scheme at one (layout, context, batch) point, interleaved.
fn decode_point(
    cfg: &Config,
    l: Layout,
    context: usize,
    batch: usize,
    bandwidth: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<DecodeRow>, String> {
    let (k, v) = kv_data(context, l, 0x5eed + context as u64);
    let mut r = Rng::new(77);
    let q: Vec<f32> = (0..batch * (l.q_heads * l.head_dim) as usize)
        .map(|_| r.f32())
        .collect();
    let cpu = CpuBackend::new(cfg.params).map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    for name in &cfg.schemes {
        let s = bind(name, l)?;
        let shape = s.shape().ok_or("unbound scheme")?;
        let mut cache = new_cache(cfg, &s, l, CacheConfig::for_tokens(batch * (context + 64)))?;
        let mut ids = Vec::new();
        for _ in 0..batch {
            let id = cache.add_sequence();
            cache.extend(id, &k, &v).map_err(|e| format!("{name}: {e}"))?;
            ids.push(id);
        }
        let attn = AttnParams::of(&s, shape);
        // Warm-up, and the check that makes the timings mean something:
        // the first sequence's output against the reference oracle (for a
        // low-rank scheme: the same projection and merge, the coordinates
        // decoded by the reference backend).
        let out = cache.decode(&cpu, &ids, &q, attn).map_err(|e| format!("{name}: {e}"))?;
        let per = (l.q_heads * l.head_dim) as usize;
        let want = cache
            .decode(&ReferenceBackend, &ids[..1], &q[..per], attn)
            .map_err(|e| format!("{name}: reference: {e}"))?;
        kivi_tuner::cpu::compare(&out[..per], &want)
            .map_err(|e| format!("{name}: the cpu backend's output is wrong, so it is not timed: {e}"))?;
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
        let checked = out[..per]
            .iter()
            .zip(&want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()))
            / scale;
        let bytes = cache.decode_bytes(&s, context, batch);
        let path = cache.kernel_path(&cpu);
        cases.push((
            name.clone(),
            cache,
            ids,
            attn,
            bytes,
            path,
            checked,
            Vec::new(),
            Vec::new(),
        ));
    }
    progress(&format!("{} context {context} batch {batch}: timing", l.name));
    let evict = cfg.cold.then(Evictor::new);
    for _ in 0..cfg.reps {
        for (_, cache, ids, attn, _, _, _, times, cpu_times) in cases.iter_mut() {
            if let Some(e) = &evict {
                e.run();
            }
            let c0 = process_cpu_ns();
            let t0 = Instant::now();
            let out = cache.decode(&cpu, ids, &q, *attn).map_err(|e| e.to_string())?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            cpu_times.push(process_cpu_ns().saturating_sub(c0) as f64 / 1e6);
            std::hint::black_box(out);
        }
    }
    let flops = attention_flops(l, context, batch);
    let rows: Vec<DecodeRow> = cases
        .into_iter()
        .map(|(scheme, _, _, _, bytes, path, checked, times, cpu_times)| {
            let stats = Stats::of(&times);
            let cpu_ms = Stats::of(&cpu_times).median_ms;
            DecodeRow {
                layout: l.name,
                context,
                batch,
                scheme,
                kv_bytes: bytes,
                gb_per_s: bytes as f64 / stats.median_ms / 1e6,
                gflop_per_s: flops / stats.median_ms / 1e6,
                cpu_ms,
                speedup_vs_f16: None,
                cpu_speedup_vs_f16: None,
                speedup_vs_numpy: None,
                byte_floor_ms: bytes as f64 / bandwidth / 1e6,
                compute_floor_ms: None,
                path,
                checked_rel_error: checked,
                stats,
            }
        })
        .collect();
    Ok(rows)
}

/// Prefill (`extend`) and streaming (`append`) throughput and memory.
fn prefill_rows(cfg: &Config, l: Layout) -> Result<Vec<PrefillRow>, String> {
    let n = cfg.prefill_tokens;
    let (k, v) = kv_data(n, l, 99);
    let row = (l.kv_heads * l.head_dim) as usize;
    let appends = n.min(2048);
    let mut out = Vec::new();
    for name in &cfg.schemes {
        let s = bind(name, l)?;
        let mut cache = new_cache(cfg, &s, l, CacheConfig::for_tokens(n + appends + 256))?;
        let id = cache.add_sequence();
        let t0 = Instant::now();
        cache.extend(id, &k, &v).map_err(|e| e.to_string())?;
        let extend_s = t0.elapsed().as_secs_f64();
        let memory = cache.memory();
        let id2 = cache.add_sequence();
        let t0 = Instant::now();
        for t in 0..appends {
            cache
                .append(id2, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                .map_err(|e| e.to_string())?;
        }
        let append_s = t0.elapsed().as_secs_f64();
        out.push(PrefillRow {
            layout: l.name,
            scheme: name.clone(),
            tokens: n,
            extend_tokens_per_s: n as f64 / extend_s,
            append_tokens_per_s: appends as f64 / append_s,
            memory_bytes: memory,
            memory_vs_f16: None,
        });
    }
    if let Some(f) = out.iter().find(|r| r.scheme == "f16").map(|r| r.memory_bytes) {
        for r in &mut out {
            r.memory_vs_f16 = Some(r.memory_bytes as f64 / f as f64);
        }
    }
    Ok(out)
}

/// Runs the suite. `peer_runner` supplies the peers' timings for the shapes
/// (or a report of why there are none); `progress` gets one line per step.
pub fn run(
    cfg: &Config,
    command: String,
    peer_runner: &mut dyn FnMut(&[peers::Shape]) -> peers::PeerReport,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, String> {
    if cfg.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    let load_start = loadavg();
    progress("measuring streaming-read bandwidth (1 GiB over 2 threads)");
    let bandwidth = read_bandwidth(1 << 30);
    let threads = if cfg.params.threads > 0 {
        cfg.params.threads
    } else {
        rayon::current_num_threads()
    };
    progress("measuring the per-core compute ceiling (FMA, decode step, VNNI)");
    // The probe's loops are AVX-512: a run capped below it (`--no-avx512`,
    // `--scalar`) gets no compute floor rather than a wrong one.
    let ceiling = (cfg.params.isa(128) == kivi_runtime::cpu::Isa::Avx512)
        .then(|| kivi_runtime::cpu::compute_ceiling(150))
        .flatten();
    let machine = Machine {
        cpu: cpu_name(),
        threads,
        isa: cfg.params.isa(128).name(),
        read_gb_per_s: bandwidth,
        fma_g_per_s: ceiling.map(|c| c.fma_per_s / 1e9),
        decode_fma_g_per_s: ceiling.map(|c| c.decode_fma_per_s / 1e9),
        dpbusd_g_per_s: ceiling.and_then(|c| c.dpbusd_per_s).map(|r| r / 1e9),
        load_start,
        load_end: String::new(),
    };
    let mut decode = Vec::new();
    let mut shapes = Vec::new();
    for &l in &cfg.layouts {
        for &context in &cfg.contexts {
            for &batch in &cfg.batches {
                progress(&format!("{} context {context} batch {batch}: filling caches", l.name));
                let mut rows = decode_point(cfg, l, context, batch, bandwidth, progress)?;
                if let Some(c) = ceiling {
                    let fmas = attention_flops(l, context, batch) / 2.0 / 16.0;
                    for r in &mut rows {
                        r.compute_floor_ms = Some(fmas / (c.decode_fma_per_s * threads as f64) * 1e3);
                    }
                }
                if let Some(f) = rows
                    .iter()
                    .find(|r| r.scheme == "f16")
                    .map(|r| (r.stats.median_ms, r.cpu_ms))
                {
                    for r in &mut rows {
                        r.speedup_vs_f16 = Some(f.0 / r.stats.median_ms);
                        r.cpu_speedup_vs_f16 = (r.cpu_ms > 0.0).then(|| f.1 / r.cpu_ms);
                    }
                }
                decode.extend(rows);
                shapes.push(peers::Shape {
                    layout: l.name.to_string(),
                    q_heads: l.q_heads,
                    kv_heads: l.kv_heads,
                    head_dim: l.head_dim,
                    context,
                    batch,
                });
            }
        }
    }
    progress("running peers");
    let peer_report = peer_runner(&shapes);
    for r in &mut decode {
        if let Some(p) = peer_report.find("numpy", "f32", r.layout, r.context, r.batch) {
            r.speedup_vs_numpy = Some(p.median_ms / r.stats.median_ms);
        }
    }
    let mut prefill = Vec::new();
    if cfg.prefill {
        for &l in &cfg.layouts {
            progress(&format!("{}: prefill/append of {} tokens", l.name, cfg.prefill_tokens));
            prefill.extend(prefill_rows(cfg, l)?);
        }
    }
    let notes = vec![
        format!(
            "times are wall-clock per decode call (all sequences of the batch, one query token each), {} reps after a warm-up, schemes interleaved rep by rep",
            cfg.reps
        ),
        "cpu: CPU time of all threads per decode (median); on a shared machine wall time also counts waiting for a core".into(),
        "kv_bytes: exact payload from the layout (codes + scales + zero points + f16 windows); byte_floor_ms = kv_bytes / read bandwidth".into(),
        "compute_floor_ms (cfloor): multiply-adds / 16 lanes / (measured per-core rate of the decode step x threads); the step is AND + convert + 4 FMAs per 16 codes, the fewest instructions exact f32 attention over codes takes here (f16 rows need one convert instead of AND + convert, so their true floor is up to ~15% lower); at best a scheme reaches max(floor, cfloor)".into(),
        if cfg.cold {
            format!(
                "cold KV: before each timed decode the run reads {} MiB (2x the {} MiB last-level cache) so that KV comes from DRAM",
                (2 * last_level_cache()).clamp(64 << 20, 1 << 30) >> 20,
                last_level_cache() >> 20
            )
        } else {
            "warm KV (--warm): caches that fit the last-level cache are read from it, GB/s can exceed DRAM bandwidth".into()
        },
    ];
    let mut machine = machine;
    machine.load_end = loadavg();
    Ok(Report {
        command,
        machine,
        params: cfg.params.name(),
        cold: cfg.cold,
        decode,
        peers: peer_report,
        prefill,
        notes,
    })
}

/// The report as aligned text tables.
pub fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "# {}", r.command);
    let _ = writeln!(
        s,
        "machine: {} | {} threads | kernel {} ({}) | stream read {:.1} GB/s | KV {} | load {} -> {}",
        r.machine.cpu,
        r.machine.threads,
        r.params,
        r.machine.isa,
        r.machine.read_gb_per_s,
        if r.cold { "cold" } else { "warm" },
        r.machine.load_start,
        r.machine.load_end
    );
    let g = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    let _ = writeln!(
        s,
        "compute per core: FMA peak {} G/s | decode step {} G FMA/s | VNNI dpbusd {} G/s",
        g(r.machine.fma_g_per_s),
        g(r.machine.decode_fma_g_per_s),
        g(r.machine.dpbusd_g_per_s)
    );
    let _ = writeln!(
        s,
        "\n{:<13} {:>6} {:>3} {:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>9} {:>7}  path",
        "layout",
        "ctx",
        "B",
        "scheme",
        "median",
        "p20",
        "p80",
        "min",
        "KV MB",
        "GB/s",
        "GFLOP/s",
        "vs f16",
        "vs np",
        "floor",
        "cfloor",
        "cpu",
        "cpu x"
    );
    for d in &r.decode {
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}x"));
        let _ = writeln!(
            s,
            "{:<13} {:>6} {:>3} {:<6} {:>7.3}ms {:>7.3}ms {:>7.3}ms {:>7.3}ms {:>9.2} {:>7.1} {:>7.1} {:>7} {:>7} {:>6.2}ms {:>8} {:>7.2}ms {:>7}  {}",
            d.layout,
            d.context,
            d.batch,
            d.scheme,
            d.stats.median_ms,
            d.stats.p20_ms,
            d.stats.p80_ms,
            d.stats.min_ms,
            d.kv_bytes as f64 / 1e6,
            d.gb_per_s,
            d.gflop_per_s,
            f(d.speedup_vs_f16),
            f(d.speedup_vs_numpy),
            d.byte_floor_ms,
            d.compute_floor_ms.map_or("-".to_string(), |v| format!("{v:.2}ms")),
            d.cpu_ms,
            f(d.cpu_speedup_vs_f16),
            d.path
        );
    }
    let _ = writeln!(s, "\npeers:");
    for (name, status) in &r.peers.available {
        let _ = writeln!(s, "  {name}: {status}");
    }
    if let Some(e) = &r.peers.error {
        let _ = writeln!(s, "  not run: {e}");
    }
    for p in &r.peers.results {
        match &p.error {
            Some(e) => {
                let _ = writeln!(
                    s,
                    "  {} {} {} ctx {} B {}: error: {e}",
                    p.peer, p.dtype, p.layout, p.context, p.batch
                );
            }
            None => {
                let ours = r
                    .decode
                    .iter()
                    .filter(|d| d.layout == p.layout && d.context == p.context && d.batch == p.batch)
                    .map(|d| format!("{} {:.2}x", d.scheme, p.median_ms / d.stats.median_ms))
                    .collect::<Vec<_>>()
                    .join(", ");
                let _ = writeln!(
                    s,
                    "  {:<10} {:<3} {:<13} ctx {:>6} B {:>2}: median {:>8.3}ms (p20 {:.3}, p80 {:.3}) | ours faster by: {}{}",
                    p.peer,
                    p.dtype,
                    p.layout,
                    p.context,
                    p.batch,
                    p.median_ms,
                    p.p20_ms,
                    p.p80_ms,
                    ours,
                    p.note.as_deref().map_or(String::new(), |n| format!(" | {n}"))
                );
            }
        }
    }
    if !r.prefill.is_empty() {
        let _ = writeln!(
            s,
            "\n{:<13} {:<6} {:>7} {:>14} {:>14} {:>12} {:>8}",
            "layout", "scheme", "tokens", "extend tok/s", "append tok/s", "memory MB", "vs f16"
        );
        for p in &r.prefill {
            let _ = writeln!(
                s,
                "{:<13} {:<6} {:>7} {:>14.0} {:>14.0} {:>12.2} {:>8}",
                p.layout,
                p.scheme,
                p.tokens,
                p.extend_tokens_per_s,
                p.append_tokens_per_s,
                p.memory_bytes as f64 / 1e6,
                p.memory_vs_f16.map_or("-".into(), |v| format!("{v:.3}"))
            );
        }
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_order() {
        let s = Stats::of(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((s.min_ms, s.median_ms, s.reps), (1.0, 3.0, 5));
        assert!(s.p20_ms <= s.median_ms && s.median_ms <= s.p80_ms);
    }

    #[test]
    fn flops_and_bytes() {
        assert_eq!(attention_flops(GQA, 1, 1), 4.0 * 32.0 * 128.0);
        let k2 = bind("kivi2", GQA).unwrap();
        let f16 = bind("f16", GQA).unwrap();
        let (a, b) = (
            Footprint::for_tokens(&k2, 32768).total(),
            Footprint::for_tokens(&f16, 32768).total(),
        );
        assert_eq!(b, 32768 * 8 * 2 * 128 * 2);
        assert!(a * 5 < b);
        assert!(bind("nope", GQA).is_err());
    }

    #[test]
    fn codec_ablations_bind_and_run() {
        let names: Vec<String> = codec_ablations().into_iter().map(|s| s.name).collect();
        assert_eq!(names.len(), 6);
        for n in &names {
            let a = bind(n, MQA).unwrap();
            let base = bind(if n.starts_with("codec15") { "codec15" } else { "codec2" }, MQA).unwrap();
            assert_ne!(kivi_spec::canonical_body(&a), kivi_spec::canonical_body(&base), "{n}");
        }
        // Every row is checked against the oracle before it is timed.
        let cfg = Config {
            layouts: vec![MQA],
            contexts: vec![300],
            batches: vec![2],
            schemes: vec![
                "f16".into(),
                "codec2".into(),
                "codec2_uniform".into(),
                "codec15_noout".into(),
            ],
            reps: 1,
            params: CpuParams::default(),
            cold: false,
            prefill: false,
            prefill_tokens: 0,
            calibration: None,
        };
        let r = run(&cfg, "test".into(), &mut |_| peers::PeerReport::default(), &mut |_| {}).unwrap();
        assert_eq!(r.decode.len(), 4);
        assert!(
            r.decode[1..].iter().all(|d| d.path.ends_with("+codec")),
            "{:?}",
            r.decode
        );
    }

    /// Runs the bench on MQA at 300 tokens, batch 2, one rep, over
    /// `first` and the scheme files written from `texts` (`name`, text).
    fn run_scheme_files(tag: &str, first: &str, texts: &[(&str, &str)], prefill: bool) -> Report {
        let dir = std::env::temp_dir().join(format!("kivi-bench-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut schemes = vec![first.to_string()];
        for (name, text) in texts {
            let p = dir.join(format!("{name}.kivi"));
            std::fs::write(&p, text).unwrap();
            schemes.push(p.display().to_string());
        }
        let cfg = Config {
            layouts: vec![MQA],
            contexts: vec![300],
            batches: vec![2],
            schemes,
            reps: 1,
            params: CpuParams::default(),
            cold: false,
            prefill,
            prefill_tokens: if prefill { 300 } else { 0 },
            calibration: None,
        };
        let r = run(&cfg, "test".into(), &mut |_| peers::PeerReport::default(), &mut |_| {});
        std::fs::remove_dir_all(&dir).unwrap();
        r.unwrap()
    }

    /// `levels = nuq` schemes (pre-RoPE keys too) get codebooks fitted on
    /// the bench's own K/V, pass the oracle check before they are timed,
    /// and prefill; a scheme file holds each.
    #[test]
    fn nuq_schemes_are_calibrated_checked_and_timed() {
        let texts = [
            ("nuqk", "nuqk { key: quant(bits = 2, axis = channel, group = 64, levels = nuq), value: quant(bits = 2, axis = token, group = 32, levels = nuq, norm = l2), residual: 32 }"),
            ("prenuq", "prenuq { key: quant(bits = 2, axis = channel, group = 64, levels = nuq), value: quant(bits = 2, axis = token, group = 32), residual: 32, sinks: 4, rope: pre(theta = 10000, style = half) }"),
        ];
        let r = run_scheme_files("nuq", "kivi2", &texts, true);
        assert_eq!(r.decode.len(), 3);
        assert!(r.decode[2].path.ends_with("+rope"), "{:?}", r.decode[2].path);
    }

    /// `vq(...)` schemes get product codebooks fitted on the bench's own
    /// K/V (no `--calibration`), pass the oracle check and are timed.
    #[test]
    fn vq_schemes_are_fitted_checked_and_timed() {
        let texts = [
            ("vqkv", "vqkv { key: vq(dim = 8, entries = 16), value: vq(dim = 8, entries = 16), residual: 32, sinks: 4 }"),
            ("vqv", "vqv { key: quant(bits = 2, axis = channel, group = 64), value: vq(dim = 4, entries = 16), residual: 32, sinks: 4 }"),
        ];
        let r = run_scheme_files("vq", "f16", &texts, false);
        assert_eq!(r.decode.len(), 3, "{:?}", r.decode);
    }

    #[test]
    fn tiny_suite_runs() {
        let cfg = Config {
            layouts: vec![MQA],
            contexts: vec![300],
            batches: vec![2],
            schemes: vec!["f16".into(), "kivi2".into()],
            reps: 2,
            params: CpuParams::default(),
            cold: false,
            prefill: true,
            prefill_tokens: 300,
            calibration: None,
        };
        let r = run(&cfg, "test".into(), &mut |_| peers::PeerReport::default(), &mut |_| {}).unwrap();
        assert_eq!(r.decode.len(), 2);
        assert!(r
            .decode
            .iter()
            .all(|d| d.stats.median_ms > 0.0 && d.speedup_vs_f16.is_some()));
        assert_eq!(r.prefill.len(), 2);
        assert!(render(&r).contains("kivi2"));
    }
}
