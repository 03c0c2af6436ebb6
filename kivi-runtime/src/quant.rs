//! DESIGN.md §3 quantization math — the only copy on the host. The
//! reference oracle and the paged cache both call these functions; the
//! kernels (CPU fused path, generated CUDA) re-derive only what they must.

use kivi_spec::{Dtype, Levels, Norm, Quant, ScaleDtype};

/// Rounds `x` to the activation dtype (round to nearest, ties to even) and
/// returns it as f32.
#[inline]
pub fn round_to_dtype(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F32 => x,
    }
}

/// Rounds a scale or zero point to its storage dtype.
#[inline]
pub fn round_to_scale(x: f32, dtype: ScaleDtype) -> f32 {
    match dtype {
        ScaleDtype::F16 => half::f16::from_f32(x).to_f32(),
        ScaleDtype::F32 => x,
    }
}

/// The largest magnitude that every group of `q` can hold, whatever the
/// other values in it, for the fixed table of `q` ([`fixed_levels`]; see
/// [`storable_limit_in`] for a calibrated `nuq` codebook).
pub fn storable_limit(q: &Quant) -> f32 {
    storable_limit_in(q, fixed_levels(q))
}

/// [`storable_limit`] for quantizer `q` decoding with the ascending table
/// `levels` (ignored for uniform levels).
///
/// Uniform levels: the zero point `z = lo` must fit the scale dtype, so
/// must `s = (hi - lo) / (2^b - 1)` for any `lo`, `hi` within ±limit, and
/// `hi - lo` must not overflow f32. (f16 scales: 32752 at 1 bit, 65504
/// above.) Lloyd–Max and `nuq` with `norm = rms` store `s = rms(x)`, at
/// most the largest `|x|`: the scale dtype's largest value. With `norm = l2` the stored
/// `s = ||x|| / ||L[c]||` can exceed every `|x|` of its group (a lone `x`
/// codes to the level nearest `±1`, and `s = |x| / |L|`), so the limit is
/// the largest scale divided by [`l2_scale_ratio`]: a value past it is
/// refused by the append that brings it rather than by the flush that
/// would quantize it (and wedge the sequence).
pub fn storable_limit_in(q: &Quant, levels: &[f32]) -> f32 {
    let max = match q.scale {
        ScaleDtype::F16 => half::f16::MAX.to_f32(),
        ScaleDtype::F32 => f32::MAX,
    };
    if q.levels == Levels::Uniform {
        return max.min(max * (q.max_code() as f32 / 2.0)).min(f32::MAX / 2.0);
    }
    if q.levels.norm().is_some_and(Norm::has_zero) {
        // `z = lo` and `s = hi - lo`: uniform levels' bound at one step.
        return (max / 2.0).min(f32::MAX / 2.0);
    }
    if q.levels.norm() != Some(Norm::L2) || levels.len() < 2 {
        // rms(x) <= max|x|, and its rounding to the scale dtype stays
        // finite below the dtype's largest value. (An empty `nuq` table
        // codes everything 0 with norm 0: nothing to overflow.)
        return max;
    }
    // Every append checks its values against this limit: remembered per
    // thread for the last few (table, group, scale dtype) (the bound below
    // takes microseconds, an append of one token about as long).
    /// A table, a group size, a scale dtype and their limit.
    type Memo = (Vec<f32>, u32, ScaleDtype, f32);
    thread_local! {
        static MEMO: std::cell::RefCell<Vec<Memo>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let hit = MEMO.with(|m| {
        m.borrow()
            .iter()
            .find(|e| e.1 == q.group && e.2 == q.scale && e.0 == levels)
            .map(|e| e.3)
    });
    if let Some(lim) = hit {
        return lim;
    }
    let lim = l2_limit(q, levels, max);
    MEMO.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= 8 {
            m.remove(0);
        }
        m.push((levels.to_vec(), q.group, q.scale, lim));
    });
    lim
}

/// [`storable_limit_in`] for L2 norms, computed.
fn l2_limit(q: &Quant, levels: &[f32], max: f32) -> f32 {
    // The largest `s` (the f64 the codec computes) whose roundings to f32
    // and then to the scale dtype are finite: just below the midpoint
    // between the largest finite value and the next power of two (that
    // midpoint rounds to even, infinity). For f16: f32 values below 65520
    // round to 65504, and f64 ones below 65520 - 2^-9 to such an f32.
    let edge = match q.scale {
        ScaleDtype::F16 => 65520.0 - 2f64.powi(-9),
        ScaleDtype::F32 => f32::MAX as f64 + 2f64.powi(103),
    };
    let top = f64::from_bits(edge.to_bits() - 1);
    let ratio = l2_scale_ratio(levels, q.group.max(1) as usize, q.scale);
    // The largest f32 `x` with `x * ratio <= top`; nudged by ulps because
    // the f64 quotient may land a rounding either side of it.
    let mut lim = ((top / ratio) as f32).min(max);
    while lim > 0.0 && lim as f64 * ratio > top {
        lim = f32::from_bits(lim.to_bits() - 1);
    }
    while lim < max && (f32::from_bits(lim.to_bits() + 1) as f64) * ratio <= top {
        lim = f32::from_bits(lim.to_bits() + 1);
    }
    lim
}

