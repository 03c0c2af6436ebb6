//! The paged cache in device memory and the CUDA backend.
//!
//! [`DeviceCache`] holds a batch of sequences on the GPU in exactly the
//! layout [`PagedCache`] uses on the host (the same pool words, block
//! tables, sink and window buffers), so it can be uploaded from a host
//! cache, filled on the device by the generated prefill/append kernels, and
//! compared word for word. [`CudaBackend`] implements [`Backend`] on top.

use super::device::{driver_err, Device, Loaded, Timing};
use super::toolkit::guarded;
use crate::backend::{check_batch, Backend};
use crate::cache::{CacheConfig, PagedCache, RawRows, SeqId};
use crate::error::{Error, Result};
use crate::quant;
use crate::reference::{round_inputs, AttnParams};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kivi_spec::layout::{self, regions, BlockLayout};
use kivi_spec::{Dtype, Scheme, Shape, Tensor};
use kivi_templates::{default_variant, generate, Generated, Kernel, Variant};
use std::sync::Arc;

/// Activation-dtype values on the device: f16/bf16 bits or f32.
pub enum ActBuf {
    Bits16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

impl ActBuf {
    fn zeros(dev: &Device, dtype: Dtype, len: usize) -> Result<ActBuf> {
        // A zero-length allocation is not portable; one element is harmless.
        let len = len.max(1);
        Ok(match dtype {
            Dtype::F32 => ActBuf::F32(dev.stream.alloc_zeros(len).map_err(driver_err("allocating"))?),
            _ => ActBuf::Bits16(dev.stream.alloc_zeros(len).map_err(driver_err("allocating"))?),
        })
    }

    /// Rounded host values (`round_inputs`) to a device buffer.
    fn from_f32(dev: &Device, dtype: Dtype, x: &[f32]) -> Result<ActBuf> {
        let up = driver_err("uploading");
        Ok(match dtype {
            Dtype::F32 if x.is_empty() => ActBuf::zeros(dev, dtype, 1)?,
            Dtype::F32 => ActBuf::F32(dev.stream.clone_htod(x).map_err(&up)?),
            d => {
                let mut bits: Vec<u16> = x.iter().map(|v| quant::to_bits_16(*v, d)).collect();
                if bits.is_empty() {
                    bits.push(0);
                }
                ActBuf::Bits16(dev.stream.clone_htod(&bits).map_err(&up)?)
            }
        })
    }

