//! The AVX-512 fast path for quantized caches: channel-axis 2/4-bit keys
//! (KIVI) or token-axis 2/4/8-bit keys (int8-style), token-axis 2/4/8-bit
//! values, f16 parameters, GQA groups of a multiple of four query heads.
//! One call runs one aligned tile of block-resident tokens end to end:
//! scores, online softmax, weighted value sum. Everything else (sinks, the
//! full-precision window, other schemes, AVX2 machines) takes the generic
//! loops in [`super::simd`], which stay the readable version.
//!
//! Where the time goes, and what this path does about it (per token and KV
//! head the arithmetic is `2 x heads x head_dim` multiply-adds, 16 per
//! instruction; everything else is overhead to minimise):
//! - **Codes to floats in two instructions.** A code word is ANDed with a
//!   per-lane mask, then converted unsigned: a lane holds `c * 2^(bits *
//!   slot)` rather than `c` (`slot` = the code's place in its word). The
//!   keys divide the query by that power of two once per split (`qw`); the
//!   values divide their per-tile sums by it when the tile ends. Powers of
//!   two are exact, so this changes the instruction count, not the
//!   rounding. For 4-bit values the lanes of a chunk visit its 16 channels
//!   in a fixed permuted order (two words broadcast as one 64-bit value),
//!   undone the same way.
//! - **Keys scored sixteen rows at a time, transposed.** Three levels of
//!   two-source permutes (a gather where a row is not a multiple of eight
//!   words) turn word `w` of sixteen rows into one vector, lane = row; each
//!   code slot then feeds four FMAs (the query broadcast from L1), and the
//!   scores come out as one 16-row vector per head: no horizontal sums, and
//!   the softmax is vector code too.
//! - **Scales folded out of the inner loops.** Channel-axis keys: `q . k_t
//!   = sum_d (q_d s_d) c_td + sum_d q_d z_d`, one folded query per key group.
//!   Token-axis keys: per key group `g`, `s_tg (q_g . c_tg) + z_tg sum_g q`,
//!   sixteen rows' partial dot products times the vector of their scales.
//!   Values: `sum_t p_t (s_t c_td + z_t) = sum_t (p_t s_t) c_td + sum_t p_t
//!   z_t`, so a value costs one FMA per head, the zero points one FMA per
//!   (head, group) per 16 tokens, summed for the tile by one transpose tree.
//! - **Eight to sixteen independent accumulators** in both loops: an FMA
//!   has a latency of four cycles and two ports, so fewer than eight chains
//!   leave ports idle.
//! - **The next block prefetched a few lines per word**: a head's parts of
//!   consecutive blocks are a block apart in the pool, which the hardware
//!   prefetchers do not follow; a whole block's lines at once stalled on
//!   fill buffers.
//!
//! Rounding differs from the reference only by the order of additions and
//! the folding above (checked against it in `tests/cpu_vs_reference.rs`).
//! Softmax weights below `e^-64` are flushed to zero here: they are below
//! `1e-27` of the largest weight, and keeping them would make `p * s`
//! subnormal, which costs a microcode assist per FMA on Intel cores.

/// How the keys are grouped: KIVI's channel axis (scales per channel per
/// `group` tokens, folded into the query) or the token axis (scales per
/// token per `2^gshift` channels, applied to partial scores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    Channel { group: usize },
    Token { gshift: u32 },
}

/// The key and value codings this path was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fast {
    pub kbits: u32,
    pub keys: Keys,
    pub vbits: u32,
    /// log2 of the value group (channels per token group, at least 16).
    pub gshift: u32,
    /// AVX-512BW is there (16-bit permutes for the value parameters).
    pub bw: bool,
}

/// Rows per score block: sub-tiles are cut at multiples of this.
pub(crate) const ROWS: usize = 16;

