//! `low_rank: pca(rank = R, apply = [key, value])`: accepted forms, the
//! canonical text and hash, and spanned refusals of what is not built.

use kivi_spec::{canonical, parse_scheme, scheme_hash, Tensor};

const K4: &str = "key: quant(bits = 4, axis = channel, group = 32)";
const V4: &str = "value: quant(bits = 4, axis = token, group = 32)";
const LR: &str = "low_rank: pca(rank = 64, apply = [key, value])";

/// The error of `text`, checked to contain every needle and to point at
/// the 1-based column of `at` in `text` (line 1).
fn refused(text: &str, needles: &[&str], at: &str) {
    let e = parse_scheme(text).expect_err(text);
    for n in needles {
        assert!(e.message.contains(n), "{text}\n  message: {}\n  lacks {n:?}", e.message);
    }
    let col = text.find(at).unwrap_or_else(|| panic!("{at:?} not in {text}")) + 1;
    assert_eq!((e.line, e.column), (1, col), "{text}: {}", e.message);
}

#[test]
fn parses_and_round_trips_through_the_canonical_text() {
    let s = parse_scheme(&format!(
        "S {{ {K4}, {V4}, residual: 32, {LR}, heads: mqa(q = 4), head_dim: 256 }}"
    ))
    .unwrap();
    let l = s.low_rank.unwrap();
    assert_eq!((l.rank, l.apply.key, l.apply.value), (64, true, true));
    assert_eq!((s.rank_of(Tensor::Key), s.rank_of(Tensor::Value)), (Some(64), Some(64)));
    let text = canonical(&s);
    assert!(
        text.contains("low_rank: pca(rank = 64, apply = [key, value])"),
        "{text}"
    );
    assert_eq!(parse_scheme(&text).unwrap(), s);
    // Full coordinates, unbound shape: fine (the rank is checked at binding).
    parse_scheme(&format!("S {{ key: full, value: full, {LR} }}")).unwrap();
}

#[test]
fn the_hash_changes_with_the_rank_and_only_when_set() {
    let plain = parse_scheme(&format!("S {{ {K4}, {V4}, residual: 32 }}")).unwrap();
    assert!(!canonical(&plain).contains("low_rank"));
    let a = parse_scheme(&format!("S {{ {K4}, {V4}, residual: 32, {LR} }}")).unwrap();
    let b = parse_scheme(&format!(
        "S {{ {K4}, {V4}, residual: 32, low_rank: pca(rank = 32, apply = [key, value]) }}"
    ))
    .unwrap();
    let (hp, ha, hb) = (scheme_hash(&plain), scheme_hash(&a), scheme_hash(&b));
    assert!(hp != ha && ha != hb && hp != hb);
}

#[test]
fn coordinate_scheme_keeps_the_full_heads_softmax_scale() {
    let s = parse_scheme(&format!(
        "S {{ {K4}, {V4}, residual: 32, {LR}, heads: gqa(q = 8, kv = 2), head_dim: 128 }}"
    ))
    .unwrap();
    let c = s.coordinate_scheme().unwrap();
    assert_eq!(c.head_dim, Some(64));
    assert_eq!(c.softmax_scale, Some(1.0 / (128f32).sqrt()));
    assert_eq!((c.low_rank, c.key, c.residual), (None, s.key, 32));
    assert!(parse_scheme(&format!("S {{ {K4}, {V4} }}"))
        .unwrap()
        .coordinate_scheme()
        .is_none());
}

#[test]
fn bad_ranks_and_lists_are_spanned_errors() {
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: pca(rank = 300, apply = [key, value]), head_dim: 256 }}"),
        &["rank = 300", "head_dim 256"],
        "300",
    );
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: pca(rank = 0, apply = [key, value]) }}"),
        &["rank = 0"],
        "0, apply",
    );
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: pca(rank = 8, apply = [key]) }}"),
        &["apply = [key]", "not supported yet"],
        "[key]",
    );
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: svd(rank = 8, apply = [key, value]) }}"),
        &["unknown low-rank basis `svd`"],
        "svd",
    );
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: pca(apply = [key, value]) }}"),
        &["missing `rank`"],
        "(apply",
    );
    refused(
        &format!("S {{ {K4}, {V4}, low_rank: pca(rank = 8, rank = 8, apply = [key, value]) }}"),
        &["duplicate"],
        "rank = 8, apply",
    );
}

#[test]
fn token_groups_must_divide_the_rank_not_the_head() {
    // 24 divides R = 48 but not head_dim 256: accepted (groups split coordinates).
    parse_scheme(&format!(
        "S {{ {K4}, value: quant(bits = 4, axis = token, group = 24), residual: 32, low_rank: pca(rank = 48, apply = [key, value]), head_dim: 256 }}"
    ))
    .unwrap();
    refused(
        &format!("S {{ {K4}, value: quant(bits = 4, axis = token, group = 32), low_rank: pca(rank = 48, apply = [key, value]), head_dim: 256 }}"),
        &["does not divide", "rank-48 coordinates"],
        "32), low_rank",
    );
}

#[test]
fn combinations_not_built_are_refused_by_name() {
    let nuq = "key: quant(bits = 4, axis = channel, group = 32, levels = nuq)";
    refused(
        &format!("S {{ {nuq}, {V4}, {LR} }}"),
        &["levels = nuq", "low_rank"],
        "nuq),",
    );
    refused(
        &format!("S {{ {K4}, {V4}, {LR}, rope: pre(theta = 10000.0, style = half) }}"),
        &["rope: pre", "low_rank", "not supported yet"],
        "pre(",
    );
    refused(
        &format!("S {{ key: quant(bits = 2, axis = channel, group = 32), {V4}, {LR}, query: int8(group = 32) }}"),
        &["query: int8", "low_rank"],
        "int8",
    );
    refused(
        &format!("S {{ {K4}, {V4}, {LR}, rotation: hadamard(block = 32, apply = [key]) }}"),
        &["rotation", "low_rank"],
        "hadamard",
    );
    refused(
        &format!("S {{ {K4}, {V4}, {LR}, outliers: sparse(per_token = 2, apply = [key]) }}"),
        &["outliers", "low_rank"],
        "sparse",
    );
}
