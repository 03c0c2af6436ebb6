//! The vector width the CPU loops are written over, once: [`Lanes`] is the
//! f32 arithmetic every body needs, [`Width`] adds what only the vector
//! widths do (code unpacking, the transposes that turn rows into lanes,
//! lookups), and zero-sized types implement them: [`Avx512`] (16 lanes),
//! [`Avx2`] (8 lanes, AVX2 + FMA + F16C) and, for [`Lanes`] only,
//! [`Scalar`] (one lane, the portable path). The fused path (`fused.rs`),
//! the generic tile loops (`simd.rs`), the cache writes (`write.rs`) and the
//! integer scores (`int8.rs`) are bodies over these types; a module with
//! needs of its own extends the traits rather than declaring another width.
//!
//! How it compiles: every method is `#[inline(always)]` and has no
//! `#[target_feature]` of its own; the body is generic and `#[inline(always)]`
//! too, and each ISA has one `#[target_feature]` entry point in `fused.rs`
//! that instantiates it. The whole tile is therefore monomorphised and
//! inlined into a function compiled for that ISA: no calls, no dispatch in
//! the loops (`objdump -d` of the release build shows no `call` inside the
//! two entry points' loops).
//!
//! What differs between the widths is data movement, so that is what the
//! trait hides:
//! - **codes to floats**: AVX-512 broadcasts a word and masks one code per
//!   lane; AVX2 (8 lanes) zero-extends eight bytes and masks one code slot
//!   per vector. Either way a lane holds `code * 2^(bits * slot)` and the
//!   weight is divided out once; [`Width::value_lane`] says which channel
//!   and weight each lane of each value vector holds (*storage order*).
//! - **rows into lanes** for scoring keys: a three-level two-source permute
//!   of sixteen rows (AVX-512) or the classic 8 x 8 unpack transpose (AVX2).
//! - **per-token parameters** `[n][groups]` f16 into `[groups][n]` f32.

