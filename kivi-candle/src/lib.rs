//! kivi's quantized KV cache for [candle](https://github.com/huggingface/candle)
//! models.
//!
//! [`KiviKvCache`] holds the K/V cache of every layer of one sequence, each
//! layer a [`kivi_runtime::PagedCache`] with its own scheme (KIVI 2-bit,
//! 4-bit, f16, ...) and its own sliding window. It takes candle tensors in
//! candle-nn's `KvCache` convention and has two ways in:
//!
//! - [`KiviKvCache::append`] — the drop-in for candle-nn's
//!   `KvCache::append`: stores the new keys and values and returns the whole
//!   cache as dense tensors (dequantized), so the model's own attention code
//!   runs unchanged. Simple, but it materialises K/V every call.
//! - [`KiviKvCache::attend`] — the fused path: stores the new tokens and
//!   returns the attention output for their queries, computed over the
//!   quantized cache by kivi's CPU backend (dequantization fused into the dot
//!   products, one pass over the bytes per group of query heads: GQA/MQA are
//!   handled inside, no `repeat_kv`). Any number of new queries at once: a
//!   prefill chunk or one decode token. [`KiviKvCache::set_backend`] runs
//!   it through kivi's device layer instead ([`AttentionBackend`]): the
//!   generated CUDA kernels on a GPU, or the same kernels on the simulated
//!   device.
//!
//! # Shapes
//!
//! As candle-nn's `KvCache` with its concatenation dimension 2:
//! keys and values are `[batch = 1, kv_heads, seq, head_dim]`, queries
//! `[1, q_heads, seq, head_dim]`, the attention output
//! `[1, q_heads, seq, head_dim]`. One cache is one sequence (batch 1); a
//! batch of sequences is a cache each. Tensors must be on the CPU device
//! and f32, f16 or bf16 (converted to f32 exactly; the scheme then rounds
//! them to its activation dtype). Anything else is an [`Error`], never a
//! panic, and a failed call leaves the cache as it was.
//!
//! # Semantics of [`KiviKvCache::attend`]
//!
//! New query `i` of a call sees every stored token and the new tokens up
//! to and including its own (causal), limited to the layer's sliding window
//! if it has one. Its output is exactly what appending tokens one at a time
//! and decoding after each would give (docs/semantics.md, "Many new
//! queries"), so a prompt can be cut into chunks of any size. RoPE, q/k norms
//! and the like are the model's business: pass K and Q as the attention
//! would use them.
//!
//! # Sliding windows evict
//!
//! A layer with a sliding window (the scheme's `sliding_window`, or
//! [`KiviKvCache::set_window`]) frees every block whose tokens all lie
//! before its window, so its memory follows the window, not the sequence
//! (Gemma 3 270M at 32k context: kivi2 110 MiB → 21.5 MiB). Outputs are
//! unchanged, bit for bit. [`KiviKvCache::set_eviction`] turns it off for a
//! layer, e.g. to read every row through [`KiviKvCache::append`]. A whole
//! model's schemes can come from one declaration
//! ([`KiviKvCache::from_model`]).
//!
//! # One block pool for the whole model
//!
//! [`KiviKvCache::from_model`] puts every layer on one
//! [`kivi_runtime::pool::BlockPool`]: a byte budget for blocks that a
//! sliding layer gives back to when it evicts and a global layer takes
//! from, whatever the layers' block sizes. [`KiviKvCache::from_model_pooled`]
//! chooses its capacity ([`PoolCapacity`]) or shares one pool between
//! several caches (sequences); an append the pool cannot hold is an
//! [`Error::Cache`] holding [`kivi_runtime::Error::PoolExhausted`], and the
//! cache is left as it was. [`KiviKvCache::pool_memory`] reports it.
//!
//! # Why a function and not a candle `CustomOp`
//!
//! A candle `CustomOp` is a pure function of its input tensors (it gets
//! `&self` and read-only storage, and candle may keep it in a graph for
//! autograd). Attending over a cache *writes* the cache: the new tokens are
//! appended (and quantized) in the same call, all or nothing. Doing that
//! inside an op would mean a lock inside an op object and a side effect
//! candle does not know about. A plain `&mut self` method says what happens,
//! lets the borrow checker stop two layers writing one cache at once, and
//! returns typed errors. The cost is the copy of q/k/v to host rows and of
//! the output back into a tensor (`seq x heads x head_dim` values), small
//! next to the attention itself.
//!
//! # Attention backends
//!
//! [`KiviKvCache::attend`] runs on the CPU by default. [`AttentionBackend`]
//! chooses where it runs instead: [`AttentionBackend::cuda`] opens a GPU
//! through kivi's device layer (cudarc, kernels generated for the layer's
//! scheme and compiled with NVRTC) and returns [`Error::Unavailable`] saying
//! why when there is no GPU, driver or NVRTC — never a panic;
//! [`AttentionBackend::simulated`] runs the same generated CUDA compiled as
//! C++ on the CPU (how the tests check the device path without a GPU; slow,
//! not for serving). Outputs agree with the CPU path within float noise
//! (another accumulation order), the stored cache is the same bit for bit
//! (the host cache stays the source of truth), and a failed call still
//! leaves it unchanged.
//!
//! Candle tensors stay on the CPU either way: candle is built without its
//! `cuda` feature, so q/k/v come from host memory and the output goes back
//! there. Each device call uploads the layer's cache and the new tokens and
//! downloads the output (a correctness path; a serving loop that keeps the
//! cache resident on the GPU uses `kivi_runtime::device::DeviceCache`).
//!
//! # Errors
//!
//! Methods return [`Result`] with this crate's [`Error`]; it converts into
//! `candle_core::Error` (wrapped), so `?` works inside a candle model that
//! returns `candle_core::Result`.
//!
//! # Supported candle versions
//!
//! candle-core 0.11 (built and tested with 0.11.1), CPU device (candle's
//! `cuda` feature is not used: tensors are host tensors even when the
//! attention runs on a GPU, see [Attention backends](#attention-backends)).
//! Only `candle-core` is needed; candle-nn is not a dependency.
//!
//! # Swapping a plain cache for kivi's
//!
//! A tiny attention layer with a concatenating cache in candle-nn's style,
//! then the same layer on kivi's cache, first through the drop-in
//! [`KiviKvCache::append`] (attention code unchanged), then through the fused
//! [`KiviKvCache::attend`]. With an unquantized scheme all three agree; with
//! `kivi2` the cache holds 2-bit codes.
//!
//! ```
//! use candle_core::{Device, Result, Tensor, D};
//! use kivi_candle::{KiviKvCache, ModelShape};
//!
//! // The model's own attention over dense K/V `[1, heads, seq, D]`, causal for
//! // the last `n` queries; `repeat_kv` because this plain code knows no GQA.
//! fn dense_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
//!     let (_, hq, n, d) = q.dims4()?;
//!     let (_, hkv, t, _) = k.dims4()?;
//!     let rep = |x: &Tensor| -> Result<Tensor> {
//!         let (b, h, s, d) = x.dims4()?;
//!         x.unsqueeze(2)?.expand((b, h, hq / hkv, s, d))?.reshape((b, hq, s, d))
//!     };
//!     let (k, v) = (rep(k)?, rep(v)?);
//!     let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
//!     let mask: Vec<f32> = (0..n)
//!         .flat_map(|i| (0..t).map(move |j| if j <= t - n + i { 0.0 } else { f32::NEG_INFINITY }))
//!         .collect();
//!     let scores = scores.broadcast_add(&Tensor::from_vec(mask, (n, t), q.device())?)?;
//!     let e = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?.exp()?;
//!     e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.matmul(&v)
//! }
//!
//! // Before: candle-nn's way, K/V concatenated along the sequence dimension.
//! struct PlainCache(Option<(Tensor, Tensor)>);
//! impl PlainCache {
//!     fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
//!         let kv = match self.0.take() {
//!             None => (k.clone(), v.clone()),
//!             Some((pk, pv)) => (Tensor::cat(&[&pk, k], 2)?, Tensor::cat(&[&pv, v], 2)?),
//!         };
//!         self.0 = Some(kv.clone());
//!         Ok(kv)
//!     }
//! }
//!
//! # fn main() -> Result<()> {
//! let dev = Device::Cpu;
//! let (hq, hkv, d) = (4, 2, 32);
//! let mut plain = PlainCache(None);
//! // After: one cache for the whole model (here one layer), an unquantized
//! // scheme so that the three paths can be compared exactly.
//! let shape = ModelShape { layers: 1, q_heads: hq, kv_heads: hkv, head_dim: d };
//! let f32_scheme = kivi_spec::resolve_scheme("f32 { dtype: f32, key: full, value: full }", &[])
//!     .map_err(candle_core::Error::msg)?
//!     .scheme;
//! let mut dropin = KiviKvCache::new(&f32_scheme, shape, 1024)?;
//! let mut fused = KiviKvCache::new(&f32_scheme, shape, 1024)?;
//! // And the real thing: 2-bit keys and values.
//! let mut kivi2 = KiviKvCache::new(&kivi_spec::presets::kivi2(), shape, 1024)?;
//!
//! for n in [7, 1, 1] {
//!     // A prefill chunk of 7 tokens, then two decode steps.
//!     let q = Tensor::randn(0f32, 1.0, (1, hq, n, d), &dev)?;
//!     let k = Tensor::randn(0f32, 1.0, (1, hkv, n, d), &dev)?;
//!     let v = Tensor::randn(0f32, 1.0, (1, hkv, n, d), &dev)?;
//!
//!     let (pk, pv) = plain.append(&k, &v)?;
//!     let before = dense_attention(&q, &pk, &pv)?;
//!
//!     let (dk, dv) = dropin.append(0, &k, &v)?; // was: plain.append(&k, &v)
//!     let after = dense_attention(&q, &dk, &dv)?;
//!
//!     let out = fused.attend(0, &q, &k, &v)?; // replaces append + attention
//!     let _ = kivi2.attend(0, &q, &k, &v)?;
//!
//!     for other in [&after, &out] {
//!         let diff = (&before - other)?.abs()?.max_all()?.to_scalar::<f32>()?;
//!         assert!(diff < 1e-4, "{diff}");
//!     }
//! }
//! assert_eq!(fused.current_seq_len(), 9);
//! assert!(kivi2.memory_bytes() > 0);
//! # Ok(())
//! # }
//! ```

