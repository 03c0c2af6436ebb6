//! The scheme model: plain data that the parser produces, tests build by
//! hand, and every backend and the code generator consume.

use std::fmt;

/// Which grouping axis a quantizer uses (DESIGN.md §3).
///
/// `Channel`: a group is `G` consecutive tokens of one channel, counted from
/// the first token after the sinks. `Token`: a group is `G` consecutive
/// channels of one token (`G` must divide `head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Channel,
    Token,
}

/// Element type of activations (inputs, full-precision windows, outputs of
/// the rounding step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    Bf16,
    F32,
}

impl Dtype {
    /// Bytes one element occupies in memory.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }
}

/// Element type of stored scales and zero points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleDtype {
    F16,
    F32,
}

impl ScaleDtype {
    pub fn bytes(self) -> usize {
        match self {
            ScaleDtype::F16 => 2,
            ScaleDtype::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ScaleDtype::F16 => "f16",
            ScaleDtype::F32 => "f32",
        }
    }
}

/// A group quantizer: `bits`-bit codes for groups of `group` elements along
/// `axis`, with per-group parameters in `scale` precision.
///
/// [`Levels::Uniform`] (KIVI) stores a scale and a zero point per group and
/// decodes `c * s + z`; [`Levels::LloydMax`] stores one norm per group and
/// decodes `s * L[c]` from a fixed table `L` (see [`lloyd_max_levels`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quant {
    /// Code width: 1, 2, 3, 4 or 8 (1 to 4 for Lloyd–Max and nuq levels).
    pub bits: u32,
    pub axis: Axis,
    /// Group size `G` along `axis`.
    pub group: u32,
    pub scale: ScaleDtype,
    /// What a code means.
    pub levels: Levels,
}

impl Quant {
    /// A uniform (min/max, KIVI) quantizer with the given parameters.
    ///
    /// ```
    /// use kivi_spec::{Axis, Levels, Quant, ScaleDtype};
    /// let q = Quant::uniform(2, Axis::Channel, 32, ScaleDtype::F16);
    /// assert_eq!((q.max_code(), q.levels), (3, Levels::Uniform));
    /// ```
    pub fn uniform(bits: u32, axis: Axis, group: u32, scale: ScaleDtype) -> Quant {
        Quant {
            bits,
            axis,
            group,
            scale,
            levels: Levels::Uniform,
        }
    }

    /// Largest code, `2^bits - 1`.
    pub fn max_code(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// Whether each group stores a zero point: uniform levels, and a
    /// `nuq` table over `[0, 1]` (`norm = minmax`).
    pub fn has_zeros(&self) -> bool {
        match self.levels {
            Levels::Uniform => true,
            Levels::LloydMax(n) | Levels::Nuq(n) => n.has_zero(),
        }
    }
}

/// What the `2^b` codes of a quantizer stand for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Levels {
    /// Evenly spaced between the group's min and max (scale + zero point).
    Uniform,
    /// The fixed MSE-optimal levels of a unit Gaussian at `b` bits
    /// (Lloyd–Max), applied to each group after dividing it by its norm.
    LloydMax(Norm),
    /// A `2^b`-entry codebook learned per layer and tensor from the model's
    /// own K/V (KVQuant's non-uniform datatype), applied exactly like
    /// `LloydMax`: each group divided by its norm, the nearest entry coded.
    /// The table is not part of the scheme: it comes from a calibration
    /// file (`kivi_runtime::calib`), whose hash joins the scheme's in a
    /// cache's identity. A cache refuses to build without one.
    Nuq(Norm),
}

impl Levels {
    /// The name the grammar spells: `uniform`, `lloyd_max` or `nuq`.
    pub fn name(self) -> &'static str {
        match self {
            Levels::Uniform => "uniform",
            Levels::LloydMax(_) => "lloyd_max",
            Levels::Nuq(_) => "nuq",
        }
    }

    /// The norm of a table-driven quantizer (`None` for uniform levels).
    pub fn norm(self) -> Option<Norm> {
        match self {
            Levels::Uniform => None,
            Levels::LloydMax(n) | Levels::Nuq(n) => Some(n),
        }
    }
}

