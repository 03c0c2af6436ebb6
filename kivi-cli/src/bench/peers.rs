//! Peers measured in the same run: numpy (f32, batched matmul), PyTorch's
//! CPU `scaled_dot_product_attention` and jax's `dot_product_attention`
//! (f16 and f32), each where it can be installed, and on request llama.cpp's
//! CPU flash attention over f16, q8_0 and q4_0 KV ([`ggml`], built from
//! source on first use, called in-process).
//!
//! They run from the benchmark's own venv (`.cache/bench-py` by default),
//! created on first use with `python3 -m venv` and filled with pip from
//! PyPI by package name. The script is `benches/peers.py`, compiled into the
//! binary and written next to the venv, so the command works from any
//! directory. A peer that cannot be installed or imported is reported with
//! the reason; it never fails the benchmark.

pub mod ggml;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The peer script, as shipped in `benches/peers.py`.
pub const SCRIPT: &str = include_str!("../../../benches/peers.py");

/// One benchmark point, as the script reads it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Shape {
    pub layout: String,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub context: usize,
    pub batch: usize,
}

/// One peer's timing at one point.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerResult {
    pub peer: String,
    pub dtype: String,
    pub layout: String,
    pub context: usize,
    pub batch: usize,
    #[serde(default)]
    pub median_ms: f64,
    #[serde(default)]
    pub p20_ms: f64,
    #[serde(default)]
    pub p80_ms: f64,
    #[serde(default)]
    pub min_ms: f64,
    #[serde(default)]
    pub kv_bytes: usize,
    #[serde(default)]
    pub error: Option<String>,
    /// How it ran (e.g. the BLAS thread count that won).
    #[serde(default)]
    pub note: Option<String>,
    /// CPU time of all threads per run, median, ms (in-process peers only:
    /// llama.cpp). Counts work done, not time waited for a core.
    #[serde(default)]
    pub cpu_ms: Option<f64>,
}

/// What the peers gave: which were available (version or reason) and their times.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PeerReport {
    pub available: BTreeMap<String, String>,
    pub results: Vec<PeerResult>,
    /// Why no peer ran at all, if none did.
    #[serde(default)]
    pub error: Option<String>,
}

impl PeerReport {
    /// A successful result of `peer` at `dtype` for one point.
    pub fn find(&self, peer: &str, dtype: &str, layout: &str, context: usize, batch: usize) -> Option<&PeerResult> {
        self.results.iter().find(|r| {
            r.peer == peer
                && r.dtype == dtype
                && r.layout == layout
                && r.context == context
                && r.batch == batch
                && r.error.is_none()
        })
    }

    fn failed(why: String) -> PeerReport {
        PeerReport {
            error: Some(why),
            ..PeerReport::default()
        }
    }
}

/// How to find or make the Python that runs the peers.
#[derive(Clone, Debug)]
pub struct PeerOptions {
    /// The venv directory (created if missing).
    pub venv: PathBuf,
    /// Use this interpreter instead of the venv (e.g. one with CPU torch).
    pub python: Option<PathBuf>,
    /// Peers to run: numpy, torch, jax (Python), llama.cpp (ggml, in-process).
    pub peers: Vec<String>,
    pub reps: usize,
    pub threads: usize,
    /// Evict the CPU caches before each timed llama.cpp run (as kivi's cold
    /// decode does; the Python peers time back to back).
    pub cold: bool,
    /// Cache root of the llama.cpp build ([`ggml::build_dir`] under it).
    pub ggml_dir: PathBuf,
}

/// Whether `name` asks for the llama.cpp peer (`llama.cpp`, `llamacpp` or `ggml`).
pub fn is_llama_cpp(name: &str) -> bool {
    matches!(name, "llama.cpp" | "llamacpp" | "ggml")
}

fn run_quiet(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
        Err(format!("{:?} failed: {last}", cmd.get_program()))
    }
}

fn venv_python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

