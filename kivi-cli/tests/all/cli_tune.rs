//! `kivi tune` / `kivi inspect` end to end on the CPU backend, tiny shapes.

use std::process::Command;

fn kivi(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kivi")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn dir(tag: &str) -> String {
    let d = std::env::temp_dir().join(format!("kivi-cli-tune-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.display().to_string()
}

const SMALL: &[&str] = &[
    "--heads",
    "gqa:8:2",
    "--head-dim",
    "64",
    "--contexts",
    "300",
    "--batches",
    "1,2",
    "--budget",
    "2",
];

#[test]
fn tune_then_hit_then_recover_from_a_truncated_file() {
    let d = dir("hit");
    let mut args = vec!["tune", "--scheme", "kivi2", "--backend", "cpu", "--cache-dir", &d];
    args.extend_from_slice(SMALL);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("bucket b1.c512.g4") && out.contains("bucket b2.c512.g4"),
        "{out}"
    );
    assert!(out.contains("tuned in"), "{out}");
    assert!(out.contains("(default)"), "{out}");

    // A hit measures nothing: no bucket is tuned again (checked by what it
    // says, not by a wall-clock bound, which a loaded CI machine would break).
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert_eq!(out.matches("cached (nothing measured)").count(), 2, "{out}");
    assert!(!out.contains("tuned in"), "{out}");

    let file = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .unwrap();
    let text = std::fs::read(&file).unwrap();
    std::fs::write(&file, &text[..text.len() / 3]).unwrap();
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert!(err.contains("warning") && err.contains("corrupt"), "{err}");
    assert_eq!(out.matches("tuned in").count(), 2, "{out}");

    let (ok, out, err) = kivi(&["inspect", "--cache-dir", &d, "--all"]);
    assert!(ok, "{err}");
    assert!(out.contains("this machine, in use"), "{out}");
    assert!(out.contains("ignored: corrupt"), "{out}");
    assert!(out.contains("pruned"), "{out}");

    // Export, import elsewhere, hit there.
    let bundle = format!("{d}/bundle.json");
    let (ok, _, err) = kivi(&["inspect", "--cache-dir", &d, "--export", &bundle]);
    assert!(ok, "{err}");
    let d2 = dir("imported");
    let (ok, out, err) = kivi(&["tune", "--scheme", "kivi2", "--cache-dir", &d2, "--import", &bundle]);
    assert!(ok, "{err}");
    assert!(out.contains("imported 2 decisions"), "{out}");
    let mut args2 = vec!["tune", "--scheme", "kivi2", "--backend", "cpu", "--cache-dir", &d2];
    args2.extend_from_slice(SMALL);
    let (ok, out, _) = kivi(&args2);
    assert!(ok);
    assert_eq!(out.matches("cached (nothing measured)").count(), 2, "{out}");
}

#[test]
fn json_plot_pin_and_bad_flags() {
    let d = dir("json");
    let plot = format!("{d}/t.svg");
    let mut args = vec![
        "tune",
        "--scheme",
        "kivi2",
        "--backend",
        "cpu",
        "--cache-dir",
        &d,
        "--json",
        "--plot",
        &plot,
    ];
    args.extend_from_slice(SMALL);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["buckets"].as_array().unwrap().len(), 2);
    assert!(v["buckets"][0]["entry"]["chosen"].is_string());
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"));

    let mut args = vec![
        "tune",
        "--scheme",
        "kivi2",
        "--backend",
        "cpu",
        "--cache-dir",
        &d,
        "--pin",
        "cpu/s1.t64.th0",
    ];
    args.extend_from_slice(SMALL);
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}");
    assert_eq!(out.matches("): pinned").count(), 2, "{out}");

    for bad in [
        vec!["tune", "--scheme", "nope"],
        vec!["tune", "--scheme", "kivi2", "--heads", "gqa:8:3"],
        vec!["tune", "--scheme", "kivi2", "--contexts", "0"],
        vec!["tune", "--scheme", "kivi2", "--backend", "tpu"],
        vec!["tune", "--scheme", "kivi2", "--budget=-1"],
        vec![
            "tune",
            "--scheme",
            "kivi2",
            "--cache-dir",
            &d,
            "--pin",
            "cpu/nope",
            "--contexts",
            "300",
            "--heads",
            "mha:2",
            "--head-dim",
            "64",
        ],
    ] {
        let (ok, _, err) = kivi(&bad);
        assert!(!ok, "{bad:?}");
        assert!(!err.contains("panicked"), "{bad:?}: {err}");
        assert!(err.lines().count() <= 2, "{bad:?}: {err}");
    }
}

