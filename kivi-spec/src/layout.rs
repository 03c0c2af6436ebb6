//! Exact memory layout and accounting. The paged cache, the CPU kernels and
//! the generated CUDA all index memory through these numbers, so the bytes
//! `kivi show` reports are the bytes the cache allocates.
//!
//! # Packing
//!
//! Codes are packed little-endian, LSB first, into 32-bit words, one token's
//! row of `head_dim` codes at a time. A code never straddles two words: a word
//! holds `floor(32 / bits)` codes — 32, 16, 10, 8 and 4 for 1, 2, 3, 4 and 8
//! bits. Widths that divide 32 waste nothing; 3-bit codes leave the top 2 bits
//! of each word unused (10 codes in 32 bits, 3.2 bits per code, 6.7% over the
//! ideal), which keeps every code a shift-and-mask away. A row is padded to
//! whole words, so `head_dim` need not be a multiple of the codes per word.
//!
//! # A block
//!
//! A block holds `block_tokens` consecutive quantized tokens (counted from the
//! first token after the sinks) for every KV head. Inside it, per KV head, in
//! this order: key codes, key scales, key zero points, value codes, value
//! scales, value zero points. Codes are token-major (`[token][word]`).
//! Parameters are `[group][channel]` for the channel axis (one scale per
//! channel per `G` tokens) and `[token][group]` for the token axis. Scales and
//! zero points are stored in the scale dtype, two f16 per word (the lower
//! half first). A `full` tensor stores its rows in the activation dtype
//! instead, with no parameters.
//!
//! Lloyd–Max levels store one norm per group in the scales section and no
//! zero points (the zeros section is empty). A tensor with sparse outliers
//! (`K` per token) adds two sections after the zeros: the channel indices,
//! `[token][K]` as u16 (two per word, the lower half first, each token's
//! list padded to whole words), then the corrections `x - x^` at those
//! channels, `[token][K]` in the activation dtype (likewise padded per
//! token). Centering means (`D` values per KV head per centered tensor, in
//! the activation dtype) are per sequence, not per block, and the Lloyd–Max
//! tables are program constants (`2^b` f32, in constant memory on a GPU).

use crate::model::*;

/// Codes one 32-bit word holds at `bits` per code.
pub fn codes_per_word(bits: u32) -> usize {
    (32 / bits) as usize
}

/// How a tensor's tokens of one sequence split into the three regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regions {
    /// Sink tokens held in the activation dtype.
    pub sinks: usize,
    /// Tokens stored in blocks (quantized, or raw for a `full` codec).
    pub quantized: usize,
    /// Recent tokens held in the activation dtype.
    pub window: usize,
}

/// DESIGN.md §3: which of `t` tokens are sinks, quantized, or in the window.
///
/// ```
/// use kivi_spec::{presets, Tensor, layout::regions};
/// let s = presets::kivi2();
/// // keys: channel axis, G = 32, R = 128: the window holds 128..=159 tokens
/// assert_eq!(regions(&s, Tensor::Key, 200).quantized, 64);
/// // values: token axis: everything but the last 128
/// assert_eq!(regions(&s, Tensor::Value, 200).quantized, 72);
/// ```
pub fn regions(s: &Scheme, t: Tensor, tokens: usize) -> Regions {
    let sinks = tokens.min(s.sinks as usize);
    let p = tokens - sinks;
    let r = s.residual as usize;
    let quantized = match s.codec(t) {
        Codec::Full => p,
        // A vq token is coded on its own, like a token-axis group.
        Codec::Vq(_) => match s.flush {
            Flush::Chunked => (p / r) * r,
            Flush::Eager => p.saturating_sub(r),
        },
        Codec::Quant(q) => match s.flush {
            Flush::Chunked => (p / r) * r,
            Flush::Eager => match q.axis {
                Axis::Token => p.saturating_sub(r),
                Axis::Channel => {
                    let g = q.group as usize;
                    (p.saturating_sub(r) / g) * g
                }
            },
        },
    };
    Regions {
        sinks,
        quantized,
        window: p - quantized,
    }
}

/// Most tokens the recent window of a tensor ever holds between appends.
pub fn window_capacity(s: &Scheme, t: Tensor) -> usize {
    let r = s.residual as usize;
    match s.codec(t) {
        Codec::Full => 0,
        Codec::Vq(_) => match s.flush {
            Flush::Chunked => r.saturating_sub(1),
            Flush::Eager => r,
        },
        Codec::Quant(q) => match s.flush {
            Flush::Chunked => r.saturating_sub(1),
            Flush::Eager => match q.axis {
                Axis::Token => r,
                Axis::Channel => r + q.group as usize - 1,
            },
        },
    }
}

