//! `kivi inspect`: show cached tuning decisions and why they were made;
//! export a device's decisions as a bundle.

use crate::args::BackendChoice;
use kivi_tuner::decisions::{self, Distrust, Store};
use kivi_tuner::fingerprint::{Fingerprint, Toolchain};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Decision cache directory (default: $KIVI_CACHE_DIR, $XDG_CACHE_HOME/kivi or ~/.cache/kivi)
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Only entries of this scheme name
    #[arg(long)]
    scheme: Option<String>,
    /// Show every candidate, not only the chosen, the default, the fastest and the rejected
    #[arg(long)]
    all: bool,
    /// Print the decision files as JSON
    #[arg(long)]
    json: bool,
    /// Write this machine's decisions for one backend as a bundle to FILE
    /// (import with `kivi tune --import FILE`)
    #[arg(long)]
    export: Option<PathBuf>,
    /// Backend whose decisions `--export` writes
    #[arg(long, default_value = "cpu", value_parser = crate::args::backend(BACKENDS))]
    backend: BackendChoice,
}

/// The backends with decisions of their own to export.
const BACKENDS: &[BackendChoice] = &[BackendChoice::Cpu, BackendChoice::Sim, BackendChoice::Cuda];

pub fn run(args: Args) -> super::Result {
    let dir = decisions::cache_dir(args.cache_dir.as_deref())?;
    let here = Fingerprint::host_cpu();
    let toolchain = Toolchain::current("rustc");
    if let Some(out) = &args.export {
        let (fp, tc) = match args.backend {
            // `auto` and `reference` are not offered (BACKENDS); cpu is the safe reading.
            BackendChoice::Cpu | BackendChoice::Auto | BackendChoice::Reference => (here, toolchain),
            BackendChoice::Sim => {
                let dev = kivi_runtime::device::SimDevice::shared();
                let c = kivi_runtime::cuda::Compiler::new().ok();
                (
                    kivi_tuner::cuda::device_fingerprint(dev.as_ref()),
                    kivi_tuner::cuda::device_toolchain(dev.as_ref(), c.as_ref()),
                )
            }
            BackendChoice::Cuda => {
                let dev = kivi_runtime::cuda::CudaDevice::new(0).map_err(|e| format!("--backend cuda: {e}"))?;
                (
                    kivi_tuner::cuda::device_fingerprint(&dev),
                    kivi_tuner::cuda::device_toolchain(&dev, Some(dev.compiler())),
                )
            }
        };
        let what = fp.summary();
        let store = Store::new(dir.clone(), fp, tc);
        let n = decisions::export_bundle(&store, out)?;
        println!("exported {n} decisions for {what} to {}", out.display());
        return Ok(());
    }
    let files = decisions::scan(&dir);
    if files.is_empty() {
        println!("no decision files in {}", dir.display());
        return Ok(());
    }
    if args.json {
        let v: Vec<serde_json::Value> = files
            .iter()
            .map(|(p, r)| match r {
                Ok(f) => serde_json::json!({"path": p, "file": f}),
                Err(d) => serde_json::json!({"path": p, "error": d.to_string()}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?);
        return Ok(());
    }
    println!("decision cache: {}", dir.display());
    for (path, r) in &files {
        println!();
        println!("file {}", path.display());
        // A copy moved aside (`.bad-`/`.stale-`) is kept for reading here; no tuner reads it.
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let aside = name.contains(".json.bad-") || name.contains(".json.stale-");
        let f = match r {
            Ok(f) => f,
            Err(d) => {
                let hint = match d {
                    _ if aside => "a copy moved aside; never read by the tuner",
                    Distrust::Corrupt(_) | Distrust::Stale(_) => {
                        "the next `kivi tune` moves it aside and writes a fresh one"
                    }
                    Distrust::Foreign(_) => "it does not describe the device its name says",
                };
                println!("  ignored: {d} ({hint})");
                continue;
            }
        };
        let mine = f.device.backend == "cpu" && f.device == here;
        let status = if aside {
            "moved aside (kept for inspection, never read by the tuner)".to_string()
        } else if f.device.backend == "cpu" && !mine {
            "another device (not used here)".to_string()
        } else if mine && f.toolchain != toolchain {
            format!(
                "stale for this build ({}; this is {}): will be re-tuned",
                f.toolchain.summary(),
                toolchain.summary()
            )
        } else if mine {
            "this machine, in use".into()
        } else {
            "used where this device is present".into()
        };
        println!("  device: {}", f.device.summary());
        for (k, v) in &f.device.facts {
            println!("    {k}: {v}");
        }
        println!("  toolchain: {}", f.toolchain.summary());
        println!("  status: {status}");
        println!("  entries: {}", f.entries.len());
        for e in f.entries.values() {
            if args.scheme.as_ref().is_some_and(|s| *s != e.scheme) {
                continue;
            }
            println!();
            println!(
                "  {} (hash {}) bucket {}{}",
                e.scheme,
                e.scheme_hash,
                e.bucket,
                if e.pinned { " [pinned]" } else { "" }
            );
            println!("  chosen {}: {}", e.chosen, e.reason);
            println!("  measured: {}", e.method);
            if let Some(p) = e.peak_gbps {
                println!("  peak read bandwidth: {p:.1} GB/s (GB/s column: KV bytes read per call / median)");
            }
            super::tune::print_entry_table(e, args.all);
        }
    }
    Ok(())
}