/// An upper bound on `s / max|x|` over every group of `n` values of an L2
/// table-driven quantizer with the ascending table `levels`: how far the
/// stored scale `s = ||x|| / ||L[c]||` can exceed the group's largest
/// magnitude. Exact for `n = 1` (`1 / |L|` of the level that `±1` codes
/// to; `x / rms` is `±1` up to the rounding of the rms to `scale`).
///
/// Why it bounds every group: write `y = x / rms` (so `sum y^2 = n rho`,
/// `rho` within the rms's rounding of 1) and `Y = max|y|`; then
/// `(s / max|x|)^2 = sum y^2 / (Y^2 sum L[c]^2)`. Each `y` lies in the
/// cell of its level, so at most that cell's outer edge and at most `Y`.
/// Relaxing the counts of values per cell to fractions `p` (at least `1/n`
/// at `Y`, which is at most `n rho`) leaves a linear program whose optimum
/// uses at most two cells: one holding `Y`, one at its outer edge below
/// `Y`. The bound is the best such pair (or single cell) at the best `Y`,
/// found in closed form per pair. For larger groups it is the limit of
/// large `n` pulled in by `Y^2 <= n rho` (within about half a percent of
/// the exact integer optimum for the fixed tables).
pub fn l2_scale_ratio(levels: &[f32], n: usize, scale: ScaleDtype) -> f64 {
    let k = levels.len();
    // The decision thresholds exactly as the codec computes them (f32).
    let t: Vec<f64> = levels.windows(2).map(|w| ((w[0] + w[1]) * 0.5) as f64).collect();
    // Magnitudes a value coded to level i can have: (inner, outer].
    let cells: Vec<(f64, f64, f64)> = (0..k)
        .map(|i| {
            let lo = if i == 0 { f64::NEG_INFINITY } else { t[i - 1] };
            let hi = if i + 1 == k { f64::INFINITY } else { t[i] };
            let (inner, outer) = if lo >= 0.0 {
                (lo, hi)
            } else if hi <= 0.0 {
                (-hi, -lo)
            } else {
                (0.0, hi.max(-lo))
            };
            (inner * inner, outer * outer, (levels[i] as f64).powi(2))
        })
        .collect();
    // The rms is rounded to the scale dtype (half an ulp relative), so
    // `sum y^2 / n` is 1 only up to twice that; both ends are tried.
    let eps = match scale {
        ScaleDtype::F16 => 2f64.powi(-10),
        ScaleDtype::F32 => 2f64.powi(-23),
    } * 1.01;
    let n = n as f64;
    let mut best = 0f64;
    for rho in [1.0 - eps, 1.0 + eps] {
        let umax = n * rho;
        for &(bin, bout, lb) in &cells {
            // Y in cell b: u = Y^2 in [max(inner_b, rho), min(outer_b, n rho)].
            let ulo = bin.max(rho);
            let uhi = bout.min(umax);
            if ulo > uhi || lb == 0.0 {
                continue;
            }
            // b alone: D = u L_b^2, least at the least u.
            best = best.max(rho / (ulo * lb));
            for &(_, ea, la) in &cells {
                // a at its outer edge below Y: a share p_b = (rho - e_a) /
                // (u - e_a) of the values at Y, the rest at e_a; worth it
                // only when a is the cheaper level.
                if !(ea < rho && la < lb) {
                    continue;
                }
                let lo = ulo.max(ea);
                // p_b >= 1/n: u <= e_a + n (rho - e_a).
                let hi = uhi.min(ea + n * (rho - ea));
                if lo > hi || lo <= ea {
                    continue;
                }
                let kk = (rho - ea) * (lb - la);
                let d = |u: f64| u * la + kk * u / (u - ea);
                // D is convex in u on (e_a, inf): its least value is at the
                // stationary point, clamped to [lo, hi].
                let stat = if la > 0.0 {
                    ea + (kk * ea / la).sqrt()
                } else {
                    f64::INFINITY
                };
                let u = stat.clamp(lo, hi);
                let dmin = if u.is_finite() { d(u) } else { kk };
                best = best.max(rho / dmin);
            }
        }
    }
    best.sqrt()
}

/// The stored parameters of one group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupParams {
    /// `s`: the scale, rounded to the scale dtype.
    pub scale: f32,
    /// `z`: the minimum, rounded to the scale dtype.
    pub zero: f32,
}

impl GroupParams {
    /// Both parameters are finite (a f16 scale overflows past 65504).
    pub fn is_finite(&self) -> bool {
        self.scale.is_finite() && self.zero.is_finite()
    }
}

/// The least and the greatest of `values` (NaNs skipped), with `-0` below
/// `+0`: the sign of a zero `lo` or `hi` is stored (as the zero point's
/// bits), so it is defined here rather than left to the order in which a
/// compiler or a vector unit compares (`f32::min` may return either zero).
/// The result does not depend on the order of `values`.
pub fn group_lo_hi(values: impl IntoIterator<Item = f32>) -> (f32, f32) {
    let mut lo = f32::INFINITY;
    let mut hi = f32::NEG_INFINITY;
    for x in values {
        if x < lo || (x == lo && x.is_sign_negative()) {
            lo = x;
        }
        if x > hi || (x == hi && x.is_sign_positive()) {
            hi = x;
        }
    }
    (lo, hi)
}

/// `lo`/`hi` of a group ([`group_lo_hi`]), then `s = (hi - lo) / (2^b - 1)`
/// and `z = lo`, each rounded to the scale dtype. Returns the params and
/// `(lo, hi)`.
pub fn group_params(values: impl IntoIterator<Item = f32>, q: &Quant) -> (GroupParams, f32, f32) {
    let (lo, hi) = group_lo_hi(values);
    let scale = (hi - lo) / q.max_code() as f32;
    (
        GroupParams {
            scale: round_to_scale(scale, q.scale),
            zero: round_to_scale(lo, q.scale),
        },
        lo,
        hi,
    )
}

/// `c = clamp(round_ties_even((x - z) / s), 0, 2^b - 1)`; `c = 0` when `s == 0`.
#[inline]
pub fn encode(x: f32, p: GroupParams, max_code: u32) -> u32 {
    if p.scale == 0.0 {
        return 0;
    }
    let c = ((x - p.zero) / p.scale).round_ties_even();
    c.clamp(0.0, max_code as f32) as u32
}

/// `x^ = c * s + z`, in f32 (two roundings, no fused multiply-add).
#[inline]
pub fn decode(c: u32, p: GroupParams) -> f32 {
    c as f32 * p.scale + p.zero
}

// ---------------------------------------------------------------------------
// The codec pipeline (DESIGN.md §8): center, rotate, take out outliers, then
// quantize with uniform or Lloyd–Max levels. Each step is one function here,
// used by the oracle and the paged cache alike.
// ---------------------------------------------------------------------------

