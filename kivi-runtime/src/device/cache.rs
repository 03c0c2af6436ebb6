//! The paged cache in device memory, and decode attention over it, on any
//! [`Device`].
//!
//! [`DeviceCache`] holds a batch of sequences in exactly the layout
//! [`PagedCache`] uses on the host (the same pool words, block tables, sink
//! and window buffers), so it can be uploaded from a host cache, filled on
//! the device by the generated prefill/append kernels, and compared word for
//! word. [`DeviceBackend`] implements [`Backend`] on top of it.

use super::args::{CombineArgs, DecodeArgs, DecodeInputs, ExtendArgs, ExtendInputs, Window};
use super::{download, upload, Buffer, Device, DeviceKind, Elem, Module, Timing};
use crate::backend::{check_batch, check_window, Backend, NewTokens};
use crate::cache::{CacheConfig, PagedCache, RawRows, SeqId};
use crate::error::{Error, Result};
use crate::quant;
use crate::reference::{round_inputs, AttnParams};
use crate::vq::VqBook;
use kivi_spec::layout::{self, regions, BlockLayout};
use kivi_spec::{Dtype, Scheme, Shape, Tensor};
use kivi_templates::{default_variant, generate_calibrated, Codebooks, GenOptions, Generated, Kernel, Variant};
use std::sync::{Arc, Mutex, Weak};

mod block;

/// Activation values (already rounded to `dtype`) in a new device buffer:
/// f16/bf16 bits or f32.
pub(crate) fn upload_act(dev: &dyn Device, dtype: Dtype, x: &[f32]) -> Result<Buffer> {
    match dtype {
        Dtype::F32 => upload(dev, x),
        d => {
            let bits: Vec<u16> = x.iter().map(|v| quant::to_bits_16(*v, d)).collect();
            upload(dev, &bits)
        }
    }
}

/// An activation buffer back on the host as f32.
pub(crate) fn download_act(dev: &dyn Device, dtype: Dtype, b: &Buffer) -> Result<Vec<f32>> {
    match dtype {
        Dtype::F32 => download(dev, b),
        d => Ok(download::<u16>(dev, b)?
            .into_iter()
            .map(|x| quant::from_bits_16(x, d))
            .collect()),
    }
}

fn act_elem(dtype: Dtype) -> Elem {
    match dtype {
        Dtype::F32 => Elem::F32,
        _ => Elem::U16,
    }
}

