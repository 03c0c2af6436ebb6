//! CUDA templates (`cuda/`) and the generator: scheme + kernel + variant ->
//! CUDA source.
//!
//! The templates are real CUDA (`cuda/kivi_common.cuh`, `kivi_decode.cuh`,
//! `kivi_extend.cuh`), written as C++ templates over a configuration struct.
//! Generation only writes that struct — the scheme's layout constants from
//! [`kivi_spec::layout`] and the variant's launch constants — then pastes the
//! template text and a few `extern "C"` entry points that instantiate it.
//! The launch shape (threads, lanes per row, loads per lane) is derived in
//! one place, `generate::team_of`, and written into the source as constants.
//!
//! ```
//! use kivi_spec::{presets, Heads};
//! use kivi_templates::{default_variant, generate, variants, Kernel};
//! let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
//! assert!(variants(&s, Kernel::Decode).len() >= 24);
//! let g = generate(&s, Kernel::Decode, &default_variant(&s, Kernel::Decode)).unwrap();
//! assert!(g.name.starts_with("kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128/decode/"));
//! assert_eq!(g.entry_points, ["kivi_decode", "kivi_combine"]);
//! assert_eq!(g.hash, kivi_spec::fnv1a64(g.source.as_bytes()));
//! ```
//!
//! # Kernel arguments
//!
//! Every entry point takes its arguments in the order of
//! [`EntryLaunch::params`]; pointers are device pointers, `act` is the
//! activation element (`unsigned short` holding f16/bf16 bits, or `float`).
//!
//! - `kivi_decode(pool, tables, table_stride, seq_lens, q, sinks_k, sinks_v,
//!   ring_k, ring_v, sm_scale, window, part_ml, part_acc)`: grid
//!   `(splits, kv_heads * group / heads_per_block, batch)`. `pool` is the
//!   block arena (`u32` words, [`kivi_spec::layout::BlockLayout`]);
//!   `tables[b * table_stride + i]` the `i`-th block of sequence `b`;
//!   `seq_lens[b]` its tokens (the quantized counts follow from the scheme,
//!   [`kivi_spec::layout::regions`]); `q` is `[batch][q_heads][D]` act;
//!   sink buffers are `[batch][sinks][kv_heads][D]` act and window rings
//!   `[batch][ring][kv_heads][D]` act (`PagedCache`'s per-sequence buffers,
//!   stacked), token `p` in slot `(p - sinks) % ring`; `sm_scale` multiplies
//!   `q . k`; `window >= 0` attends only to the last `window` tokens (`-1`:
//!   all of them). Writes
//!   `part_ml[((b * q_heads + h) * splits + s) * 2 + {0, 1}]` = (max, sum) of
//!   the split's scores in base 2 and `part_acc[((b * q_heads + h) * splits
//!   + s) * D + d]`, both f32.
//! - `kivi_combine(part_ml, part_acc, out)`: grid `(q_heads, 1, batch)`; writes
//!   `out` `[batch][q_heads][D]` f32.
//! - `kivi_prefill` / `kivi_append(pool, tables, table_stride, old_lens,
//!   new_counts, k_new, v_new, max_new, sinks_k, sinks_v, ring_k, ring_v,
//!   status)`: grid `(kv_heads, 2, batch)`. Adds `new_counts[b]` tokens
//!   (`k_new`/`v_new` `[batch][max_new][kv_heads][D]` act, already rounded to
//!   the activation dtype) to a sequence holding `old_lens[b]`: quantizes
//!   what leaves the window into the blocks of `tables` (the host reserves
//!   them, as `PagedCache` does) and stores the rest in the sink and ring
//!   buffers — the same words `PagedCache::extend` writes. `status[b]` is set
//!   to 1 when a scale or zero point overflowed its dtype (the append must
//!   then be treated as failed).

mod block;
mod generate;
mod mla;
mod variant;

pub use block::BlockShape;
pub use mla::{generate_mla_decode, mla_params, mla_shared_bytes, mla_variants, MlaVariant, MLA_ENTRY, MLA_TEMPLATE};

pub use variant::{Variant, MAX_REGISTER_FLOATS};

use kivi_spec::layout::{default_block_tokens, BlockLayout};
use kivi_spec::Scheme;
use std::fmt;

/// The kernels a scheme needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Quantize-and-pack a prompt (many tokens per sequence).
    Prefill,
    /// One decode step: store the new token, flush what leaves the window.
    Append,
    /// Fused dequantize + decode attention, split over the sequence; its
    /// source also holds the combine kernel that merges the splits (one
    /// combine per decode variant, launched right after it: there is no
    /// separate combine source, so nothing is generated that nothing runs).
    Decode,
}

