//! The `kivi` binary end to end: `schemes`, `show`, `attend`, and every kind
//! of bad input, which must give a non-zero exit and exactly one line on
//! stderr naming the problem — never a panic or a backtrace.

use kivi_runtime::rand::Rng;
use kivi_runtime::{reference, AttnParams};
use kivi_spec::{presets, Heads, Tensor};
use std::path::PathBuf;
use std::process::{Command, Output};

fn kivi(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kivi"))
        .args(args)
        // A panic would print a backtrace with this set; the tests look for it.
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run kivi")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> String {
    let o = kivi(args);
    assert!(o.status.success(), "kivi {args:?} failed: {}", stderr(&o));
    stdout(&o)
}

/// Runs a command that must fail cleanly and returns its one error line.
fn fails(args: &[&str], want: &str) -> String {
    let o = kivi(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "kivi {args:?} should fail; stdout: {}", stdout(&o));
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "kivi {args:?} panicked: {err}"
    );
    assert_eq!(err.lines().count(), 1, "kivi {args:?}: expected one line, got: {err}");
    assert!(err.starts_with("kivi: error: "), "{err}");
    assert!(err.contains(want), "kivi {args:?}: {err:?} should mention {want:?}");
    err
}

/// A scratch directory per test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("kivi-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    fn path(&self, f: &str) -> String {
        self.0.join(f).to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `.npy` file with a given header dict and raw data (written by hand so
/// that the tests do not trust the code they test).
fn npy_raw(path: &str, dict: &str, data: &[u8]) {
    let mut header = dict.to_string();
    // Pad so that the data starts at a multiple of 64 bytes.
    let unaligned = (10 + header.len() + 1) % 64;
    header.push_str(&" ".repeat((64 - unaligned) % 64));
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

fn shape_text(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn npy_f32(path: &str, shape: &[usize], data: &[f32]) {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    npy_raw(
        path,
        &format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
            shape_text(shape)
        ),
        &bytes,
    );
}

/// Reads back a float32 `.npy` the CLI wrote: (shape, data).
fn npy_read(path: &str) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0, "data is 64-byte aligned");
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let dims = &header[header.find("'shape': (").unwrap() + 10..];
    let dims = &dims[..dims.find(')').unwrap()];
    let shape: Vec<usize> = dims
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let data: Vec<f32> = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(shape.iter().product::<usize>(), data.len());
    (shape, data)
}

fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
    rng.vec(n)
}

/// q [hq, d], k and v [t, hkv, d] written to the scratch dir.
fn problem(s: &Scratch, t: usize, hq: usize, hkv: usize, d: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(0x5eed + t as u64);
    let q = random(hq * d, &mut rng);
    let k = random(t * hkv * d, &mut rng);
    let v = random(t * hkv * d, &mut rng);
    npy_f32(&s.path("q.npy"), &[hq, d], &q);
    npy_f32(&s.path("k.npy"), &[t, hkv, d], &k);
    npy_f32(&s.path("v.npy"), &[t, hkv, d], &v);
    (q, k, v)
}

/// `kivi attend` with the four paths, plus `extra`; a flag in `extra`
/// replaces the default one (clap refuses a flag given twice).
fn attend_args<'a>(paths: &'a [String; 4], extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["attend"];
    for (flag, value) in ["--q", "--k", "--v", "--out"].into_iter().zip(paths) {
        if !extra.contains(&flag) {
            a.extend([flag, value.as_str()]);
        }
    }
    a.extend_from_slice(extra);
    a
}

fn paths(s: &Scratch) -> [String; 4] {
    [s.path("q.npy"), s.path("k.npy"), s.path("v.npy"), s.path("out.npy")]
}

#[test]
fn schemes_lists_every_preset_with_summary_and_hash() {
    let out = ok(&["schemes"]);
    for p in presets::listed() {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(p.name.as_str()))
            .unwrap();
        let hash = format!("{:016x}", kivi_spec::scheme_hash(&p));
        assert!(line.contains(&hash), "{line}");
        assert!(line.contains(&format!("residual: {}", p.residual)), "{line}");
    }
    let json: serde_json::Value = serde_json::from_str(&ok(&["schemes", "--json"])).unwrap();
    assert_eq!(json.as_array().unwrap().len(), presets::listed().len());
    // The canonical text parses back to the preset.
    for (p, j) in presets::listed().iter().zip(json.as_array().unwrap()) {
        assert_eq!(&kivi_spec::parse_scheme(j["canonical"].as_str().unwrap()).unwrap(), p);
    }
}

