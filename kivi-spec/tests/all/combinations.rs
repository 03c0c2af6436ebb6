//! Fields that each work alone but not (yet) together are refused at
//! validation with a message naming both, never accepted and run with one
//! of them silently ignored.

use kivi_spec::parse_scheme;

fn refused(text: &str, needles: &[&str]) {
    let e = parse_scheme(text).expect_err(text);
    for n in needles {
        assert!(e.message.contains(n), "{text}\n  message: {}\n  lacks {n:?}", e.message);
    }
}

const KIVI2_KEY: &str = "key: quant(bits = 2, axis = channel, group = 32)";
const ROPE: &str = "rope: pre(theta = 10000.0, style = half)";
const MLA: &str = "heads: mla(q = 16, latent = 512, rope_dim = 64)";

#[test]
fn each_field_alone_is_accepted() {
    let v = "value: quant(bits = 2, axis = token, group = 32)";
    for extra in [ROPE, "query: int8(group = 32)"] {
        parse_scheme(&format!("S {{ {KIVI2_KEY}, {v}, {extra}, residual: 32 }}")).unwrap();
    }
    parse_scheme(&format!("S {{ {KIVI2_KEY}, {MLA} }}")).unwrap();
    parse_scheme(&format!(
        "S {{ key: quant(bits = 2, axis = channel, group = 32, levels = nuq), {v}, residual: 32 }}"
    ))
    .unwrap();
}

/// KVQuant's recipe: calibrated codebooks on keys stored before RoPE (the
/// codebook is fitted on pre-RoPE keys; `kivi_runtime::calib` checks the
/// stage), on either axis, with nuq values too.
#[test]
fn nuq_levels_with_pre_rope_keys_are_accepted() {
    for key in [
        "key: quant(bits = 2, axis = channel, group = 32, levels = nuq)",
        "key: quant(bits = 3, axis = token, group = 32, levels = nuq, norm = l2)",
    ] {
        let s = parse_scheme(&format!(
            "S {{ {key}, value: quant(bits = 2, axis = token, group = 32, levels = nuq), {ROPE}, residual: 32, sinks: 4 }}"
        ))
        .unwrap();
        assert!(s.rope.is_some());
    }
}

#[test]
fn int8_query_with_pre_rope_keys_or_mla_heads_is_refused() {
    let v = "value: quant(bits = 2, axis = token, group = 32)";
    refused(
        &format!("S {{ {KIVI2_KEY}, {v}, {ROPE}, query: int8(group = 32) }}"),
        &["query: int8", "rope: pre"],
    );
    refused(
        &format!("S {{ {KIVI2_KEY}, {MLA}, query: int8(group = 32) }}"),
        &["query: int8", "mla"],
    );
}

#[test]
fn nuq_levels_with_mla_heads_are_refused() {
    let nuq_key = "key: quant(bits = 2, axis = channel, group = 32, levels = nuq)";
    refused(&format!("S {{ {nuq_key}, {MLA} }}"), &["nuq", "mla"]);
    refused(
        &format!("S {{ {KIVI2_KEY}, heads: mla(q = 16, latent = 512, rope_dim = 64, rope = quant(bits = 4, axis = token, group = 32, levels = nuq)) }}"),
        &["nuq", "mla"],
    );
}

/// Both calibrated codecs learn their tables on full rows, so neither may
/// store the coordinates of a low-rank tensor.
#[test]
fn vq_codecs_with_low_rank_are_refused() {
    let lr = "low_rank: pca(rank = 64, apply = [key, value])";
    for (k, v) in [
        (
            "key: vq(dim = 8, entries = 256)",
            "value: quant(bits = 2, axis = token, group = 32)",
        ),
        (KIVI2_KEY, "value: vq(dim = 8, entries = 256)"),
    ] {
        refused(
            &format!("S {{ {k}, {v}, {lr}, residual: 32, heads: mha(4), head_dim: 128 }}"),
            &["vq", "low_rank"],
        );
    }
}
