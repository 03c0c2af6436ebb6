//! The CUDA tuning target and the GPU benchmark on the simulated device:
//! the code that a GPU runs, run in CI.

use kivi_runtime::cuda::Arch;
use kivi_runtime::device::{Device, DeviceInfo, SimDevice};
use kivi_spec::{presets, Heads};
use kivi_tuner::bucket::Bucket;
use kivi_tuner::cuda::CudaTarget;
use kivi_tuner::decisions::{export_bundle, import_bundle, Store};
use kivi_tuner::gpu_bench::{self, GpuBenchOptions};
use kivi_tuner::tune::{self, DecisionOrigin, Plan, Target};
use std::sync::Arc;

fn tmp(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kivi-device-tune-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A simulated device that reports itself as an H100 with 114 SMs: the
/// decisions made on it are keyed by that fingerprint, travel in a bundle
/// and are found again after an import, never mixed with the real sim's.
#[test]
fn sim_decisions_under_a_fake_fingerprint_round_trip_through_a_bundle() {
    let fake = SimDevice::with_info(DeviceInfo {
        ordinal: 0,
        name: "NVIDIA H100 (fake, simulated)".into(),
        arch: Arch(90),
        sms: 114,
        l2_bytes: 50 << 20,
        mem_clock_khz: 2_619_000,
        bus_width_bits: 5120,
        total_mem: 80 << 30,
        driver_version: 13000,
    });
    let dev: Arc<dyn Device> = Arc::new(fake);
    let s = presets::kivi4().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
    let target = CudaTarget::sim(&s, dev).unwrap();
    let fp = target.device();
    assert_eq!(fp.backend, "sim");
    assert_eq!(fp.facts["sm_count"], "114");
    let dir = tmp("fake");
    let store = Store::new(dir.clone(), fp.clone(), target.toolchain());
    let plan = Plan {
        budget_s: 30.0,
        force: false,
        pin: None,
        resume: false,
    };
    let mut warnings = Vec::new();
    let buckets = [Bucket::of(2, 77, 2)];
    let out = tune::run(&target, &store, &s, &buckets, &plan, &mut (), &mut warnings);
    assert!(
        matches!(out[0].origin, DecisionOrigin::Tuned { .. }),
        "{:?} {warnings:?}",
        out[0].origin
    );
    let chosen = out[0].entry.as_ref().unwrap().chosen.clone();
    assert!(target.variant(&chosen).is_some(), "{chosen}");

    let bundle = dir.join("bundle.json");
    assert_eq!(export_bundle(&store, &bundle).unwrap(), 1);
    let other = tmp("fake-import");
    assert_eq!(import_bundle(&other, &bundle, &mut warnings).unwrap(), 1);
    let again = Store::new(other.clone(), fp, target.toolchain());
    let out = tune::run(&target, &again, &s, &buckets, &plan, &mut (), &mut warnings);
    assert!(matches!(out[0].origin, DecisionOrigin::Cached), "{:?}", out[0].origin);
    assert_eq!(out[0].entry.as_ref().unwrap().chosen, chosen);
    // The real simulated device has another fingerprint: no decision there.
    let real = CudaTarget::sim(&s, SimDevice::shared()).unwrap();
    assert_ne!(real.device(), target.device());
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other);
}

/// `benches/gpu_decode.rs` on the simulated device: every row checked
/// against the reference before it is timed; a sweep over variants.
#[test]
fn gpu_benchmark_runs_on_the_simulated_device() {
    let r = gpu_bench::run(SimDevice::shared(), &GpuBenchOptions::sim()).unwrap();
    let o = GpuBenchOptions::sim();
    assert_eq!(r.decode.len(), o.schemes.len() * o.batches.len() * o.contexts.len());
    assert_eq!(r.device.backend, "sim");
    for row in r.decode.iter().chain(&r.variant_sweep) {
        assert!(row.checked_rel_error <= gpu_bench::TOLERANCE, "{row:?}");
        assert!(row.timing.median_ms > 0.0 && row.kv_bytes > 0, "{row:?}");
    }
    assert_eq!(r.variant_sweep.len(), 2 * 3);
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"checked_rel_error\""));
}