#[test]
fn show_reports_exact_bytes() {
    let out = ok(&["show", "--scheme", "kivi2", "--heads", "gqa:32:8", "--head-dim", "128"]);
    assert!(
        out.contains("key          48 = codes 32 + scales 8 + zeros 8 + outliers 0"),
        "{out}"
    );
    let codec = ok(&["show", "--scheme", "codec2", "--heads", "mqa:4", "--head-dim", "256"]);
    assert!(
        codec.contains("key         122 = codes 104 + scales 2 + zeros 0 + outliers 16"),
        "{codec}"
    );
    assert!(codec.contains("all-in 2.9375 bits per element"), "{codec}");
    assert!(out.contains("total        96"), "{out}");
    assert!(out.contains("heads: gqa(q = 32, kv = 8),"), "{out}");
    let j: serde_json::Value =
        serde_json::from_str(&ok(&["show", "--scheme", "kivi2", "--context", "1000", "--json"])).unwrap();
    let b = &j["bytes_per_token_per_head"];
    assert_eq!(b["per_token"], 96.0);
    assert_eq!(b["key"]["total"], 48.0);
    assert_eq!(b["value"]["codes"], 32.0);
    // f16 K+V at 1000 tokens, 8 KV heads of 128 channels
    assert_eq!(j["f16_bytes"], 1000 * 8 * 128 * 2 * 2);
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    let f = kivi_spec::layout::Footprint::for_tokens(&s, 1000);
    assert_eq!(j["footprint"]["total"], f.total());
    assert_eq!(j["hash"], format!("{:016x}", kivi_spec::scheme_hash(&s)));
    let m = &j["paged_cache"]["memory"];
    let sum: u64 = ["codes", "scales", "zeros", "windows", "tables"]
        .iter()
        .map(|k| m[k].as_u64().unwrap())
        .sum();
    assert_eq!(m["total"].as_u64().unwrap(), sum);
    assert!(m["total"].as_u64().unwrap() >= f.total() as u64);

    // Other head layouts and a 3-bit scheme from a file.
    let j: serde_json::Value = serde_json::from_str(&ok(&[
        "show",
        "--scheme",
        "f16",
        "--heads",
        "mqa:4",
        "--head-dim",
        "256",
        "--json",
    ]))
    .unwrap();
    assert_eq!(j["bytes_per_token_per_head"]["per_token"], 1024.0);
    assert_eq!(j["shape"]["kv_heads"], 1);
    let s = Scratch::new("show");
    let file = s.path("three.kivi");
    std::fs::write(
        &file,
        "three { key: quant(bits = 3, axis = channel, group = 32), value: full }",
    )
    .unwrap();
    let j: serde_json::Value =
        serde_json::from_str(&ok(&["show", "--scheme", &file, "--heads", "mha:2", "--json"])).unwrap();
    // Keys: 128 3-bit codes, 10 per word, 13 words = 52 bytes; one f16 scale
    // and zero per channel per 32 tokens = 16 bytes per token. Values: an
    // f16 row of 256 bytes.
    assert_eq!(j["bytes_per_token_per_head"]["per_token"], 52.0 + 16.0 + 256.0);
}

