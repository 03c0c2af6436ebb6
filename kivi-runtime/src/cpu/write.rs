//! Cache writes, vectorised: checking appended tokens, rounding them to the
//! activation dtype, and quantizing them into blocks with uniform levels.
//!
//! The arithmetic is `quant.rs`'s, re-derived lane by lane so that every
//! stored bit is the same as the scalar path's (`tests/cache_writes.rs`
//! compares them bit for bit on every instruction set):
//! - rounding to f16 is the F16C conversion (round to nearest even, the
//!   same as `half`), to bf16 the integer form of round-to-nearest-even;
//! - `lo`/`hi` are exact whatever the order of the comparisons, except for
//!   the sign of a zero: a group whose `lo` or `hi` is a zero is redone with
//!   [`quant::group_lo_hi`] (which defines it);
//! - `s = (hi - lo) / (2^b - 1)` and `(x - z) / s` are IEEE divisions
//!   (correctly rounded, so a vector divide gives the scalar's bits; a
//!   multiply by `1 / s` would not), then round-to-nearest-even, clamp, and
//!   `c = 0` where `s == 0`.
//!
//! Tensors with a codec pipeline (centering, Hadamard rotation, sparse
//! outliers, table levels: Lloyd–Max, calibrated `nuq` with every norm) run
//! here too ([`Pipeline`]): each row goes through `quant.rs`'s own
//! transform, then outlier selection and the groups re-derived the same
//! way. On the token axis a group is part of one row ([`lloyd_group`] says
//! why its reordered f64 sums still give the oracle's bits); on the channel
//! axis a group is one channel of `G` rows, so the `G` rows of every head
//! are buffered and each lane takes one channel ([`channel_pipeline`]): a
//! lane's sums run over the tokens in the oracle's own order.
//!
//! **`full` tensors are checked as they are stored** (the f16 preset; bf16
//! and f32 rows alike). A write must refuse a non-finite value and lose
//! nothing; quantized tensors get that from a separate vectorised pass over
//! the input ([`inputs_ok`]) before the first word changes. For a `full`
//! row that pass was half the write's memory traffic (the input is read
//! twice, from DRAM for a long prefill), so these rows take the check on
//! the vectors they store ([`store_row_words`], the same
//! [`Writes::and_within`]) and the input is read once. A row that fails
//! ends its job; the cache then zeroes every row of the write's range
//! (`cache.rs`, `clear_blocks`, via [`clear_rows`]), gives back the blocks
//! it took, and the reference path reports the error. Why this keeps
//! "bad input loses nothing": every row such a write touches lies past
//! the sequence's stored tokens (fresh blocks, or the unwritten tail of
//! its last block), where no reader looks, and the tokens, windows,
//! table, free list and `memory()` are updated only after every job has
//! succeeded. What can differ after a failure is the content of those
//! unreadable rows: zero afterwards, whatever they held (zero in a pool
//! that never held other tokens there, which `tests/cache_writes.rs`
//! checks word for word; the stale rows of a freed sequence otherwise).
//! The alternatives cost more on every write to save a failing one: a
//! copy of the old rows (a second stream of stores) or validating in
//! L1-sized chunks ahead of the stores (the rows stored before the bad
//! chunk must be undone anyway).
//!
//! Codes are made one byte each and packed into words afterwards
//! ([`pack_bytes`]), so one packer serves every instruction set.
//!
//! The kernels are written once, generic over [`Writes`]: the width's
//! [`Lanes`] (16 lanes with AVX-512, 8 with AVX2 + F16C, 1 with plain scalar
//! code, the types of `width.rs`) and the few operations only a write needs,
//! instantiated under each instruction set's `#[target_feature]`.

use super::simd::Isa;
#[cfg(target_arch = "x86_64")]
use super::width::{Avx2, Avx512};
use super::width::{Lanes, Scalar};
use crate::cache::RawRows;
use crate::quant::{self, GroupParams, TensorCodec};
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Dtype, Norm, Quant, ScaleDtype};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The largest head_dim (kivi_spec's `MAX_HEAD_DIM`): per-row scratch lives
/// on the stack at this size, so a write allocates nothing per token.
const MAX_D: usize = 1024;

/// Where the rows of one write come from: the caller's input (f32, not yet
/// rounded) for new tokens, the window ring (already rounded) for tokens
/// that were appended before and leave the window now.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    /// `[n][Hkv][D]`, the first row at position `old_tokens`.
    pub input: &'a [f32],
    pub ring: RawRows<'a>,
    pub ring_cap: usize,
    pub sinks: usize,
    pub old_tokens: usize,
    pub heads: usize,
    pub d: usize,
}

/// One row: `D` values.
#[derive(Clone, Copy)]
enum Src<'a> {
    /// Not yet rounded to the activation dtype.
    Input(&'a [f32]),
    /// 16-bit storage of the activation dtype.
    Bits(&'a [u16]),
    /// f32 storage (the f32 activation dtype).
    Stored(&'a [f32]),
}

impl Src<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        match self {
            Src::Input(x) => x.len(),
            Src::Bits(b) => b.len(),
            Src::Stored(f) => f.len(),
        }
    }
}

impl<'a> Rows<'a> {
    /// Row of relative token `j` (position `sinks + j`), KV head `hh`.
    #[inline(always)]
    fn row(&self, j: usize, hh: usize) -> Src<'a> {
        let (h, d) = (self.heads, self.d);
        let p = self.sinks + j;
        if p >= self.old_tokens {
            Src::Input(&self.input[((p - self.old_tokens) * h + hh) * d..][..d])
        } else {
            let base = ((j % self.ring_cap) * h + hh) * d;
            match self.ring {
                RawRows::Bits16(b) => Src::Bits(&b[base..base + d]),
                RawRows::F32(f) => Src::Stored(&f[base..base + d]),
            }
        }
    }
}

/// One tensor of one block, every KV head: the tokens `first..first + n`
/// (relative, all in this block). Rows are visited token by token, every
/// head of a token in turn, i.e. in the input's own order: visited head by
/// head, consecutive rows of a head lie `Hkv x D x 4` bytes apart (4 KiB at
/// GQA 32:8), one page each, and the hardware prefetchers lose track
/// (measured: most of the time went to stalled loads).
pub(crate) struct Job<'a> {
    /// The whole block (every head, both tensors).
    pub block: &'a mut [u32],
    pub first: usize,
    pub n: usize,
}

/// What every job of one tensor shares.
#[derive(Clone, Copy)]
pub(crate) struct Plan<'a> {
    pub tl: &'a TensorLayout,
    /// Where this tensor's part of head `h` starts in a block:
    /// `h * head_words + offset`.
    pub head_words: usize,
    pub offset: usize,
    /// `None`: a `full` tensor, rows stored raw.
    pub quant: Option<Quant>,
    pub dtype: Dtype,
    pub isa: Isa,
    /// The codec pipeline of a tensor that has one (centering, rotation,
    /// sparse outliers, table levels), on either axis; `None` for plain
    /// uniform codes and `full` rows.
    pub pipeline: Option<Pipeline<'a>>,
}

/// A tensor's codec pipeline ([`pipeline_fits`]): each row is rounded
/// here, then transformed and cleared of its outliers by `quant.rs`'s own
/// functions, call for call as the reference path does, and its groups
/// quantized as `quant::quantize_group_in` does, only without a heap
/// buffer per token.
#[derive(Clone, Copy)]
pub(crate) struct Pipeline<'a> {
    pub codec: &'a TensorCodec,
    /// The centering means, `[Hkv][D]`, once the sequence has them.
    pub means: Option<&'a [f32]>,
}

/// Whether the writes take a pipeline tensor of `heads` x `d` rows: at
/// most [`quant::TOP_K_SMALL`] outliers a token (found without
/// allocating), tables of at most 16 levels (what validation allows), and
/// on the channel axis a buffer of `G` rows of every head of at most
/// [`CHANNEL_BUFFER`] values. Lloyd–Max and calibrated `nuq` tables alike
/// (coded against the codec's own table).
pub(crate) fn pipeline_fits(codec: &TensorCodec, heads: usize, d: usize) -> bool {
    let fits = codec.outliers <= quant::TOP_K_SMALL
        && codec.outliers <= d
        && d <= MAX_D
        && codec.quant.bits <= 8
        && codec.levels.len() <= 16;
    match codec.quant.axis {
        Axis::Token => fits,
        Axis::Channel => fits && (codec.quant.group as usize).saturating_mul(heads * d) <= CHANNEL_BUFFER,
    }
}

/// The most values a channel-axis pipeline buffers (one group of rows,
/// every head): 16 MiB of f32 per writing thread, grown once. The largest
/// channel groups (G = 1024 at 8 x 1024) would need twice that; they take
/// the reference path.
const CHANNEL_BUFFER: usize = 1 << 22;

/// The instruction set a tensor's writes use: `cap` or the widest below it
/// whose lane count divides the rows (and, on the token axis, the groups).
pub(crate) fn tensor_isa(cap: Isa, quant: Option<&Quant>, d: usize) -> Isa {
    let unit = match quant {
        Some(q) if q.axis == Axis::Token => q.group as usize,
        _ => d,
    };
    let fits = |isa: Isa| unit.is_multiple_of(isa.width()) && d.is_multiple_of(isa.width());
    let mut isa = cap;
    if isa == Isa::Avx512 && !fits(isa) {
        isa = Isa::Avx2;
    }
    if isa == Isa::Avx2 && (!fits(isa) || !avx2_ok()) {
        isa = Isa::Scalar;
    }
    isa
}

#[cfg(target_arch = "x86_64")]
fn avx2_ok() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}
#[cfg(not(target_arch = "x86_64"))]
fn avx2_ok() -> bool {
    false
}