/// Raw rows of several sequences stacked `[batch][per_seq]` (zero padded).
fn stack_rows(dev: &dyn Device, dtype: Dtype, parts: &[RawRows<'_>], per_seq: usize) -> Result<Buffer> {
    match dtype {
        Dtype::F32 => {
            let mut v = vec![0f32; parts.len() * per_seq];
            for (i, p) in parts.iter().enumerate() {
                if let RawRows::F32(x) = p {
                    let n = per_seq.min(x.len());
                    v[i * per_seq..][..n].copy_from_slice(&x[..n]);
                }
            }
            upload(dev, &v)
        }
        _ => {
            let mut v = vec![0u16; parts.len() * per_seq];
            for (i, p) in parts.iter().enumerate() {
                if let RawRows::Bits16(x) = p {
                    let n = per_seq.min(x.len());
                    v[i * per_seq..][..n].copy_from_slice(&x[..n]);
                }
            }
            upload(dev, &v)
        }
    }
}

/// What a non-zero status word of the prefill/append kernels means.
pub(crate) fn status_message(b: usize, code: i32) -> String {
    match code {
        2 => format!("a key or value of sequence {b} is not finite; the device append was refused"),
        3 => format!(
            "an outlier correction of sequence {b} does not fit the activation dtype; the device append was refused"
        ),
        _ => format!(
            "a scale or zero point of sequence {b} overflowed its scale dtype during the device append \
             (use scale = f32)"
        ),
    }
}

fn ti(t: Tensor) -> usize {
    match t {
        Tensor::Key => 0,
        Tensor::Value => 1,
    }
}

/// Which buffer of the cache a saved range belongs to.
#[derive(Clone, Copy)]
enum Part {
    Pool,
    Sinks(usize),
    Ring(usize),
    Means(usize),
}

/// The prefill/append kernel an extend runs: generated for a variant
/// (`None`: the default), or a module the caller loaded.
#[derive(Clone, Copy)]
pub(crate) enum ExtendKernel<'m> {
    Variant(Option<Variant>),
    Module(&'m Module),
}

/// Ranges of the cache saved before an extend launch, restored if it fails.
struct Saved {
    ranges: Vec<(Part, usize, usize, Buffer)>,
}

/// What undoes one extend: the saved ranges and the bookkeeping before it.
struct Undo {
    saved: Saved,
    device_tables: Vec<u32>,
    host_tables: Vec<Vec<u32>>,
    free: Vec<u32>,
    lens: Vec<usize>,
}

/// A batch of sequences of one scheme, resident on a [`Device`].
pub struct DeviceCache {
    dev: Arc<dyn Device>,
    scheme: Scheme,
    shape: Shape,
    layout: BlockLayout,
    batch: usize,
    table_stride: usize,
    /// Tokens a sequence may hold (what it was sized for).
    max_tokens: usize,
    total_blocks: usize,
    pool: Buffer,
    tables: Buffer,
    seq_lens: Buffer,
    sinks: [Buffer; 2],
    rings: [Buffer; 2],
    /// Centering means `[batch][Hkv][D]` act per centered tensor (one
    /// element otherwise), written by the extend kernel.
    means: [Buffer; 2],
    /// Scratch of the extend kernel's codec pipeline.
    work: Buffer,
    /// Host copy of the bookkeeping (block tables, lengths, free blocks),
    /// mirroring [`PagedCache`]'s allocation order.
    host_tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
    free: Vec<u32>,
    /// Set when a failed append could not be undone; every later call errors.
    poisoned: bool,
    /// The calibrated tables of the scheme's `nuq` tensors, baked into
    /// every kernel this cache generates (empty without `nuq`).
    codebooks: Codebooks,
    /// The hash of the calibration they came from, if any.
    calibration: Option<u64>,
    /// The product codebooks of the scheme's vq tensors (host copies) and
    /// their device buffers, f32 `[D / M][E][M]`, passed to the vq decode
    /// kernel (a one-element buffer for a tensor that is not vq). A named
    /// codebook is one buffer per device, whichever caches use it
    /// ([`device_books`]).
    vq: [Option<Arc<VqBook>>; 2],
    books: [Arc<Buffer>; 2],
}

/// Named codebooks on a device: (device, name, FNV-1a of the f32 bits) ->
/// the buffer, held weakly, so that every cache of a device that decodes
/// with one named codebook (every layer, keys and values) shares one
/// upload, and the last cache to drop it frees it.
type SharedBooks = Vec<(usize, String, u64, Weak<Buffer>)>;
static SHARED_BOOKS: Mutex<SharedBooks> = Mutex::new(Vec::new());

/// The device buffers of `books` (see [`DeviceCache`]'s `books`): a named
/// codebook already on `dev` is reused, any other is uploaded; a tensor
/// without one gets a one-element buffer the kernel never reads.
fn device_books(dev: &Arc<dyn Device>, books: &[Option<Arc<VqBook>>; 2]) -> Result<[Arc<Buffer>; 2]> {
    let key = Arc::as_ptr(dev) as *const () as usize;
    let one = |b: &Option<Arc<VqBook>>| -> Result<Arc<Buffer>> {
        let Some(b) = b else {
            return Ok(Arc::new(dev.alloc(Elem::F32, 1)?));
        };
        let Some(name) = &b.name else {
            return Ok(Arc::new(upload(dev.as_ref(), &b.data)?));
        };
        let bits: Vec<u8> = b.data.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        let hash = kivi_spec::fnv1a64(&bits);
        // A poisoned lock only means another thread panicked mid-update of
        // a list of weak pointers; the list itself is still usable.
        let mut shared = SHARED_BOOKS.lock().unwrap_or_else(|e| e.into_inner());
        shared.retain(|e| e.3.strong_count() > 0);
        if let Some(buf) = shared
            .iter()
            .find(|e| e.0 == key && &e.1 == name && e.2 == hash)
            .and_then(|e| e.3.upgrade())
        {
            return Ok(buf);
        }
        let buf = Arc::new(upload(dev.as_ref(), &b.data)?);
        shared.push((key, name.clone(), hash, Arc::downgrade(&buf)));
        Ok(buf)
    };
    Ok([one(&books[0])?, one(&books[1])?])
}

/// The `nuq` tables of `levels` ([`crate::calib::levels_for`]'s answer):
/// the fixed Lloyd–Max tables are the templates' own and are left out.
/// What [`kivi_templates::generate_calibrated`] bakes into a kernel.
pub fn nuq_codebooks(scheme: &Scheme, levels: [Option<Vec<f32>>; 2]) -> Codebooks {
    let [k, v] = levels;
    let nuq = |t: Tensor| {
        scheme
            .codec(t)
            .quant()
            .is_some_and(|q| matches!(q.levels, kivi_spec::Levels::Nuq(_)))
    };
    Codebooks {
        key: k.filter(|_| nuq(Tensor::Key)),
        value: v.filter(|_| nuq(Tensor::Value)),
    }
}

impl DeviceCache {
    /// An empty batch of `batch` sequences, each able to hold `max_tokens`
    /// tokens, with `config.max_blocks` blocks in the pool.
    ///
    /// A scheme with `levels = nuq` or `vq(...)` is refused
    /// ([`crate::calib::CalibError::Needed`] / `VqNeeded`, as
    /// [`PagedCache::new`] does): its codebooks come from a calibration,
    /// [`Self::with_calibration`].
    pub fn new(
        dev: Arc<dyn Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
    ) -> Result<DeviceCache> {
        kivi_spec::validate(scheme)?;
        crate::calib::levels_for(scheme, None, 0)?;
        // vq codecs without their codebooks: CalibError::VqNeeded.
        crate::vq::books_for(scheme, None, 0)?;
        Self::build(
            dev,
            scheme,
            batch,
            max_tokens,
            config,
            Codebooks::default(),
            None,
            [None, None],
        )
    }

    /// [`Self::new`] for layer `layer` of a model: the scheme's `nuq`
    /// and `vq(...)` tensors decode with that layer's codebooks from
    /// `calibration` (vq codebooks uploaded once, see [`Self::book_buffer`]),
    /// checked as [`PagedCache::with_calibration`] checks them (model shape,
    /// layer count, the quantizer each was fitted for; a missing one is an
    /// error naming the layer and tensor). The tables are baked into the
    /// generated kernels ([`kivi_templates::Codebooks`]), so the device
    /// writes and decodes exactly the words a host cache built with the same
    /// calibration does.
    pub fn with_calibration(
        dev: Arc<dyn Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
        calibration: &crate::calib::Calibration,
        layer: usize,
    ) -> Result<DeviceCache> {
        kivi_spec::validate(scheme)?;
        calibration.check_shape(scheme)?;
        let levels = crate::calib::levels_for(scheme, Some(calibration), layer)?;
        let books = crate::vq::books_for(scheme, Some(calibration), layer)?;
        let cb = nuq_codebooks(scheme, levels);
        Self::build(
            dev,
            scheme,
            batch,
            max_tokens,
            config,
            cb,
            Some(calibration.hash()),
            books,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        dev: Arc<dyn Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
        codebooks: Codebooks,
        calibration: Option<u64>,
        vq: [Option<Arc<VqBook>>; 2],
    ) -> Result<DeviceCache> {
        // A low-rank scheme's rows are coordinates: its own wrapper projects.
        if scheme.low_rank.is_some() {
            return Err(Error::Config(super::NOT_DEVICE.into()));
        }
        // A codec the templates cannot generate (or a table that does not
        // fit) is refused here, not at the first launch.
        kivi_templates::check_calibrated(scheme, &codebooks).map_err(gen_err)?;
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        if batch == 0 {
            return Err(Error::Config("a device cache needs at least one sequence".into()));
        }
        let bt = config
            .block_tokens
            .unwrap_or_else(|| layout::default_block_tokens(scheme));
        layout::check_block_tokens(scheme, bt).map_err(Error::Config)?;
        let layout = BlockLayout::new(scheme, shape, bt);
        let stride = max_tokens.div_ceil(bt).max(1);
        let (h, d) = (shape.kv_heads, shape.head_dim);
        let words = config
            .max_blocks
            .checked_mul(layout.block_words)
            .ok_or_else(|| Error::Config(format!("a pool of {} blocks is too large", config.max_blocks)))?;
        let act = act_elem(scheme.dtype);
        let sinks = scheme.sinks as usize * h * d * batch;
        let ring = |t| layout::window_capacity(scheme, t).max(1) * h * d * batch;
        let means = |t| {
            if scheme.center_of(t).is_some() {
                batch * h * d
            } else {
                1
            }
        };
        let work =
            kivi_templates::extend_work_floats(scheme, GenOptions { block_tokens: Some(bt) }).map_err(gen_err)?;
        let books = device_books(&dev, &vq)?;
        let d_ = dev.as_ref();
        Ok(DeviceCache {
            books,
            vq,
            means: [d_.alloc(act, means(Tensor::Key))?, d_.alloc(act, means(Tensor::Value))?],
            work: d_.alloc(Elem::F32, (batch * 2 * h * work).max(1))?,
            pool: d_.alloc(Elem::U32, words)?,
            tables: d_.alloc(Elem::U32, batch * stride)?,
            seq_lens: d_.alloc(Elem::I32, batch)?,
            sinks: [d_.alloc(act, sinks)?, d_.alloc(act, sinks)?],
            rings: [d_.alloc(act, ring(Tensor::Key))?, d_.alloc(act, ring(Tensor::Value))?],
            dev: dev.clone(),
            scheme: scheme.clone(),
            shape,
            layout,
            batch,
            table_stride: stride,
            max_tokens,
            total_blocks: config.max_blocks,
            host_tables: vec![Vec::new(); batch],
            lens: vec![0; batch],
            free: (0..config.max_blocks as u32).rev().collect(),
            poisoned: false,
            codebooks,
            calibration,
        })
    }

    /// Copies sequences `seqs` of a host cache to the device, in that order.
    /// The copy is read-only: appends need the host cache's free list.
    pub fn upload(dev: Arc<dyn Device>, cache: &PagedCache, seqs: &[SeqId]) -> Result<DeviceCache> {
        if seqs.is_empty() {
            return Err(Error::Config("no sequences to upload".into()));
        }
        let scheme = cache.scheme().clone();
        // The host cache's `nuq` tables (from its calibration) are the ones
        // the kernels bake in.
        let levels = [Tensor::Key, Tensor::Value].map(|t| cache.codec(t).map(|c| c.levels.clone()));
        let codebooks = nuq_codebooks(&scheme, levels);
        kivi_templates::check_calibrated(&scheme, &codebooks).map_err(gen_err)?;
        // The host cache's vq codebooks (a vq cache always has them).
        let vq = [Tensor::Key, Tensor::Value].map(|t| cache.vq_book(t).cloned());
        let books = device_books(&dev, &vq)?;
        let shape = cache.shape();
        let layout = *cache.layout();
        let views: Vec<_> = seqs.iter().map(|&s| cache.view(s)).collect::<Result<_>>()?;
        // The kernels index blocks from 0: evicted entries are filled in
        // (and never read: decode checks the window, `check_window`).
        let host_tables: Vec<Vec<u32>> = views.iter().map(|v| v.logical_table()).collect();
        let stride = host_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; seqs.len() * stride];
        for (b, t) in host_tables.iter().enumerate() {
            tables[b * stride..b * stride + t.len()].copy_from_slice(t);
        }
        let lens: Vec<i32> = views
            .iter()
            .map(|v| i32::try_from(v.tokens()).map_err(|_| Error::Config("a sequence longer than 2^31 tokens".into())))
            .collect::<Result<_>>()?;
        let (h, d) = (shape.kv_heads, shape.head_dim);
        let sinks_per = scheme.sinks as usize * h * d;
        let d_ = dev.as_ref();
        let stack = |t: Tensor, sinks: bool| -> Result<Buffer> {
            let parts: Vec<RawRows> = views
                .iter()
                .map(|v| if sinks { v.sinks_raw(t) } else { v.ring_raw(t) })
                .collect();
            let per = if sinks {
                sinks_per
            } else {
                layout::window_capacity(&scheme, t).max(1) * h * d
            };
            stack_rows(d_, scheme.dtype, &parts, per)
        };
        // Centering means as the host cache holds them (zeros before the
        // first N tokens exist: nothing is quantized then).
        let stack_means = |t: Tensor| -> Result<Buffer> {
            if scheme.center_of(t).is_none() {
                return d_.alloc(act_elem(scheme.dtype), 1);
            }
            let mut m = vec![0f32; views.len() * h * d];
            for (b, v) in views.iter().enumerate() {
                for hh in 0..h {
                    if let Some(x) = v.mean(t, hh) {
                        m[(b * h + hh) * d..][..d].copy_from_slice(x);
                    }
                }
            }
            upload_act(d_, scheme.dtype, &m)
        };
        Ok(DeviceCache {
            books,
            vq,
            means: [stack_means(Tensor::Key)?, stack_means(Tensor::Value)?],
            // an upload is read-only: no extend scratch
            work: d_.alloc(Elem::F32, 1)?,
            pool: upload(d_, cache.pool())?,
            tables: upload(d_, &tables)?,
            seq_lens: upload(d_, &lens)?,
            sinks: [stack(Tensor::Key, true)?, stack(Tensor::Value, true)?],
            rings: [stack(Tensor::Key, false)?, stack(Tensor::Value, false)?],
            total_blocks: cache.pool().len() / layout.block_words.max(1),
            dev: dev.clone(),
            host_tables,
            lens: views.iter().map(|v| v.tokens()).collect(),
            free: Vec::new(),
            scheme: scheme.clone(),
            shape,
            layout,
            batch: seqs.len(),
            table_stride: stride,
            // Appends that need no new block work on an upload; the rest
            // fail for want of free blocks.
            max_tokens: i32::MAX as usize,
            poisoned: false,
            codebooks,
            calibration: cache.calibration_hash(),
        })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    pub fn batch(&self) -> usize {
        self.batch
    }
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// The calibrated `nuq` tables baked into this cache's kernels.
    pub fn codebooks(&self) -> &Codebooks {
        &self.codebooks
    }
    /// The hash of the calibration this cache was built with, if any.
    pub fn calibration_hash(&self) -> Option<u64> {
        self.calibration
    }
    /// This cache's identity ([`PagedCache::identity`]): the scheme hash
    /// joined with the calibration hash when there is one.
    pub fn identity(&self) -> u64 {
        crate::calib::identity(kivi_spec::scheme_hash(&self.scheme), self.calibration)
    }
    /// Block table of sequence `b`.
    pub fn table(&self, b: usize) -> &[u32] {
        &self.host_tables[b]
    }
    /// Blocks not in any sequence's table.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Bytes of KV data a decode over the whole batch reads: the blocks of
    /// every sequence plus its sink and window rows (what the roofline counts).
    pub fn decode_bytes(&self) -> usize {
        self.lens
            .iter()
            .map(|&t| layout::Footprint::for_tokens(&self.scheme, t).total())
            .sum()
    }

    fn gen_opts(&self) -> GenOptions {
        GenOptions {
            block_tokens: Some(self.layout.block_tokens),
        }
    }

    fn check(&self) -> Result<()> {
        if self.poisoned {
            return Err(Error::Config(
                "this device cache was left inconsistent by a failed append that could not be undone; \
                 upload it again"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Centering means of tensor `t`, `[batch][Hkv][D]` as f32 (one zero
    /// when the tensor is not centered).
    pub fn download_means(&self, t: Tensor) -> Result<Vec<f32>> {
        download_act(self.dev.as_ref(), self.scheme.dtype, &self.means[ti(t)])
    }
    /// The pool words (for comparing with a host cache).
    pub fn download_pool(&self) -> Result<Vec<u32>> {
        download(self.dev.as_ref(), &self.pool)
    }
    /// Sink (`sinks = true`) or window buffer of tensor `t`, `[batch][slots][Hkv][D]` as f32.
    pub fn download_rows(&self, t: Tensor, sinks: bool) -> Result<Vec<f32>> {
        let buf = if sinks { &self.sinks[ti(t)] } else { &self.rings[ti(t)] };
        download_act(self.dev.as_ref(), self.scheme.dtype, buf)
    }

    fn part(&mut self, p: Part) -> &mut Buffer {
        match p {
            Part::Pool => &mut self.pool,
            Part::Sinks(t) => &mut self.sinks[t],
            Part::Ring(t) => &mut self.rings[t],
            Part::Means(t) => &mut self.means[t],
        }
    }

    /// Saves on the device every range an extend of `counts` tokens may
    /// write: the blocks from the one holding the first newly quantized
    /// token to the end of the new tables, and the sink/ring rows of the new
    /// tokens' positions.
    fn save(&mut self, counts: &[usize], tables: &[Vec<u32>]) -> Result<Saved> {
        let bt = self.layout.block_tokens;
        let bw = self.layout.block_words;
        let row = self.shape.kv_heads * self.shape.head_dim;
        let sinks = self.scheme.sinks as usize;
        let mut want: Vec<(Part, usize, usize)> = Vec::new();
        for (b, &n) in counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let old = self.lens[b];
            let q0 = [Tensor::Key, Tensor::Value]
                .iter()
                .map(|&t| regions(&self.scheme, t, old).quantized)
                .min()
                .unwrap_or(0);
            for &blk in tables[b].iter().skip(q0 / bt) {
                want.push((Part::Pool, blk as usize * bw, bw));
            }
            for t in [Tensor::Key, Tensor::Value] {
                let slots = layout::window_capacity(&self.scheme, t).max(1);
                let ring_slots: Vec<usize> = (old..old + n)
                    .filter(|&p| p >= sinks)
                    .map(|p| (p - sinks) % slots)
                    .collect();
                for s in dedup(ring_slots) {
                    want.push((Part::Ring(ti(t)), (b * slots + s) * row, row));
                }
                for p in (old..old + n).filter(|&p| p < sinks) {
                    want.push((Part::Sinks(ti(t)), (b * sinks + p) * row, row));
                }
                // the launch that brings the N-th token writes the means
                if self.scheme.center_of(t).is_some_and(|c| old < c && old + n >= c) {
                    want.push((Part::Means(ti(t)), b * row, row));
                }
            }
        }
        let mut ranges = Vec::with_capacity(want.len());
        for (p, at, len) in want {
            let elem = self.part(p).elem();
            let mut scratch = self.dev.alloc(elem, len)?;
            let dev = self.dev.clone();
            dev.copy(self.part(p), at, &mut scratch, 0, len)?;
            ranges.push((p, at, len, scratch));
        }
        Ok(Saved { ranges })
    }

    fn restore(&mut self, saved: Saved) -> Result<()> {
        let dev = self.dev.clone();
        for (p, at, len, scratch) in saved.ranges {
            dev.copy(&scratch, 0, self.part(p), at, len)?;
        }
        dev.sync()
    }

    /// Adds `counts[b]` tokens to sequence `b` on the device: `k`, `v` hold
    /// `[sum(counts), Hkv, D]` f32 (sequence 0's tokens first). Uses the
    /// append kernel when every count is at most 1, prefill otherwise.
    ///
    /// Inputs are rounded and checked on the host first (non-finite values
    /// are refused with nothing changed). The kernels check again and report
    /// overflowing scales and non-finite values in a status word; a failed
    /// launch is undone (every range it could write was saved on the device
    /// before it ran), so an append that fails leaves the cache exactly as
    /// it was.
    pub fn extend(&mut self, counts: &[usize], k: &[f32], v: &[f32]) -> Result<()> {
        self.extend_with(counts, k, v, None)
    }

    /// [`DeviceCache::extend`] with a chosen prefill/append variant.
    pub fn extend_with(&mut self, counts: &[usize], k: &[f32], v: &[f32], variant: Option<Variant>) -> Result<()> {
        self.extend_checked(counts, k, v, ExtendKernel::Variant(variant))
            .map(drop)
    }

    /// [`DeviceCache::extend`] with an already loaded prefill or append
    /// module of this cache's scheme, shape and block size (the append
    /// kernel adds at most one token per sequence), as
    /// [`DeviceCache::decode_on`] takes a decode module: for callers that
    /// build the sources themselves, e.g. tests that run mutated kernels.
    pub fn extend_on(&mut self, module: &Module, counts: &[usize], k: &[f32], v: &[f32]) -> Result<()> {
        self.extend_checked(counts, k, v, ExtendKernel::Module(module))
            .map(drop)
    }

    /// [`DeviceCache::extend_with`], returning what undoes it.
    fn extend_checked(
        &mut self,
        counts: &[usize],
        k: &[f32],
        v: &[f32],
        variant: ExtendKernel<'_>,
    ) -> Result<Option<Undo>> {
        self.check()?;
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let total: usize = counts.iter().sum();
        if counts.len() != self.batch || k.len() != total * h * d || v.len() != k.len() {
            return Err(Error::Shape {
                what: "device extend",
                expected: format!(
                    "{} counts and {} values each for key and value",
                    self.batch,
                    total * h * d
                ),
                got: format!("{} counts, {} and {} values", counts.len(), k.len(), v.len()),
            });
        }
        let kr = round_inputs(&self.scheme, "key", k, h, d)?;
        let vr = round_inputs(&self.scheme, "value", v, h, d)?;
        // The same range rule as PagedCache, sequence by sequence: a value
        // no group could quantize is refused by the append that brings it.
        let row = h * d;
        let mut at = 0;
        for (b, &n) in counts.iter().enumerate() {
            let r = at * row..(at + n) * row;
            crate::cache::check_storable(
                &self.scheme,
                [&k[r.clone()], &v[r.clone()]],
                [&kr[r.clone()], &vr[r]],
                self.lens[b],
                h,
                d,
                // (The device cache has no calibrated tables: fixed ones.)
                [None, None],
            )
            .map_err(|e| Error::InSequence {
                seq: b,
                source: Box::new(e),
            })?;
            at += n;
        }
        self.extend_undoable(counts, &kr, &vr, variant)
    }

    /// The product codebooks of tensor `t`, if it is `vq(...)` (what the
    /// decode kernel reads from [`Self::book_buffer`]).
    pub fn vq_book(&self, t: Tensor) -> Option<&Arc<VqBook>> {
        self.vq[ti(t)].as_ref()
    }

    /// The device buffer the decode kernel reads tensor `t`'s codebooks
    /// from (one element when `t` is not vq). Caches of one device that
    /// name the same codebook hold the same buffer (`Arc::ptr_eq`).
    pub fn book_buffer(&self, t: Tensor) -> &Arc<Buffer> {
        &self.books[ti(t)]
    }

    /// The device part of an extend, on inputs already rounded to the
    /// activation dtype (and not re-checked here: the kernel checks them).
    #[cfg(test)]
    fn extend_rounded(&mut self, counts: &[usize], kr: &[f32], vr: &[f32], variant: Option<Variant>) -> Result<()> {
        self.extend_undoable(counts, kr, vr, ExtendKernel::Variant(variant))
            .map(drop)
    }

    /// [`DeviceCache::extend_rounded`] that also returns what undoes it
    /// ([`DeviceCache::undo`]), for callers with more work that may fail
    /// after the append (`None`: nothing was appended).
    fn extend_undoable(
        &mut self,
        counts: &[usize],
        kr: &[f32],
        vr: &[f32],
        variant: ExtendKernel<'_>,
    ) -> Result<Option<Undo>> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        // Reserve blocks exactly as PagedCache::extend does, sequence by sequence.
        let bt = self.layout.block_tokens;
        let mut tables = self.host_tables.clone();
        let mut free = self.free.clone();
        for (b, &n) in counts.iter().enumerate() {
            let new_len = self.lens[b]
                .checked_add(n)
                .filter(|l| *l <= i32::MAX as usize)
                .ok_or_else(|| Error::Config(format!("sequence {b} would exceed 2^31 tokens")))?;
            let q = regions(&self.scheme, Tensor::Key, new_len)
                .quantized
                .max(regions(&self.scheme, Tensor::Value, new_len).quantized);
            let blocks = q.div_ceil(bt);
            if blocks > self.table_stride || new_len > self.max_tokens {
                return Err(Error::Config(format!(
                    "sequence {b} would hold {new_len} tokens, more than this device cache was sized for ({})",
                    self.max_tokens
                )));
            }
            let need = blocks.saturating_sub(tables[b].len());
            if need > free.len() {
                return Err(Error::OutOfBlocks {
                    need,
                    free: free.len(),
                    total: self.total_blocks,
                });
            }
            let split = free.len() - need;
            tables[b].extend(free[split..].iter().rev());
            free.truncate(split);
        }
        let max_new = counts.iter().copied().max().unwrap_or(0);
        if max_new == 0 {
            return Ok(None);
        }
        // Pad the inputs to [batch][max_new][Hkv][D].
        let row = h * d;
        let mut kp = vec![0f32; self.batch * max_new * row];
        let mut vp = vec![0f32; self.batch * max_new * row];
        let mut at = 0;
        for (b, &n) in counts.iter().enumerate() {
            kp[b * max_new * row..][..n * row].copy_from_slice(&kr[at * row..(at + n) * row]);
            vp[b * max_new * row..][..n * row].copy_from_slice(&vr[at * row..(at + n) * row]);
            at += n;
        }
        let loaded;
        let module: &Module = match variant {
            ExtendKernel::Module(m) => {
                if m.generated.block_tokens != self.layout.block_tokens
                    || !m.generated.name.starts_with(&kivi_templates::scheme_tag(&self.scheme))
                {
                    return Err(Error::Config(format!(
                        "`{}` was generated for another scheme, shape or block size than this cache's",
                        m.generated.name
                    )));
                }
                m
            }
            ExtendKernel::Variant(variant) => {
                let kernel = if max_new > 1 { Kernel::Prefill } else { Kernel::Append };
                let v = variant.unwrap_or_else(|| default_variant(&self.scheme, kernel));
                let g =
                    generate_calibrated(&self.scheme, kernel, &v, self.gen_opts(), &self.codebooks).map_err(gen_err)?;
                loaded = self.dev.load(&g)?;
                &loaded
            }
        };
        let mut flat = vec![0u32; self.batch * self.table_stride];
        for (b, t) in tables.iter().enumerate() {
            flat[b * self.table_stride..][..t.len()].copy_from_slice(t);
        }
        let old: Vec<i32> = self.lens.iter().map(|&x| x as i32).collect();
        let cnt: Vec<i32> = counts.iter().map(|&x| x as i32).collect();
        let dev = self.dev.clone();
        let dtype = self.scheme.dtype;

        let saved = self.save(counts, &tables)?;
        let old_tables = download::<u32>(dev.as_ref(), &self.tables)?;
        let launched = (|| -> Result<Vec<i32>> {
            super::write(dev.as_ref(), &mut self.tables, &flat)?;
            let old_d = upload(dev.as_ref(), &old)?;
            let cnt_d = upload(dev.as_ref(), &cnt)?;
            let k_d = upload_act(dev.as_ref(), dtype, &kp)?;
            let v_d = upload_act(dev.as_ref(), dtype, &vp)?;
            let mut status_d = dev.alloc(Elem::I32, self.batch)?;
            let [sk, sv] = &mut self.sinks;
            let [rk, rv] = &mut self.rings;
            let inputs = if self.scheme.has_vq() {
                // kivi_vq_extend.cuh codes the vq tensors with the codebooks.
                let d = self.shape.head_dim;
                let len = |t: Tensor| self.scheme.codec(t).vq().map_or(0, |v| v.codebook_len(d));
                ExtendInputs::Books {
                    k: &self.books[0],
                    v: &self.books[1],
                    len: [len(Tensor::Key), len(Tensor::Value)],
                }
            } else {
                let [mk, mv] = &mut self.means;
                ExtendInputs::Means { k: mk, v: mv }
            };
            ExtendArgs {
                batch: self.batch,
                pool: &mut self.pool,
                tables: &self.tables,
                table_stride: self.table_stride,
                old_lens: &old_d,
                new_counts: &cnt_d,
                k_new: &k_d,
                v_new: &v_d,
                max_new,
                sinks_k: sk,
                sinks_v: sv,
                ring_k: rk,
                ring_v: rv,
                inputs,
                work: &mut self.work,
                status: &mut status_d,
            }
            .launch(dev.as_ref(), module)?;
            let status = download::<i32>(dev.as_ref(), &status_d)?;
            dev.sync()?;
            Ok(status)
        })();
        let failure = match launched {
            Ok(status) => status
                .iter()
                .enumerate()
                .find(|(_, &s)| s != 0)
                .map(|(b, &s)| Error::Config(status_message(b, s))),
            Err(e) => Some(e),
        };
        if let Some(e) = failure {
            // Undo: the saved ranges, and the block tables as they were.
            let undone = self
                .restore(saved)
                .and_then(|_| super::write(dev.as_ref(), &mut self.tables, &old_tables));
            if undone.is_err() {
                self.poisoned = true;
            }
            return Err(e);
        }
        let undo = Undo {
            saved,
            device_tables: old_tables,
            host_tables: std::mem::replace(&mut self.host_tables, tables),
            free: std::mem::replace(&mut self.free, free),
            lens: self.lens.clone(),
        };
        let lens: Vec<i32> = old.iter().zip(&cnt).map(|(a, c)| a + c).collect();
        if let Err(e) = super::write(dev.as_ref(), &mut self.seq_lens, &lens) {
            self.undo(undo);
            return Err(e);
        }
        for (l, n) in self.lens.iter_mut().zip(counts) {
            *l += n;
        }
        Ok(Some(undo))
    }

    /// Puts the cache back as it was before the extend `u` came from (a
    /// cache that cannot be put back is poisoned: every later call errors).
    fn undo(&mut self, u: Undo) {
        let dev = self.dev.clone();
        let lens: Vec<i32> = u.lens.iter().map(|&x| x as i32).collect();
        let undone = self
            .restore(u.saved)
            .and_then(|_| super::write(dev.as_ref(), &mut self.tables, &u.device_tables))
            .and_then(|_| super::write(dev.as_ref(), &mut self.seq_lens, &lens));
        if undone.is_err() {
            self.poisoned = true;
        }
        self.host_tables = u.host_tables;
        self.free = u.free;
        self.lens = u.lens;
    }

    /// The decode kernel and its combine step for `variant` (default when `None`).
    pub fn decode_module(&self, variant: Option<Variant>) -> Result<Arc<Module>> {
        let v = variant.unwrap_or_else(|| default_variant(&self.scheme, Kernel::Decode));
        let g =
            generate_calibrated(&self.scheme, Kernel::Decode, &v, self.gen_opts(), &self.codebooks).map_err(gen_err)?;
        self.dev.load(&g)
    }

    /// The decode sources of several variants, loaded together (the
    /// simulator builds them into one library).
    pub fn decode_modules(&self, variants: &[Variant]) -> Result<Vec<Arc<Module>>> {
        let gens: Vec<Generated> = variants
            .iter()
            .map(|v| {
                generate_calibrated(&self.scheme, Kernel::Decode, v, self.gen_opts(), &self.codebooks).map_err(gen_err)
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Generated> = gens.iter().collect();
        self.dev.load_many(&refs)
    }

    /// Decode attention of one query per sequence (`q` is `[batch, Hq, D]`);
    /// returns `[batch, Hq, D]`.
    pub fn decode(&self, q: &[f32], attn: AttnParams, variant: Option<Variant>) -> Result<Vec<f32>> {
        if attn.window == Some(0) {
            // A window of no tokens attends to nothing; the oracle's answer
            // is zero and no kernel encodes it.
            self.check()?;
            self.check_query(q)?;
            return Ok(vec![0.0; q.len()]);
        }
        let m = self.decode_module(variant)?;
        self.decode_on(&m, q, attn)
    }

    /// [`DeviceCache::decode`] with an already loaded decode module.
    pub fn decode_on(&self, m: &Module, q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        if attn.window == Some(0) {
            self.check()?;
            self.check_query(q)?;
            return Ok(vec![0.0; q.len()]);
        }
        let mut run = self.prepare_decode(m, q, attn)?;
        run.launch()?;
        run.output()
    }

    fn check_query(&self, q: &[f32]) -> Result<Vec<f32>> {
        let (hq, d) = (self.shape.q_heads, self.shape.head_dim);
        if q.len() != self.batch * hq * d {
            return Err(Error::Shape {
                what: "query batch",
                expected: format!("{} values ({} x {hq} x {d})", self.batch * hq * d, self.batch),
                got: q.len().to_string(),
            });
        }
        round_inputs(&self.scheme, "query", q, hq, d)
    }

    /// Uploads the query and allocates the outputs, so that
    /// [`DecodeRun::launch`] issues only the two kernels (what a benchmark times).
    pub fn prepare_decode<'a>(&'a self, module: &'a Module, q: &[f32], attn: AttnParams) -> Result<DecodeRun<'a>> {
        self.check()?;
        let qr = self.check_query(q)?;
        if module.generated.block_tokens != self.layout.block_tokens
            || module.generated.launch.q_heads as usize != self.shape.q_heads
            || module.generated.launch.head_dim as usize != self.shape.head_dim
            || !module
                .generated
                .name
                .starts_with(&kivi_templates::scheme_tag(&self.scheme))
        {
            return Err(Error::Config(format!(
                "`{}` was generated for another scheme, shape or block size than this cache's",
                module.generated.name
            )));
        }
        let window = Window::of(attn.window)?;
        let dev = self.dev.as_ref();
        let li = &module.generated.launch;
        Ok(DecodeRun {
            cache: self,
            module,
            q: upload_act(dev, self.scheme.dtype, &qr)?,
            part_ml: dev.alloc(Elem::F32, li.part_ml_len(self.batch))?,
            part_acc: dev.alloc(Elem::F32, li.part_acc_len(self.batch))?,
            out: dev.alloc(Elem::F32, self.batch * self.shape.q_heads * self.shape.head_dim)?,
            sm_scale: attn.softmax_scale,
            window,
        })
    }
}

fn dedup(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}

fn gen_err(e: kivi_templates::GenError) -> Error {
    Error::Config(e.to_string())
}

/// One prepared decode: buffers allocated, query uploaded.
pub struct DecodeRun<'a> {
    cache: &'a DeviceCache,
    module: &'a Module,
    q: Buffer,
    part_ml: Buffer,
    part_acc: Buffer,
    out: Buffer,
    sm_scale: f32,
    window: Window,
}

impl DecodeRun<'_> {
    /// Issues the decode kernel and the combine kernel (no sync).
    pub fn launch(&mut self) -> Result<()> {
        let c = self.cache;
        let dev = c.dev.as_ref();
        let inputs = if c.scheme.has_vq() {
            let d = c.shape.head_dim;
            let len = |t: Tensor| c.scheme.codec(t).vq().map_or(0, |v| v.codebook_len(d));
            DecodeInputs::Books {
                k: &c.books[0],
                v: &c.books[1],
                len: [len(Tensor::Key), len(Tensor::Value)],
            }
        } else {
            DecodeInputs::Means {
                k: &c.means[0],
                v: &c.means[1],
            }
        };
        DecodeArgs {
            batch: c.batch,
            pool: &c.pool,
            tables: &c.tables,
            table_stride: c.table_stride,
            seq_lens: &c.seq_lens,
            q: &self.q,
            sinks_k: &c.sinks[0],
            sinks_v: &c.sinks[1],
            ring_k: &c.rings[0],
            ring_v: &c.rings[1],
            inputs,
            sm_scale: self.sm_scale,
            window: self.window,
            part_ml: &mut self.part_ml,
            part_acc: &mut self.part_acc,
        }
        .launch(dev, self.module)?;
        CombineArgs {
            batch: c.batch,
            part_ml: &self.part_ml,
            part_acc: &self.part_acc,
            out: &mut self.out,
        }
        .launch(dev, self.module)
    }

    /// Waits for the kernels and downloads `[batch, Hq, D]`.
    pub fn output(&self) -> Result<Vec<f32>> {
        let out = download(self.cache.dev.as_ref(), &self.out)?;
        // Surfaces a kernel fault here, named, rather than at some later call.
        self.cache.dev.sync()?;
        Ok(out)
    }

    /// Times [`DecodeRun::launch`] (on a GPU with events, caches flushed
    /// between runs).
    pub fn time(&mut self, warmup: usize, iters: usize) -> Result<Timing> {
        let dev = self.cache.dev.clone();
        dev.time(warmup, iters, true, &mut || self.launch())
    }
}

/// Decode attention through the generated kernels on a [`Device`].
///
/// Each [`Backend::decode`] call uploads the host cache's sequences (a
/// correctness path); serving and benchmarks keep a [`DeviceCache`] on the
/// device and call [`DeviceCache::decode`].
#[derive(Clone)]
pub struct DeviceBackend {
    device: Arc<dyn Device>,
    /// Decode variant; `None` = the canonical default for the scheme.
    pub variant: Option<Variant>,
}

impl DeviceBackend {
    pub fn new(device: Arc<dyn Device>) -> DeviceBackend {
        DeviceBackend { device, variant: None }
    }
    /// On the device `kind` ([`super::open`]).
    pub fn open(kind: DeviceKind) -> Result<DeviceBackend> {
        Ok(DeviceBackend::new(super::open(kind)?))
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
    pub fn with_variant(mut self, v: Option<Variant>) -> DeviceBackend {
        self.variant = v;
        self
    }
}

impl Backend for DeviceBackend {
    fn name(&self) -> &'static str {
        self.device.kind().name()
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        check_batch(cache, seqs, q)?;
        check_window(cache, seqs.iter().copied(), attn)?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let dc = DeviceCache::upload(self.device.clone(), cache, seqs)?;
        dc.decode(q, attn, self.variant)
    }

    /// Appends on the host cache and on a device copy of its sequences,
    /// then runs the generated block kernel (`kivi_block`) there; see
    /// [`DeviceCache::attend_block`].
    fn attend_block(&self, cache: &mut PagedCache, blocks: &[NewTokens], attn: AttnParams) -> Result<Vec<f32>> {
        // An integer-domain query (`query: int8(...)`): its decode kernel,
        // one query at a time (the block kernel is not generated for it).
        if let Some(r) = crate::backend::int8_blocks(self, cache, blocks, attn) {
            return r;
        }
        block::attend_block(self, cache, blocks, attn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use kivi_spec::{presets, Heads};

    /// Pool, sink/ring rows, lengths, host tables, device tables.
    type Snapshot = (Vec<u32>, Vec<Vec<f32>>, Vec<usize>, Vec<Vec<u32>>, Vec<u32>);

    fn snapshot(dc: &DeviceCache) -> Snapshot {
        let rows = [Tensor::Key, Tensor::Value]
            .iter()
            .flat_map(|&t| [dc.download_rows(t, true).unwrap(), dc.download_rows(t, false).unwrap()])
            .collect();
        let tables = download::<u32>(dc.dev.as_ref(), &dc.tables).unwrap();
        (
            dc.download_pool().unwrap(),
            rows,
            dc.lens.clone(),
            dc.host_tables.clone(),
            tables,
        )
    }

    /// Non-finite values that reach the kernel (the host check is bypassed
    /// here) set status 2, and the launch is undone: every buffer as before.
    #[test]
    fn device_side_nonfinite_is_refused_and_undone() {
        if crate::sim::find_compiler().is_err() {
            eprintln!("skipped: no C++ compiler for the simulator");
            return;
        }
        let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
        let row = 2 * 32;
        let mut dc = DeviceCache::new(SimDevice::shared(), &s, 2, 400, CacheConfig::for_tokens(1024)).unwrap();
        let x: Vec<f32> = (0..2 * 150 * row)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        dc.extend(&[150, 150], &x, &x).unwrap();
        let before = snapshot(&dc);
        let mut k: Vec<f32> = x[..2 * 40 * row].to_vec();
        k[41 * row + 5] = f32::NAN; // sequence 1
        let e = dc.extend_rounded(&[40, 40], &k, &x[..2 * 40 * row], None).unwrap_err();
        assert!(
            e.to_string().contains("sequence 1") && e.to_string().contains("not finite"),
            "{e}"
        );
        assert!(snapshot(&dc) == before, "a refused append changed the device cache");
        assert!(!dc.poisoned);
        // ... and the cache still works.
        dc.extend(&[1, 1], &x[..2 * row], &x[..2 * row]).unwrap();
        assert_eq!(dc.lens(), &[151, 151]);
    }

    /// A scale that overflows on the device (the host's range check is
    /// bypassed here: it refuses such values before any launch) sets status
    /// 1, and the launch is undone.
    #[test]
    fn device_side_overflow_is_refused_and_undone() {
        if crate::sim::find_compiler().is_err() {
            eprintln!("skipped: no C++ compiler for the simulator");
            return;
        }
        let s = kivi_spec::parse_scheme(
            "Ovf { key: quant(bits = 2, axis = channel, group = 32), \
             value: quant(bits = 2, axis = token, group = 32), residual: 0, dtype: f32 }",
        )
        .unwrap()
        .with_shape(Heads::Gqa { q: 4, kv: 2 }, 64)
        .unwrap();
        let row = 2 * 64;
        let mut dc = DeviceCache::new(SimDevice::shared(), &s, 2, 200, CacheConfig::for_tokens(1024)).unwrap();
        let x: Vec<f32> = (0..2 * 45 * row)
            .map(|i| ((i * 29 % 97) as f32 - 48.0) / 20.0)
            .collect();
        dc.extend(&[45, 45], &x, &x).unwrap();
        let before = snapshot(&dc);
        let mut v = x[..2 * row].to_vec();
        v[row + 3] = 1e5;
        v[row + 4] = -1e5;
        // Through the public path the host refuses it, naming the range.
        let e = dc.extend(&[1, 1], &x[..2 * row], &v).unwrap_err();
        assert!(e.to_string().contains("sequence 1"), "{e}");
        assert!(snapshot(&dc) == before);
        // On the device: status 1, undone.
        let e = dc.extend_rounded(&[1, 1], &x[..2 * row], &v, None).unwrap_err();
        assert!(
            e.to_string().contains("sequence 1") && e.to_string().contains("overflowed"),
            "{e}"
        );
        assert!(snapshot(&dc) == before, "a failed device append changed the cache");
        dc.extend(&[1, 1], &x[..2 * row], &x[..2 * row]).unwrap();
        assert_eq!(dc.lens(), &[46, 46]);
    }

    /// The codec pipeline presets get a device cache (the templates
    /// generate every codec; `tests/device_codecs.rs` checks what they do).
    #[test]
    fn pipeline_presets_get_a_device_cache() {
        for p in presets::pipeline() {
            let s = p.with_shape(Heads::Mqa(4), 256).unwrap();
            assert!(DeviceCache::new(SimDevice::shared(), &s, 1, 64, CacheConfig::for_tokens(64)).is_ok());
        }
    }
}
