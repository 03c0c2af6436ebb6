//! What one core of this machine can compute, measured: the compute side of
//! the decode roofline (`kivi bench` measures the memory side, streaming
//! read bandwidth, in the same run).
//!
//! Three register-only loops, no memory traffic beyond L1:
//! - `fma`: sixteen independent 16-lane FMA chains, the arithmetic peak;
//! - `decode`: the fused kernel's inner step, per 16 codes of 16 rows: one
//!   AND (code word against a lane mask) + one int-to-float convert + four
//!   FMAs (four query heads of a GQA group). Exact f32 attention over
//!   quantized codes cannot do fewer instructions per multiply-add, so this
//!   rate is the ceiling for every quantized scheme's decode;
//! - `dpbusd`: AVX-512 VNNI 4-way u8 x s8 dot products (64 multiply-adds an
//!   instruction), to show whether integer codes would beat FMAs. An exact
//!   f32 query needs three 8-bit digits, i.e. three dot products per 64
//!   multiply-adds.

/// Per-core rates, measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeCeiling {
    /// 16-lane FMA instructions per second, independent chains.
    pub fma_per_s: f64,
    /// 16-lane FMAs per second inside the decode step (AND + convert + 4 FMAs).
    pub decode_fma_per_s: f64,
    /// VNNI `vpdpbusd` instructions per second (64 multiply-adds each), where the CPU has them.
    pub dpbusd_per_s: Option<f64>,
}

/// Measures the rates on the calling thread, about `budget_ms` each. `None`
/// where the CPU lacks AVX-512F/DQ (the probe's loops are AVX-512 only).
pub fn compute_ceiling(budget_ms: u64) -> Option<ComputeCeiling> {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")) {
            return None;
        }
        let vnni = is_x86_feature_detected!("avx512vnni");
        // SAFETY: features checked above.
        unsafe {
            Some(ComputeCeiling {
                fma_per_s: rate(budget_ms, |n| x86::fma(n)),
                decode_fma_per_s: rate(budget_ms, |n| x86::decode(n)),
                dpbusd_per_s: vnni.then(|| rate(budget_ms, |n| x86::dpbusd(n))),
            })
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = budget_ms;
        None
    }
}

