//! Model declarations (`kivi_spec::parse_model`): per-layer and per-kind
//! schemes with a default, precedence, inline schemes in the scheme
//! grammar, and every error at the offending token's line and column.

use kivi_spec::{parse_model, parse_scheme, presets, LayerKind, ParseError};

fn err(text: &str) -> ParseError {
    match parse_model(text) {
        Ok(_) => panic!("should fail: {text}"),
        Err(e) => e,
    }
}

/// 1-based line and column of the first occurrence of `needle` in `text`.
fn at(text: &str, needle: &str) -> (usize, usize) {
    let i = text.find(needle).unwrap();
    let line = text[..i].matches('\n').count() + 1;
    let col = i - text[..i].rfind('\n').map_or(0, |n| n + 1) + 1;
    (line, col)
}

#[test]
fn gemma_policy_resolves_layer_by_layer() {
    let m = parse_model(
        "model gemma3_270m {
            layers: 18,
            window: 512,
            global_layers: [5, 11, 17],
            default: kivi2,
            global: kivi4,
            layers[0, 1]: k3 { key: quant(bits = 3, axis = channel, group = 32),
                               value: quant(bits = 3, axis = token, group = 32), residual: 64 },
        }",
    )
    .unwrap();
    assert_eq!(m.name, "gemma3_270m");
    let kinds = m.kinds().unwrap();
    let windows = m.windows().unwrap();
    let schemes = m.schemes_for(&kinds).unwrap();
    for l in 0..18 {
        let global = [5, 11, 17].contains(&l);
        assert_eq!(kinds[l], if global { LayerKind::Global } else { LayerKind::Sliding });
        assert_eq!(windows[l], if global { None } else { Some(512) });
        let want = match l {
            0 | 1 => parse_scheme(
                "k3 { key: quant(bits = 3, axis = channel, group = 32), value: quant(bits = 3, axis = token, group = 32), residual: 64 }",
            )
            .unwrap(),
            _ if global => presets::kivi4(),
            _ => presets::kivi2(),
        };
        assert_eq!(schemes[l], want, "layer {l}");
    }
}

#[test]
fn index_beats_kind_beats_default_and_kinds_come_from_the_caller() {
    let m = parse_model("model { sliding: kivi2, default: f16, layers[2]: int8, global: kivi4 }").unwrap();
    assert_eq!(m.name, "model");
    assert!(m.kinds().is_none(), "no layer count: the caller's kinds");
    use LayerKind::*;
    let s = m.schemes_for(&[Sliding, Global, Global, Sliding]).unwrap();
    let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["kivi2", "kivi4", "int8", "kivi2"]);
    // Without a kind entry the default applies.
    let m = parse_model("model { default: f16, global: kivi4 }").unwrap();
    assert_eq!(m.schemes_for(&[Sliding]).unwrap()[0].name, "f16");
    // No window: every layer of a counted model is global.
    let m = parse_model("model { layers: 2, default: kivi2 }").unwrap();
    assert_eq!(m.kinds().unwrap(), [Global, Global]);
}

#[test]
fn errors_point_at_the_offending_token() {
    let cases: &[(&str, &str, &str)] = &[
        ("model m { default: kivi9 }", "kivi9", "`kivi9` is not a preset (kivi2,"),
        (
            "model m { defualt: kivi2 }",
            "defualt",
            "unknown entry `defualt`; expected one of default,",
        ),
        (
            "model m { default: kivi2, default: kivi4 }",
            "default: kivi4",
            "duplicate entry `default`",
        ),
        (
            "model m { layers[1]: kivi2, layers[3, 1]: kivi4 }",
            "1]: kivi4",
            "layer 1 is named twice",
        ),
        (
            "model m { layers: 4, default: kivi2, layers[7]: kivi4 }",
            "7]",
            "layer 7 does not exist: the model has 4 layers (0 to 3)",
        ),
        (
            "model m { layers: 4, global_layers: [1, 9], default: kivi2 }",
            "9]",
            "layer 9 does not exist",
        ),
        (
            "model m { layers: 4, global_layers: [1, 1], default: kivi2 }",
            "1]",
            "layer 1 is listed twice",
        ),
        (
            "model m { global_layers: [1], default: kivi2 }",
            "1]",
            "needs the layer count",
        ),
        ("model m { layers: 0, default: kivi2 }", "0", "at least one layer"),
        (
            "model m { window: 0, default: kivi2 }",
            "0,",
            "window 0 is out of range",
        ),
        ("model m { layers: 4u8, default: kivi2 }", "4u8", "takes a plain number"),
        (
            "model m { layers: 4 default: kivi2 }",
            "default",
            "expected `,` between entries",
        ),
        ("model m { }", "m {", "names no scheme; add `default: <scheme>`"),
        (
            "scheme m { default: kivi2 }",
            "scheme",
            "expected `model`, found `scheme`",
        ),
        // Inline schemes are checked by the scheme grammar, at their own tokens.
        (
            "model m {\n  default: x { key: full, value: quant(bits = 5, axis = token, group = 32) } }",
            "5,",
            "bits",
        ),
    ];
    for (text, needle, want) in cases {
        let e = err(text);
        assert!(
            e.message.contains(want),
            "{text}: {:?} should mention {want:?}",
            e.message
        );
        assert_eq!((e.line, e.column), at(text, needle), "{text}: {}", e.message);
    }
    // A layer with no scheme, found when the kinds are known.
    let m = parse_model("model m { global: kivi4 }").unwrap();
    let e = m.schemes_for(&[LayerKind::Global, LayerKind::Sliding]).unwrap_err();
    assert!(e.message.contains("layer 1 (sliding) has no scheme"), "{}", e.message);
    // A declared layer count that is not the model's, an index past it.
    let m = parse_model("model m { layers: 3, default: kivi2 }").unwrap();
    assert!(m
        .schemes_for(&[LayerKind::Global; 4])
        .unwrap_err()
        .message
        .contains("declares 3 layers"));
    let m = parse_model("model m { default: kivi2, layers[6]: kivi4 }").unwrap();
    let e = m.schemes_for(&[LayerKind::Global; 4]).unwrap_err();
    assert!(e.message.contains("layer 6 does not exist"), "{}", e.message);
    assert_eq!((e.line, e.column), (1, 34));
    assert!(err("model m { default: kivi2")
        .message
        .contains("not valid model syntax"));
}

/// The README's model declaration parses and means what it says.
#[test]
fn readme_declaration_parses() {
    let readme = include_str!("../../../README.md");
    let at = readme.find("### A scheme per layer").unwrap();
    let block = &readme[at..];
    let start = block.find("```text\n").unwrap() + "```text\n".len();
    let text = &block[start..start + block[start..].find("```").unwrap()];
    let m = parse_model(text).unwrap();
    let s = m.schemes_for(&m.kinds().unwrap()).unwrap();
    let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(&names[..6], ["k3", "k3", "kivi2", "kivi2", "kivi2", "kivi4"]);
}