/// Writes one job. `false` when a group's parameters overflow their dtype
/// (the caller then lets the scalar path say which group); the words
/// written so far are not yet visible to any reader.
pub(crate) fn run(plan: &Plan, rows: &Rows, job: &mut Job) -> bool {
    match plan.isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `tensor_isa` chose AVX-512 only where `Isa::select` found it.
        Isa::Avx512 => unsafe { run_avx512(plan, rows, job) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, AVX2 + FMA + F16C.
        Isa::Avx2 => unsafe { run_avx2(plan, rows, job) },
        _ => job_body::<Scalar>(plan, rows, job),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn run_avx512(plan: &Plan, rows: &Rows, job: &mut Job) -> bool {
    job_body::<Avx512>(plan, rows, job)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2(plan: &Plan, rows: &Rows, job: &mut Job) -> bool {
    job_body::<Avx2>(plan, rows, job)
}

thread_local! {
    /// Per-thread scratch of the channel-axis writes (`lo`/`hi`, then
    /// scale/zero, of every head and channel): grown once, so writes do
    /// not allocate per token.
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

#[inline(always)]
fn job_body<L: Writes>(plan: &Plan, rows: &Rows, job: &mut Job) -> bool {
    let tl = plan.tl;
    let bt = tl.block_tokens;
    let wpt = tl.words_per_token;
    let (h, d) = (rows.heads, rows.d);
    let part_start = |hh: usize| hh * plan.head_words + plan.offset;
    let words = tl.words;
    let Some(q) = plan.quant else {
        // Checked as stored (see the module docs): the first bad row ends
        // the job, and the caller clears what the write touched.
        for j in job.first..job.first + job.n {
            let off = j % bt;
            for hh in 0..h {
                let part = &mut job.block[part_start(hh)..][..words];
                if !store_row_words::<L>(rows.row(j, hh), plan.dtype, &mut part[off * wpt..(off + 1) * wpt]) {
                    return false;
                }
            }
        }
        return true;
    };
    let per = kivi_spec::layout::codes_per_word(q.bits);
    // One row of codes, padded with zeros to whole words.
    let mut codes = [0u8; MAX_D + 32];
    let padded = wpt * per;
    if let Some(pipe) = plan.pipeline {
        return match q.axis {
            Axis::Token => pipeline_rows::<L>(plan, &pipe, &q, rows, job, &mut codes),
            Axis::Channel => {
                let mut sc = CHAN_SCRATCH.take();
                let ok = channel_pipeline::<L>(plan, &pipe, &q, rows, job, &mut codes, &mut sc);
                CHAN_SCRATCH.set(sc);
                ok
            }
        };
    }
    match q.axis {
        Axis::Token => {
            for j in job.first..job.first + job.n {
                let off = j % bt;
                for hh in 0..h {
                    let part = &mut job.block[part_start(hh)..][..words];
                    if !token_row::<L>(plan, &q, rows.row(j, hh), off, part, &mut codes, None) {
                        return false;
                    }
                    codes[d..padded].fill(0);
                    pack_bytes(&codes[..padded], q.bits, &mut part[off * wpt..(off + 1) * wpt]);
                }
            }
        }
        Axis::Channel => {
            let mut scratch = SCRATCH.take();
            if scratch.len() < 2 * h * d {
                scratch.resize(2 * h * d, 0.0);
            }
            let ok = channel_groups::<L>(plan, &q, rows, job, &mut scratch, &mut codes);
            SCRATCH.set(scratch);
            return ok;
        }
    }
    true
}

/// Quantizes one row of token-axis groups into byte codes, writing the
/// groups' parameters into `part` (and, if given, into `params`, one a
/// group). `false`: a parameter overflows.
#[inline(always)]
fn token_row<L: Writes>(
    plan: &Plan,
    q: &Quant,
    src: Src,
    off: usize,
    part: &mut [u32],
    codes: &mut [u8],
    mut params: Option<&mut [GroupParams]>,
) -> bool {
    let tl = plan.tl;
    let g = q.group as usize;
    let maxc = q.max_code() as f32;
    for c0 in (0..src.len()).step_by(g) {
        // SAFETY: `tensor_isa` made the lane count divide `g` and `d`, so
        // every load stays inside the row, every store inside `codes`.
        let p = unsafe {
            let mut lo = L::read(src, c0, plan.dtype);
            let mut hi = lo;
            let mut c = c0 + L::LANES;
            while c < c0 + g {
                let x = L::read(src, c, plan.dtype);
                lo = L::min(lo, x);
                hi = L::max(hi, x);
                c += L::LANES;
            }
            let (mut lo, mut hi) = (L::reduce_min(lo), L::reduce_max(hi));
            if lo == 0.0 || hi == 0.0 {
                (lo, hi) = quant::group_lo_hi((c0..c0 + g).map(|i| scalar_at(src, i, plan.dtype)));
            }
            let p = quant::GroupParams {
                scale: round_scale1::<L>((hi - lo) / maxc, q.scale),
                zero: round_scale1::<L>(lo, q.scale),
            };
            if !p.is_finite() {
                return false;
            }
            let (vs, vz) = (L::splat(p.scale), L::splat(p.zero));
            let mut c = c0;
            while c < c0 + g {
                L::encode(L::read(src, c, plan.dtype), vz, vs, maxc, codes.as_mut_ptr().add(c));
                c += L::LANES;
            }
            p
        };
        let i = tl.param_index(off, c0);
        write_param::<L>(&mut part[tl.scales_offset..], i, p.scale, q.scale);
        write_param::<L>(&mut part[tl.zeros_offset..], i, p.zero, q.scale);
        if let Some(ps) = params.as_deref_mut() {
            ps[c0 / g] = p;
        }
    }
    true
}

/// The rows of a pipeline tensor ([`Pipeline`]), token by token, every
/// head of a token in turn: the reference path's steps (`quantize_range`
/// in `cache.rs`) on a row in per-thread scratch. `false`: a parameter or
/// an outlier's correction overflows (the reference path then says which).
#[inline(always)]
fn pipeline_rows<L: Writes>(
    plan: &Plan,
    pipe: &Pipeline,
    q: &Quant,
    rows: &Rows,
    job: &mut Job,
    codes: &mut [u8],
) -> bool {
    // Grown once per thread: zeroing row-sized stack arrays on every call
    // was most of an append's time.
    let mut sc = PIPE_SCRATCH.take();
    sc.row.resize(rows.d, 0.0);
    sc.params.resize(rows.d, GroupParams { scale: 0.0, zero: 0.0 });
    let ok = pipeline_body::<L>(plan, pipe, q, rows, job, codes, &mut sc);
    PIPE_SCRATCH.set(sc);
    ok
}

/// Per-thread scratch of [`pipeline_rows`]: one row and its groups'
/// parameters.
#[derive(Default)]
struct PipeScratch {
    row: Vec<f32>,
    params: Vec<GroupParams>,
}

thread_local! {
    static PIPE_SCRATCH: std::cell::Cell<PipeScratch> = std::cell::Cell::new(PipeScratch::default());
}

#[inline(always)]
fn pipeline_body<L: Writes>(
    plan: &Plan,
    pipe: &Pipeline,
    q: &Quant,
    rows: &Rows,
    job: &mut Job,
    codes: &mut [u8],
    sc: &mut PipeScratch,
) -> bool {
    let tl = plan.tl;
    let (h, d) = (rows.heads, rows.d);
    let (bt, wpt) = (tl.block_tokens, tl.words_per_token);
    let g = q.group as usize;
    let padded = wpt * kivi_spec::layout::codes_per_word(q.bits);
    let codec = pipe.codec;
    let PipeScratch { row, params } = sc;
    let mut idx = [0usize; quant::TOP_K_SMALL];
    let mut orig = [0f32; quant::TOP_K_SMALL];
    let mut corr = [0f32; quant::TOP_K_SMALL];
    for j in job.first..job.first + job.n {
        let off = j % bt;
        for hh in 0..h {
            let r = &mut row[..d];
            load_row::<L>(rows.row(j, hh), plan.dtype, r);
            codec.forward(r, pipe.means.map(|m| &m[hh * d..(hh + 1) * d]));
            let no = take_outliers::<L>(codec, r, &mut idx, &mut orig);
            let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
            if q.has_zeros() {
                if !token_row::<L>(plan, q, Src::Stored(r), off, part, codes, Some(params)) {
                    return false;
                }
            } else {
                for c0 in (0..d).step_by(g) {
                    let s = lloyd_group::<L>(q, &codec.levels, &r[c0..c0 + g], &mut codes[c0..c0 + g]);
                    if !s.is_finite() {
                        return false;
                    }
                    params[c0 / g] = GroupParams { scale: s, zero: 0.0 };
                    let i = tl.param_index(off, c0);
                    write_param::<L>(&mut part[tl.scales_offset..], i, s, q.scale);
                }
            }
            codes[d..padded].fill(0);
            pack_bytes(&codes[..padded], q.bits, &mut part[off * wpt..(off + 1) * wpt]);
            if tl.outliers > 0 {
                for i in 0..no {
                    let c = idx[i];
                    // The codec's own table: a calibrated `nuq` codebook is
                    // not the (empty) fixed table of `quant::dequantize`.
                    let deq = codec.dequantize(codes[c] as u32, params[c / g]);
                    match codec.correction(orig[i], deq) {
                        Some(x) => corr[i] = x,
                        None => return false,
                    }
                }
                let iw = &mut part[tl.outlier_idx_offset + off * tl.outlier_idx_words..][..tl.outlier_idx_words];
                for (w, pair) in iw.iter_mut().zip(idx[..no].chunks(2)) {
                    *w = pair[0] as u32 | (pair.get(1).map_or(0, |x| *x as u32) << 16);
                }
                let vw = &mut part[tl.outlier_val_offset + off * tl.outlier_val_words..][..tl.outlier_val_words];
                store_row_words::<L>(Src::Stored(&corr[..no]), plan.dtype, vw);
            }
        }
    }
    true
}

/// Per-thread scratch of [`channel_pipeline`], grown once.
#[derive(Default)]
struct ChanScratch {
    /// One channel group's rows, `[G][Hkv][D]`, rounded and transformed.
    rows: Vec<f32>,
    /// Per (head, channel), `Hkv x D` each: `lo` then the scale, `hi`
    /// then the zero point; the f64 sums of `x^2` and of `L[c]^2`.
    a: Vec<f32>,
    b: Vec<f32>,
    ss: Vec<f64>,
    lc: Vec<f64>,
    /// Per row (`[G][Hkv]`): how many outliers, then per outlier (`K` a
    /// row) its channel, its original value and the code its channel got.
    n_out: Vec<u8>,
    out_idx: Vec<u16>,
    out_val: Vec<f32>,
    out_code: Vec<u8>,
}

thread_local! {
    static CHAN_SCRATCH: std::cell::Cell<ChanScratch> = std::cell::Cell::new(ChanScratch::default());
}

/// How `quant::quantize_group_in` codes a group, by levels.
#[derive(Clone, Copy, PartialEq)]
enum ChanKind {
    /// `(x - z) / s` rounded: uniform levels.
    Uniform,
    /// `(x - z) / s` against the table: `nuq` with `norm = minmax` or
    /// `minmax_pinned` (`quant::minmax_group_in`).
    MinMax,
    /// `x / rms` against the table, the norm `rms` or, for `l2`, `||x|| /
    /// ||L[c]||` (`quant::lloyd_group_in`): Lloyd–Max and the other `nuq`.
    Scaled { l2: bool },
}

/// The channel-axis groups of a pipeline tensor's job (whole groups, as
/// [`channel_groups`]): per group, its `G` rows of every head are read
/// (rounded), transformed and cleared of their outliers into `sc.rows`,
/// each row as the reference path does it; then every (head, channel) is a
/// lane, so the group statistics are taken lane by lane over the tokens in
/// the oracle's order (`lo`/`hi` exactly; the f64 sums of `x^2` and
/// `L[c]^2` with the same additions in the same order, so the same bits);
/// then the codes, row by row, packed; then the parameters, and last the
/// outliers' corrections (an `l2` scale is known only after every code).
/// `false`: a parameter or a correction overflows (the reference path then
/// says which).
#[inline(always)]
fn channel_pipeline<L: Writes>(
    plan: &Plan,
    pipe: &Pipeline,
    q: &Quant,
    rows: &Rows,
    job: &mut Job,
    codes: &mut [u8],
    sc: &mut ChanScratch,
) -> bool {
    let tl = plan.tl;
    let (h, d) = (rows.heads, rows.d);
    let w = h * d;
    let g = q.group as usize;
    let (bt, wpt) = (tl.block_tokens, tl.words_per_token);
    let padded = wpt * kivi_spec::layout::codes_per_word(q.bits);
    let codec = pipe.codec;
    let levels = &codec.levels[..];
    let kind = match q.levels {
        kivi_spec::Levels::Uniform => ChanKind::Uniform,
        kivi_spec::Levels::Nuq(Norm::MinMax | Norm::MinMaxPinned) => ChanKind::MinMax,
        kivi_spec::Levels::LloydMax(n) | kivi_spec::Levels::Nuq(n) => ChanKind::Scaled { l2: n == Norm::L2 },
    };
    // An empty table (a `nuq` codec without its codebook, which caches
    // refuse to build) codes zeros, as `quant.rs` does.
    let no_table = kind != ChanKind::Uniform && levels.is_empty();
    let nt = levels.len().saturating_sub(1);
    let mut thresholds = [0f32; 15];
    for (t, v) in thresholds.iter_mut().zip(levels.windows(2)) {
        *t = (v[0] + v[1]) * 0.5;
    }
    let thresholds = &thresholds[..nt.min(15)];
    let mut lsq = [0f64; 16];
    for (o, l) in lsq.iter_mut().zip(levels) {
        *o = (*l as f64).powi(2);
    }
    let maxc = q.max_code() as f32;
    let k_out = codec.outliers.min(quant::TOP_K_SMALL);
    let transform = codec.rotation.is_some() || pipe.means.is_some();
    sc.rows.resize(g * w, 0.0);
    sc.a.resize(w, 0.0);
    sc.b.resize(w, 0.0);
    if matches!(kind, ChanKind::Scaled { .. }) {
        sc.ss.resize(w, 0.0);
        sc.lc.resize(w, 0.0);
    }
    if k_out > 0 {
        sc.n_out.resize(g * h, 0);
        sc.out_idx.resize(g * h * k_out, 0);
        sc.out_val.resize(g * h * k_out, 0.0);
        sc.out_code.resize(g * h * k_out, 0);
    }
    let ChanScratch {
        rows: buf,
        a,
        b,
        ss,
        lc,
        n_out,
        out_idx,
        out_val,
        out_code,
    } = sc;
    let (buf, a, b) = (&mut buf[..g * w], &mut a[..w], &mut b[..w]);
    let mut idx = [0usize; quant::TOP_K_SMALL];
    let mut orig = [0f32; quant::TOP_K_SMALL];
    let mut corr = [0f32; quant::TOP_K_SMALL];
    for j0 in (job.first..job.first + job.n).step_by(g) {
        let off0 = j0 % bt;
        // The rows, in the input's order (token by token, every head).
        for k in 0..g {
            for hh in 0..h {
                let r = &mut buf[(k * h + hh) * d..][..d];
                load_row::<L>(rows.row(j0 + k, hh), plan.dtype, r);
                if transform {
                    codec.forward(r, pipe.means.map(|m| &m[hh * d..(hh + 1) * d]));
                }
                if k_out > 0 {
                    let no = take_outliers::<L>(codec, r, &mut idx, &mut orig);
                    let at = (k * h + hh) * k_out;
                    n_out[k * h + hh] = no as u8;
                    for i in 0..no {
                        out_idx[at + i] = idx[i] as u16;
                        out_val[at + i] = orig[i];
                    }
                }
            }
        }
        // The parameters of every (head, channel): `a` the scale, `b` the
        // zero point.
        match kind {
            ChanKind::Uniform | ChanKind::MinMax => {
                for k in 0..g {
                    let x = &buf[k * w..(k + 1) * w];
                    let mut f = 0;
                    while f < w {
                        // SAFETY: the lane count divides `d` (`tensor_isa`),
                        // so `f + N <= w`.
                        unsafe {
                            let v = L::load(x.as_ptr().add(f));
                            let (l, u) = if k == 0 {
                                (v, v)
                            } else {
                                (
                                    L::min(L::load(a.as_ptr().add(f)), v),
                                    L::max(L::load(b.as_ptr().add(f)), v),
                                )
                            };
                            L::store(a.as_mut_ptr().add(f), l);
                            L::store(b.as_mut_ptr().add(f), u);
                        }
                        f += L::LANES;
                    }
                }
                // A zero at either end: its sign is the scalar rule's
                // (redone lane by lane; an outlier taken out leaves one).
                for f in 0..w {
                    if a[f] == 0.0 || b[f] == 0.0 {
                        (a[f], b[f]) = quant::group_lo_hi((0..g).map(|k| buf[k * w + f]));
                    }
                }
                let mut f = 0;
                while f < w {
                    // SAFETY: as above; `lo`/`hi` become scale/zero here.
                    unsafe {
                        let l = L::load(a.as_ptr().add(f));
                        let u = L::load(b.as_ptr().add(f));
                        let span = L::sub(u, l);
                        let s = match kind {
                            ChanKind::Uniform => L::div(span, L::splat(maxc)),
                            _ => span,
                        };
                        let s = L::round_scale(s, q.scale);
                        let z = L::round_scale(l, q.scale);
                        if !L::all_finite(s) || !L::all_finite(z) {
                            return false;
                        }
                        L::store(a.as_mut_ptr().add(f), s);
                        L::store(b.as_mut_ptr().add(f), z);
                    }
                    f += L::LANES;
                }
            }
            ChanKind::Scaled { .. } => {
                // `sum x^2` in f64, token after token: each lane's chain
                // of additions is the oracle's (plain loops: the compiler
                // widens them, and lane-wise additions keep their bits).
                let ss = &mut ss[..w];
                ss.fill(0.0);
                for k in 0..g {
                    for (s, x) in ss.iter_mut().zip(&buf[k * w..(k + 1) * w]) {
                        *s += (*x as f64) * (*x as f64);
                    }
                }
                for f in 0..w {
                    let rms = if no_table {
                        0.0
                    } else {
                        round_scale1::<L>((ss[f] / g as f64).sqrt() as f32, q.scale)
                    };
                    // Stored unless `l2` (checked below): an overflow.
                    if kind == (ChanKind::Scaled { l2: false }) && !rms.is_finite() {
                        return false;
                    }
                    a[f] = rms;
                    b[f] = 0.0;
                }
                lc[..w].fill(0.0);
            }
        }
        // The codes, row by row.
        for k in 0..g {
            let off = off0 + k;
            for hh in 0..h {
                let x = &buf[(k * h + hh) * d..][..d];
                let (s, z) = (&a[hh * d..(hh + 1) * d], &b[hh * d..(hh + 1) * d]);
                if no_table {
                    codes[..d].fill(0);
                } else {
                    let mut c = 0;
                    while c < d {
                        // SAFETY: as above, `c + N <= d`.
                        unsafe {
                            let v = L::load(x.as_ptr().add(c));
                            let (sv, zv) = (L::load(s.as_ptr().add(c)), L::load(z.as_ptr().add(c)));
                            let out = codes.as_mut_ptr().add(c);
                            match kind {
                                ChanKind::Uniform => L::encode(v, zv, sv, maxc, out),
                                ChanKind::MinMax => L::table_codes(v, zv, sv, true, thresholds, out),
                                ChanKind::Scaled { .. } => L::table_codes(v, zv, sv, false, thresholds, out),
                            }
                        }
                        c += L::LANES;
                    }
                }
                if kind == (ChanKind::Scaled { l2: true }) {
                    // `sum L[c]^2`, token after token, as `ss`.
                    for (l, c) in lc[hh * d..(hh + 1) * d].iter_mut().zip(&codes[..d]) {
                        *l += lsq[*c as usize];
                    }
                }
                if k_out > 0 {
                    let at = (k * h + hh) * k_out;
                    for i in 0..n_out[k * h + hh] as usize {
                        out_code[at + i] = codes[out_idx[at + i] as usize];
                    }
                }
                codes[d..padded].fill(0);
                let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
                pack_bytes(&codes[..padded], q.bits, &mut part[off * wpt..(off + 1) * wpt]);
            }
        }
        if kind == (ChanKind::Scaled { l2: true }) {
            for f in 0..w {
                let (ss, lc) = (ss[f], lc[f]);
                a[f] = if lc == 0.0 || ss == 0.0 {
                    0.0
                } else {
                    round_scale1::<L>((ss / lc).sqrt() as f32, q.scale)
                };
                if !a[f].is_finite() {
                    return false;
                }
            }
        }
        for hh in 0..h {
            let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
            for c in 0..d {
                let i = tl.param_index(off0, c);
                write_param::<L>(&mut part[tl.scales_offset..], i, a[hh * d + c], q.scale);
                if q.has_zeros() {
                    write_param::<L>(&mut part[tl.zeros_offset..], i, b[hh * d + c], q.scale);
                }
            }
        }
        if k_out > 0 && tl.outliers > 0 {
            for k in 0..g {
                let off = off0 + k;
                for hh in 0..h {
                    let at = (k * h + hh) * k_out;
                    let no = n_out[k * h + hh] as usize;
                    for i in 0..no {
                        let f = hh * d + out_idx[at + i] as usize;
                        idx[i] = out_idx[at + i] as usize;
                        // The codec's own table, as the token axis does.
                        let p = GroupParams {
                            scale: a[f],
                            zero: b[f],
                        };
                        let deq = codec.dequantize(out_code[at + i] as u32, p);
                        match codec.correction(out_val[at + i], deq) {
                            Some(x) => corr[i] = x,
                            None => return false,
                        }
                    }
                    let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
                    let iw = &mut part[tl.outlier_idx_offset + off * tl.outlier_idx_words..][..tl.outlier_idx_words];
                    for (wd, pair) in iw.iter_mut().zip(idx[..no].chunks(2)) {
                        *wd = pair[0] as u32 | (pair.get(1).map_or(0, |x| *x as u32) << 16);
                    }
                    let vw = &mut part[tl.outlier_val_offset + off * tl.outlier_val_words..][..tl.outlier_val_words];
                    store_row_words::<L>(Src::Stored(&corr[..no]), plan.dtype, vw);
                }
            }
        }
    }
    true
}

/// `TensorCodec::take_outliers_small`, the same selection, [`Lanes::LANES`]
/// values at a time: a value enters the kept `k` only when its magnitude
/// is above the k-th best's (ties go to the lower channel, met first), and
/// that bar only rises, so the lanes not above it when their vector is
/// looked at could never enter; the others are offered to the scalar rule
/// one by one, in channel order. For magnitudes (sign bit clear, NaN
/// included) `total_cmp` is the order of the bits as integers.
#[inline(always)]
fn take_outliers<L: Writes>(
    codec: &TensorCodec,
    row: &mut [f32],
    idx: &mut [usize; quant::TOP_K_SMALL],
    vals: &mut [f32; quant::TOP_K_SMALL],
) -> usize {
    let k = codec.outliers.min(quant::TOP_K_SMALL);
    let d = row.len();
    if k == 0 || d < k + L::LANES || L::LANES == 1 {
        return codec.take_outliers_small(row, idx, vals);
    }
    // (magnitude bits, channel), best first.
    let mut best = [(0u32, 0usize); quant::TOP_K_SMALL + 1];
    let mut len = 0;
    let offer = |best: &mut [(u32, usize); quant::TOP_K_SMALL + 1], len: &mut usize, a: u32, i: usize| {
        if *len == k && a <= best[*len - 1].0 {
            return;
        }
        let at = best[..*len].partition_point(|b| b.0 >= a);
        best.copy_within(at..*len, at + 1);
        best[at] = (a, i);
        *len = (*len + 1).min(k);
    };
    let mut c = 0;
    while c < d {
        if len == k && c + L::LANES <= d {
            // SAFETY: `c + N <= d`.
            let mut m = unsafe { L::above(row.as_ptr().add(c), best[len - 1].0) };
            while m != 0 {
                let i = c + m.trailing_zeros() as usize;
                offer(&mut best, &mut len, row[i].to_bits() & 0x7fff_ffff, i);
                m &= m - 1;
            }
            c += L::LANES;
        } else {
            offer(&mut best, &mut len, row[c].to_bits() & 0x7fff_ffff, c);
            c += 1;
        }
    }
    for (o, b) in idx.iter_mut().zip(&best[..len]) {
        *o = b.1;
    }
    idx[..len].sort_unstable();
    for (v, &i) in vals.iter_mut().zip(&idx[..len]) {
        *v = std::mem::replace(&mut row[i], 0.0);
    }
    len
}

/// `quant::lloyd_group` of one group `x`, codes a byte each into `codes`;
/// the stored norm returned. Bit for bit the oracle's, by this argument:
///
/// The oracle sums `ss = sum x_i^2` and `lc = sum L[c_i]^2` in f64, one
/// addition after another in channel order: a dependent chain, the bulk of
/// a group's time. Every term is exact (an f32 squared fits an f64), and
/// the terms are not negative, so any order of summation is within
/// `gamma_(n-1) = (n-1)u / (1 - (n-1)u)` (u = 2^-53) of the exact sum,
/// relative to it (Higham, *Accuracy and Stability*, 4.2); two orders are
/// within `2 gamma_(n-1) / (1 - gamma_(n-1)) < 2^-41` of each other, relative
/// to either, for groups up to 1024 values. Here the sums are taken in
/// vector lanes; `lo`/`hi` widen them by `2^-40` either way, so the oracle's
/// chained sums lie in `[lo, hi]`. What is stored — `rms = f16(f32(sqrt(ss
/// / n)))` and, for `l2`, `s = f16(f32(sqrt(ss / lc)))` — is a composition
/// of IEEE operations each monotone in `ss` (and antitone in `lc`), so when
/// the two ends of the interval give the same stored value, so does every
/// point between them, the oracle's sums included; when they do not (a
/// value a hair from a rounding boundary), the chains are summed in the
/// oracle's order. `ss == 0` exactly when every `x` is 0 in both orders
/// (a nonzero square is at least 2^-298, far above f64's least value).
/// The codes depend only on the stored `rms` (`y = x / rms`, an IEEE
/// division in every lane, compared with the thresholds exactly).
#[inline(always)]
fn lloyd_group<L: Writes>(q: &Quant, levels: &[f32], x: &[f32], codes: &mut [u8]) -> f32 {
    let Some(norm) = q.levels.norm() else {
        unreachable!("lloyd_group on uniform levels")
    };
    let g = x.len();
    // The codec's own table: Lloyd–Max's fixed one or a calibrated `nuq`
    // codebook (ascending, at most 16 entries: table levels are 1 to 4 bits
    // by validation). An empty one (a `nuq` codec given no codebook, which
    // caches refuse to build) codes zeros, as `quant::lloyd_group_in` does.
    if levels.is_empty() {
        codes[..g].fill(0);
        return 0.0;
    }
    let nt = levels.len() - 1;
    let mut thresholds = [0f32; 15];
    for (t, w) in thresholds.iter_mut().zip(levels.windows(2)) {
        *t = (w[0] + w[1]) * 0.5;
    }
    const WIDEN: f64 = 1.0 / (1u64 << 40) as f64;
    let seq_ss = || x.iter().fold(0f64, |a, v| a + (*v as f64) * (*v as f64));
    let ss_fast = sum_squares(x);
    let rms_of = |ss: f64| quant::round_to_scale((ss / g as f64).sqrt() as f32, q.scale);
    let (ss_lo, ss_hi) = (ss_fast - ss_fast * WIDEN, ss_fast + ss_fast * WIDEN);
    let mut ss = None;
    let rms = if rms_of(ss_lo) == rms_of(ss_hi) {
        rms_of(ss_fast)
    } else {
        let exact = seq_ss();
        ss = Some(exact);
        rms_of(exact)
    };
    let mut c = 0;
    while c + L::LANES <= g {
        // SAFETY: `c + N <= g` values in the group and codes.
        unsafe { L::lloyd_codes(x.as_ptr().add(c), rms, &thresholds[..nt], codes.as_mut_ptr().add(c)) };
        c += L::LANES;
    }
    for i in c..g {
        let y = if rms == 0.0 { 0.0 } else { x[i] / rms };
        codes[i] = thresholds[..nt].iter().filter(|t| y > **t).count() as u8;
    }
    match norm {
        // Token-axis minmax groups are refused by validation (they would
        // need a zero point here); as in `quant::lloyd_group_in`.
        Norm::Rms | Norm::MinMax | Norm::MinMaxPinned => rms,
        Norm::L2 => {
            // Codes counted, then `sum count_k * L_k^2`: 16 roundings at
            // most, within the same bound.
            // One vectorised count per level: a histogram's increments of
            // the same counter wait on each other.
            let mut count = [0u32; 16];
            for (k, n) in count.iter_mut().enumerate().take(levels.len()) {
                *n = codes[..g].iter().filter(|c| **c as usize == k).count() as u32;
            }
            let lsq = |k: usize| (levels[k] as f64).powi(2);
            let lc_fast: f64 = (0..levels.len()).map(|k| count[k] as f64 * lsq(k)).sum();
            let s_of = |ss: f64, lc: f64| {
                if lc == 0.0 || ss == 0.0 {
                    0.0
                } else {
                    quant::round_to_scale((ss / lc).sqrt() as f32, q.scale)
                }
            };
            if ss_fast == 0.0 {
                return 0.0;
            }
            let (lc_lo, lc_hi) = (lc_fast - lc_fast * WIDEN, lc_fast + lc_fast * WIDEN);
            if ss.is_none() && s_of(ss_lo, lc_hi) == s_of(ss_hi, lc_lo) {
                return s_of(ss_fast, lc_fast);
            }
            let ss = ss.unwrap_or_else(seq_ss);
            let lc = codes[..g].iter().fold(0f64, |a, c| a + lsq(*c as usize));
            s_of(ss, lc)
        }
    }
}

/// `sum x_i^2` in f64, eight running sums (any order will do: see
/// [`lloyd_group`]).
#[inline(always)]
fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        for (a, v) in acc.iter_mut().zip(ch) {
            *a += (*v as f64) * (*v as f64);
        }
    }
    let mut s = acc.iter().sum::<f64>();
    for v in chunks.remainder() {
        s += (*v as f64) * (*v as f64);
    }
    s
}

/// A row rounded to the activation dtype, as f32.
#[inline(always)]
fn load_row<L: Writes>(src: Src, dtype: Dtype, out: &mut [f32]) {
    let d = out.len();
    let mut c = 0;
    while c + L::LANES <= d {
        // SAFETY: `c + N <= d` values in the row and in `out`.
        unsafe { L::store(out.as_mut_ptr().add(c), L::read(src, c, dtype)) };
        c += L::LANES;
    }
    for (i, o) in out.iter_mut().enumerate().skip(c) {
        *o = scalar_at(src, i, dtype);
    }
}

/// The channel-axis groups of a job (whole groups: blocks hold whole
/// groups, and flushes come in them), token by token, every head of a
/// token in turn: a pass for `lo`/`hi` per (head, channel), the parameters,
/// then a pass that encodes and packs each row. `scratch`: `2 x Hkv x D`.
#[inline(always)]
fn channel_groups<L: Writes>(
    plan: &Plan,
    q: &Quant,
    rows: &Rows,
    job: &mut Job,
    scratch: &mut [f32],
    codes: &mut [u8],
) -> bool {
    let tl = plan.tl;
    let (h, d) = (rows.heads, rows.d);
    let g = q.group as usize;
    let maxc = q.max_code() as f32;
    let wpt = tl.words_per_token;
    let padded = wpt * kivi_spec::layout::codes_per_word(q.bits);
    let (a, b) = scratch.split_at_mut(h * d);
    for j0 in (job.first..job.first + job.n).step_by(g) {
        let off0 = j0 % tl.block_tokens;
        for k in 0..g {
            for hh in 0..h {
                let src = rows.row(j0 + k, hh);
                let (lo, hi) = (&mut a[hh * d..(hh + 1) * d], &mut b[hh * d..(hh + 1) * d]);
                for c in (0..d).step_by(L::LANES) {
                    // SAFETY: the lane count divides `d` (`tensor_isa`).
                    unsafe {
                        let x = L::read(src, c, plan.dtype);
                        let (l, u) = if k == 0 {
                            (x, x)
                        } else {
                            (
                                L::min(L::load(lo.as_ptr().add(c)), x),
                                L::max(L::load(hi.as_ptr().add(c)), x),
                            )
                        };
                        L::store(lo.as_mut_ptr().add(c), l);
                        L::store(hi.as_mut_ptr().add(c), u);
                    }
                }
            }
        }
        for hh in 0..h {
            let (lo, hi) = (&mut a[hh * d..(hh + 1) * d], &mut b[hh * d..(hh + 1) * d]);
            // A zero at either end: the sign of that zero is the scalar
            // rule's (rare: redone lane by lane).
            for c in 0..d {
                if lo[c] == 0.0 || hi[c] == 0.0 {
                    (lo[c], hi[c]) = quant::group_lo_hi((0..g).map(|k| scalar_at(rows.row(j0 + k, hh), c, plan.dtype)));
                }
            }
            for c in (0..d).step_by(L::LANES) {
                // SAFETY: as above; `lo`/`hi` become scale/zero here.
                unsafe {
                    let l = L::load(lo.as_ptr().add(c));
                    let u = L::load(hi.as_ptr().add(c));
                    let s = L::round_scale(L::div(L::sub(u, l), L::splat(maxc)), q.scale);
                    let z = L::round_scale(l, q.scale);
                    if !L::all_finite(s) || !L::all_finite(z) {
                        return false;
                    }
                    L::store(lo.as_mut_ptr().add(c), s);
                    L::store(hi.as_mut_ptr().add(c), z);
                }
            }
            let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
            for c in 0..d {
                let i = tl.param_index(off0, c);
                write_param::<L>(&mut part[tl.scales_offset..], i, lo[c], q.scale);
                write_param::<L>(&mut part[tl.zeros_offset..], i, hi[c], q.scale);
            }
        }
        for k in 0..g {
            let off = off0 + k;
            for hh in 0..h {
                let src = rows.row(j0 + k, hh);
                let (s, z) = (&a[hh * d..(hh + 1) * d], &b[hh * d..(hh + 1) * d]);
                for c in (0..d).step_by(L::LANES) {
                    // SAFETY: as above.
                    unsafe {
                        let sv = L::load(s.as_ptr().add(c));
                        let zv = L::load(z.as_ptr().add(c));
                        L::encode(L::read(src, c, plan.dtype), zv, sv, maxc, codes.as_mut_ptr().add(c));
                    }
                }
                codes[d..padded].fill(0);
                let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
                pack_bytes(&codes[..padded], q.bits, &mut part[off * wpt..(off + 1) * wpt]);
            }
        }
    }
    true
}

/// Value `i` of a row, rounded to the activation dtype, by the scalar rule.
#[inline(always)]
fn scalar_at(src: Src, i: usize, dtype: Dtype) -> f32 {
    match src {
        Src::Input(x) => quant::round_to_dtype(x[i], dtype),
        Src::Bits(b) => quant::from_bits_16(b[i], dtype),
        Src::Stored(f) => f[i],
    }
}

/// `quant::round_to_scale` of one value.
#[inline(always)]
fn round_scale1<L: Writes>(x: f32, dtype: ScaleDtype) -> f32 {
    match dtype {
        // SAFETY: the caller runs under `L`'s instruction set.
        ScaleDtype::F16 => unsafe { L::f16_round(x) },
        ScaleDtype::F32 => x,
    }
}

/// Same as the cache's `write_param` (f16 halves share a word).
#[inline(always)]
fn write_param<L: Writes>(words: &mut [u32], i: usize, x: f32, dtype: ScaleDtype) {
    match dtype {
        ScaleDtype::F16 => {
            let shift = 16 * (i % 2);
            // SAFETY: the caller runs under `L`'s instruction set.
            let b = unsafe { L::f16_bits(x) } as u32;
            words[i / 2] = (words[i / 2] & !(0xffff << shift)) | (b << shift);
        }
        ScaleDtype::F32 => words[i] = x.to_bits(),
    }
}

/// A raw row (activation dtype) of a `full` tensor: two 16-bit values per
/// word, the lower half first, or one f32 per word. Returns whether every
/// value, rounded to `dtype`, is finite: the check of [`inputs_ok`] (the
/// same [`Writes::and_within`] on the same vectors), made on the values as
/// they are stored, so that the input is read once.
#[inline(always)]
fn store_row_words<L: Writes>(src: Src, dtype: Dtype, words: &mut [u32]) -> bool {
    let d = src.len();
    let mut finite = true;
    match dtype {
        Dtype::F32 => {
            for (i, w) in words.iter_mut().enumerate().take(d) {
                let x = scalar_at(src, i, dtype);
                finite &= x.is_finite();
                *w = x.to_bits();
            }
        }
        _ => {
            let mut c = 0;
            if cfg!(target_endian = "little") {
                // The words as 16-bit halves, in memory order (little
                // endian: element `2i` is the lower half of word `i`).
                let halves = words.as_mut_ptr() as *mut u16;
                // SAFETY: `c + N <= d` values in the row and `c + N`
                // halves in `words`.
                unsafe {
                    let mut ok = L::all_true();
                    while c + L::LANES <= d && c + L::LANES <= 2 * words.len() {
                        ok = L::and_within(ok, src, c, dtype, f32::MAX);
                        L::store16(load_for_store16::<L>(src, c, dtype), halves.add(c), dtype);
                        c += L::LANES;
                    }
                    finite = L::is_all_true(ok);
                }
            }
            while c < d {
                let x = scalar_at(src, c, dtype);
                // Already rounded: a NaN stays one, an overflow is infinite.
                finite &= x.is_finite();
                let b = quant::to_bits_16(x, dtype) as u32;
                let w = &mut words[c / 2];
                let shift = 16 * (c % 2);
                *w = (*w & !(0xffff << shift)) | (b << shift);
                c += 1;
            }
            if d % 2 == 1 {
                // The unused upper half of the last word is zero.
                words[d / 2] &= 0xffff;
            }
        }
    }
    finite
}

/// Zeroes the rows a job of a `full` tensor would write (tokens
/// `first..first + n` of every head's part): what a failed checked write
/// leaves in place of the rows it stored (see the module docs).
pub(crate) fn clear_rows(plan: &Plan, heads: usize, job: &mut Job) {
    let tl = plan.tl;
    let (bt, wpt) = (tl.block_tokens, tl.words_per_token);
    for hh in 0..heads {
        let part = &mut job.block[hh * plan.head_words + plan.offset..][..tl.words];
        for j in job.first..job.first + job.n {
            let off = j % bt;
            part[off * wpt..(off + 1) * wpt].fill(0);
        }
    }
}

/// Values `i..i + N` of `src` for [`Writes::store16`]: f16 stores round
/// f32 input themselves (rounding twice gives the same bits), so the input
/// goes in as it is; other dtypes are rounded first.
///
/// # Safety
/// As [`Writes::read`].
#[inline(always)]
unsafe fn load_for_store16<L: Writes>(src: Src, i: usize, dtype: Dtype) -> L::F {
    match (src, dtype) {
        (Src::Input(x), Dtype::F16) => L::load(x.as_ptr().add(i)),
        _ => L::read(src, i, dtype),
    }
}

/// Rounds `src` (f32) to a 16-bit activation dtype into `dst` (a window or
/// sink row), vectorised on `isa`.
pub(crate) fn round_into_bits(isa: Isa, src: &[f32], dst: &mut [u16], dtype: Dtype) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` came from `Isa::select`.
        Isa::Avx512 => unsafe { round_into_bits_avx512(src, dst, dtype) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { round_into_bits_avx2(src, dst, dtype) },
        _ => round_into_bits_body::<Scalar>(src, dst, dtype),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn round_into_bits_avx512(src: &[f32], dst: &mut [u16], dtype: Dtype) {
    round_into_bits_body::<Avx512>(src, dst, dtype)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_into_bits_avx2(src: &[f32], dst: &mut [u16], dtype: Dtype) {
    round_into_bits_body::<Avx2>(src, dst, dtype)
}

#[inline(always)]
fn round_into_bits_body<L: Writes>(src: &[f32], dst: &mut [u16], dtype: Dtype) {
    let n = src.len().min(dst.len());
    let mut c = 0;
    while c + L::LANES <= n {
        // SAFETY: `c + N <= n` on both sides.
        unsafe {
            L::store16(
                load_for_store16::<L>(Src::Input(src), c, dtype),
                dst.as_mut_ptr().add(c),
                dtype,
            )
        };
        c += L::LANES;
    }
    for i in c..n {
        dst[i] = quant::to_bits_16(src[i], dtype);
    }
}

/// Whether every value of `x`, rounded to `dtype`, is finite and (for
/// values at or after element `from`) at most `limit` in magnitude. The
/// exact error, when there is one, is the scalar path's to report.
pub(crate) fn inputs_ok(isa: Isa, x: &[f32], dtype: Dtype, from: usize, limit: f32) -> bool {
    let from = from.min(x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` came from `Isa::select`.
        Isa::Avx512 => unsafe { inputs_ok_avx512(x, dtype, from, limit) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { inputs_ok_avx2(x, dtype, from, limit) },
        _ => inputs_ok_body::<Scalar>(x, dtype, from, limit),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn inputs_ok_avx512(x: &[f32], dtype: Dtype, from: usize, limit: f32) -> bool {
    inputs_ok_body::<Avx512>(x, dtype, from, limit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn inputs_ok_avx2(x: &[f32], dtype: Dtype, from: usize, limit: f32) -> bool {
    inputs_ok_body::<Avx2>(x, dtype, from, limit)
}

#[inline(always)]
fn inputs_ok_body<L: Writes>(x: &[f32], dtype: Dtype, from: usize, limit: f32) -> bool {
    within::<L>(&x[..from], dtype, f32::MAX) && within::<L>(&x[from..], dtype, limit)
}

/// No closures here: a closure does not inherit its function's target
/// features, and the intrinsics would not be inlined into it.
#[inline(always)]
fn within<L: Writes>(x: &[f32], dtype: Dtype, limit: f32) -> bool {
    let mut c = 0;
    // SAFETY: `c + N <= len`.
    unsafe {
        let mut ok = L::all_true();
        while c + L::LANES <= x.len() {
            ok = L::and_within(ok, Src::Input(x), c, dtype, limit);
            c += L::LANES;
        }
        if !L::is_all_true(ok) {
            return false;
        }
    }
    for v in &x[c..] {
        if v.is_nan() || quant::round_to_dtype(*v, dtype).abs() > limit {
            return false;
        }
    }
    true
}

/// Packs one row of byte codes (each `< 2^bits`, `out.len() * 32 / bits`
/// of them, zero past the row) into words as `quant::pack` does: LSB
/// first, `32 / bits` codes per word.
pub(crate) fn pack_bytes(codes: &[u8], bits: u32, out: &mut [u32]) {
    let r8 = |i: usize| u64::from_le_bytes(codes[i..i + 8].try_into().expect("8 bytes"));
    match bits {
        8 => {
            for (w, c) in out.iter_mut().zip(codes.chunks_exact(4)) {
                *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        // Eight codes of a u64 (one a byte) gathered into the low bits by
        // doubling shifts: neighbours first, then pairs, then quads.
        4 => {
            for (i, w) in out.iter_mut().enumerate() {
                let mut x = r8(8 * i);
                x = (x | (x >> 4)) & 0x00ff_00ff_00ff_00ff;
                x = (x | (x >> 8)) & 0x0000_ffff_0000_ffff;
                *w = (x | (x >> 16)) as u32;
            }
        }
        2 => {
            let f = |mut x: u64| {
                x = (x | (x >> 6)) & 0x000f_000f_000f_000f;
                x = (x | (x >> 12)) & 0x0000_00ff_0000_00ff;
                ((x | (x >> 24)) & 0xffff) as u32
            };
            for (i, w) in out.iter_mut().enumerate() {
                *w = f(r8(16 * i)) | (f(r8(16 * i + 8)) << 16);
            }
        }
        1 => {
            let f = |mut x: u64| {
                x = (x | (x >> 7)) & 0x0003_0003_0003_0003;
                x = (x | (x >> 14)) & 0x0000_000f_0000_000f;
                ((x | (x >> 28)) & 0xff) as u32
            };
            for (i, w) in out.iter_mut().enumerate() {
                let b = 32 * i;
                *w = f(r8(b)) | (f(r8(b + 8)) << 8) | (f(r8(b + 16)) << 16) | (f(r8(b + 24)) << 24);
            }
        }
        _ => {
            let per = (32 / bits) as usize;
            for (w, chunk) in out.iter_mut().zip(codes.chunks(per)) {
                let mut word = 0u32;
                for (i, &c) in chunk.iter().enumerate() {
                    word |= (c as u32) << (i as u32 * bits);
                }
                *w = word;
            }
        }
    }
}

/// What a write needs beyond the width's [`Lanes`]: reading a row in its
/// dtype, rounding, coding, and the finiteness checks. Every method is
/// `unsafe`: the caller has the instruction set (the `#[target_feature]`
/// entry points above) and keeps pointers `LANES` elements inside their
/// slices.
trait Writes: Lanes {
    type M: Copy;
    /// Rounded to f16 (to nearest even, as `half`) and widened back.
    unsafe fn round_f16(x: Self::F) -> Self::F;
    /// Rounded to bf16 (to nearest even, finite values) and widened back.
    unsafe fn round_bf16(x: Self::F) -> Self::F;
    /// `LANES` f16 values to f32.
    unsafe fn widen_f16(p: *const u16) -> Self::F;
    /// `LANES` bf16 values to f32.
    unsafe fn widen_bf16(p: *const u16) -> Self::F;
    /// Values `i..i + LANES` of a row, rounded to `dtype` (for one lane,
    /// [`scalar_at`]).
    #[inline(always)]
    unsafe fn read(src: Src, i: usize, dtype: Dtype) -> Self::F {
        match src {
            Src::Input(x) => {
                let v = Self::load(x.as_ptr().add(i));
                match dtype {
                    Dtype::F16 => Self::round_f16(v),
                    Dtype::Bf16 => Self::round_bf16(v),
                    Dtype::F32 => v,
                }
            }
            Src::Bits(b) => match dtype {
                Dtype::Bf16 => Self::widen_bf16(b.as_ptr().add(i)),
                _ => Self::widen_f16(b.as_ptr().add(i)),
            },
            Src::Stored(f) => Self::load(f.as_ptr().add(i)),
        }
    }
    /// Rounded to the scale dtype (`quant::round_to_scale`).
    #[inline(always)]
    unsafe fn round_scale(x: Self::F, dtype: ScaleDtype) -> Self::F {
        match dtype {
            ScaleDtype::F16 => Self::round_f16(x),
            ScaleDtype::F32 => x,
        }
    }
    unsafe fn all_finite(x: Self::F) -> bool;
    /// One value rounded to f16 and widened back, and its f16 bits
    /// (`half`'s conversions, inline: a group's parameters are converted
    /// once or twice per group, and the library call was a quarter of a
    /// write's time).
    unsafe fn f16_round(x: f32) -> f32;
    unsafe fn f16_bits(x: f32) -> u16;
    /// `encode` of every lane, one code a byte at `out`.
    unsafe fn encode(x: Self::F, zero: Self::F, scale: Self::F, max_code: f32, out: *mut u8);
    /// Lloyd–Max codes of the `LANES` values at `x`, one a byte at `out`:
    /// the number of `thresholds` below `x / rms` (`0` when `rms == 0`).
    unsafe fn lloyd_codes(x: *const f32, rms: f32, thresholds: &[f32], out: *mut u8);
    /// Table codes of every lane, one a byte at `out`: the number of
    /// `thresholds` below `y`. `minmax` (`quant::minmax_group_in`): `y =
    /// (x - zero) / scale`, code 0 where `scale == 0`; otherwise
    /// (`quant::lloyd_group_in`, `zero` unused): `y = x / scale`, `y = 0`
    /// where `scale == 0`.
    unsafe fn table_codes(x: Self::F, zero: Self::F, scale: Self::F, minmax: bool, thresholds: &[f32], out: *mut u8);
    /// Bit `i` set where the magnitude of value `i` at `x` (its bits, sign
    /// cleared, as an integer) is above `bar`.
    unsafe fn above(x: *const f32, bar: u32) -> u32;
    /// 16-bit storage of values already representable in `dtype`.
    unsafe fn store16(x: Self::F, out: *mut u16, dtype: Dtype);
    unsafe fn all_true() -> Self::M;
    /// `ok` and, lane by lane, values `i..i + LANES` of `src` rounded to
    /// `dtype` are not NaN and at most `limit` in magnitude.
    unsafe fn and_within(ok: Self::M, src: Src, i: usize, dtype: Dtype, limit: f32) -> Self::M;
    unsafe fn is_all_true(ok: Self::M) -> bool;
}

/// One lane: `quant.rs` itself.
impl Writes for Scalar {
    type M = bool;
    #[inline(always)]
    unsafe fn round_f16(x: f32) -> f32 {
        half::f16::from_f32(x).to_f32()
    }
    #[inline(always)]
    unsafe fn round_bf16(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> f32 {
        half::f16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> f32 {
        half::bf16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    unsafe fn all_finite(x: f32) -> bool {
        x.is_finite()
    }
    #[inline(always)]
    unsafe fn f16_round(x: f32) -> f32 {
        half::f16::from_f32(x).to_f32()
    }
    #[inline(always)]
    unsafe fn f16_bits(x: f32) -> u16 {
        half::f16::from_f32(x).to_bits()
    }
    #[inline(always)]
    unsafe fn encode(x: f32, zero: f32, scale: f32, max_code: f32, out: *mut u8) {
        let p = quant::GroupParams { scale, zero };
        *out = quant::encode(x, p, max_code as u32) as u8;
    }
    #[inline(always)]
    unsafe fn lloyd_codes(x: *const f32, rms: f32, thresholds: &[f32], out: *mut u8) {
        let y = if rms == 0.0 { 0.0 } else { *x / rms };
        *out = thresholds.iter().filter(|t| y > **t).count() as u8;
    }
    #[inline(always)]
    unsafe fn table_codes(x: f32, zero: f32, scale: f32, minmax: bool, thresholds: &[f32], out: *mut u8) {
        let y = if minmax {
            (x - zero) / scale
        } else if scale == 0.0 {
            0.0
        } else {
            x / scale
        };
        *out = if minmax && scale == 0.0 {
            0
        } else {
            thresholds.iter().filter(|t| y > **t).count() as u8
        };
    }
    #[inline(always)]
    unsafe fn above(x: *const f32, bar: u32) -> u32 {
        ((*x).to_bits() & 0x7fff_ffff > bar) as u32
    }
    #[inline(always)]
    unsafe fn store16(x: f32, out: *mut u16, dtype: Dtype) {
        *out = quant::to_bits_16(x, dtype);
    }
    #[inline(always)]
    unsafe fn all_true() -> bool {
        true
    }
    #[inline(always)]
    unsafe fn and_within(ok: bool, src: Src, i: usize, dtype: Dtype, limit: f32) -> bool {
        let raw = match src {
            Src::Input(x) => x[i],
            _ => 0.0,
        };
        ok && !raw.is_nan() && scalar_at(src, i, dtype).abs() <= limit
    }
    #[inline(always)]
    unsafe fn is_all_true(ok: bool) -> bool {
        ok
    }
}

/// Round to nearest even, no exceptions (the `round_ties_even` of `encode`).
#[cfg(target_arch = "x86_64")]
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
/// The f16 conversions' rounding: to nearest even (as `half`).
#[cfg(target_arch = "x86_64")]
const HALF: i32 = _MM_FROUND_TO_NEAREST_INT;

/// One value rounded to f16 and back (F16C on one lane).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_round_x86(x: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<HALF>(_mm_set_ss(x))))
}

/// The f16 bits of one value (F16C on one lane).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_bits_x86(x: f32) -> u16 {
    _mm_extract_epi16::<0>(_mm_cvtps_ph::<HALF>(_mm_set_ss(x))) as u16
}

#[cfg(target_arch = "x86_64")]
impl Writes for Avx512 {
    type M = u16;
    #[inline(always)]
    unsafe fn round_f16(x: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<HALF>(x))
    }
    /// bf16 round-to-nearest-even of finite values (the integer form of
    /// `half::bf16::from_f32`), the result widened back to f32.
    #[inline(always)]
    unsafe fn round_bf16(x: __m512) -> __m512 {
        let b = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
        _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000u32 as i32)))
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
            p as *const __m256i,
        ))))
    }
    #[inline(always)]
    unsafe fn f16_round(x: f32) -> f32 {
        f16_round_x86(x)
    }
    #[inline(always)]
    unsafe fn f16_bits(x: f32) -> u16 {
        f16_bits_x86(x)
    }
    #[inline(always)]
    unsafe fn all_finite(x: __m512) -> bool {
        let a = _mm512_abs_ps(x);
        _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(f32::INFINITY)) == 0xffff
    }
    #[inline(always)]
    unsafe fn encode(x: __m512, zero: __m512, scale: __m512, max_code: f32, out: *mut u8) {
        let q = _mm512_div_ps(_mm512_sub_ps(x, zero), scale);
        let r = _mm512_roundscale_ps::<RNE>(q);
        let r = _mm512_min_ps(_mm512_max_ps(r, _mm512_setzero_ps()), _mm512_set1_ps(max_code));
        let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(scale, _mm512_setzero_ps());
        let c = _mm512_maskz_mov_epi32(nz, _mm512_cvttps_epi32(r));
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(c));
    }
    #[inline(always)]
    unsafe fn lloyd_codes(x: *const f32, rms: f32, thresholds: &[f32], out: *mut u8) {
        // `y = 0` when `rms == 0`: then no threshold below 0 counts for
        // the lane, as in the scalar rule (the thresholds are symmetric,
        // but nothing here relies on it).
        let y = if rms == 0.0 {
            _mm512_setzero_ps()
        } else {
            _mm512_div_ps(_mm512_loadu_ps(x), _mm512_set1_ps(rms))
        };
        let mut c = _mm512_setzero_si512();
        for t in thresholds {
            let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, _mm512_set1_ps(*t));
            c = _mm512_mask_sub_epi32(c, m, c, _mm512_set1_epi32(-1));
        }
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(c));
    }
    #[inline(always)]
    unsafe fn table_codes(x: __m512, zero: __m512, scale: __m512, minmax: bool, thresholds: &[f32], out: *mut u8) {
        let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(scale, _mm512_setzero_ps());
        let y = if minmax {
            _mm512_div_ps(_mm512_sub_ps(x, zero), scale)
        } else {
            _mm512_maskz_mov_ps(nz, _mm512_div_ps(x, scale))
        };
        let mut c = _mm512_setzero_si512();
        for t in thresholds {
            let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, _mm512_set1_ps(*t));
            c = _mm512_mask_sub_epi32(c, m, c, _mm512_set1_epi32(-1));
        }
        if minmax {
            c = _mm512_maskz_mov_epi32(nz, c);
        }
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(c));
    }
    #[inline(always)]
    unsafe fn above(x: *const f32, bar: u32) -> u32 {
        let a = _mm512_and_si512(_mm512_loadu_si512(x as *const _), _mm512_set1_epi32(0x7fff_ffff));
        _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(bar as i32)) as u32
    }
    #[inline(always)]
    unsafe fn store16(x: __m512, out: *mut u16, dtype: Dtype) {
        let h = match dtype {
            // `x` is a bf16 value: its upper halves are its bits.
            Dtype::Bf16 => _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(_mm512_castps_si512(x))),
            _ => _mm512_cvtps_ph::<HALF>(x),
        };
        _mm256_storeu_si256(out as *mut __m256i, h)
    }
    #[inline(always)]
    unsafe fn all_true() -> u16 {
        0xffff
    }
    #[inline(always)]
    unsafe fn and_within(ok: u16, src: Src, i: usize, dtype: Dtype, limit: f32) -> u16 {
        let raw = match src {
            Src::Input(x) => _mm512_loadu_ps(x.as_ptr().add(i)),
            _ => _mm512_setzero_ps(),
        };
        let a = _mm512_abs_ps(Self::read(src, i, dtype));
        let within = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, _mm512_set1_ps(limit));
        ok & within & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(raw, raw)
    }
    #[inline(always)]
    unsafe fn is_all_true(ok: u16) -> bool {
        ok == 0xffff
    }
}

