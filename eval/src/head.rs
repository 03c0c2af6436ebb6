//! The output head (logits = x E^T over the 262 144-row tied embedding) for
//! a few rows at a time. It is most of a decode step's work, and candle's
//! GEMM repacks the whole 671 MB f32 matrix for every call with more than
//! one row; this kernel streams each embedding row once and dots it with up
//! to eight input rows while it sits in L1.
//!
//! The matrix stays in its stored Q8_0 form (int8 codes, one f16 scale per
//! 32): 4x fewer bytes to stream than f32. Each weight is rebuilt as
//! `code * scale` in f32, which is exact (11 + 8 significant bits), so the
//! logits are those of the dequantized matrix; activations are never
//! rounded to 8 bits.

use rayon::prelude::*;

/// Vocabulary rows per parallel task.
const CHUNK: usize = 2048;
/// Values per Q8_0 block.
pub const QK: usize = 32;

/// A `[vocab, hidden]` matrix as Q8_0: `codes[v * hidden + i]` and one
/// scale per 32 consecutive values of a row.
pub struct Q8Matrix {
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
    pub hidden: usize,
}

impl Q8Matrix {
    /// From candle's Q8_0 block bytes (`f16 scale, 32 x i8` per block).
    pub fn from_blocks(bytes: &[u8], vocab: usize, hidden: usize) -> Option<Q8Matrix> {
        if !hidden.is_multiple_of(QK) || bytes.len() != vocab * hidden / QK * (2 + QK) {
            return None;
        }
        let mut codes = Vec::with_capacity(vocab * hidden);
        let mut scales = Vec::with_capacity(vocab * hidden / QK);
        for b in bytes.chunks_exact(2 + QK) {
            scales.push(half_to_f32(u16::from_le_bytes([b[0], b[1]])));
            codes.extend(b[2..].iter().map(|&c| c as i8));
        }
        Some(Q8Matrix { codes, scales, hidden })
    }

    /// Rows of the matrix.
    pub fn vocab(&self) -> usize {
        self.codes.len() / self.hidden
    }
}

/// IEEE half to f32 (exact), without a dependency for one function.
fn half_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f32;
    sign * match exp {
        0 => man * 2f32.powi(-24),
        31 => {
            if man == 0.0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        }
        e => (1.0 + man / 1024.0) * 2f32.powi(e - 15),
    }
}

/// `x` is `[b, hidden]`; returns `[b, vocab]` = `x W^T`.
pub fn logits(w: &Q8Matrix, x: &[f32], b: usize) -> Vec<f32> {
    let hidden = w.hidden;
    assert!(
        hidden > 0 && hidden.is_multiple_of(QK) && x.len() == b * hidden,
        "head shapes"
    );
    let vocab = w.vocab();
    let blocks = hidden / QK;
    // [vocab, b] first: each task owns a contiguous slice.
    let mut t = vec![0f32; vocab * b];
    t.par_chunks_mut(CHUNK * b)
        .zip(
            w.codes
                .par_chunks(CHUNK * hidden)
                .zip(w.scales.par_chunks(CHUNK * blocks)),
        )
        .for_each(|(out, (codes, scales))| rows_dispatch(codes, scales, hidden, x, b, out));
    let mut out = vec![0f32; b * vocab];
    for v in 0..vocab {
        for r in 0..b {
            out[r * vocab + v] = t[v * b + r];
        }
    }
    out
}

fn rows_dispatch(codes: &[i8], scales: &[f32], hidden: usize, x: &[f32], b: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { rows_avx2(codes, scales, hidden, x, b, out) };
            return;
        }
    }
    rows_generic(codes, scales, hidden, x, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(codes: &[i8], scales: &[f32], hidden: usize, x: &[f32], b: usize, out: &mut [f32]) {
    rows_generic(codes, scales, hidden, x, b, out)
}

/// Inlined into the AVX2 version, where each row's eight independent lanes
/// become one 256-bit register (float sums are not reassociated otherwise).
#[inline(always)]
fn rows_generic(codes: &[i8], scales: &[f32], hidden: usize, x: &[f32], b: usize, out: &mut [f32]) {
    let mut r0 = 0;
    while r0 < b {
        let n = match b - r0 {
            n if n >= 8 => 8,
            4..=7 => 4,
            2 | 3 => 2,
            _ => 1,
        };
        let xs = &x[r0 * hidden..(r0 + n) * hidden];
        match n {
            8 => block::<8>(codes, scales, hidden, xs, b, r0, out),
            4 => block::<4>(codes, scales, hidden, xs, b, r0, out),
            2 => block::<2>(codes, scales, hidden, xs, b, r0, out),
            _ => block::<1>(codes, scales, hidden, xs, b, r0, out),
        }
        r0 += n;
    }
}

/// Dots every matrix row with input rows `r0..r0 + R`.
#[inline(always)]
fn block<const R: usize>(
    codes: &[i8],
    scales: &[f32],
    hidden: usize,
    xs: &[f32],
    b: usize,
    r0: usize,
    out: &mut [f32],
) {
    let blocks = hidden / QK;
    for ((cr, sr), o) in codes
        .chunks_exact(hidden)
        .zip(scales.chunks_exact(blocks))
        .zip(out.chunks_exact_mut(b))
    {
        let mut acc = [[0f32; 8]; R];
        for (k, (cb, &d)) in cr.chunks_exact(QK).zip(sr).enumerate() {
            let mut w = [0f32; QK];
            for (wi, &c) in w.iter_mut().zip(cb) {
                *wi = c as f32 * d;
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = &xs[r * hidden + k * QK..r * hidden + (k + 1) * QK];
                for (wc, xc) in w.chunks_exact(8).zip(xv.chunks_exact(8)) {
                    for j in 0..8 {
                        a[j] += wc[j] * xc[j];
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            o[r0 + r] = a.iter().sum::<f32>();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversion_is_exact() {
        for (h, f) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x0001, 5.960_464_5e-8),
            (0x7bff, 65504.0),
            (0x3555, 0.333_251_95),
        ] {
            assert_eq!(half_to_f32(h), f, "{h:#x}");
        }
    }

    #[test]
    fn matches_plain_dot_products() {
        for (vocab, hidden, b) in [
            (1, 32, 1),
            (5000, 64, 3),
            (4099, 640, 8),
            (33, 32, 1),
            (70, 96, 15),
            (9, 640, 13),
        ] {
            let mut bytes = Vec::new();
            for blk in 0..vocab * hidden / QK {
                let scale = 0x2000u16 + (blk as u16 % 997); // small positive halves
                bytes.extend(scale.to_le_bytes());
                bytes.extend((0..QK).map(|i| (((blk * 31 + i * 7) % 255) as i32 - 127) as i8 as u8));
            }
            let w = Q8Matrix::from_blocks(&bytes, vocab, hidden).unwrap();
            let x: Vec<f32> = (0..b * hidden)
                .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.2)
                .collect();
            let got = logits(&w, &x, b);
            for r in 0..b {
                for v in 0..vocab {
                    let want: f64 = (0..hidden)
                        .map(|i| {
                            w.codes[v * hidden + i] as f64
                                * w.scales[(v * hidden + i) / QK] as f64
                                * x[r * hidden + i] as f64
                        })
                        .sum();
                    let g = got[r * vocab + v] as f64;
                    assert!(
                        (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{vocab}x{hidden} b{b}: {g} vs {want}"
                    );
                }
            }
        }
        assert!(Q8Matrix::from_blocks(&[0; 33], 1, 32).is_none());
    }
}
