//! Multi-head latent attention (MLA, DeepSeek-V2/V3) caches.
//!
//! `heads: mla(q = 16, latent = 512, rope_dim = 64, rope = full)` declares
//! a cache that stores, per token, one latent row `c_t` (`latent` channels)
//! and one decoupled RoPE key `k_rope_t` (`rope_dim` channels), both shared
//! by all `q` query heads. The scheme's `key` codec stores the latent (the
//! latent is the value too, so an mla scheme has no `value` field); the
//! `rope = ...` argument is the codec of the RoPE part (`full`, the
//! default, keeps it exact in the activation dtype).
//!
//! Decode runs in the absorbed form (the up-projections are folded into the
//! query and the output outside the cache):
//!
//! ```text
//! score_ht = (q_latent_h . c^_t + q_rope_h . k^rope_t) * scale
//! out_h    = sum_t softmax_t(score_h)_t c^_t        (latent-wide)
//! ```
//!
//! Each part follows DESIGN.md §3 on its own, as if it were the key tensor
//! of an MQA scheme of its width ([`MlaParts`]): the same regions, windows,
//! groups and rounding. So the byte layout of a block is two
//! [`TensorLayout`]s back to back, latent then RoPE ([`MlaLayout`]).

use crate::layout::{codes_per_word, regions, TensorLayout};
use crate::model::*;
use crate::validate::{Field, Invalid, ALLOWED_BITS, LLOYD_MAX_BITS, MAX_GROUP, MAX_HEADS, MAX_HEAD_DIM};

/// The MLA head layout: `q` query heads over one shared latent of `latent`
/// channels and one shared RoPE key of `rope_dim` channels, stored with the
/// codec `rope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mla {
    pub q: u32,
    pub latent: u32,
    pub rope_dim: u32,
    /// Codec of the RoPE part (the latent's is the scheme's `key`).
    pub rope: Codec,
}

/// The two parts of an MLA cache, each an ordinary single-KV-head scheme
/// whose `key` tensor is that part: the latent (width `latent`, the
/// scheme's `key` codec) and the RoPE key (width `rope_dim`, the `rope`
/// codec). Windows, sinks, flush and dtype are the MLA scheme's.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaParts {
    pub mla: Mla,
    pub latent: Scheme,
    pub rope: Scheme,
}

impl Scheme {
    /// The MLA layout of this scheme, if its heads are `mla(...)`.
    pub fn mla(&self) -> Option<Mla> {
        match self.heads {
            Some(Heads::Mla(m)) => Some(m),
            _ => None,
        }
    }

    /// The two parts of an MLA scheme (see [`MlaParts`]); `None` for other
    /// head layouts.
    ///
    /// ```
    /// let s = kivi_spec::parse_scheme("M { key: quant(bits = 2, axis = channel, group = 32),
    ///     residual: 64, heads: mla(q = 16, latent = 512, rope_dim = 64) }").unwrap();
    /// let p = s.mla_parts().unwrap();
    /// assert_eq!((p.latent.head_dim, p.rope.head_dim), (Some(512), Some(64)));
    /// assert_eq!(p.rope.key, kivi_spec::Codec::Full);
    /// ```
    pub fn mla_parts(&self) -> Option<MlaParts> {
        let m = self.mla()?;
        let part = |codec: Codec, dim: u32| Scheme {
            key: codec,
            value: codec,
            heads: Some(Heads::Mqa(m.q)),
            head_dim: Some(dim),
            rotation: None,
            outliers: None,
            center: None,
            ..self.clone()
        };
        Some(MlaParts {
            mla: m,
            latent: part(self.key, m.latent),
            rope: part(m.rope, m.rope_dim),
        })
    }
}

/// Where the two parts of an MLA cache lie in one block: per block, the
/// latent part (`latent.words` words) then the RoPE part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaLayout {
    pub block_tokens: usize,
    pub latent: TensorLayout,
    pub rope: TensorLayout,
    /// Word offset of the RoPE part within a block.
    pub rope_offset: usize,
    pub block_words: usize,
}

