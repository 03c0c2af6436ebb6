//! Inner loops for `full` tensors (keys and values stored in the activation
//! dtype: the `f16` preset, and bf16/f32 schemes) on AVX-512 and AVX2:
//! `avx512-dense` / `avx2-dense` in [`super::CpuBackend::kernel_path`].
//!
//! Two things differ from the generic loops these tensors took before:
//! - **values** (AVX-512, head_dim a multiple of 64): four chunks of 16
//!   channels of four heads (16 accumulators) stay in registers while the
//!   rows stream past: half the passes over the tile, half the weight
//!   broadcasts and row conversions per FMA of the generic `axpy` (the same
//!   body, `simd::wide::axpy_chunks`, with four chunks instead of two);
//! - **prefetch**: the matching rows of the head's next block are requested
//!   16 rows at a time as this block's rows are consumed (4 KiB per step at
//!   head_dim 128 in f16), instead of the whole next block at the start of
//!   each block: on f16 rows the byte stream, not the arithmetic, is most
//!   of the time, and a 32 KiB burst of prefetches queues ahead of the
//!   tile's own loads.
//!
//! Scoring keys stays on the generic `simd::dot` (two rows by four heads
//! per pass): a four-row version with one transposing reduction of the 16
//! accumulators was measured slower (docs/performance.md).
//!
//! The arithmetic is the generic loops' (f32 FMAs over the same products,
//! summed in a different order), so the results agree with the oracle to
//! the usual 1e-5.

use super::simd::{Isa, Rows};

/// `out[i * ostride + h] = sum_k q[h * d + k] * row_i[k]` for `heads` query
/// heads and rows `0..n`; the caller has checked `isa != Scalar` and the
/// head dim against the ISA width. `ahead` (`n` rows, or empty) is
/// prefetched as the rows are scored.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot<R: Rows>(
    isa: Isa,
    r: &R,
    n: usize,
    d: usize,
    q: &[f32],
    heads: usize,
    out: &mut [f32],
    ostride: usize,
    ahead: &[u32],
) {
    if n == 0 || heads == 0 {
        return;
    }
    assert!(r.fits(n, d) && q.len() >= heads * d && out.len() >= (n - 1) * ostride + heads);
    for (i0, m) in chunks(n) {
        prefetch(ahead, n, i0, m);
        super::simd::dot(isa, &Shifted(r, i0), m, d, q, heads, &mut out[i0 * ostride..], ostride);
    }
}

/// `acc[h * d + k] += p[i * pstride + h] * row_i[k]` for `heads` query heads
/// and rows `0..n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn axpy<R: Rows>(
    isa: Isa,
    r: &R,
    n: usize,
    d: usize,
    p: &[f32],
    pstride: usize,
    heads: usize,
    acc: &mut [f32],
    ahead: &[u32],
) {
    if n == 0 || heads == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && d.is_multiple_of(64) {
        assert!(r.fits(n, d) && acc.len() >= heads * d && p.len() >= (n - 1) * pstride + heads);
        assert!(std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq"));
        for (i0, m) in chunks(n) {
            prefetch(ahead, n, i0, m);
            // SAFETY: AVX-512F/DQ checked (AVX2, FMA, F16C come with `Isa::Avx512`); `fits` and the asserts above bound
            // every read and write (rows `i0..i0 + m <= n`).
            unsafe {
                axpy512(
                    &Shifted(r, i0),
                    m,
                    d,
                    p.as_ptr().add(i0 * pstride),
                    pstride,
                    heads,
                    acc.as_mut_ptr(),
                )
            };
        }
        return;
    }
    // AVX2 has 16 registers: the generic loops' two chunks of four heads
    // already fill them.
    for (i0, m) in chunks(n) {
        prefetch(ahead, n, i0, m);
        super::simd::axpy(isa, &Shifted(r, i0), m, d, &p[i0 * pstride..], pstride, heads, acc);
    }
}

/// Rows per prefetch step: 16 rows of the next block are requested, then 16
/// rows of this one computed (4 KiB at head_dim 128 in f16).
const STEP: usize = 16;

/// `(first row, rows)` of the steps covering `0..n`.
fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(STEP).map(move |i0| (i0, STEP.min(n - i0)))
}

/// Prefetches rows `i0..i0 + m` of `ahead` (`n` rows, or empty) into L2.
fn prefetch(ahead: &[u32], n: usize, i0: usize, m: usize) {
    if ahead.is_empty() {
        return;
    }
    let wpr = ahead.len() / n;
    let part = &ahead[(i0 * wpr).min(ahead.len())..((i0 + m) * wpr).min(ahead.len())];
    #[cfg(target_arch = "x86_64")]
    for line in part.chunks(16) {
        // SAFETY: a prefetch is a hint; the address is inside `part`.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr() as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = part;
}

/// Rows `i0..` of `r`, as rows `0..`.
struct Shifted<'r, R>(&'r R, usize);

impl<R: Rows> Rows for Shifted<'_, R> {
    fn fits(&self, n: usize, d: usize) -> bool {
        self.0.fits(self.1 + n, d)
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        self.0.get(self.1 + i, k)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> std::arch::x86_64::__m256 {
        self.0.get8(self.1 + i, c)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> std::arch::x86_64::__m512 {
        self.0.get16(self.1 + i, c)
    }
}

/// `acc += p * row`: four chunks of 16 channels of four heads (16
/// accumulators) stay in registers while the rows stream past (the shared
/// body `simd::wide::axpy_chunks` with four chunks).
///
/// # Safety
/// AVX-512F/DQ, AVX2, FMA and F16C are available, `r.fits(n, d)`, `d` is a
/// multiple of 64, and `p`/`acc` cover `n` rows of `heads` weights and
/// `heads * d` values.
#[cfg(target_arch = "x86_64")]
unsafe fn axpy512<R: Rows>(r: &R, n: usize, d: usize, p: *const f32, pstride: usize, heads: usize, acc: *mut f32) {
    use super::simd::avx512::axpy4;
    let mut h0 = 0;
    while h0 < heads {
        if h0 + 4 <= heads {
            axpy4::<R, 4>(r, n, d, p.add(h0), pstride, acc.add(h0 * d));
            h0 += 4;
        } else {
            axpy4::<R, 1>(r, n, d, p.add(h0), pstride, acc.add(h0 * d));
            h0 += 1;
        }
    }
}
