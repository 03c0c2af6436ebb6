//! The CPU backend: fused dequantize + decode attention.
//!
//! Work is split over (sequence, KV head, split of the sequence) and run with
//! rayon; each task reads its KV head's bytes once and serves all query heads
//! of the GQA group from that pass, with an online softmax per tile of
//! tokens. Splits are merged flash-decoding style.
//!
//! Quantized caches with channel-axis 2/4-bit keys (KIVI) or token-axis
//! 2/4/8-bit keys, token-axis values, f16 parameters and GQA groups of a
//! multiple of four heads run on the fused path, `fused.rs`, on AVX-512
//! (`avx512-fused`) and on AVX2 (`avx2-fused`; 2-bit values need groups of
//! at least 32 channels there), one aligned tile of block-resident tokens
//! per call: codes to floats in two instructions, keys scored sixteen
//! tokens at a time from an in-register transpose, value scales folded into
//! the softmax weights. The two widths share one body, written over the
//! vector-width trait in `width.rs`.
//! [`CpuBackend::kernel_path`] says which path a cache gets. Caches whose
//! keys and values are both `full` (f16/bf16/f32 rows) take `dense.rs` on
//! AVX-512 and AVX2: register-resident value accumulation and a next-block
//! prefetch spread over the tile; f16 rows with groups of four heads run
//! whole tiles fused (scores, vector softmax, values in one call,
//! `avx512-dense-fused` / `avx2-dense-fused`). Everything else takes the generic loops
//! below.
//!
//! Where the arithmetic happens in the generic loops (see `kernel.rs`):
//! - channel-axis keys: the scale is folded into the query once per group of
//!   `G` tokens (`q'_d = q_d s_d`) and the zero point into one constant per
//!   query head (`sum_d q_d z_d`), so the inner loop multiplies the folded
//!   query by the integer codes directly;
//! - token-axis tensors and `full` tensors: rows are decoded in registers
//!   (codes * s + z, f16/bf16 -> f32) and consumed at once;
//! - rare combinations (1- and 3-bit codes, channel-axis values, groups that
//!   are not a power of two) take a generic path that dequantizes a tile
//!   with the cache's own row reader;
//! - tensors with a codec pipeline (Hadamard rotation, Lloyd–Max levels,
//!   sparse outliers, centering) are consumed on the query side: rows are
//!   decoded in the transformed domain (codes and outlier corrections, no
//!   un-rotation), keys are scored against the query rotated once per split
//!   plus `q . m` for the key means, and values are summed in the rotated
//!   domain and un-rotated once per split, with `(sum p) m` added for the
//!   value means. Token-axis codes of 1 to 4 bits (the codec presets)
//!   are decoded in `codec.rs` without a copy: a register table lookup of
//!   the levels, the norm folded into the score and the softmax weight,
//!   outliers added as a sparse correction (`avx512-fused+codec` on
//!   AVX-512, `avx2-table+codec` / `scalar-table+codec` elsewhere); other
//!   codec tensors take the row reader, reported as `<isa>+codec`.
//!
//! Many new queries per sequence (`Backend::attend_block`: chunked
//! prefill, speculative verification) run in `block.rs`: the long common
//! part of their context through the same split kernel, the queries of a
//! chunk as one wide group, the recent tokens per query.
//!
//! The inner loops exist twice: a vector body instantiated for AVX-512F and
//! for AVX2 + FMA + F16C (chosen at run time with
//! `is_x86_feature_detected!`; see `width.rs`) and a portable scalar version
//! that is always compiled and tested. [`CpuParams::scalar`] or the environment variable
//! `KIVI_CPU_SCALAR=1` (read once) force the scalar one.

mod block;
mod codec;
mod dense;
mod fused;
mod int8;
mod kernel;
pub mod mla;
mod probe;
mod rope;
mod simd;
mod vq;
mod width;
pub(crate) mod write;

use crate::backend::{check_batch, check_skip, check_window, evict_after_blocks, Backend, DecodePartial, NewTokens};
use crate::cache::{PagedCache, SeqId, SeqView};
use crate::error::{Error, Result};
use crate::quant::round_to_dtype;
use crate::reference::AttnParams;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use probe::{compute_ceiling, ComputeCeiling};
pub use rope::set_strategy as set_rope_strategy;
#[doc(hidden)]
pub use rope::set_vector as set_rope_vector;
pub use simd::Isa;