use candle_core::{DType, Device, Tensor};
use kivi_runtime::device::{DeviceBackend, DeviceKind};
use kivi_runtime::pool::{BlockPool, PoolReport};
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, MemoryReport, NewTokens, PagedCache, SeqId};
use kivi_spec::{Heads, Scheme};

/// What can go wrong; each message is one line naming the wrong value.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor of the wrong shape (rank, batch, heads, head_dim or length).
    #[error("{what}: expected {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: String,
        got: String,
    },
    /// A tensor of a dtype the cache cannot take.
    #[error("{what} has dtype {got:?}; the cache takes f32, f16 or bf16")]
    DType { what: &'static str, got: DType },
    /// A tensor on a device other than the CPU.
    #[error("{what} is on {got}; this cache runs on the CPU (move the tensor with `to_device(&Device::Cpu)`)")]
    Device { what: &'static str, got: String },
    /// More tokens than the cache was sized for.
    #[error("layer {layer} holds {len} tokens and {adding} more do not fit: the cache was sized for {max}; create it with a larger max_tokens")]
    CacheFull {
        layer: usize,
        len: usize,
        adding: usize,
        max: usize,
    },
    /// A layer index past the last layer.
    #[error("layer {layer} does not exist; the cache has {layers} layers")]
    NoLayer { layer: usize, layers: usize },
    /// A scheme whose heads or head_dim do not match the model's.
    #[error("head layout mismatch: {0}")]
    HeadLayout(String),
    /// A setting out of range (zero layers, a zero window, a bad scale).
    #[error("invalid setting: {0}")]
    Config(String),
    /// An error of the underlying cache (scheme, non-finite input, ...).
    #[error("layer {layer}: {source}")]
    Cache {
        layer: usize,
        #[source]
        source: kivi_runtime::Error,
    },
    /// An attention backend that cannot be opened here (no GPU, no CUDA
    /// driver, no NVRTC): [`AttentionBackend::cuda`].
    #[error("attention backend `{backend}` is unavailable: {reason}")]
    Unavailable { backend: &'static str, reason: String },
    /// An error of a candle tensor operation.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Lets `?` carry an [`Error`] out of a function returning `candle_core::Result`.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The attention shape of a model: layers and heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Where [`KiviKvCache::attend`] computes attention. The cache itself
/// (codes, scales, residual window) lives in host memory in every case.
#[derive(Clone, Default)]
pub enum AttentionBackend {
    /// kivi's CPU backend (`kivi_runtime::CpuBackend`) on rayon's global
    /// pool: the default.
    #[default]
    Cpu,
    /// kivi's device layer: the kernels generated for each layer's scheme,
    /// launched on a GPU or on the simulated device. Build it with
    /// [`AttentionBackend::cuda`] or [`AttentionBackend::simulated`], or wrap
    /// a `DeviceBackend` of your own (e.g. with a tuned decode variant).
    Device(DeviceBackend),
}

impl AttentionBackend {
    /// GPU `ordinal` through cudarc. [`Error::Unavailable`] (never a panic)
    /// when this machine has no CUDA driver, no such GPU, or no NVRTC to
    /// compile the kernels with, the reason in the message.
    pub fn cuda(ordinal: usize) -> Result<AttentionBackend> {
        let dev = kivi_runtime::cuda::CudaDevice::new(ordinal).map_err(|e| Error::Unavailable {
            backend: "cuda",
            reason: match e {
                kivi_runtime::Error::Unavailable { reason, .. } => reason,
                e => e.to_string(),
            },
        })?;
        Ok(AttentionBackend::Device(DeviceBackend::new(std::sync::Arc::new(dev))))
    }

    /// The simulated device: the generated CUDA compiled as C++ and run on
    /// the CPU (kernels are compiled on first use, then cached on disk).
    /// For testing the device path without a GPU; far slower than
    /// [`AttentionBackend::Cpu`].
    pub fn simulated() -> AttentionBackend {
        AttentionBackend::Device(DeviceBackend::new(kivi_runtime::device::SimDevice::shared()))
    }

    /// Short name: `cpu`, `sim` or `cuda`.
    pub fn name(&self) -> &'static str {
        match self {
            AttentionBackend::Cpu => "cpu",
            AttentionBackend::Device(d) => d.device().kind().name(),
        }
    }

    /// Whether this is a GPU (not the CPU, not the simulator).
    pub fn is_gpu(&self) -> bool {
        matches!(self, AttentionBackend::Device(d) if d.device().kind() == DeviceKind::Cuda)
    }
}

impl std::fmt::Debug for AttentionBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttentionBackend::Cpu => f.write_str("Cpu"),
            AttentionBackend::Device(d) => write!(f, "Device({})", d.device().describe()),
        }
    }
}

