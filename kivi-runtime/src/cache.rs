//! The paged quantized KV cache.
//!
//! Quantized tokens live in fixed-size blocks taken from one pool (a single
//! word arena, as on a GPU); each sequence has a block table, and blocks
//! return to the pool when a sequence is freed. Several caches (the layers
//! of a model, each its own scheme and block size) can also share one byte
//! budget for their blocks, a [`crate::pool::BlockPool`]
//! ([`PagedCache::set_pool`]). Sinks and the recent window
//! stay in the activation dtype in per-sequence buffers sized once, at their
//! maximum ([`kivi_spec::layout::window_capacity`]); the window is a ring
//! indexed by token position, so appending never copies the cache.
//!
//! A cache told its layer's sliding window
//! ([`PagedCache::set_eviction_window`]) frees the blocks that window no
//! longer sees: a sequence's block table then holds its blocks from a
//! logical start offset on, and attention that would read past it is
//! refused.
//!
//! Appends are all-or-nothing: inputs are rounded and checked, blocks are
//! reserved, and groups are quantized before anything a reader can see
//! changes. On error the cache is exactly as before.
//!
//! Writes are vectorised (`cpu/write.rs`: AVX-512, AVX2 or one-lane
//! scalar, blocks in parallel for long extends) and store the same bits
//! as the reference path, the `quant.rs` functions group by group, which
//! [`PagedCache::set_write_isa`]`(None)` selects and which also reports
//! every bad input. Tensors with a codec pipeline are quantized by
//! `quant.rs` on either path.
//!
//! ```
//! use kivi_runtime::{PagedCache, CacheConfig};
//! use kivi_spec::{presets, Heads, Tensor};
//! let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 64).unwrap();
//! let mut cache = PagedCache::new(s, CacheConfig::for_tokens(1024)).unwrap();
//! let seq = cache.add_sequence();
//! let row: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
//! for _ in 0..300 {
//!     cache.append(seq, &row, &row).unwrap();
//! }
//! let m = cache.memory();
//! assert_eq!(m.total, m.codes + m.scales + m.zeros + m.windows + m.tables);
//! assert_eq!(cache.dequantize(seq, Tensor::Key).unwrap().len(), 300 * 2 * 64);
//! ```

use crate::cpu::{write, CpuParams, Isa};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::quant::{self, GroupParams, TensorCodec};
use crate::reference::round_inputs;
use kivi_spec::layout::{self, regions, BlockLayout, TensorLayout};
use kivi_spec::{Axis, Codec, Dtype, Quant, ScaleDtype, Scheme, Shape, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Identifies a sequence within one cache.
pub type SeqId = u64;

/// Block size and pool capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per block; `None` picks [`layout::default_block_tokens`].
    pub block_tokens: Option<usize>,
    /// Blocks in the pool (the pool is reserved once, pages are touched on use).
    pub max_blocks: usize,
}

impl CacheConfig {
    /// Room for about `tokens` quantized tokens in total, default block size.
    pub fn for_tokens(tokens: usize) -> Self {
        CacheConfig {
            block_tokens: None,
            max_blocks: tokens.div_ceil(16) + 1,
        }
    }
}

/// Values in the activation dtype, stored at their real width.
#[derive(Clone, Debug)]
enum Buf {
    Half(Vec<u16>, Dtype),
    Single(Vec<f32>),
}

impl Buf {
    fn new(len: usize, dtype: Dtype) -> Buf {
        match dtype {
            Dtype::F32 => Buf::Single(vec![0.0; len]),
            d => Buf::Half(vec![0; len], d),
        }
    }
    #[inline]
    fn get(&self, i: usize) -> f32 {
        match self {
            Buf::Half(v, d) => quant::from_bits_16(v[i], *d),
            Buf::Single(v) => v[i],
        }
    }
    /// `x` must already be rounded to the dtype (it is stored exactly).
    #[inline]
    fn set(&mut self, i: usize, x: f32) {
        match self {
            Buf::Half(v, d) => v[i] = quant::to_bits_16(x, *d),
            Buf::Single(v) => v[i] = x,
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Buf::Half(v, _) => v.len() * 2,
            Buf::Single(v) => v.len() * 4,
        }
    }
}

#[derive(Clone, Debug)]
struct Sequence {
    tokens: usize,
    /// The blocks still held, oldest first: logical block `first_block + i`
    /// (relative tokens `(first_block + i) * block_tokens ..`) is `table[i]`.
    /// Eviction drops blocks from the front, so the table is a window onto
    /// the sequence's logical blocks and never grows past what it holds.
    table: Vec<u32>,
    /// Logical blocks evicted from the front of the table.
    first_block: usize,
    /// Quantized (block-resident) tokens per tensor.
    quantized: [usize; 2],
    sinks: [Buf; 2],
    ring: [Buf; 2],
    ring_cap: [usize; 2],
    /// Per-channel centering means, `[Hkv][D]` in the activation dtype, of
    /// each centered tensor; `None` until the first `N` tokens exist.
    means: [Option<Vec<f32>>; 2],
}

impl Sequence {
    /// The held blocks, indexed by logical block.
    fn blocks(&self) -> Blocks<'_> {
        Blocks {
            ids: &self.table,
            first: self.first_block,
        }
    }

    /// Relative tokens (counted after the sinks) that are no longer held.
    fn evicted_tokens(&self, block_tokens: usize) -> usize {
        self.first_block * block_tokens
    }
}

/// A block table seen through logical block indices: `ids[0]` is logical
/// block `first` (the ones before it were evicted). The writes index it as
/// they would a whole table; they only ever touch blocks past the stored
/// tokens, which are never evicted.
#[derive(Clone, Copy)]
struct Blocks<'a> {
    ids: &'a [u32],
    first: usize,
}

impl std::ops::Index<usize> for Blocks<'_> {
    type Output = u32;
    #[inline]
    fn index(&self, logical: usize) -> &u32 {
        &self.ids[logical - self.first]
    }
}

fn ti(t: Tensor) -> usize {
    match t {
        Tensor::Key => 0,
        Tensor::Value => 1,
    }
}

/// Bytes in use, by kind. `total` is the sum of the others.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Code words of blocks in use (raw rows for `full` tensors).
    pub codes: usize,
    /// Scales of uniform groups, norms of Lloyd–Max groups.
    pub scales: usize,
    pub zeros: usize,
    /// Sparse outliers: channel indices and corrections, of blocks in use.
    pub outliers: usize,
    /// Per-channel centering means (`Hkv x D` in the activation dtype per
    /// centered tensor, once the first `N` tokens exist).
    pub means: usize,
    /// Lloyd–Max tables (`2^b` f32 per such tensor, once per cache).
    pub codebooks: usize,
    /// Low-rank bases (`kivi_runtime::low_rank`), once per cache (layer).
    pub bases: usize,
    /// Sink and window buffers (their full capacity, as allocated).
    pub windows: usize,
    /// Block-table entries (4 bytes each).
    pub tables: usize,
    pub blocks_in_use: usize,
    pub total: usize,
}

/// A paged quantized KV cache for one scheme and shape.
pub struct PagedCache {
    scheme: Scheme,
    shape: Shape,
    layout: BlockLayout,
    pool: Vec<u32>,
    free: Vec<u32>,
    max_blocks: usize,
    seqs: BTreeMap<SeqId, Sequence>,
    next_id: SeqId,
    /// The codec pipeline of each quantized tensor.
    codecs: [Option<TensorCodec>; 2],
    /// The instruction set of the vectorised writes; `None`: the reference
    /// path (`quant.rs` group by group, as the oracle does).
    write_isa: Option<Isa>,
    /// The path the last successful write took (`None`: the reference).
    last_write: Option<Isa>,
    /// The sliding window of the layer this cache serves, if its blocks
    /// are evicted ([`Self::set_eviction_window`]).
    evict_window: Option<usize>,
    /// The hash of the calibration whose codebooks the codecs decode with
    /// ([`Self::with_calibration`]).
    calibration: Option<u64>,
    /// The pool this cache's blocks are charged to, shared with other
    /// caches ([`Self::set_pool`]); `None`: only `max_blocks` bounds it.
    shared: Option<BlockPool>,
    /// The product codebooks of each `vq(...)` tensor ([`crate::vq`]).
    vq: [Option<Arc<crate::vq::VqBook>>; 2],
}

/// Where a token of one tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    Sink(usize),
    /// Block id and token offset within it.
    Block(u32, usize),
    /// Ring slot.
    Window(usize),
}

#[inline]
fn read_param(words: &[u32], i: usize, dtype: ScaleDtype) -> f32 {
    match dtype {
        ScaleDtype::F16 => half::f16::from_bits((words[i / 2] >> (16 * (i % 2))) as u16).to_f32(),
        ScaleDtype::F32 => f32::from_bits(words[i]),
    }
}

#[inline]
fn write_param(words: &mut [u32], i: usize, x: f32, dtype: ScaleDtype) {
    match dtype {
        ScaleDtype::F16 => {
            let shift = 16 * (i % 2);
            let b = half::f16::from_f32(x).to_bits() as u32;
            words[i / 2] = (words[i / 2] & !(0xffff << shift)) | (b << shift);
        }
        ScaleDtype::F32 => words[i] = x.to_bits(),
    }
}

/// Reads element `i` of a row stored raw in the activation dtype.
#[inline]
pub fn read_raw(words: &[u32], i: usize, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F32 => f32::from_bits(words[i]),
        d => quant::from_bits_16((words[i / 2] >> (16 * (i % 2))) as u16, d),
    }
}