/// The ±1 sign of every channel for a Hadamard rotation with `seed`: bit 63
/// of successive SplitMix64 outputs (state starting at `seed`), `-1` where
/// it is set. The same vector for every head and layer.
///
/// ```
/// let s = kivi_runtime::quant::sign_vector(7, 8);
/// assert!(s.iter().all(|x| *x == 1.0 || *x == -1.0));
/// assert_eq!(s, kivi_runtime::quant::sign_vector(7, 8));
/// ```
pub fn sign_vector(seed: u32, d: usize) -> Vec<f32> {
    let mut state = seed as u64;
    (0..d)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z >> 63 == 1 {
                -1.0
            } else {
                1.0
            }
        })
        .collect()
}

/// In-place normalised Walsh–Hadamard transform of every block of `block`
/// channels of `x`: `y_i = sum_j (-1)^popcount(i & j) x_j / sqrt(block)`.
/// Butterflies in f64, one rounding to f32 at the end (so the result does
/// not depend on how a caller batches rows).
fn fwht(x: &mut [f32], block: usize) {
    // The same body compiled three times: LLVM vectorises the butterflies
    // under AVX-512 or AVX2, and an f64 add or subtract is the same IEEE
    // operation in a vector lane as in a scalar register, so every build
    // gives the same bits (the sums are not reordered).
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was just detected.
            return unsafe { fwht_avx512(x, block) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { fwht_avx2(x, block) };
        }
    }
    fwht_body(x, block)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fwht_avx512(x: &mut [f32], block: usize) {
    fwht_body(x, block)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fwht_avx2(x: &mut [f32], block: usize) {
    fwht_body(x, block)
}

#[inline(always)]
fn fwht_body(x: &mut [f32], block: usize) {
    // On the stack (blocks are at most MAX_HEAD_DIM = 1024 channels): the
    // cache rotates every token it quantizes, and a heap buffer per row was
    // a measurable part of a write. The common blocks (up to 256) zero a
    // quarter of it.
    let mut small = [0f64; 256];
    let mut big;
    let mut heap = Vec::new();
    let buf: &mut [f64] = if block <= small.len() {
        &mut small[..block]
    } else if block <= 1024 {
        big = [0f64; 1024];
        &mut big[..block]
    } else {
        heap.resize(block, 0.0);
        &mut heap
    };
    let norm = 1.0 / (block as f64).sqrt();
    for chunk in x.chunks_mut(block) {
        for (b, v) in buf.iter_mut().zip(chunk.iter()) {
            *b = *v as f64;
        }
        // The first three stages (h = 1, 2, 4) on eight values at a time,
        // in registers: the loop below leaves them scalar. The same
        // butterflies, `x + y` and `x - y` of the same pairs.
        let mut h = 1;
        if block >= 8 {
            for c in buf.chunks_exact_mut(8) {
                let a = [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
                let b = [
                    a[0] + a[1],
                    a[0] - a[1],
                    a[2] + a[3],
                    a[2] - a[3],
                    a[4] + a[5],
                    a[4] - a[5],
                    a[6] + a[7],
                    a[6] - a[7],
                ];
                let e = [
                    b[0] + b[2],
                    b[1] + b[3],
                    b[0] - b[2],
                    b[1] - b[3],
                    b[4] + b[6],
                    b[5] + b[7],
                    b[4] - b[6],
                    b[5] - b[7],
                ];
                for i in 0..4 {
                    c[i] = e[i] + e[i + 4];
                    c[i + 4] = e[i] - e[i + 4];
                }
            }
            h = 8;
        }
        while h < block {
            for i in (0..block).step_by(2 * h) {
                let (lo, hi) = buf[i..i + 2 * h].split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (x, y) = (*a, *b);
                    *a = x + y;
                    *b = x - y;
                }
            }
            h *= 2;
        }
        for (v, b) in chunk.iter_mut().zip(buf.iter()) {
            *v = (*b * norm) as f32;
        }
    }
}

/// The rotation `T = H D` of one row: the sign flip `D` (if any), then the
/// blockwise normalised Hadamard `H`.
pub fn rotate(x: &mut [f32], block: usize, signs: Option<&[f32]>) {
    if let Some(s) = signs {
        for (v, s) in x.iter_mut().zip(s) {
            *v *= s;
        }
    }
    fwht(x, block);
}

/// The inverse `T^-1 = D H` (H is symmetric and orthonormal, D its own
/// inverse): what [`rotate`] did, undone.
pub fn unrotate(x: &mut [f32], block: usize, signs: Option<&[f32]>) {
    fwht(x, block);
    if let Some(s) = signs {
        for (v, s) in x.iter_mut().zip(s) {
            *v *= s;
        }
    }
}

/// The per-channel mean of `rows` (each `D` long, already in the activation
/// dtype), summed in f64 in order and rounded to the activation dtype.
pub fn channel_mean<'a>(rows: impl IntoIterator<Item = &'a [f32]>, d: usize, dtype: Dtype) -> Vec<f32> {
    let mut sum = vec![0f64; d];
    let mut n = 0usize;
    for r in rows {
        for (s, x) in sum.iter_mut().zip(r) {
            *s += *x as f64;
        }
        n += 1;
    }
    sum.iter()
        .map(|s| round_to_dtype((s / n.max(1) as f64) as f32, dtype))
        .collect()
}

/// Channels of the `k` entries of largest magnitude in `row`, ascending.
/// Ties go to the lower channel.
pub fn top_k_abs(row: &[f32], k: usize) -> Vec<usize> {
    if k <= TOP_K_SMALL {
        let mut idx = [0usize; TOP_K_SMALL];
        let n = top_k_abs_small(row, k, &mut idx);
        return idx[..n].to_vec();
    }
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].abs().total_cmp(&row[a].abs()).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// The largest `k` that [`top_k_abs_small`] takes.
pub const TOP_K_SMALL: usize = 16;

