//! The CPU backend as a tuning [`Target`]: the candidates are
//! [`CpuParams`] (splits over the sequence, tokens per tile, threads).
//!
//! Timing uses the host's monotonic clock around whole calls (the CPU has no
//! device clock; a call is a few hundred microseconds or more, far above
//! the clock's resolution). To read KV from memory as in serving — where
//! the other layers' KV and the weights evict this layer's — the workload
//! holds several copies of the batch and rotates through them, enough to
//! cover twice the last-level cache where memory allows (capped at
//! [`CpuTarget::max_rotate_bytes`]; the decision records the coverage).

use crate::bucket::Bucket;
use crate::fingerprint::{Fingerprint, Toolchain};
use crate::tune::{Candidate, Method, Target, Workload};
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache, ReferenceBackend, SeqId};
use kivi_spec::{Heads, Scheme, Tensor};
use std::sync::OnceLock;
use std::time::Instant;

/// Split counts tried (`0` lets the kernel pick).
pub const SPLITS: &[usize] = &[0, 1, 2, 4, 8, 16, 32];
/// Tile sizes tried.
pub const TILES: &[usize] = &[16, 32, 64, 128, 256];
/// A split shorter than this is pruned: the merge would cost more than it saves.
pub const MIN_SPLIT_TOKENS: usize = 64;
/// Tolerance against the reference (absolute + relative to the output's magnitude).
pub const TOLERANCE: f32 = 1e-4;

/// The CPU backend for one bound scheme.
pub struct CpuTarget {
    scheme: Scheme,
    device: Fingerprint,
    cores: usize,
    /// Upper bound on the bytes of rotated input copies per bucket.
    pub max_rotate_bytes: u64,
    /// Upper bound on the number of copies.
    pub max_copies: usize,
    /// Timing methodology.
    pub method: Method,
    peak: OnceLock<Option<f64>>,
    /// The calibration (and layer) the tuning caches are built with.
    calibration: Option<Calib>,
}

/// A calibration and the layer whose codebooks a tuning cache uses.
pub type Calib = (std::sync::Arc<kivi_runtime::calib::Calibration>, usize);

/// A host cache for `scheme`, with `calib`'s codebooks when given.
fn new_cache(scheme: &Scheme, config: CacheConfig, calib: Option<&Calib>) -> Result<PagedCache, String> {
    match calib {
        Some((c, layer)) => PagedCache::with_calibration(scheme.clone(), config, c, *layer),
        None => PagedCache::new(scheme.clone(), config),
    }
    .map_err(|e| e.to_string())
}

impl CpuTarget {
    /// `scheme` must be bound to a shape ([`Scheme::with_shape`]).
    pub fn new(scheme: &Scheme) -> Result<CpuTarget, String> {
        if scheme.shape().is_none() {
            return Err(format!(
                "scheme `{}` has no heads/head_dim; bind a shape before tuning",
                scheme.name
            ));
        }
        let device = Fingerprint::host_cpu();
        let cores = device.facts.get("cores").and_then(|c| c.parse().ok()).unwrap_or(1);
        Ok(CpuTarget {
            scheme: scheme.clone(),
            device,
            cores,
            max_rotate_bytes: 192 << 20,
            max_copies: 32,
            method: Method::default(),
            peak: OnceLock::new(),
            calibration: None,
        })
    }

    /// A target whose tuning caches decode `nuq` tensors with the codebooks
    /// of `layer` in `calibration` (so a `levels = nuq` scheme can be
    /// tuned), its decisions keyed by the scheme hash joined with the
    /// calibration's ([`crate::tune::decision_hash`]): a decision made
    /// under one calibration is not served under another. The calibration
    /// is checked against the scheme now (shape, every codebook the scheme
    /// needs at `layer`), so a wrong one fails here, not mid-tuning.
    pub fn with_calibration(
        scheme: &Scheme,
        calibration: &kivi_runtime::calib::Calibration,
        layer: usize,
    ) -> Result<CpuTarget, String> {
        let mut t = CpuTarget::new(scheme)?;
        calibration.check_shape(scheme).map_err(|e| e.to_string())?;
        kivi_runtime::calib::levels_for(scheme, Some(calibration), layer).map_err(|e| e.to_string())?;
        kivi_runtime::vq::books_for(scheme, Some(calibration), layer).map_err(|e| e.to_string())?;
        t.calibration = Some((std::sync::Arc::new(calibration.clone()), layer));
        Ok(t)
    }

