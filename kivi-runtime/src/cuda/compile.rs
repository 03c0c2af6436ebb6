//! NVRTC compilation of generated CUDA source to PTX and CUBIN, through the
//! artifact cache.
//!
//! The options are spelled out in full ([`NvrtcOptions::args`]): the
//! architecture as `--gpu-architecture=sm_XX` (a real arch, so NVRTC also
//! hands back CUBIN the driver loads without JIT — the GPU machine's 13.0
//! driver cannot JIT newer PTX), `--std=c++17`, and every floating-point
//! flag explicitly (`--ftz`, `--prec-div`, `--prec-sqrt`, `--fmad`) rather
//! than `--use_fast_math`, whose meaning differs between tools. The
//! defaults keep IEEE division: the quantize kernels must produce the same
//! codes as the host, bit for bit.

use super::artifacts::{Artifact, ArtifactCache, ArtifactKey, Lookup};
use super::toolkit::{self, guarded, NvrtcVersion};
use crate::error::{Error, Result};
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::time::Instant;

/// A real GPU architecture, `sm_XX` (75 or newer for NVRTC 13).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch(pub u32);

impl Arch {
    pub const SM80: Arch = Arch(80);
    pub const SM90: Arch = Arch(90);
    /// From a compute capability `(major, minor)`.
    pub fn from_cc(major: i32, minor: i32) -> Arch {
        Arch((major * 10 + minor) as u32)
    }
    /// `sm_90`.
    pub fn name(&self) -> String {
        format!("sm_{}", self.0)
    }
    /// Reads `sm_90`, `sm90` or `90`.
    pub fn parse(s: &str) -> Result<Arch> {
        let d = s.trim().trim_start_matches("sm_").trim_start_matches("sm");
        d.parse::<u32>()
            .ok()
            .filter(|n| (50..=200).contains(n))
            .map(Arch)
            .ok_or_else(|| Error::Config(format!("`{s}` is not a GPU architecture; expected sm_80, sm_90, ...")))
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

/// Everything NVRTC is told, besides the include folder.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NvrtcOptions {
    pub arch: Arch,
    /// Flush denormals to zero.
    pub ftz: bool,
    /// IEEE-rounded division (needed for bit-exact quantization).
    pub prec_div: bool,
    pub prec_sqrt: bool,
    /// Contract `a * b + c` into FMA.
    pub fmad: bool,
    /// Anything else, passed verbatim after the rest.
    pub extra: Vec<String>,
}

impl NvrtcOptions {
    /// kivi's defaults for `arch`: exact division and square root, no
    /// flush-to-zero, FMA contraction on.
    pub fn for_arch(arch: Arch) -> NvrtcOptions {
        NvrtcOptions {
            arch,
            ftz: false,
            prec_div: true,
            prec_sqrt: true,
            fmad: true,
            extra: Vec::new(),
        }
    }

    /// The options that decide the output (the cache key's part): everything
    /// but the include folder, whose location differs between machines.
    pub fn args(&self) -> Vec<String> {
        let mut v = vec![
            format!("--gpu-architecture={}", self.arch.name()),
            "--std=c++17".to_string(),
            format!("--ftz={}", self.ftz),
            format!("--prec-div={}", self.prec_div),
            format!("--prec-sqrt={}", self.prec_sqrt),
            format!("--fmad={}", self.fmad),
            // ptxas (run by NVRTC to make the CUBIN) reports registers,
            // spills and shared memory into the log: the resource report
            // costs nothing extra this way.
            "--ptxas-options=-v".to_string(),
        ];
        v.extend(self.extra.iter().cloned());
        v
    }
}

/// Where an artifact came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Compiled now, in this many seconds.
    Compiled { seconds: f64 },
    /// Read from the artifact cache.
    Cached,
    /// The cache held a corrupt entry (reason); compiled again and replaced.
    Recompiled { seconds: f64, reason: String },
}

/// A compiled kernel module.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub name: String,
    pub key: ArtifactKey,
    pub arch: Arch,
    pub artifact: Artifact,
    pub origin: Origin,
}

