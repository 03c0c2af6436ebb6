//! Who measured a timing: the device fingerprint and the toolchain.
//!
//! A decision is only worth reusing on the same hardware built with the same
//! code generator. The fingerprint names the hardware by what it *is* (model,
//! core count, cache sizes, SIMD features; for a GPU its name, compute
//! capability, SM count, L2, memory bus, driver) — never by an ordinal such
//! as "device 0", which changes meaning between machines and boots. The
//! toolchain names what produced the code (crate version, decision-file
//! schema, build profile, NVRTC version for CUDA).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of the decision-file format. Bump on any incompatible change;
/// files with another schema are reported as stale and ignored.
pub const SCHEMA_VERSION: u32 = 1;

/// What a device is, as plain `key -> value` facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// `cpu` or `cuda`.
    pub backend: String,
    /// Human-readable device name (CPU model or GPU name).
    pub name: String,
    /// Every other identifying fact, sorted by key.
    pub facts: BTreeMap<String, String>,
}

impl Fingerprint {
    /// Stable 64-bit id of the whole fingerprint (FNV-1a over its fields in
    /// a fixed order), used in file names.
    pub fn id(&self) -> u64 {
        let mut text = format!("{}\n{}\n", self.backend, self.name);
        for (k, v) in &self.facts {
            text.push_str(k);
            text.push('=');
            text.push_str(v);
            text.push('\n');
        }
        kivi_spec::fnv1a64(text.as_bytes())
    }

    /// One line for tables and warnings.
    pub fn summary(&self) -> String {
        let mut s = format!("{} {}", self.backend, self.name);
        for key in ["cores", "sm_count", "cc", "l2", "llc"] {
            if let Some(v) = self.facts.get(key) {
                s.push_str(&format!(", {key} {v}"));
            }
        }
        s
    }

    /// The host CPU, read from `/proc/cpuinfo` and sysfs where they exist
    /// (facts that cannot be read are recorded as `unknown`, so two
    /// machines that both lack them still compare equal only on the rest).
    pub fn host_cpu() -> Fingerprint {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| -> Option<String> {
            cpuinfo.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
        };
        let name = field("model name")
            .or_else(|| field("Model"))
            .or_else(|| field("Hardware"))
            .unwrap_or_else(|| format!("unknown {} cpu", std::env::consts::ARCH));
        let mut facts = BTreeMap::new();
        facts.insert("arch".into(), std::env::consts::ARCH.to_string());
        // The number of threads this process may use (affinity and cgroup
        // limits included): that is what the kernel's parallelism sees.
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        facts.insert("cores".into(), cores.to_string());
        for (k, v) in cache_sizes() {
            facts.insert(k, v);
        }
        let flags = field("flags").or_else(|| field("Features")).unwrap_or_default();
        facts.insert("simd".into(), simd_features(&flags));
        Fingerprint {
            backend: "cpu".into(),
            name,
            facts,
        }
    }

    /// Last-level cache size in bytes, when known (used to size input
    /// rotation so that timed runs read KV from memory, not from cache).
    pub fn llc_bytes(&self) -> Option<u64> {
        let v = self.facts.get("llc").or_else(|| self.facts.get("l2"))?;
        parse_size(v)
    }
}

/// SIMD features that change which code is fast, in a fixed order.
fn simd_features(flags: &str) -> String {
    const KNOWN: &[&str] = &[
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "avx_vnni",
        "amx_tile",
        "neon",
        "asimd",
        "asimdhp",
        "sve",
        "sve2",
    ];
    let have: Vec<&str> = flags.split_whitespace().collect();
    let found: Vec<&str> = KNOWN.iter().copied().filter(|f| have.contains(f)).collect();
    if found.is_empty() {
        "none".into()
    } else {
        found.join(" ")
    }
}

/// `l1d`, `l2`, `l3` (and `llc`, the largest) from sysfs for cpu0.
fn cache_sizes() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut largest: Option<(u64, String)> = None;
    for i in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let read = |f: &str| {
            std::fs::read_to_string(format!("{dir}/{f}"))
                .ok()
                .map(|s| s.trim().to_string())
        };
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size")) else {
            continue;
        };
        if kind == "Instruction" {
            continue;
        }
        let key = if kind == "Data" {
            format!("l{level}d")
        } else {
            format!("l{level}")
        };
        if let Some(bytes) = parse_size(&size) {
            let bigger = match &largest {
                Some((b, _)) => bytes >= *b,
                None => true,
            };
            if bigger {
                largest = Some((bytes, size.clone()));
            }
        }
        out.push((key, size));
    }
    match largest {
        Some((_, s)) => out.push(("llc".into(), s)),
        None => out.push(("llc".into(), "unknown".into())),
    }
    out
}

/// `48K`, `2048K`, `32M`, `1G` or plain bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1u64 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok().map(|n| n * mul)
}

/// What produced the timed code. A decision written by another toolchain is
/// stale: the generated code (and so its speed) may differ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Toolchain {
    /// `kivi-tuner` crate version.
    pub kivi: String,
    /// Decision-file schema ([`SCHEMA_VERSION`]).
    pub schema: u32,
    /// `release` or `debug`: an unoptimised CPU kernel ranks variants differently.
    pub profile: String,
    /// The compiler of the kernels: `rustc` for the CPU backend, `nvrtc X.Y` for CUDA.
    pub compiler: String,
}

impl Toolchain {
    /// This build, with the given kernel compiler.
    pub fn current(compiler: &str) -> Toolchain {
        Toolchain {
            kivi: env!("CARGO_PKG_VERSION").to_string(),
            schema: SCHEMA_VERSION,
            profile: if cfg!(debug_assertions) { "debug" } else { "release" }.into(),
            compiler: compiler.to_string(),
        }
    }

    /// One line for warnings.
    pub fn summary(&self) -> String {
        format!(
            "kivi {} schema {} {} {}",
            self.kivi, self.schema, self.profile, self.compiler
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("48K"), Some(48 << 10));
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn host_fingerprint_is_stable_and_ordinal_free() {
        let a = Fingerprint::host_cpu();
        let b = Fingerprint::host_cpu();
        assert_eq!(a.id(), b.id());
        assert!(a.facts.contains_key("cores"));
        assert!(!a.facts.keys().any(|k| k.contains("ordinal") || k == "index"));
        let mut c = a.clone();
        c.facts.insert("cores".into(), "999".into());
        assert_ne!(a.id(), c.id());
    }
}