#[test]
fn show_rejects_bad_arguments() {
    fails(&["show", "--scheme", "kivi9"], "unknown scheme `kivi9`");
    fails(
        &["show", "--scheme", "kivi2", "--head-dim", "48"],
        "does not divide head_dim 48",
    );
    fails(
        &["show", "--scheme", "kivi2", "--heads", "gqa:30:8"],
        "30 query heads is not a multiple of 8 kv heads",
    );
    fails(
        &["show", "--scheme", "kivi2", "--context", "0"],
        "`0` is not a positive count",
    );
    fails(
        &["show", "--scheme", "kivi2", "--context", "2m"],
        "--context 2097152 is out of range",
    );
    // The scheme is a flag everywhere; a bare word says so.
    fails(&["show", "kivi2"], "name a scheme with --scheme NAME");
    fails(&["codegen", "kivi2"], "name a scheme with --scheme NAME");
    let s = Scratch::new("show-bad");
    let file = s.path("bad.kivi");
    std::fs::write(
        &file,
        "bad {\n  key: quant(bits = 2, axis = channel, group = 32),\n  value: full,\n  normalize: yes,\n}\n",
    )
    .unwrap();
    let e = fails(&["show", "--scheme", &file], "not supported yet");
    assert!(e.contains(&format!("{file}:4:3: field `normalize`")), "{e}");
}

#[test]
fn attend_matches_the_oracle_on_both_backends() {
    let s = Scratch::new("attend");
    let (t, hq, hkv, d) = (301, 8, 2, 64);
    let (q, k, v) = problem(&s, t, hq, hkv, d);
    let scheme = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let want = reference::attend(&scheme, &q, &k, &v, AttnParams::of(&scheme, scheme.shape().unwrap())).unwrap();
    let p = paths(&s);
    for backend in ["reference", "cpu"] {
        let dump = s.path(&format!("dq-{backend}"));
        let out = ok(&attend_args(
            &p,
            &[
                "--scheme",
                "kivi2",
                "--backend",
                backend,
                "--json",
                "--dump-dequant",
                &dump,
            ],
        ));
        let j: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(j["backend"], backend);
        assert_eq!(j["tokens"], t);
        assert_eq!(j["scheme"], "kivi2");
        assert_eq!(j["f16_bytes"], t * hkv * d * 4);
        assert!(j["bytes"]["total"].as_u64().unwrap() > 0 && j["time_ms"].as_f64().unwrap() >= 0.0);
        let (shape, got) = npy_read(&p[3]);
        assert_eq!(shape, vec![hq, d]);
        let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "{backend}: {err}");
        // The dump is the cache's view: exactly the oracle's.
        let (kshape, kdq) = npy_read(&format!("{dump}/k.npy"));
        assert_eq!(kshape, vec![t, hkv, d]);
        assert_eq!(kdq, reference::cache_view(&scheme, Tensor::Key, &k).unwrap());
        let (_, vdq) = npy_read(&format!("{dump}/v.npy"));
        assert_eq!(vdq, reference::cache_view(&scheme, Tensor::Value, &v).unwrap());
    }
    // --scale and --window override the scheme's parameters.
    ok(&attend_args(
        &p,
        &[
            "--scheme",
            "kivi2",
            "--scale",
            "0.0625",
            "--window",
            "50",
            "--block-tokens",
            "96",
        ],
    ));
    let params = AttnParams {
        softmax_scale: 0.0625,
        window: Some(50),
    };
    let want = reference::attend(&scheme, &q, &k, &v, params).unwrap();
    let (_, got) = npy_read(&p[3]);
    let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "{err}");
}