struct Layer {
    /// The layer's cache; for a `low_rank` scheme, of its coordinates.
    cache: PagedCache,
    /// A `low_rank` scheme (head_dim `D`) and its bases: rows are projected
    /// on the way in, queries once per call, outputs reconstructed once
    /// (`kivi_runtime::low_rank`).
    low_rank: Option<(Scheme, kivi_runtime::low_rank::Bases)>,
    seq: SeqId,
    attn: AttnParams,
    /// Whether the layer frees the blocks its sliding window no longer sees.
    evict: bool,
}

/// How big the block pool of [`KiviKvCache::from_model_pooled`] is.
#[derive(Clone, Debug)]
pub enum PoolCapacity {
    /// What the layers' own pools would hold: every layer's blocks for
    /// `max_tokens` tokens, eviction not counted. Never refuses an append
    /// that fits `max_tokens`; eviction then leaves room for other caches
    /// only if the pool is shared, so this is the safe default.
    Unevicted,
    /// A budget of this many bytes of blocks. With sliding layers evicting,
    /// a model needs far less than [`PoolCapacity::Unevicted`] (`kivi show
    /// --model` prints both); a prefill chunk's blocks are charged before
    /// its layer evicts, so leave room for one chunk per layer.
    Bytes(usize),
    /// An existing pool, shared with other caches (e.g. one per sequence).
    Shared(BlockPool),
}

