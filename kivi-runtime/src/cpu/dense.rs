//! Inner loops for `full` tensors (keys and values stored in the activation
//! dtype: the `f16` preset, and bf16/f32 schemes), AVX-512 and AVX2.
//!
//! The generic loops (`simd::dot`) score one or two rows per pass and pay a
//! horizontal sum per (row, head): for rows that are a single conversion
//! away from f32, that reduction and the query reloads cost as much as the
//! FMAs. Here a pass scores `RT` rows (4 with AVX-512, 2 with AVX2) against
//! four query heads, so each query chunk loaded from L1 feeds `RT` FMAs,
//! and the `4 RT` accumulators are reduced together by one transposing
//! tree (shuffles and adds shared by all of them) into one vector that is
//! stored at once. Values keep every accumulator of four chunks of four
//! heads in registers while the rows stream past (AVX-512: half the row
//! passes and weight broadcasts of the generic `axpy`).
//!
//! The arithmetic is the generic loops' (f32 FMAs over the same products),
//! only summed in a different order, so the results agree with the oracle
//! to the usual 1e-5.

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
    #[cfg(target_arch = "x86_64")]
    match isa {
        Isa::Avx512 => {
            assert!(d.is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f"));
            for (i0, m) in chunks(n) {
                prefetch(ahead, n, i0, m);
                // SAFETY: features checked; `fits` and the asserts above
                // bound every read and write (rows `i0..i0 + m < n`).
                unsafe {
                    avx512::dot(
                        &Shifted(r, i0),
                        m,
                        d,
                        q.as_ptr(),
                        heads,
                        out.as_mut_ptr().add(i0 * ostride),
                        ostride,
                    )
                };
            }
            return;
        }
        Isa::Avx2 => {
            assert!(d.is_multiple_of(8) && std::arch::is_x86_feature_detected!("fma"));
            for (i0, m) in chunks(n) {
                prefetch(ahead, n, i0, m);
                // SAFETY: as above.
                unsafe {
                    avx2::dot(
                        &Shifted(r, i0),
                        m,
                        d,
                        q.as_ptr(),
                        heads,
                        out.as_mut_ptr().add(i0 * ostride),
                        ostride,
                    )
                };
            }
            return;
        }
        Isa::Scalar => {}
    }
    let _ = ahead;
    super::simd::dot(isa, r, n, d, q, heads, out, ostride)
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
        assert!(std::arch::is_x86_feature_detected!("avx512f"));
        for (i0, m) in chunks(n) {
            prefetch(ahead, n, i0, m);
            // SAFETY: as in `dot`.
            unsafe {
                avx512::axpy(
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
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr() as *const i8)
        };
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

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod avx512 {
    use super::Rows;
    use std::arch::x86_64::*;

    /// Rows per pass.
    const RT: usize = 4;

    /// `[X0+X2, X1+X3, Y0+Y2, Y1+Y3]` over 128-bit lanes.
    #[inline(always)]
    unsafe fn fold_a(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y))
    }

    /// `[X0+X1, X2+X3, Y0+Y1, Y2+Y3]` over 128-bit lanes.
    #[inline(always)]
    unsafe fn fold_b(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y))
    }

    /// The sums of `a[t][h]` as one vector, element `4 t + h`.
    #[inline(always)]
    unsafe fn reduce16(a: &[[__m512; 4]; RT]) -> __m512 {
        // Per head: lane t of u[h] holds four partial sums of (t, h).
        let mut u = [_mm512_setzero_ps(); 4];
        for h in 0..4 {
            u[h] = fold_b(fold_a(a[0][h], a[1][h]), fold_a(a[2][h], a[3][h]));
        }
        // In every lane, a 4x4 transpose-and-add over the heads.
        let t01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
        let t23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
        let (p01, p23) = (_mm512_castps_pd(t01), _mm512_castps_pd(t23));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(p01, p23)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(p01, p23)),
        )
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub unsafe fn dot<R: Rows>(
        r: &R,
        n: usize,
        d: usize,
        q: *const f32,
        heads: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let chunks = d / 16;
        let mut h0 = 0;
        while h0 + 4 <= heads {
            let qh = q.add(h0 * d);
            let mut i = 0;
            while i + RT <= n {
                let mut a = [[_mm512_setzero_ps(); 4]; RT];
                for c in 0..chunks {
                    let x: [__m512; RT] = std::array::from_fn(|t| r.get16(i + t, c));
                    for h in 0..4 {
                        let qv = _mm512_loadu_ps(qh.add(h * d + 16 * c));
                        for t in 0..RT {
                            a[t][h] = _mm512_fmadd_ps(qv, x[t], a[t][h]);
                        }
                    }
                }
                let s = reduce16(&a);
                if ostride == 4 {
                    _mm512_storeu_ps(out.add(i * 4), s);
                } else {
                    let mut buf = [0f32; 16];
                    _mm512_storeu_ps(buf.as_mut_ptr(), s);
                    for t in 0..RT {
                        std::ptr::copy_nonoverlapping(buf.as_ptr().add(4 * t), out.add((i + t) * ostride + h0), 4);
                    }
                }
                i += RT;
            }
            rows_one::<4>(r, i, n, chunks, d, qh, out.add(h0), ostride);
            h0 += 4;
        }
        while h0 < heads {
            rows_one::<1>(r, 0, n, chunks, d, q.add(h0 * d), out.add(h0), ostride);
            h0 += 1;
        }
    }

    /// Rows `i0..n` one at a time against `NH` heads (the leftovers).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows_one<const NH: usize>(
        r: &impl Rows,
        i0: usize,
        n: usize,
        chunks: usize,
        d: usize,
        q: *const f32,
        out: *mut f32,
        ostride: usize,
    ) {
        for i in i0..n {
            let mut a = [_mm512_setzero_ps(); NH];
            for c in 0..chunks {
                let x = r.get16(i, c);
                for h in 0..NH {
                    a[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(h * d + 16 * c)), x, a[h]);
                }
            }
            for h in 0..NH {
                *out.add(i * ostride + h) = _mm512_reduce_add_ps(a[h]);
            }
        }
    }

    /// `acc += p * row`: four chunks of 16 channels of four heads (16
    /// accumulators) stay in registers while the rows stream past.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn axpy<R: Rows>(
        r: &R,
        n: usize,
        d: usize,
        p: *const f32,
        pstride: usize,
        heads: usize,
        acc: *mut f32,
    ) {
        let mut h0 = 0;
        while h0 < heads {
            if h0 + 4 <= heads {
                axpy_heads::<R, 4>(r, n, d, p.add(h0), pstride, acc.add(h0 * d));
                h0 += 4;
            } else {
                axpy_heads::<R, 1>(r, n, d, p.add(h0), pstride, acc.add(h0 * d));
                h0 += 1;
            }
        }
    }

    #[inline(always)]
    unsafe fn axpy_heads<R: Rows, const NH: usize>(
        r: &R,
        n: usize,
        d: usize,
        p: *const f32,
        pstride: usize,
        acc: *mut f32,
    ) {
        const NC: usize = 4;
        for c0 in (0..d / 16).step_by(NC) {
            let mut a = [[_mm512_setzero_ps(); NC]; NH];
            for h in 0..NH {
                for k in 0..NC {
                    a[h][k] = _mm512_loadu_ps(acc.add(h * d + 16 * (c0 + k)));
                }
            }
            for i in 0..n {
                let x: [__m512; NC] = std::array::from_fn(|k| r.get16(i, c0 + k));
                for h in 0..NH {
                    let w = _mm512_set1_ps(*p.add(i * pstride + h));
                    for k in 0..NC {
                        a[h][k] = _mm512_fmadd_ps(w, x[k], a[h][k]);
                    }
                }
            }
            for h in 0..NH {
                for k in 0..NC {
                    _mm512_storeu_ps(acc.add(h * d + 16 * (c0 + k)), a[h][k]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod avx2 {
    use super::Rows;
    use std::arch::x86_64::*;

    /// Rows per pass: 8 accumulators, 2 rows and a query chunk fill 11 of
    /// the 16 registers.
    const RT: usize = 2;

    /// The sums of `a[t][h]` as one vector, element `4 t + h`.
    #[inline(always)]
    unsafe fn reduce8(a: &[[__m256; 4]; RT]) -> __m256 {
        // Per head: lane t of u[h] holds four partial sums of (t, h).
        let mut u = [_mm256_setzero_ps(); 4];
        for h in 0..4 {
            let (x, y) = (a[0][h], a[1][h]);
            u[h] = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(x, y),
                _mm256_permute2f128_ps::<0x31>(x, y),
            );
        }
        let t01 = _mm256_add_ps(_mm256_unpacklo_ps(u[0], u[1]), _mm256_unpackhi_ps(u[0], u[1]));
        let t23 = _mm256_add_ps(_mm256_unpacklo_ps(u[2], u[3]), _mm256_unpackhi_ps(u[2], u[3]));
        let (p01, p23) = (_mm256_castps_pd(t01), _mm256_castps_pd(t23));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(p01, p23)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(p01, p23)),
        )
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let sh = _mm_movehdup_ps(s);
        let s2 = _mm_add_ps(s, sh);
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehl_ps(sh, s2)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<R: Rows>(
        r: &R,
        n: usize,
        d: usize,
        q: *const f32,
        heads: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let chunks = d / 8;
        let mut h0 = 0;
        while h0 + 4 <= heads {
            let qh = q.add(h0 * d);
            let mut i = 0;
            while i + RT <= n {
                let mut a = [[_mm256_setzero_ps(); 4]; RT];
                for c in 0..chunks {
                    let x: [__m256; RT] = std::array::from_fn(|t| r.get8(i + t, c));
                    for h in 0..4 {
                        let qv = _mm256_loadu_ps(qh.add(h * d + 8 * c));
                        for t in 0..RT {
                            a[t][h] = _mm256_fmadd_ps(qv, x[t], a[t][h]);
                        }
                    }
                }
                let s = reduce8(&a);
                if ostride == 4 {
                    _mm256_storeu_ps(out.add(i * 4), s);
                } else {
                    _mm_storeu_ps(out.add(i * ostride + h0), _mm256_castps256_ps128(s));
                    _mm_storeu_ps(out.add((i + 1) * ostride + h0), _mm256_extractf128_ps::<1>(s));
                }
                i += RT;
            }
            rows_one::<4>(r, i, n, chunks, d, qh, out.add(h0), ostride);
            h0 += 4;
        }
        while h0 < heads {
            rows_one::<1>(r, 0, n, chunks, d, q.add(h0 * d), out.add(h0), ostride);
            h0 += 1;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows_one<const NH: usize>(
        r: &impl Rows,
        i0: usize,
        n: usize,
        chunks: usize,
        d: usize,
        q: *const f32,
        out: *mut f32,
        ostride: usize,
    ) {
        for i in i0..n {
            let mut a = [_mm256_setzero_ps(); NH];
            for c in 0..chunks {
                let x = r.get8(i, c);
                for h in 0..NH {
                    a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * d + 8 * c)), x, a[h]);
                }
            }
            for h in 0..NH {
                *out.add(i * ostride + h) = hsum(a[h]);
            }
        }
    }
}
