//! Inner loops for `full` tensors (keys and values stored in the activation
//! dtype: the `f16` preset, and bf16/f32 schemes) on AVX-512 and AVX2:
//! `avx512-dense` / `avx2-dense` in [`super::CpuBackend::kernel_path`].
//!
//! **f16 rows with groups of four query heads** (`avx512-dense-fused` /
//! `avx2-dense-fused`: the f16 preset at GQA 32:8, MQA 4:1 and every group
//! of a multiple of four) run each aligned tile of block-resident tokens
//! through [`tile`]: scores, online softmax and value sum in one call,
//! written once over the vector width (`width.rs`) like the fused
//! quantized path. The F16C / AVX-512 conversion (`vcvtph2ps`) widens
//! each row chunk once per pass; see [`tile`] for what it saves. Measured
//! 1.55–2x faster than the loops below with the KV warm (one thread,
//! docs/performance.md); the tokens around them (a split's ragged ends,
//! other tiles) and the other dtypes and groups take the loops below.
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

use super::fused::{Tile, ROWS};
use super::simd::{Isa, Rows};
#[cfg(target_arch = "x86_64")]
use super::width::{Avx2, Avx512};

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

/// Per-task scratch of the fused dense tile ([`tile`]): the tile's scores,
/// then its softmax weights, `[g][tile]` (heads-major, so the softmax is
/// vector code), and each head's tile maximum.
pub(crate) struct TileState {
    g: usize,
    d: usize,
    p: Vec<f32>,
    tmax: Vec<f32>,
}

impl TileState {
    pub fn new(g: usize, d: usize, tile: usize) -> TileState {
        TileState {
            g,
            d,
            p: vec![0.0; g * tile],
            tmax: vec![0.0; g],
        }
    }
}

/// Whether f16 rows of `g` query heads per KV head at head dim `d` take the
/// fused tile on `isa`: groups of four heads (GQA 32:8, MQA 4:1 and every
/// multiple), rows a whole number of vectors.
pub(crate) fn tile_fits(isa: Isa, g: usize, d: usize) -> bool {
    cfg!(target_arch = "x86_64") && isa != Isa::Scalar && g > 0 && g.is_multiple_of(4) && d.is_multiple_of(isa.width())
}

/// One aligned tile of block-resident f16 rows, end to end: scores of every
/// head, online softmax (updating the running max `m`, sum `l` and the
/// accumulator `acc`, `[g][d]`, in the generic loops' convention), weighted
/// value sum. `q` is `[g][d]` with the softmax scale applied.
///
/// What it does that the dense loops above (`dot`, `axpy`, and the
/// generic softmax between them) do not:
/// - one call a tile: no per-16-row calls into per-head-block kernels,
///   and the next block's rows are prefetched a few lines per four rows
///   from the scoring loop;
/// - keys scored four rows by four heads at once on AVX-512 (sixteen FMA
///   chains; two rows on AVX2, whose sixteen registers hold eight), the
///   query chunk of four heads loaded once per four rows, and the sixteen
///   sums reduced together straight into heads-major order
///   (`Width::sum4x4`: one transpose tree on AVX-512);
/// - the softmax in vector registers over `[g][n]` (max, exp, sum), where
///   the generic path runs scalar loops over `[n][g]`.
///
/// Panics (an internal bug, not bad input) if the tile's rows are outside
/// the parts it names.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tile(isa: Isa, st: &mut TileState, t: &Tile, q: &[f32], m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    let (g, d, n) = (st.g, st.d, t.n);
    assert!(tile_fits(isa, g, d) && n > 0 && n.is_multiple_of(ROWS) && g * n <= st.p.len());
    let (kw, vw) = (t.klayout.words_per_token, t.vlayout.words_per_token);
    assert!(2 * kw >= d && 2 * vw >= d);
    assert!((t.off + n) * kw <= t.klayout.codes_words() && (t.off + n) * vw <= t.vlayout.codes_words());
    assert!(t.kpart.len() >= t.klayout.codes_words() && t.vpart.len() >= t.vlayout.codes_words());
    assert!(q.len() >= g * d && m.len() >= g && l.len() >= g && acc.len() >= g * d && st.tmax.len() >= g);
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"));
    // SAFETY: features checked (AVX-512 below); the asserts bound every row
    // (`off..off + n` of both parts), query, score and accumulator index the
    // loops form.
    unsafe {
        match isa {
            // Every CPU with AVX-512F and DQ has VL too; were one not to,
            // the 8-lane body is right on it.
            Isa::Avx512 if is_x86_feature_detected!("avx512vl") => {
                assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq"));
                tile_avx512(st, t, q, m, l, acc)
            }
            Isa::Avx512 | Isa::Avx2 => tile_avx2(st, t, q, m, l, acc),
            Isa::Scalar => unreachable!("tile_fits excludes the scalar loops"),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn tile(_: Isa, _: &mut TileState, _: &Tile, _: &[f32], _: &mut [f32], _: &mut [f32], _: &mut [f32]) {
    unreachable!("tile_fits is false off x86-64")
}

/// The body instantiated for AVX-512. With VL: without it, LLVM zeroes
/// the accumulators with 128-bit VEX instructions, which reach only
/// registers 0–15, and spilled four of the sixteen score accumulators to
/// the stack every chunk (seen in `objdump`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn tile_avx512(st: &mut TileState, t: &Tile, q: &[f32], m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    body::tile::<Avx512>(st, t, q, m, l, acc)
}

/// The body instantiated for AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(st: &mut TileState, t: &Tile, q: &[f32], m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    body::tile::<Avx2>(st, t, q, m, l, acc)
}

