//! Product vector quantization (LoopVQ-style): `vq(dim = M, entries = E
//! [, codebook = NAME])` as a tensor's codec.
//!
//! Each token's row of `head_dim` channels is cut into `head_dim / M`
//! consecutive sub-vectors of `M` channels; sub-vector `j` is stored as the
//! index of its nearest centroid (squared L2, ties to the lowest index) in
//! codebook `j`, an `E x M` table learned from the model's own K/V
//! (`kivi calibrate`). Decoding a token concatenates its sub-vectors'
//! centroids. Nothing is stored per token but the codes: `log2(E)` bits
//! each, packed like every other code ([`crate::layout`]), so a token costs
//! `log2(E) / M` bits per element (8 channels at 256 entries: 1 bit).
//!
//! The codebooks (`head_dim / M` tables of `E x M` f32, one set per layer
//! and tensor, shared by the layer's KV heads) come from a calibration
//! file, like `levels = nuq` tables. A `codebook = NAME` shares one set
//! across every layer (and across keys and values where both name it), as
//! LoopVQ shares one codebook across the steps of a looped model; memory
//! reports count a set once per share.
//!
//! Decode never reconstructs a key: per step and query head it builds a
//! `head_dim / M x E` table of `q_j . c` (asymmetric distance computation)
//! and scores a token by summing `head_dim / M` lookups; values add each
//! token's weight to its centroids' bins and expand the bins once.

use crate::model::{Codec, Heads, Scheme, Tensor};
use crate::validate::{Field, Invalid, MAX_HEAD_DIM};
use std::fmt;

/// Longest codebook name (bytes), so that [`VqName`] stays `Copy`.
pub const MAX_VQ_NAME: usize = 31;
/// Most centroids per codebook (16-bit codes).
pub const MAX_VQ_ENTRIES: u32 = 1 << 16;

/// The name of a shared codebook: an identifier of at most
/// [`MAX_VQ_NAME`] bytes, kept inline so that codecs stay `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct VqName {
    len: u8,
    bytes: [u8; MAX_VQ_NAME],
}

impl VqName {
    /// The name, or `None` if it is empty, longer than [`MAX_VQ_NAME`]
    /// bytes or not an ASCII identifier (`[A-Za-z_][A-Za-z0-9_]*`).
    ///
    /// ```
    /// use kivi_spec::VqName;
    /// assert_eq!(VqName::new("loop").unwrap().as_str(), "loop");
    /// assert!(VqName::new("no spaces").is_none());
    /// ```
    pub fn new(s: &str) -> Option<VqName> {
        let b = s.as_bytes();
        let ident = !b.is_empty()
            && (b[0].is_ascii_alphabetic() || b[0] == b'_')
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if !ident || b.len() > MAX_VQ_NAME {
            return None;
        }
        let mut bytes = [0u8; MAX_VQ_NAME];
        bytes[..b.len()].copy_from_slice(b);
        Some(VqName {
            len: b.len() as u8,
            bytes,
        })
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        // Only ASCII identifiers are ever stored (`new` checks).
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("")
    }
}

impl fmt::Debug for VqName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl fmt::Display for VqName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A product vector quantizer (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Vq {
    /// Channels per sub-vector, `M` (divides head_dim).
    pub dim: u32,
    /// Centroids per codebook, `E` (a power of two from 2 to 65536).
    pub entries: u32,
    /// A codebook shared across layers by name; `None`: one per layer.
    pub codebook: Option<VqName>,
}

impl Vq {
    /// Bits of one sub-vector's code, `log2(entries)`.
    ///
    /// ```
    /// let v = kivi_spec::Vq { dim: 8, entries: 256, codebook: None };
    /// assert_eq!((v.code_bits(), v.subvectors(256)), (8, 32));
    /// ```
    pub fn code_bits(&self) -> u32 {
        self.entries.max(1).trailing_zeros()
    }

    /// Sub-vectors of a `head_dim`-channel row.
    pub fn subvectors(&self, head_dim: usize) -> usize {
        head_dim / self.dim.max(1) as usize
    }

    /// f32 values of one layer's codebooks for one tensor:
    /// `subvectors x entries x dim` = `head_dim x entries`.
    pub fn codebook_len(&self, head_dim: usize) -> usize {
        head_dim * self.entries as usize
    }
}

/// The `vq` rules: a sub-vector width that divides the head, a power-of-two
/// codebook size a code can index, and refusals of what the codec does not
/// combine with yet (each naming the field to change).
pub(crate) fn validate_vq(s: &Scheme) -> Result<(), Invalid> {
    let mut named: Option<(Tensor, Vq)> = None;
    for t in [Tensor::Key, Tensor::Value] {
        let Codec::Vq(v) = s.codec(t) else { continue };
        let n = t.name();
        if v.dim == 0 || v.dim > MAX_HEAD_DIM {
            return Err(Invalid::new(
                Field::VqDim(t),
                format!("{n} vq dim = {} must be between 1 and {MAX_HEAD_DIM}", v.dim),
            ));
        }
        if let Some(d) = s.head_dim {
            if d % v.dim != 0 {
                return Err(Invalid::new(
                    Field::VqDim(t),
                    format!(
                        "{n} vq dim = {} does not divide head_dim {d}; a token's row is cut into whole sub-vectors",
                        v.dim
                    ),
                ));
            }
        }
        if v.entries < 2 || v.entries > MAX_VQ_ENTRIES || !v.entries.is_power_of_two() {
            return Err(Invalid::new(
                Field::VqEntries(t),
                format!(
                    "{n} vq entries = {} must be a power of two from 2 to {MAX_VQ_ENTRIES} (codes of 1 to 16 bits)",
                    v.entries
                ),
            ));
        }
        // The codec pipeline's steps live in a scalar quantizer's domain;
        // a codebook learned on raw sub-vectors would decode other data.
        for (on, field, what) in [
            (s.rotation_of(t).is_some(), Field::RotationApply, "a rotation"),
            (s.outliers_of(t) > 0, Field::OutliersApply, "sparse outliers"),
            (s.center_of(t).is_some(), Field::CenterApply, "centering"),
        ] {
            if on {
                return Err(Invalid::new(
                    field,
                    format!("{what} on the vq {n} tensor is not supported yet; drop `{n}` from its apply list"),
                ));
            }
        }
        if t == Tensor::Key && s.rope.is_some() {
            return Err(Invalid::new(
                Field::Rope,
                "vq keys with rope: pre(...) are not supported yet (codebooks are fitted on keys after RoPE); drop `rope` or quantize the keys with quant(...)",
            ));
        }
        if matches!(s.heads, Some(Heads::Mla(_))) {
            return Err(Invalid::new(
                Field::Codec(t),
                "vq does not apply to mla heads yet; the latent cache takes full or quant(...)",
            ));
        }
        if let Some(name) = v.codebook {
            if let Some((t0, v0)) = named.filter(|(_, v0)| v0.codebook == Some(name)) {
                if (v0.dim, v0.entries) != (v.dim, v.entries) {
                    return Err(Invalid::new(
                        Field::VqCodebook(t),
                        format!(
                            "codebook `{name}` is shared with the {} tensor as dim = {}, entries = {}; a shared codebook has one shape",
                            t0.name(),
                            v0.dim,
                            v0.entries
                        ),
                    ));
                }
            }
            named = Some((t, *v));
        }
    }
    Ok(())
}
