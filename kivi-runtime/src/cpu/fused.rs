//! The fused fast path for quantized caches: channel-axis 2/4-bit keys
//! (KIVI) or token-axis 2/4/8-bit keys (int8-style), token-axis 2/4/8-bit
//! values, f16 parameters, GQA groups of a multiple of four query heads.
//! One call runs one aligned tile of block-resident tokens end to end:
//! scores, online softmax, weighted value sum. Everything else (sinks, the
//! full-precision window, other schemes) takes the generic loops in
//! [`super::simd`], which stay the readable version.
//!
//! The body is written once over a vector width ([`super::width::Width`])
//! and instantiated twice: AVX-512 (16 lanes, `avx512-fused`) and AVX2 +
//! FMA + F16C (8 lanes, `avx2-fused`). Each instantiation is one
//! `#[target_feature]` function into which the generic body and the width's
//! operations are inlined.
//!
//! Where the time goes, and what this path does about it (per token and KV
//! head the arithmetic is `2 x heads x head_dim` multiply-adds, one vector
//! per instruction; everything else is overhead to minimise):
//! - **Codes to floats in two instructions.** A code word (or a zero-extended
//!   run of bytes on AVX2) is ANDed with a per-lane or per-vector mask and
//!   converted: a lane holds `c * 2^(bits * slot)` rather than `c` (`slot` =
//!   the code's place in its word or byte). The keys divide the query by
//!   that power of two once per split (`qw`); the values keep their sums in
//!   that *storage order and weight* for the whole split and divide once
//!   when it ends ([`State::flush`]). Powers of two are exact, so this
//!   changes the instruction count, not the rounding. A key word's top slot
//!   is shifted down instead of masked, so every lane stays below 2^31 and
//!   the signed conversion (the only one AVX2 has) is exact.
//! - **Keys scored a vector of rows at a time, transposed.** The rows' words
//!   are transposed in registers (three levels of permutes on AVX-512, the
//!   8 x 8 unpack transpose on AVX2; a gather where a row is not a multiple
//!   of eight words) so that one vector holds word `w` of 16 or 8 rows; each
//!   code slot then feeds four FMAs (the query broadcast from L1), and the
//!   scores come out as one vector per head: no horizontal sums, and the
//!   softmax is vector code too.
//! - **Scales folded out of the inner loops.** Channel-axis keys: `q . k_t
//!   = sum_d (q_d s_d) c_td + sum_d q_d z_d`, one folded query per key group.
//!   Token-axis keys: per key group `g`, `s_tg (q_g . c_tg) + z_tg sum_g q`,
//!   a vector of rows' partial dot products times the vector of their
//!   scales. Values: `sum_t p_t (s_t c_td + z_t) = sum_t (p_t s_t) c_td +
//!   sum_t p_t z_t`, so a value costs one FMA per head, the zero points one
//!   FMA per (head, group) per vector of tokens.
//! - **Eight to sixteen independent accumulators** in both loops: an FMA
//!   has a latency of four cycles and two ports, so fewer than eight chains
//!   leave ports idle (AVX2 has 16 registers: four heads by two value
//!   vectors; AVX-512 four by four).
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

use super::simd::Isa;
#[cfg(target_arch = "x86_64")]
use super::width::{Avx2, Avx512, Width};

/// How the keys are grouped: KIVI's channel axis (scales per channel per
/// `group` tokens, folded into the query) or the token axis (scales per
/// token per `2^gshift` channels, applied to partial scores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    Channel { group: usize },
    Token { gshift: u32 },
}

/// The key and value codings this path was built for, and the width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fast {
    pub kbits: u32,
    pub keys: Keys,
    pub vbits: u32,
    /// log2 of the value group (channels per token group, at least 16).
    pub gshift: u32,
    /// `Avx512` or `Avx2`.
    pub isa: Isa,
    /// AVX-512BW is there (16-bit permutes for the value parameters).
    pub bw: bool,
}

/// Rows per score block: sub-tiles are cut at multiples of this (a
/// multiple of every width's lanes).
pub(crate) const ROWS: usize = 16;