#[test]
fn attend_batches_with_lengths_and_float16_inputs() {
    let s = Scratch::new("batch");
    let (b, t, hq, hkv, d) = (3, 40, 4, 1, 32);
    let mut rng = Rng::new(99);
    let q = random(b * hq * d, &mut rng);
    let mut k = random(b * t * hkv * d, &mut rng);
    let v = random(b * t * hkv * d, &mut rng);
    let lens = [1usize, 33, 40];
    // Padding past a sequence's length is never read, even when it is NaN.
    for (i, &n) in lens.iter().enumerate() {
        for x in &mut k[(i * t + n) * hkv * d..(i + 1) * t * hkv * d] {
            *x = f32::NAN;
        }
    }
    // float16 inputs: exact in f16, so the oracle sees the same values.
    let f16 = |x: &[f32]| -> Vec<u8> {
        x.iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect()
    };
    let widen = |x: &[f32]| -> Vec<f32> { x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect() };
    let dict = |shape: &[usize]| {
        format!(
            "{{'descr': '<f2', 'fortran_order': False, 'shape': {}, }}",
            shape_text(shape)
        )
    };
    let p = paths(&s);
    npy_raw(&p[0], &dict(&[b, hq, d]), &f16(&q));
    npy_raw(&p[1], &dict(&[b, t, hkv, d]), &f16(&k));
    npy_raw(&p[2], &dict(&[b, t, hkv, d]), &f16(&v));
    let out = ok(&attend_args(&p, &["--scheme", "kivi4", "--lens", "1,33,40", "--json"]));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["tokens"], 74);
    assert_eq!(j["heads"], "mqa(q = 4)");
    let (shape, got) = npy_read(&p[3]);
    assert_eq!(shape, vec![b, hq, d]);
    let scheme = presets::kivi4().with_shape(Heads::Mqa(4), 32).unwrap();
    let (q, k, v) = (widen(&q), widen(&k), widen(&v));
    for (i, &n) in lens.iter().enumerate() {
        let r = |x: &[f32]| x[i * t * hkv * d..][..n * hkv * d].to_vec();
        let want = reference::attend(
            &scheme,
            &q[i * hq * d..][..hq * d],
            &r(&k),
            &r(&v),
            AttnParams::of(&scheme, scheme.shape().unwrap()),
        )
        .unwrap();
        let err = want
            .iter()
            .zip(&got[i * hq * d..][..hq * d])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-5, "sequence {i}: {err}");
    }
}