/// [`top_k_abs`] for `k <= TOP_K_SMALL` without allocating (the cache
/// writes call it once per token): the channels, ascending, go into
/// `out[..n]`, `n = min(k, row.len())` returned.
pub fn top_k_abs_small(row: &[f32], k: usize, out: &mut [usize; TOP_K_SMALL]) -> usize {
    // A few outliers per token (the presets keep 2 or 4): one pass that
    // keeps the best `k` so far, best first, instead of sorting every
    // channel. Same order, so the same channels: a larger magnitude first,
    // and among equal ones the lower channel (met first, kept ahead).
    let k = k.min(TOP_K_SMALL);
    if k == 0 {
        return 0;
    }
    let mut best = [(0f32, 0usize); TOP_K_SMALL + 1];
    let mut len = 0;
    for (c, chunk) in row.chunks(16).enumerate() {
        // Once `k` are kept, a run of values none above the k-th best
        // changes nothing: skip it whole. For magnitudes (sign bit clear,
        // NaN included) `total_cmp` is the order of the bits as integers,
        // so this is the test below, sixteen values at a time.
        if len == k {
            let most = chunk.iter().fold(0u32, |m, x| m.max(x.to_bits() & 0x7fff_ffff));
            if most <= best[len - 1].0.to_bits() {
                continue;
            }
        }
        for (i, x) in chunk.iter().enumerate() {
            let a = x.abs();
            if len == k && a.total_cmp(&best[len - 1].0) != std::cmp::Ordering::Greater {
                continue;
            }
            let at = best[..len].partition_point(|b| b.0.total_cmp(&a) != std::cmp::Ordering::Less);
            best.copy_within(at..len, at + 1);
            best[at] = (a, 16 * c + i);
            len = (len + 1).min(k);
        }
    }
    for (o, b) in out.iter_mut().zip(&best[..len]) {
        *o = b.1;
    }
    out[..len].sort_unstable();
    len
}

/// Lloyd–Max code of `y` (a value already divided by its group's norm): the
/// number of decision thresholds `t_i = (L_i + L_{i+1}) / 2` below `y`, so
/// the nearest level, ties to the lower one.
#[inline]
pub fn lloyd_encode(y: f32, levels: &[f32]) -> u32 {
    levels.windows(2).filter(|w| y > (w[0] + w[1]) * 0.5).count() as u32
}

/// The fixed table of a quantizer's levels: the Lloyd–Max table for
/// `lloyd_max`, empty for uniform levels and for `nuq`, whose table comes
/// from a calibration ([`crate::calib`]) through [`TensorCodec::levels`].
pub fn fixed_levels(q: &Quant) -> &'static [f32] {
    match q.levels {
        Levels::LloydMax(_) => kivi_spec::lloyd_max_levels(q.bits).unwrap_or(&[]),
        Levels::Uniform | Levels::Nuq(_) => &[],
    }
}

/// The stored norm of a Lloyd–Max group and its codes.
///
/// `Rms`: `s = rms(x)` (f64, rounded to the scale dtype), codes of `x / s`
/// (all codes of `0` when `s == 0`). `L2`: the same codes, then
/// `s = ||x|| / ||L[c]||` so the decoded group keeps the input's norm.
/// Decoding is `s * L[c]` ([`lloyd_decode`]). The fixed Lloyd–Max table;
/// [`lloyd_group_in`] takes any table (a calibrated `nuq` codebook).
pub fn lloyd_group(values: &[f32], q: &Quant, codes: &mut [u32]) -> f32 {
    lloyd_group_in(values, q, fixed_levels(q), codes)
}

/// [`lloyd_group`] against the ascending table `levels` (at most 16
/// entries). An empty table (a `nuq` quantizer given no codebook) codes
/// every value 0 with norm 0, so it decodes to zeros rather than panicking;
/// caches refuse to get there ([`crate::calib`]).
pub fn lloyd_group_in(values: &[f32], q: &Quant, levels: &[f32], codes: &mut [u32]) -> f32 {
    let norm = q.levels.norm().unwrap_or(Norm::Rms);
    if levels.is_empty() {
        codes.iter_mut().for_each(|c| *c = 0);
        return 0.0;
    }
    let ss: f64 = values.iter().map(|x| (*x as f64) * (*x as f64)).sum();
    let rms = round_to_scale((ss / values.len() as f64).sqrt() as f32, q.scale);
    // The decision thresholds of `lloyd_encode`, computed once per group
    // rather than once per value (the same f32 operations, so the same codes).
    // (Tables have at most 16 levels: Lloyd–Max codes are 1 to 4 bits.)
    let mut thresholds = [0f32; 15];
    let nt = levels.len().saturating_sub(1);
    for (t, w) in thresholds.iter_mut().zip(levels.windows(2)) {
        *t = (w[0] + w[1]) * 0.5;
    }
    for (c, x) in codes.iter_mut().zip(values) {
        let y = if rms == 0.0 { 0.0 } else { x / rms };
        *c = if nt <= thresholds.len() {
            thresholds[..nt].iter().filter(|t| y > **t).count() as u32
        } else {
            lloyd_encode(y, levels)
        };
    }
    match norm {
        // `quantize_group_in` codes minmax groups itself ([`minmax_group_in`]);
        // here (a caller asking for one norm) the RMS is the nearest meaning.
        Norm::Rms | Norm::MinMax | Norm::MinMaxPinned => rms,
        Norm::L2 => {
            let lc: f64 = codes.iter().map(|c| (levels[*c as usize] as f64).powi(2)).sum();
            if lc == 0.0 || ss == 0.0 {
                0.0
            } else {
                round_to_scale((ss / lc).sqrt() as f32, q.scale)
            }
        }
    }
}

/// A `nuq` group with `norm = minmax`: `s = hi - lo` and `z = lo`, each
/// rounded to the scale dtype (as uniform levels store them), then the
/// code of `(x - z) / s` against the ascending table `levels` over `[0, 1]`
/// (thresholds at midpoints, ties to the lower level, as
/// [`lloyd_encode`]); all codes 0 when `s == 0` or the table is empty.
/// Decoding is `z + s * L[c]` ([`dequantize_in`]).
pub fn minmax_group_in(values: &[f32], q: &Quant, levels: &[f32], codes: &mut [u32]) -> (GroupParams, f32, f32) {
    let (lo, hi) = group_lo_hi(values.iter().copied());
    let p = GroupParams {
        scale: round_to_scale(hi - lo, q.scale),
        zero: round_to_scale(lo, q.scale),
    };
    for (c, x) in codes.iter_mut().zip(values) {
        *c = if p.scale == 0.0 || levels.is_empty() {
            0
        } else {
            lloyd_encode((x - p.zero) / p.scale, levels)
        };
    }
    (p, lo, hi)
}