    fn from_rows(dev: &Device, dtype: Dtype, parts: &[RawRows<'_>], per_seq: usize) -> Result<ActBuf> {
        let up = driver_err("uploading");
        match dtype {
            Dtype::F32 => {
                let mut v = Vec::with_capacity(parts.len() * per_seq);
                for p in parts {
                    if let RawRows::F32(x) = p {
                        v.extend_from_slice(&x[..per_seq.min(x.len())]);
                    }
                    v.resize(v.len().div_ceil(per_seq.max(1)) * per_seq, 0.0);
                }
                if v.is_empty() {
                    v.push(0.0);
                }
                Ok(ActBuf::F32(dev.stream.clone_htod(&v).map_err(&up)?))
            }
            _ => {
                let mut v = Vec::with_capacity(parts.len() * per_seq);
                for p in parts {
                    if let RawRows::Bits16(x) = p {
                        v.extend_from_slice(&x[..per_seq.min(x.len())]);
                    }
                    v.resize(v.len().div_ceil(per_seq.max(1)) * per_seq, 0);
                }
                if v.is_empty() {
                    v.push(0);
                }
                Ok(ActBuf::Bits16(dev.stream.clone_htod(&v).map_err(&up)?))
            }
        }
    }

    /// Back to f32 on the host (for tests).
    pub fn to_f32(&self, dev: &Device, dtype: Dtype) -> Result<Vec<f32>> {
        let down = driver_err("downloading");
        Ok(match self {
            ActBuf::F32(s) => dev.stream.clone_dtoh(s).map_err(down)?,
            ActBuf::Bits16(s) => dev
                .stream
                .clone_dtoh(s)
                .map_err(down)?
                .into_iter()
                .map(|b| quant::from_bits_16(b, dtype))
                .collect(),
        })
    }
}

/// Pushes an activation buffer as a kernel argument.
macro_rules! act_arg {
    ($b:expr, $buf:expr) => {
        match $buf {
            ActBuf::Bits16(s) => $b.arg(s),
            ActBuf::F32(s) => $b.arg(s),
        }
    };
}

fn gen_err(e: kivi_templates::GenError) -> Error {
    Error::Config(e.to_string())
}

/// The argument lists the launches below push, in order. Checked against
/// the generator's own list before every launch, so a change of kernel
/// signature is an error, not a kernel reading garbage.
const DECODE_PARAMS: [&str; 13] = [
    "pool",
    "tables",
    "table_stride",
    "seq_lens",
    "q",
    "sinks_k",
    "sinks_v",
    "ring_k",
    "ring_v",
    "sm_scale",
    "window",
    "part_ml",
    "part_acc",
];
const COMBINE_PARAMS: [&str; 3] = ["part_ml", "part_acc", "out"];
const EXTEND_PARAMS: [&str; 13] = [
    "pool",
    "tables",
    "table_stride",
    "old_lens",
    "new_counts",
    "k_new",
    "v_new",
    "max_new",
    "sinks_k",
    "sinks_v",
    "ring_k",
    "ring_v",
    "status",
];

fn expected_params(entry: &str) -> &'static [&'static str] {
    match entry {
        "kivi_decode" => &DECODE_PARAMS,
        "kivi_combine" => &COMBINE_PARAMS,
        _ => &EXTEND_PARAMS,
    }
}

fn cfg_of(g: &Generated, entry: &str, batch: usize) -> Result<LaunchConfig> {
    let e = g
        .launch
        .entry(entry)
        .ok_or_else(|| Error::Config(format!("`{}` has no launch shape for `{entry}`", g.name)))?;
    let names: Vec<&str> = e.params.iter().map(|p| p.name).collect();
    if names != expected_params(entry) {
        return Err(Error::Config(format!(
            "`{}`: kernel `{entry}` takes ({}), the CUDA backend passes ({})",
            g.name,
            names.join(", "),
            expected_params(entry).join(", ")
        )));
    }
    let grid = e.grid(batch as u32, 0);
    Ok(LaunchConfig {
        grid_dim: (grid[0], grid[1], grid[2]),
        block_dim: (e.block[0], e.block[1], e.block[2]),
        // The templates use static shared memory only.
        shared_mem_bytes: 0,
    })
}

/// A batch of sequences of one scheme, resident on the GPU.
pub struct DeviceCache {
    dev: Arc<Device>,
    scheme: Scheme,
    shape: Shape,
    layout: BlockLayout,
    batch: usize,
    table_stride: usize,
    pool: CudaSlice<u32>,
    tables: CudaSlice<u32>,
    seq_lens: CudaSlice<i32>,
    sinks: [ActBuf; 2],
    rings: [ActBuf; 2],
    /// Host copy of the bookkeeping (block tables, lengths, free blocks),
    /// mirroring [`PagedCache`]'s allocation order.
    host_tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
    free: Vec<u32>,
    /// Set when a device-side append failed half-way; every later call errors.
    poisoned: bool,
}

fn ti(t: Tensor) -> usize {
    match t {
        Tensor::Key => 0,
        Tensor::Value => 1,
    }
}

impl DeviceCache {
    /// An empty batch of `batch` sequences, each able to hold `max_tokens`
    /// tokens, with `config.max_blocks` blocks in the pool.
    pub fn new(
        dev: Arc<Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
    ) -> Result<DeviceCache> {
        kivi_spec::validate(scheme)?;
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
        guarded("allocating a device cache", || {
            let z = driver_err("allocating");
            let sinks = scheme.sinks as usize;
            let ring = |t| layout::window_capacity(scheme, t).max(1);
            Ok(DeviceCache {
                pool: dev.stream.alloc_zeros::<u32>(words.max(1)).map_err(&z)?,
                tables: dev.stream.alloc_zeros::<u32>(batch * stride).map_err(&z)?,
                seq_lens: dev.stream.alloc_zeros::<i32>(batch).map_err(&z)?,
                sinks: [
                    ActBuf::zeros(&dev, scheme.dtype, batch * sinks * h * d)?,
                    ActBuf::zeros(&dev, scheme.dtype, batch * sinks * h * d)?,
                ],
                rings: [
                    ActBuf::zeros(&dev, scheme.dtype, batch * ring(Tensor::Key) * h * d)?,
                    ActBuf::zeros(&dev, scheme.dtype, batch * ring(Tensor::Value) * h * d)?,
                ],
                dev: dev.clone(),
                scheme: scheme.clone(),
                shape,
                layout,
                batch,
                table_stride: stride,
                host_tables: vec![Vec::new(); batch],
                lens: vec![0; batch],
                free: (0..config.max_blocks as u32).rev().collect(),
                poisoned: false,
            })
        })
    }