/// Instructions per second of `f(n)` (which runs `n` rounds and returns the
/// instructions it issued), best of a few timed runs within `budget_ms`.
#[cfg(target_arch = "x86_64")]
fn rate(budget_ms: u64, f: impl Fn(u64) -> (u64, f32)) -> f64 {
    use std::time::{Duration, Instant};
    let mut n = 1u64 << 12;
    // Grow the round count until one run takes ~1/8 of the budget.
    loop {
        let t = Instant::now();
        std::hint::black_box(f(n));
        if t.elapsed() >= Duration::from_millis(budget_ms / 8 + 1) || n >= 1 << 34 {
            break;
        }
        n *= 2;
    }
    let mut best = 0f64;
    let end = Instant::now() + Duration::from_millis(budget_ms);
    while Instant::now() < end || best == 0.0 {
        let t = Instant::now();
        let (ins, sink) = f(n);
        std::hint::black_box(sink);
        best = best.max(ins as f64 / t.elapsed().as_secs_f64());
    }
    best
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // indexes walk arrays of registers in step
mod x86 {
    use std::arch::x86_64::*;

    /// Keeps accumulators finite and normal: `a * 0.999 + 1e-3` converges.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn fma(n: u64) -> (u64, f32) {
        let mut a: [__m512; 16] = std::array::from_fn(|i| _mm512_set1_ps(1.0 + i as f32));
        let y = _mm512_set1_ps(1e-3);
        for _ in 0..n {
            // Opaque to the optimiser, so that the chains stay chains.
            let x = std::hint::black_box(_mm512_set1_ps(0.999));
            for i in 0..16 {
                a[i] = _mm512_fmadd_ps(a[i], x, y);
            }
        }
        let s = a.iter().fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v));
        (16 * n, _mm512_reduce_add_ps(s))
    }

    /// One 2-bit code word per round: 16 codes x 16 rows x 4 heads, the
    /// decode step of `fused` (eight FMA chains, query from L1).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn decode(n: u64) -> (u64, f32) {
        let q: [f32; 64] = std::array::from_fn(|i| 1e-3 * (i as f32 + 1.0));
        let masks: [__m512i; 16] = std::array::from_fn(|k| _mm512_set1_epi32((3u32 << (2 * k)) as i32));
        let mut a = [[_mm512_setzero_ps(); 4]; 2];
        let mut z = _mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16);
        let one = _mm512_set1_epi32(0x0101_0101);
        for _ in 0..n {
            z = _mm512_add_epi32(z, one);
            let z = std::hint::black_box(z);
            for k in (0..16).step_by(2) {
                let x0 = _mm512_cvtepu32_ps(_mm512_and_si512(z, masks[k]));
                let x1 = _mm512_cvtepu32_ps(_mm512_and_si512(z, masks[k + 1]));
                for h in 0..4 {
                    a[0][h] = _mm512_fmadd_ps(_mm512_set1_ps(q[16 * h + k]), x0, a[0][h]);
                    a[1][h] = _mm512_fmadd_ps(_mm512_set1_ps(q[16 * h + k + 1]), x1, a[1][h]);
                }
            }
            // Keep the sums bounded (one extra op per 64 FMAs).
            a[0][0] = _mm512_mul_ps(a[0][0], _mm512_set1_ps(0.5));
        }
        let s = a
            .iter()
            .flatten()
            .fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v));
        (64 * n, _mm512_reduce_add_ps(s))
    }

    /// VNNI: per round, 4 byte-code vectors x 12 dot products (4 heads x 3
    /// query digits), the exact-query integer alternative to `decode`.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vnni")]
    pub unsafe fn dpbusd(n: u64) -> (u64, f32) {
        let q: [i32; 64] = std::array::from_fn(|i| (i as i32 * 0x0103_0507) & 0x3f3f_3f3f);
        let mut a = [_mm512_setzero_si512(); 12];
        let mut z = _mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16);
        let (one, m) = (_mm512_set1_epi32(0x0101_0101), _mm512_set1_epi32(0x0303_0303));
        for _ in 0..n {
            z = _mm512_add_epi32(z, one);
            let z = std::hint::black_box(z);
            for k in 0..4u32 {
                let x = _mm512_and_si512(_mm512_srlv_epi32(z, _mm512_set1_epi32(2 * k as i32)), m);
                for j in 0..12 {
                    a[j] = _mm512_dpbusd_epi32(a[j], x, _mm512_set1_epi32(q[4 * j + k as usize]));
                }
            }
        }
        let s = a.iter().fold(_mm512_setzero_si512(), |s, v| _mm512_add_epi32(s, *v));
        (48 * n, _mm512_reduce_add_epi32(s) as f32)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_are_positive_and_ordered() {
        let Some(c) = super::compute_ceiling(20) else {
            eprintln!("rates_are_positive_and_ordered: no AVX-512 here, nothing to probe");
            return;
        };
        assert!(c.fma_per_s > 1e8 && c.decode_fma_per_s > 1e8, "{c:?}");
        // The decode step issues 1.5 instructions per FMA: it cannot beat
        // the FMA peak by more than timing noise. On a loaded machine one
        // probe can be preempted in the middle, so the ordering must hold in
        // one of a few probes, not in every one.
        let mut seen = vec![c];
        while !seen.iter().any(|c| c.decode_fma_per_s < 1.5 * c.fma_per_s) && seen.len() < 5 {
            seen.push(super::compute_ceiling(20).unwrap());
        }
        assert!(seen.iter().any(|c| c.decode_fma_per_s < 1.5 * c.fma_per_s), "{seen:?}");
    }
}
