//! Fused decode of codec-pipeline tensors (the `codec2` / `codec15`
//! presets and their kin): token-axis codes of 1 to 4 bits, Lloyd–Max or
//! uniform levels, one norm (or scale and zero point) per group of
//! channels, sparse outliers, in the transformed (rotated, centered) domain.
//!
//! The generic codec path decodes every row to f32 through the cache's row
//! reader and then runs the ordinary loops over that copy; this one consumes
//! the codes where they lie:
//! - **Codes to levels by a register table lookup.** A 2^b-entry table of
//!   levels (Lloyd–Max, or `0, 1, 2, ...` for uniform codes) sits in one
//!   zmm register; sixteen codes are fetched as words (a masked load of the
//!   few words they occupy), spread one word per lane (`vpermd`), shifted
//!   and masked (`vpsrlvd`, `vpandd`) and looked up (`vpermps`): five
//!   instructions per sixteen channels whatever the code width, 3-bit codes
//!   (ten to a word) included.
//! - **The norm folded out of the inner loops.** Keys: `q . (s L[c]) =
//!   s (q . L[c])`, one multiply per (token, head, group) on the partial dot
//!   product. Values: `sum_t p_t s_t L[c_t]`, the norm folded into the
//!   softmax weight once per (token, head, group). Uniform codes add
//!   `z sum_group q` to a score and `sum_t p_t z_t` to each channel of a
//!   value group.
//! - **Outliers as a sparse correction**: `q[c_k] v_k` added to a score,
//!   `p v_k` to one channel of the rotated value sum, per stored outlier.
//! - The query is rotated once per split and the value sum un-rotated once
//!   per split by the caller (`kernel.rs`), which also adds the means.
//!
//! Two implementations over the same plan: AVX-512F (keys four heads at a
//! time, two accumulator chains per head, the four horizontal sums in one
//! shuffle tree; values chunk by chunk with the accumulators of four heads
//! in registers across the tokens of a piece) and a portable one (a row
//! decoded word by word into a small buffer, then sixteen-lane loops the
//! compiler vectorises), used on AVX2 and scalar machines.
//!
//! Rounding differs from the reference (`s * L[c]` per element, then the
//! dot product) by the order of operations only: the norm multiplies a sum
//! instead of each term (checked against the oracle in
//! `tests/cpu_vs_reference.rs`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::simd::Isa;
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Codec, Dtype, Levels, ScaleDtype, Scheme, Tensor};

/// Runs `self.$f::<H, ONE>(args)` for each quad of heads `h0 = 0, 4, ..`
/// below `g`, `H` the heads left (at most four) and `ONE` whether a
/// chunk's codes share one word (1- and 2-bit codes): the head and code
/// width dispatch of the AVX-512 score and value loops, written once. Both
/// are constants so that the accumulators stay in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_head_quads {
    ($self:ident . $f:ident, $g:expr, |$h0:ident| ($($arg:expr),*)) => {{
        let g = $g;
        let mut $h0 = 0;
        while $h0 < g {
            match ($self.bits <= 2, g - $h0) {
                (true, 1) => $self.$f::<1, true>($($arg),*),
                (true, 2) => $self.$f::<2, true>($($arg),*),
                (true, 3) => $self.$f::<3, true>($($arg),*),
                (true, _) => $self.$f::<4, true>($($arg),*),
                (false, 1) => $self.$f::<1, false>($($arg),*),
                (false, 2) => $self.$f::<2, false>($($arg),*),
                (false, 3) => $self.$f::<3, false>($($arg),*),
                (false, _) => $self.$f::<4, false>($($arg),*),
            }
            $h0 += 4;
        }
    }};
}

/// Where the sixteen codes of one chunk of channels lie in a token's row.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    /// First word of the row they occupy.
    w0: usize,
    /// Words `w0..w0 + words` hold them: the mask of a load of that many.
    mask: u16,
    /// Per lane: the word (relative to `w0`) and the shift of its code.
    idx: [i32; 16],
    shift: [i32; 16],
}