#[cfg(target_arch = "x86_64")]
use super::simd::Rows;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `LANES` f32 lanes and the arithmetic every body needs, written once
/// for the two vector widths and for [`Scalar`] (one lane: the portable
/// path of a body that has one, such as the cache writes of `write.rs`).
/// [`Width`] adds what only the vector widths do; other modules extend
/// either with their own few operations (`write.rs`, `int8.rs`). Every
/// method is unsafe for [`Width`]'s reasons.
pub(crate) trait Lanes {
    /// f32 lanes.
    type F: Copy;
    /// Lanes per vector.
    const LANES: usize;
    unsafe fn zero() -> Self::F;
    unsafe fn splat(x: f32) -> Self::F;
    unsafe fn load(p: *const f32) -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn sub(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// An IEEE division in every lane (correctly rounded, as the scalar `/`).
    unsafe fn div(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn min(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn max(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn reduce_min(v: Self::F) -> f32;
    unsafe fn reduce_max(v: Self::F) -> f32;
}

/// One lane of plain f32 arithmetic.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Lanes for Scalar {
    type F = f32;
    const LANES: usize = 1;
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn min(a: f32, b: f32) -> f32 {
        a.min(b)
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn reduce_min(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn reduce_max(v: f32) -> f32 {
        v
    }
}

/// One vector width. Every method is unsafe: it needs the ISA's features
/// (checked once at the entry point) and, where it takes pointers, that they
/// point inside the caller's buffers for the lanes it reads or writes.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Width: Lanes {
    /// i32 lanes.
    type I: Copy;
    /// Enough registers for four value vectors of four heads per pass.
    const WIDE: bool;

    /// Channels spanned by the lanes of one value vector of `bits`-bit codes
    /// (all in one value group, so one weight per head serves the vector).
    fn value_span(bits: u32) -> usize;
    /// Channel (within the row) and weight of lane `j` of value vector `v`.
    fn value_lane(bits: u32, v: usize, j: usize) -> (usize, f32);
    /// Value vector `v` of the row at `row`, in storage order.
    unsafe fn unpack<const BITS: u32>(row: *const u32, v: usize) -> Self::F;

    /// `LANES` f16 values to f32.
    unsafe fn load_f16(p: *const u16) -> Self::F;
    /// `a * b + c`.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c - a * b`.
    unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn reduce_add(v: Self::F) -> f32;
    /// The four horizontal sums of `v`, as one 128-bit vector.
    unsafe fn sum4(v: [Self::F; 4]) -> __m128;
    /// The horizontal sums of `v[4 r + h]` (four rows by four heads) to
    /// `out[h * stride + r]`: four rows' scores, heads-major (`dense.rs`).
    /// Four row sums and a 4 x 4 transpose of 128-bit vectors; AVX-512
    /// does it in one transpose tree instead.
    #[inline(always)]
    unsafe fn sum4x4(v: &[Self::F; 16], out: *mut f32, stride: usize) {
        let s0 = Self::sum4([v[0], v[1], v[2], v[3]]);
        let s1 = Self::sum4([v[4], v[5], v[6], v[7]]);
        let s2 = Self::sum4([v[8], v[9], v[10], v[11]]);
        let s3 = Self::sum4([v[12], v[13], v[14], v[15]]);
        let t0 = _mm_unpacklo_ps(s0, s1);
        let t1 = _mm_unpacklo_ps(s2, s3);
        let t2 = _mm_unpackhi_ps(s0, s1);
        let t3 = _mm_unpackhi_ps(s2, s3);
        _mm_storeu_ps(out, _mm_movelh_ps(t0, t1));
        _mm_storeu_ps(out.add(stride), _mm_movehl_ps(t1, t0));
        _mm_storeu_ps(out.add(2 * stride), _mm_movelh_ps(t2, t3));
        _mm_storeu_ps(out.add(3 * stride), _mm_movehl_ps(t3, t2));
    }
    /// Chunk `c` (`LANES` values) of row `i` of `r`.
    unsafe fn row<R: Rows>(r: &R, i: usize, c: usize) -> Self::F;
    /// `out[i] = reduce_add(v[i])` (wider ISAs overlap the reductions).
    unsafe fn reduce_many(v: &[Self::F], out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(v) {
            *o = Self::reduce_add(x);
        }
    }
    /// Round to the nearest integer.
    unsafe fn round(x: Self::F) -> Self::F;
    /// `p * 2^n` for integral `n` in `-126..=0`.
    unsafe fn pow2(p: Self::F, n: Self::F) -> Self::F;
    /// `e` where `x >= lim`, else 0.
    unsafe fn keep_ge(x: Self::F, lim: f32, e: Self::F) -> Self::F;

    /// `exp(x)` for `x <= 0`, the polynomial of `simd::exp_body`; 0 below
    /// -64 (the fused and dense softmax).
    #[inline(always)]
    unsafe fn exp_le0(x: Self::F) -> Self::F {
        let a = Self::max(x, Self::splat(-87.0));
        let n = Self::round(Self::mul(a, Self::splat(std::f32::consts::LOG2_E)));
        let r = Self::fnmadd(n, Self::splat(0.693_359_4), a);
        let r = Self::fnmadd(n, Self::splat(-2.121_944_4e-4), r);
        let mut p = Self::splat(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = Self::fmadd(p, r, Self::splat(c));
        }
        Self::keep_ge(x, -64.0, Self::pow2(p, n))
    }

    unsafe fn splat_i(x: i32) -> Self::I;
    unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn and_i(a: Self::I, b: Self::I) -> Self::I;
    /// Logical right shift of every lane by `n` (a constant after inlining).
    unsafe fn srl_i(a: Self::I, n: i32) -> Self::I;
    /// Signed i32 to f32.
    unsafe fn cvt_i(a: Self::I) -> Self::F;

    /// Words `wb..wb + 8` of `LANES` rows `wpt` words apart: vector `w` holds
    /// word `wb + w` of every row (lane = row).
    unsafe fn transpose8(rows: *const i32, wpt: usize, wb: usize) -> [Self::I; 8];
    /// Word `w` of `LANES` rows `wpt` words apart (lane = row).
    unsafe fn gather_word(rows: *const i32, wpt: usize, w: usize) -> Self::I;
    /// The `bits`-bit codes (1, 2 or 4) of channels `c..c + LANES` of a
    /// packed row (channel `k` in word `k / (32 / bits)`, LSB first), one a
    /// lane; `c` a multiple of `LANES` (`rope.rs`'s vector decode).
    unsafe fn codes(row: *const u32, bits: u32, c: usize) -> Self::I;
    /// A table of 16 levels at `p` (shorter tables zero-padded by the
    /// caller), as [`Width::lookup16`] reads it.
    unsafe fn table16(p: *const f32) -> [Self::F; 2];
    /// `t[code]` per lane, codes below 16.
    unsafe fn lookup16(t: [Self::F; 2], code: Self::I) -> Self::F;
    /// Lanes `2i` and `2i + 1` exchanged (the partner of an `interleaved`
    /// RoPE pair).
    unsafe fn swap_pairs(v: Self::F) -> Self::F;
    /// Per-token parameters of `n` tokens (a multiple of `LANES`), `[n][ng]`
    /// f16 at `src`, to `[ng][n]` f32 at `dst`. The half before `src` is
    /// readable (the codes precede a part's parameter sections).
    unsafe fn params(src: *const u16, ng: usize, n: usize, dst: *mut f32, bw: bool);
}

/// 16 lanes: AVX-512F + DQ (and BW where the CPU has it).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

/// 8 lanes: AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

/// Lane `j`'s channel within a 16-channel chunk and its code's weight, as
/// the AVX-512 unpack produces them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lane512(bits: u32, j: usize) -> (usize, f32) {
    match bits {
        2 => (j, (4f32).powi(j as i32)),
        4 => (8 * (j % 2) + j / 2, (16f32).powi((j / 2) as i32)),
        _ => (j, 1.0),
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx512 {
    type F = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        _mm512_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m512) -> f32 {
        _mm512_reduce_max_ps(v)
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        _mm512_div_ps(a, b)
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        _mm512_min_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_min(v: __m512) -> f32 {
        _mm512_reduce_min_ps(v)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
impl Width for Avx512 {
    type I = __m512i;
    const WIDE: bool = true;

    fn value_span(_bits: u32) -> usize {
        16
    }
    fn value_lane(bits: u32, v: usize, j: usize) -> (usize, f32) {
        let (c, w) = lane512(bits, j);
        (16 * v + c, w)
    }
    /// A word (2-bit: 16 codes) or two (4-bit, as one 64-bit broadcast)
    /// ANDed with a per-lane mask, converted unsigned: two instructions.
    #[inline(always)]
    unsafe fn unpack<const BITS: u32>(row: *const u32, c: usize) -> __m512 {
        match BITS {
            2 => {
                let mask = _mm512_setr_epi32(
                    3,
                    3 << 2,
                    3 << 4,
                    3 << 6,
                    3 << 8,
                    3 << 10,
                    3 << 12,
                    3 << 14,
                    3 << 16,
                    3 << 18,
                    3 << 20,
                    3 << 22,
                    3 << 24,
                    3 << 26,
                    3 << 28,
                    3 << 30,
                );
                _mm512_cvtepu32_ps(_mm512_and_si512(_mm512_set1_epi32(*row.add(c) as i32), mask))
            }
            4 => {
                let mask = _mm512_setr_epi32(
                    0xf,
                    0xf,
                    0xf << 4,
                    0xf << 4,
                    0xf << 8,
                    0xf << 8,
                    0xf << 12,
                    0xf << 12,
                    0xf << 16,
                    0xf << 16,
                    0xf << 20,
                    0xf << 20,
                    0xf << 24,
                    0xf << 24,
                    0xf << 28,
                    0xf << 28,
                );
                let w = (row.add(2 * c) as *const u64).read_unaligned();
                _mm512_cvtepu32_ps(_mm512_and_si512(_mm512_set1_epi64(w as i64), mask))
            }
            _ => _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(4 * c) as *const __m128i))),
        }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fnmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }
    #[inline(always)]
    unsafe fn sum4(v: [__m512; 4]) -> __m128 {
        // No closure: it would not inherit the caller's target features.
        let mut h = [_mm256_setzero_ps(); 4];
        for (h, v) in h.iter_mut().zip(v) {
            *h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        }
        hsum4(h[0], h[1], h[2], h[3])
    }
    #[inline(always)]
    unsafe fn row<R: Rows>(r: &R, i: usize, c: usize) -> __m512 {
        r.get16(i, c)
    }
    /// One transpose tree: lane `4 h + r` holds the sum of `v[4 r + h]`,
    /// i.e. head `h`'s four rows are lanes `4 h..4 h + 4`.
    #[inline(always)]
    unsafe fn sum4x4(v: &[__m512; 16], out: *mut f32, stride: usize) {
        let t = tree(v);
        _mm_storeu_ps(out, _mm512_castps512_ps128(t));
        _mm_storeu_ps(out.add(stride), _mm512_extractf32x4_ps::<1>(t));
        _mm_storeu_ps(out.add(2 * stride), _mm512_extractf32x4_ps::<2>(t));
        _mm_storeu_ps(out.add(3 * stride), _mm512_extractf32x4_ps::<3>(t));
    }
    /// Sixteen at a time through one transpose tree.
    #[inline(always)]
    unsafe fn reduce_many(v: &[__m512], out: &mut [f32]) {
        if v.len() == 16 && out.len() >= 16 {
            let mut sums = [0f32; 16];
            _mm512_storeu_ps(sums.as_mut_ptr(), tree(v));
            // Lane 4k + m holds the sum of v[4m + k].
            for (lane, &s) in sums.iter().enumerate() {
                out[4 * (lane % 4) + lane / 4] = s;
            }
        } else {
            for (o, &x) in out.iter_mut().zip(v) {
                *o = _mm512_reduce_add_ps(x);
            }
        }
    }
    #[inline(always)]
    unsafe fn round(x: __m512) -> __m512 {
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x)
    }
    #[inline(always)]
    unsafe fn pow2(p: __m512, n: __m512) -> __m512 {
        _mm512_scalef_ps(p, n)
    }
    #[inline(always)]
    unsafe fn keep_ge(x: __m512, lim: f32, e: __m512) -> __m512 {
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(lim)), e)
    }

    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m512i {
        _mm512_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn add_i(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn and_i(a: __m512i, b: __m512i) -> __m512i {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn srl_i(a: __m512i, n: i32) -> __m512i {
        _mm512_srl_epi32(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn cvt_i(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }

    /// 1- and 2-bit rows hold sixteen codes in one word, broadcast and
    /// shifted per lane; 4-bit rows two words, one per eight lanes.
    #[inline(always)]
    unsafe fn codes(row: *const u32, bits: u32, c: usize) -> __m512i {
        let k = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let b = _mm512_set1_epi32(bits as i32);
        let per = (32 / bits) as usize;
        let (w, sh) = if per == 8 {
            let two = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            let pair = _mm512_castsi128_si512(_mm_loadl_epi64(row.add(c / 8) as *const __m128i));
            (
                _mm512_permutexvar_epi32(two, pair),
                _mm512_mullo_epi32(_mm512_and_si512(k, _mm512_set1_epi32(7)), b),
            )
        } else {
            let off = _mm512_set1_epi32(((c % per) * bits as usize) as i32);
            (
                _mm512_set1_epi32(*row.add(c / per) as i32),
                _mm512_add_epi32(_mm512_mullo_epi32(k, b), off),
            )
        };
        _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(((1u32 << bits) - 1) as i32))
    }
    #[inline(always)]
    unsafe fn table16(p: *const f32) -> [__m512; 2] {
        [_mm512_loadu_ps(p), _mm512_setzero_ps()]
    }
    /// One permute: sixteen entries fit a register.
    #[inline(always)]
    unsafe fn lookup16(t: [__m512; 2], code: __m512i) -> __m512 {
        _mm512_permutexvar_ps(code, t[0])
    }
    #[inline(always)]
    unsafe fn swap_pairs(v: __m512) -> __m512 {
        _mm512_permute_ps::<0b10_11_00_01>(v)
    }

    /// Three levels of eight two-source permutes.
    #[inline(always)]
    unsafe fn transpose8(rows: *const i32, wpt: usize, wb: usize) -> [__m512i; 8] {
        let idx = transpose_indices();
        let ld = |k: usize| _mm512_loadu_si512(idx[k].as_ptr() as *const _);
        let l: [__m512i; 8] = std::array::from_fn(|i| {
            let r0 = rows.add(2 * i * wpt + wb) as *const __m256i;
            let r1 = rows.add((2 * i + 1) * wpt + wb) as *const __m256i;
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(r0)), _mm256_loadu_si256(r1))
        });
        let p: [__m512i; 8] =
            std::array::from_fn(|k| _mm512_permutex2var_epi32(l[2 * (k / 2)], ld(k), l[2 * (k / 2) + 1]));
        // Level 2: k = 4q + 2h + e combines p[4q + h] and p[4q + 2 + h].
        let r: [__m512i; 8] = std::array::from_fn(|k| {
            let (q, h) = (k / 4, (k / 2) % 2);
            _mm512_permutex2var_epi32(p[4 * q + h], ld(8 + k), p[4 * q + 2 + h])
        });
        // Level 3: k = 4h + 2e + f combines r[2h + e] and r[4 + 2h + e].
        std::array::from_fn(|k| {
            let he = k / 2;
            _mm512_permutex2var_epi32(r[he], ld(16 + k), r[4 + he])
        })
    }
    #[inline(always)]
    unsafe fn gather_word(rows: *const i32, wpt: usize, w: usize) -> __m512i {
        let lane_rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(wpt as i32),
        );
        _mm512_i32gather_epi32::<4>(_mm512_add_epi32(lane_rows, _mm512_set1_epi32(w as i32)), rows)
    }
    /// Four groups (and AVX-512BW): two 64-half permutes per 16 tokens. Else
    /// a gather reads 32 bits at half `j - 1` and keeps the high half (half
    /// `j`): it never reads past the section.
    #[inline(always)]
    unsafe fn params(src: *const u16, ng: usize, n: usize, dst: *mut f32, bw: bool) {
        if ng == 4 && bw {
            transpose_params4(src, dst, n);
            return;
        }
        let lane_idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(ng as i32),
        );
        let src = src.sub(1) as *const i32;
        for gv in 0..ng {
            for i in (0..n).step_by(16) {
                let idx = _mm512_add_epi32(lane_idx, _mm512_set1_epi32((i * ng + gv) as i32));
                let w = _mm512_i32gather_epi32::<2>(idx, src);
                let h = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(w));
                _mm512_storeu_ps(dst.add(gv * n + i), _mm512_cvtph_ps(h));
            }
        }
    }
}

