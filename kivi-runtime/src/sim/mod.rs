//! The `sim` backend: runs the *generated CUDA source itself* on the CPU.
//!
//! [`compile`] builds generated sources (many variants per library) as
//! C++17 against `templates/cuda/sim_shim.h`, which maps the CUDA subset the
//! templates use onto host code: the threads of a block become fibers on one
//! OS thread, switched at `__syncthreads` and warp shuffles, and blocks run
//! one after another on a few worker threads. Libraries are cached on disk
//! by a hash of compiler, flags, shim and sources ([`cache_dir`]).
//!
//! [`SimBackend`] implements [`Backend`] (decode attention over a
//! [`PagedCache`]) for one decode variant; [`SimExtend`] runs the prefill or
//! append kernel on a copy of a cache's pool and windows, so tests can
//! compare the words it writes with `PagedCache`'s own.
//!
//! ```no_run
//! use kivi_runtime::sim::SimBackend;
//! use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache};
//! use kivi_spec::{presets, Heads};
//! let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
//! let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(512)).unwrap();
//! let seq = cache.add_sequence();
//! let kv = vec![0.5f32; 300 * 2 * 64];
//! cache.extend(seq, &kv, &kv).unwrap();
//! let sim = SimBackend::for_cache(&cache, None).unwrap(); // default variant
//! let q = vec![0.25f32; 8 * 64];
//! let out = sim.decode(&cache, &[seq], &q, AttnParams::of(&s, s.shape().unwrap())).unwrap();
//! assert_eq!(out.len(), 8 * 64);
//! ```

mod compile;

pub use compile::{
    cache_dir, check_launch, compile, compile_flags, find_compiler, translation_unit, ArchLimits, Schedule, SimLibrary,
    SimOptions,
};

use crate::backend::{check_batch, check_window, Backend};
use crate::cache::{PagedCache, RawRows, SeqId};
use crate::device::args::{ExtendArgs, ExtendInputs};
use crate::device::{download, upload, Buffer, DeviceCache, Elem, Module, SimDevice};
use crate::error::{Error, Result};
use crate::quant::{round_to_dtype, to_bits_16};
use crate::reference::AttnParams;
use kivi_spec::layout::{regions, window_capacity};
use kivi_spec::{Dtype, Scheme, Shape, Tensor};
use kivi_templates::{generate_with, GenOptions, Generated, Kernel, Variant};
use std::sync::Arc;

/// A buffer of activation elements as a kernel reads them.
#[derive(Clone, Debug, PartialEq)]
pub enum ActBuf {
    /// f16 or bf16 bits.
    Bits16(Vec<u16>),
    F32(Vec<f32>),
}