fn write_raw_row(words: &mut [u32], vals: &[f32], dtype: Dtype) {
    match dtype {
        Dtype::F32 => {
            for (w, v) in words.iter_mut().zip(vals) {
                *w = v.to_bits();
            }
        }
        d => {
            for (w, pair) in words.iter_mut().zip(vals.chunks(2)) {
                let lo = quant::to_bits_16(pair[0], d) as u32;
                let hi = pair.get(1).map_or(0, |x| quant::to_bits_16(*x, d) as u32);
                *w = lo | (hi << 16);
            }
        }
    }
}

/// Scale and zero point of token `t` (in block), channel `d`.
#[inline]
pub fn params_at(tl: &TensorLayout, words: &[u32], q: &Quant, t: usize, d: usize) -> GroupParams {
    let i = tl.param_index(t, d);
    GroupParams {
        scale: read_param(&words[tl.scales_offset..], i, q.scale),
        // Lloyd–Max groups store a norm and no zero point.
        zero: if q.has_zeros() {
            read_param(&words[tl.zeros_offset..], i, q.scale)
        } else {
            0.0
        },
    }
}

impl PagedCache {
    /// A cache for a scheme with a bound shape ([`Scheme::with_shape`]).
    ///
    /// A scheme with `levels = nuq` is refused
    /// ([`crate::calib::CalibError::Needed`]): its codebooks come from a
    /// calibration, [`Self::with_calibration`].
    pub fn new(scheme: Scheme, config: CacheConfig) -> Result<Self> {
        crate::calib::levels_for(&scheme, None, 0)?;
        crate::vq::books_for(&scheme, None, 0)?;
        Self::build(scheme, config)
    }

    /// A cache for layer `layer` of a model, its `nuq` codecs decoding with
    /// that layer's codebooks from `calibration` (checked against the
    /// scheme's shape and the quantizer each was fitted for; a missing one
    /// is an error naming the layer and tensor). The calibration's hash
    /// joins the scheme's in [`Self::identity`]. A scheme without `nuq`
    /// levels is built as by [`Self::new`], with the hash recorded all
    /// the same.
    ///
    /// ```
    /// use kivi_runtime::calib::{Calibration, FitOptions, LayerSamples, ModelId};
    /// use kivi_runtime::{CacheConfig, PagedCache};
    /// let s = kivi_spec::parse_scheme("pub N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
    ///     value: quant(bits = 2, axis = token, group = 32), residual: 32, heads: mha(1), head_dim: 32 }").unwrap();
    /// assert!(PagedCache::new(s.clone(), CacheConfig::for_tokens(64)).is_err());
    /// let mut rng = kivi_runtime::rand::Rng::new(3);
    /// let x = LayerSamples::new(1, 128, 1, 1, 32, rng.vec(128 * 32), rng.vec(128 * 32));
    /// let mut cal = Calibration::new(ModelId { name: "toy".into(), layers: 2, kv_heads: 1, head_dim: 32 }, "random");
    /// cal.fit_codebooks(&s, &[x], FitOptions::default()).unwrap();
    /// let e = PagedCache::with_calibration(s.clone(), CacheConfig::for_tokens(64), &cal, 0).err().unwrap();
    /// assert!(e.to_string().contains("layer 0 key"), "{e}");
    /// let c = PagedCache::with_calibration(s, CacheConfig::for_tokens(64), &cal, 1).unwrap();
    /// assert_eq!(c.calibration_hash(), Some(cal.hash()));
    /// ```
    pub fn with_calibration(
        scheme: Scheme,
        config: CacheConfig,
        calibration: &crate::calib::Calibration,
        layer: usize,
    ) -> Result<Self> {
        kivi_spec::validate(&scheme)?;
        calibration.check_shape(&scheme)?;
        let levels = crate::calib::levels_for(&scheme, Some(calibration), layer)?;
        let books = crate::vq::books_for(&scheme, Some(calibration), layer)?;
        let mut c = Self::build(scheme, config)?;
        c.vq = books;
        for (codec, l) in c.codecs.iter_mut().zip(levels) {
            if let (Some(codec), Some(l)) = (codec.as_mut(), l) {
                codec.levels = l;
            }
        }
        c.calibration = Some(calibration.hash());
        Ok(c)
    }

    /// The hash of the calibration this cache was built with, if any.
    pub fn calibration_hash(&self) -> Option<u64> {
        self.calibration
    }

    /// This cache's identity for tuning decisions and artifacts: the scheme
    /// hash, joined with the calibration hash when there is one
    /// ([`crate::calib::identity`]).
    pub fn identity(&self) -> u64 {
        crate::calib::identity(kivi_spec::scheme_hash(&self.scheme), self.calibration)
    }

    fn build(scheme: Scheme, config: CacheConfig) -> Result<Self> {
        kivi_spec::validate(&scheme)?;
        if scheme.mla().is_some() {
            return Err(Error::Config(crate::mla::NOT_PAGED.into()));
        }
        if scheme.low_rank.is_some() {
            return Err(Error::Config(crate::low_rank::NOT_PAGED.into()));
        }
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        let block_tokens = config
            .block_tokens
            .unwrap_or_else(|| layout::default_block_tokens(&scheme));
        layout::check_block_tokens(&scheme, block_tokens).map_err(Error::Config)?;
        if config.max_blocks > u32::MAX as usize {
            return Err(Error::Config(format!(
                "{} blocks is more than a block table can address",
                config.max_blocks
            )));
        }
        let layout = BlockLayout::new(&scheme, shape, block_tokens);
        let words = config
            .max_blocks
            .checked_mul(layout.block_words)
            .filter(|w| *w <= isize::MAX as usize / 4)
            .ok_or_else(|| Error::Config(format!("a pool of {} blocks does not fit in memory", config.max_blocks)))?;
        Ok(PagedCache {
            shape,
            layout,
            // calloc'd: pages are only touched when a block is first written.
            pool: vec![0u32; words],
            free: (0..config.max_blocks as u32).rev().collect(),
            max_blocks: config.max_blocks,
            seqs: BTreeMap::new(),
            next_id: 0,
            codecs: [Tensor::Key, Tensor::Value].map(|t| TensorCodec::of(&scheme, t, shape.head_dim)),
            // `KIVI_CPU_SCALAR=1` caps the writes as it caps the decode.
            write_isa: Some(CpuParams::default().isa(shape.head_dim)),
            last_write: None,
            evict_window: None,
            calibration: None,
            shared: None,
            vq: [None, None],
            scheme,
        })
    }