/// `x^ = s * L[c]`, in f32.
#[inline]
pub fn lloyd_decode(c: u32, s: f32, levels: &[f32]) -> f32 {
    s * levels[c as usize]
}

/// Quantizes one group `values` with quantizer `q` (uniform or Lloyd–Max)
/// into `codes`, returning the stored parameters (`zero` is 0 for
/// Lloyd–Max) and the group's `(lo, hi)` for error messages.
pub fn quantize_group(values: &[f32], q: &Quant, codes: &mut [u32]) -> (GroupParams, f32, f32) {
    quantize_group_in(values, q, fixed_levels(q), codes)
}

/// [`quantize_group`] with the table of a table-driven quantizer given
/// (`levels` is ignored for uniform levels): how `nuq` codebooks from a
/// calibration are applied.
pub fn quantize_group_in(values: &[f32], q: &Quant, levels: &[f32], codes: &mut [u32]) -> (GroupParams, f32, f32) {
    match q.levels {
        Levels::Uniform => {
            let (p, lo, hi) = group_params(values.iter().copied(), q);
            for (c, x) in codes.iter_mut().zip(values) {
                *c = encode(*x, p, q.max_code());
            }
            (p, lo, hi)
        }
        // A pinned table is an ordinary table over [0, 1]: same code.
        Levels::Nuq(Norm::MinMax | Norm::MinMaxPinned) => minmax_group_in(values, q, levels, codes),
        Levels::LloydMax(_) | Levels::Nuq(_) => {
            let s = lloyd_group_in(values, q, levels, codes);
            let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (GroupParams { scale: s, zero: 0.0 }, lo, hi)
        }
    }
}

/// Decodes one code of quantizer `q` with its group's parameters.
#[inline]
pub fn dequantize(c: u32, p: GroupParams, q: &Quant) -> f32 {
    dequantize_in(c, p, q, fixed_levels(q))
}

/// [`dequantize`] with the table of a table-driven quantizer given; a code
/// past the end of the table (only an empty `nuq` table) decodes to 0.
#[inline]
pub fn dequantize_in(c: u32, p: GroupParams, q: &Quant, levels: &[f32]) -> f32 {
    match q.levels {
        Levels::Uniform => decode(c, p),
        // `z + s L[c]`: two roundings, like `decode`.
        Levels::Nuq(Norm::MinMax | Norm::MinMaxPinned) => {
            levels.get(c as usize).map_or(p.zero, |l| p.scale * l + p.zero)
        }
        Levels::LloydMax(_) | Levels::Nuq(_) => levels.get(c as usize).map_or(0.0, |l| p.scale * l),
    }
}

/// Everything one tensor's codec needs to turn a token's row into what is
/// quantized and back: its quantizer, rotation, outlier count and dtype.
/// Built once per cache (or oracle call) from the scheme.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorCodec {
    pub quant: Quant,
    pub dtype: Dtype,
    /// Hadamard block and sign vector, when rotated.
    pub rotation: Option<(usize, Option<Vec<f32>>)>,
    /// Sparse outliers per token (0 for none).
    pub outliers: usize,
    /// Tokens whose mean centers this tensor, when centered.
    pub center: Option<usize>,
    /// The table codes decode to (`s * levels[c]`): the Lloyd–Max table,
    /// a calibrated `nuq` codebook ([`Self::with_levels`]), or empty for
    /// uniform levels and for a `nuq` codec not yet given its codebook.
    pub levels: Vec<f32>,
}

impl TensorCodec {
    /// The codec of tensor `t` of a bound scheme; `None` for a `full` tensor.
    pub fn of(s: &kivi_spec::Scheme, t: kivi_spec::Tensor, head_dim: usize) -> Option<TensorCodec> {
        let quant = *s.codec(t).quant()?;
        Some(TensorCodec {
            quant,
            dtype: s.dtype,
            rotation: s
                .rotation_of(t)
                .map(|r| (r.block as usize, r.signs.map(|seed| sign_vector(seed, head_dim)))),
            outliers: s.outliers_of(t),
            center: s.center_of(t),
            levels: fixed_levels(&quant).to_vec(),
        })
    }

    /// This codec decoding with `levels` (a calibrated `nuq` codebook of
    /// `2^bits` ascending entries; [`crate::calib::Calibration::codebook`]
    /// checks it).
    pub fn with_levels(mut self, levels: Vec<f32>) -> TensorCodec {
        self.levels = levels;
        self
    }

    /// Whether this codec still lacks the calibrated codebook it needs.
    pub fn needs_levels(&self) -> bool {
        matches!(self.quant.levels, Levels::Nuq(_)) && self.levels.is_empty()
    }

    /// [`quantize_group_in`] with this codec's table.
    pub fn quantize_group(&self, values: &[f32], codes: &mut [u32]) -> (GroupParams, f32, f32) {
        quantize_group_in(values, &self.quant, &self.levels, codes)
    }

    /// [`dequantize_in`] with this codec's table.
    #[inline]
    pub fn dequantize(&self, c: u32, p: GroupParams) -> f32 {
        dequantize_in(c, p, &self.quant, &self.levels)
    }

    /// Uniform levels and no pipeline step (no centering, rotation or
    /// outliers): the codec of the KIVI presets.
    pub fn is_plain_uniform(&self) -> bool {
        self.quant.levels == Levels::Uniform && self.rotation.is_none() && self.outliers == 0 && self.center.is_none()
    }

    /// Step 1 and 2 of the pipeline, in place: subtract the mean, rotate.
    pub fn forward(&self, row: &mut [f32], mean: Option<&[f32]>) {
        if let Some(m) = mean {
            for (x, m) in row.iter_mut().zip(m) {
                *x -= m;
            }
        }
        if let Some((block, signs)) = &self.rotation {
            rotate(row, *block, signs.as_deref());
        }
    }

