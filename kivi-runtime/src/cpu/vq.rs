//! Decode over `vq(...)` tensors by asymmetric distance computation
//! (DESIGN.md §8): no key or value row is ever reconstructed.
//!
//! Keys: once per split, per query head `h` and sub-vector `j`, a table
//! `L[j][c][h] = q_h[j] . C_j[c]` over the `E` centroids of codebook `j`;
//! a token's score is then `sum_j L[j][code_j][h]`, `D / M` lookups
//! instead of `D` multiply-adds over decoded channels.
//!
//! Values: each token's softmax weight is added to the bin of its centroid
//! in every sub-vector, `B[j][c][h] += p_t[h]`; the bins follow the online
//! softmax's rescaling like the accumulator does ([`rescale`]), and the
//! output is expanded once per split, `acc[h][j] += sum_c B[j][c][h] C_j[c]`.
//!
//! Layout, for speed: the heads of the GQA group are the innermost axis of
//! both tables, so one code selects the entries of every head at once, one
//! 128-bit load (or load-add-store) per four heads instead of four scalar
//! lookups in four tables a `S * E` stride apart; and all `g` heads of a
//! token touch `S` cache lines, not `g * S` (vq2's tables are 256 KiB at
//! MQA 4:1 d256 and stayed in L2 only this way). Scores take four tokens at
//! a time, four independent addition chains, so the loads' latency overlaps;
//! each head's sum still runs over `j = 0, 1, ..` in order, and each bin
//! adds tokens in order, so the results are those of the one-lookup-at-a-
//! time loop bit for bit (the oracle holds both to 1e-5).
//!
//! The four-head vectors are SSE (the x86-64 baseline, so no per-ISA copy:
//! wider vectors would only help groups of eight or more heads, and the
//! lookups, not the additions, bound the loop); elsewhere `[f32; 4]`.

use super::simd::Isa;
use crate::vq::VqBook;

/// Sub-vectors whose codes [`score`] and [`accumulate`] unpack on the
/// stack (`head_dim / dim`; wider rows take a heap buffer).
const STACK_S: usize = 256;

/// The codes of a packed row (LSB first, `32 / bits` codes per word) as
/// table offsets, `codes[j] = (j * entries + code_j) * g` (u32: the
/// callers check `S * E * g` fits): word by word, so no division per code
/// (it cost more than the lookups); 8-bit codes are the row's bytes on a
/// little-endian machine, widened sixteen at a time by the compiler (the
/// shifts and masks were most of `score`'s time).
#[inline(always)]
fn offsets(row: &[u32], bits: u32, entries: usize, g: usize, codes: &mut [u32]) {
    let (e, g) = (entries as u32, g as u32);
    #[cfg(target_endian = "little")]
    if bits == 8 {
        // SAFETY: the row's `4 * len` bytes, read as bytes (any alignment).
        let bytes = unsafe { std::slice::from_raw_parts(row.as_ptr() as *const u8, 4 * row.len()) };
        for (j, (c, &b)) in codes.iter_mut().zip(bytes).enumerate() {
            *c = (j as u32 * e + b as u32) * g;
        }
        return;
    }
    let per = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    for (w, chunk) in row.iter().zip(codes.chunks_mut(per)) {
        let mut x = *w;
        for c in chunk.iter_mut() {
            *c = x & mask;
            x >>= bits;
        }
    }
    for (j, c) in codes.iter_mut().enumerate() {
        *c = (*c + j as u32 * e) * g;
    }
}

