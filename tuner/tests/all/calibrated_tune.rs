//! Issue #12: the calibration hash joins the scheme hash in tuning
//! decisions. A `levels = nuq` scheme tunes on the CPU when given a
//! calibration; a decision made under one calibration is not served under
//! another; without a calibration every key is the scheme hash, as before.

use crate::common;

use kivi_runtime::calib::{fit_key, identity, Calibration, Entry as CalEntry, Kind, ModelId, Stage};
use kivi_spec::{lloyd_max_levels, parse_scheme, presets, Heads, Scheme, Tensor};
use kivi_tuner::decisions::{entry_key, Store};
use kivi_tuner::tune::{self, decision_hash, hex, DecisionOrigin, Plan, Target};
use kivi_tuner::{select_with, Bucket, CpuTarget, Mode, SelectOptions, Source};

fn nuq_scheme() -> Scheme {
    parse_scheme(
        "n { key: quant(bits = 3, axis = token, group = 32, levels = nuq), \
             value: quant(bits = 2, axis = channel, group = 16, levels = nuq, norm = l2), residual: 9 }",
    )
    .unwrap()
    .with_shape(Heads::Gqa { q: 4, kv: 2 }, 64)
    .unwrap()
}

/// A calibration for `s` whose codebooks are the Lloyd–Max tables times `stretch`.
fn calibration(s: &Scheme, stretch: f32) -> Calibration {
    let mut c = Calibration::new(
        ModelId {
            name: "toy".into(),
            layers: 1,
            kv_heads: 2,
            head_dim: 64,
        },
        format!("lloyd-max x{stretch}"),
    );
    for (t, bits) in [(Tensor::Key, 3), (Tensor::Value, 2)] {
        c.insert(CalEntry {
            layer: 0,
            tensor: t,
            stage: Stage::PostRope,
            kind: Kind::Codebook,
            fit: fit_key(s, t).unwrap(),
            shape: vec![1 << bits],
            data: lloyd_max_levels(bits).unwrap().iter().map(|l| l * stretch).collect(),
        })
        .unwrap();
    }
    c
}

fn run(target: &CpuTarget, store: &Store, s: &Scheme, b: Bucket) -> tune::Outcome {
    let plan = Plan {
        budget_s: 0.5,
        ..Plan::default()
    };
    let mut w = Vec::new();
    let mut out = tune::run(target, store, s, &[b], &plan, &mut (), &mut w);
    assert!(w.is_empty(), "{w:?}");
    out.remove(0)
}

#[test]
fn two_calibrations_two_decisions_and_nuq_tunes_on_the_cpu() {
    let s = nuq_scheme();
    let (ca, cb) = (calibration(&s, 1.0), calibration(&s, 1.25));
    assert_ne!(ca.hash(), cb.hash());
    let b = Bucket::of(1, 128, 2);
    let dir = common::temp_dir("calibrated");

    // Without a calibration a nuq scheme cannot be tuned: a clear failure.
    let mut plain = CpuTarget::new(&s).unwrap();
    plain.max_copies = 1;
    let store = Store::new(dir.clone(), plain.device(), plain.toolchain());
    match run(&plain, &store, &s, b).origin {
        DecisionOrigin::Failed(e) => assert!(e.contains("calibration"), "{e}"),
        o => panic!("tuned a nuq scheme without its codebooks: {o:?}"),
    }

    let mut ta = CpuTarget::with_calibration(&s, &ca, 0).unwrap();
    let mut tb = CpuTarget::with_calibration(&s, &cb, 0).unwrap();
    ta.max_copies = 1;
    tb.max_copies = 1;
    let (ka, kb) = (decision_hash(&ta, &s), decision_hash(&tb, &s));
    assert_eq!(ka, identity(kivi_spec::scheme_hash(&s), Some(ca.hash())));
    assert_ne!(ka, kb);
    assert_ne!(ka, kivi_spec::scheme_hash(&s));
    // The same key as the cache built with that calibration.
    let cache =
        kivi_runtime::PagedCache::with_calibration(s.clone(), kivi_runtime::CacheConfig::for_tokens(64), &ca, 0)
            .unwrap();
    assert_eq!(cache.identity(), ka);

    // Tuned under A (every candidate verified against the reference on the
    // calibrated cache), then served from the cache under A only.
    let oa = run(&ta, &store, &s, b);
    assert!(matches!(oa.origin, DecisionOrigin::Tuned { .. }), "{:?}", oa.origin);
    let ea = oa.entry.unwrap();
    assert_eq!(ea.scheme_hash, hex(ka));
    assert!(
        ea.candidates.iter().all(|c| c.status != kivi_tuner::Status::Rejected),
        "the cpu kernel disagrees with the reference on a calibrated cache"
    );
    assert_eq!(run(&ta, &store, &s, b).origin, DecisionOrigin::Cached);
    let ob = run(&tb, &store, &s, b);
    assert!(
        matches!(ob.origin, DecisionOrigin::Tuned { .. }),
        "a decision made under one calibration was served under another: {:?}",
        ob.origin
    );
    assert_eq!(ob.entry.unwrap().scheme_hash, hex(kb));
    let mut w = Vec::new();
    let file = store.load(&mut w);
    assert!(w.is_empty(), "{w:?}");
    assert!(file.entries.contains_key(&entry_key(ka, &b)));
    assert!(file.entries.contains_key(&entry_key(kb, &b)));

    // Selection looks up the joined key too: a hit under A, a miss under a
    // third calibration.
    let opts = SelectOptions {
        mode: Mode::Cached,
        cache_dir: Some(dir),
        budget_s: 0.5,
    };
    assert_eq!(select_with(&ta, &s, b, &opts).unwrap().source, Source::Cached);
    let tc = CpuTarget::with_calibration(&s, &calibration(&s, 0.5), 0).unwrap();
    assert_eq!(select_with(&tc, &s, b, &opts).unwrap().source, Source::Default);

    // A calibration that lacks what the scheme needs fails when the target
    // is made, by name.
    let empty = Calibration::new(ca.model.clone(), "nothing fitted");
    let e = CpuTarget::with_calibration(&s, &empty, 0).err().unwrap();
    assert!(e.contains("key") || e.contains("codebook"), "{e}");
}

/// No calibration: the key of every preset is its scheme hash, exactly as
/// before, so decisions saved earlier stay valid; a scheme without `nuq`
/// built with a calibration is keyed by the joined identity all the same.
#[test]
fn without_a_calibration_every_key_is_unchanged() {
    let heads = Heads::Gqa { q: 4, kv: 2 };
    let all = presets::all()
        .into_iter()
        .chain(presets::listed())
        .chain(presets::pipeline());
    let mut n = 0;
    for p in all {
        let Ok(s) = p.with_shape(heads, 64) else { continue };
        let Ok(t) = CpuTarget::new(&s) else { continue };
        assert_eq!(decision_hash(&t, &s), kivi_spec::scheme_hash(&s), "{}", s.name);
        n += 1;
    }
    assert!(n >= 5, "only {n} presets checked");
    let s = presets::kivi2().with_shape(heads, 64).unwrap();
    let nuq = nuq_scheme();
    let cal = calibration(&nuq, 1.0);
    let t = CpuTarget::with_calibration(&s, &cal, 0).unwrap();
    assert_eq!(
        decision_hash(&t, &s),
        identity(kivi_spec::scheme_hash(&s), Some(cal.hash()))
    );
}