    /// The parameters behind a candidate name, if it is one of ours.
    pub fn params(&self, bucket: &Bucket, name: &str) -> Option<CpuParams> {
        self.space(bucket).into_iter().find(|p| p.name() == name)
    }

    /// The whole parameter space in canonical order: the default first,
    /// then variants that change one parameter of the default, then two,
    /// and so on. Under a tight budget the nearest neighbours of the default
    /// are measured first, and ties go to the variant closest to it.
    /// Fields that `CpuParams` may grow keep their defaults.
    pub fn space(&self, _bucket: &Bucket) -> Vec<CpuParams> {
        let default = CpuParams::default();
        let mut threads = vec![0];
        if self.cores > 1 {
            // One thread: no fork/join at all, which wins for tiny problems.
            threads.push(1);
        }
        let mut v = vec![default];
        for &th in &threads {
            for &splits in SPLITS {
                for &tile_tokens in TILES {
                    let p = CpuParams {
                        splits,
                        tile_tokens,
                        threads: th,
                        ..default
                    };
                    if !v.contains(&p) {
                        v.push(p);
                    }
                }
            }
        }
        // The other instruction sets, once each, where they run different
        // code than the default: AVX2 where AVX-512 would be used (some
        // CPUs clock down under AVX-512) and the portable scalar loops.
        let d = self.scheme.head_dim.unwrap_or(0) as usize;
        for alt in [
            CpuParams {
                avx512: false,
                ..default
            },
            CpuParams {
                scalar: true,
                ..default
            },
        ] {
            if alt.isa(d) != default.isa(d) && !v.contains(&alt) {
                v.push(alt);
            }
        }
        let distance = |p: &CpuParams| {
            (p.splits != default.splits) as u32
                + (p.tile_tokens != default.tile_tokens) as u32
                + (p.threads != default.threads) as u32
                + (p.scalar != default.scalar) as u32
                + (p.avx512 != default.avx512) as u32
        };
        // Stable: within one distance the enumeration order above decides.
        v.sort_by_key(distance);
        v
    }
}

/// Runs the reference memory-read benchmark once: a parallel sum over a
/// buffer well beyond the last-level cache where memory allows.
fn measure_peak_gbps(llc: Option<u64>) -> Option<f64> {
    use rayon::prelude::*;
    let bytes = (llc.unwrap_or(32 << 20) * 2).clamp(64 << 20, 512 << 20) as usize;
    let buf = vec![1u64; bytes / 8];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, b| a.wrapping_add(*b)))
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best > 0.0).then(|| bytes as f64 / best / 1e9)
}

impl Target for CpuTarget {
    fn backend(&self) -> &'static str {
        "cpu"
    }
    fn device(&self) -> Fingerprint {
        self.device.clone()
    }
    fn toolchain(&self) -> Toolchain {
        Toolchain::current("rustc")
    }
    fn candidates(&self, bucket: &Bucket) -> Vec<Candidate> {
        self.space(bucket)
            .into_iter()
            .map(|p| Candidate {
                name: p.name(),
                // The kernel code and the instruction set this candidate runs
                // on this CPU: either changing re-measures it.
                hash: kivi_spec::fnv1a64(
                    format!(
                        "{p:?} kernels {:016x} isa {:?}",
                        kivi_runtime::cpu::KERNEL_HASH,
                        p.isa(self.scheme.shape().map_or(0, |s| s.head_dim))
                    )
                    .as_bytes(),
                ),
                notes: Vec::new(),
            })
            .collect()
    }
    fn check(&self, c: &Candidate, bucket: &Bucket) -> Result<(), String> {
        let p = self
            .params(bucket, &c.name)
            .ok_or_else(|| format!("`{}` is not a cpu variant", c.name))?;
        CpuBackend::new(p).map_err(|e| e.to_string())?;
        if p.threads > self.cores {
            return Err(format!("{} threads on {} cores", p.threads, self.cores));
        }
        let ctx = bucket.context as usize;
        if let Some(per) = ctx.checked_div(p.splits) {
            if per < MIN_SPLIT_TOKENS {
                return Err(format!("a split would hold {per} tokens (< {MIN_SPLIT_TOKENS})"));
            }
            if p.tile_tokens > per {
                return Err(format!("tile of {} tokens exceeds a split of {per}", p.tile_tokens));
            }
        } else if p.tile_tokens > ctx {
            return Err(format!("tile of {} tokens exceeds the context", p.tile_tokens));
        }
        if p.threads == 1 && p.splits > 1 {
            // Splits exist to feed threads; on one thread they only add merges.
            return Err("splits > 1 on a single thread".into());
        }
        Ok(())
    }
    fn workload<'a>(&'a self, bucket: &Bucket, prep_budget_s: f64) -> Result<Box<dyn Workload + 'a>, String> {
        Ok(Box::new(CpuWorkload::new(self, bucket, prep_budget_s)?))
    }
    fn method(&self) -> Method {
        self.method.clone()
    }
    fn peak_gbps(&self) -> Option<f64> {
        *self.peak.get_or_init(|| measure_peak_gbps(self.device.llc_bytes()))
    }
    fn calibration_hash(&self) -> Option<u64> {
        self.calibration.as_ref().map(|(c, _)| c.hash())
    }
}