impl ActBuf {
    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: Dtype, len: usize) -> ActBuf {
        match dtype {
            Dtype::F32 => ActBuf::F32(vec![0.0; len]),
            _ => ActBuf::Bits16(vec![0; len]),
        }
    }
    /// Copies raw rows as a cache stores them.
    pub fn from_raw(r: RawRows<'_>) -> ActBuf {
        match r {
            RawRows::Bits16(v) => ActBuf::Bits16(v.to_vec()),
            RawRows::F32(v) => ActBuf::F32(v.to_vec()),
        }
    }
    /// Rounds f32 values to `dtype` (round to nearest even); a value that is
    /// not finite after rounding is refused.
    pub fn round(dtype: Dtype, x: &[f32], what: &'static str) -> Result<ActBuf> {
        for (i, &v) in x.iter().enumerate() {
            if !round_to_dtype(v, dtype).is_finite() {
                return Err(Error::NonFinite {
                    tensor: what,
                    value: v,
                    token: 0,
                    head: 0,
                    channel: i,
                    policy: "reject",
                });
            }
        }
        Ok(match dtype {
            Dtype::F32 => ActBuf::F32(x.to_vec()),
            d => ActBuf::Bits16(x.iter().map(|v| to_bits_16(*v, d)).collect()),
        })
    }
    pub fn len(&self) -> usize {
        match self {
            ActBuf::Bits16(v) => v.len(),
            ActBuf::F32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn extend_from(&mut self, other: &ActBuf) -> Result<()> {
        match (self, other) {
            (ActBuf::Bits16(a), ActBuf::Bits16(b)) => a.extend_from_slice(b),
            (ActBuf::F32(a), ActBuf::F32(b)) => a.extend_from_slice(b),
            _ => return Err(Error::Config("mixed activation dtypes in one batch".into())),
        }
        Ok(())
    }
}

/// Decode attention by a generated kernel variant, run on the CPU.
#[derive(Clone)]
pub struct SimBackend {
    scheme: Scheme,
    module: Arc<Module>,
}

impl SimBackend {
    /// Generates and compiles `variant` (the default when `None`) of the
    /// decode kernel for `scheme` (with a shape) and block size.
    pub fn new(scheme: &Scheme, variant: Option<&Variant>, opts: GenOptions) -> Result<SimBackend> {
        let g = generate_decode(scheme, variant, opts)?;
        let lib = compile(&[&g])?;
        SimBackend::with_library(scheme, g, lib)
    }

    /// [`SimBackend::new`] for the scheme and block size of `cache`.
    pub fn for_cache(cache: &PagedCache, variant: Option<&Variant>) -> Result<SimBackend> {
        let opts = GenOptions {
            block_tokens: Some(cache.layout().block_tokens),
        };
        SimBackend::new(cache.scheme(), variant, opts)
    }

    /// A backend for an already generated decode source `g` compiled into
    /// `lib` (see [`compile`]; one library can hold many variants).
    pub fn with_library(scheme: &Scheme, g: Generated, lib: Arc<SimLibrary>) -> Result<SimBackend> {
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        for e in ["kivi_decode", "kivi_combine"] {
            if !lib.contains(&g, e) {
                return Err(Error::Config(format!("sim library lacks `{e}` of {}", g.name)));
            }
        }
        let _ = shape;
        Ok(SimBackend {
            scheme: scheme.clone(),
            module: Arc::new(Module::sim(g, lib)),
        })
    }

    /// The kernel this backend runs.
    pub fn generated(&self) -> &Generated {
        &self.module.generated
    }

    fn module(&self) -> Arc<Module> {
        self.module.clone()
    }
}

/// The decode source of `variant` (or the default) for `scheme`.
pub fn generate_decode(scheme: &Scheme, variant: Option<&Variant>, opts: GenOptions) -> Result<Generated> {
    let v = match variant {
        Some(v) => *v,
        None => kivi_templates::default_variant(scheme, Kernel::Decode),
    };
    generate_with(scheme, Kernel::Decode, &v, opts).map_err(|e| Error::Config(e.to_string()))
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        check_batch(cache, seqs, q)?;
        check_window(cache, seqs.iter().copied(), attn)?;
        if kivi_spec::scheme_hash(cache.scheme()) != kivi_spec::scheme_hash(&self.scheme)
            || cache.layout().block_tokens != self.module.generated.block_tokens
        {
            return Err(Error::Config(format!(
                "the sim kernel {} was generated for another scheme or block size than this cache's",
                self.module.generated.name
            )));
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        // The same host path as a GPU's: upload, then the typed launches.
        let dc = DeviceCache::upload(SimDevice::shared(), cache, seqs)?;
        dc.decode_on(&self.module(), q, attn)
    }
}

/// One sequence's state as the prefill/append kernels see it: its block
/// table, token count, sink and window buffers (`[slots][Hkv][D]`), and
/// the centering means of centered tensors (`[Hkv][D]`, zeros until the
/// first `N` tokens exist; empty for a tensor that is not centered).
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    pub tokens: usize,
    pub table: Vec<u32>,
    /// Key, value.
    pub sinks: [ActBuf; 2],
    pub ring: [ActBuf; 2],
    pub means: [ActBuf; 2],
}