/// One codec tensor's decoding plan (built once per decode call).
#[derive(Clone, Debug)]
pub(crate) struct CodecRows {
    bits: u32,
    /// Codes per word (`32 / bits`; codes never straddle words).
    per: usize,
    /// Channels per norm (a multiple of 16) and groups per token.
    group: usize,
    ng: usize,
    d: usize,
    /// The levels a code stands for: Lloyd–Max levels, or the code itself
    /// for uniform levels (then `x = s c + z`).
    table: [f32; 16],
    uniform: bool,
    scale: ScaleDtype,
    dtype: Dtype,
    tl: TensorLayout,
    chunks: Vec<Chunk>,
    avx512: bool,
    /// The portable loops compiled for AVX2 + FMA (else for the baseline).
    avx2: bool,
}

impl CodecRows {
    /// The plan for tensor `t` of scheme `s`, if this path decodes it:
    /// token-axis codes of 1 to 4 bits in groups of a multiple of 16
    /// channels (little-endian targets; the generic path takes the rest).
    /// `levels` is the codec's table ([`crate::quant::TensorCodec::levels`]:
    /// Lloyd–Max, or a calibrated `nuq` codebook; ignored for uniform codes).
    pub fn of(s: &Scheme, t: Tensor, tl: TensorLayout, d: usize, isa: Isa, levels: &[f32]) -> Option<CodecRows> {
        let Codec::Quant(q) = s.codec(t) else {
            return None;
        };
        let group = q.group as usize;
        if q.axis != Axis::Token
            || !(1..=4).contains(&q.bits)
            || !group.is_multiple_of(16)
            || !d.is_multiple_of(group)
            || cfg!(target_endian = "big")
        {
            return None;
        }
        let uniform = q.levels == Levels::Uniform;
        let mut table = [0f32; 16];
        if uniform {
            for (c, x) in table.iter_mut().enumerate() {
                *x = c as f32;
            }
        } else {
            if levels.len() != 1 << q.bits {
                return None;
            }
            table[..levels.len()].copy_from_slice(levels);
        }
        let per = (32 / q.bits) as usize;
        let chunks = (0..d / 16)
            .map(|k| {
                let w0 = 16 * k / per;
                let mut idx = [0i32; 16];
                let mut shift = [0i32; 16];
                for i in 0..16 {
                    let c = 16 * k + i;
                    idx[i] = (c / per - w0) as i32;
                    shift[i] = ((c % per) as u32 * q.bits) as i32;
                }
                Chunk {
                    w0,
                    mask: ((1u32 << ((16 * k + 15) / per - w0 + 1)) - 1) as u16,
                    idx,
                    shift,
                }
            })
            .collect();
        Some(CodecRows {
            bits: q.bits,
            per,
            group,
            ng: d / group,
            d,
            table,
            uniform,
            scale: q.scale,
            dtype: s.dtype,
            tl,
            chunks,
            avx512: isa == Isa::Avx512,
            avx2: isa == Isa::Avx2,
        })
    }

    /// Uniform levels: scores need `sum_group q` per (head, group).
    pub fn uniform(&self) -> bool {
        self.uniform
    }

    /// `sum_{c in group} q_c` per (head, group) of a `[g][d]` query, `[g][ng]`
    /// (the zero points' share of a uniform score).
    pub fn group_sums(&self, q: &[f32], g: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(g * self.ng);
        for h in 0..g {
            for gi in 0..self.ng {
                out.push(q[h * self.d + gi * self.group..][..self.group].iter().sum());
            }
        }
        out
    }

