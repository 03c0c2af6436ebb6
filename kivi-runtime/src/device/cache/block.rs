//! Many-query attention on a device (docs/semantics.md, "Many new
//! queries"): a causal block of new tokens per sequence is appended by the
//! device's extend kernels, then one launch of the generated block kernel
//! (`templates/cuda/kivi_block.cuh`) computes every new query's output.
//!
//! What the append quantizes away and some queries still read at full
//! precision — the window rows before the block and the block's own rows —
//! is gathered first into a *tail* buffer per tensor on the device: the
//! window rows are copied out of the ring before the append overwrites
//! them, the block's rows are its inputs rounded to the activation dtype.

use super::{gen_err, upload_act, DeviceBackend, DeviceCache};
use crate::backend::{check_blocks, check_window, evict_after_blocks, undo, NewTokens};
use crate::cache::{PagedCache, SeqId};
use crate::device::args::BlockArgs;
use crate::device::{download, upload, Device, Elem, Module};
use crate::error::{Error, Result};
use crate::quant;
use crate::reference::{round_inputs, stored_tokens, AttnParams};
use kivi_spec::layout::{self, regions};
use kivi_spec::{Dtype, Scheme, Tensor};
use kivi_templates::{generate_block_calibrated, Codebooks, GenError, GenOptions};
use std::sync::Arc;

/// Activation values as the bytes a device buffer of that dtype holds.
fn act_bytes(dtype: Dtype, x: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        d => x.iter().flat_map(|v| quant::to_bits_16(*v, d).to_le_bytes()).collect(),
    }
}

/// The block kernel of `scheme`, loaded on `dev`, with the calibrated
/// `nuq` tables `cb` baked in. A codec the generator refuses by name
/// (pre-RoPE keys, int8 queries) is [`Error::Unavailable`]: the device has
/// no many-query kernel for it.
fn block_module(dev: &Arc<dyn Device>, scheme: &Scheme, opts: GenOptions, cb: &Codebooks) -> Result<Arc<Module>> {
    let g = generate_block_calibrated(scheme, opts, cb).map_err(|e| match e {
        e @ GenError::Unsupported { .. } => Error::Unavailable {
            backend: dev.kind().name(),
            reason: e.to_string(),
        },
        e => gen_err(e),
    })?;
    dev.load(&g)
}

impl DeviceCache {
    /// Copies sequences `seqs` of a host cache to the device with room for
    /// `room[b]` more tokens in sequence `b`: the pool gets the blocks those
    /// tokens need past the host pool's, so the device's extend kernels can
    /// append to the copy (the host cache is not changed).
    pub fn upload_with_room(
        dev: Arc<dyn Device>,
        cache: &PagedCache,
        seqs: &[SeqId],
        room: &[usize],
    ) -> Result<DeviceCache> {
        if room.len() != seqs.len() {
            return Err(Error::Shape {
                what: "room per sequence",
                expected: seqs.len().to_string(),
                got: room.len().to_string(),
            });
        }
        let mut dc = DeviceCache::upload(dev.clone(), cache, seqs)?;
        let bt = dc.layout.block_tokens;
        let mut extra = 0;
        let mut stride = dc.table_stride;
        for (b, &r) in room.iter().enumerate() {
            let len = dc.lens[b]
                .checked_add(r)
                .filter(|l| *l <= i32::MAX as usize)
                .ok_or_else(|| Error::Config(format!("sequence {b} would exceed 2^31 tokens")))?;
            let blocks = [Tensor::Key, Tensor::Value]
                .map(|t| regions(&dc.scheme, t, len).quantized)
                .into_iter()
                .max()
                .unwrap_or(0)
                .div_ceil(bt);
            extra += blocks.saturating_sub(dc.host_tables[b].len());
            stride = stride.max(blocks);
        }
        let h = dc.shape.kv_heads;
        let bw = dc.layout.block_words;
        let old_blocks = dc.total_blocks;
        let mut pool = dev.alloc(Elem::U32, (old_blocks + extra) * bw)?;
        dev.copy(&dc.pool, 0, &mut pool, 0, old_blocks * bw)?;
        dc.pool = pool;
        dc.total_blocks = old_blocks + extra;
        // Allocation takes the lowest free ids first (DeviceCache::new's order).
        dc.free = (old_blocks as u32..(old_blocks + extra) as u32).rev().collect();
        let mut tables = vec![0u32; dc.batch * stride];
        for (b, t) in dc.host_tables.iter().enumerate() {
            tables[b * stride..][..t.len()].copy_from_slice(t);
        }
        dc.tables = upload(dev.as_ref(), &tables)?;
        dc.table_stride = stride;
        let work = kivi_templates::extend_work_floats(&dc.scheme, dc.gen_opts()).map_err(gen_err)?;
        dc.work = dev.alloc(Elem::F32, (dc.batch * 2 * h * work).max(1))?;
        Ok(dc)
    }

