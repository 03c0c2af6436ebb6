//! The `llama.cpp` peer: ggml's CPU flash attention (`ggml_flash_attn_ext`,
//! the attention llama.cpp runs on a CPU) over f16, q8_0 and q4_0 KV, at the
//! benchmark's shapes, in the same run as kivi's decode.
//!
//! ggml is built from the llama.cpp sources that the `llama-cpp-python`
//! sdist on PyPI vendors ([`VERSION`]), by `scripts/build-ggml.sh` (compiled
//! into the binary and written into the cache folder), together with a
//! small C shim (`benches/ggml_shim.c`) into `libkivi_ggml.so`. kivi loads
//! that library with `dlopen` at run time, so the kivi binary has no
//! build-time dependency on ggml; a missing compiler, CMake or network is a
//! reason in the report, never a failed benchmark. The build is cached: the
//! script returns at once when the folder holds a library built from the
//! same shim and version.
//!
//! Shapes: one query token per sequence, `batch` sequences in ggml's fourth
//! dimension, each with its own K/V, no mask, scale `1/sqrt(head_dim)`; K
//! and V are converted by ggml itself (`ggml_fp32_to_fp16_row`,
//! `ggml_quantize_chunk`). Threads: ggml's own pool, the caller plus
//! `threads - 1` workers, at llama.cpp's default polling level; the peer
//! is timed with 1 and `threads` threads and the faster is kept.

use super::{PeerResult, Shape};
use kivi_runtime::rand::Rng;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The `llama-cpp-python` sdist whose vendored ggml is built.
pub const VERSION: &str = "0.3.36";
/// The peer's name in the report and on the command line.
pub const NAME: &str = "llama.cpp";
/// The KV types timed, ggml's names.
pub const TYPES: [&str; 3] = ["f16", "q8_0", "q4_0"];
/// The shim, as shipped in `benches/ggml_shim.c`.
pub const SHIM: &str = include_str!("../../../../benches/ggml_shim.c");
/// The build script, as shipped in `scripts/build-ggml.sh`.
pub const BUILD_SCRIPT: &str = include_str!("../../../../scripts/build-ggml.sh");

// dlopen(3) and friends, from the C library (glibc >= 2.34 has them in libc).
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

type NewFn = unsafe extern "C" fn(
    *const c_char,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    *const f32,
    i64,
    *mut c_char,
    c_int,
) -> *mut c_void;
type KvBytesFn = unsafe extern "C" fn(*const c_void) -> i64;
type RunFn = unsafe extern "C" fn(*mut c_void, *mut f32) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void);

/// The loaded shim. Never unloaded: its function pointers stay valid for
/// the life of the process.
#[derive(Clone, Copy, Debug)]
pub struct Ggml {
    new: NewFn,
    kv_bytes: KvBytesFn,
    run: RunFn,
    free: FreeFn,
}

/// The folder the build for [`VERSION`] lives in under `root`.
pub fn build_dir(root: &Path) -> PathBuf {
    root.join(VERSION)
}

/// The library inside [`build_dir`].
pub fn library(root: &Path) -> PathBuf {
    build_dir(root).join("libkivi_ggml.so")
}