struct CpuWorkload<'a> {
    target: &'a CpuTarget,
    bucket: Bucket,
    cache: PagedCache,
    /// One batch of sequence ids per rotated copy.
    sets: Vec<Vec<SeqId>>,
    q: Vec<f32>,
    attn: AttnParams,
    want: Vec<f32>,
    /// The second input set of the correctness gate ([`check_inputs`]).
    check: Inputs,
    next: usize,
    bytes: u64,
    llc: Option<u64>,
}

impl<'a> CpuWorkload<'a> {
    fn new(target: &'a CpuTarget, bucket: &Bucket, prep_budget_s: f64) -> Result<Self, String> {
        let start = Instant::now();
        let scheme = &target.scheme;
        let shape = scheme.shape().ok_or("unbound scheme")?;
        let (lengths, data, q) = bucket_data(scheme, bucket)?;
        let tokens: usize = lengths.iter().sum();
        // Bytes per copy first, from a one-copy probe of the layout.
        let llc = target.device.llc_bytes();
        let probe_bytes = estimate_bytes(scheme, &lengths);
        let want = llc.map_or(1, |l| (2 * l).div_ceil(probe_bytes.max(1)) as usize);
        let by_mem = (target.max_rotate_bytes / probe_bytes.max(1)).max(1) as usize;
        let copies = want.min(by_mem).clamp(1, target.max_copies);
        let calib = target.calibration.as_ref();
        let mut cache = new_cache(
            scheme,
            CacheConfig::for_tokens(tokens * copies + 64 * lengths.len() * copies),
            calib,
        )?;
        let mut sets = Vec::with_capacity(copies);
        for c in 0..copies {
            // Extra copies only while the preparation budget lasts.
            if c > 0 && start.elapsed().as_secs_f64() > prep_budget_s {
                break;
            }
            let mut set = Vec::with_capacity(lengths.len());
            for (k, v) in &data {
                let id = cache.add_sequence();
                cache
                    .extend(id, k, v)
                    .map_err(|e| format!("cannot build tuning inputs: {e}"))?;
                set.push(id);
            }
            sets.push(set);
        }
        let bytes = measured_bytes(&cache, &sets[0])?;
        let attn = AttnParams::of(scheme, shape);
        let want = reference_parallel(&cache, &sets[0], &q, attn)?;
        Ok(CpuWorkload {
            target,
            bucket: *bucket,
            cache,
            sets,
            q,
            attn,
            want,
            check: check_inputs_in(scheme, bucket, calib)?,
            next: 0,
            bytes,
            llc,
        })
    }

    fn backend(&self, c: &Candidate) -> Result<CpuBackend, String> {
        let p = self
            .target
            .params(&self.bucket, &c.name)
            .ok_or_else(|| format!("`{}` is not a cpu variant", c.name))?;
        CpuBackend::new(p).map_err(|e| e.to_string())
    }
}

/// Per-sequence K/V (`[T, Hkv, D]`, deterministic) and the query batch for
/// a bucket's tuning inputs.
type BucketData = (Vec<usize>, Vec<(Vec<f32>, Vec<f32>)>, Vec<f32>);

fn bucket_data(scheme: &Scheme, bucket: &Bucket) -> Result<BucketData, String> {
    bucket_data_with(scheme, bucket, &bucket.tuning_lengths(), bucket.context as u64)
}