    /// Norm (scale) and zero point of group `gi` of token `off` of `part`.
    #[inline(always)]
    fn params(&self, part: &[u32], off: usize, gi: usize) -> (f32, f32) {
        let i = off * self.ng + gi;
        let read = |base: usize| match self.scale {
            ScaleDtype::F16 => f16_to_f32((part[base + i / 2] >> (16 * (i % 2))) as u16),
            ScaleDtype::F32 => f32::from_bits(part[base + i]),
        };
        let s = read(self.tl.scales_offset);
        let z = if self.uniform { read(self.tl.zeros_offset) } else { 0.0 };
        (s, z)
    }

    /// Outlier `k` of token `off`: its channel and stored correction.
    #[inline(always)]
    fn outlier(&self, part: &[u32], off: usize, k: usize) -> (usize, f32) {
        let tl = &self.tl;
        let iw = part[tl.outlier_idx_offset + off * tl.outlier_idx_words + k / 2];
        let c = ((iw >> (16 * (k % 2))) & 0xffff) as usize;
        let vw = tl.outlier_val_offset + off * tl.outlier_val_words;
        let v = match self.dtype {
            Dtype::F32 => f32::from_bits(part[vw + k]),
            Dtype::F16 => f16_to_f32((part[vw + k / 2] >> (16 * (k % 2))) as u16),
            Dtype::Bf16 => f32::from_bits((part[vw + k / 2] >> (16 * (k % 2))) << 16),
        };
        // A corrupted index would be a cache bug; stay in bounds regardless.
        (c.min(self.d - 1), v)
    }

    /// The table levels of token `off`'s codes (no norm), word by word.
    fn levels_row(&self, part: &[u32], off: usize, out: &mut [f32]) {
        let wpt = self.tl.words_per_token;
        let row = &part[self.tl.codes_offset + off * wpt..][..wpt];
        let mask = (1u32 << self.bits) - 1;
        for (chunk, &w) in out[..self.d].chunks_mut(self.per).zip(row) {
            let mut w = w;
            for o in chunk {
                *o = self.table[(w & mask) as usize];
                w >>= self.bits;
            }
        }
    }

