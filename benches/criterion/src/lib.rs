//! Inputs shared by the criterion benches in `benches/cpu.rs`: the presets
//! and head layouts they sweep and K/V drawn like `kivi bench`'s.
//!
//! This crate is a workspace of its own so that criterion is compiled only
//! by `cargo bench` here, never by the main workspace's build or tests.

use kivi_runtime::rand::Rng;
use kivi_spec::{Heads, Scheme};

/// A head layout: name, query heads, KV heads, head_dim.
pub type Layout = (&'static str, u32, u32, u32);

/// GQA 32:8, head_dim 128 (Llama-3-8B-like) and MQA 4:1, head_dim 256
/// (Gemma-3-270M-like): the layouts of `kivi bench`.
pub const LAYOUTS: [Layout; 2] = [("gqa32:8/d128", 32, 8, 128), ("mqa4:1/d256", 4, 1, 256)];

/// The presets `kivi bench` times; `f16` is the baseline.
pub const PRESETS: [&str; 4] = ["f16", "int8", "kivi4", "kivi2"];

/// `preset` bound to `layout`.
///
/// ```
/// let s = kivi_criterion::scheme("kivi2", kivi_criterion::LAYOUTS[0]).unwrap();
/// assert_eq!(s.shape().unwrap().head_dim, 128);
/// ```
pub fn scheme(preset: &str, (_, q, kv, d): Layout) -> Result<Scheme, String> {
    kivi_spec::load_scheme(preset)
        .map_err(|e| e.to_string())?
        .with_shape(Heads::from_counts(q, kv), d)
        .map_err(|e| e.to_string())
}

/// `[tokens, kv_heads, head_dim]` keys (with per-channel offsets, as real
/// keys have) and values (noise), as `kivi bench` draws them.
pub fn kv(tokens: usize, (_, _, kv, d): Layout, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (h, d) = (kv as usize, d as usize);
    let mut r = Rng::new(seed);
    let mut k = Vec::with_capacity(tokens * h * d);
    let mut v = Vec::with_capacity(tokens * h * d);
    for _ in 0..tokens * h {
        for c in 0..d {
            k.push(((c * 7) % 5) as f32 * 0.5 - 1.0 + r.f32());
            v.push(r.f32());
        }
    }
    (k, v)
}