#[test]
fn attend_rejects_bad_input_with_one_line() {
    let s = Scratch::new("bad");
    problem(&s, 40, 8, 2, 64);
    let p = paths(&s);
    let run = |extra: &[&str], want: &str| {
        let mut a = vec!["--scheme", "kivi2"];
        a.extend_from_slice(extra);
        fails(&attend_args(&p, &a), want)
    };
    let dir = s.0.to_str().unwrap().to_string();
    let file = |name: &str| format!("{dir}/{name}");
    let bad_file = |name: &str, dict: &str, data: &[u8]| {
        npy_raw(&file(name), dict, data);
        file(name)
    };
    let f32s = |n: usize| vec![0u8; n * 4];

    // Files that are missing or not what we read.
    run(&["--q", &file("missing.npy")], "missing.npy: no such file");
    std::fs::write(file("text.npy"), "q,k,v\n1,2,3\n").unwrap();
    run(&["--q", &file("text.npy")], "text.npy: not a .npy file");
    let f8 = bad_file(
        "f8.npy",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (8, 64), }",
        &f32s(8 * 64 * 2),
    );
    run(&["--q", &f8], "dtype <f8 is not supported");
    let i4 = bad_file(
        "i4.npy",
        "{'descr': '<i4', 'fortran_order': False, 'shape': (8, 64), }",
        &f32s(8 * 64),
    );
    run(&["--q", &i4], "dtype <i4 is not supported");
    let be = bad_file(
        "be.npy",
        "{'descr': '>f4', 'fortran_order': False, 'shape': (8, 64), }",
        &f32s(8 * 64),
    );
    run(&["--q", &be], "big-endian");
    let fo = bad_file(
        "fo.npy",
        "{'descr': '<f4', 'fortran_order': True, 'shape': (8, 64), }",
        &f32s(8 * 64),
    );
    run(&["--q", &fo], "Fortran order");
    let short = bad_file(
        "short.npy",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 64), }",
        &f32s(100),
    );
    run(&["--q", &short], "needs 2048 data bytes, the file has 400");
    let corrupt = bad_file(
        "corrupt.npy",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 64, }",
        &[],
    );
    run(&["--q", &corrupt], "corrupt header");
    std::fs::write(file("trunc.npy"), b"\x93NUMPY\x01\x00\xff\x00{'descr'").unwrap();
    run(&["--q", &file("trunc.npy")], "corrupt header");

    // Shapes that disagree.
    npy_f32(&file("q7.npy"), &[7, 64], &vec![0.5; 7 * 64]);
    run(
        &["--q", &file("q7.npy")],
        "7 query heads is not a multiple of 2 kv heads",
    );
    npy_f32(&file("q3d.npy"), &[1, 8, 64], &vec![0.5; 8 * 64]);
    run(&["--q", &file("q3d.npy")], "is not [Hq, D]");
    npy_f32(&file("qd.npy"), &[8, 32], &vec![0.5; 8 * 32]);
    run(
        &["--q", &file("qd.npy")],
        "head_dim 32 differs from the keys' head_dim 64",
    );
    npy_f32(&file("v39.npy"), &[39, 2, 64], &vec![0.5; 39 * 2 * 64]);
    run(&["--v", &file("v39.npy")], "differs from the keys'");
    npy_f32(&file("k2d.npy"), &[40, 128], &vec![0.5; 40 * 128]);
    run(
        &["--k", &file("k2d.npy"), "--v", &file("k2d.npy")],
        "neither [T, Hkv, D] nor [B, T, Hkv, D]",
    );
    // head_dim 48 is not a multiple of kivi2's token-axis group of 32.
    npy_f32(&file("q48.npy"), &[8, 48], &vec![0.5; 8 * 48]);
    npy_f32(&file("k48.npy"), &[4, 2, 48], &vec![0.5; 4 * 2 * 48]);
    run(
        &[
            "--q",
            &file("q48.npy"),
            "--k",
            &file("k48.npy"),
            "--v",
            &file("k48.npy"),
        ],
        "does not divide head_dim 48",
    );

    // Non-finite values.
    let mut k = vec![0.5f32; 40 * 2 * 64];
    k[5 * 128 + 64 + 7] = f32::NAN;
    npy_f32(&file("knan.npy"), &[40, 2, 64], &k);
    run(
        &["--k", &file("knan.npy")],
        "non-finite key value (NaN) at token 5, head 1, channel 7",
    );
    k[5 * 128 + 64 + 7] = f32::INFINITY;
    npy_f32(&file("vinf.npy"), &[40, 2, 64], &k);
    run(&["--v", &file("vinf.npy")], "non-finite value value");
    let mut q = vec![0.5f32; 8 * 64];
    q[3 * 64 + 1] = f32::NEG_INFINITY;
    npy_f32(&file("qinf.npy"), &[8, 64], &q);
    run(
        &["--q", &file("qinf.npy")],
        "qinf.npy: non-finite value (-inf) at [3, 1]",
    );
    // A value that overflows f16 on rounding is non-finite too.
    let mut k = vec![0.5f32; 40 * 2 * 64];
    k[0] = 1e6;
    npy_f32(&file("kbig.npy"), &[40, 2, 64], &k);
    run(&["--k", &file("kbig.npy")], "non-finite key value");

    // Options that make no sense.
    run(&["--lens", "3"], "--lens needs batched inputs");
    run(&["--scale", "0"], "--scale 0 must be a finite positive number");
    run(&["--scale", "NaN"], "--scale NaN must be a finite positive number");
    run(
        &["--window", "0"],
        "'0' for '--window <WINDOW>': `0` is not a positive count",
    );
    run(&["--block-tokens", "0"], "`0` is not a positive count");
    run(&["--lens", "3,x"], "`x` is not a count");
    run(&["--block-tokens", "48"], "not a multiple of the key channel group 32");
    run(&["--out", &file("no/such/dir/out.npy")], "cannot write");
    fails(
        &[
            "attend", "--scheme", "kivi9", "--q", &p[0], "--k", &p[1], "--v", &p[2], "--out", &p[3],
        ],
        "unknown scheme `kivi9`",
    );
    std::fs::write(file("s.kivi"), "s {\n  key: quant(bits = 2, axis = channel, group = 32),\n  value: quant(bits = 6, axis = token, group = 32),\n}").unwrap();
    let e = fails(
        &[
            "attend",
            "--scheme",
            &file("s.kivi"),
            "--q",
            &p[0],
            "--k",
            &p[1],
            "--v",
            &p[2],
            "--out",
            &p[3],
        ],
        "value bits = 6 is not supported",
    );
    assert!(e.contains("s.kivi:3:23: "), "{e}");
}