    /// Chooses how [`Self::append`] and [`Self::extend`] write: `Some(isa)`
    /// the vectorised writes on at most `isa` (capped to what this CPU has;
    /// `Isa::Scalar` is their portable one-lane form), `None` the reference
    /// path (the codec's `quant.rs` functions group by group, as the oracle
    /// calls them). Every choice stores the same bits; the reference path
    /// is there to check that and to measure against.
    ///
    /// ```
    /// use kivi_runtime::{cpu::Isa, CacheConfig, PagedCache};
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Mha(2), 64).unwrap();
    /// let rows: Vec<f32> = (0..300 * 128).map(|i| (i as f32 * 0.7).sin()).collect();
    /// let mut pools = Vec::new();
    /// for isa in [None, Some(Isa::Scalar), Some(Isa::Avx512)] {
    ///     let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
    ///     c.set_write_isa(isa);
    ///     let id = c.add_sequence();
    ///     c.extend(id, &rows, &rows).unwrap();
    ///     pools.push(c.pool().to_vec());
    /// }
    /// assert!(pools.iter().all(|p| *p == pools[0]));
    /// ```
    pub fn set_write_isa(&mut self, isa: Option<Isa>) {
        let d = self.shape.head_dim;
        self.write_isa = isa.map(|i| Isa::select(i == Isa::Scalar, i == Isa::Avx512, d));
    }

    /// The instruction set the writes use (`None`: the reference path).
    pub fn write_isa(&self) -> Option<Isa> {
        self.write_isa
    }

    /// The path the last successful [`Self::extend`] or [`Self::append`]
    /// took: the vectorised writes' instruction set, or `None` for the
    /// reference path (chosen, or taken for input it declined).
    pub fn last_write_path(&self) -> Option<Isa> {
        self.last_write
    }

    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }
    pub fn shape(&self) -> Shape {
        self.shape
    }
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// The whole block arena (`max_blocks * block_words` words).
    pub fn pool(&self) -> &[u32] {
        &self.pool
    }
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Starts an empty sequence; its sink and window buffers are allocated now.
    pub fn add_sequence(&mut self) -> SeqId {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let s = &self.scheme;
        let sinks = |_t: Tensor| s.sinks as usize;
        let cap = [
            layout::window_capacity(s, Tensor::Key),
            layout::window_capacity(s, Tensor::Value),
        ];
        let seq = Sequence {
            tokens: 0,
            table: Vec::new(),
            first_block: 0,
            quantized: [0, 0],
            sinks: [
                Buf::new(sinks(Tensor::Key) * h * d, s.dtype),
                Buf::new(sinks(Tensor::Value) * h * d, s.dtype),
            ],
            ring: [Buf::new(cap[0] * h * d, s.dtype), Buf::new(cap[1] * h * d, s.dtype)],
            ring_cap: cap,
            means: [None, None],
        };
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, seq);
        id
    }

    /// Frees a sequence; its blocks go back to the pool for reuse.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        let seq = self.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
        self.free.extend(seq.table.iter().rev());
        self.give_blocks(seq.table.len());
        Ok(())
    }

    /// Live sequence ids, ascending.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Tokens held by a sequence.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.tokens)
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or(Error::UnknownSequence(id))
    }

    /// The blocks the sequence holds, oldest first. Without eviction that
    /// is its whole block table; after it, the blocks from logical block
    /// [`SeqView::first_block`] on.
    pub fn block_table(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.table)
    }

    /// Appends one token: `k`, `v` are `[Hkv, D]`.
    pub fn append(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> Result<()> {
        let row = self.shape.kv_heads * self.shape.head_dim;
        if k.len() != row || v.len() != row {
            return Err(Error::Shape {
                what: "appended token",
                expected: format!("{row} values (kv_heads x head_dim) for key and value"),
                got: format!("{} and {}", k.len(), v.len()),
            });
        }
        self.extend(id, k, v)
    }

    /// Appends many tokens at once (prefill): `k`, `v` are `[n, Hkv, D]`.
    /// Gives the same cache, bit for bit, as `n` calls to [`Self::append`].
    /// With an eviction window ([`Self::set_eviction_window`]) it then
    /// frees the blocks that window no longer sees ([`Self::evict`]).
    pub fn extend(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> Result<()> {
        self.extend_held(id, k, v)?;
        self.evict(id)?;
        Ok(())
    }

    /// Makes the cache hold, for every sequence, only the blocks a sliding
    /// window of `window` tokens still reads: after each append or extend
    /// (and now), a block whose tokens all lie before the last `window`
    /// tokens goes back to the pool. Sinks and the full-precision window
    /// are buffers of their own and stay; a block is freed only once both
    /// tensors have stored all of its tokens (a channel group never spans
    /// two blocks), so every token a window-`window` query reads is stored
    /// exactly as without eviction. Decode over an evicted sequence must
    /// then use a window of at most `window` tokens; a wider one is refused
    /// with [`Error::Evicted`]. `None` stops evicting (evicted blocks stay
    /// gone). A window of 0 tokens is refused.
    ///
    /// ```
    /// use kivi_runtime::{CacheConfig, PagedCache};
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Mqa(4), 64).unwrap();
    /// let mut c = PagedCache::new(s, CacheConfig::for_tokens(4096)).unwrap();
    /// c.set_eviction_window(Some(512)).unwrap();
    /// let id = c.add_sequence();
    /// let row: Vec<f32> = (0..64).map(|i| (i as f32).sin()).collect();
    /// for _ in 0..4000 {
    ///     c.append(id, &row, &row).unwrap();
    /// }
    /// // 512 visible tokens need at most ceil(512 / 64) + 1 blocks of 64.
    /// assert!(c.memory().blocks_in_use <= 9);
    /// // Tokens 0..3456 (54 blocks) are gone: every one before 4000 - 512.
    /// assert_eq!(c.evicted_tokens(id).unwrap(), 3456);
    /// ```
    pub fn set_eviction_window(&mut self, window: Option<usize>) -> Result<()> {
        if window == Some(0) {
            return Err(Error::Config(
                "an eviction window of 0 tokens would evict tokens a decode still reads; use None or at least 1".into(),
            ));
        }
        self.evict_window = window;
        for id in self.sequences() {
            self.evict(id)?;
        }
        Ok(())
    }

    /// The eviction window ([`Self::set_eviction_window`]).
    pub fn eviction_window(&self) -> Option<usize> {
        self.evict_window
    }

    /// Frees the blocks of sequence `id` that the eviction window no longer
    /// sees (none without one); returns how many. [`Self::extend`] and
    /// [`Self::append`] call it; many-query attention, whose first queries
    /// see further back than the last, calls it once they are answered.
    pub fn evict(&mut self, id: SeqId) -> Result<usize> {
        let tokens = self.seq(id)?.tokens;
        Ok(match self.evict_window {
            Some(w) => self.evict_before(id, tokens.saturating_sub(w)),
            None => 0,
        })
    }

    /// Frees the blocks of `id` whose tokens all lie before position
    /// `keep_from` and are stored in both tensors.
    fn evict_before(&mut self, id: SeqId, keep_from: usize) -> usize {
        let bt = self.layout.block_tokens;
        let sinks = self.scheme.sinks as usize;
        let Some(seq) = self.seqs.get_mut(&id) else { return 0 };
        let stored = seq.quantized[0].min(seq.quantized[1]);
        // Logical blocks 0..upto lie wholly before `keep_from` and are
        // written for good (later writes go past the stored tokens).
        let upto = keep_from.saturating_sub(sinks).min(stored) / bt;
        let n = upto.saturating_sub(seq.first_block).min(seq.table.len());
        if n == 0 {
            return 0;
        }
        // Pushed newest first, so that the oldest is reused first and
        // `restore` can take exactly these back off the top.
        self.free.extend(seq.table[..n].iter().rev());
        seq.table.drain(..n);
        seq.first_block += n;
        self.give_blocks(n);
        n
    }

    /// Tokens of sequence `id` evicted so far: positions `sinks ..
    /// sinks + evicted_tokens` are no longer held (the sinks always are).
    pub fn evicted_tokens(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.evicted_tokens(self.layout.block_tokens))
    }

    /// Refuses, with [`Error::Evicted`], attention over sequence `id`
    /// that would read evicted tokens: a query at position `pos` (the
    /// sequence then holding `pos + 1` tokens) under `window`.
    pub fn check_readable(&self, id: SeqId, pos: usize, window: Option<usize>) -> Result<()> {
        let seq = self.seq(id)?;
        let evicted = seq.evicted_tokens(self.layout.block_tokens);
        if evicted == 0 {
            return Ok(());
        }
        let start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let first_held = self.scheme.sinks as usize + evicted;
        if start < first_held {
            return Err(Error::Evicted {
                seq: id,
                start,
                first_held,
                window: self.evict_window,
            });
        }
        Ok(())
    }

    /// [`Self::extend`] without the eviction: what many-query attention
    /// appends with, since its earlier queries read further back.
    pub(crate) fn extend_held(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> Result<()> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        if k.len() != v.len() || !k.len().is_multiple_of(h * d) {
            return Err(Error::Shape {
                what: "key/value input",
                expected: format!("equal lengths, multiples of {} (kv_heads x head_dim)", h * d),
                got: format!("{} and {}", k.len(), v.len()),
            });
        }
        let old_tokens = self.seq(id)?.tokens;
        // Bad input, and anything the vectorised writes decline, takes the
        // reference path: it names the offending value and changes nothing.
        // vq tensors are coded by `crate::vq` on the reference path.
        if let Some(isa) = self.write_isa.filter(|_| !self.scheme.has_vq()) {
            // `full` tensors (the f16 preset) check their rows as they store
            // them instead, reading the input once (`cpu/write.rs`).
            let checked = self.checked_in_store(old_tokens);
            if (checked || self.inputs_ok(isa, [k, v], old_tokens)) && self.extend_fast(isa, id, [k, v], old_tokens)? {
                self.last_write = Some(isa);
                return Ok(());
            }
        }
        self.extend_reference(id, k, v, old_tokens)?;
        self.last_write = None;
        Ok(())
    }

    /// Whether the vectorised writes check this extend's input themselves,
    /// as they store it: both tensors `full` (no groups to overflow, no
    /// window) and no new token a sink, so every new row goes to a block
    /// and a failed write is undone by [`clear_blocks`].
    fn checked_in_store(&self, old_tokens: usize) -> bool {
        self.scheme.key == Codec::Full && self.scheme.value == Codec::Full && old_tokens >= self.scheme.sinks as usize
    }

    /// Whether every input value is finite in the activation dtype and
    /// storable by its tensor's groups (what `round_inputs` and
    /// [`check_storable`] check, vectorised; they report the error).
    fn inputs_ok(&self, isa: Isa, x: [&[f32]; 2], old_tokens: usize) -> bool {
        use rayon::prelude::*;
        let row = self.shape.kv_heads * self.shape.head_dim;
        let dtype = self.scheme.dtype;
        [Tensor::Key, Tensor::Value].iter().all(|&t| {
            let x = x[ti(t)];
            // Elements from `from` on are range-checked too.
            let (limit, from) = match storable_bound(&self.scheme, t, self.codec(t).map(|c| &c.levels[..])) {
                Some((limit, first)) => (limit, first.saturating_sub(old_tokens) * row),
                None => (f32::MAX, x.len()),
            };
            const CHUNK: usize = 1 << 16;
            if x.len() <= CHUNK {
                return write::inputs_ok(isa, x, dtype, from, limit);
            }
            x.par_chunks(CHUNK).enumerate().all(|(c, part)| {
                let from = from.saturating_sub(c * CHUNK);
                write::inputs_ok(isa, part, dtype, from, limit)
            })
        })
    }

    /// The vectorised writes, once the inputs are known to be good:
    /// uniform codes, `full` rows, windows, sinks and token-axis codec
    /// pipelines (centering, rotation, outliers, Lloyd–Max levels) by
    /// `cpu/write.rs`, one job per block, blocks in parallel when there are
    /// many; the pipelines `write::pipeline_fits` declines (more than 16
    /// outliers a token, channel groups too large to buffer) by the
    /// reference `quantize_range`.
    /// `Ok(false)`: declined with nothing visible changed.
    fn extend_fast(&mut self, isa: Isa, id: SeqId, x: [&[f32]; 2], old_tokens: usize) -> Result<bool> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let n = x[0].len() / (h * d);
        let new_tokens = old_tokens + n;
        let target = [
            regions(&self.scheme, Tensor::Key, new_tokens).quantized,
            regions(&self.scheme, Tensor::Value, new_tokens).quantized,
        ];
        let pipeline = [0, 1].map(|i| self.codecs[i].as_ref().is_some_and(|c| !c.is_plain_uniform()));
        // Pipelines run in `cpu/write.rs` too where they fit; the others
        // take `quant.rs`'s path, which reads rounded rows.
        let in_writes = [0, 1].map(|i| self.codecs[i].as_ref().is_some_and(|c| write::pipeline_fits(c, h, d)));
        let mut rounded: [Option<Vec<f32>>; 2] = [None, None];
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            // The centering means, once per sequence, read rounded rows too:
            // only the tokens before `nc` are rounded for them.
            let need = match self.scheme.center_of(t) {
                Some(nc) if self.seqs.get(&id).is_some_and(|s| s.means[i].is_none()) && new_tokens >= nc => {
                    (nc - old_tokens.min(nc)) * h * d
                }
                _ => 0,
            };
            let len = if pipeline[i] && !in_writes[i] { x[i].len() } else { need };
            if len > 0 {
                // Validated above; were it to fail, the reference path reports it.
                let Ok(r) = round_inputs(&self.scheme, t.name(), &x[i][..len], h, d) else {
                    return Ok(false);
                };
                rounded[i] = Some(r);
            }
        }
        let bt = self.layout.block_tokens;
        let PagedCache {
            scheme,
            layout,
            pool,
            free,
            max_blocks,
            seqs,
            codecs,
            shared,
            ..
        } = self;
        let seq = seqs.get_mut(&id).ok_or(Error::UnknownSequence(id))?;
        let blocks = target[0].max(target[1]).div_ceil(bt);
        let need = blocks.saturating_sub(seq.first_block + seq.table.len());
        if need > free.len() {
            return Err(Error::OutOfBlocks {
                need,
                free: free.len(),
                total: *max_blocks,
            });
        }
        // Charged to the shared pool before anything is written; given
        // back on every way out below that does not commit.
        let block_bytes = layout.block_bytes();
        let shared: Option<&BlockPool> = shared.as_ref().filter(|_| need > 0);
        if let Some(p) = shared {
            p.take(need, block_bytes)?;
        }
        // The fresh blocks join the table now (no allocation once the table
        // has grown) and leave it again if anything fails below.
        let split = free.len() - need;
        let old_len = seq.table.len();
        seq.table.extend(free[split..].iter().rev());
        let sinks = scheme.sinks as usize;
        let mut new_means: [Option<Vec<f32>>; 2] = [None, None];
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            let Some(nc) = scheme.center_of(t) else { continue };
            if seq.means[i].is_none() && new_tokens >= nc {
                // Rounded above: the tokens from `old_tokens` up to `nc` (none left
                // when `old_tokens >= nc`).
                let input = rounded[i].as_deref().unwrap_or(&[]);
                new_means[i] = Some(center_means(scheme.dtype, sinks, seq, i, input, old_tokens, nc, h, d));
            }
        }
        // One slot a tensor, on the stack: an append allocates nothing.
        let mut writes: [Option<TensorWrite>; 2] = [None, None];
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            let range = seq.quantized[i]..target[i];
            if range.is_empty() {
                continue;
            }
            let means = new_means[i].as_deref().or(seq.means[i].as_deref());
            if let (false, Some(input)) = (in_writes[i], rounded[i].as_deref()) {
                let seq_ref: &Sequence = seq;
                let src = |j: usize, hh: usize, out: &mut [f32]| {
                    let p = sinks + j;
                    if p >= old_tokens {
                        out.copy_from_slice(&input[((p - old_tokens) * h + hh) * d..][..d]);
                    } else {
                        let base = ((j % seq_ref.ring_cap[i]) * h + hh) * d;
                        for (c, o) in out.iter_mut().enumerate() {
                            *o = seq_ref.ring[i].get(base + c);
                        }
                    }
                };
                let r = quantize_blocks(
                    scheme,
                    layout,
                    t,
                    pool,
                    seq.blocks(),
                    range,
                    sinks,
                    &src,
                    codecs[i].as_ref(),
                    means,
                );
                if let Err(e) = r {
                    seq.table.truncate(old_len);
                    if let Some(p) = shared {
                        p.give(need, block_bytes);
                    }
                    return Err(e);
                }
                continue;
            }
            let quant = codecs[i].as_ref().map(|c| c.quant);
            writes[i] = Some(TensorWrite {
                range,
                plan: write::Plan {
                    tl: layout.tensor(t),
                    head_words: layout.head_words,
                    offset: layout.tensor_offset(0, t),
                    quant,
                    dtype: scheme.dtype,
                    isa: write::tensor_isa(isa, quant.as_ref(), d),
                    pipeline: codecs[i]
                        .as_ref()
                        .filter(|_| pipeline[i])
                        .map(|codec| write::Pipeline { codec, means }),
                },
                rows: write::Rows {
                    input: x[i],
                    ring: seq.ring[i].raw(),
                    ring_cap: seq.ring_cap[i],
                    sinks,
                    old_tokens,
                    heads: h,
                    d,
                },
            });
        }
        let ok = write_blocks(layout, pool, seq.blocks(), &writes);
        if !ok {
            // A row failed its check (`full` tensors only): zero the rows
            // this write may have stored, which no reader could see.
            clear_blocks(layout, pool, seq.blocks(), &writes, h);
            seq.table.truncate(old_len);
            if let Some(p) = shared {
                p.give(need, block_bytes);
            }
            return Ok(false);
        }
        // Commit: nothing below can fail.
        free.truncate(split);
        for (m, new) in seq.means.iter_mut().zip(new_means) {
            if new.is_some() {
                *m = new;
            }
        }
        let row = h * d;
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            for p in old_tokens..new_tokens {
                let src = &x[i][(p - old_tokens) * row..][..row];
                let (buf, base) = if p < sinks {
                    (&mut seq.sinks[i], p * row)
                } else if p >= sinks + target[i] {
                    (&mut seq.ring[i], ((p - sinks) % seq.ring_cap[i]) * row)
                } else {
                    continue;
                };
                match buf {
                    Buf::Half(v, dt) => write::round_into_bits(isa, src, &mut v[base..base + row], *dt),
                    // f32 activations are stored as given (rounding is the identity).
                    Buf::Single(v) => v[base..base + row].copy_from_slice(src),
                }
            }
            seq.quantized[i] = target[i];
        }
        seq.tokens = new_tokens;
        Ok(true)
    }

    /// [`Self::extend`] on the reference path.
    fn extend_reference(&mut self, id: SeqId, k: &[f32], v: &[f32], old_tokens: usize) -> Result<()> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let n = k.len() / (h * d);
        let shift = |e: Error| match e {
            Error::NonFinite {
                tensor,
                value,
                token,
                head,
                channel,
                policy,
            } => Error::NonFinite {
                tensor,
                value,
                token: token + old_tokens,
                head,
                channel,
                policy,
            },
            e => e,
        };
        let inputs = [
            round_inputs(&self.scheme, "key", k, h, d).map_err(shift)?,
            round_inputs(&self.scheme, "value", v, h, d).map_err(shift)?,
        ];
        // A value that some group could not quantize is refused by the append
        // that brings it: refused later, when it leaves the window, it would
        // wedge the sequence (every later append would fail on it).
        let levels = [Tensor::Key, Tensor::Value].map(|t| self.codec(t).map(|c| &c.levels[..]));
        check_storable(&self.scheme, [k, v], [&inputs[0], &inputs[1]], old_tokens, h, d, levels)?;
        let new_tokens = old_tokens + n;
        let target = [
            regions(&self.scheme, Tensor::Key, new_tokens).quantized,
            regions(&self.scheme, Tensor::Value, new_tokens).quantized,
        ];
        let bt = self.layout.block_tokens;
        let seq = self.seqs.get_mut(&id).expect("checked above");
        let blocks = target[0].max(target[1]).div_ceil(bt);
        let need = blocks.saturating_sub(seq.first_block + seq.table.len());
        if need > self.free.len() {
            return Err(Error::OutOfBlocks {
                need,
                free: self.free.len(),
                total: self.max_blocks,
            });
        }
        let block_bytes = self.layout.block_bytes();
        let shared = self.shared.as_ref().filter(|_| need > 0);
        if let Some(p) = shared {
            p.take(need, block_bytes)?;
        }
        let split = self.free.len() - need;
        let fresh: Vec<u32> = self.free[split..].iter().rev().copied().collect();
        let mut table = seq.table.clone();
        table.extend(&fresh);
        let sinks = self.scheme.sinks as usize;
        // Centering means become known when the first N tokens exist; that
        // is never after the first token is quantized (validated: N <=
        // sinks + residual), and no stored token has wrapped in the ring yet.
        let mut means = seq.means.clone();
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            let Some(n) = self.scheme.center_of(t) else { continue };
            if means[i].is_some() || new_tokens < n {
                continue;
            }
            means[i] = Some(center_means(
                self.scheme.dtype,
                sinks,
                seq,
                i,
                &inputs[i],
                old_tokens,
                n,
                h,
                d,
            ));
        }
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            let seq_ref: &Sequence = seq;
            let input = &inputs[i];
            // Row of relative token j (position sinks + j) of head `hh`.
            let src = |j: usize, hh: usize, out: &mut [f32]| {
                let p = sinks + j;
                if p >= old_tokens {
                    out.copy_from_slice(&input[((p - old_tokens) * h + hh) * d..][..d]);
                } else {
                    let base = ((j % seq_ref.ring_cap[i]) * h + hh) * d;
                    for (c, o) in out.iter_mut().enumerate() {
                        *o = seq_ref.ring[i].get(base + c);
                    }
                }
            };
            if let Some(book) = &self.vq[i] {
                vq_range(
                    &self.layout,
                    t,
                    &mut self.pool,
                    Blocks {
                        ids: &table,
                        first: seq_ref.first_block,
                    },
                    seq_ref.quantized[i]..target[i],
                    &src,
                    book,
                );
                continue;
            }
            // On error nothing visible changed; `fresh` is still free and
            // the pool gets its bytes back.
            let r = quantize_range(
                &self.scheme,
                &self.layout,
                t,
                &mut self.pool,
                Blocks {
                    ids: &table,
                    first: seq_ref.first_block,
                },
                seq_ref.quantized[i]..target[i],
                sinks,
                &src,
                self.codecs[i].as_ref(),
                means[i].as_deref(),
            );
            if let Err(e) = r {
                if let Some(p) = shared {
                    p.give(need, block_bytes);
                }
                return Err(e);
            }
        }
        // Commit: nothing below can fail.
        self.free.truncate(split);
        seq.table = table;
        seq.means = means;
        for t in [Tensor::Key, Tensor::Value] {
            let i = ti(t);
            let input = &inputs[i];
            for p in old_tokens..new_tokens {
                let row = &input[(p - old_tokens) * h * d..][..h * d];
                let dst = if p < sinks {
                    Some((&mut seq.sinks[i], p * h * d))
                } else if p >= sinks + target[i] {
                    let slot = (p - sinks) % seq.ring_cap[i];
                    Some((&mut seq.ring[i], slot * h * d))
                } else {
                    None
                };
                if let Some((buf, base)) = dst {
                    for (c, x) in row.iter().enumerate() {
                        buf.set(base + c, *x);
                    }
                }
            }
            seq.quantized[i] = target[i];
        }
        seq.tokens = new_tokens;
        Ok(())
    }

    /// Read access to one sequence for kernels and tests.
    pub fn view(&self, id: SeqId) -> Result<SeqView<'_>> {
        let seq = self.seq(id)?;
        Ok(SeqView { cache: self, seq })
    }

    /// The cache's view of one tensor: `[T, Hkv, D]` f32, dequantized where
    /// quantized, stored values for sinks and window tokens.
    pub fn dequantize(&self, id: SeqId, t: Tensor) -> Result<Vec<f32>> {
        let view = self.view(id)?;
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let mut out = vec![0f32; view.tokens() * h * d];
        for p in 0..view.tokens() {
            for hh in 0..h {
                view.row(t, p, hh, &mut out[(p * h + hh) * d..][..d]);
            }
        }
        Ok(out)
    }

    fn seq_memory(&self, seq: &Sequence) -> MemoryReport {
        let l = &self.layout;
        let blocks = seq.table.len();
        let heads = self.shape.kv_heads;
        let codes = blocks * heads * (l.key.codes_words() + l.value.codes_words()) * 4;
        let scales = blocks * heads * (l.key.param_words + l.value.param_words) * 4;
        let zeros = blocks * heads * (l.key.zero_words + l.value.zero_words) * 4;
        let per_token = |tl: &TensorLayout| tl.block_tokens * (tl.outlier_idx_words + tl.outlier_val_words);
        let outliers = blocks * heads * (per_token(&l.key) + per_token(&l.value)) * 4;
        let means: usize = seq
            .means
            .iter()
            .flatten()
            .map(|m| m.len() * self.scheme.dtype.bytes())
            .sum();
        let windows: usize = seq.sinks.iter().chain(&seq.ring).map(Buf::bytes).sum();
        let tables = seq.table.len() * 4;
        MemoryReport {
            codes,
            scales,
            zeros,
            outliers,
            means,
            codebooks: 0,
            bases: 0,
            windows,
            tables,
            blocks_in_use: blocks,
            total: codes + scales + zeros + outliers + means + windows + tables,
        }
    }

    /// Bytes one sequence holds.
    pub fn sequence_memory(&self, id: SeqId) -> Result<MemoryReport> {
        Ok(self.seq_memory(self.seq(id)?))
    }

    /// Bytes the whole cache holds: every sequence's blocks, outliers,
    /// means, windows and tables, and the Lloyd–Max tables (once).
    pub fn memory(&self) -> MemoryReport {
        let mut m = MemoryReport::default();
        for s in self.seqs.values() {
            let r = self.seq_memory(s);
            m.codes += r.codes;
            m.scales += r.scales;
            m.zeros += r.zeros;
            m.outliers += r.outliers;
            m.means += r.means;
            m.windows += r.windows;
            m.tables += r.tables;
            m.blocks_in_use += r.blocks_in_use;
            m.total += r.total;
        }
        m.codebooks = self.codebook_bytes();
        m.total += m.codebooks;
        m
    }

    /// Bytes of the Lloyd–Max tables this scheme's kernels keep (one
    /// `2^b`-entry f32 table per Lloyd–Max tensor).
    pub fn codebook_bytes(&self) -> usize {
        let tables: usize = self
            .codecs
            .iter()
            .flatten()
            .filter(|c| c.quant.levels != kivi_spec::Levels::Uniform)
            .map(|c| (1usize << c.quant.bits) * 4)
            .sum();
        // vq codebooks, a set that keys and values share by name once.
        let vq: usize = match &self.vq {
            [Some(k), Some(v)] if k.name.is_some() && k.name == v.name => k.bytes(),
            books => books.iter().flatten().map(|b| b.bytes()).sum(),
        };
        tables + vq
    }

    /// The named (shared) vq codebooks this cache decodes with, each name
    /// once, with their bytes: what a caller summing several caches (the
    /// layers of a model) counts once per name ([`Self::codebook_bytes`]
    /// counts them in every cache).
    pub fn shared_codebooks(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = Vec::new();
        for b in self.vq.iter().flatten() {
            if let Some(n) = &b.name {
                if !out.iter().any(|(m, _)| m == n) {
                    out.push((n.clone(), b.bytes()));
                }
            }
        }
        out
    }

    /// The product codebooks of tensor `t`, if it is `vq(...)`.
    pub fn vq_book(&self, t: Tensor) -> Option<&Arc<crate::vq::VqBook>> {
        self.vq[ti(t)].as_ref()
    }

    /// The codec pipeline of tensor `t` (`None` for a `full` tensor).
    pub fn codec(&self, t: Tensor) -> Option<&TensorCodec> {
        self.codecs[ti(t)].as_ref()
    }

    /// What [`Self::restore`] needs to undo later appends to sequence `id`:
    /// a copy of its bookkeeping and sink and window rows, not of its blocks.
    /// Many-query attention appends one block of tokens per sequence of a
    /// batch and must leave the cache unchanged when a later one fails.
    pub(crate) fn checkpoint(&self, id: SeqId) -> Result<Checkpoint> {
        Ok(Checkpoint {
            id,
            seq: self.seq(id)?.clone(),
        })
    }

    /// Undoes every append to the checkpoint's sequence since it was taken.
    /// Enough because an append writes only blocks it takes from the free
    /// list and token slots past a block's stored tokens, which no reader
    /// looks at; the blocks it took go back in the order it took them, so
    /// checkpoints restored newest first give back the free list exactly.
    pub(crate) fn restore(&mut self, cp: Checkpoint) {
        if let Some(seq) = self.seqs.get_mut(&cp.id) {
            // Blocks evicted since sit on top of the free list (pushed
            // newest first); take them back off before returning the
            // blocks taken, in the reverse order of what happened.
            let evicted = seq.first_block - cp.seq.first_block;
            let mut logical: Vec<u32> = self.free.drain(self.free.len() - evicted..).rev().collect();
            logical.extend(&seq.table);
            let taken = logical.get(cp.seq.table.len()..).unwrap_or(&[]);
            self.free.extend(taken.iter().rev());
            // The pool: the evicted blocks are held again (the pool lent
            // them before; nothing else can have written them), the taken
            // ones are given back.
            let taken = taken.len();
            *seq = cp.seq;
            if let Some(p) = &self.shared {
                let bb = self.layout.block_bytes();
                p.retake(evicted, bb);
                p.give(taken, bb);
            }
        }
    }

    /// Draws this cache's blocks from `pool` (shared with other caches,
    /// e.g. every layer of a model: [`crate::pool`]) instead of from its
    /// own capacity alone; `None` detaches it. The blocks it holds now move
    /// with it: charged to the new pool (refused with
    /// [`Error::PoolExhausted`], the cache unchanged, if they do not fit)
    /// and given back to the old one. `max_blocks` still bounds this
    /// cache's own block slots.
    pub fn set_pool(&mut self, pool: Option<BlockPool>) -> Result<()> {
        let held: usize = self.seqs.values().map(|s| s.table.len()).sum();
        let bb = self.layout.block_bytes();
        if let Some(new) = &pool {
            if self.shared.as_ref().is_some_and(|old| old.same_pool(new)) {
                return Ok(());
            }
            new.take(held, bb)?;
        }
        if let Some(old) = &self.shared {
            old.give(held, bb);
        }
        self.shared = pool;
        Ok(())
    }

    /// The shared pool this cache draws on ([`Self::set_pool`]).
    pub fn block_pool(&self) -> Option<&BlockPool> {
        self.shared.as_ref()
    }

    /// Gives `n` freed blocks back to the shared pool, if any.
    fn give_blocks(&self, n: usize) {
        if let Some(p) = &self.shared {
            p.give(n, self.layout.block_bytes());
        }
    }
}

