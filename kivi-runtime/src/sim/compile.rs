//! Generated sources -> one host shared library, cached by content hash,
//! and the launch entry the device layer calls ([`SimLibrary::launch_raw`]).
//!
//! Many variants go into one translation unit (headers are parsed once):
//! each source is wrapped in its own namespace, its `extern "C"` entry
//! points renamed by `#define` to `kivi_v<hash>_<entry>`, and exported
//! through `KIVI_SIM_EXPORT` as `kivi_sim_<hash>_<entry>` (see
//! `templates/cuda/sim_shim.h`, whose header comment describes what the
//! simulator checks).

use crate::cuda::Arch;
use crate::error::{Error, Result};
use kivi_templates::{EntryLaunch, Generated};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// Flags every sim library is built with, chosen to match the NVRTC build
/// (`kivi-runtime/src/cuda/compile.rs`: `--std=c++17 --fmad=true --ftz=false
/// --prec-div=true --prec-sqrt=true`):
///
/// * `-std=c++17`: NVRTC's dialect, so a template that only compiles as
///   C++20 fails here too.
/// * `-ffp-contract=fast` (+ `-fexpensive-optimizations`, without which GCC
///   forms no FMAs at `-O1`, + `-mfma` where the CPU has FMA): like
///   `--fmad=true`, the compiler may fuse `a * b + c`. The `__fadd_rn`,
///   `__fsub_rn`, `__fmul_rn`, `__fdiv_rn` intrinsics, which CUDA never fuses
///   and the prefill/append quantization relies on to match the host bit for
///   bit, are opaque to the optimizer in the shim (an empty `asm`), so they
///   stay unfused here too. Which products get fused still differs between
///   GCC and NVCC, so decode results differ from a GPU's in the last bits,
///   as they would between two NVCC versions; the decode tests compare with
///   the oracle at 1e-4 relative, far above that. (Measured on the 98 decode
///   variants of the presets at MHA 8 d64: the worst relative error against
///   the oracle, 8.9e-8 to 1.2e-7 per preset, is the same to three digits
///   with contraction on and off.)
/// * no `-ffast-math`: IEEE division and square root, subnormals kept (the
///   `--ftz=false --prec-div=true --prec-sqrt=true` NVRTC defaults).
fn flags() -> &'static [String] {
    static FLAGS: OnceLock<Vec<String>> = OnceLock::new();
    FLAGS.get_or_init(|| {
        let mut f: Vec<String> = [
            "-std=c++17",
            "-O1",
            "-fexpensive-optimizations",
            "-fPIC",
            "-pthread",
            "-ffp-contract=fast",
            "-fno-strict-aliasing",
            "-Wno-unknown-pragmas",
            "-Wno-unused-variable",
            "-Wno-unused-but-set-variable",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            f.push("-mfma".into());
        }
        f
    })
}

/// The compiler flags sim libraries are built with (see [`flags`] in the source
/// for why each).
pub fn compile_flags() -> Vec<String> {
    flags().to_vec()
}

// dlopen(3) and friends, from the C library (glibc >= 2.34 has them in libc).
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

/// `int f(const unsigned* dims, void** args, const kivi_sim::Options* opts,
/// char* err, int errlen)`.
pub(crate) type LaunchFn =
    unsafe extern "C" fn(*const u32, *mut *mut c_void, *const RawOptions, *mut c_char, c_int) -> c_int;

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

/// How the simulator orders the threads of a block (see `sim_shim.h`).
///
/// A thread runs until it waits at a barrier or warp collective; then the
/// first ready thread of a priority order runs. The order is drawn afresh at
/// every `__syncthreads()`, and a warp is released as soon as its last lane
/// arrives at a collective, so the first warp of the order runs as far ahead
/// as the barriers allow. A missing barrier then changes the answer under
/// one order or another. Every schedule is deterministic: the same schedule
/// gives the same result whatever the number of worker threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Thread 0 first, then 1, ...
    InOrder,
    /// The last thread first.
    Reverse,
    /// Random orders drawn from (seed, block, barrier phase): whole warps in
    /// a random order (lanes up, down or shuffled), or all threads shuffled.
    Seeded(u64),
}

impl Schedule {
    /// The schedules a strict check runs a kernel under: both thread orders
    /// and two seeds.
    pub const STRICT: [Schedule; 4] = [
        Schedule::InOrder,
        Schedule::Reverse,
        Schedule::Seeded(1),
        Schedule::Seeded(2),
    ];