/// The one parameter a Lloyd–Max group stores (in the scale dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Norm {
    /// `s = sqrt(mean(x^2))`: the group divided by `s` is about unit Gaussian.
    Rms,
    /// Codes are chosen as for `Rms`, but the stored `s` makes the decoded
    /// group keep the input's L2 norm: `s = ||x|| / ||L[c]||` (the norm
    /// correction of TurboQuant-style codecs).
    L2,
    /// A scale and a zero point, as uniform levels store them: `s = hi -
    /// lo`, `z = lo`, codes of `(x - z) / s` against a table over `[0,
    /// 1]`, decoded `z + s L[c]` (KVQuant's per-channel offset before its
    /// non-uniform table). Pre-RoPE keys carry large per-channel offsets
    /// that a symmetric norm spends its levels on. Only `levels = nuq`
    /// (the fixed Lloyd–Max table is a Gaussian's), on channel-axis keys
    /// with `rope: pre(...)` for now (validate.rs says why).
    MinMax,
    /// `MinMax` whose table has its first and last entries fixed at 0 and
    /// 1 (`norm = minmax_pinned`); calibration learns only the inner ones.
    /// Every group then decodes its own minimum and maximum exactly, as
    /// uniform levels do: the free table pulled its ends in to about 0.16
    /// and 0.84 of the span and shrank each group's largest keys
    /// (docs/accuracy.md, "Two bits all-in"). Stored and decoded exactly
    /// like `MinMax` (the table is an ordinary table); only the fit and the
    /// scheme's identity differ. Needs at least 2 bits (at 1 bit every
    /// entry would be pinned: that is uniform levels).
    MinMaxPinned,
}

impl Norm {
    pub fn name(self) -> &'static str {
        match self {
            Norm::Rms => "rms",
            Norm::L2 => "l2",
            Norm::MinMax => "minmax",
            Norm::MinMaxPinned => "minmax_pinned",
        }
    }

    /// Whether a group stores a zero point and codes `(x - z) / s` against
    /// a table over `[0, 1]` (`minmax`, `minmax_pinned`): the kernels treat
    /// both alike.
    pub fn has_zero(self) -> bool {
        matches!(self, Norm::MinMax | Norm::MinMaxPinned)
    }
}

/// The Lloyd–Max levels of a unit Gaussian at `bits` (1 to 4), ascending;
/// `None` for other widths.
///
/// These are the MSE-optimal `2^b`-level quantizers of N(0, 1), as tabulated
/// by J. Max, "Quantizing for minimum distortion", IRE Trans. Inf. Theory
/// 6(1), 1960 (Table I), here to 7 digits. The test
/// `lloyd_max_tables_are_fixed_points` in `kivi-spec` recomputes them with a
/// Lloyd iteration (centroid and midpoint conditions on the exact Gaussian)
/// and checks every entry to 1e-5.
///
/// ```
/// let l = kivi_spec::lloyd_max_levels(2).unwrap();
/// assert_eq!(l.len(), 4);
/// assert!((l[3] - 1.5104).abs() < 1e-4 && l[0] == -l[3]);
/// ```
pub fn lloyd_max_levels(bits: u32) -> Option<&'static [f32]> {
    match bits {
        1 => Some(&LLOYD_MAX_1),
        2 => Some(&LLOYD_MAX_2),
        3 => Some(&LLOYD_MAX_3),
        4 => Some(&LLOYD_MAX_4),
        _ => None,
    }
}

const LLOYD_MAX_1: [f32; 2] = [-0.7978846, 0.7978846];
const LLOYD_MAX_2: [f32; 4] = [-1.5104176, -0.45278, 0.45278, 1.5104176];
const LLOYD_MAX_3: [f32; 8] = [
    -2.1519457, -1.3439093, -0.7560053, -0.2450942, 0.2450942, 0.7560053, 1.3439093, 2.1519457,
];
const LLOYD_MAX_4: [f32; 16] = [
    -2.7325896, -2.0690172, -1.6180464, -1.2562312, -0.9423405, -0.6567591, -0.3880483, -0.128395, 0.128395, 0.3880483,
    0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896,
];

/// How one tensor (K or V) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Kept in the activation dtype (the unquantized baseline).
    Full,
    Quant(Quant),
    /// Product vector quantization with calibrated codebooks
    /// (`vq(dim = M, entries = E [, codebook = NAME])`, see [`crate::vq`]).
    Vq(crate::vq::Vq),
}