/// A cache dropped with blocks in use gives their bytes back to the shared
/// pool, so that other caches on it can use them.
impl Drop for PagedCache {
    fn drop(&mut self) {
        let held: usize = self.seqs.values().map(|s| s.table.len()).sum();
        self.give_blocks(held);
    }
}

/// A sequence's state before some appends ([`PagedCache::checkpoint`]).
pub(crate) struct Checkpoint {
    id: SeqId,
    seq: Sequence,
}

/// The per-channel centering means of tensor `i` over the first `nc`
/// tokens, `[Hkv][D]`: stored rows (sinks, ring) for tokens before
/// `old_tokens`, `input` (rounded, from `old_tokens` on) for the rest.
#[allow(clippy::too_many_arguments)]
fn center_means(
    dtype: Dtype,
    sinks: usize,
    seq: &Sequence,
    i: usize,
    input: &[f32],
    old_tokens: usize,
    nc: usize,
    h: usize,
    d: usize,
) -> Vec<f32> {
    let mut rows = vec![0f32; nc * h * d];
    for p in 0..nc {
        for hh in 0..h {
            let out = &mut rows[(p * h + hh) * d..][..d];
            if p >= old_tokens {
                out.copy_from_slice(&input[((p - old_tokens) * h + hh) * d..][..d]);
            } else if p < sinks {
                for (c, o) in out.iter_mut().enumerate() {
                    *o = seq.sinks[i].get((p * h + hh) * d + c);
                }
            } else {
                let base = (((p - sinks) % seq.ring_cap[i]) * h + hh) * d;
                for (c, o) in out.iter_mut().enumerate() {
                    *o = seq.ring[i].get(base + c);
                }
            }
        }
    }
    let mut m = Vec::with_capacity(h * d);
    for hh in 0..h {
        m.extend(quant::channel_mean(
            (0..nc).map(|p| &rows[(p * h + hh) * d..][..d]),
            d,
            dtype,
        ));
    }
    m
}