/// Per-task scratch of the fast path, reused across tiles.
pub(crate) struct State {
    g: usize,
    d: usize,
    ng: usize,
    /// The query `[g][d]` (subnormal-free), and divided by each channel's
    /// code weight `2^(bits * slot)` (`slot` = the code's place in its word).
    q: Vec<f32>,
    qw: Vec<f32>,
    /// Folded key query `[g][d]`: `qw` times the current group's scales.
    qf: Vec<f32>,
    /// `sum_d q_d z_d` per head for the current key group (channel axis).
    cst: Vec<f32>,
    /// Token-axis keys: groups per token, `sum_{d in group} q_d` per
    /// (head, group), and the tile's key parameters as `[kng][n]`.
    kng: usize,
    qsum: Vec<f32>,
    ks: Vec<f32>,
    kz: Vec<f32>,
    key_group: Option<(u32, usize)>,
    /// Scores, then softmax weights, `[g][n]`.
    p: Vec<f32>,
    /// Value weights `p * s`, `[g][ng][n]`.
    w: Vec<f32>,
    /// Value parameters transposed to `[ng][n]`.
    vs: Vec<f32>,
    vz: Vec<f32>,
    /// This tile's score maximum per head.
    tmax: Vec<f32>,
    /// Sixteen partial sums of `l` per head, `[g][16]`.
    lvec: Vec<f32>,
    /// This tile's `sum_t p_t z_t` per (head, value group), `[g][ng]`.
    zt: Vec<f32>,
}

impl State {
    /// The state for query `q` (`[g][d]`, softmax scale applied).
    pub fn new(fast: Fast, g: usize, d: usize, tile: usize, q: &[f32]) -> State {
        let ng = d >> fast.gshift;
        // Query values below 2^-70 contribute under 1e-16 to any score but
        // would make the folded query subnormal (an assist per FMA).
        let q: Vec<f32> = q[..g * d]
            .iter()
            .map(|&x| if x.abs() < 1e-21 { 0.0 } else { x })
            .collect();
        let per = 32 / fast.kbits as usize;
        let qw = q
            .iter()
            .enumerate()
            .map(|(i, &x)| x / (1u64 << (fast.kbits as usize * (i % d % per))) as f32)
            .collect();
        let kng = match fast.keys {
            Keys::Token { gshift } => d >> gshift,
            Keys::Channel { .. } => 0,
        };
        let qsum = (0..g * kng)
            .map(|i| {
                let (h, gk) = (i / kng, i % kng);
                let gs = d / kng;
                q[h * d + gk * gs..h * d + (gk + 1) * gs].iter().sum()
            })
            .collect();
        State {
            g,
            d,
            ng,
            kng,
            qsum,
            ks: vec![0.0; kng * tile],
            kz: vec![0.0; kng * tile],
            q,
            qw,
            qf: vec![0.0; g * d],
            cst: vec![0.0; g],
            key_group: None,
            p: vec![0.0; g * tile],
            w: vec![0.0; g * ng * tile],
            vs: vec![0.0; ng * tile],
            vz: vec![0.0; ng * tile],
            tmax: vec![0.0; g],
            lvec: vec![0.0; g * 16],
            zt: vec![0.0; g * ng],
        }
    }

    /// Scales what this state holds for head `h` (a new running maximum).
    pub fn rescale(&mut self, h: usize, corr: f32) {
        for x in &mut self.lvec[h * 16..(h + 1) * 16] {
            *x *= corr;
        }
    }

    /// Adds the partial sums of `l` into the task's, and clears them.
    pub fn flush(&mut self, l: &mut [f32]) {
        for (h, l) in l.iter_mut().enumerate().take(self.g) {
            *l += self.lvec[h * 16..(h + 1) * 16].iter().sum::<f32>();
        }
        self.lvec.fill(0.0);
    }
}

/// One tile: where its tokens live and what to update.
#[derive(Clone, Copy)]
pub(crate) struct Tile<'a> {
    /// Key and value parts of KV head `h` in block `block`.
    pub kpart: &'a [u32],
    pub vpart: &'a [u32],
    /// What to prefetch meanwhile (the same rows of the head's next block,
    /// K and V), a few lines per word of scoring so that the requests never
    /// queue up behind each other.
    pub ahead: [&'a [u32]; 2],
    pub block: u32,
    /// First token's offset in the block, a multiple of [`ROWS`].
    pub off: usize,
    /// Tokens, a multiple of [`ROWS`].
    pub n: usize,
    pub klayout: kivi_spec::layout::TensorLayout,
    pub vlayout: kivi_spec::layout::TensorLayout,
}

