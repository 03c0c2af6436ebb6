//! Inner loops of the CPU kernel, twice: portable scalar code (always
//! compiled, always tested) and a vector body (`wide`) written once over
//! the vector width ([`super::width::Width`]) and instantiated for AVX2 +
//! FMA + F16C and for AVX-512, selected at run time.
//!
//! Both are written against [`Rows`]: a tile of `n` token rows of `D`
//! values, however they are stored (f16, bf16, f32, packed codes, codes with
//! per-token or per-channel parameters). A row kind only says how to read
//! one value (`get`) or eight or sixteen consecutive values (`get8`,
//! `get16`); the two kernels — scores `q . row` for a block of query heads,
//! and `acc += p * row` — are generic over it, so each storage format costs
//! one small impl and is fused into the arithmetic (no f32 copy of the tile).

#[cfg(target_arch = "x86_64")]
use super::width::{Avx2, Avx512, Width};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Which inner loops a call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar code.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64, detected at run time).
    Avx2,
    /// AVX-512F/DQ (+ F16C), 16 channels per instruction.
    Avx512,
}

impl Isa {
    /// The best available instruction set, unless `force_scalar`. The AVX2
    /// loops read rows eight channels at a time, so they need `head_dim % 8 == 0`.
    /// AVX-512 needs `head_dim % 16 == 0` and `allow_avx512`.
    pub fn select(force_scalar: bool, allow_avx512: bool, head_dim: usize) -> Isa {
        if force_scalar {
            Isa::Scalar
        } else if allow_avx512 && head_dim.is_multiple_of(16) && avx512_available() {
            Isa::Avx512
        } else if head_dim.is_multiple_of(8) && avx2_available() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Channels one instruction handles.
    pub fn width(self) -> usize {
        match self {
            Isa::Scalar => 1,
            Isa::Avx2 => 8,
            Isa::Avx512 => 16,
        }
    }

    /// `scalar` or `avx2`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    avx2_available() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")
}

/// AVX-512BW (16-bit lane permutes), an extra the fused path can use.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512bw_available() -> bool {
    avx512_available() && is_x86_feature_detected!("avx512bw")
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx512bw_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_available() -> bool {
    false
}

/// A tile of token rows, `D` values each.
pub(crate) trait Rows {
    /// Whether rows `0..n` of `d` values lie inside the backing slices; the
    /// AVX2 loops read without bounds checks once this holds.
    fn fits(&self, n: usize, d: usize) -> bool;
    /// Value `k` of row `i`.
    fn get(&self, i: usize, k: usize) -> f32;
    /// Values `8c..8c+8` of row `i`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available and `fits(n, d)` holds with `i < n`, `8c + 8 <= d`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256;
    /// Values `16c..16c+16` of row `i`.
    ///
    /// # Safety
    /// AVX-512F is available and `fits(n, d)` holds with `i < n`, `16c + 16 <= d`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512;
}

/// Rows stored as 16-bit floats, `stride` elements apart: f16 bits, or
/// bf16 bits where `BF16` (a constant, so each kind compiles to its own
/// conversion).
pub(crate) struct HalfRows<'a, const BF16: bool> {
    pub data: &'a [u16],
    pub base: usize,
    pub stride: usize,
}

/// Rows stored as f16 bits.
pub(crate) type F16Rows<'a> = HalfRows<'a, false>;

/// Rows stored as bf16 bits.
pub(crate) type Bf16Rows<'a> = HalfRows<'a, true>;

/// Rows stored as f32.
pub(crate) struct F32Rows<'a> {
    pub data: &'a [f32],
    pub base: usize,
    pub stride: usize,
}

/// Packed codes read as plain numbers `0..2^BITS` (the parameters are folded
/// elsewhere). `BITS` is 2, 4 or 8; a row is `wpt` words.
pub(crate) struct CodeRows<'a, const BITS: u32> {
    pub words: &'a [u32],
    pub base: usize,
    pub wpt: usize,
}

/// Token-axis codes dequantized on the fly: `c * s + z` with one `(s, z)`
/// per token per group of `2^gshift` channels (`s`, `z` are `[n][d >> gshift]`).
pub(crate) struct TokRows<'a, const BITS: u32> {
    pub codes: CodeRows<'a, BITS>,
    pub s: &'a [f32],
    pub z: &'a [f32],
    /// Groups per token, `d >> gshift`.
    pub ng: usize,
    pub gshift: u32,
}