/// The KV cache of one sequence for every layer of a model, quantized per
/// each layer's scheme. See the [crate docs](crate) for shapes and semantics.
pub struct KiviKvCache {
    shape: ModelShape,
    max_tokens: usize,
    layers: Vec<Layer>,
    /// The pool every layer draws on, when built on one
    /// ([`Self::from_model_pooled`]).
    pool: Option<BlockPool>,
    cpu: CpuBackend,
    backend: AttentionBackend,
}

impl KiviKvCache {
    /// One scheme for every layer, room for `max_tokens` tokens per layer.
    /// The scheme's head layout is bound to `shape` here (a preset leaves it
    /// open); a scheme that declares other heads or another head_dim is a
    /// [`Error::HeadLayout`].
    pub fn new(scheme: &Scheme, shape: ModelShape, max_tokens: usize) -> Result<KiviKvCache> {
        KiviKvCache::per_layer(&vec![scheme.clone(); shape.layers], shape, max_tokens)
    }

    /// A scheme per layer (`schemes.len() == shape.layers`), e.g. more bits
    /// for the layers that attend over the whole context.
    pub fn per_layer(schemes: &[Scheme], shape: ModelShape, max_tokens: usize) -> Result<KiviKvCache> {
        KiviKvCache::per_layer_calibrated(schemes, shape, max_tokens, None)
    }

    /// [`Self::per_layer`] with a calibration: layer `i` decodes its
    /// `levels = nuq` tensors with the calibration's layer-`i` codebooks
    /// ([`PagedCache::with_calibration`]); a scheme that needs one the
    /// calibration lacks is an error naming the layer and tensor.
    pub fn per_layer_calibrated(
        schemes: &[Scheme],
        shape: ModelShape,
        max_tokens: usize,
        calibration: Option<&kivi_runtime::calib::Calibration>,
    ) -> Result<KiviKvCache> {
        if shape.layers == 0 || schemes.len() != shape.layers {
            return Err(Error::Config(format!(
                "{} schemes for {} layers; give one per layer (and at least one layer)",
                schemes.len(),
                shape.layers
            )));
        }
        if max_tokens == 0 {
            return Err(Error::Config("max_tokens must be at least 1".into()));
        }
        let heads = model_heads(shape)?;
        let mut layers = Vec::with_capacity(shape.layers);
        for (i, s) in schemes.iter().enumerate() {
            if s.heads.is_some_and(|h| h.normalized() != heads)
                || s.head_dim.is_some_and(|d| d as usize != shape.head_dim)
            {
                return Err(Error::HeadLayout(format!(
                    "layer {i}: scheme `{}` declares heads {} and head_dim {}, the model has heads {heads} and head_dim {}",
                    s.name,
                    s.heads.map_or("open".into(), |h| h.to_string()),
                    s.head_dim.map_or("open".into(), |d| d.to_string()),
                    shape.head_dim
                )));
            }
            let in_layer = |source: kivi_runtime::Error| Error::Cache { layer: i, source };
            let bound = s
                .with_shape(heads, shape.head_dim as u32)
                .map_err(|e| in_layer(e.into()))?;
            // Exactly enough blocks for `max_tokens` quantized tokens: only
            // quantized tokens live in blocks, and the pool is reserved up
            // front (untouched pages cost no memory).
            let attn = AttnParams::of(&bound, shape_of(shape));
            // A low-rank layer stores its coordinates: a cache of the
            // coordinate scheme, with the layer's bases from the calibration.
            let (bound, low_rank) = match bound.coordinate_scheme() {
                None => (bound, None),
                Some(coords) => {
                    // LowRAM's exact residual needs LowRankCache's kept rows,
                    // which this layer (a plain coordinate cache) does not
                    // keep: refuse rather than decode it as `residual = 0`.
                    if let Some(n) = bound.low_rank.map(|l| l.residual).filter(|&n| n > 0) {
                        return Err(in_layer(kivi_runtime::Error::Config(format!(
                            "scheme `{}`: low_rank residual = {n} is not supported in kivi-candle yet \
                             (the exact residual rows live in kivi_runtime::low_rank::LowRankCache); use residual = 0",
                            bound.name
                        ))));
                    }
                    let c = calibration.ok_or_else(|| {
                        in_layer(kivi_runtime::Error::Config(format!(
                            "scheme `{}` is low_rank: its bases come from a calibration (per_layer_calibrated)",
                            bound.name
                        )))
                    })?;
                    let bases = kivi_runtime::low_rank::Bases::for_layer(&bound, c, i).map_err(in_layer)?;
                    (coords, Some((bound, bases)))
                }
            };
            let block = kivi_spec::layout::default_block_tokens(&bound);
            let config = CacheConfig {
                block_tokens: Some(block),
                max_blocks: max_tokens.div_ceil(block),
            };
            let mut cache = match calibration {
                // A coordinate scheme has head_dim R, not the model's, and no
                // nuq tables (low_rank refuses them): a plain cache.
                Some(c) if low_rank.is_none() => PagedCache::with_calibration(bound, config, c, i),
                _ => PagedCache::new(bound, config),
            }
            .map_err(in_layer)?;
            let seq = cache.add_sequence();
            let mut layer = Layer {
                cache,
                low_rank,
                seq,
                attn,
                evict: true,
            };
            layer.sync_eviction().map_err(in_layer)?;
            layers.push(layer);
        }
        Ok(KiviKvCache {
            shape,
            max_tokens,
            layers,
            pool: None,
            // threads = 0: rayon's global pool, the one candle's CPU kernels
            // use too (a pool per call would be rebuilt every token).
            cpu: CpuBackend::new(kivi_runtime::CpuParams::default())
                .map_err(|e| Error::Cache { layer: 0, source: e })?,
            backend: AttentionBackend::Cpu,
        })
    }