impl Codec {
    /// The scalar quantizer, if this codec is one (`None` for `full` and
    /// `vq`).
    pub fn quant(&self) -> Option<&Quant> {
        match self {
            Codec::Full | Codec::Vq(_) => None,
            Codec::Quant(q) => Some(q),
        }
    }

    /// The vector quantizer, if this codec is one.
    pub fn vq(&self) -> Option<&crate::vq::Vq> {
        match self {
            Codec::Vq(v) => Some(v),
            _ => None,
        }
    }

    /// Whether tokens past the windows are stored coded (anything but
    /// `full`).
    pub fn is_coded(&self) -> bool {
        !matches!(self, Codec::Full)
    }
}

/// Which tensors a transform or an extra applies to (`apply = [key, value]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Apply {
    pub key: bool,
    pub value: bool,
}

impl Apply {
    /// Whether tensor `t` is in the list.
    pub fn has(&self, t: Tensor) -> bool {
        match t {
            Tensor::Key => self.key,
            Tensor::Value => self.value,
        }
    }
    /// The list as the grammar spells it, e.g. `[key, value]`.
    pub fn text(&self) -> String {
        let v: Vec<&str> = [(self.key, "key"), (self.value, "value")]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        format!("[{}]", v.join(", "))
    }
}

/// An orthogonal transform applied to each token's row before quantizing
/// (`rotation: hadamard(block = B, apply = [...] [, signs = SEED])`).
///
/// Normalised Walsh–Hadamard on consecutive blocks of `block` channels,
/// after an optional fixed sign flip of every channel (a ±1 vector drawn
/// from `signs` as a seed, the same for every head and layer). Kernels
/// never undo it per cached token: they rotate the query once per step
/// (`q . k = (Tq) . (Tk)`) and un-rotate the value output once
/// (`sum p_t T^-1 v_t = T^-1 sum p_t v_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rotation {
    /// Channels per Hadamard block (a power of two dividing head_dim).
    pub block: u32,
    /// Seed of the sign flip, or `None` for no flip.
    pub signs: Option<u32>,
    pub apply: Apply,
}

/// Dense-and-sparse outliers (`outliers: sparse(per_token = K, apply = [...])`):
/// per token and KV head, the `K` entries of largest magnitude (after
/// centering and rotation) are taken out before quantizing and stored with
/// their channel index; the correction `x - x^` at those channels is kept in
/// the activation dtype and added back to the decoded row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Outliers {
    pub per_token: u32,
    pub apply: Apply,
}

/// Per-channel centering (`center: channel_mean(tokens = N, apply = [...])`):
/// per sequence and KV head, the mean of each channel over the first `N`
/// tokens is stored (activation dtype) and subtracted before rotating and
/// quantizing; decoding adds it back (for keys a kernel adds `q . m` to the
/// score of every quantized token). Needs no calibration: `N` must not
/// exceed `sinks + residual`, so the mean is known before the first token is
/// quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Center {
    pub tokens: u32,
    pub apply: Apply,
}

/// Which channels RoPE rotates together (`style = half | interleaved`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// NeoX / Llama / Gemma (`rotate_half`): channel `i` pairs with
    /// `i + D/2`, both at frequency `i`.
    Half,
    /// GPT-J: channels `2i` and `2i + 1` pair, at frequency `i`.
    Interleaved,
}

impl RopeStyle {
    pub fn name(self) -> &'static str {
        match self {
            RopeStyle::Half => "half",
            RopeStyle::Interleaved => "interleaved",
        }
    }

    /// The two channels of pair `i` (`0 <= i < D/2`) of a `d`-channel head.
    ///
    /// ```
    /// use kivi_spec::RopeStyle;
    /// assert_eq!(RopeStyle::Half.pair(3, 8), (3, 7));
    /// assert_eq!(RopeStyle::Interleaved.pair(3, 8), (6, 7));
    /// ```
    pub fn pair(self, i: usize, d: usize) -> (usize, usize) {
        match self {
            RopeStyle::Half => (i, i + d / 2),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        }
    }
}