/// Runs one tile for all `g` heads of `q` (`[g][d]`, softmax scale applied),
/// updating the running max `m`, sum `l` and accumulator `acc`.
///
/// Panics (an internal bug, not bad input) if the tile's rows are outside
/// the parts it names.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile(fast: Fast, st: &mut State, t: &Tile, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    let (g, d) = (st.g, st.d);
    assert!(t.n.is_multiple_of(ROWS) && t.off.is_multiple_of(ROWS) && d.is_multiple_of(16) && g.is_multiple_of(4));
    assert!((t.off + t.n) * t.klayout.words_per_token <= t.klayout.codes_words());
    assert!((t.off + t.n) * t.vlayout.words_per_token <= t.vlayout.codes_words());
    assert!(t.kpart.len() >= t.klayout.words && t.vpart.len() >= t.vlayout.words);
    assert!(m.len() >= g && l.len() >= g && acc.len() >= g * d && st.p.len() >= g * t.n);
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq"));
    // SAFETY: features checked; the asserts bound every row, parameter and
    // buffer index the loops form (rows `off..off + n` of both parts).
    unsafe {
        match fast.kbits {
            2 => avx512::scores::<2>(fast, st, t),
            4 => avx512::scores::<4>(fast, st, t),
            _ => avx512::scores::<8>(fast, st, t),
        }
        avx512::softmax(st, t.n, m, l, acc);
        match fast.vbits {
            2 => avx512::values::<2>(fast, st, t, acc),
            4 => avx512::values::<4>(fast, st, t, acc),
            _ => avx512::values::<8>(fast, st, t, acc),
        }
    }
}

