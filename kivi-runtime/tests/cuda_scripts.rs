//! scripts/gpu-check.sh fails clearly (exit 2, a one-line reason, a JSON
//! verdict) where there is no GPU, where the driver tool fails, and where
//! the bundle is missing. Runs everywhere: fake `nvidia-smi`s stand in.

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh")
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kivi-gpucheck-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs the script with PATH = `bin` plus the basic tools it needs.
fn run(bin: &Path, out: &Path) -> (i32, String, String) {
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let o = Command::new("bash")
        .arg(script())
        .arg(out)
        .env("PATH", path)
        .output()
        .unwrap();
    let json = std::fs::read_to_string(out.join("gpu-check.json")).unwrap_or_default();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        json,
    )
}

fn fake_smi(dir: &Path, body: &str) {
    let p = dir.join("nvidia-smi");
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    Command::new("chmod").arg("+x").arg(&p).status().unwrap();
}

#[test]
fn gpu_check_fails_clearly_without_a_gpu() {
    if Path::new("/usr/bin/nvidia-smi").exists() {
        println!("SKIP: this machine has nvidia-smi in /usr/bin; the no-GPU path cannot be staged");
        return;
    }
    let d = tmp("nogpu");
    let (rc, err, json) = run(&d.join("empty-bin"), &d.join("out"));
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("no GPU: nvidia-smi is not on this machine"), "{err}");
    assert!(json.contains("\"ok\": false") && json.contains("no GPU"), "{json}");

    // a driver tool that fails (no device, driver mismatch)
    let bin = d.join("bin-fail");
    std::fs::create_dir_all(&bin).unwrap();
    fake_smi(
        &bin,
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9",
    );
    let (rc, err, _) = run(&bin, &d.join("out2"));
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("nvidia-smi failed") && err.contains("could not communicate"),
        "{err}"
    );

    // a GPU but no bundle next to the script (target/gpu-bundle absent or incomplete)
    let bin = d.join("bin-ok");
    std::fs::create_dir_all(&bin).unwrap();
    fake_smi(&bin, "echo 'NVIDIA H200, 580.00, 143771 MiB'");
    let bundle = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/gpu-bundle/bin/gpu_decode");
    if !bundle.exists() {
        let (rc, err, json) = run(&bin, &d.join("out3"));
        assert_eq!(rc, 2, "{err}");
        assert!(err.contains("lacks") && err.contains("gpu-bundle.sh"), "{err}");
        assert!(json.contains("\"ok\": false"), "{json}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn gpu_check_wants_an_out_dir() {
    let o = Command::new("bash").arg(script()).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage: gpu-check.sh OUT_DIR"));
}