/// The pool, shared by the parallel writes of one extend: each writes only
/// its own (block, KV head, tensor) part, and a block table holds no block
/// twice, so no two of them touch the same word.
struct PoolPtr(*mut u32, usize);
// SAFETY: see above; the parts handed out are disjoint.
unsafe impl Send for PoolPtr {}
unsafe impl Sync for PoolPtr {}

impl PoolPtr {
    /// Words `start..start + len`.
    ///
    /// # Safety
    /// In bounds, and no other live slice overlaps them.
    #[allow(clippy::mut_from_ref)] // the point: disjoint parts for parallel jobs
    unsafe fn part(&self, start: usize, len: usize) -> &mut [u32] {
        debug_assert!(start + len <= self.1);
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// Below this many values a thread hand-off costs more than it saves (an
/// append writes one token, or one channel group every G tokens).
const PARALLEL_VALUES: usize = 1 << 15;

/// One tensor's share of a vectorised write: relative tokens `range`.
struct TensorWrite<'a> {
    range: std::ops::Range<usize>,
    plan: write::Plan<'a>,
    rows: write::Rows<'a>,
}

/// Writes every tensor's range with the vectorised writes (`cpu/write.rs`),
/// one job per block (every head, both tensors); blocks in parallel when
/// there are enough values to pay for it. `false`: a group's parameters
/// overflow their dtype (nothing visible has changed).
fn write_blocks(l: &BlockLayout, pool: &mut [u32], table: Blocks, writes: &[Option<TensorWrite>]) -> bool {
    use rayon::prelude::*;
    let (bt, bw) = (l.block_tokens, l.block_words);
    let Some(lo) = writes.iter().flatten().map(|w| w.range.start / bt).min() else {
        return true;
    };
    let hi = writes
        .iter()
        .flatten()
        .map(|w| w.range.end.div_ceil(bt))
        .max()
        .unwrap_or(lo);
    let job = |block: &mut [u32], b: usize| {
        writes.iter().flatten().all(|w| {
            let first = w.range.start.max(b * bt);
            let end = w.range.end.min((b + 1) * bt);
            first >= end
                || write::run(
                    &w.plan,
                    &w.rows,
                    &mut write::Job {
                        block,
                        first,
                        n: end - first,
                    },
                )
        })
    };
    let values: usize =
        writes.iter().flatten().map(|w| w.range.len()).sum::<usize>() * l.shape.kv_heads * l.shape.head_dim;
    if values < PARALLEL_VALUES || hi - lo < 2 {
        return (lo..hi).all(|b| {
            let start = table[b] as usize * bw;
            job(&mut pool[start..start + bw], b)
        });
    }
    // Every block must lie in the pool before any is handed out.
    if (lo..hi).any(|b| (table[b] as usize + 1) * bw > pool.len()) {
        return false;
    }
    let base = PoolPtr(pool.as_mut_ptr(), pool.len());
    (lo..hi).into_par_iter().all(|b| {
        // SAFETY: in bounds (checked above) and disjoint from every other
        // job's block (`PoolPtr`); `pool` is borrowed mutably for the call.
        let block = unsafe { base.part(table[b] as usize * bw, bw) };
        job(block, b)
    })
}

/// After a failed [`write_blocks`], zeroes every row of the `full` tensors'
/// ranges (`write::clear_rows`): the rows a checked write may have stored
/// before it met a bad value, in blocks and block tails that hold no token
/// yet. Quantized tensors are left as they are: their input is checked
/// before anything is written (`PagedCache::inputs_ok`).
fn clear_blocks(l: &BlockLayout, pool: &mut [u32], table: Blocks, writes: &[Option<TensorWrite>], heads: usize) {
    let (bt, bw) = (l.block_tokens, l.block_words);
    for w in writes.iter().flatten().filter(|w| w.plan.quant.is_none()) {
        for b in w.range.start / bt..w.range.end.div_ceil(bt) {
            let start = table[b] as usize * bw;
            let Some(block) = pool.get_mut(start..start + bw) else {
                continue;
            };
            let first = w.range.start.max(b * bt);
            let end = w.range.end.min((b + 1) * bt);
            write::clear_rows(
                &w.plan,
                heads,
                &mut write::Job {
                    block,
                    first,
                    n: end - first,
                },
            );
        }
    }
}

/// Words of a tensor part of one block of the pool.
fn part_mut<'a>(l: &BlockLayout, pool: &'a mut [u32], block: u32, h: usize, t: Tensor) -> &'a mut [u32] {
    let start = block as usize * l.block_words + l.tensor_offset(h, t);
    &mut pool[start..start + l.tensor(t).words]
}

