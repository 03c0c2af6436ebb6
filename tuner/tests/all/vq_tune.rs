//! `vq(...)` schemes on the CUDA tuning target (run on the simulated
//! device): the variant space has the lookup-table kernel's variants, every
//! candidate is checked against the reference on caches built with the
//! calibration's codebooks, and the calibration hash keys the decision.

use kivi_runtime::calib::{identity, Calibration, LayerSamples, ModelId};
use kivi_runtime::device::SimDevice;
use kivi_runtime::vq::VqFitOptions;
use kivi_spec::{parse_scheme, Heads, Scheme};
use kivi_templates::{variants, Kernel};
use kivi_tuner::cuda::CudaTarget;
use kivi_tuner::decisions::Store;
use kivi_tuner::tune::{self, decision_hash, DecisionOrigin, Plan, Target};
use kivi_tuner::Bucket;

fn vq_scheme() -> Scheme {
    parse_scheme("v { key: vq(dim = 4, entries = 16), value: vq(dim = 4, entries = 64), residual: 8 }")
        .unwrap()
        .with_shape(Heads::Gqa { q: 4, kv: 2 }, 32)
        .unwrap()
}

fn calibration(s: &Scheme, seed: u64) -> Calibration {
    let mut rng = kivi_runtime::rand::Rng::new(seed);
    let x = LayerSamples::new(0, 96, 4, 2, 32, rng.vec(96 * 64), rng.vec(96 * 64));
    let mut c = Calibration::new(
        ModelId {
            name: "toy".into(),
            layers: 1,
            kv_heads: 2,
            head_dim: 32,
        },
        format!("draw {seed}"),
    );
    let opts = VqFitOptions {
        iterations: 4,
        ..Default::default()
    };
    c.fit_vq(s, &[x], opts).unwrap();
    c
}

#[test]
fn vq_tunes_on_the_simulated_device_under_its_calibration() {
    if kivi_runtime::sim::find_compiler().is_err() {
        println!("SKIP vq_tune: no C++ compiler for the simulator");
        return;
    }
    let s = vq_scheme();
    let n = variants(&s, Kernel::Decode).len();
    assert!(n >= 8, "{n} vq decode variants");
    let cal = calibration(&s, 1);
    // Without the calibration the target exists (the sources do not
    // depend on it) but its inputs cannot be built: a failed decision.
    let bare = CudaTarget::sim(&s, SimDevice::shared()).unwrap();
    assert_eq!(bare.calibration_hash(), None);
    // A layer the calibration does not have is refused up front.
    let e = CudaTarget::sim(&s, SimDevice::shared())
        .unwrap()
        .with_calibration(&cal, 3)
        .err()
        .unwrap();
    assert!(e.contains("layer 3"), "{e}");
    let target = CudaTarget::sim(&s, SimDevice::shared())
        .unwrap()
        .with_calibration(&cal, 0)
        .unwrap();
    assert_eq!(target.calibration_hash(), Some(cal.hash()));
    assert_eq!(
        decision_hash(&target, &s),
        identity(kivi_spec::scheme_hash(&s), Some(cal.hash()))
    );
    tunes_to_a_variant(&target, &s, Bucket::of(2, 77, 2), "vq");
    // Another calibration: another key, so nothing is served from the first.
    let other = CudaTarget::sim(&s, SimDevice::shared())
        .unwrap()
        .with_calibration(&calibration(&s, 2), 0)
        .unwrap();
    assert_ne!(decision_hash(&other, &s), decision_hash(&target, &s));
}

/// `levels = nuq` schemes (here 2c64 pinned-minmax pre-RoPE keys and nuq
/// values) on the CUDA target: the tables are baked into the sources, so
/// the target has no candidates until `with_calibration` generates them;
/// then every candidate is checked against the reference on caches built
/// with the calibration, and another calibration gives other sources.
#[test]
fn nuq_tunes_on_the_simulated_device_with_its_tables_baked_in() {
    if kivi_runtime::sim::find_compiler().is_err() {
        println!("SKIP nuq tune: no C++ compiler for the simulator");
        return;
    }
    let s = parse_scheme(
        "m { key: quant(bits = 2, axis = channel, group = 64, levels = nuq, norm = minmax_pinned), \
         value: quant(bits = 2, axis = token, group = 32, levels = nuq, norm = l2), residual: 16, sinks: 2, \
         rope: pre(theta = 10000, style = half) }",
    )
    .unwrap()
    .with_shape(Heads::Gqa { q: 4, kv: 2 }, 32)
    .unwrap();
    let fit = |seed: u64| {
        let mut rng = kivi_runtime::rand::Rng::new(seed);
        let mut x = LayerSamples::new(0, 128, 4, 2, 32, rng.vec(128 * 64), rng.vec(128 * 64));
        x.keys_pre_rope = Some(rng.vec(128 * 64));
        let mut c = Calibration::new(
            ModelId {
                name: "toy".into(),
                layers: 1,
                kv_heads: 2,
                head_dim: 32,
            },
            format!("nuq draw {seed}"),
        );
        c.fit_codebooks(&s, &[x], Default::default()).unwrap();
        c
    };
    let cal = fit(3);
    let bare = CudaTarget::sim(&s, SimDevice::shared()).unwrap();
    assert!(bare.candidates(&Bucket::of(2, 77, 2)).is_empty());
    let target = CudaTarget::sim(&s, SimDevice::shared())
        .unwrap()
        .with_calibration(&cal, 0)
        .unwrap();
    let bucket = Bucket::of(2, 77, 2);
    let cands = target.candidates(&bucket);
    assert_eq!(cands.len(), variants(&s, Kernel::Decode).len());
    let other = CudaTarget::sim(&s, SimDevice::shared())
        .unwrap()
        .with_calibration(&fit(4), 0)
        .unwrap();
    assert_ne!(
        other.candidates(&bucket)[0].hash,
        cands[0].hash,
        "tables are part of the source"
    );
    tunes_to_a_variant(&target, &s, bucket, "nuq");
}

/// Tunes `bucket` on `target` into a fresh decision store: a measured
/// decision whose chosen name is one of the target's variants.
fn tunes_to_a_variant(target: &CudaTarget, s: &Scheme, bucket: Bucket, tag: &str) {
    let dir = std::env::temp_dir().join(format!("kivi-{tag}-tune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Store::new(dir.clone(), target.device(), target.toolchain());
    let plan = Plan {
        budget_s: 60.0,
        ..Plan::default()
    };
    let mut w = Vec::new();
    let out = tune::run(target, &store, s, &[bucket], &plan, &mut (), &mut w);
    assert!(
        matches!(out[0].origin, DecisionOrigin::Tuned { .. }),
        "{:?} {w:?}",
        out[0].origin
    );
    let e = out[0].entry.as_ref().unwrap();
    assert!(target.variant(&e.chosen).is_some(), "{}", e.chosen);
    let _ = std::fs::remove_dir_all(dir);
}