/// The one scheme rule (`kivi_spec::load_scheme`): `kivi show --scheme kivi2` and
/// `kivi tune --scheme kivi2` load the same scheme — the preset — even when
/// a file named `kivi2` sits in the working directory; `./kivi2` loads the
/// file in both. (Before, `show` tried the file first and `tune` the preset.)
#[test]
fn show_and_tune_load_the_same_scheme_when_a_file_shadows_a_preset() {
    let d = dir("shadow");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(
        format!("{d}/kivi2"),
        "fromfile { key: quant(bits = 8, axis = token, group = 32), value: full }",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kivi"))
            .args(args)
            .current_dir(&d)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "kivi {args:?}: {err}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (json, err)
    };
    let shape = ["--heads", "gqa:8:2", "--head-dim", "64"];
    let cache = format!("{d}/cache");
    for (name, want) in [("kivi2", "kivi2"), ("./kivi2", "fromfile")] {
        let mut show = vec!["show", "--scheme", name, "--json"];
        show.extend_from_slice(&shape);
        let (s, show_err) = run(&show);
        let mut tune = vec![
            "tune",
            "--scheme",
            name,
            "--backend",
            "cpu",
            "--json",
            "--quiet",
            "--cache-dir",
            &cache,
        ];
        tune.extend_from_slice(&shape);
        tune.extend_from_slice(&["--contexts", "300", "--batches", "1", "--budget", "1"]);
        let (t, tune_err) = run(&tune);
        assert_eq!(s["name"], want, "show {name}: {s}");
        let tuned = &t.as_array().map_or(&t, |a| &a[0]);
        assert_eq!(tuned["scheme"], want, "tune {name}: {t}");
        assert_eq!(
            s["hash"], tuned["scheme_hash"],
            "show and tune hashed different schemes for {name}"
        );
        // The shadowed file is mentioned, never silently ignored.
        let noted = name == "kivi2";
        for err in [&show_err, &tune_err] {
            assert_eq!(
                err.contains("the file `kivi2` was not read (write `./kivi2` to load it)"),
                noted,
                "{err}"
            );
        }
    }
}

