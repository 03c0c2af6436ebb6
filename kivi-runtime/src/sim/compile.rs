//! Generated sources -> one host shared library, cached by content hash.
//!
//! Many variants go into one translation unit (headers are parsed once):
//! each source is wrapped in its own namespace, its `extern "C"` entry
//! points renamed by `#define` to `kivi_v<hash>_<entry>`, and exported
//! through `KIVI_SIM_EXPORT` as `kivi_sim_<hash>_<entry>` (see
//! `templates/cuda/sim_shim.h`).

use crate::error::{Error, Result};
use kivi_templates::Generated;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// Flags every sim library is built with. `-ffp-contract=off` keeps the
/// quantization arithmetic exactly as written (no fused multiply-adds the
/// source did not ask for), so prefill/append match the host bit for bit.
const FLAGS: &[&str] = &[
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-pthread",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
];

// dlopen(3) and friends, from the C library (glibc >= 2.34 has them in libc).
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

/// `int f(const unsigned* dims, void** args, char* err, int errlen)`.
pub(crate) type LaunchFn = unsafe extern "C" fn(*const u32, *mut *mut c_void, *mut c_char, c_int) -> c_int;

/// A loaded library of simulated kernels. Never unloaded: function
/// pointers into it stay valid for the life of the process.
pub struct SimLibrary {
    path: PathBuf,
    kernels: HashMap<(u64, String), LaunchFn>,
}

// The library is immutable after loading and its launch functions are
// re-entrant (shared memory is per worker thread), so it can be shared.
unsafe impl Send for SimLibrary {}
unsafe impl Sync for SimLibrary {}

impl std::fmt::Debug for SimLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimLibrary")
            .field("path", &self.path)
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

impl SimLibrary {
    /// The shared library on disk.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Number of entry points it exports.
    pub fn len(&self) -> usize {
        self.kernels.len()
    }
    pub fn is_empty(&self) -> bool {
        self.kernels.is_empty()
    }
    /// Whether it holds entry point `entry` of source `g`.
    pub fn contains(&self, g: &Generated, entry: &str) -> bool {
        self.kernels.contains_key(&(g.hash, entry.to_string()))
    }
    /// Launches entry point `entry` of `g` on `grid` blocks of `block`
    /// threads, cuLaunchKernel style: `args[i]` points at the value of the
    /// i-th argument.
    ///
    /// # Safety
    /// `args` must match the entry point's parameter list and every pointer
    /// argument must point at memory as large as the kernel indexes it.
    pub unsafe fn launch_raw(
        &self,
        g: &Generated,
        entry: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [*mut c_void],
        _arch: crate::cuda::Arch,
    ) -> Result<()> {
        let f = self.get(g, entry)?;
        let dims = [grid[0], grid[1], grid[2], block[0], block[1], block[2]];
        let mut err = vec![0 as c_char; 1024];
        let rc = f(dims.as_ptr(), args.as_mut_ptr(), err.as_mut_ptr(), err.len() as i32);
        if rc != 0 {
            let msg = CStr::from_ptr(err.as_ptr()).to_string_lossy().into_owned();
            return Err(Error::Config(format!("sim: {} `{entry}` failed: {msg}", g.name)));
        }
        Ok(())
    }

    pub(crate) fn get(&self, g: &Generated, entry: &str) -> Result<LaunchFn> {
        self.kernels.get(&(g.hash, entry.to_string())).copied().ok_or_else(|| {
            Error::Config(format!(
                "sim library {} has no entry point `{entry}` of {}",
                self.path.display(),
                g.name
            ))
        })
    }
}

fn sim_err(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: "sim",
        reason: reason.into(),
    }
}

/// The C++ compiler: `$CXX`, else the first of `g++`, `clang++`, `c++` that runs.
pub fn find_compiler() -> Result<String> {
    static FOUND: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let mut tried = Vec::new();
            let candidates: Vec<String> = match std::env::var("CXX") {
                Ok(c) if !c.trim().is_empty() => vec![c],
                _ => vec!["g++".into(), "clang++".into(), "c++".into()],
            };
            for c in candidates {
                match Command::new(&c).arg("--version").output() {
                    Ok(o) if o.status.success() => return Ok(c),
                    _ => tried.push(c),
                }
            }
            Err(format!(
                "no C++20 compiler found (tried {}); install g++ or clang++, or set CXX",
                tried.join(", ")
            ))
        })
        .clone()
        .map_err(sim_err)
}

