//! The one validator. The macro, the run-time parser and hand-built schemes
//! all go through [`validate`]; the parser maps each [`Field`] back to the
//! token that set it, so a compile error points at the offending value.

use crate::model::*;
use std::fmt;

/// The part of a scheme an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    Name,
    Codec(Tensor),
    Bits(Tensor),
    Axis(Tensor),
    Group(Tensor),
    Scale(Tensor),
    /// `levels = ...` of a tensor's quant.
    Levels(Tensor),
    /// `norm = ...` of a tensor's quant.
    Norm(Tensor),
    /// `dim = ...`, `entries = ...` and `codebook = ...` of a tensor's `vq`.
    VqDim(Tensor),
    VqEntries(Tensor),
    VqCodebook(Tensor),
    /// The `rotation` field (its kind), its `block`, and its `apply` list.
    Rotation,
    RotationBlock,
    RotationApply,
    /// The `outliers` field, its `per_token` count, and its `apply` list.
    Outliers,
    OutliersPerToken,
    OutliersApply,
    /// The `center` field, its `tokens` count, and its `apply` list.
    Center,
    CenterTokens,
    CenterApply,
    /// The `rope` field (its kind), its `theta`, `style` and `scaling`.
    Rope,
    RopeTheta,
    RopeStyle,
    RopeScaling,
    /// The `query` field (its kind) and its `group`.
    Query,
    QueryGroup,
    /// The `low_rank` field (its kind), its `rank` and its `apply` list.
    LowRank,
    LowRankRank,
    LowRankApply,
    Residual,
    Sinks,
    Flush,
    Heads,
    QHeads,
    KvHeads,
    /// `latent = ...`, `rope_dim = ...` and `rope = ...` of `mla(...)`
    /// heads, and the `bits` and `group` of that RoPE codec.
    MlaLatent,
    MlaRopeDim,
    MlaRope,
    MlaRopeBits,
    MlaRopeGroup,
    HeadDim,
    Dtype,
    SoftmaxScale,
    SlidingWindow,
    NonFinite,
}

/// A scheme that breaks a rule: which field, and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    pub field: Field,
    pub message: String,
}