#[cfg(target_arch = "x86_64")]
impl Writes for Avx2 {
    type M = __m256;
    #[inline(always)]
    unsafe fn round_f16(x: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<HALF>(x))
    }
    #[inline(always)]
    unsafe fn round_bf16(x: __m256) -> __m256 {
        let b = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
        _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(0xffff_0000u32 as i32)))
    }
    #[inline(always)]
    unsafe fn widen_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
            p as *const __m128i,
        ))))
    }
    #[inline(always)]
    unsafe fn f16_round(x: f32) -> f32 {
        f16_round_x86(x)
    }
    #[inline(always)]
    unsafe fn f16_bits(x: f32) -> u16 {
        f16_bits_x86(x)
    }
    #[inline(always)]
    unsafe fn all_finite(x: __m256) -> bool {
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
        _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(f32::INFINITY))) == 0xff
    }
    #[inline(always)]
    unsafe fn encode(x: __m256, zero: __m256, scale: __m256, max_code: f32, out: *mut u8) {
        let q = _mm256_div_ps(_mm256_sub_ps(x, zero), scale);
        let r = _mm256_round_ps::<RNE>(q);
        let r = _mm256_min_ps(_mm256_max_ps(r, _mm256_setzero_ps()), _mm256_set1_ps(max_code));
        let nz = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_NEQ_UQ>(scale, _mm256_setzero_ps()));
        let c = _mm256_and_si256(nz, _mm256_cvttps_epi32(r));
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        _mm_storel_epi64(out as *mut __m128i, _mm_packus_epi16(w, w));
    }
    #[inline(always)]
    unsafe fn lloyd_codes(x: *const f32, rms: f32, thresholds: &[f32], out: *mut u8) {
        let y = if rms == 0.0 {
            _mm256_setzero_ps()
        } else {
            _mm256_div_ps(_mm256_loadu_ps(x), _mm256_set1_ps(rms))
        };
        let mut c = _mm256_setzero_si256();
        for t in thresholds {
            // All ones (-1) where `y > t`: subtracting it counts.
            let m = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_set1_ps(*t)));
            c = _mm256_sub_epi32(c, m);
        }
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        _mm_storel_epi64(out as *mut __m128i, _mm_packus_epi16(w, w));
    }
    #[inline(always)]
    unsafe fn table_codes(x: __m256, zero: __m256, scale: __m256, minmax: bool, thresholds: &[f32], out: *mut u8) {
        // All ones where `scale != 0`.
        let nz = _mm256_cmp_ps::<_CMP_NEQ_UQ>(scale, _mm256_setzero_ps());
        let y = if minmax {
            _mm256_div_ps(_mm256_sub_ps(x, zero), scale)
        } else {
            _mm256_and_ps(nz, _mm256_div_ps(x, scale))
        };
        let mut c = _mm256_setzero_si256();
        for t in thresholds {
            let m = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_set1_ps(*t)));
            c = _mm256_sub_epi32(c, m);
        }
        if minmax {
            c = _mm256_and_si256(c, _mm256_castps_si256(nz));
        }
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        _mm_storel_epi64(out as *mut __m128i, _mm_packus_epi16(w, w));
    }
    #[inline(always)]
    unsafe fn above(x: *const f32, bar: u32) -> u32 {
        // Magnitudes and the bar are below 2^31: a signed compare is the
        // unsigned one.
        let a = _mm256_and_si256(_mm256_loadu_si256(x as *const __m256i), _mm256_set1_epi32(0x7fff_ffff));
        let m = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(bar as i32));
        _mm256_movemask_ps(_mm256_castsi256_ps(m)) as u32
    }
    #[inline(always)]
    unsafe fn store16(x: __m256, out: *mut u16, dtype: Dtype) {
        let h = match dtype {
            Dtype::Bf16 => {
                let s = _mm256_srli_epi32::<16>(_mm256_castps_si256(x));
                _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
            }
            _ => _mm256_cvtps_ph::<HALF>(x),
        };
        _mm_storeu_si128(out as *mut __m128i, h)
    }
    #[inline(always)]
    unsafe fn all_true() -> __m256 {
        _mm256_castsi256_ps(_mm256_set1_epi32(-1))
    }
    #[inline(always)]
    unsafe fn and_within(ok: __m256, src: Src, i: usize, dtype: Dtype, limit: f32) -> __m256 {
        let raw = match src {
            Src::Input(x) => _mm256_loadu_ps(x.as_ptr().add(i)),
            _ => _mm256_setzero_ps(),
        };
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), Self::read(src, i, dtype));
        let within = _mm256_cmp_ps::<_CMP_LE_OQ>(a, _mm256_set1_ps(limit));
        _mm256_and_ps(ok, _mm256_and_ps(within, _mm256_cmp_ps::<_CMP_ORD_Q>(raw, raw)))
    }
    #[inline(always)]
    unsafe fn is_all_true(ok: __m256) -> bool {
        _mm256_movemask_ps(ok) == 0xff
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kivi_spec::{Axis, Levels};

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2_ok() {
                v.push(Isa::Avx2);
            }
            if avx2_ok() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    fn lm(q: &Quant) -> &'static [f32] {
        kivi_spec::lloyd_max_levels(q.bits).unwrap()
    }
    fn lloyd_on(isa: Isa, q: &Quant, x: &[f32], codes: &mut [u8]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isas` found the features.
            Isa::Avx512 => unsafe { lloyd_avx512(q, x, codes) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { lloyd_avx2(q, x, codes) },
            _ => lloyd_group::<Scalar>(q, lm(q), x, codes),
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn lloyd_avx512(q: &Quant, x: &[f32], codes: &mut [u8]) -> f32 {
        lloyd_group::<Avx512>(q, lm(q), x, codes)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lloyd_avx2(q: &Quant, x: &[f32], codes: &mut [u8]) -> f32 {
        lloyd_group::<Avx2>(q, lm(q), x, codes)
    }

    /// Groups whose stored norm sits exactly on a rounding boundary (the
    /// fast sums' interval straddles it, so the oracle's chains decide),
    /// and random ones of every scale: the same norm and codes as
    /// `quant::lloyd_group`, on every instruction set.
    #[test]
    fn lloyd_group_is_the_oracles() {
        let mut seed = 0x1d_2024u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        let mut cases = 0;
        for bits in 1..=4u32 {
            for norm in [Norm::Rms, Norm::L2] {
                for scale in [ScaleDtype::F16, ScaleDtype::F32] {
                    for g in [16usize, 32, 48, 256] {
                        let q = Quant {
                            bits,
                            axis: Axis::Token,
                            group: g as u32,
                            scale,
                            levels: Levels::LloydMax(norm),
                        };
                        for case in 0..40 {
                            let x: Vec<f32> = (0..g)
                                .map(|i| match case % 4 {
                                    // all equal to an f16 midpoint: rms is exactly a tie
                                    0 => (1.0 + 1.0 / 2048.0) * if i % 2 == 0 { 1.0 } else { -1.0 },
                                    1 => 0.0,
                                    // sqrt(ss / g) a hair above the f32 midpoint 1 + 2^-24:
                                    // the fast sums cannot tell which way it rounds
                                    2 if i == 0 => 1.0 + g as f32 / (1u32 << 24) as f32,
                                    2 => 1.0,
                                    _ => {
                                        let m = (next() >> 9) as f32 / (1u32 << 23) as f32 - 0.5;
                                        m * [1e-3f32, 1.0, 37.0][case % 3]
                                    }
                                })
                                .collect();
                            let mut want = vec![0u32; g];
                            let s = quant::lloyd_group(&x, &q, &mut want);
                            for isa in isas() {
                                let mut got = vec![0u8; g];
                                let t = lloyd_on(isa, &q, &x, &mut got);
                                assert_eq!(t.to_bits(), s.to_bits(), "{bits} {norm:?} g{g} case {case} {isa:?}");
                                assert!(got.iter().zip(&want).all(|(a, b)| *a as u32 == *b));
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases >= 1280);
    }

    /// The vector-prefiltered outlier selection against the scalar one:
    /// ties, zeros of both signs, rising and falling magnitudes.
    #[test]
    fn outliers_are_the_oracles() {
        let mut seed = 0x0071_1e50u32;
        for k in [1usize, 2, 4, 16] {
            let codec = TensorCodec {
                quant: Quant::uniform(2, Axis::Token, 16, ScaleDtype::F16),
                dtype: Dtype::F16,
                rotation: None,
                outliers: k,
                center: None,
                levels: Vec::new(),
            };
            for n in [k, 17, 40, 64, 256] {
                for case in 0..6 {
                    let row: Vec<f32> = (0..n)
                        .map(|i| {
                            seed ^= seed << 13;
                            seed ^= seed >> 17;
                            seed ^= seed << 5;
                            match case {
                                0 => [0.0, -0.0, 1.0, -1.0, 2.5, -2.5][(seed % 6) as usize],
                                1 => i as f32,
                                2 => -(n as f32) + i as f32,
                                _ => (seed >> 8) as f32 / 65536.0 - 128.0,
                            }
                        })
                        .collect();
                    let (mut wi, mut wv) = ([0usize; 16], [0f32; 16]);
                    let mut want_row = row.clone();
                    let nw = codec.take_outliers_small(&mut want_row, &mut wi, &mut wv);
                    for isa in isas() {
                        let (mut gi, mut gv) = ([0usize; 16], [0f32; 16]);
                        let mut got_row = row.clone();
                        let ng = match isa {
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: `isas` found the features.
                            Isa::Avx512 => unsafe { outl_avx512(&codec, &mut got_row, &mut gi, &mut gv) },
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: as above.
                            Isa::Avx2 => unsafe { outl_avx2(&codec, &mut got_row, &mut gi, &mut gv) },
                            _ => take_outliers::<Scalar>(&codec, &mut got_row, &mut gi, &mut gv),
                        };
                        let what = format!("k{k} n{n} case {case} {isa:?}");
                        assert_eq!((ng, &gi[..ng]), (nw, &wi[..nw]), "{what}");
                        assert!(gv[..ng].iter().zip(&wv[..nw]).all(|(a, b)| a.to_bits() == b.to_bits()));
                        assert!(got_row.iter().zip(&want_row).all(|(a, b)| a.to_bits() == b.to_bits()));
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn outl_avx512(c: &TensorCodec, r: &mut [f32], i: &mut [usize; 16], v: &mut [f32; 16]) -> usize {
        take_outliers::<Avx512>(c, r, i, v)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn outl_avx2(c: &TensorCodec, r: &mut [f32], i: &mut [usize; 16], v: &mut [f32; 16]) -> usize {
        take_outliers::<Avx2>(c, r, i, v)
    }

    #[test]
    fn pack_bytes_is_quant_pack() {
        let mut seed = 0x1234_5678u32;
        for bits in kivi_spec::ALLOWED_BITS {
            let per = (32 / bits) as usize;
            for n in [1usize, 7, 16, 31, 33, 64, 100, 128, 257] {
                let words = n.div_ceil(per);
                let mut codes = vec![0u8; words * per];
                for c in codes.iter_mut().take(n) {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    *c = (seed & ((1 << bits) - 1)) as u8;
                }
                let wide: Vec<u32> = codes[..n].iter().map(|c| *c as u32).collect();
                let mut want = vec![0u32; words];
                quant::pack(&wide, bits, &mut want);
                let mut got = vec![0xdead_beef; words];
                pack_bytes(&codes, bits, &mut got);
                assert_eq!(got, want, "bits {bits}, n {n}");
            }
        }
    }
}