    /// Copies sequences `seqs` of a host cache to the device, in that order.
    pub fn upload(dev: Arc<Device>, cache: &PagedCache, seqs: &[SeqId]) -> Result<DeviceCache> {
        if seqs.is_empty() {
            return Err(Error::Config("no sequences to upload".into()));
        }
        let scheme = cache.scheme().clone();
        let shape = cache.shape();
        let layout = *cache.layout();
        let views: Vec<_> = seqs.iter().map(|&s| cache.view(s)).collect::<Result<_>>()?;
        let stride = views.iter().map(|v| v.table().len()).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; seqs.len() * stride];
        for (b, v) in views.iter().enumerate() {
            tables[b * stride..b * stride + v.table().len()].copy_from_slice(v.table());
        }
        let lens: Vec<i32> = views.iter().map(|v| v.tokens() as i32).collect();
        let (h, d) = (shape.kv_heads, shape.head_dim);
        let sinks_per = scheme.sinks as usize * h * d;
        guarded("uploading a cache", || {
            let up = driver_err("uploading");
            let stack = |t: Tensor, sinks: bool| -> Result<ActBuf> {
                let parts: Vec<RawRows> = views
                    .iter()
                    .map(|v| if sinks { v.sinks_raw(t) } else { v.ring_raw(t) })
                    .collect();
                let per = if sinks {
                    sinks_per
                } else {
                    layout::window_capacity(&scheme, t).max(1) * h * d
                };
                ActBuf::from_rows(&dev, scheme.dtype, &parts, per)
            };
            Ok(DeviceCache {
                pool: dev.stream.clone_htod(cache.pool()).map_err(&up)?,
                tables: dev.stream.clone_htod(&tables).map_err(&up)?,
                seq_lens: dev.stream.clone_htod(&lens).map_err(&up)?,
                sinks: [stack(Tensor::Key, true)?, stack(Tensor::Value, true)?],
                rings: [stack(Tensor::Key, false)?, stack(Tensor::Value, false)?],
                dev: dev.clone(),
                host_tables: views.iter().map(|v| v.table().to_vec()).collect(),
                lens: views.iter().map(|v| v.tokens()).collect(),
                // Uploaded caches are read-only: appends need the host's free list.
                free: Vec::new(),
                scheme: scheme.clone(),
                shape,
                layout,
                batch: seqs.len(),
                table_stride: stride,
                poisoned: false,
            })
        })
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
    /// Block table of sequence `b`.
    pub fn table(&self, b: usize) -> &[u32] {
        &self.host_tables[b]
    }
    /// Bytes of KV data a decode over the whole batch reads: the blocks of
    /// every sequence plus its sink and window rows (what the roofline counts).
    pub fn decode_bytes(&self) -> usize {
        let mut total = 0;
        for &t in &self.lens {
            let f = layout::Footprint::for_tokens(&self.scheme, t);
            total += f.total();
        }
        total
    }

    fn check(&self) -> Result<()> {
        if self.poisoned {
            return Err(Error::Config(
                "this device cache was left inconsistent by a failed append; upload it again".into(),
            ));
        }
        Ok(())
    }

    /// The pool words (for comparing with a host cache).
    pub fn download_pool(&self) -> Result<Vec<u32>> {
        self.dev
            .stream
            .clone_dtoh(&self.pool)
            .map_err(driver_err("downloading"))
    }
    /// Sink (`sinks = true`) or window buffer of tensor `t`, `[batch][slots][Hkv][D]` as f32.
    pub fn download_rows(&self, t: Tensor, sinks: bool) -> Result<Vec<f32>> {
        let buf = if sinks { &self.sinks[ti(t)] } else { &self.rings[ti(t)] };
        buf.to_f32(&self.dev, self.scheme.dtype)
    }