/// A hash of the CPU kernels' source code (this module's decode files and
/// the quantizer they decode), fixed at build time. Tuning decisions for
/// the CPU backend are keyed by it, so a changed kernel is measured again
/// instead of trusted. (`write.rs` and `probe.rs` decide no decode time.)
pub const KERNEL_HASH: u64 = {
    const PARTS: [&str; 13] = [
        include_str!("mod.rs"),
        include_str!("vq.rs"),
        include_str!("block.rs"),
        include_str!("mla.rs"),
        include_str!("int8.rs"),
        include_str!("width.rs"),
        include_str!("rope.rs"),
        include_str!("dense.rs"),
        include_str!("codec.rs"),
        include_str!("kernel.rs"),
        include_str!("fused.rs"),
        include_str!("simd.rs"),
        include_str!("../quant.rs"),
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut p = 0;
    while p < PARTS.len() {
        let b = PARTS[p].as_bytes();
        let mut i = 0;
        while i < b.len() {
            h ^= b[i] as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
            i += 1;
        }
        p += 1;
    }
    h
};

/// Tunable parameters of the CPU kernel (the tuner searches these).
///
/// Build it with struct update syntax so that new fields keep their
/// defaults: `CpuParams { splits: 3, ..CpuParams::default() }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuParams {
    /// Splits of each sequence; `0` picks enough to keep every thread busy.
    pub splits: usize,
    /// Tokens scored before each softmax rescale (1 to 4096). The default,
    /// 64, is the default block of the KIVI presets: the fused AVX-512 path
    /// runs a tile only inside one block, and a larger tile spreads its
    /// fixed costs (softmax bookkeeping, accumulator flushes) over more rows
    /// (measured 3-8% faster than 32 at 32k tokens, every scheme).
    pub tile_tokens: usize,
    /// Worker threads; `0` uses rayon's global pool.
    pub threads: usize,
    /// Force the portable scalar inner loops even where AVX2 is available.
    pub scalar: bool,
    /// Use AVX-512 where the CPU has it (and `head_dim % 16 == 0`);
    /// `false` caps the kernel at AVX2.
    pub avx512: bool,
}

impl Default for CpuParams {
    fn default() -> Self {
        CpuParams {
            splits: 0,
            tile_tokens: 64,
            threads: 0,
            scalar: false,
            avx512: true,
        }
    }
}

impl CpuParams {
    /// A readable name, used in tuning tables and decision files.
    ///
    /// ```
    /// use kivi_runtime::CpuParams;
    /// assert_eq!(CpuParams::default().name(), "cpu/s0.t64.th0");
    /// let p = CpuParams { splits: 3, scalar: true, ..CpuParams::default() };
    /// assert_eq!(p.name(), "cpu/s3.t64.th0.scalar");
    /// ```
    pub fn name(&self) -> String {
        format!(
            "cpu/s{}.t{}.th{}{}{}",
            self.splits,
            self.tile_tokens,
            self.threads,
            if self.scalar { ".scalar" } else { "" },
            if self.avx512 { "" } else { ".noavx512" }
        )
    }

    /// The instruction set the inner loops will use for `head_dim`.
    pub fn isa(&self, head_dim: usize) -> Isa {
        Isa::select(self.scalar || env_scalar(), self.avx512, head_dim)
    }
}

/// `KIVI_CPU_SCALAR=1` forces the scalar path for the whole process.
fn env_scalar() -> bool {
    static ONCE: OnceLock<bool> = OnceLock::new();
    *ONCE.get_or_init(|| std::env::var("KIVI_CPU_SCALAR").is_ok_and(|v| v == "1" || v == "true"))
}

/// `KIVI_CPU_DENSE=0` sends `full` tensors back to the generic loops (the
/// dense loops' baseline, for side-by-side benchmarks in one build).
fn env_no_dense() -> bool {
    static ONCE: OnceLock<bool> = OnceLock::new();
    *ONCE.get_or_init(|| std::env::var("KIVI_CPU_DENSE").is_ok_and(|v| v == "0" || v == "false"))
}