    /// The inverse of [`Self::forward`]: un-rotate, add the mean back.
    pub fn inverse(&self, row: &mut [f32], mean: Option<&[f32]>) {
        if let Some((block, signs)) = &self.rotation {
            unrotate(row, *block, signs.as_deref());
        }
        if let Some(m) = mean {
            for (x, m) in row.iter_mut().zip(m) {
                *x += m;
            }
        }
    }

    /// Step 3: takes the outliers out of a transformed row (sets them to 0)
    /// and returns their channels and original values.
    pub fn take_outliers(&self, row: &mut [f32]) -> (Vec<usize>, Vec<f32>) {
        if self.outliers == 0 {
            return (Vec::new(), Vec::new());
        }
        let idx = top_k_abs(row, self.outliers);
        let vals = idx.iter().map(|&i| std::mem::replace(&mut row[i], 0.0)).collect();
        (idx, vals)
    }

    /// [`Self::take_outliers`] without allocating, for at most
    /// [`TOP_K_SMALL`] outliers a token: channels into `idx[..n]`, original
    /// values into `vals[..n]`; `n` returned.
    pub fn take_outliers_small(
        &self,
        row: &mut [f32],
        idx: &mut [usize; TOP_K_SMALL],
        vals: &mut [f32; TOP_K_SMALL],
    ) -> usize {
        debug_assert!(self.outliers <= TOP_K_SMALL);
        let n = top_k_abs_small(row, self.outliers, idx);
        for (v, &i) in vals.iter_mut().zip(&idx[..n]) {
            *v = std::mem::replace(&mut row[i], 0.0);
        }
        n
    }

    /// The stored correction of an outlier: `x - x^` in the activation
    /// dtype, or `None` when that dtype cannot hold it.
    pub fn correction(&self, original: f32, decoded: f32) -> Option<f32> {
        let c = round_to_dtype(original - decoded, self.dtype);
        c.is_finite().then_some(c)
    }
}

/// Packs `codes` (each `< 2^bits`) LSB first into `out`, `32 / bits` codes
/// per word; codes never straddle words. `out` must hold
/// `codes.len().div_ceil(32 / bits)` words; every word is overwritten.
pub fn pack(codes: &[u32], bits: u32, out: &mut [u32]) {
    let per = (32 / bits) as usize;
    for (w, chunk) in out.iter_mut().zip(codes.chunks(per)) {
        let mut word = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            word |= c << (i as u32 * bits);
        }
        *w = word;
    }
}

/// Code `i` of a packed row.
#[inline]
pub fn unpack_one(words: &[u32], bits: u32, i: usize) -> u32 {
    let per = (32 / bits) as usize;
    let mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
    (words[i / per] >> ((i % per) as u32 * bits)) & mask
}

/// Unpacks `out.len()` codes from a packed row.
pub fn unpack(words: &[u32], bits: u32, out: &mut [u32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = unpack_one(words, bits, i);
    }
}

/// Raw storage of a value in a 16-bit or 32-bit dtype.
#[inline]
pub fn to_bits_16(x: f32, dtype: Dtype) -> u16 {
    match dtype {
        Dtype::Bf16 => half::bf16::from_f32(x).to_bits(),
        _ => half::f16::from_f32(x).to_bits(),
    }
}

#[inline]
pub fn from_bits_16(b: u16, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bf16 => half::bf16::from_bits(b).to_f32(),
        _ => half::f16::from_bits(b).to_f32(),
    }
}

