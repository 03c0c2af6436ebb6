//! Finding the CUDA pieces at run time: NVRTC (`libnvrtc.so.13`), the
//! headers it needs (`cuda_fp16.h`, `cuda_bf16.h`), `ptxas` for resource
//! reports, and the driver (`libcuda.so.1`).
//!
//! Nothing here needs a system toolkit. The search order for the toolkit
//! folder (one holding `lib/`, `include/` and `bin/`) is:
//! 1. `$KIVI_CUDA_HOME` (when set, the only folder searched);
//! 2. the project-local `.cache/nvidia` that `scripts/provision-cuda.sh`
//!    fills from NVIDIA's PyPI wheels (they unpack to `nvidia/cu13/`),
//!    looked for in the current directory and its ancestors;
//! 3. `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
//!
//! cudarc opens libraries by *name* (`libnvrtc.so.13`, ...), which only
//! finds a wheel's copy through `LD_LIBRARY_PATH`, and that is read once at
//! process start. So kivi first opens the library by its full path and keeps
//! it open: the dynamic loader then hands cudarc the already-loaded object
//! for the same soname. `LD_LIBRARY_PATH` still works when set.
//!
//! cudarc panics when a library or a symbol is missing; every first touch
//! of a library here runs under `catch_unwind` and turns that into
//! [`Error::Unavailable`], so a machine without CUDA never sees a panic.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where the toolkit pieces live on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Toolkit {
    /// The toolkit folder (holds `lib/`, `include/`, `bin/`), if one was found.
    pub home: Option<PathBuf>,
    /// `libnvrtc.so.13` opened by full path, when `home` has one.
    pub nvrtc_lib: Option<PathBuf>,
    /// Folder with `cuda_fp16.h` and `cuda_bf16.h`, passed to NVRTC as `-I`.
    pub include: Option<PathBuf>,
    /// The `ptxas` binary (`$KIVI_PTXAS` first).
    pub ptxas: Option<PathBuf>,
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

/// The folders to try, in order.
fn candidate_homes() -> Vec<PathBuf> {
    let mut out = Vec::new();
    // An explicit home is the only place searched: it is how a user (or a
    // test) points kivi at one toolkit, or at none.
    if let Some(h) = std::env::var_os("KIVI_CUDA_HOME") {
        return vec![PathBuf::from(h)];
    }
    // The provisioned wheels: .cache/nvidia/nvidia/cu13 under the current
    // directory or an ancestor (tests run from the crate folder, the CLI
    // from anywhere inside the checkout).
    if let Ok(mut dir) = std::env::current_dir() {
        loop {
            out.push(dir.join(".cache/nvidia/nvidia/cu13"));
            if !dir.pop() {
                break;
            }
        }
    }
    // Where this crate was built from, for test binaries run elsewhere.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Some(root) = manifest.parent() {
        out.push(root.join(".cache/nvidia/nvidia/cu13"));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            out.push(PathBuf::from(h));
        }
    }
    out.push(PathBuf::from("/usr/local/cuda"));
    out
}

fn find_nvrtc_in(lib: &Path) -> Option<PathBuf> {
    for dir in [lib.join("lib"), lib.join("lib64")] {
        let exact = dir.join("libnvrtc.so.13");
        if exact.is_file() {
            return Some(exact);
        }
        if let Ok(rd) = std::fs::read_dir(&dir) {
            let mut names: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    n.starts_with("libnvrtc.so") && !n.contains("builtins")
                })
                .collect();
            names.sort();
            if let Some(p) = names.into_iter().next() {
                return Some(p);
            }
        }
    }
    None
}

impl Toolkit {
    /// Looks for the toolkit on this machine (no library is opened).
    pub fn discover() -> Toolkit {
        let mut tk = Toolkit {
            home: None,
            nvrtc_lib: None,
            include: None,
            ptxas: None,
        };
        for home in candidate_homes() {
            let lib = find_nvrtc_in(&home);
            let include = home.join("include");
            let has_headers = include.join("cuda_fp16.h").is_file();
            if lib.is_some() || has_headers {
                tk.home = Some(home.clone());
                tk.nvrtc_lib = lib;
                tk.include = has_headers.then_some(include);
                let ptxas = home.join("bin/ptxas");
                tk.ptxas = ptxas.is_file().then_some(ptxas);
                break;
            }
        }
        if let Some(p) = std::env::var_os("KIVI_PTXAS") {
            let p = PathBuf::from(p);
            if p.is_file() {
                tk.ptxas = Some(p);
            }
        }
        tk
    }