    /// A cache for a model declaration ([`kivi_spec::parse_model`]): layer
    /// `l` gets the scheme its declaration names for it (by index, else by
    /// kind — sliding when `windows[l]` is set — else the default) and the
    /// sliding window `windows[l]` (evicting, [`Self::set_window`]). Every
    /// layer draws its blocks from one pool of [`PoolCapacity::Unevicted`]
    /// bytes ([`Self::from_model_pooled`] chooses).
    ///
    /// ```
    /// use kivi_candle::{KiviKvCache, ModelShape};
    /// let decl = kivi_spec::parse_model("model { default: kivi2, global: kivi4, layers[0]: f16 }").unwrap();
    /// let shape = ModelShape { layers: 3, q_heads: 4, kv_heads: 1, head_dim: 64 };
    /// let c = KiviKvCache::from_model(&decl, shape, &[Some(512), Some(512), None], 4096).unwrap();
    /// let names: Vec<String> = (0..3).map(|l| c.scheme(l).unwrap().name.clone()).collect();
    /// assert_eq!(names, ["f16", "kivi2", "kivi4"]);
    /// assert_eq!(c.window(1).unwrap(), Some(512));
    /// ```
    pub fn from_model(
        decl: &kivi_spec::ModelDecl,
        shape: ModelShape,
        windows: &[Option<usize>],
        max_tokens: usize,
    ) -> Result<KiviKvCache> {
        KiviKvCache::from_model_pooled(decl, shape, windows, max_tokens, PoolCapacity::Unevicted)
    }

    /// [`Self::from_model`] on a block pool of the given capacity, or on a
    /// pool shared with other caches. Each layer's blocks are still its own
    /// (its scheme's block size, its own block table); the pool bounds the
    /// bytes of blocks all of them hold at once, and the blocks a sliding
    /// layer evicts are bytes a global layer can take.
    ///
    /// ```
    /// use kivi_candle::{KiviKvCache, ModelShape, PoolCapacity};
    /// use candle_core::{Device, Tensor};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let decl = kivi_spec::parse_model("model { default: kivi2, global: kivi4 }")?;
    /// let shape = ModelShape { layers: 2, q_heads: 4, kv_heads: 1, head_dim: 64 };
    /// let windows = [Some(128), None];
    /// let mut c = KiviKvCache::from_model_pooled(&decl, shape, &windows, 4096, PoolCapacity::Bytes(128 << 10))?;
    /// let kv = Tensor::randn(0f32, 1.0, (1, 1, 1000, 64), &Device::Cpu)?;
    /// for l in 0..2 {
    ///     c.extend(l, &kv, &kv)?;
    /// }
    /// let pool = c.pool_memory().unwrap();
    /// assert_eq!(pool.capacity, 128 << 10);
    /// assert_eq!(pool.used, (0..2).map(|l| c.layer_block_bytes(l).unwrap()).sum::<usize>());
    /// // 3000 more tokens do not fit: the global layer is refused and unchanged.
    /// let more = Tensor::randn(0f32, 1.0, (1, 1, 3000, 64), &Device::Cpu)?;
    /// assert!(c.extend(1, &more, &more).is_err());
    /// assert_eq!(c.seq_len(1)?, 1000);
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_model_pooled(
        decl: &kivi_spec::ModelDecl,
        shape: ModelShape,
        windows: &[Option<usize>],
        max_tokens: usize,
        capacity: PoolCapacity,
    ) -> Result<KiviKvCache> {
        if windows.len() != shape.layers {
            return Err(Error::Config(format!(
                "{} windows for {} layers; give one per layer (None for a global layer)",
                windows.len(),
                shape.layers
            )));
        }
        let kinds: Vec<kivi_spec::LayerKind> = windows
            .iter()
            .map(|w| match w {
                Some(_) => kivi_spec::LayerKind::Sliding,
                None => kivi_spec::LayerKind::Global,
            })
            .collect();
        let schemes = decl
            .schemes_for(&kinds)
            .map_err(|e| Error::Config(format!("model `{}`: {e}", decl.name)))?;
        let mut cache = KiviKvCache::per_layer(&schemes, shape, max_tokens)?;
        let pool = match capacity {
            PoolCapacity::Unevicted => BlockPool::new(
                cache
                    .layers
                    .iter()
                    .map(|l| l.cache.max_blocks() * l.cache.layout().block_bytes())
                    .sum(),
            ),
            PoolCapacity::Bytes(b) => BlockPool::new(b),
            PoolCapacity::Shared(p) => p,
        };
        for (i, l) in cache.layers.iter_mut().enumerate() {
            // Empty layers: nothing to charge, so this cannot be refused.
            l.cache
                .set_pool(Some(pool.clone()))
                .map_err(|e| Error::Cache { layer: i, source: e })?;
        }
        cache.pool = Some(pool);
        for (l, w) in windows.iter().enumerate() {
            cache.set_window(l, *w)?;
        }
        Ok(cache)
    }

