//! The run-time parser (`kivi::parse_scheme`, used for scheme files and by
//! the CLI) must reject exactly what `kivi::scheme!` rejects, with the same
//! message, at the same place. For every compile-fail case in
//! `kivi-macros/tests/ui/` this test blanks everything outside the macro's braces (keeping line
//! breaks, so positions do not move), parses the rest at run time and
//! compares message, line and column with the compiler's `.stderr` snapshot.

use std::path::{Path, PathBuf};

/// The compiler's verdict from a trybuild snapshot: message, line, column.
fn expected(stderr: &str) -> (String, usize, usize) {
    let mut lines = stderr.lines();
    let message = lines
        .next()
        .and_then(|l| l.strip_prefix("error: "))
        .expect("snapshot starts with `error: `")
        .to_string();
    let arrow = lines
        .find_map(|l| l.trim_start().strip_prefix("--> "))
        .expect("snapshot has a `-->` location line");
    let mut parts = arrow.rsplitn(3, ':');
    let column = parts.next().unwrap().parse().unwrap();
    let line = parts.next().unwrap().parse().unwrap();
    (message, line, column)
}

/// The text of `source` with everything outside the body of the
/// `kivi::scheme! { ... }` or `kivi::model! { ... }` invocation replaced by
/// spaces (newlines kept), and whether it is a model declaration.
fn macro_body_in_place(source: &str) -> (String, bool) {
    let (open, model) = match (source.find("kivi::scheme! {"), source.find("kivi::model! {")) {
        (Some(i), _) => (i + "kivi::scheme! ".len(), false),
        (None, Some(i)) => (i + "kivi::model! ".len(), true),
        (None, None) => panic!("a kivi::scheme! or kivi::model! invocation"),
    };
    let mut depth = 0usize;
    let mut close = None;
    for (i, c) in source[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let close = close.expect("balanced braces");
    let body = source
        .char_indices()
        .map(|(i, c)| if c == '\n' || (i > open && i < close) { c } else { ' ' })
        .collect();
    (body, model)
}

fn ui_cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kivi-macros/tests/ui");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    v.sort();
    v
}

/// Every compile-fail case (`kivi::scheme!` and `kivi::model!`) fails the
/// same way in the run-time parser: same message, same line and column.
#[test]
fn runtime_parser_agrees_with_every_compile_fail_case() {
    let cases = ui_cases();
    assert!(
        cases.len() >= 14,
        "expected one case per class of error, found {}",
        cases.len()
    );
    for rs in cases {
        let stderr = std::fs::read_to_string(rs.with_extension("stderr"))
            .unwrap_or_else(|_| panic!("{} has no .stderr snapshot", rs.display()));
        let (message, line, column) = expected(&stderr);
        let (text, model) = macro_body_in_place(&std::fs::read_to_string(&rs).unwrap());
        // A valid scheme the CUDA templates cannot instantiate fails in the
        // macro's code generation; `check_declarations` is that step at run time.
        let err = if model {
            kivi::spec::parse_model(&text).err()
        } else {
            kivi::parse_scheme(&text)
                .err()
                .or_else(|| kivi::templates::check_declarations(&text).err())
        }
        .unwrap_or_else(|| panic!("{}: the run-time parser accepted it", rs.display()));
        assert_eq!(err.message, message, "{}", rs.display());
        assert_eq!((err.line, err.column), (line, column), "{}: position", rs.display());
        // The run-time error names its place as `line:column: message`.
        assert_eq!(err.to_string(), format!("{line}:{column}: {message}"));
    }
}

/// Every planned extension is refused by name, never ignored.
#[test]
fn future_fields_are_not_supported_yet() {
    let body = "key: quant(bits = 2, axis = channel, group = 32), value: full,";
    for field in ["codebook", "vq"] {
        let text = format!("S {{ {body} {field}: x }}");
        let e = kivi::parse_scheme(&text).unwrap_err();
        assert!(e.message.contains("not supported yet"), "{field}: {}", e.message);
        assert!(e.message.contains(&format!("`{field}`")), "{field}: {}", e.message);
        assert_eq!(e.column, text.find(&format!("{field}:")).unwrap() + 1, "{field}");
    }
    for arg in ["codebook", "symmetric", "clip", "nuq"] {
        let text = format!("S {{ key: quant(bits = 2, axis = channel, group = 32, {arg} = x), value: full }}");
        let e = kivi::parse_scheme(&text).unwrap_err();
        assert!(e.message.contains("not supported yet"), "{arg}: {}", e.message);
    }
    // MLA is a head layout (`heads: mla(...)`), not a field.
    for field in ["mla", "latent"] {
        let e = kivi::parse_scheme(&format!("S {{ {body} {field}: x }}")).unwrap_err();
        assert!(
            e.message.contains("heads: mla(q = N, latent = L, rope_dim = R)"),
            "{}",
            e.message
        );
    }
    let e = kivi::parse_scheme("S { key: full, heads: mla(q = 8) }").unwrap_err();
    assert!(e.message.contains("mla(...) is missing `latent`"), "{}", e.message);
    // Calibrated codebooks are spelled `levels = nuq` (issue 12); other
    // spellings and learned rotations are refused.
    let q = "quant(bits = 2, axis = token, group = 32";
    assert!(kivi::parse_scheme(&format!("S {{ key: {q}, levels = nuq), value: full }}")).is_ok());
    for (text, what) in [
        (
            format!("S {{ key: {q}, levels = kmeans), value: full }}"),
            "levels = kmeans",
        ),
        (
            format!("S {{ key: {q}), value: full, rotation: learned(block = 32, apply = [key]) }}"),
            "`learned` rotations",
        ),
    ] {
        let e = kivi::parse_scheme(&text).unwrap_err();
        assert!(
            e.message.contains("not supported yet") && e.message.contains(what),
            "{}",
            e.message
        );
    }
}