    /// Appends `counts[b]` new tokens to sequence `b` (`k`, `v` are
    /// `[sum(counts), Hkv, D]`, sequence 0's first) and returns the
    /// attention output of each new token's query (`q` is `[sum(counts),
    /// Hq, D]`; the result is `[sum(counts), Hq, D]` in the same order),
    /// with the meaning of [`crate::Backend::attend_block`]: row `i` of a
    /// sequence's block is what appending its tokens up to `i` and decoding
    /// `q_i` gives.
    ///
    /// Bad input (shapes, non-finite queries, keys or values, values out of
    /// range, a sequence past its size) is refused before anything changes;
    /// a kernel that fails after the append is undone, so an error leaves
    /// the cache as it was. Every codec the decode kernel runs is
    /// generated (stored rows are brought to the raw domain once per tile).
    ///
    /// ```
    /// use kivi_runtime::device::{DeviceCache, SimDevice};
    /// use kivi_runtime::{AttnParams, CacheConfig};
    /// use kivi_spec::{presets, Heads};
    /// # if kivi_runtime::sim::find_compiler().is_err() { return; }
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
    /// let mut dc = DeviceCache::new(SimDevice::shared(), &s, 1, 256, CacheConfig::for_tokens(256)).unwrap();
    /// let kv: Vec<f32> = (0..40 * 2 * 32).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
    /// let q = vec![0.5f32; 40 * 4 * 32];
    /// let attn = AttnParams::of(&s, s.shape().unwrap());
    /// let out = dc.attend_block(&[40], &q, &kv, &kv, attn).unwrap(); // a 40-token prompt
    /// assert_eq!((out.len(), dc.lens()), (40 * 4 * 32, &[40][..]));
    /// ```
    pub fn attend_block(
        &mut self,
        counts: &[usize],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        attn: AttnParams,
    ) -> Result<Vec<f32>> {
        self.check()?;
        let (hq, h, d) = (self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim);
        let (qrow, row) = (hq * d, h * d);
        let total: usize = counts.iter().sum();
        if counts.len() != self.batch || k.len() != total * row || v.len() != k.len() || q.len() != total * qrow {
            return Err(Error::Shape {
                what: "device block of new tokens",
                expected: format!(
                    "{} counts, q = [{total}, {hq}, {d}] and k, v = [{total}, {h}, {d}]",
                    self.batch
                ),
                got: format!(
                    "{} counts, {} query, {} key and {} value values",
                    counts.len(),
                    q.len(),
                    k.len(),
                    v.len()
                ),
            });
        }
        let qr = round_inputs(&self.scheme, "query", q, hq, d)?;
        let module = block_module(&self.dev, &self.scheme, self.gen_opts(), &self.codebooks)?;
        let bshape =
            kivi_templates::block_shape(&self.scheme).ok_or_else(|| Error::Unbound(self.scheme.name.clone()))?;
        let max_n = counts.iter().copied().max().unwrap_or(0);
        if max_n == 0 {
            return Ok(Vec::new());
        }
        let dev = self.dev.clone();
        let dtype = self.scheme.dtype;
        let past: Vec<usize> = self.lens.clone();
        // The tails, gathered before the append overwrites the ring.
        let first = [Tensor::Key, Tensor::Value].map(|t| {
            past.iter()
                .map(|&p| stored_tokens(&self.scheme, t, p).min(p))
                .collect::<Vec<_>>()
        });
        let tail_stride = (0..self.batch)
            .flat_map(|b| first.iter().map(|f| past[b] - f[b] + counts[b]).collect::<Vec<_>>())
            .max()
            .unwrap_or(0)
            .max(1);
        let act = super::act_elem(dtype);
        let mut tails = [
            dev.alloc(act, self.batch * tail_stride * row)?,
            dev.alloc(act, self.batch * tail_stride * row)?,
        ];
        let sinks = self.scheme.sinks as usize;
        let mut at = 0;
        for b in 0..self.batch {
            for (t, x) in [(Tensor::Key, k), (Tensor::Value, v)] {
                let ti = super::ti(t);
                let slots = layout::window_capacity(&self.scheme, t).max(1);
                // Window rows first..past: consecutive ring slots in runs.
                let mut p = first[ti][b];
                while p < past[b] {
                    let slot = (p - sinks) % slots;
                    let run = (slots - slot).min(past[b] - p);
                    dev.copy(
                        &self.rings[ti],
                        (b * slots + slot) * row,
                        &mut tails[ti],
                        (b * tail_stride + p - first[ti][b]) * row,
                        run * row,
                    )?;
                    p += run;
                }
                // Then the block's rows, rounded (checked again by the append).
                let rows = round_inputs(&self.scheme, t.name(), &x[at * row..(at + counts[b]) * row], h, d)?;
                if !rows.is_empty() {
                    dev.write(
                        &mut tails[ti],
                        (b * tail_stride + past[b] - first[ti][b]) * row,
                        &act_bytes(dtype, &rows),
                    )?;
                }
            }
            at += counts[b];
        }
        // Queries padded to [batch][max_n][Hq][D].
        let mut qp = vec![0f32; self.batch * max_n * qrow];
        let mut at = 0;
        for (b, &n) in counts.iter().enumerate() {
            qp[b * max_n * qrow..][..n * qrow].copy_from_slice(&qr[at * qrow..(at + n) * qrow]);
            at += n;
        }
        let q_d = upload_act(dev.as_ref(), dtype, &qp)?;
        let past_d = upload(dev.as_ref(), &past.iter().map(|&x| x as i32).collect::<Vec<_>>())?;
        let counts_d = upload(dev.as_ref(), &counts.iter().map(|&x| x as i32).collect::<Vec<_>>())?;
        let mut out_d = dev.alloc(Elem::F32, self.batch * max_n * qrow)?;

        // The append: every check of the host path, then the extend kernels.
        let undo = self.extend_checked(counts, k, v, super::ExtendKernel::Variant(None))?;
        let ran = (|| -> Result<Vec<f32>> {
            BlockArgs {
                batch: self.batch,
                shape: bshape,
                kv_heads: h,
                pool: &self.pool,
                tables: &self.tables,
                table_stride: self.table_stride,
                past_lens: &past_d,
                counts: &counts_d,
                q: &q_d,
                max_n,
                sinks_k: &self.sinks[0],
                sinks_v: &self.sinks[1],
                means_k: &self.means[0],
                means_v: &self.means[1],
                tail_k: &tails[0],
                tail_v: &tails[1],
                tail_stride,
                sm_scale: attn.softmax_scale,
                window: attn.window,
                out: &mut out_d,
            }
            .launch(dev.as_ref(), &module)?;
            let out = download::<f32>(dev.as_ref(), &out_d)?;
            dev.sync()?;
            Ok(out)
        })();
        let padded = match ran {
            Ok(o) => o,
            Err(e) => {
                if let Some(u) = undo {
                    self.undo(u);
                }
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(total * qrow);
        for (b, &n) in counts.iter().enumerate() {
            out.extend_from_slice(&padded[b * max_n * qrow..][..n * qrow]);
        }
        Ok(out)
    }
}

/// [`crate::Backend::attend_block`] on a device: the host cache stays the
/// truth. The sequences' state before the call is uploaded (with room for
/// their blocks), the blocks are appended to the host cache (its checks
/// give the typed errors, and an error there undoes the earlier blocks),
/// then the device appends the same tokens with its own kernels and runs
/// the block kernel, round by round (a sequence that appears several
/// times has one block per round, in order).
pub(super) fn attend_block(
    be: &DeviceBackend,
    cache: &mut PagedCache,
    blocks: &[NewTokens],
    attn: AttnParams,
) -> Result<Vec<f32>> {
    let ns = check_blocks(cache, blocks)?;
    check_window(cache, blocks.iter().map(|b| b.seq), attn)?;
    let scheme = cache.scheme().clone();
    let shape = cache.shape();
    // Refused before anything is appended.
    let opts = GenOptions {
        block_tokens: Some(cache.layout().block_tokens),
    };
    // the host cache's `nuq` tables (its calibration's), as `upload` takes them
    let levels = [Tensor::Key, Tensor::Value].map(|t| cache.codec(t).map(|c| c.levels.clone()));
    block_module(be.device(), &scheme, opts, &super::nuq_codebooks(&scheme, levels))?;
    if blocks.is_empty() {
        return Ok(Vec::new());
    }
    // Distinct sequences in order of first appearance, and each block's round.
    let mut seqs: Vec<SeqId> = Vec::new();
    let mut room: Vec<usize> = Vec::new();
    let mut round = Vec::with_capacity(blocks.len());
    let mut seen: Vec<usize> = Vec::new();
    for (blk, &n) in blocks.iter().zip(&ns) {
        let at = match seqs.iter().position(|&s| s == blk.seq) {
            Some(at) => at,
            None => {
                seqs.push(blk.seq);
                room.push(0);
                seen.push(0);
                seqs.len() - 1
            }
        };
        room[at] += n;
        round.push((at, seen[at]));
        seen[at] += 1;
    }
    let mut dc = DeviceCache::upload_with_room(be.device().clone(), cache, &seqs, &room)?;
    let mut checkpoints = Vec::with_capacity(blocks.len());
    for (b, blk) in blocks.iter().enumerate() {
        let step = cache
            .checkpoint(blk.seq)
            .map(|cp| checkpoints.push(cp))
            // Eviction waits until every query of the batch is answered.
            .and_then(|()| cache.extend_held(blk.seq, blk.k, blk.v));
        if let Err(e) = step {
            undo(cache, checkpoints);
            return Err(Error::InSequence {
                seq: b,
                source: Box::new(e),
            });
        }
    }
    let qrow = shape.q_heads * shape.head_dim;
    let mut row0 = Vec::with_capacity(blocks.len());
    let mut total = 0;
    for &n in &ns {
        row0.push(total);
        total += n;
    }
    let mut out = vec![0f32; total * qrow];
    let rounds = seen.iter().copied().max().unwrap_or(0);
    for r in 0..rounds {
        let mut counts = vec![0usize; seqs.len()];
        let mut members: Vec<Option<usize>> = vec![None; seqs.len()];
        for (b, &(at, k)) in round.iter().enumerate() {
            if k == r {
                counts[at] = ns[b];
                members[at] = Some(b);
            }
        }
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for b in members.iter().flatten() {
            q.extend_from_slice(blocks[*b].q);
            k.extend_from_slice(blocks[*b].k);
            v.extend_from_slice(blocks[*b].v);
        }
        let got = match dc.attend_block(&counts, &q, &k, &v, attn) {
            Ok(o) => o,
            Err(e) => {
                undo(cache, checkpoints);
                return Err(e);
            }
        };
        let mut at = 0;
        for b in members.iter().flatten() {
            let n = ns[*b];
            out[row0[*b] * qrow..][..n * qrow].copy_from_slice(&got[at * qrow..(at + n) * qrow]);
            at += n;
        }
    }
    evict_after_blocks(cache, blocks)?;
    Ok(out)
}