/// Whether a value coding of `vbits`-bit codes in groups of `2^gshift`
/// channels at head dim `d` fits the width of `isa`: a value vector's lanes
/// must share one group.
pub(crate) fn values_fit(isa: Isa, vbits: u32, gshift: u32, d: usize) -> bool {
    let span = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Avx512::value_span(vbits),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Avx2::value_span(vbits),
        _ => return false,
    };
    gshift >= 4 && (1usize << gshift) >= span && d.is_multiple_of(span)
}

/// Per-task scratch of the fast path, reused across tiles.
pub(crate) struct State {
    g: usize,
    d: usize,
    ng: usize,
    /// The query `[g][d]` (subnormal-free), and divided by each channel's
    /// code weight `2^(bits * slot)` (`slot` = the code's place in its word;
    /// 1 for a word's top slot, which is shifted down).
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
    /// Sixteen partial sums of `l` per head, `[g][16]` (the first lanes).
    lvec: Vec<f32>,
    /// This tile's `sum_t p_t z_t` per (head, value group), `[g][ng]`.
    zt: Vec<f32>,
    /// The split's value sums `[g][d]` in storage order and weight, and per
    /// storage position its channel and weight (see `Width::value_lane`).
    vacc: Vec<f32>,
    vch: Vec<usize>,
    vwt: Vec<f32>,
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
            .map(|(i, &x)| {
                let slot = i % d % per;
                if slot == per - 1 {
                    x
                } else {
                    x / (1u64 << (fast.kbits as usize * slot)) as f32
                }
            })
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
        let lanes = fast.isa.width();
        let (vch, vwt): (Vec<usize>, Vec<f32>) = (0..d).map(|i| value_lane(fast, i / lanes, i % lanes)).unzip();
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
            vacc: vec![0.0; g * d],
            vch,
            vwt,
        }
    }

    /// Scales what this state holds for head `h` (a new running maximum).
    pub fn rescale(&mut self, h: usize, corr: f32) {
        for x in &mut self.lvec[h * 16..(h + 1) * 16] {
            *x *= corr;
        }
        for x in &mut self.vacc[h * self.d..(h + 1) * self.d] {
            *x *= corr;
        }
    }

    /// Adds the partial sums of `l` and the value sums (back in channel
    /// order, weights divided out) into the task's, and clears them.
    pub fn flush(&mut self, l: &mut [f32], acc: &mut [f32]) {
        for (h, l) in l.iter_mut().enumerate().take(self.g) {
            *l += self.lvec[h * 16..(h + 1) * 16].iter().sum::<f32>();
        }
        self.lvec.fill(0.0);
        let d = self.d;
        for h in 0..self.g {
            let (a, v) = (&mut acc[h * d..(h + 1) * d], &self.vacc[h * d..(h + 1) * d]);
            for ((&x, &c), &w) in v.iter().zip(&self.vch).zip(&self.vwt) {
                a[c] += x / w;
            }
        }
        self.vacc.fill(0.0);
    }
}

