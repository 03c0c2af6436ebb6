//! The codec pipeline's numbers against theory, independently of how the
//! oracle and the cache share their arithmetic: Lloyd–Max distortion on
//! Gaussian data matches Max's table, outliers come back exactly, centering
//! and rotation are undone, and the norm option keeps norms.

mod common;
use common::*;
use kivi_runtime::reference::cache_view;
use kivi_spec::*;

/// Standard normal samples (Box–Muller on the test generator).
fn gaussian(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1 = ((rng.f32() + 1.0) / 2.0).max(1e-7) as f64;
            let u2 = ((rng.f32() + 1.0) / 2.0) as f64;
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn scheme(text: &str, d: u32) -> Scheme {
    parse_scheme(text).unwrap().with_shape(Heads::Mha(1), d).unwrap()
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn lloyd_max_distortion_matches_max_1960() {
    // MSE of the optimal quantizer of N(0, 1) (Max 1960, Table I).
    let theory = [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)];
    let mut rng = Rng::new(17);
    let x = gaussian(&mut rng, 2000 * 256);
    for (bits, want) in theory {
        let s = scheme(
            &format!(
                "L {{ key: quant(bits = {bits}, axis = token, group = 256, levels = lloyd_max, scale = f32), value: full, dtype: f32 }}"
            ),
            256,
        );
        let y = cache_view(&s, Tensor::Key, &x).unwrap();
        let got = mse(&y, &x);
        assert!((got / want - 1.0).abs() < 0.05, "{bits} bits: mse {got}, theory {want}");
        // Uniform min/max codes at the same width do worse on Gaussian data.
        let u = scheme(
            &format!(
                "U {{ key: quant(bits = {bits}, axis = token, group = 256, scale = f32), value: full, dtype: f32 }}"
            ),
            256,
        );
        let yu = cache_view(&u, Tensor::Key, &x).unwrap();
        assert!(
            mse(&yu, &x) > got,
            "{bits} bits: uniform {} vs lloyd {got}",
            mse(&yu, &x)
        );
    }
}

#[test]
fn l2_norm_keeps_each_group_norm() {
    let mut rng = Rng::new(5);
    let x = gaussian(&mut rng, 50 * 64);
    let s = scheme(
        "L { key: quant(bits = 2, axis = token, group = 64, levels = lloyd_max, norm = l2, scale = f32), value: full, dtype: f32 }",
        64,
    );
    let y = cache_view(&s, Tensor::Key, &x).unwrap();
    for (a, b) in x.chunks(64).zip(y.chunks(64)) {
        let (na, nb) = (mse(a, &[0.0; 64]), mse(b, &[0.0; 64]));
        assert!((na / nb - 1.0).abs() < 1e-5, "{na} vs {nb}");
    }
}

#[test]
fn outliers_come_back_to_the_activation_dtype() {
    // One huge entry per token: without outlier storage it wrecks its group;
    // with it, it is exact to f16 and the rest of the group is better too.
    let mut rng = Rng::new(9);
    let d = 64;
    let mut x = gaussian(&mut rng, 40 * d);
    for t in 0..40 {
        x[t * d + (t * 7) % d] = 500.0 + t as f32;
    }
    let plain = scheme("P { key: quant(bits = 2, axis = token, group = 64), value: full }", 64);
    let with = scheme(
        "O { key: quant(bits = 2, axis = token, group = 64), value: full, outliers: sparse(per_token = 1, apply = [key]) }",
        64,
    );
    let xr: Vec<f32> = x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
    let yp = cache_view(&plain, Tensor::Key, &x).unwrap();
    let yo = cache_view(&with, Tensor::Key, &x).unwrap();
    for t in 0..40 {
        let i = t * d + (t * 7) % d;
        assert!(
            (yo[i] - xr[i]).abs() <= xr[i].abs() * 2f32.powi(-10),
            "{} vs {}",
            yo[i],
            xr[i]
        );
    }
    assert!(
        mse(&yo, &xr) * 20.0 < mse(&yp, &xr),
        "{} vs {}",
        mse(&yo, &xr),
        mse(&yp, &xr)
    );
}

#[test]
fn centering_and_rotation_are_undone() {
    // A large per-channel offset (what Gemma's keys carry): centering takes
    // it out before quantizing, so the error is that of the small part.
    let mut rng = Rng::new(11);
    let d = 128;
    let t = 300;
    let mut x = gaussian(&mut rng, t * d);
    for (i, v) in x.iter_mut().enumerate() {
        *v = *v * 0.1 + ((i % d) as f32 * 0.37).sin() * 20.0;
    }
    let base = "key: quant(bits = 3, axis = token, group = 128, levels = lloyd_max, scale = f32), value: full, dtype: f32, residual: 32";
    let rot = scheme(
        &format!("R {{ {base}, rotation: hadamard(block = 128, apply = [key], signs = 1) }}"),
        128,
    );
    let cen = scheme(
        &format!("C {{ {base}, rotation: hadamard(block = 128, apply = [key], signs = 1), center: channel_mean(tokens = 32, apply = [key]) }}"),
        128,
    );
    let er = mse(&cache_view(&rot, Tensor::Key, &x).unwrap(), &x);
    let ec = mse(&cache_view(&cen, Tensor::Key, &x).unwrap(), &x);
    // the centered error is about 3-bit Lloyd distortion of the 0.1 noise
    assert!(ec < 0.01 * 0.05, "centered mse {ec}"); // noise variance 0.01 x 3-bit distortion 0.035
    assert!(ec * 100.0 < er, "centered {ec} vs not {er}");
}

#[test]
fn corrections_that_overflow_the_dtype_are_errors_not_infinities() {
    // 256 channels of 60000 (finite in f16) rotate into one coefficient of
    // 960000: its outlier correction cannot be stored in f16.
    let s = parse_scheme(
        "O { key: quant(bits = 2, axis = token, group = 256, levels = lloyd_max), value: full,
             rotation: hadamard(block = 256, apply = [key]), outliers: sparse(per_token = 1, apply = [key]) }",
    )
    .unwrap()
    .with_shape(Heads::Mha(1), 256)
    .unwrap();
    let k = vec![60000.0f32; 256];
    let e = cache_view(&s, Tensor::Key, &k).unwrap_err();
    assert!(e.to_string().contains("cannot hold"), "{e}");
    let mut c = kivi_runtime::PagedCache::new(s, kivi_runtime::CacheConfig::for_tokens(16)).unwrap();
    let id = c.add_sequence();
    c.append(id, &[0.5; 256], &[0.5; 256]).unwrap();
    let before = c.dequantize(id, Tensor::Key).unwrap();
    let e = c.append(id, &k, &k).unwrap_err();
    // Refused either when appended (a raw value beyond what the rotated
    // group can always hold, `OutOfRange`) or when its correction is stored.
    assert!(
        matches!(
            e,
            kivi_runtime::Error::OutlierOverflow { tensor: "key", .. }
                | kivi_runtime::Error::OutOfRange { tensor: "key", .. }
        ),
        "{e}"
    );
    assert_eq!(c.len(id).unwrap(), 1, "a failed append changes nothing");
    assert_eq!(c.dequantize(id, Tensor::Key).unwrap(), before);
}
