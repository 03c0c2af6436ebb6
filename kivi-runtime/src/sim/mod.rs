//! The `sim` backend: runs the *generated CUDA source itself* on the CPU.
//!
//! [`compile`] builds generated sources (many variants per library) as
//! C++20 against `templates/cuda/sim_shim.h`, which maps the CUDA subset the
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

use crate::backend::{check_batch, Backend};
use crate::cache::{PagedCache, RawRows, SeqId, SeqView};
use crate::error::{Error, Result};
use crate::quant::{round_to_dtype, to_bits_16};
use crate::reference::AttnParams;
use kivi_spec::layout::{regions, window_capacity};
use kivi_spec::{Dtype, Scheme, Shape, Tensor};
use kivi_templates::{generate_with, GenOptions, Generated, Kernel, ParamTy, Variant};
use std::ffi::c_void;
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
    fn ptr(&self) -> *mut c_void {
        match self {
            ActBuf::Bits16(v) => v.as_ptr() as *mut c_void,
            ActBuf::F32(v) => v.as_ptr() as *mut c_void,
        }
    }
    fn ptr_mut(&mut self) -> *mut c_void {
        match self {
            ActBuf::Bits16(v) => v.as_mut_ptr() as *mut c_void,
            ActBuf::F32(v) => v.as_mut_ptr() as *mut c_void,
        }
    }
}

