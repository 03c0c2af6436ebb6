//! Built-in schemes. A preset fixes the quantization, not the model: heads
//! and head_dim are bound where the scheme is used ([`Scheme::with_shape`]).

use crate::model::*;

fn q(bits: u32, axis: Axis, group: u32) -> Codec {
    Codec::Quant(Quant::uniform(bits, axis, group, ScaleDtype::F16))
}

fn base(name: &str, key: Codec, value: Codec, residual: u32) -> Scheme {
    Scheme {
        name: name.into(),
        key,
        value,
        residual,
        sinks: 0,
        flush: Flush::Eager,
        heads: None,
        head_dim: None,
        dtype: Dtype::F16,
        softmax_scale: None,
        sliding_window: None,
        nonfinite: NonFinite::Reject,
        rotation: None,
        outliers: None,
        center: None,
        rope: None,
        query: None,
        low_rank: None,
    }
}

/// KIVI-2: keys 2-bit per channel (g32), values 2-bit per token (g32), R = 128.
pub fn kivi2() -> Scheme {
    base("kivi2", q(2, Axis::Channel, 32), q(2, Axis::Token, 32), 128)
}

/// KIVI-4: as [`kivi2`] at 4 bits.
pub fn kivi4() -> Scheme {
    base("kivi4", q(4, Axis::Channel, 32), q(4, Axis::Token, 32), 128)
}

/// [`kivi2`] without the full-precision window.
pub fn kivi2_r0() -> Scheme {
    base("kivi2_r0", q(2, Axis::Channel, 32), q(2, Axis::Token, 32), 0)
}

/// 8-bit per-token keys and values (g32), no window.
pub fn int8() -> Scheme {
    base("int8", q(8, Axis::Token, 32), q(8, Axis::Token, 32), 0)
}

/// Both tensors 4-bit per token (g32), R = 128: the naive grouping KIVI argues against.
pub fn tok4() -> Scheme {
    base("tok4", q(4, Axis::Token, 32), q(4, Axis::Token, 32), 128)
}

/// KIVI-2 with the axes swapped (keys per token, values per channel), R = 128.
pub fn swapped2() -> Scheme {
    base("swapped2", q(2, Axis::Token, 32), q(2, Axis::Channel, 32), 128)
}

/// Unquantized f16 keys and values through the same cache and kernels.
pub fn f16() -> Scheme {
    base("f16", Codec::Full, Codec::Full, 0)
}

/// The 2-bit class of the codec pipeline, at fewer bytes than [`kivi2`]
/// (2.94 bits per element all-in against 3.0; 188 bytes per token per KV
/// head at head_dim 256 against 192): keys centered on the means of their
/// first 128 tokens, Hadamard-rotated (blocks of 256), 4 sparse outliers per
/// token, 3-bit Lloyd–Max codes with one l2 norm per token; values rotated,
/// 2-bit Lloyd–Max with one l2 norm per token; 4 sinks, R = 128.
///
/// Chosen by the per-layer attention-output study on a calibration text
/// (Apache-2.0, not the evaluation text): docs/accuracy.md. Its 256-wide
/// groups and Hadamard blocks bind to head_dim 256 (Gemma 3) and its
/// multiples only, so it is in [`pipeline`], not [`all`].
pub fn codec2() -> Scheme {
    crate::parse_scheme(
        "codec2 {
            key: quant(bits = 3, axis = token, group = 256, levels = lloyd_max, norm = l2),
            value: quant(bits = 2, axis = token, group = 256, levels = lloyd_max, norm = l2),
            rotation: hadamard(block = 256, apply = [key, value]),
            outliers: sparse(per_token = 4, apply = [key]),
            center: channel_mean(tokens = 128, apply = [key]),
            residual: 128,
            sinks: 4,
        }",
    )
    .expect("the codec2 preset parses")
}

/// The 1.5-bit class (1.91 bits per element all-in at head_dim 256): KIVI's
/// 2-bit per-channel keys in groups of 64; values Hadamard-rotated, 1-bit
/// Lloyd–Max (sign times an l2 norm per token) with 2 sparse outliers per
/// token; 4 sinks, R = 128. Chosen like [`codec2`].
pub fn codec15() -> Scheme {
    crate::parse_scheme(
        "codec15 {
            key: quant(bits = 2, axis = channel, group = 64),
            value: quant(bits = 1, axis = token, group = 256, levels = lloyd_max, norm = l2),
            rotation: hadamard(block = 256, apply = [value]),
            outliers: sparse(per_token = 2, apply = [value]),
            residual: 128,
            sinks: 4,
        }",
    )
    .expect("the codec15 preset parses")
}

/// The presets every backend runs (CUDA templates included), in the order
/// `kivi schemes` lists them.
pub fn all() -> Vec<Scheme> {
    vec![kivi2(), kivi4(), kivi2_r0(), int8(), tok4(), swapped2(), f16()]
}

/// The presets that use the codec pipeline (rotations, Lloyd–Max levels,
/// outliers, centering). Every backend runs them (the CUDA templates
/// generate the pipeline); they are kept out of [`all`] because they bind
/// only head_dims that 256 divides, and [`all`] binds every layout.
pub fn pipeline() -> Vec<Scheme> {
    vec![codec2(), codec15()]
}

/// Every preset: [`all`], then [`pipeline`].
pub fn listed() -> Vec<Scheme> {
    let mut v = all();
    v.extend(pipeline());
    v
}

/// A preset by name (`kivi2`, `kivi4`, `kivi2_r0`, `int8`, `tok4`, `swapped2`,
/// `f16`, `codec2`, `codec15`).
pub fn by_name(name: &str) -> Option<Scheme> {
    listed().into_iter().find(|s| s.name == name)
}