/// Where compiled libraries are kept: `$KIVI_SIM_CACHE`, else `kivi-sim/`
/// in the cargo `target` directory the running binary lives in, else the
/// system temporary directory.
pub fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("KIVI_SIM_CACHE") {
        if !d.is_empty() {
            return PathBuf::from(d);
        }
    }
    if let Ok(exe) = std::env::current_exe() {
        for a in exe.ancestors() {
            if a.file_name().is_some_and(|n| n == "target") {
                return a.join("kivi-sim");
            }
        }
    }
    std::env::temp_dir().join("kivi-sim")
}

fn symbol(g: &Generated, entry: &str) -> String {
    format!("kivi_sim_{:016x}_{entry}", g.hash)
}

/// The translation unit holding every source of `gens`.
pub fn translation_unit(gens: &[&Generated]) -> String {
    let mut tu =
        String::from("// kivi sim library: generated sources compiled for the host\n#include \"sim_shim.h\"\n\n");
    for g in gens {
        let ns = format!("kivi_v{:016x}", g.hash);
        let _ = writeln!(tu, "// ---- {} (source hash {:016x})", g.name, g.hash);
        for e in &g.entry_points {
            let _ = writeln!(tu, "#define {e} {ns}_{e}");
        }
        let _ = writeln!(tu, "namespace {ns} {{\n#line 1 \"{:016x}.cu\"", g.hash);
        tu.push_str(&g.source);
        tu.push('\n');
        for e in &g.entry_points {
            let _ = writeln!(tu, "KIVI_SIM_EXPORT({}, {e})", symbol(g, e));
        }
        let _ = writeln!(tu, "}}  // namespace {ns}");
        for e in &g.entry_points {
            let _ = writeln!(tu, "#undef {e}");
        }
        tu.push('\n');
    }
    tu
}

fn loaded() -> &'static Mutex<HashMap<u64, Arc<SimLibrary>>> {
    static LOADED: OnceLock<Mutex<HashMap<u64, Arc<SimLibrary>>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// Compiles `gens` (deduplicated by hash) into one library, or loads it
/// from the cache when the same sources were compiled before.
pub fn compile(gens: &[&Generated]) -> Result<Arc<SimLibrary>> {
    let mut uniq: Vec<&Generated> = Vec::new();
    for g in gens {
        if !uniq.iter().any(|u| u.hash == g.hash) {
            uniq.push(g);
        }
    }
    let cxx = find_compiler()?;
    // Big batches are split into translation units compiled in parallel and
    // linked into one library; each unit re-parses the headers, so a unit
    // gets at least a few sources.
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
    let per_unit = uniq.len().div_ceil(jobs).max(4);
    let units: Vec<String> = uniq.chunks(per_unit.max(1)).map(translation_unit).collect();
    let shim = kivi_templates::SIM_SHIM;
    let key = kivi_spec::fnv1a64(format!("{cxx}\n{}\n{shim}\n{}", FLAGS.join(" "), units.join("\n")).as_bytes());
    if let Some(lib) = loaded().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(lib.clone());
    }
    let dir = cache_dir();
    let so = dir.join(format!("{key:016x}.so"));
    if !so.exists() {
        build(&cxx, &dir, key, &units, &uniq, &so)?;
    }
    let lib = Arc::new(load(&so, &uniq)?);
    loaded()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, lib.clone());
    Ok(lib)
}

