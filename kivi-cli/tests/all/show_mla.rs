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

fn npy_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    let unaligned = (10 + header.len() + 1) % 64;
    header.push_str(&" ".repeat((64 - unaligned) % 64));
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend(data.iter().flat_map(|x| x.to_le_bytes()));
    std::fs::write(path, b).unwrap();
}

/// `kivi attend` on an mla scheme: latent rows as --k, RoPE rows as --v,
/// the output against the oracle; a query of the wrong width is one line.
#[test]
fn attend_runs_mla_schemes() {
    use kivi_runtime::mla::reference;
    let dir = std::env::temp_dir().join(format!("kivi-attend-mla-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = kivi_runtime::rand::Rng::new(3);
    let (t, hq, l, r) = (45, 16, 512, 64);
    let c: Vec<f32> = (0..t * l)
        .map(|i| rng.normal() * if i % l == 7 { 30.0 } else { 1.0 })
        .collect();
    let k: Vec<f32> = (0..t * r).map(|_| rng.normal()).collect();
    let q: Vec<f32> = (0..hq * (l + r)).map(|_| rng.normal() * 0.2).collect();
    npy_f32(&dir.join("q.npy"), &[hq, l + r], &q);
    npy_f32(&dir.join("c.npy"), &[t, l], &c);
    npy_f32(&dir.join("k.npy"), &[t, r], &k);
    let out = dir.join("out.npy");
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let args = [
        "attend",
        "--scheme",
        DS2,
        "--q",
        &p("q.npy"),
        "--k",
        &p("c.npy"),
        "--v",
        &p("k.npy"),
        "--out",
        &p("out.npy"),
        "--json",
    ];
    let o = kivi(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let b = std::fs::read(&out).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let got: Vec<f32> = b[10 + hlen..]
        .chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect();
    let s = kivi_spec::parse_scheme(DS2).unwrap();
    let want = reference::attend(&s, &q, &c, &k, reference::attn_params(&s).unwrap()).unwrap();
    let den = want.iter().map(|x| x.abs()).fold(0f32, f32::max);
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / den;
    assert_eq!(got.len(), hq * l);
    assert!(err < 1e-5, "rel err {err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], t);
    // Queries one channel short: refused on one line, naming the shape.
    npy_f32(&dir.join("q.npy"), &[hq, l + r - 1], &q[..hq * (l + r - 1)]);
    let o = kivi(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("is not [16, 576]"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