/// Pre-RoPE keys (`rope: pre(theta = B, style = half|interleaved [, scaling = linear(F)])`,
/// KVQuant): the cache stores keys *before* rotary embedding, so that
/// channel-axis quantization sees the channels' own statistics, and decode
/// rotates each cached key by the angle of its absolute position. The
/// query a caller passes is the model's query after RoPE, as with any cache.
///
/// Pair `i` of the token at position `p` turns by
/// `(p / F) * B^(-2i/D)` radians ([`Rope::angle`]): computed in f64, its
/// cosine and sine rounded to f32 once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// The base `B` (`rope_theta`): 10000 for Gemma 3's local layers,
    /// 1000000 for its global ones.
    pub theta: f64,
    pub style: RopeStyle,
    /// Linear position interpolation: positions are divided by this factor
    /// (1 = none).
    pub scaling: f64,
}

impl Rope {
    /// The inverse frequency of pair `i` of a `d`-channel head, with the
    /// linear scaling folded in: `B^(-2i/d) / F`.
    pub fn inv_freq(&self, i: usize, d: usize) -> f64 {
        self.theta.powf(-2.0 * i as f64 / d as f64) / self.scaling
    }

    /// The angle pair `i` of the token at position `pos` turns by.
    ///
    /// ```
    /// let r = kivi_spec::Rope { theta: 10000.0, style: kivi_spec::RopeStyle::Half, scaling: 1.0 };
    /// assert_eq!(r.angle(7, 0, 64), 7.0);
    /// assert!((r.angle(1, 16, 64) - 0.01).abs() < 1e-12); // 10000^(-1/2)
    /// ```
    pub fn angle(&self, pos: usize, i: usize, d: usize) -> f64 {
        pos as f64 * self.inv_freq(i, d)
    }

    /// `(cos, sin)` of [`Self::angle`], rounded to f32: the numbers every
    /// backend rotates with.
    pub fn cos_sin(&self, pos: usize, i: usize, d: usize) -> (f32, f32) {
        let a = self.angle(pos, i, d);
        (a.cos() as f32, a.sin() as f32)
    }

    /// Rotates `row` (one head, `D` channels) in place to position `pos`:
    /// `(x_a, x_b) <- (x_a c - x_b s, x_b c + x_a s)` for every pair, with
    /// `c, s` from [`Self::cos_sin`] and the two products summed in f64
    /// before one rounding (the oracle's definition; kernels agree to f32
    /// rounding).
    ///
    /// ```
    /// let r = kivi_spec::Rope { theta: 10000.0, style: kivi_spec::RopeStyle::Interleaved, scaling: 1.0 };
    /// let mut x = [1.0f32, 0.0, 1.0, 0.0];
    /// r.rotate(&mut x, 0); // position 0 turns nothing
    /// assert_eq!(x, [1.0, 0.0, 1.0, 0.0]);
    /// ```
    pub fn rotate(&self, row: &mut [f32], pos: usize) {
        let d = row.len();
        for i in 0..d / 2 {
            let (a, b) = self.style.pair(i, d);
            let (c, s) = self.cos_sin(pos, i, d);
            let (xa, xb, c, s) = (row[a] as f64, row[b] as f64, c as f64, s as f64);
            row[a] = (xa * c - xb * s) as f32;
            row[b] = (xb * c + xa * s) as f32;
        }
    }
}

/// Integer-domain decode (`query: int8(group = G)`): the query is quantized
/// to 8-bit codes and key scores are accumulated as integer dot products
/// against the cached key codes (docs/semantics.md, "Integer-domain decode").
///
/// It applies to KIVI's channel-axis uniform keys (2 or 4 bits, no codec
/// pipeline). There the key group's scales fold into the query,
/// `q . k^_t = sum_d (q_d s_d) c_td + sum_d q_d z_d`, so the quantized
/// vector is the folded query `w_d = q_d s_d` (`q` rounded to the activation
/// dtype and times the softmax scale, in f32), once per head and key group:
/// per block of `group` consecutive channels, with `m = max |w|`,
/// `a = m / 127` and `qi_d = clamp(round_ties_even(w_d * (127 / m)), -127,
/// 127)` (0 where `m == 0`),
/// and the score is `sum_blocks a * (sum_d qi_d c_td) + sum_d q_d z_d`. The
/// integer sums are exact, so every backend agrees to rounding order.
///
/// Why per group of channels and per key group: a KIVI key channel with a
/// large range has a large scale, so a few entries of `w` dominate a head;
/// one `a` per head would spend the 8 bits on them. Blocks of 32 channels
/// (the default of llama.cpp's q8_0, and two 2-bit code words) confine an
/// outlier to its block, and the quantization runs once per `G` tokens, not
/// per token, so its cost is spread over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QueryQuant {
    /// Channels per query scale (a multiple of 16 dividing head_dim).
    pub group: u32,
}

