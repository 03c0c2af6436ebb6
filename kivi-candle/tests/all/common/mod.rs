//! Helpers shared by kivi-candle's integration tests: random tensors in
//! candle's `[1, heads, n, d]` layout and their host rows.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};

/// `[1, heads, n, d]` random f32 tensor and its host rows `[n, heads, d]`.
pub fn random(rng: &mut fastrand::Rng, heads: usize, n: usize, d: usize) -> (Tensor, Vec<f32>) {
    let rows: Vec<f32> = (0..n * heads * d).map(|_| rng.f32() * 4.0 - 2.0).collect();
    let t = Tensor::from_vec(rows.clone(), (n, heads, d), &Device::Cpu)
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    (t, rows)
}

/// Host rows `[n, heads, d]` of a `[1, heads, n, d]` tensor.
pub fn rows_of(t: &Tensor) -> Vec<f32> {
    t.squeeze(0)
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