/// Channel-axis codes dequantized on the fly: `c * s_k + z_k` with one
/// `(s, z)` per channel (all rows in one group).
pub(crate) struct ChanRows<'a, const BITS: u32> {
    pub codes: CodeRows<'a, BITS>,
    pub s: &'a [f32],
    pub z: &'a [f32],
}

fn span_fits(len: usize, base: usize, stride: usize, n: usize, width: usize) -> bool {
    n == 0 || base + (n - 1) * stride + width <= len
}

impl<const BF16: bool> Rows for HalfRows<'_, BF16> {
    fn fits(&self, n: usize, d: usize) -> bool {
        span_fits(self.data.len(), self.base, self.stride, n, d)
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        let b = self.data[self.base + i * self.stride + k];
        if BF16 {
            half::bf16::from_bits(b).to_f32()
        } else {
            half::f16::from_bits(b).to_f32()
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256 {
        let h = _mm_loadu_si128(self.data.as_ptr().add(self.base + i * self.stride + 8 * c) as *const __m128i);
        if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512 {
        let h = _mm256_loadu_si256(self.data.as_ptr().add(self.base + i * self.stride + 16 * c) as *const __m256i);
        if BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_cvtph_ps(h)
        }
    }
}

impl Rows for F32Rows<'_> {
    fn fits(&self, n: usize, d: usize) -> bool {
        span_fits(self.data.len(), self.base, self.stride, n, d)
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        self.data[self.base + i * self.stride + k]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256 {
        _mm256_loadu_ps(self.data.as_ptr().add(self.base + i * self.stride + 8 * c))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512 {
        _mm512_loadu_ps(self.data.as_ptr().add(self.base + i * self.stride + 16 * c))
    }
}

impl<const BITS: u32> CodeRows<'_, BITS> {
    #[inline(always)]
    fn code(&self, i: usize, k: usize) -> u32 {
        let per = (32 / BITS) as usize;
        let w = self.words[self.base + i * self.wpt + k / per];
        (w >> ((k % per) as u32 * BITS)) & ((1u32 << BITS) - 1)
    }
    /// Codes `8c..8c+8` of row `i` as i32 lanes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes8(&self, i: usize, c: usize) -> __m256i {
        let row = self.words.as_ptr().add(self.base + i * self.wpt);
        match BITS {
            2 => {
                // 16 codes per word: chunk c is the low or high half of word c/2.
                let w = _mm256_set1_epi32(*row.add(c / 2) as i32);
                let sh = _mm256_add_epi32(
                    _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                    _mm256_set1_epi32(16 * (c & 1) as i32),
                );
                _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(3))
            }
            4 => {
                let w = _mm256_set1_epi32(*row.add(c) as i32);
                let sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
                _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(15))
            }
            8 => {
                let p = (row as *const u8).add(8 * c);
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
            }
            _ => unreachable!("the plan only builds code rows of 2, 4 or 8 bits"),
        }
    }
    /// Codes `16c..16c+16` of row `i` as i32 lanes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes16(&self, i: usize, c: usize) -> __m512i {
        let row = self.words.as_ptr().add(self.base + i * self.wpt);
        match BITS {
            2 => {
                let w = _mm512_set1_epi32(*row.add(c) as i32);
                let sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(3))
            }
            4 => {
                // Words 2c and 2c+1, eight codes each.
                let lo = _mm512_set1_epi32(*row.add(2 * c) as i32);
                let hi = _mm512_set1_epi32(*row.add(2 * c + 1) as i32);
                let w = _mm512_mask_blend_epi32(0xff00, lo, hi);
                let sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
                _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(15))
            }
            8 => {
                let p = (row as *const u8).add(16 * c);
                _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
            }
            _ => unreachable!("the plan only builds code rows of 2, 4 or 8 bits"),
        }
    }
}