/// Sixteen horizontal sums at once: lane `4k + m` of the result is the
/// sum of `v[4m + k]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tree(v: &[__m512]) -> __m512 {
    let mut s = [_mm512_setzero_ps(); 8];
    for (i, s) in s.iter_mut().enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        *s = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        );
    }
    let mut t = [_mm512_setzero_ps(); 4];
    for (i, t) in t.iter_mut().enumerate() {
        let (a, b) = (s[2 * i], s[2 * i + 1]);
        *t = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        );
    }
    let mut y = [_mm512_setzero_ps(); 2];
    for (i, y) in y.iter_mut().enumerate() {
        let (a, b) = (t[2 * i], t[2 * i + 1]);
        *y = _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        );
    }
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
    )
}

/// Value parameters of `n` rows with four groups each, `[n][4]` f16 at
/// `src`, to `[4][n]` f32 at `dst`: two 64-half permutes per 16 rows. Its
/// own function: AVX-512BW is an extra the entry point does not assume.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma,f16c")]
unsafe fn transpose_params4(src: *const u16, dst: *mut f32, n: usize) {
    // Output half j of vector v (v = 0: groups 0, 1; v = 1: groups 2, 3)
    // is token j % 16 of group 2v + j / 16, at half 4 (j % 16) + group.
    const fn idx(v: i16) -> [i16; 32] {
        let mut a = [0i16; 32];
        let mut j = 0;
        while j < 32 {
            a[j] = 4 * (j as i16 % 16) + 2 * v + j as i16 / 16;
            j += 1;
        }
        a
    }
    const I01: [i16; 32] = idx(0);
    const I23: [i16; 32] = idx(1);
    let i01 = _mm512_loadu_si512(I01.as_ptr() as *const _);
    let i23 = _mm512_loadu_si512(I23.as_ptr() as *const _);
    for i in (0..n).step_by(16) {
        let a = _mm512_loadu_si512(src.add(4 * i) as *const _);
        let b = _mm512_loadu_si512(src.add(4 * i + 32) as *const _);
        for (v, ix) in [(0, i01), (1, i23)] {
            let x = _mm512_permutex2var_epi16(a, ix, b);
            let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
            let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(x));
            _mm512_storeu_ps(dst.add(2 * v * n + i), lo);
            _mm512_storeu_ps(dst.add((2 * v + 1) * n + i), hi);
        }
    }
}