/// One kernel argument; checked against the entry point's parameter list.
pub enum Arg<'a> {
    U32s(&'a [u32]),
    U32sMut(&'a mut [u32]),
    I32s(&'a [i32]),
    I32sMut(&'a mut [i32]),
    Act(&'a ActBuf),
    ActMut(&'a mut ActBuf),
    F32s(&'a [f32]),
    F32sMut(&'a mut [f32]),
    I32(i32),
    F32(f32),
}

impl Arg<'_> {
    fn fits(&self, ty: ParamTy) -> bool {
        matches!(
            (self, ty),
            (Arg::U32s(_), ParamTy::PtrU32)
                | (Arg::U32sMut(_), ParamTy::PtrU32Mut)
                | (Arg::I32s(_), ParamTy::PtrI32)
                | (Arg::I32sMut(_), ParamTy::PtrI32Mut)
                | (Arg::Act(_), ParamTy::PtrAct)
                | (Arg::ActMut(_), ParamTy::PtrActMut)
                | (Arg::F32s(_), ParamTy::PtrF32)
                | (Arg::F32sMut(_), ParamTy::PtrF32Mut)
                | (Arg::I32(_), ParamTy::I32)
                | (Arg::F32(_), ParamTy::F32)
        )
    }
}

/// Launches entry point `entry` of `g` (compiled into `lib`) on `grid`
/// blocks of the entry's threads, like `cuLaunchKernel`, under
/// [`SimOptions::current`] (the innermost [`SimOptions::scope`], else
/// `KIVI_SIM_SCHEDULE` / `KIVI_SIM_ARCH`, else the defaults). The arguments
/// are checked against the entry's parameter list, then passed to
/// [`SimLibrary::launch_raw`].
///
/// # Safety
/// The buffers must be as large as the kernel indexes them for this grid
/// (the kernel argument docs of [`kivi_templates`] say how large); only the
/// argument types are checked.
pub unsafe fn launch(lib: &SimLibrary, g: &Generated, entry: &str, grid: [u32; 3], args: &mut [Arg<'_>]) -> Result<()> {
    let el = g
        .launch
        .entry(entry)
        .ok_or_else(|| Error::Config(format!("{} has no entry point `{entry}`", g.name)))?;
    if el.params.len() != args.len() || !el.params.iter().zip(args.iter()).all(|(p, a)| a.fits(p.ty)) {
        return Err(Error::Config(format!(
            "arguments of `{entry}` do not match its parameter list {:?}",
            el.params
        )));
    }
    // Storage the void** array points into: a pointer or a scalar per argument.
    let mut slots: Vec<[u64; 1]> = vec![[0]; args.len()];
    for (slot, a) in slots.iter_mut().zip(args.iter_mut()) {
        let bits: u64 = match a {
            Arg::U32s(v) => v.as_ptr() as u64,
            Arg::U32sMut(v) => v.as_mut_ptr() as u64,
            Arg::I32s(v) => v.as_ptr() as u64,
            Arg::I32sMut(v) => v.as_mut_ptr() as u64,
            Arg::Act(v) => v.ptr() as u64,
            Arg::ActMut(v) => v.ptr_mut() as u64,
            Arg::F32s(v) => v.as_ptr() as u64,
            Arg::F32sMut(v) => v.as_mut_ptr() as u64,
            Arg::I32(x) => *x as u32 as u64,
            Arg::F32(x) => x.to_bits() as u64,
        };
        slot[0] = bits;
    }
    // Little-endian: an int or float argument is the low bytes of its slot.
    let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s.as_mut_ptr() as *mut c_void).collect();
    let block = el.block;
    lib.launch_raw(g, entry, grid, block, &mut ptrs, &SimOptions::current()?)
}

/// Decode attention by a generated kernel variant, run on the CPU.
#[derive(Clone, Debug)]
pub struct SimBackend {
    scheme: Scheme,
    shape: Shape,
    generated: Generated,
    lib: Arc<SimLibrary>,
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
        Ok(SimBackend {
            scheme: scheme.clone(),
            shape,
            generated: g,
            lib,
        })
    }

    /// The kernel this backend runs.
    pub fn generated(&self) -> &Generated {
        &self.generated
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

/// Raw rows of every sequence's buffer, stacked `[batch][slots][Hkv][D]`.
fn stack<'a>(views: &[SeqView<'a>], dtype: Dtype, f: impl Fn(&SeqView<'a>) -> RawRows<'a>) -> Result<ActBuf> {
    let mut out = ActBuf::zeros(dtype, 0);
    for v in views {
        out.extend_from(&ActBuf::from_raw(f(v)))?;
    }
    if out.is_empty() {
        out = ActBuf::zeros(dtype, 1); // never read; keeps the pointer valid
    }
    Ok(out)
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let per = check_batch(cache, seqs, q)?;
        if kivi_spec::scheme_hash(cache.scheme()) != kivi_spec::scheme_hash(&self.scheme)
            || cache.layout().block_tokens != self.generated.block_tokens
        {
            return Err(Error::Config(format!(
                "the sim kernel {} was generated for another scheme or block size than this cache's",
                self.generated.name
            )));
        }
        let batch = seqs.len();
        if batch == 0 {
            return Ok(Vec::new());
        }
        let d = self.shape.head_dim;
        let dtype = self.scheme.dtype;
        let mut qa = ActBuf::zeros(dtype, 0);
        for (b, chunk) in q.chunks(per).enumerate() {
            let r = ActBuf::round(dtype, chunk, "query").map_err(|e| match e {
                Error::NonFinite { value, channel, .. } => Error::NonFinite {
                    tensor: "query",
                    value,
                    token: b,
                    head: channel / d,
                    channel: channel % d,
                    policy: "reject",
                },
                e => e,
            })?;
            qa.extend_from(&r)?;
        }
        let views: Vec<SeqView> = seqs.iter().map(|&s| cache.view(s)).collect::<Result<_>>()?;
        let stride = views.iter().map(|v| v.table().len()).max().unwrap_or(0).max(1);
        let mut tables = vec![0u32; batch * stride];
        for (b, v) in views.iter().enumerate() {
            tables[b * stride..b * stride + v.table().len()].copy_from_slice(v.table());
        }
        let lens: Vec<i32> = views
            .iter()
            .map(|v| i32::try_from(v.tokens()).map_err(|_| Error::Config("a sequence longer than 2^31 tokens".into())))
            .collect::<Result<_>>()?;
        let sinks_k = stack(&views, dtype, |v| v.sinks_raw(Tensor::Key))?;
        let sinks_v = stack(&views, dtype, |v| v.sinks_raw(Tensor::Value))?;
        let ring_k = stack(&views, dtype, |v| v.ring_raw(Tensor::Key))?;
        let ring_v = stack(&views, dtype, |v| v.ring_raw(Tensor::Value))?;
        let window = match attn.window {
            None => -1,
            Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
        };
        let g = &self.generated;
        let mut part_ml = vec![0f32; g.launch.part_ml_len(batch)];
        let mut part_acc = vec![0f32; g.launch.part_acc_len(batch)];
        let mut out = vec![0f32; batch * self.shape.q_heads * d];
        let max_tokens = lens.iter().copied().max().unwrap_or(0) as u32;
        let grid = |e: &str| {
            g.launch
                .entry(e)
                .map(|l| l.grid(batch as u32, max_tokens))
                .unwrap_or([0; 3])
        };
        // SAFETY: every buffer is sized as the decode/combine argument docs require.
        unsafe {
            launch(
                &self.lib,
                g,
                "kivi_decode",
                grid("kivi_decode"),
                &mut [
                    Arg::U32s(cache.pool()),
                    Arg::U32s(&tables),
                    Arg::I32(stride as i32),
                    Arg::I32s(&lens),
                    Arg::Act(&qa),
                    Arg::Act(&sinks_k),
                    Arg::Act(&sinks_v),
                    Arg::Act(&ring_k),
                    Arg::Act(&ring_v),
                    Arg::F32(attn.softmax_scale),
                    Arg::I32(window),
                    Arg::F32sMut(&mut part_ml),
                    Arg::F32sMut(&mut part_acc),
                ],
            )?;
            launch(
                &self.lib,
                g,
                "kivi_combine",
                grid("kivi_combine"),
                &mut [Arg::F32s(&part_ml), Arg::F32s(&part_acc), Arg::F32sMut(&mut out)],
            )?;
        }
        Ok(out)
    }
}

/// One sequence's state as the prefill/append kernels see it: its block
/// table, token count, and sink and window buffers (`[slots][Hkv][D]`).
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    pub tokens: usize,
    pub table: Vec<u32>,
    /// Key, value.
    pub sinks: [ActBuf; 2],
    pub ring: [ActBuf; 2],
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
        })
    }
    /// A copy of what `cache` holds for `id`.
    pub fn of(cache: &PagedCache, id: SeqId) -> Result<SeqState> {
        let v = cache.view(id)?;
        Ok(SeqState {
            tokens: v.tokens(),
            table: v.table().to_vec(),
            sinks: [
                ActBuf::from_raw(v.sinks_raw(Tensor::Key)),
                ActBuf::from_raw(v.sinks_raw(Tensor::Value)),
            ],
            ring: [
                ActBuf::from_raw(v.ring_raw(Tensor::Key)),
                ActBuf::from_raw(v.ring_raw(Tensor::Value)),
            ],
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
            ];
            if sizes.iter().any(|(got, want)| got != want) {
                return Err(Error::Config(format!(
                    "sequence {b}: sink/window buffers do not match the scheme"
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
        for i in 0..4 {
            let mut all = ActBuf::zeros(dtype, 0);
            for s in states.iter() {
                all.extend_from(if i < 2 { &s.sinks[i] } else { &s.ring[i - 2] })?;
            }
            if all.is_empty() {
                all = ActBuf::zeros(dtype, 1);
            }
            bufs.push(all);
        }
        let mut status = vec![0i32; batch];
        let g = &self.generated;
        let entry = g.entry_points[0].clone();
        let grid = g
            .launch
            .entry(&entry)
            .map(|l| l.grid(batch as u32, 0))
            .unwrap_or([0; 3]);
        let [sk, sv, rk, rv] = &mut bufs[..] else {
            unreachable!("four buffers")
        };
        // SAFETY: sizes checked above against the kernel's indexing.
        unsafe {
            launch(
                &self.lib,
                g,
                &entry,
                grid,
                &mut [
                    Arg::U32sMut(pool),
                    Arg::U32s(&tables),
                    Arg::I32(stride as i32),
                    Arg::I32s(&old),
                    Arg::I32s(&n),
                    Arg::Act(&k),
                    Arg::Act(&v),
                    Arg::I32(max_new as i32),
                    Arg::ActMut(sk),
                    Arg::ActMut(sv),
                    Arg::ActMut(rk),
                    Arg::ActMut(rv),
                    Arg::I32sMut(&mut status),
                ],
            )?;
        }
        // Scatter the stacked buffers back.
        for (i, all) in bufs.iter().enumerate() {
            let mut at = 0;
            for s in states.iter_mut() {
                let dst = if i < 2 { &mut s.sinks[i] } else { &mut s.ring[i - 2] };
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