/// Deterministic K/V and queries for sequences of `lengths`, seeded by `seed`.
fn bucket_data_with(scheme: &Scheme, bucket: &Bucket, lengths: &[usize], seed: u64) -> Result<BucketData, String> {
    let shape = scheme.shape().ok_or("unbound scheme")?;
    let heads = scheme.heads.unwrap_or(Heads::Mha(1));
    if heads.q_heads() / heads.kv_heads() != bucket.gqa {
        return Err(format!(
            "bucket {bucket} has GQA ratio {}, the scheme {}",
            bucket.gqa, heads
        ));
    }
    let (hkv, d) = (shape.kv_heads, shape.head_dim);
    let lengths = lengths.to_vec();
    let mut rng = kivi_runtime::rand::Rng::new(0x9e37_79b9_7f4a_7c15 ^ seed);
    // Keys get a few outlier channels, as real keys do.
    let data: Vec<(Vec<f32>, Vec<f32>)> = lengths
        .iter()
        .map(|&t| {
            let k: Vec<f32> = (0..t * hkv * d)
                .map(|i| rng.f32() * if i % d % 17 == 3 { 6.0 } else { 1.0 })
                .collect();
            let v: Vec<f32> = (0..t * hkv * d).map(|_| rng.f32()).collect();
            (k, v)
        })
        .collect();
    let q: Vec<f32> = (0..lengths.len() * shape.q_heads * d).map(|_| rng.f32()).collect();
    Ok((lengths, data, q))
}

/// A host cache, its sequences, the query batch, the attention parameters
/// and the reference output.
pub type Inputs = (PagedCache, Vec<SeqId>, Vec<f32>, AttnParams, Vec<f32>);

/// One copy of a bucket's tuning inputs in a host cache, with the query,
/// the attention parameters and the reference output (for backends that
/// keep their own copy, such as CUDA).
pub fn build_inputs(scheme: &Scheme, bucket: &Bucket) -> Result<Inputs, String> {
    build_inputs_with(scheme, bucket, None)
}

/// [`build_inputs`] in a cache built with `calib`'s codebooks (`nuq`
/// levels, `vq` codebooks).
pub fn build_inputs_with(scheme: &Scheme, bucket: &Bucket, calib: Option<&Calib>) -> Result<Inputs, String> {
    inputs_of(scheme, bucket_data(scheme, bucket)?, calib)
}

/// A second, small input set for the correctness gate: the bucket's batch
/// size, odd lengths around the edges of blocks and groups (1, 31, 33,
/// 127, ...), keys with outlier channels, another seed. A candidate must
/// match the reference on it as well as on the bucket's own inputs, so a
/// kernel that is right only at the tuned lengths is caught.
pub fn check_inputs(scheme: &Scheme, bucket: &Bucket) -> Result<Inputs, String> {
    check_inputs_in(scheme, bucket, None)
}

/// [`check_inputs`] in a cache built with `calib`'s codebooks.
pub fn check_inputs_in(scheme: &Scheme, bucket: &Bucket, calib: Option<&Calib>) -> Result<Inputs, String> {
    const EDGES: [usize; 6] = [1, 31, 33, 127, 65, 255];
    let top = (bucket.context as usize).max(1);
    let lengths: Vec<usize> = (0..bucket.batch as usize)
        .map(|b| EDGES[b % EDGES.len()].min(top))
        .collect();
    inputs_of(
        scheme,
        bucket_data_with(scheme, bucket, &lengths, 0x005e_ed0f_c4ec_u64 ^ bucket.context as u64)?,
        calib,
    )
}

fn inputs_of(scheme: &Scheme, (lengths, data, q): BucketData, calib: Option<&Calib>) -> Result<Inputs, String> {
    let shape = scheme.shape().ok_or("unbound scheme")?;
    let tokens: usize = lengths.iter().sum();
    let mut cache = new_cache(scheme, CacheConfig::for_tokens(tokens + 64 * lengths.len()), calib)?;
    let mut seqs = Vec::new();
    for (k, v) in &data {
        let id = cache.add_sequence();
        cache
            .extend(id, k, v)
            .map_err(|e| format!("cannot build tuning inputs: {e}"))?;
        seqs.push(id);
    }
    let attn = AttnParams::of(scheme, shape);
    let want = reference_parallel(&cache, &seqs, &q, attn)?;
    Ok((cache, seqs, q, attn, want))
}

