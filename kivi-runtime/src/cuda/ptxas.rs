//! Resource use of compiled kernels, from `ptxas -v`: registers per thread,
//! spill stores/loads, stack frame, static shared memory and constant bank
//! bytes per entry point. The tuner prunes on these before benchmarking
//! (DESIGN.md §6); the all-variants test records them per variant.

use super::compile::Arch;
use super::toolkit::Toolkit;
use crate::error::{Error, Result};
use std::path::Path;
use std::process::Command;

/// What `ptxas -v` reports for one entry point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub function: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
    /// Static shared memory, bytes.
    pub shared: u32,
    /// Constant bank 0 bytes (kernel parameters).
    pub cmem0: u32,
    pub barriers: u32,
}

impl Resources {
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// Number before `unit` in `text` ("10 registers" -> 10).
fn number_before(text: &str, unit: &str) -> Option<u32> {
    let i = text.find(unit)?;
    text[..i].split_whitespace().next_back()?.parse().ok()
}

/// Parses `ptxas -v` output (it writes its report to stderr).
///
/// ```
/// let log = "ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
///            ptxas info    : Function properties for k\n\
///            \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
///            ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]\n";
/// let r = kivi_runtime::cuda::ptxas::parse(log);
/// assert_eq!(r.len(), 1);
/// assert_eq!((r[0].registers, r[0].spill_stores, r[0].shared, r[0].cmem0), (40, 4, 2048, 400));
/// ```
pub fn parse(log: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    for line in log.lines() {
        let l = line.trim();
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(Resources {
                function: name,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if l.contains("bytes stack frame") {
            cur.stack_frame = number_before(l, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(l, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(l, "bytes spill loads").unwrap_or(0);
        } else if l.contains("Used ") && l.contains("registers") {
            cur.registers = number_before(l, "registers").unwrap_or(0);
            cur.barriers = number_before(l, "barriers").unwrap_or(0);
            cur.shared = number_before(l, "bytes smem").unwrap_or(0);
            cur.cmem0 = number_before(l, "bytes cmem[0]").unwrap_or(0);
        }
    }
    out
}

/// Runs `ptxas -v` on `ptx` for `arch` and parses its report.
pub fn resources(ptx: &str, arch: Arch) -> Result<Vec<Resources>> {
    let ptxas = Toolkit::get().ptxas.clone().ok_or_else(|| Error::Unavailable {
        backend: "cuda",
        reason: "ptxas was not found: run scripts/provision-cuda.sh or set KIVI_PTXAS".into(),
    })?;
    resources_with(&ptxas, ptx, arch)
}

/// [`resources`] with an explicit `ptxas` binary.
pub fn resources_with(ptxas: &Path, ptx: &str, arch: Arch) -> Result<Vec<Resources>> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("kivi-ptxas-{}-{n}.ptx", std::process::id()));
    let io = |e: std::io::Error| Error::Unavailable {
        backend: "cuda",
        reason: format!("running {}: {e}", ptxas.display()),
    };
    std::fs::write(&file, ptx).map_err(io)?;
    let out = Command::new(ptxas)
        .arg(format!("-arch={}", arch.name()))
        .arg("-v")
        .arg("-o")
        .arg("/dev/null")
        .arg(&file)
        .output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(io)?;
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(Error::Compile {
            backend: "cuda",
            kernel: format!("ptxas -arch={}", arch.name()),
            log: text,
        });
    }
    Ok(parse(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_two_entries_and_missing_fields() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_80'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'b' for 'sm_80'
ptxas info    : Function properties for b
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8192 bytes smem, 412 bytes cmem[0]
";
        let r = parse(log);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].function, "a");
        assert_eq!((r[0].registers, r[0].shared, r[0].cmem0), (12, 0, 380));
        assert!(!r[0].spills());
        assert_eq!(r[1].registers, 255);
        assert_eq!((r[1].stack_frame, r[1].spill_stores, r[1].spill_loads), (24, 20, 16));
        assert_eq!((r[1].shared, r[1].barriers), (8192, 1));
        assert!(r[1].spills());
    }
}
