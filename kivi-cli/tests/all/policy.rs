//! `kivi policy` end to end without the model: the search runs on a saved
//! (here synthetic) sensitivity file, the declaration it writes is read by
//! `kivi show --model` and parses back to the schemes the search chose, and
//! bad input (an impossible budget, unknown candidates or budget schemes, a
//! damaged file, an unreadable `kivi eval --models` file) is one line and a
//! non-zero exit before any model loads.
#![cfg(feature = "eval")]

use kivi_eval::policy::{self, Budget, ModelLayout, Sensitivity};
use std::process::{Command, Output};

fn kivi(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kivi"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run kivi")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn fails(args: &[&str], want: &str) {
    let o = kivi(args);
    let err = text(&o.stderr);
    assert!(!o.status.success(), "{args:?} should fail; stdout {}", text(&o.stdout));
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains(want), "{args:?}: expected `{want}` in: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
}

/// Damage falls with bits; the global layers suffer 10x, layer 0 5x.
fn synthetic() -> Sensitivity {
    let layout = ModelLayout::gemma3_270m();
    let grid = policy::kivi_grid(&[1, 2, 3, 4], 128, 0).unwrap();
    let damage = (0..layout.layers)
        .map(|l| {
            let w = if layout.global_layers.contains(&l) {
                10.0
            } else if l == 0 {
                5.0
            } else {
                1.0
            };
            grid.iter()
                .map(|s| {
                    let b = |t| s.codec(t).quant().map_or(16, |q| q.bits) as f64;
                    w * (0.5f64.powf(b(kivi_spec::Tensor::Key)) + 0.3 * 0.5f64.powf(b(kivi_spec::Tensor::Value)))
                })
                .collect()
        })
        .collect();
    Sensitivity {
        model_file: "synthetic.gguf".into(),
        layout,
        text: "synthetic".into(),
        prefix: 512,
        steps: 32,
        names: grid.iter().map(|s| s.name.clone()).collect(),
        schemes: grid.iter().map(kivi_spec::canonical).collect(),
        damage,
        seconds: 0.0,
    }
}

#[test]
fn policy_writes_a_declaration_that_show_reads_and_that_parses_back() {
    let dir = std::env::temp_dir().join(format!("kivi-policy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sens_path = dir.join("sens.json");
    let sens = synthetic();
    std::fs::write(&sens_path, serde_json::to_string(&sens).unwrap()).unwrap();
    let out = dir.join("found.kivi");
    let o = kivi(&[
        "policy",
        "--sensitivities",
        sens_path.to_str().unwrap(),
        "--budget",
        "kivi2",
        "--name",
        "found",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("| 5 | global |"), "{}", text(&o.stdout));
    let written = std::fs::read_to_string(&out).unwrap();
    // The file is the search's answer, read back.
    let want = policy::find(&sens, &Budget::Scheme("kivi2".into()), 768).unwrap();
    let decl = kivi_spec::parse_model(&written).unwrap();
    let back = policy::resolve_model(&decl, &sens.layout).unwrap();
    assert_eq!(back, want.schemes, "{written}");
    assert!(want.plan.cost <= want.budget);
    // It spends on the layers that hurt: the global layers get more than
    // kivi2's bits, and the model stays within kivi2's bytes.
    for l in &sens.layout.global_layers {
        assert_ne!(back[*l].name, "k2v2", "layer {l}: {written}");
    }
    assert!(policy::model_bytes(&back, &sens.layout, 768).unwrap() <= want.budget);
    // kivi show reads it as any model declaration.
    let o = kivi(&[
        "show",
        "--model",
        out.to_str().unwrap(),
        "--heads",
        "mqa:4",
        "--head-dim",
        "256",
        "--context",
        "32k",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("model found: 18 layers"),
        "{}",
        text(&o.stdout)
    );
    // A budget in bytes per token: the same search, priced per token.
    let per_token = format!("{}B", want.budget as f64 / 768.0);
    let o = kivi(&[
        "policy",
        "--sensitivities",
        sens_path.to_str().unwrap(),
        "--budget",
        &per_token,
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).starts_with("// Found by"), "{}", text(&o.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_one_line_before_the_model_loads() {
    let dir = std::env::temp_dir().join(format!("kivi-policy-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sens_path = dir.join("sens.json");
    std::fs::write(&sens_path, serde_json::to_string(&synthetic()).unwrap()).unwrap();
    let s = sens_path.to_str().unwrap();
    fails(
        &["policy", "--sensitivities", s, "--budget", "100B"],
        "below the cheapest assignment",
    );
    fails(&["policy", "--sensitivities", s, "--budget", "kivi9"], "--budget: ");
    fails(
        &["policy", "--sensitivities", s, "--budget", "0bits"],
        "not a positive number",
    );
    fails(&["policy", "--candidates", "kivi9"], "--candidates: ");
    // Low-rank schemes need bases from a calibration file: refused by name.
    let lr =
        "lr { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), \
              low_rank: pca(rank = 32, apply = [key, value]) }";
    let lr_file = dir.join("lr.kivi");
    std::fs::write(&lr_file, lr).unwrap();
    fails(
        &["policy", "--candidates-file", lr_file.to_str().unwrap()],
        "candidate `lr` has low_rank",
    );
    fails(
        &["policy", "--sensitivities", s, "--budget", lr],
        "--budget `lr` has low_rank",
    );
    fails(&["policy", "--bits", "9"], "candidate k9v9");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"damage\": 3}").unwrap();
    fails(
        &["policy", "--sensitivities", bad.to_str().unwrap()],
        "not a sensitivity file",
    );
    fails(
        &["policy", "--sensitivities", dir.join("none.json").to_str().unwrap()],
        "none.json",
    );
    fails(
        &["eval", "--models", dir.join("none.kivi").to_str().unwrap()],
        "cannot read model file",
    );
    fails(&["eval", "--models", "model m { default: kivi9 }"], "not a preset");
    let _ = std::fs::remove_dir_all(&dir);
}
