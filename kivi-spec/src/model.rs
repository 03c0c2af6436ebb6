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

/// An asymmetric min/max integer quantizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quant {
    /// Code width: 1, 2, 3, 4 or 8.
    pub bits: u32,
    pub axis: Axis,
    /// Group size `G` along `axis`.
    pub group: u32,
    pub scale: ScaleDtype,
}

impl Quant {
    /// Largest code, `2^bits - 1`.
    pub fn max_code(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
}

/// How one tensor (K or V) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Kept in the activation dtype (the unquantized baseline).
    Full,
    Quant(Quant),
}

impl Codec {
    pub fn quant(&self) -> Option<&Quant> {
        match self {
            Codec::Full => None,
            Codec::Quant(q) => Some(q),
        }
    }
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
}

impl Heads {
    pub fn q_heads(&self) -> u32 {
        match *self {
            Heads::Mha(n) => n,
            Heads::Gqa { q, .. } => q,
            Heads::Mqa(q) => q,
        }
    }
    pub fn kv_heads(&self) -> u32 {
        match *self {
            Heads::Mha(n) => n,
            Heads::Gqa { kv, .. } => kv,
            Heads::Mqa(_) => 1,
        }
    }
    /// The same arrangement spelled the canonical way: `mha` when the counts
    /// agree, `mqa` when there is one KV head, `gqa` otherwise.
    pub fn normalized(&self) -> Heads {
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

    /// The bound shape, when both heads and head_dim are set.
    pub fn shape(&self) -> Option<Shape> {
        Some(Shape {
            q_heads: self.heads?.q_heads() as usize,
            kv_heads: self.heads?.kv_heads() as usize,
            head_dim: self.head_dim? as usize,
        })
    }

    /// The softmax scale in effect (`1/sqrt(D)` unless set).
    pub fn effective_softmax_scale(&self, head_dim: usize) -> f32 {
        self.softmax_scale.unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt())
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
