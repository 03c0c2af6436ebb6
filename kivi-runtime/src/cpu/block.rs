//! Many-query attention on the CPU: a causal block of new tokens per
//! sequence (chunked prefill, speculative verification), with the meaning
//! of docs/semantics.md, "Many new queries": query `i` of a block sees what
//! appending tokens up to its own and decoding would show it.
//!
//! The block is appended first (one `extend`, so the cache is the one
//! streaming builds), keeping the full-precision rows that a query may
//! still see but the append quantizes: the window rows before the block and
//! the block's own rows, rounded to the activation dtype (the *tail*).
//! Query `i` then reads, per tensor, the cache's stored tokens (sinks,
//! quantized) below `QueryView::stored` and the tail from there to its own
//! token; stored tokens never change, so the cache after the block holds
//! exactly what it saw.
//!
//! Work is cut into units of (block, KV head, chunk of queries). A unit's
//! *common* range — tokens every query of the chunk sees, and sees stored
//! in both tensors: from the last query's window start to the first
//! query's stored boundary — is the long part of a long context. It runs
//! through the decode kernel ([`kernel::split_attention`]) with the
//! chunk's query heads as one wide GQA group, so each tile of codes is read
//! and decoded once for every query of the chunk (and the AVX-512 fused
//! path applies where it does for decode). The *rest* — the recent tokens,
//! whose form depends on the query, and the first tokens of a sliding
//! window, which only some queries see — is short: its stored rows are
//! dequantized once per unit and every query scores its own range of them
//! and of the tail. The partial softmaxes merge by log-sum-exp.

use super::kernel::{self, Plan};
use super::rope::RopeKeys;
use super::simd::{self, F32Rows, Isa};
use super::{auto_splits, CpuBackend, Partial};
use crate::backend::{check_blocks, check_window, undo, NewTokens};
use crate::cache::{PagedCache, SeqId, SeqView};
use crate::error::{Error, Result};
use crate::quant::round_to_dtype;
use crate::reference::{stored_tokens, AttnParams, QueryView};
use kivi_spec::{Scheme, Tensor};
use rayon::prelude::*;

/// Query heads per unit: enough to spread a tile's decoding over many
/// queries, few enough that a unit's accumulators (`heads x D` floats)
/// stay in L2 and that a block of a few hundred tokens makes several units.
const UNIT_HEADS: usize = 64;

/// Full-precision rows of one tensor: tokens `first..`, `[token][Hkv][D]`.
struct Tail {
    first: usize,
    rows: Vec<f32>,
}

impl Tail {
    /// KV head `h`'s rows from token `p` on (none when `p` is before the
    /// tail: the caller then reads zero rows).
    fn rows_from(&self, p: usize, h: usize, hkv: usize, d: usize) -> F32Rows<'_> {
        F32Rows {
            data: &self.rows,
            base: ((p.max(self.first) - self.first) * hkv + h) * d,
            stride: hkv * d,
        }
    }
}

/// One appended block.
struct Job {
    seq: SeqId,
    /// Tokens before the block.
    past: usize,
    n: usize,
    /// First output row of the block.
    row0: usize,
    /// Queries rounded to the activation dtype, times the softmax scale.
    q: Vec<f32>,
    /// Key, value.
    tails: [Tail; 2],
}

/// Queries `i0..i1` of a job against KV head `h`.
struct Unit {
    job: usize,
    h: usize,
    i0: usize,
    i1: usize,
    /// The chunk's queries for KV head `h`, `[(i - i0) * group + g][D]`.
    q: Vec<f32>,
    /// Tokens every query of the unit sees, stored in both tensors (empty
    /// when `common.0 >= common.1`).
    common: (usize, usize),
}

/// A unit's share of work.
#[derive(Clone, Copy)]
enum Task {
    /// Split `s` of `splits` of the common range.
    Common { unit: usize, s: usize, splits: usize },
    /// Everything outside the common range.
    Rest { unit: usize },
}