    /// Reads `inorder` (or `in-order`), `reverse`, `<seed>` or `seeded:<seed>`
    /// (the spellings of `KIVI_SIM_SCHEDULE`).
    pub fn parse(s: &str) -> Result<Schedule> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "inorder" | "in-order" | "in_order" => Ok(Schedule::InOrder),
            "reverse" => Ok(Schedule::Reverse),
            _ => t
                .strip_prefix("seeded:")
                .unwrap_or(&t)
                .parse::<u64>()
                .map(Schedule::Seeded)
                .map_err(|_| {
                    Error::Config(format!(
                        "`{s}` is not a sim schedule; expected inorder, reverse, or a seed (a number)"
                    ))
                }),
        }
    }

    /// The byte shared memory is poisoned with under this schedule (unless
    /// [`SimOptions::poison`] says otherwise): `0xff` (every float NaN, which
    /// sums and products carry to the output) or `0x7f` (a huge finite float,
    /// which `fmaxf` does not ignore as it ignores NaN), alternating.
    pub fn poison(&self) -> u8 {
        match self {
            Schedule::InOrder => 0xff,
            Schedule::Reverse => 0x7f,
            Schedule::Seeded(s) => {
                if s % 2 == 0 {
                    0xff
                } else {
                    0x7f
                }
            }
        }
    }
}

impl Default for Schedule {
    /// `Seeded(0)`: random orders, different in every block and phase.
    fn default() -> Schedule {
        Schedule::Seeded(0)
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Schedule::InOrder => f.write_str("inorder"),
            Schedule::Reverse => f.write_str("reverse"),
            Schedule::Seeded(s) => write!(f, "seeded:{s}"),
        }
    }
}

/// What the driver would check before a launch, per architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchLimits {
    pub max_threads_per_block: u32,
    /// Per block dimension (x, y, z).
    pub max_block: [u32; 3],
    /// Per grid dimension (x, y, z).
    pub max_grid: [u32; 3],
    /// Static (`__shared__`) memory per block, bytes.
    pub max_static_shared: u32,
    /// Dynamic shared memory a kernel may opt in to, bytes (not used by the
    /// kivi kernels; for the tuner's pruning).
    pub max_shared_optin: u32,
}

impl ArchLimits {
    /// The limits of `arch` (compute capability 5.0 and newer share all but
    /// the opt-in shared memory).
    pub fn of(arch: Arch) -> ArchLimits {
        let optin_kib = match arch.0 {
            70 | 72 => 96,
            75 => 64,
            80 | 87 => 163,
            86 | 89 | 120 | 121 => 99,
            90.. => 227,
            _ => 48,
        };
        ArchLimits {
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            max_static_shared: 48 * 1024,
            max_shared_optin: optin_kib * 1024,
        }
    }
}

/// Options of one simulated launch.
///
/// `Default` is what the test suite uses: [`Schedule::default`] on sm_90;
/// [`SimOptions::current`] adds the `KIVI_SIM_SCHEDULE` / `KIVI_SIM_ARCH`
/// environment variables and [`SimOptions::scope`] overrides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimOptions {
    pub schedule: Schedule,
    /// The architecture whose launch limits are checked.
    pub arch: Arch,
    /// The byte every shared array is filled with at block start; `None`:
    /// [`Schedule::poison`].
    pub poison: Option<u8>,
    /// Worker threads running blocks; `None`: `$KIVI_SIM_THREADS` or the CPU
    /// count. Results do not depend on it.
    pub workers: Option<u32>,
}

impl Default for SimOptions {
    fn default() -> SimOptions {
        SimOptions {
            schedule: Schedule::default(),
            arch: Arch::SM90,
            poison: None,
            workers: None,
        }
    }
}

thread_local! {
    static SCOPED: Cell<Option<SimOptions>> = const { Cell::new(None) };
}

impl SimOptions {
    /// The defaults with `schedule`.
    pub fn with_schedule(schedule: Schedule) -> SimOptions {
        SimOptions {
            schedule,
            ..SimOptions::default()
        }
    }