    /// Scores of tokens `off..off + n` of `part` (this KV head's block part)
    /// in the transformed domain: `out[r * g + h] = q_h . x_r` for the `g`
    /// heads of `q` (`[g][d]`, already rotated), outliers included.
    /// `qsum` is [`Self::group_sums`] of `q` for uniform levels (else unused).
    #[allow(clippy::too_many_arguments)]
    pub fn score(&self, part: &[u32], off: usize, n: usize, q: &[f32], qsum: &[f32], g: usize, out: &mut [f32]) {
        assert!(
            q.len() >= g * self.d
                && out.len() >= n * g
                && off + n <= self.tl.block_tokens
                && part.len() >= self.tl.words,
            "codec score: rows outside the part"
        );
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // SAFETY: `avx512` is set only where `Isa::select` found
            // AVX-512F; the bounds are asserted above.
            unsafe { by_head_quads!(self.score_avx512, g, |h0| (part, off, n, q, h0, g, out)) }
            self.score_extras(part, off, n, q, qsum, g, false, out);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `avx2` is set only where `Isa::select` found AVX2 + FMA.
            unsafe { self.score_portable_avx2(part, off, n, q, g, out) };
            self.score_extras(part, off, n, q, qsum, g, true, out);
            return;
        }
        self.score_portable::<false>(part, off, n, q, g, out);
        self.score_extras(part, off, n, q, qsum, g, true, out);
    }

    /// The portable loops of [`Self::score`] compiled for AVX2 + FMA: the
    /// same source, vectorised eight lanes wide by the compiler.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_portable_avx2(&self, part: &[u32], off: usize, n: usize, q: &[f32], g: usize, out: &mut [f32]) {
        self.score_portable::<true>(part, off, n, q, g, out)
    }

    /// [`Self::score`] without extras, portable: each row's levels decoded
    /// word by word into a buffer, then sixteen-lane dot products.
    /// `AVX2`: rows decoded by [`Self::levels_row_avx2`] (the caller has
    /// AVX2 + FMA).
    #[inline(always)]
    fn score_portable<const AVX2: bool>(
        &self,
        part: &[u32],
        off: usize,
        n: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
    ) {
        let d = self.d;
        let mut x = vec![0f32; d];
        for r in 0..n {
            self.levels_row_any::<AVX2>(part, off + r, &mut x);
            for gi in 0..self.ng {
                let (s, _) = self.params(part, off + r, gi);
                let xs = &x[gi * self.group..][..self.group];
                for h in 0..g {
                    let qs = &q[h * d + gi * self.group..][..self.group];
                    let dot = dot16(qs, xs);
                    if gi == 0 {
                        out[r * g + h] = s * dot;
                    } else {
                        out[r * g + h] += s * dot;
                    }
                }
            }
        }
    }

    /// Zero points (uniform levels) and, with `outliers`, the outliers of
    /// [`Self::score`] (the AVX-512 loops add those themselves).
    #[allow(clippy::too_many_arguments)]
    fn score_extras(
        &self,
        part: &[u32],
        off: usize,
        n: usize,
        q: &[f32],
        qsum: &[f32],
        g: usize,
        outliers: bool,
        out: &mut [f32],
    ) {
        if !(self.uniform || (outliers && self.tl.outliers > 0)) {
            return;
        }
        let d = self.d;
        for r in 0..n {
            if self.uniform {
                for gi in 0..self.ng {
                    let (_, z) = self.params(part, off + r, gi);
                    for h in 0..g {
                        out[r * g + h] += z * qsum[h * self.ng + gi];
                    }
                }
            }
            if !outliers {
                continue;
            }
            // A token's few outliers read once, each head's correction
            // summed in a register (not through `out`).
            let mut ol = [(0usize, 0f32); 16];
            let k = self.tl.outliers.min(16);
            for (i, o) in ol[..k].iter_mut().enumerate() {
                *o = self.outlier(part, off + r, i);
            }
            for (h, o) in out[r * g..(r + 1) * g].iter_mut().enumerate() {
                let qh = &q[h * d..(h + 1) * d];
                let mut x = 0f32;
                for &(c, v) in &ol[..k] {
                    x += qh[c] * v;
                }
                for i in k..self.tl.outliers {
                    let (c, v) = self.outlier(part, off + r, i);
                    x += qh[c] * v;
                }
                *o += x;
            }
        }
    }

    /// Adds `sum_r p[r * g + h] x_r` (tokens `off..off + n` of `part`, in
    /// the transformed domain, outliers included) to `acc[h]` (`[g][d]`).
    /// `wts` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn accum(&self, part: &[u32], off: usize, n: usize, p: &[f32], g: usize, acc: &mut [f32], wts: &mut Vec<f32>) {
        let (d, ng) = (self.d, self.ng);
        assert!(
            p.len() >= n * g && acc.len() >= g * d && off + n <= self.tl.block_tokens && part.len() >= self.tl.words,
            "codec accum: rows outside the part"
        );
        // The norm folded into the softmax weights: `[ng][n][g]`; and, for
        // uniform levels, each group's `sum_r p z` per head, `[g][ng]`.
        wts.clear();
        wts.resize(ng * n * g + g * ng, 0.0);
        let (w, zs) = wts.split_at_mut(ng * n * g);
        for r in 0..n {
            let pr = &p[r * g..(r + 1) * g];
            for gi in 0..ng {
                let (s, z) = self.params(part, off + r, gi);
                // Heads innermost and contiguous: vector multiplies.
                for (w, &pr) in w[(gi * n + r) * g..][..g].iter_mut().zip(pr) {
                    *w = pr * s;
                }
                // Table levels have no zero point (`params` reads none).
                if self.uniform {
                    for h in 0..g {
                        zs[h * ng + gi] += pr[h] * z;
                    }
                }
            }
        }
        let mut done = false;
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // SAFETY: AVX-512F was detected (see `score`); bounds asserted.
            unsafe { by_head_quads!(self.accum_avx512, g, |h0| (part, off, n, w, h0, g, acc)) }
            done = true;
        }
        #[cfg(target_arch = "x86_64")]
        if !done && self.avx2 {
            // SAFETY: `avx2` is set only where `Isa::select` found AVX2 + FMA.
            unsafe { self.accum_portable_avx2(part, off, n, w, g, acc) };
            done = true;
        }
        if !done {
            self.accum_portable::<false>(part, off, n, w, g, acc);
        }
        if self.uniform {
            for h in 0..g {
                for gi in 0..ng {
                    let z = zs[h * ng + gi];
                    for a in &mut acc[h * d + gi * self.group..][..self.group] {
                        *a += z;
                    }
                }
            }
        }
        if self.tl.outliers > 0 {
            for r in 0..n {
                let pr = &p[r * g..(r + 1) * g];
                for k in 0..self.tl.outliers {
                    let (c, v) = self.outlier(part, off + r, k);
                    for (a, &pr) in acc[c..].iter_mut().step_by(d).zip(pr) {
                        *a += pr * v;
                    }
                }
            }
        }
    }
}