    /// Adds `counts[b]` tokens to sequence `b` on the device: `k`, `v` hold
    /// `[sum(counts), Hkv, D]` f32 (sequence 0's tokens first). Uses the
    /// append kernel when every count is at most 1, prefill otherwise.
    /// Rounds and checks the inputs on the host first (non-finite values are
    /// refused with nothing changed); a scale that overflows on the device
    /// fails the call and poisons the cache.
    pub fn extend(&mut self, counts: &[usize], k: &[f32], v: &[f32]) -> Result<()> {
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
        // Reserve blocks exactly as PagedCache::extend does, sequence by sequence.
        let bt = self.layout.block_tokens;
        let mut tables = self.host_tables.clone();
        let mut free = self.free.clone();
        for (b, &n) in counts.iter().enumerate() {
            let new_len = self.lens[b] + n;
            let q = regions(&self.scheme, Tensor::Key, new_len)
                .quantized
                .max(regions(&self.scheme, Tensor::Value, new_len).quantized);
            let blocks = q.div_ceil(bt);
            if blocks > self.table_stride {
                return Err(Error::Config(format!(
                    "sequence {b} would hold {new_len} tokens, more than this device cache was sized for ({})",
                    self.table_stride * bt
                )));
            }
            let need = blocks.saturating_sub(tables[b].len());
            if need > free.len() {
                return Err(Error::OutOfBlocks {
                    need,
                    free: free.len(),
                    total: self.pool.len() / self.layout.block_words.max(1),
                });
            }
            let split = free.len() - need;
            tables[b].extend(free[split..].iter().rev());
            free.truncate(split);
        }
        let max_new = counts.iter().copied().max().unwrap_or(0);
        if max_new == 0 {
            return Ok(());
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
        let kernel = if max_new > 1 { Kernel::Prefill } else { Kernel::Append };
        let g = generate(&self.scheme, kernel, &default_variant(&self.scheme, kernel)).map_err(gen_err)?;
        let loaded = self.dev.load(&g)?;
        let entry = g.entry_points[0].clone();
        let mut flat = vec![0u32; self.batch * self.table_stride];
        for (b, t) in tables.iter().enumerate() {
            flat[b * self.table_stride..][..t.len()].copy_from_slice(t);
        }
        let old: Vec<i32> = self.lens.iter().map(|&x| x as i32).collect();
        let cnt: Vec<i32> = counts.iter().map(|&x| x as i32).collect();
        let dev = self.dev.clone();
        let dtype = self.scheme.dtype;
        let status = guarded("device extend", || {
            let up = driver_err("uploading");
            dev.stream.memcpy_htod(&flat, &mut self.tables).map_err(&up)?;
            let old_d = dev.stream.clone_htod(&old).map_err(&up)?;
            let cnt_d = dev.stream.clone_htod(&cnt).map_err(&up)?;
            let k_d = ActBuf::from_f32(&dev, dtype, &kp)?;
            let v_d = ActBuf::from_f32(&dev, dtype, &vp)?;
            let status_d = dev.stream.alloc_zeros::<i32>(self.batch).map_err(&up)?;
            let f = loaded.function(&entry)?;
            let stride = self.table_stride as i32;
            let max_new_i = max_new as i32;
            let cfg = cfg_of(&g, &entry, self.batch)?;
            let mut b = dev.stream.launch_builder(f);
            b.arg(&mut self.pool)
                .arg(&self.tables)
                .arg(&stride)
                .arg(&old_d)
                .arg(&cnt_d);
            act_arg!(b, &k_d);
            act_arg!(b, &v_d);
            b.arg(&max_new_i);
            let [sk, sv] = &mut self.sinks;
            let [rk, rv] = &mut self.rings;
            act_arg!(b, sk);
            act_arg!(b, sv);
            act_arg!(b, rk);
            act_arg!(b, rv);
            b.arg(&status_d);
            // SAFETY: the arguments match the entry point's parameter list
            // (kivi_templates::EntryLaunch::params) in order and type, and
            // every buffer is sized for this batch.
            unsafe { b.launch(cfg) }.map_err(driver_err(&format!("launching `{}`", g.name)))?;
            let lens: Vec<i32> = old.iter().zip(&cnt).map(|(a, c)| a + c).collect();
            dev.stream.memcpy_htod(&lens, &mut self.seq_lens).map_err(&up)?;
            let status = dev.stream.clone_dtoh(&status_d).map_err(driver_err("downloading"))?;
            dev.sync()?;
            Ok(status)
        });
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                self.poisoned = true;
                return Err(e);
            }
        };
        if let Some(b) = status.iter().position(|&s| s != 0) {
            self.poisoned = true;
            return Err(Error::Config(format!(
                "a scale or zero point of sequence {b} overflowed its scale dtype during the device append \
                 (use scale = f32); the device cache must be uploaded again"
            )));
        }
        self.host_tables = tables;
        self.free = free;
        for (l, n) in self.lens.iter_mut().zip(counts) {
            *l += n;
        }
        Ok(())
    }