fn build(cxx: &str, dir: &Path, key: u64, units: &[String], gens: &[&Generated], so: &Path) -> Result<()> {
    let shim = kivi_templates::SIM_SHIM;
    let inc = dir.join(format!("include-{:016x}", kivi_spec::fnv1a64(shim.as_bytes())));
    std::fs::create_dir_all(&inc).map_err(|e| sim_err(format!("cannot create {}: {e}", inc.display())))?;
    // The shim, and a stand-in for the one CUDA header the sources include.
    for (name, text) in [
        ("sim_shim.h", shim.to_string()),
        ("cuda_fp16.h", "#pragma once\n#include \"sim_shim.h\"\n".to_string()),
    ] {
        let p = inc.join(name);
        if std::fs::read_to_string(&p).ok().as_deref() != Some(text.as_str()) {
            write_atomic(&p, text.as_bytes())?;
        }
    }
    let pid = std::process::id();
    let failed = |cpp: &Path, stderr: &[u8]| {
        let names: Vec<&str> = gens.iter().map(|g| g.name.as_str()).collect();
        // The first errors are the useful ones; g++ can print megabytes.
        let log = String::from_utf8_lossy(stderr);
        let log: String = log.lines().take(60).collect::<Vec<_>>().join("\n");
        Error::Compile {
            backend: "sim",
            kernel: format!("{} ({})", names.join(", "), cpp.display()),
            log,
        }
    };
    let mut objects = Vec::new();
    let results: Vec<Result<PathBuf>> = std::thread::scope(|sc| {
        let handles: Vec<_> = units
            .iter()
            .enumerate()
            .map(|(i, unit)| {
                let inc = &inc;
                sc.spawn(move || -> Result<PathBuf> {
                    let cpp = dir.join(format!("{key:016x}-{i}.cpp"));
                    write_atomic(&cpp, unit.as_bytes())?;
                    let obj = dir.join(format!("{key:016x}-{i}.o.tmp{pid}"));
                    let mut cmd = Command::new(cxx);
                    cmd.args(FLAGS)
                        .arg("-c")
                        .arg("-I")
                        .arg(inc)
                        .arg("-o")
                        .arg(&obj)
                        .arg(&cpp);
                    if i > 0 {
                        cmd.arg("-DKIVI_SIM_SWAP_ELSEWHERE");
                    }
                    let out = cmd.output().map_err(|e| sim_err(format!("cannot run {cxx}: {e}")))?;
                    if !out.status.success() {
                        let _ = std::fs::remove_file(&obj);
                        return Err(failed(&cpp, &out.stderr));
                    }
                    Ok(obj)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(sim_err("a compiler thread panicked"))))
            .collect()
    });
    let mut first_err = None;
    for r in results {
        match r {
            Ok(o) => objects.push(o),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let cleanup = |objs: &[PathBuf]| {
        for o in objs {
            let _ = std::fs::remove_file(o);
        }
    };
    if let Some(e) = first_err {
        cleanup(&objects);
        return Err(e);
    }
    let tmp = dir.join(format!("{key:016x}.so.tmp{pid}"));
    let out = Command::new(cxx)
        .args(["-shared", "-pthread", "-o"])
        .arg(&tmp)
        .args(&objects)
        .output()
        .map_err(|e| sim_err(format!("cannot run {cxx}: {e}")));
    cleanup(&objects);
    let out = out?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(failed(&dir.join(format!("{key:016x}-0.cpp")), &out.stderr));
    }
    std::fs::rename(&tmp, so).map_err(|e| sim_err(format!("cannot move {} into place: {e}", tmp.display())))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| sim_err(format!("cannot write {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(|e| sim_err(format!("cannot write {}: {e}", path.display())))
}

fn load(so: &Path, gens: &[&Generated]) -> Result<SimLibrary> {
    let c = CString::new(so.as_os_str().to_string_lossy().as_bytes())
        .map_err(|_| sim_err(format!("bad library path {}", so.display())))?;
    // SAFETY: a library we just built from our own sources; its static
    // initialisers only set up the shim's thread-locals.
    let handle = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a C string or null.
        let msg = unsafe {
            let e = dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(sim_err(format!("cannot load {}: {msg}", so.display())));
    }
    let mut kernels = HashMap::new();
    for g in gens {
        for e in &g.entry_points {
            let name = CString::new(symbol(g, e)).expect("symbol names are ASCII");
            // SAFETY: valid handle and C string.
            let f = unsafe { dlsym(handle, name.as_ptr()) };
            if f.is_null() {
                return Err(sim_err(format!("{} lacks symbol {}", so.display(), symbol(g, e))));
            }
            // SAFETY: KIVI_SIM_EXPORT defines the symbol with exactly this signature.
            let f: LaunchFn = unsafe { std::mem::transmute::<*mut c_void, LaunchFn>(f) };
            kernels.insert((g.hash, e.clone()), f);
        }
    }
    Ok(SimLibrary {
        path: so.to_path_buf(),
        kernels,
    })
}