/// Permutation indices of [`Avx512::transpose8`], built once by following
/// the (row, word) label of every lane through the three levels.
#[cfg(target_arch = "x86_64")]
pub(crate) fn transpose_indices() -> &'static [[i32; 16]; 24] {
    static IDX: std::sync::OnceLock<[[i32; 16]; 24]> = std::sync::OnceLock::new();
    IDX.get_or_init(|| {
        type Labels = [(u8, u8); 16];
        let pick = |a: &Labels, b: &Labels, want: &Labels| -> [i32; 16] {
            let mut idx = [0i32; 16];
            for (i, w) in want.iter().enumerate() {
                idx[i] = match a.iter().position(|x| x == w) {
                    Some(j) => j as i32,
                    None => 16 + b.iter().position(|x| x == w).expect("label in one source") as i32,
                };
            }
            idx
        };
        let labels = |rows: std::ops::Range<u8>, cols: std::ops::Range<u8>| -> Labels {
            let mut l = [(0, 0); 16];
            let mut i = 0;
            for c in cols {
                for r in rows.clone() {
                    l[i] = (r, c);
                    i += 1;
                }
            }
            l
        };
        let input: Vec<Labels> = (0..8u8)
            .map(|i| std::array::from_fn(|l| (2 * i + l as u8 / 8, l as u8 % 8)))
            .collect();
        let mut out = Vec::with_capacity(24);
        let mut p = Vec::new();
        for q in 0..4u8 {
            for h in 0..2u8 {
                let want = labels(4 * q..4 * q + 4, 4 * h..4 * h + 4);
                out.push(pick(&input[2 * q as usize], &input[2 * q as usize + 1], &want));
                p.push(want);
            }
        }
        let mut r = Vec::new();
        for q in 0..2u8 {
            for h in 0..2u8 {
                for e in 0..2u8 {
                    let (a, b) = (&p[(4 * q + h) as usize], &p[(4 * q + 2 + h) as usize]);
                    let c = 4 * h + 2 * e;
                    let want = labels(8 * q..8 * q + 8, c..c + 2);
                    out.push(pick(a, b, &want));
                    r.push(want);
                }
            }
        }
        for h in 0..2u8 {
            for e in 0..2u8 {
                for f in 0..2u8 {
                    let (a, b) = (&r[(2 * h + e) as usize], &r[(4 + 2 * h + e) as usize]);
                    let c = 4 * h + 2 * e + f;
                    out.push(pick(a, b, &labels(0..16, c..c + 1)));
                }
            }
        }
        out.try_into().expect("24 permutations")
    })
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    type F = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        _mm256_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        _mm256_div_ps(a, b)
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        _mm256_min_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_min(v: __m256) -> f32 {
        let s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_min_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)))
    }
}

