//! The backend interface: decode attention over a paged cache for a batch
//! of sequences. Every backend is checked against [`ReferenceBackend`].

use crate::cache::{PagedCache, SeqId};
use crate::error::{Error, Result};
use crate::reference::{self, round_inputs, AttnParams};
use kivi_spec::Tensor;

/// Decode attention for one query per sequence, and attention for a causal
/// block of new queries per sequence (chunked prefill, speculative
/// verification).
pub trait Backend: Sync {
    /// Short name (`reference`, `cpu`, `sim`, `cuda`).
    fn name(&self) -> &'static str;
    /// `q` is `[B, Hq, D]` for the `B` sequences in `seqs`; returns `[B, Hq, D]`.
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>>;

    /// Appends each block's keys and values to its sequence and returns the
    /// attention output of every new query, `[sum of n, Hq, D]` in the order
    /// of `blocks`.
    ///
    /// A block behaves exactly like streaming: row `i` of a block is what
    /// [`PagedCache::append`] of its `k_i, v_i` followed by [`Self::decode`]
    /// of `q_i` gives (docs/semantics.md, "Many new queries"), so outputs and
    /// cache do not depend on how a prompt is cut into blocks. A sequence may
    /// appear more than once; its blocks go in the order given.
    ///
    /// Errors leave the cache unchanged; an error about one block comes as
    /// [`Error::InSequence`] with its index in `blocks`. A backend without
    /// such a kernel keeps this default, which refuses with
    /// [`Error::Unavailable`] and touches nothing.
    ///
    /// ```
    /// use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, NewTokens, PagedCache};
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
    /// let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
    /// let seq = cache.add_sequence();
    /// let kv = |n: usize| -> Vec<f32> { (0..n * 2 * 32).map(|i| (i as f32 * 0.1).sin()).collect() };
    /// cache.extend(seq, &kv(200), &kv(200)).unwrap();
    /// // Seven new tokens: each query sees the cache and the new tokens up to its own.
    /// let (k, v) = (kv(7), kv(7));
    /// let q = vec![0.5f32; 7 * 4 * 32];
    /// let attn = AttnParams::of(&s, s.shape().unwrap());
    /// let out = CpuBackend::default()
    ///     .attend_block(&mut cache, &[NewTokens { seq, q: &q, k: &k, v: &v }], attn)
    ///     .unwrap();
    /// assert_eq!((out.len(), cache.len(seq).unwrap()), (7 * 4 * 32, 207));
    /// ```
    /// [`Self::decode`] with some tokens left out, before normalisation:
    /// the query heads of KV head `h` of `seqs[b]` do not attend the
    /// positions in `skip[b][h]` (any order; repeats and positions outside
    /// the attended range are ignored). What a caller that scores some
    /// tokens itself merges with exactly (low-rank caches' exact residual,
    /// [`crate::low_rank::LowRankCache::decode`]): no finished output has
    /// to have a token's share taken back out of it.
    ///
    /// The default computes it on the host from the cache's rows
    /// ([`crate::SeqView::row`]) with the oracle's arithmetic (f64 scores
    /// and sums, as [`reference::decode_attention`]), whatever the backend;
    /// the CPU backend runs its split kernel over the tokens in between.
    /// Schemes with an integer-domain query (`query: int8(...)`) are
    /// refused with [`Error::Unavailable`].
    ///
    /// ```
    /// use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, PagedCache, ReferenceBackend};
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
    /// let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
    /// let seq = cache.add_sequence();
    /// let kv: Vec<f32> = (0..300 * 64).map(|i| (i as f32 * 0.1).sin()).collect();
    /// cache.extend(seq, &kv, &kv).unwrap();
    /// let q = vec![0.5f32; 4 * 32];
    /// let attn = AttnParams::of(&s, s.shape().unwrap());
    /// // Nothing skipped: normalising gives the decode.
    /// let p = CpuBackend::default().decode_partial(&cache, &[seq], &q, attn, &[vec![vec![]; 2]]).unwrap();
    /// let out = CpuBackend::default().decode(&cache, &[seq], &q, attn).unwrap();
    /// assert!((p.acc[0] / p.sum[0] - out[0]).abs() < 1e-5);
    /// // Token 7 left out for KV head 1 (query heads 2 and 3) only.
    /// let p7 = ReferenceBackend.decode_partial(&cache, &[seq], &q, attn, &[vec![vec![], vec![7]]]).unwrap();
    /// assert!(p7.sum[2] < p.sum[2] && (p7.sum[0] - p.sum[0]).abs() < 1e-4);
    /// ```
    fn decode_partial(
        &self,
        cache: &PagedCache,
        seqs: &[SeqId],
        q: &[f32],
        attn: AttnParams,
        skip: &[Vec<Vec<usize>>],
    ) -> Result<DecodePartial> {
        host_partial(self.name(), cache, seqs, q, attn, skip)
    }