/// Element `i` of a state's six buffers: sinks, rings, means (key, value).
fn state_buf(s: &mut SeqState, i: usize) -> &mut ActBuf {
    match i {
        0 | 1 => &mut s.sinks[i],
        2 | 3 => &mut s.ring[i - 2],
        _ => &mut s.means[i - 4],
    }
}

impl SeqState {
    /// An empty sequence of `scheme` (with a shape) using blocks `table`.
    pub fn empty(scheme: &Scheme, table: Vec<u32>) -> Result<SeqState> {
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        let row = shape.kv_heads * shape.head_dim;
        let buf = |n: usize| ActBuf::zeros(scheme.dtype, n * row);
        Ok(SeqState {
            tokens: 0,
            table,
            sinks: [buf(scheme.sinks as usize), buf(scheme.sinks as usize)],
            ring: [
                buf(window_capacity(scheme, Tensor::Key)),
                buf(window_capacity(scheme, Tensor::Value)),
            ],
            means: [Tensor::Key, Tensor::Value].map(|t| buf(scheme.center_of(t).map_or(0, |_| 1))),
        })
    }
    /// A copy of what `cache` holds for `id`.
    pub fn of(cache: &PagedCache, id: SeqId) -> Result<SeqState> {
        let v = cache.view(id)?;
        let s = cache.scheme();
        let (h, d) = (cache.shape().kv_heads, cache.shape().head_dim);
        let mut means = [ActBuf::zeros(s.dtype, 0), ActBuf::zeros(s.dtype, 0)];
        for (i, t) in [Tensor::Key, Tensor::Value].into_iter().enumerate() {
            if s.center_of(t).is_some() {
                let mut m = vec![0f32; h * d];
                for hh in 0..h {
                    if let Some(x) = v.mean(t, hh) {
                        m[hh * d..][..d].copy_from_slice(x);
                    }
                }
                means[i] = ActBuf::round(s.dtype, &m, "mean")?;
            }
        }
        Ok(SeqState {
            tokens: v.tokens(),
            table: v.logical_table(),
            sinks: [
                ActBuf::from_raw(v.sinks_raw(Tensor::Key)),
                ActBuf::from_raw(v.sinks_raw(Tensor::Value)),
            ],
            ring: [
                ActBuf::from_raw(v.ring_raw(Tensor::Key)),
                ActBuf::from_raw(v.ring_raw(Tensor::Value)),
            ],
            means,
        })
    }
}

/// The prefill or append kernel of a scheme, run on the CPU.
#[derive(Clone, Debug)]
pub struct SimExtend {
    scheme: Scheme,
    shape: Shape,
    generated: Generated,
    lib: Arc<SimLibrary>,
}

impl SimExtend {
    /// Generates and compiles `kernel` (`Prefill` or `Append`), `variant` or
    /// the default, for `scheme` and block size.
    pub fn new(scheme: &Scheme, kernel: Kernel, variant: Option<&Variant>, opts: GenOptions) -> Result<SimExtend> {
        if !matches!(kernel, Kernel::Prefill | Kernel::Append) {
            return Err(Error::Config(format!("SimExtend runs prefill or append, not {kernel}")));
        }
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        let v = variant
            .copied()
            .unwrap_or_else(|| kivi_templates::default_variant(scheme, kernel));
        let g = generate_with(scheme, kernel, &v, opts).map_err(|e| Error::Config(e.to_string()))?;
        let lib = compile(&[&g])?;
        let _ = shape;
        SimExtend::with_library(scheme, g, lib)
    }

    /// A runner for an already generated prefill or append source `g`
    /// compiled into `lib` (one library can hold many).
    pub fn with_library(scheme: &Scheme, g: Generated, lib: Arc<SimLibrary>) -> Result<SimExtend> {
        let shape = scheme.shape().ok_or_else(|| Error::Unbound(scheme.name.clone()))?;
        let entry = g.entry_points.first().cloned().unwrap_or_default();
        if !matches!(entry.as_str(), "kivi_prefill" | "kivi_append") || !lib.contains(&g, &entry) {
            return Err(Error::Config(format!(
                "{} is not a prefill or append kernel of this library",
                g.name
            )));
        }
        Ok(SimExtend {
            scheme: scheme.clone(),
            shape,
            generated: g,
            lib,
        })
    }

