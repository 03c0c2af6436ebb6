//! Integer-domain key scores for `query: int8(group = G)`
//! ([`kivi_spec::QueryQuant`]): the folded query `w_d = q_d s_d` of a key
//! group is quantized to 8 bits once per `G` tokens and head
//! ([`crate::quant::quantize_query`], the oracle's own function), and each
//! token's score is `sum_blocks a * (sum_d qi_d c_td) + sum_d q_d z_d`,
//! the inner sums on the cached 2/4-bit codes as integers.
//!
//! Three versions of the inner loop, chosen at run time:
//! - **AVX-512 VNNI** (`vpdpbusd`): sixteen rows at a time, lane = row. A
//!   gather brings word `w` of the sixteen rows into one vector; a shift
//!   and a mask turn it into bytes holding one code each (byte `j` of a
//!   2-bit word's slot `k` is channel `16w + 4j + k`), and one `vpdpbusd`
//!   per (slot, head) multiplies those four codes by four query bytes
//!   (broadcast; the query is stored in that slot order) and adds the
//!   products into the head's 32-bit sums. At a query block's last word
//!   the sums are converted and scaled by the block's `a`: no horizontal
//!   sums, and the products of one word for four heads cost four
//!   instructions where the f32 path spends sixteen FMAs.
//! - **AVX2**: the same with eight rows, `vpmaddubsw` (u8 x i8 pairs into
//!   i16: at most `2 * 15 * 127`, no saturation for codes of 4 bits or
//!   fewer) then `vpmaddwd` by ones into 32-bit sums.
//! - **portable**: the same sums row by row, always compiled and tested,
//!   and used for the last rows of a piece that do not fill a vector.
//!
//! Integer sums are exact, so the versions differ from the oracle only in
//! the order of the f32 additions of the block terms and the zero points.

use super::simd::Isa;
use crate::quant::quantize_query;
use kivi_spec::layout::TensorLayout;
use kivi_spec::ScaleDtype;

/// The instruction set of the integer loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Int8Isa {
    /// AVX-512F + VNNI: `vpdpbusd` on sixteen rows.
    Vnni512,
    /// AVX2: `vpmaddubsw` + `vpmaddwd` on eight rows.
    Avx2,
    /// Portable scalar sums.
    Portable,
}

impl Int8Isa {
    /// The integer loops that go with the float ISA `isa` on this CPU.
    pub fn select(isa: Isa) -> Int8Isa {
        match isa {
            Isa::Avx512 if vnni_available() => Int8Isa::Vnni512,
            Isa::Avx512 | Isa::Avx2 if avx2_available() => Int8Isa::Avx2,
            _ => Int8Isa::Portable,
        }
    }