    fn attend_block(&self, cache: &mut PagedCache, blocks: &[NewTokens], attn: AttnParams) -> Result<Vec<f32>> {
        let _ = (cache, blocks, attn);
        Err(Error::Unavailable {
            backend: self.name(),
            reason: "many-query attention (attend_block) is not generated for this backend yet".into(),
        })
    }
}

/// What [`Backend::decode_partial`] returns: per sequence and query head,
/// the online-softmax state of the tokens it attended, ready to be merged
/// exactly with other tokens' (flash-decoding style). With `s_t =
/// softmax_scale * q . k_t` over the attended tokens:
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodePartial {
    /// `[B, Hq]`: `max_t s_t`, `-inf` where no token was attended.
    pub max: Vec<f32>,
    /// `[B, Hq]`: `sum_t exp(s_t - max)` (0 where none).
    pub sum: Vec<f32>,
    /// `[B, Hq, D]`: `sum_t exp(s_t - max) v_t` (0 where none).
    pub acc: Vec<f32>,
}

/// Checks `skip` against the batch for [`Backend::decode_partial`]: one
/// list per sequence and KV head; and refuses an integer-domain query.
pub(crate) fn check_skip(
    backend: &'static str,
    cache: &PagedCache,
    seqs: &[SeqId],
    skip: &[Vec<Vec<usize>>],
) -> Result<()> {
    let hkv = cache.shape().kv_heads;
    if skip.len() != seqs.len() || skip.iter().any(|s| s.len() != hkv) {
        return Err(Error::Shape {
            what: "skipped positions",
            expected: format!("{} sequences x {hkv} kv heads of lists", seqs.len()),
            got: format!(
                "{} sequences with {:?} lists",
                skip.len(),
                skip.iter().map(Vec::len).collect::<Vec<_>>()
            ),
        });
    }
    if cache.scheme().query.is_some() {
        return Err(Error::Unavailable {
            backend,
            reason: "partial decode (decode_partial) of a scheme with an integer-domain query".into(),
        });
    }
    Ok(())
}