impl<const BITS: u32> Rows for CodeRows<'_, BITS> {
    fn fits(&self, n: usize, d: usize) -> bool {
        span_fits(
            self.words.len(),
            self.base,
            self.wpt,
            n,
            d.div_ceil((32 / BITS) as usize),
        )
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        self.code(i, k) as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256 {
        _mm256_cvtepi32_ps(self.codes8(i, c))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512 {
        _mm512_cvtepi32_ps(self.codes16(i, c))
    }
}

impl<const BITS: u32> Rows for TokRows<'_, BITS> {
    fn fits(&self, n: usize, d: usize) -> bool {
        self.codes.fits(n, d) && self.s.len() >= n * self.ng && self.z.len() >= n * self.ng
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        // The §3 decode `c * s + z`: two roundings, as in the reference.
        let j = i * self.ng + (k >> self.gshift);
        self.codes.get(i, k) * self.s[j] + self.z[j]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256 {
        // A chunk of 8 never straddles groups: the plan takes this path only
        // for power-of-two groups of at least 8 channels.
        let j = i * self.ng + ((8 * c) >> self.gshift);
        let x = self.codes.get8(i, c);
        _mm256_add_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(*self.s.get_unchecked(j))),
            _mm256_set1_ps(*self.z.get_unchecked(j)),
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512 {
        // Needs groups of at least 16 channels (the plan checks).
        let j = i * self.ng + ((16 * c) >> self.gshift);
        let x = _mm512_cvtepi32_ps(self.codes.codes16(i, c));
        _mm512_add_ps(
            _mm512_mul_ps(x, _mm512_set1_ps(*self.s.get_unchecked(j))),
            _mm512_set1_ps(*self.z.get_unchecked(j)),
        )
    }
}

impl<const BITS: u32> Rows for ChanRows<'_, BITS> {
    fn fits(&self, n: usize, d: usize) -> bool {
        self.codes.fits(n, d) && self.s.len() >= d && self.z.len() >= d
    }
    #[inline(always)]
    fn get(&self, i: usize, k: usize) -> f32 {
        self.codes.get(i, k) * self.s[k] + self.z[k]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(&self, i: usize, c: usize) -> __m256 {
        let x = self.codes.get8(i, c);
        let s = _mm256_loadu_ps(self.s.as_ptr().add(8 * c));
        let z = _mm256_loadu_ps(self.z.as_ptr().add(8 * c));
        _mm256_add_ps(_mm256_mul_ps(x, s), z)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get16(&self, i: usize, c: usize) -> __m512 {
        let x = _mm512_cvtepi32_ps(self.codes.codes16(i, c));
        let s = _mm512_loadu_ps(self.s.as_ptr().add(16 * c));
        let z = _mm512_loadu_ps(self.z.as_ptr().add(16 * c));
        _mm512_add_ps(_mm512_mul_ps(x, s), z)
    }
}

/// `out[i * ostride + h] = sum_k q[h * d + k] * row_i[k]` for `heads` query
/// heads and rows `0..n`.
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
) {
    if n == 0 || heads == 0 {
        return;
    }
    assert!(r.fits(n, d) && q.len() >= heads * d && out.len() >= (n - 1) * ostride + heads);
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    let b = Dot {
        n,
        d,
        q: qp,
        heads,
        out: op,
        ostride,
    };
    by_heads(isa, d, r, b, || {
        for i in 0..n {
            for h in 0..heads {
                let qh = &q[h * d..(h + 1) * d];
                let mut s = 0f32;
                for (k, x) in qh.iter().enumerate() {
                    s += x * r.get(i, k);
                }
                out[i * ostride + h] = s;
            }
        }
    });
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
) {
    if n == 0 || heads == 0 {
        return;
    }
    assert!(r.fits(n, d) && acc.len() >= heads * d && p.len() >= (n - 1) * pstride + heads);
    let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
    let b = Axpy {
        n,
        d,
        p: pp,
        pstride,
        heads,
        acc: ap,
    };
    by_heads(isa, d, r, b, || {
        for i in 0..n {
            for h in 0..heads {
                let w = p[i * pstride + h];
                for (k, a) in acc[h * d..(h + 1) * d].iter_mut().enumerate() {
                    *a += w * r.get(i, k);
                }
            }
        }
    });
}

/// [`dot`]'s arguments, checked; by value, so that the entry point holds
/// them in registers (the rows travel apart, as a `&R` argument the
/// compiler knows no store changes).
#[derive(Clone, Copy)]
struct Dot {
    n: usize,
    d: usize,
    q: *const f32,
    heads: usize,
    out: *mut f32,
    ostride: usize,
}

/// [`axpy`]'s arguments, checked (as [`Dot`]).
#[derive(Clone, Copy)]
struct Axpy {
    n: usize,
    d: usize,
    p: *const f32,
    pstride: usize,
    heads: usize,
    acc: *mut f32,
}

/// What [`dot`] and [`axpy`] do for a block of query heads, so that the ISA
/// dispatch, the `#[target_feature]` entry points and the loop over blocks
/// of heads ([`by_heads`]) are written once for both.
trait Heads: Copy {
    fn heads(self) -> usize;
    /// Heads `h0..h0 + NH` of rows `r` on width `V`; returns `NH`.
    ///
    /// # Safety
    /// `V`'s features are available and the caller's asserts hold.
    #[cfg(target_arch = "x86_64")]
    unsafe fn block<V: Width, R: Rows, const NH: usize>(self, r: &R, h0: usize) -> usize;
}

impl Heads for Dot {
    fn heads(self) -> usize {
        self.heads
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn block<V: Width, R: Rows, const NH: usize>(self, r: &R, h0: usize) -> usize {
        let (q, out) = (self.q.add(h0 * self.d), self.out.add(h0));
        wide::dot::<V, R, NH>(r, self.n, self.d, q, out, self.ostride)
    }
}

impl Heads for Axpy {
    fn heads(self) -> usize {
        self.heads
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn block<V: Width, R: Rows, const NH: usize>(self, r: &R, h0: usize) -> usize {
        let (p, acc) = (self.p.add(h0), self.acc.add(h0 * self.d));
        wide::axpy::<V, R, NH>(r, self.n, self.d, p, self.pstride, acc)
    }
}

/// Runs `b` over rows `r` (of `d` values, a multiple of the width) on
/// `isa`, or `scalar` (the portable loops).
fn by_heads<R: Rows, H: Heads>(isa: Isa, d: usize, r: &R, b: H, scalar: impl FnOnce()) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(d.is_multiple_of(8) && avx2_available());
            // SAFETY: features checked above; the callers' asserts bound
            // every read and write.
            unsafe { heads_avx2(r, b) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            assert!(d.is_multiple_of(16) && avx512_available());
            // SAFETY: as for AVX2.
            unsafe { heads_avx512(r, b) }
        }
        _ => {
            let _ = (d, r, b);
            scalar()
        }
    }
}

/// [`blocks`] on AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn heads_avx2<R: Rows, H: Heads>(r: &R, b: H) {
    blocks::<Avx2, R, H>(r, b)
}