impl Kernel {
    /// Lower-case name used in variant names and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Prefill => "prefill",
            Kernel::Append => "append",
            Kernel::Decode => "decode",
        }
    }

    /// Parses [`Kernel::name`].
    pub fn parse(s: &str) -> Result<Kernel, GenError> {
        match s {
            "prefill" => Ok(Kernel::Prefill),
            "append" => Ok(Kernel::Append),
            "decode" => Ok(Kernel::Decode),
            _ => Err(GenError::BadKernel(s.to_string())),
        }
    }

    /// Every kernel.
    pub const ALL: [Kernel; 3] = [Kernel::Prefill, Kernel::Append, Kernel::Decode];
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why source could not be generated. Messages are one line, lower case,
/// and name the value that was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GenError {
    /// The scheme has no heads / head_dim bound.
    Unbound(String),
    /// The scheme breaks a rule of the language.
    Scheme(String),
    /// The variant does not fit this scheme and shape.
    InvalidVariant { variant: String, why: String },
    /// A `--variant` name that does not parse.
    BadVariantName(String),
    /// A kernel name that is not `prefill`, `append` or `decode`.
    BadKernel(String),
    /// A block size the scheme cannot use.
    BlockTokens(String),
    /// A codec the templates cannot instantiate yet (see [`check_supported`]):
    /// what it is, and the part of the scheme that asks for it.
    Unsupported { what: String, field: kivi_spec::Field },
    /// A calibrated codebook ([`Codebooks`]) that does not fit the scheme:
    /// missing for a `levels = nuq` tensor, given for one that is not, the
    /// wrong length, not finite or not ascending.
    Codebook { tensor: &'static str, why: String },
}

impl fmt::Display for GenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GenError::Unbound(n) => write!(
                f,
                "scheme `{n}` has no head layout or head_dim; kernels are generated for a shape (Scheme::with_shape)"
            ),
            GenError::Scheme(m) => write!(f, "invalid scheme: {m}"),
            GenError::InvalidVariant { variant, why } => write!(f, "variant `{variant}` is not valid here: {why}"),
            GenError::BadVariantName(n) => write!(
                f,
                "`{n}` is not a variant name; expected e.g. `t128.tile32.s8.h4.w1.u1`"
            ),
            GenError::BadKernel(k) => write!(
                f,
                "unknown kernel `{k}`; expected prefill, append or decode (the combine kernel is part of every decode source)"
            ),
            GenError::BlockTokens(m) => write!(f, "{m}"),
            GenError::Unsupported { what, .. } => write!(
                f,
                "the CUDA templates cannot generate {what} yet; the CPU backend and the reference run it"
            ),
            GenError::Codebook { tensor, why } => write!(f, "the {tensor} codebook given to the generator {why}"),
        }
    }
}

impl std::error::Error for GenError {}

/// The type of one kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamTy {
    /// `const unsigned int*` (read-only words or block ids).
    PtrU32,
    /// `unsigned int*` (written words).
    PtrU32Mut,
    /// `const int*`.
    PtrI32,
    /// `int*` (written).
    PtrI32Mut,
    /// `const act*`: activation elements (`unsigned short` bits or `float`).
    PtrAct,
    /// `act*` (written).
    PtrActMut,
    /// `const float*`.
    PtrF32,
    /// `float*` (written).
    PtrF32Mut,
    /// `int` by value.
    I32,
    /// `float` by value.
    F32,
}

/// One kernel argument: its name in the source and its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    pub name: &'static str,
    pub ty: ParamTy,
}

/// How one entry point is launched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryLaunch {
    /// The `extern "C"` name in the source.
    pub entry: String,
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
    /// Grid x and y; grid z is always the batch.
    pub grid_xy: [u32; 2],
    /// Static shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Arguments, in order.
    pub params: Vec<Param>,
}

impl EntryLaunch {
    /// Grid dimensions for a batch of `batch` sequences whose longest holds
    /// `max_tokens` tokens (the current kernels do not depend on it).
    pub fn grid(&self, batch: u32, _max_tokens: u32) -> [u32; 3] {
        [self.grid_xy[0], self.grid_xy[1], batch]
    }
}