    /// The pool every layer draws on (a handle: cloning it shares it), if
    /// the cache was built on one ([`Self::from_model`]).
    pub fn pool(&self) -> Option<&BlockPool> {
        self.pool.as_ref()
    }

    /// The pool's capacity, bytes in use and free, and high-water mark
    /// (`used` is every cache's blocks on it, so this cache's layers'
    /// [`Self::layer_block_bytes`] when it is not shared).
    pub fn pool_memory(&self) -> Option<PoolReport> {
        self.pool.as_ref().map(BlockPool::memory)
    }

    /// Bytes of blocks a layer holds (what it draws from the pool):
    /// `blocks_in_use * block_bytes` of its scheme's layout.
    pub fn layer_block_bytes(&self, layer: usize) -> Result<usize> {
        let c = &self.layer(layer)?.cache;
        Ok(c.memory().blocks_in_use * c.layout().block_bytes())
    }

    /// Where [`Self::attend`] runs from now on (the default is
    /// [`AttentionBackend::Cpu`]). The stored tokens do not move: every
    /// backend reads and appends to the same host cache, so this can change
    /// between calls, even in the middle of a sequence.
    pub fn set_backend(&mut self, backend: AttentionBackend) {
        self.backend = backend;
    }

    /// [`Self::set_backend`] in builder style:
    /// `KiviKvCache::new(&scheme, shape, n)?.with_backend(AttentionBackend::cuda(0)?)`.
    pub fn with_backend(mut self, backend: AttentionBackend) -> KiviKvCache {
        self.backend = backend;
        self
    }

    /// Where [`Self::attend`] runs.
    pub fn backend(&self) -> &AttentionBackend {
        &self.backend
    }

    /// The model shape the cache was made for.
    pub fn shape(&self) -> ModelShape {
        self.shape
    }

    /// Tokens each layer has room for.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// A layer's scheme, bound to the model's head layout.
    pub fn scheme(&self, layer: usize) -> Result<&Scheme> {
        let l = self.layer(layer)?;
        Ok(l.low_rank.as_ref().map_or(l.cache.scheme(), |(s, _)| s))
    }

    /// A layer's sliding window (`None`: full attention).
    pub fn window(&self, layer: usize) -> Result<Option<usize>> {
        Ok(self.layer(layer)?.attn.window)
    }

    /// Sets a layer's sliding window: [`Self::attend`] then sees only the
    /// last `window` tokens (the query's own included). The default is the
    /// scheme's `sliding_window`. Unless eviction is turned off
    /// ([`Self::set_eviction`]), the layer then frees every block whose
    /// tokens all lie before the last `window` (its memory grows with the
    /// window, not the sequence); attention over the tokens it keeps is
    /// unchanged, bit for bit. A window cannot be widened past what was
    /// already evicted: attention would then be refused.
    pub fn set_window(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
        if window == Some(0) {
            return Err(Error::Config(format!(
                "layer {layer}: a sliding window of 0 tokens sees nothing"
            )));
        }
        let l = self.layer_mut(layer)?;
        l.attn.window = window;
        l.sync_eviction().map_err(|e| Error::Cache { layer, source: e })
    }

    /// Turns a windowed layer's eviction on (the default) or off. Off, the
    /// layer keeps every token, so [`Self::append`]'s dense K/V hold every
    /// row as stored; on, the rows of evicted tokens read as zeros there
    /// (outside the window: a model's own sliding mask hides them).
    pub fn set_eviction(&mut self, layer: usize, evict: bool) -> Result<()> {
        let l = self.layer_mut(layer)?;
        l.evict = evict;
        l.sync_eviction().map_err(|e| Error::Cache { layer, source: e })
    }

    /// Whether a layer evicts what its window no longer sees (it does when
    /// it has a window and eviction is on).
    pub fn evicts(&self, layer: usize) -> Result<bool> {
        let l = self.layer(layer)?;
        Ok(l.cache.eviction_window().is_some())
    }

    /// Tokens a layer has evicted so far: positions `sinks ..
    /// sinks + evicted` are no longer held.
    pub fn evicted_tokens(&self, layer: usize) -> Result<usize> {
        let l = self.layer(layer)?;
        l.cache
            .evicted_tokens(l.seq)
            .map_err(|e| Error::Cache { layer, source: e })
    }