/// The default [`Backend::decode_partial`]: the cache's rows, the oracle's
/// arithmetic (f64), on the host.
fn host_partial(
    backend: &'static str,
    cache: &PagedCache,
    seqs: &[SeqId],
    q: &[f32],
    attn: AttnParams,
    skip: &[Vec<Vec<usize>>],
) -> Result<DecodePartial> {
    let per = check_batch(cache, seqs, q)?;
    check_window(cache, seqs.iter().copied(), attn)?;
    check_skip(backend, cache, seqs, skip)?;
    let shape = cache.shape();
    let (hq, d) = (shape.q_heads, shape.head_dim);
    let group = shape.group_size();
    let q = round_inputs(cache.scheme(), "query", q, seqs.len() * hq, d)?;
    let mut p = DecodePartial {
        max: vec![f32::NEG_INFINITY; seqs.len() * hq],
        sum: vec![0.0; seqs.len() * hq],
        acc: vec![0.0; seqs.len() * per],
    };
    let (mut k, mut v) = (vec![0f32; d], vec![0f32; d]);
    for (b, &id) in seqs.iter().enumerate() {
        let view = cache.view(id)?;
        let t = view.tokens();
        let lo = attn.window.map_or(0, |w| t.saturating_sub(w));
        for (h, skipped) in skip[b].iter().enumerate() {
            let mut skipped = skipped.clone();
            skipped.sort_unstable();
            let attended: Vec<usize> = (lo..t).filter(|p| skipped.binary_search(p).is_err()).collect();
            let heads = b * hq + h * group..b * hq + (h + 1) * group;
            let mut scores = vec![Vec::with_capacity(attended.len()); group];
            let mut rows = Vec::with_capacity(attended.len() * d);
            for &pos in &attended {
                view.row(Tensor::Key, pos, h, &mut k);
                view.row(Tensor::Value, pos, h, &mut v);
                rows.extend_from_slice(&v);
                for (g, s) in scores.iter_mut().enumerate() {
                    let qh = &q[(heads.start + g) * d..][..d];
                    let dot: f64 = qh.iter().zip(&k).map(|(a, c)| *a as f64 * *c as f64).sum();
                    s.push(dot * attn.softmax_scale as f64);
                }
            }
            for (g, s) in scores.iter().enumerate() {
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let mut acc = vec![0f64; d];
                let mut l = 0f64;
                for (i, &x) in s.iter().enumerate() {
                    let w = (x - m).exp();
                    l += w;
                    for (a, r) in acc.iter_mut().zip(&rows[i * d..][..d]) {
                        *a += w * *r as f64;
                    }
                }
                let at = heads.start + g;
                p.max[at] = m as f32;
                p.sum[at] = l as f32;
                for (o, a) in p.acc[at * d..][..d].iter_mut().zip(acc) {
                    *o = a as f32;
                }
            }
        }
    }
    Ok(p)
}

/// One sequence's causal block of `n` new tokens for [`Backend::attend_block`].
#[derive(Clone, Copy, Debug)]
pub struct NewTokens<'a> {
    pub seq: SeqId,
    /// Queries, `[n, Hq, D]`: one per new token.
    pub q: &'a [f32],
    /// Keys and values of the new tokens, `[n, Hkv, D]`.
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Checks every block's shapes, sequence and queries (finite in the
/// activation dtype) before anything is appended; returns each block's `n`.
/// Keys and values are checked by the append itself.
pub fn check_blocks(cache: &PagedCache, blocks: &[NewTokens]) -> Result<Vec<usize>> {
    let shape = cache.shape();
    let (qrow, kvrow) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let mut past: Vec<(SeqId, usize)> = Vec::new();
    let mut ns = Vec::with_capacity(blocks.len());
    for (b, blk) in blocks.iter().enumerate() {
        let in_seq = |e: Error| Error::InSequence {
            seq: b,
            source: Box::new(e),
        };
        let n = blk.k.len() / kvrow;
        if blk.k.len() != n * kvrow || blk.v.len() != blk.k.len() || blk.q.len() != n * qrow {
            return Err(in_seq(Error::Shape {
                what: "block of new tokens",
                expected: format!(
                    "q = [n, {}, {}] and k, v = [n, {}, {}]",
                    shape.q_heads, shape.head_dim, shape.kv_heads, shape.head_dim
                ),
                got: format!("{}, {} and {} values", blk.q.len(), blk.k.len(), blk.v.len()),
            }));
        }
        // The position of each query, for the error message: after the
        // sequence's tokens and its earlier blocks in this batch.
        let at = match past.iter().position(|(s, _)| *s == blk.seq) {
            Some(at) => at,
            None => {
                past.push((blk.seq, cache.len(blk.seq).map_err(in_seq)?));
                past.len() - 1
            }
        };
        let len = past[at].1;
        round_inputs(cache.scheme(), "query", blk.q, shape.q_heads, shape.head_dim).map_err(|e| match e {
            Error::NonFinite {
                tensor,
                value,
                token,
                head,
                channel,
                policy,
            } => in_seq(Error::NonFinite {
                tensor,
                value,
                token: token + len,
                head,
                channel,
                policy,
            }),
            e => in_seq(e),
        })?;
        past[at].1 += n;
        ns.push(n);
    }
    Ok(ns)
}

