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

/// Every preset, in the order `kivi schemes` lists them.
pub fn all() -> Vec<Scheme> {
    vec![kivi2(), kivi4(), kivi2_r0(), int8(), tok4(), swapped2(), f16()]
}

/// A preset by name (`kivi2`, `kivi4`, `kivi2_r0`, `int8`, `tok4`, `swapped2`, `f16`).
pub fn by_name(name: &str) -> Option<Scheme> {
    all().into_iter().find(|s| s.name == name)
}