#[test]
fn attend_rejects_bad_batches() {
    let s = Scratch::new("bad-batch");
    let p = paths(&s);
    npy_f32(&p[0], &[2, 4, 32], &vec![0.1; 2 * 4 * 32]);
    npy_f32(&p[1], &[2, 10, 2, 32], &vec![0.2; 2 * 10 * 2 * 32]);
    npy_f32(&p[2], &[2, 10, 2, 32], &vec![0.3; 2 * 10 * 2 * 32]);
    ok(&attend_args(&p, &["--scheme", "int8", "--lens", "10,0"]));
    let (shape, out) = npy_read(&p[3]);
    assert_eq!(shape, vec![2, 4, 32]);
    // All values equal 0.3 (rounded to f16): attention returns them; an empty sequence returns zeros.
    assert!(
        out[..4 * 32]
            .iter()
            .all(|x| (x - half::f16::from_f32(0.3).to_f32()).abs() < 1e-2),
        "{out:?}"
    );
    assert!(out[4 * 32..].iter().all(|x| *x == 0.0));
    let run = |extra: &[&str], want: &str| {
        let mut a = vec!["--scheme", "int8"];
        a.extend_from_slice(extra);
        fails(&attend_args(&p, &a), want)
    };
    run(&["--lens", "1,2,3"], "--lens has 3 lengths for a batch of 2 sequences");
    run(&["--lens", "1,11"], "sequence 1 has length 11, more than the 10 tokens");
    npy_f32(&p[0], &[3, 4, 32], &vec![0.1; 3 * 4 * 32]);
    run(&[], "3 queries for a batch of 2 sequences");
    npy_f32(&p[0], &[4, 32], &vec![0.1; 4 * 32]);
    run(&[], "is not [B, Hq, D]");
    let mut v = vec![0.3f32; 2 * 10 * 2 * 32];
    v[(10 + 4) * 64] = f32::NAN;
    npy_f32(&p[0], &[2, 4, 32], &vec![0.1; 2 * 4 * 32]);
    npy_f32(&p[2], &[2, 10, 2, 32], &v);
    run(
        &[],
        "sequence 1: non-finite value value (NaN) at token 4, head 0, channel 0",
    );
}

