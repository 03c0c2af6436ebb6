//! Shared helpers for the runtime's integration tests: the seeded generator
//! (`kivi_runtime::rand`) and a set of schemes covering the language.
#![allow(dead_code)]

use kivi_spec::*;

/// The runtime's one seeded generator (the same xorshift64* stream these
/// tests always used), with the test-data shapes of [`KvData`] on top.
pub use kivi_runtime::rand::Rng;

/// Test-data shapes drawn from [`Rng`].
pub trait KvData {
    /// Activations that look like LLM keys: a few channels with large
    /// magnitude (outliers), the rest small.
    fn kv(&mut self, tokens: usize, heads: usize, d: usize, outliers: bool) -> Vec<f32>;
}

impl KvData for Rng {
    fn kv(&mut self, tokens: usize, heads: usize, d: usize, outliers: bool) -> Vec<f32> {
        let mut v = Vec::with_capacity(tokens * heads * d);
        for _ in 0..tokens {
            for _ in 0..heads {
                for c in 0..d {
                    let scale = if outliers && c % 17 == 3 { 8.0 } else { 1.0 };
                    v.push(self.f32() * scale);
                }
            }
        }
        v
    }
}

pub fn quant(bits: u32, axis: Axis, group: u32) -> Codec {
    Codec::Quant(Quant {
        bits,
        axis,
        group,
        scale: ScaleDtype::F16,
        levels: Levels::Uniform,
    })
}

/// Presets plus non-preset schemes that exercise every feature.
pub fn schemes() -> Vec<Scheme> {
    let mut v = presets::all();
    let k2 = presets::kivi2();
    v.push(Scheme {
        name: "three_bit_sinks".into(),
        key: quant(3, Axis::Channel, 16),
        value: quant(3, Axis::Token, 16),
        residual: 20,
        sinks: 4,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "one_bit_bf16".into(),
        key: quant(1, Axis::Channel, 8),
        value: quant(1, Axis::Token, 8),
        residual: 5,
        dtype: Dtype::Bf16,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "chunked_f32".into(),
        key: quant(4, Axis::Channel, 32),
        value: quant(2, Axis::Token, 16),
        residual: 64,
        flush: Flush::Chunked,
        dtype: Dtype::F32,
        ..k2.clone()
    });
    v.push(Scheme {
        name: "f32_scales_window".into(),
        key: Codec::Quant(Quant {
            bits: 8,
            axis: Axis::Channel,
            group: 8,
            scale: ScaleDtype::F32,
            levels: Levels::Uniform,
        }),
        value: Codec::Quant(Quant {
            bits: 2,
            axis: Axis::Channel,
            group: 16,
            scale: ScaleDtype::F32,
            levels: Levels::Uniform,
        }),
        residual: 3,
        sinks: 2,
        sliding_window: Some(50),
        softmax_scale: Some(0.0625),
        ..k2.clone()
    });
    v.push(Scheme {
        name: "full_key".into(),
        key: Codec::Full,
        value: quant(4, Axis::Token, 16),
        residual: 0,
        sinks: 1,
        ..k2
    });
    v
}

pub fn layouts() -> Vec<(Heads, u32)> {
    vec![
        (Heads::Mha(2), 32),
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Gqa { q: 7, kv: 1 }, 32),
        (Heads::Mqa(4), 64),
    ]
}

/// max |a - b| / max |b|.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let num = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let den = want.iter().map(|b| b.abs()).fold(0f32, f32::max).max(1e-30);
    num / den
}

/// Schemes that use the codec pipeline (rotation, Lloyd–Max levels, norms,
/// outliers, centering), alone and together, on both axes. Head dims in
/// `layouts()` are 32 and 64: rotation blocks here divide both.
pub fn codec_schemes() -> Vec<Scheme> {
    let texts = [
        // Lloyd–Max alone, token and channel axis, both norms.
        "lloyd_tok { key: quant(bits = 3, axis = token, group = 16, levels = lloyd_max),
                     value: quant(bits = 2, axis = token, group = 32, levels = lloyd_max, norm = l2), residual: 5 }",
        "lloyd_chan { key: quant(bits = 2, axis = channel, group = 8, levels = lloyd_max, norm = l2),
                      value: quant(bits = 4, axis = token, group = 8, levels = lloyd_max), residual: 3, sinks: 2 }",
        // Rotation with and without signs, uniform codes.
        "rot_uniform { key: quant(bits = 2, axis = channel, group = 16), value: quant(bits = 2, axis = token, group = 16),
                       rotation: hadamard(block = 32, apply = [key, value]), residual: 7 }",
        "rot_signs_bf16 { key: quant(bits = 4, axis = token, group = 32, levels = lloyd_max),
                          value: quant(bits = 1, axis = token, group = 32, levels = lloyd_max),
                          rotation: hadamard(block = 16, apply = [key], signs = 5), dtype: bf16 }",
        // Outliers alone, then everything at once.
        "outliers_only { key: quant(bits = 2, axis = channel, group = 8), value: quant(bits = 2, axis = token, group = 16),
                         outliers: sparse(per_token = 3, apply = [key, value]), residual: 4 }",
        "everything { key: quant(bits = 3, axis = token, group = 32, levels = lloyd_max, norm = l2),
                      value: quant(bits = 2, axis = token, group = 16, levels = lloyd_max),
                      rotation: hadamard(block = 32, apply = [key, value], signs = 9),
                      outliers: sparse(per_token = 2, apply = [key]),
                      center: channel_mean(tokens = 6, apply = [key, value]), residual: 4, sinks: 2 }",
        // Centering with chunked flush and f32 activations and scales.
        "center_chunked_f32 { key: quant(bits = 2, axis = channel, group = 4, scale = f32),
                              value: full, center: channel_mean(tokens = 8, apply = [key]),
                              rotation: hadamard(block = 8, apply = [key]), residual: 8, flush: chunked, dtype: f32 }",
    ];
    texts
        .iter()
        .map(|t| parse_scheme(t).unwrap_or_else(|e| panic!("{t}: {e}")))
        .collect()
}