/// Launch shapes of every entry point of one generated source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchInfo {
    pub entries: Vec<EntryLaunch>,
    /// Splits over the sequence (decode); the partial buffers hold
    /// `batch * q_heads * splits` rows.
    pub splits: u32,
    pub q_heads: u32,
    pub head_dim: u32,
}

impl LaunchInfo {
    /// The launch of entry point `name`.
    pub fn entry(&self, name: &str) -> Option<&EntryLaunch> {
        self.entries.iter().find(|e| e.entry == name)
    }
    /// f32 elements of `part_ml` for a batch.
    pub fn part_ml_len(&self, batch: usize) -> usize {
        batch * self.q_heads as usize * self.splits as usize * 2
    }
    /// f32 elements of `part_acc` for a batch.
    pub fn part_acc_len(&self, batch: usize) -> usize {
        batch * self.q_heads as usize * self.splits as usize * self.head_dim as usize
    }
}

/// One generated kernel source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generated {
    /// `scheme/shape/kernel/variant`, e.g.
    /// `kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128/decode/t128.tile32.s8.h4.w1.u1`.
    pub name: String,
    /// Complete CUDA source; needs only `cuda_fp16.h`.
    pub source: String,
    /// FNV-1a of `source` ([`kivi_spec::fnv1a64`]).
    pub hash: u64,
    /// The `extern "C"` kernels the source defines.
    pub entry_points: Vec<String>,
    pub launch: LaunchInfo,
    /// Tokens per block of the layout the source was generated for.
    pub block_tokens: usize,
}

/// Options that change the generated layout rather than the tuning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenOptions {
    /// Tokens per cache block; `None` = [`default_block_tokens`] (what
    /// `PagedCache` uses by default).
    pub block_tokens: Option<usize>,
}

/// The calibrated `nuq` codebooks one source is generated with: for each
/// tensor with `levels = nuq`, its `2^bits` ascending levels for one
/// (layer, tensor) of a calibration (what `kivi_runtime::calib::levels_for`
/// returns); `None` for every other tensor.
///
/// The table is baked into the source as a `__constant__` array, exactly as
/// the fixed Lloyd–Max table is, rather than passed as a kernel argument:
/// the kernels, their arguments and their launch code stay the same for
/// every table-driven codec (no extra pointer threaded through the decode,
/// append, prefill and simulator paths), the table sits in constant memory
/// with no per-launch copy, and the source hash — the kernel cache key and
/// artifact identity — then covers the calibration, so a module compiled
/// for one calibration can never run with another's table. The cost is one
/// compile per distinct (layer, tensor) table, cached by that hash.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Codebooks {
    /// The key's codebook (`levels = nuq` keys only).
    pub key: Option<Vec<f32>>,
    /// The value's codebook (`levels = nuq` values only).
    pub value: Option<Vec<f32>>,
}

impl Codebooks {
    /// The codebook of tensor `t`, if any.
    pub fn get(&self, t: kivi_spec::Tensor) -> Option<&[f32]> {
        match t {
            kivi_spec::Tensor::Key => self.key.as_deref(),
            kivi_spec::Tensor::Value => self.value.as_deref(),
        }
    }