    pub fn generated(&self) -> &Generated {
        &self.generated
    }

    /// Adds tokens to a batch of sequences: `k_new[b]`, `v_new[b]` are
    /// `[n_b, Hkv, D]` f32 (rounded to the activation dtype here). Writes
    /// the blocks of `pool` (laid out as the scheme's `BlockLayout`) and
    /// each state's buffers; `states[b].table` must already hold the blocks
    /// the new tokens need. Returns, per sequence, whether a scale or zero
    /// point overflowed its dtype (the append must then count as failed).
    pub fn run(
        &self,
        pool: &mut [u32],
        states: &mut [SeqState],
        k_new: &[&[f32]],
        v_new: &[&[f32]],
    ) -> Result<Vec<bool>> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let batch = states.len();
        if k_new.len() != batch || v_new.len() != batch {
            return Err(Error::Config(format!(
                "{batch} sequences but {} / {} inputs",
                k_new.len(),
                v_new.len()
            )));
        }
        if batch == 0 {
            return Ok(Vec::new());
        }
        let bt = self.generated.block_tokens;
        let block_words = kivi_spec::layout::BlockLayout::new(&self.scheme, self.shape, bt).block_words;
        let dtype = self.scheme.dtype;
        let mut counts = Vec::with_capacity(batch);
        for b in 0..batch {
            if k_new[b].len() != v_new[b].len() || !k_new[b].len().is_multiple_of(h * d) {
                return Err(Error::Shape {
                    what: "key/value input",
                    expected: format!("equal lengths, multiples of {}", h * d),
                    got: format!("{} and {}", k_new[b].len(), v_new[b].len()),
                });
            }
            let n = k_new[b].len() / (h * d);
            if self.generated.entry_points[0] == "kivi_append" && n > 1 {
                return Err(Error::Config(format!(
                    "the append kernel adds one token per sequence, not {n}"
                )));
            }
            let s = &states[b];
            let after = s.tokens + n;
            let need = [Tensor::Key, Tensor::Value]
                .iter()
                .map(|&t| regions(&self.scheme, t, after).quantized)
                .max()
                .unwrap_or(0)
                .div_ceil(bt);
            if s.table.len() < need {
                return Err(Error::Config(format!(
                    "sequence {b} needs {need} blocks for {after} tokens, its table has {}",
                    s.table.len()
                )));
            }
            if s.table.iter().any(|&blk| (blk as usize + 1) * block_words > pool.len()) {
                return Err(Error::Config(format!("sequence {b} names a block outside the pool")));
            }
            let row = h * d;
            let sizes = [
                (s.sinks[0].len(), self.scheme.sinks as usize * row),
                (s.sinks[1].len(), self.scheme.sinks as usize * row),
                (s.ring[0].len(), window_capacity(&self.scheme, Tensor::Key) * row),
                (s.ring[1].len(), window_capacity(&self.scheme, Tensor::Value) * row),
                (s.means[0].len(), self.scheme.center_of(Tensor::Key).map_or(0, |_| row)),
                (
                    s.means[1].len(),
                    self.scheme.center_of(Tensor::Value).map_or(0, |_| row),
                ),
            ];
            if sizes.iter().any(|(got, want)| got != want) {
                return Err(Error::Config(format!(
                    "sequence {b}: sink/window/means buffers do not match the scheme"
                )));
            }
            counts.push(n);
        }
        let max_new = counts.iter().copied().max().unwrap_or(0).max(1);
        let stride = states.iter().map(|s| s.table.len()).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; batch * stride];
        let mut k = ActBuf::zeros(dtype, batch * max_new * h * d);
        let mut v = ActBuf::zeros(dtype, batch * max_new * h * d);
        for b in 0..batch {
            tables[b * stride..b * stride + states[b].table.len()].copy_from_slice(&states[b].table);
            for (dst, src) in [(&mut k, k_new[b]), (&mut v, v_new[b])] {
                let r = ActBuf::round(dtype, src, "key/value")?;
                let at = b * max_new * h * d;
                match (dst, r) {
                    (ActBuf::Bits16(a), ActBuf::Bits16(x)) => a[at..at + x.len()].copy_from_slice(&x),
                    (ActBuf::F32(a), ActBuf::F32(x)) => a[at..at + x.len()].copy_from_slice(&x),
                    _ => unreachable!("same dtype"),
                }
            }
        }
        let old: Vec<i32> = states.iter().map(|s| s.tokens as i32).collect();
        let n: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
        let mut bufs: Vec<ActBuf> = Vec::new();
        for i in 0..6 {
            let mut all = ActBuf::zeros(dtype, 0);
            for s in states.iter_mut() {
                all.extend_from(state_buf(s, i))?;
            }
            if all.is_empty() {
                all = ActBuf::zeros(dtype, 1);
            }
            bufs.push(all);
        }
        // Through the device layer on the simulated device: the arguments
        // are built by `device::args::ExtendArgs`, as for a GPU.
        let dev = SimDevice::shared();
        let d = dev.as_ref();
        let to_dev = |b: &ActBuf| -> Result<Buffer> {
            match b {
                ActBuf::Bits16(v) => upload(d, v),
                ActBuf::F32(v) => upload(d, v),
            }
        };
        let mut pool_d = upload(d, pool)?;
        let mut dev_bufs: Vec<Buffer> = bufs.iter().map(&to_dev).collect::<Result<_>>()?;
        let mut status_d = d.alloc(Elem::I32, batch)?;
        let work = kivi_templates::extend_work_floats(&self.scheme, GenOptions { block_tokens: Some(bt) })
            .map_err(|e| Error::Config(e.to_string()))?;
        let mut work_d = d.alloc(Elem::F32, (batch * 2 * h * work).max(1))?;
        let module = Module::sim(self.generated.clone(), self.lib.clone());
        {
            let [sk, sv, rk, rv, mk, mv] = &mut dev_bufs[..] else {
                unreachable!("six buffers")
            };
            ExtendArgs {
                batch,
                pool: &mut pool_d,
                tables: &upload(d, &tables)?,
                table_stride: stride,
                old_lens: &upload(d, &old)?,
                new_counts: &upload(d, &n)?,
                k_new: &to_dev(&k)?,
                v_new: &to_dev(&v)?,
                max_new,
                sinks_k: sk,
                sinks_v: sv,
                ring_k: rk,
                ring_v: rv,
                inputs: ExtendInputs::Means { k: mk, v: mv },
                work: &mut work_d,
                status: &mut status_d,
            }
            .launch(d, &module)?;
        }
        pool.copy_from_slice(&download::<u32>(d, &pool_d)?[..pool.len()]);
        for (host, devb) in bufs.iter_mut().zip(&dev_bufs) {
            match host {
                ActBuf::Bits16(x) => *x = download(d, devb)?,
                ActBuf::F32(x) => *x = download(d, devb)?,
            }
        }
        let status: Vec<i32> = download(d, &status_d)?;
        // Scatter the stacked buffers back.
        for (i, all) in bufs.iter().enumerate() {
            let mut at = 0;
            for s in states.iter_mut() {
                let dst = state_buf(s, i);
                let len = dst.len();
                match (dst, all) {
                    (ActBuf::Bits16(a), ActBuf::Bits16(x)) => a.copy_from_slice(&x[at..at + len]),
                    (ActBuf::F32(a), ActBuf::F32(x)) => a.copy_from_slice(&x[at..at + len]),
                    _ => unreachable!("same dtype"),
                }
                at += len;
            }
        }
        for (s, c) in states.iter_mut().zip(&counts) {
            s.tokens += c;
        }
        Ok(status.iter().map(|&x| x != 0).collect())
    }
}