/// Four f32 lanes: SSE on x86-64 (its baseline), an array elsewhere.
#[cfg(target_arch = "x86_64")]
mod v4 {
    use std::arch::x86_64::*;
    pub type V = __m128;
    #[inline(always)]
    pub fn zero() -> V {
        // SAFETY: SSE is part of the x86-64 baseline.
        unsafe { _mm_setzero_ps() }
    }
    /// # Safety
    /// `p..p + 4` readable.
    #[inline(always)]
    pub unsafe fn load(p: *const f32) -> V {
        _mm_loadu_ps(p)
    }
    /// # Safety
    /// `p..p + 4` writable.
    #[inline(always)]
    pub unsafe fn store(p: *mut f32, v: V) {
        _mm_storeu_ps(p, v)
    }
    #[inline(always)]
    pub fn add(a: V, b: V) -> V {
        // SAFETY: SSE is part of the x86-64 baseline.
        unsafe { _mm_add_ps(a, b) }
    }
    #[inline(always)]
    pub fn mul(a: V, b: V) -> V {
        // SAFETY: SSE is part of the x86-64 baseline.
        unsafe { _mm_mul_ps(a, b) }
    }
    #[inline(always)]
    pub fn splat(x: f32) -> V {
        // SAFETY: SSE is part of the x86-64 baseline.
        unsafe { _mm_set1_ps(x) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod v4 {
    pub type V = [f32; 4];
    #[inline(always)]
    pub fn zero() -> V {
        [0.0; 4]
    }
    #[inline(always)]
    pub unsafe fn load(p: *const f32) -> V {
        std::ptr::read_unaligned(p as *const V)
    }
    #[inline(always)]
    pub unsafe fn store(p: *mut f32, v: V) {
        std::ptr::write_unaligned(p as *mut V, v)
    }
    #[inline(always)]
    pub fn add(a: V, b: V) -> V {
        [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]
    }
    #[inline(always)]
    pub fn mul(a: V, b: V) -> V {
        [a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3]]
    }
    #[inline(always)]
    pub fn splat(x: f32) -> V {
        [x; 4]
    }
}

/// The lookup table of `g` query heads (`q`, `g x D`, already scaled):
/// `lut[(j * E + c) * g + h] = q_h[j*M..(j+1)*M] . C_j[c]`. Per sub-vector
/// the query's channels are transposed so that a centroid's channel `k`
/// multiplies four heads at once (a broadcast, a multiply and an add);
/// each entry is still `((0 + q_0 c_0) + q_1 c_1) + ..`, the dot product
/// in channel order, without FMA.
pub(crate) fn build_lut(book: &VqBook, q: &[f32], g: usize, lut: &mut Vec<f32>) {
    let (m, e, s) = (book.dim, book.entries, book.subvectors);
    let d = m * s;
    lut.clear();
    lut.resize(g * s * e, 0.0);
    let mut qt = vec![0f32; m * g];
    for j in 0..s {
        for (k, row) in qt.chunks_exact_mut(g).enumerate() {
            for (hh, x) in row.iter_mut().enumerate() {
                *x = q[hh * d + j * m + k];
            }
        }
        for (c, cent) in book.table(j).chunks_exact(m).enumerate() {
            let out = &mut lut[(j * e + c) * g..][..g];
            let mut h0 = 0;
            while h0 + 4 <= g {
                let mut acc = v4::zero();
                for (k, &x) in cent.iter().enumerate() {
                    // SAFETY: `qt[k * g + h0..][..4]` is inside `qt` (`h0 + 4 <= g`).
                    let qv = unsafe { v4::load(qt.as_ptr().add(k * g + h0)) };
                    acc = v4::add(acc, v4::mul(v4::splat(x), qv));
                }
                // SAFETY: `out[h0..h0 + 4]` is inside `out`.
                unsafe { v4::store(out.as_mut_ptr().add(h0), acc) };
                h0 += 4;
            }
            for (hh, o) in out.iter_mut().enumerate().skip(h0) {
                *o = cent.iter().enumerate().map(|(k, x)| qt[k * g + hh] * x).sum();
            }
        }
    }
}

/// A buffer of `n` code offsets: on the stack when it fits.
macro_rules! code_buf {
    ($stack:ident, $heap:ident, $n:expr) => {{
        let n = $n;
        if n <= $stack.len() {
            &mut $stack[..n]
        } else {
            $heap.resize(n, 0);
            &mut $heap[..]
        }
    }};
}

/// Scores of `len` block rows starting at word `base` (`wpt` words a row):
/// `out[r * g + h] = sum_j lut[(j * E + code(r, j)) * g + h]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn score(
    isa: Isa,
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    lut: &[f32],
    g: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: the backend selects `Avx2` or `Avx512` only where the
        // CPU has AVX2.
        unsafe { score_avx2(book, bits, words, base, wpt, len, lut, g, out) };
        return;
    }
    let _ = isa;
    score_body(book, bits, words, base, wpt, len, lut, g, out)
}

/// [`score_body`] compiled with AVX2 (see [`accumulate_avx2`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_avx2(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    lut: &[f32],
    g: usize,
    out: &mut [f32],
) {
    score_body(book, bits, words, base, wpt, len, lut, g, out)
}

