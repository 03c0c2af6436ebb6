//! Decode over `vq(...)` tensors (DESIGN.md §8): keys by asymmetric
//! distance computation, values by centroid sums or per-centroid bins.
//!
//! Keys: once per split, per query head `h` and sub-vector `j`, a table
//! `L[j][c][h] = q_h[j] . C_j[c]` over the `E` centroids of codebook `j`;
//! a token's score is then `sum_j L[j][code_j][h]`, `D / M` lookups
//! instead of `D` multiply-adds over decoded channels. The heads of the
//! GQA group are the table's innermost axis, so one code selects the
//! entries of every head at once, one 128-bit load per four heads; and all
//! `g` heads of a token touch `S` cache lines, not `g * S` (vq2's tables
//! are 256 KiB at MQA 4:1 d256 and stay in L2 only this way). Scores run
//! a few sub-vectors at a time over every row of a piece ([`score_body`]:
//! eight of vq2's 4 KiB tables, 32 KiB, stay in L1 while the piece's rows
//! look them up), each row's sums kept in the output between chunks, so
//! each head's sum still runs over `j = 0, 1, ..` in order. 8-bit codes
//! are read as bytes where they are used, with `E = 256` a constant, and
//! GQA's group sizes 4 and 8 are constants, so a lookup is a byte load, a
//! shift and an add from the table at a constant offset of the chunk's
//! first (no offsets buffer, no multiply: three instructions, where the
//! earlier four-rows-at-a-time loop took five and reloaded spilled
//! registers).
//!
//! Values ([`VqValues`]), where the group's `g * M` channels of a
//! sub-vector fill one vector exactly (vq2's 4-wide centroids at four
//! heads on AVX-512): `vacc[j][h][..M] += p_t[h] C_j[code_j]`, the weighted
//! centroid sums in a *transposed* accumulator, sub-vector major with the
//! group's heads inside, so that one centroid broadcast across the vector
//! (`vbroadcastf32x4`) serves every head with one FMA; sub-vectors eight at
//! a time, their sums in registers across the rows of a piece, moved into
//! the head-major output once per split. Elsewhere each token's weight is
//! added to the bin of its centroid in every sub-vector, `B[j][c][h] +=
//! p_t[h]` (one load-add-store per four heads), the bins follow the online
//! softmax's rescaling and are expanded once per split. The bins do less
//! arithmetic where a sub-vector needs more than one FMA (vq1's 8-wide
//! centroids: 0.40 against 0.56 ns per row and sub-vector in a standalone
//! loop with uniform codes), but their store-to-load chains make repeated
//! codes slow: with 16 codes in use, 1.3–6 ns against 0.5 for the sums.
//!
//! The four-head key and bin vectors are SSE (the x86-64 baseline, so no
//! per-ISA copy: the lookups, not the additions, bound the loop);
//! elsewhere `[f32; 4]`. The transposed sums use AVX-512 or AVX2 vectors,
//! in one body compiled once per ISA ([`run`]).

use super::simd::Isa;
#[cfg(target_arch = "x86_64")]
use super::width::{Avx2, Avx512};
use crate::vq::VqBook;