/// [`blocks`] on AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
unsafe fn heads_avx512<R: Rows, H: Heads>(r: &R, b: H) {
    blocks::<Avx512, R, H>(r, b)
}

/// Every head in blocks of four, two or one (a constant per block, so that
/// the block's accumulators stay in registers), inlined into the entry point.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn blocks<V: Width, R: Rows, H: Heads>(r: &R, b: H) {
    let heads = b.heads();
    let mut h0 = 0;
    while h0 < heads {
        h0 += match heads - h0 {
            1 => b.block::<V, R, 1>(r, h0),
            2 | 3 => b.block::<V, R, 2>(r, h0),
            _ => b.block::<V, R, 4>(r, h0),
        };
    }
}

/// f16 bits to f32.
pub(crate) fn f16_to_f32(isa: Isa, src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && avx2_available() {
        // SAFETY: F16C checked; every chunk lies inside both slices.
        unsafe { done = avx2::f16_to_f32(&src[..n], &mut dst[..n]) };
    }
    let _ = isa;
    for i in done..n {
        dst[i] = half::f16::from_bits(src[i]).to_f32();
    }
}

/// `x <- exp(x)` for `x <= 0` (softmax terms after subtracting the max).
pub(crate) fn exp_le0(isa: Isa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && avx2_available() {
        // SAFETY: features checked.
        unsafe { avx2::exp_le0(x) };
        return;
    }
    let _ = isa;
    exp_body(x);
}

/// Cody-Waite range reduction and a degree-7 Taylor polynomial: relative
/// error about 1e-7 on `[-87, 0]`, below that the result is 0-ish (the
/// reference's `exp` would give at most 1.7e-38 there). Plain arithmetic, so
/// that LLVM vectorises it under whatever target features the caller has.
#[inline(always)]
fn exp_body(x: &mut [f32]) {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    for v in x.iter_mut() {
        let a = v.max(-87.0);
        let y = a * LOG2E + MAGIC;
        let n_int = y.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
        let n = y - MAGIC;
        let r = a - n * LN2_HI - n * LN2_LO;
        let mut p = 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        *v = p * f32::from_bits(((n_int + 127) as u32) << 23);
    }
}

/// The AVX2 and AVX-512 loops, written once over the vector width
/// ([`super::width::Width`]) and instantiated by the `#[target_feature]`
/// entry points `heads_avx2` and `heads_avx512` (and `avx512::axpy4`):
/// everything here is inlined into them.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
pub(crate) mod wide {
    use super::Rows;
    use crate::cpu::width::Width;
    use std::arch::x86_64::*;