/// Refuses, with [`Error::Evicted`], attention that would read tokens an
/// eviction window freed ([`PagedCache::set_eviction_window`]): a decode
/// of each sequence in `seqs` at its length under `attn`'s window. Checks
/// many-query blocks too (their first query reads from one token later).
pub fn check_window(cache: &PagedCache, seqs: impl IntoIterator<Item = SeqId>, attn: AttnParams) -> Result<()> {
    for s in seqs {
        let t = cache.len(s)?;
        cache.check_readable(s, t.saturating_sub(1), attn.window)?;
    }
    Ok(())
}

/// After many-query attention has answered every block: frees what the
/// eviction window no longer sees (the appends kept what the blocks' first
/// queries read).
pub(crate) fn evict_after_blocks(cache: &mut PagedCache, blocks: &[NewTokens]) -> Result<()> {
    for blk in blocks {
        cache.evict(blk.seq)?;
    }
    Ok(())
}

/// Checks `q` against the batch and returns the per-sequence query length.
pub fn check_batch(cache: &PagedCache, seqs: &[SeqId], q: &[f32]) -> Result<usize> {
    let shape = cache.shape();
    let per = shape.q_heads * shape.head_dim;
    if q.len() != seqs.len() * per {
        return Err(Error::Shape {
            what: "query batch",
            expected: format!(
                "{} values ({} sequences x {} q_heads x {} head_dim)",
                seqs.len() * per,
                seqs.len(),
                shape.q_heads,
                shape.head_dim
            ),
            got: q.len().to_string(),
        });
    }
    for &s in seqs {
        cache.len(s)?;
    }
    Ok(per)
}

/// The oracle on a paged cache: reads the cache's view of K and V and runs
/// [`reference::decode_attention`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceBackend;

impl Backend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let per = check_batch(cache, seqs, q)?;
        check_window(cache, seqs.iter().copied(), attn)?;
        let mut out = Vec::with_capacity(q.len());
        for (b, &s) in seqs.iter().enumerate() {
            let v = cache.dequantize(s, Tensor::Value)?;
            if cache.scheme().query.is_some() {
                let keys = reference::KeyCodes::from_cache(cache, s)?;
                out.extend(reference::decode_attention_int8(
                    cache.scheme(),
                    &q[b * per..(b + 1) * per],
                    &keys,
                    &v,
                    attn,
                )?);
                continue;
            }
            let k = cache.dequantize(s, Tensor::Key)?;
            out.extend(reference::decode_attention(
                cache.scheme(),
                &q[b * per..(b + 1) * per],
                &k,
                &v,
                attn,
            )?);
        }
        Ok(out)
    }

    /// By its definition on the cache's own views: for each block, the view
    /// before it (whose rows past the stored tokens are the full-precision
    /// window) and its rounded inputs give the full-precision rows, the
    /// views after every append the stored ones; then
    /// [`reference::block_attention_views`].
    fn attend_block(&self, cache: &mut PagedCache, blocks: &[NewTokens], attn: AttnParams) -> Result<Vec<f32>> {
        if let Some(r) = int8_blocks(self, cache, blocks, attn) {
            return r;
        }
        let ns = check_blocks(cache, blocks)?;
        check_window(cache, blocks.iter().map(|b| b.seq), attn)?;
        let mut checkpoints = Vec::with_capacity(blocks.len());
        let mut kept = Vec::with_capacity(blocks.len());
        for (b, blk) in blocks.iter().enumerate() {
            let step = match cache.checkpoint(blk.seq) {
                Ok(cp) => {
                    checkpoints.push(cp);
                    append_keeping_rows(cache, blk)
                }
                Err(e) => Err(e),
            };
            match step {
                Ok(k) => kept.push(k),
                Err(e) => {
                    undo(cache, checkpoints);
                    return Err(Error::InSequence {
                        seq: b,
                        source: Box::new(e),
                    });
                }
            }
        }
        let mut out = Vec::new();
        for ((blk, &n), (past, full)) in blocks.iter().zip(&ns).zip(&kept) {
            let end = (past + n) * cache.shape().kv_heads * cache.shape().head_dim;
            let attended = [Tensor::Key, Tensor::Value]
                .map(|t| cache.dequantize(blk.seq, t))
                .into_iter()
                .collect::<Result<Vec<_>>>()
                .and_then(|stored| {
                    reference::block_attention_views(
                        cache.scheme(),
                        *past,
                        blk.q,
                        [&stored[0][..end], &stored[1][..end]],
                        [&full[0], &full[1]],
                        attn,
                    )
                });
            match attended {
                Ok(o) => out.extend(o),
                Err(e) => {
                    undo(cache, checkpoints);
                    return Err(e);
                }
            }
        }
        evict_after_blocks(cache, blocks)?;
        Ok(out)
    }
}