impl CodecRows {
    /// The portable loops of [`Self::accum`] compiled for AVX2 + FMA.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accum_portable_avx2(&self, part: &[u32], off: usize, n: usize, w: &[f32], g: usize, acc: &mut [f32]) {
        self.accum_portable::<true>(part, off, n, w, g, acc)
    }

    /// The weighted rows of [`Self::accum`] (weights `[ng][n][g]` with the
    /// norms folded in), portable: levels decoded into a buffer, then one
    /// multiply-add per channel and head.
    #[inline(always)]
    fn accum_portable<const AVX2: bool>(
        &self,
        part: &[u32],
        off: usize,
        n: usize,
        w: &[f32],
        g: usize,
        acc: &mut [f32],
    ) {
        let (d, ng) = (self.d, self.ng);
        let mut x = vec![0f32; d];
        for r in 0..n {
            self.levels_row_any::<AVX2>(part, off + r, &mut x);
            for gi in 0..ng {
                let xs = &x[gi * self.group..][..self.group];
                for h in 0..g {
                    let wr = w[(gi * n + r) * g + h];
                    let a = &mut acc[h * d + gi * self.group..][..self.group];
                    for (a, x) in a.iter_mut().zip(xs) {
                        *a += wr * x;
                    }
                }
            }
        }
    }
}

impl CodecRows {
    /// [`Self::levels_row`], or with `AVX2` (only from code compiled for
    /// AVX2 + FMA) [`Self::levels_row_avx2`].
    #[inline(always)]
    fn levels_row_any<const AVX2: bool>(&self, part: &[u32], off: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if AVX2 {
            let wpt = self.tl.words_per_token;
            assert!(out.len() >= self.d && part.len() >= self.tl.codes_offset + (off + 1) * wpt);
            // SAFETY: AVX2 is there (the const parameter's contract); the
            // row and `out` are in bounds (asserted).
            unsafe { self.levels_row_avx2(part.as_ptr().add(self.tl.codes_offset + off * wpt), out) };
            return;
        }
        self.levels_row(part, off, out)
    }

