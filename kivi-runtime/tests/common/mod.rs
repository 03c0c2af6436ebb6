//! Shared helpers for the runtime's integration tests: a seeded generator
//! (no external crates) and a set of schemes covering the language.
#![allow(dead_code)]

use kivi_spec::*;

/// xorshift64*: deterministic, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Activations that look like LLM keys: a few channels with large
    /// magnitude (outliers), the rest small.
    pub fn kv(&mut self, tokens: usize, heads: usize, d: usize, outliers: bool) -> Vec<f32> {
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