    /// The defaults, with the schedule from `KIVI_SIM_SCHEDULE`
    /// (`inorder`, `reverse` or a seed) and the architecture from
    /// `KIVI_SIM_ARCH` (`sm_90`, ...) when set. A value that does not parse
    /// is an error, not ignored.
    pub fn from_env() -> Result<SimOptions> {
        let mut o = SimOptions::default();
        if let Ok(s) = std::env::var("KIVI_SIM_SCHEDULE") {
            if !s.trim().is_empty() {
                o.schedule = Schedule::parse(&s).map_err(|_| {
                    Error::Config(format!(
                        "KIVI_SIM_SCHEDULE=`{s}` is not a sim schedule; expected inorder, reverse, or a seed (a number)"
                    ))
                })?;
            }
        }
        if let Ok(a) = std::env::var("KIVI_SIM_ARCH") {
            if !a.trim().is_empty() {
                o.arch = Arch::parse(&a).map_err(|_| {
                    Error::Config(format!(
                        "KIVI_SIM_ARCH=`{a}` is not a GPU architecture; expected sm_80, sm_90, ..."
                    ))
                })?;
            }
        }
        Ok(o)
    }

    /// The options launches on this thread should use: those of the
    /// innermost enclosing [`SimOptions::scope`], else [`SimOptions::from_env`].
    /// `sim::launch` uses them; so should a device layer that is not handed
    /// explicit options.
    pub fn current() -> Result<SimOptions> {
        match SCOPED.with(|c| c.get()) {
            Some(o) => Ok(o),
            None => SimOptions::from_env(),
        }
    }

    /// Runs `f` with [`SimOptions::current`] returning `self` on this thread
    /// (restored afterwards, also on panic): how a test runs code that
    /// launches internally under several schedules.
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<SimOptions>);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPED.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(SCOPED.with(|c| c.replace(Some(self))));
        f()
    }
}

/// `kivi_sim::Options` of `sim_shim.h`, field for field.
#[repr(C)]
pub(crate) struct RawOptions {
    size: u32,
    schedule: u32,
    seed: u64,
    poison: u32,
    max_shared: u32,
    declared_shared: u32,
    workers: u32,
}

/// The `__launch_bounds__(N)` of `entry` in `source`, if any.
fn launch_bounds(source: &str, entry: &str) -> Option<u32> {
    source.lines().find_map(|l| {
        let rest = l.split("__launch_bounds__(").nth(1)?;
        let (n, after) = rest.split_once(')')?;
        let name = after.trim_start().split('(').next()?.trim();
        (name == entry).then(|| n.split(',').next()?.trim().parse().ok())?
    })
}

/// The driver's checks of a launch shape against `arch`.
pub fn check_launch(
    el: &EntryLaunch,
    source: &str,
    grid: [u32; 3],
    block: [u32; 3],
    arch: Arch,
) -> std::result::Result<(), String> {
    let lim = ArchLimits::of(arch);
    let axes = ["x", "y", "z"];
    for i in 0..3 {
        if block[i] == 0 || block[i] > lim.max_block[i] {
            return Err(format!(
                "block dimension {} = {} is outside 1..={} on {arch}",
                axes[i], block[i], lim.max_block[i]
            ));
        }
        if grid[i] == 0 || grid[i] > lim.max_grid[i] {
            return Err(format!(
                "grid dimension {} = {} is outside 1..={} on {arch}",
                axes[i], grid[i], lim.max_grid[i]
            ));
        }
    }
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    if threads > lim.max_threads_per_block as u64 {
        return Err(format!(
            "a block of {threads} threads ({}x{}x{}) exceeds the {} threads per block of {arch}",
            block[0], block[1], block[2], lim.max_threads_per_block
        ));
    }
    if let Some(n) = launch_bounds(source, &el.entry) {
        if threads > n as u64 {
            return Err(format!(
                "a block of {threads} threads exceeds the kernel's __launch_bounds__({n})"
            ));
        }
    }
    if el.shared_bytes > lim.max_static_shared {
        return Err(format!(
            "{} bytes of static shared memory per block exceed the {}-byte limit of {arch}",
            el.shared_bytes, lim.max_static_shared
        ));
    }
    Ok(())
}

/// Appends the text of every `<hash>.cu:<line>` of `g` a message names.
fn annotate(msg: &str, g: &Generated) -> String {
    let tag = format!("{:016x}.cu:", g.hash);
    let lines: Vec<&str> = g.source.lines().collect();
    let mut seen = Vec::new();
    let mut out = msg.to_string();
    for part in msg.split(&tag).skip(1) {
        let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
        let Ok(n) = digits.parse::<usize>() else { continue };
        if seen.contains(&n) || n == 0 || n > lines.len() {
            continue;
        }
        seen.push(n);
        let _ = write!(out, "\n  {tag}{n}: {}", lines[n - 1].trim());
    }
    out
}