impl Compiled {
    /// Registers, spills and shared memory per entry point, from the ptxas
    /// report in NVRTC's log (empty for a virtual arch, which runs no ptxas).
    pub fn resources(&self) -> Vec<super::ptxas::Resources> {
        super::ptxas::parse(&self.artifact.log)
    }
}

/// Compiles generated source with NVRTC, through an artifact cache.
///
/// In *offline* mode (no NVRTC on this machine, `KIVI_NVRTC_VERSION` set)
/// it only reads artifacts compiled elsewhere by that NVRTC version — how
/// prebuilt kernels reach a GPU machine that has a driver but no NVRTC.
#[derive(Clone, Debug)]
pub struct Compiler {
    version: String,
    include: Option<PathBuf>,
    cache: Option<ArtifactCache>,
    offline: bool,
}

impl Compiler {
    /// Loads NVRTC and uses the default artifact cache. Without NVRTC it
    /// falls back to offline mode when `KIVI_NVRTC_VERSION` is set, and
    /// otherwise returns [`Error::Unavailable`].
    pub fn new() -> Result<Compiler> {
        let cache = ArtifactCache::default_location();
        match Compiler::online() {
            Ok(c) => Ok(c.with_cache(cache)),
            Err(e) => match std::env::var("KIVI_NVRTC_VERSION") {
                Ok(v) if !v.trim().is_empty() => Ok(Compiler::offline(v.trim(), cache)),
                _ => Err(e),
            },
        }
    }

    /// NVRTC required (no cache until [`Compiler::with_cache`]).
    pub fn online() -> Result<Compiler> {
        let v: NvrtcVersion = toolkit::nvrtc()?;
        let include = toolkit::include_dir()?.to_path_buf();
        Ok(Compiler {
            version: v.to_string(),
            include: Some(include),
            cache: None,
            offline: false,
        })
    }

    /// A compiler that never compiles: it serves artifacts that NVRTC
    /// `version` put in `cache` and reports a miss as unavailable.
    pub fn offline(version: &str, cache: Option<ArtifactCache>) -> Compiler {
        Compiler {
            version: version.to_string(),
            include: None,
            cache,
            offline: true,
        }
    }

    pub fn with_cache(mut self, cache: Option<ArtifactCache>) -> Compiler {
        self.cache = cache;
        self
    }

    /// NVRTC's version (`13.0`), the toolchain half of every cache key.
    pub fn version(&self) -> &str {
        &self.version
    }
    pub fn is_offline(&self) -> bool {
        self.offline
    }
    pub fn cache(&self) -> Option<&ArtifactCache> {
        self.cache.as_ref()
    }

    /// Where the artifact of `name` compiled under `opts` lives (or would).
    pub fn artifact_path(&self, name: &str, source: &str, opts: &NvrtcOptions) -> Option<PathBuf> {
        let key = self.key(source, opts);
        self.cache.as_ref().map(|c| c.path(&file_name(name, opts.arch), key))
    }

    /// The cache key of `source` under `opts`.
    pub fn key(&self, source: &str, opts: &NvrtcOptions) -> ArtifactKey {
        ArtifactKey::new(source, &self.version, &opts.args(), &opts.arch.name())
    }

