//! Measures the lookup-table idea (T-MAC style) against the kernel's folded
//! query x codes FMA, for 2-bit channel-axis keys. Standalone, std only:
//!
//!     rustc -O --edition 2021 benches/lut_vs_fma.rs -o /tmp/lut_vs_fma && /tmp/lut_vs_fma
//!
//! 2-bit channel-key scores for one group of G tokens, 4 query heads, D=128:
//! (a) folded query x codes, AVX-512 FMA; (b) T-MAC-style 256-entry tables per
//! 4 channels (built per group), one lookup per code byte.
use std::arch::x86_64::*;
use std::time::Instant;
const D: usize = 128;
const H: usize = 4;

#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn direct(codes: &[u32], q: &[f32], g: usize, out: &mut [f32]) {
    let sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for t in 0..g {
        let mut acc = [_mm512_setzero_ps(); H];
        for c in 0..D / 16 {
            let w = _mm512_set1_epi32(codes[t * 8 + c] as i32);
            let x = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(3)));
            for h in 0..H {
                acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q.as_ptr().add(h * D + 16 * c)), x, acc[h]);
            }
        }
        for h in 0..H {
            out[t * H + h] = _mm512_reduce_add_ps(acc[h]);
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn lut(codes: &[u32], q: &[f32], g: usize, out: &mut [f32], tab: &mut [f32]) {
    // tab[h][j][b] = sum_{i<4} q[h][4j+i] * ((b >> 2i) & 3), j < 32, b < 256
    for h in 0..H {
        for j in 0..D / 4 {
            let qq = &q[h * D + 4 * j..h * D + 4 * j + 4];
            let base = &mut tab[(h * 32 + j) * 256..(h * 32 + j + 1) * 256];
            // build 16-entry pair tables, then 256 = lo16 + hi16 (vectorised adds)
            let mut lo = [0f32; 16];
            let mut hi = [0f32; 16];
            for b in 0..16 {
                lo[b] = qq[0] * (b & 3) as f32 + qq[1] * (b >> 2) as f32;
                hi[b] = qq[2] * (b & 3) as f32 + qq[3] * (b >> 2) as f32;
            }
            let lov = _mm512_loadu_ps(lo.as_ptr());
            for (b, h) in hi.iter().enumerate() {
                _mm512_storeu_ps(base.as_mut_ptr().add(16 * b), _mm512_add_ps(lov, _mm512_set1_ps(*h)));
            }
        }
    }
    for t in 0..g {
        let bytes = std::slice::from_raw_parts(codes.as_ptr().add(t * 8) as *const u8, 32);
        for h in 0..H {
            let tb = &tab[h * 32 * 256..];
            let mut s = [0f32; 4];
            for j in (0..32).step_by(4) {
                for k in 0..4 {
                    s[k] += *tb.get_unchecked((j + k) * 256 + bytes[j + k] as usize);
                }
            }
            out[t * H + h] = s[0] + s[1] + s[2] + s[3];
        }
    }
}

fn main() {
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")) {
        eprintln!("needs AVX-512F and FMA");
        return;
    }
    for g in [32usize, 128, 1024] {
        let codes: Vec<u32> = (0..g * 8).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let q: Vec<f32> = (0..H * D).map(|i| (i as f32 * 0.1).sin()).collect();
        let mut o1 = vec![0f32; g * H];
        let mut o2 = vec![0f32; g * H];
        let mut tab = vec![0f32; H * 32 * 256];
        let reps = 200_000 / g;
        let (mut td, mut tl) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..reps {
                unsafe { direct(&codes, &q, g, &mut o1) };
                std::hint::black_box(&o1);
            }
            td = td.min(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            for _ in 0..reps {
                unsafe { lut(&codes, &q, g, &mut o2, &mut tab) };
                std::hint::black_box(&o2);
            }
            tl = tl.min(t0.elapsed().as_secs_f64());
        }
        let err = o1.iter().zip(&o2).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let per = |t: f64| t / (reps * g) as f64 * 1e9;
        println!(
            "group {g:5}: direct FMA {:.1} ns/token (4 heads), LUT {:.1} ns/token (build+lookup), max diff {err:e}",
            per(td),
            per(tl)
        );
    }
}