/// The integer-domain query of `query: int8(group = G)` (see
/// [`kivi_spec::QueryQuant`]): per block of `group` consecutive values of
/// `w` (the folded query `q_d s_d`), with `m = max |w|`: the scale
/// `a = m / 127` and the codes `qi = clamp(round_ties_even(w * (127 / m)),
/// -127, 127)`, or all zeros where `m == 0`. Writes `codes` (`w.len()`) and
/// `scales` (`w.len() / group`).
///
/// Every kernel computes exactly these f32 operations (a maximum, two
/// divisions per block, one product per value, ties to even), so the codes
/// and scales are bit-identical everywhere and the integer sums exact. A
/// product by the block's reciprocal rather than a division per value: the
/// division cost more than the integer dot products of a group on the CPU.
///
/// ```
/// let mut c = [0i8; 4];
/// let mut a = [0f32; 1];
/// kivi_runtime::quant::quantize_query(&[1.0, -0.5, 0.25, 0.0], 4, &mut c, &mut a);
/// assert_eq!(c, [127, -64, 32, 0]); // -63.5 and 31.75 round to -64 and 32
/// assert_eq!(a[0], 1.0 / 127.0);
/// ```
pub fn quantize_query(w: &[f32], group: usize, codes: &mut [i8], scales: &mut [f32]) {
    for ((wb, cb), a) in w.chunks(group).zip(codes.chunks_mut(group)).zip(scales.iter_mut()) {
        let m = wb.iter().fold(0f32, |m, x| m.max(x.abs()));
        *a = m / 127.0;
        let inv = 127.0 / m;
        for (c, x) in cb.iter_mut().zip(wb) {
            *c = if m == 0.0 {
                0
            } else {
                (x * inv).round_ties_even().clamp(-127.0, 127.0) as i8
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_hadamard_equals_the_matrix_and_inverts() {
        for block in [2usize, 4, 16, 64, 256] {
            let d = block * 2;
            let x: Vec<f32> = (0..d).map(|i| ((i * 7919 % 113) as f32 - 56.0) / 9.0).collect();
            let signs = sign_vector(3, d);
            let mut y = x.clone();
            rotate(&mut y, block, Some(&signs));
            for b in 0..2 {
                for i in 0..block {
                    let mut want = 0f64;
                    for j in 0..block {
                        let h = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                        want += h * (x[b * block + j] * signs[b * block + j]) as f64;
                    }
                    want /= (block as f64).sqrt();
                    assert!((y[b * block + i] as f64 - want).abs() < 1e-5, "block {block}");
                }
            }
            unrotate(&mut y, block, Some(&signs));
            for (a, b) in y.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        // a few signs of each kind, not all the same
        let s = sign_vector(1, 64);
        assert!(s.iter().any(|x| *x < 0.0) && s.iter().any(|x| *x > 0.0));
        assert_ne!(sign_vector(1, 64), sign_vector(2, 64));
    }

    #[test]
    fn lloyd_codes_pick_the_nearest_level() {
        let q = Quant {
            bits: 2,
            axis: kivi_spec::Axis::Token,
            group: 4,
            scale: ScaleDtype::F32,
            levels: Levels::LloydMax(Norm::Rms),
        };
        let l = kivi_spec::lloyd_max_levels(2).unwrap();
        assert_eq!(lloyd_encode(-5.0, l), 0);
        assert_eq!(lloyd_encode(0.0, l), 1); // tie at the middle threshold: lower
        assert_eq!(lloyd_encode(0.9, l), 2);
        assert_eq!(lloyd_encode(0.99, l), 3);
        let xs = [1.0f32, -1.0, 1.0, -1.0];
        let mut c = [0u32; 4];
        let (p, _, _) = quantize_group(&xs, &q, &mut c);
        assert_eq!(p.scale, 1.0);
        assert_eq!(c, [3, 0, 3, 0]);
        // l2: the decoded group keeps the input's norm
        let q2 = Quant {
            levels: Levels::LloydMax(Norm::L2),
            ..q
        };
        let (p2, _, _) = quantize_group(&xs, &q2, &mut c);
        let n: f32 = c.iter().map(|c| dequantize(*c, p2, &q2).powi(2)).sum();
        assert!((n - 4.0).abs() < 1e-5);
        // an all-zero group decodes to zero
        let (pz, _, _) = quantize_group(&[0.0; 4], &q2, &mut c);
        assert_eq!(dequantize(c[0], pz, &q2), 0.0);
    }

    fn l2(bits: u32, group: u32, scale: ScaleDtype, nuq: bool) -> Quant {
        Quant {
            bits,
            axis: kivi_spec::Axis::Token,
            group,
            scale,
            levels: if nuq {
                Levels::Nuq(Norm::L2)
            } else {
                Levels::LloydMax(Norm::L2)
            },
        }
    }

    /// A calibrated-looking table with a level near 0 on one side only: a
    /// lone negative value codes to -0.05, so its scale is 20 |x|.
    const LOPSIDED: [f32; 4] = [-3.0, -0.05, 0.02, 0.9];

    fn scale_of(values: &[f32], q: &Quant, levels: &[f32]) -> f32 {
        let mut c = vec![0; values.len()];
        quantize_group_in(values, q, levels, &mut c).0.scale
    }

    /// Group of 1: the limit is exact, both sides of it, for every fixed
    /// table, both scale dtypes, and a lopsided `nuq` table (both signs).
    #[test]
    fn l2_limit_is_exact_for_a_lone_value() {
        let mut cases: Vec<(Quant, Vec<f32>)> = Vec::new();
        for bits in 1..=4 {
            for scale in [ScaleDtype::F16, ScaleDtype::F32] {
                let q = l2(bits, 1, scale, false);
                cases.push((q, fixed_levels(&q).to_vec()));
            }
        }
        cases.push((l2(2, 1, ScaleDtype::F16, true), LOPSIDED.to_vec()));
        cases.push((l2(2, 1, ScaleDtype::F32, true), LOPSIDED.to_vec()));
        for (q, levels) in cases {
            let lim = storable_limit_in(&q, &levels);
            let up = f32::from_bits(lim.to_bits() + 1);
            let fits = |x: f32| scale_of(&[x], &q, &levels).is_finite();
            assert!(fits(lim) && fits(-lim), "{q:?}: {lim} must fit");
            // (Capped, like every codec, at the scale dtype's largest value:
            // at 2 bits `±1` codes to ±1.51, so `s < |x|`.)
            let cap = if q.scale == ScaleDtype::F16 { 65504.0 } else { f32::MAX };
            let ratio = l2_scale_ratio(&levels, 1, q.scale);
            assert_eq!(lim == cap, ratio <= 1.0, "{q:?} {lim} {ratio}");
            if lim < cap {
                assert!(!fits(up) || !fits(-up), "{q:?}: {up} fits, so {lim} is not the limit");
            }
        }
        // The lopsided table: only negative values are held to it.
        let q = l2(2, 1, ScaleDtype::F16, true);
        let lim = storable_limit_in(&q, &LOPSIDED);
        assert!((lim - 65520.0 * 0.05).abs() < 0.01, "{lim}");
        assert!(scale_of(&[-f32::from_bits(lim.to_bits() + 1)], &q, &LOPSIDED).is_infinite());
        // Rms norm and uniform levels keep their rule.
        let rms = Quant {
            levels: Levels::LloydMax(Norm::Rms),
            ..l2(4, 1, ScaleDtype::F16, false)
        };
        assert_eq!(storable_limit(&rms), 65504.0);
    }

    /// Larger groups: no group (structured worst cases and random ones
    /// climbing towards them) gets `s / max|x|` past [`l2_scale_ratio`],
    /// and the structured ones come close to it (the bound is not loose).
    #[test]
    fn l2_ratio_bounds_every_group_and_is_nearly_reached() {
        let mut rng = crate::rand::Rng::new(0x12_3457);
        let mut tables: Vec<(Quant, Vec<f32>)> = (1..=4)
            .map(|bits| {
                let q = l2(bits, 1, ScaleDtype::F32, false);
                (q, fixed_levels(&q).to_vec())
            })
            .collect();
        tables.push((l2(2, 1, ScaleDtype::F32, true), LOPSIDED.to_vec()));
        for (q0, levels) in &tables {
            for n in [2usize, 3, 4, 5, 8, 32, 128] {
                let q = Quant { group: n as u32, ..*q0 };
                let bound = l2_scale_ratio(levels, n, q.scale);
                let ratio = |x: &[f32]| {
                    let m = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    scale_of(x, &q, levels) as f64 / m
                };
                // Edge magnitudes: each threshold, just inside either cell.
                let t: Vec<f32> = levels.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect();
                let mut edges: Vec<f32> = t.iter().flat_map(|t| [t * (1.0 - 1e-5), t * (1.0 + 1e-5)]).collect();
                edges.push(0.0);
                let mut best = 0f64;
                let mut x = vec![0f32; n];
                for &e in &edges {
                    for m in 1..=n {
                        for sign in [1.0f32, -1.0] {
                            // n - m values at the edge, m at whatever makes sum y^2 = n.
                            let rest = (n - m) as f32 * e * e;
                            if rest >= n as f32 {
                                continue;
                            }
                            let y = ((n as f32 - rest) / m as f32).sqrt() * sign;
                            x[..m].fill(y);
                            x[m..].fill(e);
                            let r = ratio(&x);
                            assert!(r <= bound * (1.0 + 1e-6), "{q:?}: {x:?} {r} > {bound}");
                            best = best.max(r);
                            // and a few random nudges from there
                            for _ in 0..8 {
                                let mut z = x.clone();
                                for v in z.iter_mut() {
                                    *v *= 1.0 + (rng.next_u32() % 2001) as f32 * 1e-4 - 0.1;
                                }
                                let r = ratio(&z);
                                assert!(r <= bound * (1.0 + 1e-6), "{q:?}: {z:?} {r} > {bound}");
                                best = best.max(r);
                            }
                        }
                    }
                }
                for _ in 0..2000 {
                    let z: Vec<f32> = (0..n).map(|_| (rng.next_u32() % 20001) as f32 * 1e-3 - 10.0).collect();
                    let r = ratio(&z);
                    assert!(r <= bound * (1.0 + 1e-6), "{q:?}: {z:?} {r} > {bound}");
                }
                assert!(best >= bound * 0.97, "{q:?} n {n}: reached {best}, bound {bound}");
            }
        }
    }

    /// The butterflies stage by stage, as the transform is defined.
    fn fwht_plain(x: &mut [f32], block: usize) {
        let norm = 1.0 / (block as f64).sqrt();
        for chunk in x.chunks_mut(block) {
            let mut buf: Vec<f64> = chunk.iter().map(|v| *v as f64).collect();
            let mut h = 1;
            while h < block {
                for i in (0..block).step_by(2 * h) {
                    for j in i..i + h {
                        let (x, y) = (buf[j], buf[j + h]);
                        buf[j] = x + y;
                        buf[j + h] = x - y;
                    }
                }
                h *= 2;
            }
            for (v, b) in chunk.iter_mut().zip(&buf) {
                *v = (*b * norm) as f32;
            }
        }
    }

    #[test]
    fn hadamard_bits_do_not_depend_on_the_instruction_set() {
        let mut seed = 0x77u32;
        for block in [2usize, 4, 8, 16, 64, 256, 512, 1024] {
            let x: Vec<f32> = (0..2 * block)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    f32::from_bits(0x3000_0000 + seed % 0x1800_0000) * if seed & 1 == 0 { 1.0 } else { -1.0 }
                })
                .collect();
            let (mut a, mut b, mut c) = (x.clone(), x.clone(), x.clone());
            fwht(&mut a, block);
            fwht_body(&mut b, block);
            fwht_plain(&mut c, block);
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "block {block}"
            );
            assert!(
                a.iter().zip(&c).all(|(p, q)| p.to_bits() == q.to_bits()),
                "block {block}: the radix-8 stages"
            );
        }
    }

    #[test]
    fn top_k_selection_equals_the_sort() {
        let mut seed = 0x51u32;
        for n in [1usize, 2, 5, 31, 64, 256] {
            for k in [0usize, 1, 2, 4, 16, 17] {
                let row: Vec<f32> = (0..n)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        // few distinct magnitudes and both zeros: many ties
                        [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 0.25][(seed % 7) as usize]
                    })
                    .collect();
                let mut idx: Vec<usize> = (0..n).collect();
                idx.sort_by(|&a, &b| row[b].abs().total_cmp(&row[a].abs()).then(a.cmp(&b)));
                idx.truncate(k);
                idx.sort_unstable();
                assert_eq!(top_k_abs(&row, k), idx, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn top_k_and_means() {
        assert_eq!(top_k_abs(&[0.5, -3.0, 2.0, 3.0, 0.1], 2), vec![1, 3]);
        assert_eq!(top_k_abs(&[1.0, 1.0, 1.0], 2), vec![0, 1]);
        let rows = [[1.0f32, 2.0], [3.0, -2.0]];
        assert_eq!(channel_mean(rows.iter().map(|r| &r[..]), 2, Dtype::F32), vec![2.0, 0.0]);
    }

    #[test]
    fn pack_unpack_round_trip_every_width() {
        let mut rng = crate::rand::Rng::new(0x9e37_79b9);
        for bits in kivi_spec::ALLOWED_BITS {
            for n in [1usize, 7, 31, 32, 33, 100, 128, 257] {
                let codes: Vec<u32> = (0..n).map(|_| rng.next_u32() & ((1 << bits) - 1)).collect();
                let mut words = vec![0xdead_beefu32; n.div_ceil((32 / bits) as usize)];
                pack(&codes, bits, &mut words);
                let mut back = vec![0; n];
                unpack(&words, bits, &mut back);
                assert_eq!(codes, back, "bits {bits}, n {n}");
                // unused high bits of a 3-bit word stay zero
                if bits == 3 {
                    assert!(words.iter().all(|w| w >> 30 == 0));
                }
            }
        }
    }

    #[test]
    fn encode_decode_within_half_step() {
        let q = Quant::uniform(2, kivi_spec::Axis::Token, 4, ScaleDtype::F32);
        let xs = [0.1f32, -0.7, 2.3, 1.1];
        let (p, lo, hi) = group_params(xs, &q);
        assert_eq!((lo, hi), (-0.7, 2.3));
        for x in xs {
            let d = decode(encode(x, p, 3), p);
            assert!((d - x).abs() <= p.scale / 2.0 + 1e-6);
        }
        let flat = group_params([1.5f32; 4], &q).0;
        assert_eq!(flat.scale, 0.0);
        assert_eq!(encode(1.5, flat, 3), 0);
        assert_eq!(decode(0, flat), 1.5);
    }
}