/// The codes of a packed row (LSB first, `32 / bits` codes per word) as
/// indices into the codebooks' centroids, `codes[j] = j * entries +
/// code_j` (u32: [`run`] checks that they fit): word by word, so no
/// division per code (it cost more than the lookups). Whole-byte codes are
/// read in place instead ([`Bytes`]).
#[inline(always)]
fn offsets(row: &[u32], bits: u32, entries: usize, codes: &mut [u32]) {
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
        *c += j as u32 * entries as u32;
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
///
/// On AVX-512, groups of four heads and 4- or 8-channel centroids take
/// four centroids a vector (the table's 16 floats for them are contiguous)
/// with the same products and sums: 11% of vq2's decode at MQA 4:1 d256,
/// where each of the four splits builds its 256 KiB table, was this loop.
pub(crate) fn build_lut(isa: Isa, book: &VqBook, q: &[f32], g: usize, lut: &mut Vec<f32>) {
    let (m, e, s) = (book.dim, book.entries, book.subvectors);
    let d = m * s;
    lut.clear();
    lut.resize(g * s * e, 0.0);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && g == 4 && e % 4 == 0 && q.len() >= g * d && book.data.len() >= s * e * m {
        // SAFETY: `Avx512` is selected only where the CPU has AVX-512F;
        // the lengths are checked above.
        match m {
            4 => return unsafe { lut4_avx512::<4>(book, q, lut) },
            8 => return unsafe { lut4_avx512::<8>(book, q, lut) },
            _ => {}
        }
    }
    let _ = isa;
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

/// [`build_lut`] for four heads and `M`-channel centroids (4 or 8): lane
/// `4 * i + h` of a vector is centroid `c + i`, head `h`; channel `k` is
/// one permute of the four centroids' `4 * M` floats times the four
/// heads' channel `k` repeated, added in channel order without FMA.
///
/// # Safety
/// AVX-512F; `q` holds `4 x D`, `lut` `4 * S * E` floats, `E % 4 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn lut4_avx512<const M: usize>(book: &VqBook, q: &[f32], lut: &mut [f32]) {
    use std::arch::x86_64::*;
    let (e, s) = (book.entries, book.subvectors);
    let d = M * s;
    let idx: [__m512i; M] = std::array::from_fn(|k| {
        let lane: [i32; 16] = std::array::from_fn(|l| ((l / 4) * M + k) as i32);
        _mm512_loadu_si512(lane.as_ptr() as *const _)
    });
    for j in 0..s {
        let qk: [__m512; M] = std::array::from_fn(|k| {
            let lane: [f32; 16] = std::array::from_fn(|l| q[(l % 4) * d + j * M + k]);
            _mm512_loadu_ps(lane.as_ptr())
        });
        let table = book.table(j).as_ptr();
        for c in (0..e).step_by(4) {
            let lo = _mm512_loadu_ps(table.add(c * M));
            let hi = if M > 4 {
                _mm512_loadu_ps(table.add(c * M + 16))
            } else {
                lo
            };
            let mut acc = _mm512_setzero_ps();
            for k in 0..M {
                let x = _mm512_permutex2var_ps(lo, idx[k], hi);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, qk[k]));
            }
            _mm512_storeu_ps(lut.as_mut_ptr().add((j * e + c) * 4), acc);
        }
    }
}

/// The packed rows of one piece of a block: `len` rows of `wpt` words
/// starting at word `base` of `words`, coded against `book` in `bits`-bit
/// codes, for a group of `g` query heads.
pub(crate) struct Piece<'a> {
    pub book: &'a VqBook,
    pub bits: u32,
    pub words: &'a [u32],
    pub base: usize,
    pub wpt: usize,
    pub len: usize,
    pub g: usize,
}

/// What a [`Piece`]'s rows are used for.
pub(crate) enum Job<'a> {
    /// `out[r * g + h] = sum_j lut[(j * E + code(r, j)) * g + h]`.
    Score { lut: &'a [f32], out: &'a mut [f32] },
    /// The rows' values weighted by `p[r * g + h]`, into `values`.
    Accum { p: &'a [f32], values: &'a mut VqValues },
}

/// The value sums of one split, in one of two forms (see the module docs):
/// where the group's `g * M` channels of a sub-vector fill one vector
/// exactly, the transposed sums `[S][g][M]`, one FMA per row and
/// sub-vector; otherwise the weights binned per centroid, `[S][E][g]`.
pub(crate) struct VqValues {
    buf: Vec<f32>,
    bins: bool,
    g: usize,
}