/// A Rust type suffix on a number is refused where the number stands (syn
/// keeps the suffix aside, so `300u8` used to read as 300), in every
/// numeric position: field values, codec arguments, head counts, floats.
#[test]
fn numbers_with_type_suffixes_are_refused() {
    let q = "quant(bits = 2, axis = token, group = 32)";
    for (text, lit) in [
        (format!("S {{ key: {q}, value: full, residual: 300u8 }}"), "300u8"),
        (format!("S {{ key: {q}, value: full, sinks: 4usize }}"), "4usize"),
        (
            "S { key: quant(bits = 2u32, axis = token, group = 32), value: full }".to_string(),
            "2u32",
        ),
        (
            "S { key: quant(bits = 2, axis = token, group = 32i64), value: full }".to_string(),
            "32i64",
        ),
        (format!("S {{ key: {q}, value: full, head_dim: 128u16 }}"), "128u16"),
        (
            format!("S {{ key: {q}, value: full, heads: gqa(q = 8u8, kv = 2) }}"),
            "8u8",
        ),
        (
            format!("S {{ key: {q}, value: full, softmax_scale: 0.125f32 }}"),
            "0.125f32",
        ),
        (format!("S {{ key: {q}, value: full, softmax_scale: 1f64 }}"), "1f64"),
    ] {
        let e = kivi::parse_scheme(&text).unwrap_err();
        assert!(
            e.message.contains(&format!("`{lit}` has a type suffix"))
                && e.message.contains("numbers in a scheme are plain"),
            "{text}: {}",
            e.message
        );
        assert_eq!(e.column, text.find(lit).unwrap() + 1, "{text}");
    }
    // The plain forms parse.
    kivi::parse_scheme(&format!(
        "S {{ key: {q}, value: full, residual: 128, softmax_scale: 0.125 }}"
    ))
    .unwrap();
}

/// The codec pipeline parses identically through the macro and at run time.
#[test]
fn macro_and_runtime_parser_agree_on_the_codec_pipeline() {
    kivi::scheme! {
        pub Codecs {
            key: quant(bits = 3, axis = token, group = 256, levels = lloyd_max, norm = l2),
            value: quant(bits = 2, axis = token, group = 64),
            rotation: hadamard(block = 256, apply = [key, value], signs = 11),
            outliers: sparse(per_token = 2, apply = [key]),
            center: channel_mean(tokens = 32, apply = [key]),
            residual: 128,
            sinks: 4,
        }
    }
    let from_text = kivi::parse_scheme(Codecs::CANONICAL).unwrap();
    assert_eq!(Codecs::spec(), from_text);
    assert_eq!(Codecs::HASH, kivi::scheme_hash(&from_text));
    assert!(Codecs::KERNELS.is_empty(), "no shape, no kernels");
}

/// `low_rank` parses identically through the macro and at run time; with a
/// shape the macro embeds the coordinate scheme's prefill, append and
/// decode kernels (head_dim = rank: the device low-rank cache projects on
/// the host and runs these).
#[test]
fn macro_and_runtime_parser_agree_on_low_rank() {
    kivi::scheme! {
        pub LowRank {
            key: quant(bits = 4, axis = channel, group = 32),
            value: quant(bits = 3, axis = token, group = 32),
            low_rank: pca(rank = 96, apply = [key, value]),
            residual: 128,
            heads: mqa(q = 4),
            head_dim: 256,
        }
    }
    let from_text = kivi::parse_scheme(LowRank::CANONICAL).unwrap();
    assert_eq!(LowRank::spec(), from_text);
    assert_eq!(LowRank::HASH, kivi::scheme_hash(&from_text));
    let coords = from_text.coordinate_scheme().unwrap();
    let tag = kivi_templates::scheme_tag(&coords);
    assert!(tag.ends_with("/mqa4.d96"), "{tag}");
    assert_eq!(LowRank::KERNELS.len(), 3);
    for (name, source) in LowRank::KERNELS {
        assert!(name.starts_with(&tag), "{name}");
        assert!(!source.is_empty());
    }
}

/// Good schemes parse the same at run time as through the macro.
#[test]
fn macro_and_runtime_parser_build_the_same_scheme() {
    kivi::scheme! {
        pub Kivi2 {
            key: quant(bits = 2, axis = channel, group = 32),
            value: quant(bits = 2, axis = token, group = 32),
            residual: 128,
            heads: gqa(q = 32, kv = 8),
            head_dim: 128,
        }
    }
    let from_text = kivi::parse_scheme(
        "pub Kivi2 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 128, heads: gqa(q = 32, kv = 8), head_dim: 128 }",
    )
    .unwrap();
    assert_eq!(Kivi2::spec(), from_text);
    assert_eq!(Kivi2::CANONICAL, kivi::canonical(&from_text));
    // Same meaning as the preset bound to the same shape: same hash.
    let preset = kivi::presets::kivi2()
        .with_shape(kivi::Heads::Gqa { q: 32, kv: 8 }, 128)
        .unwrap();
    assert_eq!(Kivi2::HASH, kivi::scheme_hash(&preset));
    // The exact cost from the issue: 96 bytes per token per KV head.
    let (bytes, per) = kivi::spec::layout::bytes_per_token_per_head(&Kivi2::spec());
    assert_eq!((bytes, per), (96 * per, per));
}
