//! Sample statistics and the deterministic choice rule.

use crate::decisions::CandidateTiming;

/// Linear-interpolated quantile of sorted samples (`q` in 0..=1).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        }
    }
}

/// Median, p20 and p80 of per-call times, and GB/s at the median.
pub fn summarize(samples: &[f64], bytes_per_call: u64) -> Option<CandidateTiming> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite() && *x > 0.0).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let median = quantile(&s, 0.5);
    Some(CandidateTiming {
        median_s: median,
        p20_s: quantile(&s, 0.2),
        p80_s: quantile(&s, 0.8),
        samples: s.len() as u32,
        gbps: bytes_per_call as f64 / median / 1e9,
    })
}

/// Relative tolerance within which two timings count as a tie: the larger
/// of the configured floor and either candidate's own noise.
pub fn tie_tolerance(a: &CandidateTiming, b: &CandidateTiming, floor: f64) -> f64 {
    floor.max(a.noise()).max(b.noise())
}

/// Picks the winner among `(canonical index, timing)`: the fastest median
/// defines the bar, and the first candidate in canonical order whose median
/// is within the tie tolerance of it wins. The default variant is canonical
/// index 0, so it wins every tie, and a different variant is chosen only when
/// it is faster than the default by more than the noise.
///
/// Returns the index into `timed`, or `None` when nothing was timed.
pub fn choose(timed: &[(usize, CandidateTiming)], floor: f64) -> Option<usize> {
    let best = timed
        .iter()
        .enumerate()
        .min_by(|a, b| a.1 .1.median_s.total_cmp(&b.1 .1.median_s).then(a.1 .0.cmp(&b.1 .0)))?;
    let (_, best_t) = best.1;
    timed
        .iter()
        .enumerate()
        .filter(|(_, (_, t))| t.median_s <= best_t.median_s * (1.0 + tie_tolerance(t, best_t, floor)))
        .min_by_key(|(_, (idx, _))| *idx)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(m: f64, spread: f64) -> CandidateTiming {
        CandidateTiming {
            median_s: m,
            p20_s: m * (1.0 - spread),
            p80_s: m * (1.0 + spread),
            samples: 9,
            gbps: 0.0,
        }
    }

    #[test]
    fn quantiles_interpolate() {
        let s = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&s, 0.5), 3.0);
        assert!((quantile(&s, 0.2) - 1.8).abs() < 1e-12);
        assert_eq!(quantile(&[7.0], 0.8), 7.0);
        assert!(quantile(&[], 0.5).is_nan());
        let st = summarize(&[5.0, 1.0, f64::NAN, 3.0], 3_000_000_000).unwrap();
        assert_eq!((st.median_s, st.samples), (3.0, 3));
        assert!((st.gbps - 1.0).abs() < 1e-12);
        assert!(summarize(&[f64::NAN, -1.0], 1).is_none());
    }

    #[test]
    fn ties_go_to_the_canonical_candidate() {
        // default 1.00, variant 0.99: within the 3% floor -> default.
        assert_eq!(choose(&[(0, t(1.00, 0.0)), (5, t(0.99, 0.0))], 0.03), Some(0));
        // variant 0.90: clearly faster -> variant.
        assert_eq!(choose(&[(0, t(1.00, 0.0)), (5, t(0.90, 0.0))], 0.03), Some(1));
        // noisy variant: 0.90 but +-15% -> tie -> default.
        assert_eq!(choose(&[(0, t(1.00, 0.0)), (5, t(0.90, 0.15))], 0.03), Some(0));
        // among two tied non-defaults, the lower canonical index wins whatever the order given.
        assert_eq!(
            choose(&[(7, t(0.50, 0.0)), (0, t(1.0, 0.0)), (3, t(0.505, 0.0))], 0.03),
            Some(2)
        );
        assert_eq!(choose(&[], 0.03), None);
    }
}