impl MlaLayout {
    /// The layout of an MLA scheme with `block_tokens` tokens per block
    /// (see [`mla_block_tokens`] for the default and the rule).
    pub fn new(s: &Scheme, m: Mla, block_tokens: usize) -> MlaLayout {
        let latent = TensorLayout::new(s.key, s.dtype, m.latent as usize, block_tokens);
        let rope = TensorLayout::new(m.rope, s.dtype, m.rope_dim as usize, block_tokens);
        MlaLayout {
            block_tokens,
            latent,
            rope,
            rope_offset: latent.words,
            block_words: latent.words + rope.words,
        }
    }
}

/// The default block size of an MLA scheme: the smallest multiple of both
/// parts' channel groups that is at least 64 tokens.
pub fn mla_block_tokens(s: &Scheme, m: Mla) -> usize {
    let mut l = 1usize;
    for c in [s.key, m.rope] {
        if let Some(q) = c.quant() {
            if q.axis == Axis::Channel {
                l = l / gcd(l, q.group as usize) * q.group as usize;
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

/// Exact bytes of one quantized token of an MLA cache (latent plus RoPE
/// part: codes, scales, zero points; raw rows for a `full` part), as a
/// fraction `(bytes, tokens)` over one period of every channel group.
///
/// DeepSeek-V2-Lite, 2-bit channel-axis latent (g32, f16 scales) and an
/// exact f16 RoPE part: 128 + 64 + 128 = 320 bytes per token, against
/// 1152 for an f16 cache of the latent and the RoPE key.
///
/// ```
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 2, axis = channel, group = 32),
///     heads: mla(q = 16, latent = 512, rope_dim = 64) }").unwrap();
/// let (bytes, per) = kivi_spec::mla_bytes_per_token(&s).unwrap();
/// assert_eq!(bytes as f64 / per as f64, 320.0);
/// ```
pub fn mla_bytes_per_token(s: &Scheme) -> Option<(usize, usize)> {
    let m = s.mla()?;
    let mut period = 1usize;
    for c in [s.key, m.rope] {
        if let Some(q) = c.quant() {
            period = period / gcd(period, q.group as usize) * q.group as usize;
        }
    }
    let bytes = part_bytes(&s.key, s.dtype, m.latent as usize, period)
        + part_bytes(&m.rope, s.dtype, m.rope_dim as usize, period);
    Some((bytes, period))
}

/// Bytes `n` quantized tokens of one part occupy (`n` a whole number of
/// groups).
fn part_bytes(c: &Codec, dtype: Dtype, d: usize, n: usize) -> usize {
    match c {
        Codec::Full => n * d * dtype.bytes(),
        // `validate_vq` refuses vq with mla heads; counted as stored anyway.
        Codec::Vq(v) => n * v.subvectors(d).div_ceil(codes_per_word(v.code_bits())) * 4,
        Codec::Quant(q) => {
            let g = q.group as usize;
            let params = match q.axis {
                Axis::Channel => (n / g) * d,
                Axis::Token => n * (d / g),
            };
            let zeros = if q.has_zeros() { params } else { 0 };
            n * d.div_ceil(codes_per_word(q.bits)) * 4 + (params + zeros) * q.scale.bytes()
        }
    }
}

/// Exact bytes of `tokens` tokens of one sequence of an MLA cache, by part:
/// `(latent, rope)`, each counting quantized rows, parameters and the
/// sink and window rows in the activation dtype (not block rounding).
pub fn mla_bytes_for_tokens(s: &Scheme, tokens: usize) -> Option<(usize, usize)> {
    let p = s.mla_parts()?;
    let part = |ps: &Scheme, d: usize| {
        let r = regions(ps, Tensor::Key, tokens);
        part_bytes(&ps.key, ps.dtype, d, r.quantized) + (r.sinks + r.window) * d * ps.dtype.bytes()
    };
    Some((
        part(&p.latent, p.mla.latent as usize),
        part(&p.rope, p.mla.rope_dim as usize),
    ))
}

/// The rules an `mla(...)` layout adds (run by [`crate::validate`]).
pub(crate) fn validate_mla(s: &Scheme, m: &Mla) -> Result<(), Invalid> {
    if m.q == 0 || m.q > MAX_HEADS {
        return Err(Invalid::new(
            Field::QHeads,
            format!("{} query heads is out of range; expected 1 to {MAX_HEADS}", m.q),
        ));
    }
    if m.latent == 0 || m.latent > MAX_HEAD_DIM {
        return Err(Invalid::new(
            Field::MlaLatent,
            format!(
                "mla latent = {} is out of range; expected 1 to {MAX_HEAD_DIM}",
                m.latent
            ),
        ));
    }
    if m.rope_dim == 0 || m.rope_dim > MAX_HEAD_DIM {
        return Err(Invalid::new(
            Field::MlaRopeDim,
            format!(
                "mla rope_dim = {} is out of range; expected 1 to {MAX_HEAD_DIM}",
                m.rope_dim
            ),
        ));
    }
    if s.head_dim != Some(m.latent) {
        return Err(Invalid::new(
            Field::HeadDim,
            format!(
                "head_dim = {} disagrees with mla latent = {}; an mla scheme's head_dim is its latent width (leave head_dim out)",
                s.head_dim.map_or("none".into(), |d| d.to_string()),
                m.latent
            ),
        ));
    }
    if s.value != s.key {
        return Err(Invalid::new(
            Field::Codec(Tensor::Value),
            "an mla cache stores one latent per token, read by the scores and the output alike; its codec is `key` (leave `value` out)",
        ));
    }
    for (what, field) in [
        (s.rotation.is_some(), Field::Rotation),
        (s.outliers.is_some(), Field::Outliers),
        (s.center.is_some(), Field::Center),
    ] {
        if what {
            return Err(Invalid::new(
                field,
                "rotations, outliers and centering are not supported with mla heads yet; declare the latent's codec with `key` and the RoPE part's with `rope = ...`",
            ));
        }
    }
    // An MlaCache takes no calibration file, so a calibrated table would
    // have nothing to decode with: refused here rather than at run time.
    for (codec, field) in [(s.key, Field::Levels(Tensor::Key)), (m.rope, Field::MlaRope)] {
        if codec.quant().is_some_and(|q| matches!(q.levels, Levels::Nuq(_))) {
            return Err(Invalid::new(
                field,
                "levels = nuq is not supported with mla heads yet (an mla cache takes no calibration); use uniform or lloyd_max levels",
            ));
        }
    }
    if let Codec::Quant(q) = m.rope {
        if !ALLOWED_BITS.contains(&q.bits) {
            return Err(Invalid::new(
                Field::MlaRopeBits,
                format!(
                    "mla rope bits = {} is not supported; expected one of 1, 2, 3, 4, 8",
                    q.bits
                ),
            ));
        }
        if q.levels != Levels::Uniform && !LLOYD_MAX_BITS.contains(&q.bits) {
            return Err(Invalid::new(
                Field::MlaRopeBits,
                format!(
                    "mla rope bits = {} has no lloyd_max table; lloyd_max levels support 1, 2, 3 or 4 bits",
                    q.bits
                ),
            ));
        }
        if q.group == 0 || q.group > MAX_GROUP {
            return Err(Invalid::new(
                Field::MlaRopeGroup,
                format!("mla rope group = {} must be between 1 and {MAX_GROUP}", q.group),
            ));
        }
        if q.axis == Axis::Token && !m.rope_dim.is_multiple_of(q.group) {
            return Err(Invalid::new(
                Field::MlaRopeGroup,
                format!(
                    "mla rope group = {} does not divide rope_dim {}; token-axis groups split one token's channels",
                    q.group, m.rope_dim
                ),
            ));
        }
        if q.axis == Axis::Channel {
            if s.flush == Flush::Chunked && !s.residual.is_multiple_of(q.group) {
                return Err(Invalid::new(
                    Field::MlaRopeGroup,
                    format!(
                        "residual = {} is not a multiple of the mla rope group {}; chunked flush quantizes the whole window at once",
                        s.residual, q.group
                    ),
                ));
            }
            if mla_block_tokens(s, *m) > crate::layout::MAX_BLOCK_TOKENS {
                return Err(Invalid::new(
                    Field::MlaRopeGroup,
                    "the mla rope and latent channel groups need a block larger than 65536 tokens; use groups where one divides the other",
                ));
            }
        }
    }
    Ok(())
}