/// Fused CPU decode attention.
///
/// ```
/// use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache};
/// use kivi_spec::{presets, Heads};
/// let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
/// let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
/// let seq = cache.add_sequence();
/// let k: Vec<f32> = (0..300 * 64).map(|i| (i as f32 * 0.1).sin()).collect();
/// cache.extend(seq, &k, &k).unwrap();
/// let q = vec![0.5f32; 4 * 32];
/// let cpu = CpuBackend::new(CpuParams { splits: 2, ..CpuParams::default() }).unwrap();
/// let out = cpu.decode(&cache, &[seq], &q, AttnParams::of(&s, s.shape().unwrap())).unwrap();
/// assert_eq!(out.len(), 4 * 32);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend {
    pub params: CpuParams,
}

/// Partial result of one split: running max, normaliser and unnormalised
/// output for each query head of the group.
pub(crate) struct Partial {
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub acc: Vec<f32>,
}

/// One task of [`CpuBackend::decode`] / `decode_partial`: sequence `b`,
/// KV head `h`, and the token ranges it runs in turn.
type Task = (usize, usize, Vec<(usize, usize)>);

/// Two partial results of one group merged (flash-decoding style).
fn merge(x: Partial, y: Partial, group: usize, d: usize) -> Partial {
    let mut out = x;
    for g in 0..group {
        let m = out.m[g].max(y.m[g]);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let (wx, wy) = ((out.m[g] - m).exp(), (y.m[g] - m).exp());
        out.m[g] = m;
        out.l[g] = wx * out.l[g] + wy * y.l[g];
        for (a, b) in out.acc[g * d..(g + 1) * d].iter_mut().zip(&y.acc[g * d..(g + 1) * d]) {
            *a = wx * *a + wy * b;
        }
    }
    out
}

/// A split shorter than this costs more in merging than it gains.
const MIN_SPLIT_TOKENS: usize = 512;

fn auto_splits(work: usize, tokens: usize, threads: usize) -> usize {
    // Two tasks per thread balance uneven lengths without many merges.
    let want = (2 * threads).div_ceil(work.max(1));
    want.clamp(1, tokens.div_ceil(MIN_SPLIT_TOKENS).max(1))
}

/// Thread pools by size, built once: building one per call costs more than
/// a short decode.
fn pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut map = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = map.get(&threads) {
        return Ok(p.clone());
    }
    let p = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Config(format!("cannot start {threads} threads: {e}")))?,
    );
    map.insert(threads, p.clone());
    Ok(p)
}