/// Builds the library under `root` unless a build of the same shim and
/// version is there (the script checks its stamp and returns at once).
/// The script's progress goes to stderr.
pub fn build(root: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf, String> {
    let dir = build_dir(root);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let script = dir.join("build-ggml.sh");
    let shim = dir.join("ggml_shim.c");
    std::fs::write(&script, BUILD_SCRIPT)
        .and_then(|_| std::fs::write(&shim, SHIM))
        .map_err(|e| format!("cannot write the build script into {}: {e}", dir.display()))?;
    let so = library(root);
    if !so.exists() {
        log(&format!(
            "building ggml (llama-cpp-python {VERSION} sdist from PyPI) into {}: a few minutes, once",
            dir.display()
        ));
    }
    let out = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .arg(&shim)
        .env("KIVI_GGML_VERSION", VERSION)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run bash {}: {e}", script.display()))?;
    let err = String::from_utf8_lossy(&out.stderr);
    for line in err.lines().filter(|l| !l.trim().is_empty()) {
        log(line);
    }
    if !out.status.success() {
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
        return Err(format!("cannot build ggml: {last}"));
    }
    Ok(so)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a C string or null.
    unsafe {
        let e = dlerror();
        if e.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// The query and K/V of one decode point, in kivi's layouts.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// `[batch, q_heads, head_dim]`.
    pub q: &'a [f32],
    /// `[tokens, kv_heads, head_dim]` per sequence, sequence `b` at
    /// `b * seq_stride`.
    pub k: &'a [f32],
    /// As `k`.
    pub v: &'a [f32],
    /// Floats between sequences; 0: all sequences share one K/V (each still
    /// gets its own copy in ggml).
    pub seq_stride: usize,
}

impl Ggml {
    /// Loads a library built by [`build`].
    pub fn load(so: &Path) -> Result<Ggml, String> {
        let c = CString::new(so.as_os_str().to_string_lossy().as_bytes())
            .map_err(|_| format!("bad library path {}", so.display()))?;
        // SAFETY: a library built from our shim and ggml's sources; its
        // static initialisers only set up ggml's tables.
        let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("cannot load {}: {}", so.display(), dl_error()));
        }
        let sym = |name: &str| -> Result<*mut c_void, String> {
            let n = CString::new(name).expect("symbol names are ASCII");
            // SAFETY: valid handle and C string.
            let f = unsafe { dlsym(handle, n.as_ptr()) };
            if f.is_null() {
                Err(format!("{} has no symbol {name}: {}", so.display(), dl_error()))
            } else {
                Ok(f)
            }
        };
        // SAFETY: the signatures are those of benches/ggml_shim.c.
        unsafe {
            Ok(Ggml {
                new: std::mem::transmute::<*mut c_void, NewFn>(sym("kivi_ggml_new")?),
                kv_bytes: std::mem::transmute::<*mut c_void, KvBytesFn>(sym("kivi_ggml_kv_bytes")?),
                run: std::mem::transmute::<*mut c_void, RunFn>(sym("kivi_ggml_run")?),
                free: std::mem::transmute::<*mut c_void, FreeFn>(sym("kivi_ggml_free")?),
            })
        }
    }

    /// One decode point of type `ty` (one of [`TYPES`]) on `threads` threads.
    pub fn prepare(&self, ty: &str, shape: &Shape, threads: usize, inputs: Inputs) -> Result<Point, String> {
        let Inputs { q, k, v, seq_stride } = inputs;
        let (b, hq, hkv, d, t) = (
            shape.batch,
            shape.q_heads as usize,
            shape.kv_heads as usize,
            shape.head_dim as usize,
            shape.context,
        );
        let per_seq = t * hkv * d;
        let need = if seq_stride == 0 {
            per_seq
        } else {
            (b - 1) * seq_stride + per_seq
        };
        if b == 0 || q.len() != b * hq * d || k.len() < need || v.len() < need {
            return Err(format!(
                "ggml peer: inputs do not match the shape (q {}, k {}, v {}; want q {}, k/v {need})",
                q.len(),
                k.len(),
                v.len(),
                b * hq * d
            ));
        }
        let int = |x: usize| c_int::try_from(x).map_err(|_| format!("ggml peer: {x} does not fit a C int"));
        let ty_c = CString::new(ty).map_err(|_| "bad type name".to_string())?;
        let mut err = vec![0 as c_char; 256];
        // SAFETY: the buffers are at least as long as the shim reads (checked
        // above); err is writable for its length.
        let h = unsafe {
            (self.new)(
                ty_c.as_ptr(),
                int(b)?,
                int(hq)?,
                int(hkv)?,
                int(d)?,
                int(t)?,
                int(threads.max(1))?,
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                seq_stride as i64,
                err.as_mut_ptr(),
                err.len() as c_int,
            )
        };
        if h.is_null() {
            // SAFETY: the shim wrote a NUL-terminated message (or nothing).
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(format!("ggml {ty}: {msg}"));
        }
        Ok(Point {
            lib: *self,
            handle: h,
            out_len: b * hq * d,
        })
    }
}