/// [`quantize_range`] block by block, blocks in parallel when there are
/// enough values to pay for it. Each block is handed over as a pool of its
/// own (table `[0]`, tokens shifted to it, `sinks` shifted alike so that an
/// error names the true token); the first error in token order wins, as
/// in one sequential pass.
#[allow(clippy::too_many_arguments)]
fn quantize_blocks(
    s: &Scheme,
    l: &BlockLayout,
    t: Tensor,
    pool: &mut [u32],
    table: Blocks,
    range: std::ops::Range<usize>,
    sinks: usize,
    src: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
    codec: Option<&TensorCodec>,
    means: Option<&[f32]>,
) -> Result<()> {
    use rayon::prelude::*;
    let (bt, bw) = (l.block_tokens, l.block_words);
    let blocks = range.start / bt..range.end.div_ceil(bt);
    let values = range.len() * l.shape.kv_heads * l.shape.head_dim;
    if values < PARALLEL_VALUES || blocks.len() < 2 || blocks.clone().any(|b| (table[b] as usize + 1) * bw > pool.len())
    {
        return quantize_range(s, l, t, pool, table, range, sinks, src, codec, means);
    }
    let base = PoolPtr(pool.as_mut_ptr(), pool.len());
    let results: Vec<Result<()>> = blocks
        .into_par_iter()
        .map(|b| {
            let (first, end) = (range.start.max(b * bt), range.end.min((b + 1) * bt));
            let shift = b * bt;
            // SAFETY: in bounds (checked above) and disjoint from every
            // other job's block (`PoolPtr`); `pool` is borrowed mutably.
            let block = unsafe { base.part(table[b] as usize * bw, bw) };
            let local = |j: usize, hh: usize, out: &mut [f32]| src(j + shift, hh, out);
            quantize_range(
                s,
                l,
                t,
                block,
                Blocks { ids: &[0], first: 0 },
                first - shift..end - shift,
                sinks + shift,
                &local,
                codec,
                means,
            )
        })
        .collect();
    results.into_iter().collect()
}