    /// The toolkit found on first use, for the life of the process.
    pub fn get() -> &'static Toolkit {
        static TK: OnceLock<Toolkit> = OnceLock::new();
        TK.get_or_init(Toolkit::discover)
    }
}

/// Runs `f`, turning a panic from inside cudarc into an error.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            // cudarc's messages are long; the first sentence says it.
            let first = msg.split(" - ").next().unwrap_or(&msg).to_string();
            Err(unavailable(format!("{what}: {first}")))
        }
    }
}

/// NVRTC's `(major, minor)` once it is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NvrtcVersion {
    pub major: i32,
    pub minor: i32,
}

impl std::fmt::Display for NvrtcVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Loads NVRTC (once per process) and returns its version, or why it cannot.
///
/// Set `KIVI_CUDA_DISABLE=nvrtc` (or `all`) to act as if it were absent,
/// which is how the tests check the no-toolkit path on a machine that has one.
pub fn nvrtc() -> Result<NvrtcVersion> {
    static LOADED: OnceLock<std::result::Result<NvrtcVersion, String>> = OnceLock::new();
    if disabled("nvrtc") {
        return Err(unavailable("NVRTC is disabled by KIVI_CUDA_DISABLE"));
    }
    LOADED
        .get_or_init(|| load_nvrtc().map_err(|e| e.to_string()))
        .clone()
        .map_err(|reason| {
            // The stored message already names the backend; strip the prefix.
            let reason = reason
                .strip_prefix("the cuda backend is unavailable: ")
                .unwrap_or(&reason)
                .to_string();
            unavailable(reason)
        })
}

pub(crate) fn disabled(what: &str) -> bool {
    std::env::var("KIVI_CUDA_DISABLE")
        .map(|v| v.split(',').any(|x| x.trim() == what || x.trim() == "all"))
        .unwrap_or(false)
}

fn load_nvrtc() -> Result<NvrtcVersion> {
    let tk = Toolkit::get();
    if let Some(path) = &tk.nvrtc_lib {
        // NVRTC opens its builtins library by name at compile time; open it
        // first, by full path, so that lookup finds it too.
        if let Some(dir) = path.parent() {
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    if n.starts_with("libnvrtc-builtins.so.") {
                        let _ = preload(&e.path());
                    }
                }
            }
        }
        preload(path)?;
    }
    guarded("NVRTC", || {
        // SAFETY: only probes whether the library can be opened by name.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable(
                "NVRTC (libnvrtc.so.13) was not found: run scripts/provision-cuda.sh, \
                 or set KIVI_CUDA_HOME to a folder with lib/libnvrtc.so.13 and include/cuda_fp16.h",
            ));
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-pointers to live integers.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        r.result()
            .map_err(|e| unavailable(format!("nvrtcVersion failed: {e:?}")))?;
        Ok(NvrtcVersion { major, minor })
    })
}

/// Opens a library by full path and keeps it open for the life of the
/// process, so that later by-name lookups of its soname resolve to it.
fn preload(path: &Path) -> Result<()> {
    // SAFETY: loading NVRTC runs its initialisers, which have no
    // preconditions; the handle is leaked on purpose and never closed.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    };
    match lib {
        Ok(lib) => {
            std::mem::forget(lib);
            Ok(())
        }
        Err(e) => Err(unavailable(format!("cannot open {}: {e}", path.display()))),
    }
}

/// Whether a CUDA driver library can be opened (no device is touched).
pub fn driver_present() -> bool {
    if disabled("driver") {
        return false;
    }
    // SAFETY: only probes whether the library can be opened by name.
    guarded("driver", || Ok(unsafe { cudarc::driver::sys::is_culib_present() })).unwrap_or(false)
}

/// The include folder, or why NVRTC cannot compile kivi's kernels.
pub fn include_dir() -> Result<&'static Path> {
    Toolkit::get().include.as_deref().ok_or_else(|| {
        unavailable(
            "the CUDA headers (cuda_fp16.h, cuda_bf16.h) were not found: run scripts/provision-cuda.sh \
             or set KIVI_CUDA_HOME",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_turns_panics_into_unavailable() {
        let e = guarded::<()>("probe", || panic!("Unable to load - searched")).unwrap_err();
        assert_eq!(e.to_string(), "the cuda backend is unavailable: probe: Unable to load");
    }
}