/// One prepared decode point (ggml context, graph and thread pool).
pub struct Point {
    lib: Ggml,
    handle: *mut c_void,
    out_len: usize,
}

impl Point {
    /// Bytes of K and V as ggml stores them.
    pub fn kv_bytes(&self) -> usize {
        // SAFETY: a live handle.
        unsafe { (self.lib.kv_bytes)(self.handle) }.max(0) as usize
    }

    /// Runs the attention once; `out` (if given) gets `[batch, q_heads, head_dim]`.
    pub fn run(&mut self, out: Option<&mut [f32]>) -> Result<(), String> {
        let ptr = match out {
            Some(o) if o.len() == self.out_len => o.as_mut_ptr(),
            Some(o) => {
                return Err(format!(
                    "ggml peer: output of {} floats, want {}",
                    o.len(),
                    self.out_len
                ))
            }
            None => std::ptr::null_mut(),
        };
        // SAFETY: a live handle; out is null or out_len floats.
        let s = unsafe { (self.lib.run)(self.handle, ptr) };
        if s == 0 {
            Ok(())
        } else {
            Err(format!("ggml_graph_compute returned status {s}"))
        }
    }
}

impl Drop for Point {
    fn drop(&mut self) {
        // SAFETY: a live handle, freed once.
        unsafe { (self.lib.free)(self.handle) }
    }
}

/// How the peer runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Cache root; the build goes into `root/VERSION`.
    pub root: PathBuf,
    pub threads: usize,
    pub reps: usize,
    /// Evict the CPU caches before each timed run, as kivi's cold decode does.
    pub cold: bool,
}