/// Layout of one tensor of one KV head inside a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub codec: Codec,
    pub dtype: Dtype,
    pub head_dim: usize,
    pub block_tokens: usize,
    /// Words of one token's row (codes, or raw values for `full`).
    pub words_per_token: usize,
    /// Scales (and, equally many, zero points) per block; 0 for `full`.
    pub params_per_block: usize,
    /// Words holding the scales (or norms).
    pub param_words: usize,
    /// Words holding the zero points: `param_words`, or 0 for Lloyd–Max levels.
    pub zero_words: usize,
    /// Sparse outliers kept per token (0 for none).
    pub outliers: usize,
    /// Words of one token's outlier indices (u16) and corrections (activation dtype).
    pub outlier_idx_words: usize,
    pub outlier_val_words: usize,
    /// Word offsets of the sections within this tensor's part.
    pub codes_offset: usize,
    pub scales_offset: usize,
    pub zeros_offset: usize,
    pub outlier_idx_offset: usize,
    pub outlier_val_offset: usize,
    /// Total words of this tensor per block per KV head.
    pub words: usize,
}

impl TensorLayout {
    /// The layout of tensor `t` of scheme `s` (codec, outliers, dtype).
    pub fn of(s: &Scheme, t: Tensor, head_dim: usize, block_tokens: usize) -> Self {
        let mut l = TensorLayout::new(*s.codec(t), s.dtype, head_dim, block_tokens);
        let k = s.outliers_of(t);
        if k > 0 && l.params_per_block > 0 {
            l.outliers = k;
            l.outlier_idx_words = k.div_ceil(2);
            l.outlier_val_words = (k * s.dtype.bytes()).div_ceil(4);
            l.outlier_idx_offset = l.words;
            l.outlier_val_offset = l.words + block_tokens * l.outlier_idx_words;
            l.words = l.outlier_val_offset + block_tokens * l.outlier_val_words;
        }
        l
    }

    /// The layout of a codec without outliers.
    pub fn new(codec: Codec, dtype: Dtype, head_dim: usize, block_tokens: usize) -> Self {
        let (words_per_token, params_per_block, param_bytes) = match codec {
            Codec::Full => ((head_dim * dtype.bytes()).div_ceil(4), 0, 0),
            // One code per sub-vector, packed like scalar codes; the
            // codebooks are per layer, not per block.
            Codec::Vq(v) => (v.subvectors(head_dim).div_ceil(codes_per_word(v.code_bits())), 0, 0),
            Codec::Quant(q) => {
                let g = q.group as usize;
                let params = match q.axis {
                    Axis::Channel => (block_tokens / g) * head_dim,
                    Axis::Token => block_tokens * (head_dim / g),
                };
                (
                    head_dim.div_ceil(codes_per_word(q.bits)),
                    params,
                    params * q.scale.bytes(),
                )
            }
        };
        let param_words = param_bytes.div_ceil(4);
        let zero_words = match codec {
            Codec::Quant(q) if q.has_zeros() => param_words,
            _ => 0,
        };
        let codes = block_tokens * words_per_token;
        let end = codes + param_words + zero_words;
        TensorLayout {
            codec,
            dtype,
            head_dim,
            block_tokens,
            words_per_token,
            params_per_block,
            param_words,
            zero_words,
            outliers: 0,
            outlier_idx_words: 0,
            outlier_val_words: 0,
            codes_offset: 0,
            scales_offset: codes,
            zeros_offset: codes + param_words,
            outlier_idx_offset: end,
            outlier_val_offset: end,
            words: end,
        }
    }

    /// Words of packed codes (or raw rows) per block.
    pub fn codes_words(&self) -> usize {
        self.block_tokens * self.words_per_token
    }

    /// Index (in elements, within the scales or zeros section) of the
    /// parameter for token `t` (within the block) and channel `d`.
    #[inline]
    pub fn param_index(&self, t: usize, d: usize) -> usize {
        match self.codec {
            Codec::Full | Codec::Vq(_) => 0,
            Codec::Quant(q) => {
                let g = q.group as usize;
                match q.axis {
                    Axis::Channel => (t / g) * self.head_dim + d,
                    Axis::Token => t * (self.head_dim / g) + d / g,
                }
            }
        }
    }
}

/// Layout of a whole block (all KV heads, both tensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    pub shape: Shape,
    pub block_tokens: usize,
    pub key: TensorLayout,
    pub value: TensorLayout,
    /// Words per KV head (key part then value part).
    pub head_words: usize,
    /// Words per block.
    pub block_words: usize,
}