/// [`score`]'s loop, one body for every ISA.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_body(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    lut: &[f32],
    g: usize,
    out: &mut [f32],
) {
    let (e, s) = (book.entries, book.subvectors);
    // The unchecked reads below rely on these (the plan's invariants).
    assert!(lut.len() >= g * s * e && out.len() >= len * g && bits <= 16 && e == 1 << bits);
    assert!(g * s * e <= u32::MAX as usize, "vq table offsets fit u32");
    let mut stack = [0u32; 4 * STACK_S];
    let mut heap = Vec::new();
    let codes = code_buf!(stack, heap, 4 * s);
    let lp = lut.as_ptr();
    let mut r = 0;
    while r < len {
        let n = (len - r).min(4);
        for t in 0..4 {
            // A short last group repeats its last token (its sums are not stored).
            let row = &words[base + (r + t.min(n - 1)) * wpt..][..wpt];
            offsets(row, bits, e, g, &mut codes[t * s..(t + 1) * s]);
        }
        let (c01, c23) = codes.split_at(2 * s);
        let (c0, c1) = c01.split_at(s);
        let (c2, c3) = c23.split_at(s);
        let mut h0 = 0;
        while h0 + 4 <= g {
            let mut acc = [v4::zero(); 4];
            for j in 0..s {
                // SAFETY: an offset is `(j * E + code) * g` with `j < S` and
                // `code < E` (masked to `bits`, `E = 2^bits`), so offset +
                // `h0 + 3 < g` is below `S * E * g <= lut.len()`.
                unsafe {
                    acc[0] = v4::add(acc[0], v4::load(lp.add(c0[j] as usize + h0)));
                    acc[1] = v4::add(acc[1], v4::load(lp.add(c1[j] as usize + h0)));
                    acc[2] = v4::add(acc[2], v4::load(lp.add(c2[j] as usize + h0)));
                    acc[3] = v4::add(acc[3], v4::load(lp.add(c3[j] as usize + h0)));
                }
            }
            for (t, a) in acc.iter().enumerate().take(n) {
                let o = &mut out[(r + t) * g + h0..][..4];
                // SAFETY: `o` holds four floats.
                unsafe { v4::store(o.as_mut_ptr(), *a) };
            }
            h0 += 4;
        }
        for hh in h0..g {
            let mut acc = [0f32; 4];
            for j in 0..s {
                // SAFETY: as above, with `hh < g`.
                unsafe {
                    acc[0] += *lp.add(c0[j] as usize + hh);
                    acc[1] += *lp.add(c1[j] as usize + hh);
                    acc[2] += *lp.add(c2[j] as usize + hh);
                    acc[3] += *lp.add(c3[j] as usize + hh);
                }
            }
            for (t, a) in acc.iter().enumerate().take(n) {
                out[(r + t) * g + hh] = *a;
            }
        }
        r += n;
    }
}

/// Adds the weights `p[r * g + h]` of `len` block rows to their centroids'
/// bins: `bins[(j * E + code(r, j)) * g + h] += p[r * g + h]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate(
    isa: Isa,
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    p: &[f32],
    g: usize,
    bins: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: the backend selects `Avx2` or `Avx512` only where the
        // CPU has AVX2.
        unsafe { accumulate_avx2(book, bits, words, base, wpt, len, p, g, bins) };
        return;
    }
    let _ = isa;
    accumulate_body(book, bits, words, base, wpt, len, p, g, bins)
}

/// [`accumulate_body`] compiled with AVX2: the code offsets' 32-bit
/// multiplies become one instruction (the x86-64 baseline emulates them
/// with two `pmuludq` and shuffles, a third of `score`'s time), and the
/// offsets are computed inline rather than in a call per token. The same
/// body, so the same sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_avx2(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    p: &[f32],
    g: usize,
    bins: &mut [f32],
) {
    accumulate_body(book, bits, words, base, wpt, len, p, g, bins)
}