/// Queries per unit: about [`UNIT_HEADS`] heads, in a number that makes the
/// wide group a multiple of four heads where the GQA group allows (the
/// fused AVX-512 path takes only such groups).
fn chunk_queries(group: usize) -> usize {
    let unit = 4 / gcd(group, 4);
    ((UNIT_HEADS / group) / unit * unit).max(unit)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl CpuBackend {
    /// [`crate::Backend::attend_block`] on the CPU (the thread pool is
    /// chosen by the caller).
    pub(crate) fn run_block(&self, cache: &mut PagedCache, blocks: &[NewTokens], attn: AttnParams) -> Result<Vec<f32>> {
        let ns = check_blocks(cache, blocks)?;
        check_window(cache, blocks.iter().map(|b| b.seq), attn)?;
        let scheme = cache.scheme().clone();
        let shape = cache.shape();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        // Append block by block, keeping what the appends quantize away.
        let mut jobs: Vec<Job> = Vec::with_capacity(blocks.len());
        let mut checkpoints = Vec::new();
        let mut row0 = 0;
        for (b, blk) in blocks.iter().enumerate() {
            // The last block needs no checkpoint: its own append is atomic
            // and nothing after it can fail.
            let checkpointed = if b + 1 < blocks.len() {
                cache.checkpoint(blk.seq).map(|cp| checkpoints.push(cp))
            } else {
                Ok(())
            };
            let step = checkpointed.and_then(|()| append_keeping_tail(cache, &scheme, blk));
            match step {
                Ok((past, tails)) => {
                    let q = blk
                        .q
                        .iter()
                        .map(|&x| round_to_dtype(x, scheme.dtype) * attn.softmax_scale)
                        .collect();
                    jobs.push(Job {
                        seq: blk.seq,
                        past,
                        n: ns[b],
                        row0,
                        q,
                        tails,
                    });
                    row0 += ns[b];
                }
                Err(e) => {
                    undo(cache, checkpoints);
                    return Err(Error::InSequence {
                        seq: b,
                        source: Box::new(e),
                    });
                }
            }
        }
        let cache = &*cache;
        let mut views = Vec::with_capacity(jobs.len());
        for j in &jobs {
            // Every sequence was just appended to: this cannot fail.
            views.push(cache.view(j.seq)?);
        }
        let mut out = vec![0f32; row0 * hq * d];
        let group = shape.group_size();
        let chunk = chunk_queries(group);
        let mut units = Vec::new();
        for (ji, j) in jobs.iter().enumerate() {
            for h in 0..hkv {
                for i0 in (0..j.n).step_by(chunk) {
                    let i1 = (i0 + chunk).min(j.n);
                    let first = QueryView::at(&scheme, attn, j.past + i0 + 1);
                    let last = QueryView::at(&scheme, attn, j.past + i1);
                    let mut q = Vec::with_capacity((i1 - i0) * group * d);
                    for i in i0..i1 {
                        q.extend_from_slice(&j.q[(i * hq + h * group) * d..][..group * d]);
                    }
                    units.push(Unit {
                        job: ji,
                        h,
                        i0,
                        i1,
                        q,
                        common: (last.start, first.stored[0].min(first.stored[1])),
                    });
                }
            }
        }
        let longest = units
            .iter()
            .map(|u| u.common.1.saturating_sub(u.common.0))
            .max()
            .unwrap_or(0);
        let splits = match self.params.splits {
            0 => auto_splits(units.len(), longest, rayon::current_num_threads()),
            s => s,
        };
        let mut tasks = Vec::new();
        let mut first_task = Vec::with_capacity(units.len() + 1);
        for (ui, u) in units.iter().enumerate() {
            first_task.push(tasks.len());
            if u.common.0 < u.common.1 {
                tasks.extend((0..splits).map(|s| Task::Common { unit: ui, s, splits }));
            }
            tasks.push(Task::Rest { unit: ui });
        }
        first_task.push(tasks.len());
        let isa = self.params.isa(d);
        let tile = self.params.tile_tokens;
        let ctx = Ctx {
            scheme: &scheme,
            attn,
            isa,
            group,
            hkv,
            d,
            rope: RopeKeys::of(&scheme, d, tile),
        };
        let partials: Vec<Partial> = tasks
            .par_iter()
            .map(|&task| match task {
                Task::Common { unit, s, splits } => {
                    let u = &units[unit];
                    let (a, z) = u.common;
                    let plan = Plan::for_heads(cache, isa, tile, (u.i1 - u.i0) * group);
                    let (sa, sz) = (a + (z - a) * s / splits, a + (z - a) * (s + 1) / splits);
                    kernel::split_attention(&plan, &views[u.job], u.h, &u.q, sa, sz)
                }
                Task::Rest { unit } => {
                    let u = &units[unit];
                    rest(&ctx, &views[u.job], &jobs[u.job], u)
                }
            })
            .collect();
        // Merge each head's partial softmaxes.
        for (ui, u) in units.iter().enumerate() {
            let parts = &partials[first_task[ui]..first_task[ui + 1]];
            let j = &jobs[u.job];
            for i in u.i0..u.i1 {
                for g in 0..group {
                    let x = (i - u.i0) * group + g;
                    let m = parts.iter().map(|p| p.m[x]).fold(f32::NEG_INFINITY, f32::max);
                    if m == f32::NEG_INFINITY {
                        continue; // an empty window attends to nothing: zero
                    }
                    let o = &mut out[((j.row0 + i) * hq + u.h * group + g) * d..][..d];
                    let mut l = 0f32;
                    for p in parts.iter().filter(|p| p.m[x] != f32::NEG_INFINITY) {
                        let w = (p.m[x] - m).exp();
                        l += w * p.l[x];
                        for (y, a) in o.iter_mut().zip(&p.acc[x * d..(x + 1) * d]) {
                            *y += w * a;
                        }
                    }
                    for y in o.iter_mut() {
                        *y /= l;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Appends one block; returns the sequence's length before it and the
/// tail of each tensor: the rows from the stored boundary before the block
/// on, at full precision — the window rows as the cache held them, then the
/// block's inputs rounded to the activation dtype.
fn append_keeping_tail(cache: &mut PagedCache, scheme: &Scheme, blk: &NewTokens) -> Result<(usize, [Tail; 2])> {
    let shape = cache.shape();
    let (hkv, d) = (shape.kv_heads, shape.head_dim);
    let row = hkv * d;
    let n = blk.k.len() / row;
    let view = cache.view(blk.seq)?;
    let past = view.tokens();
    let mut tails = [Tensor::Key, Tensor::Value].map(|t| {
        let first = stored_tokens(scheme, t, past).min(past);
        let mut rows = vec![0f32; (past - first + n) * row];
        for p in first..past {
            for hh in 0..hkv {
                view.row(t, p, hh, &mut rows[((p - first) * hkv + hh) * d..][..d]);
            }
        }
        Tail { first, rows }
    });
    // Eviction waits until every query of the batch is answered.
    cache.extend_held(blk.seq, blk.k, blk.v)?;
    // The append accepted these, so they round to finite values.
    for (tail, x) in tails.iter_mut().zip([blk.k, blk.v]) {
        let at = (past - tail.first) * row;
        for (r, &x) in tail.rows[at..].iter_mut().zip(x) {
            *r = round_to_dtype(x, scheme.dtype);
        }
    }
    // Pre-RoPE keys: the tail is only ever scored, so it is turned to its
    // positions once here.
    if let Some(rk) = RopeKeys::of(scheme, d, 64) {
        rk.rotate_rows(&mut tails[0].rows, tails[0].first, hkv);
    }
    Ok((past, tails))
}

/// What every rest task shares.
struct Ctx<'a> {
    scheme: &'a Scheme,
    attn: AttnParams,
    isa: Isa,
    group: usize,
    hkv: usize,
    d: usize,
    /// Pre-RoPE keys: stored key rows are turned to their positions as
    /// they are read (the tails were turned when they were made).
    rope: Option<RopeKeys>,
}

/// The unit's queries over their tokens outside the common range: per
/// query, scores against stored rows below its stored boundary and tail
/// rows above it, then one online-softmax step per range.
fn rest(cx: &Ctx, view: &SeqView, job: &Job, u: &Unit) -> Partial {
    let (g, d, hkv) = (cx.group, cx.d, cx.hkv);
    let heads = (u.i1 - u.i0) * g;
    let mut m = vec![f32::NEG_INFINITY; heads];
    let mut l = vec![0f32; heads];
    let mut acc = vec![0f32; heads * d];
    let at = |i: usize| QueryView::at(cx.scheme, cx.attn, job.past + i + 1);
    let (start, end) = (at(u.i0).start, job.past + u.i1);
    let last = at(u.i1 - 1);
    let ranges = if u.common.0 < u.common.1 {
        [(start, u.common.0), (u.common.1, end)]
    } else {
        [(start, end), (end, end)]
    };
    let mut scores = Vec::new();
    let mut stored = [Vec::new(), Vec::new()];
    for (ra, rz) in ranges {
        if ra >= rz {
            continue;
        }
        // The stored rows some query of the unit reads here, decoded once.
        for ((t, top), rows) in [Tensor::Key, Tensor::Value]
            .into_iter()
            .zip(last.stored)
            .zip(&mut stored)
        {
            let top = top.clamp(ra, rz);
            rows.resize((top - ra) * d, 0.0);
            for p in ra..top {
                view.row(t, p, u.h, &mut rows[(p - ra) * d..][..d]);
            }
            if let (Some(rk), Tensor::Key) = (&cx.rope, t) {
                rk.rotate_rows(rows, ra, 1);
            }
        }
        for i in u.i0..u.i1 {
            let qv = at(i);
            let (qa, qz) = (ra.max(qv.start), rz.min(qv.end));
            if qa >= qz {
                continue;
            }
            let x0 = (i - u.i0) * g;
            let q = &u.q[x0 * d..(x0 + g) * d];
            let [bk, bv] = qv.stored.map(|b| b.clamp(qa, qz));
            let s = {
                scores.resize((qz - qa) * g, 0.0);
                &mut scores[..]
            };
            let [ktail, vtail] = &job.tails;
            let stored_rows = |t: usize, p: usize| F32Rows {
                data: &stored[t],
                base: (p - ra) * d,
                stride: d,
            };
            simd::dot(cx.isa, &stored_rows(0, qa), bk - qa, d, q, g, s, g);
            let kt = ktail.rows_from(bk, u.h, hkv, d);
            simd::dot(cx.isa, &kt, qz - bk, d, q, g, &mut s[(bk - qa) * g..], g);
            // One online-softmax step for the query's heads.
            for hh in 0..g {
                let tmax = s.iter().skip(hh).step_by(g).fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let x = x0 + hh;
                let new_m = m[x].max(tmax);
                if m[x] != f32::NEG_INFINITY && m[x] != new_m {
                    let corr = (m[x] - new_m).exp();
                    l[x] *= corr;
                    for a in &mut acc[x * d..(x + 1) * d] {
                        *a *= corr;
                    }
                }
                m[x] = new_m;
            }
            for row in s.chunks_exact_mut(g) {
                for (y, mm) in row.iter_mut().zip(&m[x0..x0 + g]) {
                    *y -= mm;
                }
            }
            simd::exp_le0(cx.isa, s);
            for row in s.chunks_exact(g) {
                for (li, p) in l[x0..x0 + g].iter_mut().zip(row) {
                    *li += p;
                }
            }
            let a = &mut acc[x0 * d..(x0 + g) * d];
            simd::axpy(cx.isa, &stored_rows(1, qa), bv - qa, d, s, g, g, a);
            let vt = vtail.rows_from(bv, u.h, hkv, d);
            simd::axpy(cx.isa, &vt, qz - bv, d, &s[(bv - qa) * g..], g, g, a);
        }
    }
    Partial { m, l, acc }
}
