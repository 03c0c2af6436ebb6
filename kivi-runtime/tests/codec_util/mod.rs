//! Schemes of the `device_codecs` and `nvrtc_all_variants` tests: one per
//! step of the codec pipeline, and mixes of them.
#![allow(dead_code)]

use kivi_spec::Scheme;

/// One scheme per pipeline step (and mixes), each written for head_dim 64
/// and its multiples. Half of them keep sinks; odd outlier counts, 1- to
/// 4-bit codes, f32 scales, bf16 and f32 activations, chunked flush.
pub fn codec_schemes() -> Vec<Scheme> {
    let texts = [
        "rot_tok { key: quant(bits = 2, axis = token, group = 32), value: quant(bits = 2, axis = token, group = 32),
            rotation: hadamard(block = 32, apply = [key, value]), residual: 16 }",
        "rot_chan_signs { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 3, axis = channel, group = 16),
            rotation: hadamard(block = 64, apply = [key, value], signs = 11), residual: 16, sinks: 3 }",
        "lloyd_rms { key: quant(bits = 3, axis = token, group = 32, levels = lloyd_max, norm = rms),
            value: quant(bits = 2, axis = channel, group = 32, levels = lloyd_max, norm = rms), residual: 32 }",
        "lloyd_l2 { key: quant(bits = 4, axis = channel, group = 16, levels = lloyd_max, norm = l2),
            value: quant(bits = 1, axis = token, group = 64, levels = lloyd_max, norm = l2), residual: 16, sinks: 2 }",
        "outliers { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32),
            outliers: sparse(per_token = 3, apply = [key, value]), residual: 16 }",
        "center { key: quant(bits = 2, axis = token, group = 32), value: quant(bits = 2, axis = channel, group = 16),
            center: channel_mean(tokens = 20, apply = [key, value]), residual: 16, sinks: 4 }",
        "all_bf16 { key: quant(bits = 3, axis = token, group = 64, levels = lloyd_max, norm = l2),
            value: quant(bits = 2, axis = token, group = 32),
            rotation: hadamard(block = 64, apply = [key, value], signs = 5),
            outliers: sparse(per_token = 2, apply = [key, value]),
            center: channel_mean(tokens = 8, apply = [key, value]), residual: 16, sinks: 4, dtype: bf16 }",
        "mixed_f32 { key: quant(bits = 2, axis = channel, group = 16, levels = lloyd_max, norm = rms),
            value: quant(bits = 4, axis = channel, group = 16, scale = f32),
            rotation: hadamard(block = 32, apply = [value]), outliers: sparse(per_token = 1, apply = [key]),
            center: channel_mean(tokens = 16, apply = [value]), residual: 32, dtype: f32, flush: chunked }",
    ];
    texts.iter().map(|t| kivi_spec::parse_scheme(t).unwrap()).collect()
}