    /// Rows per vector of the integer loops.
    pub fn rows(self) -> usize {
        match self {
            Int8Isa::Vnni512 => 16,
            Int8Isa::Avx2 => 8,
            Int8Isa::Portable => 1,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn vnni_available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn vnni_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

/// Per-task state: the scaled query and the current key group's integer
/// query, its block scales and zero-point constants.
pub(crate) struct Int8Keys {
    isa: Int8Isa,
    /// The float ISA (F16C widening of the parameters).
    fisa: Isa,
    bits: u32,
    /// Query heads, head_dim, channels per query block.
    g: usize,
    d: usize,
    qgroup: usize,
    /// The query `[g][d]`, rounded and times the softmax scale.
    qs: Vec<f32>,
    /// (block, key group) whose query is held.
    key: Option<(u32, usize)>,
    /// Integer query `[g][word][slot]`: four query bytes per dword, in the
    /// order a word's slot unpacks its codes into bytes.
    qd: Vec<i32>,
    /// Block scales `a`, `[g][d / qgroup]`.
    a: Vec<f32>,
    /// `sum_d qs_d z_d` per head.
    cst: Vec<f32>,
    /// Scratch: scales, zero points, folded query, its codes.
    s: Vec<f32>,
    z: Vec<f32>,
    w: Vec<f32>,
    qi: Vec<i8>,
}

impl Int8Keys {
    /// The state for `g` heads of the scaled query `qs` (`[g][d]`), keys of
    /// `bits` (2 or 4) bits and query blocks of `qgroup` channels.
    pub fn new(isa: Int8Isa, fisa: Isa, bits: u32, g: usize, d: usize, qgroup: usize, qs: &[f32]) -> Int8Keys {
        let per = (32 / bits) as usize;
        let wpt = d / per;
        Int8Keys {
            isa,
            fisa,
            bits,
            g,
            d,
            qgroup,
            qs: qs[..g * d].to_vec(),
            key: None,
            qd: vec![0; g * wpt * (per / 4)],
            a: vec![0.0; g * (d / qgroup)],
            cst: vec![0.0; g],
            s: vec![0.0; d],
            z: vec![0.0; d],
            w: vec![0.0; d],
            qi: vec![0; d],
        }
    }

    /// Rows per vector of the integer loops (1: portable).
    pub fn rows(&self) -> usize {
        self.isa.rows()
    }

    /// Makes the integer query of key group `(block, group)` current: reads
    /// its scales and zero points (token `off` of the block part `part`),
    /// folds and quantizes. Once per group of `G` tokens.
    pub fn fold(&mut self, part: &[u32], tl: &TensorLayout, scale: ScaleDtype, key: (u32, usize), off: usize) {
        if self.key == Some(key) {
            return;
        }
        let d = self.d;
        let i0 = tl.param_index(off, 0);
        read(self.fisa, &part[tl.scales_offset..], scale, i0, &mut self.s);
        read(self.fisa, &part[tl.zeros_offset..], scale, i0, &mut self.z);
        let nb = d / self.qgroup;
        // SAFETY: `select` chose Vnni512 only with AVX-512F (and VNNI); the
        // group is a multiple of 16 (validated), so is D; the buffers were
        // sized in `new` for `g` heads.
        #[cfg(target_arch = "x86_64")]
        if self.isa == Int8Isa::Vnni512
            && unsafe {
                x86::fold_heads512(
                    &self.qs,
                    &self.s,
                    &self.z,
                    self.qgroup,
                    self.bits,
                    &mut self.qd,
                    &mut self.a,
                    &mut self.cst,
                )
            }
        {
            self.key = Some(key);
            return;
        }
        for h in 0..self.g {
            let qh = &self.qs[h * d..(h + 1) * d];
            let a = &mut self.a[h * nb..(h + 1) * nb];
            let qd = &mut self.qd[h * d / 4..(h + 1) * d / 4];
            match self.isa {
                // SAFETY: `select` checked AVX2 and FMA; the group is a
                // multiple of 16 (validated), so is D.
                #[cfg(target_arch = "x86_64")]
                Int8Isa::Vnni512 | Int8Isa::Avx2 => unsafe {
                    self.cst[h] = x86::fold_head(qh, &self.s, &self.z, self.qgroup, self.bits, qd, a);
                },
                _ => {
                    for ((w, q), s) in self.w.iter_mut().zip(qh).zip(&self.s) {
                        *w = q * s;
                    }
                    quantize_query(&self.w, self.qgroup, &mut self.qi, a);
                    pack_slots(&self.qi, self.bits, qd);
                    // In f64, rounded once: a sequential f32 sum of D
                    // products with offsets of both signs (KIVI keys' zero
                    // points) loses up to 1e-5 of the output on spiky keys.
                    self.cst[h] = qh.iter().zip(&self.z).map(|(q, z)| *q as f64 * *z as f64).sum::<f64>() as f32;
                }
            }
        }
        self.key = Some(key);
    }

    /// Scores of `n` rows of codes (`words[base + r * wpt..]`, `wpt` words
    /// a row) for every head, into `out[r * rs + h * hs]`. [`Self::fold`]
    /// must have made the rows' key group current.
    #[allow(clippy::too_many_arguments)] // rows, then where each score goes: all needed
    pub fn scores(&self, words: &[u32], base: usize, wpt: usize, n: usize, out: &mut [f32], rs: usize, hs: usize) {
        self.scores_ahead(words, base, wpt, n, out, rs, hs, None)
    }

    /// [`Self::scores`], prefetching `ahead`'s lines a few per word of the
    /// vector loops (the fused tile's next block: see [`Ahead`]).
    #[allow(clippy::too_many_arguments)]
    pub fn scores_ahead(
        &self,
        words: &[u32],
        base: usize,
        wpt: usize,
        n: usize,
        out: &mut [f32],
        rs: usize,
        hs: usize,
        ahead: Option<Ahead>,
    ) {
        assert!(base + n * wpt <= words.len() && wpt * (32 / self.bits as usize) == self.d);
        assert!(n == 0 || (n - 1) * rs + (self.g - 1) * hs < out.len());
        let step = self.isa.rows();
        let full = if self.isa == Int8Isa::Portable {
            0
        } else {
            n / step * step
        };
        #[cfg(target_arch = "x86_64")]
        for r0 in (0..full).step_by(step) {
            let rows = words[base + r0 * wpt..].as_ptr() as *const i32;
            // Four heads a pass (GQA groups of a multiple of four take
            // only these), then one at a time.
            let mut h0 = 0;
            while h0 < self.g {
                let nh = if self.g - h0 >= 4 { 4 } else { 1 };
                let o = &mut out[r0 * rs + h0 * hs..];
                // One head pass asks for the lines; piece = (vector of rows, word).
                let pf = ahead.filter(|_| h0 == 0).map(|a| Ahead {
                    piece: a.piece + r0 / step * wpt,
                    ..a
                });
                // SAFETY: the asserts bound rows `r0..r0 + step` of `words`
                // and every output index; `select` checked the features.
                unsafe {
                    match (self.isa, self.bits, nh, pf.is_some()) {
                        (Int8Isa::Vnni512, 2, 4, false) => x86::vnni::<2, 4, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, 2, 4, true) => x86::vnni::<2, 4, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, 2, _, false) => x86::vnni::<2, 1, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, 2, _, true) => x86::vnni::<2, 1, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, _, 4, false) => x86::vnni::<4, 4, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, _, 4, true) => x86::vnni::<4, 4, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, _, _, false) => x86::vnni::<4, 1, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Vnni512, _, _, true) => x86::vnni::<4, 1, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, 2, 4, false) => x86::avx2::<2, 4, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, 2, 4, true) => x86::avx2::<2, 4, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, 2, _, false) => x86::avx2::<2, 1, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, 2, _, true) => x86::avx2::<2, 1, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, _, 4, false) => x86::avx2::<4, 4, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, _, 4, true) => x86::avx2::<4, 4, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, _, _, false) => x86::avx2::<4, 1, false>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Avx2, _, _, true) => x86::avx2::<4, 1, true>(self, rows, wpt, h0, o, rs, hs, pf),
                        (Int8Isa::Portable, ..) => unreachable!("one row at a time"),
                    }
                }
                h0 += nh;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let full = 0;
        for r in full..n {
            let row = &words[base + r * wpt..base + (r + 1) * wpt];
            for h in 0..self.g {
                out[r * rs + h * hs] = self.score_row(row, h);
            }
        }
    }

    /// The portable score of one row for head `h`.
    fn score_row(&self, row: &[u32], h: usize) -> f32 {
        let (d, bits) = (self.d, self.bits);
        let (per, mask) = ((32 / bits) as usize, (1u32 << bits) - 1);
        let nb = d / self.qgroup;
        let qi = &self.qd[h * (d / per) * (per / 4)..];
        let slots = per / 4;
        let mut score = 0f32;
        let mut dot = 0i32;
        for (wd, &word) in row.iter().enumerate() {
            for k in 0..slots {
                let q = qi[wd * slots + k].to_le_bytes();
                for (j, qb) in q.iter().enumerate() {
                    let c = (word >> (bits as usize * (j * slots + k))) & mask;
                    dot += c as i32 * *qb as i8 as i32;
                }
            }
            if ((wd + 1) * per).is_multiple_of(self.qgroup) {
                score += self.a[h * nb + (wd * per) / self.qgroup] * dot as f32;
                dot = 0;
            }
        }
        score + self.cst[h]
    }
}