impl CpuBackend {
    /// Runs `f` on this backend's thread pool (`threads > 0`) or the
    /// caller's (rayon's global one). `params` is a public field, so it is
    /// checked here, on every call, not only in `new`.
    fn on_pool<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        check_params(&self.params)?;
        if self.params.threads > 0 {
            pool(self.params.threads)?.install(f)
        } else {
            f()
        }
    }

    /// A backend with checked parameters.
    pub fn new(params: CpuParams) -> Result<Self> {
        check_params(&params)?;
        Ok(CpuBackend { params })
    }

    /// Which inner loops decoding `cache` runs on this machine: `avx512-fused`
    /// or `avx2-fused` (the fast path: channel-axis 2/4-bit or token-axis
    /// 2/4/8-bit keys with token-axis values, GQA groups of a multiple of
    /// four heads; on AVX2, 2-bit values in groups of at least 32),
    /// `avx512-dense-fused` / `avx2-dense-fused` (f16 rows, groups of a
    /// multiple of four heads: whole tiles fused),
    /// `avx512-dense` / `avx2-dense` (both tensors `full`: the `f16` preset,
    /// bf16/f32 schemes; `KIVI_CPU_DENSE=0` turns it off for comparisons), or
    /// `avx512`, `avx2`, `scalar` (the generic loops), with `+codec` when a
    /// tensor's codec pipeline is consumed on the query side (the KIVI fused
    /// path declines those): `avx512-fused+codec`, `avx2-table+codec` or
    /// `scalar-table+codec` where every codec tensor runs the fused codec
    /// loops (`codec.rs`: token-axis codes of 1 to 4 bits), else
    /// `<isa>+codec` (the generic row reader).
    ///
    /// ```
    /// use kivi_runtime::{CacheConfig, CpuBackend, CpuParams, PagedCache};
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 128).unwrap();
    /// let cache = PagedCache::new(s, CacheConfig::for_tokens(64)).unwrap();
    /// let scalar = CpuBackend::new(CpuParams { scalar: true, ..CpuParams::default() }).unwrap();
    /// assert_eq!(scalar.kernel_path(&cache), "scalar");
    /// ```
    pub fn kernel_path(&self, cache: &PagedCache) -> &'static str {
        let plan = kernel::Plan::new(cache, self.params.isa(cache.shape().head_dim), self.params.tile_tokens);
        plan.path_name()
    }

    fn run(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let d = cache.shape().head_dim;
        let p = self.partials(cache, seqs, q, attn, None)?;
        let mut out = p.acc;
        for (o, (&m, &l)) in out.chunks_exact_mut(d).zip(p.max.iter().zip(&p.sum)) {
            if m == f32::NEG_INFINITY {
                continue; // nothing attended: output stays zero
            }
            for x in o.iter_mut() {
                *x /= l;
            }
        }
        Ok(out)
    }

    /// The split kernel over every (sequence, KV head, split), merged per
    /// query head but not normalised. With `skip`
    /// ([`Backend::decode_partial`]), each split is cut around its head's
    /// skipped positions and the kernel runs on the pieces in between.
    fn partials(
        &self,
        cache: &PagedCache,
        seqs: &[SeqId],
        q: &[f32],
        attn: AttnParams,
        skip: Option<&[Vec<Vec<usize>>]>,
    ) -> Result<DecodePartial> {
        let per = check_batch(cache, seqs, q)?;
        check_window(cache, seqs.iter().copied(), attn)?;
        if let Some(skip) = skip {
            check_skip(self.name(), cache, seqs, skip)?;
        }
        let shape = cache.shape();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let group = shape.group_size();
        let dtype = cache.scheme().dtype;
        // Queries are inputs too: round them to the activation dtype.
        let mut qr = Vec::with_capacity(q.len());
        for (i, &x) in q.iter().enumerate() {
            let r = round_to_dtype(x, dtype);
            if !r.is_finite() {
                return Err(Error::NonFinite {
                    tensor: "query",
                    value: x,
                    token: i / per,
                    head: (i % per) / d,
                    channel: i % d,
                    policy: "reject",
                });
            }
            qr.push(r * attn.softmax_scale);
        }
        let views: Vec<SeqView> = seqs.iter().map(|&s| cache.view(s)).collect::<Result<_>>()?;
        let ranges: Vec<(usize, usize)> = views
            .iter()
            .map(|v| {
                let t = v.tokens();
                (attn.window.map_or(0, |w| t.saturating_sub(w)), t)
            })
            .collect();
        let threads = rayon::current_num_threads();
        let max_len = ranges.iter().map(|(a, b)| b - a).max().unwrap_or(0);
        let splits = if self.params.splits == 0 {
            auto_splits(seqs.len() * hkv, max_len, threads)
        } else {
            self.params.splits
        };
        let plan = kernel::Plan::new(cache, self.params.isa(d), self.params.tile_tokens);
        // Tasks `(b, h, pieces)` grouped by (b, h); `first[b * hkv + h]` is
        // where that group starts. A task is one split, one piece, unless
        // `skip` has positions in it: then it is cut around them, and
        // each piece's unaligned ends (fewer than `fused::ROWS` tokens) are
        // pieces of their own, so that its body still runs whole aligned
        // tiles on the fused path; one task runs a split's pieces in turn.
        let sinks = cache.scheme().sinks as usize;
        let up = |p: usize| {
            if p <= sinks {
                p
            } else {
                sinks + (p - sinks).next_multiple_of(fused::ROWS)
            }
        };
        let down = |p: usize| {
            if p <= sinks {
                p
            } else {
                sinks + (p - sinks) / fused::ROWS * fused::ROWS
            }
        };
        let mut tasks: Vec<Task> = Vec::with_capacity(seqs.len() * hkv * splits);
        let mut first = Vec::with_capacity(seqs.len() * hkv + 1);
        for (b, &(lo, hi)) in ranges.iter().enumerate() {
            for h in 0..hkv {
                first.push(tasks.len());
                let len = hi - lo;
                let mut cuts: Vec<usize> = skip.map_or(Vec::new(), |s| {
                    s[b][h].iter().copied().filter(|p| (lo..hi).contains(p)).collect()
                });
                cuts.sort_unstable();
                cuts.dedup();
                for s in 0..splits {
                    let (mut a, z) = (lo + len * s / splits, lo + len * (s + 1) / splits);
                    let from = cuts.partition_point(|&p| p < a);
                    // A split with nothing to skip runs as `decode` runs it.
                    if cuts.get(from).is_none_or(|&p| p >= z) {
                        tasks.push((b, h, vec![(a, z)]));
                        continue;
                    }
                    let mut pieces = Vec::new();
                    let mut piece = |a: usize, z: usize| {
                        let (a16, z16) = (up(a), down(z));
                        if a16 < z16 {
                            for r in [(a, a16), (a16, z16), (z16, z)] {
                                if r.0 < r.1 {
                                    pieces.push(r);
                                }
                            }
                        } else if a < z {
                            pieces.push((a, z));
                        }
                    };
                    for &p in cuts[from..].iter().take_while(|&&p| p < z) {
                        piece(a, p);
                        a = p + 1;
                    }
                    piece(a, z);
                    if !pieces.is_empty() {
                        tasks.push((b, h, pieces));
                    }
                }
            }
        }
        first.push(tasks.len());
        let partials: Vec<Partial> = tasks
            .par_iter()
            .map(|(b, h, pieces)| {
                let qg = &qr[b * per + h * group * d..][..group * d];
                let mut parts = pieces
                    .iter()
                    .map(|&(a, z)| kernel::split_attention(&plan, &views[*b], *h, qg, a, z));
                let one = parts.next().expect("a task has a piece");
                parts.fold(one, |x, y| merge(x, y, group, d))
            })
            .collect();
        let mut out = DecodePartial {
            max: vec![f32::NEG_INFINITY; seqs.len() * hq],
            sum: vec![0.0; seqs.len() * hq],
            acc: vec![0.0; seqs.len() * hq * d],
        };
        for b in 0..seqs.len() {
            for h in 0..hkv {
                let parts = &partials[first[b * hkv + h]..first[b * hkv + h + 1]];
                for g in 0..group {
                    let m = parts.iter().map(|p| p.m[g]).fold(f32::NEG_INFINITY, f32::max);
                    if m == f32::NEG_INFINITY {
                        continue; // nothing attended
                    }
                    let at = b * hq + h * group + g;
                    let o = &mut out.acc[at * d..][..d];
                    let mut l = 0f32;
                    for p in parts {
                        if p.m[g] == f32::NEG_INFINITY {
                            continue;
                        }
                        let w = (p.m[g] - m).exp();
                        l += w * p.l[g];
                        for (x, a) in o.iter_mut().zip(&p.acc[g * d..(g + 1) * d]) {
                            *x += w * a;
                        }
                    }
                    out.max[at] = m;
                    out.sum[at] = l;
                }
            }
        }
        Ok(out)
    }
}