    /// Compiles `source` (named `name` in logs and file names), or reads it
    /// from the cache. A corrupt cache entry is reported in
    /// [`Compiled::origin`] and replaced.
    pub fn compile(&self, name: &str, source: &str, opts: &NvrtcOptions) -> Result<Compiled> {
        let key = self.key(source, opts);
        let mut corrupt = None;
        if let Some(cache) = &self.cache {
            match cache.load(&file_name(name, opts.arch), key) {
                Lookup::Hit(artifact) => {
                    return Ok(Compiled {
                        name: name.to_string(),
                        key,
                        arch: opts.arch,
                        artifact,
                        origin: Origin::Cached,
                    })
                }
                Lookup::Miss => {}
                Lookup::Corrupt(why) => corrupt = Some(why),
            }
        }
        if self.offline {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: format!(
                    "`{name}` ({}) is not in the artifact cache {} and NVRTC is not on this machine \
                     (offline mode, KIVI_NVRTC_VERSION={})",
                    opts.arch,
                    self.cache
                        .as_ref()
                        .map_or("(none)".to_string(), |c| c.dir().display().to_string()),
                    self.version
                ),
            });
        }
        let include = self.include.as_ref().expect("an online compiler has an include folder");
        let mut args = opts.args();
        args.push(format!("--include-path={}", include.display()));
        let t0 = Instant::now();
        let artifact = nvrtc_compile(name, source, &args)?;
        let seconds = t0.elapsed().as_secs_f64();
        if let Some(cache) = &self.cache {
            // A cache that cannot be written costs time, not correctness.
            if let Err(e) = cache.store(&file_name(name, opts.arch), key, &artifact) {
                eprintln!("kivi: cannot write artifact cache {}: {e}", cache.dir().display());
            }
        }
        let origin = match corrupt {
            None => Origin::Compiled { seconds },
            Some(reason) => Origin::Recompiled { seconds, reason },
        };
        Ok(Compiled {
            name: name.to_string(),
            key,
            arch: opts.arch,
            artifact,
            origin,
        })
    }
}

/// The readable half of an artifact's file name: the kernel name and arch
/// (`...-sm_90-<key>.kart`), so a bundle for one GPU can be picked by glob.
fn file_name(name: &str, arch: Arch) -> String {
    format!("{name}-{arch}")
}

fn cstr_lossy(v: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same size and alignment.
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) };
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Destroys the program on every path out of [`nvrtc_compile`].
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

/// One NVRTC compilation: PTX always, CUBIN when the arch is a real `sm_XX`.
fn nvrtc_compile(name: &str, source: &str, args: &[String]) -> Result<Artifact> {
    use cudarc::nvrtc::{result, sys};
    let fail = |log: String| Error::Compile {
        backend: "cuda",
        kernel: name.to_string(),
        log,
    };
    let src = CString::new(source).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let cname = CString::new(name.replace('\0', "")).expect("NULs removed");
    guarded("NVRTC", || {
        let prog = Program(
            result::create_program(&src, Some(&cname)).map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?,
        );
        // SAFETY: prog is a live program; options are plain ASCII strings.
        let compiled = unsafe { result::compile_program(prog.0, args) };
        // SAFETY: prog is live.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| cstr_lossy(&l))
            .unwrap_or_default();
        if let Err(e) = compiled {
            return Err(fail(format!("{e:?} with options {args:?}\n{log}")));
        }
        // SAFETY: prog is live and compiled.
        let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| fail(format!("nvrtcGetPTX: {e:?}")))?;
        let ptx = cstr_lossy(&ptx);
        let mut cubin = Vec::new();
        let real_arch = args.iter().any(|a| a.starts_with("--gpu-architecture=sm_"));
        if real_arch {
            let mut size = 0usize;
            // SAFETY: prog is live; size is a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
            cubin = vec![0u8; size];
            if size > 0 {
                // SAFETY: cubin holds `size` bytes as NVRTC asked.
                unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
            }
        }
        Ok(Artifact { ptx, cubin, log })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_explicit() {
        let a = NvrtcOptions::for_arch(Arch::SM90).args();
        assert_eq!(
            a,
            [
                "--gpu-architecture=sm_90",
                "--std=c++17",
                "--ftz=false",
                "--prec-div=true",
                "--prec-sqrt=true",
                "--fmad=true",
                "--ptxas-options=-v"
            ]
        );
    }

    #[test]
    fn arch_parse() {
        assert_eq!(Arch::parse("sm_90").unwrap(), Arch::SM90);
        assert_eq!(Arch::parse("80").unwrap(), Arch::SM80);
        assert_eq!(Arch::from_cc(9, 0), Arch::SM90);
        assert!(Arch::parse("compute_90x").is_err());
        assert!(Arch::parse("").is_err());
    }
}