/// Lines to prefetch while scoring (into L2): the same rows of the KV
/// head's next block, K and V, `step[k]` lines of part `k` per piece, a
/// piece being one word of one vector of rows, numbered from `piece`. A
/// head's parts of consecutive blocks are a block apart, a stride the
/// hardware prefetchers do not follow; asking for a few lines per word (as
/// the f32 key loops of `fused.rs` do) rather than a tile's worth per
/// sixteen rows keeps the requests from queueing on the fill buffers.
#[derive(Clone, Copy)]
pub(crate) struct Ahead<'a> {
    pub parts: [&'a [u32]; 2],
    pub step: [usize; 2],
    pub piece: usize,
}

impl Ahead<'_> {
    /// Prefetches piece `i`'s lines.
    #[inline(always)]
    fn fetch(&self, i: usize) {
        for (part, &step) in self.parts.iter().zip(&self.step) {
            let lines = part.len().div_ceil(16);
            for l in (i * step).min(lines)..((i + 1) * step).min(lines) {
                // SAFETY: a prefetch is a hint; the address is inside `part`.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        part.as_ptr().add(16 * l) as *const i8
                    )
                };
            }
        }
    }
}

/// Query codes `qi` (channel order) as [`Int8Keys`] holds them: four bytes
/// per dword, dword `k` of word `wd` holding the codes that slot `k` of a
/// `bits`-bit code word unpacks into its four bytes (channels
/// `wd * per + j * slots + k`, `j` = 0..4).
fn pack_slots(qi: &[i8], bits: u32, qd: &mut [i32]) {
    let per = (32 / bits) as usize;
    let slots = per / 4;
    for wd in 0..qi.len() / per {
        for k in 0..slots {
            let b = |j: usize| qi[wd * per + j * slots + k] as u8 as u32;
            let v = b(0) | (b(1) << 8) | (b(2) << 16) | (b(3) << 24);
            qd[wd * slots + k] = v as i32;
        }
    }
}