#[cfg(target_arch = "x86_64")]
impl Width for Avx2 {
    type I = __m256i;
    const WIDE: bool = false;

    /// 2-bit: eight bytes (32 channels) per load, one code slot per
    /// vector; 4-bit: eight bytes (16 channels), one nibble per vector;
    /// 8-bit: eight consecutive channels.
    fn value_span(bits: u32) -> usize {
        match bits {
            2 => 32,
            4 => 16,
            _ => 8,
        }
    }
    fn value_lane(bits: u32, v: usize, j: usize) -> (usize, f32) {
        match bits {
            2 => (32 * (v / 4) + 4 * j + v % 4, (4f32).powi((v % 4) as i32)),
            4 => (16 * (v / 2) + 2 * j + v % 2, (16f32).powi((v % 2) as i32)),
            _ => (8 * v + j, 1.0),
        }
    }
    /// Eight bytes zero-extended to lanes (one shuffle), then one code slot
    /// masked per vector: lane values stay below 2^16, so the signed
    /// conversion (AVX2 has no unsigned one) is exact.
    #[inline(always)]
    unsafe fn unpack<const BITS: u32>(row: *const u32, v: usize) -> __m256 {
        match BITS {
            2 => {
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(2 * (v / 4)) as *const __m128i));
                _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(3 << (2 * (v % 4)))))
            }
            4 => {
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(2 * (v / 2)) as *const __m128i));
                _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xf << (4 * (v % 2)))))
            }
            _ => _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(2 * v) as *const __m128i))),
        }
    }

    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn fnmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fnmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let sh = _mm_movehdup_ps(s);
        let s2 = _mm_add_ps(s, sh);
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehl_ps(sh, s2)))
    }
    #[inline(always)]
    unsafe fn sum4(v: [__m256; 4]) -> __m128 {
        hsum4(v[0], v[1], v[2], v[3])
    }
    #[inline(always)]
    unsafe fn row<R: Rows>(r: &R, i: usize, c: usize) -> __m256 {
        r.get8(i, c)
    }
    #[inline(always)]
    unsafe fn round(x: __m256) -> __m256 {
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x)
    }
    /// `2^n` built in the exponent field (`n >= -126` keeps it normal).
    #[inline(always)]
    unsafe fn pow2(p: __m256, n: __m256) -> __m256 {
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }
    #[inline(always)]
    unsafe fn keep_ge(x: __m256, lim: f32, e: __m256) -> __m256 {
        _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(lim)), e)
    }

    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m256i {
        _mm256_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn add_i(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn and_i(a: __m256i, b: __m256i) -> __m256i {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn srl_i(a: __m256i, n: i32) -> __m256i {
        _mm256_srl_epi32(a, _mm_cvtsi32_si128(n))
    }
    #[inline(always)]
    unsafe fn cvt_i(a: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }

    /// Eight codes lie in one word (`bits <= 4`): broadcast, shifted per lane.
    #[inline(always)]
    unsafe fn codes(row: *const u32, bits: u32, c: usize) -> __m256i {
        let per = (32 / bits) as usize;
        let lane = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(bits as i32),
        );
        let w = _mm256_set1_epi32(*row.add(c / per) as i32);
        let sh = _mm256_add_epi32(lane, _mm256_set1_epi32(((c % per) * bits as usize) as i32));
        _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(((1u32 << bits) - 1) as i32))
    }
    #[inline(always)]
    unsafe fn table16(p: *const f32) -> [__m256; 2] {
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
    /// Two eight-entry permutes (they read the code's low three bits),
    /// blended on its bit 3 moved to the sign.
    #[inline(always)]
    unsafe fn lookup16(t: [__m256; 2], code: __m256i) -> __m256 {
        let lo = _mm256_permutevar8x32_ps(t[0], code);
        let hi = _mm256_permutevar8x32_ps(t[1], code);
        _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(code)))
    }
    #[inline(always)]
    unsafe fn swap_pairs(v: __m256) -> __m256 {
        _mm256_permute_ps::<0b10_11_00_01>(v)
    }

    /// The classic 8 x 8 transpose: 32-bit, 64-bit, then 128-bit interleaves.
    #[inline(always)]
    unsafe fn transpose8(rows: *const i32, wpt: usize, wb: usize) -> [__m256i; 8] {
        let r: [__m256i; 8] = std::array::from_fn(|i| _mm256_loadu_si256(rows.add(i * wpt + wb) as *const __m256i));
        transpose8x8(r)
    }
    #[inline(always)]
    unsafe fn gather_word(rows: *const i32, wpt: usize, w: usize) -> __m256i {
        let lane_rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(wpt as i32));
        _mm256_i32gather_epi32::<4>(rows.add(w), lane_rows)
    }
    /// Four groups: eight tokens (32 halves) converted, then two interleave
    /// levels and one lane permute; multiples of eight groups: 8 x 8
    /// transposes; otherwise one value at a time.
    #[inline(always)]
    unsafe fn params(src: *const u16, ng: usize, n: usize, dst: *mut f32, _bw: bool) {
        if ng == 4 {
            // v_k = tokens 2k, 2k + 1 (four groups each); the shuffles give
            // tokens in the order 0 2 4 6 1 3 5 7, which the permute undoes.
            let fix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for i in (0..n).step_by(8) {
                let v: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_cvtph_ps(_mm_loadu_si128(src.add(4 * i + 8 * k) as *const __m128i)));
                let lo01 = _mm256_unpacklo_ps(v[0], v[1]);
                let hi01 = _mm256_unpackhi_ps(v[0], v[1]);
                let lo23 = _mm256_unpacklo_ps(v[2], v[3]);
                let hi23 = _mm256_unpackhi_ps(v[2], v[3]);
                let g = [
                    _mm256_shuffle_ps::<0b01_00_01_00>(lo01, lo23),
                    _mm256_shuffle_ps::<0b11_10_11_10>(lo01, lo23),
                    _mm256_shuffle_ps::<0b01_00_01_00>(hi01, hi23),
                    _mm256_shuffle_ps::<0b11_10_11_10>(hi01, hi23),
                ];
                for (gv, &x) in g.iter().enumerate() {
                    _mm256_storeu_ps(dst.add(gv * n + i), _mm256_permutevar8x32_ps(x, fix));
                }
            }
        } else if ng.is_multiple_of(8) {
            for i in (0..n).step_by(8) {
                for g0 in (0..ng).step_by(8) {
                    let r: [__m256i; 8] = std::array::from_fn(|t| {
                        _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(
                            src.add((i + t) * ng + g0) as *const __m128i
                        )))
                    });
                    for (k, x) in transpose8x8(r).into_iter().enumerate() {
                        _mm256_storeu_si256(dst.add((g0 + k) * n + i) as *mut __m256i, x);
                    }
                }
            }
        } else {
            for i in 0..n {
                for gv in 0..ng {
                    *dst.add(gv * n + i) = half::f16::from_bits(*src.add(i * ng + gv)).to_f32();
                }
            }
        }
    }
}