    /// The decode kernel and its combine step for `variant` (default when `None`).
    pub fn decode_module(&self, variant: Option<Variant>) -> Result<Arc<Loaded>> {
        let v = variant.unwrap_or_else(|| default_variant(&self.scheme, Kernel::Decode));
        let g = generate(&self.scheme, Kernel::Decode, &v).map_err(gen_err)?;
        self.dev.load(&g)
    }

    /// Decode attention of one query per sequence (`q` is `[batch, Hq, D]`);
    /// returns `[batch, Hq, D]`.
    pub fn decode(&self, q: &[f32], attn: AttnParams, variant: Option<Variant>) -> Result<Vec<f32>> {
        if attn.window == Some(0) {
            // A window of no tokens attends to nothing (the kernels read 0 as
            // "no window"); the oracle's answer is zero.
            self.check()?;
            let n = self.batch * self.shape.q_heads * self.shape.head_dim;
            if q.len() != n {
                return Err(Error::Shape {
                    what: "query batch",
                    expected: n.to_string(),
                    got: q.len().to_string(),
                });
            }
            round_inputs(&self.scheme, "query", q, self.shape.q_heads, self.shape.head_dim)?;
            return Ok(vec![0.0; n]);
        }
        let m = self.decode_module(variant)?;
        let mut run = self.prepare_decode(&m, q, attn)?;
        run.launch()?;
        run.output()
    }

    /// Uploads the query and allocates the outputs, so that
    /// [`DecodeRun::launch`] enqueues only the two kernels (what a benchmark times).
    pub fn prepare_decode<'a>(&'a self, module: &'a Loaded, q: &[f32], attn: AttnParams) -> Result<DecodeRun<'a>> {
        self.check()?;
        let (hq, d) = (self.shape.q_heads, self.shape.head_dim);
        if q.len() != self.batch * hq * d {
            return Err(Error::Shape {
                what: "query batch",
                expected: format!("{} values ({} x {hq} x {d})", self.batch * hq * d, self.batch),
                got: q.len().to_string(),
            });
        }
        let qr = round_inputs(&self.scheme, "query", q, hq, d)?;
        let g = &module.generated;
        let window =
            match attn.window {
                Some(0) => return Err(Error::Config(
                    "a sliding window of 0 tokens attends to nothing; DeviceCache::decode answers it without a launch"
                        .into(),
                )),
                None => 0,
                Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
            };
        guarded("preparing a decode", || {
            let z = driver_err("allocating");
            Ok(DecodeRun {
                cache: self,
                module,
                q: ActBuf::from_f32(&self.dev, self.scheme.dtype, &qr)?,
                part_ml: self
                    .dev
                    .stream
                    .alloc_zeros::<f32>(g.launch.part_ml_len(self.batch).max(1))
                    .map_err(&z)?,
                part_acc: self
                    .dev
                    .stream
                    .alloc_zeros::<f32>(g.launch.part_acc_len(self.batch).max(1))
                    .map_err(&z)?,
                out: self.dev.stream.alloc_zeros::<f32>(self.batch * hq * d).map_err(&z)?,
                sm_scale: attn.softmax_scale,
                window,
            })
        })
    }
}

/// One prepared decode: buffers allocated, query uploaded.
pub struct DecodeRun<'a> {
    cache: &'a DeviceCache,
    module: &'a Loaded,
    q: ActBuf,
    part_ml: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    out: CudaSlice<f32>,
    sm_scale: f32,
    window: i32,
}