/// Parameters `i0..i0 + out.len()` of a scale or zero section, as f32
/// (F16C where the float ISA has it: once per key group, but a software
/// f16 conversion per channel cost more than the group's dot products).
fn read(isa: Isa, section: &[u32], dtype: ScaleDtype, i0: usize, out: &mut [f32]) {
    match dtype {
        ScaleDtype::F16 => {
            // SAFETY: u16 has weaker alignment than u32 and the length
            // doubles; element `i` is half `i % 2` of word `i / 2` on the
            // little-endian targets this path runs on (the plan keeps
            // big-endian ones off it).
            let halves = unsafe { std::slice::from_raw_parts(section.as_ptr() as *const u16, section.len() * 2) };
            super::simd::f16_to_f32(isa, &halves[i0..i0 + out.len()], out);
        }
        ScaleDtype::F32 => {
            for (o, w) in out.iter_mut().zip(&section[i0..]) {
                *o = f32::from_bits(*w);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
mod x86 {
    use super::{Ahead, Int8Keys};
    use crate::cpu::width::{transpose_indices, Avx2, Avx512, Width};
    use std::arch::x86_64::*;

    /// Byte shuffles from channel order to slot order within sixteen
    /// channels: byte `4k + j` of a word's run is the code the slot-`k`
    /// shift leaves in byte `j`, channel `j * slots + k` of the word.
    const SLOTS2: [i8; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
    const SLOTS4: [i8; 16] = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15];

    /// [`crate::quant::quantize_query`] of the folded query `w = q * s`,
    /// eight values at a time, with the same f32 operations (products, a
    /// maximum, `m / 127` and `127 / m`, rounding to nearest even), so
    /// bit-identical to it, the codes written straight in slot order (`qd`,
    /// four per dword); and `sum q z` in sixteen lanes (returned). Once per
    /// head and key group: its cost is spread over the group's rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fold_head(
        q: &[f32],
        s: &[f32],
        z: &[f32],
        group: usize,
        bits: u32,
        qd: &mut [i32],
        scales: &mut [f32],
    ) -> f32 {
        let d = q.len();
        assert!(group.is_multiple_of(16) && s.len() == d && z.len() == d);
        assert!(d == 4 * qd.len() && d == scales.len() * group);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let shuf = _mm_loadu_si128(if bits == 2 { SLOTS2.as_ptr() } else { SLOTS4.as_ptr() } as *const __m128i);
        let out = qd.as_mut_ptr() as *mut __m128i;
        let (qp, sp, zp) = (q.as_ptr(), s.as_ptr(), z.as_ptr());
        let w = |c: usize| _mm256_mul_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(sp.add(c)));
        let mut cz = [_mm256_setzero_ps(); 2];
        for c in (0..d).step_by(16) {
            cz[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(zp.add(c)), cz[0]);
            cz[1] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c + 8)), _mm256_loadu_ps(zp.add(c + 8)), cz[1]);
        }
        for (b, a) in scales.iter_mut().enumerate() {
            let c0 = b * group;
            let mut mv = _mm256_setzero_ps();
            for c in (c0..c0 + group).step_by(8) {
                mv = _mm256_max_ps(mv, _mm256_and_ps(w(c), abs));
            }
            // Exact reduction of eight maxima.
            let m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps::<1>(mv));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
            *a = m / 127.0;
            let inv_s = 127.0 / m;
            if m != 0.0 && !inv_s.is_finite() {
                // `127 / m` overflows (m < 127 / f32::MAX): `cvtps2dq` would
                // turn `w * inf` into -128 where the oracle clamps to ±127
                // (and `0 * inf` into -128 where it gives 0). Such a block
                // takes the oracle's own formula, then the same shuffle.
                for c in (c0..c0 + group).step_by(16) {
                    let mut t = [0i8; 16];
                    for (j, x) in t.iter_mut().enumerate() {
                        let v = *qp.add(c + j) * *sp.add(c + j);
                        *x = (v * inv_s).round_ties_even().clamp(-127.0, 127.0) as i8;
                    }
                    let bytes = _mm_shuffle_epi8(_mm_loadu_si128(t.as_ptr() as *const __m128i), shuf);
                    _mm_storeu_si128(out.add(c / 16), bytes);
                }
                continue;
            }
            let inv = _mm256_set1_ps(inv_s);
            // `cvtps2dq` rounds by MXCSR, to nearest even (Rust never
            // changes it), and |w * inv| <= 127 (1 + 2^-23) rounds to at
            // most 127: the oracle's round and clamp in one instruction.
            let code = |c: usize| _mm256_cvtps_epi32(_mm256_mul_ps(w(c), inv));
            for c in (c0..c0 + group).step_by(16) {
                let bytes = if m == 0.0 {
                    _mm_setzero_si128()
                } else {
                    let (x0, x1) = (code(c), code(c + 8));
                    let p0 = _mm_packs_epi32(_mm256_castsi256_si128(x0), _mm256_extracti128_si256::<1>(x0));
                    let p1 = _mm_packs_epi32(_mm256_castsi256_si128(x1), _mm256_extracti128_si256::<1>(x1));
                    _mm_shuffle_epi8(_mm_packs_epi16(p0, p1), shuf)
                };
                _mm_storeu_si128(out.add(c / 16), bytes);
            }
        }
        // Sixteen partial sums, then a tree: a sequential f32 sum of the D
        // products (zero points of both signs) lost up to 1e-5 of the output.
        let s8 = _mm256_add_ps(cz[0], cz[1]);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// [`fold_head`] for every head at once with sixteen lanes, bit-identical
    /// to [`crate::quant::quantize_query`] as well: the block maxima of all
    /// heads first (one vector maximum per block), then `m / 127` and
    /// `127 / m` for sixteen blocks per division instead of two scalar
    /// divisions per block, then one product, one rounding conversion and
    /// one truncating narrowing (`vpmovdb`) per sixteen channels, the bytes
    /// shuffled into slot order. A block of zeros (`m == 0`) needs no test:
    /// `0 * inf` is NaN, which converts to `0x8000_0000`, whose low byte is
    /// the code 0. Returns false, having written nothing the caller relies
    /// on, when a block's `m` is so small that `127 / m` overflows (the
    /// oracle then clamps `±inf` to ±127): the caller takes the portable
    /// fold, which is the oracle's function.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fold_heads512(
        qs: &[f32],
        s: &[f32],
        z: &[f32],
        group: usize,
        bits: u32,
        qd: &mut [i32],
        scales: &mut [f32],
        cst: &mut [f32],
    ) -> bool {
        let d = s.len();
        let (g, nb) = (cst.len(), d / group);
        assert!(group.is_multiple_of(16) && z.len() == d && qs.len() >= g * d);
        assert!(qd.len() >= g * d / 4 && scales.len() >= g * nb);
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (qp, sp, zp) = (qs.as_ptr(), s.as_ptr(), z.as_ptr());
        let w = |h: usize, c: usize| _mm512_mul_ps(_mm512_loadu_ps(qp.add(h * d + c)), _mm512_loadu_ps(sp.add(c)));
        // Per (head, block) `i = h * nb + b`, sixteen at a time: the
        // blocks' vector maxima, reduced by one transpose tree (sixteen
        // horizontal maxima in fifteen steps rather than sixteen chains of
        // four), then `m / 127` and `127 / m` as two vector divisions.
        // The reciprocals live on the stack: more than 256 blocks (wide
        // GQA groups of long heads) take the portable fold.
        let n = g * nb;
        if n > 256 {
            return false;
        }
        let mut inv = [0f32; 256];
        // Lane `4k + m` of the tree holds block `4m + k` of the sixteen.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let (k127, lo) = (_mm512_set1_ps(127.0), _mm512_set1_ps(1e-36));
        for i0 in (0..n).step_by(16) {
            let k = (n - i0).min(16);
            let mut bv = [_mm512_setzero_ps(); 16];
            for (j, v) in bv.iter_mut().enumerate().take(k) {
                let (h, b) = ((i0 + j) / nb, (i0 + j) % nb);
                let mut mv = _mm512_setzero_ps();
                for c in (b * group..(b + 1) * group).step_by(16) {
                    mv = _mm512_max_ps(
                        mv,
                        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(w(h, c)), abs)),
                    );
                }
                *v = mv;
            }
            // Maxima of non-negative finite floats: exact in any order.
            let m = _mm512_permutexvar_ps(order, tree_max(&bv));
            let mask: __mmask16 = if k == 16 { 0xffff } else { (1u16 << k) - 1 };
            // `127 / m` overflows where `m < 127 / f32::MAX`; the oracle
            // then clamps `±inf` to ±127, which the narrowing below would
            // not: decline (the caller takes the eight-lane `fold_head`,
            // which handles such a block with the oracle's formula).
            let tiny = _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(mask, m, lo)
                & _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_setzero_ps());
            if tiny != 0 {
                return false;
            }
            _mm512_mask_storeu_ps(inv.as_mut_ptr().add(i0), mask, _mm512_div_ps(k127, m));
            _mm512_mask_storeu_ps(scales.as_mut_ptr().add(i0), mask, _mm512_div_ps(m, k127));
        }
        let inv_of = &inv[..n];
        let shuf = _mm_loadu_si128(if bits == 2 { SLOTS2.as_ptr() } else { SLOTS4.as_ptr() } as *const __m128i);
        let out = qd.as_mut_ptr() as *mut __m128i;
        for h in 0..g {
            let mut cz = _mm512_setzero_ps();
            for b in 0..nb {
                let iv = _mm512_set1_ps(inv_of[h * nb + b]);
                for c in (b * group..(b + 1) * group).step_by(16) {
                    // `cvtps2dq` rounds by MXCSR, to nearest even (Rust never
                    // changes it); |w * inv| <= 127 (1 + 2^-23) rounds to at
                    // most 127, so narrowing by truncation is exact.
                    let x = _mm512_cvtps_epi32(_mm512_mul_ps(w(h, c), iv));
                    let bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(x), shuf);
                    _mm_storeu_si128(out.add((h * d + c) / 16), bytes);
                    cz = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(h * d + c)), _mm512_loadu_ps(zp.add(c)), cz);
                }
            }
            // Sixteen partial sums, then a tree (see `fold_head`).
            cst[h] = _mm512_reduce_add_ps(cz);
        }
        true
    }

    /// Words `wb..wb + 8` of sixteen rows, one vector per word (lane =
    /// row): `width.rs`'s three levels of eight two-source permutes
    /// (`Width::transpose8`, same indices), written with plain loops.
    /// Its `array::from_fn` closures were left out of line once the integer
    /// loop grew a prefetch (`core::array::try_from_fn` calls in the
    /// disassembly, the decode twice as slow); loops over fixed arrays
    /// inline and unroll whatever the caller's size.
    #[inline(always)]
    unsafe fn transpose16x8(rows: *const i32, wpt: usize, wb: usize) -> [__m512i; 8] {
        let idx = transpose_indices();
        let ld = |k: usize| _mm512_loadu_si512(idx[k].as_ptr() as *const _);
        let mut l = [_mm512_setzero_si512(); 8];
        for i in 0..8 {
            let r0 = rows.add(2 * i * wpt + wb) as *const __m256i;
            let r1 = rows.add((2 * i + 1) * wpt + wb) as *const __m256i;
            l[i] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(r0)), _mm256_loadu_si256(r1));
        }
        let mut p = [_mm512_setzero_si512(); 8];
        for k in 0..8 {
            p[k] = _mm512_permutex2var_epi32(l[2 * (k / 2)], ld(k), l[2 * (k / 2) + 1]);
        }
        let mut r = [_mm512_setzero_si512(); 8];
        for k in 0..8 {
            let (q, h) = (k / 4, (k / 2) % 2);
            r[k] = _mm512_permutex2var_epi32(p[4 * q + h], ld(8 + k), p[4 * q + 2 + h]);
        }
        let mut out = [_mm512_setzero_si512(); 8];
        for k in 0..8 {
            out[k] = _mm512_permutex2var_epi32(r[k / 2], ld(16 + k), r[4 + k / 2]);
        }
        out
    }

    /// Words `wb..wb + 8` of eight rows, one vector per word: the 8 x 8
    /// unpack transpose of `width.rs` (`Width::transpose8` for AVX2), in
    /// plain loops for the reason [`transpose16x8`] gives.
    #[inline(always)]
    unsafe fn transpose8x8(rows: *const i32, wpt: usize, wb: usize) -> [__m256i; 8] {
        let mut r = [_mm256_setzero_si256(); 8];
        for i in 0..8 {
            r[i] = _mm256_loadu_si256(rows.add(i * wpt + wb) as *const __m256i);
        }
        let mut t = [_mm256_setzero_si256(); 8];
        for k in 0..8 {
            let (a, b) = (r[2 * (k / 2)], r[2 * (k / 2) + 1]);
            t[k] = if k % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            };
        }
        // u[4q + 2s + e]: rows 4q..4q + 4, words (2s + e) and (2s + e) + 4.
        let mut u = [_mm256_setzero_si256(); 8];
        for k in 0..8 {
            let (q, s, e) = (k / 4, (k / 2) % 2, k % 2);
            let (a, b) = (t[4 * q + s], t[4 * q + 2 + s]);
            u[k] = if e == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            };
        }
        let mut out = [_mm256_setzero_si256(); 8];
        for w in 0..8 {
            let (a, b) = (u[w % 4], u[4 + w % 4]);
            out[w] = if w < 4 {
                _mm256_permute2x128_si256::<0x20>(a, b)
            } else {
                _mm256_permute2x128_si256::<0x31>(a, b)
            };
        }
        out
    }

    /// Sixteen horizontal maxima at once: lane `4k + m` of the result is
    /// the maximum of `v[4m + k]` (`width.rs`'s sum tree, with maxima).
    #[inline(always)]
    unsafe fn tree_max(v: &[__m512; 16]) -> __m512 {
        let s: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        let t: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (s[2 * i], s[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        let y: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (t[2 * i], t[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        _mm512_max_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
        )
    }

    /// What the integer loop adds to [`Width`] (everything else in [`dot`]
    /// is written once over it): how the words of a vector's rows (lane =
    /// row) are brought in, and how four u8 x i8 products are added into a
    /// lane's 32-bit sum. Every method is `#[inline(always)]` without
    /// features of its own, so the generic body is compiled inside each
    /// ISA's `#[target_feature]` entry point ([`vnni`], [`avx2`]), as the
    /// f32 path is.
    trait IntDot: Width {
        /// Independent sum chains per head (1 or 2): `vpdpbusd`'s latency
        /// needs two in flight; AVX2's three-instruction product does not.
        const CHAINS: usize;
        /// Words `wb..wb + 8` of the rows, one vector a word; words past
        /// `wpt` are left zero. Where a row is a multiple of eight words
        /// this is an in-register transpose (the f32 path's
        /// `Width::transpose8`, or a copy in plain loops): sixteen gathers of
        /// one word each took the loads' latency into the dot products, and
        /// issue at about one lane per cycle.
        unsafe fn words8<const PF: bool>(rows: *const i32, wpt: usize, wb: usize) -> [Self::I; 8];
        /// `acc` + the four u8 (`v`) x i8 (`q`) products of each lane.
        unsafe fn dot(acc: Self::I, v: Self::I, q: Self::I) -> Self::I;
    }

    /// Words `wb..wb + 8` of rows of any length, one gather a word.
    #[inline(always)]
    unsafe fn gathered<V: Width>(rows: *const i32, wpt: usize, wb: usize) -> [V::I; 8] {
        let mut zs = [V::splat_i(0); 8];
        for (j, z) in zs.iter_mut().enumerate().take((wpt - wb).min(8)) {
            *z = V::gather_word(rows, wpt, wb + j);
        }
        zs
    }

    /// AVX-512F + VNNI: sixteen rows, `vpdpbusd`.
    impl IntDot for Avx512 {
        const CHAINS: usize = 2;
        #[inline(always)]
        unsafe fn words8<const PF: bool>(rows: *const i32, wpt: usize, wb: usize) -> [__m512i; 8] {
            if wpt.is_multiple_of(8) && !PF {
                // Inlined into the loop without the prefetch, width.rs's
                // transpose measured ~8% cheaper (GQA d128) than the copy below.
                Avx512::transpose8(rows, wpt, wb)
            } else if wpt.is_multiple_of(8) {
                transpose16x8(rows, wpt, wb)
            } else {
                gathered::<Self>(rows, wpt, wb)
            }
        }
        #[inline(always)]
        unsafe fn dot(acc: __m512i, v: __m512i, q: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, v, q)
        }
    }

    /// AVX2: eight rows, `vpmaddubsw` + `vpmaddwd`.
    impl IntDot for Avx2 {
        const CHAINS: usize = 1;
        #[inline(always)]
        unsafe fn words8<const PF: bool>(rows: *const i32, wpt: usize, wb: usize) -> [__m256i; 8] {
            if wpt.is_multiple_of(8) {
                transpose8x8(rows, wpt, wb)
            } else {
                gathered::<Self>(rows, wpt, wb)
            }
        }
        #[inline(always)]
        unsafe fn dot(acc: __m256i, v: __m256i, q: __m256i) -> __m256i {
            // Pairs of u8 x i8 into i16 (|2 * 15 * 127| fits), then pairs
            // of i16 into the i32 sums.
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, q), _mm256_set1_epi16(1));
            _mm256_add_epi32(acc, p)
        }
    }

    /// Sixteen rows, heads `h0..h0 + NH`: see the module docs. `NH` is a
    /// constant so that the sums stay in registers.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn vnni<const BITS: u32, const NH: usize, const PF: bool>(
        k: &Int8Keys,
        rows: *const i32,
        wpt: usize,
        h0: usize,
        out: &mut [f32],
        rs: usize,
        hs: usize,
        ahead: Option<Ahead>,
    ) {
        dot::<Avx512, BITS, NH, PF>(k, rows, wpt, h0, out, rs, hs, ahead)
    }

    /// Eight rows, heads `h0..h0 + NH`, `vpmaddubsw` + `vpmaddwd`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2<const BITS: u32, const NH: usize, const PF: bool>(
        k: &Int8Keys,
        rows: *const i32,
        wpt: usize,
        h0: usize,
        out: &mut [f32],
        rs: usize,
        hs: usize,
        ahead: Option<Ahead>,
    ) {
        dot::<Avx2, BITS, NH, PF>(k, rows, wpt, h0, out, rs, hs, ahead)
    }

    /// The one body of [`vnni`] and [`avx2`]: `V::LANES` rows, heads
    /// `h0..h0 + NH`.
    #[inline(always)]
    unsafe fn dot<V: IntDot, const BITS: u32, const NH: usize, const PF: bool>(
        k: &Int8Keys,
        rows: *const i32,
        wpt: usize,
        h0: usize,
        out: &mut [f32],
        rs: usize,
        hs: usize,
        ahead: Option<Ahead>,
    ) {
        let per = (32 / BITS) as usize;
        let slots = per / 4;
        let (wpg, nb) = (k.qgroup / per, k.d / k.qgroup);
        let mask = V::splat_i(if BITS == 2 { 0x0303_0303 } else { 0x0f0f_0f0f });
        let qd = k.qd.as_ptr().add(h0 * wpt * slots);
        let qa = k.a.as_ptr().add(h0 * nb);
        // Sums by chain (`V::CHAINS` of the two: even and odd slots), so
        // that more dot products are in flight where the ISA wants it.
        let mut ia = [[V::splat_i(0); NH]; 2];
        let mut sa = [V::zero(); NH];
        // The gathers of up to eight words issued together, ahead of their
        // use: one at a time, each stalled the dot products on its loads.
        let mut zs = [V::splat_i(0); 8];
        for w in 0..wpt {
            if PF {
                if let Some(a) = &ahead {
                    a.fetch(a.piece + w);
                }
            }
            if w % 8 == 0 {
                zs = V::words8::<PF>(rows, wpt, w);
            }
            let z = zs[w % 8];
            for s in 0..slots {
                let v = V::and_i(V::srl_i(z, (BITS as usize * s) as i32), mask);
                for h in 0..NH {
                    let q = V::splat_i(*qd.add((h * wpt + w) * slots + s));
                    ia[s % V::CHAINS][h] = V::dot(ia[s % V::CHAINS][h], v, q);
                }
            }
            if (w + 1).is_multiple_of(wpg) {
                for h in 0..NH {
                    let sum = if V::CHAINS == 2 {
                        V::add_i(ia[0][h], ia[1][h])
                    } else {
                        ia[0][h]
                    };
                    sa[h] = V::fmadd(V::cvt_i(sum), V::splat(*qa.add(h * nb + w / wpg)), sa[h]);
                    ia[0][h] = V::splat_i(0);
                    ia[1][h] = V::splat_i(0);
                }
            }
        }
        let mut tmp = [0f32; 16];
        for h in 0..NH {
            if rs == 1 {
                // Rows contiguous per head (the fused tile's `[g][n]`): one
                // store, not sixteen scalar ones. `scores` bounded
                // `(LANES - 1) + h * hs` by `out.len()`.
                V::store(out.as_mut_ptr().add(h * hs), V::add(sa[h], V::splat(k.cst[h0 + h])));
                continue;
            }
            V::store(tmp.as_mut_ptr(), V::add(sa[h], V::splat(k.cst[h0 + h])));
            for (r, x) in tmp[..V::LANES].iter().enumerate() {
                *out.get_unchecked_mut(r * rs + h * hs) = *x;
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// One fold's input: `g` heads of query `qs`, key scales `s` and zero
    /// points `z`, and a label.
    struct FoldCase {
        bits: u32,
        g: usize,
        d: usize,
        group: usize,
        qs: Vec<f32>,
        s: Vec<f32>,
        z: Vec<f32>,
        at: String,
        /// Some block's `m` is so small that `127 / m` overflows.
        tiny: bool,
    }

    /// Random blocks, a block of zeros (`0 * inf` must give the code 0),
    /// signed zeros, exact ties, and blocks near and below the overflow of
    /// `127 / m` (m ~ 1e-36), over five shapes.
    fn fold_cases() -> Vec<FoldCase> {
        let mut rng = crate::rand::Rng::new(17);
        let mut out = Vec::new();
        for (bits, g, d, group) in [
            (2u32, 4usize, 128usize, 32usize),
            (4, 4, 256, 32),
            (2, 1, 128, 64),
            (2, 7, 256, 16),
            (4, 3, 64, 64),
        ] {
            for case in 0..5 {
                let mut qs: Vec<f32> = (0..g * d).map(|_| rng.f32() * 4.0 - 2.0).collect();
                let s: Vec<f32> = (0..d)
                    .map(|c| if c % 9 == 4 { 40.0 * rng.f32() } else { rng.f32() })
                    .collect();
                let z: Vec<f32> = (0..d).map(|_| rng.f32() - 0.5).collect();
                match case {
                    1 => {
                        qs[..group].fill(0.0);
                        qs[group] = -0.0;
                    }
                    2 => {
                        // w = q * s = 127 * k / 2 ties against a maximum of 127.
                        for (c, q) in qs[..group].iter_mut().enumerate() {
                            *q = (c as f32 - 8.0) / 2.0 / s[c];
                        }
                    }
                    3 => qs[d * (g - 1)..d * (g - 1) + group]
                        .iter_mut()
                        .for_each(|q| *q *= 1e-38),
                    4 => qs[..group].iter_mut().for_each(|q| *q *= 1e-40),
                    _ => {}
                }
                let tiny = qs.chunks(d).any(|qh| {
                    qh.chunks(group).enumerate().any(|(b, qb)| {
                        let m = qb
                            .iter()
                            .enumerate()
                            .fold(0f32, |m, (c, q)| m.max((q * s[b * group + c]).abs()));
                        m > 0.0 && m < 1e-36
                    })
                });
                let at = format!("bits {bits} g {g} d {d} group {group} case {case}");
                out.push(FoldCase {
                    bits,
                    g,
                    d,
                    group,
                    qs,
                    s,
                    z,
                    at,
                    tiny,
                });
            }
        }
        out
    }

    /// Head `h` of a fold (`qd` codes in slot order, `a` scales, `cst` the
    /// zero-point sum) against the oracle's `quantize_query` and the
    /// portable packing, bit for bit (the sum to 1e-6 of its terms).
    fn check_head(f: &FoldCase, h: usize, qd: &[i32], a: &[f32], cst: f32) {
        let (d, nb) = (f.d, f.d / f.group);
        let (mut w, mut qi, mut ra, mut rqd) = (vec![0f32; d], vec![0i8; d], vec![0f32; nb], vec![0i32; d / 4]);
        for (c, x) in w.iter_mut().enumerate() {
            *x = f.qs[h * d + c] * f.s[c];
        }
        quantize_query(&w, f.group, &mut qi, &mut ra);
        pack_slots(&qi, f.bits, &mut rqd);
        let at = format!("{} head {h}", f.at);
        assert_eq!(qd, &rqd[..], "codes, {at}");
        let bits_of = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits_of(a), bits_of(&ra), "scales, {at}");
        let want: f64 = (0..d).map(|c| f.qs[h * d + c] as f64 * f.z[c] as f64).sum();
        let tol = 1e-6 * (0..d).map(|c| (f.qs[h * d + c] * f.z[c]).abs() as f64).sum::<f64>();
        assert!((cst as f64 - want).abs() <= tol, "zero-point sum {cst} vs {want}, {at}");
    }

    /// The sixteen-lane fold of every head against the oracle: it must
    /// decline exactly the cases where `127 / m` may overflow (`fold` then
    /// takes the eight-lane fold, checked below) and match bit for bit
    /// elsewhere.
    #[test]
    fn fold_heads512_is_the_oracles_quantization() {
        if !vnni_available() {
            eprintln!("no AVX-512 VNNI here: fold_heads512 not exercised");
            return;
        }
        let mut declined = 0;
        for f in fold_cases() {
            let (d, nb) = (f.d, f.d / f.group);
            let (mut qd, mut a, mut cst) = (vec![0i32; f.g * d / 4], vec![0f32; f.g * nb], vec![0f32; f.g]);
            // SAFETY: AVX-512F checked above; shapes as `fold` passes them.
            let ok = unsafe { x86::fold_heads512(&f.qs, &f.s, &f.z, f.group, f.bits, &mut qd, &mut a, &mut cst) };
            assert_eq!(ok, !f.tiny, "{}: declined iff 127 / m may overflow", f.at);
            if !ok {
                declined += 1;
                continue;
            }
            for h in 0..f.g {
                check_head(&f, h, &qd[h * d / 4..(h + 1) * d / 4], &a[h * nb..(h + 1) * nb], cst[h]);
            }
        }
        assert!(declined > 0, "the overflow case was never reached");
    }

    /// The eight-lane fold (AVX2, and where the sixteen-lane one declines)
    /// against the oracle on every case, the overflowing blocks included.
    #[test]
    fn fold_head_is_the_oracles_quantization() {
        if !avx2_available() {
            eprintln!("no AVX2 + FMA here: fold_head not exercised");
            return;
        }
        let cases = fold_cases();
        assert!(cases.iter().any(|f| f.tiny), "the overflow case was never reached");
        for f in cases {
            let (d, nb) = (f.d, f.d / f.group);
            for h in 0..f.g {
                let (mut qd, mut a) = (vec![0i32; d / 4], vec![0f32; nb]);
                let qh = &f.qs[h * d..(h + 1) * d];
                // SAFETY: AVX2 and FMA checked above; shapes as `fold` passes them.
                let cst = unsafe { x86::fold_head(qh, &f.s, &f.z, f.group, f.bits, &mut qd, &mut a) };
                check_head(&f, h, &qd, &a, cst);
            }
        }
    }
}