/// Query/KV head arrangement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Heads {
    /// `n` query heads, `n` KV heads.
    Mha(u32),
    /// `q` query heads sharing `kv` KV heads (`q % kv == 0`).
    Gqa { q: u32, kv: u32 },
    /// `q` query heads sharing one KV head.
    Mqa(u32),
    /// Multi-head latent attention: `q` query heads over one cached latent
    /// and one decoupled RoPE key per token (see [`crate::mla`]).
    Mla(crate::mla::Mla),
}

impl Heads {
    pub fn q_heads(&self) -> u32 {
        match *self {
            Heads::Mha(n) => n,
            Heads::Gqa { q, .. } => q,
            Heads::Mqa(q) => q,
            Heads::Mla(m) => m.q,
        }
    }
    pub fn kv_heads(&self) -> u32 {
        match *self {
            Heads::Mha(n) => n,
            Heads::Gqa { kv, .. } => kv,
            Heads::Mqa(_) | Heads::Mla(_) => 1,
        }
    }
    /// The same arrangement spelled the canonical way: `mha` when the counts
    /// agree, `mqa` when there is one KV head, `gqa` otherwise; `mla`
    /// stays itself.
    pub fn normalized(&self) -> Heads {
        if let Heads::Mla(_) = self {
            return *self;
        }
        let (q, kv) = (self.q_heads(), self.kv_heads());
        if q == kv {
            Heads::Mha(q)
        } else if kv == 1 {
            Heads::Mqa(q)
        } else {
            Heads::Gqa { q, kv }
        }
    }
    /// Builds the normalized layout from head counts.
    pub fn from_counts(q: u32, kv: u32) -> Heads {
        Heads::Gqa { q, kv }.normalized()
    }
}

impl fmt::Display for Heads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.normalized() {
            Heads::Mha(n) => write!(f, "mha({n})"),
            Heads::Mqa(q) => write!(f, "mqa(q = {q})"),
            Heads::Gqa { q, kv } => write!(f, "gqa(q = {q}, kv = {kv})"),
            Heads::Mla(m) => write!(
                f,
                "mla(q = {}, latent = {}, rope_dim = {}, rope = {})",
                m.q,
                m.latent,
                m.rope_dim,
                crate::canonical::codec_text(&m.rope)
            ),
        }
    }
}

/// When channel-axis (and token-axis) tensors leave the residual window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flush {
    /// DESIGN.md §3 default: token-axis tensors quantize a token as soon as it
    /// leaves the `R`-token window; channel-axis tensors quantize `G` tokens
    /// once the window holds `R + G`. The window always holds at least `R`
    /// tokens (once `R` exist).
    Eager,
    /// KIVI's original: once the window holds `R` tokens, all `R` are
    /// quantized at once, so it cycles between 0 and `R - 1` tokens.
    Chunked,
}

/// What an append does with NaN or infinite inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NonFinite {
    /// Refuse the whole append with an error; the cache is left unchanged.
    Reject,
}

/// A fully validated KV-cache scheme.
///
/// `heads` and `head_dim` are optional: a preset fixes the quantization and
/// the model supplies its shape (see [`Scheme::with_shape`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Scheme {
    pub name: String,
    pub key: Codec,
    pub value: Codec,
    /// Full-precision window of recent tokens, `R`.
    pub residual: u32,
    /// Full-precision attention sinks, the first `S` tokens.
    pub sinks: u32,
    pub flush: Flush,
    pub heads: Option<Heads>,
    pub head_dim: Option<u32>,
    pub dtype: Dtype,
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Attend only to the last `W` tokens.
    pub sliding_window: Option<u32>,
    pub nonfinite: NonFinite,
    /// Orthogonal transform before quantizing, if any.
    pub rotation: Option<Rotation>,
    /// Sparse exact outliers, if any.
    pub outliers: Option<Outliers>,
    /// Per-channel centering, if any.
    pub center: Option<Center>,
    /// Pre-RoPE keys with RoPE applied in the kernel, if any (`None`: keys
    /// are stored as given, after the model's RoPE).
    pub rope: Option<Rope>,
    /// Integer-domain decode (an 8-bit query), if any.
    pub query: Option<QueryQuant>,
    /// Low-rank keys and values stored as coordinates in a calibrated
    /// basis, if any (see [`crate::low_rank`]).
    pub low_rank: Option<crate::low_rank::LowRank>,
}

