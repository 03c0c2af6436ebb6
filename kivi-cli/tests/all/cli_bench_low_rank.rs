//! `kivi bench` with low-rank schemes (`low_rank: pca(...)`): without a
//! calibration the bench fits bases on its own K/V; with `--calibration`
//! it uses that file's; either way each row is checked against the
//! reference before it is timed, and the JSON reports the whole low-rank
//! step (projection, coordinate decode, reconstruction; `residual = N`
//! merged in) next to kivi2. A layer the file lacks is a clear error.

use std::process::Command;

fn kivi(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kivi")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bench_times_low_rank_schemes() {
    use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
    let d = std::env::temp_dir().join(format!("kivi-cli-bench-lr-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let codecs = "key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 32, sinks: 2";
    let files: Vec<String> = [("lr0", 0), ("lr8", 8)]
        .iter()
        .map(|(name, n)| {
            let p = d.join(format!("{name}.kivi"));
            std::fs::write(
                &p,
                format!("{name} {{ {codecs}, low_rank: pca(rank = 64, apply = [key, value], residual = {n}) }}"),
            )
            .unwrap();
            p.display().to_string()
        })
        .collect();
    let list = format!("f16,kivi2,{},{}", files[0], files[1]);
    // The bench's mqa layout: 4 query heads, 1 KV head, head_dim 256.
    let base = [
        "bench",
        "--layouts",
        "mqa",
        "--contexts",
        "300",
        "--batches",
        "2",
        "--reps",
        "2",
        "--no-peers",
        "--no-prefill",
        "--json",
        "--schemes",
        list.as_str(),
    ];
    let (ok, out, err) = kivi(&base);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = j["decode"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{out}");
    let kivi2 = rows.iter().find(|r| r["scheme"] == "kivi2").unwrap();
    for f in &files {
        let r = rows.iter().find(|r| r["scheme"] == f.as_str()).unwrap();
        assert!(r["path"].as_str().unwrap().ends_with("+low_rank"), "{r}");
        assert!(r["median_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["checked_rel_error"].as_f64().unwrap() < 1e-4, "{r}");
        // Rank 64 of 256 at 2 bits reads about a quarter of kivi2's bytes
        // (plus the bases, 2 x 64 x 256 f16 values).
        let (b, k2) = (r["kv_bytes"].as_u64().unwrap(), kivi2["kv_bytes"].as_u64().unwrap());
        assert!(b < k2 / 2 && b > 2 * 64 * 256 * 2, "{b} vs kivi2 {k2}");
    }
    // With a calibration (bases of the mqa shape), and with a layer it lacks.
    let mut rng = kivi_runtime::rand::Rng::new(5);
    let x = LayerSamples::new(0, 400, 4, 1, 256, rng.vec(400 * 256), rng.vec(400 * 256));
    let model = ModelId {
        name: "toy".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 256,
    };
    let mut cal = Calibration::new(model, "cli test draws");
    cal.fit_bases(&[x]).unwrap();
    let path = d.join("cal.kivical");
    cal.save(&path).unwrap();
    let calp = path.to_str().unwrap();
    let mut args = base.to_vec();
    args[13] = files[1].as_str(); // --schemes: the residual one alone
    args.extend(["--calibration", calp]);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert!(out.contains("lr8.kivi"), "{out}");
    args.extend(["--layer", "3"]);
    let (ok, _, err) = kivi(&args);
    assert!(!ok && err.contains("layer 3"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