/// Appends one block and returns the sequence's length before it and the
/// full-precision rows of its tokens: the cache's view before the append
/// (whose rows past the stored tokens are the window), then the block's
/// inputs rounded to the activation dtype.
fn append_keeping_rows(cache: &mut PagedCache, blk: &NewTokens) -> Result<(usize, [Vec<f32>; 2])> {
    let shape = cache.shape();
    let past = cache.len(blk.seq)?;
    let mut full = [
        cache.dequantize(blk.seq, Tensor::Key)?,
        cache.dequantize(blk.seq, Tensor::Value)?,
    ];
    cache.extend_held(blk.seq, blk.k, blk.v)?;
    for (f, (x, name)) in full.iter_mut().zip([(blk.k, "key"), (blk.v, "value")]) {
        f.extend(round_inputs(cache.scheme(), name, x, shape.kv_heads, shape.head_dim)?);
    }
    Ok((past, full))
}

/// Restores checkpoints newest first (see [`PagedCache::restore`]).
pub(crate) fn undo(cache: &mut PagedCache, checkpoints: Vec<crate::cache::Checkpoint>) {
    for cp in checkpoints.into_iter().rev() {
        cache.restore(cp);
    }
}

/// Many-query attention for a scheme with an integer-domain query
/// (`query: int8(...)`), by its streaming definition
/// ([`reference::block_attention_streaming`]): each new token is appended
/// and its query decoded with `b` over the first `past + i + 1` tokens.
/// A stored token never changes, so this is the many-query meaning of the
/// scheme (docs/semantics.md, "Many new queries"); it costs a decode per
/// query, which the CPU's block path (`cpu/block.rs`, f32 query) avoids.
/// `None` for other schemes. All or nothing, like every `attend_block`.
pub(crate) fn int8_blocks(
    b: &dyn Backend,
    cache: &mut PagedCache,
    blocks: &[NewTokens],
    attn: AttnParams,
) -> Option<Result<Vec<f32>>> {
    cache.scheme().query?;
    let run = |cache: &mut PagedCache| -> Result<Vec<f32>> {
        let ns = check_blocks(cache, blocks)?;
        check_window(cache, blocks.iter().map(|b| b.seq), attn)?;
        let shape = cache.shape();
        let (qrow, kvrow) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
        let mut checkpoints = Vec::with_capacity(blocks.len());
        let mut out = Vec::new();
        for (i, (blk, &n)) in blocks.iter().zip(&ns).enumerate() {
            let mut step = || -> Result<()> {
                checkpoints.push(cache.checkpoint(blk.seq)?);
                for j in 0..n {
                    let kv = j * kvrow..(j + 1) * kvrow;
                    cache.append(blk.seq, &blk.k[kv.clone()], &blk.v[kv])?;
                    out.extend(b.decode(cache, &[blk.seq], &blk.q[j * qrow..(j + 1) * qrow], attn)?);
                }
                Ok(())
            };
            if let Err(e) = step() {
                undo(cache, checkpoints);
                return Err(Error::InSequence {
                    seq: i,
                    source: Box::new(e),
                });
            }
        }
        evict_after_blocks(cache, blocks)?;
        Ok(out)
    };
    Some(run(cache))
}
