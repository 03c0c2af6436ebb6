//! Low-rank schemes (`low_rank: pca(...)`) in `kivi show` and `kivi tune`:
//! show reports the coordinates' bytes and the bases (counted once), and
//! `show --model` takes low-rank global layers;
//! tune measures the coordinate scheme's variants and keys the decision by
//! the low-rank scheme joined with the calibration of its bases; without a
//! calibration, or with a layer it lacks, both tune and attend refuse.

use kivi_runtime::calib::{identity, Calibration, LayerSamples, ModelId};
use std::process::Command;

fn kivi(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kivi")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const TEXT: &str =
    "lr { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 16), \
                    residual: 32, low_rank: pca(rank = 32, apply = [key, value]) }";

#[test]
fn show_reports_coordinates_and_bases() {
    let (ok, out, err) = kivi(&[
        "show",
        "--scheme",
        TEXT,
        "--heads",
        "gqa:4:2",
        "--head-dim",
        "64",
        "--context",
        "300",
        "--json",
    ]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["low_rank"]["rank"], 32);
    // 2 tensors x 2 KV heads x 32 x 64 in f16, once.
    assert_eq!(j["low_rank"]["bases_bytes"], 2 * 2 * 32 * 64 * 2);
    let mem = &j["paged_cache"]["memory"];
    assert_eq!(mem["bases"], 2 * 2 * 32 * 64 * 2);
    let parts: u64 = [
        "codes",
        "scales",
        "zeros",
        "outliers",
        "means",
        "codebooks",
        "bases",
        "windows",
        "tables",
    ]
    .iter()
    .map(|k| mem[k].as_u64().unwrap())
    .sum();
    assert_eq!(mem["total"].as_u64().unwrap(), parts);
    // Per token: 32 coordinates at 2 bits + channel/token group parameters,
    // the bytes of the coordinate scheme (kivi2-like at head_dim 32).
    let coords = kivi_spec::parse_scheme(TEXT)
        .unwrap()
        .with_shape(kivi_spec::Heads::Gqa { q: 4, kv: 2 }, 64)
        .unwrap()
        .coordinate_scheme()
        .unwrap();
    let (bytes, per) = kivi_spec::layout::bytes_per_token_per_head(&coords);
    assert_eq!(j["bytes_per_token_per_head"]["bytes"], bytes);
    assert_eq!(j["bytes_per_token_per_head"]["tokens"], per);
    // The text report says the same.
    let (ok, out, err) = kivi(&["show", "--scheme", TEXT, "--heads", "gqa:4:2", "--head-dim", "64"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("low_rank  32 coordinates") && out.contains("+ bases 16384"),
        "{out}"
    );
}

/// `kivi show --model` with low-rank layers: each global low-rank layer is
/// a low-rank cache on the model's block pool (its coordinate blocks in
/// the pool, its bases and exact rows outside it) with the same bytes as
/// `kivi show --scheme` reports for it alone; a low-rank scheme on a
/// sliding layer is refused by name (a low-rank cache does not evict).
#[test]
fn show_model_with_low_rank_layers() {
    let lr = TEXT.replace(
        "low_rank: pca(rank = 32, apply = [key, value])",
        "low_rank: pca(rank = 32, apply = [key, value], residual = 4)",
    );
    let model = format!("model m {{ layers: 4, window: 64, global_layers: [1, 3], default: kivi2, global: {lr} }}");
    let shape = ["--heads", "gqa:4:2", "--head-dim", "64", "--context", "300", "--json"];
    let mut args = vec!["show", "--model", model.as_str()];
    args.extend(shape);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let layers = j["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    assert_eq!(layers[1]["scheme"], "lr");
    assert_eq!(layers[0]["scheme"], "kivi2");
    let mut args = vec!["show", "--scheme", lr.as_str()];
    args.extend(shape);
    let (ok, one, err) = kivi(&args);
    assert!(ok, "{err}");
    let one: serde_json::Value = serde_json::from_str(&one).unwrap();
    let alone = &one["paged_cache"]["memory"];
    for l in [1, 3] {
        let m = &layers[l]["memory"];
        assert_eq!(m, alone, "layer {l}");
        // The bases, and 4 exact rows per KV head and tensor (64 values in
        // f16 and a position each), counted with the layer.
        assert_eq!(m["bases"], 2 * 2 * 32 * 64 * 2);
        assert_eq!(m["outliers"], 4 * 2 * 2 * (64 * 2 + 4));
        assert_eq!(layers[l]["without_eviction"], m["total"]);
    }
    let total: u64 = layers.iter().map(|l| l["memory"]["total"].as_u64().unwrap()).sum();
    assert_eq!(j["total"].as_u64().unwrap(), total);
    // The pool holds the coordinate blocks; the bases and exact rows are outside it.
    let outside = j["pool"]["outside_pool"].as_u64().unwrap();
    assert!(
        outside >= 2 * (2 * 2 * 32 * 64 * 2 + 4 * 2 * 2 * (64 * 2 + 4)),
        "{outside}"
    );
    // The text report names the layers too.
    let (ok, text, err) = kivi(&args_text(&model));
    assert!(ok, "{err}");
    assert!(
        text.contains(" lr ") && text.contains("low-rank layers' bases"),
        "{text}"
    );
    // A low-rank scheme on sliding layers: refused, naming the layer.
    let sliding = format!("model m {{ layers: 4, window: 64, global_layers: [1, 3], default: {lr}, global: kivi2 }}");
    let (ok, _, err) = kivi(&args_text(&sliding));
    assert!(
        !ok && err.contains("layer 0") && err.contains("does not evict"),
        "{err}"
    );
}

fn args_text(model: &str) -> Vec<&str> {
    vec![
        "show",
        "--model",
        model,
        "--heads",
        "gqa:4:2",
        "--head-dim",
        "64",
        "--context",
        "300",
    ]
}

#[test]
fn tune_keys_decisions_by_scheme_and_calibration() {
    let d = std::env::temp_dir().join(format!("kivi-cli-low-rank-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let mut rng = kivi_runtime::rand::Rng::new(5);
    let x = LayerSamples::new(0, 128, 4, 2, 64, rng.vec(128 * 128), rng.vec(128 * 128));
    let model = ModelId {
        name: "toy".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
    };
    let mut cal = Calibration::new(model, "cli test draws");
    cal.fit_bases(&[x]).unwrap();
    let path = d.join("cal.kivical");
    cal.save(&path).unwrap();
    let cache = d.join("decisions");
    let (calp, cachep) = (path.to_str().unwrap(), cache.to_str().unwrap());
    let base = [
        "tune",
        "--scheme",
        TEXT,
        "--heads",
        "gqa:4:2",
        "--head-dim",
        "64",
        "--backend",
        "cpu",
        "--contexts",
        "200",
        "--batches",
        "1",
        "--budget",
        "1",
        "--quiet",
        "--json",
        "--cache-dir",
        cachep,
    ];
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--calibration", calp, "--layer", "0"]);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let bound = kivi_spec::parse_scheme(TEXT)
        .unwrap()
        .with_shape(kivi_spec::Heads::Gqa { q: 4, kv: 2 }, 64)
        .unwrap();
    let key = format!("{:016x}", identity(kivi_spec::scheme_hash(&bound), Some(cal.hash())));
    let entry = &j["buckets"][0]["entry"];
    assert_eq!(entry["scheme_hash"], key.as_str(), "{out}");
    assert_ne!(key, format!("{:016x}", kivi_spec::scheme_hash(&bound)));
    assert!(entry["chosen"].as_str().is_some_and(|c| !c.is_empty()), "{out}");
    // Without a calibration, or with a layer it lacks: refused, named.
    let (ok, _, err) = kivi(&base);
    assert!(
        !ok && err.contains("low_rank") && err.contains("--calibration"),
        "{err}"
    );
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--calibration", calp, "--layer", "3"]);
    let (ok, _, err) = kivi(&args);
    assert!(!ok && err.contains("layer 3"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// The CI sample of low-rank tuning on the simulated device: a small shape
/// (MHA 1, D 32, R 16: few decode variants) keeps the simulator's compile
/// short; the decision is keyed by scheme and calibration, as on the CPU.
#[test]
fn tune_on_the_simulated_device() {
    if kivi_runtime::sim::find_compiler().is_err() {
        eprintln!("skipped: no C++ compiler for the simulator");
        return;
    }
    let d = std::env::temp_dir().join(format!("kivi-cli-low-rank-sim-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let mut rng = kivi_runtime::rand::Rng::new(6);
    let x = LayerSamples::new(0, 96, 1, 1, 32, rng.vec(96 * 32), rng.vec(96 * 32));
    let model = ModelId {
        name: "toy".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 32,
    };
    let mut cal = Calibration::new(model, "cli test draws");
    cal.fit_bases(&[x]).unwrap();
    let path = d.join("cal.kivical");
    cal.save(&path).unwrap();
    let text =
        "lrs { key: quant(bits = 2, axis = channel, group = 16), value: quant(bits = 4, axis = token, group = 8), \
                residual: 16, low_rank: pca(rank = 16, apply = [key, value]) }";
    let cache = d.join("decisions");
    let (ok, out, err) = kivi(&[
        "tune",
        "--scheme",
        text,
        "--heads",
        "mha:1",
        "--head-dim",
        "32",
        "--backend",
        "sim",
        "--contexts",
        "100",
        "--batches",
        "1",
        "--budget",
        "2",
        "--quiet",
        "--json",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--calibration",
        path.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["backend"], "sim");
    let bound = kivi_spec::parse_scheme(text)
        .unwrap()
        .with_shape(kivi_spec::Heads::Mha(1), 32)
        .unwrap();
    let key = format!("{:016x}", identity(kivi_spec::scheme_hash(&bound), Some(cal.hash())));
    let entry = &j["buckets"][0]["entry"];
    assert_eq!(entry["scheme_hash"], key.as_str(), "{out}");
    // The candidates are the coordinate scheme's decode variants (head_dim 16).
    let coords = bound.coordinate_scheme().unwrap();
    let n = kivi_templates::variants(&coords, kivi_templates::Kernel::Decode).len();
    assert_eq!(entry["candidates"].as_array().unwrap().len(), n, "{out}");
    let _ = std::fs::remove_dir_all(&d);
}