    /// Scores of `NH` heads; two rows at a time so that each query chunk
    /// loaded from L1 feeds two FMAs. Returns `NH`.
    #[inline(always)]
    pub unsafe fn dot<V: Width, R: Rows, const NH: usize>(
        r: &R,
        n: usize,
        d: usize,
        q: *const f32,
        out: *mut f32,
        ostride: usize,
    ) -> usize {
        let (chunks, w) = (d / V::LANES, V::LANES);
        let mut i = 0;
        while i + 2 <= n {
            let mut a0 = [V::zero(); NH];
            let mut a1 = [V::zero(); NH];
            for c in 0..chunks {
                let x0 = V::row(r, i, c);
                let x1 = V::row(r, i + 1, c);
                for h in 0..NH {
                    let qv = V::load(q.add(h * d + w * c));
                    a0[h] = V::fmadd(qv, x0, a0[h]);
                    a1[h] = V::fmadd(qv, x1, a1[h]);
                }
            }
            if NH == 4 {
                // Four heads' scores are adjacent in `out`: one tree, one store.
                _mm_storeu_ps(out.add(i * ostride), V::sum4([a0[0], a0[1], a0[2], a0[3]]));
                _mm_storeu_ps(out.add((i + 1) * ostride), V::sum4([a1[0], a1[1], a1[2], a1[3]]));
            } else {
                for h in 0..NH {
                    *out.add(i * ostride + h) = V::reduce_add(a0[h]);
                    *out.add((i + 1) * ostride + h) = V::reduce_add(a1[h]);
                }
            }
            i += 2;
        }
        if i < n {
            let mut a0 = [V::zero(); NH];
            for c in 0..chunks {
                let x0 = V::row(r, i, c);
                for h in 0..NH {
                    a0[h] = V::fmadd(V::load(q.add(h * d + w * c)), x0, a0[h]);
                }
            }
            for h in 0..NH {
                *out.add(i * ostride + h) = V::reduce_add(a0[h]);
            }
        }
        NH
    }

    /// `acc += p * row` for `NH` heads: chunks of every head stay in
    /// registers while the rows stream past. Two chunks at a time where
    /// there are two: 2 x NH FMA chains in flight (four chains leave half
    /// the FMA throughput idle behind their latency) and one weight
    /// broadcast per two FMAs. Returns `NH`.
    #[inline(always)]
    pub unsafe fn axpy<V: Width, R: Rows, const NH: usize>(
        r: &R,
        n: usize,
        d: usize,
        p: *const f32,
        pstride: usize,
        acc: *mut f32,
    ) -> usize {
        let chunks = d / V::LANES;
        let mut c = 0;
        while c < chunks {
            if c + 2 <= chunks {
                axpy_chunks::<V, R, NH, 2>(r, n, d, p, pstride, acc, c);
                c += 2;
            } else {
                axpy_chunks::<V, R, NH, 1>(r, n, d, p, pstride, acc, c);
                c += 1;
            }
        }
        NH
    }

    /// Chunks `c0..c0 + NC` of `axpy`.
    #[inline(always)]
    pub unsafe fn axpy_chunks<V: Width, R: Rows, const NH: usize, const NC: usize>(
        r: &R,
        n: usize,
        d: usize,
        p: *const f32,
        pstride: usize,
        acc: *mut f32,
        c0: usize,
    ) {
        let w = V::LANES;
        let mut a = [[V::zero(); NC]; NH];
        for h in 0..NH {
            for k in 0..NC {
                a[h][k] = V::load(acc.add(h * d + w * (c0 + k)));
            }
        }
        for i in 0..n {
            let x: [V::F; NC] = std::array::from_fn(|k| V::row(r, i, c0 + k));
            for h in 0..NH {
                let wt = V::splat(*p.add(i * pstride + h));
                for k in 0..NC {
                    a[h][k] = V::fmadd(wt, x[k], a[h][k]);
                }
            }
        }
        for h in 0..NH {
            for k in 0..NC {
                V::store(acc.add(h * d + w * (c0 + k)), a[h][k]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Converts whole chunks of 8; returns how many values it converted.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> usize {
        let n = src.len().min(dst.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), v);
        }
        n
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_le0(x: &mut [f32]) {
        super::exp_body(x)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::Rows;
    use crate::cpu::width::Avx512;

    /// Four chunks of `NH` heads at a time (`dense.rs`: AVX-512 has the
    /// registers for 16 accumulators); `d` a multiple of 64.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub unsafe fn axpy4<R: Rows, const NH: usize>(
        r: &R,
        n: usize,
        d: usize,
        p: *const f32,
        pstride: usize,
        acc: *mut f32,
    ) {
        for c0 in (0..d / 16).step_by(4) {
            super::wide::axpy_chunks::<Avx512, R, NH, 4>(r, n, d, p, pstride, acc, c0);
        }
    }
}