/// Creates the venv and installs numpy (required) and jax (optional) on
/// first use. torch is not installed: PyPI's Linux wheel pulls in the CUDA
/// libraries (gigabytes) and will not import without them, and PyPI has no
/// CPU-only build; point `--python` at an interpreter with CPU torch instead.
pub fn ensure_venv(venv: &Path, want: &[String], log: &mut dyn FnMut(&str)) -> Result<PathBuf, String> {
    let py = venv_python(venv);
    if !py.exists() {
        log(&format!("creating {} (python3 -m venv)", venv.display()));
        if let Some(parent) = venv.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        run_quiet(Command::new("python3").args(["-m", "venv"]).arg(venv))?;
    }
    let has = |module: &str| {
        Command::new(&py)
            .args(["-c", &format!("import {module}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let pip = |pkgs: &[&str]| run_quiet(Command::new(&py).args(["-m", "pip", "install", "-q"]).args(pkgs));
    if !has("numpy") {
        log("pip install numpy");
        pip(&["numpy"])?;
    }
    if !has("threadpoolctl") {
        // Lets the numpy peer try 1 and N BLAS threads; optional.
        let _ = pip(&["threadpoolctl"]);
    }
    // One attempt per venv: a marker remembers a failed optional install.
    let marker = venv.join(".kivi-jax-tried");
    if want.iter().any(|p| p == "jax") && !has("jax") && !marker.exists() {
        log("pip install jax jaxlib (CPU; optional)");
        if let Err(e) = pip(&["jax", "jaxlib"]) {
            log(&format!("jax not installed: {e}"));
        }
        let _ = std::fs::write(&marker, "");
    }
    Ok(py)
}

/// Runs the peers over `shapes`; never fails, reports instead.
pub fn run(opts: &PeerOptions, shapes: &[Shape], log: &mut dyn FnMut(&str)) -> PeerReport {
    if opts.peers.is_empty() || shapes.is_empty() {
        return PeerReport::failed("no peers requested".into());
    }
    let (native, python): (Vec<String>, Vec<String>) = opts.peers.iter().cloned().partition(|p| is_llama_cpp(p));
    let mut report = if python.is_empty() {
        PeerReport::default()
    } else {
        run_python(
            &PeerOptions {
                peers: python,
                ..opts.clone()
            },
            shapes,
            log,
        )
    };
    if !native.is_empty() {
        let g = ggml::Options {
            root: opts.ggml_dir.clone(),
            threads: opts.threads,
            reps: opts.reps,
            cold: opts.cold,
        };
        let (status, results) = ggml::run(&g, shapes, log);
        report.available.insert(ggml::NAME.into(), status);
        report.results.extend(results);
    }
    report
}

/// Runs the Python peers (`benches/peers.py`) over `shapes`.
fn run_python(opts: &PeerOptions, shapes: &[Shape], log: &mut dyn FnMut(&str)) -> PeerReport {
    let py = match &opts.python {
        Some(p) => p.clone(),
        None => match ensure_venv(&opts.venv, &opts.peers, log) {
            Ok(p) => p,
            Err(e) => return PeerReport::failed(format!("no Python environment for peers: {e}")),
        },
    };
    let dir = opts.venv.clone();
    let _ = std::fs::create_dir_all(&dir);
    let script = dir.join("peers.py");
    let spec = dir.join("peers-spec.json");
    let spec_json = serde_json::json!({
        "shapes": shapes,
        "reps": opts.reps,
        "peers": opts.peers,
        "threads": opts.threads,
    });
    if let Err(e) = std::fs::write(&script, SCRIPT).and_then(|_| std::fs::write(&spec, spec_json.to_string())) {
        return PeerReport::failed(format!("cannot write the peer script into {}: {e}", dir.display()));
    }
    log(&format!("peers: {} {}", py.display(), script.display()));
    let out = Command::new(&py)
        .arg(&script)
        .arg("--spec")
        .arg(&spec)
        .env("OMP_NUM_THREADS", opts.threads.to_string())
        .env("OPENBLAS_NUM_THREADS", opts.threads.to_string())
        .env("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
        .env("JAX_PLATFORMS", "cpu")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output();
    match out {
        Err(e) => PeerReport::failed(format!("cannot run {}: {e}", py.display())),
        Ok(o) if !o.status.success() => PeerReport::failed(format!("peers.py exited with {}", o.status)),
        Ok(o) => serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| PeerReport::failed(format!("peers.py printed no report: {e}"))),
    }
}