#[test]
fn writes_to_a_closed_pipe_do_not_panic() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kivi"))
        .args(["schemes"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

/// `kivi attend --backend sim` runs the generated CUDA kernels on the
/// simulated device (through the same device cache and launches as a GPU)
/// and agrees with `--backend reference` on random inputs with outlier
/// channels, in a batch of odd lengths, with and without a window.
#[test]
fn attend_on_the_simulated_device_agrees_with_the_reference() {
    let s = Scratch::new("attend-sim");
    let (b, t, hq, hkv, d) = (3, 130, 8, 2, 64);
    let mut rng = Rng::new(7);
    let q = random(b * hq * d, &mut rng);
    let k: Vec<f32> = random(b * t * hkv * d, &mut rng)
        .iter()
        .enumerate()
        .map(|(i, x)| if i % d == 5 { x * 8.0 } else { *x })
        .collect();
    let v = random(b * t * hkv * d, &mut rng);
    let p = paths(&s);
    npy_f32(&p[0], &[b, hq, d], &q);
    npy_f32(&p[1], &[b, t, hkv, d], &k);
    npy_f32(&p[2], &[b, t, hkv, d], &v);
    for window in [None, Some("37")] {
        let mut outs = Vec::new();
        for backend in ["reference", "sim"] {
            let mut a = vec![
                "--scheme",
                "kivi2",
                "--backend",
                backend,
                "--lens",
                "1,33,127",
                "--json",
            ];
            if let Some(w) = window {
                a.extend(["--window", w]);
            }
            let out = ok(&attend_args(&p, &a));
            let j: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(j["backend"], backend);
            outs.push(npy_read(&p[3]).1);
        }
        let scale = outs[0].iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.1, "the reference output is not trivial");
        let err = outs[0]
            .iter()
            .zip(&outs[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            err <= 1e-4 * scale,
            "window {window:?}: sim differs from the reference by {err}"
        );
    }
}

/// `--backend cuda` without a GPU fails with one line that says why, and
/// points at `--backend sim`.
#[test]
fn attend_on_cuda_without_a_gpu_fails_clearly() {
    if kivi_runtime::cuda::CudaDevice::new(0).is_ok() {
        println!("a GPU is present; nothing to check");
        return;
    }
    let s = Scratch::new("attend-nogpu");
    let (q, k, v) = problem(&s, 20, 4, 1, 32);
    let _ = (q, k, v);
    let p = paths(&s);
    let err = fails(
        &attend_args(&p, &["--scheme", "kivi2", "--backend", "cuda"]),
        "unavailable",
    );
    assert!(err.contains("--backend sim"), "{err}");
    assert!(!std::path::Path::new(&p[3]).exists(), "no output written");
}

#[test]
fn show_model_reports_every_layer_and_the_total() {
    let decl = "model gemma { layers: 18, window: 512, global_layers: [5, 11, 17], default: kivi2, global: kivi4 }";
    let args = [
        "show",
        "--model",
        decl,
        "--heads",
        "mqa:4",
        "--head-dim",
        "256",
        "--context",
        "4k",
    ];
    let text = ok(&args);
    assert!(text.contains("model gemma: 18 layers"), "{text}");
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let v: serde_json::Value = serde_json::from_str(&ok(&json_args)).unwrap();
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 18);
    let sum: u64 = layers.iter().map(|l| l["memory"]["total"].as_u64().unwrap()).sum();
    assert_eq!(v["total"].as_u64().unwrap(), sum);
    for (i, l) in layers.iter().enumerate() {
        let global = [5, 11, 17].contains(&i);
        assert_eq!(l["scheme"], if global { "kivi4" } else { "kivi2" });
        assert_eq!(l["kind"], if global { "global" } else { "sliding" });
        let (m, kept) = (
            l["memory"]["total"].as_u64().unwrap(),
            l["without_eviction"].as_u64().unwrap(),
        );
        // Sliding layers evict (4k tokens, window 512); global ones keep all.
        if global {
            assert_eq!(m, kept);
        } else {
            assert!(4 * m < kept, "layer {i}: {m} of {kept}");
        }
    }
    // One block pool for all layers: its bytes are the layers' blocks
    // (codes, scales, zeros, outliers); the rest of each layer's bytes is
    // per sequence, outside it. Eviction shrinks it as it shrinks the total.
    let pool = &v["pool"];
    let blocks: u64 = layers
        .iter()
        .map(|l| {
            ["codes", "scales", "zeros", "outliers"]
                .iter()
                .map(|k| l["memory"][k].as_u64().unwrap())
                .sum::<u64>()
        })
        .sum();
    assert_eq!(pool["blocks"].as_u64().unwrap(), blocks, "{pool}");
    assert_eq!(
        pool["blocks"].as_u64().unwrap() + pool["outside_pool"].as_u64().unwrap(),
        sum
    );
    assert!(pool["peak"].as_u64().unwrap() >= blocks);
    assert!(
        2 * pool["blocks"].as_u64().unwrap() < pool["without_eviction"].as_u64().unwrap(),
        "{pool}"
    );
    assert!(text.contains("one block pool for all 18 layers"), "{text}");
    // A global layer's bytes are what `show --scheme` reports for its scheme.
    let one: serde_json::Value = serde_json::from_str(&ok(&[
        "show",
        "--scheme",
        "kivi4",
        "--heads",
        "mqa:4",
        "--head-dim",
        "256",
        "--context",
        "4k",
        "--json",
    ]))
    .unwrap();
    assert_eq!(layers[5]["memory"]["total"], one["paged_cache"]["memory"]["total"]);
}

#[test]
fn show_model_rejects_bad_declarations() {
    fails(
        &["show", "--model", "model m { layers: 4, default: kivi9 }"],
        "model text:1:31: `kivi9` is not a preset",
    );
    fails(
        &["show", "--model", "model m { default: kivi2 }"],
        "declares no layer count",
    );
    fails(&["show", "--model", "./no-such-model-file"], "cannot read model file");
    fails(
        &[
            "show",
            "--model",
            "model m { layers: 1, default: kivi2 }",
            "--scheme",
            "kivi2",
        ],
        "cannot be used with",
    );
}
