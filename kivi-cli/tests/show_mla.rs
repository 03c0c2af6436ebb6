//! `kivi show` on MLA schemes (`heads: mla(...)`): exact bytes per token of
//! the latent and RoPE parts against the f16 and FP8 references, and a
//! filled paged cache; other commands refuse mla schemes on one line.

use std::process::{Command, Output};

fn kivi(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kivi"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run kivi")
}

const DS2: &str = "DsLite2 { key: quant(bits = 2, axis = channel, group = 32), residual: 64, heads: mla(q = 16, latent = 512, rope_dim = 64), softmax_scale: 0.07216878 }";

#[test]
fn show_reports_mla_bytes_per_token_and_the_paged_cache() {
    let o = kivi(&["show", "--scheme", DS2, "--context", "1000"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("heads: mla(q = 16, latent = 512, rope_dim = 64, rope = full)"),
        "{out}"
    );
    assert!(
        out.contains("latent       192 = codes 128 + scales 32 + zeros 32"),
        "{out}"
    );
    assert!(
        out.contains("rope         128 = codes 128 + scales 0 + zeros 0"),
        "{out}"
    );
    assert!(
        out.contains("f16 latent + rope: 1152, 3.60x; DeepSeek FP8 layout: 656, 2.05x"),
        "{out}"
    );
    let o = kivi(&["show", "--scheme", DS2, "--context", "1000", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["bytes_per_token"]["per_token"], 320.0);
    assert_eq!(v["bytes_per_token"]["deepseek_fp8"], 656);
    // 1000 tokens, R = 64, channel groups of 32: 928 latent tokens stored,
    // 72 in the window; all 1000 RoPE rows stored exact.
    let pc = &v["paged_cache"];
    assert_eq!(pc["latent"], 928 * 192 + 72 * 1024);
    assert_eq!(pc["rope"], 1000 * 128);
    assert_eq!(pc["blocks_in_use"], 16);
    assert_eq!(pc["total"], 16 * 64 * 320 + 72 * 1024 + 16 * 4);
}

#[test]
fn commands_without_an_mla_path_refuse_it_on_one_line() {
    let o = kivi(&["codegen", "--scheme", DS2, "--kernel", "decode"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("mla"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