    /// Sets the attention scale of every layer (default: the scheme's
    /// `softmax_scale`, else `1/sqrt(head_dim)`).
    pub fn set_softmax_scale(&mut self, scale: f32) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::Config(format!("softmax scale {scale} is not a positive number")));
        }
        for l in &mut self.layers {
            l.attn.softmax_scale = scale;
        }
        Ok(())
    }

    /// Tokens stored in one layer.
    pub fn seq_len(&self, layer: usize) -> Result<usize> {
        let l = self.layer(layer)?;
        l.cache.len(l.seq).map_err(|e| Error::Cache { layer, source: e })
    }

    /// Tokens every layer holds: the length of the sequence after the last
    /// complete forward pass (layers ahead in a pass under way hold more).
    pub fn current_seq_len(&self) -> usize {
        (0..self.layers.len())
            .map(|l| self.seq_len(l).unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// Empties every layer; the blocks go back to each layer's pool (and
    /// their bytes to the shared pool, if any).
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            // The id is live (only reset frees it), so this cannot fail;
            // ignoring the Result keeps reset infallible, as candle-nn's is.
            let _ = l.cache.free_sequence(l.seq);
            l.seq = l.cache.add_sequence();
        }
    }

    /// Bytes the cache holds, by kind, summed over layers (exact, from the
    /// caches' own accounting; a vq codebook shared by name across layers
    /// counted once).
    pub fn memory(&self) -> MemoryReport {
        let mut m = MemoryReport::default();
        // A vq codebook shared by name across layers is counted once.
        let mut shared = std::collections::HashSet::new();
        for l in &self.layers {
            let mut r = l.memory();
            for (name, bytes) in l.cache.shared_codebooks() {
                if !shared.insert((name, bytes)) {
                    r.codebooks -= bytes;
                    r.total -= bytes;
                }
            }
            m.bases += r.bases;
            m.codes += r.codes;
            m.scales += r.scales;
            m.zeros += r.zeros;
            m.outliers += r.outliers;
            m.means += r.means;
            m.codebooks += r.codebooks;
            m.windows += r.windows;
            m.tables += r.tables;
            m.blocks_in_use += r.blocks_in_use;
            m.total += r.total;
        }
        m
    }

    /// `self.memory().total`.
    pub fn memory_bytes(&self) -> usize {
        self.memory().total
    }

    /// Bytes a plain f16 cache of the same tokens would hold: 2 bytes per
    /// element of K and V, every layer, nothing else.
    pub fn f16_bytes(&self) -> usize {
        let per_token = self.shape.kv_heads * self.shape.head_dim * 2 * 2;
        (0..self.layers.len())
            .map(|l| self.seq_len(l).unwrap_or(0) * per_token)
            .sum()
    }

    /// Stores new keys and values (`[1, kv_heads, seq, head_dim]`) in
    /// `layer`, quantized per its scheme, and returns nothing: for filling a
    /// cache from K/V computed elsewhere.
    pub fn extend(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (n, kh, vh) = self.new_kv(layer, k, v)?;
        self.check_room(layer, n)?;
        let l = &mut self.layers[layer];
        let (kh, vh) = l.coordinates(kh, vh).map_err(|e| Error::Cache { layer, source: e })?;
        l.cache
            .extend(l.seq, &kh, &vh)
            .map_err(|e| Error::Cache { layer, source: e })
    }

    /// candle-nn's `KvCache::append`: stores new keys and values
    /// (`[1, kv_heads, seq, head_dim]`) and returns the layer's whole K and
    /// V, `[1, kv_heads, seq_len, head_dim]` in the dtype of `k`, as the
    /// cache holds them (quantized tokens dequantized). Materialises the
    /// whole cache each call: prefer [`Self::attend`].
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        self.extend(layer, k, v)?;
        let l = &self.layers[layer];
        let len = self.seq_len(layer)?;
        let dense = |t: kivi_spec::Tensor| -> Result<Tensor> {
            let rows = l
                .cache
                .dequantize(l.seq, t)
                .map_err(|e| Error::Cache { layer, source: e })?;
            let rows = match &l.low_rank {
                Some((_, b)) => b.reconstruct(t, &rows),
                None => rows,
            };
            Ok(
                Tensor::from_vec(rows, (len, self.shape.kv_heads, self.shape.head_dim), &Device::Cpu)?
                    .transpose(0, 1)?
                    .unsqueeze(0)?
                    .contiguous()?
                    .to_dtype(k.dtype())?,
            )
        };
        Ok((dense(kivi_spec::Tensor::Key)?, dense(kivi_spec::Tensor::Value)?))
    }

    /// The fused path: stores the new tokens' keys and values
    /// (`[1, kv_heads, seq, head_dim]`) and returns the attention output of
    /// their queries (`q`: `[1, q_heads, seq, head_dim]`) over the cache,
    /// `[1, q_heads, seq, head_dim]` in the dtype of `q`. Causal within the
    /// new tokens, sliding window per layer; see the crate docs. Computed on
    /// [`Self::backend`] (the CPU unless [`Self::set_backend`] chose a
    /// device).
    pub fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (n, kh, vh) = self.new_kv(layer, k, v)?;
        let (nq, qh) = host_rows(q, "query", self.shape.q_heads, self.shape.head_dim)?;
        if nq != n {
            return Err(Error::Shape {
                what: "queries",
                expected: format!("one per new key/value token ({n})"),
                got: nq.to_string(),
            });
        }
        self.check_room(layer, n)?;
        let l = &mut self.layers[layer];
        let (kh, vh) = l.coordinates(kh, vh).map_err(|e| Error::Cache { layer, source: e })?;
        let qh = match &l.low_rank {
            // The query once per call: q . (B c) = (Bᵀ q) . c.
            Some((s, b)) => b.project_queries(
                &kivi_runtime::reference::round_inputs(s, "query", &qh, self.shape.q_heads, self.shape.head_dim)
                    .map_err(|e| Error::Cache { layer, source: e })?,
                self.shape.q_heads,
            ),
            None => qh,
        };
        let blocks = [NewTokens {
            seq: l.seq,
            q: &qh,
            k: &kh,
            v: &vh,
        }];
        let backend: &dyn Backend = match &self.backend {
            AttentionBackend::Cpu => &self.cpu,
            AttentionBackend::Device(d) => d,
        };
        let out = backend.attend_block(&mut l.cache, &blocks, l.attn).map_err(|e| {
            // One block per call: its index adds nothing to the message.
            let source = match e {
                kivi_runtime::Error::InSequence { source, .. } => *source,
                e => e,
            };
            Error::Cache { layer, source }
        })?;
        let out = match &l.low_rank {
            // Value coordinates accumulated by the backend, reconstructed once.
            Some((_, b)) => b.reconstruct_outputs(&out, self.shape.q_heads),
            None => out,
        };
        Ok(
            Tensor::from_vec(out, (n, self.shape.q_heads, self.shape.head_dim), &Device::Cpu)?
                .transpose(0, 1)?
                .unsqueeze(0)?
                .contiguous()?
                .to_dtype(q.dtype())?,
        )
    }

    /// A layer's exact memory report.
    pub fn layer_memory(&self, layer: usize) -> Result<MemoryReport> {
        Ok(self.layer(layer)?.memory())
    }

    fn layer(&self, layer: usize) -> Result<&Layer> {
        let layers = self.layers.len();
        self.layers.get(layer).ok_or(Error::NoLayer { layer, layers })
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut Layer> {
        let layers = self.layers.len();
        self.layers.get_mut(layer).ok_or(Error::NoLayer { layer, layers })
    }

    /// Checks the layer and both tensors; returns the token count and the
    /// host rows `[seq, kv_heads, head_dim]`.
    fn new_kv(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(usize, Vec<f32>, Vec<f32>)> {
        self.layer(layer)?;
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        if k.dims() != v.dims() {
            return Err(Error::Shape {
                what: "keys and values",
                expected: "the same shape".into(),
                got: format!("{:?} and {:?}", k.dims(), v.dims()),
            });
        }
        let (n, kh) = host_rows(k, "keys", h, d)?;
        let (_, vh) = host_rows(v, "values", h, d)?;
        Ok((n, kh, vh))
    }

    fn check_room(&self, layer: usize, adding: usize) -> Result<()> {
        let len = self.seq_len(layer)?;
        if len + adding > self.max_tokens {
            return Err(Error::CacheFull {
                layer,
                len,
                adding,
                max: self.max_tokens,
            });
        }
        Ok(())
    }
}

impl Layer {
    /// The rows a layer's cache stores: as given, or for a low-rank layer
    /// rounded to the activation dtype and projected on its bases.
    fn coordinates(&self, k: Vec<f32>, v: Vec<f32>) -> kivi_runtime::Result<(Vec<f32>, Vec<f32>)> {
        let Some((s, b)) = &self.low_rank else {
            return Ok((k, v));
        };
        let (h, d) = (b.kv_heads, b.head_dim);
        let k = kivi_runtime::reference::round_inputs(s, "key", &k, h, d)?;
        let v = kivi_runtime::reference::round_inputs(s, "value", &v, h, d)?;
        Ok((
            b.project(kivi_spec::Tensor::Key, &k),
            b.project(kivi_spec::Tensor::Value, &v),
        ))
    }

    /// The layer's memory: its cache's, plus a low-rank layer's bases once.
    fn memory(&self) -> MemoryReport {
        let mut m = self.cache.memory();
        if let Some((_, b)) = &self.low_rank {
            m.bases = b.bytes();
            m.total += m.bases;
        }
        m
    }

    /// The cache evicts with the attention window when eviction is on.
    fn sync_eviction(&mut self) -> kivi_runtime::Result<()> {
        let w = if self.evict { self.attn.window } else { None };
        self.cache.set_eviction_window(w)
    }
}

fn model_heads(shape: ModelShape) -> Result<Heads> {
    let (q, kv) = (shape.q_heads, shape.kv_heads);
    let fits = |x: usize| u32::try_from(x).is_ok() && x > 0;
    if !fits(q) || !fits(kv) || !fits(shape.head_dim) || !q.is_multiple_of(kv) {
        return Err(Error::HeadLayout(format!(
            "{q} query heads, {kv} kv heads, head_dim {}: heads must be positive and the query heads a multiple of the kv heads",
            shape.head_dim
        )));
    }
    Ok(Heads::from_counts(q as u32, kv as u32))
}

fn shape_of(s: ModelShape) -> kivi_spec::Shape {
    kivi_spec::Shape {
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
    }
}

/// A `[1, heads, seq, head_dim]` CPU tensor as host rows
/// `[seq, heads, head_dim]` in f32, with the token count.
fn host_rows(t: &Tensor, what: &'static str, heads: usize, head_dim: usize) -> Result<(usize, Vec<f32>)> {
    if !matches!(t.device(), Device::Cpu) {
        return Err(Error::Device {
            what,
            got: format!("{:?}", t.device().location()),
        });
    }
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::DType { what, got: t.dtype() });
    }
    let dims = t.dims();
    if dims.len() != 4 || dims[0] != 1 || dims[1] != heads || dims[3] != head_dim {
        return Err(Error::Shape {
            what,
            expected: format!("[1, {heads}, seq, {head_dim}] (batch 1, heads, seq, head_dim)"),
            got: format!("{dims:?}"),
        });
    }
    let rows = t
        .squeeze(0)?
        .transpose(0, 1)?
        .to_dtype(DType::F32)?
        .contiguous()?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((dims[2], rows))
}