fn check_params(p: &CpuParams) -> Result<()> {
    if p.tile_tokens == 0 || p.tile_tokens > 4096 {
        return Err(Error::Config(format!(
            "tile_tokens = {} must be between 1 and 4096",
            p.tile_tokens
        )));
    }
    if p.splits > 65536 {
        return Err(Error::Config(format!("splits = {} must be at most 65536", p.splits)));
    }
    if p.threads > 1024 {
        return Err(Error::Config(format!("threads = {} must be at most 1024", p.threads)));
    }
    Ok(())
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        self.on_pool(|| self.run(cache, seqs, q, attn))
    }
    /// The split kernel over the tokens between the skipped ones (each
    /// split cut around them), merged per query head, not normalised.
    fn decode_partial(
        &self,
        cache: &PagedCache,
        seqs: &[SeqId],
        q: &[f32],
        attn: AttnParams,
        skip: &[Vec<Vec<usize>>],
    ) -> Result<DecodePartial> {
        self.on_pool(|| self.partials(cache, seqs, q, attn, Some(skip)))
    }
    /// Many-query attention: see `block.rs` for how the work is cut.
    fn attend_block(&self, cache: &mut PagedCache, blocks: &[NewTokens], attn: AttnParams) -> Result<Vec<f32>> {
        check_params(&self.params)?;
        if let Some(r) = crate::backend::int8_blocks(self, cache, blocks, attn) {
            return r;
        }
        let out = self.on_pool(|| self.run_block(cache, blocks, attn))?;
        evict_after_blocks(cache, blocks)?;
        Ok(out)
    }
}