/// The oracle on a batch, one sequence per rayon task (it is the slowest
/// part of preparing a bucket; the oracle itself stays scalar and plain).
fn reference_parallel(cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>, String> {
    use rayon::prelude::*;
    let per = q.len() / seqs.len().max(1);
    let outs: Vec<Result<Vec<f32>, String>> = seqs
        .par_iter()
        .enumerate()
        .map(|(b, &s)| {
            ReferenceBackend
                .decode(cache, &[s], &q[b * per..(b + 1) * per], attn)
                .map_err(|e| format!("reference failed: {e}"))
        })
        .collect();
    let mut want = Vec::with_capacity(q.len());
    for o in outs {
        want.extend(o?);
    }
    Ok(want)
}

/// KV bytes of a batch before building it (the layout's exact footprint).
fn estimate_bytes(scheme: &Scheme, lengths: &[usize]) -> u64 {
    lengths
        .iter()
        .map(|&t| {
            let f = kivi_spec::layout::Footprint::for_tokens(scheme, t);
            (f.codes + f.scales + f.zeros + f.windows) as u64
        })
        .sum::<u64>()
        .max(1)
}

/// KV bytes one decode call reads: the codes, scales and zero points of the
/// blocks in use, plus the full-precision tokens actually present.
fn measured_bytes(cache: &PagedCache, seqs: &[SeqId]) -> Result<u64, String> {
    let shape = cache.shape();
    let row = (shape.kv_heads * shape.head_dim * cache.scheme().dtype.bytes()) as u64;
    let mut total = 0u64;
    for &s in seqs {
        let m = cache.sequence_memory(s).map_err(|e| e.to_string())?;
        let view = cache.view(s).map_err(|e| e.to_string())?;
        let raw: u64 = [Tensor::Key, Tensor::Value]
            .iter()
            .map(|&t| (view.tokens() - view.quantized(t)) as u64 * row)
            .sum();
        total += (m.codes + m.scales + m.zeros) as u64 + raw;
    }
    Ok(total)
}

/// The correctness gate: every output finite and within `TOLERANCE` of
/// the largest reference value (the tolerance of the backend tests);
/// otherwise the worst output, named.
pub fn compare(got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("output has {} values, the reference {}", got.len(), want.len()));
    }
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
    let mut worst: Option<(usize, f32)> = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() {
            return Err(format!("output {i} is {g} (reference {w})"));
        }
        let err = (g - w).abs();
        if err > TOLERANCE * scale && worst.is_none_or(|(_, e)| err > e) {
            worst = Some((i, err));
        }
    }
    match worst {
        None => Ok(()),
        Some((i, err)) => Err(format!(
            "output {i} is {} but the reference says {} (error {:.2e} of the output's scale {scale:.3e}; tolerance {TOLERANCE:.0e})",
            got[i],
            want[i],
            err / scale
        )),
    }
}

impl Workload for CpuWorkload<'_> {
    fn bytes_per_call(&self) -> u64 {
        self.bytes
    }
    fn verify(&mut self, c: &Candidate) -> Result<(), String> {
        let be = self.backend(c)?;
        let got = be
            .decode(&self.cache, &self.sets[0], &self.q, self.attn)
            .map_err(|e| format!("failed: {e}"))?;
        compare(&got, &self.want)?;
        let (cache, seqs, q, attn, want) = &self.check;
        let got = be
            .decode(cache, seqs, q, *attn)
            .map_err(|e| format!("failed on the edge-length inputs: {e}"))?;
        compare(&got, want).map_err(|e| format!("edge-length inputs: {e}"))
    }
    fn sample(&mut self, c: &Candidate, iters: u32) -> Result<f64, String> {
        let be = self.backend(c)?;
        let t = Instant::now();
        for _ in 0..iters.max(1) {
            self.next = (self.next + 1) % self.sets.len();
            let out = be
                .decode(&self.cache, &self.sets[self.next], &self.q, self.attn)
                .map_err(|e| e.to_string())?;
            std::hint::black_box(out);
        }
        Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
    }
    fn describe(&self) -> String {
        let rot = self.bytes * self.sets.len() as u64;
        let cover = match self.llc {
            Some(l) => format!(", {:.1}x the last-level cache ({} MiB)", rot as f64 / l as f64, l >> 20),
            None => String::new(),
        };
        format!(
            "host monotonic clock around whole calls; inputs rotated over {} copies ({:.1} MiB{cover}); lengths {:?}",
            self.sets.len(),
            rot as f64 / (1u64 << 20) as f64,
            self.bucket.tuning_lengths()
        )
    }
}