    /// The levels of one row, eight channels per step: the words of a
    /// 16-channel chunk loaded once (masked), spread by `vpermd`, shifted,
    /// masked and looked up by `vpermps` (two lookups and a blend for
    /// 16-entry tables).
    ///
    /// # Safety
    /// AVX2; `row` points at a token's codes, `out` holds `d` floats.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn levels_row_avx2(&self, row: *const u32, out: &mut [f32]) {
        let lo = _mm256_loadu_ps(self.table.as_ptr());
        let hi = _mm256_loadu_ps(self.table.as_ptr().add(8));
        let mask = _mm256_set1_epi32((1i32 << self.bits) - 1);
        let seven = _mm256_set1_epi32(7);
        let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (k, ch) in self.chunks.iter().enumerate() {
            let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(ch.mask.count_ones() as i32), iota);
            let words = _mm256_maskload_epi32(row.add(ch.w0) as *const i32, live);
            for half in 0..2 {
                let idx = _mm256_loadu_si256(ch.idx.as_ptr().add(8 * half) as *const _);
                let shift = _mm256_loadu_si256(ch.shift.as_ptr().add(8 * half) as *const _);
                let w = _mm256_permutevar8x32_epi32(words, idx);
                let c = _mm256_and_si256(_mm256_srlv_epi32(w, shift), mask);
                let mut x = _mm256_permutevar8x32_ps(lo, c);
                if self.bits == 4 {
                    let big = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, seven));
                    x = _mm256_blendv_ps(x, _mm256_permutevar8x32_ps(hi, c), big);
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(16 * k + 8 * half), x);
            }
        }
    }
}

/// A finite f16 as f32, exactly, in three integer operations and a
/// multiply (inlined where the `half` crate's call checks for F16C on every
/// value): the sign, exponent and mantissa moved to f32's places make
/// `x * 2^-112`, and `2^112` is exact. Norms and outlier corrections are
/// finite (the cache refuses to store anything else); an infinity would read
/// as 2^16-ish, a NaN as a finite number.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    f32::from_bits(((h & 0x8000) << 16) | ((h & 0x7fff) << 13)) * f32::from_bits(0x7780_0000)
}

/// `a . b` with sixteen partial sums (which the compiler keeps in vector
/// registers); lengths are multiples of 16 here.
#[inline]
fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 16];
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for i in 0..16 {
            s[i] += x[i] * y[i];
        }
    }
    s.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