/// As [`tile`], with the scores (`[g][n]`) written by `scores` instead of
/// the f32 key loops: the integer-domain query of `int8.rs`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile_scored(
    fast: Fast,
    st: &mut State,
    t: &Tile,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    scores: impl FnOnce(&mut [f32]),
) {
    let (g, d) = (st.g, st.d);
    assert!(t.n.is_multiple_of(ROWS) && t.off.is_multiple_of(ROWS) && d.is_multiple_of(16) && g.is_multiple_of(4));
    assert!((t.off + t.n) * t.vlayout.words_per_token <= t.vlayout.codes_words());
    assert!(t.vpart.len() >= t.vlayout.words);
    assert!(m.len() >= g && l.len() >= g && acc.len() >= g * d && st.p.len() >= g * t.n);
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq"));
    scores(&mut st.p[..g * t.n]);
    // SAFETY: as in `tile`.
    unsafe {
        avx512::softmax(st, t.n, m, l, acc);
        match fast.vbits {
            2 => avx512::values::<2>(fast, st, t, acc),
            4 => avx512::values::<4>(fast, st, t, acc),
            _ => avx512::values::<8>(fast, st, t, acc),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn tile_scored(
    _: Fast,
    _: &mut State,
    _: &Tile,
    _: &mut [f32],
    _: &mut [f32],
    _: &mut [f32],
    _: impl FnOnce(&mut [f32]),
) {
    unreachable!("the fast path is only planned on x86-64 with AVX-512")
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn tile(_: Fast, _: &mut State, _: &Tile, _: &mut [f32], _: &mut [f32], _: &mut [f32]) {
    unreachable!("the fast path is only planned on x86-64 with AVX-512")
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod avx512 {
    use super::{Fast, Keys, State, Tile, ROWS};
    use std::arch::x86_64::*;

    /// Lane `j`'s channel within a chunk of 16, and its code's weight
    /// `2^(bits * slot)` as produced by [`unpack`].
    #[inline(always)]
    fn lane(bits: u32, j: usize) -> (usize, f32) {
        match bits {
            2 => (j, (4f32).powi(j as i32)),
            4 => (8 * (j % 2) + j / 2, (16f32).powi((j / 2) as i32)),
            _ => (j, 1.0),
        }
    }

    /// `lane()` as vectors: channel indices, weights and their inverses.
    #[inline(always)]
    unsafe fn lanes(bits: u32) -> (__m512i, __m512i, __m512, __m512) {
        let mut perm = [0i32; 16];
        let mut inv = [0i32; 16];
        let mut wt = [0f32; 16];
        let mut iw = [0f32; 16];
        for j in 0..16 {
            let (c, w) = lane(bits, j);
            perm[j] = c as i32;
            inv[c] = j as i32;
            wt[j] = w;
            iw[j] = 1.0 / w;
        }
        (
            _mm512_loadu_si512(perm.as_ptr() as *const _),
            _mm512_loadu_si512(inv.as_ptr() as *const _),
            _mm512_loadu_ps(wt.as_ptr()),
            _mm512_loadu_ps(iw.as_ptr()),
        )
    }

    #[inline(always)]
    unsafe fn mask(bits: u32) -> __m512i {
        match bits {
            2 => _mm512_setr_epi32(
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
            ),
            _ => _mm512_setr_epi32(
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
            ),
        }
    }

    /// Codes of chunk `c` (channels `16c..16c+16`) of the row at `row`, each
    /// times its lane weight (see [`lane`]).
    #[inline(always)]
    unsafe fn unpack<const BITS: u32>(row: *const u32, c: usize, mask: __m512i) -> __m512 {
        match BITS {
            2 => _mm512_cvtepu32_ps(_mm512_and_si512(_mm512_set1_epi32(*row.add(c) as i32), mask)),
            4 => {
                let w = (row.add(2 * c) as *const u64).read_unaligned();
                _mm512_cvtepu32_ps(_mm512_and_si512(_mm512_set1_epi64(w as i64), mask))
            }
            _ => _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(4 * c) as *const __m128i))),
        }
    }

    /// Sixteen horizontal sums at once: lane `4k + m` of the result is the
    /// sum of `v[4m + k]`.
    #[inline(always)]
    unsafe fn tree(v: &[__m512; 16]) -> __m512 {
        let mut s = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            s[i] = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            );
        }
        let mut t = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let (a, b) = (s[2 * i], s[2 * i + 1]);
            t[i] = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            );
        }
        let mut y = [_mm512_setzero_ps(); 2];
        for i in 0..2 {
            let (a, b) = (t[2 * i], t[2 * i + 1]);
            y[i] = _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            );
        }
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
        )
    }

    /// Folds the key group containing block row `off` into `st.qf`/`st.cst`.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn fold(st: &mut State, t: &Tile) {
        let (g, d) = (st.g, st.d);
        let i0 = t.klayout.param_index(t.off, 0);
        let halves = t.kpart.as_ptr() as *const u16;
        let (so, zo) = (2 * t.klayout.scales_offset, 2 * t.klayout.zeros_offset);
        debug_assert!(i0 + d <= 2 * t.klayout.param_words);
        // Channel chunks outer, heads inner: each chunk's parameters are
        // widened once, in registers, and four heads' constants accumulate
        // side by side (their reductions overlap).
        let (ks, kz) = (halves.add(so + i0), halves.add(zo + i0));
        for hb in (0..g).step_by(4) {
            let mut cz = [_mm512_setzero_ps(); 4];
            for c in (0..d).step_by(16) {
                let sv = _mm512_cvtph_ps(_mm256_loadu_si256(ks.add(c) as *const __m256i));
                let zv = _mm512_cvtph_ps(_mm256_loadu_si256(kz.add(c) as *const __m256i));
                for (j, cz) in cz.iter_mut().enumerate() {
                    let at = (hb + j) * d + c;
                    let f = _mm512_mul_ps(_mm512_loadu_ps(st.qw.as_ptr().add(at)), sv);
                    _mm512_storeu_ps(st.qf.as_mut_ptr().add(at), f);
                    *cz = _mm512_fmadd_ps(_mm512_loadu_ps(st.q.as_ptr().add(at)), zv, *cz);
                }
            }
            for (j, cz) in cz.iter().enumerate() {
                st.cst[hb + j] = _mm512_reduce_add_ps(*cz);
            }
        }
    }

    /// Prefetches piece `i` of the tile's `ahead` lines (into L2), `step[k]`
    /// lines of part `k` a piece (no division in the loop).
    #[inline(always)]
    unsafe fn prefetch_piece(t: &Tile, i: usize, step: [usize; 2]) {
        for (part, step) in t.ahead.iter().zip(step) {
            let lines = part.len().div_ceil(16);
            for l in (i * step).min(lines)..((i + 1) * step).min(lines) {
                _mm_prefetch::<_MM_HINT_T1>(part.as_ptr().add(16 * l) as *const i8);
            }
        }
    }

    /// One word of sixteen rows (`z`, lane = row): its codes times the
    /// folded query `qw[h * d + k]` of four heads, into `a[k % 2][h]`.
    #[inline(always)]
    unsafe fn word<const BITS: u32>(
        z: __m512i,
        qw: *const f32,
        d: usize,
        masks: &[__m512i; 16],
        a: &mut [[__m512; 4]; 2],
    ) {
        for k in (0..(32 / BITS) as usize).step_by(2) {
            let x0 = _mm512_cvtepu32_ps(_mm512_and_si512(z, masks[k]));
            let x1 = _mm512_cvtepu32_ps(_mm512_and_si512(z, masks[k + 1]));
            for h in 0..4 {
                a[0][h] = _mm512_fmadd_ps(_mm512_set1_ps(*qw.add(h * d + k)), x0, a[0][h]);
                a[1][h] = _mm512_fmadd_ps(_mm512_set1_ps(*qw.add(h * d + k + 1)), x1, a[1][h]);
            }
        }
    }

    /// Permutation indices of [`transpose8`], built once by following the
    /// (row, word) label of every lane through the three levels.
    fn transpose_indices() -> &'static [[i32; 16]; 24] {
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

    /// Words `wb..wb + 8` of sixteen rows `wpt` words apart, transposed:
    /// vector `w` holds word `wb + w` of rows 0..16 (lane = row). Three
    /// levels of eight two-source permutes.
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

    /// Scores of rows `off..off + n` into `st.p` (`[g][n]`), sixteen rows
    /// at a time: a gather turns the rows' word `w` into one vector (lane =
    /// row), so each of the word's codes becomes sixteen rows' worth of
    /// values in two instructions and the scores come out as one vector per
    /// head, with no horizontal sums.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub unsafe fn scores<const BITS: u32>(fast: Fast, st: &mut State, t: &Tile) {
        let (g, d, n) = (st.g, st.d, t.n);
        let wpt = t.klayout.words_per_token;
        let per = (32 / BITS) as usize;
        let lane_rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(wpt as i32),
        );
        // The next block's lines, spread over the tile's (16 rows, word) pieces.
        let pieces = n / ROWS * wpt;
        let step = t.ahead.map(|p| p.len().div_ceil(16).div_ceil(pieces));
        let mut masks = [_mm512_setzero_si512(); 16];
        for (k, m) in masks.iter_mut().enumerate().take(per) {
            *m = _mm512_set1_epi32((((1u64 << BITS) - 1) << (BITS as usize * k)) as u32 as i32);
        }
        // Token-axis keys: every `wpg` words close a group, whose partial
        // scores are scaled per row and joined by the zero-point term.
        let (kng, wpg) = match fast.keys {
            Keys::Token { gshift } => {
                token_params(fast, t.kpart, &t.klayout, t.off, n, st.kng, &mut st.ks, &mut st.kz);
                (st.kng, (((1usize << gshift) * BITS as usize) / 32).max(1))
            }
            Keys::Channel { .. } => (0, usize::MAX),
        };
        for r0 in (0..n).step_by(ROWS) {
            let off = t.off + r0;
            if let Keys::Channel { group } = fast.keys {
                let key = (t.block, off / group);
                if st.key_group != Some(key) {
                    fold(st, &Tile { off, ..*t });
                    st.key_group = Some(key);
                }
            }
            let rows = t.kpart.as_ptr().add(off * wpt) as *const i32;
            for hb in (0..g).step_by(4) {
                // Channel axis: the folded query; token axis: the query itself.
                let qf = if kng == 0 { st.qf.as_ptr() } else { st.qw.as_ptr() }.add(hb * d);
                let mut sc = [_mm512_setzero_ps(); 4];
                let mut close = |a: &mut [[__m512; 4]; 2], w: usize| {
                    if kng > 0 && (w + 1).is_multiple_of(wpg) {
                        let gk = w / wpg;
                        let sv = _mm512_loadu_ps(st.ks.as_ptr().add(gk * n + r0));
                        let zv = _mm512_loadu_ps(st.kz.as_ptr().add(gk * n + r0));
                        for h in 0..4 {
                            let part = _mm512_add_ps(a[0][h], a[1][h]);
                            sc[h] = _mm512_fmadd_ps(sv, part, sc[h]);
                            sc[h] = _mm512_fmadd_ps(zv, _mm512_set1_ps(st.qsum[(hb + h) * kng + gk]), sc[h]);
                            a[0][h] = _mm512_setzero_ps();
                            a[1][h] = _mm512_setzero_ps();
                        }
                    }
                };
                // Two sets of four heads (even and odd codes of a word):
                // eight FMA chains in flight.
                let mut a = [[_mm512_setzero_ps(); 4]; 2];
                if wpt.is_multiple_of(8) {
                    for wb in (0..wpt).step_by(8) {
                        let z = transpose8(rows, wpt, wb);
                        for (w, &z) in z.iter().enumerate() {
                            if hb == 0 {
                                prefetch_piece(t, r0 / ROWS * wpt + wb + w, step);
                            }
                            word::<BITS>(z, qf.add((wb + w) * per), d, &masks, &mut a);
                            close(&mut a, wb + w);
                        }
                    }
                } else {
                    for w in 0..wpt {
                        if hb == 0 {
                            prefetch_piece(t, r0 / ROWS * wpt + w, step);
                        }
                        let z =
                            _mm512_i32gather_epi32::<4>(_mm512_add_epi32(lane_rows, _mm512_set1_epi32(w as i32)), rows);
                        word::<BITS>(z, qf.add(w * per), d, &masks, &mut a);
                        close(&mut a, w);
                    }
                }
                for h in 0..4 {
                    let v = if kng > 0 {
                        sc[h]
                    } else {
                        _mm512_add_ps(_mm512_add_ps(a[0][h], a[1][h]), _mm512_set1_ps(st.cst[hb + h]))
                    };
                    _mm512_storeu_ps(st.p.as_mut_ptr().add((hb + h) * n + r0), v);
                }
            }
        }
    }

    /// `exp(x)` for `x <= 0`, the polynomial of `simd::exp_body`; 0 below -64.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        let a = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            a,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), a);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let e = _mm512_scalef_ps(p, n);
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-64.0)), e)
    }

    /// Online softmax over the tile's scores: `st.p` becomes the weights.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub unsafe fn softmax(st: &mut State, n: usize, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
        let (g, d) = (st.g, st.d);
        // Three sweeps rather than one per head, so that the heads' maxima
        // reductions and exponentials overlap instead of waiting on each
        // other's latency chains.
        for h in 0..g {
            let s = st.p.as_ptr().add(h * n);
            let mut mx = _mm512_loadu_ps(s);
            for i in (16..n).step_by(16) {
                mx = _mm512_max_ps(mx, _mm512_loadu_ps(s.add(i)));
            }
            st.tmax[h] = _mm512_reduce_max_ps(mx);
        }
        for h in 0..g {
            let new_m = m[h].max(st.tmax[h]);
            // Most tiles leave the maximum where it was: no exp, no rescale.
            if new_m != m[h] {
                let corr = if m[h] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m[h] - new_m).exp()
                };
                l[h] *= corr;
                for x in &mut acc[h * d..(h + 1) * d] {
                    *x *= corr;
                }
                st.rescale(h, corr);
                m[h] = new_m;
            }
        }
        for h in 0..g {
            let s = st.p.as_mut_ptr().add(h * n);
            let mv = _mm512_set1_ps(m[h]);
            let mut sum = _mm512_loadu_ps(st.lvec.as_ptr().add(16 * h));
            for i in (0..n).step_by(16) {
                let p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s.add(i)), mv));
                _mm512_storeu_ps(s.add(i), p);
                sum = _mm512_add_ps(sum, p);
            }
            _mm512_storeu_ps(st.lvec.as_mut_ptr().add(16 * h), sum);
        }
    }

    /// Token-axis parameters of rows `off..off + n` of `part`, `[n][ng]` f16
    /// -> `[ng][n]` f32 in `vs` (scales) and `vz` (zero points). A gather
    /// reads 32 bits at half `j - 1` and keeps the high half (half `j`): it
    /// never reads past the section, and the half before the first
    /// parameter is still inside the part (the codes come first).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn token_params(
        fast: Fast,
        part: &[u32],
        layout: &kivi_spec::layout::TensorLayout,
        off: usize,
        n: usize,
        ng: usize,
        vs: &mut [f32],
        vz: &mut [f32],
    ) {
        let i0 = layout.param_index(off, 0);
        debug_assert!(i0 + n * ng <= 2 * layout.param_words && layout.scales_offset > 0);
        debug_assert!(vs.len() >= ng * n && vz.len() >= ng * n);
        let halves = part.as_ptr() as *const u16;
        let lane_idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(ng as i32),
        );
        for (dst, at) in [(vs, layout.scales_offset), (vz, layout.zeros_offset)] {
            if ng == 4 && fast.bw {
                transpose_params4(halves.add(2 * at + i0), dst.as_mut_ptr(), n);
                continue;
            }
            let src = halves.add(2 * at + i0 - 1) as *const i32;
            for gv in 0..ng {
                for i in (0..n).step_by(16) {
                    let idx = _mm512_add_epi32(lane_idx, _mm512_set1_epi32((i * ng + gv) as i32));
                    let w = _mm512_i32gather_epi32::<2>(idx, src);
                    let h = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(w));
                    _mm512_storeu_ps(dst.as_mut_ptr().add(gv * n + i), _mm512_cvtph_ps(h));
                }
            }
        }
    }

    /// `acc += sum_t p_t v_t` over the tile's value rows.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub unsafe fn values<const BITS: u32>(fast: Fast, st: &mut State, t: &Tile, acc: &mut [f32]) {
        let (g, d, n, ng) = (st.g, st.d, t.n, st.ng);
        token_params(fast, t.vpart, &t.vlayout, t.off, n, ng, &mut st.vs, &mut st.vz);
        // w = p s per (head, group, token); zero points summed per (head,
        // group) into `st.zt`, added once per tile (sixteen sums at a time
        // through the transpose tree where they come in sixteens).
        let pairs = g * ng;
        let mut zv = [_mm512_setzero_ps(); 16];
        for h in 0..g {
            for gv in 0..ng {
                let mut z = _mm512_setzero_ps();
                for i in (0..n).step_by(16) {
                    let p = _mm512_loadu_ps(st.p.as_ptr().add(h * n + i));
                    let s = _mm512_loadu_ps(st.vs.as_ptr().add(gv * n + i));
                    z = _mm512_fmadd_ps(p, _mm512_loadu_ps(st.vz.as_ptr().add(gv * n + i)), z);
                    _mm512_storeu_ps(st.w.as_mut_ptr().add((h * ng + gv) * n + i), _mm512_mul_ps(p, s));
                }
                let i = h * ng + gv;
                if pairs.is_multiple_of(16) {
                    zv[i % 16] = z;
                    if i % 16 == 15 {
                        let mut sums = [0f32; 16];
                        _mm512_storeu_ps(sums.as_mut_ptr(), tree(&zv));
                        // Lane 4k + m holds the sum of zv[4m + k].
                        for (lane, &v) in sums.iter().enumerate() {
                            st.zt[i - 15 + 4 * (lane % 4) + lane / 4] = v;
                        }
                    }
                } else {
                    st.zt[i] = _mm512_reduce_add_ps(z);
                }
            }
        }
        let chunks = d / 16;
        for hb in (0..g).step_by(4) {
            let mut c0 = 0;
            while c0 < chunks {
                let left = chunks - c0;
                // Where pairs of chunks share a value group, the pass
                // needs half the weight pointers (no spills).
                let pairs = fast.gshift >= 5 && c0.is_multiple_of(2);
                c0 += if left >= 4 && pairs {
                    pass::<BITS, 4, true>(fast, st, t, acc, hb, c0)
                } else if left >= 4 {
                    pass::<BITS, 4, false>(fast, st, t, acc, hb, c0)
                } else if left >= 2 {
                    pass::<BITS, 2, false>(fast, st, t, acc, hb, c0)
                } else {
                    pass::<BITS, 1, false>(fast, st, t, acc, hb, c0)
                };
            }
        }
    }

    /// Value parameters of `n` rows with four groups each, `[n][4]` f16 at
    /// `src`, to `[4][n]` f32 at `dst`: two 64-half permutes per 16 rows.
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

    /// Chunks `c0..c0 + NC` of heads `hb..hb + 4`: the accumulators stay in
    /// registers (in lane order and weight) while the tile's rows stream by.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn pass<const BITS: u32, const NC: usize, const PAIRS: bool>(
        fast: Fast,
        st: &State,
        t: &Tile,
        acc: &mut [f32],
        hb: usize,
        c0: usize,
    ) -> usize {
        let (d, n, ng) = (st.d, t.n, st.ng);
        let wpt = t.vlayout.words_per_token;
        let (_, inv, _, iw) = lanes(BITS);
        let mk = mask(BITS);
        // The tile's sum starts from zero and is added to `acc` at the end:
        // short sums round better than one long running sum, and the zero
        // points' term (of the opposite sign) joins before that addition.
        let mut a = [[_mm512_setzero_ps(); NC]; 4];
        let mut wp = [[std::ptr::null::<f32>(); NC]; 4];
        for h in 0..4 {
            for cc in 0..NC {
                let gv = (16 * (c0 + cc)) >> fast.gshift;
                wp[h][cc] = st.w.as_ptr().add(((hb + h) * ng + gv) * n);
            }
        }
        let rows = t.vpart.as_ptr().add(t.off * wpt);
        for i in 0..n {
            let row = rows.add(i * wpt);
            let mut x = [_mm512_setzero_ps(); NC];
            for cc in 0..NC {
                x[cc] = unpack::<BITS>(row, c0 + cc, mk);
            }
            for h in 0..4 {
                for cc in 0..NC {
                    let wi = if PAIRS { cc & !1 } else { cc };
                    a[h][cc] = _mm512_fmadd_ps(_mm512_set1_ps(*wp[h][wi].add(i)), x[cc], a[h][cc]);
                }
            }
        }
        for h in 0..4 {
            for cc in 0..NC {
                let gv = (16 * (c0 + cc)) >> fast.gshift;
                let z = _mm512_set1_ps(st.zt[(hb + h) * ng + gv]);
                let mut v = _mm512_mul_ps(a[h][cc], iw);
                if BITS == 4 {
                    // Back from the permuted lane order of 4-bit chunks.
                    v = _mm512_permutexvar_ps(inv, v);
                }
                let v = _mm512_add_ps(v, z);
                let at = acc.as_mut_ptr().add((hb + h) * d + 16 * (c0 + cc));
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), v));
            }
        }
        NC
    }
}