/// Query heads, KV heads and head dimension of a bound scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Shape {
    /// Query heads served by one KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

/// Which tensor of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tensor {
    Key,
    Value,
}

impl Tensor {
    pub fn name(self) -> &'static str {
        match self {
            Tensor::Key => "key",
            Tensor::Value => "value",
        }
    }
}

impl Scheme {
    /// The codec of one tensor.
    pub fn codec(&self, t: Tensor) -> &Codec {
        match t {
            Tensor::Key => &self.key,
            Tensor::Value => &self.value,
        }
    }

    /// The rotation applied to tensor `t`, if any.
    pub fn rotation_of(&self, t: Tensor) -> Option<&Rotation> {
        self.rotation.as_ref().filter(|r| r.apply.has(t))
    }

    /// Outliers kept per token of tensor `t` (0 when none).
    pub fn outliers_of(&self, t: Tensor) -> usize {
        self.outliers
            .filter(|o| o.apply.has(t))
            .map_or(0, |o| o.per_token as usize)
    }

    /// Tokens whose mean centers tensor `t`, if it is centered.
    pub fn center_of(&self, t: Tensor) -> Option<usize> {
        self.center.filter(|c| c.apply.has(t)).map(|c| c.tokens as usize)
    }

    /// Whether tensor `t` uses anything beyond KIVI's uniform codes on an
    /// axis (a transform, Lloyd–Max levels, outliers or centering).
    pub fn has_pipeline(&self, t: Tensor) -> bool {
        self.rotation_of(t).is_some()
            || self.outliers_of(t) > 0
            || self.center_of(t).is_some()
            || self.codec(t).quant().is_some_and(|q| q.levels != Levels::Uniform)
    }

    /// Whether either tensor uses product vector quantization.
    pub fn has_vq(&self) -> bool {
        self.key.vq().is_some() || self.value.vq().is_some()
    }

    /// The bound shape, when both heads and head_dim are set.
    pub fn shape(&self) -> Option<Shape> {
        Some(Shape {
            q_heads: self.heads?.q_heads() as usize,
            kv_heads: self.heads?.kv_heads() as usize,
            head_dim: self.head_dim? as usize,
        })
    }

    /// The softmax scale in effect (`1/sqrt(D)` unless set; for `mla`
    /// heads `1/sqrt(latent + rope_dim)`, the width of the absorbed key —
    /// a real model sets its own, e.g. DeepSeek-V2-Lite `1/sqrt(192)`).
    pub fn effective_softmax_scale(&self, head_dim: usize) -> f32 {
        let d = match self.heads {
            Some(Heads::Mla(m)) => (m.latent + m.rope_dim) as usize,
            _ => head_dim,
        };
        self.softmax_scale.unwrap_or_else(|| 1.0 / (d as f32).sqrt())
    }

    /// Binds a model shape to this scheme and re-validates the whole.
    ///
    /// A preset leaves `heads`/`head_dim` open; where the scheme already fixes
    /// them they must agree.
    ///
    /// ```
    /// use kivi_spec::{presets, Heads};
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    /// assert_eq!(s.shape().unwrap().group_size(), 4);
    /// assert!(presets::kivi2().with_shape(Heads::Mha(8), 48).is_err()); // 32 does not divide 48
    /// ```
    pub fn with_shape(&self, heads: Heads, head_dim: u32) -> Result<Scheme, crate::Invalid> {
        if let Some(h) = self.heads {
            if h.normalized() != heads.normalized() {
                return Err(crate::Invalid::new(
                    crate::Field::Heads,
                    format!("scheme `{}` declares heads {h}, the input has {heads}", self.name),
                ));
            }
        }
        if let Some(d) = self.head_dim {
            if d != head_dim {
                return Err(crate::Invalid::new(
                    crate::Field::HeadDim,
                    format!("scheme `{}` declares head_dim {d}, the input has {head_dim}", self.name),
                ));
            }
        }
        let mut s = self.clone();
        s.heads = Some(heads.normalized());
        s.head_dim = Some(head_dim);
        crate::validate(&s)?;
        Ok(s)
    }
}