/// Channel and weight of lane `j` of value vector `v` for `fast`'s width.
fn value_lane(fast: Fast, v: usize, j: usize) -> (usize, f32) {
    match fast.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Avx512::value_lane(fast.vbits, v, j),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Avx2::value_lane(fast.vbits, v, j),
        _ => (v + j, 1.0),
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
/// updating the running max `m`, sum `l` and accumulator `acc` (the values
/// reach `acc` at [`State::flush`]).
///
/// Panics (an internal bug, not bad input) if the tile's rows are outside
/// the parts it names.
pub(crate) fn tile(fast: Fast, st: &mut State, t: &Tile, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    run(fast, st, t, m, l, acc, None::<fn(&mut [f32])>)
}

/// As [`tile`], with the scores (`[g][n]`) written by `scores` instead of
/// the f32 key loops: the integer-domain query of `int8.rs`.
pub(crate) fn tile_scored(
    fast: Fast,
    st: &mut State,
    t: &Tile,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    scores: impl FnOnce(&mut [f32]),
) {
    run(fast, st, t, m, l, acc, Some(scores))
}

/// [`tile`] (`scores` is `None`: the key loops score the tile) and
/// [`tile_scored`] written once, so the bounds both rely on are checked in
/// one place and the two cannot drift apart.
#[cfg(target_arch = "x86_64")]
fn run(
    fast: Fast,
    st: &mut State,
    t: &Tile,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    scores: Option<impl FnOnce(&mut [f32])>,
) {
    let (g, d) = (st.g, st.d);
    let keys = scores.is_none();
    assert!(t.n.is_multiple_of(ROWS) && t.off.is_multiple_of(ROWS) && d.is_multiple_of(16) && g.is_multiple_of(4));
    if keys {
        // Only the key loops read the key part.
        assert!((t.off + t.n) * t.klayout.words_per_token <= t.klayout.codes_words());
        assert!(t.kpart.len() >= t.klayout.words);
    }
    assert!((t.off + t.n) * t.vlayout.words_per_token <= t.vlayout.codes_words());
    assert!(t.vpart.len() >= t.vlayout.words);
    assert!(m.len() >= g && l.len() >= g && acc.len() >= g * d && st.p.len() >= g * t.n);
    assert!(values_fit(fast.isa, fast.vbits, fast.gshift, d) && st.vacc.len() >= g * d);
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"));
    if let Some(scores) = scores {
        scores(&mut st.p[..g * t.n]);
    }
    // SAFETY: features checked (AVX-512 below); the asserts bound every row,
    // parameter and buffer index the loops form (rows `off..off + n` of the
    // parts they read).
    unsafe {
        match fast.isa {
            Isa::Avx512 => {
                assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq"));
                tile_avx512(fast, st, t, m, l, acc, keys)
            }
            Isa::Avx2 => tile_avx2(fast, st, t, m, l, acc, keys),
            Isa::Scalar => unreachable!("the fast path is only planned on AVX2 and AVX-512"),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn run(
    _: Fast,
    _: &mut State,
    _: &Tile,
    _: &mut [f32],
    _: &mut [f32],
    _: &mut [f32],
    _: Option<impl FnOnce(&mut [f32])>,
) {
    unreachable!("the fast path is only planned on x86-64")
}

/// The body instantiated for AVX-512 (`keys`: score the tile from its
/// keys, else its scores are already in `st.p`).
// No VL (unlike dense.rs): with it this body's code only swapped 138 zeroing idioms, no spills (objdump, rustc 1.95).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(fast: Fast, st: &mut State, t: &Tile, m: &mut [f32], l: &mut [f32], acc: &mut [f32], keys: bool) {
    body::tile::<Avx512>(fast, st, t, m, l, acc, keys)
}

/// The body instantiated for AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2(fast: Fast, st: &mut State, t: &Tile, m: &mut [f32], l: &mut [f32], acc: &mut [f32], keys: bool) {
    body::tile::<Avx2>(fast, st, t, m, l, acc, keys)
}

/// The one body: generic over the width, every function inlined into the
/// ISA's entry point above.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod body {
    use super::{Fast, Keys, State, Tile, ROWS};
    use crate::cpu::width::Width;

    /// Scores (when `keys`; otherwise they are in `st.p` already: the int8
    /// query's integer scores, `int8.rs`), softmax and values of one tile.
    #[inline(always)]
    pub unsafe fn tile<V: Width>(
        fast: Fast,
        st: &mut State,
        t: &Tile,
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        keys: bool,
    ) {
        if keys {
            match fast.kbits {
                2 => scores::<V, 2>(fast, st, t),
                4 => scores::<V, 4>(fast, st, t),
                _ => scores::<V, 8>(fast, st, t),
            }
        }
        softmax::<V>(st, t.n, m, l, acc);
        match fast.vbits {
            2 => values::<V, 2>(fast, st, t),
            4 => values::<V, 4>(fast, st, t),
            _ => values::<V, 8>(fast, st, t),
        }
    }

    /// Folds the key group containing block row `off` into `st.qf`/`st.cst`.
    #[inline(always)]
    unsafe fn fold<V: Width>(st: &mut State, t: &Tile) {
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
            let mut cz = [V::zero(); 4];
            for c in (0..d).step_by(V::LANES) {
                let sv = V::load_f16(ks.add(c));
                let zv = V::load_f16(kz.add(c));
                for (j, cz) in cz.iter_mut().enumerate() {
                    let at = (hb + j) * d + c;
                    V::store(st.qf.as_mut_ptr().add(at), V::mul(V::load(st.qw.as_ptr().add(at)), sv));
                    *cz = V::fmadd(V::load(st.q.as_ptr().add(at)), zv, *cz);
                }
            }
            for (j, cz) in cz.iter().enumerate() {
                st.cst[hb + j] = V::reduce_add(*cz);
            }
        }
    }

    /// Prefetches piece `i` of the tile's `ahead` lines (into L2), `step[k]`
    /// lines of part `k` a piece (no division in the loop).
    #[inline(always)]
    unsafe fn prefetch_piece(t: &Tile, i: usize, step: [usize; 2]) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        for (part, step) in t.ahead.iter().zip(step) {
            let lines = part.len().div_ceil(16);
            for l in (i * step).min(lines)..((i + 1) * step).min(lines) {
                _mm_prefetch::<_MM_HINT_T1>(part.as_ptr().add(16 * l) as *const i8);
            }
        }
    }

    /// One word of sixteen rows (`z`, lane = row; one vector of 16 rows,
    /// or two of 8): its codes times the folded query `qw[h * d + k]` of
    /// four heads, into two sets of four accumulators. Sixteen lanes: the
    /// sets are the even and odd codes; eight: the two halves of the rows,
    /// so that each broadcast of the query (a separate instruction on AVX2)
    /// feeds two FMAs. Either way eight FMA chains are in flight. The top
    /// slot is shifted down rather than masked (see `State::qw`).
    #[inline(always)]
    unsafe fn word<V: Width, const BITS: u32>(
        z: [V::I; 2],
        qw: *const f32,
        d: usize,
        masks: &[V::I; 16],
        a: &mut [[V::F; 4]; 2],
    ) {
        let per = (32 / BITS) as usize;
        if V::LANES == ROWS {
            for k in (0..per).step_by(2) {
                let x0 = slot::<V, BITS>(z[0], k, masks);
                let x1 = slot::<V, BITS>(z[0], k + 1, masks);
                for h in 0..4 {
                    a[0][h] = V::fmadd(V::splat(*qw.add(h * d + k)), x0, a[0][h]);
                    a[1][h] = V::fmadd(V::splat(*qw.add(h * d + k + 1)), x1, a[1][h]);
                }
            }
        } else {
            for k in 0..per {
                let x0 = slot::<V, BITS>(z[0], k, masks);
                let x1 = slot::<V, BITS>(z[1], k, masks);
                for h in 0..4 {
                    let q = V::splat(*qw.add(h * d + k));
                    a[0][h] = V::fmadd(q, x0, a[0][h]);
                    a[1][h] = V::fmadd(q, x1, a[1][h]);
                }
            }
        }
    }

    /// Code slot `k` of every lane of `z`, times its weight (the top slot
    /// shifted down, weight 1).
    #[inline(always)]
    unsafe fn slot<V: Width, const BITS: u32>(z: V::I, k: usize, masks: &[V::I; 16]) -> V::F {
        if k == (32 / BITS) as usize - 1 {
            V::cvt_i(V::srl_i(z, (BITS as usize * k) as i32))
        } else {
            V::cvt_i(V::and_i(z, masks[k]))
        }
    }

    /// Rows `r * LANES..` of sixteen from the two accumulator sets: both
    /// sets (even and odd codes) with one vector of rows, set `r` with two.
    #[inline(always)]
    unsafe fn part<V: Width>(a: &[[V::F; 4]; 2], r: usize, h: usize) -> V::F {
        if V::LANES == ROWS {
            V::add(a[0][h], a[1][h])
        } else {
            a[r][h]
        }
    }

    /// Token-axis keys: closes key group `gk` of rows `r0..r0 + 16` for
    /// heads `hb..hb + 4`: the partial scores times the rows' scales, plus
    /// their zero points times `sum_group q`, into `sc`; clears `a`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn close_group<V: Width>(
        st: &State,
        a: &mut [[V::F; 4]; 2],
        sc: &mut [[V::F; 4]; 2],
        gk: usize,
        n: usize,
        r0: usize,
        hb: usize,
    ) {
        let kng = st.kng;
        for r in 0..ROWS / V::LANES {
            let sv = V::load(st.ks.as_ptr().add(gk * n + r0 + r * V::LANES));
            let zv = V::load(st.kz.as_ptr().add(gk * n + r0 + r * V::LANES));
            for h in 0..4 {
                sc[r][h] = V::fmadd(sv, part::<V>(a, r, h), sc[r][h]);
                sc[r][h] = V::fmadd(zv, V::splat(*st.qsum.get_unchecked((hb + h) * kng + gk)), sc[r][h]);
            }
        }
        *a = [[V::zero(); 4]; 2];
    }

    /// Scores of rows `off..off + n` into `st.p` (`[g][n]`), sixteen rows
    /// at a time: a transpose turns the rows' word `w` into one or two
    /// vectors (lane = row), so each of the word's codes becomes the rows'
    /// values in two instructions and the scores come out as vectors per
    /// head, with no horizontal sums.
    #[inline(always)]
    unsafe fn scores<V: Width, const BITS: u32>(fast: Fast, st: &mut State, t: &Tile) {
        let (g, d, n) = (st.g, st.d, t.n);
        let wpt = t.klayout.words_per_token;
        let per = (32 / BITS) as usize;
        // Vectors per sixteen rows: 1 (AVX-512) or 2 (AVX2).
        let rv = ROWS / V::LANES;
        // The next block's lines, spread over the tile's (16 rows, word) pieces.
        let pieces = n / ROWS * wpt;
        let step = t.ahead.map(|p| p.len().div_ceil(16).div_ceil(pieces));
        let mut masks = [V::splat_i(0); 16];
        for (k, m) in masks.iter_mut().enumerate().take(per) {
            *m = V::splat_i((((1u64 << BITS) - 1) << (BITS as usize * k)) as u32 as i32);
        }
        // Token-axis keys: every `wpg` words close a group, whose partial
        // scores are scaled per row and joined by the zero-point term.
        let (kng, wpg) = match fast.keys {
            Keys::Token { gshift } => {
                token_params::<V>(fast, t.kpart, &t.klayout, t.off, n, st.kng, &mut st.ks, &mut st.kz);
                (st.kng, (((1usize << gshift) * BITS as usize) / 32).max(1))
            }
            Keys::Channel { .. } => (0, usize::MAX),
        };
        for r0 in (0..n).step_by(ROWS) {
            let off = t.off + r0;
            if let Keys::Channel { group } = fast.keys {
                let key = (t.block, off / group);
                if st.key_group != Some(key) {
                    fold::<V>(st, &Tile { off, ..*t });
                    st.key_group = Some(key);
                }
            }
            let rows = t.kpart.as_ptr().add(off * wpt) as *const i32;
            let rows2 = rows.add(V::LANES * wpt);
            for hb in (0..g).step_by(4) {
                // Channel axis: the folded query; token axis: the query itself.
                let qf = if kng == 0 { st.qf.as_ptr() } else { st.qw.as_ptr() }.add(hb * d);
                let mut sc = [[V::zero(); 4]; 2];
                // Token-axis keys close a group every `wpg` words (in a plain
                // function: a closure was left out of line, its accumulators
                // passed through memory every word, 15% of the tile).
                let mut a = [[V::zero(); 4]; 2];
                if wpt.is_multiple_of(8) {
                    for wb in (0..wpt).step_by(8) {
                        let z0 = V::transpose8(rows, wpt, wb);
                        let z1 = if rv == 2 { V::transpose8(rows2, wpt, wb) } else { z0 };
                        for w in 0..8 {
                            if hb == 0 {
                                prefetch_piece(t, r0 / ROWS * wpt + wb + w, step);
                            }
                            word::<V, BITS>([z0[w], z1[w]], qf.add((wb + w) * per), d, &masks, &mut a);
                            if kng > 0 && (wb + w + 1).is_multiple_of(wpg) {
                                close_group::<V>(st, &mut a, &mut sc, (wb + w) / wpg, n, r0, hb);
                            }
                        }
                    }
                } else {
                    for w in 0..wpt {
                        if hb == 0 {
                            prefetch_piece(t, r0 / ROWS * wpt + w, step);
                        }
                        let z0 = V::gather_word(rows, wpt, w);
                        let z1 = if rv == 2 { V::gather_word(rows2, wpt, w) } else { z0 };
                        word::<V, BITS>([z0, z1], qf.add(w * per), d, &masks, &mut a);
                        if kng > 0 && (w + 1).is_multiple_of(wpg) {
                            close_group::<V>(st, &mut a, &mut sc, w / wpg, n, r0, hb);
                        }
                    }
                }
                for r in 0..rv {
                    for h in 0..4 {
                        let v = if kng > 0 {
                            sc[r][h]
                        } else {
                            V::add(part::<V>(&a, r, h), V::splat(st.cst[hb + h]))
                        };
                        V::store(st.p.as_mut_ptr().add((hb + h) * n + r0 + r * V::LANES), v);
                    }
                }
            }
        }
    }

    /// `exp(x)` for `x <= 0` ([`Width::exp_le0`], shared with `dense.rs`).
    #[inline(always)]
    unsafe fn exp<V: Width>(x: V::F) -> V::F {
        V::exp_le0(x)
    }

    /// Online softmax over the tile's scores: `st.p` becomes the weights.
    #[inline(always)]
    unsafe fn softmax<V: Width>(st: &mut State, n: usize, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
        let (g, d) = (st.g, st.d);
        // Three sweeps rather than one per head, so that the heads' maxima
        // reductions and exponentials overlap instead of waiting on each
        // other's latency chains.
        for h in 0..g {
            let s = st.p.as_ptr().add(h * n);
            let mut mx = V::load(s);
            for i in (V::LANES..n).step_by(V::LANES) {
                mx = V::max(mx, V::load(s.add(i)));
            }
            st.tmax[h] = V::reduce_max(mx);
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
            let mv = V::splat(m[h]);
            let mut sum = V::load(st.lvec.as_ptr().add(16 * h));
            for i in (0..n).step_by(V::LANES) {
                let p = exp::<V>(V::sub(V::load(s.add(i)), mv));
                V::store(s.add(i), p);
                sum = V::add(sum, p);
            }
            V::store(st.lvec.as_mut_ptr().add(16 * h), sum);
        }
    }

    /// Token-axis parameters of rows `off..off + n` of `part`, `[n][ng]` f16
    /// -> `[ng][n]` f32 in `vs` (scales) and `vz` (zero points).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn token_params<V: Width>(
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
        for (dst, at) in [(vs, layout.scales_offset), (vz, layout.zeros_offset)] {
            V::params(halves.add(2 * at + i0), ng, n, dst.as_mut_ptr(), fast.bw);
        }
    }

    /// `vacc += sum_t p_t v_t` over the tile's value rows (storage order).
    #[inline(always)]
    unsafe fn values<V: Width, const BITS: u32>(fast: Fast, st: &mut State, t: &Tile) {
        let (g, d, n, ng) = (st.g, st.d, t.n, st.ng);
        token_params::<V>(fast, t.vpart, &t.vlayout, t.off, n, ng, &mut st.vs, &mut st.vz);
        // w = p s per (head, group, token); zero points summed per (head,
        // group) into `st.zt`, added once per tile (sixteen reductions at a
        // time, which the width may overlap).
        let mut zv = [V::zero(); 16];
        let mut k = 0;
        for h in 0..g {
            for gv in 0..ng {
                let mut z = V::zero();
                for i in (0..n).step_by(V::LANES) {
                    let p = V::load(st.p.as_ptr().add(h * n + i));
                    let s = V::load(st.vs.as_ptr().add(gv * n + i));
                    z = V::fmadd(p, V::load(st.vz.as_ptr().add(gv * n + i)), z);
                    V::store(st.w.as_mut_ptr().add((h * ng + gv) * n + i), V::mul(p, s));
                }
                zv[k] = z;
                k += 1;
                let i = h * ng + gv;
                if k == 16 || i + 1 == g * ng {
                    V::reduce_many(&zv[..k], &mut st.zt[i + 1 - k..i + 1]);
                    k = 0;
                }
            }
        }
        let nv = d / V::LANES;
        // Vectors `v` and `v + 1` share a value group (one weight pointer).
        let pair =
            |v: usize| (V::value_lane(BITS, v, 0).0 >> fast.gshift) == (V::value_lane(BITS, v + 1, 0).0 >> fast.gshift);
        for hb in (0..g).step_by(4) {
            let mut c0 = 0;
            while c0 < nv {
                let left = nv - c0;
                // Where pairs of vectors share a value group, the pass
                // needs half the weight pointers (no spills).
                let pairs = |c: usize| c0.is_multiple_of(2) && (0..c).step_by(2).all(|cc| pair(c0 + cc));
                c0 += if V::WIDE && left >= 4 && pairs(4) {
                    pass::<V, BITS, 4, true>(fast, st, t, hb, c0)
                } else if V::WIDE && left >= 4 {
                    pass::<V, BITS, 4, false>(fast, st, t, hb, c0)
                } else if left >= 2 && pairs(2) {
                    pass::<V, BITS, 2, true>(fast, st, t, hb, c0)
                } else if left >= 2 {
                    pass::<V, BITS, 2, false>(fast, st, t, hb, c0)
                } else {
                    pass::<V, BITS, 1, false>(fast, st, t, hb, c0)
                };
            }
        }
    }

    /// Value vectors `c0..c0 + NC` of heads `hb..hb + 4`: the accumulators
    /// stay in registers (in storage order and weight) while the tile's rows
    /// stream by, and join `st.vacc` with the zero points' term at the end.
    #[inline(always)]
    unsafe fn pass<V: Width, const BITS: u32, const NC: usize, const PAIRS: bool>(
        fast: Fast,
        st: &mut State,
        t: &Tile,
        hb: usize,
        c0: usize,
    ) -> usize {
        let (d, n, ng) = (st.d, t.n, st.ng);
        let wpt = t.vlayout.words_per_token;
        // The tile's sum starts from zero and is added to `vacc` at the end:
        // short sums round better than one long running sum, and the zero
        // points' term (of the opposite sign) joins before that addition.
        let mut a = [[V::zero(); NC]; 4];
        let mut wp = [[std::ptr::null::<f32>(); NC]; 4];
        for h in 0..4 {
            for cc in 0..NC {
                let gv = V::value_lane(BITS, c0 + cc, 0).0 >> fast.gshift;
                wp[h][cc] = st.w.as_ptr().add(((hb + h) * ng + gv) * n);
            }
        }
        let rows = t.vpart.as_ptr().add(t.off * wpt);
        for i in 0..n {
            let row = rows.add(i * wpt);
            let mut x = [V::zero(); NC];
            for cc in 0..NC {
                x[cc] = V::unpack::<BITS>(row, c0 + cc);
            }
            for h in 0..4 {
                for cc in 0..NC {
                    let wi = if PAIRS { cc & !1 } else { cc };
                    a[h][cc] = V::fmadd(V::splat(*wp[h][wi].add(i)), x[cc], a[h][cc]);
                }
            }
        }
        for h in 0..4 {
            for cc in 0..NC {
                let v = c0 + cc;
                let gv = V::value_lane(BITS, v, 0).0 >> fast.gshift;
                // The zero points' term in storage weight: `z * weight`.
                let wt = V::load(st.vwt.as_ptr().add(v * V::LANES));
                let s = V::fmadd(V::splat(st.zt[(hb + h) * ng + gv]), wt, a[h][cc]);
                let at = st.vacc.as_mut_ptr().add((hb + h) * d + v * V::LANES);
                V::store(at, V::add(V::load(at), s));
            }
        }
        NC
    }
}