impl SimLibrary {
    /// Launches entry point `entry` of `g` on `grid` blocks of `block`
    /// threads, like `cuLaunchKernel`: `args[i]` points at the value of the
    /// i-th kernel argument (a device pointer — here a host pointer — or a
    /// scalar), in the order of `g.launch.entry(entry).params`.
    ///
    /// Before running, the launch shape is checked as the driver would for
    /// `opts.arch` ([`check_launch`]); while running, everything `sim_shim.h`
    /// checks (barriers, warp collectives, shared memory, vector-load
    /// alignment). A failure is an `Err` naming the block, thread and source
    /// line (with its text), never a panic or an abort.
    ///
    /// # Safety
    /// `args` must hold one pointer per parameter, each to a value of the
    /// parameter's type, and every buffer must be as large as the kernel
    /// indexes it for this grid (the kernel argument docs of
    /// [`kivi_templates`] say how large); none of that can be checked here.
    /// Vector loads need buffers aligned as a GPU allocation would be (16
    /// bytes is enough; `malloc` gives that).
    pub unsafe fn launch_raw(
        &self,
        g: &Generated,
        entry: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [*mut c_void],
        opts: &SimOptions,
    ) -> Result<()> {
        let f = self.get(g, entry)?;
        let el = g
            .launch
            .entry(entry)
            .ok_or_else(|| Error::Config(format!("{} has no entry point `{entry}`", g.name)))?;
        if args.len() != el.params.len() {
            return Err(Error::Config(format!(
                "`{entry}` of {} takes {} arguments, {} given",
                g.name,
                el.params.len(),
                args.len()
            )));
        }
        check_launch(el, &g.source, grid, block, opts.arch)
            .map_err(|e| Error::Config(format!("sim: launch of {} `{entry}` refused: {e}", g.name)))?;
        let raw = RawOptions {
            size: std::mem::size_of::<RawOptions>() as u32,
            schedule: match opts.schedule {
                Schedule::InOrder => 0,
                Schedule::Reverse => 1,
                Schedule::Seeded(_) => 2,
            },
            seed: match opts.schedule {
                Schedule::Seeded(s) => s,
                _ => 0,
            },
            poison: opts.poison.unwrap_or_else(|| opts.schedule.poison()) as u32,
            max_shared: ArchLimits::of(opts.arch).max_static_shared,
            declared_shared: el.shared_bytes,
            workers: opts.workers.unwrap_or(0),
        };
        let dims = [grid[0], grid[1], grid[2], block[0], block[1], block[2]];
        let mut err = vec![0 as c_char; 4096];
        let rc = f(
            dims.as_ptr(),
            args.as_mut_ptr(),
            &raw,
            err.as_mut_ptr(),
            err.len() as c_int,
        );
        if rc != 0 {
            let msg = CStr::from_ptr(err.as_ptr()).to_string_lossy().into_owned();
            return Err(Error::Config(format!(
                "sim: {} `{entry}` failed ({}): {}",
                g.name,
                opts.schedule,
                annotate(&msg, g)
            )));
        }
        Ok(())
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
    let key = kivi_spec::fnv1a64(format!("{cxx}\n{}\n{shim}\n{}", flags().join(" "), units.join("\n")).as_bytes());
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
    // Unique per call, not only per process: two threads of one test binary
    // may build the same library at once and must not share temporaries.
    let pid = temp_suffix();
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
                let (inc, pid) = (&inc, &pid);
                sc.spawn(move || -> Result<PathBuf> {
                    let cpp = dir.join(format!("{key:016x}-{i}.cpp"));
                    write_atomic(&cpp, unit.as_bytes())?;
                    let obj = dir.join(format!("{key:016x}-{i}.o.tmp{pid}"));
                    let mut cmd = Command::new(cxx);
                    cmd.args(flags())
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
    let tmp = path.with_extension(format!("tmp{}", temp_suffix()));
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

/// `PID-N`, different for every call in this process: names temporary files
/// that are renamed into place, so concurrent builds never collide.
fn temp_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}
