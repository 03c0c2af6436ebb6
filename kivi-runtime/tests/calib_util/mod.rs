//! What the calibrated-cache tests (`calib.rs`, `calib_rope.rs`, `vq.rs`)
//! share: the synthetic K/V draw and the loop that fills caches and holds
//! every stored row to the calibrated oracle view.

#![allow(dead_code)]

use kivi_runtime::calib::Calibration;
use kivi_runtime::rand::Rng;
use kivi_runtime::reference::cache_view_calibrated;
use kivi_runtime::{PagedCache, SeqId};
use kivi_spec::{Scheme, Tensor};
use std::fmt::Display;

/// `tokens × h × d` rows: keys with per-channel offsets and spreads (what
/// channel-axis codecs and calibrated tables must cope with), values
/// standard normal.
pub fn kv(rng: &mut Rng, tokens: usize, h: usize, d: usize, key: bool) -> Vec<f32> {
    (0..tokens * h * d)
        .map(|i| {
            let c = i % d;
            if key {
                ((c * 7) % 5) as f32 - 2.0 + (0.5 + (c % 3) as f32) * rng.f32()
            } else {
                rng.normal()
            }
        })
        .collect()
}

/// The oracle's calibrated view of one sequence: `(keys, values)`.
pub type Views = (Vec<f32>, Vec<f32>);

/// Adds one sequence per length in `lens` to every cache, alternately as
/// one `extend` and as token-by-token `append`s (so each cache sees both
/// write paths), and asserts that every cache stores exactly the oracle's
/// calibrated view of the rows. Returns the sequence ids (the last cache's;
/// every cache numbers its sequences alike) and the views `(keys, values)`.
pub fn fill_and_check(
    caches: &mut [PagedCache],
    s: &Scheme,
    cal: &Calibration,
    layer: usize,
    lens: &[usize],
    rng: &mut Rng,
    what: &dyn Display,
) -> (Vec<SeqId>, Vec<Views>) {
    let shape = s.shape().expect("a bound scheme");
    let (hkv, d) = (shape.kv_heads, shape.head_dim);
    let row = hkv * d;
    let mut seqs = Vec::new();
    let mut views = Vec::new();
    for (n_i, &n) in lens.iter().enumerate() {
        let k = kv(rng, n, hkv, d, true);
        let v = kv(rng, n, hkv, d, false);
        let mut id = 0;
        for (ci, c) in caches.iter_mut().enumerate() {
            id = c.add_sequence();
            if (n_i + ci) % 2 == 0 {
                c.extend(id, &k, &v).unwrap();
            } else {
                for t in 0..n {
                    c.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                        .unwrap();
                }
            }
        }
        let kw = cache_view_calibrated(s, Tensor::Key, &k, cal, layer).unwrap();
        let vw = cache_view_calibrated(s, Tensor::Value, &v, cal, layer).unwrap();
        for c in caches.iter() {
            assert_eq!(
                c.dequantize(id, Tensor::Key).unwrap(),
                kw,
                "{} {what} len {n} keys",
                s.name
            );
            assert_eq!(
                c.dequantize(id, Tensor::Value).unwrap(),
                vw,
                "{} {what} len {n} values",
                s.name
            );
        }
        seqs.push(id);
        views.push((kw, vw));
    }
    (seqs, views)
}