    /// FNV-1a of the tables' f32 bits (`None` without any): names the
    /// calibration in kernel names (`.cb` + 8 hex digits).
    pub fn tag(&self) -> Option<u64> {
        if self.key.is_none() && self.value.is_none() {
            return None;
        }
        let mut bytes = Vec::new();
        for (mark, t) in [(b'k', &self.key), (b'v', &self.value)] {
            if let Some(t) = t {
                bytes.push(mark);
                bytes.extend(t.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            }
        }
        Some(kivi_spec::fnv1a64(&bytes))
    }
}

/// Whether the templates can instantiate every part of `scheme`'s codecs
/// without a calibration.
///
/// They implement the whole codec pipeline of the scheme language: uniform
/// and Lloyd–Max levels (rms or l2 norms; calibrated tables also with a
/// zero point, `norm = minmax` / `minmax_pinned`), Hadamard rotations with or
/// without a seeded sign flip, sparse outliers and per-channel centering,
/// on either axis, for keys and values (docs/cuda.md says what each kernel
/// does for each). Calibrated codebooks (`levels = nuq`) are generated too,
/// but only with their tables ([`generate_calibrated`],
/// [`check_calibrated`]): the table lives in a calibration file, not in
/// the scheme, so here they are refused by name — [`GenError::Unsupported`],
/// which `kivi::scheme!` turns into a compile error at that field (the
/// macro cannot embed a calibration) — rather than generated without one.
///
/// ```
/// use kivi_spec::{parse_scheme, presets};
/// assert!(kivi_templates::check_supported(&presets::kivi2()).is_ok());
/// assert!(kivi_templates::check_supported(&presets::codec2()).is_ok());
/// let s = parse_scheme("R { key: quant(bits = 3, axis = channel, group = 32, levels = lloyd_max, norm = rms),
///     value: quant(bits = 2, axis = token, group = 32), rotation: hadamard(block = 64, apply = [key, value], signs = 7),
///     outliers: sparse(per_token = 2, apply = [value]), center: channel_mean(tokens = 16, apply = [key]),
///     residual: 32 }").unwrap();
/// assert!(kivi_templates::check_supported(&s).is_ok());
/// ```
pub fn check_supported(scheme: &Scheme) -> Result<(), GenError> {
    let scheme = &*kernel_scheme(scheme);
    check_codecs(scheme)?;
    for t in [kivi_spec::Tensor::Key, kivi_spec::Tensor::Value] {
        if let Some(q) = scheme.codec(t).quant() {
            if let kivi_spec::Levels::Nuq(_) = q.levels {
                return Err(GenError::Unsupported {
                    what: format!(
                        "{} levels = nuq (calibrated codebooks) without the calibration's table \
                         (generate_calibrated bakes it in)",
                        t.name()
                    ),
                    field: kivi_spec::Field::Levels(t),
                });
            }
        }
    }
    Ok(())
}

/// [`check_supported`] with the calibrated tables `cb`: every `nuq` tensor
/// must have its codebook (`2^bits` finite, ascending levels — what
/// `lloyd_encode`'s thresholds assume), and no other tensor may have one
/// (a table that would be silently ignored is a mistake upstream).
///
/// ```
/// use kivi_templates::{check_calibrated, Codebooks};
/// let s = kivi_spec::parse_scheme("N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
///     value: quant(bits = 2, axis = token, group = 32), residual: 32 }").unwrap();
/// assert!(check_calibrated(&s, &Codebooks::default()).is_err());
/// let cb = Codebooks { key: Some(vec![-1.5, -0.4, 0.3, 1.2]), value: None };
/// assert!(check_calibrated(&s, &cb).is_ok());
/// let bad = Codebooks { key: Some(vec![-1.5, 0.3, -0.4, 1.2]), value: None };
/// assert!(check_calibrated(&s, &bad).unwrap_err().to_string().contains("ascending"));
/// ```
pub fn check_calibrated(scheme: &Scheme, cb: &Codebooks) -> Result<(), GenError> {
    let scheme = &*kernel_scheme(scheme);
    check_codecs(scheme)?;
    for t in [kivi_spec::Tensor::Key, kivi_spec::Tensor::Value] {
        let err = |why: String| GenError::Codebook { tensor: t.name(), why };
        let nuq = scheme
            .codec(t)
            .quant()
            .filter(|q| matches!(q.levels, kivi_spec::Levels::Nuq(_)));
        match (nuq, cb.get(t)) {
            (None, None) => {}
            (None, Some(_)) => {
                return Err(err(format!(
                    "is for a tensor that scheme `{}` does not quantize with levels = nuq",
                    scheme.name
                )))
            }
            (Some(_), None) => {
                return Err(err(format!(
                    "is missing: scheme `{}` uses levels = nuq there",
                    scheme.name
                )))
            }
            (Some(q), Some(table)) => {
                let want = 1usize << q.bits;
                if table.len() != want {
                    return Err(err(format!(
                        "has {} entries; {}-bit codes need {want}",
                        table.len(),
                        q.bits
                    )));
                }
                if table.iter().any(|x| !x.is_finite()) {
                    return Err(err("has a level that is not finite".into()));
                }
                if table.windows(2).any(|w| w[0] > w[1]) {
                    return Err(err("is not ascending".into()));
                }
            }
        }
    }
    Ok(())
}

/// The scheme whose kernels serve `scheme`: itself, or for a low-rank
/// scheme (`low_rank: pca(...)`) its coordinate scheme
/// ([`Scheme::coordinate_scheme`]: the same codecs and windows over `R`
/// coordinates, head_dim `R`, the full head's softmax scale). A low-rank
/// cache *is* a cache of coordinates; the host wrapper
/// (`kivi_runtime::device::DeviceLowRankCache`) projects rows and queries
/// with the calibrated basis and reconstructs the output once per step, so
/// the generated prefill, append and decode kernels are the coordinate
/// scheme's, unchanged. Every generator entry point here resolves its
/// scheme through this; the many-query block kernel refuses low-rank
/// schemes ([`generate_block_calibrated`]).
///
/// ```
/// let s = kivi_spec::parse_scheme("L { key: quant(bits = 2, axis = channel, group = 32), \
///     value: quant(bits = 2, axis = token, group = 16), residual: 32, \
///     low_rank: pca(rank = 32, apply = [key, value]), heads: mha(2), head_dim: 64 }").unwrap();
/// assert_eq!(kivi_templates::kernel_scheme(&s).head_dim, Some(32));
/// let v = kivi_templates::default_variant(&s, kivi_templates::Kernel::Decode);
/// let g = kivi_templates::generate(&s, kivi_templates::Kernel::Decode, &v).unwrap();
/// assert_eq!(g.launch.head_dim, 32); // scores R-wide coordinates
/// ```
pub fn kernel_scheme(scheme: &Scheme) -> std::borrow::Cow<'_, Scheme> {
    match scheme.coordinate_scheme() {
        Some(c) => std::borrow::Cow::Owned(c),
        None => std::borrow::Cow::Borrowed(scheme),
    }
}