impl Invalid {
    pub fn new(field: Field, message: impl Into<String>) -> Self {
        Invalid {
            field,
            message: message.into(),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Invalid {}

/// Code widths the packer and the kernels implement.
pub const ALLOWED_BITS: [u32; 5] = [1, 2, 3, 4, 8];
/// Widths with a Lloyd–Max table ([`crate::lloyd_max_levels`]).
pub const LLOYD_MAX_BITS: [u32; 4] = [1, 2, 3, 4];
/// Upper bounds beyond which a value is a typo, not a scheme.
pub const MAX_GROUP: u32 = 4096;
pub const MAX_WINDOW: u32 = 1 << 20;
pub const MAX_SINKS: u32 = 1 << 16;
pub const MAX_HEADS: u32 = 1024;
pub const MAX_HEAD_DIM: u32 = 1024;

/// Checks every rule of the scheme language; the first broken rule wins.
///
/// ```
/// let mut s = kivi_spec::presets::kivi2();
/// s.residual = 100; // chunked flush needs R to be a multiple of the channel group
/// s.flush = kivi_spec::Flush::Chunked;
/// let e = kivi_spec::validate(&s).unwrap_err();
/// assert_eq!(e.field, kivi_spec::Field::Residual);
/// ```
pub fn validate(s: &Scheme) -> Result<(), Invalid> {
    // First, so that a codec that does not fit the coordinates is named as such.
    crate::low_rank::validate_low_rank(s)?;
    for t in [Tensor::Key, Tensor::Value] {
        if let Codec::Quant(q) = s.codec(t) {
            if !ALLOWED_BITS.contains(&q.bits) {
                return Err(Invalid::new(
                    Field::Bits(t),
                    format!(
                        "{} bits = {} is not supported; expected one of 1, 2, 3, 4, 8",
                        t.name(),
                        q.bits
                    ),
                ));
            }
            if q.group == 0 || q.group > MAX_GROUP {
                return Err(Invalid::new(
                    Field::Group(t),
                    format!("{} group = {} must be between 1 and {MAX_GROUP}", t.name(), q.group),
                ));
            }
            if q.levels != Levels::Uniform && !LLOYD_MAX_BITS.contains(&q.bits) {
                return Err(Invalid::new(
                    Field::Bits(t),
                    format!(
                        "{} bits = {} has no {} table; {} levels support 1, 2, 3 or 4 bits",
                        t.name(),
                        q.bits,
                        q.levels.name(),
                        q.levels.name()
                    ),
                ));
            }
            validate_minmax(s, t, q)?;
            // A low-rank tensor's token groups split its R coordinates.
            let width = s.low_rank.map(|l| l.rank).or(s.head_dim);
            if let (Axis::Token, Some(d)) = (q.axis, width) {
                if d % q.group != 0 {
                    return Err(Invalid::new(
                        Field::Group(t),
                        format!(
                            "{} group = {} does not divide head_dim {d}; token-axis groups split one token's channels",
                            t.name(),
                            q.group
                        ),
                    ));
                }
            }
        }
    }
    // A block holds a whole number of every channel-axis group, so its size
    // is a multiple of their lcm: keep that within what a block can be.
    if let (Some(k), Some(v)) = (s.key.quant(), s.value.quant()) {
        if k.axis == Axis::Channel && v.axis == Axis::Channel {
            let lcm = crate::layout::default_block_tokens(s);
            if lcm > crate::layout::MAX_BLOCK_TOKENS {
                return Err(Invalid::new(
                    Field::Group(Tensor::Value),
                    format!(
                        "value group = {} with key group = {}: a block must hold a multiple of both ({lcm} tokens), more than {}; use groups where one divides the other",
                        v.group,
                        k.group,
                        crate::layout::MAX_BLOCK_TOKENS
                    ),
                ));
            }
        }
    }
    if s.residual > MAX_WINDOW {
        return Err(Invalid::new(
            Field::Residual,
            format!("residual = {} is absurd; at most {MAX_WINDOW}", s.residual),
        ));
    }
    if s.sinks > MAX_SINKS {
        return Err(Invalid::new(
            Field::Sinks,
            format!("sinks = {} is absurd; at most {MAX_SINKS}", s.sinks),
        ));
    }
    crate::vq::validate_vq(s)?;
    let any_quant = s.key.is_coded() || s.value.is_coded() || s.mla().is_some_and(|m| m.rope.quant().is_some());
    if !any_quant && (s.residual > 0 || s.sinks > 0) {
        let field = if s.residual > 0 { Field::Residual } else { Field::Sinks };
        return Err(Invalid::new(
            field,
            "full-precision windows have no effect when neither key nor value is quantized; set residual and sinks to 0",
        ));
    }
    validate_pipeline(s)?;
    validate_query(s)?;
    if s.flush == Flush::Chunked {
        if s.residual == 0 {
            return Err(Invalid::new(
                Field::Flush,
                "flush = chunked needs a residual window; set residual to a multiple of the channel groups",
            ));
        }
        for t in [Tensor::Key, Tensor::Value] {
            if let Some(q) = s.codec(t).quant() {
                if q.axis == Axis::Channel && !s.residual.is_multiple_of(q.group) {
                    return Err(Invalid::new(
                        Field::Residual,
                        format!(
                            "residual = {} is not a multiple of the {} group {}; chunked flush quantizes the whole window at once",
                            s.residual,
                            t.name(),
                            q.group
                        ),
                    ));
                }
            }
        }
    }
    if let Some(h) = s.heads {
        let (q, kv) = (h.q_heads(), h.kv_heads());
        if q == 0 || q > MAX_HEADS {
            return Err(Invalid::new(
                Field::QHeads,
                format!("{q} query heads is out of range; expected 1 to {MAX_HEADS}"),
            ));
        }
        if kv == 0 || kv > MAX_HEADS {
            return Err(Invalid::new(
                Field::KvHeads,
                format!("{kv} kv heads is out of range; expected 1 to {MAX_HEADS}"),
            ));
        }
        if q % kv != 0 {
            return Err(Invalid::new(
                Field::KvHeads,
                format!("{q} query heads is not a multiple of {kv} kv heads"),
            ));
        }
    }
    if let Some(m) = s.mla() {
        crate::mla::validate_mla(s, &m)?;
    }
    if let Some(d) = s.head_dim {
        if d == 0 || d > MAX_HEAD_DIM {
            return Err(Invalid::new(
                Field::HeadDim,
                format!("head_dim = {d} is out of range; expected 1 to {MAX_HEAD_DIM}"),
            ));
        }
    }
    if let Some(sc) = s.softmax_scale {
        if !(sc.is_finite() && sc > 0.0) {
            return Err(Invalid::new(
                Field::SoftmaxScale,
                format!("softmax_scale = {sc} must be a finite positive number"),
            ));
        }
    }
    if let Some(w) = s.sliding_window {
        if w == 0 || w > MAX_WINDOW {
            return Err(Invalid::new(
                Field::SlidingWindow,
                format!("sliding_window = {w} is out of range; expected 1 to {MAX_WINDOW}"),
            ));
        }
    }
    if s.name.is_empty() {
        return Err(Invalid::new(Field::Name, "a scheme needs a name"));
    }
    Ok(())
}

/// The transform and extras: each applies only to quantized tensors, and
/// fits the shape once one is bound.
fn validate_pipeline(s: &Scheme) -> Result<(), Invalid> {
    let needs_quant = |apply: &Apply, field: Field, what: &str| -> Result<(), Invalid> {
        for t in [Tensor::Key, Tensor::Value] {
            if apply.has(t) && s.codec(t).quant().is_none() {
                return Err(Invalid::new(
                    field,
                    format!(
                        "{what} applies to the {} tensor, which is `full`; it only changes how quantized tokens are stored",
                        t.name()
                    ),
                ));
            }
        }
        Ok(())
    };
    if let Some(r) = &s.rotation {
        needs_quant(&r.apply, Field::RotationApply, "rotation")?;
        if r.block < 2 || !r.block.is_power_of_two() || r.block > MAX_HEAD_DIM {
            return Err(Invalid::new(
                Field::RotationBlock,
                format!(
                    "hadamard block = {} must be a power of two from 2 to {MAX_HEAD_DIM}",
                    r.block
                ),
            ));
        }
        if let Some(d) = s.head_dim {
            if d % r.block != 0 {
                return Err(Invalid::new(
                    Field::RotationBlock,
                    format!(
                        "hadamard block = {} does not divide head_dim {d}; each block rotates whole channels of one token",
                        r.block
                    ),
                ));
            }
        }
    }
    if let Some(o) = &s.outliers {
        needs_quant(&o.apply, Field::OutliersApply, "outliers")?;
        let limit = s.head_dim.unwrap_or(MAX_HEAD_DIM);
        if o.per_token == 0 || o.per_token >= limit {
            return Err(Invalid::new(
                Field::OutliersPerToken,
                format!(
                    "outliers per_token = {} must be between 1 and {}, fewer than the channels of a token",
                    o.per_token,
                    limit - 1
                ),
            ));
        }
    }
    if let Some(r) = &s.rope {
        validate_rope(s, r)?;
    }
    if let Some(c) = &s.center {
        needs_quant(&c.apply, Field::CenterApply, "center")?;
        if c.tokens == 0 || c.tokens > s.sinks + s.residual {
            return Err(Invalid::new(
                Field::CenterTokens,
                format!(
                    "center tokens = {} must be between 1 and sinks + residual ({}), so the means are known before the first token is quantized",
                    c.tokens,
                    s.sinks + s.residual
                ),
            ));
        }
    }
    Ok(())
}

/// Integer-domain decode: which keys it applies to, and a query group that
/// covers whole code words and divides the head.
fn validate_query(s: &Scheme) -> Result<(), Invalid> {
    let Some(qq) = &s.query else {
        return Ok(());
    };
    let fits = match s.key.quant() {
        Some(k) => k.axis == Axis::Channel && k.levels == Levels::Uniform && matches!(k.bits, 2 | 4),
        None => false,
    };
    if !fits {
        return Err(Invalid::new(
            Field::Query,
            "query: int8(...) applies to channel-axis uniform keys of 2 or 4 bits (kivi2, kivi4); these keys are not, so the scores cannot be accumulated on their codes",
        ));
    }
    if s.has_pipeline(Tensor::Key) {
        return Err(Invalid::new(
            Field::Query,
            "query: int8(...) does not combine with a key rotation, outliers or centering yet; drop `key` from their apply lists or the query field",
        ));
    }
    // The integer scores are taken on the stored codes as they are: keys
    // stored before RoPE would need the turn inside the integer dot, and an
    // MLA latent has its own decode path that has no integer loops.
    if s.rope.is_some() {
        return Err(Invalid::new(
            Field::Query,
            "query: int8(...) does not combine with rope: pre(...) yet (the integer scores are taken on unrotated key codes); drop one of them",
        ));
    }
    if matches!(s.heads, Some(Heads::Mla(_))) {
        return Err(Invalid::new(
            Field::Query,
            "query: int8(...) does not apply to mla heads yet; the latent decode has no integer loops",
        ));
    }
    // Whole 32-bit code words per group (16 2-bit or 8 4-bit codes): a
    // kernel closes a group at a word boundary.
    if qq.group == 0 || !qq.group.is_multiple_of(16) || qq.group > MAX_HEAD_DIM {
        return Err(Invalid::new(
            Field::QueryGroup,
            format!(
                "query int8 group = {} must be a multiple of 16 up to {MAX_HEAD_DIM}, so that a group covers whole code words; 32 is the usual choice",
                qq.group
            ),
        ));
    }
    if let Some(d) = s.head_dim {
        if d % qq.group != 0 {
            return Err(Invalid::new(
                Field::QueryGroup,
                format!(
                    "query int8 group = {} does not divide head_dim {d}; a group is consecutive channels of one head",
                    qq.group
                ),
            ));
        }
    }
    Ok(())
}

/// `norm = minmax` (a `nuq` table over `[0, 1]` with a scale and a zero
/// point per group): only where every kernel that can read it adds the
/// zero point. The fixed Lloyd–Max table is a unit Gaussian's, not one over
/// `[0, 1]`; the fused codec loops (`cpu/codec.rs`, token-axis writes)
/// store and fold a norm with no zero, while pre-RoPE channel-axis keys
/// are decoded by `cpu/rope.rs` (vector path and row reader alike), which
/// adds it (and, off the vector path, key outliers' corrections after
/// it), and by the CUDA templates, which add it wherever they read table
/// codes (`MINMAX` tensors, docs/cuda.md).
///
/// `norm = minmax_pinned` (the same with the table's ends fixed at 0 and 1)
/// follows the same rules, and needs at least 2 bits: at 1 bit both
/// entries are pinned, which is uniform levels with nothing to calibrate.
fn validate_minmax(s: &Scheme, t: Tensor, q: &crate::Quant) -> Result<(), Invalid> {
    let Some(norm) = q.levels.norm().filter(|n| n.has_zero()) else {
        return Ok(());
    };
    let (n, name) = (t.name(), norm.name());
    let why = if !matches!(q.levels, Levels::Nuq(_)) {
        format!("norm = {name} needs levels = nuq (a learned table over [0, 1]; the Lloyd-Max table is a Gaussian's)")
    } else if t != Tensor::Key || q.axis != Axis::Channel || s.rope.is_none() {
        format!("norm = {name} is only supported on channel-axis keys with rope: pre(...) yet (the other kernels store no zero point for table codes)")
    } else if s.rotation_of(t).is_some() || s.center_of(t).is_some() {
        // (Key outliers are fine: both decoders of these keys, the oracle
        // and `cpu/rope.rs`, add the corrections to the decoded row.)
        format!("norm = {name} does not combine with a rotation or centering yet")
    } else if s.low_rank.is_some() || matches!(s.heads, Some(Heads::Mla(_))) {
        format!("norm = {name} does not apply to low-rank or mla caches yet")
    } else if norm == crate::Norm::MinMaxPinned && q.bits < 2 {
        format!(
            "norm = {name} at 1 bit pins both table entries (0 and 1): that is levels = uniform; use 2 bits or more"
        )
    } else {
        return Ok(());
    };
    Err(Invalid::new(Field::Norm(t), format!("{n}: {why}")))
}

/// `rope: pre(...)`: a usable base and factor, pairs that fit the head, and
/// no key transform that the kernels would have to undo per token.
fn validate_rope(s: &Scheme, r: &Rope) -> Result<(), Invalid> {
    if !(r.theta.is_finite() && r.theta > 1.0 && r.theta <= 1e12) {
        return Err(Invalid::new(
            Field::RopeTheta,
            format!(
                "rope theta = {} must be a number above 1 and at most 1e12 (e.g. 10000 or 1000000)",
                r.theta
            ),
        ));
    }
    if !(r.scaling.is_finite() && r.scaling > 0.0 && r.scaling <= 1e6) {
        return Err(Invalid::new(
            Field::RopeScaling,
            format!(
                "rope scaling factor = {} must be above 0 and at most 1000000",
                r.scaling
            ),
        ));
    }
    if let Some(d) = s.head_dim {
        if d % 2 != 0 {
            return Err(Invalid::new(
                Field::HeadDim,
                format!("head_dim {d} is odd; rope: pre(...) rotates pairs of channels"),
            ));
        }
    }
    // A key rotation or centering lives in the codes' domain, which RoPE (a
    // per-token rotation of the original domain) does not commute with; the
    // kernels would have to leave the codes' domain per token. Key outliers
    // alone are fine: without those transforms the codes' domain is the
    // pre-RoPE one, and each correction is added to the pre-RoPE row before
    // it is turned (KVQuant's dense-and-sparse keys; the oracle, the CPU
    // backend and the CUDA decode template do).
    for (on, field, what) in [
        (
            s.rotation_of(Tensor::Key).is_some(),
            Field::RotationApply,
            "a key rotation",
        ),
        (s.center_of(Tensor::Key).is_some(), Field::CenterApply, "key centering"),
    ] {
        if on {
            return Err(Invalid::new(
                field,
                format!("{what} with rope: pre(...) is not supported yet; apply it to values only or drop `rope`"),
            ));
        }
    }
    // Calibrated key codebooks (`levels = nuq`) are fine: a pre-RoPE
    // scheme's are fitted on pre-RoPE keys, and the calibration records the
    // stage and refuses a post-RoPE table (kivi_runtime::calib).
    Ok(())
}