/// [`accumulate`]'s loop, one body for every ISA.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn accumulate_body(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    p: &[f32],
    g: usize,
    bins: &mut [f32],
) {
    let (e, s) = (book.entries, book.subvectors);
    // The unchecked accesses below rely on these (the plan's invariants).
    assert!(bins.len() >= g * s * e && p.len() >= len * g && bits <= 16 && e == 1 << bits);
    assert!(g * s * e <= u32::MAX as usize, "vq table offsets fit u32");
    let mut stack = [0u32; STACK_S];
    let mut heap = Vec::new();
    let codes = code_buf!(stack, heap, s);
    let bp = bins.as_mut_ptr();
    for r in 0..len {
        offsets(&words[base + r * wpt..][..wpt], bits, e, g, codes);
        let w = &p[r * g..][..g];
        let mut h0 = 0;
        while h0 + 4 <= g {
            // SAFETY: `w[h0..h0 + 4]` is in `w`; bin offsets as in `score`.
            unsafe {
                let pv = v4::load(w.as_ptr().add(h0));
                for &c in codes.iter() {
                    let b = bp.add(c as usize + h0);
                    v4::store(b, v4::add(v4::load(b), pv));
                }
            }
            h0 += 4;
        }
        for (hh, &x) in w.iter().enumerate().skip(h0) {
            for &c in codes.iter() {
                // SAFETY: `c + hh < S * E * g <= bins.len()`, as in `score`.
                unsafe { *bp.add(c as usize + hh) += x };
            }
        }
    }
}

/// The online softmax's rescaling of the bins: `bins[.. * g + h] *= corr[h]`
/// for the `g = corr.len()` heads (nothing when every factor is 1). Where
/// `g` divides 16 the factors are repeated into a 16-lane pattern that the
/// compiler multiplies a vector at a time: a loop over `g = 4` factors ran
/// one scalar multiply per bin, and this pass (128 KiB of bins for vq1 at
/// MQA 4:1, each time any head's maximum grows) was most of the decode.
pub(crate) fn rescale(bins: &mut [f32], corr: &[f32]) {
    let g = corr.len();
    if g == 0 || corr.iter().all(|&c| c == 1.0) {
        return;
    }
    let mut rest = &mut bins[..];
    if 16 % g == 0 {
        let pattern: [f32; 16] = std::array::from_fn(|i| corr[i % g]);
        let mut chunks = rest.chunks_exact_mut(16);
        for chunk in &mut chunks {
            for (x, c) in chunk.iter_mut().zip(&pattern) {
                *x *= c;
            }
        }
        // A 16-float chunk holds whole groups of `g`: the rest starts at a head 0.
        rest = chunks.into_remainder();
    }
    for row in rest.chunks_exact_mut(g) {
        for (x, c) in row.iter_mut().zip(corr) {
            *x *= c;
        }
    }
}

/// `acc[h][j*M..] += sum_c bins[(j * E + c) * g + h] * C_j[c]` for the `g`
/// heads (`acc` is `g x D`); empty bins are skipped. Sub-vectors of 4 or 8
/// channels keep their sums in a fixed-size array the compiler holds in
/// registers across the `E` centroids; each channel still adds the
/// centroids in order, as the generic loop does.
pub(crate) fn expand(book: &VqBook, bins: &[f32], g: usize, acc: &mut [f32]) {
    match book.dim {
        4 => expand_m::<4>(book, bins, g, acc),
        8 => expand_m::<8>(book, bins, g, acc),
        _ => expand_any(book, bins, g, acc),
    }
}

fn expand_m<const M: usize>(book: &VqBook, bins: &[f32], g: usize, acc: &mut [f32]) {
    let (e, s) = (book.entries, book.subvectors);
    let d = M * s;
    for j in 0..s {
        let table = &book.table(j)[..e * M];
        for hh in 0..g {
            let out: &mut [f32; M] = (&mut acc[hh * d + j * M..][..M]).try_into().expect("M channels");
            let mut sum = *out;
            for (c, cent) in table.chunks_exact(M).enumerate() {
                let w = bins[(j * e + c) * g + hh];
                if w != 0.0 {
                    for (o, x) in sum.iter_mut().zip(cent) {
                        *o += w * x;
                    }
                }
            }
            *out = sum;
        }
    }
}

fn expand_any(book: &VqBook, bins: &[f32], g: usize, acc: &mut [f32]) {
    let (m, e, s) = (book.dim, book.entries, book.subvectors);
    let d = m * s;
    for j in 0..s {
        for c in 0..e {
            let b = &bins[(j * e + c) * g..][..g];
            let x = book.centroid(j, c);
            for (hh, &w) in b.iter().enumerate() {
                if w != 0.0 {
                    for (o, x) in acc[hh * d + j * m..][..m].iter_mut().zip(x) {
                        *o += w * x;
                    }
                }
            }
        }
    }
}
