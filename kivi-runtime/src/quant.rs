//! DESIGN.md §3 quantization math — the only copy on the host. The
//! reference oracle and the paged cache both call these functions; the
//! kernels (CPU fused path, generated CUDA) re-derive only what they must.

use kivi_spec::{Dtype, Quant, ScaleDtype};

/// Rounds `x` to the activation dtype (round to nearest, ties to even) and
/// returns it as f32.
#[inline]
pub fn round_to_dtype(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F32 => x,
    }
}

/// Rounds a scale or zero point to its storage dtype.
#[inline]
pub fn round_to_scale(x: f32, dtype: ScaleDtype) -> f32 {
    match dtype {
        ScaleDtype::F16 => half::f16::from_f32(x).to_f32(),
        ScaleDtype::F32 => x,
    }
}

/// The largest magnitude that every group of `q` can hold, whatever the
/// other values in it: the zero point `z = lo` must fit the scale dtype, so
/// must `s = (hi - lo) / (2^b - 1)` for any `lo`, `hi` within ±limit, and
/// `hi - lo` must not overflow f32. (f16 scales: 32752 at 1 bit, 65504 above.)
pub fn storable_limit(q: &Quant) -> f32 {
    let max = match q.scale {
        ScaleDtype::F16 => half::f16::MAX.to_f32(),
        ScaleDtype::F32 => f32::MAX,
    };
    max.min(max * (q.max_code() as f32 / 2.0)).min(f32::MAX / 2.0)
}

/// The stored parameters of one group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupParams {
    /// `s`: the scale, rounded to the scale dtype.
    pub scale: f32,
    /// `z`: the minimum, rounded to the scale dtype.
    pub zero: f32,
}

impl GroupParams {
    /// Both parameters are finite (a f16 scale overflows past 65504).
    pub fn is_finite(&self) -> bool {
        self.scale.is_finite() && self.zero.is_finite()
    }
}

/// `lo`/`hi` of a group, then `s = (hi - lo) / (2^b - 1)` and `z = lo`, each
/// rounded to the scale dtype. Returns the params and `(lo, hi)`.
pub fn group_params(values: impl IntoIterator<Item = f32>, q: &Quant) -> (GroupParams, f32, f32) {
    let mut lo = f32::INFINITY;
    let mut hi = f32::NEG_INFINITY;
    for x in values {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let scale = (hi - lo) / q.max_code() as f32;
    (
        GroupParams {
            scale: round_to_scale(scale, q.scale),
            zero: round_to_scale(lo, q.scale),
        },
        lo,
        hi,
    )
}

/// `c = clamp(round_ties_even((x - z) / s), 0, 2^b - 1)`; `c = 0` when `s == 0`.
#[inline]
pub fn encode(x: f32, p: GroupParams, max_code: u32) -> u32 {
    if p.scale == 0.0 {
        return 0;
    }
    let c = ((x - p.zero) / p.scale).round_ties_even();
    c.clamp(0.0, max_code as f32) as u32
}

/// `x^ = c * s + z`, in f32 (two roundings, no fused multiply-add).
#[inline]
pub fn decode(c: u32, p: GroupParams) -> f32 {
    c as f32 * p.scale + p.zero
}

/// Packs `codes` (each `< 2^bits`) LSB first into `out`, `32 / bits` codes
/// per word; codes never straddle words. `out` must hold
/// `codes.len().div_ceil(32 / bits)` words; every word is overwritten.
pub fn pack(codes: &[u32], bits: u32, out: &mut [u32]) {
    let per = (32 / bits) as usize;
    for (w, chunk) in out.iter_mut().zip(codes.chunks(per)) {
        let mut word = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            word |= c << (i as u32 * bits);
        }
        *w = word;
    }
}

/// Code `i` of a packed row.
#[inline]
pub fn unpack_one(words: &[u32], bits: u32, i: usize) -> u32 {
    let per = (32 / bits) as usize;
    let mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
    (words[i / per] >> ((i % per) as u32 * bits)) & mask
}

/// Unpacks `out.len()` codes from a packed row.
pub fn unpack(words: &[u32], bits: u32, out: &mut [u32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = unpack_one(words, bits, i);
    }
}

/// Raw storage of a value in a 16-bit or 32-bit dtype.
#[inline]
pub fn to_bits_16(x: f32, dtype: Dtype) -> u16 {
    match dtype {
        Dtype::Bf16 => half::bf16::from_f32(x).to_bits(),
        _ => half::f16::from_f32(x).to_bits(),
    }
}

#[inline]
pub fn from_bits_16(b: u16, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bf16 => half::bf16::from_bits(b).to_f32(),
        _ => half::f16::from_bits(b).to_f32(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_round_trip_every_width() {
        let mut seed = 0x9e3779b9u32;
        for bits in kivi_spec::ALLOWED_BITS {
            for n in [1usize, 7, 31, 32, 33, 100, 128, 257] {
                let codes: Vec<u32> = (0..n)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        seed & ((1 << bits) - 1)
                    })
                    .collect();
                let mut words = vec![0xdead_beefu32; n.div_ceil((32 / bits) as usize)];
                pack(&codes, bits, &mut words);
                let mut back = vec![0; n];
                unpack(&words, bits, &mut back);
                assert_eq!(codes, back, "bits {bits}, n {n}");
                // unused high bits of a 3-bit word stay zero
                if bits == 3 {
                    assert!(words.iter().all(|w| w >> 30 == 0));
                }
            }
        }
    }

    #[test]
    fn encode_decode_within_half_step() {
        let q = Quant {
            bits: 2,
            axis: kivi_spec::Axis::Token,
            group: 4,
            scale: ScaleDtype::F32,
        };
        let xs = [0.1f32, -0.7, 2.3, 1.1];
        let (p, lo, hi) = group_params(xs, &q);
        assert_eq!((lo, hi), (-0.7, 2.3));
        for x in xs {
            let d = decode(encode(x, p, 3), p);
            assert!((d - x).abs() <= p.scale / 2.0 + 1e-6);
        }
        let flat = group_params([1.5f32; 4], &q).0;
        assert_eq!(flat.scale, 0.0);
        assert_eq!(encode(1.5, flat, 3), 0);
        assert_eq!(decode(0, flat), 1.5);
    }
}
