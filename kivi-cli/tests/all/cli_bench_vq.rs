//! `kivi bench --calibration FILE --layer N`: a vq scheme is timed with its
//! codebooks (after the bench's own check against the oracle); without a
//! calibration the bench fits codebooks on its own K/V and times those; a
//! layer the file does not have is a clear error.

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
fn bench_times_a_vq_scheme_with_its_calibration() {
    use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
    let d = std::env::temp_dir().join(format!("kivi-cli-bench-vq-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let scheme = d.join("vq.kivi");
    let text = "vqb { key: vq(dim = 8, entries = 16), value: vq(dim = 8, entries = 16), residual: 16, sinks: 2 }";
    std::fs::write(&scheme, text).unwrap();
    // The bench's mqa layout: 4 query heads, 1 KV head, head_dim 256.
    let s = kivi_spec::parse_scheme(text).unwrap();
    let mut rng = kivi_runtime::rand::Rng::new(3);
    let x = LayerSamples::new(0, 64, 4, 1, 256, rng.vec(64 * 256), rng.vec(64 * 256));
    let model = ModelId {
        name: "toy".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 256,
    };
    let mut cal = Calibration::new(model, "cli test draws");
    cal.fit_vq(&s, &[x], Default::default()).unwrap();
    let path = d.join("cal.kivical");
    cal.save(&path).unwrap();
    let (sch, calp) = (scheme.to_str().unwrap(), path.to_str().unwrap());
    let base = [
        "bench",
        "--layouts",
        "mqa",
        "--contexts",
        "300",
        "--batches",
        "1",
        "--reps",
        "1",
        "--no-peers",
        "--no-prefill",
        "--schemes",
    ];
    let list = format!("f16,kivi2,{sch}");
    let mut args: Vec<&str> = base.to_vec();
    args.extend([list.as_str(), "--calibration", calp]);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert!(out.contains("vq.kivi"), "{out}");
    // Without the calibration: codebooks fitted on the bench's own K/V,
    // checked against the oracle and timed all the same.
    let mut args: Vec<&str> = base.to_vec();
    args.push(sch);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert!(out.contains("vq.kivi"), "{out}");
    // A layer the calibration does not have.
    let mut args: Vec<&str> = base.to_vec();
    args.extend([sch, "--calibration", calp, "--layer", "3"]);
    let (ok, _, err) = kivi(&args);
    assert!(!ok && err.contains("layer 3"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