/// Reads twice the last-level cache so that the next run finds K/V in DRAM
/// (the same amount `kivi bench` reads before each cold decode).
fn evict(buf: &[u64]) {
    let half = buf.len().div_ceil(2).max(1);
    let s: u64 = std::thread::scope(|sc| {
        let hs: Vec<_> = buf
            .chunks(half)
            .map(|c| sc.spawn(move || c.iter().fold(0u64, |a, x| a.wrapping_add(*x))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
    });
    std::hint::black_box(s);
}

/// K/V for one sequence, `[tokens, kv_heads, head_dim]`, drawn like the
/// benchmark's own (keys with per-channel offsets, values noise).
fn kv_data(shape: &Shape, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (h, d) = (shape.kv_heads as usize, shape.head_dim as usize);
    let mut r = Rng::new(seed);
    let n = shape.context * h * d;
    let mut k = Vec::with_capacity(n);
    let mut v = Vec::with_capacity(n);
    for _ in 0..shape.context * h {
        for c in 0..d {
            k.push(((c * 7) % 5) as f32 * 0.5 - 1.0 + r.f32());
            v.push(r.f32());
        }
    }
    (k, v)
}

/// Times one (type, thread count) at one shape: a warm-up, then `reps`
/// runs, each after an eviction when cold. Returns the wall-time statistics,
/// the median CPU time of the process per run (ms) and ggml's KV bytes.
#[allow(clippy::too_many_arguments)]
fn time_one(
    lib: &Ggml,
    ty: &str,
    shape: &Shape,
    threads: usize,
    opts: &Options,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    evict_buf: &[u64],
) -> Result<(crate::bench::Stats, f64, usize), String> {
    let mut p = lib.prepare(ty, shape, threads, Inputs { q, k, v, seq_stride: 0 })?;
    p.run(None)?; // warm-up
    let (mut ms, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..opts.reps.max(1) {
        if opts.cold {
            evict(evict_buf);
        }
        let c0 = crate::bench::process_cpu_ns();
        let t0 = Instant::now();
        p.run(None)?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        cpu.push(crate::bench::process_cpu_ns().saturating_sub(c0) as f64 / 1e6);
    }
    Ok((
        crate::bench::Stats::of(&ms),
        crate::bench::Stats::of(&cpu).median_ms,
        p.kv_bytes(),
    ))
}

/// Builds (or finds) ggml and times it at every shape and type. Returns the
/// availability line and one result per (shape, type); a failure is a
/// reason in the line or an error in the row, never a panic.
pub fn run(opts: &Options, shapes: &[Shape], log: &mut dyn FnMut(&str)) -> (String, Vec<PeerResult>) {
    let lib = match build(&opts.root, log).and_then(|so| Ggml::load(&so)) {
        Ok(l) => l,
        Err(e) => return (format!("unavailable: {e}"), Vec::new()),
    };
    let evict_buf: Vec<u64> = if opts.cold {
        let bytes = (2 * crate::bench::last_level_cache()).clamp(64 << 20, 1 << 30);
        (0..(bytes / 8) as u64).collect()
    } else {
        Vec::new()
    };
    let mut results = Vec::new();
    for shape in shapes {
        let (k, v) = kv_data(shape, 0x5eed + shape.context as u64);
        let mut r = Rng::new(77);
        let q: Vec<f32> = (0..shape.batch * (shape.q_heads * shape.head_dim) as usize)
            .map(|_| r.f32())
            .collect();
        for ty in TYPES {
            let mut row = PeerResult {
                peer: NAME.into(),
                dtype: ty.into(),
                layout: shape.layout.clone(),
                context: shape.context,
                batch: shape.batch,
                median_ms: 0.0,
                p20_ms: 0.0,
                p80_ms: 0.0,
                min_ms: 0.0,
                kv_bytes: 0,
                error: None,
                note: None,
                cpu_ms: None,
            };
            // Like the numpy peer: time 1 thread and `threads`, keep the
            // faster. On a busy 2-core machine ggml's spin barriers can make
            // 2 threads slower than 1; the peer gets its best showing.
            let mut best: Option<(crate::bench::Stats, f64, usize, usize)> = None;
            let mut failed = None;
            let mut counts = vec![1, opts.threads.max(1)];
            counts.dedup();
            for n in counts {
                match time_one(&lib, ty, shape, n, opts, &q, &k, &v, &evict_buf) {
                    Ok((s, cpu_ms, bytes)) => {
                        let faster = match &best {
                            Some(b) => s.median_ms < b.0.median_ms,
                            None => true,
                        };
                        if faster {
                            best = Some((s, cpu_ms, bytes, n));
                        }
                    }
                    Err(e) => failed = Some(e),
                }
            }
            match (best, failed) {
                (Some((s, cpu_ms, bytes, n)), _) => {
                    row.cpu_ms = Some(cpu_ms);
                    row.median_ms = s.median_ms;
                    row.p20_ms = s.p20_ms;
                    row.p80_ms = s.p80_ms;
                    row.min_ms = s.min_ms;
                    row.kv_bytes = bytes;
                    row.note = Some(format!(
                        "ggml_flash_attn_ext, threads: {n} (best of 1 and {}), {} KV, CPU {cpu_ms:.2} ms/run",
                        opts.threads,
                        if opts.cold { "cold" } else { "warm" }
                    ));
                }
                (None, e) => row.error = Some(e.unwrap_or_else(|| "not run".into())),
            }
            let took = match &row.error {
                Some(e) => format!("error: {e}"),
                None => format!("{:.3} ms", row.median_ms),
            };
            log(&format!(
                "peer {NAME} {ty} {} context {} batch {}: {took}",
                shape.layout, shape.context, shape.batch
            ));
            results.push(row);
        }
    }
    (
        format!("ggml from llama-cpp-python {VERSION} (sdist, built -O3 -march=native)"),
        results,
    )
}

#[cfg(test)]
mod tests {
    //! ggml must compute the same attention as kivi's reference on the same
    //! f16 K/V, or its timings compare kivi with something else. These tests
    //! need the built library and do not build it (that downloads 77 MB and
    //! compiles for minutes): without it they print why and pass, unless
    //! `KIVI_REQUIRE_GGML=1`. Build first with
    //! `scripts/build-ggml.sh` (or any `kivi bench --peers llama.cpp`), then
    //! `cargo test -p kivi-cli --bin kivi ggml`. `KIVI_GGML_DIR` points at
    //! another cache root than `.cache/ggml`.
    use super::*;
    use kivi_runtime::{AttnParams, Backend, CacheConfig, PagedCache, ReferenceBackend};
    use kivi_spec::Heads;

    fn lib() -> Option<Ggml> {
        let root = std::env::var_os("KIVI_GGML_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/ggml"));
        let so = library(&root);
        let required = std::env::var("KIVI_REQUIRE_GGML").is_ok_and(|v| v == "1");
        if !so.exists() {
            assert!(!required, "KIVI_REQUIRE_GGML=1 but {} is missing", so.display());
            eprintln!(
                "skipping: no ggml build at {} (run scripts/build-ggml.sh {})",
                so.display(),
                build_dir(&root).display()
            );
            return None;
        }
        // A library built from another version of the shim may not match
        // the signatures declared here.
        let built_from = std::fs::read_to_string(build_dir(&root).join("ggml_shim.c")).unwrap_or_default();
        if built_from != SHIM {
            assert!(!required, "KIVI_REQUIRE_GGML=1 but {} is stale", so.display());
            eprintln!(
                "skipping: {} was built from another shim (rerun scripts/build-ggml.sh {})",
                so.display(),
                build_dir(&root).display()
            );
            return None;
        }
        Some(Ggml::load(&so).expect("the ggml build loads"))
    }

    /// Max |ggml - reference| / max |v| over `batch` sequences, each with
    /// its own K/V, at one shape. The output is a convex combination of V
    /// rows, so V's scale is the one its rounding errors are relative to
    /// (the output itself shrinks towards 0 as more noise rows are averaged).
    /// `shared_kv` hands ggml the first sequence's K/V for every sequence: a
    /// deliberate layout mistake, to show that the check catches one.
    fn error_vs_reference(
        lib: &Ggml,
        ty: &str,
        (hq, hkv, d): (u32, u32, u32),
        tokens: usize,
        batch: usize,
        shared_kv: bool,
    ) -> f32 {
        let scheme = kivi_spec::load_scheme("f16")
            .unwrap()
            .with_shape(Heads::from_counts(hq, hkv), d)
            .unwrap();
        let shape = Shape {
            layout: format!("{hq}:{hkv}/d{d}"),
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            context: tokens,
            batch,
        };
        let per_seq = tokens * (hkv * d) as usize;
        let mut r = Rng::new(tokens as u64 * 31 + hq as u64);
        // Keys with a per-channel offset, so that a transposed or shifted
        // layout changes the scores, not only the noise.
        let k: Vec<f32> = (0..batch * per_seq)
            .map(|i| ((i % d as usize) % 5) as f32 * 0.4 + r.f32())
            .collect();
        let v: Vec<f32> = (0..batch * per_seq).map(|_| r.normal()).collect();
        let q: Vec<f32> = (0..batch * (hq * d) as usize).map(|_| r.f32()).collect();
        let mut cache = PagedCache::new(scheme.clone(), CacheConfig::for_tokens(batch * (tokens + 16))).unwrap();
        let ids: Vec<_> = (0..batch)
            .map(|b| {
                let id = cache.add_sequence();
                cache
                    .extend(
                        id,
                        &k[b * per_seq..(b + 1) * per_seq],
                        &v[b * per_seq..(b + 1) * per_seq],
                    )
                    .unwrap();
                id
            })
            .collect();
        let attn = AttnParams::of(&scheme, scheme.shape().unwrap());
        let want = ReferenceBackend.decode(&cache, &ids, &q, attn).unwrap();
        let mut got = vec![0f32; want.len()];
        let seq_stride = if shared_kv { 0 } else { per_seq };
        lib.prepare(
            ty,
            &shape,
            2,
            Inputs {
                q: &q,
                k: &k,
                v: &v,
                seq_stride,
            },
        )
        .unwrap()
        .run(Some(&mut got))
        .unwrap();
        let scale = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
    }

    const LAYOUTS: [(u32, u32, u32); 3] = [(4, 4, 64), (8, 2, 128), (4, 1, 256)]; // MHA, GQA, MQA

    #[test]
    fn ggml_f16_matches_the_reference() {
        let Some(lib) = lib() else { return };
        for (hq, hkv, d) in LAYOUTS {
            for tokens in [1, 31, 33, 127, 1000] {
                let e = error_vs_reference(&lib, "f16", (hq, hkv, d), tokens, 2, false);
                // ggml rounds the query to f16 and sums V in f16: measured
                // <= 4e-4 of V's scale; the wrong K/V gives ~0.08.
                assert!(e < 2e-3, "ggml f16 {hq}:{hkv}/d{d} at {tokens} tokens: error {e}");
            }
        }
    }

    #[test]
    fn ggml_quantized_types_are_close_to_the_reference() {
        let Some(lib) = lib() else { return };
        // 8-bit and 4-bit KV, tolerances ~3x the measured error of V's
        // quantization (q8_0 <= 4e-3, q4_0 <= 1.4e-2 of V's scale from 33
        // tokens on; one q4_0 row alone is off by 8%, so not at 1 token); the
        // wrong K/V gives ~0.08.
        for (ty, tol, lengths) in [("q8_0", 1e-2, &[1, 33, 1000][..]), ("q4_0", 3e-2, &[33, 1000][..])] {
            for (hq, hkv, d) in LAYOUTS {
                for &tokens in lengths {
                    let e = error_vs_reference(&lib, ty, (hq, hkv, d), tokens, 2, false);
                    assert!(e < tol, "ggml {ty} {hq}:{hkv}/d{d} at {tokens} tokens: error {e}");
                }
            }
        }
    }

    #[test]
    fn the_check_catches_a_layout_mistake() {
        let Some(lib) = lib() else { return };
        for l in LAYOUTS {
            let e = error_vs_reference(&lib, "f16", l, 127, 2, true);
            assert!(e > 0.02, "{l:?}: the wrong K/V went unnoticed (error {e})");
        }
    }

    #[test]
    fn an_unbuildable_peer_is_a_reason_not_a_failure() {
        // A cache root that cannot hold a folder (it is a file): the peer
        // reports why and times nothing; this needs no ggml build.
        let file = std::env::temp_dir().join(format!("kivi-ggml-not-a-dir-{}", std::process::id()));
        std::fs::write(&file, b"").unwrap();
        let opts = Options {
            root: file.clone(),
            threads: 2,
            reps: 1,
            cold: false,
        };
        let shape = Shape {
            layout: "x".into(),
            q_heads: 4,
            kv_heads: 1,
            head_dim: 64,
            context: 8,
            batch: 1,
        };
        let (status, rows) = run(&opts, &[shape], &mut |_| {});
        let _ = std::fs::remove_file(&file);
        assert!(status.starts_with("unavailable: cannot create"), "{status}");
        assert!(rows.is_empty());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let Some(lib) = lib() else { return };
        let shape = Shape {
            layout: "x".into(),
            q_heads: 4,
            kv_heads: 1,
            head_dim: 48, // not a multiple of q4_0's 32-element block
            context: 8,
            batch: 1,
        };
        let (q, kv) = (vec![0f32; 4 * 48], vec![0f32; 8 * 48]);
        let inp = |q| Inputs {
            q,
            k: &kv,
            v: &kv,
            seq_stride: 0,
        };
        assert!(lib.prepare("q4_0", &shape, 2, inp(&q)).is_err());
        assert!(lib.prepare("bf17", &shape, 2, inp(&q)).is_err());
        assert!(lib.prepare("f16", &shape, 2, inp(&q[..5])).is_err());
        assert!(lib.prepare("f16", &shape, 2, inp(&q)).is_ok());
    }
}