impl VqValues {
    pub(crate) fn new(isa: Isa, book: &VqBook, g: usize) -> VqValues {
        let bins = lanes(isa) == 0 || g * book.dim != lanes(isa);
        let n = g * book.subvectors * if bins { book.entries } else { book.dim };
        VqValues {
            buf: vec![0.0; n],
            bins,
            g,
        }
    }

    /// The online softmax's rescaling, `corr[h]` for head `h` (nothing
    /// when every factor is 1). Bins: where `g` divides 16 the factors are
    /// repeated into a 16-lane pattern that the compiler multiplies a
    /// vector at a time (a loop over `g = 4` factors ran one scalar
    /// multiply per bin, and this pass, 128 KiB of bins for vq1 at MQA 4:1
    /// each time any head's maximum grows, was most of the decode).
    pub(crate) fn rescale(&mut self, book: &VqBook, corr: &[f32]) {
        let g = self.g;
        if corr.iter().all(|&c| c == 1.0) {
            return;
        }
        if !self.bins {
            let m = book.dim;
            for run in self.buf.chunks_exact_mut(g * m) {
                for (x, c) in run.chunks_exact_mut(m).zip(corr) {
                    x.iter_mut().for_each(|x| *x *= c);
                }
            }
            return;
        }
        let mut rest = &mut self.buf[..];
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

    /// Adds the sums to the head-major output `acc` (`g x D`), once per
    /// split: transposed sums moved into place, or bins expanded,
    /// `acc[h][j*M..] += sum_c bins[(j * E + c) * g + h] * C_j[c]`, empty
    /// bins skipped (each channel adds the centroids in order).
    pub(crate) fn fold(&self, book: &VqBook, acc: &mut [f32]) {
        let (m, s, e, g) = (book.dim, book.subvectors, book.entries, self.g);
        let d = m * s;
        if !self.bins {
            for (j, run) in self.buf.chunks_exact(g * m).enumerate() {
                for (hh, x) in run.chunks_exact(m).enumerate() {
                    for (a, y) in acc[hh * d + j * m..][..m].iter_mut().zip(x) {
                        *a += y;
                    }
                }
            }
            return;
        }
        match m {
            4 => expand::<4>(book, &self.buf, g, acc),
            8 => expand::<8>(book, &self.buf, g, acc),
            _ => {
                for j in 0..s {
                    for hh in 0..g {
                        let out = &mut acc[hh * d + j * m..][..m];
                        for (c, cent) in book.table(j).chunks_exact(m).enumerate() {
                            let w = self.buf[(j * e + c) * g + hh];
                            if w != 0.0 {
                                for (o, x) in out.iter_mut().zip(cent) {
                                    *o += w * x;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// [`VqValues::fold`]'s expansion of bins for `M`-channel centroids: the
/// sums in a fixed-size array the compiler holds in registers across the
/// `E` centroids, not in memory as the runtime-`M` loop keeps them; each
/// channel still adds the centroids in order.
fn expand<const M: usize>(book: &VqBook, bins: &[f32], g: usize, acc: &mut [f32]) {
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

/// f32 lanes of the value vectors on `isa` (0: none).
fn lanes(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => 16,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => 8,
        _ => 0,
    }
}

/// Runs `job` over the rows of `pc` on instruction set `isa`.
pub(crate) fn run(isa: Isa, pc: &Piece, job: Job, offs: &mut Vec<u32>) {
    let (e, s, m) = (pc.book.entries, pc.book.subvectors, pc.book.dim);
    // The unchecked accesses below rely on these (the plan's invariants):
    // a code is masked to `bits` and `E = 2^bits`, so an index `j * E +
    // code` with `j < S` is below `S * E`.
    assert!(pc.bits <= 16 && e == 1 << pc.bits && pc.book.data.len() >= s * e * m);
    assert!(pc.words.len() >= pc.base + pc.len * pc.wpt && pc.wpt * 32 >= s * pc.bits as usize);
    assert!(s * e <= u32::MAX as usize, "vq code indices fit u32");
    match &job {
        Job::Score { lut, out } => assert!(lut.len() >= pc.g * s * e && out.len() >= pc.len * pc.g),
        Job::Accum { p, values } => {
            assert!(p.len() >= pc.len * pc.g && values.g == pc.g);
            assert!(values.buf.len() == pc.g * s * if values.bins { e } else { m });
            assert!(values.bins || lanes(isa) == pc.g * m);
        }
    }
    match isa {
        // SAFETY: the backend selects `Avx512` only where the CPU has
        // AVX-512F/DQ (and AVX2, FMA), `Avx2` only where it has AVX2 + FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run_avx512(pc, job, offs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run_avx2(pc, job, offs) },
        _ => run_body::<Portable>(pc, job, offs),
    }
}

/// [`run_body`] compiled with AVX-512: 16-lane value vectors; the loops of
/// keys and bins are the same as everywhere, with the wider ISA enabled.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
unsafe fn run_avx512(pc: &Piece, job: Job, offs: &mut Vec<u32>) {
    run_body::<Avx512>(pc, job, offs)
}

/// [`run_body`] compiled with AVX2 + FMA: 8-lane value vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(pc: &Piece, job: Job, offs: &mut Vec<u32>) {
    run_body::<Avx2>(pc, job, offs)
}

/// One body for every ISA: the codes come from the rows' bytes where
/// codes are bytes (little-endian), else from `offs`, unpacked once per
/// piece.
#[inline(always)]
fn run_body<W: Lanes>(pc: &Piece, job: Job, offs: &mut Vec<u32>) {
    let (e, s) = (pc.book.entries, pc.book.subvectors);
    #[cfg(target_endian = "little")]
    if pc.bits == 8 {
        let codes = Bytes {
            // SAFETY: the piece's words (checked in `run`).
            p: unsafe { pc.words.as_ptr().add(pc.base) } as *const u8,
            row: 4 * pc.wpt,
        };
        return job_body::<W, _>(pc, job, codes);
    }
    offs.resize(pc.len * s, 0);
    for (r, o) in offs.chunks_exact_mut(s).enumerate() {
        offsets(&pc.words[pc.base + r * pc.wpt..][..pc.wpt], pc.bits, e, o);
    }
    job_body::<W, _>(pc, job, Unpacked { o: offs, s })
}

/// Dispatches on the group size where a constant one saves a multiply
/// per lookup (GQA's 4 and 8 heads).
#[inline(always)]
fn job_body<W: Lanes, C: Codes>(pc: &Piece, job: Job, codes: C) {
    match job {
        Job::Score { lut, out } => match pc.g {
            4 => score_body::<C, 4>(pc, lut, out, codes),
            8 => score_body::<C, 8>(pc, lut, out, codes),
            _ => score_body::<C, 0>(pc, lut, out, codes),
        },
        Job::Accum { p, values } if values.bins => match pc.g {
            4 => bins_body::<C, 4>(pc, p, &mut values.buf, codes),
            8 => bins_body::<C, 8>(pc, p, &mut values.buf, codes),
            _ => bins_body::<C, 0>(pc, p, &mut values.buf, codes),
        },
        // SAFETY: `W`'s features are enabled (the caller's entry point);
        // `g * M = W::LANES` (checked in `run`).
        Job::Accum { p, values } => unsafe {
            match pc.book.dim {
                1 => vectors_body::<W, C, 1>(pc, p, &mut values.buf, codes),
                2 => vectors_body::<W, C, 2>(pc, p, &mut values.buf, codes),
                4 => vectors_body::<W, C, 4>(pc, p, &mut values.buf, codes),
                8 => vectors_body::<W, C, 8>(pc, p, &mut values.buf, codes),
                16 => vectors_body::<W, C, 16>(pc, p, &mut values.buf, codes),
                m => unreachable!("vq value vectors of {m}-channel centroids"),
            }
        },
    }
}

/// Where the codes of a piece are read from: `at(r, j) = j * E +
/// code(r, j)`, the index of row `r`'s centroid `j` in the codebooks.
trait Codes: Copy {
    /// # Safety
    /// `r < len`, `j < S`.
    unsafe fn at(&self, r: usize, j: usize) -> usize;
}

/// 8-bit codes: row `r`'s code `j` is its byte `j`; `E = 2^8` (checked
/// in [`run`]) is a constant here, so the compiler folds `j * E` of an
/// unrolled chunk into the load's displacement.
#[derive(Clone, Copy)]
struct Bytes {
    p: *const u8,
    row: usize,
}

impl Codes for Bytes {
    #[inline(always)]
    unsafe fn at(&self, r: usize, j: usize) -> usize {
        (j << 8) + opaque(*self.p.add(r * self.row + j) as usize)
    }
}

/// `x`, hidden from the optimiser at no cost (an empty `asm!` that
/// takes and gives it in a register): LLVM's SLP vectorizer otherwise
/// merges a row's adjacent code bytes into one vector load and takes each
/// address back out with `vpextrq` / `vextracti32x4` (11 vector-to-scalar
/// moves per 8 lookups in vq2's value loop, on the ports its FMAs need).
#[inline(always)]
fn opaque(x: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let mut x = x;
        // SAFETY: an empty template; it reads and writes only `x`'s register.
        unsafe { std::arch::asm!("/* {0} */", inout(reg) x, options(pure, nomem, nostack, preserves_flags)) };
        x
    }
    #[cfg(not(target_arch = "x86_64"))]
    x
}

/// Indices unpacked by [`offsets`], `[len][S]`.
#[derive(Clone, Copy)]
struct Unpacked<'a> {
    o: &'a [u32],
    s: usize,
}

impl Codes for Unpacked<'_> {
    #[inline(always)]
    unsafe fn at(&self, r: usize, j: usize) -> usize {
        *self.o.get_unchecked(r * self.s + j) as usize
    }
}

/// [`Job::Score`]; `G` the group size, or 0 for `pc.g`.
#[inline(always)]
fn score_body<C: Codes, const G: usize>(pc: &Piece, lut: &[f32], out: &mut [f32], codes: C) {
    let (s, e, len) = (pc.book.subvectors, pc.book.entries, pc.len);
    let g = if G == 0 { pc.g } else { G };
    let out = &mut out[..len * g];
    out.fill(0.0);
    // Sub-vectors `J` at a time over every row, so that the `J` tables in
    // use (`E * g` floats each) stay in L1 across the piece's rows.
    let table = e * g * 4;
    let mut j0 = 0;
    if 8 * table <= KEY_TABLES {
        while j0 + 8 <= s {
            score_chunk::<C, G, 8>(pc, lut, out, j0, codes);
            j0 += 8;
        }
    }
    if 4 * table <= KEY_TABLES {
        while j0 + 4 <= s {
            score_chunk::<C, G, 4>(pc, lut, out, j0, codes);
            j0 += 4;
        }
    }
    if 2 * table <= KEY_TABLES {
        while j0 + 2 <= s {
            score_chunk::<C, G, 2>(pc, lut, out, j0, codes);
            j0 += 2;
        }
    }
    while j0 < s {
        score_chunk::<C, G, 1>(pc, lut, out, j0, codes);
        j0 += 1;
    }
}

/// Bytes of key tables [`score_body`] keeps in use at once: eight of
/// vq2's 4 KiB tables at four heads (32 KiB, an L1 of 48 KiB holds them
/// with the piece's codes and sums).
const KEY_TABLES: usize = 32 << 10;

/// Sub-vectors `j0..j0 + J` of [`score_body`]: every row's sums (in
/// `out`) plus its `J` lookups, in order.
#[inline(always)]
fn score_chunk<C: Codes, const G: usize, const J: usize>(
    pc: &Piece,
    lut: &[f32],
    out: &mut [f32],
    j0: usize,
    codes: C,
) {
    let g = if G == 0 { pc.g } else { G };
    let (lp, op) = (lut.as_ptr(), out.as_mut_ptr());
    for r in 0..pc.len {
        // SAFETY: `r < len`, `j0 + k < S`; an index is below `S * E`, so
        // `index * g + h` (`h < g`) is below `S * E * g <= lut.len()`
        // (checked in `run`); `out` holds `len * g` floats.
        unsafe {
            let idx: [usize; J] = std::array::from_fn(|k| codes.at(r, j0 + k) * g);
            let o = op.add(r * g);
            let mut h0 = 0;
            while h0 + 4 <= g {
                let mut a = v4::load(o.add(h0));
                for &i in &idx {
                    a = v4::add(a, v4::load(lp.add(i + h0)));
                }
                v4::store(o.add(h0), a);
                h0 += 4;
            }
            for hh in h0..g {
                let mut a = *o.add(hh);
                for &i in &idx {
                    a += *lp.add(i + hh);
                }
                *o.add(hh) = a;
            }
        }
    }
}

/// [`Job::Accum`] into bins: `bins[(j * E + code(r, j)) * g + h] += p[r *
/// g + h]`, four heads a vector; `G` as in [`score_body`].
#[inline(always)]
fn bins_body<C: Codes, const G: usize>(pc: &Piece, p: &[f32], bins: &mut [f32], codes: C) {
    let s = pc.book.subvectors;
    let g = if G == 0 { pc.g } else { G };
    let bp = bins.as_mut_ptr();
    for r in 0..pc.len {
        let w = &p[r * g..][..g];
        let mut h0 = 0;
        while h0 + 4 <= g {
            // SAFETY: `w[h0..h0 + 4]` is in `w`; `index * g + h0 + 3 < S *
            // E * g = bins.len()` as in `score_body`.
            unsafe {
                let pv = v4::load(w.as_ptr().add(h0));
                for j in 0..s {
                    let b = bp.add(codes.at(r, j) * g + h0);
                    v4::store(b, v4::add(v4::load(b), pv));
                }
            }
            h0 += 4;
        }
        for (hh, &x) in w.iter().enumerate().skip(h0) {
            for j in 0..s {
                // SAFETY: as above, with `hh < g`.
                unsafe { *bp.add(codes.at(r, j) * g + hh) += x };
            }
        }
    }
}

/// The value vectors of one ISA (implemented for `width.rs`'s ISA types):
/// the arithmetic, a centroid repeated across the lanes and the group's
/// weights spread over them.
trait Lanes {
    type F: Copy;
    unsafe fn load(p: *const f32) -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);
    /// `a * b + c`.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// The `M` floats at `p`, repeated across the lanes.
    unsafe fn tile<const M: usize>(p: *const f32) -> Self::F;
    /// Lane `i` = `p[i / M]`, reading `p[..lanes / M]` only.
    unsafe fn spread<const M: usize>(p: *const f32) -> Self::F;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx512 {
    type F = std::arch::x86_64::__m512;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::F {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::F) {
        std::arch::x86_64::_mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        std::arch::x86_64::_mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn tile<const M: usize>(p: *const f32) -> Self::F {
        use std::arch::x86_64::*;
        match M {
            16 => _mm512_loadu_ps(p),
            8 => _mm512_broadcast_f32x8(_mm256_loadu_ps(p)),
            4 => _mm512_broadcast_f32x4(_mm_loadu_ps(p)),
            2 => _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(p as *const f64))),
            _ => _mm512_set1_ps(*p),
        }
    }
    #[inline(always)]
    unsafe fn spread<const M: usize>(p: *const f32) -> Self::F {
        use std::arch::x86_64::*;
        let i = |x: i32| x / M as i32;
        let idx = _mm512_set_epi32(
            i(15),
            i(14),
            i(13),
            i(12),
            i(11),
            i(10),
            i(9),
            i(8),
            i(7),
            i(6),
            i(5),
            i(4),
            i(3),
            i(2),
            i(1),
            0,
        );
        let x = _mm512_maskz_loadu_ps(((1u32 << (16 / M)) - 1) as u16, p);
        _mm512_permutexvar_ps(idx, x)
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    type F = std::arch::x86_64::__m256;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::F {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::F) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn tile<const M: usize>(p: *const f32) -> Self::F {
        use std::arch::x86_64::*;
        match M {
            8 => _mm256_loadu_ps(p),
            4 => {
                let x = _mm_loadu_ps(p);
                _mm256_set_m128(x, x)
            }
            2 => _mm256_castpd_ps(_mm256_set1_pd(std::ptr::read_unaligned(p as *const f64))),
            _ => _mm256_set1_ps(*p),
        }
    }
    #[inline(always)]
    unsafe fn spread<const M: usize>(p: *const f32) -> Self::F {
        use std::arch::x86_64::*;
        let n = (8 / M) as i32;
        let i = |x: i32| x / M as i32;
        let idx = _mm256_set_epi32(i(7), i(6), i(5), i(4), i(3), i(2), i(1), 0);
        let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0));
        _mm256_permutevar8x32_ps(_mm256_maskload_ps(p, live), idx)
    }
}

/// No value vectors: [`VqValues`] bins on this ISA, so the vector loop is
/// never instantiated with these.
struct Portable;

impl Lanes for Portable {
    type F = f32;
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    unsafe fn fmadd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    unsafe fn tile<const M: usize>(p: *const f32) -> f32 {
        *p
    }
    unsafe fn spread<const M: usize>(p: *const f32) -> f32 {
        *p
    }
}

/// [`Job::Accum`] into transposed sums, `vacc[(j * g + h) * M + k] +=
/// p[r * g + h] * C_j[code(r, j)][k]`, the group's `g * M` lanes one vector:
/// sub-vectors eight at a time, their sums in registers across the rows.
///
/// # Safety
/// `W`'s features are enabled; `g * M` is `W`'s lanes; `run`'s checks hold.
#[inline(always)]
unsafe fn vectors_body<W: Lanes, C: Codes, const M: usize>(pc: &Piece, p: &[f32], vacc: &mut [f32], codes: C) {
    let s = pc.book.subvectors;
    let mut j0 = 0;
    while j0 + 8 <= s {
        chunk::<W, C, M, 8>(pc, p, vacc, j0, codes);
        j0 += 8;
    }
    while j0 + 2 <= s {
        chunk::<W, C, M, 2>(pc, p, vacc, j0, codes);
        j0 += 2;
    }
    if j0 < s {
        chunk::<W, C, M, 1>(pc, p, vacc, j0, codes);
    }
}

/// Sub-vectors `j0..j0 + J` of [`vectors_body`] over every row.
///
/// # Safety
/// As [`vectors_body`], and `j0 + J <= S`.
#[inline(always)]
unsafe fn chunk<W: Lanes, C: Codes, const M: usize, const J: usize>(
    pc: &Piece,
    p: &[f32],
    vacc: &mut [f32],
    j0: usize,
    codes: C,
) {
    let (g, book) = (pc.g, pc.book.data.as_ptr());
    let run = g * M;
    let mut a = [W::load(vacc.as_ptr().add(j0 * run)); J];
    for (k, x) in a.iter_mut().enumerate().skip(1) {
        *x = W::load(vacc.as_ptr().add((j0 + k) * run));
    }
    for r in 0..pc.len {
        let w = W::spread::<M>(p.as_ptr().add(r * g));
        for (k, x) in a.iter_mut().enumerate() {
            *x = W::fmadd(w, W::tile::<M>(book.add(codes.at(r, j0 + k) * M)), *x);
        }
    }
    for (k, x) in a.iter().enumerate() {
        W::store(vacc.as_mut_ptr().add((j0 + k) * run), *x);
    }
}