/// The block size used when none is given: the smallest multiple of every
/// channel-axis group that is at least 64 tokens.
pub fn default_block_tokens(s: &Scheme) -> usize {
    let mut l = 1usize;
    for t in [Tensor::Key, Tensor::Value] {
        if let Some(q) = s.codec(t).quant() {
            if q.axis == Axis::Channel {
                l = lcm(l, q.group as usize);
            }
        }
    }
    l * 64usize.div_ceil(l)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// The largest block, in tokens.
pub const MAX_BLOCK_TOKENS: usize = 1 << 16;

/// Why a block size does not fit a scheme.
pub fn check_block_tokens(s: &Scheme, block_tokens: usize) -> Result<(), String> {
    if block_tokens == 0 || block_tokens > MAX_BLOCK_TOKENS {
        return Err(format!(
            "block size {block_tokens} tokens is out of range; expected 1 to {MAX_BLOCK_TOKENS}"
        ));
    }
    for t in [Tensor::Key, Tensor::Value] {
        if let Some(q) = s.codec(t).quant() {
            if q.axis == Axis::Channel && !block_tokens.is_multiple_of(q.group as usize) {
                return Err(format!(
                    "block size {block_tokens} tokens is not a multiple of the {} channel group {}",
                    t.name(),
                    q.group
                ));
            }
        }
    }
    Ok(())
}

impl BlockLayout {
    /// The layout of `scheme` (which must have a shape) with `block_tokens`
    /// tokens per block.
    pub fn new(s: &Scheme, shape: Shape, block_tokens: usize) -> Self {
        let key = TensorLayout::of(s, Tensor::Key, shape.head_dim, block_tokens);
        let value = TensorLayout::of(s, Tensor::Value, shape.head_dim, block_tokens);
        let head_words = key.words + value.words;
        BlockLayout {
            shape,
            block_tokens,
            key,
            value,
            head_words,
            block_words: head_words * shape.kv_heads,
        }
    }

    pub fn tensor(&self, t: Tensor) -> &TensorLayout {
        match t {
            Tensor::Key => &self.key,
            Tensor::Value => &self.value,
        }
    }

    /// Word offset, within a block, of tensor `t` of KV head `h`.
    #[inline]
    pub fn tensor_offset(&self, h: usize, t: Tensor) -> usize {
        h * self.head_words
            + match t {
                Tensor::Key => 0,
                Tensor::Value => self.key.words,
            }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_words * 4
    }
}

/// Exact bytes of one sequence's payload, by kind, for one shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Packed codes (or raw rows of `full` tensors) of quantized tokens.
    pub codes: usize,
    /// Scales of uniform groups, norms of Lloyd–Max groups.
    pub scales: usize,
    pub zeros: usize,
    /// Sparse outliers: channel indices and corrections.
    pub outliers: usize,
    /// Per-channel centering means (per sequence, once the means exist).
    pub means: usize,
    /// Sink and recent-window tokens in the activation dtype.
    pub windows: usize,
}

impl Footprint {
    pub fn total(&self) -> usize {
        self.codes + self.scales + self.zeros + self.outliers + self.means + self.windows
    }