impl CodecRows {
    /// The sixteen levels of chunk `ch` of the row at `row` (no norm).
    /// `ONE`: the chunk's codes share one word (1- and 2-bit codes), which
    /// is broadcast instead of loaded and spread.
    ///
    /// # Safety
    /// AVX-512F; `row` points at a token's codes (words `w0..w0 + words`
    /// of the chunk are readable; the masked load touches no others).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn levels16<const ONE: bool>(ch: &Chunk, row: *const u32, table: __m512, mask: __m512i) -> __m512 {
        let w = if ONE {
            _mm512_set1_epi32(*row.add(ch.w0) as i32)
        } else {
            let words = _mm512_maskz_loadu_epi32(ch.mask, row.add(ch.w0) as *const i32);
            _mm512_permutexvar_epi32(_mm512_loadu_si512(ch.idx.as_ptr() as *const _), words)
        };
        // A rotate, not a shift: the code's bits come down alike (a code
        // never straddles its word), and `vprorvd` has no out-of-range
        // counts to emulate, where `_mm512_srlv_epi32` compiles to a compare
        // and a masked shift.
        let c = _mm512_and_si512(
            _mm512_rorv_epi32(w, _mm512_loadu_si512(ch.shift.as_ptr() as *const _)),
            mask,
        );
        _mm512_permutexvar_ps(c, table)
    }

    /// Scores of heads `h0..h0 + H` (see [`Self::score`]; no extras):
    /// blocks of four tokens, then single tokens.
    ///
    /// # Safety
    /// AVX-512F; the caller checked that the rows, `q` and `out` are in bounds.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn score_avx512<const H: usize, const ONE: bool>(
        &self,
        part: &[u32],
        off: usize,
        n: usize,
        q: &[f32],
        h0: usize,
        g: usize,
        out: &mut [f32],
    ) {
        let mut r = 0;
        while r + 4 <= n {
            self.score_tokens::<H, ONE, 4>(part, off + r, q, h0, g, out.as_mut_ptr().add(r * g));
            r += 4;
        }
        while r < n {
            self.score_tokens::<H, ONE, 1>(part, off + r, q, h0, g, out.as_mut_ptr().add(r * g));
            r += 1;
        }
    }

    /// Scores of tokens `off..off + T`, heads `h0..h0 + H`, into `out[t * g + h0 + j]`.
    /// Each chunk's query vectors and code positions are loaded once for the
    /// `T` tokens: on a core that loads one zmm per cycle (Zen 4) the loads,
    /// not the arithmetic, bound a token at a time. `T x H` accumulators.
    ///
    /// # Safety
    /// AVX-512F; rows `off..off + T` and `out[..T * g]` are in bounds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn score_tokens<const H: usize, const ONE: bool, const T: usize>(
        &self,
        part: &[u32],
        off: usize,
        q: &[f32],
        h0: usize,
        g: usize,
        out: *mut f32,
    ) {
        let d = self.d;
        let wpt = self.tl.words_per_token;
        let table = _mm512_loadu_ps(self.table.as_ptr());
        let mask = _mm512_set1_epi32((1i32 << self.bits) - 1);
        let per_group = self.group / 16;
        let qp = q.as_ptr().add(h0 * d);
        let z = _mm512_setzero_ps();
        let mut rows = [std::ptr::null::<u32>(); T];
        for t in 0..T {
            rows[t] = part.as_ptr().add(self.tl.codes_offset + (off + t) * wpt);
        }
        for (gi, chunks) in self.chunks.chunks_exact(per_group).enumerate() {
            let mut a = [[z; H]; T];
            for (kk, ch) in chunks.iter().enumerate() {
                let k = gi * per_group + kk;
                let idx = _mm512_loadu_si512(ch.idx.as_ptr() as *const _);
                let shift = _mm512_loadu_si512(ch.shift.as_ptr() as *const _);
                let mut x = [z; T];
                for t in 0..T {
                    let w = if ONE {
                        _mm512_set1_epi32(*rows[t].add(ch.w0) as i32)
                    } else {
                        let words = _mm512_maskz_loadu_epi32(ch.mask, rows[t].add(ch.w0) as *const i32);
                        _mm512_permutexvar_epi32(idx, words)
                    };
                    // a rotate: see `levels16`
                    let c = _mm512_and_si512(_mm512_rorv_epi32(w, shift), mask);
                    x[t] = _mm512_permutexvar_ps(c, table);
                }
                for j in 0..H {
                    let qv = _mm512_loadu_ps(qp.add(j * d + 16 * k));
                    for t in 0..T {
                        a[t][j] = _mm512_fmadd_ps(qv, x[t], a[t][j]);
                    }
                }
            }
            for t in 0..T {
                let (s, _) = self.params(part, off + t, gi);
                let o = out.add(t * g + h0);
                let mut sums = [0f32; 4];
                if H == 4 {
                    _mm_storeu_ps(sums.as_mut_ptr(), hsum4(a[t][0], a[t][1], a[t][2], a[t][3]));
                } else {
                    for j in 0..H {
                        sums[j] = _mm512_reduce_add_ps(a[t][j]);
                    }
                }
                if gi == 0 {
                    // The token's outliers, while its row is at hand.
                    let mut e = [0f32; 4];
                    for kk in 0..self.tl.outliers {
                        let (c, v) = self.outlier(part, off + t, kk);
                        for j in 0..H {
                            e[j] += *qp.add(j * d + c) * v;
                        }
                    }
                    for j in 0..H {
                        *o.add(j) = s * sums[j] + e[j];
                    }
                } else {
                    for j in 0..H {
                        *o.add(j) += s * sums[j];
                    }
                }
            }
        }
    }

    /// Adds the weighted rows to heads `h0..h0 + H` of `acc`; `w` holds the
    /// weights with the norms folded in, `[ng][n][g]` (see [`Self::accum`]).
    ///
    /// # Safety
    /// AVX-512F; the caller checked the bounds.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn accum_avx512<const H: usize, const ONE: bool>(
        &self,
        part: &[u32],
        off: usize,
        n: usize,
        w: &[f32],
        h0: usize,
        g: usize,
        acc: &mut [f32],
    ) {
        let d = self.d;
        let wpt = self.tl.words_per_token;
        let table = _mm512_loadu_ps(self.table.as_ptr());
        let mask = _mm512_set1_epi32((1i32 << self.bits) - 1);
        let per_group = self.group / 16;
        let rows = part.as_ptr().add(self.tl.codes_offset + off * wpt);
        let ap = acc.as_mut_ptr().add(h0 * d);
        let wp = w.as_ptr();
        // Chunks four at a time (then a pair, then one): with four heads,
        // sixteen independent accumulators, and each weight broadcast
        // serves four chunks (a 512-bit load issues once per cycle on Zen 4,
        // so broadcasts, not FMAs, bound two at a time).
        for (gi, chunks) in self.chunks.chunks_exact(per_group).enumerate() {
            let wg = wp.add(gi * n * g + h0);
            let mut k = gi * per_group;
            let mut quads = chunks.chunks_exact(4);
            for c in &mut quads {
                self.accum_block::<H, ONE, 4>(c, k, rows, n, wg, g, ap, table, mask);
                k += 4;
            }
            let mut pairs = quads.remainder().chunks_exact(2);
            for c in &mut pairs {
                self.accum_block::<H, ONE, 2>(c, k, rows, n, wg, g, ap, table, mask);
                k += 2;
            }
            if let [c] = pairs.remainder() {
                self.accum_block::<H, ONE, 1>(std::slice::from_ref(c), k, rows, n, wg, g, ap, table, mask);
            }
        }
    }

    /// Adds the weighted rows' chunks `k..k + C` (`chunks`) to heads
    /// `h0..h0 + H` of the accumulator at `ap` (`[H][d]` from head `h0`);
    /// `rows` is the piece's first row, `wg` its weights for this group.
    ///
    /// # Safety
    /// AVX-512F; the caller checked the bounds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn accum_block<const H: usize, const ONE: bool, const C: usize>(
        &self,
        chunks: &[Chunk],
        k: usize,
        rows: *const u32,
        n: usize,
        wg: *const f32,
        g: usize,
        ap: *mut f32,
        table: __m512,
        mask: __m512i,
    ) {
        let (d, wpt) = (self.d, self.tl.words_per_token);
        let mut a = [[_mm512_setzero_ps(); C]; H];
        for j in 0..H {
            for c in 0..C {
                a[j][c] = _mm512_loadu_ps(ap.add(j * d + 16 * (k + c)));
            }
        }
        for r in 0..n {
            let row = rows.add(r * wpt);
            let mut x = [_mm512_setzero_ps(); C];
            for c in 0..C {
                x[c] = Self::levels16::<ONE>(&chunks[c], row, table, mask);
            }
            for j in 0..H {
                let wv = _mm512_set1_ps(*wg.add(r * g + j));
                for c in 0..C {
                    a[j][c] = _mm512_fmadd_ps(wv, x[c], a[j][c]);
                }
            }
        }
        for j in 0..H {
            for c in 0..C {
                _mm512_storeu_ps(ap.add(j * d + 16 * (k + c)), a[j][c]);
            }
        }
    }
}

/// The four horizontal sums of `a..d` as one vector: halves added, then
/// three horizontal adds and one more half (13 instructions instead of
/// four full reductions).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    let (a, b, c, d) = (halves(a), halves(b), halves(c), halves(d));
    let ab = _mm256_hadd_ps(a, b);
    let cd = _mm256_hadd_ps(c, d);
    let abcd = _mm256_hadd_ps(ab, cd);
    _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1))
}

/// The low and high 256-bit halves of `v`, added.
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn halves(v: __m512) -> __m256 {
    _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn f16_conversion_is_exact_for_every_finite_half() {
        for b in 0..=u16::MAX {
            let want = half::f16::from_bits(b);
            if want.is_finite() {
                assert_eq!(super::f16_to_f32(b).to_bits(), want.to_f32().to_bits(), "{b:#06x}");
            }
        }
    }
}