/// The one body, generic over the width (`width.rs`), inlined into the two
/// entry points above.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod body {
    use super::{Tile, TileState};
    use crate::cpu::width::Width;
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};

    #[inline(always)]
    pub unsafe fn tile<V: Width>(
        st: &mut TileState,
        t: &Tile,
        q: &[f32],
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
    ) {
        let (g, d, n) = (st.g, st.d, t.n);
        // Halves per row, and the tile's first row in each part.
        let (ks, vs) = (2 * t.klayout.words_per_token, 2 * t.vlayout.words_per_token);
        let k = (t.kpart.as_ptr() as *const u16).add(t.off * ks);
        let v = (t.vpart.as_ptr() as *const u16).add(t.off * vs);
        // The next block's rows: an equal share of lines every four rows of
        // the first four heads' scoring.
        let pieces = n / 4;
        let step = t.ahead.map(|a| a.len().div_ceil(16).div_ceil(pieces));
        let p = st.p.as_mut_ptr();
        for hb in (0..g).step_by(4) {
            let qh = q.as_ptr().add(hb * d);
            for i in (0..n).step_by(4) {
                if hb == 0 {
                    prefetch_piece(t, i / 4, step);
                }
                // Sixteen sums, `4 r + h` for row i + r and head hb + h,
                // reduced heads-major straight into the scores.
                let mut a = [V::zero(); 16];
                if V::WIDE {
                    rows::<V, 4>(k.add(i * ks), ks, d, qh, &mut a, 0);
                } else {
                    rows::<V, 2>(k.add(i * ks), ks, d, qh, &mut a, 0);
                    rows::<V, 2>(k.add((i + 2) * ks), ks, d, qh, &mut a, 2);
                }
                V::sum4x4(&a, p.add(hb * n + i), n);
            }
        }
        softmax::<V>(st, n, m, l, acc);
        let chunks = d / V::LANES;
        for hb in (0..g).step_by(4) {
            let (ph, ah) = (st.p.as_ptr().add(hb * n), acc.as_mut_ptr().add(hb * d));
            let mut c = 0;
            while c < chunks {
                if V::WIDE && c + 4 <= chunks {
                    values::<V, 4>(v, vs, n, d, ph, ah, c);
                    c += 4;
                } else if c + 2 <= chunks {
                    values::<V, 2>(v, vs, n, d, ph, ah, c);
                    c += 2;
                } else {
                    values::<V, 1>(v, vs, n, d, ph, ah, c);
                    c += 1;
                }
            }
        }
    }

    /// Dot products of rows `0..R` (`ks` halves apart at `k`) with four
    /// heads (`q`, `[4][d]`) into `out[4 (r0 + r) + h]`, unreduced: `4 R`
    /// FMA chains, each query chunk loaded once for the `R` rows.
    #[inline(always)]
    unsafe fn rows<V: Width, const R: usize>(
        k: *const u16,
        ks: usize,
        d: usize,
        q: *const f32,
        out: &mut [V::F; 16],
        r0: usize,
    ) {
        // No closures here (`array::from_fn`): a closure does not inherit
        // the entry point's target features, and its intrinsics were left
        // as calls (measured 2.5x slower).
        let mut a = [[V::zero(); 4]; R];
        let mut qv = [V::zero(); 4];
        let mut c = 0;
        while c < d {
            for h in 0..4 {
                qv[h] = V::load(q.add(h * d + c));
            }
            for r in 0..R {
                let x = V::load_f16(k.add(r * ks + c));
                for h in 0..4 {
                    a[r][h] = V::fmadd(qv[h], x, a[r][h]);
                }
            }
            c += V::LANES;
        }
        for r in 0..R {
            for h in 0..4 {
                out[4 * (r0 + r) + h] = a[r][h];
            }
        }
    }

    /// Online softmax over the scores `st.p` (`[g][n]`): they become the
    /// weights, `m`, `l` and `acc` are updated. Sweeps over all heads one
    /// after the other, so that the heads' latency chains overlap.
    #[inline(always)]
    unsafe fn softmax<V: Width>(st: &mut TileState, n: usize, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
        let (g, d) = (st.g, st.d);
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
            // Most tiles leave the maximum where it was: no rescale.
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
                m[h] = new_m;
            }
        }
        for h in 0..g {
            let s = st.p.as_mut_ptr().add(h * n);
            let mv = V::splat(m[h]);
            let mut sum = V::zero();
            for i in (0..n).step_by(V::LANES) {
                let e = V::exp_le0(V::sub(V::load(s.add(i)), mv));
                V::store(s.add(i), e);
                sum = V::add(sum, e);
            }
            l[h] += V::reduce_add(sum);
        }
    }

    /// `acc[h][c] += sum_i p[h][i] v_i[c]` for four heads and value chunks
    /// `c0..c0 + NC`: `4 NC` accumulators stay in registers while the `n`
    /// rows stream past (the tile's rows are in L1 by the second pass).
    #[inline(always)]
    unsafe fn values<V: Width, const NC: usize>(
        v: *const u16,
        vs: usize,
        n: usize,
        d: usize,
        p: *const f32,
        acc: *mut f32,
        c0: usize,
    ) {
        let w = V::LANES;
        let mut a = [[V::zero(); NC]; 4];
        for h in 0..4 {
            for k in 0..NC {
                a[h][k] = V::load(acc.add(h * d + w * (c0 + k)));
            }
        }
        for i in 0..n {
            let mut x = [V::zero(); NC];
            for k in 0..NC {
                x[k] = V::load_f16(v.add(i * vs + w * (c0 + k)));
            }
            for h in 0..4 {
                let wt = V::splat(*p.add(h * n + i));
                for k in 0..NC {
                    a[h][k] = V::fmadd(wt, x[k], a[h][k]);
                }
            }
        }
        for h in 0..4 {
            for k in 0..NC {
                V::store(acc.add(h * d + w * (c0 + k)), a[h][k]);
            }
        }
    }

    /// Prefetches piece `i` of the tile's `ahead` lines (into L2), `step[k]`
    /// lines of part `k` a piece.
    #[inline(always)]
    unsafe fn prefetch_piece(t: &Tile, i: usize, step: [usize; 2]) {
        for (part, step) in t.ahead.iter().zip(step) {
            let lines = part.len().div_ceil(16);
            for l in (i * step).min(lines)..((i + 1) * step).min(lines) {
                _mm_prefetch::<_MM_HINT_T1>(part.as_ptr().add(16 * l) as *const i8);
            }
        }
    }
}