/// `kivi tune --backend sim` tunes the generated CUDA variants on the
/// simulated device (every candidate checked against the reference), its
/// decisions export as a bundle (`kivi inspect --export --backend sim`)
/// and import into another cache, where `inspect` shows them.
#[test]
fn tune_on_the_simulated_device_and_round_trip_its_bundle() {
    let d = dir("sim");
    let args = vec![
        "tune",
        "--scheme",
        "kivi2",
        "--backend",
        "sim",
        "--cache-dir",
        &d,
        "--heads",
        "gqa:4:2",
        "--head-dim",
        "32",
        "--contexts",
        "100",
        "--batches",
        "1",
        "--budget",
        "30",
    ];
    let (ok, out, err) = kivi(&args);
    assert!(ok, "{err}\n{out}");
    assert!(out.contains("backend sim"), "{out}");
    assert!(out.contains("chosen "), "{out}");
    assert!(
        out.contains("static ranking") && out.contains("simulated device"),
        "{out}"
    );
    let bundle = format!("{d}/bundle.json");
    let (ok, out, err) = kivi(&["inspect", "--cache-dir", &d, "--export", &bundle, "--backend", "sim"]);
    assert!(ok, "{err}");
    assert!(out.contains("exported 1 decisions"), "{out}");
    let other = dir("sim-import");
    let (ok, out, err) = kivi(&["tune", "--scheme", "kivi2", "--import", &bundle, "--cache-dir", &other]);
    assert!(ok, "{err}");
    assert!(out.contains("imported 1 decisions"), "{out}");
    let (ok, out, err) = kivi(&["inspect", "--cache-dir", &other, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let files = v.as_array().unwrap();
    assert_eq!(files.len(), 1, "{out}");
    assert_eq!(files[0]["file"]["device"]["backend"], "sim", "{out}");
    // The imported decision is a hit: nothing is measured again.
    let (ok, out, err) = kivi(&[&args[..5], &["--cache-dir", &other], &args[7..]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("cached (nothing measured)"), "{out}");
}

/// Asked for CUDA by name on a machine without a GPU, `kivi tune` fails and
/// says why; it never tunes the cpu instead.
#[test]
fn tune_on_cuda_without_a_gpu_fails() {
    if kivi_runtime::cuda::CudaDevice::new(0).is_ok() {
        println!("a GPU is present; nothing to check");
        return;
    }
    let d = dir("nogpu");
    let mut args = vec!["tune", "--scheme", "kivi2", "--backend", "cuda", "--cache-dir", &d];
    args.extend_from_slice(SMALL);
    let (ok, out, err) = kivi(&args);
    assert!(!ok, "{out}");
    assert!(err.contains("--backend cuda") && err.contains("unavailable"), "{err}");
    assert!(!out.contains("chosen"), "{out}");
    assert!(
        std::fs::read_dir(&d).map_or(true, |mut r| r.next().is_none()),
        "nothing written"
    );
}

/// `--calibration`: a `nuq` scheme tunes on the CPU only with its
/// codebooks; a missing or damaged file, a scheme that needs none and a
/// layer the file lacks are clear errors; two calibrations make two
/// decisions (the key joins both hashes).
#[test]
fn nuq_schemes_tune_with_their_calibration() {
    use kivi_runtime::calib::{Calibration, FitOptions, LayerSamples, ModelId};
    use kivi_runtime::rand::Rng;
    let text = "nuq_cli { key: quant(bits = 2, axis = channel, group = 32), \
                value: quant(bits = 2, axis = token, group = 32, levels = nuq), residual: 32, \
                heads: gqa(q = 8, kv = 2), head_dim = 64 }"
        .replace("head_dim = 64", "head_dim: 64");
    let scheme = kivi_spec::parse_scheme(&text).unwrap();
    let d = dir("calib");
    std::fs::create_dir_all(&d).unwrap();
    let files: Vec<String> = [11u64, 12]
        .iter()
        .map(|&seed| {
            let mut rng = Rng::new(seed);
            let n = 96;
            let draw = |rng: &mut Rng| (0..n * 2 * 64).map(|_| rng.normal()).collect::<Vec<f32>>();
            let (k, v) = (draw(&mut rng), draw(&mut rng));
            let samples = vec![LayerSamples::new(0, n, 8, 2, 64, k, v)];
            let model = ModelId {
                name: "toy".into(),
                layers: 1,
                kv_heads: 2,
                head_dim: 64,
            };
            let mut c = Calibration::new(model, "cli test draws");
            c.fit_codebooks(&scheme, &samples, FitOptions::default()).unwrap();
            let path = format!("{d}/cal{seed}.kivical");
            c.save(std::path::Path::new(&path)).unwrap();
            path
        })
        .collect();
    let small = ["--contexts", "300", "--batches", "1", "--budget", "1", "--quiet"];
    let run = |extra: &[&str]| {
        let mut a = vec!["tune", "--scheme", &text, "--backend", "cpu", "--cache-dir", &d];
        a.extend_from_slice(&small);
        a.extend_from_slice(extra);
        kivi(&a)
    };
    let (ok, _, err) = run(&[]);
    assert!(!ok && err.contains("calibration"), "{err}");
    let (ok, _, err) = run(&["--calibration", &format!("{d}/missing.kivical")]);
    assert!(!ok && err.contains("missing.kivical"), "{err}");
    let damaged = format!("{d}/damaged.kivical");
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(&damaged, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, _, err) = run(&["--calibration", &damaged]);
    assert!(!ok && err.contains("damaged.kivical"), "{err}");
    let (ok, _, err) = run(&["--calibration", &files[0], "--layer", "3"]);
    assert!(!ok && err.contains("layer 3"), "{err}");
    let (ok, _, err) = kivi(&[
        "tune",
        "--scheme",
        "kivi2",
        "--backend",
        "cpu",
        "--cache-dir",
        &d,
        "--calibration",
        &files[0],
    ]);
    assert!(!ok && err.contains("no levels = nuq"), "{err}");
    // The simulated CUDA target too: its variants are generated with the
    // file's tables baked in, each checked against the reference.
    let mut sim = vec!["tune", "--scheme", &text, "--backend", "sim", "--cache-dir", &d];
    sim.extend_from_slice(&small);
    sim.extend_from_slice(&["--calibration", &files[0]]);
    let (ok, out, err) = kivi(&sim);
    assert!(ok, "{err}");
    assert!(out.contains("bucket b1.c512") && out.contains("tuned in"), "{out}");
    // Each calibration is its own decision: the second file is measured,
    // not served the first one's; the first one is then a cache hit.
    for f in &files {
        let (ok, out, err) = run(&["--calibration", f]);
        assert!(ok, "{err}");
        assert!(out.contains("bucket b1.c512") && out.contains("tuned in"), "{out}");
    }
    let (ok, out, err) = run(&["--calibration", &files[0]]);
    assert!(ok, "{err}");
    assert!(out.contains("cached (nothing measured)"), "{out}");
}

/// `--calibration` with a `vq(...)` scheme: needed (a clear error
/// without it), and taken by the simulated CUDA target as well as the CPU
/// one (its codebooks are kernel arguments); a layer the file lacks is
/// refused before tuning.
#[test]
fn vq_schemes_tune_on_the_simulated_device_with_their_calibration() {
    use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
    use kivi_runtime::rand::Rng;
    use kivi_runtime::vq::VqFitOptions;
    if kivi_runtime::sim::find_compiler().is_err() {
        println!("SKIP vq tune on sim: no C++ compiler for the simulator");
        return;
    }
    let text = "vq_cli { key: vq(dim = 4, entries = 16), value: vq(dim = 4, entries = 16), residual: 8, \
                heads: gqa(q = 4, kv = 2), head_dim: 32 }";
    let scheme = kivi_spec::parse_scheme(text).unwrap();
    let d = dir("vqcalib");
    std::fs::create_dir_all(&d).unwrap();
    let mut rng = Rng::new(5);
    let n = 96;
    let draw = |rng: &mut Rng| (0..n * 2 * 32).map(|_| rng.normal()).collect::<Vec<f32>>();
    let (k, v) = (draw(&mut rng), draw(&mut rng));
    let model = ModelId {
        name: "toy".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 32,
    };
    let mut c = Calibration::new(model, "cli vq draws");
    let opts = VqFitOptions {
        iterations: 4,
        ..Default::default()
    };
    c.fit_vq(&scheme, &[LayerSamples::new(0, n, 4, 2, 32, k, v)], opts)
        .unwrap();
    let file = format!("{d}/vq.kivical");
    c.save(std::path::Path::new(&file)).unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["tune", "--scheme", text, "--backend", "sim", "--cache-dir", &d];
        a.extend_from_slice(&["--contexts", "100", "--batches", "1", "--budget", "20", "--quiet"]);
        a.extend_from_slice(extra);
        kivi(&a)
    };
    let (ok, _, err) = run(&[]);
    assert!(!ok && err.contains("vq(...)") && err.contains("--calibration"), "{err}");
    let (ok, _, err) = run(&["--calibration", &file, "--layer", "2"]);
    assert!(!ok && err.contains("layer 2"), "{err}");
    let (ok, out, err) = run(&["--calibration", &file]);
    assert!(ok, "{err}");
    assert!(out.contains("tuned in"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}