/// What no table can fix: caches the paged-cache kernels have no layout for.
fn check_codecs(scheme: &Scheme) -> Result<(), GenError> {
    // Every codec of the grammar is generated (see above), and the
    // integer-domain query (`query: int8(...)`) by the decode template;
    // MLA caches have their own layout (kivi_spec::mla) and no template yet.
    if scheme.mla().is_some() {
        return Err(GenError::Unsupported {
            what: "mla heads with the paged-cache kernels (mla decode has its own: generate_mla_decode)".into(),
            field: kivi_spec::Field::Heads,
        });
    }
    // `nuq` tables with a zero point (`norm = minmax` / `minmax_pinned`)
    // and key outliers on pre-RoPE keys are generated: the templates store
    // and add the zero point (`MINMAX` tensors) and turn each key outlier's
    // correction with the query (kivi_decode.cuh).
    if scheme.has_vq() {
        check_vq(scheme)?;
    }
    Ok(())
}

/// What the vq decode template (`cuda/kivi_vq_decode.cuh`) leaves out:
/// the codec pipeline of the other tensor (rotations, outliers,
/// centering), pre-RoPE keys and the int8 query. Each is refused by name
/// rather than generated wrong.
fn check_vq(scheme: &Scheme) -> Result<(), GenError> {
    use kivi_spec::{Field, Tensor};
    let refuse = |what: &str, field: Field| {
        Err(GenError::Unsupported {
            what: format!("{what} in a scheme with vq(...) codecs (kivi_vq_decode.cuh has no such step)"),
            field,
        })
    };
    if scheme.rope.is_some() {
        return refuse("pre-RoPE keys (rope: pre)", Field::Rope);
    }
    if scheme.query.is_some() {
        return refuse("an int8 query (query: int8)", Field::Query);
    }
    for t in [Tensor::Key, Tensor::Value] {
        if scheme.rotation_of(t).is_some() || scheme.outliers_of(t) > 0 || scheme.center_of(t).is_some() {
            return refuse(
                &format!("a rotation, outliers or centering of the {}s", t.name()),
                Field::Codec(t),
            );
        }
    }
    Ok(())
}

fn layout_of(scheme: &Scheme, opts: GenOptions) -> Result<BlockLayout, GenError> {
    kivi_spec::validate(scheme).map_err(|e| GenError::Scheme(e.message))?;
    check_supported(scheme)?;
    layout_unchecked(scheme, opts)
}

/// The layout without the codebook check: variants and scratch sizes do
/// not depend on a `nuq` table, so they are the same with any calibration.
fn layout_unchecked(scheme: &Scheme, opts: GenOptions) -> Result<BlockLayout, GenError> {
    kivi_spec::validate(scheme).map_err(|e| GenError::Scheme(e.message))?;
    check_codecs(scheme)?;
    let shape = scheme.shape().ok_or_else(|| GenError::Unbound(scheme.name.clone()))?;
    let bt = opts.block_tokens.unwrap_or_else(|| default_block_tokens(scheme));
    kivi_spec::layout::check_block_tokens(scheme, bt).map_err(GenError::BlockTokens)?;
    Ok(BlockLayout::new(scheme, shape, bt))
}