    /// The bytes `tokens` tokens occupy in this scheme, counting codes and
    /// parameters exactly (partial channel groups never exist: they are in the
    /// window) but not block rounding, tables or unused window capacity —
    /// the paged cache reports those separately.
    ///
    /// # Panics
    ///
    /// If the scheme has no shape; bind one first with [`Scheme::with_shape`].
    ///
    /// ```
    /// use kivi_spec::{presets, Heads, layout::Footprint};
    /// let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    /// let f = Footprint::for_tokens(&s, 128 + 32);
    /// // 32 key tokens and 32 value tokens quantized, 128 + 128 in the windows, 8 heads
    /// assert_eq!(f.windows, 8 * 2 * 128 * 128 * 2);
    /// assert_eq!(f.codes, 8 * 2 * 32 * 32);
    /// ```
    pub fn for_tokens(s: &Scheme, tokens: usize) -> Footprint {
        let shape = s.shape().expect("Footprint::for_tokens needs a scheme with a shape");
        // A low-rank scheme stores R-wide coordinate rows (its coordinate
        // scheme's footprint) plus, with `residual = N`, up to N exact
        // D-wide rows per tensor and KV head with a 4-byte position each,
        // counted under `outliers` as `LowRankCache::memory` counts them.
        // The bases are per cache, like tables, and not counted here.
        if let (Some(l), Some(coords)) = (s.low_rank, s.coordinate_scheme()) {
            let mut f = Footprint::for_tokens(&coords, tokens);
            let kept = tokens.min(l.residual as usize);
            f.outliers += 2 * shape.kv_heads * kept * (shape.head_dim * s.dtype.bytes() + 4);
            return f;
        }
        let d = shape.head_dim;
        let mut f = Footprint::default();
        for t in [Tensor::Key, Tensor::Value] {
            let r = regions(s, t, tokens);
            f.windows += (r.sinks + r.window) * d * s.dtype.bytes();
            match s.codec(t) {
                Codec::Full => f.codes += r.quantized * d * s.dtype.bytes(),
                Codec::Vq(v) => f.codes += r.quantized * v.subvectors(d).div_ceil(codes_per_word(v.code_bits())) * 4,
                Codec::Quant(q) => {
                    let wpt = d.div_ceil(codes_per_word(q.bits));
                    f.codes += r.quantized * wpt * 4;
                    let g = q.group as usize;
                    let params = match q.axis {
                        Axis::Channel => (r.quantized / g) * d,
                        Axis::Token => r.quantized * (d / g),
                    };
                    f.scales += params * q.scale.bytes();
                    if q.has_zeros() {
                        f.zeros += params * q.scale.bytes();
                    }
                    let k = s.outliers_of(t);
                    if k > 0 {
                        f.outliers += r.quantized * (k.div_ceil(2) + (k * s.dtype.bytes()).div_ceil(4)) * 4;
                    }
                }
            }
            if let Some(n) = s.center_of(t) {
                if tokens >= n {
                    f.means += d * s.dtype.bytes();
                }
            }
        }
        f.codes *= shape.kv_heads;
        f.scales *= shape.kv_heads;
        f.zeros *= shape.kv_heads;
        f.outliers *= shape.kv_heads;
        f.means *= shape.kv_heads;
        f.windows *= shape.kv_heads;
        f
    }
}

/// Bytes per quantized token per KV head (keys plus values: codes,
/// parameters and sparse outliers), as a fraction `(bytes, tokens)` so it stays exact even when
/// a channel group's parameters do not divide evenly.
///
/// # Panics
///
/// If the scheme has no shape; bind one first with [`Scheme::with_shape`].
///
/// ```
/// use kivi_spec::{presets, Heads, layout::bytes_per_token_per_head};
/// let s = presets::kivi2().with_shape(Heads::Mha(1), 128).unwrap();
/// let (bytes, per) = bytes_per_token_per_head(&s);
/// assert_eq!(bytes as f64 / per as f64, 96.0); // vs 512 for f16 K + V
/// ```
pub fn bytes_per_token_per_head(s: &Scheme) -> (usize, usize) {
    // A low-rank token stores its R coordinates as a head of width R.
    if let Some(c) = s.coordinate_scheme() {
        return bytes_per_token_per_head(&c);
    }
    let one = Scheme {
        heads: Some(Heads::Mha(1)),
        ..s.clone()
    };
    // Over one full period of every group size the count is exact.
    let mut period = 1usize;
    for t in [Tensor::Key, Tensor::Value] {
        if let Some(q) = s.codec(t).quant() {
            period = lcm(period, q.group as usize);
        }
    }
    // Payload of `period` tokens that are all quantized (no windows).
    let no_windows = Scheme {
        residual: 0,
        sinks: 0,
        flush: Flush::Eager,
        ..one
    };
    let f = Footprint::for_tokens(&no_windows, period);
    (f.codes + f.scales + f.zeros + f.outliers, period)
}

/// All-in bits per element of a quantized token: everything a quantized
/// token stores per KV head (codes, scales or norms, zero points, outlier
/// indices and corrections; [`bytes_per_token_per_head`]) over its `2 D`
/// key and value elements. Per-sequence constants (windows, centering
/// means) and program constants (Lloyd–Max tables) are not per token and
/// are reported separately. kivi2 at any head_dim: 3.0.
///
/// # Panics
///
/// If the scheme has no shape.
///
/// ```
/// use kivi_spec::{presets, Heads, layout::bits_per_element};
/// let s = presets::kivi2().with_shape(Heads::Mqa(4), 256).unwrap();
/// assert_eq!(bits_per_element(&s), 3.0);
/// ```
pub fn bits_per_element(s: &Scheme) -> f64 {
    let d = s
        .shape()
        .expect("bits_per_element needs a scheme with a shape")
        .head_dim;
    let (bytes, per) = bytes_per_token_per_head(s);
    bytes as f64 * 8.0 / (per as f64 * 2.0 * d as f64)
}