/// Quantizes relative tokens `range` of tensor `t` into the blocks of `table`,
/// through the tensor's codec pipeline (see `reference::cache_view` for the
/// steps; the arithmetic here is the same, call for call).
#[allow(clippy::too_many_arguments)]
fn quantize_range(
    s: &Scheme,
    l: &BlockLayout,
    t: Tensor,
    pool: &mut [u32],
    table: Blocks,
    range: std::ops::Range<usize>,
    sinks: usize,
    src: &dyn Fn(usize, usize, &mut [f32]),
    codec: Option<&TensorCodec>,
    means: Option<&[f32]>,
) -> Result<()> {
    let (h, d) = (l.shape.kv_heads, l.shape.head_dim);
    let tl = *l.tensor(t);
    let bt = l.block_tokens;
    let wpt = tl.words_per_token;
    let Some(codec) = codec else {
        let mut row = vec![0f32; d];
        for j in range {
            for hh in 0..h {
                src(j, hh, &mut row);
                let part = part_mut(l, pool, table[j / bt], hh, t);
                write_raw_row(&mut part[(j % bt) * wpt..][..wpt], &row, s.dtype);
            }
        }
        return Ok(());
    };
    let q = codec.quant;
    let g = q.group as usize;
    // Tokens quantized together: a channel group, or one token.
    let unit = match q.axis {
        Axis::Channel => g,
        Axis::Token => 1,
    };
    let mut rows = vec![0f32; unit * d];
    let mut codes = vec![0u32; unit * d];
    let mut params = vec![GroupParams { scale: 0.0, zero: 0.0 }; unit * d];
    let mut vals = vec![0f32; g];
    let mut gcodes = vec![0u32; g];
    let mut outl: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); unit];
    for j0 in range.step_by(unit) {
        for hh in 0..h {
            let mean = means.map(|m| &m[hh * d..(hh + 1) * d]);
            for k in 0..unit {
                let row = &mut rows[k * d..(k + 1) * d];
                src(j0 + k, hh, row);
                codec.forward(row, mean);
                outl[k] = codec.take_outliers(row);
            }
            // Quantize each group; `params[k * d + c]` is the group of (k, c).
            let groups: Vec<(usize, usize)> = match q.axis {
                Axis::Channel => (0..d).map(|c| (0, c)).collect(),
                Axis::Token => (0..d).step_by(g).map(|c0| (0, c0)).collect(),
            };
            for (k0, c0) in groups {
                let member = |i: usize| match q.axis {
                    Axis::Channel => (k0 + i) * d + c0,
                    Axis::Token => k0 * d + c0 + i,
                };
                for (i, v) in vals.iter_mut().enumerate() {
                    *v = rows[member(i)];
                }
                let (p, lo, hi) = codec.quantize_group(&vals, &mut gcodes);
                if !p.is_finite() {
                    return Err(Error::ScaleOverflow {
                        tensor: t.name(),
                        token: sinks + j0 + k0,
                        head: hh,
                        channel: c0,
                        lo,
                        hi,
                        dtype: q.scale.name(),
                    });
                }
                for (i, c) in gcodes.iter().enumerate() {
                    codes[member(i)] = *c;
                    params[member(i)] = p;
                }
            }
            let part = part_mut(l, pool, table[j0 / bt], hh, t);
            // Parameters, at the position of each group's first member.
            match q.axis {
                Axis::Channel => {
                    for (c, p) in params[..d].iter().enumerate() {
                        let i = tl.param_index(j0 % bt, c);
                        write_param(&mut part[tl.scales_offset..], i, p.scale, q.scale);
                        if q.has_zeros() {
                            write_param(&mut part[tl.zeros_offset..], i, p.zero, q.scale);
                        }
                    }
                }
                Axis::Token => {
                    for c0 in (0..d).step_by(g) {
                        let i = tl.param_index(j0 % bt, c0);
                        write_param(&mut part[tl.scales_offset..], i, params[c0].scale, q.scale);
                        if q.has_zeros() {
                            write_param(&mut part[tl.zeros_offset..], i, params[c0].zero, q.scale);
                        }
                    }
                }
            }
            for k in 0..unit {
                let off = (j0 + k) % bt;
                quant::pack(
                    &codes[k * d..(k + 1) * d],
                    q.bits,
                    &mut part[off * wpt..(off + 1) * wpt],
                );
                if tl.outliers > 0 {
                    let (idx, orig) = &outl[k];
                    let mut corr = Vec::with_capacity(idx.len());
                    for (&c, &o) in idx.iter().zip(orig) {
                        let deq = codec.dequantize(codes[k * d + c], params[k * d + c]);
                        corr.push(codec.correction(o, deq).ok_or(Error::OutlierOverflow {
                            tensor: t.name(),
                            token: sinks + j0 + k,
                            head: hh,
                            channel: c,
                            value: o - deq,
                            dtype: s.dtype.name(),
                        })?);
                    }
                    let iw = &mut part[tl.outlier_idx_offset + off * tl.outlier_idx_words..][..tl.outlier_idx_words];
                    for (w, pair) in iw.iter_mut().zip(idx.chunks(2)) {
                        *w = pair[0] as u32 | (pair.get(1).map_or(0, |x| *x as u32) << 16);
                    }
                    let vw = &mut part[tl.outlier_val_offset + off * tl.outlier_val_words..][..tl.outlier_val_words];
                    write_raw_row(vw, &corr, s.dtype);
                }
            }
        }
    }
    Ok(())
}

/// Codes relative tokens `range` of vq tensor `t` into the blocks of
/// `table`: each row through [`crate::vq::VqBook::encode`] (as the oracle
/// codes it), the codes packed like scalar ones.
#[allow(clippy::too_many_arguments)]
fn vq_range(
    l: &BlockLayout,
    t: Tensor,
    pool: &mut [u32],
    table: Blocks,
    range: std::ops::Range<usize>,
    src: &dyn Fn(usize, usize, &mut [f32]),
    book: &crate::vq::VqBook,
) {
    let (h, d) = (l.shape.kv_heads, l.shape.head_dim);
    let (bt, wpt) = (l.block_tokens, l.tensor(t).words_per_token);
    let bits = book.entries.trailing_zeros();
    let mut row = vec![0f32; d];
    let mut codes = vec![0u32; book.subvectors];
    for j in range {
        for hh in 0..h {
            src(j, hh, &mut row);
            book.encode(&row, &mut codes);
            let part = part_mut(l, pool, table[j / bt], hh, t);
            quant::pack(&codes, bits, &mut part[(j % bt) * wpt..][..wpt]);
        }
    }
}

/// Raw rows of a sink or window buffer, `[slot][kv_head][D]` in the
/// activation dtype (f16/bf16 bits, or f32) — what a kernel reads.
#[derive(Clone, Copy, Debug)]
pub enum RawRows<'a> {
    Bits16(&'a [u16]),
    F32(&'a [f32]),
}

impl Buf {
    fn raw(&self) -> RawRows<'_> {
        match self {
            Buf::Half(v, _) => RawRows::Bits16(v),
            Buf::Single(v) => RawRows::F32(v),
        }
    }
}

/// Read-only access to one sequence.
pub struct SeqView<'a> {
    cache: &'a PagedCache,
    seq: &'a Sequence,
}

impl<'a> SeqView<'a> {
    /// Adds the stored outlier corrections of token `off` of a block part to
    /// its decoded row (in the transformed domain; for pre-RoPE keys, which
    /// have no transform, the pre-RoPE domain: `cpu/rope.rs` adds them
    /// before turning the row).
    pub(crate) fn add_outliers(&self, tl: &TensorLayout, part: &[u32], off: usize, row: &mut [f32]) {
        for k in 0..tl.outliers {
            let iw = part[tl.outlier_idx_offset + off * tl.outlier_idx_words + k / 2];
            let c = ((iw >> (16 * (k % 2))) & 0xffff) as usize;
            let vw = &part[tl.outlier_val_offset + off * tl.outlier_val_words..][..tl.outlier_val_words];
            row[c] += read_raw(vw, k, self.cache.scheme.dtype);
        }
    }