/// Every valid variant of `kernel` for this scheme (with a shape), the
/// canonical default first. Empty when the scheme has no shape.
pub fn variants(scheme: &Scheme, kernel: Kernel) -> Vec<Variant> {
    variants_with(scheme, kernel, GenOptions::default())
}

/// [`variants`] for a non-default layout.
pub fn variants_with(scheme: &Scheme, kernel: Kernel, opts: GenOptions) -> Vec<Variant> {
    let scheme = &*kernel_scheme(scheme);
    // The same for every calibration (and without one): a `nuq` scheme
    // tunes over the variants its Lloyd–Max twin has.
    let Ok(layout) = layout_unchecked(scheme, opts) else {
        return Vec::new();
    };
    let mut out: Vec<Variant> = Vec::new();
    for v in variant::space(scheme, &layout, kernel) {
        if v.check(kernel, scheme, &layout).is_ok() && !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// The canonical variant: the first of [`variants`]. For a scheme without
/// a shape (or one no variant fits), a plain 128-thread variant, which
/// [`generate`] then refuses with the reason.
pub fn default_variant(scheme: &Scheme, kernel: Kernel) -> Variant {
    variants(scheme, kernel)
        .into_iter()
        .next()
        .unwrap_or_else(|| variant::space_fallback(kernel))
}

/// Why [`default_kernels`] failed: the message `kivi::scheme!` reports, and
/// the part of the scheme it is about, where the generator names one.
pub type KernelError = (String, Option<kivi_spec::Field>);

/// `(name, source)` of the default variant of the prefill, append and
/// decode kernels of a scheme with a shape (none without one, or with mla
/// heads or low-rank keys, which have no template yet): what
/// `kivi::scheme!` embeds. On failure, the message the macro reports and
/// the part of the scheme it is about, where the generator names one.
pub fn default_kernels(s: &Scheme) -> Result<Vec<(String, String)>, KernelError> {
    // A low-rank scheme embeds its coordinate scheme's kernels
    // (`kernel_scheme`, via `generate`).
    if s.shape().is_none() || s.mla().is_some() {
        return Ok(Vec::new());
    }
    // vq schemes: none (CPU only, as before the templates had vq) when the
    // templates cannot serve the scheme: a step they leave out, or lookup
    // tables too large for any decode variant's shared memory (E = 4096
    // at D = 128).
    if s.has_vq() && (check_vq(s).is_err() || variants(s, Kernel::Decode).is_empty()) {
        return Ok(Vec::new());
    }
    [Kernel::Prefill, Kernel::Append, Kernel::Decode]
        .into_iter()
        .map(|k| {
            generate(s, k, &default_variant(s, k))
                .map(|g| (g.name, g.source))
                .map_err(|e| {
                    let field = match &e {
                        GenError::Unsupported { field, .. } => Some(*field),
                        _ => None,
                    };
                    (format!("cannot generate the {k} kernel of `{}`: {e}", s.name), field)
                })
        })
        .collect()
}

/// Everything `kivi::scheme!` checks, at run time: parse and validate every
/// declaration in `text`, then generate the default kernels of those with a
/// shape. Errors carry the line and column the macro would point at.
///
/// ```
/// let text = "A { key: quant(bits = 2, axis = channel, group = 32), value: full,
///     outliers: sparse(per_token = 1, apply = [key]), heads: mha(2), head_dim: 64 }";
/// assert!(kivi_templates::check_declarations(text).is_ok()); // its kernels generate
/// let bad = "A { key: quant(bits = 2, axis = channel, group = 32), value: full,
///     outliers: sparse(per_token = 1, apply = [value]), heads: mha(2), head_dim: 64 }";
/// let e = kivi_templates::check_declarations(bad).unwrap_err(); // outliers of a `full` tensor
/// assert_eq!(e.line, 2);
/// ```
pub fn check_declarations(text: &str) -> Result<(), kivi_spec::ParseError> {
    for d in kivi_spec::parse_decls(text)? {
        if let Err((msg, field)) = default_kernels(&d.scheme) {
            let span = field
                .and_then(|f| kivi_spec::span_for(&d.spans, f))
                .unwrap_or_else(|| d.ident.span());
            return Err(kivi_spec::ParseError::at(span, msg));
        }
    }
    Ok(())
}

/// Generates the source of `kernel` for `scheme` (which must have a shape)
/// instantiated with `variant`, for the default block size.
pub fn generate(scheme: &Scheme, kernel: Kernel, variant: &Variant) -> Result<Generated, GenError> {
    generate_with(scheme, kernel, variant, GenOptions::default())
}

/// [`generate`] for a non-default layout.
pub fn generate_with(
    scheme: &Scheme,
    kernel: Kernel,
    variant: &Variant,
    opts: GenOptions,
) -> Result<Generated, GenError> {
    let scheme = &*kernel_scheme(scheme);
    let layout = layout_of(scheme, opts)?;
    variant.check(kernel, scheme, &layout)?;
    Ok(generate::generate(
        scheme,
        &layout,
        kernel,
        variant,
        &Codebooks::default(),
    ))
}

/// [`generate_with`] for a scheme whose `levels = nuq` tensors decode with
/// the calibrated tables `cb` ([`check_calibrated`]), baked into the source
/// as `__constant__` arrays (see [`Codebooks`] for why), so the source, its
/// hash and its name (`.cb` + 8 hex digits after the shape) change with
/// the tables. With no `nuq` tensor and no tables it is [`generate_with`].
///
/// ```
/// use kivi_templates::{default_variant, generate_calibrated, Codebooks, Kernel};
/// let s = kivi_spec::parse_scheme("N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
///     value: quant(bits = 2, axis = token, group = 32), residual: 32, heads: mha(2), head_dim: 64 }").unwrap();
/// let v = default_variant(&s, Kernel::Decode);
/// let cb = |x: f32| Codebooks { key: Some(vec![-1.5, -0.4, x, 1.2]), value: None };
/// let a = generate_calibrated(&s, Kernel::Decode, &v, Default::default(), &cb(0.3)).unwrap();
/// let b = generate_calibrated(&s, Kernel::Decode, &v, Default::default(), &cb(0.25)).unwrap();
/// assert_ne!(a.hash, b.hash);
/// assert!(kivi_templates::generate(&s, Kernel::Decode, &v).is_err()); // no table: refused
/// ```
pub fn generate_calibrated(
    scheme: &Scheme,
    kernel: Kernel,
    variant: &Variant,
    opts: GenOptions,
    cb: &Codebooks,
) -> Result<Generated, GenError> {
    let scheme = &*kernel_scheme(scheme);
    check_calibrated(scheme, cb)?;
    let layout = layout_unchecked(scheme, opts)?;
    variant.check(kernel, scheme, &layout)?;
    Ok(generate::generate(scheme, &layout, kernel, variant, cb))
}

/// Floats of scratch the prefill/append kernels need per (sequence,
/// tensor, KV head) for the codec pipeline (transformed rows, outliers'
/// channels and values); 0 without a pipeline. The `work` argument holds
/// `batch * 2 * kv_heads` such regions.
pub fn extend_work_floats(scheme: &Scheme, opts: GenOptions) -> Result<usize, GenError> {
    // Independent of any `nuq` table: the same with every calibration.
    let scheme = &*kernel_scheme(scheme);
    let layout = layout_unchecked(scheme, opts)?;
    Ok(generate::work_floats(scheme, &layout))
}

/// The readable scheme + shape part of a kernel name, e.g.
/// `kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128`.
pub fn scheme_tag(scheme: &Scheme) -> String {
    generate::scheme_tag(&kernel_scheme(scheme), None)
}

/// The text of the simulator shim header (`cuda/sim_shim.h`), for the `sim`
/// backend: compiles a generated source as C++ on the host.
pub const SIM_SHIM: &str = include_str!("../cuda/sim_shim.h");

/// The template files, `(file name, text)`, in the order the generator
/// pastes them.
/// The two `kivi_codec_*` files hold the codec pipeline and are pasted
/// only into the sources of schemes that have one.
/// `kivi_vq_decode.cuh` (the lookup-table decode of vq schemes) and
/// `kivi_vq_extend.cuh` (their exact nearest-centroid coding) are pasted
/// only into those schemes' decode and prefill/append sources, after
/// `kivi_decode.cuh` / `kivi_extend.cuh`.
pub const TEMPLATES: [(&str, &str); 7] = [
    ("kivi_common.cuh", include_str!("../cuda/kivi_common.cuh")),
    ("kivi_decode.cuh", include_str!("../cuda/kivi_decode.cuh")),
    ("kivi_extend.cuh", include_str!("../cuda/kivi_extend.cuh")),
    ("kivi_codec_decode.cuh", include_str!("../cuda/kivi_codec_decode.cuh")),
    ("kivi_codec_extend.cuh", include_str!("../cuda/kivi_codec_extend.cuh")),
    ("kivi_vq_decode.cuh", include_str!("../cuda/kivi_vq_decode.cuh")),
    ("kivi_vq_extend.cuh", include_str!("../cuda/kivi_vq_extend.cuh")),
];

/// The many-query (block) kernel's template (`cuda/kivi_block.cuh`), pasted
/// only into [`generate_block`]'s sources.
pub const BLOCK_TEMPLATE: &str = include_str!("../cuda/kivi_block.cuh");

/// The many-query kernel `kivi_block` of `scheme` (which must have a
/// shape): attention for a causal block of new queries per sequence over a
/// cache the block was just appended to, with the meaning of
/// docs/semantics.md "Many new queries". One source per scheme and layout
/// (launch shape [`BlockShape::of`]).
///
/// `kivi_block(pool, tables, table_stride, past_lens, counts, q, max_n,
/// sinks_k, sinks_v, means_k, means_v, tail_k, tail_v, tail_stride,
/// sm_scale, window, out)`:
/// grid [`BlockShape::grid`]. Sequence `b` held `past_lens[b]` tokens and
/// was appended `counts[b]`; `q` is `[batch][max_n][q_heads][D]` act;
/// `tail_k`/`tail_v` are `[batch][tail_stride][kv_heads][D]` act, row `r`
/// of sequence `b` the full-precision token `stored_tokens(past) + r`
/// (the window rows before the block, then the block's rows); `window` as
/// for decode (`-1`: none; `0` attends to nothing). Writes `out`
/// `[batch][max_n][q_heads][D]` f32 for the rows `i < counts[b]`.
///
/// Every codec the decode kernel supports is generated: a stored row is
/// brought to the raw domain once per tile (levels, outliers, inverse
/// rotation, centering means `[batch][kv_heads][D]` act, as for decode).
///
/// ```
/// use kivi_spec::{presets, Heads};
/// let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
/// let g = kivi_templates::generate_block(&s, Default::default()).unwrap();
/// assert!(g.name.starts_with("kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128/block/"));
/// assert_eq!(g.entry_points, ["kivi_block"]);
/// let r = presets::codec2().with_shape(Heads::Mqa(4), 256).unwrap();
/// assert!(kivi_templates::generate_block(&r, Default::default()).is_ok()); // rotated, centered
/// ```
pub fn generate_block(scheme: &Scheme, opts: GenOptions) -> Result<Generated, GenError> {
    check_supported(scheme)?;
    generate_block_calibrated(scheme, opts, &Codebooks::default())
}

/// [`generate_block`] for a scheme whose `levels = nuq` tensors decode with
/// the calibrated tables `cb`, baked in as [`generate_calibrated`] bakes
/// them (the source, its hash and its name change with the tables).
pub fn generate_block_calibrated(scheme: &Scheme, opts: GenOptions, cb: &Codebooks) -> Result<Generated, GenError> {
    if scheme.low_rank.is_some() {
        // The many-query path of a low-rank cache would project every new
        // query and reconstruct every output row; no host wrapper does
        // that for the device yet (kivi_runtime::device::DeviceLowRankCache
        // decodes one query per sequence).
        return Err(GenError::Unsupported {
            what: "low_rank in the many-query block kernel (the device low-rank cache decodes one query per step)"
                .into(),
            field: kivi_spec::Field::LowRank,
        });
    }
    if scheme.rope.is_some() {
        // The block kernel decodes stored rows once per tile for many
        // queries at different positions; turning them is not written yet.
        return Err(GenError::Unsupported {
            what: "pre-RoPE keys (rope: pre) in the many-query block kernel".into(),
            field: kivi_spec::Field::Rope,
        });
    }
    if scheme.has_vq() {
        // The block kernel brings stored rows to the raw domain per tile;
        // it has no codebook argument (vq decodes one query at a time).
        return Err(GenError::Unsupported {
            what: "vq(...) codecs in the many-query block kernel".into(),
            field: kivi_spec::Field::Codec(if scheme.key.vq().is_some() {
                kivi_spec::Tensor::Key
            } else {
                kivi_spec::Tensor::Value
            }),
        });
    }
    check_calibrated(scheme, cb)?;
    let layout = layout_unchecked(scheme, opts)?;
    block::generate_block(scheme, &layout, cb)
}

/// The launch shape [`generate_block`] uses for `scheme`'s shape (`None`
/// without one).
pub fn block_shape(scheme: &Scheme) -> Option<BlockShape> {
    scheme.shape().map(|s| BlockShape::of(s.group_size(), s.head_dim))
}