impl DecodeRun<'_> {
    /// Enqueues the decode kernel and the combine kernel (no sync).
    pub fn launch(&mut self) -> Result<()> {
        let c = self.cache;
        let g = &self.module.generated;
        let dev = &c.dev;
        guarded("launching decode", || {
            let stride = c.table_stride as i32;
            let cfg = cfg_of(g, "kivi_decode", c.batch)?;
            let f = self.module.function("kivi_decode")?;
            let mut b = dev.stream.launch_builder(f);
            b.arg(&c.pool).arg(&c.tables).arg(&stride).arg(&c.seq_lens);
            act_arg!(b, &self.q);
            act_arg!(b, &c.sinks[0]);
            act_arg!(b, &c.sinks[1]);
            act_arg!(b, &c.rings[0]);
            act_arg!(b, &c.rings[1]);
            b.arg(&self.sm_scale)
                .arg(&self.window)
                .arg(&mut self.part_ml)
                .arg(&mut self.part_acc);
            // SAFETY: arguments in the order and types of the entry point's
            // parameter list; buffers sized from LaunchInfo for this batch.
            unsafe { b.launch(cfg) }.map_err(driver_err(&format!("launching `{}`", g.name)))?;
            let cfg = cfg_of(g, "kivi_combine", c.batch)?;
            let f = self.module.function("kivi_combine")?;
            let mut b = dev.stream.launch_builder(f);
            b.arg(&self.part_ml).arg(&self.part_acc).arg(&mut self.out);
            // SAFETY: as above.
            unsafe { b.launch(cfg) }.map_err(driver_err("launching kivi_combine"))?;
            Ok(())
        })
    }

    /// Waits for the kernels and downloads `[batch, Hq, D]`.
    pub fn output(&self) -> Result<Vec<f32>> {
        let out = self
            .cache
            .dev
            .stream
            .clone_dtoh(&self.out)
            .map_err(driver_err("downloading the output"))?;
        // Surfaces a kernel fault here, named, rather than at some later call.
        self.cache.dev.sync()?;
        Ok(out)
    }

    /// Times [`DecodeRun::launch`] with CUDA events (L2 flushed between runs).
    pub fn time(&mut self, warmup: usize, iters: usize) -> Result<Timing> {
        let dev = self.cache.dev.clone();
        dev.time(warmup, iters, true, || self.launch())
    }
}

/// Decode attention on a GPU through the generated kernels.
///
/// Each [`Backend::decode`] call uploads the host cache's sequences (a
/// correctness path); serving and benchmarks keep a [`DeviceCache`] on the
/// device and call [`DeviceCache::decode`].
#[derive(Clone)]
pub struct CudaBackend {
    device: Arc<Device>,
    /// Decode variant; `None` = the canonical default for the scheme.
    pub variant: Option<Variant>,
}

impl CudaBackend {
    /// The backend on GPU 0, or [`Error::Unavailable`] (never a panic).
    pub fn new() -> Result<CudaBackend> {
        CudaBackend::on(0)
    }
    /// The backend on GPU `ordinal`.
    pub fn on(ordinal: usize) -> Result<CudaBackend> {
        Ok(CudaBackend {
            device: Arc::new(Device::new(ordinal)?),
            variant: None,
        })
    }
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
    pub fn with_variant(mut self, v: Option<Variant>) -> CudaBackend {
        self.variant = v;
        self
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        check_batch(cache, seqs, q)?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let dc = DeviceCache::upload(self.device.clone(), cache, seqs)?;
        dc.decode(q, attn, self.variant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kivi_spec::{presets, Heads};

    /// The generator's kernel signatures are the ones the launches push.
    #[test]
    fn launches_match_the_generated_signatures() {
        for p in presets::all() {
            let s = p.with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
            for k in Kernel::ALL {
                let g = generate(&s, k, &default_variant(&s, k)).unwrap();
                for e in &g.entry_points {
                    let cfg = cfg_of(&g, e, 3).unwrap();
                    assert_eq!(cfg.grid_dim.2, 3, "grid z is the batch");
                    assert_eq!(cfg.shared_mem_bytes, 0);
                }
            }
        }
    }
}