    /// The codec pipeline of tensor `t` (`None` for a `full` tensor).
    pub fn codec(&self, t: Tensor) -> Option<&'a TensorCodec> {
        self.cache.codec(t)
    }

    /// Quantized token `p` of tensor `t`, KV head `h`, decoded in the codec's
    /// transformed domain: codes decoded and outlier corrections added, but
    /// not un-rotated and without the means (what a kernel that rotates the
    /// query instead consumes). `p` must be block-resident.
    pub fn coded_row(&self, t: Tensor, p: usize, h: usize, out: &mut [f32]) {
        let Loc::Block(b, off) = self.locate(t, p) else {
            panic!("coded_row: token {p} is not quantized");
        };
        let part = self.block_part(b, h, t);
        let tl = self.cache.layout.tensor(t);
        let row = &part[off * tl.words_per_token..][..tl.words_per_token];
        let Codec::Quant(q) = self.cache.scheme.codec(t) else {
            panic!("coded_row: a full tensor has no codes");
        };
        match (q.axis, q.levels) {
            // Token-axis Lloyd–Max (the common codec case): one norm per
            // group, the table looked up once, codes unpacked word by word.
            (Axis::Token, kivi_spec::Levels::LloydMax(_) | kivi_spec::Levels::Nuq(_)) => {
                // The codec's table: Lloyd–Max, or this layer's codebook.
                let levels = self.codec(t).map_or(&[][..], |c| &c.levels);
                let (g, per, mask) = (q.group as usize, (32 / q.bits) as usize, (1u32 << q.bits) - 1);
                for (gi, chunk) in out.chunks_mut(g).enumerate() {
                    let s = params_at(tl, part, q, off, gi * g).scale;
                    for (k, o) in chunk.iter_mut().enumerate() {
                        let c = gi * g + k;
                        let code = (row[c / per] >> ((c % per) as u32 * q.bits)) & mask;
                        *o = s * levels[code as usize];
                    }
                }
            }
            _ => {
                let levels = self.codec(t).map_or(&[][..], |c| &c.levels);
                for (c, o) in out.iter_mut().enumerate() {
                    let code = quant::unpack_one(row, q.bits, c);
                    *o = quant::dequantize_in(code, params_at(tl, part, q, off, c), q, levels);
                }
            }
        }
        self.add_outliers(tl, part, off, out);
    }

    /// The centering means of tensor `t`, KV head `h` (`None` if the tensor
    /// is not centered or its means are not known yet).
    pub fn mean(&self, t: Tensor, h: usize) -> Option<&'a [f32]> {
        let d = self.cache.shape.head_dim;
        self.seq.means[ti(t)].as_ref().map(|m| &m[h * d..(h + 1) * d])
    }

    pub fn tokens(&self) -> usize {
        self.seq.tokens
    }
    /// The blocks the sequence still holds, oldest first: logical block
    /// `first_block() + i` is `table()[i]` (see [`Self::block_at`]).
    pub fn table(&self) -> &'a [u32] {
        &self.seq.table
    }
    /// Logical blocks evicted from the front of the table
    /// ([`PagedCache::set_eviction_window`]); 0 without eviction.
    pub fn first_block(&self) -> usize {
        self.seq.first_block
    }
    /// The block holding relative tokens `logical * block_tokens ..`, if
    /// the sequence holds it.
    #[inline]
    pub fn block_at(&self, logical: usize) -> Option<u32> {
        logical
            .checked_sub(self.seq.first_block)
            .and_then(|i| self.seq.table.get(i).copied())
    }
    /// The table as a kernel that indexes blocks from 0 reads it: evicted
    /// entries hold the first held block (never read: attention over them
    /// is refused, [`PagedCache::check_readable`]).
    pub fn logical_table(&self) -> Vec<u32> {
        let filler = self.seq.table.first().copied().unwrap_or(0);
        let mut t = vec![filler; self.seq.first_block];
        t.extend(&self.seq.table);
        t
    }
    /// Whether token `p` was evicted (its block freed).
    #[inline]
    pub fn is_evicted(&self, p: usize) -> bool {
        let sinks = self.cache.scheme.sinks as usize;
        p >= sinks && p - sinks < self.seq.evicted_tokens(self.cache.layout.block_tokens)
    }
    /// Quantized (block-resident) tokens of a tensor.
    pub fn quantized(&self, t: Tensor) -> usize {
        self.seq.quantized[ti(t)]
    }
    /// The sink buffer of tensor `t` (`sinks` slots).
    pub fn sinks_raw(&self, t: Tensor) -> RawRows<'a> {
        self.seq.sinks[ti(t)].raw()
    }
    /// The window ring of tensor `t`; token `p` (not a sink, not quantized)
    /// sits in slot `(p - sinks) % ring_capacity(t)`.
    pub fn ring_raw(&self, t: Tensor) -> RawRows<'a> {
        self.seq.ring[ti(t)].raw()
    }
    /// Slots of the window ring of tensor `t`.
    pub fn ring_capacity(&self, t: Tensor) -> usize {
        self.seq.ring_cap[ti(t)]
    }
    /// Where token `p` of tensor `t` lives. `p` must not be evicted
    /// ([`Self::is_evicted`]).
    #[inline]
    pub fn locate(&self, t: Tensor, p: usize) -> Loc {
        let sinks = self.cache.scheme.sinks as usize;
        let i = ti(t);
        if p < sinks {
            return Loc::Sink(p);
        }
        let j = p - sinks;
        if j < self.seq.quantized[i] {
            let bt = self.cache.layout.block_tokens;
            Loc::Block(self.seq.table[j / bt - self.seq.first_block], j % bt)
        } else {
            Loc::Window(j % self.seq.ring_cap[i])
        }
    }
    /// Words of tensor `t`, KV head `h`, in block `block`.
    #[inline]
    pub fn block_part(&self, block: u32, h: usize, t: Tensor) -> &'a [u32] {
        let l = &self.cache.layout;
        let start = block as usize * l.block_words + l.tensor_offset(h, t);
        &self.cache.pool[start..start + l.tensor(t).words]
    }
    /// Stored (unquantized) value of a sink or window token.
    #[inline]
    fn buf_row(&self, buf: &Buf, slot: usize, h: usize, out: &mut [f32]) {
        let d = self.cache.shape.head_dim;
        let base = (slot * self.cache.shape.kv_heads + h) * d;
        for (c, o) in out.iter_mut().enumerate() {
            *o = buf.get(base + c);
        }
    }
    /// The cache's value of token `p`, KV head `h`, of tensor `t` (dequantized
    /// if quantized) into `out` (`D` floats).
    /// An evicted token reads as zeros (no window that may read the
    /// sequence sees it).
    pub fn row(&self, t: Tensor, p: usize, h: usize, out: &mut [f32]) {
        let i = ti(t);
        if self.is_evicted(p) {
            out.fill(0.0);
            return;
        }
        match self.locate(t, p) {
            Loc::Sink(s) => self.buf_row(&self.seq.sinks[i], s, h, out),
            Loc::Window(w) => self.buf_row(&self.seq.ring[i], w, h, out),
            Loc::Block(b, off) => {
                let part = self.block_part(b, h, t);
                let tl = self.cache.layout.tensor(t);
                let row = &part[off * tl.words_per_token..][..tl.words_per_token];
                match self.cache.scheme.codec(t) {
                    Codec::Full => {
                        for (c, o) in out.iter_mut().enumerate() {
                            *o = read_raw(row, c, self.cache.scheme.dtype);
                        }
                    }
                    Codec::Vq(v) => match &self.cache.vq[i] {
                        Some(book) => {
                            let bits = v.code_bits();
                            for (j, o) in out.chunks_exact_mut(book.dim).enumerate() {
                                o.copy_from_slice(book.centroid(j, quant::unpack_one(row, bits, j) as usize));
                            }
                        }
                        // A vq cache is only built with its codebooks.
                        None => out.fill(0.0),
                    },
                    Codec::Quant(q) => {
                        let levels = self.cache.codec(t).map_or(&[][..], |c| &c.levels);
                        for (c, o) in out.iter_mut().enumerate() {
                            let code = quant::unpack_one(row, q.bits, c);
                            *o = quant::dequantize_in(code, params_at(tl, part, q, off, c), q, levels);
                        }
                        if let Some(codec) = self.cache.codec(t) {
                            self.add_outliers(tl, part, off, out);
                            let mean = self.seq.means[i]
                                .as_ref()
                                .map(|m| &m[h * tl.head_dim..(h + 1) * tl.head_dim]);
                            codec.inverse(out, mean);
                        }
                    }
                }
            }
        }
    }
}

/// The largest magnitude a (rounded) value of tensor `t` may have, and the
/// first position held to it; `None` for a `full` tensor. `levels`: the
/// tensor's table when it is a calibrated one (`nuq`), else its fixed one.
pub(crate) fn storable_bound(scheme: &Scheme, t: Tensor, levels: Option<&[f32]>) -> Option<(f32, usize)> {
    let q = scheme.codec(t).quant()?;
    // A pipeline transforms values before quantizing them: an orthonormal
    // rotation of `n` channels can grow one by up to sqrt(n), centering
    // subtracts a mean of up to the limit (and that mean may come from sink
    // tokens, so those are checked too). Bound the raw values accordingly.
    let mut limit = quant::storable_limit_in(q, levels.unwrap_or(quant::fixed_levels(q)));
    if let Some(r) = scheme.rotation.filter(|r| r.apply.has(t)) {
        limit /= (r.block as f32).sqrt();
    }
    let centered = scheme.center.is_some_and(|c| c.apply.has(t));
    if centered {
        limit /= 2.0;
    }
    Some((limit, if centered { 0 } else { scheme.sinks as usize }))
}

/// Refuses, with [`Error::OutOfRange`], a value that some group of its
/// tensor could not quantize (its scale or zero point would overflow the
/// scale dtype): refused later, when it leaves the window, it would wedge
/// the sequence. `given` are the caller's values (for the message),
/// `rounded` the same rounded to the activation dtype, `[tokens][Hkv][D]`,
/// the first of them at position `old_tokens`. The host cache and the
/// device cache both call it, so both refuse the same appends. `levels`:
/// each tensor's table, where the cache holds one (a calibrated `nuq`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_storable(
    scheme: &Scheme,
    given: [&[f32]; 2],
    rounded: [&[f32]; 2],
    old_tokens: usize,
    h: usize,
    d: usize,
    levels: [Option<&[f32]>; 2],
) -> Result<()> {
    for (t, given) in [(Tensor::Key, given[0]), (Tensor::Value, given[1])] {
        if let (Codec::Quant(q), Some((limit, first))) = (scheme.codec(t), storable_bound(scheme, t, levels[ti(t)])) {
            for (i, x) in rounded[ti(t)].iter().enumerate() {
                let token = old_tokens + i / (h * d);
                if token >= first && x.abs() > limit {
                    return Err(Error::OutOfRange {
                        tensor: t.name(),
                        value: given[i],
                        token,
                        head: (i / d) % h,
                        channel: i % d,
                        limit,
                        bits: q.bits,
                        dtype: q.scale.name(),
                    });
                }
            }
        }
    }
    Ok(())
}