/// Horizontal sums of four vectors, as one vector `[s0, s1, s2, s3]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let u = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u))
}

/// Rows `r` (eight 32-bit lanes each) to columns.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8x8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|k| {
        let (a, b) = (r[2 * (k / 2)], r[2 * (k / 2) + 1]);
        if k % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4q + 2s + e]: rows 4q..4q + 4, words (2s + e) and (2s + e) + 4.
    let u: [__m256i; 8] = std::array::from_fn(|k| {
        let (q, s, e) = (k / 4, (k / 2) % 2, k % 2);
        let (a, b) = (t[4 * q + s], t[4 * q + 2 + s]);
        if e == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|w| {
        let (a, b) = (u[w % 4], u[4 + w % 4]);
        if w < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        }
    })
}

/// The contract the fused body relies on: `unpack` puts in each lane the
/// code of the channel `value_lane` names, times the weight it names; every
/// channel appears once; a vector's lanes stay inside one aligned span of
/// `value_span` channels (one value group).
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn code(ch: usize, bits: u32) -> u32 {
        ((ch * 7 + 3) as u32) % (1 << bits)
    }

    /// A row of `d` channels, packed as the layout packs codes (channel `k`
    /// of a word at bits `bits * k`), with a word of slack for 8-byte loads.
    fn row(d: usize, bits: u32) -> Vec<u32> {
        let per = (32 / bits) as usize;
        let mut w = vec![0u32; d / per + 2];
        for ch in 0..d {
            w[ch / per] |= code(ch, bits) << (bits as usize * (ch % per));
        }
        w
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_avx2<const B: u32>(row: &[u32], v: usize, out: &mut [f32; 16]) {
        Avx2::store(out.as_mut_ptr(), Avx2::unpack::<B>(row.as_ptr(), v))
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn unpack_avx512<const B: u32>(row: &[u32], v: usize, out: &mut [f32; 16]) {
        Avx512::store(out.as_mut_ptr(), Avx512::unpack::<B>(row.as_ptr(), v))
    }

    fn check<V: Width>(bits: u32, unpack: impl Fn(&[u32], usize, &mut [f32; 16])) {
        let d = 128;
        let r = row(d, bits);
        let mut seen = vec![false; d];
        for v in 0..d / V::LANES {
            let mut out = [0f32; 16];
            unpack(&r, v, &mut out);
            let span = V::value_span(bits);
            let first = V::value_lane(bits, v, 0).0 / span;
            for (j, &x) in out.iter().enumerate().take(V::LANES) {
                let (ch, w) = V::value_lane(bits, v, j);
                assert_eq!(
                    x,
                    code(ch, bits) as f32 * w,
                    "{bits}-bit vector {v} lane {j} (channel {ch})"
                );
                assert!(!seen[ch], "{bits}-bit channel {ch} twice");
                assert_eq!(ch / span, first, "{bits}-bit vector {v} leaves its span");
                seen[ch] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{bits}-bit: some channel in no lane");
    }

    #[test]
    fn unpack_matches_value_lane() {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            // SAFETY (all three): features checked; rows have slack words.
            check::<Avx2>(2, |r, v, o| unsafe { unpack_avx2::<2>(r, v, o) });
            check::<Avx2>(4, |r, v, o| unsafe { unpack_avx2::<4>(r, v, o) });
            check::<Avx2>(8, |r, v, o| unsafe { unpack_avx2::<8>(r, v, o) });
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
            check::<Avx512>(2, |r, v, o| unsafe { unpack_avx512::<2>(r, v, o) });
            check::<Avx512>(4, |r, v, o| unsafe { unpack_avx512::<4>(r, v, o) });
            check::<Avx512>(8, |r, v, o| unsafe { unpack_avx512::<8>(r, v, o) });
        }
    }

    #[test]
    fn transpose8x8_is_a_transpose() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let m: Vec<i32> = (0..64).collect();
        let mut out = [[0i32; 8]; 8];
        // SAFETY: AVX2 checked; eight rows of eight words.
        unsafe { transpose_avx2(&m, &mut out) };
        for (w, col) in out.iter().enumerate() {
            for (r, &x) in col.iter().enumerate() {
                assert_eq!(x, m[r * 8 + w], "word {w} row {r}");
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn transpose_avx2(m: &[i32], out: &mut [[i32; 8]; 8]) {
        for (o, v) in out.iter_mut().zip(Avx2::transpose8(m.as_ptr(), 8, 0)) {
            _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, v);
        }
    }
}
